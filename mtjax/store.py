"""The layer store: the one owner of every layer group's training state, where it lives and how it moves.

A layer group (embedding, each block, head) has fp32 master weights `w` (one flat vector, matrices
first so weight decay is a prefix) and optimizer state `opt` (AdamW: flat `m` and `v`; any other
optax optimizer: its state pytree). Each group sits in one tier, chosen per group by the planner:

  host    w in pinned host memory (one DMA to the device), opt in plain host memory; the host
          optimizer updates it in place on a worker thread as the gradient lands.
  stream  w and opt in pinned host memory; the update runs on the device: opt crosses the link both
          ways, the updated w stays on the device until `sync()` (4 B/param of device memory).
  device  w and opt live in device memory (HBM) for the whole run and are updated there; nothing
          crosses the link. This is how state that does not fit host RAM is held.

Groups are ordered as the forward pass runs them, and the planner puts device and stream tiers on
the first groups: the backward reaches them last, so their updates cannot delay the next forward,
which needs them first.

Placement is written as `NamedSharding`s over a `Mesh` with one axis, "data". With several devices
the step is data-parallel: the batch is split over the axis, each group's weights go from their one
host copy to every device (replicated), and XLA's collectives sum the weight gradients on the
devices. Each group also has a home device, round-robin within its tier: host and stream groups'
pinned buffers belong to it (their copies spread over the devices' links), stream and device groups
are updated there, and device groups' state lives there alone, so device-tier capacity grows with
the device count while host memory keeps one copy of the state however many devices there are.

The store does: `fetch` (weights to the compute device), `prefetch` (a stream group's optimizer
state), `commit` (a gradient becomes an update, on the host or the device), `sync` (every update
done, host copies current), and host views of each group (`read`, `write`) for checkpoints, import
and export.
"""

from __future__ import annotations

import concurrent.futures as cf
import ctypes
import dataclasses
import os
import threading
import time
import zlib
from typing import Literal, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from mtjax import models, optimizer as opt_lib
from mtjax.config import Config
from mtjax.layout import Layout

Tier = Literal["host", "stream", "device"]
TIERS = ("host", "stream", "device")


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
  buf = (ctypes.c_char * (n * arr.dtype.itemsize)).from_address(arr.unsafe_buffer_pointer())
  view = np.frombuffer(buf, dtype=arr.dtype)
  assert view.size == n
  return view


def placement(cfg: Config) -> list[Tier]:
  """The tier of each group from a resolved config: the first `engine.device_state_layers` groups
  in device memory, the next `engine.device_update_layers` streamed, the rest on the host."""
  e = cfg.engine
  n = cfg.model.block_groups + 2
  if "auto" in (e.device_state_layers, e.device_update_layers, e.grad_queue):
    raise ValueError("engine placement is 'auto': resolve it with mtjax.launch.plan_run(cfg) first")
  n_dev = min(e.device_state_layers, n)
  n_str = min(e.device_update_layers, n - n_dev)
  return ["device"] * n_dev + ["stream"] * n_str + ["host"] * (n - n_dev - n_str)


@dataclasses.dataclass
class Group:
  """One layer group's state. `w` and the leaves of `opt` are jax arrays in the memory of the
  group's tier (pinned host or device) on its `home` device, or numpy arrays in plain host memory."""
  name: str
  kind: str
  layout: Layout
  tier: Tier
  w: object
  opt: dict
  home: jax.Device | None = None

  @property
  def size(self) -> int:
    return self.layout.size


class LayerStore:
  """Owns all training state and its copies; the engine asks it for weights and hands it gradients."""

  def __init__(self, cfg: Config, groups: list[Group], mesh: Mesh, rule: opt_lib.UpdateRule):
    self.cfg = cfg
    self.model_cfg = cfg.model
    self.spec = models.spec(cfg.model)
    self.layouts = self.spec.layouts
    self.groups = groups
    self.mesh = mesh
    self.devices = list(mesh.devices.flat)
    self._process = jax.process_index()  # asked once: owns() runs on every fetch and commit
    self.local_devices = [d for d in self.devices if d.process_index == self._process]
    # Several processes (hosts): each group's state lives in its home device's process alone.
    self.multiprocess = any(d.process_index != self._process for d in self.devices)
    self.step = 0  # optimizer updates applied so far
    self._shardings: dict[tuple[int, str], NamedSharding] = {}
    self.on_device = NamedSharding(mesh, PartitionSpec(), memory_kind="device")  # every device
    self.batch_sharding = NamedSharding(mesh, PartitionSpec("data"))  # [B, ...] split over devices
    self.host_kind = host_memory_kind(self.local_devices[0])
    # One host copy, in the first device's pinned memory (gradients for the caller, checkpoints).
    self.on_host = self.pinned(self.local_devices[0])
    self._sum_rows = jax.jit(lambda a: a.sum(0), out_shardings=self.on_device)
    self._zeros: dict[tuple[int, int], object] = {}  # jitted makers of a zero row, made on use
    self.rule = rule
    self.host_opt = opt_lib.HostOptimizer(cfg.optim, self.rule)
    self.wait_s = 0.0  # host seconds spent waiting for the host optimizer (reset by the engine)
    self._resident: dict[int, jax.Array] = {}  # stream groups: updated weights kept on the device
    self._moments: dict[int, dict] = {}  # stream groups: optimizer state prefetched to the device
    self._casts: dict = {}  # (layout, dtype) -> jitted unflatten-and-cast (device_tree)
    self._views: dict[tuple[int, str], np.ndarray] = {}
    self._views_lock = threading.Lock()  # the host optimizer's thread fills it too
    self._device_update = jax.jit(self._device_update_fn, static_argnums=(5,),
                                  donate_argnums=(0, 1, 2))

  # ---- sizes -----------------------------------------------------------------------------------

  @property
  def n_params(self) -> int:
    return sum(g.size for g in self.groups)

  @property
  def embed(self) -> Group:
    return self.groups[0]

  @property
  def blocks(self) -> list[Group]:
    return self.groups[1:-1]

  @property
  def head(self) -> Group:
    return self.groups[-1]

  def tiers(self) -> list[Tier]:
    return [g.tier for g in self.groups]

  def allocated_bytes(self) -> dict[str, int]:
    """Bytes of persistent state by memory, counted from the buffers actually allocated:
    {'host': plain host, 'pinned': pinned host, 'device': HBM}."""
    out = {"host": 0, "pinned": 0, "device": 0}
    for g in self.groups:
      for a in [g.w, *jax.tree.leaves(g.opt)] if self.owns(g) else []:
        if isinstance(a, np.ndarray):
          out["host"] += a.nbytes
        else:
          out["pinned" if a.sharding.memory_kind == "pinned_host" else "device"] += a.nbytes
    return out

  # ---- placement -------------------------------------------------------------------------------

  def on(self, device: jax.Device, kind: str = "device") -> NamedSharding:
    """One device's memory of `kind` (device, pinned_host) as a sharding over a mesh of one."""
    key = (device.id, kind)
    if key not in self._shardings:
      self._shardings[key] = NamedSharding(Mesh(np.array([device]), ("data",)), PartitionSpec(),
                                           memory_kind=kind)
    return self._shardings[key]

  def pinned(self, device: jax.Device) -> NamedSharding | None:
    """That device's pinned host memory, or None where the backend has none."""
    return self.on(device, self.host_kind) if self.host_kind else None

  def _local(self, x: jax.Array, device: jax.Device) -> jax.Array:
    """The copy of a replicated device array that lives on `device` (no transfer)."""
    if len(self.devices) == 1:
      return x
    return next(s.data for s in x.addressable_shards if s.device == device)

  def owns(self, g: Group | int) -> bool:
    """Whether this process holds (and updates) the group's state: always, in one process."""
    g = self.groups[g] if isinstance(g, int) else g
    return g.home.process_index == self._process

  def _everywhere(self, g: Group, x: jax.Array | None) -> jax.Array:
    """Group g's weights x (on its home device or in pinned host memory) replicated on every
    device of the mesh. With several processes only the owner has x: the other devices join with
    zeros and XLA's all-reduce sums the rows (exact: x + 0 = x)."""
    if not self.multiprocess:
      if len(self.devices) == 1 and x.sharding.memory_kind == "device":
        return x
      return jax.device_put(x, self.on_device)
    rows = []
    for d in self.local_devices:
      if d == g.home:
        rows.append(jax.device_put(x, self.on(d))[None])
      else:  # made on the device for this fetch (no copy, nothing kept)
        key = (d.id, g.size)
        if key not in self._zeros:
          self._zeros[key] = jax.jit(lambda n=g.size: jnp.zeros((1, n), jnp.float32),
                                     out_shardings=self.on(d))
        rows.append(self._zeros[key]())
    stacked = jax.make_array_from_single_device_arrays((len(self.devices), g.size),
                                                       self.batch_sharding, rows)
    return self._sum_rows(stacked)

  # ---- movement --------------------------------------------------------------------------------

  def fetch(self, i: int) -> jax.Array:
    """Group i's current fp32 weights on every device (the copies are asynchronous)."""
    g = self.groups[i]
    if not self.owns(g):
      return self._everywhere(g, None)
    if g.tier == "device":
      return self._everywhere(g, g.w)
    if i in self._resident:
      return self._everywhere(g, self._resident[i])
    t = time.perf_counter()
    self.host_opt.wait(i)  # a host group is copied only after its last update finished
    self.wait_s += time.perf_counter() - t
    return self._everywhere(g, g.w)

  def prefetch(self, i: int):
    """Starts copying a stream group's optimizer state to its home device, ahead of its update."""
    g = self.groups[i]
    if g.tier == "stream" and g.opt and i not in self._moments and self.owns(g):
      self._moments[i] = jax.device_put(g.opt, self.on(g.home))

  def to_host(self, x):
    """A device array's copy into pinned host memory, laid out as on the devices (a batch-split
    activation stays split; asynchronous), or x without pinned memory."""
    if self.host_kind is None:
      return x
    return jax.tree.map(lambda a: jax.device_put(a, a.sharding.with_memory_kind(self.host_kind)), x)

  def grad_to_host(self, grad: jax.Array, device: jax.Device | None = None):
    """One host copy of a (replicated) device gradient, taken from `device` (default this
    process's first)."""
    device = device or self.local_devices[0]
    local = self._local(grad, device)
    return local if self.host_kind is None else jax.device_put(local, self.pinned(device))

  def commit(self, i: int, grad: jax.Array, scale: float = 1.0, w: jax.Array | None = None,
             max_queued: int = 4, ok=True):
    """Applies update number `self.step` to group i with gradient `grad * scale`, if `ok`.

    Args:
      grad: the fp32 gradient on the device.
      w: the group's weights on the device, when the caller holds them (saves a copy).
      max_queued: host updates allowed in flight before this call waits for the oldest.
      ok: False (or a device bool that turns out False) leaves the group's weights and optimizer
        state untouched: a step whose loss or gradients are not finite. A device bool is read by
        the device update itself, or by the host optimizer's thread, never by the caller.
    """
    g = self.groups[i]
    if not self.owns(g):
      return None  # its owner process applies it
    if g.tier == "host":
      g_host = self.grad_to_host(grad, g.home)
      self.host_opt.submit(i, g, g_host, self.step, scale, self._host_view, ok)
      t = time.perf_counter()
      while self.host_opt.queued() > max_queued:
        self.host_opt.wait_oldest()
      self.wait_s += time.perf_counter() - t
      return g_host
    # The update runs on the group's home device, on its copies of the weights and the gradient.
    if g.tier == "device":
      w, opt = g.w, g.opt
    else:
      w = self._local(self.fetch(i) if w is None else w, g.home)
      self.prefetch(i)
      opt = self._moments.pop(i)
    ok = jnp.asarray(ok, bool)
    if len(self.devices) > 1:
      ok = jax.device_put(ok, self.on(g.home))
    w, opt = self._device_update(w, opt, self._local(grad, g.home), self.rule.scalars(self.step),
                                 np.float32(scale), g.layout, ok)
    if g.tier == "device":
      g.w, g.opt = w, opt
      return None
    # The weights stay on the device; only the optimizer state goes back now.
    self._resident[i] = w
    g.opt = self.to_host(opt)  # a stream group's state is never viewed in place: no views to drop
    return jax.tree.leaves(g.opt)[-1]

  def is_resident(self, i: int) -> bool:
    """Whether group i's current weights are on the device already (no copy on fetch)."""
    return self.groups[i].tier == "device" or i in self._resident

  def wait(self, i: int):
    """Waits for group i's queued host update."""
    self.host_opt.wait(i)

  def _device_update_fn(self, w, opt, grad, scalars, scale, layout, ok):
    new = self.rule.device_update(w, opt, grad * scale, scalars, layout)
    return jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, (w, opt))

  def end_step(self):
    """Counts the update applied by the commits of this step."""
    self.step += 1

  def sync(self):
    """Waits for every queued update and copy; afterwards every host copy is the current state."""
    self.host_opt.wait_all()
    for i, w in sorted(self._resident.items()):
      g = self.groups[i]
      g.w = self.to_host(w)  # into the home device's pinned memory
      self._drop_views(i)
    self._resident.clear()
    jax.block_until_ready([(g.w, g.opt) for g in self.groups
                           if self.owns(g) and not isinstance(g.w, np.ndarray)])

  def close(self):
    self.sync()
    self.host_opt.close()

  # ---- host views ------------------------------------------------------------------------------

  def _host_view(self, i: int, attr: str) -> np.ndarray:
    """A writable numpy view of a host-tier group's buffer (w or an optimizer leaf name)."""
    key = (i, attr)
    with self._views_lock:
      view = self._views.get(key)
    if view is None:
      g = self.groups[i]
      buf = g.w if attr == "w" else g.opt[attr]
      view = buf if isinstance(buf, np.ndarray) else writable_view(buf.block_until_ready())
      with self._views_lock:
        self._views[key] = view
    return view

  def _owned(self, i: int) -> Group:
    g = self.groups[i]
    if not self.owns(g):
      raise ValueError(f"{g.name}: its state lives in process {g.home.process_index}, "
                       f"not this one ({self._process})")
    return g

  def _drop_views(self, i: int):
    with self._views_lock:
      for key in [k for k in self._views if k[0] == i]:
        del self._views[key]

  def read(self, i: int) -> dict:
    """Numpy copies of group i's state, {'w': ..., 'opt': {...}}; call `sync()` first."""
    g = self._owned(i)
    if g.tier == "device":  # through pinned memory: the fast path off the device
      w, opt = jax.device_get(self.to_host((g.w, g.opt)))
      return {"w": np.array(w), "opt": jax.tree.map(np.array, opt)}
    return {"w": np.array(self._host_view(i, "w")),
            "opt": jax.tree.map(np.array, jax.device_get(g.opt))}

  def write(self, i: int, w: np.ndarray | None = None, opt: dict | None = None):
    """Overwrites group i's weights and/or optimizer state wherever the group lives; any device
    copy of the old weights is dropped. Shapes are checked before anything is written."""
    g = self._owned(i)
    if w is not None and np.shape(w) != (g.size,):
      raise ValueError(f"{g.name}: weights of shape {np.shape(w)}, expected ({g.size},)")
    if opt is not None:
      want = jax.tree.map(np.shape, g.opt)
      have = jax.tree.map(np.shape, opt)
      if jax.tree.structure(want) != jax.tree.structure(have) or want != have:
        raise ValueError(f"{g.name}: optimizer state {have} does not match {want}")
    self.host_opt.wait(i)
    self._resident.pop(i, None)
    self._moments.pop(i, None)
    if g.tier == "device":  # copies: on the CPU backend device_put may alias a numpy buffer
      if w is not None:
        g.w = jax.device_put(np.array(w, np.float32), self.on(g.home))
      if opt is not None:
        g.opt = jax.device_put(jax.tree.map(np.array, opt), self.on(g.home))
      return
    if w is not None:
      np.copyto(self._host_view(i, "w"), w)
    if opt is not None:
      if g.tier == "host" and all(isinstance(a, np.ndarray) for a in jax.tree.leaves(g.opt)):
        jax.tree.map(np.copyto, g.opt, opt)
      else:
        g.opt = _place_like(opt, g.opt)
        self._drop_views(i)

  def fill(self, i: int, fill_fn):
    """Overwrites group i's weights by `fill_fn(out)`, which writes the flat fp32 vector `out` in
    place: straight into the group's host buffer where it has one (no temporary), else into one
    group-sized temporary that then moves to the device."""
    g = self._owned(i)
    self.host_opt.wait(i)
    self._resident.pop(i, None)
    if g.tier == "device":
      out = np.empty(g.size, np.float32)
      fill_fn(out)
      g.w = jax.device_put(out, self.on(g.home))
      return
    fill_fn(self._host_view(i, "w"))

  # ---- whole-model trees (tests, small models) -------------------------------------------------

  def to_tree(self) -> dict:
    """Numpy copies of all weights: {'embed': ..., 'blocks': [...], 'head': ...} (call sync first)."""
    trees = [g.layout.unflatten(self.read(i)["w"]) for i, g in enumerate(self.groups)]
    return {"embed": trees[0], "blocks": trees[1:-1], "head": trees[-1]}

  def device_tree(self, dtype=jnp.bfloat16) -> dict:
    """Every group's current weights on the devices in `dtype`, laid out as `to_tree()`: each
    group fetched as a step fetches it and cast there, so no host copy is made and one group's
    fp32 copy is in flight at a time (the sampler's weights; call sync first)."""
    trees = []
    for i, g in enumerate(self.groups):
      cast = self._casts.get((g.layout, dtype))
      if cast is None:
        cast = jax.jit(lambda w, layout=g.layout: jax.tree.map(
            lambda a: a.astype(dtype), layout.unflatten(w)))
        self._casts[(g.layout, dtype)] = cast
      trees.append(cast(self.fetch(i)))
    return {"embed": trees[0], "blocks": trees[1:-1], "head": trees[-1]}

  def opt_trees(self) -> dict:
    """Numpy copies of every group's optimizer state, by group name."""
    return {g.name: self.read(i)["opt"] for i, g in enumerate(self.groups)}

  def moments_tree(self) -> tuple[dict, dict]:
    """AdamW m and v in the layout of `to_tree` (flat-state optimizers only)."""
    out = []
    for key in ("m", "v"):
      trees = [g.layout.unflatten(self.read(i)["opt"][key]) for i, g in enumerate(self.groups)]
      out.append({"embed": trees[0], "blocks": trees[1:-1], "head": trees[-1]})
    return out[0], out[1]

  def load_tree(self, tree: dict):
    """Overwrites every group's weights from a tree shaped like `to_tree()`."""
    if len(tree["blocks"]) != len(self.blocks):
      raise ValueError(f"tree has {len(tree['blocks'])} blocks, the model has {len(self.blocks)}")
    parts = [tree["embed"], *tree["blocks"], tree["head"]]
    flats = [g.layout.flatten(t) for g, t in zip(self.groups, parts)]  # all checked first
    for i, flat in enumerate(flats):
      self.write(i, w=flat)


def _place_like(tree, like):
  """`tree`'s values as fresh arrays in the memory `like`'s leaves occupy."""
  def one(a, ref):
    a = np.array(a, dtype=ref.dtype)
    return a if isinstance(ref, np.ndarray) else jax.device_put(a, ref.sharding)
  return jax.tree.map(one, tree, like)


def single_device_mesh(device: jax.Device | None = None) -> Mesh:
  return Mesh(np.array([device or jax.local_devices()[0]]), ("data",))


def device_mesh(cfg: Config) -> Mesh:
  """The data-parallel mesh of `engine.devices` local devices (all of them by default) of every
  process (`jax.distributed.initialize`: several hosts), in process order."""
  local = jax.local_devices()
  n = len(local) if cfg.engine.devices == "all" else cfg.engine.devices
  if n > len(local):
    raise ValueError(f"engine.devices: {n} requested, this process sees {len(local)}")
  by_process = {}
  for d in jax.devices():
    by_process.setdefault(d.process_index, []).append(d)
  return Mesh(np.array([d for p in sorted(by_process) for d in by_process[p][:n]]), ("data",))


def homes(tiers: Sequence[Tier], devices: Sequence[jax.Device]) -> list[jax.Device]:
  """Each group's home device: round-robin over the devices within each tier, so every device
  holds an even share of the device tier's state and of the copies and updates."""
  # Interleaved across processes (hosts) first: consecutive groups land on different hosts.
  rank = {}
  for d in devices:
    rank[d] = (sum(e.process_index == d.process_index for e in rank), d.process_index)
  devices = sorted(devices, key=rank.get)
  seen = {t: 0 for t in TIERS}
  out = []
  for t in tiers:
    out.append(devices[seen[t] % len(devices)])
    seen[t] += 1
  return out


def create(cfg: Config, key: jax.Array, tiers: Sequence[Tier] | None = None,
           mesh: Mesh | None = None, tx=None) -> LayerStore:
  """Allocates and initialises the state one group at a time, each straight into its tier (no
  whole-model temporaries: at most one group's host buffer beyond the final state).

  Args:
    cfg: a resolved config (`mtjax.launch.plan_run`); its placement is used unless `tiers` is given.
    key: seeds the initial weights; a tensor's values depend only on (key, group, parameter name).
    tiers: one tier per group, overriding the config's placement.
    mesh: the devices the state is placed over (default: `engine.devices` local devices).
    tx: an optax GradientTransformation to use instead of the config's optimizer.
  """
  mesh = mesh or device_mesh(cfg)
  tiers = list(tiers) if tiers is not None else placement(cfg)
  spec = models.spec(cfg.model)
  names = spec.groups
  if len(tiers) != len(names):
    raise ValueError(f"placement has {len(tiers)} tiers, the model has {len(names)} groups")
  lays = spec.layouts
  rule = opt_lib.UpdateRule(cfg.optim, cfg.decay_steps, tx)
  store = LayerStore(cfg, [], mesh, rule)
  if store.multiprocess:  # every process must place every group alike, or a group has 0 or 2 owners
    from jax.experimental import multihost_utils
    multihost_utils.assert_equal(np.array([TIERS.index(t) for t in tiers], np.int32),
                                 "the processes planned different placements; give every host "
                                 "the same engine.device_state_layers and device_update_layers")
  seed = np.asarray(jax.random.key_data(key)).ravel().astype(np.uint32).tolist()
  for (name, kind_), tier, home in zip(names, tiers, homes(tiers, store.devices)):
    lay = lays[kind_]
    if home.process_index != jax.process_index():  # another host holds this group
      store.groups.append(Group(name, kind_, lay, tier, None, None, home))
      continue
    w = np.empty(lay.size, np.float32)
    init_params(spec, lay, name, seed, w)
    # a frozen group (train.freeze) is never updated: no optimizer state
    opt = {} if spec.part(kind_) in cfg.train.freeze else rule.init_host(lay)
    pinned = store.pinned(home)
    if tier == "device":
      w, opt = jax.device_put((w, opt), store.on(home))
    elif pinned is not None:
      w = jax.device_put(w, pinned)
      if tier == "stream":
        opt = jax.device_put(opt, pinned)
    jax.block_until_ready((w, opt))  # the numpy source may be freed now
    store.groups.append(Group(name, kind_, lay, tier, w, opt, home))
  return store


_INIT_CHUNK = 1 << 22
_init_pool: cf.ThreadPoolExecutor | None = None
_init_lock = threading.Lock()


def _stable(*names: str) -> list[int]:
  return [zlib.crc32(n.encode()) & 0x7FFFFFFF for n in names]


def init_params(spec: models.ModelSpec, layout: Layout, group: str, seed: Sequence[int],
                out: np.ndarray):
  """Fills `out` with one group's initial weights, each parameter as the family's init rule says
  (`ModelSpec.init_value`). Each tensor's values depend only on (seed, group name, parameter
  name), never on the buffer layout or the model's depth; matrices draw N(0, init_std) in chunks of
  4M elements on all cores (numpy's generators release the GIL), so a 14B model initialises in
  seconds rather than minutes."""
  global _init_pool
  with _init_lock:
    if _init_pool is None:
      _init_pool = cf.ThreadPoolExecutor(os.cpu_count() or 1, thread_name_prefix="mtjax-init")
  jobs = []
  for path, shape, off in zip(layout.paths, layout.shapes, layout.offsets):
    n = int(np.prod(shape))
    rule = spec.init_value(path)
    if rule == "ones":
      out[off:off + n] = 1.0
    elif rule == "zeros":
      out[off:off + n] = 0.0
    else:
      base = list(seed) + _stable(group, "/".join(path))
      for c, lo in enumerate(range(0, n, _INIT_CHUNK)):
        hi = min(n, lo + _INIT_CHUNK)
        jobs.append(_init_pool.submit(_normal_fill, base + [c], out[off + lo:off + hi],
                                      np.float32(spec.cfg.init_std)))
  for j in jobs:
    j.result()


def _normal_fill(seed: list[int], out: np.ndarray, std: np.float32):
  np.random.default_rng(seed).standard_normal(out.shape, np.float32, out=out)
  out *= std
