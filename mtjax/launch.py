"""The launch of a run: everything that must happen before the jax backend starts, and the plan made
with what the started backend tells.

Before the backend starts (it reads both once, when it starts): probe the machine (nvidia-smi's
memory and device count, the host memory limit), set the device memory the run may use
(XLA_PYTHON_CLIENT_MEM_FRACTION) and cap XLA's pinned host pool for the run's plan, its layer
programs' device bytes compiled in a child process where the placement turns on them. After: the
device's real limit, its memory bandwidth, the programs' device bytes from XLA's analysis, the
re-plan, and the refusal of a run that does not fit, before anything is allocated.

`plan_run` does it all; `mtjax.train` calls it first, and library users call it before anything
touches jax (examples/custom_loop.py). The planner itself (mtjax.plan) takes these facts as
arguments and has no side effects.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time

from mtjax import config as config_lib, models, optimizer as opt_lib, programs
from mtjax.plan import (DEVICE_MEMORY_FRACTION, GiB, Plan, PlanError, Rates, carries_documents,
                        check, devices_of, make, pinned_pool_bytes, refuse_by_size, with_devices)


def plan_run(cfg: config_lib.Config, host_limit: int | None = None
             ) -> tuple[config_lib.Config, Plan]:
  """Plans a run and makes every placement choice once; call it before anything touches jax.

  Before the backend starts it caps XLA's pinned host pool near what the plan pins and sets the
  device memory the run may use (`engine.device_memory_gb`, else DEVICE_MEMORY_FRACTION of the
  GPU). After the backend starts it re-plans with the device's real limit and the layer programs'
  device bytes from XLA's analysis of the compiled code, and refuses (PlanError) a run that does
  not fit, before any state is allocated.

  Args:
    cfg: the run's config, placement `auto` or given.
    host_limit: the host memory the run may use; default `host_memory_limit()`.

  Returns:
    (the config with a concrete placement, the plan).
  """
  host_limit = host_memory_limit() if host_limit is None else host_limit
  early = None if backend_started() else _before_backend(cfg, host_limit)
  import jax  # the environment is set: the backend may start now

  device = jax.local_devices()[0]
  accel = device.platform != "cpu"
  local = len(jax.local_devices())
  # Byte arithmetic first: laying out an absurd model (millions of layers) costs seconds per
  # million before any figure is known.
  refuse_by_size(with_devices(cfg, devices_of(cfg, local)), host_limit,
                 device_memory_limit(device) if accel else None)
  cfg = _split_batch(cfg, local, jax.process_count())
  facts = _started_facts(cfg, device, cfg.engine.devices * jax.process_count(), early)
  plan = make(cfg, host_limit, facts.device_limit, facts.rates, facts.working, facts.opt_bytes,
              facts.pinned_cap)
  check(plan)
  return plan.resolve(cfg), plan


@dataclasses.dataclass(frozen=True)
class _Early:
  """What was measured before the backend started, for the plan after it."""
  devices: int  # the devices that plan split the batch over
  working: dict | None  # the layer programs' device bytes compiled in a child process, or None


def _before_backend(cfg: config_lib.Config, host_limit: int) -> _Early:
  """Sets what the backend reads once, when it starts: the device memory the run may use and the
  pinned pool's cap, for the plan made now from nvidia-smi's figures."""
  total, count = probe_device_memory(), probe_device_count()
  first_cfg = with_devices(cfg, devices_of(cfg, count))
  limit = None if total is None else set_device_memory_share(total, cfg.engine.device_memory_gb)
  rates = Rates(accelerator=total is not None)
  first = make(first_cfg, host_limit, limit, rates)
  early = _Early(first_cfg.engine.devices, None)
  e = cfg.engine
  if (total is not None and set(first.tiers) != {"device"} and first.fits_host
      and "auto" in (e.device_state_layers, e.device_update_layers, e.grad_queue)):
    # Host groups pin their weights and queued gradients, so the pool's cap turns on how many
    # groups stay on the host and how deep the queue is, which the programs' device bytes decide
    # (the formula's estimate errs high: docs/performance.md); here they are compiled in a child
    # process, and the plan after the backend starts uses them too.
    early = _Early(early.devices, compiled_memory_apart(first_cfg, early.devices))
    if early.working is not None:
      first = make(first_cfg, host_limit, limit, rates, early.working)
  configure_pinned_pool(first.pinned)
  return early


def _split_batch(cfg: config_lib.Config, local: int, processes: int) -> config_lib.Config:
  """`cfg` with its data-parallel device count resolved for the `local` devices this process
  sees; PlanError where the batch does not split evenly over every process's devices."""
  n = devices_of(cfg, local)
  if n > local:
    raise PlanError(f"engine.devices: {n} requested, this process sees {local}")
  mb = cfg.engine.micro_batch or 1
  n_all = n * processes  # every process's devices share the global batch
  if cfg.train.batch % (n_all * mb):
    raise PlanError(f"train.batch: {cfg.train.batch} sequences do not split evenly over {n_all} "
                    f"device(s)" + (f" in micro-batches of {mb}" if mb > 1 else "")
                    + "; set engine.devices or the batch")
  return with_devices(cfg, n)


@dataclasses.dataclass(frozen=True)
class _Facts:
  """What the started backend tells of the machine: the plan's arguments."""
  device_limit: int | None  # the device's allocator limit
  rates: Rates
  working: dict | None  # the layer programs' device bytes (XLA's analysis), or None: estimated
  opt_bytes: dict  # optimizer-state bytes per group kind, from the update rule's own state
  pinned_cap: int | None  # the pinned pool's cap the backend started with


def _started_facts(cfg: config_lib.Config, device, n_all: int, early: _Early | None) -> _Facts:
  accel = device.platform != "cpu"
  # On the CPU backend "device" memory is host memory, nothing bounds it apart from the host, and
  # the estimate serves (each compile costs seconds there).
  working = pinned_cap = None
  if accel:
    pinned_cap = int(os.environ.get("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "64")) * GiB
    reuse = early is not None and early.working is not None and early.devices == n_all
    working = early.working if reuse else compiled_memory(cfg, device, n_all)
  rule = opt_lib.UpdateRule(cfg.optim, cfg.decay_steps)
  opt_bytes = {k: rule.state_bytes(lay) for k, lay in models.spec(cfg.model).layouts.items()}
  rates = Rates(accelerator=accel, compute_capability=programs.device_capability(device))
  if accel:  # the memory-bound parts (the head's softmax, device updates) at this GPU's rate
    rates = dataclasses.replace(rates, hbm_gbps=device_memory_gbps(device))
  return _Facts(device_memory_limit(device), rates, working, opt_bytes, pinned_cap)


# ---- probes: what the machine says before the backend starts -----------------------------------

def host_memory_limit() -> int:
  """The memory this process may use: the cgroup limit where one applies, else physical RAM."""
  limits = [os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")]
  for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
    try:
      text = open(path).read().strip()
    except OSError:
      continue
    if text.isdigit():
      limits.append(int(text))
  return min(limits)


def probe_device_memory() -> int | None:
  """Total memory of the first GPU, read without starting the jax backend (nvidia-smi), or None."""
  if os.environ.get("JAX_PLATFORMS", "").strip() == "cpu":
    return None
  try:
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total",
                          "--format=csv,noheader,nounits"], capture_output=True, text=True,
                         timeout=20)
  except (OSError, subprocess.SubprocessError):
    return None
  first = out.stdout.strip().splitlines()[:1]
  return int(float(first[0])) * 2**20 if out.returncode == 0 and first else None


def probe_device_count() -> int | None:
  """How many GPUs nvidia-smi lists (without starting the jax backend), or None."""
  if os.environ.get("JAX_PLATFORMS", "").strip() == "cpu":
    return None
  visible = os.environ.get("CUDA_VISIBLE_DEVICES")
  if visible is not None:  # what the process will see, not what the machine has
    return len([d for d in visible.split(",") if d.strip()]) or None
  try:
    out = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=20)
  except (OSError, subprocess.SubprocessError):
    return None
  return len(out.stdout.split()) if out.returncode == 0 and out.stdout.strip() else None


def backend_started() -> bool:
  from jax._src import xla_bridge  # only to ask whether it has started
  return bool(getattr(xla_bridge, "_backends", None))


# ---- what the backend reads once, when it starts -----------------------------------------------

def set_device_memory_share(total: int, want_gb: float | None = None) -> int:
  """Sets the share of the GPU's `total` bytes XLA's allocator may take: `want_gb`
  (engine.device_memory_gb), else DEVICE_MEMORY_FRACTION; a user's own
  XLA_PYTHON_CLIENT_MEM_FRACTION wins. Returns the bytes the run may use. Must run before the
  jax backend starts."""
  frac = min(want_gb * GiB / total, 1.0) if want_gb else DEVICE_MEMORY_FRACTION
  os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{frac:.4f}")
  return int(total * float(os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"]))


def configure_pinned_pool(pinned: int) -> None:
  """Caps XLA's pinned host pool near `pinned`, the bytes the run pins. The pool grows in doubling
  regions up to its cap, so a loose cap can pin up to twice what is used; a user's own setting
  wins. Must run before the jax backend starts."""
  os.environ.setdefault("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", str(pinned_pool_bytes(pinned) // GiB))


# ---- after the backend starts -------------------------------------------------------------------

def device_memory_limit(device) -> int | None:
  """The device allocator's limit in bytes, or None where the device reports none (the CPU)."""
  stats = device.memory_stats() if hasattr(device, "memory_stats") else None
  return None if not stats else stats.get("bytes_limit")


_HBM_GBPS: dict = {}


def device_memory_gbps(device, nbytes: int = 256 * 2**20, repeats: int = 5,
                       passes: int = 8) -> float:
  """The device's memory bandwidth as the planner counts it: bytes read and written by a jitted
  element-wise pass over `nbytes` of float32, once per device. Runs of 1 and `1 + passes` passes
  are queued back to back and timed (medians of `repeats`); their difference over `passes` is one
  pass, so the call's fixed cost (the launch, the wait for the result) cancels
  (docs/performance.md shows what a single timed pass reads instead)."""
  if device in _HBM_GBPS:
    return _HBM_GBPS[device]
  import jax
  import jax.numpy as jnp
  x = jax.device_put(jnp.zeros(nbytes // 4, jnp.float32), device)
  touch = jax.jit(lambda a: a + 1.0, donate_argnums=0)  # in place: no allocation in the timing
  x = touch(x).block_until_ready()  # compiled and warm

  def timed(n):
    nonlocal x
    times = []
    for _ in range(repeats):
      t = time.perf_counter()
      for _ in range(n):
        x = touch(x)
      x.block_until_ready()
      times.append(time.perf_counter() - t)
    return statistics.median(times)

  one, more = timed(1), timed(1 + passes)
  # a noisy host (the CPU backend) can make the difference vanish: then the long run's average
  per_pass = (more - one) / passes if more > one else more / (1 + passes)
  del x
  _HBM_GBPS[device] = 2 * nbytes / per_pass / 1e9
  return _HBM_GBPS[device]


def compiled_memory(cfg: config_lib.Config, device=None, devices: int = 1
                    ) -> dict[str, dict[str, int]]:
  """Device bytes of each layer program at the config's shapes, from XLA's own analysis of the
  compiled code (`.lower().compile().memory_analysis()` of the programs the engine runs,
  mtjax.programs): arguments, outputs, temporaries, aliased (donated) bytes. With the batch split
  over `devices`, one device's share (its rows of one pass)."""
  import jax
  device = device or jax.local_devices()[0]
  e, m, t = cfg.engine, cfg.model, cfg.train
  # One device's share: the run's programs over the rows it holds, strided as the run splits them.
  settings = programs.Settings.of(e, m, t.seq, device, 1, strided=devices > 1)
  rows = max(1, t.batch // t.grad_accum // devices)
  documents = carries_documents(cfg)  # the attention's mask is part of the layers' working set
  key = (m, settings, rows, t.seq, device, documents)
  if key in _COMPILED_MEMORY:  # placement does not change the layer programs
    return _COMPILED_MEMORY[key]
  progs = programs.build(models.spec(m), settings)
  out = {}
  for name, (fn, args) in programs.shaped_calls(progs, rows, t.seq, device, documents).items():
    stats = fn.lower(*args).compile().memory_analysis()
    out[name] = {"argument": stats.argument_size_in_bytes, "output": stats.output_size_in_bytes,
                 "temp": stats.temp_size_in_bytes, "alias": stats.alias_size_in_bytes}
  _COMPILED_MEMORY[key] = out
  return out


_COMPILED_MEMORY: dict = {}


def compiled_memory_apart(cfg: config_lib.Config, devices: int = 1, timeout: float = 300
                          ) -> dict[str, dict[str, int]] | None:
  """`compiled_memory` in a child process, for a plan made before this process's backend starts
  (the backend reads the pinned pool's cap once, when it starts). The child starts its own backend
  without preallocating device memory and exits before this one starts. None where it fails: the
  plan then estimates the programs' bytes."""
  code = ("import json, sys\n"
          "from mtjax import config, launch\n"
          "cfg = config.from_dict(json.load(sys.stdin))\n"
          "print(json.dumps(launch.compiled_memory(cfg, None, int(sys.argv[1]))))\n")
  env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false",
             PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
  try:
    out = subprocess.run([sys.executable, "-c", code, str(devices)], capture_output=True,
                         input=json.dumps(config_lib.to_dict(cfg)), text=True, env=env,
                         timeout=timeout)
    if out.returncode == 0:
      return json.loads(out.stdout.strip().splitlines()[-1])
  except (OSError, subprocess.SubprocessError, ValueError, IndexError):
    pass
  return None
