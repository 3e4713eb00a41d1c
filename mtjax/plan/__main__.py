"""`python -m mtjax.plan --config FILE [key.path=value ...]`: will this run fit, and how fast can it go?

The plan places every layer group's state (host RAM, streamed through the device, or held in
device memory: see mtjax.store), counts host and device bytes, and predicts the step time from
a simulation of the engine's schedule. Host figures are arithmetic on the config; the layer
programs' device bytes come from XLA's analysis of the compiled code once the backend runs.
`mtjax.train` makes the same plan first (`mtjax.launch.plan_run`) and refuses a run that does not
fit, before it allocates anything."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mtjax import cli, config as config_lib, exits
from mtjax.plan.machine import Machine
from mtjax.plan.report import format_plan, plan_summary
from mtjax.plan.schedule import Rates
from mtjax.plan.search import PlanError, check, make


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m mtjax.plan", description=__doc__,
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                              epilog=cli.CONFIG_HELP)
  p.add_argument("--machine", help="plan for the machine this YAML file describes "
                                   "(configs/machines/h200.yaml), not this one; no accelerator used")
  p.add_argument("--no-device", action="store_true",
                 help="plan without starting the accelerator (device bytes estimated, no device limit)")
  p.add_argument("--json", help="also write the plan's figures (bytes, seconds) to this path")
  args, cfg = cli.parse_cli(p, argv)
  try:
    if args.machine:
      plan = Machine.load(args.machine).plan(cfg)
    else:
      from mtjax import launch  # a command above launch; --machine needs none of it
      if args.no_device:
        plan = make(cfg, host_limit=launch.host_memory_limit(),
                    rates=Rates(accelerator=launch.probe_device_memory() is not None))
      else:
        _, plan = launch.plan_run(cfg)
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


if __name__ == "__main__":
  sys.exit(main())
