"""Config: typed YAML with dotted overrides; every bad value is a one-line error naming its key."""

import subprocess
import sys
from pathlib import Path

import pytest

from mtjax import config

CONFIGS = Path(__file__).parent.parent / "configs"


def test_shipped_configs_load_and_bench_shape_is_3b():
  for f in CONFIGS.glob("*.yaml"):
    if f.name != "finetune.yaml":  # needs model.from_hf and data.path: tested in test_hf
      config.load(f)
  with pytest.raises(config.ConfigError, match="data.path: required"):
    config.load(CONFIGS / "finetune.yaml")
  m = config.load(CONFIGS / "llama_3b.yaml").model
  assert (m.vocab_size, m.hidden, m.layers, m.heads, m.ffn, m.tie_embeddings) == (
      32000, 3072, 28, 24, 8192, False)


def test_overrides_are_typed_and_applied_in_order():
  cfg = config.load(CONFIGS / "tiny.yaml", ["train.steps=3", "optim.lr=1e-3", "model.qk_norm=true",
                                            "optim.clip_norm=1", "train.steps=4"])
  assert cfg.train.steps == 4 and cfg.optim.lr == 1e-3 and cfg.model.qk_norm is True
  assert cfg.optim.clip_norm == 1.0 and isinstance(cfg.optim.clip_norm, float)


@pytest.mark.parametrize("overrides,key", [
    (["model.hiden=3"], "model.hiden"),
    (["foo.bar=1"], "foo"),
    (["train.steps=ten"], "train.steps"),
    (["train.steps=2.5"], "train.steps"),
    (["model.qk_norm=1"], "model.qk_norm"),
    (["engine.activations=disk"], "engine.activations"),
    (["engine.overlap=false"], "engine.overlap"),
    (["optim.name=adamax"], "optim.name"),
    (["engine.device_state_layers=-1"], "engine.device_state_layers"),
    (["engine.device_memory_gb=0"], "engine.device_memory_gb"),
    (["train.batch=0"], "train.batch"),
    (["model.kv_heads=3"], "model.kv_heads"),
    (["model.heads=5"], "model.heads"),
    (["engine.micro_batch=3"], "engine.micro_batch"),
    (["optim.b2=1.5"], "optim.b1/b2"),
    (["optim.clip_norm=-1"], "optim.clip_norm"),
    (["data.source=tokens"], "data.path"),
    (["train.seq"], "train.seq"),
])
def test_bad_values_name_the_key(overrides, key):
  with pytest.raises(config.ConfigError) as e:
    config.load(CONFIGS / "tiny.yaml", overrides)
  msg = str(e.value)
  assert key in msg and "\n" not in msg


@pytest.mark.parametrize("overrides,key", [
    (["model.head_dim=0"], "model.head_dim: 0 must be > 0"),
    (["model.head_dim=-2"], "model.head_dim: -2 must be > 0"),
    (["model.kv_heads=0"], "model.kv_heads: 0 must be > 0"),
    (["optim.decay_steps=-5"], "optim.decay_steps: -5 must be > 0"),
    (["optim.decay_steps=0"], "optim.decay_steps: 0 must be > 0"),
    (["train.eval_every=5"], "--val-fraction"),
])
def test_bad_values_that_once_trained_or_crashed_are_refused(overrides, key):
  with pytest.raises(config.ConfigError) as e:
    config.load(CONFIGS / "tiny.yaml", overrides)
  assert key in str(e.value) and "\n" not in str(e.value)


def test_float16_export_is_accepted():
  assert config.load(CONFIGS / "tiny.yaml", ["train.export_dtype=float16"]).train.export_dtype == (
      "float16")


@pytest.mark.parametrize("files", [
    {"a.yaml": "base: a.yaml\n"},
    {"a.yaml": "base: b.yaml\n", "b.yaml": "base: sub/c.yaml\n", "sub/c.yaml": "base: ../a.yaml\n"},
])
def test_a_base_chain_that_loops_is_one_line_error(tmp_path, files):
  for name, text in files.items():
    (tmp_path / name).parent.mkdir(exist_ok=True)
    (tmp_path / name).write_text(text)
  with pytest.raises(config.ConfigError) as e:
    config.load(tmp_path / "a.yaml")
  assert "loop" in str(e.value) and "a.yaml" in str(e.value) and "\n" not in str(e.value)
  r = subprocess.run([sys.executable, "-m", "mtjax.train", "--config", str(tmp_path / "a.yaml")],
                     capture_output=True, text=True)
  assert r.returncode == 2 and "Traceback" not in r.stderr and "loop" in r.stderr, r.stderr


def test_a_base_chain_merges_in_order(tmp_path):
  (tmp_path / "a.yaml").write_text("base: b.yaml\ntrain:\n  steps: 3\n")
  (tmp_path / "b.yaml").write_text("base: c.yaml\ntrain:\n  steps: 2\n  batch: 2\n")
  (tmp_path / "c.yaml").write_text("train:\n  steps: 1\n  batch: 1\n  seq: 4\n")
  t = config.load(tmp_path / "a.yaml").train
  assert (t.steps, t.batch, t.seq) == (3, 2, 4)


def test_missing_file_and_non_mapping(tmp_path):
  with pytest.raises(config.ConfigError, match="does not exist"):
    config.load(tmp_path / "nope.yaml")
  f = tmp_path / "list.yaml"
  f.write_text("- 1\n- 2\n")
  with pytest.raises(config.ConfigError, match="mapping"):
    config.load(f)


def test_configs_are_frozen():
  cfg = config.load(CONFIGS / "tiny.yaml")
  with pytest.raises(Exception):
    cfg.train.steps = 3


def test_cli_reports_config_errors_in_one_line():
  r = subprocess.run([sys.executable, "-m", "mtjax.train", "--config", str(CONFIGS / "tiny.yaml"),
                      "model.hidden=abc"], capture_output=True, text=True)
  assert r.returncode == 2
  assert r.stderr.strip().count("\n") == 0 and "model.hidden" in r.stderr
