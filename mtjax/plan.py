"""`python -m mtjax.plan --config FILE [key.path=value ...]`: will this run fit, and how fast can it go?

The plan places every layer group's state (host RAM, streamed through the device, or held in
device memory: see mtjax.store), counts host and device bytes, and predicts the step time from
a simulation of the engine's schedule. Host figures are arithmetic on the config; the layer
executables' device bytes come from XLA's analysis of the compiled code once the backend runs.
`mtjax.train` runs the same plan first (`prepare`) and refuses a run that does not fit, before it
allocates anything.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

from mtjax import cli, config as config_lib, models

GiB = 2**30
# Python, jax/XLA, the CUDA runtime and compiled code: measured on the H200 box (7B and 9B runs:
# peak RSS minus the other items was 3.5-6.4 GiB), so the plan errs high by up to 3 GiB. Without an
# accelerator (the CPU backend, no CUDA runtime, no pinned pool) a much smaller allowance.
RUNTIME_HOST_BYTES = 6.5 * GiB
RUNTIME_HOST_BYTES_CPU = 1 * GiB
# Host memory that grows with the state held in device memory, not yet explained item by item:
# the 14.8B run with 94.8 GiB of device-tier state peaked at 101.6 GiB RSS against 91.6 GiB of
# the other items (benchmarks/results/store/), about 10.5% of the device-tier bytes; a 17.0B run
# planned without this allowance at 125.7 of 125.8 GiB was killed for host memory.
DEVICE_TIER_HOST_SHARE = 0.11
# XLA's GPU allocator (BFC) hands a request a free chunk of up to twice its size, unsplit, when the
# rest would be under 128 MiB, and counts the whole chunk in use; the saved block inputs live
# longest, among short-lived buffers of other sizes. Measured on the H200 (1B and 3.37B at 32k: the
# device peak 0.72 and 1.6 GiB over the plan's items): about this share of min(input, 128 MiB) per
# saved input in device memory.
SAVED_INPUT_ROUNDING = 0.3


def pinned_pool_bytes(pinned: int) -> int:
  """The cap mtjax gives XLA's pinned host pool for `pinned` bytes of pinned buffers. The pool grows
  in doubling regions up to its cap, so a run that pins more than half of it ends up holding it all:
  10% plus 2 GiB of headroom against fragmentation."""
  return math.ceil((pinned * 1.1 + 2 * GiB) / GiB) * GiB


class PlanError(RuntimeError):
  """The run does not fit; the message gives the numbers and what to change."""


def param_counts(m: config_lib.ModelConfig) -> dict[str, int]:
  """Parameters: `total`, `active` per token (a mixture's unchosen experts left out), and one
  group's of each layer kind ("embed", "head", each block kind: mtjax.models.spec)."""
  return models.spec(m).counts


def flops(cfg: config_lib.Config) -> dict[str, float]:
  """FLOPs of one training step at the config's batch and sequence length.

  `model`: 6 x active parameters x tokens, the usual count (attention's own matmuls left out; a
  mixture of experts counts the experts a token uses).
  `attention`: those matmuls, scores and values, forward and backward (3 x the forward), counting
  only the causal pairs a flash kernel computes, and for sliding layers those in the window.
  `with_attention`: their sum, the work a long context is judged by."""
  m, t = cfg.model, cfg.train
  spec = models.spec(m)
  model = 6 * spec.counts["active"] * t.batch * t.seq
  attention = 3 * spec.attention_forward_flops(t.batch, t.seq, causal_half=True)
  return {"model": float(model), "attention": float(attention),
          "with_attention": float(model + attention)}


def hf_staging_bytes(cfg: config_lib.Config) -> int:
  """Host bytes a Hugging Face import (`model.from_hf`, at the start) or export
  (`train.export_dir`, at the end) holds beside the state, the larger of the two. The import
  writes one group at a time (a group's fp32 buffer, its tensors read through memory maps in
  chunks); the export gathers up to one shard of tensors in the export dtype before writing it,
  beside one group's fp32 weights copied from its tier."""
  from mtjax import hf  # noqa: PLC0415 - numpy and the safetensors format only; no backend
  pc = param_counts(cfg.model)
  group = 4 * max(v for k, v in pc.items() if k not in ("total", "active"))
  imported = group if cfg.model.from_hf else 0
  exported = 0
  if cfg.train.export_dir:
    width = 4 if cfg.train.export_dtype == "float32" else 2
    exported = min(hf.MAX_SHARD_BYTES, width * pc["total"]) + group
  return max(imported, exported)


# An AdamW update on the device reads weights, gradient and both moments and writes weights and
# moments back, all fp32: 28 bytes per parameter through device memory.
DEVICE_UPDATE_BYTES = 28
# The LM head's loss step moves each chunk's fp32 logits through device memory about six times
# (written, max and logsumexp, softmax, its gradient written, read by two matmuls): bytes per
# (token, vocabulary entry), beside its matmuls; a 128k vocabulary makes this 10-30% of the head.
HEAD_LOGIT_BYTES = 24


@dataclasses.dataclass(frozen=True)
class Rates:
  """Machine rates for the step-time prediction (defaults: the lent H200 box, measured)."""
  matmul_tflops: float = 600.0  # bf16 dense matmul through jax.jit
  # cuDNN's fused causal attention, forward and backward, bf16, head_dim 128: 465-476 TFLOP/s
  # measured on the H200 at 128k-512k tokens (benchmarks/results/session6/context)
  attention_tflops: float = 470.0
  h2d_gbps: float = 53.0  # pinned host -> device
  d2h_gbps: float = 53.0  # device -> pinned host
  # The fused in-place AdamW alone, 16 cores (4.4-5.6 Gparam/s measured): the roofline's figure.
  host_adamw_gparams: float = 4.4
  # The same loop inside a training step, beside the device's compute and copies: fitted to the
  # host path (every group's state on the host) on the H200 boxes lent now, the 3.37B shape at
  # 8 x 2048 (1.269 s) and the 8B (3.090 s); with it the schedule predicts both within 1%. An
  # earlier box ran it at 4.2 (benchmarks/results/record/): the schedule's optimistic end.
  host_adamw_in_step_gparams: float = 3.4
  host_adamw_in_step_best_gparams: float = 4.2
  # The device's memory bandwidth (a large device-to-device copy, bytes read and written: 4.3 TB/s
  # on the H200): an update on the device and the LM head's softmax are bound by it.
  hbm_gbps: float = 4300.0
  accelerator: bool = True  # False: the CPU backend runs the layers (no CUDA runtime, no pinned pool)


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
    working: device bytes of the layer executables from `mtjax.engine.compiled_memory`; without
      it they are estimated by formula (before the backend starts).
    opt_bytes: optimizer-state bytes per group kind; default AdamW's 8 B/param.
    pinned_cap: the pinned pool's cap when it is fixed already (the backend has started).
  """
  refuse_by_size(cfg, host_limit, device_limit)
  if "auto" in (cfg.engine.activations_every, cfg.engine.activations):
    return _checkpoints(cfg, lambda c: make(c, host_limit, device_limit, rates, working,
                                            opt_bytes, pinned_cap))
  e = cfg.engine
  G = cfg.model.layers + 2
  plans: dict[tuple[int, int, int], Plan] = {}
  queue = 4 if e.grad_queue == "auto" else e.grad_queue

  def build(n_state, n_upd, q=None, optimistic=False):
    q = queue if q is None else q
    key = (n_state, n_upd, q, optimistic)
    if key not in plans:  # the search compares pessimistic schedules; the chosen gets both
      plans[key] = _make(
          cfg, ["device"] * n_state + ["stream"] * n_upd + ["host"] * (G - n_state - n_upd),
          host_limit, device_limit, rates, working, opt_bytes, pinned_cap, q, optimistic)
    return plans[key]

  def final(p):
    full = build(p.device_state_layers, p.device_update_layers, p.grad_queue, optimistic=True)
    return dataclasses.replace(full, runner_up=p.runner_up)

  plan = _place(cfg, build, G, host_limit, device_limit, rates)
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
  return final(dataclasses.replace(chosen, runner_up=plan.runner_up))


GRAD_QUEUES = (2, 4, 6, 8, 12, 16, 24)  # what engine.grad_queue=auto chooses among
ACTIVATIONS_EVERY = (1, 2, 3, 4, 6, 8, 12, 16)  # what engine.activations_every=auto chooses among


def _checkpoints(cfg: config_lib.Config, make_plan) -> Plan:
  """Where the blocks' saved inputs go (`engine.activations_every` and `engine.activations`: auto).

  `activations_every: auto` alone keeps every block's input while the device holds them, else the
  fewest kept that fit. `activations: auto` spills the fewest kept inputs to pinned host memory
  that make both memories fit (copied out in the forward and back in the backward, overlapped with
  compute); with both auto, each K's fewest spills compete on the simulated step (spilling costs
  link time, re-running a segment costs compute), the search ending at the first K that needs no
  spill (a larger one only re-computes more). Spill counts are tried from 0 up: device bytes need
  not fall as more are spilled, since host bytes grow and `device_state_layers: auto` may then move
  state to the device."""
  e, L = cfg.engine, cfg.model.layers
  with_ = lambda k, a: make_plan(dataclasses.replace(cfg, engine=dataclasses.replace(
      e, activations_every=k, activations=a)))
  fits = lambda p: p.fits_device and p.fits_host and p.fits_pool
  best = plan = None
  for k in ACTIVATIONS_EVERY if e.activations_every == "auto" else (e.activations_every,):
    if e.activations != "auto":
      plan = with_(k, e.activations)
      if plan.fits_device:
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
# device's (XLA's allocator) and the host's (the runtime) peaks err by a few percent.
DEVICE_SPARE, HOST_SPARE = 0.05, 0.03


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
  """Raises PlanError when the state alone (weights and AdamW moments, 12 B/param) exceeds host
  and device memory together: byte arithmetic on the config, before anything is laid out or
  searched (an absurd size is refused at once)."""
  if host_limit is None:
    return
  m = cfg.model
  D = m.hidden
  # A lower bound on the parameters without a layout: embedding (and head), each block's query
  # and output projections and its feed-forward's matrices (a mixture's every expert).
  mlp = 3 * D * m.ffn
  if m.moe is not None:
    mlp = min(mlp, 3 * D * m.moe.expert_ffn * m.moe.experts)
  params = m.vocab_size * D * (1 if m.tie_embeddings else 2) + m.layers * (
      2 * D * m.heads * m.dim_per_head + mlp)
  state = 12 * params
  total = host_limit + (device_limit or 0) * devices_of(cfg)
  if state > total:
    raise PlanError(f"does not fit in host memory and device memory together: the weights and "
                    f"optimizer state alone need at least {state / GiB:,.1f} GiB ({params / 1e9:,.2f}B "
                    f"params x 12 B/param) where {total / GiB:,.1f} GiB are available; use a "
                    f"smaller model")


def devices_of(cfg: config_lib.Config, available: int | None = None) -> int:
  """The data-parallel device count: `engine.devices`, or all `available` (default 1)."""
  return (available or 1) if cfg.engine.devices == "all" else cfg.engine.devices


def _make(cfg: config_lib.Config, tiers: list[str], host_limit, device_limit, rates: Rates,
          working: dict | None, opt_bytes: dict | None, pinned_cap: int | None,
          grad_queue: int, optimistic: bool = True) -> Plan:
  m, e, t, o = cfg.model, cfg.engine, cfg.train, cfg.optim
  nd = devices_of(cfg)  # resolved by the caller
  spec = models.spec(m)
  pc = spec.counts
  P, L = pc["total"], m.layers
  kinds = [k for _, k in spec.groups]
  sizes = [pc[k] for k in kinds]
  ob = [(opt_bytes or {}).get(k, 8 * pc[k]) for k in kinds]  # optimizer state bytes per group
  on = lambda tier: [i for i, tr in enumerate(tiers) if tr == tier]
  host_g, stream_g, dev_g = on("host"), on("stream"), on("device")
  act = 2 if e.compute_dtype == "bfloat16" else 4
  tokens = t.batch * t.seq
  top = lambda group_sizes, k: sum(sorted(group_sizes, reverse=True)[:k])  # the k largest
  largest_stream = max((sizes[i] for i in stream_g), default=0)
  largest_stream_opt = max((ob[i] for i in stream_g), default=0)
  largest_dev = max((sizes[i] + ob[i] // 4 for i in dev_g), default=0)
  streamed = [sizes[i] for i in host_g + stream_g]
  checkpoint = t.batch * t.seq * m.hidden * act  # one block's saved input (all devices)
  K = e.activations_every
  kept = -(-L // K)  # blocks whose input the forward keeps
  spilled = e.activations_on_host(L)  # the first kept inputs wait in pinned host memory
  # Device figures are the busiest device's: the batch splits evenly, device and stream groups
  # live on home devices round-robin within their tier (mtjax.store.homes), the rest is replicated.
  busiest = lambda per_group: max(sum(per_group[k::nd]) for k in range(nd)) if per_group else 0

  host = {
      "master weights": 4 * sum(streamed),
      "optimizer state": sum(ob[i] for i in host_g + stream_g),
      # at most grad_queue queued, one being applied, one landing
      "gradients in flight": 4 * top([sizes[i] for i in host_g], grad_queue + 2),
      "clip gradient buffer": (4 * sum(sizes[i] for i in host_g)
                               if (o.clip_norm and o.clip_mode == "host_buffer") else 0),
      "stream staging": 2 * (4 * largest_stream + largest_stream_opt) if stream_g else 0,
      "device-tier staging (sync, checkpoints)": 4 * largest_dev if dev_g else 0,
      "activations on host": spilled * checkpoint,
      "import / export staging (start / end)": hf_staging_bytes(cfg),
      "runtime": RUNTIME_HOST_BYTES if rates.accelerator else RUNTIME_HOST_BYTES_CPU,
      "device-tier host allowance (measured)": int(DEVICE_TIER_HOST_SHARE * sum(
          4 * sizes[i] + ob[i] for i in dev_g)) if rates.accelerator else 0,
  }
  pinned = (host["master weights"] + sum(ob[i] for i in stream_g) + host["gradients in flight"]
            + host["clip gradient buffer"] + host["stream staging"]
            + host["device-tier staging (sync, checkpoints)"] + host["activations on host"])
  host["pinned pool headroom"] = pinned_pool_bytes(pinned) - pinned if rates.accelerator else 0

  device = {
      "weights and optimizer state (device tier)": busiest([4 * sizes[i] + ob[i] for i in dev_g]),
      "resident weights (stream tier)": busiest([4 * sizes[i] for i in stream_g]),
      "optimizer state in flight (stream tier)": 2 * 2 * largest_stream_opt,
      "streamed weights": 4 * top(streamed, e.inflight_layers + 1),
      "gradients": 4 * top(sizes, 2),
      # kept inputs in device memory (and two in flight from the host when some are spilled),
      # and with K > 1 one segment's re-computed inputs plus the block's own at the turn between
      # two segments
      "saved activations": ((kept - spilled + (2 if spilled else 0))
                            + (K + 1 if K > 1 else 0)) * checkpoint // nd,
      # (accelerators only) the allocator's rounding of the saved inputs in device memory
      "allocator rounding (measured)": int(SAVED_INPUT_ROUNDING * min(checkpoint // nd, 128 * 2**20)
                                           * (kept - spilled)) if rates.accelerator else 0,
      # clip_mode=host_buffer: stream and device groups' gradients (and stream groups' prefetched
      # state) wait on the device until the global norm is known
      "clip-held gradients": (sum(4 * sizes[i] for i in stream_g + dev_g)
                              + busiest([ob[i] for i in stream_g])
                              if (o.clip_norm and o.clip_mode == "host_buffer") else 0),
  }
  if working is not None:
    # The largest executable's temporaries and outputs (its arguments are the items above).
    device["layer executables (compiled)"] = max(w["temp"] + w["output"] for w in working.values())
  else:
    mb = e.micro_batch or max(1, t.batch // nd)
    D, F, V = m.hidden, m.ffn, m.vocab_size
    if m.moe is not None:  # a token's experts' inner width, and its sorted copies
      F = max(F, m.moe.experts_per_token * (m.moe.expert_ffn + 2 * D) + m.moe.shared_width)
    H = m.heads
    # One block's backward over one micro-batch: its forward re-run under vjp keeps about a dozen
    # [mb, T, D]-sized and three [mb, T, F]-sized intermediates, and as many cotangents; tiled
    # over the sequence (engine.seq_tile), about eight [mb, T, D] (input, q, k, v, attention
    # output, residuals) and one tile's share of the rest.
    tile = min(e.seq_tile or t.seq, t.seq)
    layer_acts = 2 * mb * act * (t.seq * (12 * D + 3 * F) if tile == t.seq
                                 else t.seq * 8 * D + tile * (4 * D + 3 * F))
    attn = (mb * H * t.seq * 4 * 2 if e.attention != "xla" and e.compute_dtype == "bfloat16"
            else 3 * mb * H * t.seq * t.seq * 4)  # flash: row stats; XLA: scores, probs, their grad
    chunk = min(e.loss_chunk, tokens)
    device["layer working set (estimated)"] = max(layer_acts + attn + 3 * tokens * D * act,
                                                  chunk * V * (4 + 4 + act) + 8 * D * V)

  D, V = m.hidden, m.vocab_size
  causal = 0.5 if e.compute_dtype == "bfloat16" and e.attention != "xla" else 1.0
  rerun = 1 + (K - 1) / K  # a block's forward runs again in the backward: once, or twice in a segment
  # Seconds for matmul FLOPs and attention FLOPs: a fused (flash) attention kernel runs below the
  # dense matmul rate; XLA's attention is plain matmuls.
  attn_rate = rates.attention_tflops if causal < 1 else rates.matmul_tflops
  seconds = lambda matmul, attn: (matmul / rates.matmul_tflops + attn / attn_rate) / (nd * 1e12)
  N, dqk, dv = spec.attention_widths
  # each block's matrix parameters a token uses, and its attention matmuls in the forward
  block_matmul = [spec.matmul_params(kinds[i + 1]) for i in range(L)]
  attn_fwd = [2 * N * (dqk + dv) * spec.attention_pairs(i, t.batch, t.seq, causal < 1)
              for i in range(L)]
  # forward, its re-runs, backward (2x the forward): matmuls and causal attention
  compute_s = (seconds((6 + 2 * rerun) * sum(block_matmul) * tokens + 6 * D * V * tokens,
                       (3 + rerun) * sum(attn_fwd))
               + HEAD_LOGIT_BYTES * V * tokens / (nd * rates.hbm_gbps * 1e9)
               + DEVICE_UPDATE_BYTES * sum(sizes[i] for i in stream_g + dev_g) / (rates.hbm_gbps * 1e9))
  ckpt_link = spilled * checkpoint
  # Host groups' weights cross twice (forward, backward; the embedding's backward needs none),
  # stream groups' optimizer state crosses both ways, device groups cross nothing.
  twice = lambda i: 1 + rerun if 0 < i <= L else 1  # blocks' re-runs fetch their weights again
  h2d = (sum(4 * sizes[i] * twice(i) for i in host_g) + sum(ob[i] for i in stream_g) + ckpt_link)
  d2h = 4 * sum(sizes[i] for i in host_g) + sum(ob[i] for i in stream_g) + ckpt_link
  host_updated = sum(sizes[i] for i in host_g)
  step_s = {
      "compute": compute_s,
      "host->device": h2d / (rates.h2d_gbps * 1e9),
      "device->host": d2h / (rates.d2h_gbps * 1e9),
      "host optimizer": host_updated / (rates.host_adamw_gparams * 1e9),
  }
  block_fwd = [seconds(2 * block_matmul[i] * tokens, attn_fwd[i]) for i in range(L)]
  layers = [Layer(sizes[0], 0.0, 0.0, 0)]
  # A block whose input was not kept has its forward re-run in the backward: (K-1)/K of them.
  layers += [Layer(sizes[i + 1], block_fwd[i], (2 + rerun) * block_fwd[i],
                   checkpoint if i % K == 0 and i // K < spilled else 0) for i in range(L)]
  head_s = seconds(6 * D * V * tokens, 0) + HEAD_LOGIT_BYTES * V * tokens / (nd * rates.hbm_gbps * 1e9)
  layers += [Layer(sizes[-1], head_s, 0.0, 0)]
  if not rates.accelerator:  # the CPU backend's "device" memory is host RAM
    host["device memory (CPU backend: host RAM)"] = sum(device.values())
  fits = ((host_limit is None or sum(host.values()) <= host_limit)
          and (device_limit is None or sum(device.values()) <= device_limit))
  if fits:  # the simulation costs O(layers); a plan that does not fit needs none
    clip = o.clip_mode if o.clip_norm else None
    sched = simulate(layers, tiers, rates, e.inflight_layers, grad_queue, clip=clip)
    best = dataclasses.replace(rates,
                               host_adamw_in_step_gparams=rates.host_adamw_in_step_best_gparams)
    sched_best = (simulate(layers, tiers, best, e.inflight_layers, grad_queue, clip=clip)
                  if optimistic else sched)
  else:
    sched = sched_best = math.inf
  return Plan(P, tuple(tiers), host, device, pinned, step_s, host_limit, device_limit, sched,
              min(sched, sched_best), working is not None, pinned_cap, grad_queue, devices=nd,
              activations_every=K, activations_on_host=spilled,
              device_tier_bytes=sum(4 * sizes[i] + ob[i] for i in dev_g), family=m.family,
              active_params=pc["active"])


@dataclasses.dataclass(frozen=True)
class Layer:
  """One layer group as the schedule sees it: parameters, device seconds forward and backward
  (the head's whole loss step counts as forward), saved-input bytes that cross the link."""
  params: int
  fwd_s: float
  bwd_s: float
  checkpoint_bytes: int


def simulate(layers: list[Layer], tiers, rates: Rates, inflight: int = 2, grad_queue: int = 4,
             overlap: bool = True, steps: int = 4, clip: str | None = None) -> float:
  """Predicted step time of the engine's schedule: four in-order lanes (host->device copies, device
  compute, device->host copies, the host optimizer) and the engine's dependencies between them.

  `tiers` gives each group's tier (an int k means: the first k groups streamed, the rest host).
  Forward, group g: host groups' weights are copied once their last update is done (stream and
  device groups' weights are on the device already), at most `inflight` layers ahead of the
  device. Backward, in reverse: weights (or, for stream groups, the optimizer state) come in, the
  gradient (or the optimizer state) goes out, and the host optimizer takes host groups in order;
  the device waits once more than `grad_queue` updates are queued. Device groups move nothing.
  Without overlap every item runs alone. Exact clipping (`clip`, optim.clip_mode) changes the
  backward: `host_buffer` applies every update only once the backward has ended (the host
  optimizer cannot overlap it); `recompute` runs a norm-only backward before the applying one.
  Steady state: the last step's length.
  """
  n = len(layers)
  if isinstance(tiers, int):
    tiers = ["stream"] * tiers + ["host"] * (n - tiers)
  h2d_rate, d2h_rate = rates.h2d_gbps * 1e9, rates.d2h_gbps * 1e9
  opt_rate = rates.host_adamw_in_step_gparams * 1e9
  hbm_rate = rates.hbm_gbps * 1e9
  free = {"h2d": 0.0, "compute": 0.0, "d2h": 0.0, "opt": 0.0}
  updated = [0.0] * n  # when group g's last update finished
  moments_back = [0.0] * n  # when a stream group's optimizer state was last back in host memory
  starts = []

  def run(lane, ready, dur):
    start = max(free[lane], ready)
    if not overlap:
      start = max(start, *free.values())
    free[lane] = start + dur
    return free[lane]

  def _update(g, ready):
    """Group g's update, its gradient ready at `ready` (on the host for host groups)."""
    lay, tier = layers[g], tiers[g]
    if tier == "stream":  # m and v go back; the device's new weights stay for the next forward
      updated[g] = run("compute", ready, lay.params * DEVICE_UPDATE_BYTES / hbm_rate)
      moments_back[g] = run("d2h", updated[g], 8 * lay.params / d2h_rate)
    elif tier == "device":
      updated[g] = run("compute", ready, lay.params * DEVICE_UPDATE_BYTES / hbm_rate)
    else:
      updated[g] = run("opt", ready, lay.params / opt_rate)
      opt_done.append(updated[g])

  for _ in range(steps):
    host_t = free["compute"]  # the host syncs on the loss and norms at the end of a step
    starts.append(host_t)
    done = [0.0] * n  # forward compute done
    for g, lay in enumerate(layers):
      gate = done[g - 1 - inflight] if g - 1 - inflight >= 0 else host_t
      arrived = (updated[g] if tiers[g] != "host" else
                 run("h2d", max(updated[g], gate), 4 * lay.params / h2d_rate))
      done[g] = run("compute", max(arrived, gate), lay.fwd_s)
      if lay.checkpoint_bytes:
        run("d2h", done[g], lay.checkpoint_bytes / d2h_rate)
    # clip="recompute": a norm-only backward first (nothing updated), then the applying one.
    for applying in ((False, True) if clip == "recompute" else (True,)):
      opt_done: list[float] = []  # host updates of this backward, in order
      held = []  # clip="host_buffer": (group, gradient landed) until the backward has ended
      bwd_done = [0.0] * n
      for g in reversed(range(n)):
        gate = opt_done[-grad_queue - 1] if len(opt_done) > grad_queue else host_t
        if g + 2 + inflight < n:
          gate = max(gate, bwd_done[g + 2 + inflight])
        lay, tier = layers[g], tiers[g]
        streamed = tier == "stream" and applying
        if g == n - 1:  # the head's gradient exists once its (forward) step ran
          computed = done[-1]
          if streamed:  # its moments, for the device update, once last step's are back
            run("h2d", max(gate, moments_back[g]), 8 * lay.params / h2d_rate)
        else:
          # weights (the embedding's backward needs none), or only the moments when streamed
          nbytes = {"stream": 8 * lay.params * applying, "host": 4 * lay.params * (g > 0),
                    "device": 0}[tier] + lay.checkpoint_bytes
          ready = max(gate, moments_back[g]) if streamed else gate
          arrived = run("h2d", ready, nbytes / h2d_rate) if nbytes else ready
          computed = run("compute", max(arrived, gate), lay.bwd_s)
        bwd_done[g] = computed
        if not applying:
          continue
        landed = run("d2h", computed, 4 * lay.params / d2h_rate) if tier == "host" else computed
        if clip == "host_buffer":
          held.append((g, landed))
          continue
        _update(g, landed)
      end = free["compute"]  # the global norm is known: held gradients are applied in order
      for g, landed in held:
        _update(g, max(landed, end))
  return starts[-1] - starts[-2]


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


def device_memory_limit(device) -> int | None:
  stats = device.memory_stats() if hasattr(device, "memory_stats") else None
  return None if not stats else stats.get("bytes_limit")


def probe_device_memory() -> int | None:
  """Total memory of the first GPU, read without starting the jax backend (nvidia-smi), or None."""
  if os.environ.get("JAX_PLATFORMS", "").strip() == "cpu":
    return None
  try:
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=20)
  except (OSError, subprocess.SubprocessError):
    return None
  first = out.stdout.strip().splitlines()[:1]
  return int(float(first[0])) * 2**20 if out.returncode == 0 and first else None


def backend_started() -> bool:
  from jax._src import xla_bridge  # noqa: PLC0415 - only to ask whether it has started
  return bool(getattr(xla_bridge, "_backends", None))


# The share of a GPU's memory XLA's allocator may take (its own default is 75%): the rest holds the
# CUDA context, cuDNN's workspace and the pinned-pool bookkeeping.
DEVICE_MEMORY_FRACTION = 0.92


def prepare(cfg: config_lib.Config, host_limit: int | None = None
            ) -> tuple[config_lib.Config, Plan]:
  """Plans a run and makes every placement choice once; call it before anything touches jax.

  Before the backend starts it caps XLA's pinned host pool near what the plan pins and sets the
  device memory the run may use (`engine.device_memory_gb`, else 92% of the GPU); library users
  call it too (examples/custom_loop.py). After the backend starts it re-plans with the device's
  real limit and the layer executables' device bytes from XLA's analysis of the compiled code, and
  refuses (PlanError) a run that does not fit, before any state is allocated.

  Returns:
    (the config with a concrete placement, the plan).
  """
  import jax  # noqa: PLC0415 - imported late: the environment must be set before the backend starts

  host_limit = host_memory_limit() if host_limit is None else host_limit
  fresh = not backend_started()
  pinned_cap = None
  if fresh:
    total, count = probe_device_memory(), probe_device_count()
    first_cfg = _with_devices(cfg, devices_of(cfg, count))
    limit = None
    if total is not None:
      want = cfg.engine.device_memory_gb
      frac = min(want * GiB / total, 1.0) if want else DEVICE_MEMORY_FRACTION
      os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{frac:.4f}")
      limit = int(total * float(os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"]))
    first = make(first_cfg, host_limit, limit, Rates(accelerator=total is not None))
    configure_pinned_pool(first.pinned)
  device = jax.local_devices()[0]
  accel = device.platform != "cpu"
  n = devices_of(cfg, len(jax.local_devices()))
  if n > len(jax.local_devices()):
    raise PlanError(f"engine.devices: {n} requested, this process sees {len(jax.local_devices())}")
  mb = cfg.engine.micro_batch or 1
  n_all = n * jax.process_count()  # every process's devices share the global batch
  if cfg.train.batch % (n_all * mb):
    raise PlanError(f"train.batch: {cfg.train.batch} sequences do not split evenly over {n_all} "
                    f"device(s)" + (f" in micro-batches of {mb}" if mb > 1 else "")
                    + "; set engine.devices or the batch")
  cfg = _with_devices(cfg, n)
  if accel:
    pinned_cap = int(os.environ.get("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", "64")) * GiB
  from mtjax import engine as engine_lib, optimizer as opt_lib  # noqa: PLC0415
  # The layer executables' device bytes from XLA's own analysis; on the CPU backend "device" memory
  # is host memory, nothing bounds it apart from the host, and the estimate serves (each compile
  # costs seconds there).
  working = engine_lib.compiled_memory(cfg, device, n_all) if accel else None
  rule = opt_lib.UpdateRule(cfg.optim, cfg.decay_steps)
  opt_bytes = {k: rule.state_bytes(lay) for k, lay in models.spec(cfg.model).layouts.items()}
  plan = make(cfg, host_limit, device_memory_limit(device), Rates(accelerator=accel), working,
              opt_bytes, pinned_cap)
  check(plan)
  return plan.resolve(cfg), plan


def _with_devices(cfg: config_lib.Config, n: int) -> config_lib.Config:
  return dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, devices=n))


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


def configure_pinned_pool(pinned: int) -> None:
  """Caps XLA's pinned host pool near `pinned`, the bytes the run pins. The pool grows in doubling
  regions up to its cap, so a loose cap can pin up to twice what is used; a user's own setting
  wins. Must run before the jax backend starts."""
  os.environ.setdefault("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", str(pinned_pool_bytes(pinned) // GiB))


def check(plan: Plan) -> None:
  """Raises PlanError (one line: the numbers and what to change) if the plan does not fit."""
  if not plan.fits_host:
    state = plan.host["master weights"] + plan.host["optimizer state"]
    raise PlanError(
        f"does not fit in host memory: needs {plan.host_total / GiB:.1f} GiB "
        f"({state / GiB:.1f} GiB state of {plan.params / 1e9:.2f}B params + "
        f"{(plan.host_total - state) / GiB:.1f} GiB buffers, "
        f"{plan.device_state_layers} groups' state in device memory), limit "
        f"{plan.host_limit / GiB:.1f} GiB; use a smaller model, fewer engine.activations on the host, "
        f"optim.clip_mode=recompute, more engine.device_state_layers or a lower engine.grad_queue")
  if not plan.fits_pool:
    raise PlanError(
        f"does not fit in the pinned host pool: needs {pinned_pool_bytes(plan.pinned) / GiB:.1f} "
        f"GiB, cap {plan.pinned_cap / GiB:.1f} GiB (set before the backend started); call "
        f"mtjax.plan.prepare before anything touches jax, or set XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB")
  if not plan.fits_device:
    top = max(plan.device, key=plan.device.get)
    raise PlanError(
        f"does not fit in device memory: needs {plan.device_total / GiB:.1f} GiB (largest: {top} "
        f"{plan.device[top] / GiB:.1f} GiB), limit {plan.device_limit / GiB:.1f} GiB; lower "
        f"train.batch or engine.micro_batch, use engine.activations=auto, "
        f"engine.activations_every=auto, engine.seq_tile or fewer "
        f"engine.device_state_layers / engine.device_update_layers")


def format_plan(plan: Plan) -> str:
  lim = lambda x: "unknown" if x is None else f"{x / GiB:.1f} GiB"
  tiers = {t: plan.tiers.count(t) for t in ("device", "stream", "host")}
  active = (f" ({plan.active_params / 1e6:,.1f}M active per token)"
            if plan.active_params not in (None, plan.params) else "")
  lines = [f"{plan.family}: {plan.params / 1e6:,.1f}M parameters{active}; state "
           f"{plan.host_bytes_per_param:.2f} B/param; "
           f"layer groups: {tiers['device']} in device memory, {tiers['stream']} streamed "
           f"(device update), {tiers['host']} on the host",
           f"host memory: {plan.host_total / GiB:.2f} GiB of {lim(plan.host_limit)} "
           f"({'fits' if plan.fits_host else 'DOES NOT FIT'}); pinned {plan.pinned / GiB:.2f} GiB"]
  lines += [f"  {k:<34}{v / GiB:>9.2f} GiB" for k, v in plan.host.items() if v]
  each = f" per device, {plan.devices} devices" if plan.devices > 1 else ""
  lines += [f"device memory{each}: {plan.device_total / GiB:.2f} GiB of {lim(plan.device_limit)} "
            f"({'fits' if plan.fits_device else 'DOES NOT FIT'})"]
  lines += [f"  {k:<34}{v / GiB:>9.2f} GiB" for k, v in plan.device.items() if v]
  lines += [f"predicted step >= {plan.roofline_s:.3f} s (roofline: "
            + ", ".join(f"{k} {v:.3f}" for k, v in plan.step_s.items()) + ")",
            f"predicted step {plan.schedule_best_s:.3f}-{plan.schedule_s:.3f} s (the engine's "
            f"schedule, simulated; host AdamW at its best-worst in-step rate; gradient queue "
            f"{plan.grad_queue}" + (f"; every {plan.activations_every}th block's input kept, the "
                                    f"rest re-computed" if plan.activations_every > 1 else "")
            + (f"; {plan.activations_on_host} kept inputs in host memory"
               if plan.activations_on_host else "") + ")",
            "device bytes of the layer executables: " + ("from XLA's analysis of the compiled code"
                                                         if plan.compiled else "estimated")]
  if plan.runner_up is not None:
    n_dev, n_str, t = plan.runner_up
    lines.append(f"runner-up placement: {n_dev} groups in device memory, {n_str} streamed: "
                 f"{t:.3f} s simulated")
  return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class Machine:
  """A machine to plan for, from a YAML file (configs/machines/h200.yaml): its memories, device
  count and rates; no accelerator needed where the plan is made."""
  device_memory_gb: float  # each device's memory; a run may use DEVICE_MEMORY_FRACTION of it
  devices: int  # devices the step runs on
  host_memory_gb: float  # host RAM the process may use
  matmul_tflops: float  # bf16 dense matmul rate
  h2d_gbps: float  # pinned host -> device
  d2h_gbps: float  # device -> pinned host
  host_adamw_gparams: float  # the host AdamW inside a training step
  attention_tflops: float = 470.0  # fused causal attention, forward and backward
  hbm_gbps: float = 4300.0  # device memory bandwidth

  @classmethod
  def load(cls, path: str | Path) -> "Machine":
    """Reads and checks a machine file; MachineError (one line) on anything wrong."""
    import yaml  # noqa: PLC0415
    try:
      raw = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
      raise config_lib.ConfigError(f"--machine: cannot read {path} ({type(e).__name__})") from None
    if not isinstance(raw, dict):
      raise config_lib.ConfigError(f"--machine: {path} must hold a mapping")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names)
    missing = sorted(f.name for f in dataclasses.fields(cls)
                     if f.default is dataclasses.MISSING and f.name not in raw)
    if unknown or missing:
      raise config_lib.ConfigError(f"--machine: {path}: " + "; ".join(
          ([f"unknown keys {unknown}"] if unknown else [])
          + ([f"missing keys {missing}"] if missing else [])))
    for k, v in raw.items():
      ok = (isinstance(v, int) and not isinstance(v, bool) and v > 0) if k == "devices" else (
          isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < 1e9)
      if not ok:
        raise config_lib.ConfigError(f"--machine: {path}: {k}={v!r} must be a positive number")
    return cls(**raw)

  def rates(self) -> Rates:
    return Rates(matmul_tflops=self.matmul_tflops, attention_tflops=self.attention_tflops,
                 h2d_gbps=self.h2d_gbps, d2h_gbps=self.d2h_gbps,
                 host_adamw_gparams=self.host_adamw_gparams,
                 host_adamw_in_step_gparams=self.host_adamw_gparams,
                 host_adamw_in_step_best_gparams=max(self.host_adamw_gparams,
                                                     Rates.host_adamw_in_step_best_gparams),
                 hbm_gbps=self.hbm_gbps)

  def plan(self, cfg: config_lib.Config) -> Plan:
    """The plan of `cfg` on this machine: every `auto` resolved, device bytes estimated."""
    cfg = _with_devices(cfg, devices_of(cfg, self.devices))
    if cfg.train.batch % (cfg.engine.devices * (cfg.engine.micro_batch or 1)):
      raise PlanError(f"train.batch: {cfg.train.batch} sequences do not split evenly over "
                      f"{cfg.engine.devices} device(s)")
    return make(cfg, host_limit=int(self.host_memory_gb * GiB),
                device_limit=int(self.device_memory_gb * GiB * DEVICE_MEMORY_FRACTION),
                rates=self.rates())


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m mtjax.plan", description=__doc__)
  p.add_argument("--machine", help="plan for the machine this YAML file describes "
                                   "(configs/machines/h200.yaml), not this one; no accelerator used")
  p.add_argument("--no-device", action="store_true",
                 help="plan without starting the accelerator (device bytes estimated, no device limit)")
  p.add_argument("--json", help="also write the plan's figures (bytes, seconds) to this path")
  args, cfg = cli.parse_cli(p, argv)
  if args.machine:
    try:
      plan = Machine.load(args.machine).plan(cfg)
    except config_lib.ConfigError as e:
      print(f"error: {e}", file=sys.stderr)
      return 2
    except PlanError as e:
      print(f"refused: {e}", file=sys.stderr)
      return 1
  elif args.no_device:
    plan = make(cfg, host_limit=host_memory_limit(),
                rates=Rates(accelerator=probe_device_memory() is not None))
  else:
    try:
      _, plan = prepare(cfg)
    except PlanError as e:
      print(f"refused: {e}", file=sys.stderr)
      if args.json:
        Path(args.json).write_text(json.dumps({"refused": str(e)}))
      return 1
  print(format_plan(plan))
  if args.json:
    Path(args.json).write_text(json.dumps(plan_summary(plan), indent=1))
  return 0 if plan.fits_host and plan.fits_device else 1


def plan_summary(plan: Plan) -> dict:
  """The plan's main figures as plain JSON values (bytes and seconds; inf as null)."""
  finite = lambda x: x if math.isfinite(x) else None
  return {"family": plan.family, "params": plan.params, "active_params": plan.active_params,
          "host_bytes": plan.host_total, "device_bytes": plan.device_total,
          "host": plan.host, "device": plan.device, "host_limit": plan.host_limit,
          "device_limit": plan.device_limit, "fits": plan.fits_host and plan.fits_device,
          "devices": plan.devices, "device_state_layers": plan.device_state_layers,
          "device_update_layers": plan.device_update_layers,
          "host_groups": plan.tiers.count("host"),
          "schedule_s": finite(plan.schedule_s), "schedule_best_s": finite(plan.schedule_best_s),
          "roofline_s": finite(plan.roofline_s), "roofline_terms_s": plan.step_s,
          "runner_up": None if plan.runner_up is None else {
              "device_state_layers": plan.runner_up[0], "device_update_layers": plan.runner_up[1],
              "schedule_s": finite(plan.runner_up[2])},
          "tiers": list(plan.tiers),
          "activations_every": plan.activations_every,
          "activations_on_host": plan.activations_on_host, "compiled": plan.compiled}


if __name__ == "__main__":
  sys.exit(main())
