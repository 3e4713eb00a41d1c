"""Nothing lost: signals, SIGKILLs at random moments, non-finite steps and bad inputs, each tried
on the real CLI in a subprocess; resumed runs must equal an uninterrupted run bit for bit."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import chex
import jax
import numpy as np
import pytest

from mtjax import checkpoint, config, data, engine, launch, store as store_lib
from mtjax import exits

TINY = Path(__file__).parent.parent / "configs" / "tiny.yaml"
# decay_steps fixed: runs of different lengths share one schedule, so they can be compared.
COMMON = ["optim.decay_steps=1000", "model.layers=1", "train.batch=4", "train.seq=16"]


def cli(*args, timeout=300):
  return subprocess.run([sys.executable, "-m", "mtjax.train", "--config", str(TINY),
                         "--no-progress", *args], capture_output=True, text=True, timeout=timeout)


def start(*args, env=None):
  return subprocess.Popen([sys.executable, "-m", "mtjax.train", "--config", str(TINY),
                           "--no-progress", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True, env=env)


def weights_at(directory, step=None):
  """The weights and optimizer state of a checkpoint (the newest, or `step`), as numpy trees."""
  cfg, _ = launch.plan_run(config.load(TINY, COMMON + ["engine.device_state_layers=0"]))
  st = store_lib.create(cfg, jax.random.key(99))
  path = checkpoint.latest(directory) if step is None else Path(directory) / f"step_{step}"
  checkpoint.restore(st, path)
  return st.step, st.to_tree(), st.opt_trees()


def resume_and_run_straight(tmp_path, ck, n):
  """Resumes the run in `ck` to step n, and trains one uninterrupted run of n steps beside it."""
  from mtjax import train
  for d in (ck, tmp_path / "straight"):
    s = train.run(config.load(TINY, COMMON + [f"train.steps={n}", f"train.checkpoint_dir={d}"]),
                  progress=False)
    assert s["checkpoint"].endswith(f"step_{n}")


def wait_for_step(ckdir, step, proc, limit=120):
  """Waits until the run has committed checkpoint `step` (so it is training)."""
  t = time.time()
  while not (Path(ckdir) / f"step_{step}" / "meta.json").exists():
    assert proc.poll() is None, proc.communicate()
    assert time.time() - t < limit
    time.sleep(0.05)


def test_sigterm_finishes_the_step_saves_and_the_resumed_run_is_exact(tmp_path):
  ck = tmp_path / "ck"
  proc = start(*COMMON, "train.steps=5000", f"train.checkpoint_dir={ck}", "train.checkpoint_every=1")
  wait_for_step(ck, 2, proc)
  proc.send_signal(signal.SIGTERM)
  out, err = proc.communicate(timeout=120)
  assert proc.returncode == exits.INTERRUPTED + signal.SIGTERM, err
  assert "Traceback" not in err
  line = [l for l in err.splitlines() if l.startswith("stopped by SIGTERM")]
  assert len(line) == 1, err
  stopped_at = int(line[0].split("after step ")[1].split(";")[0])
  assert f"saved {ck / f'step_{stopped_at}'}" in line[0]
  # Resume to stopped_at + 3 and compare with one uninterrupted run of that length (in-process).
  n = stopped_at + 3
  resume_and_run_straight(tmp_path, ck, n)
  a, b = weights_at(ck), weights_at(tmp_path / "straight")
  assert a[0] == b[0] == n
  chex.assert_trees_all_equal(a[1:], b[1:])  # bit for bit


def test_a_second_signal_abandons_the_step_without_a_traceback(tmp_path):
  ck = tmp_path / "ck"
  proc = start(*COMMON, "train.steps=5000", f"train.checkpoint_dir={ck}", "train.checkpoint_every=1")
  wait_for_step(ck, 1, proc)
  proc.send_signal(signal.SIGINT)
  proc.send_signal(signal.SIGINT)
  out, err = proc.communicate(timeout=120)
  assert proc.returncode == exits.INTERRUPTED + signal.SIGINT, err
  assert "Traceback" not in err, err
  ends = [l for l in err.splitlines() if l.startswith(("abandoned by a second SIGINT",
                                                         "stopped by SIGINT"))]
  assert len(ends) == 1, err  # one line says how it ended (the 2nd signal may land after the save)


@pytest.mark.soak  # a fault-injection loop (other signal tests run in the README run)
@pytest.mark.parametrize("n_kills", [6, 50])
def test_sigkill_at_random_moments_then_resume_equals_uninterrupted(tmp_path, n_kills):
  # Kills land anywhere: during start-up, a step, a checkpoint's save (one group at a time, then
  # the rename) or the pruning of old ones. Every restart resumes from what is on disk.
  steps = 400
  ck = tmp_path / "ck"
  over = COMMON + [f"train.steps={steps}", f"train.checkpoint_dir={ck}",
                   "train.checkpoint_every=1", "train.keep_checkpoints=2"]
  # The run's compilation cache (tests/conftest.py) shortens each restart, in a folder of this
  # test's own: a kill mid-write leaves a partial entry, which a reader skips with a warning.
  env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax_cache")}
  rng = random.Random(0)
  kills, during_startup = 0, 0
  while kills < n_kills:
    before = checkpoint.latest(ck)
    proc = start(*over, env=env)
    if kills == 0 or rng.random() < 0.2:  # anywhere, start-up included (the first always)
      time.sleep(rng.uniform(0.0, 4.0))
      during_startup += checkpoint.latest(ck) == before
    else:  # once training is under way: in a step, a save or a prune
      t = time.time()
      while checkpoint.latest(ck) == before and proc.poll() is None and time.time() - t < 60:
        time.sleep(0.02)
      time.sleep(rng.uniform(0.0, 0.8))
    assert proc.poll() is None, proc.communicate()  # still running: the kill lands mid-run
    proc.kill()
    proc.wait()
    kills += 1
  assert kills == n_kills and during_startup > 0
  done = checkpoint.latest(tmp_path / "ck")
  assert done is not None and 0 < int(done.name.split("_")[1]) < steps  # progress, not finished
  n = int(done.name.split("_")[1]) + 2
  resume_and_run_straight(tmp_path, ck, n)
  a, b = weights_at(tmp_path / "ck"), weights_at(tmp_path / "straight")
  assert a[0] == b[0] == n
  chex.assert_trees_all_equal(a[1:], b[1:])  # bit for bit
  assert len(checkpoint.steps(tmp_path / "ck")) <= 3  # pruned to the default last 3


def test_non_finite_steps_are_skipped_logged_and_stop_the_run(tmp_path):
  # A learning rate of 1e30 overflows the weights within a step or two: the loss turns NaN.
  out = tmp_path / "s.json"
  r = cli(*COMMON, "optim.lr=1e30", "optim.warmup_steps=0", "train.steps=6",
          "train.max_skipped_steps=100", "--json", str(out))
  assert r.returncode == 0, r.stderr
  s = json.loads(out.read_text())  # valid JSON: no NaN in it
  assert s["skipped_steps"] and s["final_loss"] is None
  assert f"step {s['skipped_steps'][0]} skipped" in r.stderr
  r = cli(*COMMON, "optim.lr=1e30", "optim.warmup_steps=0", "train.steps=50",
          "train.max_skipped_steps=3", "--json", str(tmp_path / "t.json"))
  assert r.returncode == exits.DIVERGED and "3 steps in a row" in r.stderr and "Traceback" not in r.stderr
  assert not (tmp_path / "t.json").exists()


@pytest.mark.parametrize("clip", [None, "host_buffer", "recompute"])
@pytest.mark.parametrize("tiers", [(0, 0), (1, 1), (3, 0)])
def test_a_step_with_a_non_finite_loss_touches_no_state(clip, tiers):
  over = ["engine.compute_dtype=float32", f"engine.device_state_layers={tiers[0]}",
          f"engine.device_update_layers={tiers[1]}"]
  if clip:
    over += ["optim.clip_norm=0.5", f"optim.clip_mode={clip}"]
  cfg = config.load(TINY, COMMON + over)
  st = store_lib.create(cfg, jax.random.key(0))
  eng = engine.Engine(cfg, st)
  eng.step(data.synthetic_batch(0, 4, 16, 256, 0))
  eng.sync()
  head = st.read(len(st.groups) - 1)
  w = head["w"].copy()
  w[0] = np.inf  # the final norm's scale: every logit, the loss and every gradient not finite
  st.write(len(st.groups) - 1, w=w)
  before = [st.read(i) for i in range(len(st.groups))]
  stats = eng.step(data.synthetic_batch(1, 4, 16, 256, 0))
  eng.sync()
  assert stats.skipped and not np.isfinite(stats.loss)
  for i, b in enumerate(before):
    chex.assert_trees_all_equal(st.read(i), b)  # weights and optimizer state untouched
  st.write(len(st.groups) - 1, w=head["w"])
  assert not eng.step(data.synthetic_batch(2, 4, 16, 256, 0)).skipped
  eng.close()


def one_line_error(result, *parts):
  code, err = result
  assert code == 2, (code, err)
  err = err.strip()
  assert "\n" not in err and "Traceback" not in err, err
  for p in parts:
    assert p in err, err


def test_bad_inputs_are_one_line_errors_before_any_training(tmp_path, capsys, monkeypatch):
  import logging
  from mtjax import train
  # main() attaches a handler to this test's captured stderr; none of it outlives the test.
  monkeypatch.setattr(logging.getLogger("mtjax"), "handlers", [])

  def main(*args, config_path=TINY):  # the CLI in-process: same checks, no interpreter start-up
    capsys.readouterr()
    try:
      code = train.main(["--config", str(config_path), "--no-progress", *args])
    except SystemExit as e:
      code = e.code
    return code, capsys.readouterr().err

  bad_yaml = tmp_path / "bad.yaml"
  bad_yaml.write_text("model:\n  hidden: [64\n")
  one_line_error(main(config_path=bad_yaml), "is not valid YAML at line 3")
  one_line_error(main(config_path=tmp_path), "is not a file")
  one_line_error(main("optim.lr=.nan"), "optim.lr: nan is not a finite number")
  (tmp_path / "file").write_text("x")
  one_line_error(main(f"train.checkpoint_dir={tmp_path / 'file'}"), "exists and is not a folder")
  one_line_error(main("--json", str(tmp_path / "missing" / "s.json")), "--json", "cannot write")
  one_line_error(main("data.source=tokens", f"data.path={tmp_path / 'none.bin'}"), "none.bin")
  (tmp_path / "empty.bin").write_bytes(b"")
  one_line_error(main("data.source=tokens", f"data.path={tmp_path / 'empty.bin'}"), "is empty")
  (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02")
  one_line_error(main("data.source=tokens", f"data.path={tmp_path / 'odd.bin'}"), "truncated")
  big = tmp_path / "big.bin"
  np.full(4096, 300, np.uint16).tofile(big)  # ids beyond the vocabulary (256)
  one_line_error(main("data.source=tokens", f"data.path={big}"), "token id 300 >= model.vocab_size")
  (tmp_path / "out").mkdir()
  (tmp_path / "out" / "x").write_text("x")
  one_line_error(main(f"train.export_dir={tmp_path / 'out'}"), "train.export_dir",
                 "not an empty folder")
  one_line_error(main(f"model.from_hf={tmp_path / 'out'}"), "model.from_hf")
  one_line_error(main("--coordinator", "localhost:1"), "--num-processes", "--process-id")
  one_line_error(main("engine.devices=2"), "engine.devices: 2 requested, this process sees 1")
  one_line_error(main("engine.devices=0"), "engine.devices: 0 must be > 0")
  # A checkpoint folder of another model is refused, never silently skipped or mixed.
  ck = tmp_path / "ck"
  assert main(*COMMON, "train.steps=2", f"train.checkpoint_dir={ck}")[0] == 0
  one_line_error(main(*COMMON, "model.hidden=32", "train.steps=3", f"train.checkpoint_dir={ck}"),
                 "another model", "model.hidden: 64 in the checkpoint, 32 in this run")
  # The same parameter shapes (8 heads of 8 channels for 4 of 16) are another model all the same;
  # refused before anything is allocated.
  monkeypatch.setattr(store_lib, "create", lambda *a, **k: pytest.fail("allocated"))
  one_line_error(main(*COMMON, "model.heads=8", "model.kv_heads=8", "train.steps=3",
                      f"train.checkpoint_dir={ck}"), "another model", "model.heads")
  monkeypatch.undo()
  monkeypatch.setattr(logging.getLogger("mtjax"), "handlers", [])
  # Held-out loss asked of prepared data without a val split: what to do about it, before training.
  from test_data import write_prepared
  prep = write_prepared(tmp_path / "prep", {"train": [list(range(2, 200))], "val": [[2, 3]]}, vocab=256)
  meta = json.loads((prep / "meta.json").read_text())
  meta["splits"]["val"] = {"documents": 0, "tokens": 0}
  (prep / "meta.json").write_text(json.dumps(meta))
  (prep / "val.bin").write_bytes(b"")
  np.zeros(1, np.uint64).tofile(prep / "val.idx")
  one_line_error(main("data.source=prepared", f"data.path={prep}", "train.eval_every=2"),
                 "train.eval_every: 2 needs held-out documents", "--val-fraction")
  one_line_error(main(*COMMON, "train.steps=3", "train.resume=false", f"train.checkpoint_dir={ck}"),
                 "holds another run's checkpoints")
  assert checkpoint.steps(ck) == [ck / "step_2"]  # none of the refused runs wrote anything
  assert main(*COMMON, "train.steps=3", "train.resume=false", "train.overwrite=true",
              f"train.checkpoint_dir={ck}")[0] == 0
  assert checkpoint.steps(ck) == [ck / "step_3"]


def test_a_failing_host_update_stops_the_run_and_keeps_the_last_checkpoint(tmp_path, monkeypatch):
  from mtjax import optimizer, train
  real = optimizer.UpdateRule.host_update

  def failing(self, w, opt, g, step, scale, layout):
    if step == 2:
      raise MemoryError("injected")
    return real(self, w, opt, g, step, scale, layout)

  monkeypatch.setattr(optimizer.UpdateRule, "host_update", failing)
  ck = tmp_path / "ck"
  cfg = config.load(TINY, COMMON + ["train.steps=6", f"train.checkpoint_dir={ck}",
                                    "train.checkpoint_every=1"])
  with pytest.raises(optimizer.HostUpdateError, match=r"at step 3 failed: MemoryError: injected.*"
                     r"not saved; last checkpoint: .*step_2"):
    train.run(cfg, progress=False)
  assert checkpoint.latest(ck).name == "step_2"  # nothing part-updated was saved
