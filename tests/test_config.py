"""Config: typed YAML with dotted overrides; every bad value is a one-line error naming its key."""

import dataclasses
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
    (["train.freeze=[vision]"], "train.freeze"),  # a text-only model has no tower
    (["train.freeze=[language]"], "train.freeze"),  # nothing left to train
    (["train.freeze=[vision,projector,language]", "model.vision.layers=1"], "train.freeze"),
    (["train.freeze=[tower]"], "train.freeze"),
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
  with pytest.raises(dataclasses.FrozenInstanceError):
    cfg.train.steps = 3


def test_cli_reports_config_errors_in_one_line():
  r = subprocess.run([sys.executable, "-m", "mtjax.train", "--config", str(CONFIGS / "tiny.yaml"),
                      "model.hidden=abc"], capture_output=True, text=True)
  assert r.returncode == 2
  assert r.stderr.strip().count("\n") == 0 and "model.hidden" in r.stderr


def test_rope_is_a_section_of_its_own():
  cfg = config.load(CONFIGS / "llama3.2_1b.yaml", ["model.rope.theta=1e4"])
  rope = cfg.model.rope
  assert isinstance(rope, config.RopeConfig)
  assert (rope.theta, rope.scaling, rope.factor, rope.original_max_len) == (
      1e4, "llama3", 32.0, 8192)
  assert config.to_dict(cfg)["model"]["rope"]["theta"] == 1e4
  for over, key in ((["model.rope.partial=1.5"], "model.rope.partial: 1.5 must be in (0, 1]"),
                    (["model.rope.theta=0"], "model.rope.theta: 0.0 must be > 0"),
                    (["model.rope.scaling=ntk"], "model.rope.scaling"),
                    (["model.rope.thetaa=1"], "model.rope.thetaa: unknown key"),
                    (["model.head_dim=6", "model.rope.partial=0.5"], "rope.partial 0.5 = 3")):
    with pytest.raises(config.ConfigError) as e:
      config.load(CONFIGS / "tiny.yaml", over)
    assert key in str(e.value) and "\n" not in str(e.value), (over, str(e.value))


# A model section as configs, run folders and checkpoints spelled RoPE before it was a section.
FLAT_MODEL = {"vocab_size": 64, "hidden": 32, "layers": 1, "heads": 4, "ffn": 48,
              "rope_theta": 500000.0, "rope_scaling": "llama3", "rope_factor": 8.0,
              "rope_low_freq_factor": 1.0, "rope_high_freq_factor": 4.0,
              "rope_original_max_len": 64, "rope_short_factor": [], "rope_long_factor": [],
              "rope_beta_fast": 32.0, "rope_beta_slow": 1.0, "rope_mscale": 1.0,
              "rope_mscale_all_dim": 0.0, "rope_attention_factor": None, "rope_truncate": True,
              "rope_partial": 1.0, "rope_local_theta": None}


def test_a_flat_rope_spelling_upgrades_to_the_section_and_round_trips():
  up = config.upgrade_model_section(FLAT_MODEL)
  assert not any(k.startswith("rope_") for k in up)
  assert up["rope"]["theta"] == 500000.0 and up["rope"]["scaling"] == "llama3"
  assert config.upgrade_model_section(up) == up  # already in today's spelling: unchanged
  cfg = config.from_dict({"model": FLAT_MODEL})
  assert cfg.model.rope == config.RopeConfig(theta=500000.0, scaling="llama3", factor=8.0,
                                             original_max_len=64)
  again = config.to_dict(cfg)
  assert config.from_dict(again) == cfg and again["model"]["rope"]["factor"] == 8.0
  # A YAML (or a command line) in the flat spelling reads the same; both spellings at odds are
  # one line naming the key to keep.
  assert config.load(CONFIGS / "tiny.yaml", ["model.rope_theta=5e5"]).model.rope.theta == 5e5
  with pytest.raises(config.ConfigError) as e:
    config.load(CONFIGS / "llama3.2_1b.yaml", ["model.rope_theta=1e4"])
  assert "keep model.rope.theta" in str(e.value) and "\n" not in str(e.value)
  same = config.load(CONFIGS / "llama3.2_1b.yaml", ["model.rope_theta=500000.0"])
  assert same.model.rope.theta == 5e5  # the same value both ways agrees


def test_a_checkpoint_with_the_flat_rope_spelling_resumes_and_exports(tmp_path):
  """A checkpoint whose stored config spells RoPE flat (meta.json "config") exports through
  `python -m mtjax.export`, is told apart from a model of another RoPE base, and resumes."""
  import json
  from mtjax import checkpoint, train
  ck = tmp_path / "ck"
  base = ["train.batch=2", "train.seq=8", "train.tensorboard=false", f"train.checkpoint_dir={ck}",
          "model.rope.theta=20000", "optim.decay_steps=4"]
  train.run(config.load(CONFIGS / "tiny.yaml", [*base, "train.steps=2"]), progress=False)
  meta_path = ck / "step_2" / "meta.json"
  meta = json.loads(meta_path.read_text())
  model = meta["extra"]["config"]["model"]
  model.update({f"rope_{k}": v for k, v in model.pop("rope").items()})
  del model["max_position"]  # a field the flat spelling's configs did not have
  meta_path.write_text(json.dumps(meta))
  r = subprocess.run([sys.executable, "-m", "mtjax.export", "--checkpoint", str(ck / "step_2"),
                      "--out", str(tmp_path / "out"), "--dtype", "float32"],
                     capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr
  assert json.loads((tmp_path / "out" / "config.json").read_text())["rope_theta"] == 20000.0
  with pytest.raises(checkpoint.CheckpointMismatch, match=r"model\.rope\.theta: 20000.0 in the"):
    train.run(config.load(CONFIGS / "tiny.yaml", [*base, "train.steps=3", "model.rope.theta=1e4"]),
              progress=False)
  s = train.run(config.load(CONFIGS / "tiny.yaml", [*base, "train.steps=3"]), progress=False)
  assert s["resumed_from"].endswith("step_2") and s["steps"] == 1
