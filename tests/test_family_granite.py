"""The Granite family against transformers through the parity harness (tests/parity.py): the
embedding, residual and attention multipliers and the logits' divisor (through the engine's chunked
loss too), attention and MLP biases."""

import json

import pytest

from mtjax import hf
from mtjax.config import ModelConfig
from mtjax.models import FamilyError, read_hf_config

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# After the skip: the parity harness imports torch and transformers.
import parity

SHAPE = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2,
             pad_token_id=None, bos_token_id=None, eos_token_id=None)
# Each far from 1 (and the attention's from 1 / sqrt(8)), so each moves the logits.
MULTIPLIERS = dict(embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.6,
                   logits_scaling=4.0)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  d = tmp_path_factory.mktemp("granite")
  config = transformers.GraniteConfig(**SHAPE, **MULTIPLIERS, attention_bias=True, mlp_bias=True,
                                      rope_parameters={"rope_type": "default", "rope_theta": 1e4})
  parity.save_tiny(config, d / "src")
  return d


@parity.covers("granite")
def test_granite_equals_transformers(saved):
  d = saved
  cfg, params, _ = parity.check_logits_and_gradients(d / "src")
  assert cfg.family == "granite"
  assert (cfg.embed_multiplier, cfg.residual_multiplier, cfg.query_scale, cfg.logits_divisor) == (
      3.0, 0.5, 0.6, 4.0)
  assert cfg.qkv_bias and cfg.o_bias and cfg.mlp_bias
  for change in (dict(embed_multiplier=1.0), dict(residual_multiplier=1.0),
                 dict(query_scale=None), dict(logits_divisor=1.0)):
    parity.feature_matters(cfg, params, **change)
  parity.pieces_cover_every_parameter(cfg)
  parity.check_export(cfg, params, d / "own")  # the family's config.json
  parity.check_export(cfg, params, d / "kept", source=d / "src")
  # The engine's embedding backward (its scale) and the head's loss chunks (7 tokens each).
  parity.check_adamw_step(d / "src", **{"engine.loss_chunk": 7})


def config_json(**change):
  config = {"architectures": ["GraniteForCausalLM"], "model_type": "granite", **SHAPE, **change}
  return {k: v for k, v in config.items() if v is not None}


@pytest.mark.parametrize("change", [
    dict(),  # every multiplier at GraniteConfig's default 1
    dict(MULTIPLIERS, rope_theta=5e5, rope_scaling={"rope_type": "linear", "factor": 2.0}),
    dict(attention_multiplier=8 ** -0.5),  # the standard scale: no query_scale of its own
])
def test_config_keys_read_as_transformers_reads_them(change):
  config = config_json(**change)
  theirs = transformers.GraniteConfig.from_dict(config)
  cfg = ModelConfig(**hf.model_fields(config))
  assert (cfg.embed_multiplier, cfg.residual_multiplier, cfg.logits_divisor) == (
      theirs.embedding_multiplier, theirs.residual_multiplier, theirs.logits_scaling)
  scale = cfg.dim_per_head ** -0.5 if cfg.query_scale is None else cfg.query_scale
  assert scale == theirs.attention_multiplier
  assert cfg.rope.theta == theirs.rope_parameters["rope_theta"]
  assert cfg.rope.scaling == {"default": "none"}.get(theirs.rope_parameters["rope_type"],
                                                     theirs.rope_parameters["rope_type"])


def test_granite_config_errors_are_one_line(saved):
  good = json.loads((saved / "src" / "config.json").read_text())
  bad = {
      "logits_scaling=0 must be a positive number": {"logits_scaling": 0},
      "residual_multiplier=-1.0 must be a positive number": {"residual_multiplier": -1.0},
      "partial_rotary_factor=0.5 unsupported": {"partial_rotary_factor": 0.5},
      "hidden_act='gelu' unsupported": {"hidden_act": "gelu"},
  }
  for message, change in bad.items():
    with pytest.raises(FamilyError, match=message) as e:
      read_hf_config({**good, **change}, "x/config.json")
    assert "\n" not in str(e.value) and str(e.value).startswith("x/config.json: ")
