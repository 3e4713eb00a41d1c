"""Blockwise attention against a naive materialised-scores attention: values and q/k/v gradients."""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as hst

from mtjax.attention import blockwise_attention
from numerics import assert_trees_close


def naive_attention(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, seg_q_BxT=None, seg_k_BxS=None, causal=True):
  """Full [B, N, T, S] fp32 scores, k/v repeated per query head; rows that see nothing give 0."""
  B, T, N, H = q_BxTxNxH.shape
  S, K = k_BxSxKxH.shape[1:3]
  hi = jax.lax.Precision.HIGHEST
  q = q_BxTxNxH.astype(jnp.float32)
  k = jnp.repeat(k_BxSxKxH.astype(jnp.float32), N // K, axis=2)
  v = jnp.repeat(v_BxSxKxH.astype(jnp.float32), N // K, axis=2)
  s_BxNxTxS = jnp.einsum("btnh,bsnh->bnts", q, k, precision=hi) / np.sqrt(H)
  mask_BxNxTxS = jnp.ones((B, N, T, S), bool)
  if causal:
    mask_BxNxTxS = mask_BxNxTxS & jnp.asarray(np.tril(np.ones((T, S), bool)))[None, None]
  if seg_q_BxT is not None:
    mask_BxNxTxS = mask_BxNxTxS & (seg_q_BxT[:, :, None] == seg_k_BxS[:, None, :])[:, None]
  p = jax.nn.softmax(jnp.where(mask_BxNxTxS, s_BxNxTxS, -1e30), axis=-1) * mask_BxNxTxS
  return jnp.einsum("bnts,bsnh->btnh", p, v, precision=hi)


def packed_segments(B, T, seed):
  """Document ids as packing makes them: nondecreasing along the row, random document lengths."""
  rng = np.random.default_rng(seed)
  return jnp.asarray(np.cumsum(rng.random((B, T)) < 0.2, axis=1).astype(np.int32))


def random_qkv(B, T, S, N, K, H, dtype, seed):
  # numpy draws: jax.random would compile afresh for every shape the sweeps visit.
  rng = np.random.default_rng(seed)
  draw = lambda *shape: rng.standard_normal(shape, np.float32)
  q, k, v = draw(B, T, N, H), draw(B, S, K, H), draw(B, S, K, H)
  return (jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype),
          jnp.asarray(draw(B, T, N, H)))


def value_and_grads(attn, q, k, v, ct):
  """attn's output and the gradients of sum(out * ct) with respect to q, k and v (one compile)."""

  def run(q, k, v, ct):
    out, vjp = jax.vjp(attn, q, k, v)
    return out, vjp(ct.astype(out.dtype))

  return jax.jit(run)(q, k, v, ct)


def both(q, k, v, ct, seg_q=None, seg_k=None, causal=True, **blocks):
  """(blockwise, naive) outputs and gradients; naive sees inputs upcast to fp32."""
  fast = lambda q, k, v: blockwise_attention(q, k, v, segments_q_BxT=seg_q, segments_k_BxS=seg_k,
                                             causal=causal, **blocks)
  slow = lambda q, k, v: naive_attention(q, k, v, seg_q, seg_k, causal)
  f32 = lambda x: x.astype(jnp.float32)
  ct = f32(ct.astype(q.dtype))  # both sides get the cotangent a bf16 output would receive
  return value_and_grads(fast, q, k, v, ct), value_and_grads(slow, f32(q), f32(k), f32(v), ct)


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
  assert out.dtype == jnp.bfloat16 and all(g.dtype == jnp.bfloat16 for g in grads)
  assert relative_error(out, out_ref) < 1e-2
  for g, g_ref in zip(grads, grads_ref):
    assert relative_error(g, g_ref) < 1e-2


@pytest.mark.parametrize("T,S,causal", [(16, 40, True), (40, 16, False)])
def test_cross_lengths_match_naive(T, S, causal):
  """T != S: causal is top-left aligned (query i sees keys j <= i), as is_causal=True."""
  q, k, v, ct = random_qkv(1, T, S, 4, 2, 8, jnp.float32, seed=T + S)
  assert_fp32_close(*both(q, k, v, ct, causal=causal, q_block=8, kv_block=16))


def test_unsorted_segment_ids_match_naive():
  """Ids need not be sorted: a block is skipped only when its id range misses the other's."""
  q, k, v, ct = random_qkv(2, 24, 24, 4, 2, 8, jnp.float32, seed=11)
  seg = jnp.asarray(np.random.default_rng(11).integers(0, 3, (2, 24)), jnp.int32)
  seg = seg.at[:, 16:].set(7)  # the last query block shares no id with the first key blocks
  assert_fp32_close(*both(q, k, v, ct, seg, seg, causal=False, q_block=8, kv_block=8))


def test_rows_without_visible_keys_are_zero_not_nan():
  T, S = 12, 10
  q, k, v, ct = random_qkv(2, T, S, 2, 2, 8, jnp.float32, seed=3)
  seg_q = jnp.asarray(np.repeat([[0] * 4 + [1] * 4 + [2] * 4], 2, axis=0), jnp.int32)
  seg_k = jnp.asarray(np.repeat([[1] * 5 + [2] * 5], 2, axis=0), jnp.int32)  # no key of doc 0
  got = both(q, k, v, ct, seg_q, seg_k, q_block=4, kv_block=4)
  (out, grads) = got[0]
  assert np.all(np.isfinite(out)) and all(np.all(np.isfinite(g)) for g in grads)
  np.testing.assert_array_equal(out[:, :4], 0.0)  # document 0's queries see no key at all
  np.testing.assert_array_equal(grads[0][:, :4], 0.0)
  assert_fp32_close(*got)


@pytest.mark.parametrize("scale", [None, 0.3])
def test_agrees_with_jax_dot_product_attention(scale):
  q, k, v, ct = random_qkv(2, 48, 48, 4, 2, 16, jnp.float32, seed=7)
  fast = lambda q, k, v: blockwise_attention(q, k, v, q_block=16, kv_block=16, scale=scale)
  xla = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True,
                                                     implementation="xla")
  assert_fp32_close(value_and_grads(fast, q, k, v, ct), value_and_grads(xla, q, k, v, ct))


def test_rejects_mismatched_heads():
  q, k, v, _ = random_qkv(1, 4, 4, 3, 2, 8, jnp.float32, seed=0)
  with pytest.raises(ValueError, match="multiple"):
    blockwise_attention(q, k, v)


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

