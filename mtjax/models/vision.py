"""A vision tower as layer kinds of the block chain: its groups stream and are placed like decoder
blocks.

A model with `model.vision` runs, after the token embedding,

  vision_embed   (x, ctx.images) -> (x, v): each image's patches embedded (a patch-sized conv as
                 one matmul), CLIP's class token, position embeddings, CLIP's pre-norm
  vision (xN)    (x, v) -> (x, v): a pre-norm ViT encoder block (bidirectional attention within
                 each image, an MLP), the text stream `x` passed through untouched
  projector      (x, v) -> x: the features projected to model.hidden (LLaVA's two linears, or
                 Gemma 3's average pool, RMSNorm and matrix) and written over the image tokens'
                 embeddings (`ctx.image_slots`)

then the decoder blocks and the head. The carry is a pair while the tower runs, so the engine's
forward, saved inputs and per-layer vjp treat it as they treat `x`; the pass-through's cotangent
flows back to the embedding unchanged. (Qwen3-VL's deepstack features ride in the text stream's
place as (x, features) from the tower's embedding to the decoder layers that add them:
`carry`.)

Images are `ctx.images` [B, M, C, H, W] (M = model.vision.max_images slots a row; unused slots
are zeros and their features are never read); `ctx.image_slots` [B, T] gives each position the
index of the feature it takes among its row's M x image_tokens, or -1 for a text token.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from mtjax import attention
from mtjax.config import ModelConfig, VisionConfig
from mtjax.models import qwen_vision
from mtjax.models.layers import Ctx, RMSNorm, VisionKind

# the towers' layer kinds, in forward order (vision_window, vision_deepstack:
# mtjax.models.qwen_vision's)
KINDS = ("vision_embed", "vision", "vision_window", "vision_deepstack", "projector")


def group_kinds(cfg: ModelConfig) -> list[tuple[str, VisionKind]]:
  """The tower's (group name, kind) in forward order; none without model.vision."""
  v = cfg.vision
  if v is None:
    return []
  if _qwen(v):
    return qwen_vision.group_kinds(cfg)
  return ([("vision_embed", VisionKind("vision_embed"))]
          + [(f"vision_block_{i}", VisionKind("vision")) for i in range(v.layers)]
          + [("projector", VisionKind("projector"))])


def _act(name: str):
  return {"quick_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
          "gelu": lambda x: jax.nn.gelu(x, approximate=False),
          "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
          "silu": jax.nn.silu}[name]


def _linear(name: str, features: int, bias: bool = True, dtype=None):
  return nn.Dense(features, use_bias=bias, name=name, dtype=dtype, param_dtype=jnp.float32,
                  kernel_init=nn.initializers.normal(0.02))


class _LayerNorm(nn.Module):
  """LayerNorm with a bias, in fp32."""
  eps: float

  @nn.compact
  def __call__(self, x):
    D = x.shape[-1]
    scale = self.param("scale", nn.initializers.ones, (D,), jnp.float32)
    bias = self.param("bias", nn.initializers.zeros, (D,), jnp.float32)
    h = x.astype(jnp.float32)
    mean = h.mean(-1, keepdims=True)
    var = jnp.mean(jnp.square(h - mean), -1, keepdims=True)
    shape = (1,) * (x.ndim - 1) + (D,)
    return ((h - mean) * jax.lax.rsqrt(var + self.eps) * scale.reshape(shape)
            + bias.reshape(shape)).astype(x.dtype)


def patches(images_BxMxCxHxW: jax.Array, p: int) -> jax.Array:
  """[B, M, C, H, W] -> [B, M, (H/p)(W/p), C p p]: row-major patches, each flattened as a conv
  kernel [C, p, p] is."""
  B, M, C, H, W = images_BxMxCxHxW.shape
  x = images_BxMxCxHxW.reshape(B, M, C, H // p, p, W // p, p)
  x = x.transpose(0, 1, 3, 5, 2, 4, 6)
  return x.reshape(B, M, (H // p) * (W // p), C * p * p)


class VisionEmbed(nn.Module):
  """Patch embedding (a conv of stride patch as one matmul), class token, positions, pre-norm."""
  v: VisionConfig
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, x_BxTxD, ctx: Ctx):
    v = self.v
    clip = v.tower == "clip"
    pix = patches(ctx.images.astype(self.dtype), v.patch)
    # the conv's kernel as checkpoints store it, [Dv, C, p, p]: one matmul over each patch
    kernel = self.param("patch", nn.initializers.normal(0.02),
                        (v.hidden, v.channels, v.patch, v.patch), jnp.float32)
    h = pix @ kernel.reshape(v.hidden, -1).T.astype(self.dtype)  # [B, M, P, Dv]
    if not clip:
      h = h + self.param("patch_bias", nn.initializers.zeros, (v.hidden,),
                         jnp.float32).astype(self.dtype)[None, None, None]
    B, M = h.shape[:2]
    if clip:
      cls = self.param("cls", nn.initializers.normal(0.02), (v.hidden,), jnp.float32)
      h = jnp.concatenate([jnp.broadcast_to(cls.astype(h.dtype), (B, M, 1, v.hidden)), h], 2)
    pos = self.param("position", nn.initializers.normal(0.02), (v.seq, v.hidden), jnp.float32)
    h = h + pos.astype(h.dtype)[None, None]
    if clip:
      h = _LayerNorm(v.norm_eps, name="pre_norm")(h)
    return (x_BxTxD, h), {}


class VisionBlock(nn.Module):
  """A pre-norm ViT encoder block over each image's tokens (no mask), the text stream passed."""
  v: VisionConfig
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, carry, ctx: Ctx):
    x_BxTxD, h_BxMxSxDv = carry
    v = self.v
    B, M, S, Dv = h_BxMxSxDv.shape
    N, Hd = v.heads, v.hidden // v.heads
    a = _LayerNorm(v.norm_eps, name="norm1")(h_BxMxSxDv).reshape(B * M, S, Dv)
    q, k, val = (_linear(n, Dv, dtype=self.dtype)(a).reshape(B * M, S, N, Hd)
                 for n in ("q", "k", "v"))
    o = attention.dense_attention(q, k, val, causal=False).reshape(B, M, S, Dv)
    h = h_BxMxSxDv + _linear("o", Dv, dtype=self.dtype)(o)
    m = _LayerNorm(v.norm_eps, name="norm2")(h)
    m = _linear("fc2", Dv, dtype=self.dtype)(_act(v.act)(_linear("fc1", v.ffn, dtype=self.dtype)(m)))
    return (x_BxTxD, h + m), {}


class Projector(nn.Module):
  """Image features to model.hidden, written over the image tokens' embeddings."""
  cfg: ModelConfig
  dtype: jnp.dtype = jnp.float32

  @nn.compact
  def __call__(self, carry, ctx: Ctx):
    x_BxTxD, h_BxMxSxDv = carry
    cfg, v = self.cfg, self.cfg.vision
    if v.tower == "clip" and v.drop_cls:
      h_BxMxSxDv = h_BxMxSxDv[:, :, 1:]
    if v.tower == "siglip":
      h_BxMxSxDv = _LayerNorm(v.norm_eps, name="post_norm")(h_BxMxSxDv)
    if v.projector == "mlp":
      f = _linear("fc1", cfg.hidden, v.projector_bias, self.dtype)(h_BxMxSxDv)
      f = _linear("fc2", cfg.hidden, v.projector_bias, self.dtype)(_act(v.projector_act)(f))
    else:  # Gemma 3: average pool of each image's patch grid, soft-embedding norm, one matrix
      B, M, S, Dv = h_BxMxSxDv.shape
      side, out = v.patches_per_side, math.isqrt(v.image_tokens)
      k = side // out
      g = h_BxMxSxDv.astype(jnp.float32).reshape(B, M, out, k, out, k, Dv).mean((3, 5))
      # Gemma 3's mm_soft_emb_norm: over the tower's width with the tower's epsilon
      g = RMSNorm(v.norm_eps, offset=True, name="norm")(g.reshape(B, M, out * out, Dv))
      f = _linear("proj", cfg.hidden, False, self.dtype)(g.astype(self.dtype))
    B, M, P, D = f.shape
    feats_BxFxD = f.reshape(B, M * P, D).astype(x_BxTxD.dtype)
    slots_BxT = ctx.image_slots
    taken = jnp.take_along_axis(feats_BxFxD, jnp.maximum(slots_BxT, 0)[..., None], axis=1)
    return jnp.where((slots_BxT >= 0)[..., None], taken, x_BxTxD), {}


def module(cfg: ModelConfig, kind: str, dtype=jnp.float32) -> nn.Module:
  """The flax module of a tower layer kind."""
  if _qwen(cfg.vision):
    return qwen_vision.module(cfg, kind, dtype)
  if kind == "vision_embed":
    return VisionEmbed(cfg.vision, dtype)
  if kind == "vision":
    return VisionBlock(cfg.vision, dtype)
  return Projector(cfg, dtype)


def carry(cfg: ModelConfig, kind: str, deepstack: int, make, rows: int, seq: int, dtype):
  """A layer kind's input built by `make(shape, dtype)`: x [B, T, D]; in the tower (after its
  embedding) the pair (x, features [B, M, S, Dv]), x with Qwen3-VL's deepstack features beside
  it, (x, [B, k, M x image_tokens, D]); a decoder layer that adds `deepstack` of them, (x, those)."""
  x = make((rows, seq, cfg.hidden), dtype)
  v = cfg.vision
  if v is None or kind == "vision_embed":
    return x
  stack = lambda k: (x, make((rows, k, v.max_images * v.image_tokens, cfg.hidden), dtype))
  if kind in KINDS:
    return stack(len(v.deepstack)) if v.deepstack else x, make((rows, v.max_images, v.seq, v.hidden), dtype)
  return stack(deepstack) if deepstack else x


def sample_carry(cfg: ModelConfig, kind: str, batch: int = 1, seq: int = 2, deepstack: int = 0):
  """Zeros of a kind's input (`carry`) and a Ctx with images: shapes only, for layouts and
  memory probes."""
  v = cfg.vision
  ctx = Ctx(jnp.zeros((batch, seq), jnp.int32), None,
            jnp.zeros((batch, v.max_images, *v.image_shape), jnp.float32),
            jnp.full((batch, seq), -1, jnp.int32))
  return carry(cfg, kind, deepstack, jnp.zeros, batch, seq, jnp.float32), ctx


def forward_flops(cfg: ModelConfig, kind: str, batch: int) -> float:
  """One tower group's forward FLOPs over a batch of `batch` rows (every image slot computed)."""
  v = cfg.vision
  if _qwen(v):
    return qwen_vision.forward_flops(cfg, kind, batch)
  images = batch * v.max_images
  S, Dv = v.seq, v.hidden
  if kind == "vision_embed":
    return 2.0 * images * (S - (v.tower == "clip")) * v.channels * v.patch ** 2 * Dv
  if kind == "vision":
    return images * (2.0 * S * (4 * Dv * Dv + 2 * Dv * v.ffn) + 4.0 * S * S * Dv)
  P = v.image_tokens
  first = Dv * cfg.hidden + (cfg.hidden * cfg.hidden if v.projector == "mlp" else 0)
  return 2.0 * images * P * first


def rope_positions(cfg: ModelConfig, input_ids_BxT) -> np.ndarray | None:
  """M-RoPE positions [B, T, 3] of a model whose RoPE has `mrope_section`s (from its image
  tokens, mtjax.models.qwen_vision.rope_positions); None for any other."""
  if not cfg.rope.mrope_section:
    return None
  return qwen_vision.rope_positions(cfg, input_ids_BxT)


def image_inputs(cfg: ModelConfig, input_ids_BxT, images=None, image_grid_thw=None
                 ) -> tuple[np.ndarray, np.ndarray]:
  """(images [B, M, *image_shape], image slots [B, T]) on the host: the k-th image token of a row
  takes the k-th feature of its row's images in order. `images` is [B, M, *image_shape], or
  Hugging Face's `pixel_values` of the whole batch in the order of its image tokens ([N, C, H, W];
  a qwen tower's [N x S, C x frames x patch^2], its `image_grid_thw` checked to be the configured
  grid); None where no row has image tokens. Raises ValueError, naming the row, where they do
  not match."""
  v = cfg.vision
  ids = np.asarray(input_ids_BxT)
  B, T = ids.shape
  P, M = v.image_tokens, v.max_images
  shape = (B, M, *v.image_shape)
  if image_grid_thw is not None:
    if not _qwen(v):
      raise ValueError(f"image_grid_thw: a {v.tower} tower takes images of one fixed size")
    qwen_vision.check_grids(v, image_grid_thw)
  if _qwen(v) and images is not None and np.ndim(images) == 2:  # HF's patches, images in a row
    if np.shape(images)[0] % v.seq:
      raise ValueError(f"pixel_values: {np.shape(images)[0]} patches, not whole images of "
                       f"{v.seq} (model.vision.image_size {v.image_size})")
    images = np.asarray(images).reshape(-1, *v.image_shape)
  is_image = ids == v.image_token_id
  counts = is_image.sum(1)
  room = M * P
  if (counts > room).any():
    row = int(np.argmax(counts > room))
    raise ValueError(f"row {row}: {int(counts[row])} image tokens; {M} image(s) of {P} tokens "
                     f"fill {room} (model.vision.max_images)")
  if images is None:
    if counts.any():
      raise ValueError(f"row {int(np.argmax(counts > 0))}: image tokens (id {v.image_token_id}) "
                       "but no images")
    images = np.zeros(shape, np.float32)
  images = np.asarray(images, np.float32)
  if images.ndim == len(shape) - 1:  # Hugging Face's pixel_values: images in token order
    if (counts % P).any():
      row = int(np.argmax(counts % P > 0))
      raise ValueError(f"row {row}: {int(counts[row])} image tokens, not whole images of {P}")
    if images.shape[0] != counts.sum() // P:
      raise ValueError(f"pixel_values: {images.shape[0]} images for {counts.sum() // P} images' "
                       f"tokens")
    out = np.zeros(shape, np.float32)
    first = np.concatenate([[0], np.cumsum(counts // P)])
    for b in range(B):
      out[b, :counts[b] // P] = images[first[b]:first[b + 1]]
    images = out
  if images.shape != shape:
    raise ValueError(f"images: expected shape {shape} (B, model.vision.max_images, ...), got "
                     f"{images.shape}")
  slots = np.where(is_image, np.cumsum(is_image, axis=1) - 1, -1).astype(np.int32)
  return images, slots


def _qwen(v: VisionConfig) -> bool:
  return v.tower in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
