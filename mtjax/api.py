"""The functional API for research code: a Hugging Face model's config and parameters as plain
pytrees, and the whole model as one pure function of them.

    cfg, params = mtjax.load_hf("path/to/model")       # every family mtjax.models registers
    logits = mtjax.forward(cfg, params, input_ids)      # [B, T, V] float32
    loss, grads = jax.value_and_grad(lambda p: my_loss(mtjax.forward(cfg, p, ids)))(params)

`params` is {"embed": {...}, "blocks": [{...} per layer], "head": {...}} of fp32 numpy arrays, the
tree `LayerStore.to_tree()` gives; the layer modules are the ones the streaming engine runs.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from mtjax import hf, models
from mtjax.config import ModelConfig
from mtjax.models import vision
from mtjax.models.layers import Ctx


def load_hf(path: str | os.PathLike) -> tuple[ModelConfig, dict]:
  """(model config, fp32 parameters) of a Hugging Face model directory, every tensor checked
  before any is read.

  Raises:
    mtjax.hf.HFError: the architecture, an option or a tensor mtjax cannot use, in one line.
  """
  ck = hf.Checkpoint(path)
  cfg = ModelConfig(**ck.model_fields(), from_hf=str(Path(path).resolve()))
  spec = models.spec(cfg)
  ck.check(spec)
  trees = []
  for g, _ in spec.groups:
    lay = spec.group_layout(g)
    flat = np.full(lay.size, np.nan, np.float32)  # a parameter no tensor fills would show
    ck.read_group(spec, g, flat)
    trees.append(lay.unflatten(flat))
  return cfg, {"embed": trees[0], "blocks": trees[1:-1], "head": trees[-1]}


def forward(cfg: ModelConfig, params: dict, input_ids, *, dtype=jnp.float32, positions=None,
            segments=None, attention: str = "xla", logits_dtype=jnp.float32, aux: bool = False,
            pixel_values=None, image_grid_thw=None):
  """The whole model: logits [B, T, V] of `input_ids` [B, T] (`logits_dtype`, float32 unless asked).

  Args:
    cfg: the model config (`load_hf`'s, or one's own).
    params: the parameter tree (`load_hf`'s, `LayerStore.to_tree()`'s, or a gradient's).
    input_ids: [B, T] token ids.
    dtype: the weights' and activations' dtype in the layers (bfloat16 for speed).
    positions: [B, T] RoPE positions (packed documents restart at 0); default 0..T-1. Under
      M-RoPE (`model.rope.mrope_section`) [3, B, T] as transformers' position_ids, by default
      from the image tokens as its get_rope_index.
    segments: [B, T] document ids: attention stays within a document; default one per row.
    attention: "xla" (scores whole), "blockwise" (mtjax.attention) or "cudnn".
    aux: also return (auxiliary loss, metrics) of a mixture of experts' routers (0 and {} for a
      dense model): the load-balancing loss the training loss adds.
    pixel_values: a vision-language model's images (model.vision): Hugging Face's [N, C, H, W]
      in the order of the image tokens, or [B, M, C, H, W] per row; their features replace the
      image tokens' embeddings. A Qwen-VL tower takes patches: Hugging Face's [N x S, C x
      frames x patch^2], or [B, M, S, C x frames x patch^2].
    image_grid_thw: a Qwen-VL model's [N, 3] grids, each checked to be model.vision's fixed one.
  """
  spec = models.spec(cfg)
  ids = jnp.asarray(input_ids, jnp.int32)
  B, T = ids.shape
  if positions is None and cfg.rope.mrope_section:  # M-RoPE's from the image tokens (concrete ids)
    positions = vision.rope_positions(cfg, np.asarray(input_ids))
  elif cfg.rope.mrope_section and np.ndim(positions) == 3:  # transformers' [3, B, T]
    positions = jnp.moveaxis(jnp.asarray(positions), 0, -1)
  ctx = Ctx(jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T)) if positions is None
            else jnp.asarray(positions, jnp.int32),
            None if segments is None else jnp.asarray(segments, jnp.int32))
  if cfg.vision is not None:
    images, slots = vision.image_inputs(cfg, np.asarray(input_ids), pixel_values, image_grid_thw)
    ctx = Ctx(ctx.positions, ctx.segments, jnp.asarray(images), jnp.asarray(slots))
  elif pixel_values is not None:
    raise ValueError(f"pixel_values: model.family {cfg.family} has no vision tower")
  cast = lambda tree: jax.tree.map(lambda a: jnp.asarray(a).astype(dtype), tree)
  x = spec.embed(dtype).apply({"params": params["embed"]}, ids)
  sums = []
  for (_, kind), p in zip(spec.groups[1:-1], params["blocks"]):
    x, block_sums = spec.block(kind, attention, dtype=dtype).apply({"params": cast(p)}, x, ctx)
    sums.append(block_sums)
  table = cast(params["embed"]["table"]) if cfg.tie_embeddings else None
  logits = spec.head().apply({"params": cast(params["head"])}, x, table).astype(logits_dtype)
  if aux:
    return (logits, *spec.aux_loss(sums))
  return logits


def to_hf_names(cfg: ModelConfig, tree: dict) -> dict[str, np.ndarray]:
  """A parameter (or gradient) tree as Hugging Face tensors by name, in their layout."""
  spec = models.spec(cfg)
  parts = [tree["embed"], *tree["blocks"], tree["head"]]
  out = {}
  for (g, _), part in zip(spec.groups, parts):
    flat = spec.group_layout(g).flatten(jax.tree.map(np.asarray, part))
    out.update(hf.hf_tensors(spec, g, flat))
  return out
