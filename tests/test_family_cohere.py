"""Cohere's families (Command R, Command R7B) against transformers through the parity harness
(tests/parity.py): the parallel block from one bias-free LayerNorm, interleaved RoPE, logit_scale,
per-head q/k LayerNorms; Command R7B's sliding layers with RoPE and global NoPE layers.

The tiny configs take a logit_scale of 0.5 (Cohere's 0.0625 would leave logits too small for the
harness's scale check) and a window of 4 in 12 tokens.
"""

import dataclasses

import pytest

import mtjax
from mtjax.models import FamilyError, read_hf_config
from numerics import REL_L2, errors

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# After the skip: the parity harness imports torch and transformers.
import parity

SHAPE = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_attention_heads=4,
             num_key_value_heads=2, initializer_range=0.2, logit_scale=0.5,
             rope_parameters={"rope_type": "default", "rope_theta": 100.0})


@pytest.fixture(scope="module")
def cohere(tmp_path_factory):
  d = tmp_path_factory.mktemp("cohere") / "src"
  parity.save_tiny(transformers.CohereConfig(**SHAPE, num_hidden_layers=2, use_qk_norm=True,
                                             layer_norm_eps=1e-4), d)
  return d


@pytest.fixture(scope="module")
def cohere2(tmp_path_factory):
  d = tmp_path_factory.mktemp("cohere2") / "src"
  parity.save_tiny(transformers.Cohere2Config(
      **SHAPE, num_hidden_layers=2, sliding_window=4, pad_token_id=None,
      layer_types=["sliding_attention", "full_attention"]), d)
  return d


def _serial(cfg, params):
  """The config and parameters of the same model as a serial block (the MLP after attention's
  residual), its MLP norm a copy of the input norm."""
  blocks = [{**b, "mlp_norm": b["attn_norm"]} for b in params["blocks"]]
  return dataclasses.replace(cfg, parallel_block=False), {**params, "blocks": blocks}


def _moves(base, other_cfg, other_params):
  """The logits of another config and parameters move beyond 100 x the parity bound from `base`
  (parity.feature_matters for a change the parameters follow)."""
  ids = parity.token_ids(other_cfg.vocab_size)
  moved = errors(parity.forward(other_cfg, other_params, ids), base)[0]
  assert moved > 100 * REL_L2, moved


@parity.covers("cohere")
def test_cohere_equals_transformers(cohere, tmp_path):
  cfg, params, _ = parity.check_logits_and_gradients(cohere)
  assert (cfg.family, cfg.norm_kind, cfg.parallel_block, cfg.logit_scale) == (
      "cohere", "layer", True, 0.5)
  assert cfg.qk_norm and cfg.qk_norm_scope == "each_head" and cfg.rope.interleave
  assert cfg.tie_embeddings and cfg.norm_eps == 1e-4 and cfg.pad_token_id == 0
  assert params["blocks"][0]["attn"]["q_norm"]["scale"].shape == (4, 8)
  # (norm_kind's own check is Command R7B's: RMSNorm has no per-head weights.)
  base = parity.forward(cfg, params, parity.token_ids(cfg.vocab_size))
  for change in (dict(logit_scale=1.0), dict(rope=dict(interleave=False)), dict(qk_norm=False)):
    parity.feature_matters(cfg, params, base=base, **change)
  _moves(base, *_serial(cfg, params))
  parity.pieces_cover_every_parameter(cfg)
  parity.check_export(cfg, params, tmp_path / "out")  # the family's own config.json
  parity.check_adamw_step(cohere, eps=1e-4)


@parity.covers("cohere2")
def test_cohere2_equals_transformers(cohere2, tmp_path):
  cfg, params, _ = parity.check_logits_and_gradients(cohere2)
  assert (cfg.family, cfg.layer_types, cfg.sliding_window, cfg.nope_layers) == (
      "cohere2", ("sliding", "full"), 4, (1,))
  assert not cfg.qk_norm and cfg.parallel_block and cfg.rope.interleave
  base = parity.forward(cfg, params, parity.token_ids(cfg.vocab_size))
  for change in (dict(nope_layers=()), dict(layer_types=None), dict(norm_kind="rms")):
    parity.feature_matters(cfg, params, base=base, **change)
  _moves(base, *_serial(cfg, params))
  parity.pieces_cover_every_parameter(cfg)
  parity.check_export(cfg, params, tmp_path / "out")
  with pytest.raises(FamilyError, match=r"nope_layers=\[\] unsupported by Cohere2ForCausalLM"):
    parity.check_export(dataclasses.replace(cfg, nope_layers=()), params, tmp_path / "bad")
  parity.check_adamw_step(cohere2, eps=1e-4)


def _fields(config: dict) -> dict:
  return read_hf_config(config, "config.json")


def test_both_key_styles_and_omitted_keys_read_as_transformers_resolves_them():
  old = dict(architectures=["Cohere2ForCausalLM"], num_hidden_layers=8, hidden_size=64,
             num_attention_heads=4, intermediate_size=96, vocab_size=96, rope_theta=5e4,
             sliding_window_pattern=4, head_dim=8)  # Cohere2Config overrides head_dim
  new = transformers.Cohere2Config.from_dict(dict(old)).to_dict()
  assert "sliding_window_pattern" not in new and new["rope_parameters"]["rope_theta"] == 5e4
  new["architectures"] = old["architectures"]
  assert _fields(old) == _fields(new)
  fields = _fields(old)
  assert fields["layer_types"] == ("sliding", "sliding", "sliding", "full") * 2
  assert fields["nope_layers"] == (3, 7) and fields["head_dim"] is None
  assert (fields["sliding_window"], fields["logit_scale"], fields["tie_embeddings"]) == (
      4096, 0.0625, True)

  old1 = dict(architectures=["CohereForCausalLM"], num_hidden_layers=2, hidden_size=64,
              num_attention_heads=4, intermediate_size=96, vocab_size=96, rope_theta=8e3)
  new1 = transformers.CohereConfig.from_dict(dict(old1)).to_dict()
  new1["architectures"] = old1["architectures"]
  assert _fields(old1) == _fields(new1)
  assert _fields(old1)["rope"].theta == 8e3 and not _fields(old1).get("qk_norm")


@pytest.mark.parametrize("key,value,message", [
    ("hidden_act", "gelu", "hidden_act='gelu' unsupported"),
    ("partial_rotary_factor", 0.5, "partial_rotary_factor=0.5 unsupported"),
    ("attention_dropout", 0.1, "attention_dropout=0.1 unsupported"),
    ("logit_scale", 0, "logit_scale=0 must be a positive number"),
    ("sliding_window_pattern", 0, "sliding_window_pattern=0 unsupported"),
    ("layer_types", ["chunked_attention"] * 2, "layer_types=.* unsupported"),
])
def test_config_errors_name_the_file_and_key(key, value, message):
  config = dict(architectures=["Cohere2ForCausalLM"], num_hidden_layers=2, hidden_size=64,
                num_attention_heads=4, intermediate_size=96, vocab_size=96, **{key: value})
  with pytest.raises(FamilyError, match=f"^config.json: {message}") as e:
    _fields(config)
  assert "\n" not in str(e.value)
  assert mtjax.models.get("cohere2").notes
