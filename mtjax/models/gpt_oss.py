"""The GPT-OSS family (gpt-oss-20b, gpt-oss-120b): attention sinks, biases on q/k/v/o, sliding and
full attention layers alternating (`layer_types`), YaRN RoPE (truncate false), a mixture of experts
in every layer (a router with a bias, softmax over the top-k logits; experts with a clamped SwiGLU
and biases).

The experts are stored stacked as transformers keeps them, not as Linear weights: gate_up_proj
[E, D, 2F] with the gate and up columns interleaved (gate = [..., ::2], up = [..., 1::2]) and
down_proj [E, F, D]. OpenAI's checkpoints store those two in MXFP4 (`<name>_blocks`: two fp4 e2m1
values per byte, `<name>_scales`: one e8m0 exponent per 32 values); `MXFP4` decodes them on import,
bit for bit as transformers' `convert_moe_packed_tensors`. Exports are written dequantized (bf16 or
fp32), as any mtjax export.
"""

from __future__ import annotations


import numpy as np

from mtjax.config import ModelConfig, MoEConfig
from mtjax.layout import Layout
from mtjax.models.registry import Family, FamilyError, Piece, block_index, register
from mtjax.models.common import Reader, base_config, layer_type_names, standard_pieces

# transformers' GptOssConfig defaults for keys a config.json may leave out.
_DEFAULTS = dict(rms_norm_eps=1e-5, tie_word_embeddings=False, head_dim=64, num_key_value_heads=8,
                 sliding_window=128, num_experts_per_tok=4, swiglu_alpha=1.702, swiglu_limit=7.0,
                 router_aux_loss_coef=0.001, attention_bias=True, attention_dropout=0.0,
                 rope_theta=150000.0, max_position_embeddings=131072)
_DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                 "truncate": False, "original_max_position_embeddings": 4096}


def _read(config: dict, where: str) -> dict:
  quant = config.get("quantization_config")
  if quant is not None and (not isinstance(quant, dict) or quant.get("quant_method") != "mxfp4"):
    raise FamilyError(f"{where}: quantization_config={quant!r} unsupported (mtjax reads GPT-OSS in "
                      f"bf16, fp16, fp32 or MXFP4 experts)")
  defaults = dict(_DEFAULTS)
  if config.get("rope_parameters") is None and config.get("rope_scaling") is None:
    defaults["rope_parameters"] = _DEFAULT_ROPE
  if config.get("num_local_experts") is None and config.get("num_experts") is not None:
    defaults["num_local_experts"] = config["num_experts"]  # transformers' attribute_map alias
  r = Reader(config, where, defaults)
  if r.opt("attention_dropout") != 0:
    r.refuse("attention_dropout", "mtjax's attention has no dropout")
  fields = dict(r.shape(), **r.rope())
  layers = fields["layers"]
  if r.c.get("layer_types") is None:  # transformers: sliding first, then alternating
    types = tuple("sliding" if i % 2 == 0 else "full" for i in range(layers))
  else:
    types = r.layer_types(layers) or ("full",) * layers
  if "sliding" in types:
    if r.c.get("sliding_window") is None:
      r.refuse("sliding_window", "sliding_attention layers need a window")
    fields.update(sliding_window=int(r.positive("sliding_window")), layer_types=types)
  experts, k = r.positive("num_local_experts"), r.positive("num_experts_per_tok")
  if k > experts:
    r.refuse("num_experts_per_tok", f"more than num_local_experts={experts}")
  coef = r.opt("router_aux_loss_coef")
  if isinstance(coef, bool) or not isinstance(coef, (int, float)) or coef < 0:
    r.refuse("router_aux_loss_coef", "expected a number >= 0")
  bias = bool(r.opt("attention_bias"))
  fields.update(
      qkv_bias=bias, o_bias=bias, attention_sinks=True,
      # The experts apply their own clamped SwiGLU whatever hidden_act says (transformers too).
      mlp_act="swiglu_clamped", mlp_bias=True,
      swiglu_limit=float(r.positive("swiglu_limit")),
      swiglu_alpha=float(r.positive("swiglu_alpha")),
      moe=MoEConfig(experts=int(experts), experts_per_token=int(k), expert_ffn=fields["ffn"],
                    router="topk_softmax", router_bias=True, aux_loss_coef=float(coef)))
  return fields


def _write(cfg: ModelConfig, dtype: str) -> dict:
  m = cfg.moe
  if m is None:
    raise FamilyError("model.moe: a GPT-OSS model has a mixture of experts in every layer; set "
                      "model.moe")
  out = base_config(cfg, "GptOssForCausalLM", "gpt_oss", dtype)
  out.update(intermediate_size=m.expert_ffn, num_local_experts=m.experts,
             num_experts_per_tok=m.experts_per_token, router_aux_loss_coef=m.aux_loss_coef,
             sliding_window=cfg.sliding_window, layer_types=layer_type_names(cfg),
             attention_bias=cfg.qkv_bias, swiglu_limit=cfg.swiglu_limit,
             swiglu_alpha=cfg.swiglu_alpha, hidden_act="silu", attention_dropout=0.0)
  return out


_ROUTER = {("mlp", "router", "kernel"): "mlp.router.weight",
           ("mlp", "router", "bias"): "mlp.router.bias"}
_ALL, _EVEN, _ODD = slice(None), slice(0, None, 2), slice(1, None, 2)
# mtjax expert parameter -> (transformers tensor, the index of its share): gate and up are the
# even and odd columns of gate_up_proj, as GptOssExperts splits them.
_EXPERTS = {
    "gate": ("gate_up_proj", (_ALL, _ALL, _EVEN)), "up": ("gate_up_proj", (_ALL, _ALL, _ODD)),
    "down": ("down_proj", ()),
    "gate_bias": ("gate_up_proj_bias", (_ALL, _EVEN)),
    "up_bias": ("gate_up_proj_bias", (_ALL, _ODD)),
    "down_bias": ("down_proj_bias", ()),
}


def _pieces(cfg: ModelConfig, group: str, layout: Layout) -> list[Piece]:
  i = block_index(group)
  if i is None:
    return standard_pieces(cfg, group, layout)
  experts = lambda path: path[:2] == ("mlp", "experts")
  # standard_pieces names attention, norms and the router; the experts' pieces are made here
  # (a placeholder name keeps it from refusing them).
  named = lambda path: _ROUTER.get(path) or ("-" if experts(path) else None)
  out = [p for p in standard_pieces(cfg, group, layout, named) if not experts(p.path)]
  for path, shape in zip(layout.paths, layout.shapes):
    if experts(path):
      name, src = _EXPERTS[path[2]]
      # Stacked as the parameter (not a Linear's [out, in]); gate/up take every other column.
      stored = (*shape[:-1], 2 * shape[-1]) if src else tuple(shape)
      out.append(Piece(f"model.layers.{i}.mlp.experts.{name}", stored, tuple(path), src=src))
  return out



register(Family(
    "gpt_oss", ("GptOssForCausalLM",), _read, _write, _pieces,
    notes="GPT-OSS 20b/120b: attention sinks, q/k/v/o biases, alternating sliding/full layers, "
          "YaRN, top-k softmax router with a bias, clamped-SwiGLU experts with biases; MXFP4 "
          "experts dequantized on import (exports bf16/fp32)"))
