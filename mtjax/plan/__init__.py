"""The planner: will this run fit, where does each layer group's state live, and how fast can it go?

  schedule.py  parameter and FLOP counts, machine rates, the simulation of the engine's schedule
  memory.py    byte items that are not layout arithmetic (runtime, measured allowances, staging)
  search.py    a plan's bytes and step (Plan), the placement and activation search (make), check
  probe.py     this machine's memories and devices; prepare (plan a run before the backend starts)
  machine.py   a machine described by a YAML file (plan for a box you do not have)
  __main__.py  `python -m mtjax.plan --config FILE [--machine FILE] [--json OUT]`

`mtjax.train` runs `prepare` first and refuses a run that does not fit, before it allocates
anything; library users call it before anything touches jax (examples/custom_loop.py).
"""

from mtjax.plan.machine import Machine
from mtjax.plan.memory import (DEVICE_TIER_HOST_SHARE, GiB, RUNTIME_HOST_BYTES,
                               SAVED_INPUT_ROUNDING, hf_staging_bytes, human_bytes,
                               pinned_pool_bytes)
from mtjax.plan.probe import (DEVICE_MEMORY_FRACTION, backend_started, compiled_memory,
                              configure_pinned_pool, device_memory_gbps, device_memory_limit,
                              host_memory_limit, prepare, probe_device_count, probe_device_memory)
from mtjax.plan.schedule import (DEVICE_UPDATE_BYTES, HEAD_CHUNK_BYTES, HEAD_LOGIT_BYTES, Layer,
                                 Rates, count_params, flops, param_counts, simulate)
from mtjax.plan.search import (ACTIVATIONS_EVERY, DEVICE_SPARE, EXHAUSTIVE_GROUPS, GRAD_QUEUES,
                               HOST_SPARE, Plan, PlanError, check, devices_of, make,
                               refuse_by_size)


def format_plan(plan: Plan) -> str:
  """The plan as the CLI and `--show-plan` print it."""
  from mtjax.plan.__main__ import format_plan as fmt  # noqa: PLC0415
  return fmt(plan)


def plan_summary(plan: Plan) -> dict:
  """The plan's main figures as plain JSON values."""
  from mtjax.plan.__main__ import plan_summary as summary  # noqa: PLC0415
  return summary(plan)


def main(argv=None) -> int:
  from mtjax.plan.__main__ import main as run  # noqa: PLC0415
  return run(argv)


__all__ = ["ACTIVATIONS_EVERY", "DEVICE_MEMORY_FRACTION", "DEVICE_SPARE", "DEVICE_TIER_HOST_SHARE",
           "DEVICE_UPDATE_BYTES", "EXHAUSTIVE_GROUPS", "GRAD_QUEUES", "GiB", "HEAD_CHUNK_BYTES",
           "HEAD_LOGIT_BYTES", "HOST_SPARE", "Layer", "Machine", "Plan", "PlanError",
           "RUNTIME_HOST_BYTES", "Rates", "SAVED_INPUT_ROUNDING", "backend_started", "check",
           "compiled_memory", "configure_pinned_pool", "count_params", "device_memory_gbps", "device_memory_limit",
           "devices_of", "flops", "format_plan", "hf_staging_bytes", "host_memory_limit",
           "human_bytes", "main", "make", "param_counts", "pinned_pool_bytes", "plan_summary",
           "prepare", "probe_device_count", "probe_device_memory", "refuse_by_size", "simulate"]
