"""The layer math every family shares: pure Flax modules for the embedding, one decoder block and
the LM head, configured by `ModelConfig`'s fields (norm placement, attention variants, the MLP's
activation, a mixture of experts).

Each module is a stateless template: `Module(...).apply({"params": p}, ...)` is a pure function of
one layer's parameters and its inputs. The streaming engine binds whichever layer's weights just
arrived on the device; nothing here knows about hosts, streams or optimizers. A block returns its
output and a dict of auxiliary sums (empty for a dense block; a mixture of experts' router
statistics, see mtjax.models.moe) that the model's auxiliary loss is computed from.
"""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from mtjax import attention
from mtjax.config import ModelConfig, RopeConfig


@dataclasses.dataclass(frozen=True)
class BlockKind:
  """What distinguishes one layer kind from another: one compiled executable per kind."""
  layer_type: str = "full"  # full attention, a sliding window, chunks, or linear (a gated DeltaNet)
  moe: bool = False  # a mixture-of-experts feed-forward instead of the dense MLP
  rope: bool = True  # the attention rotates q and k (False: NoPE)
  deepstack: int = 0  # Qwen3-VL's deepstack feature sets its input carries beside x; it adds the first to the image tokens

  @property
  def name(self) -> str:
    return ("block" + ("" if self.layer_type == "full" else f"_{self.layer_type}")
            + ("" if self.rope else "_nope") + ("_moe" if self.moe else "")
            + (f"_deepstack{self.deepstack}" if self.deepstack else ""))


@dataclasses.dataclass(frozen=True)
class VisionKind:
  """A tower layer kind; reads like a BlockKind where the rest of mtjax asks one (no experts, no
  RoPE, no decoder attention)."""
  name: str
  layer_type: str = "vision"
  moe: bool = False
  rope: bool = False
  deepstack: int = 0  # always 0, read where a BlockKind's is (a tower kind's carry follows the config)


def block_kind(cfg: ModelConfig, i: int) -> BlockKind:
  k = len(cfg.vision.deepstack) if cfg.vision is not None else 0
  return BlockKind(cfg.layer_type(i), cfg.is_moe_layer(i), cfg.uses_rope(i), max(k - i, 0))


# ---------------------------------------------------------------------------------------- RoPE


def rope_inv_freq(cfg: ModelConfig, layer_type: str = "full", long: bool = False
                  ) -> tuple[jax.Array, float]:
  """Per-pair rotation frequencies of the RoPE channels and the factor cos/sin are scaled by.

  Sliding layers with `rope.local_theta` (Gemma 3) rotate by that base, unscaled. `longrope`
  takes its long factors when `long` (see `rope_tables`).
  """
  r = cfg.rope
  dim = cfg.rotary_dim
  theta, scaling = r.theta, r.scaling
  if layer_type == "sliding" and r.local_theta is not None:
    theta, scaling = r.local_theta, "none"
  exponent = jnp.arange(0, dim, 2, dtype=jnp.float32) / dim
  inv_freq = 1.0 / (theta ** exponent)
  factor = 1.0
  if scaling == "linear":
    inv_freq = inv_freq / r.factor
  elif scaling == "llama3":
    low_wavelen = r.original_max_len / r.low_freq_factor
    high_wavelen = r.original_max_len / r.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelen > low_wavelen, inv_freq / r.factor, inv_freq)
    smooth = ((r.original_max_len / wavelen - r.low_freq_factor)
              / (r.high_freq_factor - r.low_freq_factor))
    smoothed = (1 - smooth) * scaled / r.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    inv_freq = jnp.where(medium, smoothed, scaled)
  elif scaling == "longrope":
    ext = jnp.asarray(r.long_factor if long else r.short_factor, jnp.float32)
    inv_freq = 1.0 / (ext * theta ** exponent)
    f = r.factor
    factor = 1.0 if f <= 1 else math.sqrt(1 + math.log(f) / math.log(r.original_max_len))
  elif scaling == "yarn":
    inv_freq, factor = _yarn(r, theta, dim)
  if scaling != "none" and r.attention_factor is not None:
    factor = r.attention_factor
  return inv_freq, factor


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
  """YaRN's attention temperature: 0.1 * mscale * ln(scale) + 1 (1 for scale <= 1)."""
  return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(r: RopeConfig, theta: float, dim: int) -> tuple[jax.Array, float]:
  """YaRN: interpolated low frequencies, extrapolated high ones, a linear ramp between."""
  f, orig = r.factor, r.original_max_len
  if r.mscale and r.mscale_all_dim:
    factor = yarn_mscale(f, r.mscale) / yarn_mscale(f, r.mscale_all_dim)
  else:
    factor = yarn_mscale(f)

  def correction_dim(rotations):
    return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

  low, high = correction_dim(r.beta_fast), correction_dim(r.beta_slow)
  if r.truncate:
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, dim - 1)
  if low == high:
    high += 0.001  # as transformers: no zero-width ramp
  ramp = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
  pos_freqs = theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim)
  extrapolated = 1.0 - ramp
  inv_freq = (1.0 / (f * pos_freqs)) * (1 - extrapolated) + (1.0 / pos_freqs) * extrapolated
  return inv_freq, factor


def mrope_streams(r) -> np.ndarray:
  """The position stream (0 temporal, 1 height, 2 width) each frequency of M-RoPE turns by:
  consecutive sections, or interleaved (transformers' Qwen3-VL recomposition_frequencies)."""
  if not r.mrope_interleaved:
    return np.repeat(np.arange(3), r.mrope_section)
  j = np.arange(sum(r.mrope_section))
  out = np.zeros_like(j)
  for stream in (1, 2):
    out[(j % 3 == stream) & (j < 3 * r.mrope_section[stream])] = stream
  return out


def rope_tables(cfg: ModelConfig, positions_BxT: jax.Array, layer_type: str = "full"
                ) -> tuple[jax.Array, jax.Array]:
  """cos and sin of position x frequency, [B, T, R/2] fp32, scaled by the rule's factor.

  Per-token inputs of the q/k projections, computed once per sequence (not per tile).
  `longrope` takes its long factors when the longest position exceeds the pre-training length,
  as transformers decides per batch. With `rope.mrope_section` (M-RoPE) positions may be
  [B, T, 3] (temporal, height, width): each frequency turns by the position of its section's
  stream; [B, T] positions turn all three alike, which is plain RoPE.
  """
  r = cfg.rope
  inv_freq, factor = rope_inv_freq(cfg, layer_type)
  if r.scaling == "longrope" and not (layer_type == "sliding" and r.local_theta):
    long = jnp.max(positions_BxT) + 1 > r.original_max_len
    inv_freq = jnp.where(long, rope_inv_freq(cfg, layer_type, long=True)[0], inv_freq)
  if positions_BxT.ndim == 3:  # M-RoPE: frequency j takes the stream its section names
    stream_R2 = mrope_streams(r)
    positions_BxTxR2 = positions_BxT.astype(jnp.float32)[..., stream_R2]
    angles_BxTxR2 = positions_BxTxR2 * inv_freq[None, None, :]
  else:
    angles_BxTxR2 = positions_BxT.astype(jnp.float32)[..., None] * inv_freq[None, None, :]
  return jnp.cos(angles_BxTxR2) * factor, jnp.sin(angles_BxTxR2) * factor


def apply_rope(x_BxTxNxH: jax.Array, cos_BxTxR2: jax.Array, sin_BxTxR2: jax.Array,
               interleaved: bool = False) -> jax.Array:
  """Rotates the first R channels (R/2 the tables' width) by the tables (fp32); the rest pass.

  Pairs are (i, i + R/2) of the R rotated channels, as transformers' rotate_half; `interleaved`
  pairs (2i, 2i + 1) instead (DeepSeek's checkpoints, GLM-4).
  """
  R = 2 * cos_BxTxR2.shape[-1]
  cos, sin = cos_BxTxR2[:, :, None, :], sin_BxTxR2[:, :, None, :]
  x = x_BxTxNxH.astype(jnp.float32)
  rot, rest = x[..., :R], x[..., R:]
  if interleaved:  # (2i, 2i+1) pairs: de-interleave, rotate as halves, interleave back
    x1, x2 = rot[..., 0::2], rot[..., 1::2]
    y1, y2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    rot = jnp.stack([y1, y2], axis=-1).reshape(rot.shape)
  else:
    x1, x2 = jnp.split(rot, 2, axis=-1)
    rot = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  out = jnp.concatenate([rot, rest], axis=-1) if R < x.shape[-1] else rot
  return out.astype(x_BxTxNxH.dtype)


# ---------------------------------------------------------------------------------------- pieces


@flax.struct.dataclass
class Ctx:
  """Per-token context every layer is called with, beside its weights and activations.

  `positions` feed RoPE (packed documents restart at 0); `segments` keep attention inside a
  document (None: each row is one document). The per-token loss weights live with the head's
  targets, not here: blocks never see them.
  """
  positions: jax.Array  # [B, T] int32; [B, T, 3] (temporal, height, width) under M-RoPE
  segments: jax.Array | None = None  # [B, T] int32 document ids, or None
  images: jax.Array | None = None  # [B, M, C, H, W] pixels of each row's image slots (model.vision)
  image_slots: jax.Array | None = None  # [B, T] int32 the image feature each position takes, -1: none

  @classmethod
  def default(cls, B: int, T: int) -> "Ctx":
    return cls(jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None, :], (B, T)))


def layer_segments(cfg: ModelConfig, layer_type: str, ctx: Ctx) -> jax.Array | None:
  """The ids a layer's attention keeps to: the documents, and in a chunked layer each
  document's chunks of `attention_chunk` positions (mtjax.attention.chunk_segments)."""
  if layer_type != "chunked":
    return ctx.segments
  return attention.chunk_segments(ctx.positions, cfg.attention_chunk, ctx.segments)


def add_at_image_slots(x_BxTxD, f_BxFxD, slots_BxT):
  """x plus each image token's feature (`slots_BxT`: its index among f's, -1 for text)."""
  taken = jnp.take_along_axis(f_BxFxD.astype(x_BxTxD.dtype), jnp.maximum(slots_BxT, 0)[..., None],
                              axis=1)
  return x_BxTxD + jnp.where((slots_BxT >= 0)[..., None], taken, jnp.zeros_like(taken))


def image_groups(cfg: ModelConfig, ctx: Ctx) -> jax.Array | None:
  """[B, T] int32 ids of the image blocks a decoder's attention lets see each other whole
  (`model.vision.image_attention` bidirectional): each contiguous run of image tokens
  (ctx.image_slots >= 0) one id, numbered along the row, -1 for text, as transformers' Gemma 3
  builds its block mask from token_type_ids (two images with no token between them are one
  block). None where the model's image tokens attend causally."""
  if cfg.vision is None or cfg.vision.image_attention == "causal" or ctx.image_slots is None:
    return None
  image_BxT = ctx.image_slots >= 0
  start_BxT = image_BxT & ~jnp.pad(image_BxT, ((0, 0), (1, 0)))[:, :-1]
  return jnp.where(image_BxT, jnp.cumsum(start_BxT, axis=1, dtype=jnp.int32) - 1, -1)


class RMSNorm(nn.Module):
  """RMSNorm over the last axis in fp32; with `offset` the weight w scales by (1 + w) (Gemma)."""
  eps: float
  offset: bool = False

  @nn.compact
  def __call__(self, x):
    init = nn.initializers.zeros if self.offset else nn.initializers.ones
    scale = self.param("scale", init, (x.shape[-1],), jnp.float32)
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    shape = (1,) * (x.ndim - 1) + (-1,)
    if self.offset:  # Gemma multiplies in fp32 and casts once
      return (normed * (1.0 + scale.reshape(shape))).astype(x.dtype)
    return normed.astype(x.dtype) * scale.astype(x.dtype).reshape(shape)


class LayerNorm(nn.Module):
  """LayerNorm over the last axis in fp32 without a bias (Cohere): the mean subtracted, the
  weight multiplied in fp32 and the product cast once. `weight_axes` 2 gives each head a weight of
  its own ([N, H]: Cohere's q/k norms), the statistics still over the last axis alone."""
  eps: float
  weight_axes: int = 1

  @nn.compact
  def __call__(self, x):
    scale = self.param("scale", nn.initializers.ones, x.shape[-self.weight_axes:], jnp.float32)
    x32 = x.astype(jnp.float32)
    centred = x32 - jnp.mean(x32, axis=-1, keepdims=True)
    normed = centred * jax.lax.rsqrt(jnp.mean(centred * centred, axis=-1, keepdims=True) + self.eps)
    return (normed * scale.reshape((1,) * (x.ndim - self.weight_axes) + scale.shape)).astype(x.dtype)


def norm_layer(cfg: ModelConfig, name: str | None = None, weight_axes: int = 1) -> nn.Module:
  """The config's norm: RMSNorm (`norm_offset`: Gemma's 1 + w), or LayerNorm (`norm_kind`)."""
  if cfg.norm_kind == "layer":
    return LayerNorm(cfg.norm_eps, weight_axes, name=name)
  return RMSNorm(cfg.norm_eps, cfg.norm_offset, name=name)


def l2_norm(x, eps: float):
  """RMS normalisation without a weight in fp32 (Llama 4's q/k norm)."""
  x32 = x.astype(jnp.float32)
  return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def nope_temperature(cfg: ModelConfig, positions_BxT: jax.Array) -> jax.Array:
  """Llama 4's query scale in NoPE layers, [B, T, 1, 1] fp32: log(floor((p + 1) / floor) + 1)
  * scale + 1 (positions count from each document's start)."""
  p = positions_BxT.astype(jnp.float32)
  t = jnp.log1p(jnp.floor((p + 1.0) / cfg.temperature_floor)) * cfg.temperature_scale + 1.0
  return t[:, :, None, None]


def dense(features, name=None, bias=False):
  return nn.Dense(features, use_bias=bias, name=name, param_dtype=jnp.float32)


def softcap(x, cap: float | None):
  return x if cap is None else jnp.tanh(x / cap) * cap


# Packed rows up to this many tokens take cuDNN's kernel with their documents as a mask (the
# mask's bias is B x T x T bf16: 64 MiB at 8 x 2048); longer ones the blockwise kernel.
CUDNN_MASK_MAX_SEQ = 4096
# From this sequence length on, `auto` takes the blockwise attention over XLA's where cuDNN's does
# not apply: XLA's [T x T] scores (and their gradient) outgrow a layer's other activations.
BLOCKWISE_FROM_SEQ = 4096


def choose_attention(choice: str, platform: str, capability: float, compute_dtype: str,
                     widths: tuple[int, int, int], seq: int = 0) -> str:
  """The attention kernel of `engine.attention` (`auto` resolved) for a device and model.

  `auto` takes cuDNN's fused (flash) attention on a GPU in bf16 for head widths it supports: up to
  128, and 256 on Hopper (compute capability 9.0) and later, where its forward and backward run
  at 0.86 of the 128-wide rate and 4.9x XLA's (benchmarks/attention_kernels.py, H100);
  elsewhere the blockwise kernel (mtjax.attention) from BLOCKWISE_FROM_SEQ tokens, XLA's below.

  Args:
    widths: (query heads, query/key width, value width) per head (`spec.attention_widths`).
  """
  if choice != "auto":
    return choice
  _, hd, hv = widths
  widest = 256 if capability >= 9.0 else 128
  # a value width of its own (MLA) through jax's cuDNN call, which needs Hopper's cuDNN
  widths_ok = hd % 8 == 0 and hv % 8 == 0 and max(hd, hv) <= widest and (hd == hv or capability >= 9.0)
  if platform == "gpu" and compute_dtype == "bfloat16" and widths_ok:
    return "cudnn"
  return "blockwise" if seq >= BLOCKWISE_FROM_SEQ else "xla"


def layer_kernel(implementation: str, *, seq: int, packed: bool, softcap: bool = False,
                 sinks: bool = False, same_widths: bool = True, groups: bool = False) -> str:
  """The kernel one layer's attention runs: `implementation`, except that cuDNN's fused kernel
  takes no logit cap, nor a document mask beyond CUDNN_MASK_MAX_SEQ tokens or beside sinks or a
  value width of its own: those layers run the blockwise kernel. `cudnn-mask` is cuDNN's kernel
  with the documents as a mask. Sinks (over the kernel's log-sum-exp) and a value width of its
  own (MLA) take cuDNN through jax's cuDNN call (mtjax.attention.cudnn_attention): at 8k tokens
  on an H100 0.97 and 1.00 of cuDNN's plain causal rate, where the blockwise kernel ran 0.10
  and 0.13 (docs/performance.md, the attention table). Image groups (causal OR the same image)
  are no mask cuDNN's causal kernel takes: those layers run the blockwise kernel."""
  if implementation != "cudnn":
    return implementation
  if softcap or groups or (packed and (seq > CUDNN_MASK_MAX_SEQ or sinks or not same_widths)):
    return "blockwise"
  return "cudnn-mask" if packed else "cudnn"


def fused_attention(q_BxTxNxH, k_BxSxKxH, v_BxSxKxV, segments_BxT=None, *,
                    window: int | None = None, scale: float | None = None,
                    implementation: str = "cudnn"):
  """Causal attention by jax.nn.dot_product_attention (cuDNN's fused kernel on the GPU; its XLA
  form elsewhere, which tests compare): documents as a [B, 1, T, T] mask, a window of `window`
  keys up to and including the query's own."""
  local = None if window is None else (window - 1, 0)
  mask = (None if segments_BxT is None
          else segments_BxT[:, None, :, None] == segments_BxT[:, None, None, :])
  return jax.nn.dot_product_attention(q_BxTxNxH, k_BxSxKxH, v_BxSxKxV, mask=mask, is_causal=True,
                                      scale=scale, local_window_size=local,
                                      implementation=implementation)


def attend(q_BxTxNxH, k_BxSxKxH, v_BxSxKxV, segments_BxT, *, implementation: str | None,
           window: int | None = None, softcap_: float | None = None, scale: float | None = None,
           sinks_N=None, groups_BxT=None):
  """Causal attention over the sequence with the layer's options, by the chosen kernel.

  cuDNN's fused kernel takes a causal window, packed documents as a [B, 1, T, T] mask up to
  CUDNN_MASK_MAX_SEQ tokens, sinks and a value width of its own (not beside documents); it takes
  no logit cap and no image groups (`groups_BxT`, `image_groups`): those layers (and longer
  packed rows) go to the blockwise kernel, which takes them all and never builds a [T x T]
  tensor. `xla` computes the scores whole (short sequences, the CPU).
  """
  impl = layer_kernel(implementation, seq=q_BxTxNxH.shape[1], packed=segments_BxT is not None,
                      softcap=softcap_ is not None, sinks=sinks_N is not None,
                      same_widths=v_BxSxKxV.shape[-1] == q_BxTxNxH.shape[-1],
                      groups=groups_BxT is not None)
  if impl == "cudnn" and (sinks_N is not None or v_BxSxKxV.shape[-1] != q_BxTxNxH.shape[-1]):
    scale = 1.0 / math.sqrt(q_BxTxNxH.shape[-1]) if scale is None else scale
    return attention.cudnn_attention(q_BxTxNxH, k_BxSxKxH, v_BxSxKxV, scale=scale, window=window,
                                     sinks_N=sinks_N)
  if impl in ("cudnn", "cudnn-mask"):
    return fused_attention(q_BxTxNxH, k_BxSxKxH, v_BxSxKxV, segments_BxT, window=window,
                           scale=scale)
  kw = dict(segments_q_BxT=segments_BxT, segments_k_BxS=segments_BxT, causal=True, scale=scale,
            window=window, softcap=softcap_, sinks_N=sinks_N, groups_BxT=groups_BxT)
  if impl == "blockwise":
    return attention.blockwise_attention(q_BxTxNxH, k_BxSxKxH, v_BxSxKxV, **kw)
  return attention.dense_attention(q_BxTxNxH, k_BxSxKxH, v_BxSxKxV, **kw)


class Attention(nn.Module):
  """Causal GQA attention with RoPE, in per-token (`qkv`, `out`) and sequence (`core`) parts.

  Options from the config: q/k/v (and o) biases, q/k norms per head (a weight per head or one for
  all) or over the whole projection, or without a weight after RoPE, a sliding window for sliding
  layers, logit soft-capping, a logit scale, attention sinks, no rotary embedding (NoPE layers),
  with a query temperature by position there, an output gate (q_proj's outputs are, per head, its
  query then its gate).
  """
  cfg: ModelConfig
  layer_type: str = "full"
  implementation: str | None = None
  rotary: bool = True  # False: NoPE, q and k keep their positions' information out

  def setup(self):
    cfg = self.cfg
    H, K, hd = cfg.heads, cfg.n_kv_heads, cfg.dim_per_head
    self.q = dense(H * hd * (2 if cfg.attn_output_gate else 1), bias=cfg.qkv_bias)
    self.k = dense(K * hd, bias=cfg.qkv_bias)
    self.v = dense(K * hd, bias=cfg.qkv_bias)
    self.o = dense(cfg.hidden, bias=cfg.o_bias)
    if cfg.qk_norm:
      axes = 2 if cfg.qk_norm_scope == "each_head" else 1
      self.q_norm, self.k_norm = norm_layer(cfg, weight_axes=axes), norm_layer(cfg, weight_axes=axes)
    if cfg.attention_sinks:
      self.sinks = self.param("sinks", nn.initializers.zeros, (H,), jnp.float32)

  def rope(self, positions_BxT):
    """This layer's per-token tables: RoPE's cos and sin (`rope_tables`); in a NoPE layer the
    query temperature (`nope_temperature`) or nothing."""
    if not self.rotary:
      return () if self.cfg.temperature_floor is None else (nope_temperature(self.cfg,
                                                                             positions_BxT),)
    return rope_tables(self.cfg, positions_BxT, self.layer_type)

  def qkv(self, x_BxTxD, *tables):
    """Queries, keys and values with RoPE applied (and the output gate [B, T, N * H] with
    `attn_output_gate`); each token's from its own input alone."""
    cfg = self.cfg
    B, T, _ = x_BxTxD.shape
    H, K, hd = cfg.heads, cfg.n_kv_heads, cfg.dim_per_head
    q, k, v = self.q(x_BxTxD), self.k(x_BxTxD), self.v(x_BxTxD)
    gate = ()
    if cfg.attn_output_gate:
      q_and_gate = q.reshape(B, T, H, 2 * hd)
      q, gate = q_and_gate[..., :hd], (q_and_gate[..., hd:].reshape(B, T, H * hd),)
    if cfg.qk_norm and cfg.qk_norm_scope == "all":  # OLMo 2: over the whole projection
      q, k = self.q_norm(q), self.k_norm(k)
    q, k, v = q.reshape(B, T, H, hd), k.reshape(B, T, K, hd), v.reshape(B, T, K, hd)
    if cfg.qk_norm and cfg.qk_norm_scope != "all":
      q, k = self.q_norm(q), self.k_norm(k)
    if not self.rotary:
      if tables:  # the temperature
        q = (q * tables[0]).astype(q.dtype)
      return (q, k, v, *gate)
    interleaved = cfg.rope.interleave
    q, k = apply_rope(q, *tables, interleaved), apply_rope(k, *tables, interleaved)
    if cfg.qk_l2_norm:
      q, k = l2_norm(q, cfg.norm_eps), l2_norm(k, cfg.norm_eps)
    return (q, k, v, *gate)

  def scoring(self) -> dict:
    """How this layer scores keys: `attend`'s window, softcap_, scale and sinks_N (the one place
    they are chosen, for the sequence core and for a KV cache's attention alike)."""
    cfg = self.cfg
    return dict(window=cfg.sliding_window if self.layer_type == "sliding" else None,
                softcap_=cfg.attn_softcap, scale=cfg.query_scale,
                sinks_N=self.sinks if cfg.attention_sinks else None)

  def core(self, qkv, segments_BxT, groups_BxT=None):
    """Attention over the sequence of `qkv`'s queries, keys and values (gated by its gate):
    [B, T, N * H], before the output projection; `groups_BxT` the image groups (`image_groups`)."""
    q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, *gate = qkv
    B, T = q_BxTxNxH.shape[:2]
    out = attend(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, segments_BxT,
                 implementation=self.implementation, groups_BxT=groups_BxT, **self.scoring())
    out = out.reshape(B, T, -1)
    return out * jax.nn.sigmoid(gate[0]).astype(out.dtype) if gate else out

  def out(self, a_BxTxE):
    return self.o(a_BxTxE)

  def __call__(self, x_BxTxD, ctx: Ctx | None = None):
    B, T, _ = x_BxTxD.shape
    ctx = Ctx.default(B, T) if ctx is None else ctx
    return self.out(self.core(self.qkv(x_BxTxD, *self.rope(ctx.positions)),
                              layer_segments(self.cfg, self.layer_type, ctx),
                              image_groups(self.cfg, ctx)))


def activate(cfg: ModelConfig, gate, up):
  """The gated MLP's activation: silu(gate) * up, gelu_tanh(gate) * up, or GPT-OSS's clamped
  SwiGLU (gate capped above, up within +-limit, gate * sigmoid(alpha * gate) * (up + 1))."""
  if cfg.mlp_act == "silu":
    return nn.silu(gate) * up
  if cfg.mlp_act == "gelu_tanh":
    return nn.gelu(gate, approximate=True) * up
  limit = cfg.swiglu_limit
  gate = jnp.minimum(gate, limit)
  up = jnp.clip(up, -limit, limit)
  return gate * jax.nn.sigmoid(gate * cfg.swiglu_alpha) * (up + 1)


class MLP(nn.Module):
  """The gated MLP: down(act(gate(x)) * up(x))."""
  cfg: ModelConfig
  width: int

  @nn.compact
  def __call__(self, x):
    bias = self.cfg.mlp_bias
    gate = dense(self.width, "gate", bias)(x)
    up = dense(self.width, "up", bias)(x)
    return dense(self.cfg.hidden, "down", bias)(activate(self.cfg, gate, up))


class Embed(nn.Module):
  """The token embedding; Gemma scales it by sqrt(hidden) rounded to the activations' dtype,
  Granite by its embedding multiplier."""
  cfg: ModelConfig
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, tokens_BxT):
    table = self.param("table", nn.initializers.normal(self.cfg.init_std),
                       (self.cfg.vocab_size, self.cfg.hidden), jnp.float32)
    x = jnp.take(table.astype(self.dtype), tokens_BxT, axis=0)
    if self.cfg.pad_token_id is not None:  # its row gets no gradient (transformers' padding_idx)
      pad = (tokens_BxT == self.cfg.pad_token_id)[..., None]
      x = jnp.where(pad, jax.lax.stop_gradient(x), x)
    if self.cfg.embed_scale:  # Gemma rounds its normaliser to the activations' dtype
      x = x * jnp.asarray(math.sqrt(self.cfg.hidden), self.dtype)
    if self.cfg.embed_multiplier != 1.0:  # Granite: in fp32, rounded once
      x = (x.astype(jnp.float32) * self.cfg.embed_multiplier).astype(self.dtype)
    return x

  @property
  def scale(self) -> float:
    """What the embedding is multiplied by (the backward's factor)."""
    return (math.sqrt(self.cfg.hidden) if self.cfg.embed_scale else 1.0) * self.cfg.embed_multiplier


class Head(nn.Module):
  """Final norm and the LM head (logits scaled by `logit_scale`, divided by `logits_divisor`,
  soft-capped where the config says); with tied embeddings the caller passes the embedding table."""
  cfg: ModelConfig

  def setup(self):
    self.norm = norm_layer(self.cfg, name="norm")
    if not self.cfg.tie_embeddings:
      self.out = self.param("out", nn.initializers.normal(self.cfg.init_std),
                            (self.cfg.hidden, self.cfg.vocab_size), jnp.float32)

  def normalize(self, h):
    return self.norm(h)

  def logits(self, hn_NxD, table_VxD=None):
    w_DxV = table_VxD.T if self.cfg.tie_embeddings else self.out
    logits = hn_NxD @ w_DxV.astype(hn_NxD.dtype)
    if self.cfg.logit_scale != 1.0:
      logits = logits * jnp.asarray(self.cfg.logit_scale, logits.dtype)
    if self.cfg.logits_divisor != 1.0:  # Granite's logits_scaling, in fp32 as the loss is
      logits = logits.astype(jnp.float32) / self.cfg.logits_divisor
    if self.cfg.final_softcap is None:
      return logits
    return softcap(logits.astype(jnp.float32), self.cfg.final_softcap)

  def __call__(self, h, table_VxD=None):
    return self.logits(self.normalize(h), table_VxD)


def token_nll(logits_NxV: jax.Array, targets_N: jax.Array) -> jax.Array:
  """Cross-entropy per token, computed in fp32."""
  logits = logits_NxV.astype(jnp.float32)
  lse = jax.nn.logsumexp(logits, axis=-1)
  picked = jnp.take_along_axis(logits, targets_N[:, None], axis=-1)[:, 0]
  return lse - picked
