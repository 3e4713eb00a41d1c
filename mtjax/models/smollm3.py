"""The SmolLM3 family (SmolLM3ForCausalLM): a Llama-style decoder whose attention skips RoPE in
some layers (NoPE: `model.nope_layers`).

config.json lists per layer whether it rotates (`no_rope_layers`: 1 RoPE, 0 NoPE), or, without the
list, makes every `no_rope_layer_interval`-th layer NoPE. With `use_sliding_window` the NoPE layers
are windowed (transformers' derived `layer_types`), unless `layer_types` says otherwise.
"""

from __future__ import annotations

from mtjax.config import ModelConfig
from mtjax.models.registry import Family, FamilyError, register
from mtjax.models.common import Reader, base_config, layer_type_names, standard_pieces

# SmolLM3Config's defaults for keys save_pretrained may leave out.
_DEFAULTS = dict(rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_act="silu",
                 rope_theta=2e6, no_rope_layer_interval=4, use_sliding_window=False,
                 attention_bias=False, mlp_bias=False, pad_token_id=128004)


def _rotating(r: Reader, layers: int) -> list[bool]:
  """Whether each layer applies RoPE, as SmolLM3Config derives it."""
  flags = r.c.get("no_rope_layers")
  if flags is None:
    every = r.positive("no_rope_layer_interval")
    if isinstance(every, float):
      r.refuse("no_rope_layer_interval", "an integer number of layers")
    return [(i + 1) % every != 0 for i in range(layers)]
  if (not isinstance(flags, list) or len(flags) < layers
      or any(f not in (0, 1) or isinstance(f, float) for f in flags)):
    r.refuse("no_rope_layers", f"expected at least {layers} flags of 1 (RoPE) or 0 (NoPE)")
  return [bool(f) for f in flags[:layers]]


def _read(config: dict, where: str) -> dict:
  r = Reader(config, where, _DEFAULTS)
  act = r.act("hidden_act", {"silu": "silu"})
  fields = dict(r.shape(), **r.rope(), mlp_act=act)
  if fields["rope"].partial != 1.0:
    raise FamilyError(f"{where}: partial_rotary_factor={fields['rope'].partial} unsupported "
                      f"(transformers' SmolLM3 rotates whole heads)")
  layers = fields["layers"]
  rotating = _rotating(r, layers)
  if r.opt("attention_bias"):
    r.refuse("attention_bias", "mtjax's smollm3 family has no q/k/v/o biases")
  fields.update(nope_layers=tuple(i for i in range(layers) if not rotating[i]),
                mlp_bias=bool(r.opt("mlp_bias")))
  use = bool(r.opt("use_sliding_window")) and r.c.get("sliding_window") is not None
  if r.c.get("layer_types") is not None:
    types = r.layer_types(layers)
  else:
    types = tuple("sliding" if use and not rotating[i] else "full" for i in range(layers))
    types = None if "sliding" not in types else types
  if types is not None:
    if not use:  # transformers' attention then takes no window though the mask has one
      r.refuse("layer_types", "sliding layers need use_sliding_window true and a sliding_window")
    fields.update(sliding_window=int(r.positive("sliding_window")), layer_types=types)
  return fields


def _write(cfg: ModelConfig, dtype: str) -> dict:
  out = base_config(cfg, "SmolLM3ForCausalLM", "smollm3", dtype)
  windowed = cfg.layer_types is not None and "sliding" in cfg.layer_types
  if cfg.qkv_bias or cfg.o_bias:
    raise FamilyError("smollm3: model.qkv_bias / o_bias unsupported (no attention biases)")
  out.update(hidden_act="silu", attention_bias=False, mlp_bias=cfg.mlp_bias,
             no_rope_layers=[int(cfg.uses_rope(i)) for i in range(cfg.layers)],
             use_sliding_window=windowed, sliding_window=cfg.sliding_window if windowed else None,
             layer_types=layer_type_names(cfg),
             # SmolLM3Config's token ids are SmolLM3's tokenizer's: unknown here.
             bos_token_id=None, eos_token_id=None)
  return out


register(Family("smollm3", ("SmolLM3ForCausalLM",), _read, _write, standard_pieces,
                notes="SmolLM3: NoPE layers (no_rope_layers, or every no_rope_layer_interval-th), "
                      "MLP biases, sliding NoPE layers when use_sliding_window; no attention "
                      "biases, whole-head RoPE only"))
