"""`python -m mtjax.plan --config FILE [key.path=value ...]`: will this run fit, and how fast can it go?

Everything here is arithmetic on the config: nothing is allocated and no accelerator is touched
until the device's memory is asked for (`--no-device` skips that). `mtjax.train` runs the same plan
first and refuses a run that does not fit, before it allocates anything.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys

from mtjax import config as config_lib

GiB = 2**30
# Python, jax/XLA, the CUDA runtime and compiled code: measured on the H200 box (7B and 9B runs:
# peak RSS minus the other items was 3.5-6.4 GiB), so the plan errs high by up to 3 GiB. Without an
# accelerator (the CPU backend, no CUDA runtime, no pinned pool) a much smaller allowance.
RUNTIME_HOST_BYTES = 6.5 * GiB
RUNTIME_HOST_BYTES_CPU = 1 * GiB


def pinned_pool_bytes(pinned: int) -> int:
  """The cap mtjax gives XLA's pinned host pool for `pinned` bytes of pinned buffers. The pool grows
  in doubling regions up to its cap, so a run that pins more than half of it ends up holding it all:
  10% plus 2 GiB of headroom against fragmentation."""
  return math.ceil((pinned * 1.1 + 2 * GiB) / GiB) * GiB


class PlanError(RuntimeError):
  """The run does not fit; the message gives the numbers and what to change."""


def param_counts(m: config_lib.ModelConfig) -> dict[str, int]:
  """Parameters of each layer kind, in closed form (tests hold it to the real layouts)."""
  D, F, hd = m.hidden, m.ffn, m.dim_per_head
  q, kv = m.heads * hd, m.n_kv_heads * hd
  block = (D * q + 2 * D * kv + q * D + 3 * D * F + 2 * D + (q + 2 * kv if m.qkv_bias else 0)
           + (2 * hd if m.qk_norm else 0))
  embed = m.vocab_size * D
  head = D + (0 if m.tie_embeddings else D * m.vocab_size)
  return {"embed": embed, "block": block, "head": head, "total": embed + m.layers * block + head}


@dataclasses.dataclass(frozen=True)
class Rates:
  """Machine rates for the step-time prediction (defaults: the lent H200 box, measured)."""
  matmul_tflops: float = 600.0  # bf16 dense matmul through jax.jit
  h2d_gbps: float = 53.0  # pinned host -> device
  d2h_gbps: float = 53.0  # device -> pinned host
  # The fused in-place AdamW alone, 16 cores (4.4-5.6 Gparam/s measured): the roofline's figure.
  host_adamw_gparams: float = 4.4
  # The same loop inside a training step, beside the device's compute and copies: 4.17 Gparam/s
  # measured at batch 8, 4.69 at batch 32 (benchmarks/results/record/). The schedule takes the
  # lower figure, its optimistic end the higher.
  host_adamw_in_step_gparams: float = 4.2
  host_adamw_in_step_best_gparams: float = 4.7
  accelerator: bool = True  # False: the CPU backend runs the layers (no CUDA runtime, no pinned pool)


@dataclasses.dataclass(frozen=True)
class Plan:
  params: int
  host: dict[str, int]  # bytes by item
  device: dict[str, int]  # bytes by item
  pinned: int  # of `host`, bytes that must be pinned (the XLA pinned pool must hold them)
  step_s: dict[str, float]  # predicted lower-bound terms
  host_limit: int | None
  device_limit: int | None
  device_update_layers: int  # layer groups updated on the device (resolved when the config says auto)
  schedule_s: float  # predicted step time from simulating the engine's schedule (`simulate`)
  schedule_best_s: float  # the same with the best in-step host AdamW rate measured

  @property
  def host_total(self) -> int:
    return sum(self.host.values())

  @property
  def device_total(self) -> int:
    return sum(self.device.values())

  @property
  def host_bytes_per_param(self) -> float:
    return (self.host["master weights"] + self.host["AdamW moments"]) / self.params

  @property
  def fits_host(self) -> bool:
    return self.host_limit is None or self.host_total <= self.host_limit

  @property
  def fits_device(self) -> bool:
    return self.device_limit is None or self.device_total <= self.device_limit

  @property
  def predicted_step_s(self) -> float:
    return max(self.step_s.values())


def make(cfg: config_lib.Config, host_limit: int | None = None, device_limit: int | None = None,
         rates: Rates = Rates()) -> Plan:
  """The plan of `cfg`; `engine.device_update_layers: auto` is resolved here (see `choose_device_updates`)."""
  n_dev = cfg.engine.device_update_layers
  if n_dev == "auto":
    n_dev = choose_device_updates(cfg, device_limit, rates, host_limit)
  return _make(cfg, n_dev, host_limit, device_limit, rates)


def choose_device_updates(cfg: config_lib.Config, device_limit: int | None = None,
                          rates: Rates = Rates(), host_limit: int | None = None) -> int:
  """How many of the backward's last layer groups to update on the device: among the counts that
  fit the device and leave 3% of the host spare (pinned moments enlarge the pinned pool), the
  largest whose simulated step (`simulate`) is within 2% of the shortest. Largest, because the
  host optimizer shares the host's cores and memory bus with everything else the process does and
  the device's update does not: on the H200 all groups on the device ran 22% faster than none at
  batch 8 and tied at batch 32 (benchmarks/results/record/)."""
  times = {}
  for k in range(cfg.model.layers + 3):
    plan = _make(cfg, k, host_limit, device_limit, rates)
    # An optional choice keeps 3% of the host spare.
    roomy = host_limit is None or plan.host_total <= 0.97 * host_limit
    if k and not (plan.fits_device and roomy):
      break  # device bytes and the pinned pool grow with k
    times[k] = plan.schedule_s
  shortest = min(times.values())
  return max(k for k, s in times.items() if s <= shortest * 1.02)


def _make(cfg: config_lib.Config, n_dev: int, host_limit: int | None, device_limit: int | None,
          rates: Rates) -> Plan:
  m, e, t, o = cfg.model, cfg.engine, cfg.train, cfg.optim
  pc = param_counts(m)
  P, L = pc["total"], m.layers
  sizes = [pc["embed"]] + [pc["block"]] * L + [pc["head"]]
  largest = max(sizes)
  act = 2 if e.compute_dtype == "bfloat16" else 4
  tokens = t.batch * t.seq
  host_updated = sum(sizes[n_dev:])
  dev_largest = max(sizes[:n_dev], default=0)
  checkpoint = t.batch * t.seq * m.hidden * act  # one layer's saved input

  host = {
      "master weights": 4 * P,
      "AdamW moments": 8 * P,
      "gradients in flight": 4 * largest * (e.grad_queue + 2) if host_updated else 0,
      "clip gradient buffer": 4 * host_updated if (o.clip_norm and o.clip_mode == "host_buffer") else 0,
      "device-update staging": 12 * dev_largest * min(n_dev, 2),
      "activation checkpoints": L * checkpoint if e.checkpoints == "host" else 0,
      "runtime": RUNTIME_HOST_BYTES if rates.accelerator else RUNTIME_HOST_BYTES_CPU,
  }
  moments_pinned = 8 * sum(sizes[:n_dev])
  pinned = (host["master weights"] + moments_pinned + host["gradients in flight"]
            + host["clip gradient buffer"] + host["device-update staging"]
            + host["activation checkpoints"])
  host["pinned pool headroom"] = pinned_pool_bytes(pinned) - pinned if rates.accelerator else 0

  mb = e.micro_batch or t.batch
  D, F, V = m.hidden, m.ffn, m.vocab_size
  H, hd = m.heads, m.dim_per_head
  # One block's backward over one micro-batch: its forward re-run under vjp keeps about a dozen
  # [mb, T, D]-sized and three [mb, T, F]-sized intermediates, and as many cotangents.
  layer_acts = 2 * mb * t.seq * (12 * D + 3 * F) * act
  attn = (mb * H * t.seq * 4 * 2 if e.attention != "xla" and e.compute_dtype == "bfloat16"
          else 3 * mb * H * t.seq * t.seq * 4)  # flash: row stats; XLA: scores, probs, their grad
  chunk = min(e.loss_chunk, tokens)
  device = {
      "streamed weights": (e.inflight_layers + 1) * largest * (4 + act),
      "resident weights (device update)": 4 * sum(sizes[:n_dev]),
      "moments in flight (device update)": 2 * 2 * 8 * dev_largest,
      "gradients": 2 * 4 * largest,
      "activation checkpoints": L * checkpoint if e.checkpoints == "device" else 2 * checkpoint,
      "layer working set": layer_acts + attn,
      "loss chunk": chunk * V * (4 + 4 + act) + 4 * D * V,
      "embedding gradient": 4 * V * D,
      "hidden states": 3 * tokens * D * act,
  }

  block_matmul = pc["block"] - 2 * D - (H * hd + 2 * m.n_kv_heads * hd if m.qkv_bias else 0)
  causal = 0.5 if e.compute_dtype == "bfloat16" and e.attention != "xla" else 1.0
  hw_flops = (L * (8 * block_matmul * tokens + 16 * t.batch * t.seq**2 * H * hd * causal)
              + 6 * D * V * tokens)
  ckpt_link = L * checkpoint if e.checkpoints == "host" else 0
  tail = sum(sizes[:n_dev])  # device-updated groups: weights stay resident, moments cross twice
  tail_blocks = sum(sizes[1:min(n_dev, L + 1)])
  h2d = 4 * (P - tail) + 4 * (L * pc["block"] - tail_blocks) + 8 * tail + ckpt_link
  step_s = {
      "compute": hw_flops / (rates.matmul_tflops * 1e12),
      "host->device": h2d / (rates.h2d_gbps * 1e9),
      "device->host": (4 * host_updated + 8 * tail + ckpt_link) / (rates.d2h_gbps * 1e9),
      "host optimizer": host_updated / (rates.host_adamw_gparams * 1e9),
  }
  block_fwd = (2 * block_matmul * tokens + 4 * t.batch * t.seq**2 * H * hd * causal) / (
      rates.matmul_tflops * 1e12)
  layers = [Layer(sizes[0], 0.0, 0.0, 0)]
  layers += [Layer(pc["block"], block_fwd, 3 * block_fwd, checkpoint if e.checkpoints == "host"
                   else 0)] * L
  layers += [Layer(sizes[-1], 6 * D * V * tokens / (rates.matmul_tflops * 1e12), 0.0, 0)]
  sched = simulate(layers, n_dev, rates, e.inflight_layers, e.grad_queue, e.overlap)
  best = dataclasses.replace(rates, host_adamw_in_step_gparams=rates.host_adamw_in_step_best_gparams)
  sched_best = simulate(layers, n_dev, best, e.inflight_layers, e.grad_queue, e.overlap)
  return Plan(P, host, device, pinned, step_s, host_limit, device_limit, n_dev, sched,
              min(sched, sched_best))


@dataclasses.dataclass(frozen=True)
class Layer:
  """One layer group as the schedule sees it: parameters, device seconds forward and backward
  (the head's whole loss step counts as forward), saved-input bytes that cross the link."""
  params: int
  fwd_s: float
  bwd_s: float
  checkpoint_bytes: int


def simulate(layers: list[Layer], n_device: int, rates: Rates, inflight: int = 2,
             grad_queue: int = 4, overlap: bool = True, steps: int = 4) -> float:
  """Predicted step time of the engine's schedule: four in-order lanes (host->device copies, device
  compute, device->host copies, the host optimizer) and the engine's dependencies between them.

  Forward, layer g: its weights are copied once its last update is done (device-updated groups
  stay resident), at most `inflight` layers ahead of the device. Backward, in reverse: weights (or,
  for device-updated groups, the moments) come in, the gradient (or w, m, v) goes out, and the
  host optimizer takes host-updated groups in order; the device waits once more than `grad_queue`
  updates are queued. Without overlap every item runs alone. Steady state: the last step's length.
  """
  h2d_rate, d2h_rate = rates.h2d_gbps * 1e9, rates.d2h_gbps * 1e9
  opt_rate = rates.host_adamw_in_step_gparams * 1e9
  n = len(layers)
  free = {"h2d": 0.0, "compute": 0.0, "d2h": 0.0, "opt": 0.0}
  updated = [0.0] * n  # when group g's last update finished
  moments_back = [0.0] * n  # when a device-updated group's m and v were last back in host memory
  starts = []

  def run(lane, ready, dur):
    start = max(free[lane], ready)
    if not overlap:
      start = max(start, *free.values())
    free[lane] = start + dur
    return free[lane]

  for _ in range(steps):
    host_t = free["compute"]  # the host syncs on the loss and norms at the end of a step
    starts.append(host_t)
    done = [0.0] * n  # forward compute done
    for g, lay in enumerate(layers):
      gate = done[g - 1 - inflight] if g - 1 - inflight >= 0 else host_t
      arrived = (updated[g] if g < n_device else
                 run("h2d", max(updated[g], gate), 4 * lay.params / h2d_rate))
      done[g] = run("compute", max(arrived, gate), lay.fwd_s)
      if lay.checkpoint_bytes:
        run("d2h", done[g], lay.checkpoint_bytes / d2h_rate)
    opt_done: list[float] = []  # host updates of this backward, in order
    bwd_done = [0.0] * n
    for g in reversed(range(n)):
      gate = opt_done[-grad_queue - 1] if len(opt_done) > grad_queue else host_t
      if g + 2 + inflight < n:
        gate = max(gate, bwd_done[g + 2 + inflight])
      lay = layers[g]
      if g == n - 1:  # the head's gradient exists once its (forward) step ran
        computed = done[-1]
        if g < n_device:  # its moments, for the device update, once last step's are back
          run("h2d", max(gate, moments_back[g]), 8 * lay.params / h2d_rate)
      else:
        # weights (the embedding's backward needs none), or only the moments when device-updated
        nbytes = (8 * lay.params if g < n_device else 4 * lay.params * (g > 0)) + lay.checkpoint_bytes
        arrived = run("h2d", max(gate, moments_back[g]) if g < n_device else gate, nbytes / h2d_rate)
        computed = run("compute", max(arrived, gate), lay.bwd_s)
      bwd_done[g] = computed
      if g < n_device:  # m and v go back; the device's new weights stay for the next forward
        moments_back[g] = run("d2h", computed, 8 * lay.params / d2h_rate)
        updated[g] = computed
      else:
        landed = run("d2h", computed, 4 * lay.params / d2h_rate)
        updated[g] = run("opt", landed, lay.params / opt_rate)
        opt_done.append(updated[g])
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


def configure_pinned_pool(plan: Plan) -> None:
  """Caps XLA's pinned host pool near what the run pins. The pool grows in doubling regions up to
  its cap, so a loose cap can pin up to twice what is used; a user's own setting wins. Must run
  before the jax backend starts."""
  os.environ.setdefault("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", str(pinned_pool_bytes(plan.pinned) // GiB))


def check(plan: Plan) -> None:
  """Raises PlanError (one line: the numbers and what to change) if the plan does not fit."""
  if not plan.fits_host:
    raise PlanError(
        f"does not fit in host memory: needs {plan.host_total / GiB:.1f} GiB "
        f"({plan.host_bytes_per_param:.1f} B/param state for {plan.params / 1e9:.2f}B params + "
        f"{(plan.host_total - plan.host['master weights'] - plan.host['AdamW moments']) / GiB:.1f} "
        f"GiB buffers), limit {plan.host_limit / GiB:.1f} GiB; use a smaller model, "
        f"engine.checkpoints=device, optim.clip_mode=recompute or a lower engine.grad_queue")
  if not plan.fits_device:
    top = max(plan.device, key=plan.device.get)
    raise PlanError(
        f"does not fit in device memory: needs {plan.device_total / GiB:.1f} GiB (largest: {top} "
        f"{plan.device[top] / GiB:.1f} GiB), limit {plan.device_limit / GiB:.1f} GiB; lower "
        f"train.batch or engine.micro_batch, use engine.checkpoints=host or fewer "
        f"engine.device_update_layers")


def format_plan(plan: Plan) -> str:
  lim = lambda x: "unknown" if x is None else f"{x / GiB:.1f} GiB"
  lines = [f"{plan.params / 1e6:,.1f}M parameters; host state {plan.host_bytes_per_param:.2f} B/param",
           f"host memory: {plan.host_total / GiB:.2f} GiB of {lim(plan.host_limit)} "
           f"({'fits' if plan.fits_host else 'DOES NOT FIT'}); pinned {plan.pinned / GiB:.2f} GiB"]
  lines += [f"  {k:<34}{v / GiB:>9.2f} GiB" for k, v in plan.host.items() if v]
  lines += [f"device memory: {plan.device_total / GiB:.2f} GiB of {lim(plan.device_limit)} "
            f"({'fits' if plan.fits_device else 'DOES NOT FIT'})"]
  lines += [f"  {k:<34}{v / GiB:>9.2f} GiB" for k, v in plan.device.items() if v]
  lines += [f"predicted step >= {plan.predicted_step_s:.3f} s (roofline: "
            + ", ".join(f"{k} {v:.3f}" for k, v in plan.step_s.items()) + ")",
            f"predicted step {plan.schedule_best_s:.3f}-{plan.schedule_s:.3f} s (the engine's "
            f"schedule, simulated; host AdamW at its best-worst in-step rate) with "
            f"{plan.device_update_layers} layer groups updated on the device"]
  return "\n".join(lines)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m mtjax.plan", description=__doc__)
  p.add_argument("--no-device", action="store_true", help="do not ask the accelerator its memory")
  args, cfg = config_lib.parse_cli(p, argv)
  plan = make(cfg, host_limit=host_memory_limit())
  if not args.no_device:
    configure_pinned_pool(plan)
    import jax
    device = jax.devices()[0]
    plan = make(cfg, plan.host_limit, device_memory_limit(device),
                Rates(accelerator=device.platform != "cpu"))
  print(format_plan(plan))
  return 0 if plan.fits_host and plan.fits_device else 1


if __name__ == "__main__":
  sys.exit(main())
