"""The mixture-of-experts layer (mtjax.models.moe) against references written here: the grouped
matmul and its gradients, every router variant, capacity dropping, and the streaming engine's
loss and gradients of an MoE model against jax.grad of the whole model."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, strategies as hst

import mtjax
from mtjax import config, data, engine, models, store as store_lib
from mtjax.config import ModelConfig, MoEConfig
from mtjax.models import moe
from mtjax.models.layers import token_nll
from numerics import assert_close


# ---------------------------------------------------------------------------- grouped matmul


def per_expert_reference(x_MxD, w_ExDxF, sizes_E):
  """sum over experts e of mask_e * (x @ w[e]), mask_e the rows of e's group: rows past the
  groups get nothing."""
  ends = np.cumsum(np.asarray(sizes_E))
  starts = ends - np.asarray(sizes_E)
  rows = jnp.arange(x_MxD.shape[0])
  out = jnp.zeros((x_MxD.shape[0], w_ExDxF.shape[2]), x_MxD.dtype)
  for e in range(w_ExDxF.shape[0]):
    mask = ((rows >= starts[e]) & (rows < ends[e])).astype(x_MxD.dtype)[:, None]
    out = out + mask * (x_MxD @ w_ExDxF[e])
  return out


@hst.composite
def groupings(draw):
  """Tokens' top-k choices among E experts, some experts never chosen, a few rows past the
  groups: (rows M, group sizes)."""
  E = draw(hst.integers(1, 6))
  k = draw(hst.integers(1, E))
  N = draw(hst.integers(1, 7))
  unused = draw(hst.sets(hst.integers(0, E - 1), max_size=E - k))  # always empty groups
  pool = [e for e in range(E) if e not in unused]
  seed = draw(hst.integers(0, 2**16))
  rng = np.random.default_rng(seed)
  choices = np.stack([rng.choice(pool, size=k, replace=False) for _ in range(N)])
  sizes = np.bincount(choices.reshape(-1), minlength=E).astype(np.int32)
  extra = draw(hst.integers(0, 2))
  return N * k + extra, sizes, seed


@given(groupings(), hst.sampled_from(["ragged", "dense"]))
def test_grouped_matmul_and_its_gradients_equal_a_loop_over_experts(grouping, impl):
  M, sizes, seed = grouping
  E, D, F = len(sizes), 5, 3
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.normal(size=(M, D)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(E, D, F)), jnp.float32)
  dy = jnp.asarray(rng.normal(size=(M, F)), jnp.float32)
  sizes = jnp.asarray(sizes)
  got, pull = jax.vjp(lambda x, w: moe.grouped_matmul(x, w, sizes, impl), x, w)
  want, pull_want = jax.vjp(lambda x, w: per_expert_reference(x, w, sizes), x, w)
  assert_close(got, want, name="y")
  assert not np.any(np.asarray(got)[int(sizes.sum()):])  # rows past the groups stay zero
  for name, g, r in zip(("dx", "dw"), pull(dy), pull_want(dy)):
    assert_close(g, r, name=name, zero_scale=1.0)
  dw = np.asarray(pull(dy)[1])
  assert not np.any(dw[np.asarray(sizes) == 0])  # an empty group's matrix gets no gradient


# ---------------------------------------------------------------------------------- routing


def softmax(x):
  e = np.exp(x - x.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def topk(x, k):
  idx = np.argsort(-x, axis=-1, kind="stable")[:, :k]
  return np.take_along_axis(x, idx, -1), idx


def reference_route(m: MoEConfig, logits, e_bias=None):
  """The routers as transformers writes them (Mixtral / Qwen, GPT-OSS, DeepSeek-V2 / V3), in
  float64 numpy."""
  logits = logits.astype(np.float64)
  k = m.experts_per_token
  if m.router == "topk_softmax":  # GPT-OSS: the top-k logits, softmax over them
    top, idx = topk(logits, k)
    return softmax(top), idx
  scores = softmax(logits) if m.router == "softmax" else 1 / (1 + np.exp(-logits))
  choice = scores + (0 if e_bias is None else e_bias)
  if m.groups > 1:
    g = choice.reshape(len(choice), m.groups, -1)
    group_score = (np.sort(g, -1)[..., -2:].sum(-1) if m.group_score == "top2_sum"
                   else g.max(-1))
    best = topk(group_score, m.topk_groups)[1]
    mask = np.zeros_like(group_score, bool)
    np.put_along_axis(mask, best, True, -1)
    # outside the kept groups: V3 -inf (a score plus a negative bias may be below 0), V2 0
    fill = -np.inf if m.router == "sigmoid" else 0.0
    choice = np.where(np.repeat(mask, m.experts // m.groups, -1), choice, fill)
  idx = topk(choice, k)[1]
  w = np.take_along_axis(scores, idx, -1)
  if m.norm_topk_prob:
    w = w / (w.sum(-1, keepdims=True) + (1e-20 if m.router == "sigmoid" else 0))
  return w * m.routed_scaling, idx


ROUTERS = {
    "softmax_renormalised": MoEConfig(experts=8, experts_per_token=2),  # Mixtral, Qwen3-MoE
    "softmax": MoEConfig(experts=8, experts_per_token=4, norm_topk_prob=False),  # Qwen2-MoE
    "topk_softmax": MoEConfig(experts=8, experts_per_token=3, router="topk_softmax"),  # GPT-OSS
    "softmax_group_limited": MoEConfig(experts=8, experts_per_token=3, norm_topk_prob=False,
                                       groups=4, topk_groups=2, routed_scaling=2.0),  # DS-V2
    "sigmoid_bias_groups": MoEConfig(experts=16, experts_per_token=4, router="sigmoid",
                                     score_correction_bias=True, groups=4, topk_groups=2,
                                     group_score="top2_sum", routed_scaling=2.5),  # DS-V3
}


def test_every_router_chooses_and_weighs_as_written_out():
  rng = np.random.default_rng(0)
  for name, m in ROUTERS.items():
    cfg = ModelConfig(moe=m)
    logits = rng.normal(size=(64, m.experts)).astype(np.float32) * 2
    e_bias = (rng.normal(size=m.experts).astype(np.float32) * 0.5
              if m.score_correction_bias else None)
    w, idx = moe.route(cfg, jnp.asarray(logits), None if e_bias is None else jnp.asarray(e_bias))
    want_w, want_idx = reference_route(m, logits, e_bias)
    # Within the chosen k the order is the score's (sorted per row for the sigmoid router, whose
    # transformers implementation takes them unsorted).
    order, want_order = np.argsort(idx, -1), np.argsort(want_idx, -1)
    assert np.array_equal(np.take_along_axis(np.asarray(idx), order, -1),
                          np.take_along_axis(want_idx, want_order, -1)), name
    assert_close(np.take_along_axis(np.asarray(w), order, -1),
                 np.take_along_axis(want_w, want_order, -1), name=name)
  # the bias changes the choice, not the weights' source: a zero bias chooses otherwise
  m = ROUTERS["sigmoid_bias_groups"]
  chosen = lambda b: np.sort(np.asarray(moe.route(ModelConfig(moe=m), jnp.asarray(logits), b)[1]))
  assert not np.array_equal(chosen(jnp.asarray(e_bias)), chosen(jnp.zeros(m.experts)))


# --------------------------------------------------------------------------------- capacity


def test_capacity_drops_the_pairs_past_an_experts_share_and_counts_them():
  m = MoEConfig(experts=4, experts_per_token=2, expert_ffn=8, capacity_factor=1.0)
  cfg = ModelConfig(hidden=16, moe=m, init_std=0.5)
  B, T, D, k, E = 2, 6, 16, 2, 4
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.normal(size=(B, T, D)), jnp.float32)
  valid = np.ones((B, T), np.float32)
  valid[1, 4:] = 0  # padding: routed and holding capacity, never counted
  layer = moe.MoE(cfg)
  params = layer.init(jax.random.key(0), x, jnp.asarray(valid))["params"]
  y, sums = layer.apply({"params": params}, x, jnp.asarray(valid))

  x_NxD = np.asarray(x).reshape(-1, D)
  w, idx = moe.route(cfg, jnp.asarray(x_NxD @ np.asarray(params["router"]["kernel"])))
  w, idx = np.asarray(w), np.asarray(idx)
  C = int(np.ceil(1.0 * B * T * k / E))
  seen = np.zeros(E, int)
  kept = np.zeros((B * T, k), bool)
  for n in range(B * T):  # an expert takes its pairs in token order, up to C
    for j in range(k):
      kept[n, j] = seen[idx[n, j]] < C
      seen[idx[n, j]] += 1
  dropped = np.sum(~kept * valid.reshape(-1, 1))
  assert dropped >= 2  # the test drops something: routing here is skewed enough
  assert float(sums["dropped"]) == dropped
  assert np.array_equal(np.asarray(sums["counts"]),  # counts: the valid pairs routed, kept or not
                        np.bincount(idx.reshape(-1), weights=np.repeat(valid.reshape(-1), k),
                                    minlength=E))
  ex = jax.tree.map(np.asarray, params["experts"])
  silu = lambda a: a / (1 + np.exp(-a))
  want = np.zeros_like(x_NxD)
  for n in range(B * T):
    for j in range(k):
      if kept[n, j]:
        e = idx[n, j]
        h = silu(x_NxD[n] @ ex["gate"][e]) * (x_NxD[n] @ ex["up"][e])
        want[n] += w[n, j] * (h @ ex["down"][e])
  assert_close(np.asarray(y).reshape(-1, D), want, name="output with dropped pairs")


# ----------------------------------------------------------------------------------- engine


def moe_config() -> config.Config:
  """3 layers, the first dense, then two MoE layers with a gated shared expert; sequence tiles
  that do not divide the sequence; two micro-batches."""
  moe_cfg = dict(experts=4, experts_per_token=2, expert_ffn=16, shared_experts=1, shared_ffn=8,
                 shared_gate=True, first_dense_layers=1, aux_loss_coef=0.1, z_loss_coef=0.01)
  return config.from_dict({
      "model": dict(vocab_size=64, hidden=32, layers=3, heads=4, kv_heads=2, ffn=48,
                    init_std=0.2, moe=moe_cfg),
      "engine": dict(compute_dtype="float32", loss_chunk=24, device_state_layers=1,
                     device_update_layers=1, micro_batch=2, seq_tile=5),
      "optim": dict(lr=1e-2, warmup_steps=0),
      "train": dict(batch=4, seq=8, steps=2),
  })


def test_streamed_moe_loss_and_grads_equal_the_whole_model_grad():
  cfg = moe_config()
  spec = models.spec(cfg.model)
  assert [k for _, k in spec.groups] == ["embed", "block", "block_moe", "block_moe", "head"]
  st = store_lib.create(cfg, jax.random.key(0))
  eng = engine.Engine(cfg, st)
  b = data.synthetic_batch(0, cfg.train.batch, cfg.train.seq, cfg.model.vocab_size, seed=7)
  loss, grads = eng.grads(b)

  def whole(params):
    logits, aux, metrics = mtjax.forward(cfg.model, params, b.inputs, aux=True)
    nll = token_nll(logits.reshape(-1, cfg.model.vocab_size), jnp.asarray(b.targets.reshape(-1)))
    return jnp.mean(nll) + aux, (aux, metrics)

  (want_loss, (aux, metrics)), want = jax.jit(jax.value_and_grad(whole, has_aux=True))(st.to_tree())
  assert float(aux) > 0.05  # the auxiliary loss is in both: large enough to matter
  assert_close(loss, float(want_loss), name="loss (cross-entropy + aux)")
  parts = [want["embed"], *want["blocks"], want["head"]]
  for (g, _), got, part in zip(spec.groups, grads, parts):
    assert_close(got, spec.group_layout(g).flatten(jax.tree.map(np.asarray, part)), name=g)

  stats = eng.step(b)
  eng.close()
  assert_close(stats.aux["aux_loss"], float(aux), name="aux_loss")
  assert_close(stats.loss + stats.aux["aux_loss"], float(want_loss), name="step loss")
  for key in ("expert_tokens_min", "expert_tokens_max"):  # tokens per expert, whole batch
    assert stats.aux[key] == float(metrics[key]), key
  assert stats.aux["expert_tokens_min"] < stats.aux["expert_tokens_max"]

