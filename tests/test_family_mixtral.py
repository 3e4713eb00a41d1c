"""The Mixtral family against transformers through the parity harness (tests/parity.py): logits,
loss with the load-balancing loss at config.json's router_aux_loss_coef, every gradient, the
routing of every token, an export and one AdamW step."""

import dataclasses
import shutil

import pytest
import safetensors.numpy

import mtjax
from mtjax import hf

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# After the skip: the parity harness and moe_checks import torch and transformers.
import moe_checks
import parity

COEF = 0.2  # router_aux_loss_coef: large enough that a wrong load balance moves the gradients
SHAPE = dict(vocab_size=96, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2,
             num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=COEF)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  d = tmp_path_factory.mktemp("mixtral") / "src"
  parity.save_tiny(transformers.MixtralConfig(**SHAPE, sliding_window=5), d)
  return d


@parity.covers("mixtral")
def test_mixtral_equals_transformers(saved, tmp_path):
  cfg, params, want = parity.check_logits_and_gradients(saved, aux_coef=COEF)
  assert cfg.family == "mixtral"
  assert cfg.moe.norm_topk_prob and cfg.layer_types == ("sliding",) * 2
  moe_checks.check_aux_loss(cfg, params, want, COEF)
  moe_checks.check_routing(saved, cfg, params)
  parity.feature_matters(cfg, params, layer_types=None)  # the window changes the logits
  parity.feature_matters(cfg, params, moe=dataclasses.replace(cfg.moe, norm_topk_prob=False))
  parity.pieces_cover_every_parameter(cfg)
  parity.check_export(cfg, params, tmp_path / "out")


def test_mixtral_adamw_step_equals_torch(saved):
  stats = parity.check_adamw_step(saved, aux_coef=COEF)
  assert {"aux_loss", "expert_tokens_min", "expert_tokens_max"} <= stats.aux.keys()


def config_json(**change):
  config = {"architectures": ["MixtralForCausalLM"], **SHAPE, "rms_norm_eps": 1e-5, **change}
  return {k: v for k, v in config.items() if v is not None}


def fields(**change):
  return hf.model_fields(config_json(**change))


@pytest.mark.parametrize("change", [
    {}, dict(num_local_experts=None, num_experts=6),  # the alias
    dict(num_experts=6),  # both: the alias wins
    dict(num_local_experts=None, router_aux_loss_coef=None, rope_theta=None)])  # the defaults
def test_config_keys_read_as_transformers_reads_them(change):
  theirs = transformers.MixtralConfig.from_dict(config_json(**change))
  f = fields(**change)
  assert f["moe"].experts == theirs.num_local_experts
  assert f["moe"].aux_loss_coef == theirs.router_aux_loss_coef
  assert f["rope"].theta == theirs.rope_parameters["rope_theta"]
  assert "layer_types" not in f and theirs.sliding_window is None


@pytest.mark.parametrize("change,match", [
    (dict(num_experts_per_tok=5),
     "num_experts_per_tok=5 must be an integer <= num_local_experts=4"),
    (dict(num_local_experts=0), "num_local_experts=0 must be a positive number"),
    (dict(router_jitter_noise=0.1), "router_jitter_noise=0.1 unsupported"),
    (dict(router_aux_loss_coef=-1), "router_aux_loss_coef=-1 must be a number >= 0"),
    (dict(hidden_act="gelu"), "hidden_act='gelu' unsupported"),
    (dict(hidden_size=None), "required key 'hidden_size' missing"),
])
def test_bad_config_is_a_one_line_error(change, match):
  with pytest.raises(hf.HFError, match=match) as e:
    fields(**change)
  assert "\n" not in str(e.value) and "config.json" in str(e.value)


def test_misshapen_or_missing_expert_is_a_one_line_error(saved, tmp_path):
  tensors = safetensors.numpy.load_file(saved / "model.safetensors")
  name = "model.layers.1.block_sparse_moe.experts.3.w2.weight"
  for case, change in (("misshapen", lambda t: t.update({name: t[name][:, :-1].copy()})),
                       ("missing", lambda t: t.pop(name))):
    d = tmp_path / case
    shutil.copytree(saved, d)
    t = dict(tensors)
    change(t)
    safetensors.numpy.save_file(t, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(hf.HFError) as e:
      mtjax.load_hf(d)
    message = "shape [32, 23], expected [32, 24]" if case == "misshapen" else "missing"
    assert name in str(e.value) and message in str(e.value) and "\n" not in str(e.value)
