"""The plan as text (`format_plan`: what `python -m mtjax.plan` and `train --show-plan` print) and
as plain JSON values (`plan_summary`: `--json`)."""

from __future__ import annotations

import math

from mtjax.plan.memory import GiB, human_bytes
from mtjax.plan.search import Plan


def format_plan(plan: Plan) -> str:
  """The plan as `python -m mtjax.plan` and `train --show-plan` print it: placement, byte tables,
  predicted step, disk."""
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
  width = max(map(len, [*plan.host, *plan.device])) + 2  # both tables' labels, one column
  item = lambda k, v: f"  {k:<{width}}{v / GiB:>9.2f} GiB"
  lines += [item(k, v) for k, v in plan.host.items() if v]
  each = f" per device, {plan.devices} devices" if plan.devices > 1 else ""
  lines += [f"device memory{each}: {plan.device_total / GiB:.2f} GiB of {lim(plan.device_limit)} "
            f"({'fits' if plan.fits_device else 'DOES NOT FIT'})"]
  lines += [item(k, v) for k, v in plan.device.items() if v]
  lines += [f"predicted step >= {plan.roofline_s:.3f} s (roofline: "
            + ", ".join(f"{k} {v:.3f}" for k, v in plan.step_s.items()) + ")",
            f"predicted step {plan.schedule_best_s:.3f}-{plan.schedule_s:.3f} s (the engine's "
            f"schedule, simulated; host AdamW at its best-worst in-step rate; gradient queue "
            f"{plan.grad_queue}" + (f"; every {plan.activations_every}th block's input kept, the "
                                    f"rest re-computed" if plan.activations_every > 1 else "")
            + (f"; {plan.activations_on_host} kept inputs in host memory"
               if plan.activations_on_host else "") + ")",
            *([f"gradient accumulation: {plan.grad_accum} forward/backward passes per step, "
               f"each layer's weights streamed once per pass: {plan.link_bytes / GiB:.2f} GiB "
               f"cross the link per step (host->device and back)"] if plan.grad_accum > 1 else []),
            "device bytes of the layer executables: " + ("from XLA's analysis of the compiled code"
                                                         if plan.compiled else "estimated")]
  d = plan.disk
  if "one checkpoint" in d:
    lines.append(f"checkpoint disk: {human_bytes(d['checkpoints kept'])} (at most "
                 f"{d['checkpoints at once']} on disk at once, {human_bytes(d['one checkpoint'])} "
                 f"each)")
  if "export" in d:
    lines.append(f"export disk: {human_bytes(d['export'])}")
  if plan.runner_up is not None:
    n_dev, n_str, t = plan.runner_up
    why = (" (all state in device memory is taken when it fits: no host RAM, no link traffic)"
           if set(plan.tiers) == {"device"} and t < plan.schedule_s else "")
    lines.append(f"runner-up placement: {n_dev} groups in device memory, {n_str} streamed: "
                 f"{t:.3f} s simulated{why}")
  return "\n".join(lines)


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
          "activations_on_host": plan.activations_on_host, "compiled": plan.compiled,
          "disk": plan.disk,
          "grad_accum": plan.grad_accum, "link_bytes_per_step": plan.link_bytes}
