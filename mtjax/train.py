"""`python -m mtjax.train --config FILE [key.path=value ...]`: train with host-resident state."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import resource
import shutil
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

import jax

from mtjax import cli, config as config_lib, exits, launch
from mtjax import checkpoint, export, hf, models, objectives, plan as plan_lib, runlog
from mtjax import store as store_lib
from mtjax.engine import Engine
from mtjax.optimizer import HostUpdateError

log = logging.getLogger("mtjax")


def peak_rss_bytes() -> int:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def rss_bytes() -> int:
  """This process's resident memory now (Linux /proc), or its peak where /proc is missing."""
  try:
    with open("/proc/self/statm") as f:
      return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
  except OSError:
    return peak_rss_bytes()


def run_folder(cfg: config_lib.Config) -> Path:
  tc = cfg.train
  if tc.run_dir:
    folder = Path(tc.run_dir)
  elif tc.checkpoint_dir:
    folder = Path(tc.checkpoint_dir)
  else:
    folder = Path("runs") / time.strftime("%Y%m%d-%H%M%S", time.gmtime())
  # Several processes: the first writes the run folder, each other one a subfolder of its own.
  return folder / f"process_{jax.process_index()}" if jax.process_index() else folder


def device_peak_bytes(device) -> int | None:
  stats = device.memory_stats() if hasattr(device, "memory_stats") else None
  return None if not stats else stats.get("peak_bytes_in_use")


class Stopped(Exception):
  """A signal asked the run to stop; the current step finished and the state was saved."""

  def __init__(self, signum: int, step: int, saved: Path | None):
    self.signum = signum
    super().__init__(f"stopped by {exits.signal_name(signum)} after step {step}; "
                     + (f"saved {saved}" if saved else
                        "nothing saved (no checkpoint_dir, or no step trained)"))


class Abandoned(Exception):
  """A second signal: the run stopped without finishing its step (`during`, None outside the
  step loop)."""

  def __init__(self, signum: int, during: int | None = None, last: Path | None = None):
    self.signum, self.during = signum, during
    where = f" during step {during}" if during is not None else ""
    super().__init__(f"abandoned by a second {exits.signal_name(signum)}{where}; last "
                     f"checkpoint: {last or 'none'}")


class TooManySkipped(Exception):
  """train.max_skipped_steps steps in a row had a non-finite loss or gradient."""


class Saves:
  """The run's checkpoint saves: a save that fails (a full disk, permissions, a vanished folder)
  leaves the state as it was and warns once, naming the folder, the reason and the last good
  checkpoint; the next interval tries again. A second failure in a row, or a failed final save,
  raises SaveFailed (exit code exits.IO_FAILURE)."""

  def __init__(self, directory: str, keep: int):
    self.directory, self.keep = directory, keep
    self.failed = 0  # failures in a row

  def __call__(self, store, meta: dict, source: str | None, final: bool = False) -> Path | None:
    """Saves step `store.step` (and prunes to `keep`); returns its path, or None when it failed
    and the run may go on."""
    try:
      path = checkpoint.save(store, self.directory, meta, source=source)
    except checkpoint.SaveFailed as e:
      self.failed += 1
      last = checkpoint.latest(self.directory)
      line = f"checkpoint: {e}; last good checkpoint: {last or 'none'}"
      if final or self.failed > 1:
        why = "the final save failed" if final else f"{self.failed} saves in a row failed"
        raise checkpoint.SaveFailed(f"{line} ({why}; free space or fix the folder, then run "
                                    f"again to resume)") from None
      log.warning("%s; trying again at the next checkpoint", line)
      return None
    self.failed = 0
    checkpoint.prune(self.directory, self.keep)
    return path


LOG_FILE = "train.log"  # in the run folder: library threads' errors and tracebacks, warnings


class _ThreadStderr:
  """sys.stderr for the run: the main thread's writes (mtjax's messages, the progress bar) reach
  the terminal, other threads' (tracebacks that tensorstore's callback threads print directly)
  go to the log file."""

  def __init__(self, terminal, log_file):
    self._terminal, self._log = terminal, log_file

  def write(self, text):
    if threading.current_thread() is threading.main_thread():
      return self._terminal.write(text)
    self._log.write(text)
    self._log.flush()
    return len(text)

  def flush(self):
    self._terminal.flush()

  def __getattr__(self, name):  # isatty, fileno, encoding: the terminal's
    return getattr(self._terminal, name)


class _LibraryLogs:
  """Sends what libraries log (orbax's background threads log their tracebacks through absl),
  uncaught exceptions of threads and whatever other threads print to stderr to the run folder's
  log file, never to the terminal; mtjax's own one-line messages still reach stderr."""

  def __init__(self, folder: Path):
    self.path = Path(folder) / LOG_FILE

  def __enter__(self):
    root = logging.getLogger()
    self._old = root.handlers[:], root.level, threading.excepthook
    self.path.parent.mkdir(parents=True, exist_ok=True)
    self.handler = logging.FileHandler(self.path, encoding="utf-8")
    self.handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root.handlers = [self.handler]
    root.setLevel(logging.WARNING)
    self._stderr = sys.stderr
    sys.stderr = _ThreadStderr(sys.stderr, self.handler.stream)
    threading.excepthook = lambda a: logging.getLogger("thread").error(
        "uncaught in thread %s", a.thread.name if a.thread else "?",
        exc_info=(a.exc_type, a.exc_value, a.exc_traceback))
    return self

  def __exit__(self, *exc):
    root = logging.getLogger()
    root.handlers, level, threading.excepthook = self._old
    root.setLevel(level)
    sys.stderr = self._stderr
    self.handler.close()


def check_disk(cfg: config_lib.Config, plan) -> None:
  """Refuses (PlanError) a run whose checkpoints (keep-K plus the one being written) and export do
  not fit in the free space of their folders, unless train.allow_low_disk accepts the risk.
  Committed checkpoints already there count as space the run will reuse (pruning frees them)."""
  tc = cfg.train
  if tc.allow_low_disk:
    return
  need: dict[Path, list] = {}

  def add(path, n, what):
    folder = Path(path).absolute()
    while not folder.exists():  # the nearest existing folder holds its file system
      folder = folder.parent
    dev = folder.stat().st_dev
    entry = next((v for v in need.values() if v[0] == dev), None) or need.setdefault(
        folder, [dev, 0, [], folder])
    entry[1] += n
    entry[2].append(what)

  disk = plan.disk
  if tc.checkpoint_dir and disk.get("checkpoints kept"):
    n = max(0, disk["checkpoints kept"] - checkpoint.stored_bytes(tc.checkpoint_dir))
    add(tc.checkpoint_dir, n, f"checkpoints {plan_lib.human_bytes(disk['checkpoints kept'])} "
                              f"({plan_lib.human_bytes(disk['one checkpoint'])} each)")
  if tc.export_dir and disk.get("export"):
    add(Path(tc.export_dir).absolute().parent, disk["export"], f"export {plan_lib.human_bytes(disk['export'])}")
  for _, n, what, folder in need.values():
    free = shutil.disk_usage(folder).free
    if n > free:
      raise plan_lib.PlanError(
          f"not enough disk space: {folder} has {plan_lib.human_bytes(free)} free, the run needs {plan_lib.human_bytes(n)} more "
          f"({', '.join(what)}); free space, lower train.keep_checkpoints, use another folder or "
          f"set train.allow_low_disk=true to accept the risk")


class _Signals:
  """SIGINT / SIGTERM: the first finishes the step and saves, the second abandons it."""

  def __init__(self):
    self.received: list[int] = []
    self._old = {}

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():  # signals reach the main thread only
      for sig in (signal.SIGINT, signal.SIGTERM):
        self._old[sig] = signal.signal(sig, self._handle)
    return self

  def _handle(self, signum, frame):
    self.received.append(signum)
    if len(self.received) > 1:
      raise Abandoned(signum)

  def __exit__(self, *exc):
    for sig, old in self._old.items():
      signal.signal(sig, old)


def check_outputs(cfg: config_lib.Config, json_path: str | None = None) -> None:
  """Refuses, before any training, output paths that cannot be written."""
  tc = cfg.train
  if tc.checkpoint_dir:  # checked only: the folder is taken once nothing can refuse the run
    checkpoint.check_claim(tc.checkpoint_dir, tc.resume, tc.overwrite)
    if tc.resume:
      checkpoint.check_model(tc.checkpoint_dir, config_lib.to_dict(cfg.model))
  for key, path in (("train.export_dir", tc.export_dir), ("--json", json_path)):
    if not path:
      continue
    p = Path(path)
    if key == "train.export_dir" and p.exists() and (not p.is_dir() or any(p.iterdir())):
      raise ValueError(f"{key}: {p} exists and is not an empty folder")
    if key == "--json" and p.is_dir():
      raise ValueError(f"{key}: {p} is a folder")
    parent = p.absolute().parent
    if not parent.is_dir() or not os.access(parent, os.W_OK):
      raise ValueError(f"{key}: cannot write into {parent}")


def check_length(model: config_lib.ModelConfig, seq: int) -> None:
  """Refuses sequences longer than the model was trained for (config.json's
  max_position_embeddings), unless model.max_position is raised on purpose."""
  if model.max_position is not None and seq > model.max_position:
    raise ValueError(f"train.seq: {seq} tokens exceed the model's max_position_embeddings "
                     f"({model.max_position}); set model.max_position={seq} to train beyond it "
                     f"(its RoPE then extrapolates; the export records the new length)")


def check_resume(cfg: config_lib.Config) -> None:
  """Refuses a resume that would change the run mid-way: its learning-rate schedule (with
  optim.decay_steps null the cosine spans train.steps, so other train.steps would re-stretch it
  from the checkpoint's step on), or its moments' storage between 8-bit codes and floats."""
  tc = cfg.train
  if not (tc.checkpoint_dir and tc.resume):
    return
  for path in checkpoint.steps(tc.checkpoint_dir):
    try:
      saved = checkpoint.read_meta(path)["extra"]["config"]
      steps, decay = saved["train"]["steps"], saved["optim"]["decay_steps"]
    except (ValueError, OSError, KeyError, TypeError):
      continue  # damaged: restore_latest skips it and says why
    state = saved["optim"].get("state_dtype")
    if state not in (None, cfg.optim.state_dtype) and "int8" in (state, cfg.optim.state_dtype):
      raise checkpoint.CheckpointMismatch(checkpoint.state_dtype_line(path, state,
                                                                      cfg.optim.state_dtype))
    if decay is None and cfg.optim.decay_steps is None and steps != tc.steps:
      raise ValueError(
          f"train.steps: {tc.steps} differs from the {steps} that {path} was trained toward, and "
          f"with optim.decay_steps null the cosine schedule spans train.steps: set "
          f"optim.decay_steps={steps} to keep its schedule (the steps after {steps} at the floor "
          f"learning rate) or optim.decay_steps={tc.steps} to stretch it from here on")
    return


@dataclasses.dataclass(frozen=True)
class Inputs:
  """Every input of the run checked, before anything is allocated."""
  objective: objectives.Objective
  data: object  # what the objective's `data` checked (its sources are built from it)


def check_inputs(cfg: config_lib.Config) -> Inputs:
  """The objective's data files, the tokenizer they were prepared with, the sequence length, the
  Hugging Face files and the schedule of a resume; each refusal is one line naming the key."""
  objective = objectives.get(cfg.train)
  objective.check(cfg)
  check_length(cfg.model, cfg.train.seq)
  checked = objective.data(cfg)  # the tokenizer they were prepared with included
  if cfg.model.from_hf:
    hf.Checkpoint(cfg.model.from_hf).check(models.spec(cfg.model))
  check_resume(cfg)
  return Inputs(objective, checked)


def plan_run(cfg: config_lib.Config, on_plan=None) -> tuple[config_lib.Config, plan_lib.Plan]:
  """The plan (refused before any allocation when it does not fit) and the disk it needs."""
  cfg, plan = launch.plan_run(cfg)
  if jax.process_count() > 1:  # asked only now: it starts the backend, which the launch sets up
    for key in ("checkpoint_dir", "export_dir"):
      if getattr(cfg.train, key):
        raise ValueError(f"train.{key}: not supported yet in a run over several processes "
                         f"(hosts); leave it unset")
  if on_plan is not None:
    on_plan(plan)
  check_disk(cfg, plan)
  return cfg, plan


@dataclasses.dataclass
class Started:
  """The run's state in memory, its data and where it came from."""
  store: store_lib.LayerStore
  engine: Engine
  source: object  # batch(step), position(step), epoch(step)
  held_out: object | None  # evaluate(engine) -> {metric: value}, or None
  resumed: Path | None  # the checkpoint restored, or None
  init_s: float  # seconds to allocate the state


def start(cfg: config_lib.Config, inputs: Inputs) -> Started:
  """Allocates the state, fills it (the checkpoint to resume, else the Hugging Face weights, else
  the init) and builds the objective's sources; an objective that reads the initial weights (a
  reference model) sees them before a checkpoint replaces them."""
  tc, objective = cfg.train, inputs.objective
  t0 = time.perf_counter()
  store = store_lib.create(cfg, jax.random.key(tc.seed))  # the only key: data is seeded by step
  init_s = time.perf_counter() - t0
  engine = Engine(cfg, store)
  loaded = False
  if objective.reads_initial_weights:
    if cfg.model.from_hf:
      hf.load_into(store, cfg.model.from_hf)
    loaded = True
    source, held_out, line = objective.sources(cfg, engine, inputs.data)
  resumed = None
  if tc.checkpoint_dir and tc.resume:
    resumed, extra, skipped = checkpoint.restore_latest(store, tc.checkpoint_dir)
    for line_ in skipped:
      log.warning("checkpoint: %s", line_)
  if resumed is None and cfg.model.from_hf and not loaded:
    hf.load_into(store, cfg.model.from_hf)
  if not objective.reads_initial_weights:
    source, held_out, line = objective.sources(cfg, engine, inputs.data)
  if resumed is not None and hasattr(source, "resume"):  # what the source saved (grpo's rollouts)
    source.resume(extra.get("data_position"))
  if line:
    log.info("%s", line)
  return Started(store, engine, source, held_out, resumed, init_s)


@dataclasses.dataclass
class Trained:
  """What the step loop did."""
  losses: list = dataclasses.field(default_factory=list)
  times: list = dataclasses.field(default_factory=list)
  evals: list = dataclasses.field(default_factory=list)  # (step, the evaluation's first metric)
  skipped: list = dataclasses.field(default_factory=list)  # steps whose update was skipped
  stop: int | None = None  # the signal that stopped the run
  saved: Path | None = None  # the newest checkpoint this run wrote


def loop(cfg: config_lib.Config, run: Started, metrics: runlog.RunLog, progress: runlog.Progress,
         signals, folder: Path) -> Trained:
  """The steps from the store's to train.steps: each one's metrics, progress line, evaluation
  and checkpoint; a signal stops it after the step (saved), a second one abandons the step."""
  tc, store, engine, src = cfg.train, run.store, run.engine, run.source
  device = jax.local_devices()[0]
  accel = device.platform != "cpu"
  saves = Saves(tc.checkpoint_dir, tc.keep_checkpoints)
  out, in_a_row = Trained(), 0
  work = plan_lib.flops(cfg)  # FLOPs of one step, with and without attention
  tokens_per_step = tc.batch * tc.seq

  def save(final=False):
    engine.sync()
    meta = {"config": config_lib.to_dict(cfg), "data_position": src.position(store.step)}
    return saves(store, meta, cfg.model.from_hf, final) or out.saved

  def evaluate(step):
    values = run.held_out.evaluate(engine)
    out.evals.append((step, next(iter(values.values()))))  # held_out_loss, or its like
    progress.note(f"step {step}: " + ", ".join(f"{k.replace('_', ' ')} {v:.4f}"
                                               for k, v in values.items()))
    return values

  if run.held_out is not None and tc.eval_every and store.step == 0:  # before any update
    metrics.log(0, tokens=0, **evaluate(0))
  epoch = src.epoch(store.step)
  for i in range(store.step, tc.steps):
    if signals.received:  # arrived before this step: during start-up or an evaluation
      out.stop = signals.received[0]
      break
    if src.epoch(i) != epoch:
      epoch = src.epoch(i)
      progress.note(f"data: epoch {epoch + 1} begins at step {i + 1}")
    profiling = tc.profile_step == i + 1
    if profiling:
      jax.profiler.start_trace(str(folder / "profile"))
    stats = engine.step(src.batch(i))
    if profiling:
      engine.sync()
      jax.profiler.stop_trace()
    out.losses.append(stats.loss)
    out.times.append(stats.step_s)
    in_a_row = in_a_row + 1 if stats.skipped else 0
    if stats.skipped:
      out.skipped.append(stats.step)
      log.warning("step %d skipped: loss %s, gradient norm %s (not finite)", stats.step,
                  stats.loss, stats.grad_norm)
      if in_a_row >= tc.max_skipped_steps:
        last = checkpoint.latest(tc.checkpoint_dir) if tc.checkpoint_dir else None
        raise TooManySkipped(f"{in_a_row} steps in a row (up to step {stats.step}) had a "
                             f"non-finite loss or gradient; lower optim.lr or set "
                             f"optim.clip_norm (train.max_skipped_steps={tc.max_skipped_steps}); "
                             f"last checkpoint: {last or 'none'}")
    record = dict(loss=stats.loss, lr=stats.lr, grad_norm=stats.grad_norm,
                  skipped=stats.skipped, tokens=stats.step * tokens_per_step,
                  tokens_per_s=stats.tokens / stats.step_s,
                  model_tflops=work["model"] / stats.step_s / 1e12,
                  tflops_with_attention=work["with_attention"] / stats.step_s / 1e12,
                  step_s=stats.step_s, forward_s=stats.forward_s,
                  backward_s=stats.backward_s, finish_s=stats.finish_s,
                  opt_wait_s=stats.opt_wait_s, device_wait_s=stats.device_wait_s,
                  host_rss_gib=rss_bytes() / 2**30, epoch=src.epoch(i), **stats.objective,
                  **(src.metrics(i) if hasattr(src, "metrics") else {}))  # the batch's own
    if accel:
      record["device_peak_gib"] = (device_peak_bytes(device) or 0) / 2**30
    if run.held_out is not None and (store.step % tc.eval_every == 0 or store.step == tc.steps):
      record.update(evaluate(store.step))
    metrics.log(stats.step, **record)
    progress.update(stats.step, loss=stats.loss, lr=stats.lr, grad_norm=stats.grad_norm,
                    tokens_per_s=stats.tokens / stats.step_s, step_s=stats.step_s,
                    held_out=out.evals[-1][1] if out.evals else None)
    if signals.received:
      out.stop = signals.received[0]
      break
    if tc.checkpoint_dir and tc.checkpoint_every and store.step % tc.checkpoint_every == 0:
      out.saved = save()
  if tc.checkpoint_dir and out.losses and (out.saved is None
                                           or out.saved.name != f"step_{store.step}"):
    out.saved = save(final=True)
  engine.sync()
  return out


def _last_checkpoint(cfg: config_lib.Config) -> Path | None:
  return checkpoint.latest(cfg.train.checkpoint_dir) if cfg.train.checkpoint_dir else None


def run(cfg: config_lib.Config, progress: bool | str = True, on_plan=None,
        json_path: str | None = None) -> dict:
  """Trains for cfg.train.steps steps and returns a summary of the run.

  The stages: the outputs claimed, the plan (refused before any allocation when it does not
  fit), every input checked, the state started, the step loop, the final save and export. Bad
  inputs are refused before anything is trained. SIGINT/SIGTERM finish the current step, save a
  checkpoint and raise Stopped; a second one raises Abandoned at once.

  Args:
    progress: "auto" (a bar on a terminal, plain step lines otherwise; True), "lines" or "off"
      (False).
    on_plan: called with the plan once the run is planned, before anything is allocated.
    json_path: where the CLI will write the summary (checked up front).
  """
  mode = {True: "auto", False: "off"}.get(progress, progress)
  with _Signals() as signals:
    try:
      check_outputs(cfg, json_path)
      cfg, plan = plan_run(cfg, on_plan)
      inputs = check_inputs(cfg)
      if cfg.train.checkpoint_dir:
        checkpoint.claim(cfg.train.checkpoint_dir, cfg.train.resume, cfg.train.overwrite)
      folder = run_folder(cfg)
      with _LibraryLogs(folder):
        return _train(cfg, plan, inputs, folder, mode, signals)
    except Abandoned as e:
      if e.during is None:  # outside the step loop: start-up, the final save or sync
        raise Abandoned(e.signum, None, _last_checkpoint(cfg)) from None
      raise


def _train(cfg: config_lib.Config, plan, inputs: Inputs, folder: Path, mode: str, signals
           ) -> dict:
  """Starts the state, runs the loop, saves and exports; returns the summary."""
  tc = cfg.train
  run_ = start(cfg, inputs)
  store, engine = run_.store, run_.engine
  metrics = runlog.RunLog(folder, config_lib.to_dict(cfg), plan_lib.format_plan(plan),
                          start_step=store.step + 1 if run_.resumed else 0,  # steps are 1-based
                          trackers=tuple(t for t in tc.trackers
                                         if tc.tensorboard or t != "tensorboard"))
  progress = runlog.Progress(tc.steps, store.step, mode=mode, every=tc.log_every)
  exported = None
  try:
    done = loop(cfg, run_, metrics, progress, signals, folder)
    if tc.export_dir and done.losses and done.stop is None:
      export_at_end(store, tc, cfg.model.from_hf, done.saved)
      exported = Path(tc.export_dir)
  except Abandoned as e:
    raise Abandoned(e.signum, store.step + 1, _last_checkpoint(cfg)) from None
  except HostUpdateError as e:
    raise HostUpdateError(f"{e}; the state in memory is part-updated and was not saved; last "
                          f"checkpoint: {_last_checkpoint(cfg) or 'none'}") from None
  finally:
    progress.close()
    metrics.close()
    try:
      engine.close()
    except HostUpdateError:
      pass  # already on its way to the caller
  if done.stop is not None:
    raise Stopped(done.stop, store.step, done.saved)
  if not done.losses:
    raise ValueError(f"train.steps: {tc.steps} reached already by the checkpoint at step "
                     f"{store.step} ({run_.resumed}); raise train.steps to train further (and set "
                     f"optim.decay_steps: the schedule it had spans {tc.steps} steps)")
  return summarize(cfg, plan, run_, done, folder, exported)


def summarize(cfg: config_lib.Config, plan, run_: Started, done: Trained, folder: Path,
              exported: Path | None) -> dict:
  """The run's summary (the CLI prints it and writes it with --json)."""
  tc, store = cfg.train, run_.store
  device = jax.local_devices()[0]
  timed = done.times[1:] or done.times  # the first step includes compilation
  step_s = statistics.median(timed)
  tokens = tc.batch * tc.seq
  n = store.n_params
  allocated = store.allocated_bytes()
  counts = models.spec(cfg.model).counts
  work = plan_lib.flops(cfg)
  return {
      "family": cfg.model.family,
      "params": n,
      "active_params": counts["active"],
      "steps": len(done.losses),
      "resumed_from": None if run_.resumed is None else str(run_.resumed),
      "first_loss": done.losses[0],
      "final_loss": done.losses[-1],
      "skipped_steps": done.skipped,
      "held_out": done.evals,  # (step, loss) of each evaluation (grpo: held-out reward)
      "step_s_median": step_s,
      "tokens_per_s": tokens / step_s,
      "model_tflops": work["model"] / step_s / 1e12,
      "tflops_with_attention": work["with_attention"] / step_s / 1e12,
      "state_bytes_per_param": sum(allocated.values()) / n,
      "state_host_gib": (allocated["host"] + allocated["pinned"]) / 2**30,
      "state_device_gib": allocated["device"] / 2**30,
      "peak_rss_gib": peak_rss_bytes() / 2**30,
      "peak_rss_bytes_per_param": peak_rss_bytes() / n,
      "device_peak_gib": (lambda b: None if b is None else b / 2**30)(device_peak_bytes(device)),
      "init_s": run_.init_s,
      "plan_host_gib": plan.host_total / 2**30,
      "plan_device_gib": plan.device_total / 2**30,
      "plan_step_s": plan.roofline_s,
      "plan_schedule_s": plan.schedule_s,
      "plan_schedule_best_s": plan.schedule_best_s,
      "device_state_layers": plan.device_state_layers,
      "device_update_layers": plan.device_update_layers,
      "host_groups": plan.tiers.count("host"),
      "devices": plan.devices,
      "device_list": [str(d) for d in store.devices],
      "activations_every": plan.activations_every,
      "activations_on_host": plan.activations_on_host,
      "layers": cfg.model.layers,
      "batch": tc.batch,
      "seq": tc.seq,
      "checkpoint": None if done.saved is None else str(done.saved),
      "export": None if exported is None else str(exported),
      "run_dir": str(folder),
      "device": str(device),
      "jax": jax.__version__,
  }


def export_at_end(store, tc: config_lib.TrainConfig, source: str | None, saved: Path | None):
  """The end-of-run export to train.export_dir; a write that fails says what is safe (the
  checkpoint) and how to export it again."""
  try:
    groups = ((g.name, store.read(i)["w"]) for i, g in enumerate(store.groups))
    export.export_verified(tc.export_dir, store.model_cfg, groups, tc.export_dtype, source)
  except OSError as e:
    again = (f"the checkpoint {saved} is saved: export it with python -m mtjax.export "
             f"--checkpoint {saved} --out {tc.export_dir}" if saved else "nothing was saved "
             "(no train.checkpoint_dir)")
    failed = OSError(f"train.export_dir: cannot write {tc.export_dir} "
                     f"({checkpoint.reason(e)}); {again}")
    failed.errno = e.errno
    raise failed from None


def json_safe(x):
  """The summary with non-finite numbers as null, so the file is valid JSON."""
  if isinstance(x, float) and not math.isfinite(x):
    return None
  if isinstance(x, dict):
    return {k: json_safe(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [json_safe(v) for v in x]
  return x


def format_summary(s: dict) -> str:
  """A few aligned lines; figures that mean nothing on this backend (CPU) are left out."""
  accel = s["device_peak_gib"] is not None
  held = (f" (held-out {s['held_out'][0][1]:.4f} -> {s['held_out'][-1][1]:.4f})"
          if s["held_out"] else "")
  skipped = f", {len(s['skipped_steps'])} skipped" if s["skipped_steps"] else ""
  loss = lambda x: "nan" if x is None or not math.isfinite(x) else f"{x:.4f}"
  rows = [
      ("model", f"{s['family']}, {s['params'] / 1e6:,.1f}M params"
                + (f" ({s['active_params'] / 1e6:,.1f}M active per token)"
                   if s['active_params'] != s['params'] else "")
                + f" on {s['devices']} device(s) ({s['device']}"
                + (" ..." if s['devices'] > 1 else "") + "); state "
                f"{s['state_bytes_per_param']:.2f} B/param: {s['state_host_gib']:.2f} GiB host, "
                f"{s['state_device_gib']:.2f} GiB device ({s['device_state_layers']} groups in "
                f"device memory, {s['device_update_layers']} streamed, {s['host_groups']} on the "
                f"host)"),
      ("loss", f"{loss(s['first_loss'])} -> {loss(s['final_loss'])}{held} over {s['steps']} "
               f"steps{skipped}"),
      ("speed", f"{s['tokens_per_s']:,.0f} tokens/s, {s['step_s_median']:.3f} s/step (median "
                f"after the first), {s['model_tflops']:.1f} model TFLOP/s "
                f"({s['tflops_with_attention']:.1f} with attention)"
                + (f"; plan {s['plan_schedule_best_s']:.3f}-{s['plan_schedule_s']:.3f} s"
                   if accel else "")),
      ("memory", f"peak RSS {s['peak_rss_gib']:.2f} GiB (plan {s['plan_host_gib']:.2f})"
                 + (f", device peak {s['device_peak_gib']:.2f} GiB (plan "
                    f"{s['plan_device_gib']:.2f})" if accel else "")),
      ("run folder", s["run_dir"] + (f"; checkpoint {s['checkpoint']}" if s["checkpoint"] else "")
                     + (f"; export {s['export']}" if s.get("export") else "")),
  ]
  return "\n".join(f"{k:<11}{v}" for k, v in rows)


def internal_error_log(cfg: config_lib.Config, e: BaseException) -> Path:
  """Appends the traceback of an unexpected error to the run folder's log file; returns its path."""
  import traceback
  path = run_folder(cfg) / LOG_FILE
  try:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
      f.write("".join(traceback.format_exception(e)))
  except OSError:
    path = Path(os.devnull)
  return path


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(
      prog="python -m mtjax.train", description=__doc__,
      formatter_class=argparse.ArgumentDefaultsHelpFormatter,
      epilog=cli.CONFIG_HELP)
  p.add_argument("--json", help="also write the summary as JSON to this path")
  p.add_argument("--no-progress", action="store_true",
                 help="plain step lines instead of the progress bar (the default whenever stdout "
                      "is not a terminal)")
  p.add_argument("--log-every", type=int, metavar="N",
                 help="a step line (or bar update) every N steps: train.log_every")
  p.add_argument("--quiet", action="store_true",
                 help="no progress, no summary and only warnings in the log (errors still show)")
  p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                 help="level of mtjax's log messages on stderr")
  p.add_argument("--show-plan", action="store_true", help="print the plan before training")
  p.add_argument("--debug", action="store_true",
                 help="show the full traceback of an error instead of its one-line summary")
  p.add_argument("--coordinator", metavar="HOST:PORT",
                 help="several hosts: process 0's address (jax.distributed); with --num-processes "
                      "and --process-id")
  p.add_argument("--num-processes", type=int, help="several hosts: how many processes in all")
  p.add_argument("--process-id", type=int, help="several hosts: this process's index, from 0")
  args, cfg = cli.parse_cli(p, argv, extra=lambda a: [f"train.log_every={a.log_every}"]
                            if a.log_every is not None else [])
  dist = (args.coordinator, args.num_processes, args.process_id)
  if any(x is not None for x in dist):
    if any(x is None for x in dist) or not 0 <= args.process_id < args.num_processes:
      return exits.fail("error", "several hosts need --coordinator, --num-processes and "
                        "--process-id (0 <= id < processes)", exits.BAD_INPUT)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU-only hosts too
    jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)
  runlog.setup_logging("WARNING" if args.quiet else args.log_level)
  show = (lambda plan: print(plan_lib.format_plan(plan), flush=True)) if args.show_plan else None
  mode = "off" if args.quiet else "lines" if args.no_progress else "auto"
  try:
    summary = run(cfg, progress=mode, on_plan=show, json_path=args.json)
  except plan_lib.PlanError as e:
    return exits.fail("refused", e, exits.BAD_INPUT)
  except (Stopped, Abandoned) as e:
    print(f"{e}", file=sys.stderr)
    return exits.of_signal(e.signum)
  except TooManySkipped as e:
    return exits.fail("error", e, exits.DIVERGED)
  except HostUpdateError as e:
    return exits.fail("error", e, exits.FAILED)
  except checkpoint.SaveFailed as e:
    return exits.fail("error", e, exits.IO_FAILURE)
  except (ValueError, OSError, KeyError) as e:  # bad input: data, checkpoint, paths, HF files
    if args.debug:
      raise
    return exits.fail("error", e, exits.of_os_error(e) if isinstance(e, OSError)
                      else exits.BAD_INPUT)
  except Exception as e:
    if args.debug:
      raise
    where = internal_error_log(cfg, e)
    return exits.fail("internal error", f"{type(e).__name__}: {exits.one_line(e)[:300]} "
                      f"(traceback in {where}; --debug shows it here)", exits.FAILED)
  if not args.quiet:
    print(format_summary(summary))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(json_safe(summary), f, indent=2, allow_nan=False)
  return 0


if __name__ == "__main__":
  sys.exit(main())
