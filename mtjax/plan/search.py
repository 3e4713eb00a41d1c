"""The plan of a run: every item's bytes in each memory, the simulated step, and the search for a
placement (each layer group's tier) and an activation policy that fit both memories fastest."""

from __future__ import annotations

import dataclasses
import math

from mtjax import config as config_lib, models, objectives
from mtjax.models import vision
from mtjax.plan.memory import (DEVICE_TIER_HOST_SHARE, GiB, RUNTIME_HOST_BYTES,
                               RUNTIME_HOST_BYTES_CPU, SAVED_INPUT_ROUNDING, hf_staging_bytes,
                               pinned_pool_bytes)
from mtjax.plan.schedule import (DEVICE_UPDATE_BYTES, HEAD_CHUNK_BYTES, HEAD_LOGIT_BYTES, Layer,
                                 Rates, count_params, simulate)

class PlanError(RuntimeError):
  """The run does not fit; the message gives the numbers and what to change."""


@dataclasses.dataclass(frozen=True)
class Plan:
  params: int
  tiers: tuple[str, ...]  # each group's tier: host, stream or device (see mtjax.store)
  host: dict[str, int]  # bytes by item
  device: dict[str, int]  # bytes by item
  pinned: int  # of `host`, bytes that must be pinned (the XLA pinned pool must hold them)
  step_s: dict[str, float]  # predicted lower-bound terms
  host_limit: int | None
  device_limit: int | None
  schedule_s: float  # predicted step time from simulating the engine's schedule (`simulate`)
  schedule_best_s: float  # the same with the best in-step host AdamW rate measured
  compiled: bool  # the layer executables' device bytes came from XLA's analysis of the compiled code
  pinned_cap: int | None = None  # the pinned pool's cap when it was fixed before this plan
  grad_queue: int = 4  # host-group gradients queued before the device waits (resolved when auto)
  devices: int = 1  # data-parallel devices; `device` and `device_limit` are per device
  activations_every: int = 1  # every K-th block's input kept (resolved when auto)
  activations_on_host: int = 0  # of the kept inputs, the first ones spilled to pinned host memory
  device_tier_bytes: int = 0  # the device tier's state, all devices together
  runner_up: tuple | None = None  # (device, stream groups, simulated step s) of the next-best placement
  family: str = "llama"  # the model family (mtjax.models)
  active_params: int | None = None  # parameters a token uses (a mixture's chosen experts)
  disk: dict[str, int] = dataclasses.field(default_factory=dict)  # bytes on disk (`disk_bytes`)
  grad_accum: int = 1  # forward/backward passes per step (train.grad_accum)
  link_bytes: int = 0  # bytes that cross between host and device in a step, both ways

  @property
  def device_state_layers(self) -> int:
    return self.tiers.count("device")

  @property
  def device_update_layers(self) -> int:
    return self.tiers.count("stream")

  @property
  def host_total(self) -> int:
    return sum(self.host.values())

  @property
  def device_total(self) -> int:
    return sum(self.device.values())

  @property
  def host_bytes_per_param(self) -> float:
    """Bytes of persistent state per parameter, wherever it lives (host and device tiers)."""
    state = self.host["master weights"] + self.host["optimizer state"] + self.device_tier_bytes
    return state / self.params

  @property
  def fits_host(self) -> bool:
    return self.host_limit is None or self.host_total <= self.host_limit

  @property
  def fits_pool(self) -> bool:
    return self.pinned_cap is None or pinned_pool_bytes(self.pinned) <= self.pinned_cap

  @property
  def fits_device(self) -> bool:
    return self.device_limit is None or self.device_total <= self.device_limit

  @property
  def roofline_s(self) -> float:
    """The largest of the roofline terms: no schedule runs a step faster."""
    return max(self.step_s.values())

  def resolve(self, cfg: config_lib.Config) -> config_lib.Config:
    """`cfg` with this plan's placement written in: everything downstream takes concrete numbers."""
    return dataclasses.replace(cfg, engine=dataclasses.replace(
        cfg.engine, device_state_layers=self.device_state_layers,
        device_update_layers=self.device_update_layers, grad_queue=self.grad_queue,
        devices=self.devices, activations_every=self.activations_every,
        activations=(self.activations_on_host if cfg.engine.activations == "auto"
                     else cfg.engine.activations)))


def make(cfg: config_lib.Config, host_limit: int | None = None, device_limit: int | None = None,
         rates: Rates = Rates(), working: dict | None = None, opt_bytes: dict | None = None,
         pinned_cap: int | None = None) -> Plan:
  """The plan of `cfg`; an `auto` placement is resolved here, once.

  `engine.device_state_layers` and `engine.device_update_layers` at `auto` (the defaults) take,
  among every pair of counts that fits both memories, all state in device memory when that fits,
  else the pair whose simulated step (`simulate`) is the shortest (`_place`).

  Args:
    working: device bytes of the layer programs from XLA's analysis of their compiled code
      (mtjax.launch.compiled_memory); without it they are estimated by formula.
    opt_bytes: optimizer-state bytes per group kind; default AdamW's 8 B/param.
    pinned_cap: the pinned pool's cap when it is fixed already (the backend has started).
  """
  refuse_by_size(cfg, host_limit, device_limit)
  if cfg.optim.name == "adamw" and cfg.optim.impl == "fused" and rates.state_dtype is None:
    rates = rates.for_state(cfg.optim.state_dtype)  # the fused update's cost of its moments
  if "auto" in (cfg.engine.activations_every, cfg.engine.activations):
    return _saved_inputs(cfg, lambda c: make(c, host_limit, device_limit, rates, working,
                                            opt_bytes, pinned_cap))
  e = cfg.engine
  G = cfg.model.block_groups + 2
  plans: dict[tuple[int, int, int], Plan] = {}
  # auto: the placement is searched at a queue of 4, or of the shallowest where nothing fits at 4
  # (a slot holds a host group's fp32 gradient: the largest models need every byte of the host).
  queues = (4, GRAD_QUEUES[0]) if e.grad_queue == "auto" else (e.grad_queue,)

  def build(n_state, n_upd, q, optimistic=False):
    key = (n_state, n_upd, q, optimistic)
    if key not in plans:  # the search compares pessimistic schedules; the chosen gets both
      plans[key] = _make(
          cfg, ["device"] * n_state + ["stream"] * n_upd + ["host"] * (G - n_state - n_upd),
          host_limit, device_limit, rates, working, opt_bytes, pinned_cap, q, optimistic)
    return plans[key]

  def final(p):
    full = build(p.device_state_layers, p.device_update_layers, p.grad_queue, optimistic=True)
    return dataclasses.replace(full, runner_up=p.runner_up)

  for q in queues:
    plan = _place(cfg, lambda n_state, n_upd, q=q: build(n_state, n_upd, q), G, host_limit,
                  device_limit, rates)
    if plan.fits_device and plan.fits_host and plan.fits_pool:
      break
  if e.grad_queue != "auto":
    return final(plan)
  # A deeper queue lets the device run on while the host optimizer catches up, at 4 B/param of
  # pinned gradient buffers per slot: the shallowest within 1% of the fastest that leaves 3% of
  # the host spare.
  n_state, n_upd = plan.device_state_layers, plan.device_update_layers
  fits = {q: build(n_state, n_upd, q) for q in GRAD_QUEUES}
  fits = {q: p for q, p in fits.items()
          if p.fits_host and p.fits_pool and (host_limit is None or p.host_total <= 0.97 * host_limit)}
  if not fits:
    return final(plan)
  shortest = min(p.schedule_s for p in fits.values())
  chosen = fits[min(q for q, p in fits.items() if p.schedule_s <= shortest * 1.01)]
  runner_up = plan.runner_up
  if runner_up is not None:  # the runner-up at the chosen queue, where its host holds that queue
    r = build(runner_up[0], runner_up[1], chosen.grad_queue)
    if r.fits_host and r.fits_pool:
      runner_up = (runner_up[0], runner_up[1], r.schedule_s)
  return final(dataclasses.replace(chosen, runner_up=runner_up))


GRAD_QUEUES = (2, 4, 6, 8, 12, 16, 24)  # what engine.grad_queue=auto chooses among


ACTIVATIONS_EVERY = (1, 2, 3, 4, 6, 8, 12, 16)  # what engine.activations_every=auto chooses among


def _saved_inputs(cfg: config_lib.Config, make_plan) -> Plan:
  """Where the blocks' saved inputs go (`engine.activations_every` and `engine.activations`: auto).

  `activations_every: auto` alone keeps every block's input while the device holds them, else the
  fewest kept that fit. `activations: auto` spills the fewest kept inputs to pinned host memory
  that make both memories fit (copied out in the forward and back in the backward, overlapped with
  compute); with both auto, each K's fewest spills compete on the simulated step (spilling costs
  link time, re-running a segment costs compute), the search ending at the first K that needs no
  spill (a larger one only re-computes more). Spill counts are tried from 0 up: device bytes need
  not fall as more are spilled, since host bytes grow and `device_state_layers: auto` may then move
  state to the device."""
  e, L = cfg.engine, cfg.model.block_groups
  with_ = lambda k, a: make_plan(dataclasses.replace(cfg, engine=dataclasses.replace(
      e, activations_every=k, activations=a)))
  fits = lambda p: p.fits_device and p.fits_host and p.fits_pool
  best = plan = None
  for k in ACTIVATIONS_EVERY if e.activations_every == "auto" else (e.activations_every,):
    if e.activations != "auto":
      plan = with_(k, e.activations)
      if fits(plan):  # both memories: re-computing more frees device bytes the placement can use
        return plan
      continue
    for n in range(-(-L // k) + 1):
      plan = with_(k, n)
      if fits(plan):
        break
    if fits(plan) and (best is None or plan.schedule_s < best.schedule_s):
      best = plan
    if best is not None and best.activations_on_host == 0:
      break
  return best or plan


# A placement the planner chooses leaves this share of each memory spare: its estimates of the
# device's (XLA's allocator) and the host's (the runtime) peaks err by a few percent; a wider
# margin keeps groups out of device memory that fit there (docs/performance.md, the planner's
# constants).
DEVICE_SPARE, HOST_SPARE = 0.04, 0.03


EXHAUSTIVE_GROUPS = 40  # up to this many layer groups the search tries every pair


def _place(cfg, build, G, host_limit, device_limit, rates) -> Plan:
  """The placement part of `make`: every (device, stream) count pair that fits both memories (with
  DEVICE_SPARE and HOST_SPARE left for an `auto` count, or without where nothing fits with them),
  all state in device memory when it fits, else the pair with the shortest simulated step (ties:
  more groups in device memory); an explicit count is taken as given. The runner-up is recorded in
  the plan. Past EXHAUSTIVE_GROUPS groups a coarse grid is searched first, then every pair near
  its best. On the CPU backend nothing moves to "device" memory (it is host memory there)."""
  e = cfg.engine
  auto_state, auto_upd = e.device_state_layers == "auto", e.device_update_layers == "auto"
  if not rates.accelerator:
    return build(0 if auto_state else e.device_state_layers, 0 if auto_upd else
                 e.device_update_layers)
  states = range(G + 1) if auto_state else (min(e.device_state_layers, G),)
  upds = lambda n: (range(G - n + 1) if auto_upd else (min(e.device_update_layers, G - n),))
  for spare in (True, False):
    chosen = spare and (auto_state or auto_upd)
    device_ok = lambda p: p.fits_device and (not chosen or device_limit is None or
                                             p.device_total <= (1 - DEVICE_SPARE) * device_limit)
    host_ok = lambda p: p.fits_host and p.fits_pool and (not chosen or host_limit is None or
                                                         p.host_total <= (1 - HOST_SPARE) * host_limit)

    def search(state_counts, upd_counts):
      found = []
      for n_state in state_counts:
        fitted_device = False
        for n_upd in upd_counts(n_state):
          p = build(n_state, n_upd)
          if not device_ok(p):
            break  # device bytes grow with every streamed group
          fitted_device = True
          if host_ok(p):
            found.append(p)
        if not fitted_device and n_state:
          break  # and with every group held in device memory
      return found

    if G <= EXHAUSTIVE_GROUPS:
      candidates = search(states, upds)
    else:  # a coarse grid, then every pair around its best
      step = -(-G // 20)
      coarse = search(states[::step] if auto_state else states,
                      lambda n: upds(n)[::step] if auto_upd else upds(n))
      candidates = coarse
      if coarse:
        b = min(coarse, key=lambda p: (p.schedule_s, -p.device_state_layers))
        near = lambda lo, n: range(max(0, lo - step), min(n, lo + step) + 1)
        candidates += search(
            near(b.device_state_layers, G) if auto_state else states,
            lambda n: (near(b.device_update_layers, G - n) if auto_upd else upds(n)))
        candidates += [build(G, 0)] if auto_state and host_ok(build(G, 0)) and device_ok(
            build(G, 0)) else []
    if candidates:
      break
  if not candidates:  # refused by check(): the plan that comes closest says why
    return build(0 if auto_state else e.device_state_layers,
                 0 if auto_upd else e.device_update_layers)
  unique = {(p.device_state_layers, p.device_update_layers): p for p in candidates}
  ranked = sorted(unique.values(), key=lambda p: (p.schedule_s, -p.device_state_layers))
  everything = [p for p in ranked if p.device_state_layers == G]
  best = everything[0] if everything else ranked[0]
  runner = next((p for p in ranked if p is not best), None)
  if runner is None:
    return best
  return dataclasses.replace(best, runner_up=(runner.device_state_layers,
                                              runner.device_update_layers, runner.schedule_s))


def refuse_by_size(cfg: config_lib.Config, host_limit: int | None, device_limit: int | None):
  """Raises PlanError when the state alone (weights and optimizer state: 12 B/param with AdamW's
  fp32 moments, 8 with bfloat16 ones) exceeds host and device memory together: arithmetic on the
  config, before anything is laid out or searched, so an absurd size is refused at once.

  It decides on a lower bound of the parameters (the embedding and head, each block's query and
  output projections and its feed-forward's matrices): a model near the limits gets the whole
  plan's refusal, which says what to change. The message names the true count (`count_params`)."""
  if host_limit is None:
    return
  m = cfg.model
  D = m.hidden
  mlp = 3 * D * m.ffn
  if m.moe is not None:
    mlp = min(mlp, 3 * D * m.moe.expert_ffn * m.moe.experts)
  at_least = m.vocab_size * D * (1 if m.tie_embeddings else 2) + m.layers * (
      2 * D * m.heads * m.dim_per_head + mlp)
  # a frozen text model (train.freeze: language) holds no optimizer state
  per_param = 4 + cfg.optim.moment_bytes * ("language" not in cfg.train.freeze)
  total = host_limit + (device_limit or 0) * devices_of(cfg)
  if per_param * at_least > total:
    params = count_params(m)
    fused = (cfg.optim.name, cfg.optim.impl) == ("adamw", "fused")
    int8 = 4 + dataclasses.replace(cfg.optim, state_dtype="int8").moment_bytes if fused else 0
    smaller_state = (f" or optim.state_dtype=int8 ({int8:.2f} B/param)"
                     if fused and per_param > int8 and int8 * at_least <= total else "")
    raise PlanError(f"does not fit in host memory and device memory together: the weights and "
                    f"optimizer state alone need at least {per_param * params / GiB:,.1f} GiB "
                    f"({params / 1e9:,.2f}B params x {per_param} B/param) where {total / GiB:,.1f} "
                    f"GiB are available; use a smaller model" + smaller_state)


def devices_of(cfg: config_lib.Config, available: int | None = None) -> int:
  """The data-parallel device count: `engine.devices`, or all `available` (default 1)."""
  return (available or 1) if cfg.engine.devices == "all" else cfg.engine.devices


def with_devices(cfg: config_lib.Config, n: int) -> config_lib.Config:
  """`cfg` with its data-parallel device count set to `n`."""
  return dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, devices=n))


def _make(cfg: config_lib.Config, tiers: list[str], host_limit, device_limit, rates: Rates,
          working: dict | None, opt_bytes: dict | None, pinned_cap: int | None,
          grad_queue: int, optimistic: bool = True) -> Plan:
  """The plan of one placement (`tiers`, a tier per group) at one gradient queue: its host and
  device bytes, its roofline terms and its simulated step (both host AdamW rates when
  `optimistic`; only the pessimistic one otherwise, as the search compares those)."""
  spec = models.spec(cfg.model)
  groups = _Groups.of(cfg, spec, tiers, opt_bytes)
  tiers_run = ["host" if t == "stream" and f else t for t, f in zip(tiers, groups.frozen)]
  shape = _PassShape.of(cfg)
  host = _host_bytes(cfg, groups, shape, rates, grad_queue)
  device = _device_bytes(cfg, groups, shape, rates, working)
  step = _step_terms(cfg, spec, groups, shape, rates)
  if not rates.accelerator:  # the CPU backend's "device" memory is host RAM
    host.items["device memory (CPU backend: host RAM)"] = sum(device.values())
  fits = ((host_limit is None or sum(host.items.values()) <= host_limit)
          and (device_limit is None or sum(device.values()) <= device_limit))
  # the simulation costs O(layers); a plan that does not fit needs none
  sched, best = (_simulated(cfg, step.layers, tiers_run, rates, grad_queue, shape, optimistic)
                 if fits else (math.inf, math.inf))
  pc = spec.counts
  return Plan(pc["total"], tuple(tiers), host.items, device, host.pinned, step.terms, host_limit,
              device_limit, sched, min(sched, best), working is not None, pinned_cap, grad_queue,
              devices=groups.devices, activations_every=shape.every,
              activations_on_host=shape.spilled,
              device_tier_bytes=sum(groups.state(groups.device)), family=cfg.model.family,
              active_params=pc["active"], grad_accum=shape.passes, link_bytes=step.link_bytes,
              disk=disk_bytes(cfg, sum(groups.state(range(len(groups.sizes)))),
                              len(groups.sizes), pc["total"]))


@dataclasses.dataclass(frozen=True)
class _Groups:
  """The layer groups as one placement has them: each group's parameters and optimizer-state
  bytes, and which groups each tier holds (indices in forward order)."""
  sizes: list[int]  # parameters per group
  opt: list[int]  # optimizer-state bytes per group
  host: list[int]
  stream: list[int]
  device: list[int]
  devices: int  # the data-parallel devices
  modes: list[str]  # each group's backward (ModelSpec.backward_modes: full, dx, pass, skip)

  @classmethod
  def of(cls, cfg: config_lib.Config, spec: models.ModelSpec, tiers: list[str],
         opt_bytes: dict | None) -> _Groups:
    pc = spec.counts
    kinds = [k for _, k in spec.groups]
    modes = spec.backward_modes(cfg.train.freeze)
    opt = [0 if mode != "full" else (opt_bytes or {}).get(k, cfg.optim.moment_bytes * pc[k])
           for k, mode in zip(kinds, modes)]  # a frozen group holds no optimizer state
    # a frozen stream group is never updated on the device: its weights come in as a host group's
    tiers = ["host" if t == "stream" and mode != "full" else t for t, mode in zip(tiers, modes)]
    on = lambda tier: [i for i, tr in enumerate(tiers) if tr == tier]
    return cls([pc[k] for k in kinds], opt, on("host"), on("stream"), on("device"),
               devices_of(cfg), modes)  # the device count is resolved by the caller

  @property
  def frozen(self) -> list[bool]:
    return [mode != "full" for mode in self.modes]

  def trained(self, idx) -> list[int]:
    """Of `idx`, the groups that get a gradient and an update."""
    return [i for i in idx if self.modes[i] == "full"]

  def params(self, idx) -> int:
    return sum(self.sizes[i] for i in idx)

  def state(self, idx) -> list[int]:
    """Each group's fp32 weights and optimizer state, in bytes."""
    return [4 * self.sizes[i] + self.opt[i] for i in idx]

  def busiest(self, per_group: list[int]) -> int:
    """The busiest device's share: device and stream groups live on home devices round-robin
    within their tier (mtjax.store.homes)."""
    n = self.devices
    return max(sum(per_group[k::n]) for k in range(n)) if per_group else 0


@dataclasses.dataclass(frozen=True)
class _PassShape:
  """One forward/backward pass as the activations and the link see it (train.grad_accum passes of
  batch / grad_accum sequences: activations are one pass's, the weights cross once per pass, and
  each group's gradient sum is held between passes)."""
  passes: int  # train.grad_accum
  rows: int  # sequences per pass, all devices together
  act: int  # bytes per activation element
  saved_input: int  # one block's saved input, all devices together
  every: int  # every K-th block's input is kept
  kept: int  # blocks whose input the forward keeps
  spilled: int  # of those, the first ones waiting in pinned host memory
  clip_held: bool  # gradients wait for the global norm (host_buffer, or accumulated ones)

  @property
  def reruns(self) -> float:
    """A block's forward runs again in the backward: once, or twice in a re-computed segment."""
    return 1 + (self.every - 1) / self.every

  @classmethod
  def of(cls, cfg: config_lib.Config) -> _PassShape:
    e, t, o, L = cfg.engine, cfg.train, cfg.optim, cfg.model.block_groups
    act = 2 if e.compute_dtype == "bfloat16" else 4
    rows = t.batch // t.grad_accum
    return cls(t.grad_accum, rows, act, rows * t.seq * cfg.model.hidden * act,
               e.activations_every, -(-L // e.activations_every), e.activations_on_host(L),
               bool(o.clip_norm and (o.clip_mode == "host_buffer" or t.grad_accum > 1)))


@dataclasses.dataclass(frozen=True)
class _HostBytes:
  items: dict[str, int]  # bytes by item
  pinned: int  # of those, the bytes that must be pinned (the XLA pinned pool holds them)


def _largest(group_sizes, k: int) -> int:
  """The sum of the `k` largest."""
  return sum(sorted(group_sizes, reverse=True)[:k])


def _host_bytes(cfg: config_lib.Config, g: _Groups, shape: _PassShape, rates: Rates,
                grad_queue: int) -> _HostBytes:
  G, host_g, host_t = shape.passes, g.host, g.trained(g.host)
  largest_stream = max((g.sizes[i] for i in g.stream), default=0)
  largest_stream_opt = max((g.opt[i] for i in g.stream), default=0)
  largest_dev = max((g.sizes[i] + g.opt[i] // 4 for i in g.device), default=0)
  items = {
      "master weights": 4 * g.params(host_g + g.stream),
      "optimizer state": sum(g.opt[i] for i in host_g + g.stream),
      # at most grad_queue queued, one being applied, one landing
      "gradients in flight": 4 * _largest([g.sizes[i] for i in host_t], grad_queue + 2),
      # a host group's gradient held until the norm is known, or its sum between passes
      # (accumulation: the held gradient is the sum, so one buffer serves both)
      "clip gradient buffer": 4 * g.params(host_t) if shape.clip_held and G == 1 else 0,
      "gradient accumulation sums": 4 * g.params(host_t) if G > 1 else 0,
      "stream staging": 2 * (4 * largest_stream + largest_stream_opt) if g.stream else 0,
      "device-tier staging (sync, checkpoints)": 4 * largest_dev if g.device else 0,
      "activations on host": shape.spilled * shape.saved_input,
      "import / export staging (start / end)": hf_staging_bytes(cfg),
      "reference weights (train.grpo.kl_coef)": objectives.get(cfg.train).host_bytes(
          sum(g.sizes)),
      "runtime": RUNTIME_HOST_BYTES if rates.accelerator else RUNTIME_HOST_BYTES_CPU,
      "device-tier host allowance (measured)": int(DEVICE_TIER_HOST_SHARE * sum(
          g.state(g.device))) if rates.accelerator else 0,
  }
  pinned = (items["master weights"] + sum(g.opt[i] for i in g.stream)
            + sum(items[k] for k in ("gradients in flight", "clip gradient buffer",
                                     "gradient accumulation sums", "stream staging",
                                     "device-tier staging (sync, checkpoints)",
                                     "activations on host")))
  items["pinned pool headroom"] = pinned_pool_bytes(pinned) - pinned if rates.accelerator else 0
  return _HostBytes(items, pinned)


def _device_bytes(cfg: config_lib.Config, g: _Groups, shape: _PassShape, rates: Rates,
                  working: dict | None) -> dict[str, int]:
  """The busiest device's bytes by item: the batch splits evenly, device and stream groups live
  on their home devices, the rest is replicated."""
  e, nd, K = cfg.engine, g.devices, shape.every
  held = shape.kept - shape.spilled  # kept inputs in device memory
  on_device = g.trained(g.stream + g.device)
  device = {
      "weights and optimizer state (device tier)": g.busiest(g.state(g.device)),
      "resident weights (stream tier)": g.busiest([4 * g.sizes[i] for i in g.stream]),
      "optimizer state in flight (stream tier)": 2 * 2 * max((g.opt[i] for i in g.stream),
                                                             default=0),
      "streamed weights": 4 * _largest([g.sizes[i] for i in g.host + g.stream],
                                       e.inflight_layers + 1),
      "gradients": 4 * _largest([g.sizes[i] for i in g.trained(range(len(g.sizes)))], 2),
      # kept inputs in device memory (and two in flight from the host when some are spilled),
      # and with K > 1 one segment's re-computed inputs plus the block's own at the turn between
      # two segments
      "saved activations": ((held + (2 if shape.spilled else 0))
                            + (K + 1 if K > 1 else 0)) * shape.saved_input // nd,
      # (accelerators only) the allocator's rounding of the saved inputs in device memory
      "allocator rounding (measured)": int(SAVED_INPUT_ROUNDING * min(
          shape.saved_input // nd, 128 * 2**20) * held) if rates.accelerator else 0,
      # clip_mode=host_buffer: stream and device groups' gradients (and stream groups' prefetched
      # state) wait on the device until the global norm is known
      "clip-held gradients": (4 * g.params(on_device) * (shape.passes == 1)
                              + g.busiest([g.opt[i] for i in g.stream])
                              if shape.clip_held else 0),
      # grad_accum > 1: stream and device groups' gradient sums between passes (and held for
      # the clip)
      "gradient accumulation sums": 4 * g.params(on_device) if shape.passes > 1 else 0,
  }
  if working is not None:
    # The largest program's temporaries and outputs (its arguments are the items above).
    device["layer executables (compiled)"] = max(w["temp"] + w["output"] for w in working.values())
  else:
    device["layer working set (estimated)"] = _working_set(cfg, shape, rates, nd)
  sampler = objectives.get(cfg.train).device_bytes(cfg, sum(g.sizes))
  if sampler:
    # The sampler runs between steps, when the step's buffers are free and the device tier's
    # state is not; it fetches one group's fp32 weights at a time to cast them.
    step = sum(v for k, v in device.items() if k != "weights and optimizer state (device tier)")
    device["sampler beyond the step's buffers (train.grpo)"] = max(
        0, sampler + 4 * max(g.sizes) - step)
  return device


def _working_set(cfg: config_lib.Config, shape: _PassShape, rates: Rates, nd: int) -> int:
  """The layer programs' largest working set by formula, where XLA's analysis of them is not at
  hand: one block's backward, or the LM head's loss chunk."""
  m, e, t, act = cfg.model, cfg.engine, cfg.train, shape.act
  mb = e.micro_batch or max(1, shape.rows // nd)
  D, F, V, H = m.hidden, m.ffn, m.vocab_size, m.heads
  if m.moe is not None:  # a token's experts' inner width, and its sorted copies
    F = max(F, m.moe.experts_per_token * (m.moe.expert_ffn + 2 * D) + m.moe.shared_width)
  # One block's backward over one micro-batch: its forward re-run under vjp keeps about a dozen
  # [mb, T, D]-sized and three [mb, T, F]-sized intermediates, and as many cotangents; tiled over
  # the sequence (engine.seq_tile), about eight [mb, T, D] (input, q, k, v, attention output,
  # residuals) and one tile's share of the rest.
  tile = min(e.seq_tile or t.seq, t.seq)
  layer_acts = 2 * mb * act * (t.seq * (12 * D + 3 * F) if tile == t.seq
                               else t.seq * 8 * D + tile * (4 * D + 3 * F))
  attn = (mb * H * t.seq * 4 * 2 if e.attention != "xla" and e.compute_dtype == "bfloat16"
          else 3 * mb * H * t.seq * t.seq * 4)  # flash: row stats; XLA: scores, probs, their grad
  if "cudnn-mask" in attention_kernels(cfg, rates):  # the documents' mask and its bf16 bias
    attn += 3 * mb * t.seq * t.seq
  chunk = min(e.loss_chunk, shape.rows * t.seq)
  return max(layer_acts + attn + 3 * shape.rows * t.seq * D * act,
             chunk * V * (4 + 4 + act) + 8 * D * V)


@dataclasses.dataclass(frozen=True)
class _Compute:
  """The device's work in a step."""
  seconds: float  # the whole step's, every pass's
  block_fwd_s: list[float]  # each block's forward in one pass
  head_s: float  # the LM head's loss step in one pass (forward and backward)


def _compute(cfg: config_lib.Config, spec: models.ModelSpec, g: _Groups, shape: _PassShape,
             rates: Rates) -> _Compute:
  """Matmuls and attention at the machine's rates, the memory-bound head and device updates."""
  m, e, t = cfg.model, cfg.engine, cfg.train
  L, D, V, nd, G = m.layers, m.hidden, m.vocab_size, g.devices, shape.passes
  tokens = t.batch * t.seq
  dqk = spec.attention_widths[1]
  # Each layer's attention kernel (as the engine picks it) and its rate on the causal pairs.
  if rates.accelerator:
    attn_rate = [rates.attention_tflops * kernel_efficiency(k, dqk)
                 for k in attention_kernels(cfg, rates)]
    causal_pairs = True
  else:  # the CPU backend: XLA's scores whole, plain matmuls at the matmul rate
    attn_rate, causal_pairs = [rates.matmul_tflops] * L, False
  # a gated DeltaNet's chunked scan is plain (small) matmuls
  attn_rate = [rates.matmul_tflops if m.layer_type(i) == "linear" else rate
               for i, rate in enumerate(attn_rate)]
  seconds = lambda matmul, attn: (matmul / rates.matmul_tflops + attn) / (nd * 1e12)
  # each block's matrix parameters a token uses, and its attention in the forward: FLOPs / rate
  # (a vision tower's groups, first: their matmuls over its own tokens, at the matmul rate)
  kinds = [k for _, k in spec.groups]
  text = [spec.text_layer(j) for j in range(m.block_groups)]
  block_matmul = [0 if i is None else spec.matmul_params(kinds[j + 1]) for j, i in enumerate(text)]
  attn_fwd = [vision.forward_flops(m, kinds[j + 1], t.batch) / rates.matmul_tflops if i is None
              else spec.mixer_forward_flops(i, t.batch, t.seq, causal_pairs) / attn_rate[i]
              for j, i in enumerate(text)]
  # the LM head: forward and backward, and the objective's extra forwards (dpo: one, first)
  head_flops = (6 + 2 * objectives.get(t).head_forwards) * D * V * tokens
  # its memory traffic: the logits' passes, and each chunk's pass over the head's weights (every
  # device holds them whole)
  chunks = G * -(-shape.rows * t.seq // min(e.loss_chunk, shape.rows * t.seq))
  head_mem_s = (HEAD_LOGIT_BYTES * V * tokens / nd + HEAD_CHUNK_BYTES * V * D * chunks) / (
      rates.hbm_gbps * 1e9)
  # forward, its re-runs, backward (2x the forward): matmuls and causal attention; a frozen
  # block's backward (train.freeze) computes no weight gradient (a third of its matmuls), or
  # none at all where nothing below it trains
  rerun = shape.reruns
  modes = g.modes[1:-1]
  mm_factor = {"full": 6 + 2 * rerun, "dx": 4 + 2 * rerun, "pass": 2, "skip": 2}
  attn_factor = {"full": 3 + rerun, "dx": 3 + rerun, "pass": 1, "skip": 1}
  total = (seconds(sum(mm_factor[mo] * b for mo, b in zip(modes, block_matmul)) * tokens
                   + head_flops, sum(attn_factor[mo] * a for mo, a in zip(modes, attn_fwd)))
           + head_mem_s + DEVICE_UPDATE_BYTES * rates.device_update_factor
           * g.params(g.trained(g.stream + g.device)) / (rates.hbm_gbps * 1e9))
  # the schedule's layers are one pass's (simulate runs G of them per step)
  block_fwd = [seconds(2 * block_matmul[j] * tokens, attn_fwd[j]) / G
               for j in range(m.block_groups)]
  return _Compute(total, block_fwd, (seconds(head_flops, 0) + head_mem_s) / G)


def _link_bytes(g: _Groups, shape: _PassShape) -> tuple[int, int]:
  """(host->device, device->host) bytes of a step. Host groups' weights cross twice (forward,
  backward; the embedding's backward needs none), stream groups' optimizer state crosses both
  ways, device groups cross nothing. With G passes the weights and the saved inputs cross G
  times, a host group's gradient comes out G times and its sum goes in G - 1 times."""
  G, blocks = shape.passes, len(g.sizes) - 2
  saved = shape.spilled * shape.saved_input
  # blocks' re-runs fetch their weights again; a frozen block without a backward only once
  fetches = lambda i: (1 + shape.reruns if 0 < i <= blocks and g.modes[i] in ("full", "dx")
                       else 1)
  stream_opt = sum(g.opt[i] for i in g.stream)
  trained = g.params(g.trained(g.host))  # frozen groups send no gradient
  h2d = (G * (sum(4 * g.sizes[i] * fetches(i) for i in g.host) + saved)
         + (G - 1) * 4 * trained + stream_opt)
  d2h = G * (4 * trained + saved) + stream_opt
  return h2d, d2h


@dataclasses.dataclass(frozen=True)
class _Step:
  terms: dict[str, float]  # the roofline's lower-bound terms, seconds
  layers: list[Layer]  # one pass's groups as the schedule simulates them
  link_bytes: int  # bytes that cross between host and device in a step, both ways


def _step_terms(cfg: config_lib.Config, spec: models.ModelSpec, g: _Groups, shape: _PassShape,
                rates: Rates) -> _Step:
  """The step's roofline terms, and the layers the schedule simulates."""
  work = _compute(cfg, spec, g, shape, rates)
  h2d, d2h = _link_bytes(g, shape)
  terms = {
      "compute": work.seconds,
      "host->device": h2d / (rates.h2d_gbps * 1e9),
      "device->host": d2h / (rates.d2h_gbps * 1e9),
      "host optimizer": g.params(g.trained(g.host)) / (rates.host_adamw_gparams * 1e9),
  }
  K = shape.every
  frozen = g.frozen
  # a frozen block's backward: the input's cotangent alone (about half the work), or none
  bwd = {"full": 2 + shape.reruns, "dx": 1 + shape.reruns, "pass": 0.0, "skip": 0.0}
  layers = [Layer(g.sizes[0], 0.0, 0.0, 0, frozen[0])]
  # A block whose input was not kept has its forward re-run in the backward: (K-1)/K of them.
  layers += [Layer(g.sizes[i + 1], fwd, bwd[g.modes[i + 1]] * fwd,
                   shape.saved_input if i % K == 0 and i // K < shape.spilled else 0,
                   frozen[i + 1])
             for i, fwd in enumerate(work.block_fwd_s)]
  layers += [Layer(g.sizes[-1], work.head_s, 0.0, 0, frozen[-1])]
  return _Step(terms, layers, h2d + d2h)


def _simulated(cfg: config_lib.Config, layers: list[Layer], tiers: list[str], rates: Rates,
               grad_queue: int, shape: _PassShape, optimistic: bool) -> tuple[float, float]:
  """The engine's schedule simulated: (at the in-step host AdamW rate, at the best one measured;
  the first twice unless `optimistic`)."""
  e, o = cfg.engine, cfg.optim
  clip = ("host_buffer" if shape.clip_held else o.clip_mode) if o.clip_norm else None
  run = lambda r: simulate(layers, tiers, r, e.inflight_layers, grad_queue, clip=clip,
                           passes=shape.passes, moment_bytes=o.moment_bytes)
  sched = run(rates)
  if not optimistic:
    return sched, sched
  return sched, run(dataclasses.replace(
      rates, host_adamw_in_step_gparams=rates.host_adamw_in_step_best_gparams))


CHECKPOINT_FILE_BYTES = 64 * 2**10  # orbax's metadata files per layer group (a bound)
EXPORT_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def disk_bytes(cfg: config_lib.Config, state_bytes: int, groups: int, params: int) -> dict[str, int]:
  """Disk bytes of the files the run writes, each item only where the run writes it.

  With train.checkpoint_dir: one checkpoint (every group's weights and optimizer state,
  uncompressed: a bound, as orbax's compression of trained weights gains little) and the most on
  disk at once: the run saves every train.checkpoint_every steps and at its last step (one save
  where the two coincide), and holds train.keep_checkpoints committed plus the one being written
  (every save when keep is 0). With train.export_dir: a Hugging Face export at train.export_dtype.
  """
  t = cfg.train
  out = {}
  if t.checkpoint_dir:
    one = state_bytes + CHECKPOINT_FILE_BYTES * (groups + 1)
    saves = -(-t.steps // t.checkpoint_every) if t.checkpoint_every else 1
    at_once = min(t.keep_checkpoints + 1, saves) if t.keep_checkpoints else saves
    out.update({"one checkpoint": one, "checkpoints at once": at_once,
                "checkpoints kept": at_once * one})
  if t.export_dir:
    out["export"] = params * EXPORT_DTYPE_BYTES[t.export_dtype] + 2**20  # + config, tokenizer
  return out


def check(plan: Plan) -> None:
  """Raises PlanError (one line: the numbers and what to change) if the plan does not fit."""
  if not plan.fits_host:
    state = plan.host["master weights"] + plan.host["optimizer state"]
    # fp32 AdamW moments (twice the weights' bytes): 8-bit ones take a quarter, bfloat16 half
    halve = ("optim.state_dtype=int8 (or bfloat16), "
             if plan.host["optimizer state"] > 1.5 * plan.host["master weights"] else "")
    raise PlanError(
        f"does not fit in host memory: needs {plan.host_total / GiB:.1f} GiB "
        f"({state / GiB:.1f} GiB state of {plan.params / 1e9:.2f}B params + "
        f"{(plan.host_total - state) / GiB:.1f} GiB buffers, "
        f"{plan.device_state_layers} groups' state in device memory), limit "
        f"{plan.host_limit / GiB:.1f} GiB; use {halve}a smaller model, fewer engine.activations on the host, "
        f"optim.clip_mode=recompute, more engine.device_state_layers or a lower engine.grad_queue")
  if not plan.fits_pool:
    raise PlanError(
        f"does not fit in the pinned host pool: needs {pinned_pool_bytes(plan.pinned) / GiB:.1f} "
        f"GiB, cap {plan.pinned_cap / GiB:.1f} GiB (set before the backend started); call "
        f"mtjax.launch.plan_run before anything touches jax, or set "
        f"XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB")
  if not plan.fits_device:
    top = max(plan.device, key=plan.device.get)
    raise PlanError(
        f"does not fit in device memory: needs {plan.device_total / GiB:.1f} GiB (largest: {top} "
        f"{plan.device[top] / GiB:.1f} GiB), limit {plan.device_limit / GiB:.1f} GiB; lower "
        f"train.batch or engine.micro_batch, use engine.activations=auto, "
        f"engine.activations_every=auto, engine.seq_tile or fewer "
        f"engine.device_state_layers / engine.device_update_layers")


# Each attention kernel's rate, forward and backward, as a share of cuDNN's fused kernel on plain
# causal rows of 128-wide heads (rates.attention_tflops), fitted to every kernel timed side by side
# on one H100 (benchmarks/attention_kernels.py; the rows and the shares: docs/performance.md, the
# planner's constants). Below 128 the kernels cost about as much per score as at 128 (softmax, not
# matmuls), so their share on FLOPs falls with the width; XLA's scores-whole attention is bound by
# its [B, N, T, T] fp32 scores' traffic. Not modelled: a sliding window.
MASK_SHARE = 0.60
WIDE_SHARE = 0.86  # cuDNN's share at heads wider than 128 (256)
BLOCKWISE_WIDTH = 700  # the blockwise kernel's share: width / 700, at most BLOCKWISE_MAX_SHARE
BLOCKWISE_MAX_SHARE = 0.24
XLA_WIDTH = 1530  # XLA's share: width / 1530


def kernel_efficiency(kernel: str, head_width: int) -> float:
  """The kernel's share of the fused rate on the causal pairs (the shares above)."""
  fused = min(1.0, head_width / 128) if head_width <= 128 else WIDE_SHARE
  return {"cudnn": fused, "cudnn-mask": MASK_SHARE * fused,
          "blockwise": min(BLOCKWISE_MAX_SHARE, head_width / BLOCKWISE_WIDTH),
          "xla": min(1.0, head_width / XLA_WIDTH)}[kernel]


def carries_documents(cfg: config_lib.Config) -> bool:
  """Whether the run's batches carry document ids (a mask the attention keeps to): the
  objective's answer (prepared documents, packed or padded, do; preference pairs do not)."""
  return objectives.get(cfg.train).carries_documents(cfg.data)


def attention_kernels(cfg: config_lib.Config, rates: Rates) -> list[str]:
  """Each layer's attention kernel as the engine picks it on the planned device: `auto` resolved
  (models.layers.choose_attention), then per layer (layer_kernel): prepared data (not preference
  pairs) carries document ids, which cuDNN takes as a mask, as are a chunked layer's chunks; a
  soft-cap or sinks take the blockwise kernel."""
  from mtjax.models import layers  # flax: loaded when a plan is made
  m, e, t = cfg.model, cfg.engine, cfg.train
  widths = models.spec(m).attention_widths
  impl = layers.choose_attention(e.attention, "gpu" if rates.accelerator else "cpu",
                                 rates.compute_capability, e.compute_dtype, widths, t.seq)
  documents = carries_documents(cfg)
  return [layers.layer_kernel(impl, seq=t.seq, packed=documents or m.layer_type(i) == "chunked",
                              softcap=m.attn_softcap is not None, sinks=bool(m.attention_sinks),
                              same_widths=widths[1] == widths[2]) for i in range(m.layers)]
