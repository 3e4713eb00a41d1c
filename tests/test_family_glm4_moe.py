"""The GLM-4.5 MoE family against transformers through the parity harness (tests/parity.py):
partial RoPE, q/k/v biases and per-head q/k norms, a dense first layer, DeepSeek-V3's sigmoid
router (group-limited, score correction bias, routed_scaling_factor) with a shared expert, every
token's routing; the multi-token-prediction layers skipped on import."""

import dataclasses
import json

import numpy as np
import pytest
import safetensors.numpy

from mtjax import hf, models
from mtjax.config import ModelConfig
from mtjax.models import FamilyError, read_hf_config

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# After the skip: the parity harness and moe_checks import torch and transformers.
import moe_checks
import parity

# 8 experts top-2 in 2 groups, 1 kept; layer 0 dense, layer 1 a mixture.
SHAPE = dict(vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             initializer_range=0.2, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
             topk_group=1, n_shared_experts=1, routed_scaling_factor=2.5, first_k_dense_replace=1,
             norm_topk_prob=True, use_qk_norm=True, attention_bias=True)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  d = tmp_path_factory.mktemp("glm4_moe") / "src"
  config = transformers.Glm4MoeConfig(**SHAPE, rope_parameters={
      "rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5})
  parity.save_tiny(config, d)
  return d


@parity.covers("glm4_moe")
def test_glm4_moe_equals_transformers(saved, tmp_path):
  d = saved
  cfg, params, _ = parity.check_logits_and_gradients(d)
  m = cfg.moe
  assert (cfg.family, cfg.qkv_bias, cfg.o_bias, cfg.qk_norm, cfg.qk_norm_scope) == (
      "glm4_moe", True, False, True, "head")
  assert (cfg.rope.partial, cfg.rotary_dim, cfg.rope.interleave) == (0.5, 8, False)
  assert (m.router, m.groups, m.topk_groups, m.routed_scaling, m.shared_width) == (
      "sigmoid", 2, 1, 2.5, 16)
  assert [cfg.is_moe_layer(i) for i in range(cfg.layers)] == [False, True]
  assert m.aux_loss_coef == 0.0
  moe_checks.check_routing(d, cfg, params)
  change_moe = lambda **kw: dict(moe=dataclasses.replace(m, **kw))
  for change in (change_moe(groups=1, topk_groups=1), change_moe(shared_experts=0),
                 change_moe(routed_scaling=1.0), change_moe(score_correction_bias=False),
                 dict(rope=dict(partial=1.0)),
                 dict(qk_norm=False)):
    parity.feature_matters(cfg, params, **change)
  parity.pieces_cover_every_parameter(cfg)
  parity.check_export(cfg, params, tmp_path / "own")  # the family's config.json
  parity.check_adamw_step(d)


def config_json(**change):
  config = {"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", **SHAPE, **change}
  return {k: v for k, v in config.items() if v is not None}


@pytest.mark.parametrize("change", [
    dict(),
    dict(n_routed_experts=None, num_local_experts=6, n_group=None, topk_group=None),
    dict(rope_theta=5e5, partial_rotary_factor=0.25, use_qk_norm=None, first_k_dense_replace=None),
])
def test_config_keys_read_as_transformers_reads_them(change):
  config = config_json(**change)
  theirs = transformers.Glm4MoeConfig.from_dict(config)
  cfg = ModelConfig(**hf.model_fields(config))
  m = cfg.moe
  assert (m.experts, m.experts_per_token, m.groups, m.topk_groups, m.first_dense_layers) == (
      theirs.n_routed_experts, theirs.num_experts_per_tok, theirs.n_group, theirs.topk_group,
      theirs.first_k_dense_replace)
  assert cfg.rope.partial == theirs.rope_parameters.get("partial_rotary_factor", 1.0)
  assert cfg.rope.theta == theirs.rope_parameters["rope_theta"]
  assert cfg.qk_norm == theirs.use_qk_norm


def test_glm4_moe_config_errors_are_one_line(saved):
  good = json.loads((saved / "config.json").read_text())
  bad = {
      "n_group=3 unsupported": {"n_group": 3},
      "n_group=8 unsupported": {"n_group": 8, "topk_group": 1},
      "topk_group=3 unsupported": {"topk_group": 3},
      "num_experts_per_tok=5 unsupported": {"num_experts_per_tok": 5},
      "n_shared_experts=0 must be an integer >= 1": {"n_shared_experts": 0},
      "hidden_act='gelu' unsupported": {"hidden_act": "gelu"},
  }
  for message, change in bad.items():
    with pytest.raises(FamilyError, match=message) as e:
      read_hf_config({**good, **change}, "x/config.json")
    assert "\n" not in str(e.value) and str(e.value).startswith("x/config.json: ")


def test_multi_token_prediction_layers_are_skipped(saved, tmp_path):
  """The num_nextn_predict_layers layers after the decoder layers, which transformers does not
  load, are tolerated; a layer beyond them is refused."""
  config = json.loads((saved / "config.json").read_text())
  (tmp_path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 2}))
  tensors = safetensors.numpy.load_file(saved / "model.safetensors")
  for i in (2, 3):
    tensors[f"model.layers.{i}.eh_proj.weight"] = np.zeros((4, 4), np.float32)
  safetensors.numpy.save_file(tensors, tmp_path / "model.safetensors")
  spec = models.spec(ModelConfig(**hf.Checkpoint(tmp_path).model_fields()))
  hf.Checkpoint(tmp_path).check(spec)
  tensors["model.layers.4.eh_proj.weight"] = np.zeros((4, 4), np.float32)
  safetensors.numpy.save_file(tensors, tmp_path / "model.safetensors")
  with pytest.raises(hf.HFError, match="model.layers.4.eh_proj.weight") as e:
    hf.Checkpoint(tmp_path).check(spec)
  assert "\n" not in str(e.value)
