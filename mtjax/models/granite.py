"""The Granite family (GraniteForCausalLM): IBM Granite 3.x dense models, a Llama-style decoder with
four scalars muP-style training set: the embedding times `embedding_multiplier`, each sub-layer's
output times `residual_multiplier` before its residual add, attention logits scaled by
`attention_multiplier` (in place of 1 / sqrt(head_dim)), logits divided by `logits_scaling`."""

from __future__ import annotations

from mtjax.config import ModelConfig
from mtjax.models.registry import Family, FamilyError, register
from mtjax.models.common import Reader, base_config, standard_pieces

# GraniteConfig's defaults for keys save_pretrained may leave out.
_DEFAULTS = dict(rms_norm_eps=1e-6, tie_word_embeddings=False, hidden_act="silu",
                 attention_bias=False, mlp_bias=False, embedding_multiplier=1.0,
                 residual_multiplier=1.0, attention_multiplier=1.0, logits_scaling=1.0)


def _read(config: dict, where: str) -> dict:
  r = Reader(config, where, _DEFAULTS)
  act = r.act("hidden_act", {"silu": "silu"})
  fields = dict(r.shape(), **r.rope(), mlp_act=act)
  if fields["rope"].partial != 1.0:
    raise FamilyError(f"{where}: partial_rotary_factor={fields['rope'].partial} unsupported "
                      f"(transformers' Granite rotates whole heads)")
  bias = bool(r.opt("attention_bias"))
  scale = float(r.positive("attention_multiplier"))
  head_dim = fields["head_dim"] or fields["hidden"] // fields["heads"]
  fields.update(qkv_bias=bias, o_bias=bias, mlp_bias=bool(r.opt("mlp_bias")),
                embed_multiplier=float(r.positive("embedding_multiplier")),
                residual_multiplier=float(r.positive("residual_multiplier")),
                query_scale=None if scale == head_dim ** -0.5 else scale,
                logits_divisor=float(r.positive("logits_scaling")))
  return fields


def _write(cfg: ModelConfig, dtype: str) -> dict:
  if cfg.qkv_bias != cfg.o_bias:
    raise FamilyError(f"granite: attention_bias covers q/k/v and o_proj together; model.qkv_bias="
                      f"{cfg.qkv_bias} and model.o_bias={cfg.o_bias} differ")
  out = base_config(cfg, "GraniteForCausalLM", "granite", dtype)
  scale = cfg.dim_per_head ** -0.5 if cfg.query_scale is None else cfg.query_scale
  out.update(hidden_act="silu", attention_bias=cfg.qkv_bias, mlp_bias=cfg.mlp_bias,
             embedding_multiplier=cfg.embed_multiplier,
             residual_multiplier=cfg.residual_multiplier, attention_multiplier=scale,
             logits_scaling=cfg.logits_divisor,
             # GraniteConfig's token ids are Granite's tokenizer's: unknown here.
             bos_token_id=None, eos_token_id=None)
  return out


register(Family("granite", ("GraniteForCausalLM",), _read, _write, standard_pieces,
                notes="Granite 3.x dense: embedding, residual and attention multipliers, logits "
                      "divided by logits_scaling, attention and MLP biases; whole-head RoPE only"))
