"""A run folder: the resolved config, the plan, one JSON line of metrics per step and TensorBoard
scalars of the same numbers.

Layout of RUN_DIR: config.yaml and config.json (the resolved config), plan.txt, metrics.jsonl (one
JSON object per step; non-finite floats are null, so every line is valid JSON) and
tb/events.out.tfevents.<time>.<host>.mtjax (one scalar per numeric field, tag = field name). Both
are flushed every step, so a crash loses at most the step being written.

The TensorBoard writer is written here instead of taken from TensorFlow or tensorboardX: scalars
need only TFRecord framing (length, masked crc32c, data, masked crc32c) around two small protobuf
messages (Event and Summary), a few varint and fixed-width fields encoded by hand.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import os
import sys
import socket
import struct
import time
from pathlib import Path
from typing import Any

import yaml

logger = logging.getLogger("mtjax")

# What the trainer logs per step (all optional but step): seconds, GiB, tokens/s, TFLOP/s.
FIELDS = ("step", "loss", "held_out_loss", "lr", "grad_norm", "skipped", "tokens", "tokens_per_s",
          "model_tflops", "tflops_with_attention", "step_s", "forward_s", "backward_s", "finish_s",
          "opt_wait_s", "device_wait_s", "transfer_wait_s", "host_rss_gib", "device_peak_gib",
          "time")
METRICS = "metrics.jsonl"
TB_DIR = "tb"
_TB_SUFFIX = ".mtjax"  # only event files with this suffix are ours to rebuild on resume


def setup_logging(level: int | str = logging.INFO) -> logging.Logger:
  """Sends the "mtjax" logger's records at `level` and above to stderr, once however often called.

  Args:
    level: a `logging` level or its name ("INFO", "DEBUG", ...).

  Returns:
    The "mtjax" logger.
  """
  for old in [h for h in logger.handlers if getattr(h, "_mtjax", False)]:
    logger.removeHandler(old)  # bound to the stderr of an earlier call, which may be gone now
  handler = logging.StreamHandler(sys.stderr)
  handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
  handler._mtjax = True  # marks ours, so a second call does not print every record twice
  logger.addHandler(handler)
  logger.setLevel(level.upper() if isinstance(level, str) else level)
  return logger


# ---- TensorBoard event files ----------------------------------------------------------------

def _crc32c_table() -> list[int]:
  table = []
  for n in range(256):
    c = n
    for _ in range(8):
      c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1  # Castagnoli polynomial, reflected
    table.append(c)
  return table


_CRC_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
  crc = 0xFFFFFFFF
  for b in data:
    crc = _CRC_TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
  return crc ^ 0xFFFFFFFF


def _masked_crc(data: bytes) -> int:
  crc = crc32c(data)
  return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF  # TFRecord's mask


def _varint(n: int) -> bytes:
  n &= (1 << 64) - 1  # int64 fields: negatives as two's complement, ten bytes
  out = bytearray()
  while n >= 0x80:
    out.append((n & 0x7F) | 0x80)
    n >>= 7
  out.append(n)
  return bytes(out)


def _field_bytes(number: int, payload: bytes) -> bytes:
  return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _event(wall_time: float, step: int, file_version: str | None = None,
           scalars: dict[str, float] | None = None) -> bytes:
  # Event: wall_time=1 (double), step=2 (int64), file_version=3 (string), summary=5 (Summary).
  # Summary: value=1 (repeated Value); Value: tag=1 (string), simple_value=2 (float).
  out = _varint(1 << 3 | 1) + struct.pack("<d", wall_time) + _varint(2 << 3) + _varint(step)
  if file_version is not None:
    out += _field_bytes(3, file_version.encode())
  if scalars:
    values = b"".join(_field_bytes(1, _field_bytes(1, tag.encode()) + _varint(2 << 3 | 5)
                                   + struct.pack("<f", v)) for tag, v in scalars.items())
    out += _field_bytes(5, values)
  return out


class EventWriter:
  """A TensorBoard event file of scalar summaries, flushed after every record."""

  def __init__(self, directory: str | Path):
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    now = time.time()
    self.path = directory / f"events.out.tfevents.{int(now)}.{socket.gethostname()}{_TB_SUFFIX}"
    self._f = open(self.path, "ab")
    self._write(_event(now, 0, file_version="brain.Event:2"))

  def _write(self, data: bytes):
    header = struct.pack("<Q", len(data))
    self._f.write(header + struct.pack("<I", _masked_crc(header)) + data
                  + struct.pack("<I", _masked_crc(data)))
    self._f.flush()

  def scalars(self, step: int, values: dict[str, float], wall_time: float | None = None):
    """Writes `values` (tag -> number) at `step` as one event."""
    if values:
      self._write(_event(time.time() if wall_time is None else wall_time, step, scalars=values))

  def close(self):
    self._f.close()


# ---- the run folder -------------------------------------------------------------------------

def _clean(name: str, value: Any) -> Any:
  if value is None or isinstance(value, (bool, str)):
    return value
  if isinstance(value, numbers.Integral):
    return int(value)
  try:
    value = float(value)  # numpy and 0-d jax arrays as well as Python floats
  except (TypeError, ValueError):
    raise TypeError(f"metric {name}: {type(value).__name__} is not a number, bool, str or None")
  return value if math.isfinite(value) else None  # JSON has no NaN or inf


def _scalars(record: dict) -> dict[str, float]:
  return {k: float(v) for k, v in record.items()
          if k not in ("step", "time") and isinstance(v, (int, float))}  # bools as 0/1


class RunLog:
  """Writes a run folder: config, plan, metrics.jsonl and TensorBoard scalars.

  A folder that already holds metrics.jsonl is resumed: the lines with step < `start_step` are kept,
  later ones (logged after the last checkpoint of a run that crashed) are dropped, and the
  TensorBoard files are rebuilt from the kept lines, so neither shows a step twice.
  """

  def __init__(self, run_dir: str | Path, config: dict | None = None, plan: str | None = None,
               start_step: int = 0, tensorboard: bool = True):
    """Opens (creates or resumes) a run folder.

    Args:
      run_dir: the folder; created if missing.
      config: the resolved config as a dict (e.g. `config.to_dict(cfg)`), written as config.yaml
        and config.json; None leaves files already there.
      plan: the plan as text (e.g. `plan.format_plan(plan)`), written as plan.txt.
      start_step: the first step this run will log (store.step after a restore, 0 for a fresh
        run); earlier lines of metrics.jsonl with step >= start_step are dropped.
      tensorboard: also write TensorBoard event files under run_dir/tb.
    """
    self.run_dir = Path(run_dir)
    self.run_dir.mkdir(parents=True, exist_ok=True)
    if config is not None:
      config = json.loads(json.dumps(config, default=str))  # tuples, paths, enums: plain JSON/YAML
      (self.run_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
      (self.run_dir / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    if plan is not None:
      (self.run_dir / "plan.txt").write_text(plan if plan.endswith("\n") else plan + "\n")
    self.path = self.run_dir / METRICS
    kept = self._truncate(start_step)
    self._f = open(self.path, "a", encoding="utf-8")
    self._tb = None
    if tensorboard:
      tb_dir = self.run_dir / TB_DIR
      for old in tb_dir.glob(f"events.out.tfevents.*{_TB_SUFFIX}") if tb_dir.is_dir() else ():
        old.unlink()
      self._tb = EventWriter(tb_dir)
      for record in kept:
        self._tb.scalars(record["step"], _scalars(record), record.get("time"))

  def _truncate(self, start_step: int) -> list[dict]:
    """Keeps the lines with step < start_step; returns them."""
    if not self.path.exists():
      return []
    kept, dropped = [], 0
    for line in self.path.read_text().splitlines():
      try:
        record = json.loads(line)
      except json.JSONDecodeError:  # a line torn by a crash
        dropped += 1
        continue
      if isinstance(record, dict) and isinstance(record.get("step"), int) \
          and record["step"] < start_step:
        kept.append(record)
      else:
        dropped += 1
    tmp = self.path.with_name(self.path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r, allow_nan=False) + "\n" for r in kept))
    os.replace(tmp, self.path)  # a crash here leaves the old file or the new one, never half
    logger.info("run folder %s: resuming at step %d, kept %d metric lines, dropped %d",
                self.run_dir, start_step, len(kept), dropped)
    return kept

  def log(self, step: int, **fields: Any) -> dict:
    """Appends one step's metrics to metrics.jsonl and TensorBoard, flushed before returning.

    Args:
      step: the step number.
      **fields: numbers, bools, strings or None, usually named as in `FIELDS`; `time` (Unix
        seconds) defaults to now. NaN and inf become null; a field left out is absent.

    Returns:
      The record as written.
    """
    record = {"step": int(step)}
    record.update({k: _clean(k, v) for k, v in fields.items()})
    if record.get("time") is None:
      record["time"] = time.time()
    self._f.write(json.dumps(record, allow_nan=False) + "\n")
    self._f.flush()
    if self._tb is not None:
      self._tb.scalars(record["step"], _scalars(record), record["time"])
    return record

  def close(self):
    self._f.close()
    if self._tb is not None:
      self._tb.close()

  def __enter__(self) -> RunLog:
    return self

  def __exit__(self, *exc):
    self.close()


def read_metrics(run_dir: str | Path) -> list[dict]:
  """The records of RUN_DIR/metrics.jsonl in file order, skipping a line torn by a crash."""
  out = []
  for line in (Path(run_dir) / METRICS).read_text().splitlines():
    try:
      out.append(json.loads(line))
    except json.JSONDecodeError:
      continue
  return out
