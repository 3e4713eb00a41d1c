"""`python -m mtjax.plan --config FILE [key.path=value ...]`: will this run fit, and how fast can it go?

The plan places every layer group's state (host RAM, streamed through the device, or held in
device memory: see mtjax.store), counts host and device bytes, and predicts the step time from
a simulation of the engine's schedule. Host figures are arithmetic on the config; the layer
executables' device bytes come from XLA's analysis of the compiled code once the backend runs.
`mtjax.train` runs the same plan first (`prepare`) and refuses a run that does not fit, before it
allocates anything."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from mtjax import cli, config as config_lib, exits
from mtjax.plan.memory import GiB, human_bytes
from mtjax.plan.machine import Machine
from mtjax.plan.probe import host_memory_limit, prepare, probe_device_memory
from mtjax.plan.schedule import Rates
from mtjax.plan.search import Plan, PlanError, check, make


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


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m mtjax.plan", description=__doc__)
  p.add_argument("--machine", help="plan for the machine this YAML file describes "
                                   "(configs/machines/h200.yaml), not this one; no accelerator used")
  p.add_argument("--no-device", action="store_true",
                 help="plan without starting the accelerator (device bytes estimated, no device limit)")
  p.add_argument("--json", help="also write the plan's figures (bytes, seconds) to this path")
  args, cfg = cli.parse_cli(p, argv)
  try:
    if args.machine:
      plan = Machine.load(args.machine).plan(cfg)
    elif args.no_device:
      plan = make(cfg, host_limit=host_memory_limit(),
                  rates=Rates(accelerator=probe_device_memory() is not None))
    else:
      _, plan = prepare(cfg)
  except config_lib.ConfigError as e:
    return exits.fail("error", e, exits.BAD_INPUT)
  except PlanError as e:  # does not fit: refused, as `train` refuses it
    failed = _write_json(args.json, {"refused": exits.one_line(e)})
    return failed or exits.fail("refused", e, exits.BAD_INPUT)
  print(format_plan(plan))
  failed = _write_json(args.json, plan_summary(plan))
  if failed:
    return failed
  try:
    check(plan)
  except PlanError as e:
    return exits.fail("refused", e, exits.BAD_INPUT)
  return exits.OK


def _write_json(path: str | None, figures: dict) -> int:
  """Writes `--json`; 0, or the exit code of a write that failed (its line printed)."""
  if not path:
    return 0
  try:
    Path(path).write_text(json.dumps(figures, indent=1))
  except OSError as e:
    return exits.fail("error", f"--json: cannot write {path} ({e.strerror or e})",
                      exits.of_os_error(e))
  return 0


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


if __name__ == "__main__":
  sys.exit(main())
