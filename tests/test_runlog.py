"""The run folder: metrics.jsonl schema, resume truncation, and TensorBoard files read back by a
decoder written here independently of the writer (TFRecord framing, crc32c, protobuf fields)."""

import json
import logging
import math
import struct

import numpy as np
import pytest
import yaml

from mtjax import runlog


def _crc32c(data: bytes) -> int:
  """Bitwise crc32c, no table: independent of the writer's table-driven one."""
  crc = 0xFFFFFFFF
  for b in data:
    crc ^= b
    for _ in range(8):
      crc = (crc >> 1) ^ (0x82F63B78 & -(crc & 1))
  return crc ^ 0xFFFFFFFF


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
    assert _unmask(len_crc) == _crc32c(header)
    data = buf[pos + 12:pos + 12 + length]
    (data_crc,) = struct.unpack("<I", buf[pos + 12 + length:pos + 16 + length])
    assert _unmask(data_crc) == _crc32c(data)
    out.append(data)
    pos += 16 + length
  assert pos == len(buf)
  return out


def _fields(buf: bytes) -> list[tuple[int, int, object]]:
  """(field number, wire type, value) of a protobuf message: ints, 8/4 raw bytes or bytes."""
  pos, out = 0, []

  def varint():
    nonlocal pos
    n = shift = 0
    while True:
      b = buf[pos]
      pos += 1
      n |= (b & 0x7F) << shift
      shift += 7
      if not b & 0x80:
        return n

  while pos < len(buf):
    key = varint()
    number, wire = key >> 3, key & 7
    if wire == 0:
      value = varint()
    elif wire == 1:
      value, pos = buf[pos:pos + 8], pos + 8
    elif wire == 5:
      value, pos = buf[pos:pos + 4], pos + 4
    elif wire == 2:
      n = varint()
      value, pos = buf[pos:pos + n], pos + n
    else:
      raise AssertionError(f"wire type {wire}")
    out.append((number, wire, value))
  return out


def _tb_events(run_dir) -> list[dict]:
  """Every event of every event file under run_dir/tb, as {step, wall_time, version, scalars}."""
  events = []
  for path in sorted((run_dir / "tb").glob("events.out.tfevents.*")):
    for data in _records(path):
      ev = {"step": 0, "scalars": {}}
      for number, wire, value in _fields(data):
        if number == 1:
          assert wire == 1
          ev["wall_time"] = struct.unpack("<d", value)[0]
        elif number == 2:
          assert wire == 0
          ev["step"] = value
        elif number == 3:
          ev["version"] = value.decode()
        elif number == 5:
          for vnum, _, v in _fields(value):
            assert vnum == 1
            parts = {n: (w, x) for n, w, x in _fields(v)}
            assert parts[2][0] == 5  # simple_value: a 32-bit float
            ev["scalars"][parts[1][1].decode()] = struct.unpack("<f", parts[2][1])[0]
      events.append(ev)
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
  assert _crc32c(b"123456789") == 0xE3069283  # the published crc32c check value
  assert runlog.crc32c(b"123456789") == 0xE3069283


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
  with runlog.RunLog(tmp_path, tensorboard=False) as log:
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
    assert ev["wall_time"] == rec["time"]
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
