"""Llama-family layer math: pure Flax modules for the embedding, one decoder block and the LM head.

Each module is a stateless template: `Module(cfg).apply({"params": p}, ...)` is a pure function of
one layer's parameters and its inputs. The streaming engine binds whichever layer's weights just
arrived on the device; nothing here knows about hosts, streams or optimizers.
"""

from __future__ import annotations

import math

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp

from mtjax import attention
from mtjax.config import ModelConfig


def rope_inv_freq(cfg: ModelConfig) -> jax.Array:
  """Per-pair rotation frequencies, with the configured context-extension scaling applied."""
  hd = cfg.dim_per_head
  inv_freq = 1.0 / (cfg.rope_theta ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd))
  if cfg.rope_scaling == "linear":
    return inv_freq / cfg.rope_factor
  if cfg.rope_scaling == "llama3":
    low_wavelen = cfg.rope_original_max_len / cfg.rope_low_freq_factor
    high_wavelen = cfg.rope_original_max_len / cfg.rope_high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelen > low_wavelen, inv_freq / cfg.rope_factor, inv_freq)
    smooth = ((cfg.rope_original_max_len / wavelen - cfg.rope_low_freq_factor)
              / (cfg.rope_high_freq_factor - cfg.rope_low_freq_factor))
    smoothed = (1 - smooth) * scaled / cfg.rope_factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return jnp.where(medium, smoothed, scaled)
  return inv_freq


@flax.struct.dataclass
class Ctx:
  """Per-token context every layer is called with, beside its weights and activations.

  `positions` feed RoPE (packed documents restart at 0); `segments` keep attention inside a
  document (None: each row is one document). The per-token loss weights live with the head's
  targets, not here: blocks never see them.
  """
  positions: jax.Array  # [B, T] int32
  segments: jax.Array | None = None  # [B, T] int32 document ids, or None

  @classmethod
  def default(cls, B: int, T: int) -> "Ctx":
    return cls(jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None, :], (B, T)))

  def micro(self, n: int) -> "Ctx":
    """[B, T] -> [n, B/n, T] on every field, for lax.map / scan over micro-batches."""
    split = lambda a: a.reshape((n, a.shape[0] // n) + a.shape[1:])
    return jax.tree.map(split, self)


def apply_rope(x_BxTxNxH: jax.Array, inv_freq: jax.Array, positions_BxT: jax.Array | None = None
               ) -> jax.Array:
  """Rotates channel pairs (i, i + H/2) by position * frequency, computed in fp32."""
  B, T = x_BxTxNxH.shape[:2]
  if positions_BxT is None:
    positions_BxT = jnp.broadcast_to(jnp.arange(T)[None, :], (B, T))
  angles_BxTxH2 = positions_BxT.astype(jnp.float32)[..., None] * inv_freq[None, None, :]
  cos = jnp.cos(angles_BxTxH2)[:, :, None, :]
  sin = jnp.sin(angles_BxTxH2)[:, :, None, :]
  x = x_BxTxNxH.astype(jnp.float32)
  x1, x2 = jnp.split(x, 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BxTxNxH.dtype)


class RMSNorm(nn.Module):
  eps: float

  @nn.compact
  def __call__(self, x):
    scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), jnp.float32)
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return normed.astype(x.dtype) * scale.astype(x.dtype).reshape((1,) * (x.ndim - 1) + (-1,))


def _dense(features, name, bias=False):
  return nn.Dense(features, use_bias=bias, name=name, param_dtype=jnp.float32)


class Attention(nn.Module):
  cfg: ModelConfig
  implementation: str | None = None

  @nn.compact
  def __call__(self, x_BxTxD, ctx: Ctx | None = None):
    cfg = self.cfg
    B, T, _ = x_BxTxD.shape
    ctx = Ctx.default(B, T) if ctx is None else ctx
    H, K, hd = cfg.heads, cfg.n_kv_heads, cfg.dim_per_head
    q = _dense(H * hd, "q", cfg.qkv_bias)(x_BxTxD).reshape(B, T, H, hd)
    k = _dense(K * hd, "k", cfg.qkv_bias)(x_BxTxD).reshape(B, T, K, hd)
    v = _dense(K * hd, "v", cfg.qkv_bias)(x_BxTxD).reshape(B, T, K, hd)
    if cfg.qk_norm:  # Qwen3: RMSNorm over each head's channels, before RoPE
      q = RMSNorm(cfg.norm_eps, name="q_norm")(q)
      k = RMSNorm(cfg.norm_eps, name="k_norm")(k)
    inv_freq = rope_inv_freq(cfg)
    q, k = apply_rope(q, inv_freq, ctx.positions), apply_rope(k, inv_freq, ctx.positions)
    impl = self.implementation
    if impl == "cudnn" and ctx.segments is not None:
      impl = "blockwise"  # the fused kernel takes no document mask; no [T x T] mask instead
    if impl == "blockwise":
      out_BxTxHxh = attention.blockwise_attention(q, k, v, segments_q_BxT=ctx.segments,
                                                  segments_k_BxS=ctx.segments, causal=True)
    else:
      mask = None
      if ctx.segments is not None:  # packed documents: no attention across a document boundary
        mask = (ctx.segments[:, :, None] == ctx.segments[:, None, :])[:, None]
      out_BxTxHxh = jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True,
                                                 implementation=impl)
    return _dense(cfg.hidden, "o")(out_BxTxHxh.reshape(B, T, H * hd))


class MLP(nn.Module):
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x):
    gate = _dense(self.cfg.ffn, "gate")(x)
    up = _dense(self.cfg.ffn, "up")(x)
    return _dense(self.cfg.hidden, "down")(nn.silu(gate) * up)


class Block(nn.Module):
  """RMSNorm -> causal GQA attention with RoPE -> residual -> RMSNorm -> SwiGLU -> residual."""
  cfg: ModelConfig
  implementation: str | None = None

  @nn.compact
  def __call__(self, x_BxTxD, ctx: Ctx | None = None):
    h = x_BxTxD + Attention(self.cfg, self.implementation, name="attn")(
        RMSNorm(self.cfg.norm_eps, name="attn_norm")(x_BxTxD), ctx)
    return h + MLP(self.cfg, name="mlp")(RMSNorm(self.cfg.norm_eps, name="mlp_norm")(h))


class Embed(nn.Module):
  cfg: ModelConfig

  @nn.compact
  def __call__(self, tokens_BxT):
    table = self.param("table", nn.initializers.normal(self.cfg.init_std),
                       (self.cfg.vocab_size, self.cfg.hidden), jnp.float32)
    return jnp.take(table, tokens_BxT, axis=0)


class Head(nn.Module):
  """Final RMSNorm and the LM head; with tied embeddings the caller passes the embedding table."""
  cfg: ModelConfig

  def setup(self):
    self.norm = RMSNorm(self.cfg.norm_eps, name="norm")
    if not self.cfg.tie_embeddings:
      self.out = self.param("out", nn.initializers.normal(self.cfg.init_std),
                            (self.cfg.hidden, self.cfg.vocab_size), jnp.float32)

  def normalize(self, h):
    return self.norm(h)

  def logits(self, hn_NxD, table_VxD=None):
    w_DxV = table_VxD.T if self.cfg.tie_embeddings else self.out
    return hn_NxD @ w_DxV.astype(hn_NxD.dtype)

  def __call__(self, h, table_VxD=None):
    return self.logits(self.normalize(h), table_VxD)


def token_nll(logits_NxV: jax.Array, targets_N: jax.Array) -> jax.Array:
  """Cross-entropy per token, computed in fp32."""
  logits = logits_NxV.astype(jnp.float32)
  lse = jax.nn.logsumexp(logits, axis=-1)
  picked = jnp.take_along_axis(logits, targets_N[:, None], axis=-1)[:, 0]
  return lse - picked
