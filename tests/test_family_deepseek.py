"""DeepSeek-V2 and DeepSeek-V3 (latent attention, group-limited routers, shared experts, YaRN with
mscale_all_dim) against transformers, through the parity harness (tests/parity.py)."""

import dataclasses
import json
import re

import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy

import mtjax
from mtjax import hf, models
from mtjax.config import ModelConfig
from mtjax.models import mla, moe
from numerics import REL_L2, assert_close, errors

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# After the skip: the parity harness imports torch and transformers.
import parity

YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64,
            mscale=0.707, mscale_all_dim=1.0, beta_fast=32, beta_slow=1)
# 8 experts top-2 in 4 groups (V3 keeps 2); rms_norm_eps off the latent norms' fixed 1e-6.
SHAPE = dict(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
             num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4,
             num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=4,
             topk_group=2, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12,
             max_position_embeddings=256, rope_parameters=YARN, rms_norm_eps=1e-5,
             initializer_range=0.2)
CONFIGS = {
    "deepseek_v3": lambda: transformers.DeepseekV3Config(
        **SHAPE, q_lora_rank=24, n_shared_experts=1, routed_scaling_factor=2.5,
        norm_topk_prob=True),
    # V2-Lite style (a full query projection). One group kept: groups scored by their best expert
    # hold the k best anyway while k <= topk_group. norm_topk_prob, which transformers' V2 router
    # ignores, set to show that mtjax ignores it as well.
    "deepseek_v2": lambda: transformers.DeepseekV2Config(
        **{**SHAPE, "topk_group": 1}, q_lora_rank=None, n_shared_experts=2,
        routed_scaling_factor=1.5, topk_method="group_limited_greedy", norm_topk_prob=True),
}
EXPERT = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """Each family's tiny checkpoint, built and saved once: name -> directory. The latents' weights
  are scaled down so that the latent norms' epsilon matters."""
  out = {}
  for name, config in CONFIGS.items():
    out[name] = tmp_path_factory.mktemp(name) / "src"
    m = parity.save_tiny(config(), out[name])
    with torch.no_grad():
      for layer in m.model.layers:
        a = layer.self_attn
        a.kv_a_proj_with_mqa.weight[:a.kv_lora_rank] *= 0.03
        if a.q_a_proj is not None:
          a.q_a_proj.weight *= 0.03
    m.save_pretrained(out[name])
  return out


@pytest.fixture
def torch_names(monkeypatch):
  """Every checkpoint-named dict mtjax.to_hf_names gives during a test (the gradients, then the
  stepped weights), recorded as they pass to the harness."""
  seen, original = [], mtjax.to_hf_names

  def to_hf_names(cfg, tree):
    seen.append(original(cfg, tree))
    return seen[-1]

  monkeypatch.setattr(mtjax, "to_hf_names", to_hf_names)
  return seen


def buffers(directory) -> dict:
  return {k: v for k, v in safetensors.numpy.load_file(directory / "model.safetensors").items()
          if k.endswith("e_score_correction_bias")}


@pytest.mark.parametrize("family", list(CONFIGS))
@parity.covers("deepseek_v2", "deepseek_v3")
def test_equals_transformers(saved, tmp_path, torch_names, family):
  src = saved[family]
  cfg, params, _ = parity.check_logits_and_gradients(src)
  assert cfg.family == family and cfg.moe.groups == 4 and cfg.moe.first_dense_layers == 1
  assert (cfg.mla.q_lora_rank is None) == (family == "deepseek_v2")
  bias = buffers(src)
  assert len(bias) == (2 if family == "deepseek_v3" else 0)
  for name in bias:  # chosen through top-k only: no gradient, exactly
    assert not np.any(torch_names[-1][name]), name
  parity.pieces_cover_every_parameter(cfg)
  parity.check_export(cfg, params, tmp_path / "out")
  if family == "deepseek_v3":  # the engine runs V2's layers through the same code
    # Adam's first step is lr * g / (|g| + eps): a gradient's fp32 rounding dg (about 1e-7 of its
    # tensor's largest, up to a few 1e-6 here) moves it by up to lr * dg / (4 eps). At eps = 1e-8
    # the elements with |g| near 1e-8, which tensors of this size hold, step by their rounding,
    # beyond the harness's 1e-3 lr; at 1e-2 (on both sides) the step is a smooth function of the
    # gradient.
    parity.check_adamw_step(src, eps=1e-2)
    for name, value in bias.items():  # AdamW (no decay on vectors) leaves it as imported
      np.testing.assert_array_equal(torch_names[-1][name], value)


@pytest.mark.parametrize("family", list(CONFIGS))
def test_router_equals_transformers(saved, family):
  """moe.route against transformers' router module on many tokens; V3's correction bias mostly
  below minus the scores, so that the choice among the kept groups is between negative values."""
  cfg = ModelConfig(**hf.model_fields(json.loads((saved[family] / "config.json").read_text())))
  v3 = family == "deepseek_v3"
  modeling = transformers.models.deepseek_v3.modeling_deepseek_v3 if v3 else \
      transformers.models.deepseek_v2.modeling_deepseek_v2
  gate = (modeling.DeepseekV3TopkRouter if v3 else modeling.DeepseekV2TopkRouter)(CONFIGS[family]())
  torch.manual_seed(1)
  with torch.no_grad():
    gate.weight.normal_(0.0, 0.2)
    if v3:
      gate.e_score_correction_bias.copy_(-0.8 + 0.3 * torch.randn(cfg.moe.experts))
    logits, weights, experts = gate(torch.randn(512, cfg.hidden))
  bias = jnp.asarray(gate.e_score_correction_bias.numpy()) if v3 else None
  got_w, got_e = moe.route(cfg, jnp.asarray(logits.numpy()), bias)
  mine, theirs = np.argsort(got_e, axis=-1), np.argsort(experts.numpy(), axis=-1)
  np.testing.assert_array_equal(np.take_along_axis(np.asarray(got_e), mine, -1),
                                np.take_along_axis(experts.numpy(), theirs, -1))
  assert_close(np.take_along_axis(np.asarray(got_w), mine, -1),
               np.take_along_axis(weights.numpy(), theirs, -1), name="router weights")


def chosen_experts(cfg, params, ids):
  """mtjax's (token, expert) choices of each MoE layer, from its own hidden states: the router
  logits each block computes (flax's captured intermediates), routed by moe.route."""
  spec = models.spec(cfg)
  x = spec.embed().apply({"params": params["embed"]}, jnp.asarray(ids))
  out = []
  for (_, kind), p in zip(spec.groups[1:-1], params["blocks"]):
    x, state = spec.block(kind, "xla").apply({"params": p}, x, capture_intermediates=True,
                                            mutable=["intermediates"])
    x = x[0]
    if spec.kinds[kind].moe:
      logits = state["intermediates"]["mlp"]["router"]["__call__"][0]
      _, idx = moe.route(cfg, logits.reshape(-1, cfg.moe.experts), p["mlp"].get("e_bias"))
      out.append(np.sort(np.asarray(idx), axis=-1))
  return out


@pytest.mark.soak  # long; the README run's time budget (the soak runs it)
@pytest.mark.parametrize("family", list(CONFIGS))
def test_chosen_experts_and_features(saved, monkeypatch, family):
  cfg, params = mtjax.load_hf(saved[family])
  m = transformers.AutoModelForCausalLM.from_pretrained(saved[family], attn_implementation="eager",
                                                        dtype=torch.float32)
  theirs = []
  for layer in m.model.layers[1:]:  # each router's chosen experts, [tokens, k]
    layer.mlp.gate.register_forward_hook(
        lambda mod, args, out: theirs.append(np.sort(out[2].numpy(), axis=-1)))
  ids = parity.token_ids(cfg.vocab_size)
  with torch.no_grad():
    m(torch.from_numpy(ids).long())
  ours = chosen_experts(cfg, params, ids)
  assert len(ours) == len(theirs) == 2
  for a, b in zip(ours, theirs):
    np.testing.assert_array_equal(a, b)

  # Each distinguishing feature moves the logits far beyond the parity bound.
  change_moe = lambda **kw: dict(moe=dataclasses.replace(cfg.moe, **kw))
  parity.feature_matters(cfg, params, **change_moe(groups=1, topk_groups=1))
  parity.feature_matters(cfg, params, **change_moe(shared_experts=0))
  parity.feature_matters(cfg, params, **change_moe(routed_scaling=1.0))
  parity.feature_matters(cfg, params, rope=dict(mscale_all_dim=0.0))  # the logits' mscale^2
  if family == "deepseek_v3":
    parity.feature_matters(cfg, params, **change_moe(score_correction_bias=False))
    parity.feature_matters(cfg, params, **change_moe(norm_topk_prob=False))
    parity.feature_matters(cfg, params, mla=dataclasses.replace(cfg.mla, rope_interleave=False))
  else:  # the V2 router's weights are not renormalised, whatever norm_topk_prob says
    parity.feature_matters(cfg, params, **change_moe(norm_topk_prob=True))
  # The latent norms' epsilon is transformers' RMSNorm default, not rms_norm_eps (1e-5 here).
  base = mtjax.forward(cfg, params, ids)
  monkeypatch.setattr(mla, "LATENT_NORM_EPS", 1e-5)
  assert errors(mtjax.forward(cfg, params, ids), base)[0] > 100 * REL_L2


def one_line(excinfo, *parts):
  msg = str(excinfo.value)
  assert "\n" not in msg, msg
  for p in parts:
    assert p in msg, msg


@pytest.mark.parametrize("family,edit,parts", [
    ("deepseek_v3", dict(num_key_value_heads=2), ["num_key_value_heads=2"]),
    ("deepseek_v3", dict(n_group=3), ["n_group=3", "8 experts"]),
    ("deepseek_v3", dict(n_group=8, topk_group=2), ["n_group=8", "at least 2"]),
    ("deepseek_v3", dict(topk_group=5), ["topk_group=5"]),
    ("deepseek_v3", dict(num_experts_per_tok=9), ["num_experts_per_tok=9"]),
    ("deepseek_v3", dict(attention_bias=True), ["attention_bias=True"]),
    ("deepseek_v3", dict(hidden_act="gelu"), ["hidden_act='gelu'"]),
    ("deepseek_v3", dict(qk_rope_head_dim=7), ["qk_rope_head_dim=7"]),
    ("deepseek_v3", dict(n_shared_experts=0), ["n_shared_experts=0"]),
    ("deepseek_v3", dict(rope_parameters={"rope_type": "linear", "factor": 2.0}), ["'linear'"]),
    ("deepseek_v2", dict(topk_method="noaux_tc"), ["topk_method='noaux_tc'"]),
    ("deepseek_v2", dict(num_experts_per_tok=None), ["num_experts_per_tok", "missing"]),
    ("deepseek_v2", dict(mlp_bias=True), ["mlp_bias=True"]),
    ("deepseek_v2", dict(kv_lora_rank=0), ["kv_lora_rank=0"]),
])
def test_unsupported_config_is_a_one_line_error(saved, family, edit, parts):
  config = {**json.loads((saved[family] / "config.json").read_text()), **edit}
  with pytest.raises(hf.HFError) as e:
    hf.model_fields(config, "x/config.json")
  one_line(e, "x/config.json", *parts)


def test_config_defaults_and_tensors(saved, tmp_path):
  # An older config.json (rope_scaling with `type`; keys left to transformers' defaults) reads the
  # same model; q_lora_rank absent is transformers' 1536, null a full query projection.
  d = saved["deepseek_v3"]
  config = json.loads((d / "config.json").read_text())
  fields = hf.model_fields(config)
  old = {k: v for k, v in config.items() if k not in ("rope_parameters", "rope_interleave",
                                                     "norm_topk_prob")}
  old["rope_scaling"] = {**{k: v for k, v in YARN.items() if k not in ("rope_type", "rope_theta")},
                         "type": "yarn"}
  old["rope_theta"] = 10000.0
  assert hf.model_fields(old) == fields
  del old["q_lora_rank"]
  assert hf.model_fields(old)["mla"].q_lora_rank == 1536

  # A tensor of the wrong shape, and the multi-token-prediction layer transformers skips.
  (tmp_path / "config.json").write_text(json.dumps(config))
  tensors = safetensors.numpy.load_file(d / "model.safetensors")
  tensors["model.layers.3.eh_proj.weight"] = np.zeros((4, 4), np.float32)
  name = "model.layers.1.self_attn.kv_a_proj_with_mqa.weight"
  good = tensors[name]
  tensors[name] = good[:-1]
  safetensors.numpy.save_file(tensors, tmp_path / "model.safetensors")
  ckpt = hf.Checkpoint(tmp_path)
  spec = models.spec(ModelConfig(**ckpt.model_fields()))
  with pytest.raises(hf.HFError) as e:
    ckpt.check(spec)
  one_line(e, name, "[23, 64]", "[24, 64]")
  tensors[name] = good
  safetensors.numpy.save_file(tensors, tmp_path / "model.safetensors")
  hf.Checkpoint(tmp_path).check(spec)


@pytest.mark.parametrize("nextn,tolerated", [(None, ["model.layers.3."]),
                                             (2, ["model.layers.3.", "model.layers.4."]),
                                             (0, [])])
def test_multi_token_prediction_layers_follow_the_depth(saved, tmp_path, nextn, tolerated):
  """V3's multi-token-prediction layers, which transformers does not load, are the
  num_nextn_predict_layers (default 1) after the num_hidden_layers decoder layers, whatever the
  depth (3 here, 61 in DeepSeek-V3); a layer beyond them is refused."""
  d = saved["deepseek_v3"]
  config = json.loads((d / "config.json").read_text())
  config.pop("num_nextn_predict_layers", None)
  if nextn is not None:
    config["num_nextn_predict_layers"] = nextn
  (tmp_path / "config.json").write_text(json.dumps(config))
  tensors = safetensors.numpy.load_file(d / "model.safetensors")
  for prefix in tolerated:
    tensors[prefix + "eh_proj.weight"] = np.zeros((4, 4), np.float32)
  safetensors.numpy.save_file(tensors, tmp_path / "model.safetensors")
  spec = models.spec(ModelConfig(**hf.Checkpoint(tmp_path).model_fields()))
  hf.Checkpoint(tmp_path).check(spec)
  beyond = f"model.layers.{3 + len(tolerated)}.eh_proj.weight"
  tensors[beyond] = np.zeros((4, 4), np.float32)
  safetensors.numpy.save_file(tensors, tmp_path / "model.safetensors")
  with pytest.raises(hf.HFError) as e:
    hf.Checkpoint(tmp_path).check(spec)
  one_line(e, beyond, "unexpected")
