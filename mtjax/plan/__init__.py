"""The planner: will this run fit, where does each layer group's state live, and how fast can it go?

Pure: bytes, the simulated step and the search, from the config and the machine's facts given as
arguments (limits, rates, the layer programs' compiled bytes); nothing here probes the machine,
sets the environment or starts the jax backend (mtjax.launch does, then calls `make`).

  schedule.py  parameter and FLOP counts, machine rates, the simulation of the engine's schedule
  memory.py    byte items that are not layout arithmetic (runtime, measured allowances, staging)
  search.py    a plan's bytes and step (Plan), the placement and activation search (make), check
  machine.py   a machine described by a YAML file (plan for a box you do not have)
  report.py    the plan as text and as JSON values
  __main__.py  `python -m mtjax.plan --config FILE [--machine FILE] [--json OUT]`
"""

from mtjax.plan.machine import Machine
from mtjax.plan.memory import (DEVICE_MEMORY_FRACTION, DEVICE_TIER_HOST_SHARE, GiB,
                               RUNTIME_HOST_BYTES, SAVED_INPUT_ROUNDING, hf_staging_bytes,
                               human_bytes, pinned_pool_bytes)
from mtjax.plan.report import format_plan, plan_summary
from mtjax.plan.schedule import (DEVICE_UPDATE_BYTES, HEAD_CHUNK_BYTES, HEAD_LOGIT_BYTES, Layer,
                                 Rates, count_params, flops, param_counts, simulate)
from mtjax.plan.search import (ACTIVATIONS_EVERY, DEVICE_SPARE, EXHAUSTIVE_GROUPS, GRAD_QUEUES,
                               HOST_SPARE, Plan, PlanError, carries_documents, check, devices_of,
                               make, refuse_by_size, with_devices)

__all__ = ["ACTIVATIONS_EVERY", "DEVICE_MEMORY_FRACTION", "DEVICE_SPARE", "DEVICE_TIER_HOST_SHARE",
           "DEVICE_UPDATE_BYTES", "EXHAUSTIVE_GROUPS", "GRAD_QUEUES", "GiB", "HEAD_CHUNK_BYTES",
           "HEAD_LOGIT_BYTES", "HOST_SPARE", "Layer", "Machine", "Plan", "PlanError",
           "RUNTIME_HOST_BYTES", "Rates", "SAVED_INPUT_ROUNDING", "carries_documents", "check",
           "count_params", "devices_of", "flops", "format_plan", "hf_staging_bytes", "human_bytes",
           "make", "param_counts", "pinned_pool_bytes", "plan_summary", "refuse_by_size",
           "simulate", "with_devices"]
