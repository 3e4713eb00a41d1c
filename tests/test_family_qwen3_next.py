"""The Qwen3-Next family against transformers through the parity harness (tests/parity.py):
logits, loss with the load-balancing loss, every gradient, the routing of every token, an export
and one AdamW step; each distinguishing feature moves the logits; the chunked scan of the gated
DeltaNet equals the token-by-token recurrence for any chunk, across sequence tiles and packed
documents.

The tiny config has both layer kinds (a DeltaNet layer with a mixture, a gated-attention one with
a dense MLP by mlp_only_layers), two value heads per key head, attention biases (so that the
query/gate split of q_proj's bias is tested) and transformers' partial rotation (0.25).
Its weights are drawn at std 0.1, not the other families' 0.2: at 0.2 the DeltaNet layers' fp32
rounding alone (transformers' as mtjax's, each against a float64 evaluation) reaches 1e-4 of
some gradients, where the parity bounds would measure the rounding rather than the code.
"""

import dataclasses
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy

import mtjax
from mtjax import cli, config, hf, models, plan
from mtjax.config import ModelConfig
from mtjax.models import deltanet
from mtjax.models.layers import Ctx
from numerics import REL_L2, assert_close, assert_trees_close, errors

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# After the skip: the parity harness and moe_checks import torch and transformers.
import moe_checks
import parity

COEF = 0.2  # router_aux_loss_coef: large enough that a wrong load balance moves the gradients
SHAPE = dict(vocab_size=96, hidden_size=32, intermediate_size=40, moe_intermediate_size=16,
             shared_expert_intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
             linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
             linear_conv_kernel_dim=3, num_experts=4, num_experts_per_tok=2,
             initializer_range=0.1, attention_bias=True, router_aux_loss_coef=COEF,
             layer_types=["linear_attention", "full_attention"], mlp_only_layers=[1])


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  d = tmp_path_factory.mktemp("qwen3_next") / "src"
  m = parity.save_tiny(transformers.Qwen3NextConfig(**SHAPE), d)
  with torch.no_grad():  # A_log and dt_bias away from their init too: a swapped pair shows
    for layer in m.model.layers[:1]:
      layer.linear_attn.A_log.add_(0.5 * torch.randn_like(layer.linear_attn.A_log))
      layer.linear_attn.dt_bias.add_(0.5 * torch.randn_like(layer.linear_attn.dt_bias))
  m.save_pretrained(d)
  return d


def with_linear(params, **values):
  """`params` with the given DeltaNet parameters (name -> function of the old value) changed in
  every linear layer."""
  blocks = []
  for b in params["blocks"]:
    if "qkvz" in b["attn"]:
      b = dict(b, attn={**b["attn"], **{k: f(b["attn"][k]) for k, f in values.items()}})
    blocks.append(b)
  return dict(params, blocks=blocks)


@parity.covers("qwen3_next")
def test_qwen3_next_equals_transformers(saved, tmp_path):
  cfg, params, want = parity.check_logits_and_gradients(saved, aux_coef=COEF)
  assert cfg.family == "qwen3_next" and cfg.layer_types == ("linear", "full")
  assert [k for _, k in models.spec(cfg).groups[1:-1]] == ["block_linear_moe", "block"]
  assert (cfg.rope.partial, cfg.rotary_dim, cfg.norm_offset, cfg.attn_output_gate) == (
      0.25, 4, True, True)
  moe_checks.check_aux_loss(cfg, params, want, COEF)
  moe_checks.check_routing(saved, cfg, params)
  for change in (dict(norm_offset=False), dict(rope=dict(partial=0.5)),
                 dict(moe=dataclasses.replace(cfg.moe, shared_gate=False))):
    parity.feature_matters(cfg, params, **change)
  # The same criterion for features of the weights: the output gate (q_proj's query half alone,
  # per head, without attn_output_gate); no decay (A_log -> -inf); the convolution as the
  # identity; the gated norm's weights at 1.
  ids = parity.token_ids(cfg.vocab_size)
  base = parity.forward(cfg, params, ids)
  H, hd, D, K = cfg.heads, cfg.dim_per_head, cfg.hidden, cfg.linear.conv_kernel
  half = lambda q: {"kernel": q["kernel"].reshape(D, H, 2, hd)[:, :, 0].reshape(D, H * hd),
                    "bias": q["bias"].reshape(H, 2, hd)[:, 0].reshape(H * hd)}
  gateless = [dict(b, attn={**b["attn"], "q": half(b["attn"]["q"])}) if "q" in b["attn"] else b
              for b in params["blocks"]]
  for other, changed in (
      (dataclasses.replace(cfg, attn_output_gate=False), dict(params, blocks=gateless)),
      (cfg, with_linear(params, A_log=lambda a: np.full_like(a, -30.0))),
      (cfg, with_linear(params, conv=lambda w: np.repeat(np.eye(K, dtype=w.dtype)[K - 1:],
                                                          w.shape[0], 0))),
      (cfg, with_linear(params, out_norm=lambda n: {"scale": np.ones_like(n["scale"])}))):
    assert errors(parity.forward(other, changed, ids), base)[0] > 100 * REL_L2
  parity.pieces_cover_every_parameter(cfg)
  parity.check_export(cfg, params, tmp_path / "out")


@pytest.mark.soak  # long; the README run's time budget (the soak runs it)
def test_qwen3_next_adamw_step_equals_torch(saved):
  stats = parity.check_adamw_step(saved, aux_coef=COEF)
  assert {"aux_loss", "expert_tokens_min", "expert_tokens_max"} <= stats.aux.keys()


def token_by_token(q, k, v, g, beta, segments=None):
  """The gated delta rule one token at a time in float64 numpy (q scaled by K^-0.5), its state
  zeroed at each document's first token: the reference the chunked scan is held to."""
  B, T, H, Kd = q.shape
  out = np.zeros(v.shape, np.float64)
  S = np.zeros((B, H, Kd, v.shape[-1]))
  q = q * Kd ** -0.5
  for t in range(T):
    if segments is not None and t > 0:
      S = S * (segments[:, t] == segments[:, t - 1])[:, None, None, None]
    S = S * np.exp(g[:, t])[..., None, None]
    delta = (v[:, t] - np.einsum("bhkv,bhk->bhv", S, k[:, t])) * beta[:, t][..., None]
    S = S + np.einsum("bhk,bhv->bhkv", k[:, t], delta)
    out[:, t] = np.einsum("bhkv,bhk->bhv", S, q[:, t])
  return out


def scan_inputs(B=2, T=12, H=3, Kd=4, Vd=5, seed=0):
  rng = np.random.default_rng(seed)
  unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
  q, k = unit(rng.normal(size=(B, T, H, Kd))), unit(rng.normal(size=(B, T, H, Kd)))
  v = rng.normal(size=(B, T, H, Vd))
  g = -np.exp(rng.normal(size=(B, T, H))) * 0.3  # decays of 0.5 to 0.99 a token
  beta = 1 / (1 + np.exp(-rng.normal(size=(B, T, H))))
  return [a.astype(np.float32) for a in (q, k, v, g, beta)]


# 5 divides no T here; T itself (one chunk) is the parity tests'
@pytest.mark.parametrize("chunk,packed", [(1, False), (5, False), (3, True), (5, True)])
def test_chunked_scan_equals_the_token_by_token_recurrence(chunk, packed):
  q, k, v, g, beta = scan_inputs()
  segments = np.array([[0] * 3 + [1] * 6 + [2] * 3, [5] * 7 + [6] * 5]) if packed else None
  want = token_by_token(*(a.astype(np.float64) for a in (q, k, v, g, beta)), segments)
  runs = None if segments is None else deltanet.document_runs(jnp.asarray(segments))
  got = jax.jit(deltanet.chunked_delta_rule, static_argnames="chunk")(
      q, k, v, g, beta, runs, chunk=chunk)
  assert_close(np.asarray(got), want, name=f"chunk {chunk}")


@pytest.mark.soak  # long; the README run's time budget (the soak runs it)
def test_chunks_seq_tiles_and_packed_documents_change_nothing(saved):
  """A DeltaNet block's output and every gradient are the same for another chunk (several chunks
  against the parity tests' one: the scan's gradient across chunks) and sequence tiles (the
  recurrence lives in the untiled core), packed documents included; a row of packed documents
  gives each document's output alone."""
  cfg, params = mtjax.load_hf(saved)
  other = dataclasses.replace(cfg, linear=dataclasses.replace(cfg.linear, chunk=5))
  kind = models.spec(cfg).groups[1][1]
  x = jax.random.normal(jax.random.key(0), (2, 13, cfg.hidden))
  segments = jnp.asarray([[0] * 4 + [1] * 9, [3] * 13])
  positions = jnp.asarray([list(range(4)) + list(range(9)), list(range(13))])
  ctx = Ctx(positions, segments)

  def block_loss(p, x, cfg, tile):
    y, _ = models.spec(cfg).block(kind, "xla", seq_tile=tile).apply({"params": p}, x, ctx)
    return jnp.sum(y * jnp.cos(jnp.arange(y.size).reshape(y.shape)))

  grad = jax.jit(jax.value_and_grad(block_loss, argnums=(0, 1)), static_argnums=(2, 3))
  assert_trees_close(grad(params["blocks"][0], x, other, 5),
                     grad(params["blocks"][0], x, cfg, None), name="chunk 5, tiles of 5")

  # two documents of 6 tokens in a row against the two as rows of their own
  spec_block = models.spec(cfg).block(kind, "xla")
  block = lambda x, ctx: spec_block.apply({"params": params["blocks"][0]}, x, ctx)[0]
  x = x[:, :6]
  packed = jax.jit(block)(x.reshape(1, 12, -1), Ctx(jnp.tile(jnp.arange(6), 2)[None],
                                                    jnp.repeat(jnp.arange(2), 6)[None]))
  alone = jax.jit(block)(x, Ctx.default(2, 6))
  assert_close(np.asarray(packed).reshape(2, 6, -1), np.asarray(alone), name="packed documents")


def test_planner_counts_the_scan_and_the_parameters():
  cfg = ModelConfig(**models.read_hf_config(
      {"architectures": ["Qwen3NextForCausalLM"], **SHAPE}))
  spec = models.spec(cfg)
  assert plan.count_params(cfg) == spec.counts["total"]
  dense = dataclasses.replace(cfg, moe=None, attn_output_gate=False)
  assert plan.count_params(dense) == models.spec(dense).counts["total"]
  scan = spec.mixer_forward_flops(0, 2, 1000, causal_half=True)
  a = cfg.linear  # 16 chunks of 64 (the last one padded) per row and value head
  assert scan == 2 * a.value_heads * 16 * (64 * 64 * (5 * 8 + 3 * 8) + 6 * 64 * 8 * 8)
  attention = spec.mixer_forward_flops(1, 2, 1000, causal_half=True)
  assert attention == 2 * 4 * 32 * 2 * 1000 * 1001 / 2
  assert spec.attention_forward_flops(2, 1000, True) == scan + attention


def config_json(**change):
  config = {"architectures": ["Qwen3NextForCausalLM"], **SHAPE, **change}
  return {k: v for k, v in config.items() if v is not None}


@pytest.mark.parametrize("change", [
    dict(layer_types=None, num_hidden_layers=8),  # every 4th layer full
    dict(layer_types=None, num_hidden_layers=6, full_attention_interval=2),
    dict(attention_bias=None, norm_topk_prob=None, mlp_only_layers=None, decoder_sparse_step=2),
    dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                          "partial_rotary_factor": 0.5}),
    dict(num_experts=0),
])
def test_config_keys_read_as_transformers_reads_them(change):
  config = config_json(**change)
  theirs = transformers.AutoConfig.for_model("qwen3_next", **config)
  cfg = ModelConfig(**hf.model_fields(config))
  layers = theirs.num_hidden_layers
  assert [cfg.layer_type(i) for i in range(layers)] == [
      "linear" if t == "linear_attention" else "full" for t in theirs.layer_types]
  assert cfg.rope.partial == theirs.rope_parameters["partial_rotary_factor"]
  assert cfg.rope.theta == theirs.rope_parameters["rope_theta"]
  assert cfg.qkv_bias == cfg.o_bias == theirs.attention_bias
  moe_layers = [theirs.num_experts > 0 and i not in theirs.mlp_only_layers
                and (i + 1) % theirs.decoder_sparse_step == 0 for i in range(layers)]
  assert [cfg.is_moe_layer(i) for i in range(layers)] == moe_layers
  if cfg.moe is not None:
    assert (cfg.moe.norm_topk_prob, cfg.moe.shared_width) == (
        theirs.norm_topk_prob, theirs.shared_expert_intermediate_size)


@pytest.mark.parametrize("change,match", [
    (dict(hidden_act="gelu"), "hidden_act='gelu' unsupported"),
    (dict(linear_num_value_heads=3), "linear_num_value_heads=3 unsupported .*no multiple"),
    (dict(layer_types=["linear_attention", "sliding_attention", "full_attention"]),
     "layer_types=.* unsupported"),
    (dict(linear_key_head_dim=0), "linear_key_head_dim=0 must be a positive number"),
    (dict(num_experts_per_tok=5), "num_experts_per_tok=5 must be an integer <= num_experts=4"),
])
def test_bad_config_is_a_one_line_error(change, match):
  with pytest.raises(hf.HFError, match=match) as e:
    hf.model_fields(config_json(**change))
  assert "\n" not in str(e.value) and "config.json" in str(e.value)


def test_multi_token_prediction_tensors_are_not_read_and_others_refused(saved, tmp_path):
  tensors = safetensors.numpy.load_file(saved / "model.safetensors")
  extra = np.ones((4, 32), np.float32)
  for name, ok in (("mtp.layers.0.mlp.gate.weight", True), ("model.layers.0.extra", False)):
    bad = tmp_path / name
    shutil.copytree(saved, bad)
    safetensors.numpy.save_file({**tensors, name: extra}, bad / "model.safetensors",
                                metadata={"format": "pt"})
    if ok:
      assert mtjax.load_hf(bad)[0].family == "qwen3_next"
    else:
      with pytest.raises(hf.HFError, match=f"tensor {name} unexpected"):
        mtjax.load_hf(bad)
  bad = tmp_path / "conv"
  shutil.copytree(saved, bad)
  name = "model.layers.0.linear_attn.conv1d.weight"
  safetensors.numpy.save_file({**tensors, name: tensors[name][:, :, :-1].copy()},
                              bad / "model.safetensors", metadata={"format": "pt"})
  with pytest.raises(hf.HFError, match=rf"{name} has shape \[64, 1, 2\], expected \[64, 1, 3\]"):
    mtjax.load_hf(bad)


def test_linear_layers_need_their_section_and_the_chunk_is_a_knob(saved):
  with pytest.raises(config.ConfigError, match="linear layers need model.linear"):
    ModelConfig(layers=2, layer_types=("linear", "full"))
  with pytest.raises(config.ConfigError, match="model.linear.value_heads: 3 is no multiple"):
    config.LinearAttentionConfig(key_heads=2, value_heads=3)
  cfg = cli.load_config(None, [f"model.from_hf={saved}", "model.linear.chunk=16"])
  assert cfg.model.linear.chunk == 16
  with pytest.raises(config.ConfigError, match="model.linear.key_dim: 4 differs"):
    cli.load_config(None, [f"model.from_hf={saved}", "model.linear.key_dim=4"])
