"""The GLM-4 family (Glm4ForCausalLM): GLM-4-9B-0414, GLM-4-32B-0414 and GLM-Z1. A decoder with a
norm before and after each sub-layer (norm_position "sandwich": the placement of Gemma's norms,
under GLM's names), q/k/v biases (no o_proj bias), gate and up fused into one `gate_up_proj`
(split into mtjax's two parameters on import, fused again on export), and RoPE on a share of each
head (partial_rotary_factor, 0.5 when config.json states none) rotating interleaved channel pairs
(2i, 2i + 1).
"""

from __future__ import annotations

import dataclasses

from mtjax.config import ModelConfig
from mtjax.layout import Layout
from mtjax.models.registry import Family, FamilyError, Piece, block_index, register
from mtjax.models.common import Reader, base_config, standard_pieces

# Glm4Config's defaults for keys save_pretrained may leave out (head_dim 128 whatever the width;
# partial_rotary_factor 0.5 for older files).
_DEFAULTS = dict(rms_norm_eps=1.5625e-07, tie_word_embeddings=False, hidden_act="silu",
                 head_dim=128, attention_bias=True, partial_rotary_factor=0.5,
                 pad_token_id=151329)
# mtjax path in a block -> its name under model.layers.<i>.
_NORMS = {
    ("attn_norm", "scale"): "input_layernorm.weight",
    ("post_attn_norm", "scale"): "post_self_attn_layernorm.weight",
    ("mlp_norm", "scale"): "post_attention_layernorm.weight",
    ("post_mlp_norm", "scale"): "post_mlp_layernorm.weight",
}


def _read(config: dict, where: str) -> dict:
  r = Reader(config, where, _DEFAULTS)
  act = r.act("hidden_act", {"silu": "silu"})
  fields = dict(r.shape(), **r.rope(), mlp_act=act, norm_position="sandwich",
                qkv_bias=bool(r.opt("attention_bias")))
  fields["rope"] = dataclasses.replace(fields["rope"], interleave=True)
  return fields


def _write(cfg: ModelConfig, dtype: str) -> dict:
  if (cfg.norm_position, cfg.rope.interleave, cfg.o_bias) != ("sandwich", True, False):
    raise FamilyError("glm4: a config.json needs norm_position sandwich, rope.interleave true "
                      "and no o_bias")
  out = base_config(cfg, "Glm4ForCausalLM", "glm4", dtype)
  out["rope_parameters"]["partial_rotary_factor"] = cfg.rope.partial  # 1.0 too: not the default
  out.update(hidden_act="silu", attention_bias=cfg.qkv_bias,
             partial_rotary_factor=cfg.rope.partial,
             # Glm4Config's token ids are GLM-4's tokenizer's: unknown here.
             bos_token_id=None, eos_token_id=None)
  return out


def _pieces(cfg: ModelConfig, group: str, layout: Layout) -> list[Piece]:
  """Llama's names, GLM's norms, and gate/up rows of one `gate_up_proj` (gate first)."""
  i = block_index(group)
  pieces = standard_pieces(cfg, group, layout, _NORMS.get if i is not None else None)
  if i is None:
    return pieces
  F = cfg.ffn
  gate_up = f"model.layers.{i}.mlp.gate_up_proj.weight"
  rows = {("mlp", "gate", "kernel"): 0, ("mlp", "up", "kernel"): F}
  return [Piece(gate_up, (2 * F, p.shape[1]), p.path, src=(slice(rows[p.path], rows[p.path] + F),),
                transpose=True) if p.path in rows else p for p in pieces]


register(Family("glm4", ("Glm4ForCausalLM",), _read, _write, _pieces,
                notes="GLM-4-0414, GLM-Z1: norms before and after attention and MLP, q/k/v "
                      "biases, fused gate_up_proj, partial RoPE on interleaved pairs"))
