"""End to end: the CLI trains the tiny config, and a golden loss guards against silent changes."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mtjax import config, train

TINY = Path(__file__).parent.parent / "configs" / "tiny.yaml"


def test_cli_trains_tiny_config(tmp_path):
  out = tmp_path / "summary.json"
  r = subprocess.run([sys.executable, "-m", "mtjax.train", "--config", str(TINY), "--json", str(out),
                      "train.steps=12"], capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr
  assert "tokens/s" in r.stdout and "B/param" in r.stdout
  assert "loss=" in r.stderr  # the progress bar
  s = json.loads(out.read_text())
  assert s["steps"] == 12 and s["final_loss"] < s["first_loss"]
  assert s["state_bytes_per_param"] == 12.0 and s["state_device_gib"] == 0.0


def test_golden_loss_after_one_step():
  # Golden numbers for configs/tiny.yaml at seed 0. If a change alters the numerics on purpose
  # (init, data, the model or the optimizer), update them and say why in the commit message.
  cfg = config.load(TINY, ["train.steps=2"])
  s = train.run(cfg, progress=False)
  assert s["first_loss"] == pytest.approx(5.554263114929199, abs=2e-5)
  assert s["final_loss"] == pytest.approx(5.5480055809021, abs=2e-5)


def test_custom_loop_example_runs():
  example = Path(__file__).parent.parent / "examples" / "custom_loop.py"
  r = subprocess.run([sys.executable, str(example)], capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr
  losses = [float(l.split()[3]) for l in r.stdout.splitlines() if l.startswith("step")]
  assert losses[-1] < losses[0]


def test_a_run_leaves_its_folder_and_the_report_renders_from_it(tmp_path):
  pytest.importorskip("matplotlib")
  from mtjax import report, runlog
  ck = tmp_path / "run"
  cfg = config.load(TINY, ["train.steps=4", f"train.checkpoint_dir={ck}", "optim.decay_steps=8"])
  s = train.run(cfg, progress=False)
  assert s["run_dir"] == str(ck)
  assert (ck / "config.yaml").exists() and "parameters" in (ck / "plan.txt").read_text()
  records = runlog.read_metrics(ck)
  assert [r["step"] for r in records] == [1, 2, 3, 4]
  for r in records:
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "step_s", "forward_s", "backward_s",
            "finish_s", "opt_wait_s", "host_rss_gib"} <= set(r)
    parts = r["forward_s"] + r["backward_s"] + r["finish_s"]
    assert parts == pytest.approx(r["step_s"], rel=1e-6)  # the split is a partition of the step
  assert [r["loss"] for r in records] == pytest.approx([s["first_loss"], *[r["loss"] for r in records[1:3]], s["final_loss"]])
  # Resuming appends to the same log.
  train.run(config.load(TINY, ["train.steps=6", f"train.checkpoint_dir={ck}", "optim.decay_steps=8"]),
            progress=False)
  assert [r["step"] for r in runlog.read_metrics(ck)] == [1, 2, 3, 4, 5, 6]
  assert any((ck / "tb").glob("events.out.tfevents.*"))
  pngs = report.render(ck, tmp_path / "report")
  names = {p.name for p in pngs}
  assert {"loss.png", "lr.png", "throughput.png", "step_time.png", "memory.png"} <= names
  for p in pngs:
    assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_profile_step_records_a_trace_into_the_run_folder(tmp_path):
  cfg = config.load(TINY, ["train.steps=3", "train.profile_step=2", f"train.run_dir={tmp_path}"])
  train.run(cfg, progress=False)
  traces = [p for p in (tmp_path / "profile").rglob("*") if p.is_file()]
  assert traces and any(p.name.endswith((".xplane.pb", ".trace.json.gz")) for p in traces), traces
