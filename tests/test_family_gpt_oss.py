"""The GPT-OSS family against transformers, through the parity harness (tests/parity.py): attention
sinks, q/k/v/o biases, alternating sliding/full layers, YaRN (truncate false), the top-k softmax
router with a bias, clamped-SwiGLU experts with biases, and MXFP4 expert weights."""

import json

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy

import mtjax
from mtjax import hf, models
from mtjax.config import ModelConfig
from mtjax.models import FamilyError, gpt_oss, moe

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# After the skip: the parity harness imports torch and transformers.
import parity

AUX = 0.5  # router_aux_loss_coef: large enough that a wrong load-balancing loss shows in the loss
CONFIG = dict(
    vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
    num_experts_per_tok=2, sliding_window=4,
    layer_types=["sliding_attention", "full_attention"] * 2,
    # original_max_position_embeddings 32: the ramp's upper edge (1.09 channels) is fractional, so
    # truncate (false here) changes a frequency.
    rope_parameters=dict(rope_type="yarn", factor=4.0, beta_fast=32.0, beta_slow=1.0,
                         truncate=False, original_max_position_embeddings=32, rope_theta=150000.0),
    max_position_embeddings=128, initializer_range=0.2, router_aux_loss_coef=AUX,
    swiglu_limit=1.5)  # a limit the tiny model's gate and up values reach


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  d = tmp_path_factory.mktemp("gpt_oss") / "src"
  parity.save_tiny(transformers.GptOssConfig(**CONFIG), d)
  return d


def one_line(excinfo, *parts):
  msg = str(excinfo.value)
  assert "\n" not in msg, msg
  for p in parts:
    assert p in msg, msg


def router_logits_mtjax(cfg, params, ids) -> list[np.ndarray]:
  """Every MoE layer's router logits in mtjax's forward, in layer order."""
  out = []

  def keep(next_fun, args, kwargs, context):
    y = next_fun(*args, **kwargs)
    if context.method_name == "__call__" and context.module.name == "router":
      out.append(np.asarray(y))
    return y

  with nn.intercept_methods(keep):
    mtjax.forward(cfg, params, ids)
  return out


def router_choices_transformers(directory, ids) -> tuple[list, list]:
  """Every layer's (router logits, chosen experts) in transformers' forward, by forward hooks."""
  m = transformers.AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager",
                                                        dtype=torch.float32)
  seen = []
  hooks = [layer.mlp.router.register_forward_hook(lambda mod, args, out: seen.append(out))
           for layer in m.model.layers]
  with torch.no_grad():
    m(torch.from_numpy(ids).long())
  for h in hooks:
    h.remove()
  return [o[0].numpy() for o in seen], [o[2].numpy() for o in seen]


@parity.covers("gpt_oss")
def test_parity_routing_features_and_export(saved, tmp_path):
  cfg, params, want = parity.check_logits_and_gradients(saved, aux_coef=AUX)
  assert cfg.family == "gpt_oss" and cfg.layer_types == ("sliding", "full") * 2
  assert (cfg.sliding_window, cfg.rope.scaling, cfg.rope.truncate) == (4, "yarn", False)
  assert cfg.attention_sinks and cfg.qkv_bias and cfg.o_bias and cfg.mlp_bias
  assert (cfg.moe.router, cfg.moe.router_bias, cfg.moe.aux_loss_coef) == ("topk_softmax", True, AUX)
  assert AUX * want.aux > 0.3  # the load-balancing loss is a real part of the compared loss

  ids = parity.token_ids(cfg.vocab_size)
  logits_t, chosen_t = router_choices_transformers(saved, ids)
  logits_m = router_logits_mtjax(cfg, params, ids)
  assert len(logits_m) == len(chosen_t) == cfg.layers
  for i, (lm, lt, ct) in enumerate(zip(logits_m, logits_t, chosen_t)):
    parity.assert_close(lm, lt, name=f"layer {i} router logits")
    chosen = np.asarray(moe.route(cfg, jnp.asarray(lm))[1])
    np.testing.assert_array_equal(chosen, ct, err_msg=f"layer {i} experts")
    assert len(np.unique(ct)) == cfg.moe.experts  # every expert is chosen by some token

  parity.feature_matters(cfg, params, attention_sinks=False)
  parity.feature_matters(cfg, params, swiglu_limit=7.0)  # the clamp binds at 1.5
  parity.feature_matters(cfg, params, layer_types=None)  # the window of the sliding layers
  parity.feature_matters(cfg, params, rope=dict(scaling="none"))  # YaRN's frequencies and factor
  parity.feature_matters(cfg, params, rope=dict(truncate=True))
  parity.pieces_cover_every_parameter(cfg)
  parity.check_export(cfg, params, tmp_path / "out")  # with the family's config.json


@pytest.mark.soak  # long; the README run's time budget (the soak runs it)
def test_adamw_step_equals_torch(saved):
  # Adam's first step is lr * g / (|g| + eps): with eps 1e-8 a coordinate whose gradient is 1e-7 of
  # the tensor's (the clamp and the routing leave some) turns its fp32 rounding into 1e-2 of lr.
  # eps 1e-4 bounds that amplification at 1e4; the gradients are held to fp32 by the test above.
  stats = parity.check_adamw_step(saved, aux_coef=AUX, **{"optim.eps": 1e-4})
  assert stats.aux["aux_loss"] > 0.3


# ------------------------------------------------------------------------------------ config


def test_older_keys_and_omitted_defaults_read_as_transformers_reads_them(saved):
  new = json.loads((saved / "config.json").read_text())
  old = {k: v for k, v in new.items() if k not in ("rope_parameters", "swiglu_alpha")}
  rope = {k: v for k, v in new["rope_parameters"].items() if k != "rope_theta"}
  old.update(rope_scaling=rope, rope_theta=new["rope_parameters"]["rope_theta"])
  assert hf.model_fields(old) == hf.model_fields(new)
  theirs = [transformers.GptOssConfig.from_dict(c) for c in (old, new)]
  assert theirs[0].rope_parameters == theirs[1].rope_parameters  # the same model for them too
  # A config.json that names only the sizes: transformers' GptOssConfig fills the rest.
  sizes = dict(architectures=["GptOssForCausalLM"], model_type="gpt_oss", vocab_size=96,
               hidden_size=128, intermediate_size=64, num_hidden_layers=3, num_attention_heads=16,
               num_local_experts=8)
  full = transformers.GptOssConfig(**sizes).to_dict()
  got = hf.model_fields(sizes)
  assert got == hf.model_fields(full)
  assert (got["head_dim"], got["kv_heads"], got["sliding_window"]) == (64, 8, 128)
  assert got["layer_types"] == ("sliding", "full", "sliding") and got["rope"].theta == 150000.0
  assert (got["rope"].factor, got["rope"].truncate) == (32.0, False)
  assert got["moe"].experts_per_token == 4


@pytest.mark.parametrize("edit,parts", [
    (dict(quantization_config={"quant_method": "bitsandbytes"}), ["quantization_config"]),
    (dict(attention_dropout=0.1), ["attention_dropout=0.1"]),
    (dict(num_experts_per_tok=5), ["num_experts_per_tok=5", "num_local_experts=4"]),
    (dict(layer_types=["sliding_attention"] * 3), ["layer_types"]),
    (dict(sliding_window=None), ["sliding_window=None"]),
    (dict(swiglu_limit=-1.0), ["swiglu_limit=-1.0"]),
    (dict(router_aux_loss_coef=-0.1), ["router_aux_loss_coef=-0.1"]),
    (dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0}), ["'dynamic'"]),
    (dict(num_local_experts=None), ["num_local_experts", "missing"]),
])
def test_unsupported_config_is_a_one_line_error(saved, edit, parts):
  config = {**json.loads((saved / "config.json").read_text()), **edit}
  with pytest.raises(hf.HFError) as e:
    hf.model_fields(config, "x/config.json")
  one_line(e, "x/config.json", *parts)


def test_write_config_needs_experts():
  with pytest.raises(FamilyError) as e:
    gpt_oss._write(ModelConfig(family="gpt_oss"), "float32")
  one_line(e, "model.moe")


# ------------------------------------------------------------------------------------- MXFP4


def test_mxfp4_unpacking_equals_transformers_bit_for_bit():
  # transformers' MXFP4 integration, imported by the one test that compares against it.
  from transformers.integrations.mxfp4 import convert_moe_packed_tensors
  rng = np.random.default_rng(0)
  blocks = rng.integers(0, 256, (3, 40, 8, 16), dtype=np.uint8)
  scales = rng.integers(0, 256, (3, 40, 8), dtype=np.uint8)
  scales[0, :32] = np.arange(256, dtype=np.uint8).reshape(32, 8)  # every exponent, 255 included
  want = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                    dtype=torch.float32).numpy()
  got = gpt_oss.mxfp4_to_float32(blocks, scales)
  assert got.shape == want.shape == (3, 256, 40) and got.dtype == np.float32
  np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))  # inf, -0 included


def pack_mxfp4(w_ExXxR: np.ndarray):
  """An expert weight [E, X, R] as MXFP4 (blocks [E, R, X/32, 16], scales [E, R, X/32]) of its
  nearest fp4 values per block of 32, and the fp32 values those decode to."""
  E, X, R = w_ExXxR.shape
  g = np.swapaxes(w_ExXxR, 1, 2).reshape(E, R, X // 32, 32)
  exp = np.ceil(np.log2(np.abs(g).max(-1) / 6.0)).astype(np.int32)  # the block's max fits in +-6
  codes = np.abs((g / np.exp2(exp)[..., None])[..., None] - gpt_oss.FP4_VALUES).argmin(-1)
  codes = codes.astype(np.uint8)
  blocks = np.ascontiguousarray(codes[..., 0::2] | (codes[..., 1::2] << 4))
  scales = np.ascontiguousarray(exp + 127).astype(np.uint8)
  values = gpt_oss.FP4_VALUES[codes] * np.exp2(exp)[..., None].astype(np.float32)
  return blocks, scales, np.swapaxes(values.reshape(E, R, X), 1, 2)


@pytest.fixture(scope="module")
def mxfp4(saved, tmp_path_factory):
  """The tiny model with its experts packed as MXFP4, as OpenAI's checkpoints store them: the
  directory, and the dequantized expert weights by name."""
  d = tmp_path_factory.mktemp("gpt_oss_mxfp4")
  tensors, dequantized = {}, {}
  for name, t in safetensors.numpy.load_file(saved / "model.safetensors").items():
    if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
      tensors[f"{name}_blocks"], tensors[f"{name}_scales"], dequantized[name] = pack_mxfp4(t)
    else:
      tensors[name] = t
  safetensors.numpy.save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
  config = json.loads((saved / "config.json").read_text())
  config["quantization_config"] = {
      "quant_method": "mxfp4", "modules_to_not_convert": [
          "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
  (d / "config.json").write_text(json.dumps(config))
  return d, dequantized


def test_mxfp4_checkpoint_imports_its_dequantized_weights(mxfp4, saved, monkeypatch):
  d, dequantized = mxfp4
  monkeypatch.setattr(hf, "CHUNK", 2048)  # one expert's weights at a time
  decoded = []
  decode = gpt_oss.mxfp4_to_float32
  monkeypatch.setattr(gpt_oss, "mxfp4_to_float32",
                      lambda b, s: decoded.append(len(b)) or decode(b, s))
  cfg, params = mtjax.load_hf(d)
  assert decoded and max(decoded) == 1  # decoded a slab at a time, never a layer's experts at once
  assert cfg == ModelConfig(**{**hf.Checkpoint(saved).model_fields(), "from_hf": str(d)})
  got = mtjax.to_hf_names(cfg, params)
  plain = safetensors.numpy.load_file(saved / "model.safetensors")
  # transformers' own load of the same files, dequantized to fp32.
  m = transformers.AutoModelForCausalLM.from_pretrained(
      d, dtype=torch.float32, quantization_config=transformers.Mxfp4Config(dequantize=True))
  theirs = {k: v.detach().numpy() for k, v in m.state_dict().items()}
  assert got.keys() == theirs.keys() == plain.keys()
  for name, want in plain.items():
    want = dequantized.get(name, want)
    np.testing.assert_array_equal(got[name], want, err_msg=name)
    np.testing.assert_array_equal(got[name].view(np.uint32), theirs[name].view(np.uint32),
                                  err_msg=name)
  assert not np.array_equal(dequantized["model.layers.0.mlp.experts.down_proj"],
                            plain["model.layers.0.mlp.experts.down_proj"])  # really quantized


@pytest.mark.parametrize("change,parts", [
    ("no_scales", ["layers.1.mlp.experts.down_proj_blocks without", "down_proj_scales"]),
    ("no_quantization_config", ["down_proj_blocks is MXFP4", "quantization_config"]),
    ("misshapen", ["layers.1.mlp.experts.down_proj_blocks decodes to [4, 32, 32]",
                   "expected [4, 64, 32]"]),
    ("not_uint8", ["layers.1.mlp.experts.down_proj_scales is F32"]),
    ("quantization_other", ["quant_method='fp8'"]),
])
def test_bad_mxfp4_tensors_are_one_line_errors(mxfp4, tmp_path, change, parts):
  d, _ = mxfp4
  tensors = safetensors.numpy.load_file(d / "model.safetensors")
  config = json.loads((d / "config.json").read_text())
  name = "model.layers.1.mlp.experts.down_proj"
  if change == "no_scales":
    del tensors[f"{name}_scales"]
  elif change == "no_quantization_config":
    del config["quantization_config"]
  elif change == "misshapen":
    tensors[f"{name}_blocks"] = tensors[f"{name}_blocks"][:, :, :1]
    tensors[f"{name}_scales"] = tensors[f"{name}_scales"][:, :, :1]
  elif change == "not_uint8":
    tensors[f"{name}_scales"] = tensors[f"{name}_scales"].astype(np.float32)
  elif change == "quantization_other":
    config["quantization_config"] = {"quant_method": "fp8"}
  safetensors.numpy.save_file(tensors, tmp_path / "model.safetensors")
  (tmp_path / "config.json").write_text(json.dumps(config))
  with pytest.raises(hf.HFError) as e:
    ck = hf.Checkpoint(tmp_path)
    ck.check(models.spec(ModelConfig(**ck.model_fields())))
  one_line(e, *parts)


def test_misshapen_expert_tensor_is_a_one_line_error(saved, tmp_path):
  tensors = safetensors.numpy.load_file(saved / "model.safetensors")
  name = "model.layers.2.mlp.experts.gate_up_proj"
  tensors[name] = tensors[name][..., :-2]
  safetensors.numpy.save_file(tensors, tmp_path / "model.safetensors")
  (tmp_path / "config.json").write_text((saved / "config.json").read_text())
  ck = hf.Checkpoint(tmp_path)
  with pytest.raises(hf.HFError) as e:
    ck.check(models.spec(ModelConfig(**ck.model_fields())))
  one_line(e, name, "[4, 32, 126]", "[4, 32, 128]")
