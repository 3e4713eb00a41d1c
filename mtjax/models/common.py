"""What families share: reading config.json (both key styles in the wild), writing it back, and the
Llama-style tensor names most families use.

transformers 5 writes `rope_parameters` (the base inside it, per layer type for Gemma 3); older
files carry `rope_theta` and `rope_scaling` (with `type` or `rope_type`). Both read the same.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mtjax.config import ConfigError, ModelConfig, RopeConfig
from mtjax.layout import Layout
from mtjax.models.registry import FamilyError, Piece, block_index


class Reader:
  """A config.json with the family's defaults for keys save_pretrained may leave out; every
  error names the file and the key."""

  def __init__(self, config: dict, where: str, defaults: dict | None = None):
    self.c = {**(defaults or {}), **config}
    self.where = where

  def get(self, key: str) -> Any:
    """A required key."""
    if self.c.get(key) is None:
      raise FamilyError(f"{self.where}: required key {key!r} missing")
    return self.c[key]

  def opt(self, key: str, default: Any = None) -> Any:
    value = self.c.get(key)
    return default if value is None else value

  def refuse(self, key: str, why: str):
    raise FamilyError(f"{self.where}: {key}={self.c.get(key)!r} unsupported ({why})")

  def positive(self, key: str, required: bool = True) -> int | float | None:
    """A number > 0 (an int stays an int)."""
    value = self.get(key) if required else self.c.get(key)
    if value is None:
      return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
      raise FamilyError(f"{self.where}: {key}={value!r} must be a positive number")
    return value

  def shape(self) -> dict:
    """The fields every decoder has: sizes, heads, the tied head, the norm epsilon, the longest
    sequence."""
    hidden, heads = self.positive("hidden_size"), self.positive("num_attention_heads")
    kv = self.positive("num_key_value_heads", required=False) or heads
    head_dim = self.positive("head_dim", required=False) or hidden // heads
    if heads % kv:
      raise FamilyError(f"{self.where}: num_key_value_heads={kv} must divide "
                        f"num_attention_heads={heads}")
    vocab = self.positive("vocab_size")
    pad = self.c.get("pad_token_id")
    pad = pad if isinstance(pad, int) and not isinstance(pad, bool) and 0 <= pad < vocab else None
    max_position = self.positive("max_position_embeddings", required=False)
    return dict(vocab_size=vocab, hidden=hidden, pad_token_id=pad,
                max_position=None if max_position is None else int(max_position),
                layers=self.positive("num_hidden_layers"), heads=heads, kv_heads=kv,
                head_dim=None if head_dim * heads == hidden else head_dim,
                ffn=self.positive("intermediate_size"),
                tie_embeddings=bool(self.opt("tie_word_embeddings", False)),
                norm_eps=float(self.positive("rms_norm_eps")))

  def act(self, key: str, allowed: dict[str, str]) -> str:
    """The MLP activation under `key`, as an mtjax `mlp_act`."""
    value = self.opt(key, "silu")
    if value not in allowed:
      self.refuse(key, f"mtjax's gated MLP takes {', '.join(sorted(allowed))}")
    return allowed[value]

  def rope(self, layer_type: str | None = None) -> dict:
    """The `rope` field: base, scaling rule and its parameters, partial rotation."""
    key = "rope_parameters" if self.c.get("rope_parameters") is not None else "rope_scaling"
    rope = self.c.get(key) or {}
    if not isinstance(rope, dict):
      raise FamilyError(f"{self.where}: {key}={rope!r} unsupported (expected a dict)")
    if layer_type is not None and layer_type in rope:  # Gemma 3: per layer type
      rope = rope[layer_type]
    theta = rope.get("rope_theta", self.c.get("rope_theta", 10000.0))
    kind = rope.get("rope_type", rope.get("type", "default"))
    partial = rope.get("partial_rotary_factor", self.c.get("partial_rotary_factor", 1.0))
    out = dict(theta=float(theta), partial=float(partial))

    def need(k):
      if rope.get(k) is None:
        raise FamilyError(f"{self.where}: {key} of type {kind!r} lacks {k!r}")
      return rope[k]

    orig = rope.get("original_max_position_embeddings",
                    self.c.get("original_max_position_embeddings"))
    if kind == "default":
      out.update(scaling="none")
    elif kind == "linear":
      out.update(scaling="linear", factor=float(need("factor")))
    elif kind == "llama3":
      out.update(scaling="llama3", factor=float(need("factor")),
                 low_freq_factor=float(need("low_freq_factor")),
                 high_freq_factor=float(need("high_freq_factor")),
                 original_max_len=int(need("original_max_position_embeddings")))
    elif kind == "longrope":
      orig = int(orig or self.get("max_position_embeddings"))
      factor = rope.get("factor") or self.get("max_position_embeddings") / orig
      out.update(scaling="longrope", factor=float(factor), original_max_len=orig,
                 short_factor=tuple(float(x) for x in need("short_factor")),
                 long_factor=tuple(float(x) for x in need("long_factor")),
                 attention_factor=_maybe_float(rope.get("attention_factor")))
    elif kind == "yarn":
      orig = int(orig or need("original_max_position_embeddings"))
      factor = rope.get("factor") or self.get("max_position_embeddings") / orig
      out.update(scaling="yarn", factor=float(factor), original_max_len=orig,
                 beta_fast=float(rope.get("beta_fast") or 32.0),
                 beta_slow=float(rope.get("beta_slow") or 1.0),
                 mscale=float(rope.get("mscale") or 0.0),
                 mscale_all_dim=float(rope.get("mscale_all_dim") or 0.0),
                 attention_factor=_maybe_float(rope.get("attention_factor")),
                 truncate=bool(rope.get("truncate", True)))
    else:
      raise FamilyError(f"{self.where}: {key} rope_type {kind!r} unsupported (default, linear, "
                        f"llama3, longrope, yarn)")
    try:
      return {"rope": RopeConfig(**out)}
    except ConfigError as e:  # a value mtjax's RoPE cannot take, named as config.json spells it
      raise FamilyError(f"{self.where}: {key}={rope!r} unsupported ({e})") from None

  def layer_types(self, layers: int, default: str = "full", chunked: bool = False
                  ) -> tuple[str, ...] | None:
    """`layer_types` as mtjax's full/sliding (/chunked where the family has chunked layers), or
    None when every layer is full."""
    names = self.c.get("layer_types")
    if names is None:
      return None if default == "full" else (default,) * layers
    mapping = {"full_attention": "full", "sliding_attention": "sliding"}
    if chunked:
      mapping["chunked_attention"] = "chunked"
    if len(names) != layers or any(n not in mapping for n in names):
      self.refuse("layer_types", f"expected {layers} of {' / '.join(mapping)}")
    out = tuple(mapping[n] for n in names)
    return None if all(t == "full" for t in out) else out


def _maybe_float(x):
  return None if x is None else float(x)


def rope_parameters(cfg: ModelConfig) -> dict:
  """transformers 5's `rope_parameters` of a config (the base inside)."""
  r = cfg.rope
  rope = {"rope_type": "default" if r.scaling == "none" else r.scaling, "rope_theta": r.theta}
  if r.partial != 1.0:
    rope["partial_rotary_factor"] = r.partial
  if r.scaling in ("linear", "llama3", "longrope", "yarn"):
    rope["factor"] = r.factor
  if r.scaling == "llama3":
    rope.update(low_freq_factor=r.low_freq_factor, high_freq_factor=r.high_freq_factor,
                original_max_position_embeddings=r.original_max_len)
  if r.scaling == "longrope":
    rope.update(short_factor=list(r.short_factor), long_factor=list(r.long_factor),
                original_max_position_embeddings=r.original_max_len)
  if r.scaling == "yarn":
    rope.update(beta_fast=r.beta_fast, beta_slow=r.beta_slow,
                original_max_position_embeddings=r.original_max_len, truncate=r.truncate)
    if r.mscale or r.mscale_all_dim:
      rope.update(mscale=r.mscale, mscale_all_dim=r.mscale_all_dim)
  if r.scaling != "none" and r.attention_factor is not None:
    rope["attention_factor"] = r.attention_factor
  return rope


def base_config(cfg: ModelConfig, arch: str, model_type: str, dtype: str) -> dict:
  """The config.json keys every decoder family writes."""
  r = cfg.rope
  return {
      "architectures": [arch], "model_type": model_type,
      "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden, "intermediate_size": cfg.ffn,
      "num_hidden_layers": cfg.layers, "num_attention_heads": cfg.heads,
      "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.dim_per_head,
      "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings,
      "pad_token_id": cfg.pad_token_id,
      # A model that states no length gets its RoPE's context (what generation tools read).
      "max_position_embeddings": cfg.max_position or max(r.original_max_len,
                                                         int(r.original_max_len * r.factor)),
      # Both spellings: transformers >= 5 reads rope_parameters, older readers rope_theta/scaling.
      "rope_theta": r.theta, "rope_parameters": rope_parameters(cfg),
      "rope_scaling": None if r.scaling == "none" else rope_parameters(cfg),
      "torch_dtype": dtype,
  }


def layer_type_names(cfg: ModelConfig) -> list[str]:
  names = {"full": "full_attention", "sliding": "sliding_attention", "chunked": "chunked_attention"}
  return [names[cfg.layer_type(i)] for i in range(cfg.layers)]


# ------------------------------------------------------------------------------- tensor names

# mtjax parameter path inside a block -> its name under model.layers.<i>. (pre-norm placement)
BLOCK_NAMES = {
    ("attn_norm", "scale"): "input_layernorm.weight",
    ("mlp_norm", "scale"): "post_attention_layernorm.weight",
    ("attn", "q_norm", "scale"): "self_attn.q_norm.weight",
    ("attn", "k_norm", "scale"): "self_attn.k_norm.weight",
    ("attn", "sinks"): "self_attn.sinks",
}
# Norms after the sub-layers (sandwich: Gemma; post: OLMo 2) take other names.
SANDWICH_NAMES = {
    ("attn_norm", "scale"): "input_layernorm.weight",
    ("post_attn_norm", "scale"): "post_attention_layernorm.weight",
    ("mlp_norm", "scale"): "pre_feedforward_layernorm.weight",
    ("post_mlp_norm", "scale"): "post_feedforward_layernorm.weight",
}


def linear_name(path: tuple[str, ...], module: str) -> str | None:
  """`<module>.<x>_proj.weight|bias` of a flax Dense at (sub, x, kernel|bias)."""
  if len(path) == 3 and path[2] in ("kernel", "bias"):
    return f"{module}.{path[1]}_proj.{'weight' if path[2] == 'kernel' else 'bias'}"
  return None


def one_to_one(name: str, path, shape) -> Piece:
  """The piece of a parameter that is one Hugging Face tensor, transposed if it is a kernel."""
  transpose = path[-1] == "kernel" or path == ("out",)
  return Piece(name, tuple(reversed(shape)) if transpose else tuple(shape), tuple(path),
               transpose=transpose)


def standard_pieces(cfg: ModelConfig, group: str, layout: Layout, block_name=None) -> list[Piece]:
  """Llama-style names for every parameter of a group (embed, head, or a block with the
  attention and dense MLP of mtjax.models.layers). `block_name(path) -> name or None` names the
  parameters a family keeps elsewhere (its MoE, say) first."""
  i = block_index(group)
  out = []
  for path, shape in zip(layout.paths, layout.shapes):
    if i is None:
      name = {("table",): "model.embed_tokens.weight", ("norm", "scale"): "model.norm.weight",
              ("out",): "lm_head.weight"}.get(path)
    else:
      name = block_name(path) if block_name else None
      if name is None:
        names = BLOCK_NAMES if cfg.norm_position == "pre" else {**BLOCK_NAMES, **SANDWICH_NAMES}
        name = names.get(path) or (linear_name(path, "self_attn") if path[0] == "attn" else None)
        if name is None and path[0] == "mlp":
          name = linear_name(path, "mlp")
      if name is not None:
        name = f"model.layers.{i}.{name}"
    if name is None:
      raise FamilyError(f"{group}: parameter {'/'.join(path)} has no Hugging Face name")
    out.append(one_to_one(name, path, shape))
  return out


def expert_pieces(layer: int, path, shape, name_of) -> list[Piece]:
  """One piece per expert of a stacked [E, a, b] kernel from per-expert [b, a] Linear weights
  named `name_of(e)` (transposed), or of a stacked [E, n] bias from [n] ones."""
  E = shape[0]
  if len(shape) == 3:
    return [Piece(f"model.layers.{layer}.{name_of(e)}", (shape[2], shape[1]), tuple(path),
                  dst=(e,), transpose=True) for e in range(E)]
  return [Piece(f"model.layers.{layer}.{name_of(e)}", tuple(shape[1:]), tuple(path), dst=(e,))
          for e in range(E)]


def size(shape) -> int:
  return int(np.prod(shape))
