"""Llama 4's text decoder against transformers through the parity harness (tests/parity.py):
chunked local attention in RoPE layers (chunks of 4 in 12 tokens), weightless q/k norms, global
NoPE layers with attention temperature tuning (floor_scale 2, so the temperature moves within the
sequence), a sigmoid router scaling the experts' inputs, fused experts, a shared expert, and dense
and MoE layers interleaved (layer kinds: chunked dense, NoPE MoE).
"""

import numpy as np
import pytest

import mtjax
from mtjax.models import FamilyError, moe, read_hf_config
from numerics import assert_close

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# After the skip: the parity harness imports torch and transformers.
import parity

CONFIG = dict(vocab_size=96, hidden_size=32, intermediate_size=24, intermediate_size_mlp=48,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
              num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2,
              no_rope_layer_interval=2, attention_chunk_size=4, floor_scale=2, attn_scale=0.5,
              initializer_range=0.2, pad_token_id=None,
              rope_parameters={"rope_type": "default", "rope_theta": 100.0})


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  d = tmp_path_factory.mktemp("llama4") / "src"
  config = transformers.Llama4TextConfig(**CONFIG)
  config.architectures = ["Llama4ForCausalLM"]
  parity.save_tiny(config, d)
  return d


def check_routing(directory, cfg, params):
  """mtjax routes the inputs of transformers' routers (every token of every MoE layer) to the
  same experts with the same scores."""
  model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32,
                                                            attn_implementation="eager")
  calls = []
  hooks = [layer.feed_forward.router.register_forward_hook(
      lambda mod, args, out, i=i: calls.append((i, args[0], out)))
      for i, layer in enumerate(model.model.layers) if layer.is_moe_layer]
  with torch.no_grad():
    model(torch.from_numpy(parity.token_ids(cfg.vocab_size)).long())
  for h in hooks:
    h.remove()
  assert [i for i, _, _ in calls] == [i for i in range(cfg.layers) if cfg.is_moe_layer(i)]
  for i, x, (scores, logits) in calls:
    got_logits = x.numpy() @ np.asarray(params["blocks"][i]["mlp"]["router"]["kernel"])
    assert_close(got_logits, logits.numpy(), name=f"layer {i} router logits")
    got_w, got_e = moe.route(cfg, got_logits)
    scores = scores.numpy()
    want_e = np.argsort(-scores, axis=-1)[:, :cfg.moe.experts_per_token]
    assert np.array_equal(np.sort(np.asarray(got_e), -1), np.sort(want_e, -1)), i
    assert_close(np.asarray(got_w), np.take_along_axis(scores, np.asarray(got_e), -1),
                 name=f"layer {i} routing scores")


@parity.covers("llama4")
def test_llama4_equals_transformers(saved, tmp_path):
  cfg, params, _ = parity.check_logits_and_gradients(saved)
  assert cfg.layer_types == ("chunked", "full") and cfg.attention_chunk == 4
  assert cfg.nope_layers == (1,) and cfg.qk_l2_norm and cfg.rope.interleave
  assert (cfg.temperature_floor, cfg.temperature_scale, cfg.moe.every) == (2, 0.5, 2)
  assert [cfg.is_moe_layer(i) for i in range(2)] == [False, True]
  assert (cfg.ffn, cfg.moe.expert_ffn, cfg.moe.shared_width, cfg.moe.router) == (48, 24, 24,
                                                                                "sigmoid")
  check_routing(saved, cfg, params)
  base = parity.forward(cfg, params, parity.token_ids(cfg.vocab_size))
  # (rope.interleave's own check is Command R's.)
  for change in (dict(layer_types=None), dict(nope_layers=()), dict(temperature_floor=None),
                 dict(qk_l2_norm=False), dict(moe=dict(weight_inputs=False)),
                 dict(moe=dict(shared_experts=0, shared_ffn=None))):
    parity.feature_matters(cfg, params, base=base, **change)
  parity.pieces_cover_every_parameter(cfg)
  parity.check_export(cfg, params, tmp_path / "out")  # the family's own config.json
  parity.check_adamw_step(saved, eps=1e-4)


def _fields(config: dict) -> dict:
  return read_hf_config({**config, "architectures": ["Llama4ForCausalLM"]}, "config.json")


def test_both_key_styles_and_omitted_keys_read_as_transformers_resolves_them():
  old = dict(vocab_size=96, hidden_size=64, num_hidden_layers=8, num_attention_heads=8,
             rope_theta=5e5, interleave_moe_layer_step=2,
             rope_scaling={"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
  new = transformers.Llama4TextConfig.from_dict(dict(old)).to_dict()
  assert new["moe_layers"] == [1, 3, 5, 7] and new["no_rope_layers"] == [1, 1, 1, 0] * 2
  assert _fields(old) == _fields(new)
  f = _fields(old)
  assert f["nope_layers"] == (3, 7) and f["layer_types"] == ("chunked",) * 3 + ("full",) + (
      "chunked",) * 3 + ("full",)
  assert (f["attention_chunk"], f["temperature_floor"], f["head_dim"], f["kv_heads"]) == (
      8192, 8192, 128, 8)
  assert (f["moe"].every, f["moe"].dense_layers, f["moe"].experts) == (2, (), 16)
  assert f["rope"].scaling == "llama3" and f["rope"].interleave
  # No chunk size: every layer attends to the whole context; no NoPE layer: no temperature.
  f = _fields(dict(old, attention_chunk_size=None, no_rope_layers=[1] * 8))
  assert f.get("layer_types") is None and f["nope_layers"] == () and "temperature_floor" not in f


@pytest.mark.parametrize("key,value,message", [
    ("hidden_act", "gelu", "hidden_act='gelu' unsupported"),
    ("no_rope_layers", [1, 2], r"no_rope_layers=\[1, 2\] unsupported"),
    ("moe_layers", [5], r"moe_layers=\[5\] unsupported"),
    ("layer_types", ["sliding_attention"] * 2, "layer_types=.* unsupported"),
    ("attention_dropout", 0.1, "attention_dropout=0.1 unsupported"),
    ("floor_scale", 2.5, "floor_scale=2.5 unsupported"),
])
def test_config_errors_name_the_file_and_key(key, value, message):
  config = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_attention_heads=8,
                no_rope_layer_interval=2, **{key: value})
  with pytest.raises(FamilyError, match=f"^config.json: {message}") as e:
    _fields(config)
  assert "\n" not in str(e.value)
  assert mtjax.models.get("llama4").notes
