"""python -m mtjax.report renders every plot of a small synthetic run folder."""

import json

import pytest

pytest.importorskip("matplotlib")

from mtjax import exits, report

PNG = b"\x89PNG\r\n\x1a\n"


def _write_run(run_dir, steps=12, first_step_s=0.3):
  """metrics.jsonl written by hand (not by RunLog), with a null loss and held-out every 4 steps;
  the first step takes `first_step_s` (its compile), the others 0.3 s."""
  lines = []
  for i in range(steps):
    step_s = first_step_s if i == 0 else 0.3
    r = {"step": i, "loss": None if i == 5 else 5.0 - 0.2 * i, "lr": 1e-3 * min(1, (i + 1) / 4),
         "grad_norm": 1.0, "skipped": i == 5, "tokens_per_s": 270.0 / step_s + 10 * i,
         "model_tflops": 0.006 / step_s, "step_s": step_s, "forward_s": 0.1, "backward_s": 0.15, "opt_wait_s": 0.01,
         "transfer_wait_s": 0.02, "host_rss_gib": 1.0 + 0.01 * i, "device_peak_gib": 0.5,
         "time": 1.7e9 + 0.3 * i}
    if i % 4 == 3:
      r["held_out_loss"] = 5.1 - 0.2 * i
    lines.append(json.dumps(r))
  (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
  lanes = {"h2d": [[0.0, 0.01, "0", "fwd"], [0.01, 0.02, "1", "fwd"]],
           "compute": [[0.01, 0.03, "0", "fwd"], [0.03, 0.05, "1", "bwd"]],
           "d2h": [[0.05, 0.06, "1", "bwd"]], "host optimizer": [[0.06, 0.08, "1", "bwd"]]}
  (run_dir / "timeline.json").write_text(json.dumps(lanes))


def test_renders_every_png(tmp_path, capsys):
  run_dir, out = tmp_path / "run", tmp_path / "plots"
  run_dir.mkdir()
  _write_run(run_dir)
  assert report.main([str(run_dir), "--out", str(out)]) == 0
  names = {"loss.png", "lr.png", "throughput.png", "step_time.png", "memory.png", "timeline.png"}
  assert {p.name for p in out.iterdir()} == names
  for name in names:
    data = (out / name).read_bytes()
    assert data[:8] == PNG and len(data) > 1000, name
  assert len(capsys.readouterr().out.splitlines()) == len(names)


def test_the_compile_step_is_left_out_of_the_scale(tmp_path, monkeypatch):
  import matplotlib.figure
  run_dir = tmp_path / "run"
  run_dir.mkdir()
  _write_run(run_dir, first_step_s=40.0)  # the first step compiles: 130x a steady step
  axes = {}
  real = matplotlib.figure.Figure.savefig

  def savefig(fig, path, *a, **k):
    axes[type(path)(path).name] = [(ax.get_ylim(), ax.get_title()) for ax in fig.axes]
    return real(fig, path, *a, **k)
  monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
  report.render(run_dir, tmp_path / "plots")
  (seconds, title), = axes["step_time.png"]
  assert 0.3 <= seconds[1] < 1.0  # the steady steps' 0.3 s fill the axis, not the compile's 40 s
  assert "step 0 (compilation, 40.0 s) left out" in title
  (tokens_s, title), (tflops, _) = axes["throughput.png"]
  assert 700 < tokens_s[0] and tokens_s[1] < 1100  # 900-1010 tok/s; the compile step's 7 left out
  assert 0.015 < tflops[0] and "step 0 (compilation, 40.0 s) left out" in title
  assert report.compile_step([{"step": 0, "held_out_loss": 3.0}, {"step": 1, "step_s": 9.0}]) \
      is None  # a run of one step keeps it: there is no other to scale by


def test_tokens_seen_from_throughput():
  records = [{"step": 0, "tokens_per_s": 100.0, "step_s": 2.0},
             {"step": 1, "tokens_per_s": None, "step_s": 2.0},
             {"step": 2, "tokens_per_s": 50.0, "step_s": 2.0}]
  assert report.tokens_seen(records) == [200.0, 200.0, 300.0]
  assert report.tokens_seen([{"step": 0, "tokens": 64}]) == [64.0]


def test_folder_without_metrics_is_one_line_error(tmp_path, capsys):
  assert report.main([str(tmp_path)]) == exits.BAD_INPUT
  err = capsys.readouterr().err
  assert len(err.strip().splitlines()) == 1 and "metrics.jsonl" in err


def test_an_unwritable_out_or_a_full_disk_is_one_line_and_its_code(tmp_path, capsys, monkeypatch):
  import errno

  import matplotlib.figure
  run_dir = tmp_path / "run"
  run_dir.mkdir()
  _write_run(run_dir)
  (tmp_path / "file").write_text("x")
  assert report.main([str(run_dir), "--out", str(tmp_path / "file")]) == exits.BAD_INPUT
  assert capsys.readouterr().err == f"error: File exists: {tmp_path / 'file'}\n"

  def full(fig, path, *a, **k):
    raise OSError(errno.ENOSPC, "No space left on device", str(path))
  monkeypatch.setattr(matplotlib.figure.Figure, "savefig", full)
  assert report.main([str(run_dir), "--out", str(tmp_path / "plots")]) == exits.IO_FAILURE
  assert capsys.readouterr().err == f"error: No space left on device: {tmp_path / 'plots'}" \
                                    f"/loss.png\n"


def test_help_shows_the_defaults(capsys):
  with pytest.raises(SystemExit) as e:
    report.main(["--help"])
  assert e.value.code == exits.OK and "(default: RUN_DIR/report)" in capsys.readouterr().out


def test_a_grpo_run_gets_its_reward_kl_clip_and_length_plots(tmp_path):
  run_dir = tmp_path / "run"
  run_dir.mkdir()
  records = [{"step": i, "loss": -0.01 * i, "reward_mean": 0.1 * i, "reward_std": 0.3,
              "kl": 0.001 * i, "clip_fraction": 0.05 * (i % 2), "completion_tokens_mean": 3.0 + i,
              **({"held_out_reward_mean": 0.2} if i % 2 else {})} for i in range(1, 7)]
  (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
  names = {p.name for p in report.render(run_dir, tmp_path / "plots")}
  assert names == {"loss.png", "grpo_rewards.png", "grpo_kl.png", "grpo_clip.png",
                   "completion_tokens.png"}
  for name in names:
    data = (tmp_path / "plots" / name).read_bytes()
    assert data[:8] == PNG and len(data) > 1000, name
