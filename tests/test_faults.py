"""Faults and bad input over the whole workflow: configs drawn at random through the planner's check,
a full disk during a save, and a soak of random faults (SIGKILLs, full disks, corrupted checkpoints,
truncated token files) over prepare, train and export whose final export must equal an
uninterrupted run's bit for bit."""

import dataclasses
import math
import time
import typing
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings, strategies as st

from mtjax import cli, config, exits, launch, plan

ROOT = Path(__file__).parent.parent
TINY = ROOT / "configs" / "tiny.yaml"

# ---- configs drawn over the dataclasses' fields --------------------------------------------------

ODD = [0, -1, 1, 2, 3, 5, 64, 10**6, 2**40, 10**18, -(10**9), 0.5, -0.5, 1e-3, 1e30, math.nan,
       math.inf, -math.inf, "x", "auto", "", None, True, False, [], [1, 2], {}, {"bogus": 1}]


def _sections() -> dict[str, type]:
  hints = typing.get_type_hints(config.Config)
  return {f.name: hints[f.name] for f in dataclasses.fields(config.Config)}


def _choices(tp) -> list:
  """The values a field's annotation names (Literal options), found anywhere in a Union."""
  if typing.get_origin(tp) is typing.Literal:
    return list(typing.get_args(tp))
  return [c for a in typing.get_args(tp) for c in _choices(a)]


@st.composite
def section_values(draw, cls, depth=0):
  hints = typing.get_type_hints(cls)
  names = [f.name for f in dataclasses.fields(cls)]
  out = {}
  for name in draw(st.lists(st.sampled_from(names), max_size=4, unique=True)):
    tp = hints[name]
    nested = [a for a in (tp, *typing.get_args(tp)) if dataclasses.is_dataclass(a)]
    if nested and depth < 1 and draw(st.booleans()):
      out[name] = draw(section_values(nested[0], depth + 1))
    else:
      out[name] = draw(st.sampled_from(ODD + _choices(tp)))
  if draw(st.integers(0, 9)) == 0:
    out["no_such_key"] = 1
  return out


@st.composite
def config_files(draw):
  """(top-level mapping, base-file mapping or None): a config and, half the time, a base file
  between it and configs/tiny.yaml (a chain of two), with the drawn keys split between them."""
  sections = _sections()
  top = {}
  for name in draw(st.lists(st.sampled_from(sorted(sections)), max_size=3, unique=True)):
    top[name] = draw(section_values(sections[name]))
  if draw(st.integers(0, 14)) == 0:
    top["no_such_section"] = {}
  mid = None
  if draw(st.booleans()):
    mid = {n: draw(section_values(sections[n])) for n in draw(
        st.lists(st.sampled_from(sorted(sections)), max_size=2, unique=True))}
  return top, mid


def planned(path: Path) -> str:
  """What `python -m mtjax.plan --config PATH` decides, in-process: 'planned', or the one-line
  message of the project's error."""
  try:
    cfg = cli.load_config(path)
    launch.plan_run(cfg)
  except (config.ConfigError, plan.PlanError) as e:
    text = str(e)
    assert text and "\n" not in text, f"not one line: {text!r}"
    return text
  return "planned"


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(files=config_files())
def test_drawn_configs_plan_or_are_refused_in_one_line(tmp_path, files):
  top, mid = files
  if mid is not None:
    (tmp_path / "mid.yaml").write_text(yaml.safe_dump({"base": str(TINY), **mid}))
    top = {"base": "mid.yaml", **top}
  else:
    top = {"base": str(TINY), **top}
  (tmp_path / "run.yaml").write_text(yaml.safe_dump(top))
  planned(tmp_path / "run.yaml")  # any other exception fails the test


@pytest.mark.parametrize("over", [
    ["model.layers=2000000"], ["model.hidden=10000000"], ["model.vocab_size=1000000000000"],
    ["model.layers=100000", "model.hidden=1024"]])
def test_absurd_sizes_are_refused_before_anything_is_laid_out(over, monkeypatch):
  from mtjax import models, store as store_lib
  forbidden = lambda *a, **k: pytest.fail("laid out, allocated or compiled an absurd config")
  monkeypatch.setattr(models, "spec", forbidden)
  monkeypatch.setattr(store_lib, "create", forbidden)
  monkeypatch.setattr(launch, "compiled_memory", forbidden)
  with pytest.raises((plan.PlanError, config.ConfigError)) as e:
    launch.plan_run(cli.load_config(TINY, over))
  assert "\n" not in str(e.value)


# ---- in-process: the CLI's answers to failed writes ----------------------------------------------

COMMON = ["optim.decay_steps=1000", "model.layers=1", "train.batch=4", "train.seq=16",
          "train.tensorboard=false"]


@pytest.fixture
def main(capsys, monkeypatch):
  """`python -m mtjax.train` in-process (same code path, no interpreter start-up): (exit code,
  stderr)."""
  import logging
  from mtjax import train
  monkeypatch.setattr(logging.getLogger("mtjax"), "handlers", [])  # main() adds one per call

  def run(*args):
    capsys.readouterr()
    try:
      code = train.main(["--config", str(TINY), "--no-progress", "--quiet", *COMMON, *args])
    except SystemExit as e:
      code = e.code
    return code, capsys.readouterr().err
  return run


def full_disk_at(monkeypatch, steps):
  """Every checkpoint save of a step in `steps` finds the disk full after writing part of it."""
  import errno
  from mtjax import checkpoint
  real = checkpoint._write

  def write(store, tmp, *a):
    if store.step in steps:
      (Path(tmp) / "part").write_bytes(b"x" * 10)
      raise OSError(errno.ENOSPC, "No space left on device")
    return real(store, tmp, *a)
  monkeypatch.setattr(checkpoint, "_write", write)


def test_a_failed_save_is_retried_and_a_second_in_a_row_ends_the_run(tmp_path, main, monkeypatch):
  from mtjax import checkpoint
  ck = tmp_path / "ck"
  full_disk_at(monkeypatch, {2})
  code, err = main("train.steps=6", "train.checkpoint_every=2", f"train.checkpoint_dir={ck}")
  assert code == exits.OK, err
  warning, = err.strip().splitlines()  # one line: the folder, the reason, the last good one
  assert (f"cannot write step_2 in {ck} (No space left on device); last good checkpoint: none; "
          f"trying again" in warning)
  assert sorted(p.name for p in ck.iterdir() if p.name.startswith(("step_", ".step_"))) == [
      "step_4", "step_6"]
  # Two failures in a row: the run ends with the I/O exit code; the last good checkpoint stays.
  full_disk_at(monkeypatch, {10, 12})
  code, err = main("train.steps=14", "train.checkpoint_every=2", f"train.checkpoint_dir={ck}")
  assert code == exits.IO_FAILURE, err
  lines = err.strip().splitlines()
  assert len(lines) == 2 and "Traceback" not in err
  assert lines[1] == (f"error: checkpoint: cannot write step_12 in {ck} (No space left on device); "
                      f"last good checkpoint: {ck / 'step_8'} (2 saves in a row failed; free space "
                      f"or fix the folder, then run again to resume)")
  assert checkpoint.latest(ck) == ck / "step_8" and not list(ck.glob(".step_*"))
  # A final save that fails ends the run the same way.
  full_disk_at(monkeypatch, {9})
  code, err = main("train.steps=9", f"train.checkpoint_dir={ck}")
  assert code == exits.IO_FAILURE and "the final save failed" in err and len(err.splitlines()) == 1
  assert (ck / "train.log").exists()  # the run folder's log holds the warnings too
  monkeypatch.undo()


@pytest.fixture
def small_disk(tmp_path):
  """A 1.5 MiB tmpfs (root only): a real full disk, as orbax and tensorstore meet it."""
  import os
  import subprocess
  disk = tmp_path / "disk"
  disk.mkdir()
  if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1536k", "tmpfs",
                                          str(disk)], capture_output=True).returncode:
    pytest.skip("mounting a tmpfs needs root")
  yield disk
  subprocess.run(["umount", str(disk)], check=True)


def test_a_real_full_disk_ends_in_one_line_and_tracebacks_go_to_the_log(tmp_path, main,
                                                                        small_disk):
  from mtjax import checkpoint
  ck = small_disk / "ck"  # room for one checkpoint of ~1 MiB, not two
  code, err = main("train.steps=12", "train.checkpoint_every=2", "train.keep_checkpoints=1",
                   f"train.checkpoint_dir={ck}", f"train.run_dir={tmp_path / 'run'}",
                   "train.allow_low_disk=true")
  assert code == exits.IO_FAILURE, err
  warning, error = err.strip().splitlines()
  assert "No space left on device" in warning and "trying again" in warning
  assert error.startswith("error: checkpoint: cannot write ") and "2 saves in a row" in error
  good = checkpoint.latest(ck)
  assert good is not None and sorted(p.name for p in ck.iterdir()) == [good.name]
  # orbax's background threads reported the failure with tracebacks: in the log, not the terminal
  assert "No space left on device" in (tmp_path / "run" / "train.log").read_text()


def test_too_little_disk_is_refused_with_both_numbers_unless_accepted(tmp_path, main, monkeypatch):
  import collections
  import shutil
  usage = collections.namedtuple("usage", "total used free")
  monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**9, 10**9 - 300_000, 300_000))
  ck = tmp_path / "ck"
  code, err = main("train.steps=2", f"train.checkpoint_dir={ck}", "train.keep_checkpoints=2",
                   "train.checkpoint_every=1")
  assert code == exits.BAD_INPUT, err
  # the folder is made by the first save: its disk is the nearest existing folder's
  assert err.startswith(f"refused: not enough disk space: {tmp_path} has 0.3 MiB free, the run "
                        f"needs ")
  assert not ck.exists()
  assert "train.allow_low_disk=true" in err and len(err.splitlines()) == 1
  assert not (ck / "step_1").exists()
  code, err = main("train.steps=2", f"train.checkpoint_dir={ck}", "train.allow_low_disk=true")
  assert code == exits.OK, err


def test_a_bug_is_one_line_and_its_traceback_goes_to_the_run_log(tmp_path, main, monkeypatch):
  from mtjax import engine
  monkeypatch.setattr(engine.Engine, "step", lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
  code, err = main("train.steps=2", f"train.run_dir={tmp_path}")
  assert code == exits.FAILED and len(err.strip().splitlines()) == 1
  assert err.startswith("internal error: RuntimeError: boom") and "Traceback" not in err
  assert "Traceback" in (tmp_path / "train.log").read_text()


def export_main(*args):
  from mtjax import export
  return export.main(list(map(str, args)))


def tree_bytes(d: Path) -> dict:
  return {p.name: p.read_bytes() for p in d.iterdir()}


def test_export_is_atomic_verified_and_a_rerun_finishes_it(tmp_path, main, monkeypatch, capsys):
  import errno
  from mtjax import hf
  ck = tmp_path / "ck"
  assert main("train.steps=2", f"train.checkpoint_dir={ck}")[0] == 0
  assert export_main("--checkpoint", ck, "--out", tmp_path / "a") == exits.OK
  want = tree_bytes(tmp_path / "a")
  # What a killed export leaves beside its target is cleared, and the export finishes.
  (tmp_path / ".b.partial").mkdir()
  (tmp_path / ".b.partial" / "model.safetensors").write_bytes(b"half")
  (tmp_path / "..b.partial.tmp-0badc0de").mkdir()
  assert export_main("--checkpoint", ck, "--out", tmp_path / "b") == exits.OK
  assert tree_bytes(tmp_path / "b") == want
  assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "ck"]
  # A full disk: the I/O exit code, nothing at the target, nothing left beside it.
  real = hf._write_safetensors
  monkeypatch.setattr(hf, "_write_safetensors", lambda path, items: (
      real(path, items), path.write_bytes(path.read_bytes()[:50]),
      (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left on device"))))
  capsys.readouterr()
  assert export_main("--checkpoint", ck, "--out", tmp_path / "c") == exits.IO_FAILURE
  assert capsys.readouterr().err == "error: No space left on device\n"
  # A shard written short without an error (a lying disk): verification refuses it.
  monkeypatch.setattr(hf, "_write_safetensors", lambda path, items: (
      real(path, items), path.write_bytes(path.read_bytes()[:-8])))
  assert export_main("--checkpoint", ck, "--out", tmp_path / "c") == exits.BAD_INPUT
  assert len(capsys.readouterr().err.splitlines()) == 1
  assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "ck"]


# ---- the fault soak: prepare -> train -> export, faults drawn at random ----------------------------

SOAK_OVER = ["model.vocab_size=320", "data.source=prepared", "train.checkpoint_every=1",
             "train.keep_checkpoints=2", "train.tensorboard=false"]
# Each kind of fault and the commands it lands on (before or during them).
KINDS = {"kill prepare": ("prepare",), "kill train": ("train",), "kill export": ("export",),
         "full disk at a save": ("train",), "full disk for two saves": ("train",),
         "full disk in the export": ("export",), "corrupted newest checkpoint": ("train", "export"),
         "truncated token file": ("train",)}


class Workflow:
  """A user's workflow in one folder: prepare a corpus, train tiny with checkpoints, export; each
  command re-run as a user would after it failed (prepare again when train says the data is bad,
  train again when the export finds the checkpoint damaged). A command carrying a kill runs as a
  subprocess (the real CLI, SIGKILLed); the others run in-process through the same `main`."""

  def __init__(self, root: Path, tok: Path, corpus: Path, steps: int, rng, log):
    self.root, self.tok, self.corpus, self.rng, self.log = root, tok, corpus, rng, log
    self.prep, self.ck, self.out = root / "prep", root / "ck", root / "export"
    self.train_args = ["--config", str(TINY), "--no-progress", "--quiet", *COMMON, *SOAK_OVER,
                       f"data.path={self.prep}", f"train.steps={steps}",
                       f"train.checkpoint_dir={self.ck}"]
    # The run's compilation cache settings (tests/conftest.py), in a folder of the workflow's own:
    # a kill mid-write leaves a partial entry, which a reader skips with a warning.
    self.env = {**__import__("os").environ,
                "JAX_COMPILATION_CACHE_DIR": str(root.parent / "jax_cache")}

  def args(self, stage):
    return {"prepare": ["prepare", "--tokenizer", str(self.tok), "--out", str(self.prep),
                        "--val-fraction", "0", "--quiet", str(self.corpus)],
            "train": self.train_args,
            "export": ["--checkpoint", str(self.ck), "--out", str(self.out)]}[stage]

  def in_process(self, stage) -> tuple[int, str]:
    import contextlib
    import io
    import logging
    from mtjax import export, train
    from mtjax.data import __main__ as data_cli
    fn = {"prepare": data_cli.main, "train": train.main, "export": export.main}[stage]
    err = io.StringIO()
    handlers = logging.getLogger("mtjax").handlers[:]
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
      try:
        code = fn(self.args(stage)) or 0
      except SystemExit as e:
        code = e.code or 0
    logging.getLogger("mtjax").handlers = handlers
    return code, err.getvalue()

  def killed(self, stage) -> tuple[bool, int | None, str]:
    """Runs `stage` as the CLI and SIGKILLs it at a random moment: (killed, exit code, stderr);
    not killed when it ended first."""
    import subprocess
    import sys
    module = {"prepare": "mtjax.data", "train": "mtjax.train", "export": "mtjax.export"}[stage]
    proc = subprocess.Popen([sys.executable, "-m", module, *self.args(stage)], env=self.env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if stage == "train" and self.rng.random() < 0.7:  # once training is under way
      from mtjax import checkpoint
      before, t = checkpoint.latest(self.ck), time.time()
      while checkpoint.latest(self.ck) == before and proc.poll() is None and time.time() - t < 60:
        time.sleep(0.02)
      time.sleep(self.rng.uniform(0.0, 0.5))
    else:  # anywhere, start-up included
      time.sleep(self.rng.uniform(0.0, 5.0 if stage == "train" else 3.0))
    if proc.poll() is not None:
      return False, proc.returncode, proc.communicate()[1]
    proc.kill()
    proc.communicate()
    return True, None, ""


def corrupt_newest(ck: Path, rng) -> bool:
  """Flips a byte in a random file of the newest checkpoint; False when there is none."""
  from mtjax import checkpoint
  newest = checkpoint.latest(ck)
  if newest is None:
    return False
  files = sorted(f for f in newest.rglob("*") if f.is_file() and f.stat().st_size)
  f = rng.choice(files)
  data = bytearray(f.read_bytes())
  i = rng.randrange(len(data))
  data[i] ^= 0xFF
  f.write_bytes(bytes(data))
  return True


def truncate_tokens(prep: Path, rng) -> bool:
  tokens = prep / "train.bin"
  if not tokens.exists() or tokens.stat().st_size < 4:
    return False
  with open(tokens, "r+b") as f:
    f.truncate(rng.randrange(1, tokens.stat().st_size))
  return True


def soak(tmp_path, n_faults, kinds, monkeypatch, steps):
  """Runs workflows until `n_faults` faults were injected and the last workflow finished; each
  finished workflow's export must equal the uninterrupted one's bit for bit. Returns the tally."""
  import collections
  import errno
  import random
  from mtjax import hf
  from test_chat import SENTENCES, make_tokenizer
  rng = random.Random(1)
  tok = make_tokenizer(tmp_path / "tok")
  corpus = tmp_path / "corpus"
  corpus.mkdir()
  for i in range(12):
    (corpus / f"doc{i:02d}.txt").write_text(" ".join(SENTENCES[(i + j) % len(SENTENCES)]
                                                     for j in range(6)))
  log = []
  ref = Workflow(tmp_path / "reference", tok, corpus, steps, rng, log)
  for stage in ("prepare", "train", "export"):
    code, err = ref.in_process(stage)
    assert code == 0, err
  want = tree_bytes(ref.out)
  tally = collections.Counter()
  recovered = collections.Counter()
  n, runs = 0, 0
  while True:
    runs += 1
    w = Workflow(tmp_path / f"run{runs}", tok, corpus, steps, rng, log)
    stage, failures = "prepare", 0
    while stage != "done":
      assert failures < 8, log[-8:]
      kind = None
      if n < n_faults and isinstance(kinds, list):  # a fixed sequence: the next one that fits
        kind = next((k for k in kinds[n:n + 1] if stage in KINDS[k]), None)
      elif n < n_faults:
        kind = rng.choice([k for k in kinds if stage in KINDS[k]] or [None])
      injected = False
      if kind == "corrupted newest checkpoint":
        injected = corrupt_newest(w.ck, rng)
      elif kind == "truncated token file":
        injected = truncate_tokens(w.prep, rng)
      if kind is not None and kind.startswith("kill"):
        injected, code, err = w.killed(stage)
      else:
        with monkeypatch.context() as m:
          if kind in ("full disk at a save", "full disk for two saves"):
            injected = full_disk_during_training(m, w.ck, rng, steps, two="two" in kind)
          elif kind == "full disk in the export":
            m.setattr(hf, "_write_safetensors", lambda *a: (_ for _ in ()).throw(
                OSError(errno.ENOSPC, "No space left on device")))
            injected = True
          code, err = w.in_process(stage)
      lines = err.strip().splitlines()
      assert "Traceback" not in err and all(
          ln.startswith(("error:", "refused:")) or " WARNING " in ln for ln in lines), err
      if injected:
        n += 1
        tally[kind] += 1
      log.append((runs, stage, kind if injected else None, code, err.strip()[-300:]))
      if code == 0:
        stage = {"prepare": "train", "train": "export", "export": "done"}[stage]
        failures = 0
        continue
      failures += 1
      if code is None:  # killed: the user runs the same command again
        continue
      assert code in (exits.BAD_INPUT, exits.IO_FAILURE), (code, err)
      if stage == "train" and str(w.prep) in err:  # the data is bad: prepare it again
        stage = "prepare"
      elif stage == "train" and "reached already" in err:  # trained: export
        stage = "export"
      elif stage == "export" and "exists and is not an empty folder" in err:
        stage = "done"  # a kill landed after the rename: the export is in place, whole
      elif stage == "export" and code == exits.BAD_INPUT:  # a damaged checkpoint: train again
        stage = "train"
    assert tree_bytes(w.out) == want, f"run {runs}: the export differs from the uninterrupted one"
    recovered.update(k for r, _, k, _, _ in log if r == runs and k)
    if n >= n_faults:
      return tally, recovered, runs, log


def full_disk_during_training(m, ck: Path, rng, steps: int, two: bool) -> bool:
  """Makes the save of a step soon after the newest checkpoint (and, `two`, the next one too)
  find the disk full; False when no such step is left to train."""
  import errno
  from mtjax import checkpoint
  done = checkpoint.latest(ck)
  first = (int(done.name.split("_")[1]) if done else 0) + 1 + rng.randrange(3)
  bad = {first, first + 1} if two else {first}
  real = checkpoint._write

  def write(store, tmp, *a):
    if store.step in bad:
      raise OSError(errno.ENOSPC, "No space left on device")
    return real(store, tmp, *a)
  m.setattr(checkpoint, "_write", write)
  return max(bad) <= steps


@pytest.mark.parametrize("n_faults", [3, pytest.param(60, marks=pytest.mark.soak)])
def test_faults_over_the_workflow_lose_nothing(tmp_path, monkeypatch, n_faults, capsys):
  # The main suite's few: one of each kind that costs a re-run of train, in order; the soak draws.
  kinds = (["kill train", "full disk for two saves", "corrupted newest checkpoint"]
           if n_faults <= 3 else tuple(KINDS))
  t = time.time()
  tally, recovered, runs, log = soak(tmp_path, n_faults, kinds, monkeypatch, steps=8)
  with capsys.disabled():
    print(f"\nfault soak: {sum(tally.values())} faults injected over {runs} workflow(s) in "
          f"{time.time() - t:.0f} s; by kind: {dict(tally)}; recovered (the workflow finished, "
          f"its export equal to the uninterrupted run's bit for bit): {sum(recovered.values())}; "
          f"commands run: {len(log)}; lost: nothing")
  assert sum(tally.values()) >= n_faults and recovered == tally
