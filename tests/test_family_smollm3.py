"""The SmolLM3 family against transformers through the parity harness (tests/parity.py): NoPE
layers among RoPE ones, MLP biases, a window on the NoPE layers."""

import json

import pytest

from mtjax import hf
from mtjax.config import ModelConfig
from mtjax.models import FamilyError, read_hf_config

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# After the skip: the parity harness imports torch and transformers.
import parity

SHAPE = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2,
             # SmolLM3's pad id (128004) lies beyond a tiny vocabulary.
             pad_token_id=None, bos_token_id=None, eos_token_id=None)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  d = tmp_path_factory.mktemp("smollm3")
  config = transformers.SmolLM3Config(
      **SHAPE, no_rope_layers=[1, 0, 1], mlp_bias=True,
      use_sliding_window=True, sliding_window=4,
      rope_parameters={"rope_type": "default", "rope_theta": 1e4})
  parity.save_tiny(config, d / "src")
  return d


@parity.covers("smollm3")
def test_smollm3_equals_transformers(saved):
  d = saved
  cfg, params, _ = parity.check_logits_and_gradients(d / "src")
  assert (cfg.family, cfg.nope_layers, cfg.tie_embeddings) == ("smollm3", (1,), True)
  assert cfg.layer_types == ("full", "sliding", "full") and cfg.sliding_window == 4
  assert cfg.mlp_bias
  parity.feature_matters(cfg, params, nope_layers=())  # RoPE in the NoPE layer too
  parity.feature_matters(cfg, params, nope_layers=(0, 1, 2))  # in none
  parity.feature_matters(cfg, params, layer_types=None)
  parity.pieces_cover_every_parameter(cfg)
  parity.check_export(cfg, params, d / "own")  # the family's config.json
  parity.check_export(cfg, params, d / "kept", source=d / "src")
  parity.check_adamw_step(d / "src")


def config_json(**change):
  config = {"architectures": ["SmolLM3ForCausalLM"], "model_type": "smollm3", **SHAPE,
            "num_hidden_layers": 8, **change}
  return {k: v for k, v in config.items() if v is not None}


@pytest.mark.parametrize("change", [
    dict(),  # no list: every 4th layer NoPE
    dict(no_rope_layer_interval=3),
    dict(no_rope_layers=[1, 1, 0, 0, 1, 1, 1, 0, 1]),  # longer than the layers, as allowed
    dict(use_sliding_window=True, sliding_window=6),  # the NoPE layers windowed
    dict(rope_theta=5e5),  # the older key
])
def test_config_keys_read_as_transformers_reads_them(change):
  config = config_json(**change)
  theirs = transformers.SmolLM3Config.from_dict(config)
  cfg = ModelConfig(**hf.model_fields(config))
  layers = theirs.num_hidden_layers
  assert [cfg.uses_rope(i) for i in range(layers)] == [
      bool(f) for f in theirs.no_rope_layers[:layers]]
  assert [cfg.layer_type(i) for i in range(layers)] == [
      "sliding" if t == "sliding_attention" else "full" for t in theirs.layer_types]
  assert cfg.rope.theta == theirs.rope_parameters["rope_theta"]
  assert cfg.tie_embeddings == theirs.tie_word_embeddings


def test_smollm3_config_errors_are_one_line(saved):
  good = json.loads((saved / "src" / "config.json").read_text())
  bad = {
      "no_rope_layers=\\[1, 0\\] unsupported": {"no_rope_layers": [1, 0]},
      "no_rope_layers=\\[1, 2, 1\\] unsupported": {"no_rope_layers": [1, 2, 1]},
      "layer_types=.* unsupported \\(sliding layers need use_sliding_window": {
          "use_sliding_window": False},
      "attention_bias=True unsupported": {"attention_bias": True},
      "partial_rotary_factor=0.5 unsupported": {"partial_rotary_factor": 0.5},
      "hidden_act='gelu' unsupported": {"hidden_act": "gelu"},
  }
  for message, change in bad.items():
    with pytest.raises(FamilyError, match=message) as e:
      read_hf_config({**good, **change}, "x/config.json")
    assert "\n" not in str(e.value) and str(e.value).startswith("x/config.json: ")
