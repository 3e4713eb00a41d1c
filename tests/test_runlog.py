"""The run folder: metrics.jsonl schema, resume truncation, and TensorBoard files read back with
the TFRecord framing checked by google-crc32c and each record parsed by the Event protobuf."""

import io
import json
import logging
import math
import re
import statistics
import struct

import google_crc32c
import numpy as np
import pytest
import yaml
from tensorboardX.proto import event_pb2

from mtjax import config, runlog


def _unmask(masked: int) -> int:
  rot = (masked - 0xA282EAD8) & 0xFFFFFFFF
  return ((rot >> 17) | (rot << 15)) & 0xFFFFFFFF


def _records(path) -> list[bytes]:
  """TFRecord payloads of a file, every length and data crc checked."""
  buf, pos, out = path.read_bytes(), 0, []
  while pos < len(buf):
    header = buf[pos:pos + 8]
    (length,) = struct.unpack("<Q", header)
    (len_crc,) = struct.unpack("<I", buf[pos + 8:pos + 12])
    assert _unmask(len_crc) == google_crc32c.value(header)
    data = buf[pos + 12:pos + 12 + length]
    (data_crc,) = struct.unpack("<I", buf[pos + 12 + length:pos + 16 + length])
    assert _unmask(data_crc) == google_crc32c.value(data)
    out.append(data)
    pos += 16 + length
  assert pos == len(buf)
  return out


def _tb_events(run_dir) -> list[dict]:
  """The events of the event files under run_dir/tb as {step, wall_time, version, scalars}, the
  scalars of consecutive events of one step and time together."""
  events = []
  for path in sorted((run_dir / "tb").glob("events.out.tfevents.*")):
    for data in _records(path):
      ev = event_pb2.Event.FromString(data)
      scalars = {v.tag: v.simple_value for v in ev.summary.value}
      for v in ev.summary.value:
        assert v.WhichOneof("value") == "simple_value"
      if ev.file_version:
        events.append({"step": ev.step, "wall_time": ev.wall_time, "version": ev.file_version,
                       "scalars": {}})
      elif events and events[-1]["scalars"] and events[-1]["step"] == ev.step \
          and events[-1]["wall_time"] == ev.wall_time:
        events[-1]["scalars"].update(scalars)
      else:
        events.append({"step": ev.step, "wall_time": ev.wall_time, "scalars": scalars})
  return events


def _lines(run_dir) -> list[dict]:
  def no_constants(name):
    raise AssertionError(f"{name} is not valid JSON")
  text = (run_dir / "metrics.jsonl").read_text()
  assert text.endswith("\n")
  return [json.loads(line, parse_constant=no_constants) for line in text.splitlines()]


def _step(i: int) -> dict:
  return dict(loss=5.0 - 0.1 * i, lr=1e-3 * (i + 1), grad_norm=np.float32(1.5), skipped=False,
              tokens_per_s=1000.0 + i, model_tflops=0.01, step_s=0.25, forward_s=0.1,
              backward_s=0.12, opt_wait_s=0.01, transfer_wait_s=0.02, host_rss_gib=1.5,
              device_peak_gib=None)


def test_crc32c_check_value():
  assert google_crc32c.value(b"123456789") == 0xE3069283  # the published crc32c check value


def test_metrics_schema_config_and_plan(tmp_path):
  cfg = {"model": {"hidden": 32, "layers": 2}, "train": {"steps": 3, "lr": 1e-3}}
  with runlog.RunLog(tmp_path, config=cfg, plan="plan: 2 groups") as log:
    log.log(0, **_step(0))
    log.log(1, **_step(1), held_out_loss=4.5)
    log.log(2, **{**_step(2), "loss": float("nan"), "grad_norm": np.float64("inf")})
  assert json.loads((tmp_path / "config.json").read_text()) == cfg
  assert yaml.safe_load((tmp_path / "config.yaml").read_text()) == cfg
  assert (tmp_path / "plan.txt").read_text() == "plan: 2 groups\n"
  lines = _lines(tmp_path)
  assert [r["step"] for r in lines] == [0, 1, 2]
  for i, r in enumerate(lines):
    expected = set(_step(0)) | {"step", "time"} | ({"held_out_loss"} if i == 1 else set())
    assert set(r) == expected
    assert isinstance(r["time"], float) and r["skipped"] is False and r["device_peak_gib"] is None
  assert lines[0]["loss"] == 5.0 and lines[0]["grad_norm"] == 1.5
  assert lines[1]["held_out_loss"] == 4.5
  assert lines[2]["loss"] is None and lines[2]["grad_norm"] is None  # NaN and inf as null


def test_bad_value_named(tmp_path):
  with runlog.RunLog(tmp_path, trackers=("jsonl",)) as log:
    with pytest.raises(TypeError, match="lr"):
      log.log(0, lr=[1.0])


def test_resume_keeps_earlier_steps_and_drops_later(tmp_path):
  with runlog.RunLog(tmp_path) as log:
    for i in range(6):
      log.log(i, **_step(i))
  with (tmp_path / "metrics.jsonl").open("a") as f:
    f.write('{"step": 6, "loss": 1.')  # torn by a crash mid-write
  # The last checkpoint was at step 3: steps 3.. are logged again.
  with runlog.RunLog(tmp_path, start_step=3) as log:
    log.log(3, **_step(30))
    log.log(4, **_step(40))
  lines = _lines(tmp_path)
  assert [r["step"] for r in lines] == [0, 1, 2, 3, 4]
  assert lines[2]["loss"] == _step(2)["loss"] and lines[3]["loss"] == _step(30)["loss"]
  events = [e for e in _tb_events(tmp_path) if e["scalars"]]
  assert [e["step"] for e in events] == [0, 1, 2, 3, 4]  # the TB files hold no dropped step
  assert events[3]["scalars"]["loss"] == pytest.approx(_step(30)["loss"], rel=1e-6)


def test_fresh_run_in_old_folder_starts_over(tmp_path):
  with runlog.RunLog(tmp_path) as log:
    log.log(0, loss=1.0)
  with runlog.RunLog(tmp_path) as log:
    log.log(0, loss=2.0)
  assert [r["loss"] for r in _lines(tmp_path)] == [2.0]


def test_tensorboard_scalars_round_trip(tmp_path):
  log = runlog.RunLog(tmp_path)
  written = [log.log(i, **_step(i), held_out_loss=4.0 if i == 1 else float("nan"))
             for i in range(3)]
  # Flushed every step: readable while the run is still open.
  assert len([e for e in _tb_events(tmp_path) if e["scalars"]]) == 3
  log.close()
  events = _tb_events(tmp_path)
  assert events[0]["version"] == "brain.Event:2" and not events[0]["scalars"]
  steps = events[1:]
  assert [e["step"] for e in steps] == [0, 1, 2]
  for ev, rec in zip(steps, written):
    assert ev["wall_time"] == pytest.approx(rec["time"], abs=1e-6)
    numeric = {k: v for k, v in rec.items()
               if k not in ("step", "time") and isinstance(v, (int, float))}
    assert set(ev["scalars"]) == set(numeric)  # no step, time, null or non-numeric fields
    for k, v in numeric.items():
      assert ev["scalars"][k] == pytest.approx(float(v), rel=1e-6), k
  assert "held_out_loss" in steps[1]["scalars"] and "held_out_loss" not in steps[0]["scalars"]
  assert steps[0]["scalars"]["skipped"] == 0.0 and not math.isnan(steps[2]["scalars"]["loss"])


def test_large_step_encodes(tmp_path):
  with runlog.RunLog(tmp_path) as log:
    log.log(2**40, loss=1.0)
  assert [e["step"] for e in _tb_events(tmp_path) if e["scalars"]] == [2**40]


def test_setup_logging_once(capsys):
  logger = runlog.setup_logging("INFO")
  runlog.setup_logging(logging.INFO)
  try:
    logger.info("hello from the test")
    assert capsys.readouterr().err.count("hello from the test") == 1
  finally:
    for h in [h for h in logger.handlers if getattr(h, "_mtjax", False)]:
      logger.removeHandler(h)
    logger.setLevel(logging.NOTSET)


def test_trackers_config_and_a_missing_wandb(tmp_path, monkeypatch):
  with runlog.RunLog(tmp_path / "plain", trackers=("jsonl",)) as log:
    log.log(0, loss=1.0)
  assert not (tmp_path / "plain" / "tb").exists()
  with pytest.raises(ValueError, match="unknown tracker 'mlflow'"):
    runlog.RunLog(tmp_path / "x", trackers=("jsonl", "mlflow"))
  with pytest.raises(config.ConfigError, match="leaves out jsonl"):
    config.TrainConfig(trackers=("tensorboard",))
  assert config.TrainConfig(trackers=("jsonl", "tensorboard")).trackers == ("jsonl", "tensorboard")
  monkeypatch.setattr(config.importlib.util, "find_spec", lambda name: None)
  with pytest.raises(config.ConfigError, match="wandb is selected but the wandb package is not "
                     "installed"):
    config.TrainConfig(trackers=("jsonl", "wandb"))
  monkeypatch.setitem(__import__("sys").modules, "wandb", None)  # import wandb fails
  with pytest.raises(ValueError, match="wandb is selected but the wandb package is not installed"):
    runlog.RunLog(tmp_path / "w", trackers=("jsonl", "wandb"))


def test_wandb_offline_run_holds_the_scalars(tmp_path, monkeypatch):
  wandb = pytest.importorskip("wandb")
  monkeypatch.setenv("WANDB_MODE", "offline")
  monkeypatch.setenv("WANDB_SILENT", "true")
  with runlog.RunLog(tmp_path, {"train": {"steps": 2}}, trackers=("jsonl", "wandb")) as log:
    log.log(0, loss=2.0)
    log.log(1, loss=1.5)
  (run,) = (tmp_path / "wandb").glob("offline-run-*")
  assert list(run.glob("*.wandb")), "no offline run file"
  del wandb


# ---- progress ----------------------------------------------------------------------------------

_LINE = re.compile(r"step (\d+)/(\d+)  loss (\S+)  lr (\S+)  gnorm (\S+)  ([\d,]+) tok/s"
                   r"(?:  held-out (\S+))?(?:  ETA (?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?)?$")


def _eta_seconds(m: re.Match) -> int | None:
  if not m.group(0).count("ETA"):
    return None
  d, h, mi, s = (int(g or 0) for g in m.groups()[7:])
  return ((d * 24 + h) * 60 + mi) * 60 + s


class _Terminal(io.StringIO):
  def isatty(self):
    return True


def _feed(progress, steps, start=0, slow_first=30.0):
  """Steps start+1..steps: the first takes 30 s (the compile), the others 1.5 s and 0.5 s in turn."""
  times = []
  for step in range(start + 1, steps + 1):
    times.append(slow_first if step == start + 1 else (0.5 if step % 2 else 1.5))
    progress.update(step, loss=4.0 - 0.01 * step, lr=3e-4, grad_norm=0.8, tokens_per_s=12345.0,
                    step_s=times[-1], held_out=3.75 if step == 6 else None)
  return times


@pytest.mark.parametrize("mode", ["lines", "auto"])
def test_progress_lines_off_a_terminal(mode):
  out = io.StringIO()  # a file or a pipe: no isatty
  with runlog.Progress(12, 0, mode=mode, stream=out, every=5) as p:
    p.note("data: epoch 1 begins")
    times = _feed(p, 12)
  text = out.getvalue()
  assert "\r" not in text and text.endswith("\n")
  lines = text.splitlines()
  assert lines[0] == "data: epoch 1 begins"
  matches = [_LINE.match(line) for line in lines[1:]]
  assert all(matches), lines
  assert [int(m.group(1)) for m in matches] == [1, 5, 10, 12]  # first, every 5th, last
  assert {int(m.group(2)) for m in matches} == {12}
  assert float(matches[1].group(3)) == pytest.approx(3.95)
  assert [m.group(7) for m in matches] == [None, None, "3.7500", "3.7500"]  # once evaluated
  assert _eta_seconds(matches[0]) is None  # the compile step alone says nothing of the rest
  for m in matches[1:]:
    step = int(m.group(1))
    want = statistics.median(times[1:step]) * (12 - step)  # the steps after the compile
    assert _eta_seconds(m) == round(want), m.group(0)


def test_progress_resumed_run_starts_its_lines_at_its_first_step():
  out = io.StringIO()
  with runlog.Progress(20, 13, mode="lines", stream=out, every=5) as p:
    _feed(p, 20, start=13)
  assert [int(_LINE.match(line).group(1)) for line in out.getvalue().splitlines()] == [14, 15, 20]


def test_progress_bar_on_a_terminal_and_notes_above_it():
  term = _Terminal()
  with runlog.Progress(12, 0, mode="auto", stream=term, every=5) as p:
    assert p.mode == "bar"
    _feed(p, 6)
    p.note("eval: held-out loss 3.7500 at step 6")
    _feed(p, 12, start=6)
  text = term.getvalue()
  assert "\r" in text and "12/12" in text and "held_out=3.7500" in text
  assert "\neval: held-out loss 3.7500 at step 6\n" in text.replace("\r", "\n")
  assert not any(_LINE.match(line) for line in text.replace("\r", "\n").splitlines())


def test_progress_off_writes_nothing_and_modes_are_checked():
  out = _Terminal()
  with runlog.Progress(12, 0, mode="off", stream=out) as p:
    p.note("not shown")
    _feed(p, 12)
  assert out.getvalue() == ""
  with pytest.raises(ValueError, match="progress mode 'bars': one of auto, lines, off"):
    runlog.Progress(12, mode="bars")


def test_duration():
  assert [runlog.duration(s) for s in (0, 44.6, 192, 3600 * 2 + 300, 86400 * 3 + 3600 * 4)] == \
      ["0s", "45s", "3m12s", "2h05m", "3d04h"]
