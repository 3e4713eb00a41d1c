"""Flat parameter layouts of the layer kinds, and host-memory helpers.

Every layer group keeps its parameters as one flat fp32 vector. Within it the parameters sit
matrices first, so weight decay applies to the prefix `[0, n_decay)` and the fused optimizer needs
no per-parameter mask. Where each group's vectors live is `mtjax.store`'s business.
"""

from __future__ import annotations

import ctypes
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from mtjax import model
from mtjax.config import ModelConfig

Path = tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Layout:
  """Where each parameter of one layer kind sits inside its flat fp32 vector."""
  paths: tuple[Path, ...]
  shapes: tuple[tuple[int, ...], ...]
  offsets: tuple[int, ...]
  size: int
  n_decay: int  # elements [0, n_decay) are matrices and get weight decay

  @classmethod
  def from_shapes(cls, tree: dict) -> "Layout":
    leaves = _flatten_dict(tree)
    # Matrices first (decayed), then vectors; stable by name inside each class.
    leaves.sort(key=lambda kv: (len(kv[1]) < 2, kv[0]))
    paths, shapes, offsets, off, n_decay = [], [], [], 0, 0
    for path, shape in leaves:
      paths.append(path)
      shapes.append(tuple(shape))
      offsets.append(off)
      off += int(np.prod(shape))
      if len(shape) >= 2:
        n_decay = off
    return cls(tuple(paths), tuple(shapes), tuple(offsets), off, n_decay)

  def unflatten(self, flat) -> dict:
    """Views (numpy) or slices (jax, fused by XLA) of `flat` as the nested parameter dict."""
    out: dict = {}
    for path, shape, off in zip(self.paths, self.shapes, self.offsets):
      n = int(np.prod(shape))
      node = out
      for k in path[:-1]:
        node = node.setdefault(k, {})
      node[path[-1]] = flat[off:off + n].reshape(shape)
    return out

  def flatten(self, tree: dict, out: np.ndarray | None = None) -> np.ndarray:
    """Writes a nested parameter dict into `out` (or a new fp32 vector); shapes must match."""
    out = np.empty(self.size, np.float32) if out is None else out
    for path, shape, off in zip(self.paths, self.shapes, self.offsets):
      node = tree
      for k in path:
        if k not in node:
          raise KeyError(f"parameter {'/'.join(path)} missing")
        node = node[k]
      arr = np.asarray(node)
      if arr.shape != shape:
        raise ValueError(f"parameter {'/'.join(path)}: shape {arr.shape}, expected {shape}")
      out[off:off + arr.size] = arr.reshape(-1)
    return out


def _flatten_dict(tree, prefix=()) -> list[tuple[Path, tuple[int, ...]]]:
  out = []
  for k, v in tree.items():
    if isinstance(v, dict):
      out += _flatten_dict(v, prefix + (k,))
    else:
      out.append((prefix + (k,), tuple(v.shape)))
  return out


def layouts(cfg: ModelConfig) -> dict[str, Layout]:
  """The flat layouts of the three layer kinds, from shapes alone (nothing is allocated)."""
  key = jax.random.key(0)
  tok = jax.ShapeDtypeStruct((1, 2), jnp.int32)
  x = jax.ShapeDtypeStruct((1, 2, cfg.hidden), jnp.float32)
  table = jax.ShapeDtypeStruct((cfg.vocab_size, cfg.hidden), jnp.float32)
  shapes = {
      "embed": jax.eval_shape(model.Embed(cfg).init, key, tok),
      "block": jax.eval_shape(model.Block(cfg).init, key, x),
      "head": jax.eval_shape(model.Head(cfg).init, key, x, table),
  }
  return {k: Layout.from_shapes(v["params"]) for k, v in shapes.items()}


def host_memory_kind(device: jax.Device) -> str | None:
  kinds = {m.kind for m in device.addressable_memories()}
  return "pinned_host" if "pinned_host" in kinds else None


def writable_view(arr: jax.Array) -> np.ndarray:
  """A writable numpy view of a single-device host-memory jax array.

  jax arrays are immutable by contract, but a pinned buffer is the only memory the device can DMA
  from at full speed, so the host optimizer writes the master weights here in place. Safe because
  the engine orders it: a layer is rewritten only after every device copy that reads it has
  completed (its gradient, which depends on that copy, has arrived), and it is copied again only
  after the update has finished.
  """
  n = arr.size
  buf = (ctypes.c_float * n).from_address(arr.unsafe_buffer_pointer())
  view = np.frombuffer(buf, dtype=np.float32)
  assert view.size == n
  return view


