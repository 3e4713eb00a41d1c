"""End to end: the CLI trains the tiny config, and a golden loss guards against silent changes."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mtjax import config, train

ROOT = Path(__file__).parent.parent
TINY = ROOT / "configs" / "tiny.yaml"


def test_cli_trains_tiny_config(tmp_path):
  out = tmp_path / "summary.json"
  r = subprocess.run([sys.executable, "-m", "mtjax.train", "--config", str(TINY), "--json", str(out),
                      "train.steps=12"], capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr
  assert "tokens/s" in r.stdout and "B/param" in r.stdout
  # stdout is a pipe, not a terminal: plain step lines, no progress bar's carriage returns
  assert "\r" not in r.stdout + r.stderr
  lines = [l for l in r.stdout.splitlines() if l.startswith("step ")]
  assert [l.split()[1] for l in lines] == [f"{i}/12" for i in range(1, 13)]
  assert all("loss" in l and "tok/s" in l for l in lines)
  assert all("ETA" in l for l in lines[1:])  # from the steady steps' median: none at the first
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


def cli(*args, timeout=300, config=TINY):
  r = subprocess.run([sys.executable, "-m", "mtjax.train", "--config", str(config), *map(str, args)],
                     capture_output=True, text=True, timeout=timeout)
  return r.returncode, r.stdout, r.stderr.strip().splitlines()


def test_log_every_and_no_progress_give_plain_lines_every_n_steps_and_the_last():
  code, out, err = cli("--no-progress", "--log-every", 4, "train.steps=10")
  assert code == 0, err
  steps = [l.split()[1] for l in out.splitlines() if l.startswith("step ")]
  assert steps == ["1/10", "4/10", "8/10", "10/10"]  # the first, every 4th, the last
  code, out, _ = cli("--quiet", "train.steps=3")
  assert code == 0 and not [l for l in out.splitlines() if l.startswith("step ")]


@pytest.mark.soak  # long; the README run's time budget (the soak runs it)
def test_a_new_epoch_is_reported(tmp_path):
  """A token file of 4 rows' worth: with batch 2 the data starts a new pass every 2 steps."""
  import numpy as np
  toks = tmp_path / "toks.bin"
  np.random.default_rng(0).integers(0, 256, 4 * 65 + 1).astype(np.uint16).tofile(toks)
  code, out, err = cli("--no-progress", "train.steps=5", "train.batch=2", "data.source=tokens",
                       f"data.path={toks}")
  assert code == 0, err
  notes = [l for l in out.splitlines() if l.startswith("data: epoch")]
  assert notes and notes[0].startswith("data: epoch 2 begins at step"), out


def test_help_shows_defaults_and_points_to_the_config_reference():
  r = subprocess.run([sys.executable, "-m", "mtjax.train", "--help"], capture_output=True,
                     text=True, timeout=60)
  assert r.returncode == 0
  text = " ".join(r.stdout.split())
  assert "(default: INFO)" in text and "docs/config.md" in text and "--log-every" in text


def test_train_seq_beyond_the_models_positions_is_refused_unless_raised(tmp_path):
  code, _, err = cli("train.steps=1", "model.max_position=32")  # tiny.yaml trains 64 tokens
  assert code == 2 and len(err) == 1
  assert "train.seq: 64 tokens exceed" in err[0] and "model.max_position=64" in err[0], err
  code, _, err = cli("train.steps=1", "model.max_position=64")
  assert code == 0, err


def test_resume_with_other_steps_refuses_to_stretch_the_schedule(tmp_path):
  ck = tmp_path / "ck"
  warm = "optim.warmup_steps=1"
  s = train.run(config.load(TINY, ["train.steps=3", f"train.checkpoint_dir={ck}", warm]),
                progress=False)
  assert s["steps"] == 3
  code, _, err = cli("train.steps=5", f"train.checkpoint_dir={ck}", warm)
  assert code == 2 and len(err) == 1, err
  assert "train.steps: 5 differs from the 3" in err[0] and "optim.decay_steps=3" in err[0]
  # said explicitly, either way: the schedule of 3 steps goes on at its floor
  s = train.run(config.load(TINY, ["train.steps=5", f"train.checkpoint_dir={ck}", warm,
                                   "optim.decay_steps=3"]), progress=False)
  from mtjax import runlog
  lrs = [r["lr"] for r in runlog.read_metrics(ck)]
  cfg = config.load(TINY, [])
  assert s["steps"] == 2 and lrs[3] == pytest.approx(cfg.optim.lr * cfg.optim.min_lr_ratio)


def test_summary_and_json_say_where_the_export_went(tmp_path):
  out, js = tmp_path / "export", tmp_path / "s.json"
  code, stdout, err = cli("train.steps=2", f"train.export_dir={out}", "--json", js)
  assert code == 0, err
  assert json.loads(js.read_text())["export"] == str(out)
  assert f"export {out}" in stdout


def test_data_of_another_tokenizer_is_refused_by_train_unless_accepted(tmp_path):
  """The README's fine-tune with a model of one tokenizer and data prepared with another: one line
  naming both, exit 2; data.allow_other_tokenizer=true accepts it. Without model.from_hf, data
  whose ids do not fit the vocabulary names the key to set."""
  from test_readme import tiny_model
  from mtjax import data
  model, other = tmp_path / "model", tmp_path / "other"
  tiny_model(model)
  from test_chat import make_tokenizer
  make_tokenizer(other, vocab=300)
  corpus = tmp_path / "docs.jsonl"
  corpus.write_text("".join(json.dumps({"text": f"hello world {i}"}) + "\n" for i in range(40)))
  prep = tmp_path / "prep"
  data.prepare(other, prep, [str(corpus)], val_fraction=0, progress=False)
  small = ["train.steps=1", "train.batch=2", "train.seq=16", "data.source=prepared",
           f"data.path={prep}"]
  finetune = ROOT / "configs" / "finetune.yaml"
  from test_readme import TOY
  code, _, err = cli(f"model.from_hf={model}", *small, *TOY[3:], "train.eval_every=0",
                     config=finetune)
  assert code == 2 and len(err) == 1, err
  assert str(model) in err[0] and str(other / "tokenizer.json") in err[0], err
  assert "data.allow_other_tokenizer=true" in err[0]
  code, _, err = cli(f"model.from_hf={model}", "data.allow_other_tokenizer=true", *small,
                     *TOY[3:], "train.eval_every=0", config=finetune)
  assert code == 0, err
  code, _, err = cli("model.vocab_size=64", *small)  # forgot model.from_hf
  assert code == 2 and len(err) == 1 and "model.from_hf" in err[0], err


def test_a_run_refused_by_the_plan_leaves_no_folder_and_loses_no_checkpoint(tmp_path, capsys):
  from mtjax import checkpoint, exits
  ck = tmp_path / "ck"
  refused = ["--config", str(TINY), "--no-progress", "model.layers=2000000"]
  assert train.main([*refused, f"train.checkpoint_dir={ck}"]) == exits.BAD_INPUT
  assert capsys.readouterr().err.startswith("refused: does not fit")
  assert not ck.exists()
  assert train.main(["--config", str(TINY), "--quiet", "train.steps=1",
                     f"train.checkpoint_dir={ck}"]) == exits.OK
  assert train.main([*refused, f"train.checkpoint_dir={ck}", "train.resume=false",
                     "train.overwrite=true"]) == exits.BAD_INPUT
  assert checkpoint.latest(ck) == ck / "step_1"  # the refused run deleted nothing


def test_resume_with_moments_stored_otherwise_is_refused_and_keeps_the_checkpoint(tmp_path):
  """8-bit codes and float moments do not convert into each other: a resume across them is one
  line naming both, before anything is allocated, and the checkpoint stays good."""
  from mtjax import checkpoint
  ck = tmp_path / "ck"
  train.run(config.load(TINY, ["train.steps=2", f"train.checkpoint_dir={ck}"]), progress=False)
  code, _, err = cli("train.steps=2", f"train.checkpoint_dir={ck}", "optim.state_dtype=int8")
  assert code == 2 and len(err) == 1, err
  assert "optim.state_dtype=float32 moments and this run has int8" in err[0]
  assert checkpoint.latest(ck) == ck / "step_2" and not list(ck.glob(".damaged-*"))
