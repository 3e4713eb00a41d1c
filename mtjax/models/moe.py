"""A mixture-of-experts feed-forward: the router, the experts as one grouped matmul over tokens
sorted by expert, optional shared experts, and the load-balancing loss across layers.

Routing is dropless by default: every token reaches its k experts whatever the load. The experts
run as a grouped matmul: the (token, choice) pairs sorted by expert, each expert's rows multiplied
by its own weights (`jax.lax.ragged_dot`), never a dense loop of every expert over every token.
With `moe.capacity_factor` an expert takes at most that factor times its even share of the pairs;
the rest are dropped (weight 0) and counted. The share is of the pairs of one call: one micro-batch's
sequence tile (`engine.micro_batch`, `engine.seq_tile`), earlier tokens first.

Every MoE block returns, beside its output, sums over its (valid) tokens that the model's
auxiliary loss needs: the router probabilities and the tokens each expert got (the
load-balancing loss of Switch / Mixtral multiplies their totals over all layers, so it is computed
once the forward has seen every layer, and each layer's backward gets its share of the gradient),
and the router's squared logsumexp (the z-loss).
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from mtjax.config import ModelConfig
from mtjax.models import grouped
from mtjax.models.layers import MLP, activate, dense


def route(cfg: ModelConfig, logits_NxE: jax.Array, e_bias_E: jax.Array | None = None
          ) -> tuple[jax.Array, jax.Array]:
  """(weights [N, k] fp32, experts [N, k] int32) each token is sent to, by the config's router.

  softmax: softmax over all experts, the k largest (DeepSeek-V2: within the best groups);
  topk_softmax: the k largest logits, softmax over those (GPT-OSS); sigmoid: sigmoid scores,
  chosen by score + correction bias within the best groups, weighted by the scores (DeepSeek-V3).
  """
  m = cfg.moe
  k, E = m.experts_per_token, m.experts
  logits = logits_NxE.astype(jnp.float32)
  if m.router == "topk_softmax":
    top, idx = jax.lax.top_k(logits, k)
    return jax.nn.softmax(top, axis=-1), idx
  scores = jax.nn.softmax(logits, axis=-1) if m.router == "softmax" else jax.nn.sigmoid(logits)
  choice = scores if e_bias_E is None else scores + e_bias_E[None, :]
  if m.groups > 1:  # group-limited: only experts of the topk_groups best groups may be chosen
    grouped = choice.reshape(-1, m.groups, E // m.groups)
    if m.group_score == "top2_sum":
      group_score = jax.lax.top_k(grouped, 2)[0].sum(-1)
    else:
      group_score = grouped.max(-1)
    _, best = jax.lax.top_k(group_score, m.topk_groups)
    keep = jnp.zeros(group_score.shape, bool).at[jnp.arange(best.shape[0])[:, None], best].set(True)
    # -inf, not 0: a sigmoid score plus a negative correction bias may be below 0.
    choice = jnp.where(jnp.repeat(keep, E // m.groups, axis=-1), choice, -jnp.inf)
  _, idx = jax.lax.top_k(choice, k)
  weights = jnp.take_along_axis(scores, idx, axis=-1)
  if m.norm_topk_prob:
    weights = weights / (weights.sum(-1, keepdims=True) + (1e-20 if m.router == "sigmoid" else 0))
  return weights * m.routed_scaling, idx


def grouped_matmul(x_MxD: jax.Array, w_ExDxF: jax.Array, group_sizes_E: jax.Array,
                   impl: str = "ragged") -> jax.Array:
  """Rows of x sorted by group (the first group_sizes[0] rows group 0's, ...) times their group's
  matrix: [M, F]. Rows past sum(group_sizes) get zeros."""
  if impl == "dense":  # every group's matrix on every row, then each row's own: a reference
    ends = jnp.cumsum(group_sizes_E)
    group_M = jnp.searchsorted(ends, jnp.arange(x_MxD.shape[0]), side="right")
    all_MxExF = jnp.einsum("md,edf->mef", x_MxD, w_ExDxF)
    pick = jax.nn.one_hot(group_M, w_ExDxF.shape[0], dtype=all_MxExF.dtype)  # past the end: 0
    return jnp.einsum("mef,me->mf", all_MxExF, pick)
  if impl == "mosaic":  # Hopper GPUs: jax's Mosaic-GPU kernels, forward and both gradients
    return grouped.grouped_matmul(x_MxD, w_ExDxF, group_sizes_E)
  return jax.lax.ragged_dot(x_MxD, w_ExDxF, group_sizes_E.astype(jnp.int32))


class Experts(nn.Module):
  """E gated MLPs stacked: gate and up [E, D, F], down [E, F, D] (and biases [E, F], [E, D])."""
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x_MxD, group_sizes_E, expert_M, impl: str):
    cfg, m = self.cfg, self.cfg.moe
    E, D, F = m.experts, cfg.hidden, m.expert_ffn
    init = nn.initializers.normal(cfg.init_std)
    gate = self.param("gate", init, (E, D, F), jnp.float32)
    up = self.param("up", init, (E, D, F), jnp.float32)
    down = self.param("down", init, (E, F, D), jnp.float32)
    dt = x_MxD.dtype
    g = grouped_matmul(x_MxD, gate.astype(dt), group_sizes_E, impl)
    u = grouped_matmul(x_MxD, up.astype(dt), group_sizes_E, impl)
    if cfg.mlp_bias:
      g = g + self.param("gate_bias", nn.initializers.zeros, (E, F), jnp.float32)[expert_M].astype(dt)
      u = u + self.param("up_bias", nn.initializers.zeros, (E, F), jnp.float32)[expert_M].astype(dt)
    y = grouped_matmul(activate(cfg, g, u), down.astype(dt), group_sizes_E, impl)
    if cfg.mlp_bias:
      y = y + self.param("down_bias", nn.initializers.zeros, (E, D), jnp.float32)[expert_M].astype(dt)
    return y


class MoE(nn.Module):
  """Router, routed experts and shared experts of one layer; returns (output, sums for the
  auxiliary loss over the tokens `valid_BxT` marks)."""
  cfg: ModelConfig
  impl: str = "ragged"

  @nn.compact
  def __call__(self, x_BxTxD, valid_BxT):
    cfg, m = self.cfg, self.cfg.moe
    B, T, D = x_BxTxD.shape
    N, E, k = B * T, m.experts, m.experts_per_token
    x_NxD = x_BxTxD.reshape(N, D)
    valid_N = valid_BxT.reshape(N).astype(jnp.float32)
    logits_NxE = dense(E, "router", m.router_bias)(x_NxD).astype(jnp.float32)
    e_bias = (self.param("e_bias", nn.initializers.zeros, (E,), jnp.float32)
              if m.score_correction_bias else None)
    weights_Nxk, experts_Nxk = route(cfg, logits_NxE, e_bias)

    # The (token, choice) pairs sorted by expert: each expert's rows are contiguous.
    expert_P = experts_Nxk.reshape(N * k)
    order_P = jnp.argsort(expert_P, stable=True)
    sizes_E = jnp.bincount(expert_P, length=E)
    sorted_expert_P = expert_P[order_P]
    weight_P = weights_Nxk.reshape(N * k)
    dropped = jnp.zeros((), jnp.float32)
    if m.capacity_factor is not None:  # at most C pairs per expert, the rest weigh nothing
      C = math.ceil(m.capacity_factor * N * k / E)
      starts_E = jnp.cumsum(sizes_E) - sizes_E
      rank_P = jnp.arange(N * k) - starts_E[sorted_expert_P]
      kept_sorted = rank_P < C
      kept_P = jnp.zeros(N * k, bool).at[order_P].set(kept_sorted)
      dropped = jnp.sum((~kept_P).reshape(N, k) * valid_N[:, None])
      weight_P = jnp.where(kept_P, weight_P, 0.0)
    x_sorted = x_NxD[order_P // k]
    if m.weight_inputs:  # Llama 4: the weight scales the expert's input; a dropped pair adds 0
      x_sorted = x_sorted * weight_P[order_P][:, None].astype(x_sorted.dtype)
      weight_P = jnp.ones_like(weight_P) if m.capacity_factor is None else kept_P.astype(jnp.float32)
    y_sorted = Experts(cfg, name="experts")(x_sorted, sizes_E, sorted_expert_P, self.impl)
    y_P = jnp.zeros_like(y_sorted).at[order_P].set(y_sorted)  # back in (token, choice) order
    y_NxD = jnp.einsum("nkd,nk->nd", y_P.reshape(N, k, D), weight_P.reshape(N, k).astype(y_P.dtype))
    if m.shared_experts or m.shared_ffn:
      shared = MLP(cfg, m.shared_width, name="shared")(x_NxD)
      if m.shared_gate:  # Qwen2-MoE: a sigmoid gate per token
        shared = jax.nn.sigmoid(dense(1, "shared_gate")(x_NxD)) * shared
      y_NxD = y_NxD + shared

    probs_NxE = jax.nn.softmax(logits_NxE, axis=-1)
    counts_E = jnp.zeros(E, jnp.float32).at[expert_P].add(jnp.repeat(valid_N, k))
    sums = {
        "probs": jnp.einsum("ne,n->e", probs_NxE, valid_N),
        "counts": jax.lax.stop_gradient(counts_E),
        "lse2": jnp.sum(jnp.square(jax.nn.logsumexp(logits_NxE, axis=-1)) * valid_N),
        "tokens": jnp.sum(valid_N),
        "dropped": jax.lax.stop_gradient(dropped),
    }
    return y_NxD.reshape(B, T, D), sums


def aux_loss(cfg: ModelConfig, sums: list[dict]) -> tuple[jax.Array, dict]:
  """The load-balancing loss of Switch / Mixtral over all MoE layers at once, as transformers'
  `load_balancing_loss_func` computes it from every layer's router logits concatenated:
  E * sum_e f_e P_e, f_e the share of (token, choice) pairs expert e got and P_e its mean router
  probability, both over all layers' tokens; plus the router z-loss (the mean squared logsumexp).
  Weighted by moe.aux_loss_coef and moe.z_loss_coef. Returns (loss, metrics)."""
  m = cfg.moe
  sums = [s for s in sums if s]
  counts = sum(s["counts"] for s in sums)
  probs = sum(s["probs"] for s in sums)
  rows = jnp.maximum(sum(s["tokens"] for s in sums), 1.0)
  balance = m.experts * jnp.sum((counts / rows) * (probs / rows))
  z = sum(s["lse2"] for s in sums) / rows
  loss = m.aux_loss_coef * balance + m.z_loss_coef * z
  per_layer = jnp.stack([s["counts"] for s in sums])
  metrics = {"aux_loss": loss, "load_balance": balance, "router_z": z,
             "expert_tokens_min": per_layer.min(), "expert_tokens_max": per_layer.max(),
             "dropped": sum(s["dropped"] for s in sums)}
  return loss, metrics
