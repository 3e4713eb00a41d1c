"""Host-resident training state: fp32 master weights and AdamW moments, one flat buffer set per layer.

Every layer ("group") keeps three flat fp32 vectors in host memory for the whole run: the master
weights `w` (in `pinned_host` memory where the device offers it, so a copy to the device is one DMA),
and the AdamW moments `m` and `v` (plain host memory: they never leave the host). That is 12 bytes
per parameter; gradients only pass through for a few layers at a time.

Within a flat vector the parameters sit matrices first, so weight decay applies to the prefix
`[0, n_decay)` and the optimizer needs no per-parameter mask.
"""

from __future__ import annotations

import ctypes
import dataclasses
import zlib
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding

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


class Group:
  """One layer's host state: buffers `w`, `m`, `v` and writable numpy views `w_np`, `m_np`, `v_np`.

  A buffer is a jax array in pinned host memory (what a copy to or from the device reads or
  writes by DMA) or, where the device has no such memory, a numpy array. The engine may replace a
  buffer with a new pinned array that a device->host copy produced (`swap`); views follow.
  """

  def __init__(self, name: str, kind: str, layout: Layout, w, m, v):
    self.name, self.kind, self.layout = name, kind, layout
    self.w, self.m, self.v = w, m, v
    self._views: dict[str, np.ndarray] = {}

  def _view(self, attr: str) -> np.ndarray:
    view = self._views.get(attr)
    if view is None:
      buf = getattr(self, attr)
      view = buf if isinstance(buf, np.ndarray) else _writable_view(buf.block_until_ready())
      self._views[attr] = view
    return view

  @property
  def w_np(self) -> np.ndarray:
    return self._view("w")

  @property
  def m_np(self) -> np.ndarray:
    return self._view("m")

  @property
  def v_np(self) -> np.ndarray:
    return self._view("v")

  def swap(self, **buffers):
    """Replaces buffers (e.g. w=..., m=...) with arrays of the same size; their copies may still be
    in flight (a view waits for them)."""
    for attr, buf in buffers.items():
      if buf.shape != (self.layout.size,) or buf.dtype != np.float32:
        raise ValueError(f"{self.name}.{attr}: {buf.shape} {buf.dtype}, expected "
                         f"({self.layout.size},) float32")
      setattr(self, attr, buf)
      self._views.pop(attr, None)

  def pin(self, device: jax.Device, attrs=("w", "m", "v")):
    """Moves the named buffers into pinned host memory, where the device has it (one copy each)."""
    kind = host_memory_kind(device)
    if kind is None:
      return
    sharding = SingleDeviceSharding(device, memory_kind=kind)
    for attr in attrs:
      buf = getattr(self, attr)
      if isinstance(buf, np.ndarray):
        self.swap(**{attr: jax.device_put(buf, sharding).block_until_ready()})

  @property
  def nbytes(self) -> int:
    return 3 * 4 * self.layout.size


def host_memory_kind(device: jax.Device) -> str | None:
  kinds = {m.kind for m in device.addressable_memories()}
  return "pinned_host" if "pinned_host" in kinds else None


def _writable_view(arr: jax.Array) -> np.ndarray:
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


def _alloc_pinned(n: int, device: jax.Device):
  kind = host_memory_kind(device)
  if kind is None:
    return np.zeros(n, np.float32)
  return jax.device_put(np.zeros(n, np.float32),
                        SingleDeviceSharding(device, memory_kind=kind)).block_until_ready()


def _stable_key(key: jax.Array, *names: str) -> jax.Array:
  for n in names:
    key = jax.random.fold_in(key, zlib.crc32(n.encode()) & 0x7FFFFFFF)
  return key


def init_params(cfg: ModelConfig, layout: Layout, group: str, key: jax.Array, out: np.ndarray):
  """Fills `out` with one layer's initial weights; each tensor's values depend only on
  (seed, layer name, parameter name), never on the buffer layout."""
  cpu = jax.devices("cpu")[0]
  for path, shape, off in zip(layout.paths, layout.shapes, layout.offsets):
    n = int(np.prod(shape))
    name = path[-1]
    if name in ("scale",):
      out[off:off + n] = 1.0
    elif name == "bias":
      out[off:off + n] = 0.0
    else:
      k = jax.device_put(_stable_key(key, group, "/".join(path)), cpu)
      with jax.default_device(cpu):
        out[off:off + n] = np.asarray(jax.random.normal(k, (n,), jnp.float32)) * cfg.init_std


@dataclasses.dataclass
class HostState:
  """All training state, host-resident: per-layer master weights and moments, and the step count."""
  cfg: ModelConfig
  layouts: dict[str, Layout]
  groups: list[Group]  # embed, block_0..block_{L-1}, head (the order of the forward pass)
  step: int = 0  # optimizer updates applied so far
  version: int = 0  # bumped when weights are overwritten from outside, so device copies go stale

  @property
  def embed(self) -> Group:
    return self.groups[0]

  @property
  def blocks(self) -> list[Group]:
    return self.groups[1:-1]

  @property
  def head(self) -> Group:
    return self.groups[-1]

  @property
  def n_params(self) -> int:
    return sum(g.layout.size for g in self.groups)

  def host_bytes(self) -> int:
    """Bytes of persistent host state: master weights plus both moments."""
    return sum(g.nbytes for g in self.groups)

  def to_tree(self) -> dict:
    """A numpy copy of all weights: {'embed': ..., 'blocks': [...], 'head': ...}."""
    unf = lambda g: jax.tree.map(np.array, g.layout.unflatten(g.w_np))
    return {"embed": unf(self.embed), "blocks": [unf(g) for g in self.blocks],
            "head": unf(self.head)}

  def moments_tree(self) -> tuple[dict, dict]:
    """Numpy copies of AdamW m and v in the layout of `to_tree`."""
    def tree(attr):
      unf = lambda g: jax.tree.map(np.array, g.layout.unflatten(getattr(g, attr + "_np")))
      return {"embed": unf(self.embed), "blocks": [unf(g) for g in self.blocks],
              "head": unf(self.head)}
    return tree("m"), tree("v")

  def load_tree(self, tree: dict):
    """Overwrites the master weights from a tree shaped like `to_tree()`."""
    if len(tree["blocks"]) != len(self.blocks):
      raise ValueError(f"tree has {len(tree['blocks'])} blocks, state has {len(self.blocks)}")
    self.embed.layout.flatten(tree["embed"], self.embed.w_np)
    for g, t in zip(self.blocks, tree["blocks"]):
      g.layout.flatten(t, g.w_np)
    self.head.layout.flatten(tree["head"], self.head.w_np)
    self.version += 1


def create(cfg: ModelConfig, key: jax.Array, device: jax.Device | None = None) -> HostState:
  """Allocates and initialises the host state one layer at a time (no whole-model temporaries)."""
  device = device or jax.devices()[0]
  lays = layouts(cfg)
  names = ["embed"] + [f"block_{i}" for i in range(cfg.layers)] + ["head"]
  kinds = ["embed"] + ["block"] * cfg.layers + ["head"]
  groups = []
  for name, kind in zip(names, kinds):
    lay = lays[kind]
    group = Group(name, kind, lay, _alloc_pinned(lay.size, device), np.zeros(lay.size, np.float32),
                  np.zeros(lay.size, np.float32))
    init_params(cfg, lay, name, key, group.w_np)
    groups.append(group)
  return HostState(cfg, lays, groups)
