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
RUNTIME_HOST_BYTES = 3 * GiB  # Python, jax/XLA, the CUDA runtime and compiled code: a measured allowance


class PlanError(RuntimeError):
  """The run does not fit; the message gives the numbers and what to change."""


def param_counts(m: config_lib.ModelConfig) -> dict[str, int]:
  """Parameters of each layer kind, in closed form (tests hold it to the real layouts)."""
  D, F, hd = m.hidden, m.ffn, m.dim_per_head
  q, kv = m.heads * hd, m.n_kv_heads * hd
  block = D * q + 2 * D * kv + q * D + 3 * D * F + 2 * D + (q + 2 * kv if m.qkv_bias else 0)
  embed = m.vocab_size * D
  head = D + (0 if m.tie_embeddings else D * m.vocab_size)
  return {"embed": embed, "block": block, "head": head, "total": embed + m.layers * block + head}


@dataclasses.dataclass(frozen=True)
class Rates:
  """Machine rates for the step-time prediction (defaults: the lent H200 box, measured)."""
  matmul_tflops: float = 600.0  # bf16 dense matmul through jax.jit
  h2d_gbps: float = 53.0  # pinned host -> device
  d2h_gbps: float = 53.0  # device -> pinned host
  host_adamw_gparams: float = 3.2  # fused in-place AdamW on 16 cores


@dataclasses.dataclass(frozen=True)
class Plan:
  params: int
  host: dict[str, int]  # bytes by item
  device: dict[str, int]  # bytes by item
  pinned: int  # of `host`, bytes that must be pinned (the XLA pinned pool must hold them)
  step_s: dict[str, float]  # predicted lower-bound terms
  host_limit: int | None
  device_limit: int | None

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
  m, e, t, o = cfg.model, cfg.engine, cfg.train, cfg.optim
  pc = param_counts(m)
  P, L = pc["total"], m.layers
  sizes = [pc["embed"]] + [pc["block"]] * L + [pc["head"]]
  largest = max(sizes)
  act = 2 if e.compute_dtype == "bfloat16" else 4
  tokens = t.batch * t.seq
  n_dev = e.device_update_layers
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
      "runtime": RUNTIME_HOST_BYTES,
  }
  moments_pinned = 8 * sum(sizes[:n_dev])
  pinned = (host["master weights"] + moments_pinned + host["gradients in flight"]
            + host["clip gradient buffer"] + host["device-update staging"]
            + host["activation checkpoints"])

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
      "device->host": (4 * host_updated + 12 * tail + ckpt_link) / (rates.d2h_gbps * 1e9),
      "host optimizer": host_updated / (rates.host_adamw_gparams * 1e9),
  }
  return Plan(P, host, device, pinned, step_s, host_limit, device_limit)


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
  gb = math.ceil((plan.pinned * 1.1 + 2 * GiB) / GiB)
  os.environ.setdefault("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", str(gb))


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
            + ", ".join(f"{k} {v:.3f}" for k, v in plan.step_s.items()) + ")"]
  return "\n".join(lines)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m mtjax.plan", description=__doc__)
  p.add_argument("--no-device", action="store_true", help="do not ask the accelerator its memory")
  args, cfg = config_lib.parse_cli(p, argv)
  plan = make(cfg, host_limit=host_memory_limit())
  if not args.no_device:
    configure_pinned_pool(plan)
    import jax
    plan = dataclasses.replace(plan, device_limit=device_memory_limit(jax.devices()[0]))
  print(format_plan(plan))
  return 0 if plan.fits_host and plan.fits_device else 1


if __name__ == "__main__":
  sys.exit(main())
