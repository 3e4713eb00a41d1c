"""Host and device bytes of a plan's items that are not arithmetic on the layouts: the runtime,
allowances measured on the H200 (the figures: docs/performance.md, the planner's constants), the
pinned pool's rounding, a Hugging Face import or export."""

from __future__ import annotations

import math

from mtjax import config as config_lib
from mtjax.plan.schedule import param_counts

def human_bytes(n: int) -> str:
  """Bytes as a short figure: GiB from 1 GiB up, else MiB."""
  return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / 2**20:.1f} MiB"


GiB = 2**30


# Python, jax/XLA, the CUDA runtime and compiled code, measured on the H200 and rounded up: the
# plan errs high here. Without an accelerator (the CPU backend, no CUDA runtime, no pinned pool) a
# much smaller allowance.
RUNTIME_HOST_BYTES = 6.5 * GiB


RUNTIME_HOST_BYTES_CPU = 1 * GiB


# Host memory that grows with the state held in device memory, not yet explained item by item: a
# share of the device-tier bytes, measured on the H200 (a run planned without it was killed for
# host memory).
DEVICE_TIER_HOST_SHARE = 0.11


# The share of a GPU's memory XLA's allocator may take (its own default is 75%): the rest holds the
# CUDA context, cuDNN's workspace and the pinned-pool bookkeeping. A machine file's plan counts it,
# and mtjax.launch sets it before the backend starts.
DEVICE_MEMORY_FRACTION = 0.92


# XLA's GPU allocator (BFC) hands a request a free chunk of up to twice its size, unsplit, when the
# rest would be under 128 MiB, and counts the whole chunk in use; the saved block inputs live
# longest, among short-lived buffers of other sizes. Measured on the H200: about this share of
# min(input, 128 MiB) per saved input in device memory.
SAVED_INPUT_ROUNDING = 0.3


def pinned_pool_bytes(pinned: int) -> int:
  """The cap mtjax gives XLA's pinned host pool for `pinned` bytes of pinned buffers. The pool grows
  in doubling regions up to its cap, so a run that pins more than half of it ends up holding it all:
  10% plus 2 GiB of headroom against fragmentation."""
  return math.ceil((pinned * 1.1 + 2 * GiB) / GiB) * GiB


def hf_staging_bytes(cfg: config_lib.Config) -> int:
  """Host bytes a Hugging Face import (`model.from_hf`, at the start) or export
  (`train.export_dir`, at the end) holds beside the state, the larger of the two. The import
  writes one group at a time (a group's fp32 buffer, its tensors read through memory maps in
  chunks); the export gathers up to one shard of tensors in the export dtype before writing it,
  beside one group's fp32 weights copied from its tier."""
  from mtjax import hf  # numpy and the safetensors format only; no backend
  pc = param_counts(cfg.model)
  group = 4 * max(v for k, v in pc.items() if k not in ("total", "active"))
  imported = group if cfg.model.from_hf else 0
  exported = 0
  if cfg.train.export_dir:
    width = 4 if cfg.train.export_dtype == "float32" else 2
    exported = min(hf.MAX_SHARD_BYTES, width * pc["total"]) + group
  return max(imported, exported)
