"""The gated DeltaNet (Qwen3-Next's "linear" layers): a token mixer in the same per-token (`qkv`,
`out`) and sequence (`core`) parts as attention, whose core is a causal depthwise convolution and
the gated delta rule's recurrence instead of a softmax over the sequence.

Per value head, with a [key_dim x value_dim] state S, decay a_t = exp(g_t) and rate beta_t:

    S_t = a_t S_{t-1} + k_t beta_t (v_t - (a_t S_{t-1})^T k_t)^T,    o_t = S_t^T q_t

with q_t, k_t L2-normalised and q_t scaled by key_dim^-0.5. The core runs it as a chunked scan:
within a chunk of C tokens every pair's decay is a matrix and the chunk's updates solve one
unit-triangular system; only the state passes from chunk to chunk (`chunked_delta_rule`). Packed
documents (runs of equal ids in `segments`) each start from a zero state and a zero convolution
history.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from mtjax.config import ModelConfig
from mtjax.models.layers import RMSNorm, dense

L2_EPS = 1e-6  # transformers' (and the FLA kernels') epsilon of the q/k L2 norm


def wide(a):
  """`a` in fp32, or wider: the recurrence and its inputs never run in bf16."""
  return a.astype(jnp.promote_types(a.dtype, jnp.float32))


def document_runs(segments_BxT: jax.Array) -> jax.Array:
  """The index of each token's document within its row, [B, T] int32: a new one wherever the id
  changes."""
  starts = jnp.concatenate([jnp.zeros_like(segments_BxT[:, :1], bool),
                            segments_BxT[:, 1:] != segments_BxT[:, :-1]], axis=1)
  return jnp.cumsum(starts, axis=1, dtype=jnp.int32)


def causal_conv(x_BxTxC: jax.Array, w_CxK: jax.Array, runs_BxT: jax.Array | None = None):
  """Depthwise causal convolution: y[t] = sum_j w[:, K-1-j] x[t-j], taps before a document's
  first token (or the row's) left out."""
  T, K = x_BxTxC.shape[1], w_CxK.shape[1]
  tap = lambda j: w_CxK[None, None, :, K - 1 - j]  # the weight of the input j tokens back
  y = x_BxTxC * tap(0)
  for j in range(1, min(K, T + 1)):
    back = jnp.pad(x_BxTxC, ((0, 0), (j, 0), (0, 0)))[:, :T]
    if runs_BxT is not None:
      same = jnp.pad(runs_BxT, ((0, 0), (j, 0)), constant_values=-1)[:, :T] == runs_BxT
      back = jnp.where(same[..., None], back, 0)
    y = y + back * tap(j)
  return y


def l2_normalize(x):
  return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2_EPS)


def chunked_delta_rule(q_BxTxHxK, k_BxTxHxK, v_BxTxHxV, g_BxTxH, beta_BxTxH,
                       runs_BxT: jax.Array | None = None, chunk: int = 64) -> jax.Array:
  """The gated delta rule's outputs [B, T, H, V] (fp32 or wider) from a zero state, in chunks of
  `chunk` tokens; q and k normalised already (q is scaled by K^-0.5 here). A document (a run of
  `runs`) sees nothing of the ones before it.

  Within a chunk, the decay between positions j <= i is exp(cum_i - cum_j) (cum: the running sum
  of g), 0 across a document's start. The chunk's updates d_j = beta_j (v_j - k_j^T S_{j-1})
  solve (I + L) d = beta v - (beta k exp(cum)) S_prev, L the strictly lower
  beta_i k_i.k_j exp(cum_i - cum_j); outputs and the next state follow in three matmuls each.
  """
  B, T, H, Kd = q_BxTxHxK.shape
  Vd = v_BxTxHxV.shape[-1]
  C = min(chunk, T)
  n = -(-T // C)
  pad = n * C - T

  def chunks(a, mode="constant"):  # [B, T, H, ...] -> [B, H, n, C, ...], zeros past T
    a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2), mode=mode)
    a = a.reshape(B, n, C, *a.shape[2:])
    return jnp.moveaxis(a, 3, 1) if a.ndim > 3 else a

  q = chunks(wide(q_BxTxHxK) * Kd ** -0.5)
  k, v = chunks(wide(k_BxTxHxK)), chunks(wide(v_BxTxHxV))
  g, beta = chunks(wide(g_BxTxH)), chunks(wide(beta_BxTxH))
  cum = jnp.cumsum(g, axis=-1)  # [B, H, n, C]
  causal = jnp.tril(jnp.ones((C, C), bool))[None, None, None]
  eye = jnp.eye(C, dtype=bool)[None, None, None]
  if runs_BxT is None:
    same_CxC, first, last = causal, None, None
  else:
    runs = chunks(runs_BxT, mode="edge")[:, None]  # [B, 1, n, C]
    same_CxC = causal & (runs[..., :, None] == runs[..., None, :])
    # each token's document against the one the previous chunk ended in (chunk 0: no state)
    before = jnp.concatenate([runs[..., :1, :1], runs[..., :-1, -1:]], axis=-2)
    first = runs == before  # reads the carried state
    last = runs == runs[..., -1:]  # reaches the state the chunk hands on
  diff = cum[..., :, None] - cum[..., None, :]
  decay = jnp.where(same_CxC, jnp.exp(jnp.where(same_CxC, diff, 0.0)), 0.0)
  kb, vb = k * beta[..., None], v * beta[..., None]
  lower = jnp.einsum("bhnik,bhnjk->bhnij", kb, k) * jnp.where(eye, 0.0, decay)
  system = jnp.where(eye, 1.0, lower)
  to_start = jnp.exp(cum) if first is None else jnp.where(first, jnp.exp(cum), 0.0)
  to_end = jnp.exp(cum[..., -1:] - cum)
  to_end = to_end if last is None else jnp.where(last, to_end, 0.0)
  # One solve for both right-hand sides: u, the updates were the carried state zero, and w, what
  # the carried state takes from them.
  uw = jax.lax.linalg.triangular_solve(system, jnp.concatenate([vb, kb * to_start[..., None]], -1),
                                       left_side=True, lower=True, unit_diagonal=True)
  u, w = uw[..., :Vd], uw[..., Vd:]
  attn = jnp.einsum("bhnik,bhnjk->bhnij", q, k) * decay
  q_start = q * to_start[..., None]
  k_end = k * to_end[..., None]
  carry_decay = to_start[..., -1]  # the carried state at the chunk's end, 0 past a document start

  def step(S_BxHxKxV, xs):
    u_c, w_c, attn_c, q_c, k_c, a_c = xs
    d = u_c - jnp.einsum("bhck,bhkv->bhcv", w_c, S_BxHxKxV)
    o = jnp.einsum("bhck,bhkv->bhcv", q_c, S_BxHxKxV) + jnp.einsum("bhij,bhjv->bhiv", attn_c, d)
    S = S_BxHxKxV * a_c[..., None, None] + jnp.einsum("bhck,bhcv->bhkv", k_c, d)
    return S, o

  per_chunk = lambda a: jnp.moveaxis(a, 2, 0)  # the scan's axis first
  S0 = jnp.zeros((B, H, Kd, Vd), q.dtype)
  xs = tuple(per_chunk(a) for a in (u, w, attn, q_start, k_end,
                                    jnp.broadcast_to(carry_decay, cum.shape[:-1])))
  if n == 1:  # one chunk: no loop to compile
    o = step(S0, tuple(a[0] for a in xs))[1][None]
  else:
    _, o = jax.lax.scan(step, S0, xs)
  o = jnp.moveaxis(o, 0, 2).reshape(B, H, n * C, Vd)[:, :, :T]  # [B, H, T, V]
  return jnp.moveaxis(o, 1, 2)


class GatedDeltaNet(nn.Module):
  """The gated DeltaNet token mixer: in_proj_qkvz / in_proj_ba projections (per token), the
  convolution, recurrence and gated norm (the core), out_proj (per token).

  The projections keep transformers' layout, grouped by key head: in_proj_qkvz's outputs are,
  per key head, its q, its k, then the v and z of the value heads it serves; in_proj_ba's, per key
  head, the b then the a of those value heads.
  """
  cfg: ModelConfig

  def setup(self):
    cfg, m = self.cfg, self.cfg.linear
    kd, vd = m.key_heads * m.key_dim, m.value_heads * m.value_dim
    self.qkvz = dense(2 * kd + 2 * vd)
    self.ba = dense(2 * m.value_heads)
    self.conv = self.param("conv", nn.initializers.normal(cfg.init_std),
                           (2 * kd + vd, m.conv_kernel), jnp.float32)
    self.A_log = self.param("A_log", nn.initializers.zeros, (m.value_heads,), jnp.float32)
    self.dt_bias = self.param("dt_bias", nn.initializers.ones, (m.value_heads,), jnp.float32)
    # Scales by w, not (1 + w), whatever the model's other norms do (transformers' RMSNormGated).
    self.out_norm = RMSNorm(cfg.norm_eps)
    self.o = dense(cfg.hidden)

  def rope(self, positions_BxT):
    """No positional tables: the recurrence is ordered by itself."""
    return ()

  def qkv(self, x_BxTxD):
    """(q, k and v before the convolution [B, T, 2 Hk Dk + Hv Dv], z [B, T, Hv, Dv], beta and the
    log decay g [B, T, Hv] fp32); each token's from its own input alone."""
    m = self.cfg.linear
    B, T, _ = x_BxTxD.shape
    Hk, r, Dk, Dv = m.key_heads, m.value_heads // m.key_heads, m.key_dim, m.value_dim
    qkvz = self.qkvz(x_BxTxD).reshape(B, T, Hk, 2 * Dk + 2 * r * Dv)
    q, k = qkvz[..., :Dk], qkvz[..., Dk:2 * Dk]
    v, z = qkvz[..., 2 * Dk:2 * Dk + r * Dv], qkvz[..., 2 * Dk + r * Dv:]
    ba = self.ba(x_BxTxD).reshape(B, T, Hk, 2 * r)
    b, a = ba[..., :r].reshape(B, T, -1), ba[..., r:].reshape(B, T, -1)
    mixed = jnp.concatenate([q.reshape(B, T, -1), k.reshape(B, T, -1), v.reshape(B, T, -1)], -1)
    beta = jax.nn.sigmoid(wide(b))
    g = -jnp.exp(self.A_log)[None, None] * jax.nn.softplus(wide(a) + self.dt_bias[None, None])
    return mixed, z.reshape(B, T, m.value_heads, Dv), beta, g

  def core(self, qkv, segments_BxT, groups_BxT=None):
    """Convolution, recurrence and gated norm over the sequence: [B, T, Hv * Dv]."""
    if groups_BxT is not None:
      raise ValueError("model.vision.image_attention: bidirectional image tokens need attention "
                       "layers (a gated DeltaNet's recurrence is causal)")
    m = self.cfg.linear
    mixed, z_BxTxHxV, beta, g = qkv
    B, T, _ = mixed.shape
    runs = None if segments_BxT is None else document_runs(segments_BxT)
    y = nn.silu(causal_conv(mixed, self.conv.astype(mixed.dtype), runs))
    kd = m.key_heads * m.key_dim
    r = m.value_heads // m.key_heads
    q = jnp.repeat(y[..., :kd].reshape(B, T, m.key_heads, m.key_dim), r, axis=2)
    k = jnp.repeat(y[..., kd:2 * kd].reshape(B, T, m.key_heads, m.key_dim), r, axis=2)
    v = y[..., 2 * kd:].reshape(B, T, m.value_heads, m.value_dim)
    q, k = (l2_normalize(wide(a)) for a in (q, k))
    o = chunked_delta_rule(q, k, v, g, beta, runs, m.chunk).astype(mixed.dtype)
    gated = wide(self.out_norm(o)) * nn.silu(wide(z_BxTxHxV))
    return gated.astype(mixed.dtype).reshape(B, T, -1)

  def out(self, a_BxTxE):
    return self.o(a_BxTxE)


def scan_flops(cfg: ModelConfig, batch: int, seq: int) -> float:
  """The chunked scan's matmuls in one layer's forward (`chunked_delta_rule`; the projections
  and the convolution are parameters' work): per chunk of C tokens and value head, the two C x C
  products (k k^T, q k^T: 4 C^2 Dk), the triangular solves for v and k (C^2 (Dv + Dk)), the
  chunk's outputs (2 C^2 Dv) and the three products with the state (6 C Dk Dv)."""
  m = cfg.linear
  C = min(m.chunk, seq)
  chunks = -(-seq // C)
  per_chunk = C * C * (5 * m.key_dim + 3 * m.value_dim) + 6 * C * m.key_dim * m.value_dim
  return float(batch * m.value_heads * chunks * per_chunk)
