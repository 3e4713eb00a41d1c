"""The Gemma family (Gemma 2, Gemma 3 text) against transformers, through the parity harness
(tests/parity.py); Gemma 3's vision-language model has tests/test_family_gemma3_vl.py.

The tiny configs set what Gemma's defaults make useless at this size: head_dim 256 and a window
of 4096 tokens. Soft-caps of 2-5, a window of 4 in 12 tokens, a query_pre_attn_scalar apart from
head_dim and RoPE bases far apart make each feature move the logits (`feature_matters`).
pad_token_id is unset: transformers' embedding gives its row no gradient from lookups
(torch's padding_idx), which mtjax's embedding does not model.
"""

import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

import mtjax
from mtjax import hf, models

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# After the skip: the parity harness imports torch and transformers.
import parity

SHAPE = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=4,
             initializer_range=0.2, pad_token_id=None)
GEMMA3 = dict(SHAPE, num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"],
              rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0,
                                                  "rope_theta": 10000.0},
                               "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}},
              final_logit_softcapping=3.0,
              attn_logit_softcapping=2.0)  # transformers' Gemma 3 does not apply it
# Adam's first step is lr * g / (|g| + eps): for |g| near eps it moves with g's rounding, and
# GELU's derivative crosses zero (x = -0.75), so a gate gradient can land within rounding of the
# default 1e-8 (one does here). An eps of 1e-4 keeps every step a smooth function of its gradient.
ADAM = {"optim.eps": 1e-4}


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
  d = tmp_path_factory.mktemp("gemma2") / "src"
  # No layer_types: transformers' default alternation, sliding first.
  parity.save_tiny(transformers.Gemma2Config(**SHAPE, num_hidden_layers=2,
                                             attn_logit_softcapping=3.0,
                                             final_logit_softcapping=4.0), d)
  return d


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
  d = tmp_path_factory.mktemp("gemma3") / "src"
  parity.save_tiny(transformers.Gemma3TextConfig(**GEMMA3), d)
  return d


@parity.covers("gemma2")
def test_gemma2_equals_transformers(gemma2, tmp_path):
  cfg, params, _ = parity.check_logits_and_gradients(gemma2)
  assert cfg.family == "gemma2" and cfg.layer_types == ("sliding", "full")
  assert (cfg.attn_softcap, cfg.final_softcap, cfg.query_scale) == (3.0, 4.0, 24 ** -0.5)
  for change in (dict(attn_softcap=None), dict(final_softcap=None), dict(layer_types=None),
                 dict(query_scale=None), dict(embed_scale=False), dict(norm_offset=False),
                 dict(norm_position="pre"), dict(mlp_act="silu")):
    parity.feature_matters(cfg, params, **change)
  # In bf16 the embedding is scaled by sqrt(hidden) rounded to bf16, as transformers does: bit for
  # bit (a scale kept in fp32 rounds 1 element in 32 differently here).
  m = transformers.AutoModelForCausalLM.from_pretrained(gemma2, dtype=torch.bfloat16)
  ids = parity.token_ids(cfg.vocab_size)
  want = m.model.embed_tokens(torch.from_numpy(ids).long()).detach().float().numpy()
  embed = models.spec(cfg).embed(jnp.bfloat16).apply({"params": params["embed"]}, ids)
  np.testing.assert_array_equal(np.asarray(embed.astype(jnp.float32)), want)
  parity.pieces_cover_every_parameter(cfg)
  parity.check_export(cfg, params, tmp_path / "out")  # the family's own config.json
  parity.check_adamw_step(gemma2, **ADAM)


@parity.covers("gemma3")
def test_gemma3_equals_transformers(gemma3, tmp_path):
  cfg, params, _ = parity.check_logits_and_gradients(gemma3)
  assert cfg.family == "gemma3" and cfg.qk_norm and cfg.attn_softcap is None
  assert (cfg.rope.theta, cfg.rope.scaling, cfg.rope.factor, cfg.rope.local_theta) == (
      10000.0, "linear", 4.0, 100.0)
  for change in (dict(qk_norm=False), dict(rope=dict(local_theta=None)),
                 dict(rope=dict(scaling="none")),
                 dict(final_softcap=None), dict(layer_types=None), dict(query_scale=None)):
    parity.feature_matters(cfg, params, **change)
  parity.pieces_cover_every_parameter(cfg)
  parity.check_export(cfg, params, tmp_path / "out")
  parity.check_adamw_step(gemma3, **ADAM)


def _fields(config: dict) -> dict:
  return models.read_hf_config(config, "config.json")


def test_both_key_styles_and_omitted_keys_read_as_transformers_resolves_them():
  old3 = dict(architectures=["Gemma3ForCausalLM"], num_hidden_layers=7, rope_theta=5e5,
              rope_local_base_freq=2e4, rope_scaling={"rope_type": "linear", "factor": 8.0},
              sliding_window_pattern=3)
  new3 = transformers.Gemma3TextConfig.from_dict(dict(old3)).to_dict()
  assert "rope_scaling" not in new3 and "sliding_attention" in new3["rope_parameters"]
  new3["architectures"] = old3["architectures"]
  assert _fields(old3) == _fields(new3)
  fields = _fields(old3)
  rope = fields["rope"]
  assert (rope.theta, rope.local_theta, rope.factor) == (5e5, 2e4, 8.0)
  assert fields["layer_types"] == ("sliding", "sliding", "full") * 2 + ("sliding",)
  assert (fields["head_dim"], fields["kv_heads"], fields["vocab_size"]) == (256, 4, 262208)

  old2 = dict(architectures=["Gemma2ForCausalLM"], num_hidden_layers=3, rope_theta=2e4,
              hidden_act="gelu_pytorch_tanh")
  new2 = transformers.Gemma2Config.from_dict(dict(old2)).to_dict()
  new2["architectures"] = old2["architectures"]
  assert _fields(old2) == _fields(new2)
  assert (_fields(old2)["attn_softcap"], _fields(old2)["final_softcap"]) == (50.0, 30.0)

  # A published vision-language config (Gemma 3 4B's) names a few text keys; the rest are
  # Gemma3TextConfig's, and the tower's the rest SiglipVisionConfig's.
  vl = dict(architectures=["Gemma3ForConditionalGeneration"],
            text_config=dict(hidden_size=2560, intermediate_size=10240, num_hidden_layers=34,
                             rope_scaling={"factor": 8.0, "rope_type": "linear"},
                             sliding_window=1024, final_logit_softcapping=30.0),
            vision_config=dict(hidden_size=1152, image_size=896, intermediate_size=4304,
                               model_type="siglip_vision_model", num_attention_heads=16,
                               num_hidden_layers=27, patch_size=14, vision_use_head=False))
  full = transformers.Gemma3Config.from_dict(json.loads(json.dumps(vl)))
  text = full.text_config.to_dict()
  text["architectures"] = ["Gemma3ForCausalLM"]
  fields = _fields(vl)
  v = fields.pop("vision")
  assert fields == {**_fields(text), "family": "gemma3_vl", "final_softcap": None}
  assert fields["query_scale"] is None and fields["sliding_window"] == 1024
  tower = full.vision_config
  assert (v.hidden, v.layers, v.heads, v.ffn, v.image_size, v.patch, v.norm_eps) == (
      tower.hidden_size, tower.num_hidden_layers, tower.num_attention_heads,
      tower.intermediate_size, tower.image_size, tower.patch_size, tower.layer_norm_eps)
  assert (v.act, v.image_tokens, v.image_token_id, v.image_attention) == (
      "gelu_tanh", full.mm_tokens_per_image, full.image_token_index, "bidirectional")


@pytest.mark.parametrize("key,value,message", [
    ("attention_bias", True, "attention_bias=True unsupported"),
    ("use_bidirectional_attention", True, "use_bidirectional_attention=True unsupported"),
    ("hidden_activation", "silu", "hidden_activation='silu' unsupported"),
    ("partial_rotary_factor", 0.5, "partial_rotary_factor=0.5 unsupported"),
    ("layer_types", ["sliding_attention"], "layer_types=.* unsupported"),
    ("sliding_window", None, "sliding_window=None unsupported"),
    ("query_pre_attn_scalar", 0, "query_pre_attn_scalar=0 must be a positive number"),
    ("num_attention_heads", None, "required key 'num_attention_heads' missing"),
    ("rope_parameters", {"sliding_attention": {"rope_type": "linear", "factor": 2.0}},
     r"rope_parameters=.* unsupported \(sliding_attention must be an unscaled default RoPE"),
])
def test_config_errors_name_the_file_and_key(key, value, message):
  config = dict(architectures=["Gemma3ForCausalLM"], num_hidden_layers=2, **{key: value})
  with pytest.raises(models.FamilyError, match=f"^config.json: {message}") as e:
    _fields(config)
  assert "\n" not in str(e.value)


def test_a_misshapen_tensor_is_a_one_line_error(gemma2, tmp_path):
  bad = tmp_path / "bad"
  shutil.copytree(gemma2, bad)
  config = json.loads((bad / "config.json").read_text())
  config["intermediate_size"] = 40
  (bad / "config.json").write_text(json.dumps(config))
  with pytest.raises(hf.HFError, match=r"mlp.down_proj.weight has shape \[32, 48\], expected "
                                       r"\[32, 40\]$"):
    mtjax.load_hf(bad)
  shutil.rmtree(bad)
  # Only a vision-language checkpoint's SigLIP pooling head (which Gemma 3 never runs) is unread.
  assert models.get("gemma3_vl").ignored({}, "vision_tower.head.mlp.fc1.weight")
  assert not models.get("gemma3_vl").ignored({}, "vision_tower.encoder.layers.0.mlp.fc1.weight")
  assert not models.get("gemma2").ignored({}, "vision_tower.head.mlp.fc1.weight")
