"""The host optimizer: AdamW with decoupled weight decay applied per layer to host-resident state.

Semantics are optax's: `optax.adamw` under `optax.warmup_cosine_decay_schedule`, with global-norm
clipping equal to `optax.clip_by_global_norm`. Two implementations share that contract:

- `fused` (default): one in-place numba loop over (w, m, v, g) per layer. optax on XLA:CPU allocates
  new outputs and peaked near 1 Gparam/s on a 16-core host; an in-place loop streams each byte once
  and runs near memory bandwidth (4.4-5.6 Gparam/s alone on the H200 box, 4.2-4.7 inside a training
  step), which is what lets the update of layer i hide behind the device's work on layer i-1.
- `optax`: the real `optax.adamw` jitted on the CPU backend, for reference and for checking.

Updates run on one worker thread, in the order gradients arrive, so they overlap the device.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import threading
import time

import jax
import jax.numpy as jnp
import numba
import numpy as np
import optax

from mtjax.config import OptimConfig
from mtjax.state import Group


def schedule(cfg: OptimConfig, decay_steps: int) -> optax.Schedule:
  """Linear warmup from 0 to lr, then cosine down to lr * min_lr_ratio at decay_steps."""
  warmup = min(cfg.warmup_steps, decay_steps)
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=cfg.lr, warmup_steps=warmup,
      decay_steps=max(decay_steps, warmup + 1), end_value=cfg.lr * cfg.min_lr_ratio)


def clip_scale(global_norm: float, max_norm: float | None) -> float:
  """The factor optax.clip_by_global_norm applies to every gradient."""
  if max_norm is None or global_norm < max_norm:
    return 1.0
  return max_norm / global_norm


@numba.njit(parallel=True, fastmath=True, nogil=True, cache=True)
def _adamw_inplace(w, m, v, g, lr, b1, b2, eps, wd, bc1, bc2, scale):  # pragma: no cover (compiled)
  one = np.float32(1.0)
  for i in numba.prange(w.size):
    gi = g[i] * scale
    mi = b1 * m[i] + (one - b1) * gi
    vi = b2 * v[i] + (one - b2) * gi * gi
    m[i] = mi
    v[i] = vi
    u = (mi / bc1) / (np.sqrt(vi / bc2) + eps) + wd * w[i]
    w[i] = w[i] - lr * u


class HostOptimizer:
  """Applies AdamW to one layer's host buffers at a time, on a worker thread when asked."""

  def __init__(self, cfg: OptimConfig, decay_steps: int):
    self.cfg = cfg
    self.schedule = schedule(cfg, decay_steps)
    self.threads = cfg.threads or os.cpu_count() or 1
    self._pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="mtjax-opt",
                                       initializer=numba.set_num_threads,
                                       initargs=(min(self.threads, numba.config.NUMBA_NUM_THREADS),))
    self._pending: dict[int, cf.Future] = {}
    self.log: list | None = None  # set to [] to record (group name, start, end) of every update
    self._cpu = jax.devices("cpu")[0]
    self._hyper: dict[int, dict] = {}  # the last two steps' scalars (the worker may lag a step)
    self._hyper_lock = threading.Lock()  # the main thread (device updates) and the worker share it
    self._optax = None
    if cfg.impl == "optax":
      self._optax = _OptaxImpl(cfg, self.schedule)

  def hyper(self, step: int) -> dict:
    """Scalars for update number `step` (0-based), as optax computes them.

    The schedule is a jax function: evaluated on the default device (the GPU) it would queue
    behind the layer being computed and make every update wait for it. So it runs on the CPU
    backend, once per step."""
    with self._hyper_lock:
      h = self._hyper.get(step)
      if h is None:
        c = self.cfg
        t = step + 1
        with jax.default_device(self._cpu):
          lr = np.float32(self.schedule(step))
        h = dict(lr=lr, b1=np.float32(c.b1), b2=np.float32(c.b2), eps=np.float32(c.eps),
                 wd=np.float32(c.weight_decay), bc1=np.float32(1 - c.b1 ** t),
                 bc2=np.float32(1 - c.b2 ** t))
        self._hyper = {s: v for s, v in self._hyper.items() if s == step - 1} | {step: h}
      return h

  def update(self, group: Group, grad, step: int, scale: float = 1.0):
    """Applies update number `step` to `group` in place; `grad` is a host array (or a host jax
    array whose copy may still be in flight: np.asarray waits for it)."""
    g = np.asarray(grad)
    t0 = time.perf_counter()
    self._update(group, g, step, scale)
    if self.log is not None:
      self.log.append((group.name, t0, time.perf_counter()))

  def _update(self, group: Group, g: np.ndarray, step: int, scale: float):
    if g.shape != (group.layout.size,) or g.dtype != np.float32:
      raise ValueError(f"{group.name}: gradient {g.shape} {g.dtype}, expected "
                       f"({group.layout.size},) float32")
    if self._optax is not None:
      self._optax.update(group, g, step, scale)
      return
    h = self.hyper(step)
    nd = group.layout.n_decay
    sc = np.float32(scale)
    # optim.chunk > 0 hands chunks out dynamically instead of one equal split per thread, which
    # runs at the pace of its slowest thread when other threads share the cores during a step.
    # Not yet shown to help: benchmarks/host_adamw_contention.py on 2 cores is within its noise.
    with numba.parallel_chunksize(self.cfg.chunk):
      for lo, hi, wd in ((0, nd, h["wd"]), (nd, group.layout.size, np.float32(0))):
        if hi > lo:
          _adamw_inplace(group.w_np[lo:hi], group.m_np[lo:hi], group.v_np[lo:hi], g[lo:hi],
                         h["lr"], h["b1"], h["b2"], h["eps"], wd, h["bc1"], h["bc2"], sc)

  def submit(self, idx: int, group: Group, grad, step: int, scale: float = 1.0):
    """Queues `update` on the worker thread; `wait(idx)` blocks until it has run."""
    self._pending[idx] = self._pool.submit(self.update, group, grad, step, scale)

  def wait(self, idx: int):
    fut = self._pending.pop(idx, None)
    if fut is not None:
      fut.result()

  def queued(self) -> int:
    return sum(not f.done() for f in self._pending.values())

  def wait_oldest(self):
    for idx in list(self._pending):
      if not self._pending[idx].done():
        self.wait(idx)
        return

  def wait_all(self):
    for idx in list(self._pending):
      self.wait(idx)

  def close(self):
    self.wait_all()
    self._pool.shutdown()


class _OptaxImpl:
  """optax.adamw jitted on the CPU backend. The group's m and v stay the single source of truth:
  they are handed to optax as its state and its results are copied back in place."""

  def __init__(self, cfg: OptimConfig, sched):
    self.cpu = jax.devices("cpu")[0]
    # The flat vector is passed to optax as (matrices, vectors): the mask decays only the first.
    self.tx = optax.adamw(sched, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                          weight_decay=cfg.weight_decay, mask=(True, False))

    def step(params, grads, mu, nu, count, scale):
      state = optax.tree_utils.tree_set(self.tx.init(params), count=count, mu=mu, nu=nu)
      grads = jax.tree.map(lambda x: x * scale, grads)
      updates, state = self.tx.update(grads, state, params)
      adam = state[0]
      return optax.apply_updates(params, updates), adam.mu, adam.nu
    self._step = jax.jit(step)

  def update(self, group: Group, g: np.ndarray, step: int, scale: float):
    nd = group.layout.n_decay
    split = lambda a: (jax.device_put(a[:nd], self.cpu), jax.device_put(a[nd:], self.cpu))
    w, mu, nu = self._step(split(group.w_np), split(g), split(group.m_np), split(group.v_np),
                           np.int32(step), np.float32(scale))
    for dst, src in ((group.w_np, w), (group.m_np, mu), (group.v_np, nu)):
      dst[:nd], dst[nd:] = np.asarray(src[0]), np.asarray(src[1])


def adamw_on_device(w, m, v, g, hyper: dict, scale, n_decay: int):
  """The fused kernel's update as a jax function, for layers updated on the device: the same fp32
  arithmetic, decay on elements [0, n_decay). Returns (w, m, v)."""
  g = g * scale
  m = hyper["b1"] * m + (1 - hyper["b1"]) * g
  v = hyper["b2"] * v + (1 - hyper["b2"]) * g * g
  wd = jnp.where(jnp.arange(w.shape[0]) < n_decay, hyper["wd"], jnp.float32(0))
  u = (m / hyper["bc1"]) / (jnp.sqrt(v / hyper["bc2"]) + hyper["eps"]) + wd * w
  return w - hyper["lr"] * u, m, v
