"""Qwen2-VL's, Qwen2.5-VL's and Qwen3-VL's vision towers as layer kinds of the block chain (the
carry and the image slots of mtjax.models.vision):

  vision_embed    (x, ctx.images) -> (x, v): each patch of temporal_patch frames x patch x patch
                  pixels embedded (the checkpoint's Conv3d as one matmul), no bias, no positions
                  (Qwen3-VL: the conv's bias, learned positions resized to the grid, and x
                  becomes (x, zero deepstack features))
  vision (xN)     (x, v) -> (x, v): a pre-norm block attending over each whole image, q and k
                  turned by a 2D rotary embedding (a patch's row on the first half of the
                  frequencies, its column on the second)
  vision_window   the same block attending only within windows of `window` pixels a side
                  (Qwen2.5-VL's blocks outside `full_blocks`)
  vision_deepstack  the whole-image block whose output, through a merger of its own, joins the
                  deepstack features beside x (Qwen3-VL's `deepstack` blocks)
  projector       (x, v) -> x: the merger: a norm, merge x merge neighbouring patches
                  concatenated, two linears with a GELU between, written over the image tokens
                  (Qwen3-VL with deepstack: -> (x, deepstack features), mtjax.models.qwen3_vl)

Images are patches already (what the processor gives, mtjax.data.images.QwenVLImages):
`ctx.images` [B, M, S, C * temporal_patch * patch^2], S = (image_size / patch)^2 patches of each
slot, the patches of one merge window consecutive. Every image of a run is image_size pixels a
side: a fixed grid, so the streamed kinds compile once (other grids are refused where images come
in, mtjax.models.vision.image_inputs).

transformers reorders the patches window by window before the blocks and back after the merger,
and splits attention at the windows' boundaries (cu_window_seqlens). Attention is the same for
any order of its keys, and a window is a whole number of merge windows, so here the patches keep
the processor's order between blocks: a window block gathers its windows for its attention and
puts the patches back (`window_attention`; a grid the windows do not tile masks the whole
image's scores to each window instead). The same outputs, the order local to one block.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from mtjax import attention
from mtjax.config import ModelConfig, VisionConfig
from mtjax.models.layers import Ctx, RMSNorm, VisionKind, apply_rope

TOWERS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
MERGER_EPS = 1e-6  # the merger's norm (transformers fixes it)


def patch_width(v: VisionConfig) -> int:
  """Values of one patch: channels x frames x patch x patch."""
  return v.channels * v.temporal_patch * v.patch ** 2


def group_kinds(cfg: ModelConfig) -> list[tuple[str, VisionKind]]:
  """The tower's (group name, kind) in forward order."""
  v = cfg.vision
  windowed = lambda i: v.window is not None and i not in v.full_blocks
  kind = lambda i: ("vision_window" if windowed(i) else "vision_deepstack" if i in v.deepstack
                    else "vision")
  return ([("vision_embed", VisionKind("vision_embed"))]
          + [(f"vision_block_{i}", VisionKind(kind(i))) for i in range(v.layers)]
          + [("projector", VisionKind("projector"))])


def patch_coords(v: VisionConfig) -> tuple[np.ndarray, np.ndarray]:
  """(row, column) of each patch [S] in the processor's order: merge windows row-major, the
  patches of each row-major within it."""
  side, m = v.patches_per_side, v.merge
  rows, cols = np.meshgrid(np.arange(side), np.arange(side), indexing="ij")
  order = lambda a: a.reshape(side // m, m, side // m, m).transpose(0, 2, 1, 3).reshape(-1)
  return order(rows), order(cols)


def window_ids(v: VisionConfig) -> np.ndarray:
  """The attention window of each patch [S]: windows of window / patch patches a side from the
  image's top left (those at the right and bottom edges smaller where the grid does not divide)."""
  rows, cols = patch_coords(v)
  side = v.window // v.merge // v.patch * v.merge  # patches a side of a window (whole merge windows)
  across = -(-v.patches_per_side // side)
  return (rows // side) * across + cols // side


def window_attention(v: VisionConfig, q_BxSxNxH, k_BxSxNxH, v_BxSxNxH) -> jax.Array:
  """Attention of each patch to the patches of its window, [B, S, N, H]. Windows that tile the
  grid are gathered into a batch of their own (scores per window, W^2 pairs each); otherwise
  (smaller windows at the edges) the whole image's scores are masked to each window."""
  ids = window_ids(v)
  B, S, N, H = q_BxSxNxH.shape
  count = int(ids.max()) + 1
  if S % count or (np.bincount(ids) != S // count).any():
    segments = jnp.broadcast_to(jnp.asarray(ids, jnp.int32)[None], (B, S))
    return attention.dense_attention(q_BxSxNxH, k_BxSxNxH, v_BxSxNxH, causal=False,
                                     segments_q_BxT=segments, segments_k_BxS=segments)
  order = np.argsort(ids, kind="stable")  # window by window
  split = lambda a: a[:, order].reshape(B * count, S // count, N, H)
  o = attention.dense_attention(split(q_BxSxNxH), split(k_BxSxNxH), split(v_BxSxNxH),
                                causal=False)
  return o.reshape(B, S, N, H)[:, np.argsort(order)]


def rotary_tables(v: VisionConfig) -> tuple[jax.Array, jax.Array]:
  """cos and sin [S, Hd / 2] of the tower's 2D rotary embedding: Hd / 4 frequencies turned by a
  patch's row, then the same by its column."""
  dim = v.hidden // v.heads // 2
  inv_freq = 1.0 / (v.rope_theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))
  rows, cols = patch_coords(v)
  angles_SxR2 = jnp.concatenate([jnp.asarray(rows, jnp.float32)[:, None] * inv_freq[None],
                                 jnp.asarray(cols, jnp.float32)[:, None] * inv_freq[None]], -1)
  return jnp.cos(angles_SxR2), jnp.sin(angles_SxR2)


ACTIVATIONS = {"silu": jax.nn.silu, "quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
               "gelu": lambda x: jax.nn.gelu(x, approximate=False),
               "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True)}


def linear(name: str, features: int, dtype=None) -> nn.Dense:
  """A tower linear with a bias: fp32 weights, computing in `dtype`."""
  return nn.Dense(features, name=name, dtype=dtype, param_dtype=jnp.float32,
                  kernel_init=nn.initializers.normal(0.02))


class LayerNorm(nn.Module):
  """Qwen2-VL's LayerNorm with a bias, in fp32 (two-pass variance, as torch)."""
  eps: float

  @nn.compact
  def __call__(self, x):
    D = x.shape[-1]
    scale = self.param("scale", nn.initializers.ones, (D,), jnp.float32)
    bias = self.param("bias", nn.initializers.zeros, (D,), jnp.float32)
    h = x.astype(jnp.float32)
    centred = h - h.mean(-1, keepdims=True)
    normed = centred * jax.lax.rsqrt(jnp.mean(jnp.square(centred), -1, keepdims=True) + self.eps)
    shape = (1,) * (x.ndim - 1) + (D,)
    return (normed * scale.reshape(shape) + bias.reshape(shape)).astype(x.dtype)


def position_taps(v: VisionConfig) -> tuple[np.ndarray, np.ndarray]:
  """Qwen3-VL's learned positions resized to the grid (bilinear, corners aligned, as
  transformers' get_vision_interpolation_indices_and_weights): for each patch [S] in the
  processor's order, 4 rows of the table and their weights, [S, 4] each."""
  side, size = math.isqrt(v.positions), np.float32(v.patches_per_side)

  def axis(index):
    src = index.astype(np.float32) * np.float32(side - 1) / np.maximum(size - 1, np.float32(1))
    floor = np.floor(src)
    taps = np.clip(floor.astype(np.int64)[:, None] + np.arange(2), 0, side - 1)
    weights = np.maximum(1 - np.abs(src[:, None] - floor[:, None] - np.arange(2)), 0)
    return taps, weights.astype(np.float32)

  rows, cols = patch_coords(v)
  (ht, hw), (wt, ww) = axis(rows), axis(cols)
  return ((ht[:, :, None] * side + wt[:, None, :]).reshape(-1, 4),
          (hw[:, :, None] * ww[:, None, :]).reshape(-1, 4))


def _norm(v: VisionConfig, name: str, eps: float):
  """Qwen2.5-VL's RMSNorm, Qwen2-VL's and Qwen3-VL's LayerNorm (with a bias)."""
  return RMSNorm(eps, name=name) if v.tower == "qwen2_5_vl" else LayerNorm(eps, name=name)


class PatchEmbed(nn.Module):
  """Each patch's pixels times the Conv3d kernel [Dv, C, frames, p, p]; Qwen3-VL's adds the
  conv's bias and the learned positions resized to the grid (`position_taps`), and starts its
  deepstack features (zeros, [B, k, M x image_tokens, D]) beside x."""
  v: VisionConfig
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x_BxTxD, ctx: Ctx):
    v = self.v
    kernel = self.param("patch", nn.initializers.normal(0.02),
                        (v.hidden, v.channels, v.temporal_patch, v.patch, v.patch), jnp.float32)
    pix_BxMxSxP = ctx.images.astype(self.dtype)
    h = pix_BxMxSxP @ kernel.reshape(v.hidden, -1).T.astype(self.dtype)
    if v.tower != "qwen3_vl":
      return (x_BxTxD, h), {}
    bias = self.param("patch_bias", nn.initializers.zeros, (v.hidden,), jnp.float32)
    h = h + bias.astype(h.dtype)[None, None, None]
    table = self.param("position", nn.initializers.normal(0.02), (v.positions, v.hidden),
                       jnp.float32)
    taps, weights = position_taps(v)
    pos_SxDv = (table[taps] * jnp.asarray(weights)[..., None]).sum(1)
    h = h + pos_SxDv.astype(h.dtype)[None, None]
    if v.deepstack:
      B = x_BxTxD.shape[0]
      d = jnp.zeros((B, len(v.deepstack), v.max_images * v.image_tokens, x_BxTxD.shape[-1]),
                    x_BxTxD.dtype)
      x_BxTxD = (x_BxTxD, d)
    return (x_BxTxD, h), {}


class Block(nn.Module):
  """A pre-norm block over each image's patches (within windows when `windowed`), the text
  stream passed through. A Qwen3-VL deepstack block (`deepstack`: the model's config) merges its
  output with a merger of its own into the features beside x: the oldest set shifted out of
  the first place (a zero start), the new set in the last, so after the tower they are in
  block order."""
  v: VisionConfig
  windowed: bool = False
  dtype: jnp.dtype = jnp.float32
  deepstack: ModelConfig | None = None

  @nn.compact
  def __call__(self, carry, ctx: Ctx):
    x_BxTxD, h_BxMxSxDv = carry
    v = self.v
    B, M, S, Dv = h_BxMxSxDv.shape
    N, Hd = v.heads, v.hidden // v.heads
    a = _norm(v, "norm1", v.norm_eps)(h_BxMxSxDv).reshape(B * M, S, Dv)
    qkv = linear("qkv", 3 * Dv, dtype=self.dtype)(a).reshape(B * M, S, 3, N, Hd)
    cos, sin = (t[None] for t in rotary_tables(v))
    q, k = apply_rope(qkv[:, :, 0], cos, sin), apply_rope(qkv[:, :, 1], cos, sin)
    o = window_attention(v, q, k, qkv[:, :, 2]) if self.windowed else (
        attention.dense_attention(q, k, qkv[:, :, 2], causal=False))
    o = o.reshape(B, M, S, Dv)
    h = h_BxMxSxDv + linear("proj", Dv, dtype=self.dtype)(o)
    m = _norm(v, "norm2", v.norm_eps)(h)
    if v.tower == "qwen2_5_vl":  # a gated MLP with biases
      gate = linear("gate", v.ffn, dtype=self.dtype)(m)
      m = ACTIVATIONS[v.act](gate) * linear("up", v.ffn, dtype=self.dtype)(m)
      m = linear("down", Dv, dtype=self.dtype)(m)
    else:
      m = linear("fc2", Dv, dtype=self.dtype)(ACTIVATIONS[v.act](linear("fc1", v.ffn, dtype=self.dtype)(m)))
    h = h + m
    if self.deepstack is not None:
      x_BxTxD, d_BxKxFxD = x_BxTxD
      f = Merger(self.deepstack, self.dtype, postshuffle=True, name="deepstack")(h, None)
      d_BxKxFxD = jnp.concatenate([d_BxKxFxD[:, 1:], f[:, None].astype(d_BxKxFxD.dtype)], 1)
      x_BxTxD = (x_BxTxD, d_BxKxFxD)
    return (x_BxTxD, h), {}


class Merger(nn.Module):
  """The patch merger: norm, merge x merge patches concatenated, fc1, GELU, fc2 to model.hidden,
  written over the image tokens' embeddings (`ctx.image_slots`); Qwen3-VL's deepstack features
  beside x pass on to the decoder. `postshuffle`: the norm over the concatenated patches
  (Qwen3-VL's deepstack mergers)."""
  cfg: ModelConfig
  dtype: jnp.dtype = jnp.float32
  postshuffle: bool = False

  @nn.compact
  def __call__(self, carry, ctx: Ctx | None):
    """(x, features) -> x written; a bare features array [B, M, S, Dv] -> its merged features
    [B, M x image_tokens, D] (a deepstack block's merger)."""
    x_BxTxD, h_BxMxSxDv = carry if isinstance(carry, tuple) else (None, carry)
    v = self.cfg.vision
    B, M, S, Dv = h_BxMxSxDv.shape
    U = v.merge ** 2
    if self.postshuffle:
      g = _norm(v, "ln_q", MERGER_EPS)(h_BxMxSxDv.reshape(B, M, S // U, U * Dv))
    else:
      g = _norm(v, "ln_q", MERGER_EPS)(h_BxMxSxDv).reshape(B, M, S // U, U * Dv)
    g = jax.nn.gelu(linear("fc1", U * Dv, dtype=self.dtype)(g), approximate=False)
    f = linear("fc2", self.cfg.hidden, dtype=self.dtype)(g).reshape(B, M * (S // U), -1)
    if x_BxTxD is None:
      return f
    deepstack = None
    if isinstance(x_BxTxD, tuple):
      x_BxTxD, deepstack = x_BxTxD
    feats_BxFxD = f.astype(x_BxTxD.dtype)
    slots_BxT = ctx.image_slots
    taken = jnp.take_along_axis(feats_BxFxD, jnp.maximum(slots_BxT, 0)[..., None], axis=1)
    x_BxTxD = jnp.where((slots_BxT >= 0)[..., None], taken, x_BxTxD)
    return (x_BxTxD if deepstack is None else (x_BxTxD, deepstack)), {}


def module(cfg: ModelConfig, kind: str, dtype=jnp.float32) -> nn.Module:
  """The flax module of a tower layer kind."""
  if kind == "vision_embed":
    return PatchEmbed(cfg.vision, dtype)
  if kind in ("vision", "vision_window", "vision_deepstack"):
    return Block(cfg.vision, kind == "vision_window", dtype,
                 cfg if kind == "vision_deepstack" else None)
  return Merger(cfg, dtype)


def forward_flops(cfg: ModelConfig, kind: str, batch: int) -> float:
  """One tower group's forward FLOPs over `batch` rows (every image slot computed; a window
  block's scores only within its windows)."""
  v = cfg.vision
  images, S, Dv = batch * v.max_images, v.seq, v.hidden
  if kind == "vision_embed":
    return 2.0 * images * S * patch_width(v) * Dv
  U = v.merge ** 2
  merger = 2.0 * images * (S // U) * (U * Dv * U * Dv + U * Dv * cfg.hidden)
  if kind in ("vision", "vision_window", "vision_deepstack"):
    mlp = (3 if v.tower == "qwen2_5_vl" else 2) * Dv * v.ffn
    pairs = S * S
    if kind == "vision_window":
      pairs = int(np.sum(np.bincount(window_ids(v)) ** 2))
    block = images * (2.0 * S * (4 * Dv * Dv + mlp) + 4.0 * pairs * Dv)
    return block + (merger if kind == "vision_deepstack" else 0.0)
  return merger


def params(cfg: ModelConfig) -> int:
  """The tower's parameters by arithmetic: the patch embedding, the blocks (norms, fused qkv,
  projection, MLP, all with biases), the merger."""
  v = cfg.vision
  Dv, F, U = v.hidden, v.ffn, v.merge ** 2
  norm = Dv * (1 if v.tower == "qwen2_5_vl" else 2)
  mlp = 3 * Dv * F + 2 * F + Dv if v.tower == "qwen2_5_vl" else 2 * Dv * F + F + Dv
  block = 2 * norm + 3 * Dv * Dv + 3 * Dv + Dv * Dv + Dv + mlp
  linears = (U * Dv) ** 2 + U * Dv + U * Dv * cfg.hidden + cfg.hidden
  merger = norm + linears
  embed = patch_width(v) * Dv
  if v.tower == "qwen3_vl":  # the conv's bias, learned positions; deepstack mergers (norms of U Dv)
    embed += Dv + v.positions * Dv
    merger += len(v.deepstack) * (2 * U * Dv + linears)
  return embed + v.layers * block + merger


def check_grids(v: VisionConfig, image_grid_thw) -> None:
  """Raises ValueError, in one line, unless every grid is the configured one (1, side, side)."""
  side = v.patches_per_side
  grids = np.asarray(image_grid_thw).reshape(-1, 3)
  bad = [tuple(int(n) for n in g) for g in grids if tuple(g) != (1, side, side)]
  if bad:
    raise ValueError(f"image_grid_thw: grid {bad[0]} (t, h, w); this run's images are "
                     f"{v.image_size} pixels a side, the grid (1, {side}, {side}) "
                     "(model.vision.image_size: every image resized to it)")


def rope_positions(cfg: ModelConfig, input_ids_BxT) -> np.ndarray:
  """M-RoPE positions [B, T, 3] (temporal, height, width) of rows whose images are the
  configured grid, as transformers' get_rope_index: text advances all three; each run of image
  tokens is one image (an image's tokens are consecutive, text between two images). Raises
  ValueError, naming the row, on a run that is not one image's tokens."""
  from mtjax.data.images import mrope_positions  # the data package, not needed to build a model

  ids = np.asarray(input_ids_BxT)
  B, T = ids.shape
  if cfg.vision is None:
    return np.broadcast_to(np.arange(T, dtype=np.int32)[None, :, None], (B, T, 3)).copy()
  v = cfg.vision
  side = v.patches_per_side
  family = cfg.family if cfg.family in TOWERS else "qwen2_vl"
  out = np.zeros((B, T, 3), np.int32)
  for b in range(B):
    types = (ids[b] == v.image_token_id).astype(np.int64)
    runs = int(np.sum(np.diff(np.concatenate([[0], types])) == 1))
    try:
      pos, _ = mrope_positions(types, np.tile([1, side, side], (runs, 1)), family=family,
                               spatial_merge_size=v.merge)
    except ValueError as e:
      raise ValueError(f"row {b}: {e} (each image's {v.image_tokens} tokens one run)") from None
    out[b] = pos.T
  return out

