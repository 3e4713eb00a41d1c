"""The benchmark CLI on the CPU: every system runs and writes the record fields the issue asks for."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
import bench  # noqa: E402

TINY = Path(__file__).parent.parent / "configs" / "tiny.yaml"
FIELDS = {"system", "params", "hidden", "layers", "batch", "seq", "step_s", "tokens_per_s",
          "model_tflops", "hw_tflops", "host_bytes_per_param", "device_peak_gib", "h2d_gbps",
          "d2h_gbps", "host_opt_gparams_per_s", "gpu_idle_frac", "roofline_s", "jax_version"}


def test_bench_runs_every_system_and_records_the_fields(tmp_path, capsys):
  out = tmp_path / "records.json"
  rc = bench.main(["--config", str(TINY), "--warmup", "1", "--steps", "1", "--out", str(out),
                   "--variant", "dev:engine.device_update_layers=auto", "model.layers=1"])
  assert rc == 0
  records = json.loads(out.read_text())
  systems = [r["system"] for r in records]
  assert systems == ["mtjax", "mtjax:dev", "mtjax-serial", "jax-all-gpu", "roofline"]
  for r in records[:2]:
    assert FIELDS <= set(r), FIELDS - set(r)
    assert r["host_bytes_per_param"] + r["device_state_bytes_per_param"] == 12.0
    assert 0 <= r["gpu_idle_frac"] < 1
    assert r["tokens_per_s"] * r["step_s"] == pytest.approx(8 * 64)  # tiny config: batch 8 x seq 64
  assert isinstance(records[1]["device_update_layers"], int)  # auto resolved by the planner
  assert records[0]["host_bytes_per_param"] == 12.0  # tiny fits the host: nothing in device memory
  roof = records[-1]
  terms = [v for k, v in roof.items() if k.startswith("roofline_") and k != "roofline_s"]
  assert len(terms) == 4  # compute, both link directions, host optimizer
  assert roof["step_s"] == max(terms)
  assert "roofline terms" in capsys.readouterr().out


def test_bench_refuses_unknown_system_and_bad_variant(capsys):
  assert bench.main(["--config", str(TINY), "--systems", "mtjax,deepspeed"]) == 2
  assert bench.main(["--config", str(TINY), "--variant", "x:engine.bogus=1"]) == 2
  err = capsys.readouterr().err
  assert "deepspeed" in err and "engine.bogus" in err


def test_tracer_survives_an_array_donated_before_it_is_watched():
  import jax.numpy as jnp
  tracer = bench.Tracer()
  gone, kept = jnp.ones(8), jnp.ones(8)
  gone.delete()  # what a donating kernel does to its input
  tracer.issued("h2d", 0, "bwd", gone)
  tracer.issued("h2d", 1, "bwd", kept)  # the lane's watcher must still see this one
  tracer.close()
  assert [e[1] for e in tracer.events] == [0, 1]


def test_long_context_rows_extrapolate_a_slice_and_plan_the_whole_model(tmp_path, capsys):
  """One slice row of the long-context table on the CPU: the training run, the whole model's
  plan beside it, and the extrapolation."""
  import long_context  # noqa: PLC0415
  from mtjax import config, plan  # noqa: PLC0415
  over = ["model.layers=3", "engine.activations=auto"]
  assert long_context.main(["run", "--out", str(tmp_path), "--name", "tiny", "--config", str(TINY),
                            "--seq", "128", "--layers", "1", "--steps", "2", *over]) == 0
  row = json.loads((tmp_path / "tiny_128_L1.json").read_text())
  assert row["train"]["seq"] == 128 and row["train"]["layers"] == 1 and row["full_layers"] == 3
  assert row["full_plan"]["fits"] and row["full_plan"]["params"] == plan.param_counts(
      config.load(TINY, ["model.layers=3"]).model)["total"]
  # the measured step scaled by the planner's whole-model / slice ratio
  whole = long_context.whole_model(row)
  assert row["full_plan"]["schedule_s"] > row["train"]["plan_schedule_s"] > 0
  assert whole["step_s"] == pytest.approx(row["train"]["step_s_median"]
                                          * row["full_plan"]["schedule_s"]
                                          / row["train"]["plan_schedule_s"])
  capsys.readouterr()
  assert long_context.main(["table", "--out", str(tmp_path)]) == 0
  assert "| tiny | 128 | 1 of 3 |" in capsys.readouterr().out


def test_long_context_table_says_why_a_slice_has_no_whole_model_step(tmp_path):
  """A slice whose whole model the planner refused shows the refusal, not "(this row)", and
  `--ceiling` holds every row against one rate."""
  import long_context  # noqa: PLC0415
  train = {"step_s_median": 2.0, "tokens_per_s": 100.0, "model_tflops": 50.0,
           "tflops_with_attention": 300.0, "device_peak_gib": 10.0, "plan_device_gib": 10.5,
           "peak_rss_gib": 5.0, "plan_host_gib": 6.0, "plan_schedule_s": 1.9}
  row = {"name": "8B", "seq": 1 << 20, "steps": 2, "layers": 1, "full_layers": 32, "command": "c",
         "rc": 0, "ceiling_tflops": 500.0, "train": train,
         "full_plan": {"refused": "does not fit in device memory: needs 257.7 GiB; lower x"}}
  assert long_context.whole_model(row) is None
  own, one = (long_context.format_rows([row], None, c).splitlines()[-1] for c in (None, 600.0))
  assert "refused by the planner: does not fit in device memory: needs 257.7 GiB |" in own
  assert "(this row)" not in own and "| 60% |" in own and "| 50% |" in one
