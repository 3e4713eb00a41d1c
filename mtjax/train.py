"""`python -m mtjax.train --config FILE [key.path=value ...]`: train with host-resident state."""

from __future__ import annotations

import argparse
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
from tqdm.auto import tqdm

from mtjax import cli, config as config_lib, exits
from mtjax import checkpoint, data, dpo, export, hf, launch, models, plan as plan_lib, runlog
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


class Abandoned(Exception):
  """A second signal: the run stopped without finishing its step."""


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
  for dev, n, what, folder in need.values():
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
      raise Abandoned(signal.Signals(signum).name)

  def __exit__(self, *exc):
    for sig, old in self._old.items():
      signal.signal(sig, old)


def check_outputs(cfg: config_lib.Config, json_path: str | None = None) -> None:
  """Refuses, before any training, output paths that cannot be written."""
  tc = cfg.train
  if tc.checkpoint_dir:
    checkpoint.claim(tc.checkpoint_dir, tc.resume, tc.overwrite)
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


def run(cfg: config_lib.Config, progress: bool = True, on_plan=None, json_path: str | None = None
        ) -> dict:
  """Trains for cfg.train.steps steps and returns a summary of the run (see `_run`); SIGINT and
  SIGTERM are handled from the start to the end of the run, the final sync included."""
  with _Signals() as signals:
    try:
      return _run(cfg, progress, on_plan, json_path, signals)
    except Abandoned as e:
      if str(e).startswith("abandoned"):
        raise
      # The second signal landed outside the step loop (start-up, the final save or sync).
      ck = cfg.train.checkpoint_dir
      last = checkpoint.latest(ck) if ck else None
      raise Abandoned(f"abandoned by a second {e}; last checkpoint: {last or 'none'}") from None


def _run(cfg: config_lib.Config, progress: bool, on_plan, json_path: str | None, signals
         ) -> dict:
  """Trains for cfg.train.steps steps and returns a summary of the run.

  Bad inputs (output paths, data files, a Hugging Face directory, a checkpoint of another model)
  are refused before anything is trained. SIGINT/SIGTERM finish the current step, save a
  checkpoint and raise Stopped; a second one raises Abandoned at once.

  Args:
    on_plan: called with the plan once the run is planned, before anything is allocated.
    json_path: where the CLI will write the summary (checked up front).
  """
  check_outputs(cfg, json_path)
  cfg, plan = launch.plan_run(cfg)  # refuses a run that cannot fit, before any allocation
  if jax.process_count() > 1:  # asked only now: it starts the backend, which prepare sets up
    for key in ("checkpoint_dir", "export_dir"):
      if getattr(cfg.train, key):
        raise ValueError(f"train.{key}: not supported yet in a run over several processes "
                         f"(hosts); leave it unset")
  if on_plan is not None:
    on_plan(plan)
  check_disk(cfg, plan)
  tc = cfg.train
  src = pairs = None
  if tc.objective == "dpo":  # checks the files; the source follows the reference log-probs
    pairs = dpo.load_pairs(cfg.data.path, tc.seq, cfg.model.vocab_size)
  else:
    src = data.source(cfg.data, tc.batch, tc.seq, cfg.model.vocab_size, tc.seed)  # checks the files
  if tc.eval_every:  # the held-out split is checked now, not at the first evaluation
    try:
      data.Prepared(cfg.data.path, "val", cfg.model.vocab_size)
    except ValueError as e:
      raise ValueError(f"train.eval_every: {tc.eval_every} needs held-out documents ({e}); "
                       f"prepare the data with --val-fraction 0.02, or set train.eval_every=0"
                       ) from None
  if cfg.model.from_hf:
    hf.Checkpoint(cfg.model.from_hf).check(models.spec(cfg.model))
  folder = run_folder(cfg)
  with _LibraryLogs(folder):
    return _train(cfg, plan, src, pairs, folder, progress, signals)


def _train(cfg: config_lib.Config, plan, src, pairs, folder: Path, progress: bool, signals
           ) -> dict:
  """The body of `_run` once every input is checked: allocate, restore, train, save, export.
  `src` is the token source, or None with a pair objective's `pairs` (its source is built once
  the reference log-probs of the initial weights are known)."""
  tc = cfg.train
  device = jax.local_devices()[0]
  init_key = jax.random.key(tc.seed)  # the only key: data is seeded from train.seed by step
  t0 = time.perf_counter()
  store = store_lib.create(cfg, init_key)
  init_s = time.perf_counter() - t0
  engine = Engine(cfg, store)
  initial = False  # the initial weights are in the store (dpo's reference needs them)
  if tc.objective == "dpo":
    if cfg.model.from_hf:
      hf.load_into(store, cfg.model.from_hf)
    initial = True
    src, computed = dpo.training_source(cfg, engine, pairs)
    log.info("dpo: reference log-probs %s %s", "computed into" if computed else "read from",
             cfg.data.path)
  resumed = None
  if tc.checkpoint_dir and tc.resume:
    resumed, _, skipped = checkpoint.restore_latest(store, tc.checkpoint_dir)
    for line in skipped:
      log.warning("checkpoint: %s", line)
  if resumed is None and cfg.model.from_hf and not initial:
    hf.load_into(store, cfg.model.from_hf)
  metrics = runlog.RunLog(folder, config_lib.to_dict(cfg), plan_lib.format_plan(plan),
                          start_step=store.step + 1 if resumed else 0,  # steps are 1-based
                          trackers=tuple(t for t in tc.trackers
                                         if tc.tensorboard or t != "tensorboard"))
  accel = device.platform != "cpu"

  def meta():  # kept with every checkpoint: export reads the config, a resume the data position
    return {"config": config_lib.to_dict(cfg), "data_position": src.position(store.step)}

  saves = Saves(tc.checkpoint_dir, tc.keep_checkpoints)

  def save(final=False):
    engine.sync()
    return saves(store, meta(), cfg.model.from_hf, final) or saved

  def held_out():
    it = data.validation_batches(cfg.data, tc.batch, tc.seq, cfg.model.vocab_size)
    return engine.evaluate(b for _, b in zip(range(tc.eval_batches), it))

  losses, times, evals, skipped_steps = [], [], [], []
  in_a_row, stop, saved = 0, None, None
  bar = tqdm(range(store.step, tc.steps), desc="train", disable=not progress, dynamic_ncols=True)
  tokens_per_step = tc.batch * tc.seq
  work = plan_lib.flops(cfg)  # FLOPs of one step, with and without attention
  try:
    if tc.eval_every and store.step == 0 and tc.steps > 0:  # the baseline before any update
      evals.append((0, held_out()))
      metrics.log(0, held_out_loss=evals[-1][1], tokens=0)
    for i in bar:
      if signals.received:  # arrived before this step: during start-up or an evaluation
        stop = signal.Signals(signals.received[0]).name
        break
      profiling = tc.profile_step == i + 1
      if profiling:
        jax.profiler.start_trace(str(folder / "profile"))
      stats = engine.step(src.batch(i))
      if profiling:
        engine.sync()
        jax.profiler.stop_trace()
      losses.append(stats.loss)
      times.append(stats.step_s)
      in_a_row = in_a_row + 1 if stats.skipped else 0
      if stats.skipped:
        skipped_steps.append(stats.step)
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
                    opt_wait_s=stats.opt_wait_s,
                    device_wait_s=stats.device_wait_s,
                    host_rss_gib=rss_bytes() / 2**30, **stats.objective)
      if accel:
        record["device_peak_gib"] = (device_peak_bytes(device) or 0) / 2**30
      if tc.eval_every and (store.step % tc.eval_every == 0 or store.step == tc.steps):
        evals.append((store.step, held_out()))
        record["held_out_loss"] = evals[-1][1]
      metrics.log(stats.step, **record)
      if i % tc.log_every == 0 or i == tc.steps - 1:
        post = dict(loss=f"{stats.loss:.4f}", tok_s=f"{stats.tokens / stats.step_s:,.0f}",
                    gnorm=f"{stats.grad_norm:.3f}")
        if evals:
          post["held_out"] = f"{evals[-1][1]:.4f}"
        bar.set_postfix(post)
      if signals.received:
        stop = signal.Signals(signals.received[0]).name
        break
      if tc.checkpoint_dir and tc.checkpoint_every and store.step % tc.checkpoint_every == 0:
        saved = save()
    if tc.checkpoint_dir and losses and (saved is None or saved.name != f"step_{store.step}"):
      saved = save(final=True)
    engine.sync()
    if tc.export_dir and losses and stop is None:
      export_at_end(store, tc, cfg.model.from_hf, saved)
  except Abandoned as e:
    last = checkpoint.latest(tc.checkpoint_dir) if tc.checkpoint_dir else None
    raise Abandoned(f"abandoned by a second {e} during step {store.step + 1}; last checkpoint: "
                    f"{last or 'none'}") from None
  except HostUpdateError as e:
    last = checkpoint.latest(tc.checkpoint_dir) if tc.checkpoint_dir else None
    raise HostUpdateError(f"{e}; the state in memory is part-updated and was not saved; last "
                          f"checkpoint: {last or 'none'}") from None
  finally:
    bar.close()
    metrics.close()
    try:
      engine.close()
    except HostUpdateError:
      pass  # already on its way to the caller
  if stop is not None:
    raise Stopped(f"stopped by {stop} after step {store.step}; "
                  + (f"saved {saved}" if saved else "nothing saved (no checkpoint_dir, or no "
                                                    "step trained)"))
  if not losses:
    raise ValueError(f"train.steps: {tc.steps} reached already by the checkpoint at step "
                     f"{store.step} ({resumed}); raise train.steps to train further")
  timed = times[1:] or times  # the first step includes compilation
  step_s = statistics.median(timed)
  tokens = tc.batch * tc.seq
  n = store.n_params
  allocated = store.allocated_bytes()
  counts = models.spec(cfg.model).counts
  return {
      "family": cfg.model.family,
      "params": n,
      "active_params": counts["active"],
      "steps": len(losses),
      "resumed_from": None if resumed is None else str(resumed),
      "first_loss": losses[0],
      "final_loss": losses[-1],
      "skipped_steps": skipped_steps,
      "held_out": evals,  # (step, loss) of each evaluation
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
      "init_s": init_s,
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
      "checkpoint": None if saved is None else str(saved),
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
      ("run folder", s["run_dir"] + (f"; checkpoint {s['checkpoint']}" if s["checkpoint"] else "")),
  ]
  return "\n".join(f"{k:<11}{v}" for k, v in rows)


def internal_error_log(cfg: config_lib.Config, e: BaseException) -> Path:
  """Appends the traceback of an unexpected error to the run folder's log file; returns its path."""
  import traceback  # noqa: PLC0415
  path = run_folder(cfg) / LOG_FILE
  try:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
      f.write("".join(traceback.format_exception(e)))
  except OSError:
    path = Path(os.devnull)
  return path


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog="python -m mtjax.train", description=__doc__)
  p.add_argument("--json", help="also write the summary as JSON to this path")
  p.add_argument("--no-progress", action="store_true", help="no progress bar")
  p.add_argument("--quiet", action="store_true",
                 help="no progress bar, no summary and only warnings in the log (errors still show)")
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
  args, cfg = cli.parse_cli(p, argv)
  dist = (args.coordinator, args.num_processes, args.process_id)
  if any(x is not None for x in dist):
    if any(x is None for x in dist) or not 0 <= args.process_id < args.num_processes:
      print("error: several hosts need --coordinator, --num-processes and --process-id (0 <= id "
            "< processes)", file=sys.stderr)
      return 2
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU-only hosts too
    jax.distributed.initialize(args.coordinator, args.num_processes, args.process_id)
  runlog.setup_logging("WARNING" if args.quiet else args.log_level)
  show = (lambda plan: print(plan_lib.format_plan(plan), flush=True)) if args.show_plan else None
  try:
    summary = run(cfg, progress=not (args.no_progress or args.quiet), on_plan=show,
                  json_path=args.json)
  except plan_lib.PlanError as e:
    print(f"refused: {e}", file=sys.stderr)
    return exits.BAD_INPUT
  except (Stopped, Abandoned) as e:
    print(f"{e}", file=sys.stderr)
    return exits.INTERRUPTED + (signal.SIGTERM if "SIGTERM" in str(e) else signal.SIGINT)
  except TooManySkipped as e:
    print(f"error: {e}", file=sys.stderr)
    return exits.DIVERGED
  except HostUpdateError as e:
    print(f"error: {e}", file=sys.stderr)
    return exits.FAILED
  except checkpoint.SaveFailed as e:
    print(f"error: {e}", file=sys.stderr)
    return exits.IO_FAILURE
  except (ValueError, OSError, KeyError) as e:  # bad input: data, checkpoint, paths, HF files
    if args.debug:
      raise
    msg = " ".join(str(e).split()) or type(e).__name__
    print(f"error: {msg}", file=sys.stderr)
    return exits.of_os_error(e) if isinstance(e, OSError) else exits.BAD_INPUT
  except Exception as e:  # noqa: BLE001 - a bug: one line here, the traceback in the log file
    if args.debug:
      raise
    where = internal_error_log(cfg, e)
    print(f"internal error: {type(e).__name__}: {' '.join(str(e).split())[:300]} (traceback in "
          f"{where}; --debug shows it here)", file=sys.stderr)
    return exits.FAILED
  if not args.quiet:
    print(format_summary(summary))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(json_safe(summary), f, indent=2, allow_nan=False)
  return 0


if __name__ == "__main__":
  sys.exit(main())
