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
