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
