"""The Qwen2-MoE and Qwen3-MoE families against transformers through the parity harness
(tests/parity.py): logits, loss with the load-balancing loss at config.json's
router_aux_loss_coef, every gradient, the routing of every token, an export and one AdamW step;
dense layers among the mixtures, the shared expert and its gate, norm_topk_prob, windows."""

import dataclasses
import shutil

import pytest
import safetensors.numpy

import mtjax
from mtjax import hf
from mtjax.config import ModelConfig

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# After the skip: the parity harness and moe_checks import torch and transformers.
import moe_checks
import parity

COEF = 0.2  # router_aux_loss_coef: large enough that a wrong load balance moves the gradients
SHAPE = dict(vocab_size=96, hidden_size=32, intermediate_size=40, moe_intermediate_size=16,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             initializer_range=0.2, num_experts=4, num_experts_per_tok=2,
             router_aux_loss_coef=COEF)
CONFIGS = {
    # layer 0 dense and sliding, layer 1 a mixture with a gated shared expert, unnormalised top-k
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
        **SHAPE, shared_expert_intermediate_size=24, mlp_only_layers=[0], use_sliding_window=True,
        sliding_window=5, max_window_layers=2),
    # two mixtures (one load balance over both), renormalised top-k, biases, a window everywhere
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **SHAPE, norm_topk_prob=True, attention_bias=True, use_sliding_window=True,
        sliding_window=5),
}


@pytest.fixture(scope="module", params=list(CONFIGS))
def saved(request, tmp_path_factory):
  d = tmp_path_factory.mktemp(request.param) / "src"
  parity.save_tiny(CONFIGS[request.param](), d)
  return request.param, d


# Each feature turned off moves the logits: the parity above has tested it. (The attention's biases
# and q/k norms are the dense Qwen families'; their gradients are checked above.)
FEATURES = {
    "qwen2_moe": lambda cfg: [
        dict(moe=dataclasses.replace(cfg.moe, shared_experts=0, shared_ffn=None,
                                     shared_gate=False)),
        dict(moe=dataclasses.replace(cfg.moe, shared_gate=False)),
        dict(moe=dataclasses.replace(cfg.moe, norm_topk_prob=True)), dict(layer_types=None)],
    "qwen3_moe": lambda cfg: [
        dict(moe=dataclasses.replace(cfg.moe, norm_topk_prob=False)), dict(layer_types=None)],
}


@parity.covers("qwen2_moe", "qwen3_moe")
def test_qwen_moe_equals_transformers(saved, tmp_path):
  family, d = saved
  cfg, params, want = parity.check_logits_and_gradients(d, aux_coef=COEF)
  assert cfg.family == family
  assert [cfg.is_moe_layer(i) for i in range(cfg.layers)] == (
      [False, True] if family == "qwen2_moe" else [True, True])
  assert cfg.layer_types == (("sliding", "full") if family == "qwen2_moe" else ("sliding",) * 2)
  moe_checks.check_aux_loss(cfg, params, want, COEF)
  moe_checks.check_routing(d, cfg, params)
  for change in FEATURES[family](cfg):
    parity.feature_matters(cfg, params, **change)
  parity.pieces_cover_every_parameter(cfg)
  parity.check_export(cfg, params, tmp_path / "out")


@pytest.mark.soak  # long; the README run's time budget (the soak runs it)
def test_qwen_moe_adamw_step_equals_torch(saved):
  stats = parity.check_adamw_step(saved[1], aux_coef=COEF)
  assert {"aux_loss", "expert_tokens_min", "expert_tokens_max"} <= stats.aux.keys()


ARCH = {"qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


def config_json(family, **change):
  config = {"architectures": [ARCH[family]], **SHAPE, **change}
  return {k: v for k, v in config.items() if v is not None}


@pytest.mark.parametrize("family,change", [
    # older files: no layer_types, transformers derives them from max_window_layers
    ("qwen2_moe", dict(num_hidden_layers=5, use_sliding_window=True, max_window_layers=3)),
    ("qwen2_moe", dict(num_hidden_layers=5, use_sliding_window=True)),
    ("qwen2_moe", dict(num_hidden_layers=5, use_sliding_window=False, max_window_layers=3)),
    ("qwen2_moe", dict(num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3])),
    ("qwen2_moe", dict(num_experts=None, qkv_bias=None, router_aux_loss_coef=None)),
    ("qwen3_moe", dict(num_experts=None, num_local_experts=6)),  # what transformers 5 writes
    ("qwen3_moe", dict(num_local_experts=6)),  # both: num_local_experts wins
    ("qwen3_moe", dict(num_experts=None, use_sliding_window=True, norm_topk_prob=None)),
])
def test_config_keys_read_as_transformers_reads_them(family, change):
  config = config_json(family, **change)
  theirs = transformers.AutoConfig.for_model(family, **config)
  f = hf.model_fields(config)
  layers = theirs.num_hidden_layers
  moe_layers = [i not in theirs.mlp_only_layers and (i + 1) % theirs.decoder_sparse_step == 0
                for i in range(layers)]
  m = f["moe"]
  assert (m.experts, m.norm_topk_prob, m.aux_loss_coef) == (
      theirs.num_experts, theirs.norm_topk_prob, theirs.router_aux_loss_coef)
  cfg = ModelConfig(**f)
  assert [cfg.is_moe_layer(i) for i in range(layers)] == moe_layers
  if family == "qwen2_moe":
    assert cfg.qkv_bias == theirs.qkv_bias
    types = theirs.layer_types
  else:
    types = (["sliding_attention" if theirs.sliding_window else "full_attention"] * layers)
  want = tuple("sliding" if t == "sliding_attention" else "full" for t in types)
  assert tuple(cfg.layer_type(i) for i in range(layers)) == want
  if "sliding" in want:
    assert cfg.sliding_window == theirs.sliding_window


@pytest.mark.parametrize("family,change,match", [
    ("qwen2_moe", dict(shared_expert_intermediate_size=0),
     "shared_expert_intermediate_size=0 must be a positive number"),
    ("qwen2_moe", dict(mlp_only_layers=[2]), r"mlp_only_layers=\[2\] layer indices below 2"),
    ("qwen2_moe", dict(decoder_sparse_step=0), "decoder_sparse_step=0 must be a positive number"),
    ("qwen2_moe", dict(layer_types=["sliding_attention", "full_attention"]),
     "layer_types=.* unsupported \\(sliding layers need use_sliding_window true\\)"),
    ("qwen2_moe", dict(num_experts_per_tok=5), "num_experts_per_tok=5 must be an integer <= "
     "num_experts=4"),
    ("qwen3_moe", dict(num_experts=None, num_local_experts=1),
     "num_experts_per_tok=2 must be an integer <= num_local_experts=1"),
    ("qwen3_moe", dict(moe_intermediate_size=-3), "moe_intermediate_size=-3 must be a positive"),
    ("qwen3_moe", dict(hidden_act="gelu"), "hidden_act='gelu' unsupported"),
])
def test_bad_config_is_a_one_line_error(family, change, match):
  with pytest.raises(hf.HFError, match=match) as e:
    hf.model_fields(config_json(family, **change))
  assert "\n" not in str(e.value) and "config.json" in str(e.value)


def test_misshapen_expert_or_shared_expert_is_a_one_line_error(saved, tmp_path):
  family, d = saved
  tensors = safetensors.numpy.load_file(d / "model.safetensors")
  names = {"model.layers.1.mlp.experts.2.gate_proj.weight": "shape [16, 31], expected [16, 32]"}
  if family == "qwen2_moe":
    names["model.layers.1.mlp.shared_expert_gate.weight"] = "shape [1, 31], expected [1, 32]"
  for i, (name, message) in enumerate(names.items()):
    bad = tmp_path / str(i)
    shutil.copytree(d, bad)
    safetensors.numpy.save_file({**tensors, name: tensors[name][:, :-1].copy()},
                                bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(hf.HFError) as e:
      mtjax.load_hf(bad)
    assert name in str(e.value) and message in str(e.value) and "\n" not in str(e.value)
