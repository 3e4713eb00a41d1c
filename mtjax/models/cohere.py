"""Cohere's decoders: Command R / R+ (CohereForCausalLM) and Command R7B / A (Cohere2ForCausalLM).

Both run attention and the MLP in parallel from one LayerNorm without a bias (mean subtracted,
`layer_norm_eps`), add both to the residual, rotate interleaved channel pairs (2i, 2i + 1), tie
the head by default and multiply the logits by `logit_scale`. Command R may norm q and k with a
LayerNorm over each head's channels and a weight per head (`use_qk_norm`). Command R7B has
sliding-window layers with RoPE and global full-attention layers without (NoPE), from
`layer_types` or, in older files, every `sliding_window_pattern`-th layer global.
"""

from __future__ import annotations

import dataclasses

from mtjax.config import ModelConfig
from mtjax.models.registry import Family, FamilyError, register
from mtjax.models.common import Reader, base_config, layer_type_names, standard_pieces

# CohereConfig's / Cohere2Config's values for keys save_pretrained may leave out.
_SHARED = dict(layer_norm_eps=1e-5, tie_word_embeddings=True, hidden_act="silu", logit_scale=0.0625,
               attention_bias=False, attention_dropout=0.0, pad_token_id=0,
               max_position_embeddings=8192, rope_theta=500000.0)
_DEFAULTS = {"cohere": dict(_SHARED, use_qk_norm=False),
             "cohere2": dict(_SHARED, sliding_window=4096)}
_PATTERN = 4  # Cohere2Config: every 4th layer global when neither layer_types nor a pattern is given


def _cohere2_layers(r: Reader, layers: int) -> dict:
  """Sliding layers (RoPE, a window) and global ones (NoPE), as Cohere2Config derives them."""
  if r.c.get("layer_types") is not None:
    types = r.layer_types(layers) or ("full",) * layers
  else:
    every = r.opt("sliding_window_pattern", _PATTERN)
    if isinstance(every, bool) or not isinstance(every, int) or every <= 0:
      r.refuse("sliding_window_pattern", "expected a positive integer")
    types = tuple("sliding" if (i + 1) % every else "full" for i in range(layers))
  fields = dict(nope_layers=tuple(i for i, t in enumerate(types) if t == "full"))
  if "sliding" in types:
    fields.update(layer_types=types, sliding_window=int(r.positive("sliding_window")))
  return fields


def _read(family: str):
  def read(config: dict, where: str) -> dict:
    r = Reader(config, where, _DEFAULTS[family])
    r.c["rms_norm_eps"] = r.positive("layer_norm_eps")  # what Reader.shape reads
    if family == "cohere2":  # Cohere2Config sets head_dim = hidden / heads whatever the file says
      r.c["head_dim"] = None
    act = r.act("hidden_act", {"silu": "silu"})
    if r.opt("attention_dropout") != 0:
      r.refuse("attention_dropout", "mtjax's attention has no dropout")
    fields = dict(r.shape(), **r.rope(), mlp_act=act, norm_kind="layer", parallel_block=True,
                  logit_scale=float(r.positive("logit_scale")))
    rope = fields["rope"]
    if rope.partial != 1.0:
      r.refuse("partial_rotary_factor", "Cohere rotates whole heads")
    fields["rope"] = dataclasses.replace(rope, interleave=True)
    bias = bool(r.opt("attention_bias"))
    fields.update(qkv_bias=bias, o_bias=bias)
    if family == "cohere":
      if r.opt("use_qk_norm"):
        fields.update(qk_norm=True, qk_norm_scope="each_head")
    else:
      fields.update(_cohere2_layers(r, fields["layers"]))
    return fields
  return read


def _write(arch: str, model_type: str):
  def write(cfg: ModelConfig, dtype: str) -> dict:
    out = base_config(cfg, arch, model_type, dtype)
    out["layer_norm_eps"] = out.pop("rms_norm_eps")
    out.update(hidden_act="silu", logit_scale=cfg.logit_scale, attention_bias=cfg.qkv_bias,
               attention_dropout=0.0)
    if model_type == "cohere":
      out["use_qk_norm"] = cfg.qk_norm
    else:
      full = tuple(i for i in range(cfg.layers) if cfg.layer_type(i) == "full")
      if cfg.nope_layers != full:
        raise FamilyError(f"model.nope_layers={list(cfg.nope_layers)} unsupported by {arch} (its "
                          f"full-attention layers {list(full)}, and only they, apply no RoPE)")
      out.update(layer_types=layer_type_names(cfg), sliding_window=cfg.sliding_window)
    return out
  return write


NOTES = {
    "cohere": ("Command R, R+ (parallel attention and MLP from one bias-free LayerNorm, "
               "interleaved RoPE, logit_scale, tied head; q/k LayerNorms per head when "
               "use_qk_norm; attention_bias)"),
    "cohere2": ("Command R7B / A (Command R's block; sliding-window layers with RoPE, global "
                "layers without, from layer_types or sliding_window_pattern)"),
}
for name, arch in (("cohere", "CohereForCausalLM"), ("cohere2", "Cohere2ForCausalLM")):
  register(Family(name, (arch,), _read(name), _write(arch, name), standard_pieces,
                  notes=NOTES[name]))
