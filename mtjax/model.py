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


def _dense(features, name=None, bias=False):
  return nn.Dense(features, use_bias=bias, name=name, param_dtype=jnp.float32)


class Attention(nn.Module):
  """Causal GQA attention with RoPE, in per-token (`qkv`, `o`) and sequence (`core`) parts."""
  cfg: ModelConfig
  implementation: str | None = None

  def setup(self):
    cfg = self.cfg
    H, K, hd = cfg.heads, cfg.n_kv_heads, cfg.dim_per_head
    self.q = _dense(H * hd, bias=cfg.qkv_bias)
    self.k = _dense(K * hd, bias=cfg.qkv_bias)
    self.v = _dense(K * hd, bias=cfg.qkv_bias)
    self.o = _dense(cfg.hidden)
    if cfg.qk_norm:  # Qwen3: RMSNorm over each head's channels, before RoPE
      self.q_norm = RMSNorm(cfg.norm_eps)
      self.k_norm = RMSNorm(cfg.norm_eps)

  def qkv(self, x_BxTxD, positions_BxT):
    """Queries, keys and values with RoPE applied; each token's from its own input alone."""
    cfg = self.cfg
    B, T, _ = x_BxTxD.shape
    H, K, hd = cfg.heads, cfg.n_kv_heads, cfg.dim_per_head
    q = self.q(x_BxTxD).reshape(B, T, H, hd)
    k = self.k(x_BxTxD).reshape(B, T, K, hd)
    v = self.v(x_BxTxD).reshape(B, T, K, hd)
    if cfg.qk_norm:
      q, k = self.q_norm(q), self.k_norm(k)
    inv_freq = rope_inv_freq(cfg)
    return apply_rope(q, inv_freq, positions_BxT), apply_rope(k, inv_freq, positions_BxT), v

  def core(self, q_BxTxHxh, k_BxTxKxh, v_BxTxKxh, segments_BxT):
    """Attention over the sequence: [B, T, H * h], before the output projection."""
    B, T, H, hd = q_BxTxHxh.shape
    impl = self.implementation
    if impl == "cudnn" and segments_BxT is not None:
      impl = "blockwise"  # the fused kernel takes no document mask; no [T x T] mask instead
    if impl == "blockwise":
      out_BxTxHxh = attention.blockwise_attention(q_BxTxHxh, k_BxTxKxh, v_BxTxKxh,
                                                  segments_q_BxT=segments_BxT,
                                                  segments_k_BxS=segments_BxT, causal=True)
    else:
      mask = None
      if segments_BxT is not None:  # packed documents: no attention across a document boundary
        mask = (segments_BxT[:, :, None] == segments_BxT[:, None, :])[:, None]
      out_BxTxHxh = jax.nn.dot_product_attention(q_BxTxHxh, k_BxTxKxh, v_BxTxKxh, mask=mask,
                                                 is_causal=True, implementation=impl)
    return out_BxTxHxh.reshape(B, T, H * hd)

  def __call__(self, x_BxTxD, ctx: Ctx | None = None):
    B, T, _ = x_BxTxD.shape
    ctx = Ctx.default(B, T) if ctx is None else ctx
    return self.o(self.core(*self.qkv(x_BxTxD, ctx.positions), ctx.segments))


class MLP(nn.Module):
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x):
    gate = _dense(self.cfg.ffn, "gate")(x)
    up = _dense(self.cfg.ffn, "up")(x)
    return _dense(self.cfg.hidden, "down")(nn.silu(gate) * up)


class Block(nn.Module):
  """RMSNorm -> causal GQA attention with RoPE -> residual -> RMSNorm -> SwiGLU -> residual.

  With `seq_tile`, everything but the attention core (which is blockwise already, or [T x T]
  anyway) runs `seq_tile` tokens at a time, each tile recomputed in the backward: the input norm
  and q/k/v projections before it, the output projection, MLP and residuals after it. A layer's
  working set is then bounded by the tile, not by T x ffn. Same parameters either way.
  """
  cfg: ModelConfig
  implementation: str | None = None
  seq_tile: int | None = None

  def setup(self):
    self.attn_norm = RMSNorm(self.cfg.norm_eps)
    self.attn = Attention(self.cfg, self.implementation)
    self.mlp_norm = RMSNorm(self.cfg.norm_eps)
    self.mlp = MLP(self.cfg)

  def _qkv(self, x_BxTxD, positions_BxT):
    return self.attn.qkv(self.attn_norm(x_BxTxD), positions_BxT)

  def _out(self, x_BxTxD, a_BxTxE):
    h_BxTxD = x_BxTxD + self.attn.o(a_BxTxE)
    return h_BxTxD + self.mlp(self.mlp_norm(h_BxTxD))

  def __call__(self, x_BxTxD, ctx: Ctx | None = None):
    B, T, _ = x_BxTxD.shape
    ctx = Ctx.default(B, T) if ctx is None else ctx
    q, k, v = self._per_token(Block._qkv, x_BxTxD, ctx.positions)
    a_BxTxE = self.attn.core(q, k, v, ctx.segments)
    return self._per_token(Block._out, x_BxTxD, a_BxTxE)

  def _per_token(self, method, *xs_BxT):
    """`method(self, *xs_BxT)`, for a method that treats each token alone, `seq_tile` at a time.

    Each tile runs under jax.checkpoint inside lax.map: differentiated, only the tiles' inputs are
    kept and a tile's intermediates (the MLP's [B, tile, ffn]) are recomputed in its backward, so
    the working set is bounded by the tile, not by T. The tiles apply this block's own params (the
    tree is the untiled one), taken into the loop in fp32 so that their gradient sums over the
    tiles in fp32: bf16 weights get it rounded once, not once per tile (for one fp32 copy of the
    layer's weights). A T that is no multiple of the tile is padded with copies of its last token:
    finite wherever the real tokens are, and their outputs are dropped, so they add exact zeros to
    every gradient.
    """
    B, T = xs_BxT[0].shape[:2]
    tile = self.seq_tile
    if tile is None or T <= tile or self.is_initializing():  # init: the untiled tree, as is
      return method(self, *xs_BxT)
    params = self.variables["params"]
    dtypes = jax.tree.map(lambda p: p.dtype, params)
    template = Block(self.cfg, self.implementation, parent=None)  # unbound: a pure function

    @jax.checkpoint
    def one(params32, xs):
      params = jax.tree.map(lambda p, dtype: p.astype(dtype), params32, dtypes)
      return template.apply({"params": params}, *xs, method=method)

    params32 = jax.tree.map(lambda p: p.astype(jnp.float32), params)
    n = -(-T // tile)
    pad = lambda a: jnp.pad(a, [(0, 0), (0, n * tile - T)] + [(0, 0)] * (a.ndim - 2), mode="edge")
    tiles = tuple(jnp.moveaxis(pad(a).reshape(B, n, tile, *a.shape[2:]), 1, 0) for a in xs_BxT)
    ys = jax.lax.map(lambda xs: one(params32, xs), tiles)
    return jax.tree.map(lambda y: jnp.moveaxis(y, 0, 1).reshape(B, n * tile, *y.shape[3:])[:, :T],
                        ys)


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
