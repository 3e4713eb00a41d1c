"""Blockwise and dense attention against a naive materialised-scores attention: values and
gradients (q, k, v, sinks), with sliding windows, soft-capping, sinks and a value width of its own.
"""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as hst

from mtjax import attention
from mtjax.attention import blockwise_attention, dense_attention
from numerics import REL_L2, assert_trees_close


def naive_attention(q_BxTxNxH, k_BxSxKxH, v_BxSxKxHv, *, segments_q_BxT=None, segments_k_BxS=None,
                    causal=True, scale=None, window=None, softcap=None, sinks_N=None,
                    positions_BxT=None, chunk=None, groups_BxT=None):
  """Full [B, N, T, S] fp32 scores and masks, k/v repeated per query head, the cap as written,
  the sink as a concatenated score column dropped after the softmax; rows that see nothing give 0.
  With `chunk`, a query sees only keys whose position // chunk is its own (chunked local
  attention, T == S): the block-diagonal mask over `positions_BxT`. With `groups_BxT` (causal,
  T == S), a query also sees every key of its own group (ids >= 0), the window still applied.
  """
  B, T, N, H = q_BxTxNxH.shape
  S, K = k_BxSxKxH.shape[1:3]
  hi = jax.lax.Precision.HIGHEST
  q = q_BxTxNxH.astype(jnp.float32)
  k = jnp.repeat(k_BxSxKxH.astype(jnp.float32), N // K, axis=2)
  v = jnp.repeat(v_BxSxKxHv.astype(jnp.float32), N // K, axis=2)
  scale = 1 / np.sqrt(H) if scale is None else scale
  s_BxNxTxS = jnp.einsum("btnh,bsnh->bnts", q, k, precision=hi) * scale
  if softcap is not None:
    s_BxNxTxS = softcap * jnp.tanh(s_BxNxTxS / softcap)
  i_Tx1, j_1xS = np.arange(T)[:, None], np.arange(S)[None, :]  # numpy: broadcasts as written
  mask_BxNxTxS = jnp.ones((B, N, T, S), bool)
  if causal:
    order_BxTxS = np.broadcast_to(j_1xS <= i_Tx1, (B, T, S))
    if groups_BxT is not None:
      g_BxT = np.asarray(groups_BxT)
      order_BxTxS = order_BxTxS | ((g_BxT[:, :, None] == g_BxT[:, None, :])
                                   & (g_BxT[:, :, None] >= 0))
    mask_BxNxTxS = mask_BxNxTxS & jnp.asarray(order_BxTxS)[:, None]
  if window is not None:
    mask_BxNxTxS = mask_BxNxTxS & jnp.asarray(j_1xS > i_Tx1 - window)[None, None]
  if segments_q_BxT is not None:
    same_BxTxS = segments_q_BxT[:, :, None] == segments_k_BxS[:, None, :]
    mask_BxNxTxS = mask_BxNxTxS & same_BxTxS[:, None]
  if chunk is not None:
    c_BxT = np.asarray(positions_BxT) // chunk
    mask_BxNxTxS = mask_BxNxTxS & jnp.asarray(c_BxT[:, :, None] == c_BxT[:, None, :])[:, None]
  s_BxNxTxS = jnp.where(mask_BxNxTxS, s_BxNxTxS, -1e30)
  if sinks_N is not None:
    sink_BxNxTx1 = jnp.broadcast_to(sinks_N.astype(jnp.float32)[None, :, None, None], (B, N, T, 1))
    s_BxNxTxS1 = jnp.concatenate([s_BxNxTxS, sink_BxNxTx1], axis=-1)
    mask_BxNxTxS1 = jnp.concatenate([mask_BxNxTxS, jnp.ones((B, N, T, 1), bool)], axis=-1)
    p_BxNxTxS = (jax.nn.softmax(s_BxNxTxS1, axis=-1) * mask_BxNxTxS1)[..., :S]
  else:
    p_BxNxTxS = jax.nn.softmax(s_BxNxTxS, axis=-1) * mask_BxNxTxS
  return jnp.einsum("bnts,bsnh->btnh", p_BxNxTxS, v, precision=hi)


def packed_segments(B, T, seed):
  """Document ids as packing makes them: nondecreasing along the row, random document lengths."""
  rng = np.random.default_rng(seed)
  return jnp.asarray(np.cumsum(rng.random((B, T)) < 0.2, axis=1).astype(np.int32))


def image_groups(B, T, seed):
  """Group ids as Gemma 3's image tokens make them: runs of positions numbered along the row,
  -1 between them, some runs right after another (ids of their own), some across blocks."""
  rng = np.random.default_rng(seed + 2)
  groups = np.full((B, T), -1, np.int32)
  for b in range(B):
    n, t = 0, int(rng.integers(0, 4))
    while t < T:
      length = int(rng.integers(1, max(2, T // 3)))
      groups[b, t:t + length] = n
      n, t = n + 1, t + length + int(rng.integers(0, 6))
  return jnp.asarray(groups)


def random_qkv(B, T, S, N, K, H, dtype, seed, Hv=None):
  # numpy draws: jax.random would compile afresh for every shape the sweeps visit.
  rng = np.random.default_rng(seed)
  draw = lambda *shape: rng.standard_normal(shape, np.float32)
  Hv = H if Hv is None else Hv
  q, k, v = draw(B, T, N, H), draw(B, S, K, H), draw(B, S, K, Hv)
  return (jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype),
          jnp.asarray(draw(B, T, N, Hv)))


def random_sinks(N, seed):
  """Sink logits of the scores' own size, so the sink column takes a real share of each row."""
  return jnp.asarray(2 * np.random.default_rng(seed + 1).standard_normal(N, np.float32))


def value_and_grads(attn, q, k, v, ct, *sinks):
  """attn's output, the gradients of sum(out * ct) with respect to q, k and v and, with sinks
  given, the sinks' gradient of sum(out**2) / 2; one compile.

  The sinks' gradient under a random cotangent, -sum over rows of p_sink * (ct . out), sums terms
  of either sign that cancel: fp32 rounding of the terms then moves the result by ~1e-5 of itself
  in any implementation (blockwise, dense and naive each measured 5e-6 to 7e-6 off a float64
  reference on one sweep case), so a comparison would measure the cancellation. With ct = out
  every term is -p_sink |out|^2 <= 0, and it measures the formula.
  """

  def run(ct, *args):
    out, vjp = jax.vjp(attn, *args)
    grads = vjp(ct.astype(out.dtype))
    return out, grads[:3] + vjp(out)[3:]

  return jax.jit(run)(ct, q, k, v, *sinks)


def results(attn, q, k, v, ct, seg_q=None, seg_k=None, causal=True, sinks=None, **options):
  """attn's output and gradients (q, k, v, and the sinks when given) as `value_and_grads` takes
  them; the naive attention sees the inputs upcast to fp32."""
  if attn is naive_attention:
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
  ct = ct.astype(q.dtype).astype(jnp.float32)  # every side gets what a bf16 output would receive
  f = lambda q, k, v, *sinks: attn(q, k, v, segments_q_BxT=seg_q, segments_k_BxS=seg_k,
                                   causal=causal, sinks_N=sinks[0] if sinks else None, **options)
  return value_and_grads(f, q, k, v, ct, *(() if sinks is None else (sinks,)))


def both(q, k, v, ct, seg_q=None, seg_k=None, causal=True, sinks=None, impl=blockwise_attention,
         **options):
  """(impl, naive) outputs and gradients. `options` go to both, but the block sizes only to the
  blockwise attention."""
  blocks = {name: options.pop(name) for name in ("q_block", "kv_block") if name in options}
  assert impl is blockwise_attention or not blocks
  args = (q, k, v, ct, seg_q, seg_k, causal, sinks)
  return results(impl, *args, **options, **blocks), results(naive_attention, *args, **options)


def assert_fp32_close(got, want):
  (out, grads), (out_ref, grads_ref) = got, want
  assert_trees_close(out, out_ref, name="output")
  assert_trees_close(grads, grads_ref, name="gradients")


def relative_error(x, ref):
  x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
  return np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30)


HEADS = [(4, 2), (2, 2), (4, 1)]  # GQA, MHA, MQA


# Fixed corners of the sweep below, so every T, head layout, head size and block regime is hit.
@pytest.mark.parametrize("B,T,heads,H,q_block,kv_block,packed", [
    (2, 1, (2, 2), 8, 8, 8, False),
    (1, 7, (4, 1), 24, 16, 8, True),  # blocks larger than T
    (2, 33, (4, 2), 8, 8, 16, True),
    (2, 64, (4, 2), 16, 16, 8, False),
    (1, 64, (4, 1), 16, 128, 128, True),  # one block covers everything
])
def test_fp32_matches_naive(B, T, heads, H, q_block, kv_block, packed):
  N, K = heads
  q, k, v, ct = random_qkv(B, T, T, N, K, H, jnp.float32, seed=T)
  seg = packed_segments(B, T, seed=T) if packed else None
  assert not packed or T < 16 or len(np.unique(np.asarray(seg[0]))) > 2  # several documents
  assert_fp32_close(*both(q, k, v, ct, seg, seg, q_block=q_block, kv_block=kv_block))


@given(B=hst.sampled_from([1, 2]), T=hst.sampled_from([1, 7, 33, 64]),
       heads=hst.sampled_from(HEADS), H=hst.sampled_from([8, 16, 24]),
       q_block=hst.sampled_from([8, 16, 128]), kv_block=hst.sampled_from([8, 16, 128]),
       packed=hst.booleans(), seed=hst.integers(0, 2**16))
def test_fp32_sweep_matches_naive(B, T, heads, H, q_block, kv_block, packed, seed):
  N, K = heads
  q, k, v, ct = random_qkv(B, T, T, N, K, H, jnp.float32, seed)
  seg = packed_segments(B, T, seed) if packed else None
  assert_fp32_close(*both(q, k, v, ct, seg, seg, q_block=q_block, kv_block=kv_block))


@given(T=hst.sampled_from([7, 33, 64]), heads=hst.sampled_from(HEADS),
       H=hst.sampled_from([8, 16, 24]), blocks=hst.sampled_from([(8, 16), (16, 8), (128, 128)]),
       packed=hst.booleans(), seed=hst.integers(0, 2**16))
def test_bf16_sweep_close_to_fp32_naive(T, heads, H, blocks, packed, seed):
  N, K = heads
  q, k, v, ct = random_qkv(2, T, T, N, K, H, jnp.bfloat16, seed)
  seg = packed_segments(2, T, seed) if packed else None
  (out, grads), (out_ref, grads_ref) = both(q, k, v, ct, seg, seg, q_block=blocks[0],
                                            kv_block=blocks[1])
  dense_out, dense_grads = results(dense_attention, q, k, v, ct, seg, seg)
  for o, gs in [(out, grads), (dense_out, dense_grads)]:
    assert o.dtype == jnp.bfloat16 and all(g.dtype == jnp.bfloat16 for g in gs)
    assert relative_error(o, out_ref) < 1e-2
    for g, g_ref in zip(gs, grads_ref):
      assert relative_error(g, g_ref) < 1e-2


# Scores far into tanh's bend under the cap: q.k has standard deviation sqrt(H), so this scale
# gives scores of standard deviation 4, several times the cap (test_softcap_bends_the_scores).
CAP, CAP_SCALE = 5.0, lambda H: 4 / np.sqrt(H)


def features_case(B, T, S, heads, H, Hv, packed, window, softcap, sinks, seed, groups=False):
  """Inputs and options of one case of the feature tests: (q, k, v, ct, segments, options)."""
  N, K = heads
  q, k, v, ct = random_qkv(B, T, S, N, K, H, jnp.float32, seed, Hv=Hv)
  seg = packed_segments(B, T, seed) if packed else None
  options = dict(window=window, softcap=softcap, scale=CAP_SCALE(H) if softcap else None,
                 sinks=random_sinks(N, seed) if sinks else None)
  if groups:
    options["groups_BxT"] = image_groups(B, T, seed)
  return q, k, v, ct, seg, options


def assert_matches_naive(q, k, v, ct, seg, causal=True, blocks=(8, 8), **options):
  """The blockwise and the dense attention each match the naive one, values and gradients."""
  args = (q, k, v, ct, seg, seg, causal)
  want = results(naive_attention, *args, **options)
  assert_fp32_close(results(blockwise_attention, *args, q_block=blocks[0], kv_block=blocks[1],
                            **options), want)
  assert_fp32_close(results(dense_attention, *args, **options), want)


# Fixed corners of the feature sweep below: each feature with others, blocks that do not divide T.
@pytest.mark.parametrize("B,T,S,heads,H,Hv,blocks,packed,window,softcap,sinks,causal", [
    (2, 33, 33, (4, 2), 8, None, (8, 16), True, 1, None, True, True),  # GQA, documents
    (1, 64, 64, (4, 1), 24, 16, (16, 8), False, 3, CAP, False, True),  # q/k 24 wide, v 16
    (2, 64, 64, (2, 2), 16, 8, (16, 16), True, 17, CAP, True, True),  # everything at once
    (1, 40, 16, (4, 2), 8, 12, (8, 8), False, 3, None, True, True),  # rows past S + 2 see no key
    (1, 16, 40, (4, 2), 16, 8, (8, 16), False, None, CAP, True, False),  # not causal
])
def test_features_match_naive(B, T, S, heads, H, Hv, blocks, packed, window, softcap, sinks,
                              causal):
  q, k, v, ct, seg, options = features_case(B, T, S, heads, H, Hv, packed, window, softcap, sinks,
                                            seed=T + S)
  assert_matches_naive(q, k, v, ct, seg, causal, blocks, **options)


@given(B=hst.sampled_from([1, 2]), T=hst.sampled_from([7, 33, 64]),
       heads=hst.sampled_from(HEADS), H=hst.sampled_from([8, 16, 24]),
       Hv=hst.sampled_from([None, 8, 12]), q_block=hst.sampled_from([8, 16, 128]),
       kv_block=hst.sampled_from([8, 16, 128]), packed=hst.booleans(),
       window=hst.sampled_from([None, 1, 3, 17]), softcap=hst.sampled_from([None, CAP]),
       sinks=hst.booleans(), groups=hst.booleans(), seed=hst.integers(0, 2**16))
def test_features_sweep_matches_naive(B, T, heads, H, Hv, q_block, kv_block, packed, window,
                                      softcap, sinks, groups, seed):
  q, k, v, ct, seg, options = features_case(B, T, T, heads, H, Hv, packed, window, softcap, sinks,
                                            seed, groups)
  assert_matches_naive(q, k, v, ct, seg, True, (q_block, kv_block), **options)


@pytest.mark.parametrize("B,T,heads,blocks,packed,window", [
    (2, 40, (4, 1), (8, 8), True, 3),  # documents, and a window shorter than a group
    # groups across blocks that do not divide T, key blocks longer than query blocks
    pytest.param(2, 33, (4, 2), (8, 16), False, None, marks=pytest.mark.soak),
])
def test_image_groups_match_naive(B, T, heads, blocks, packed, window):
  """A query sees its group's later keys too (within the window and its document): the dense
  and the blockwise kernels equal the naive mask, and the groups change what they compute."""
  q, k, v, ct, seg, options = features_case(B, T, T, heads, 8, None, packed, window, None, False,
                                            seed=T, groups=True)
  groups = np.asarray(options["groups_BxT"])
  assert (groups >= 0).any(axis=1).all() and len(np.unique(groups)) > 3
  assert_matches_naive(q, k, v, ct, seg, True, blocks, **options)
  plain = results(dense_attention, q, k, v, ct, seg, seg, window=window)
  grouped = results(dense_attention, q, k, v, ct, seg, seg, **options)
  assert relative_error(grouped[0], plain[0]) > 1e-2


def test_groups_of_none_are_the_causal_mask_exactly():
  """Ids of -1 alone (a batch with no image) compute the causal attention bit for bit, the
  blockwise kernel visiting the causal blocks alone."""
  q, k, v, ct = random_qkv(2, 20, 20, 4, 2, 8, jnp.float32, seed=5)
  none = jnp.full((2, 20), -1, jnp.int32)
  kw = dict(q_block=8, kv_block=8)
  jax.tree.map(np.testing.assert_array_equal,
               results(blockwise_attention, q, k, v, ct, groups_BxT=none, **kw),
               results(blockwise_attention, q, k, v, ct, **kw))


def test_softcap_bends_the_scores():
  """At the tests' scale a fifth of the scores lie past the cap, where c * tanh(x / c) is 24% or
  more below x and its slope under 0.42: the cap moves outputs and gradients by far more than the
  tolerance, so the sweeps tell a capped attention from an uncapped or barely capped one."""
  q, k, v, ct = random_qkv(2, 33, 33, 4, 2, 16, jnp.float32, seed=2)
  scale = CAP_SCALE(16)
  scores = np.einsum("btkgh,bskh->bkgts", np.asarray(q).reshape(2, 33, 2, 2, 16), k) * scale
  assert np.mean(np.abs(scores) > CAP) > 0.15
  assert 2 * np.abs(scores).max() < 10 * CAP  # the mild cap below is over twice every score

  def run(q, k, v, ct):  # one compile for the three
    attn = lambda q, k, v, cap: naive_attention(q, k, v, scale=scale, softcap=cap)
    return [value_and_grads(lambda q, k, v, cap=cap: attn(q, k, v, cap), q, k, v, ct)
            for cap in [None, CAP, 10 * CAP]]

  (out, grads), (capped, capped_grads), (mild, _) = jax.jit(run)(q, k, v, ct)
  assert relative_error(capped, out) > 1e3 * REL_L2
  for g, g_capped in zip(grads, capped_grads):
    assert relative_error(g_capped, g) > 1e3 * REL_L2
  assert relative_error(mild, out) > 100 * REL_L2  # even that one shows


@pytest.mark.parametrize("impl", [blockwise_attention, dense_attention])
def test_window_covering_the_sequence_equals_no_window_exactly(impl):
  """A window of T or more hides no key of a causal row: the same numbers, bit for bit."""
  B, T, N, K, H = 2, 33, 4, 2, 8
  q, k, v, ct = random_qkv(B, T, T, N, K, H, jnp.float32, seed=4)
  seg, sinks = packed_segments(B, T, seed=4), random_sinks(N, seed=4)
  blocks = dict(q_block=8, kv_block=16) if impl is blockwise_attention else {}

  def run(q, k, v, sinks, ct):
    results = []
    for window in [None, T, T + 9]:
      attn = lambda q, k, v, s, w=window: impl(q, k, v, segments_q_BxT=seg, window=w, sinks_N=s,
                                               **blocks)
      out, vjp = jax.vjp(attn, q, k, v, sinks)
      results.append((out, vjp(ct)))
    return results

  (out, grads), *windowed = jax.jit(run)(q, k, v, sinks, ct)
  for out_w, grads_w in windowed:
    np.testing.assert_array_equal(out_w, out)
    for g_w, g in zip(grads_w, grads):
      np.testing.assert_array_equal(g_w, g)


def pairs_with_visible_keys(T, S, window, bq, bk):
  """The (query block, key block) pairs where some causal windowed query sees some key."""
  i_Tx1, j_1xS = np.arange(T)[:, None], np.arange(S)[None, :]
  visible_TxS = (j_1xS <= i_Tx1) & (j_1xS > i_Tx1 - window)
  return sorted((a, b) for a in range(-(-T // bq)) for b in range(-(-S // bk))
                if visible_TxS[a * bq:(a + 1) * bq, b * bk:(b + 1) * bk].any())


@pytest.mark.parametrize("T,window,bq,bk", [(256, 16, 16, 16), (100, 17, 16, 8)])
def test_window_skips_key_blocks_outside_it(monkeypatch, T, window, bq, bk):
  """Counts the block pairs the forward and the backward really compute (a callback in the score
  function, run on the device each time a loop visits a pair): exactly the pairs that hold a
  visible (query, key), each once, so the cost follows the window and not T."""
  visits = {"forward": [], "backward": []}
  phase = ["forward"]  # which pass is being traced when the score function is traced
  scores = attention._Layout.scores

  def counting_scores(self, q_blk, i, j):
    record = visits[phase[0]].append
    jax.debug.callback(lambda i, j: record((int(i), int(j))), i, j)
    return scores(self, q_blk, i, j)

  monkeypatch.setattr(attention._Layout, "scores", counting_scores)
  q, k, v, ct = random_qkv(1, T, T, 2, 1, 8, jnp.float32, seed=T)

  def run(q, k, v, ct):
    attn = lambda q, k, v: blockwise_attention(q, k, v, window=window, q_block=bq, kv_block=bk)
    out, vjp = jax.vjp(attn, q, k, v)
    phase[0] = "backward"
    return out, vjp(ct)

  jax.block_until_ready(jax.jit(run)(q, k, v, ct))
  jax.effects_barrier()
  expected = pairs_with_visible_keys(T, T, window, bq, bk)
  assert sorted(visits["forward"]) == expected
  assert sorted(visits["backward"]) == expected
  causal_pairs = pairs_with_visible_keys(T, T, T, bq, bk)
  assert len(expected) * 2 < len(causal_pairs), (len(expected), len(causal_pairs))
  if (T, window, bq, bk) == (256, 16, 16, 16):  # each block meets at most two of the other kind
    assert max(np.bincount([i for i, _ in expected])) == 2
    assert max(np.bincount([j for _, j in expected])) == 2
    assert (len(expected), len(causal_pairs)) == (31, 136)


@pytest.mark.soak
def test_groups_visit_the_key_blocks_they_reach_and_no_others(monkeypatch):
  """With a group over positions 20..43 (8-wide blocks), the forward and the backward compute
  exactly the block pairs that hold a visible (query, key) under causal OR same group: the
  causal ones and those above the diagonal the group spans."""
  T, bq = 64, 8
  visits = {"forward": [], "backward": []}
  phase = ["forward"]
  scores = attention._Layout.scores

  def counting_scores(self, q_blk, i, j):
    record = visits[phase[0]].append
    jax.debug.callback(lambda i, j: record((int(i), int(j))), i, j)
    return scores(self, q_blk, i, j)

  monkeypatch.setattr(attention._Layout, "scores", counting_scores)
  q, k, v, ct = random_qkv(1, T, T, 2, 1, 8, jnp.float32, seed=T)
  groups_T = np.full(T, -1, np.int32)
  groups_T[20:44] = 0

  def run(q, k, v, ct):
    attn = lambda q, k, v: blockwise_attention(q, k, v, q_block=bq, kv_block=bq,
                                               groups_BxT=jnp.asarray(groups_T[None]))
    out, vjp = jax.vjp(attn, q, k, v)
    phase[0] = "backward"
    return out, vjp(ct)

  jax.block_until_ready(jax.jit(run)(q, k, v, ct))
  jax.effects_barrier()
  i_Tx1, j_1xT = np.arange(T)[:, None], np.arange(T)[None, :]
  visible_TxT = (j_1xT <= i_Tx1) | ((groups_T[:, None] == groups_T[None, :]) & (groups_T[:, None] >= 0))
  n = T // bq
  expected = sorted((a, b) for a in range(n) for b in range(n)
                    if visible_TxT[a * bq:(a + 1) * bq, b * bq:(b + 1) * bq].any())
  assert sorted(visits["forward"]) == expected
  assert sorted(visits["backward"]) == expected
  assert len(expected) == n * (n + 1) // 2 + 6  # blocks 2..5 meet: 6 pairs above the diagonal


@pytest.mark.parametrize("T,S,causal", [(16, 40, True), (40, 16, False)])
def test_cross_lengths_match_naive(T, S, causal):
  """T != S: causal is top-left aligned (query i sees keys j <= i), as is_causal=True."""
  q, k, v, ct = random_qkv(1, T, S, 4, 2, 8, jnp.float32, seed=T + S)
  assert_fp32_close(*both(q, k, v, ct, causal=causal, q_block=8, kv_block=16))


@pytest.mark.parametrize("impl", [blockwise_attention, dense_attention])
@pytest.mark.parametrize("packed", [False, True])
def test_chunks_as_segments_match_the_naive_chunk_mask(impl, packed):
  """Chunked local attention (Llama 4) as the kernels take it, ids from `chunk_segments`
  (position // chunk within each document), against the naive attention's block-diagonal mask."""
  B, T, chunk = 2, 29, 6
  q, k, v, ct = random_qkv(B, T, T, 4, 2, 8, jnp.float32, seed=21)
  seg = packed_segments(B, T, 21) if packed else jnp.zeros((B, T), jnp.int32)
  s = np.asarray(seg)
  starts = np.maximum.accumulate(np.where(np.diff(s, prepend=-1, axis=1) != 0, np.arange(T), 0),
                                 axis=1)
  pos = np.arange(T)[None, :] - starts  # restarting at each document
  ids = attention.chunk_segments(jnp.asarray(pos), chunk, seg if packed else None)
  blocks = dict(q_block=8, kv_block=8) if impl is blockwise_attention else {}
  got = results(impl, q, k, v, ct, ids, ids, **blocks)
  want = results(naive_attention, q, k, v, ct, seg, seg, positions_BxT=pos, chunk=chunk)
  assert_fp32_close(got, want)


def test_unsorted_segment_ids_match_naive():
  """Ids need not be sorted: a block is skipped only when its id range misses the other's."""
  q, k, v, ct = random_qkv(2, 24, 24, 4, 2, 8, jnp.float32, seed=11)
  seg = jnp.asarray(np.random.default_rng(11).integers(0, 3, (2, 24)), jnp.int32)
  seg = seg.at[:, 16:].set(7)  # the last query block shares no id with the first key blocks
  assert_fp32_close(*both(q, k, v, ct, seg, seg, causal=False, q_block=8, kv_block=8))


@pytest.mark.parametrize("impl", [blockwise_attention, dense_attention])
@pytest.mark.parametrize("sinks", [False, True])
def test_rows_without_visible_keys_are_zero_not_nan(impl, sinks):
  """Zeros with or without a sink: the sink takes all of such a row's probability, and has no
  value."""
  T, S = 12, 10
  q, k, v, ct = random_qkv(2, T, S, 2, 2, 8, jnp.float32, seed=3)
  seg_q = jnp.asarray(np.repeat([[0] * 4 + [1] * 4 + [2] * 4], 2, axis=0), jnp.int32)
  seg_k = jnp.asarray(np.repeat([[1] * 5 + [2] * 5], 2, axis=0), jnp.int32)  # no key of doc 0
  blocks = dict(q_block=4, kv_block=4) if impl is blockwise_attention else {}
  got = both(q, k, v, ct, seg_q, seg_k, sinks=random_sinks(2, 3) if sinks else None, impl=impl,
             **blocks)
  (out, grads) = got[0]
  assert len(grads) == 3 + sinks
  assert np.all(np.isfinite(out)) and all(np.all(np.isfinite(g)) for g in grads)
  np.testing.assert_array_equal(out[:, :4], 0.0)  # document 0's queries see no key at all
  np.testing.assert_array_equal(grads[0][:, :4], 0.0)
  assert_fp32_close(*got)


@pytest.mark.parametrize("scale", [None, 0.3])
def test_agrees_with_jax_dot_product_attention(scale):
  q, k, v, ct = random_qkv(2, 48, 48, 4, 2, 16, jnp.float32, seed=7)
  fast = lambda q, k, v: blockwise_attention(q, k, v, q_block=16, kv_block=16, scale=scale)
  dense = lambda q, k, v: dense_attention(q, k, v, scale=scale)
  xla = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True,
                                                     implementation="xla")
  want = value_and_grads(xla, q, k, v, ct)
  assert_fp32_close(value_and_grads(fast, q, k, v, ct), want)
  assert_fp32_close(value_and_grads(dense, q, k, v, ct), want)


@pytest.mark.parametrize("impl", [blockwise_attention, dense_attention])
def test_rejects_bad_arguments(impl):
  q, k, v, _ = random_qkv(1, 4, 4, 4, 2, 8, jnp.float32, seed=0)
  with pytest.raises(ValueError, match="multiple"):
    impl(q[:, :, :3], k, v)
  with pytest.raises(ValueError, match="do not fit"):
    impl(q, k, v[:, :3])
  with pytest.raises(ValueError, match="causal"):
    impl(q, k, v, causal=False, window=2)
  with pytest.raises(ValueError, match="window"):
    impl(q, k, v, window=0)
  with pytest.raises(ValueError, match="softcap"):
    impl(q, k, v, softcap=0.0)
  with pytest.raises(ValueError, match="sinks"):
    impl(q, k, v, sinks_N=jnp.zeros(2))


def test_dense_keeps_keys_and_values_at_their_own_heads():
  """No array in the dense forward and backward holds k or v repeated per query head: the query
  heads are grouped beside their key/value head, as in the blockwise attention."""
  B, T, S, N, K, H, Hv = 1, 24, 40, 6, 2, 16, 8
  q = jax.ShapeDtypeStruct((B, T, N, H), jnp.float32)
  k = jax.ShapeDtypeStruct((B, S, K, H), jnp.float32)
  v = jax.ShapeDtypeStruct((B, S, K, Hv), jnp.float32)
  loss = lambda q, k, v: jnp.sum(dense_attention(q, k, v, causal=False) ** 2)
  jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v).jaxpr
  for shape in _intermediate_shapes(jaxpr):
    size = int(np.prod(shape))
    assert not (S in shape and H in shape and size > B * S * K * H), shape  # k repeated
    assert not (S in shape and Hv in shape and size > B * S * K * Hv), shape  # v repeated
  assert (B, K, N // K, T, S) in _intermediate_shapes(jaxpr)  # the scores, grouped


def _intermediate_shapes(jaxpr):
  """Every array shape an equation produces, descending into sub-jaxprs."""
  shapes = set()
  for eqn in jaxpr.eqns:
    shapes.update(tuple(var.aval.shape) for var in eqn.outvars if hasattr(var.aval, "shape"))
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      shapes |= _intermediate_shapes(sub)
  return shapes


def _max_intermediate_elements(jaxpr):
  """Largest array any equation produces, descending into loop bodies and custom rules."""
  biggest = 0
  for eqn in jaxpr.eqns:
    for var in eqn.outvars:
      if hasattr(var.aval, "shape"):
        biggest = max(biggest, int(np.prod(var.aval.shape, dtype=np.int64)))
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      biggest = max(biggest, _max_intermediate_elements(sub))
  return biggest


def test_long_sequence_never_materialises_t_by_t():
  """T=4096, blocks of 256: no array in forward+backward, and no compiled temp, scales with T^2."""
  B, T, N, K, H, blk = 1, 4096, 4, 2, 16, 256
  q = jax.ShapeDtypeStruct((B, T, N, H), jnp.float32)
  kv = jax.ShapeDtypeStruct((B, T, K, H), jnp.float32)
  seg = jax.ShapeDtypeStruct((B, T), jnp.int32)

  def loss(q, k, v, seg):
    out = blockwise_attention(q, k, v, segments_q_BxT=seg, q_block=blk, kv_block=blk)
    return jnp.sum(out * out)

  step = jax.value_and_grad(loss, argnums=(0, 1, 2))
  biggest = _max_intermediate_elements(jax.make_jaxpr(step)(q, kv, kv, seg).jaxpr)
  block_scores = B * N * blk * blk  # one block of scores, the largest thing the method needs
  assert biggest <= max(block_scores, B * T * N * H), biggest
  assert biggest * 64 <= T * T
  temp = jax.jit(step).lower(q, kv, kv, seg).compile().memory_analysis().temp_size_in_bytes
  # All O(T) buffers (padded copies, dq accumulator, logsumexp) plus a few blocks of scores.
  assert temp <= 16 * B * T * N * H * 4 + 8 * block_scores * 4, temp
  assert temp * 16 <= B * N * T * T * 4, temp  # the fp32 scores of every head



@pytest.mark.parametrize("window", [None, 5])
def test_fused_path_takes_documents_as_a_mask_like_the_naive_attention(window):
  """The engine's cuDNN call (models.layers.fused_attention) in jax's XLA form, which takes the
  same mask and window arguments: packed documents and a window give the naive attention's
  output and gradients (the mask's layout and the window's off-by-one are the engine's)."""
  from mtjax.models.layers import fused_attention
  q, k, v, ct = random_qkv(2, 24, 24, 4, 2, 8, jnp.float32, seed=3)
  seg = jnp.asarray(np.repeat([[1, 2, 3], [1, 1, 2]], [8, 8, 8], axis=1).astype(np.int32))
  fused = lambda q, k, v: fused_attention(q, k, v, seg, window=window, implementation="xla")
  naive = lambda q, k, v: naive_attention(q, k, v, segments_q_BxT=seg, segments_k_BxS=seg,
                                          window=window)
  assert_fp32_close(value_and_grads(fused, q, k, v, ct), value_and_grads(naive, q, k, v, ct))
  # and the mask does cut: the same call without documents differs
  whole = value_and_grads(lambda q, k, v: fused_attention(q, k, v, implementation="xla"),
                          q, k, v, ct)
  assert relative_error(whole[0], value_and_grads(fused, q, k, v, ct)[0]) > 0.1


def test_each_layer_takes_the_kernel_that_applies_to_it():
  from mtjax.models.layers import (BLOCKWISE_FROM_SEQ, CUDNN_MASK_MAX_SEQ,
                                   choose_attention, layer_kernel)
  hopper, ampere = 9.0, 8.0
  assert choose_attention("auto", "gpu", hopper, "bfloat16", (32, 128, 128)) == "cudnn"
  assert choose_attention("auto", "gpu", hopper, "bfloat16", (16, 256, 256)) == "cudnn"
  assert choose_attention("auto", "gpu", ampere, "bfloat16", (16, 256, 256), 2048) == "xla"
  # MLA's 192/128 widths: jax's cuDNN call on Hopper, the blockwise kernel before it
  assert choose_attention("auto", "gpu", hopper, "bfloat16", (16, 192, 128), 8192) == "cudnn"
  assert choose_attention("auto", "gpu", ampere, "bfloat16", (16, 192, 128), 8192) == "blockwise"
  assert choose_attention("auto", "gpu", hopper, "float32", (32, 128, 128), 2048) == "xla"
  assert choose_attention("auto", "cpu", 0.0, "bfloat16", (32, 128, 128),
                          BLOCKWISE_FROM_SEQ) == "blockwise"
  assert choose_attention("xla", "gpu", hopper, "bfloat16", (32, 128, 128)) == "xla"
  assert layer_kernel("cudnn", seq=2048, packed=False) == "cudnn"
  assert layer_kernel("cudnn", seq=CUDNN_MASK_MAX_SEQ, packed=True) == "cudnn-mask"
  assert layer_kernel("cudnn", seq=2 * CUDNN_MASK_MAX_SEQ, packed=True) == "blockwise"
  assert layer_kernel("cudnn", seq=2048, packed=False, softcap=True) == "blockwise"
  # sinks and a value width of its own through jax's cuDNN call, not beside documents
  assert layer_kernel("cudnn", seq=2048, packed=False, sinks=True) == "cudnn"
  assert layer_kernel("cudnn", seq=2048, packed=False, same_widths=False) == "cudnn"
  assert layer_kernel("cudnn", seq=2048, packed=True, sinks=True) == "blockwise"
  assert layer_kernel("cudnn", seq=2048, packed=True, same_widths=False) == "blockwise"
  assert layer_kernel("xla", seq=2048, packed=True) == "xla"
  # image groups (Gemma 3's bidirectional image tokens): no cuDNN mask expresses causal OR group
  assert layer_kernel("cudnn", seq=2048, packed=False, groups=True) == "blockwise"
  assert layer_kernel("xla", seq=2048, packed=False, groups=True) == "xla"
