"""Flat parameter layouts: where each parameter of a layer kind sits in its group's fp32 vector.

Every layer group keeps its parameters as one flat fp32 vector. Within it the parameters sit
matrices first, so weight decay applies to the prefix `[0, n_decay)` and the fused optimizer needs
no per-parameter mask. A layout is computed from parameter shapes alone (`mtjax.models.spec`);
where each group's vectors live is `mtjax.store`'s business.
"""

from __future__ import annotations

import dataclasses

import numpy as np

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
    leaves.sort(key=lambda kv: (not decayed(kv[0], kv[1]), kv[0]))
    paths, shapes, offsets, off, n_decay = [], [], [], 0, 0
    for path, shape in leaves:
      paths.append(path)
      shapes.append(tuple(shape))
      offsets.append(off)
      off += int(np.prod(shape))
      if decayed(path, shape):
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


def decayed(path: Path, shape) -> bool:
  """Whether weight decay applies: matrices, not vectors, nor stacks of biases (experts')."""
  return len(shape) >= 2 and not path[-1].endswith("bias")


def _flatten_dict(tree, prefix=()) -> list[tuple[Path, tuple[int, ...]]]:
  out = []
  for k, v in tree.items():
    if isinstance(v, dict):
      out += _flatten_dict(v, prefix + (k,))
    else:
      out.append((prefix + (k,), tuple(v.shape)))
  return out
