"""Every benchmark script's `--smoke` run on the CPU, in this process where the script allows (one
jax start-up for all), so no script rots; and what the scripts compute from their measurements."""

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).parent.parent
BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(BENCH))
import bench

from mtjax import exits

TINY = ROOT / "configs" / "tiny.yaml"
FIELDS = {"system", "params", "hidden", "layers", "batch", "seq", "step_s", "tokens_per_s",
          "model_tflops", "hw_tflops", "host_bytes_per_param", "device_peak_gib", "h2d_gbps",
          "d2h_gbps", "host_opt_gparams_per_s", "gpu_idle_frac", "roofline_s", "jax_version"}
# Each script in benchmarks/ and the test that runs its smoke.
SMOKES = {"bench.py": "test_bench_smoke_runs_every_system_and_records_the_fields",
          "long_context.py": "test_long_context_smoke_extrapolates_a_slice",
          "moe_kernels.py": "test_moe_kernels_smoke_checks_each_implementation_against_float32",
          "attention_kernels.py": "test_attention_kernels_smoke_checks_each_kernel_against_float32",
          "deepspeed_baseline.py": "test_deepspeed_baseline_smoke_builds_the_same_shape",
          "gpu_check.py": "test_gpu_check_smoke_holds_the_engine_to_the_reference",
          "finetune.py": "test_finetune_smoke_exports_what_transformers_reads_back",
          "recipes.py": "test_recipes_smoke_runs_sft_dpo_and_accumulation",
          "h200.sh": "test_h200_dry_run_names_existing_scripts_and_configs",
          "int8_adamw.py": "test_int8_adamw_smoke_times_each_state_dtype_and_compares_the_maps",
          "decode.py": "test_decode_smoke_times_both_systems",
          "moments_quality.py": "test_moments_quality_smoke_trains_each_state_dtype",
          "vlm.py": "test_vlm_smoke_times_each_freeze",
          "grpo.py": "test_grpo_smoke_splits_the_step_into_generation_and_training",
          "deepspeed_wheels.sh": None,  # builds wheels from the network: nothing to smoke
          "attention_wheels.sh": None}  # downloads wheels from the network: nothing to smoke


def test_every_benchmark_script_has_a_smoke_test():
  scripts = {p.name for p in BENCH.iterdir() if p.suffix in (".py", ".sh")}
  assert scripts == set(SMOKES), f"add a smoke test for {scripts - set(SMOKES)}"
  for name, test in SMOKES.items():
    assert test is None or test in globals(), test
    if name.endswith(".py"):
      assert "--smoke" in (BENCH / name).read_text(), name


@pytest.mark.soak  # long; the README run's time budget (the soak runs it)
def test_bench_smoke_runs_every_system_and_records_the_fields(tmp_path, capsys):
  out = tmp_path / "records.json"
  assert bench.main(["--smoke", "--out", str(out)]) == 0
  records = json.loads(out.read_text())
  systems = [r["system"] for r in records]
  assert systems == ["mtjax", "mtjax:dev", "mtjax-serial", "jax-all-gpu", "roofline"]
  for r in records[:2]:
    assert FIELDS <= set(r), FIELDS - set(r)
    assert r["host_bytes_per_param"] + r["device_state_bytes_per_param"] == 12.0
    assert 0 <= r["gpu_idle_frac"] < 1
    assert r["layers"] == 1
    assert r["tokens_per_s"] * r["step_s"] == pytest.approx(8 * 64)  # tiny config: batch 8 x seq 64
  assert isinstance(records[1]["device_update_layers"], int)  # auto resolved by the planner
  roof = records[-1]
  terms = [v for k, v in roof.items() if k.startswith("roofline_") and k != "roofline_s"]
  assert len(terms) == 4  # compute, both link directions, host optimizer
  assert roof["step_s"] == max(terms)
  assert "roofline terms" in capsys.readouterr().out


def test_bench_refuses_unknown_system_and_bad_variant(capsys):
  assert bench.main(["--config", str(TINY), "--systems", "mtjax,deepspeed"]) == 2
  assert bench.main(["--config", str(TINY), "--variant", "x:engine.bogus=1"]) == 2
  # a variant of another shape would be fed the first shape's batches and FLOPs
  assert bench.main(["--config", str(TINY), "--variant", "v:model.vocab_size=300"]) == 2
  err = capsys.readouterr().err
  assert "deepspeed" in err and "engine.bogus" in err and "--variant v: changes the model" in err


def test_bench_packs_documents_as_prepared_data_does():
  from mtjax import data
  b = bench.packed(data.synthetic_batch(0, 4, 64, 100, 0), 5, 0)
  for seg, pos in zip(b.segments, b.positions):
    assert seg[0] == 1 and seg[-1] == 5 and (np.diff(seg) >= 0).all()  # ids 1..5 along the row
    starts = np.flatnonzero(np.diff(seg, prepend=0))
    assert len(starts) == 5 and (pos[starts] == 0).all()  # each document's positions start at 0
    assert (np.diff(pos)[np.diff(seg) == 0] == 1).all()  # and count up inside it
  assert bench.packed(data.synthetic_batch(0, 4, 64, 100, 0), 0, 0).segments is None
  # and such rows are planned as prepared data is (the attention's mask costed)
  from mtjax import config
  from mtjax.plan.search import carries_documents
  cfg = config.load(TINY)
  assert not carries_documents(bench.with_documents(cfg, 1))
  assert carries_documents(bench.with_documents(cfg, 5))


def test_tracer_survives_an_array_donated_before_it_is_watched():
  import jax.numpy as jnp
  tracer = bench.Tracer()
  gone, kept = jnp.ones(8), jnp.ones(8)
  gone.delete()  # what a donating kernel does to its input
  tracer.issued("h2d", 0, "bwd", gone)
  tracer.issued("h2d", 1, "bwd", kept)  # the lane's watcher must still see this one
  tracer.close()
  assert [e[1] for e in tracer.events] == [0, 1]


@pytest.mark.soak  # long; the README run's time budget (the soak runs it)
def test_long_context_smoke_extrapolates_a_slice(tmp_path, capsys):
  """The smoke's slice row: the training run, the whole model's plan beside it, the
  extrapolation and the table."""
  import long_context
  from mtjax import config, plan
  assert long_context.main(["--smoke", "--out", str(tmp_path)]) == 0
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
  assert "| tiny | 128 | 1 of 3 |" in capsys.readouterr().out


def test_long_context_table_says_why_a_slice_has_no_whole_model_step():
  """A slice whose whole model the planner refused shows the refusal, not "(this row)", and
  `--ceiling` holds every row against one rate."""
  import long_context
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


def test_int8_adamw_smoke_times_each_state_dtype_and_compares_the_maps(tmp_path):
  import int8_adamw
  out = tmp_path / "int8_adamw.json"
  assert int8_adamw.main(["--smoke", "--out", str(out)]) == 0
  r = json.loads(out.read_text())
  assert set(r["host"]) == {"float32", "bfloat16", "int8"} and set(r["device_update"]) == {
      "float32", "int8"}
  assert all(h["gparams_median"] > 0 for h in r["host"].values())
  ours = [m for m in r["maps"] if m["map"] == "power (mtjax)" and m["block"] == 256]
  assert ours and all(0 < m["rel_rms"] < 0.2 for m in ours), ours


def test_moe_kernels_smoke_checks_each_implementation_against_float32(tmp_path):
  import moe_kernels
  assert moe_kernels.main(["--smoke", "--out", str(tmp_path)]) == 0
  rows = json.loads((tmp_path / "moe_kernels.json").read_text())
  assert {r["skew"] for r in rows} == {1, 8}
  for r in rows:
    assert r["dense"]["s"] > 0 and r["ragged"]["s"] > 0, r
    assert max(r["ragged error"].values()) < 1e-2, r  # bf16 operands against float32


@pytest.mark.soak  # long; the README run's time budget (the soak runs it)
def test_attention_kernels_smoke_checks_each_kernel_against_float32(tmp_path):
  """Every (variant, candidate) gets a row; the measured ones (sinks through the Triton kernel's
  lse, in Pallas's interpreter, and v padded for the latent widths included) match float32."""
  import attention_kernels
  out = tmp_path / "attention.json"
  assert attention_kernels.main(["--smoke", "--out", str(out)]) == 0
  rows = json.loads(out.read_text())
  assert [(r["variant"], r["impl"]) for r in rows] == [
      (v, i) for v in attention_kernels.SMOKE for i in ("xla", "blockwise", "pallas")]
  skipped = {(r["variant"], r["impl"]): r["skip"] for r in rows if "skip" in r}
  assert skipped == {("tiny-softcap", "pallas"): "jax's Triton kernel: causal and segment ids only"}
  for r in rows:  # fp32 on the CPU: the kernels sum in another order, nothing more
    if "skip" not in r:
      assert r["ok"] and r["fwd_ms"] > 0 and r["ms"] > 0 and r["rel_err"] < 1e-5, r
      assert set(r["errors"]) == {"out", "dq", "dk", "dv"} | ({"dsinks"} if "sinks" in r else set())
  # the pairs a query sees: causal, cut by documents and by the window, counted by hand
  seg = attention_kernels.documents(1, 6, 2, seed=1)
  cut = seg[0].tolist().index(2)
  assert attention_kernels.visible_pairs(1, 6, seg, None) == (
      cut * (cut + 1) // 2 + (6 - cut) * (7 - cut) // 2)
  assert attention_kernels.visible_pairs(2, 6, None, 2) == 2 * (1 + 2 * 5)
  assert attention_kernels.document_starts(np.array([[1, 1, 2, 2, 2, 3]])).tolist() == [
      [0, 0, 2, 2, 2, 5]]
  # latent widths: q.k over 192, p.v over 128 (forward); 3 x 192 + 2 x 128 in the backward
  mla = attention_kernels.case_of(1, 4, 2, 2, 192, {"hv": 128})
  assert attention_kernels.flops(mla) == (2 * 2 * 10 * (192 + 128), 2 * 2 * 10 * (3 * 192 + 256))


def test_attention_kernels_refuses_an_unknown_candidate_in_one_line(capsys):
  import attention_kernels
  assert attention_kernels.main(["--smoke", "--impls", "xla,flash"]) == exits.BAD_INPUT
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("attention_kernels: unknown candidate 'flash'"), err


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_deepspeed_baseline_smoke_builds_the_same_shape(tmp_path, family):
  """transformers' model built from the family's config.json has mtjax's parameter count (the
  smoke refuses otherwise), and the record says what a step took, a mixture's TFLOP/s from its
  active parameters."""
  import deepspeed_baseline
  from mtjax import config, plan
  cfg_path = TINY
  if family == "qwen3_moe":
    cfg_path = tmp_path / "moe.yaml"
    cfg_path.write_text(f"base: {ROOT / 'configs' / 'qwen3_moe_4l.yaml'}\n"
                        "model: {vocab_size: 256, hidden: 64, layers: 2, heads: 4, kv_heads: 2, "
                        "head_dim: 16, ffn: 96, moe: {experts: 4, experts_per_token: 2, "
                        "expert_ffn: 32}}\ntrain: {batch: 8, seq: 64}\n")
  out = tmp_path / "ds.json"
  assert deepspeed_baseline.main(["--smoke", "--config", str(cfg_path), "--out", str(out)]) == 0
  [rec] = json.loads(out.read_text())
  counts = plan.param_counts(config.load(cfg_path).model)
  assert rec["params"] == counts["total"] and rec["active_params"] == counts["active"]
  assert (counts["active"] < counts["total"]) == (family == "qwen3_moe")
  assert rec["model_tflops"] == pytest.approx(6 * counts["active"] * 8 * 64 / rec["step_s"] / 1e12)
  assert rec["tokens_per_s"] * rec["step_s"] == pytest.approx(8 * 64)
  assert math.isfinite(rec["loss"])


@pytest.mark.soak
def test_gpu_check_smoke_holds_the_engine_to_the_reference(capsys):
  import gpu_check
  assert gpu_check.main(["--smoke"]) == 0  # 1 if any placement is 1e-5 from the reference
  out = capsys.readouterr().out
  assert "tiers device=1 stream=2" in out and "attention blockwise" in out
  assert len(re.findall(r"host update \w+ \(\w+\): [0-9.]+ Gparam/s", out)) == 4


@pytest.mark.soak
def test_finetune_smoke_exports_what_transformers_reads_back(tmp_path):
  import finetune
  assert finetune.main([str(tmp_path), "--smoke"]) == 0
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert summary["logits_rel_err"] < 1e-5 and summary["argmax_agreement"] == 1.0
  assert summary["finetune"]["params"] == summary["hf_params"]
  phases = summary["finetune"]["phases"]  # the step's parts, from the run's metrics.jsonl
  timed = summary["finetune"]["steps"] - 1  # after the first
  assert 0 < phases["forward_s"] < phases["step_s"]
  assert len(phases["step_s_by_quarter"]) == min(4, timed)  # four parts, none left over


@pytest.mark.soak  # ten processes, one after another (prepare, train, report)
def test_recipes_smoke_runs_sft_dpo_and_accumulation(tmp_path, capsys):
  """ShareGPT SFT, exported, then DPO from the export on preference rows, then one batch in one
  and in four passes: each run's summary, report and DPO's reward metrics."""
  import recipes
  assert recipes.main([str(tmp_path), "--smoke"]) == 0
  rows = {r["run"]: r for r in json.loads((tmp_path / "summary.json").read_text())}
  assert list(rows) == ["sft_sharegpt", "dpo_preference", "sft_b32_accum1", "sft_b32_accum4"]
  assert rows["dpo_preference"]["first_loss"] == pytest.approx(math.log(2), rel=1e-4)
  assert "reward_accuracy" in rows["dpo_preference"] and "reward_accuracy" not in rows["sft_sharegpt"]
  # the same data, batch and weights: the accumulated step's first loss is the one-pass step's
  assert rows["sft_b32_accum4"]["first_loss"] == pytest.approx(rows["sft_b32_accum1"]["first_loss"],
                                                               rel=1e-5)
  for name in rows:
    assert (tmp_path / name / "report" / "loss.png").is_file(), name  # the report's curves
  assert (tmp_path / "dpo_preference" / "report" / "reward_accuracy.png").is_file()
  assert not (tmp_path / "sft_sharegpt" / "report" / "rewards.png").exists()
  assert "grad_accum 4 against 1" in capsys.readouterr().out


def test_h200_dry_run_names_existing_scripts_and_configs():
  """Every table's commands, printed: each script and config they name exists; an unknown table
  is refused."""
  tables = re.search(r'TABLES="([^"]+)"', (BENCH / "h200.sh").read_text()).group(1).split()
  r = subprocess.run(["bash", "benchmarks/h200.sh", "--dry-run", *tables], cwd=ROOT,
                     capture_output=True, text=True, timeout=60)
  assert r.returncode == 0, r.stderr
  commands = [line for line in r.stdout.splitlines() if line.startswith("+ ")]
  assert len(commands) >= len(tables)
  paths = set(re.findall(r"(?:benchmarks/\w+\.py|configs/[\w.]+\.yaml)", r.stdout))
  assert paths and all((ROOT / p).is_file() for p in paths), sorted(paths)
  bad = subprocess.run(["bash", "benchmarks/h200.sh", "--dry-run", "no-such-table"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
  assert bad.returncode == 2 and "unknown table no-such-table" in bad.stderr


@pytest.mark.soak  # two processes, jax's and torch's
def test_decode_smoke_times_both_systems(tmp_path):
  out = tmp_path / "decode.json"
  done = subprocess.run([sys.executable, str(BENCH / "decode.py"), "--smoke", "--out", str(out)],
                        capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-2000:]
  rows = json.loads(out.read_text())
  assert [(r["system"], r["batch"]) for r in rows] == [
      ("mtjax", 1), ("mtjax", 2), ("transformers", 1), ("transformers", 2)]
  assert all(r["decode_tokens_per_s"] != 0 for r in rows)


@pytest.mark.soak  # a corpus, a tokenizer, three training runs
def test_moments_quality_smoke_trains_each_state_dtype(tmp_path):
  done = subprocess.run([sys.executable, str(BENCH / "moments_quality.py"), "--smoke",
                         str(tmp_path)], capture_output=True, text=True, timeout=900)
  assert done.returncode == 0, done.stderr[-2000:]
  r = json.loads((tmp_path / "runs" / "moments_quality.json").read_text())
  assert set(r) == {"float32", "bfloat16", "int8"}
  assert all(len(v["train"]) == 6 and len(v["held_out"]) >= 2 for v in r.values())
  assert (tmp_path / "runs" / "moments_quality.png").stat().st_size > 0
  assert "| int8 |" in done.stdout


@pytest.mark.soak  # three engines on a tiny vision-language model
def test_vlm_smoke_times_each_freeze(tmp_path):
  out = tmp_path / "vlm.json"
  done = subprocess.run([sys.executable, str(BENCH / "vlm.py"), "--smoke", "--out", str(out)],
                        capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-2000:]
  rows = json.loads(out.read_text())
  assert [r["freeze"] for r in rows] == [[], ["vision"], ["vision", "projector"]]
  for r in rows:
    assert np.isfinite(r["loss"]) and r["step_s"] > 0 and r["plan_s"] > 0
    assert r["tokens_per_s"] * r["step_s"] == pytest.approx(2 * 64)  # the smoke's batch 2 x 64
  # a frozen part's optimizer state is left out of the plan's host bytes
  assert rows[0]["host_gib"] > rows[1]["host_gib"] > rows[2]["host_gib"]


@pytest.mark.soak  # a GRPO run of three steps
def test_grpo_smoke_splits_the_step_into_generation_and_training(tmp_path):
  out = tmp_path / "grpo.json"
  done = subprocess.run([sys.executable, str(BENCH / "grpo.py"), "--smoke", "--out", str(out)],
                        capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-2000:]
  row = json.loads(out.read_text())
  assert row["generation_s"] > 0 and row["train_step_s"] > 0 and row["train_plan_s"] > 0
  assert row["step_s"] == row["generation_s"] + row["train_step_s"]
  assert 1 <= row["completion_tokens_mean"] <= 12 and len(row["reward_mean"]) == 3
  assert "| generation |" in done.stdout
