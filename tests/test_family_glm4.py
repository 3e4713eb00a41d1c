"""The GLM-4 family against transformers through the parity harness (tests/parity.py): norms
before and after each sub-layer, q/k/v biases, the fused gate_up_proj, partial RoPE on
interleaved pairs."""

import dataclasses
import json
import shutil

import pytest
import safetensors.numpy

import mtjax
from mtjax import hf
from mtjax.config import ModelConfig
from mtjax.models import FamilyError, read_hf_config
from numerics import REL_L2, errors

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# After the skip: the parity harness imports torch and transformers.
import parity

SHAPE = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, initializer_range=0.2,
             rms_norm_eps=1e-6, pad_token_id=None, eos_token_id=None)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  d = tmp_path_factory.mktemp("glm4")
  config = transformers.Glm4Config(**SHAPE, rope_parameters={
      "rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5})
  parity.save_tiny(config, d / "src")
  return d


@parity.covers("glm4")
def test_glm4_equals_transformers(saved):
  d = saved
  cfg, params, _ = parity.check_logits_and_gradients(d / "src")
  assert (cfg.family, cfg.norm_position, cfg.qkv_bias, cfg.o_bias) == (
      "glm4", "sandwich", True, False)
  assert (cfg.rope.partial, cfg.rotary_dim, cfg.rope.interleave) == (0.5, 8, True)
  parity.feature_matters(cfg, params, rope=dict(interleave=False))
  parity.feature_matters(cfg, params, rope=dict(partial=1.0))
  # The norms after the sub-layers dropped (their scales unused).
  pre = [{k: v for k, v in b.items() if not k.startswith("post_")} for b in params["blocks"]]
  ids = parity.token_ids(cfg.vocab_size)
  moved = errors(parity.forward(dataclasses.replace(cfg, norm_position="pre"),
                                {**params, "blocks": pre}, ids), parity.forward(cfg, params, ids))[0]
  assert moved > 100 * REL_L2, moved
  parity.pieces_cover_every_parameter(cfg)
  parity.check_export(cfg, params, d / "own")  # the family's config.json
  parity.check_export(cfg, params, d / "kept", source=d / "src")
  parity.check_adamw_step(d / "src")


def config_json(**change):
  config = {"architectures": ["Glm4ForCausalLM"], "model_type": "glm4", **SHAPE, **change}
  return {k: v for k, v in config.items() if v is not None}


@pytest.mark.parametrize("change", [
    dict(),  # no RoPE keys: Glm4Config's 0.5 rotated
    dict(rope_theta=5e5, partial_rotary_factor=0.25),  # the older keys
    dict(rope_parameters={"rope_type": "default", "rope_theta": 2e4, "partial_rotary_factor": 1.0}),
    dict(head_dim=None, attention_bias=None),  # Glm4Config's 128-wide heads and biases
])
def test_config_keys_read_as_transformers_reads_them(change):
  config = config_json(**change)
  theirs = transformers.Glm4Config.from_dict(config)
  cfg = ModelConfig(**hf.model_fields(config))
  assert cfg.rope.partial == theirs.rope_parameters.get("partial_rotary_factor", 1.0)
  assert cfg.rope.theta == theirs.rope_parameters["rope_theta"]
  assert (cfg.dim_per_head, cfg.qkv_bias) == (theirs.head_dim, theirs.attention_bias)


def test_glm4_config_errors_are_one_line(saved, tmp_path):
  good = json.loads((saved / "src" / "config.json").read_text())
  bad = {
      "hidden_act='gelu' unsupported": {"hidden_act": "gelu"},
      "rope_type 'dynamic' unsupported": {"rope_parameters": {"rope_type": "dynamic", "factor": 2}},
      "required key 'intermediate_size' missing": {"intermediate_size": None},
  }
  for message, change in bad.items():
    with pytest.raises(FamilyError, match=message) as e:
      read_hf_config({**good, **change}, "x/config.json")
    assert "\n" not in str(e.value) and str(e.value).startswith("x/config.json: ")
  # The fused tensor of the wrong shape, named before any read.
  shutil.copytree(saved / "src", tmp_path / "m")
  name = "model.layers.1.mlp.gate_up_proj.weight"
  tensors = safetensors.numpy.load_file(tmp_path / "m" / "model.safetensors")
  safetensors.numpy.save_file({**tensors, name: tensors[name][:-2].copy()},
                              tmp_path / "m" / "model.safetensors", metadata={"format": "pt"})
  with pytest.raises(hf.HFError, match=rf"{name} has shape \[94, 32\], expected \[96, 32\]") as e:
    mtjax.load_hf(tmp_path / "m")
  assert "\n" not in str(e.value)
