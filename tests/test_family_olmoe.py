"""The OLMoE family against transformers through the parity harness (tests/parity.py): logits,
loss with the load-balancing loss at config.json's router_aux_loss_coef, every gradient, the
routing of every token, an export and one AdamW step; q/k norms over the whole projection,
norm_topk_prob."""

import dataclasses
import json

import pytest

from mtjax import hf
from mtjax.config import ModelConfig
from mtjax.models import FamilyError, read_hf_config

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# After the skip: the parity harness and moe_checks import torch and transformers.
import moe_checks
import parity

COEF = 0.2  # router_aux_loss_coef: large enough that a wrong load balance moves the gradients
SHAPE = dict(vocab_size=96, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2, num_experts=4,
             num_experts_per_tok=2, router_aux_loss_coef=COEF,
             # OLMoE's pad id makes torch zero one embedding row's gradient (padding_idx).
             pad_token_id=None, eos_token_id=None)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  d = tmp_path_factory.mktemp("olmoe") / "src"
  # OLMoE-1B-7B's unnormalised top-k; the renormalised one is Qwen3-MoE's and Mixtral's path.
  parity.save_tiny(transformers.OlmoeConfig(**SHAPE, norm_topk_prob=False), d)
  return d


@parity.covers("olmoe")
def test_olmoe_equals_transformers(saved, tmp_path):
  d = saved
  cfg, params, want = parity.check_logits_and_gradients(d, aux_coef=COEF)
  assert (cfg.family, cfg.qk_norm, cfg.qk_norm_scope, cfg.norm_position) == (
      "olmoe", True, "all", "pre")
  assert not cfg.moe.norm_topk_prob and cfg.moe.expert_ffn == 16
  assert all(cfg.is_moe_layer(i) for i in range(cfg.layers))
  moe_checks.check_aux_loss(cfg, params, want, COEF)
  moe_checks.check_routing(d, cfg, params)
  parity.feature_matters(cfg, params, moe=dataclasses.replace(cfg.moe, norm_topk_prob=True))
  parity.feature_matters(cfg, params, qk_norm=False)
  parity.pieces_cover_every_parameter(cfg)
  parity.check_export(cfg, params, tmp_path / "own")
  parity.check_export(cfg, params, tmp_path / "kept", source=d)
  stats = parity.check_adamw_step(d, aux_coef=COEF)
  assert {"aux_loss", "expert_tokens_min", "expert_tokens_max"} <= stats.aux.keys()


def config_json(**change):
  config = {"architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", **SHAPE, **change}
  return {k: v for k, v in config.items() if v is not None}


@pytest.mark.parametrize("change", [
    dict(num_experts=None, num_local_experts=6),  # the attribute_map's spelling
    dict(num_local_experts=6),  # both: num_local_experts wins
    dict(router_aux_loss_coef=None, norm_topk_prob=None, num_experts_per_tok=3),
    dict(rope_theta=5e5),  # the older key
])
def test_config_keys_read_as_transformers_reads_them(change):
  config = config_json(**change)
  theirs = transformers.OlmoeConfig.from_dict(config)
  m = ModelConfig(**hf.model_fields(config)).moe
  assert (m.experts, m.experts_per_token, m.norm_topk_prob, m.aux_loss_coef) == (
      theirs.num_experts, theirs.num_experts_per_tok, theirs.norm_topk_prob,
      theirs.router_aux_loss_coef)


def test_olmoe_config_errors_are_one_line(saved):
  good = json.loads((saved / "config.json").read_text())
  bad = {
      "clip_qkv=8.0 unsupported": {"clip_qkv": 8.0},
      "attention_bias=True unsupported": {"attention_bias": True},
      "head_dim=16 unsupported": {"head_dim": 16},
      "num_experts_per_tok=5 must be an integer <= num_experts=4": {"num_experts_per_tok": 5},
      "hidden_act='gelu' unsupported": {"hidden_act": "gelu"},
  }
  for message, change in bad.items():
    with pytest.raises(FamilyError, match=message) as e:
      read_hf_config({**good, **change}, "x/config.json")
    assert "\n" not in str(e.value) and str(e.value).startswith("x/config.json: ")
