"""Qwen3-Next (Qwen3NextForCausalLM): gated DeltaNet layers ("linear_attention") interleaved with
gated full-attention ones, a mixture of experts with a sigmoid-gated shared expert.

The full-attention layers gate their output (q_proj gives each head a query and a gate; sigmoid of
the gate scales the attention's output), rotate `partial_rotary_factor` of each head's channels
(0.25 when config.json says nothing) and norm q and k per head. Every norm but the DeltaNet's
gated one scales by (1 + w), w stored at 0. The DeltaNet layers are mtjax.models.deltanet's. The
mixture is Qwen2-MoE's: softmax router, top `num_experts_per_tok` renormalised when
`norm_topk_prob`, dense layers by `mlp_only_layers` / `decoder_sparse_step`; router_aux_loss_coef
weighs the load-balancing loss in training, as transformers does with output_router_logits.

The multi-token-prediction head some checkpoints carry (`mtp.*`) is no part of the model: its
tensors are tolerated and not read, as transformers skips them.
"""

from __future__ import annotations

from mtjax.config import ConfigError, LinearAttentionConfig, ModelConfig
from mtjax.layout import Layout
from mtjax.models.common import Reader, base_config, rope_parameters
from mtjax.models.mixtral import moe_pieces, routed
from mtjax.models.qwen_moe import sparse_layers
from mtjax.models.registry import (Family, FamilyError, Piece, block_index, register,
                                   rotary_buffers)

# Qwen3NextConfig's values for keys config.json may leave out.
_DEFAULTS = dict(rms_norm_eps=1e-6, tie_word_embeddings=False, hidden_act="silu", head_dim=256,
                 num_attention_heads=16, num_key_value_heads=2, max_position_embeddings=32768,
                 partial_rotary_factor=0.25, attention_bias=False, linear_conv_kernel_dim=4,
                 linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
                 linear_num_value_heads=32, decoder_sparse_step=1, moe_intermediate_size=512,
                 shared_expert_intermediate_size=512, num_experts_per_tok=10, num_experts=512,
                 norm_topk_prob=True, router_aux_loss_coef=0.001, mlp_only_layers=[])
_TYPES = {"linear_attention": "linear", "full_attention": "full"}
_LINEAR_KEYS = dict(key_heads="linear_num_key_heads", value_heads="linear_num_value_heads",
                    key_dim="linear_key_head_dim", value_dim="linear_value_head_dim",
                    conv_kernel="linear_conv_kernel_dim")


def _layer_types(r: Reader, layers: int) -> tuple[str, ...]:
  """`layer_types`, or transformers' default: every `full_attention_interval`-th layer full."""
  names = r.c.get("layer_types")
  if names is None:
    every = r.opt("full_attention_interval", 4)
    if isinstance(every, bool) or not isinstance(every, int) or every <= 0:
      r.refuse("full_attention_interval", "expected a positive integer")
    return tuple("linear" if (i + 1) % every else "full" for i in range(layers))
  if not isinstance(names, list) or len(names) != layers or any(n not in _TYPES for n in names):
    r.refuse("layer_types", f"expected {layers} of linear_attention / full_attention")
  return tuple(_TYPES[n] for n in names)


def _read(config: dict, where: str) -> dict:
  r = Reader(config, where, _DEFAULTS)
  act = r.act("hidden_act", {"silu": "silu"})  # the MLPs' and the DeltaNet convolution's
  bias = bool(r.opt("attention_bias"))
  fields = dict(r.shape(), **r.rope(), mlp_act=act, norm_offset=True, qk_norm=True,
                attn_output_gate=True, qkv_bias=bias, o_bias=bias)
  layers = fields["layers"]
  types = _layer_types(r, layers)
  fields["layer_types"] = None if all(t == "full" for t in types) else types
  try:
    fields["linear"] = LinearAttentionConfig(**{k: r.positive(key) for k, key in
                                                _LINEAR_KEYS.items()})
  except ConfigError as e:
    raise FamilyError(f"{where}: linear_num_value_heads={r.c['linear_num_value_heads']} "
                      f"unsupported ({e})") from None
  if r.c.get("num_experts") == 0:  # transformers: every layer's MLP dense
    return fields
  moe = dict(norm_topk_prob=bool(r.opt("norm_topk_prob")), shared_experts=1,
             shared_ffn=r.positive("shared_expert_intermediate_size"), shared_gate=True,
             **sparse_layers(r, layers))
  fields["moe"] = routed(r, ("num_experts",), _DEFAULTS["num_experts"],
                         r.positive("moe_intermediate_size"), **moe)
  return fields


def _write(cfg: ModelConfig, dtype: str) -> dict:
  out = base_config(cfg, "Qwen3NextForCausalLM", "qwen3_next", dtype)
  # Qwen3NextConfig reads a missing partial_rotary_factor as 0.25: always written.
  rope = dict(rope_parameters(cfg), partial_rotary_factor=cfg.rope.partial)
  out.update(hidden_act="silu", attention_bias=cfg.qkv_bias, rope_parameters=rope,
             partial_rotary_factor=cfg.rope.partial,
             layer_types=[{"linear": "linear_attention", "full": "full_attention"}[
                 cfg.layer_type(i)] for i in range(cfg.layers)])
  if cfg.rope.scaling != "none":
    out["rope_scaling"] = rope
  a = cfg.linear
  if a is not None:
    out.update({key: getattr(a, k) for k, key in _LINEAR_KEYS.items()})
  m = cfg.moe
  if m is None:
    out.update(num_experts=0)
  else:
    out.update(num_experts=m.experts, num_experts_per_tok=m.experts_per_token,
               moe_intermediate_size=m.expert_ffn, norm_topk_prob=m.norm_topk_prob,
               shared_expert_intermediate_size=m.shared_width, decoder_sparse_step=m.every,
               mlp_only_layers=sorted({*range(m.first_dense_layers), *m.dense_layers}),
               router_aux_loss_coef=m.aux_loss_coef)
  return out


_MOE = {("mlp", "router", "kernel"): "mlp.gate.weight",
        **{("mlp", "shared", w, "kernel"): f"mlp.shared_expert.{w}_proj.weight"
           for w in ("gate", "up", "down")},
        ("mlp", "shared_gate", "kernel"): "mlp.shared_expert_gate.weight"}
_LINEAR = {("attn", "qkvz", "kernel"): "linear_attn.in_proj_qkvz.weight",
           ("attn", "ba", "kernel"): "linear_attn.in_proj_ba.weight",
           ("attn", "conv"): "linear_attn.conv1d.weight",
           ("attn", "A_log"): "linear_attn.A_log",
           ("attn", "dt_bias"): "linear_attn.dt_bias",
           ("attn", "out_norm", "scale"): "linear_attn.norm.weight",
           ("attn", "o", "kernel"): "linear_attn.out_proj.weight"}
_EXPERT = lambda e, w: f"mlp.experts.{e}.{w}_proj.weight"
_ATTENTION_PIECES = moe_pieces(_MOE, _EXPERT)
_LINEAR_PIECES = moe_pieces({**_MOE, **_LINEAR}, _EXPERT)


def _pieces(cfg: ModelConfig, group: str, layout: Layout) -> list[Piece]:
  """Qwen2-MoE's names for attention layers; a DeltaNet layer's under linear_attn, its depthwise
  convolution [C, K] the checkpoint's [C, 1, K]."""
  i = block_index(group)
  if i is None or cfg.layer_type(i) != "linear":
    return _ATTENTION_PIECES(cfg, group, layout)
  out = []
  for p in _LINEAR_PIECES(cfg, group, layout):
    if p.path == ("attn", "conv"):
      C, K = p.shape
      p = Piece(p.name, (C, 1, K), p.path, src=(slice(None), 0))
    out.append(p)
  return out


def _ignored(config: dict, name: str) -> bool:
  """The multi-token-prediction head (`mtp.*`) and RoPE buffers: tolerated, not read."""
  return name.startswith("mtp.") or rotary_buffers(config, name)


register(Family(
    "qwen3_next", ("Qwen3NextForCausalLM",), _read, _write, _pieces, ignored=_ignored,
    notes="Qwen3-Next-80B-A3B (gated DeltaNet layers as a chunked scan, packed documents each "
          "from a zero state; gated full attention, partial RoPE, (1 + w) norms; a mixture with "
          "a sigmoid-gated shared expert, dense layers); router_aux_loss_coef weighs the "
          "load-balancing loss in training; the multi-token-prediction mtp.* tensors are not "
          "read"))
