"""A run folder: the resolved config, the plan, one JSON line of metrics per step, and the same
numbers sent to the trackers the config names (train.trackers); and the run's progress on the
terminal or in its log (`Progress`).

Layout of RUN_DIR: config.yaml and config.json (the resolved config), plan.txt, metrics.jsonl (one
JSON object per step; non-finite floats are null, so every line is valid JSON) and, with the
tensorboard tracker, tb/events.out.tfevents.<time>.<host>.mtjax (one scalar per numeric field,
tag = field name, written by tensorboardX). Both are flushed every step, so a crash loses at most
the step being written. The wandb tracker logs the same scalars to a Weights & Biases run (files
under RUN_DIR/wandb; WANDB_MODE=offline keeps them there).
"""

from __future__ import annotations

import collections
import json
import logging
import math
import numbers
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import yaml
from tqdm import tqdm

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


# ---- trackers --------------------------------------------------------------------------------

TRACKERS = ("jsonl", "tensorboard", "wandb")


class TensorBoard:
  """TensorBoard event files of scalar summaries (tensorboardX), flushed after every step."""

  def __init__(self, directory: str | Path):
    from tensorboardX import SummaryWriter

    directory = Path(directory)
    for old in directory.glob(f"events.out.tfevents.*{_TB_SUFFIX}") if directory.is_dir() else ():
      old.unlink()  # rebuilt from the kept metrics lines: no step twice
    self._w = SummaryWriter(str(directory), filename_suffix=_TB_SUFFIX, flush_secs=3600)

  def scalars(self, step: int, values: dict[str, float], wall_time: float):
    for tag, v in values.items():
      self._w.add_scalar(tag, v, global_step=step, walltime=wall_time)
    self._w.flush()

  def close(self):
    self._w.close()


class WandB:
  """A Weights & Biases run of the same scalars; WANDB_MODE=offline writes it under run_dir only."""

  def __init__(self, run_dir: Path, config: dict | None):
    try:
      import wandb
    except ImportError:
      raise ValueError("train.trackers: wandb is selected but the wandb package is not installed "
                       "(pip install wandb, or leave wandb out of train.trackers)") from None
    self._run = wandb.init(dir=str(run_dir), config=config, name=run_dir.name,
                           project=os.environ.get("WANDB_PROJECT", "mtjax"))

  def scalars(self, step: int, values: dict[str, float], wall_time: float):
    self._run.log(values, step=step)

  def close(self):
    self._run.finish()


# ---- the run folder -------------------------------------------------------------------------

def _clean(name: str, value: Any) -> Any:
  if value is None or isinstance(value, (bool, str)):
    return value
  if isinstance(value, numbers.Integral):
    return int(value)
  try:
    value = float(value)  # numpy and 0-d jax arrays as well as Python floats
  except (TypeError, ValueError):
    raise TypeError(f"metric {name}: {type(value).__name__} is not a number, bool, str or None"
                    ) from None
  return value if math.isfinite(value) else None  # JSON has no NaN or inf


def _scalars(record: dict) -> dict[str, float]:
  return {k: float(v) for k, v in record.items()
          if k not in ("step", "time") and isinstance(v, (int, float))}  # bools as 0/1


class RunLog:
  """Writes a run folder: config, plan, metrics.jsonl and the trackers' scalars.

  A folder that already holds metrics.jsonl is resumed: the lines with step < `start_step` are kept,
  later ones (logged after the last checkpoint of a run that crashed) are dropped, and the
  TensorBoard files are rebuilt from the kept lines, so neither shows a step twice.
  """

  def __init__(self, run_dir: str | Path, config: dict | None = None, plan: str | None = None,
               start_step: int = 0, trackers: tuple[str, ...] = ("jsonl", "tensorboard")):
    """Opens (creates or resumes) a run folder.

    Args:
      run_dir: the folder; created if missing.
      config: the resolved config as a dict (e.g. `config.to_dict(cfg)`), written as config.yaml
        and config.json; None leaves files already there.
      plan: the plan as text (e.g. `plan.format_plan(plan)`), written as plan.txt.
      start_step: the first step this run will log (store.step after a restore, 0 for a fresh
        run); earlier lines of metrics.jsonl with step >= start_step are dropped.
      trackers: where the metrics go besides metrics.jsonl (always written: report and resume
        read it): tensorboard (run_dir/tb), wandb.
    """
    unknown = [t for t in trackers if t not in TRACKERS]
    if unknown:
      raise ValueError(f"train.trackers: unknown tracker {unknown[0]!r} (one of "
                       f"{', '.join(TRACKERS)})")
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
    self._trackers = []
    if "tensorboard" in trackers:
      tb = TensorBoard(self.run_dir / TB_DIR)
      for record in kept:
        tb.scalars(record["step"], _scalars(record), record.get("time") or time.time())
      self._trackers.append(tb)
    if "wandb" in trackers:
      self._trackers.append(WandB(self.run_dir, config))

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
    """Appends one step's metrics to metrics.jsonl and the trackers, flushed before returning.

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
    for t in self._trackers:
      t.scalars(record["step"], _scalars(record), record["time"])
    return record

  def close(self):
    self._f.close()
    for t in self._trackers:
      t.close()

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


# ---- progress -------------------------------------------------------------------------------

PROGRESS_MODES = ("auto", "lines", "off")
_ETA_WINDOW = 1000  # steady steps the ETA's median is taken over: it follows a change of speed


def duration(seconds: float) -> str:
  """A duration as the two largest units that matter: 45s, 3m12s, 2h05m, 3d04h."""
  s = max(0, round(seconds))
  days, s = divmod(s, 86400)
  hours, s = divmod(s, 3600)
  minutes, s = divmod(s, 60)
  if days:
    return f"{days}d{hours:02d}h"
  if hours:
    return f"{hours}h{minutes:02d}m"
  return f"{minutes}m{s:02d}s" if minutes else f"{s}s"


def _is_terminal(stream) -> bool:
  try:
    return bool(stream.isatty())
  except (AttributeError, ValueError):  # no isatty, or a closed stream
    return False


class Progress:
  """A run's progress: a tqdm bar on a terminal, plain step lines anywhere else, or nothing.

  A step line, e.g. `step 12/200  loss 3.4521  lr 2.90e-04  gnorm 0.812  12,345 tok/s  held-out
  3.6012  ETA 3m12s`, ends in a newline and is flushed at once, so a log file or a pipe holds
  whole lines and no carriage returns. Lines (and the bar's loss figures) come at the run's first
  step, every `every` steps and at the last step. The ETA is the median time of the steps after
  the run's first (which compiles) times the steps left; the held-out loss is the latest one given.
  """

  def __init__(self, total_steps: int, start_step: int = 0, mode: str = "auto",
               stream: TextIO | None = None, every: int = 1):
    """Starts the bar (on a terminal) or nothing yet (lines, off).

    Args:
      total_steps: the step the run ends at (train.steps).
      start_step: the steps done before this run (store.step after a restore, else 0).
      mode: "auto" (the bar when `stream` is a terminal, lines otherwise), "lines" (always lines:
        `--no-progress`) or "off" (nothing, notes included: `--quiet`).
      stream: where it writes; sys.stdout when None.
      every: steps between lines (train.log_every).
    """
    if mode not in PROGRESS_MODES:
      raise ValueError(f"progress mode {mode!r}: one of {', '.join(PROGRESS_MODES)}")
    if every < 1:
      raise ValueError(f"progress every: {every} is not a positive number of steps")
    self.stream = sys.stdout if stream is None else stream
    self.total, self.start, self.every = int(total_steps), int(start_step), int(every)
    if mode == "auto":
      mode = "bar" if _is_terminal(self.stream) else "lines"
    self.mode = mode  # resolved: "bar", "lines" or "off"
    self.held_out: float | None = None
    self._steady = collections.deque(maxlen=_ETA_WINDOW)
    self._updates = 0
    self._bar = None
    if mode == "bar":
      self._bar = tqdm(total=self.total, initial=self.start, desc="train", file=self.stream,
                       dynamic_ncols=True)

  def _due(self, step: int) -> bool:
    return step == self.start + 1 or step % self.every == 0 or step >= self.total

  def eta_s(self, step: int) -> float | None:
    """Seconds until the last step from the steady steps' median; None before one is known."""
    if not self._steady:
      return None
    return statistics.median(self._steady) * max(self.total - step, 0)

  def update(self, step: int, loss: float, lr: float, grad_norm: float, tokens_per_s: float,
             step_s: float, held_out: float | None = None) -> None:
    """Reports step `step` (1-based: the steps done so far) once it finished.

    Args:
      step: the step just finished.
      loss, lr, grad_norm, tokens_per_s, step_s: that step's figures (seconds for step_s).
      held_out: a held-out loss evaluated at this step, if any; kept for the lines after it.
    """
    if held_out is not None:
      self.held_out = float(held_out)
    self._updates += 1
    if self._updates > 1:  # the run's first step holds the compilation
      self._steady.append(float(step_s))
    if self.mode == "off":
      return
    due = self._due(step)
    if self._bar is not None:
      if due:
        post = {"loss": f"{loss:.4f}", "tok_s": f"{tokens_per_s:,.0f}", "gnorm": f"{grad_norm:.3f}"}
        if self.held_out is not None:
          post["held_out"] = f"{self.held_out:.4f}"
        self._bar.set_postfix(post, refresh=False)
      self._bar.update(step - self._bar.n)
      return
    if not due:
      return
    line = (f"step {step}/{self.total}  loss {loss:.4f}  lr {lr:.2e}  gnorm {grad_norm:.3f}  "
            f"{tokens_per_s:,.0f} tok/s")
    if self.held_out is not None:
      line += f"  held-out {self.held_out:.4f}"
    eta = self.eta_s(step)
    if eta is not None:
      line += f"  ETA {duration(eta)}"
    self._write(line)

  def note(self, text: str) -> None:
    """One line of its own (an epoch begins, an evaluation, a save), above the bar on a terminal."""
    if self.mode == "off":
      return
    if self._bar is not None:
      tqdm.write(text, file=self.stream)
    else:
      self._write(text)

  def _write(self, line: str) -> None:
    self.stream.write(line + "\n")
    self.stream.flush()

  def close(self) -> None:
    if self._bar is not None:
      self._bar.close()  # a closed bar ignores later updates; tqdm.write still prints notes

  def __enter__(self) -> Progress:
    return self

  def __exit__(self, *exc):
    self.close()
