"""Llama 4's text decoder (Llama4ForCausalLM, Llama4TextConfig): Scout's and Maverick's language
model as transformers computes it.

Layers with RoPE (interleaved pairs, as a complex multiplication) attend within chunks of
`attention_chunk_size` positions (`chunked_attention`) and L2-normalise q and k after RoPE
(`use_qk_norm`); the others (`no_rope_layers` 0, every `no_rope_layer_interval`-th by default) are
global NoPE layers whose queries are scaled by log(floor((p + 1) / floor_scale) + 1) * attn_scale
+ 1 (`attn_temperature_tuning`). The feed-forward of the `moe_layers` (every
`interleave_moe_layer_step`-th by default) is a mixture: a sigmoid router over the top
`num_experts_per_tok` logits whose score scales the chosen expert's input, experts of width
`intermediate_size` stored fused (gate_up_proj [E, D, 2F]: gate then up; down_proj [E, F, D]) and
a shared expert beside them; the other layers a dense MLP of width `intermediate_size_mlp`.
transformers' Llama4ForCausalLM adds no load-balancing loss, so neither does mtjax.

Packed documents count the chunks and the temperature from each document's start (transformers
counts them from the row's first token; one document per row is the same).
"""

from __future__ import annotations

import dataclasses

from mtjax.config import ModelConfig, MoEConfig
from mtjax.layout import Layout
from mtjax.models.registry import Family, FamilyError, Piece, block_index, register
from mtjax.models.common import (Reader, base_config, layer_type_names, linear_name,
                                 standard_pieces)

# Llama4TextConfig's values for keys save_pretrained may leave out.
_DEFAULTS = dict(rms_norm_eps=1e-5, tie_word_embeddings=False, hidden_act="silu", head_dim=128,
                 num_key_value_heads=8, intermediate_size=8192, intermediate_size_mlp=16384,
                 num_experts_per_tok=1, num_local_experts=16, interleave_moe_layer_step=1,
                 use_qk_norm=True, no_rope_layer_interval=4, attention_chunk_size=8192,
                 attn_temperature_tuning=True, floor_scale=8192, attn_scale=0.1,
                 attention_bias=False, attention_dropout=0.0, rope_theta=500000.0,
                 max_position_embeddings=4096 * 32)


def _int_list(r: Reader, key: str, layers: int, values=None) -> list[int] | None:
  v = r.c.get(key)
  if v is None:
    return None
  ok = isinstance(v, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in v)
  if not ok or (values is not None and (len(v) != layers or any(i not in values for i in v))):
    r.refuse(key, f"expected {layers} of 0 / 1" if values else "expected layer indices")
  return v


def _read(config: dict, where: str) -> dict:
  r = Reader(config, where, _DEFAULTS)
  act = r.act("hidden_act", {"silu": "silu"})
  if r.opt("attention_dropout") != 0:
    r.refuse("attention_dropout", "mtjax's attention has no dropout")
  fields = dict(r.shape(), **r.rope(), mlp_act=act)
  L = fields["layers"]
  if fields["rope"].partial != 1.0:
    r.refuse("partial_rotary_factor", "Llama 4 rotates whole heads")
  fields["rope"] = dataclasses.replace(fields["rope"], interleave=True)
  bias = bool(r.opt("attention_bias"))
  fields.update(qkv_bias=bias, o_bias=bias, ffn=r.positive("intermediate_size_mlp"))

  # no_rope_layers[i] is 1 where layer i rotates (transformers' naming), empty: the interval's.
  rotates = _int_list(r, "no_rope_layers", L, (0, 1))
  if not rotates:
    every = r.positive("no_rope_layer_interval")
    rotates = [int((i + 1) % every != 0) for i in range(L)]
  chunk = r.positive("attention_chunk_size", required=False)
  if r.c.get("layer_types") is not None:
    types = r.layer_types(L, chunked=True) or ("full",) * L
    if "sliding" in types:
      r.refuse("layer_types", "Llama 4's layers are full_attention or chunked_attention")
  else:
    types = tuple("chunked" if rope and chunk is not None else "full" for rope in rotates)
  if "chunked" in types:
    if chunk is None:
      r.refuse("attention_chunk_size", "layer_types has chunked_attention layers")
    fields.update(layer_types=types, attention_chunk=int(chunk))
  nope = tuple(i for i, rope in enumerate(rotates) if not rope)
  fields.update(nope_layers=nope, qk_l2_norm=bool(r.opt("use_qk_norm")))
  if r.opt("attn_temperature_tuning") and nope:
    floor = r.positive("floor_scale")
    if int(floor) != floor:
      r.refuse("floor_scale", "expected an integer")
    fields.update(temperature_floor=int(floor), temperature_scale=float(r.c["attn_scale"]))

  step = r.positive("interleave_moe_layer_step")
  pattern = list(range(step - 1, L, step))
  moe_layers = _int_list(r, "moe_layers", L)
  moe_layers = pattern if moe_layers is None else sorted(set(moe_layers))
  if any(not 0 <= i < L for i in moe_layers):
    r.refuse("moe_layers", f"expected layer indices below {L}")
  if moe_layers:
    every = step if moe_layers == pattern else 1
    experts, k = r.positive("num_local_experts"), r.positive("num_experts_per_tok")
    if k > experts:
      r.refuse("num_experts_per_tok", f"more than num_local_experts={experts}")
    width = r.positive("intermediate_size")
    fields["moe"] = MoEConfig(
        experts=int(experts), experts_per_token=int(k), expert_ffn=int(width), router="sigmoid",
        norm_topk_prob=False, weight_inputs=True, shared_experts=1, shared_ffn=int(width),
        every=every, dense_layers=tuple(i for i in range(L) if (i + 1) % every == 0
                                        and i not in moe_layers))
  return fields


def _write(cfg: ModelConfig, dtype: str) -> dict:
  out = base_config(cfg, "Llama4ForCausalLM", "llama4_text", dtype)
  m = cfg.moe
  chunked = [i for i in range(cfg.layers) if cfg.layer_type(i) == "chunked"]
  out.update(hidden_act="silu", intermediate_size_mlp=cfg.ffn, attention_bias=cfg.qkv_bias,
             attention_dropout=0.0, layer_types=layer_type_names(cfg),
             attention_chunk_size=cfg.attention_chunk if chunked else None,
             no_rope_layers=[int(cfg.uses_rope(i)) for i in range(cfg.layers)],
             use_qk_norm=cfg.qk_l2_norm, attn_temperature_tuning=cfg.temperature_floor is not None,
             floor_scale=cfg.temperature_floor or 8192, attn_scale=cfg.temperature_scale,
             moe_layers=[i for i in range(cfg.layers) if cfg.is_moe_layer(i)],
             interleave_moe_layer_step=1 if m is None else m.every)
  if m is not None:
    if (m.router, m.norm_topk_prob, m.weight_inputs, m.shared_width) != (
        "sigmoid", False, True, m.expert_ffn) or m.routed_scaling != 1.0 or m.shared_gate:
      raise FamilyError("model.moe unsupported by Llama4ForCausalLM (a sigmoid router weighting "
                        "the experts' inputs, unnormalised, one shared expert of expert_ffn)")
    out.update(intermediate_size=m.expert_ffn, num_local_experts=m.experts,
               num_experts_per_tok=m.experts_per_token)
  return out


_MOE = {("mlp", "router", "kernel"): "feed_forward.router.weight"}
_MOE.update({("mlp", "shared", w, "kernel"): f"feed_forward.shared_expert.{w}_proj.weight"
             for w in ("gate", "up", "down")})


def _pieces(cfg: ModelConfig, group: str, layout: Layout) -> list[Piece]:
  i = block_index(group)
  if i is None:
    return standard_pieces(cfg, group, layout)
  experts = lambda path: path[:2] == ("mlp", "experts")

  def named(path):
    if experts(path):
      return "-"  # a placeholder: the experts' pieces are made below
    if path[0] == "mlp":
      return _MOE.get(path) or linear_name(path, "feed_forward")
    return None

  out = [p for p in standard_pieces(cfg, group, layout, named) if not experts(p.path)]
  for path, shape in zip(layout.paths, layout.shapes):
    if experts(path):
      E, a, b = shape
      if path[2] == "down":
        out.append(Piece(f"model.layers.{i}.feed_forward.experts.down_proj", (E, a, b), path))
      else:  # gate then up along gate_up_proj's last axis
        half = slice(0, b) if path[2] == "gate" else slice(b, 2 * b)
        out.append(Piece(f"model.layers.{i}.feed_forward.experts.gate_up_proj", (E, a, 2 * b),
                         path, src=(slice(None), slice(None), half)))
  return out


register(Family(
    "llama4", ("Llama4ForCausalLM",), _read, _write, _pieces,
    notes="Llama 4 text (Scout, Maverick): chunked local attention in RoPE layers (interleaved "
          "pairs, weightless q/k norms), global NoPE layers with attention temperature tuning, "
          "a sigmoid top-k router scaling the experts' inputs, fused experts and a shared expert, "
          "interleaved dense and MoE layers; no load-balancing loss (transformers adds none)"))
