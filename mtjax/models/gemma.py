"""The Gemma family: Gemma 2 and Gemma 3 (text), as transformers computes them.

Both scale the embedding by sqrt(hidden) (rounded to the activations' dtype), scale norms by
(1 + w), put norms before and after each sub-layer, tie the head (by default), use a tanh-GELU
gated MLP, scale the attention logits by query_pre_attn_scalar^-0.5 and alternate sliding-window
layers with global ones (`layer_types`). Gemma 2 soft-caps the attention and the final logits.
Gemma 3 adds q/k norms per head and rotates sliding layers by a base of their own
(`rope.local_theta`, unscaled) while the global layers take `full_attention`'s base and scaling;
transformers' Gemma 3 applies no attention soft-cap whatever `attn_logit_softcapping` says, so
neither does mtjax.

`gemma3_vl` is Gemma3ForConditionalGeneration: a SigLIP vision tower (mtjax.models.vision)
whose last hidden state, post-normed, is average-pooled to `mm_tokens_per_image` tokens an image,
RMS-normed (1 + w, the tower's epsilon) and multiplied by `mm_input_projection_weight`; the
features replace the `image_token_index` tokens' embeddings (after the sqrt(hidden) scale, which
they do not take) in the Gemma 3 text model, whose image tokens attend to each other
bidirectionally within each contiguous run (`model.vision.image_attention`; transformers does so
given token_type_ids). Its head is never soft-capped (transformers' Gemma3ForConditionalGeneration
applies no `final_logit_softcapping`) and its tying is the top level's `tie_word_embeddings`.
SigLIP's attention-pooling head (`vision_use_head`) is not in Gemma 3's computation: its tensors
are tolerated, not read. The tower's post-norm (`vision_tower.post_layernorm`) runs in the
projector's group, so `train.freeze: [vision]` leaves it training; freezing the projector holds it.
A text-only run may set `model.vision.max_images: 0`: the tower then computes nothing (its
weights still stream; frozen, they hold no optimizer state). Tensors are read in LLaVA's
spellings (mtjax.models.llava.RENAMES): `vision_tower.*` (what transformers writes) or
`vision_tower.vision_model.*` (the hub's files), and the `model.*` / `lm_head.weight` style.
"""

from __future__ import annotations

import dataclasses
import math

from mtjax.config import ModelConfig, VisionConfig
from mtjax.layout import Layout
from mtjax.models import llava
from mtjax.models.registry import Family, FamilyError, Piece, register, rotary_buffers
from mtjax.models.common import (Reader, base_config, layer_type_names, rope_parameters,
                                 standard_pieces)

# transformers' values for keys config.json may leave out (Gemma2Config, Gemma3TextConfig):
# published Gemma 3 vision-language configs give only a few keys of their text_config.
_SHARED = dict(num_attention_heads=8, num_key_value_heads=4, head_dim=256,
               hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6, tie_word_embeddings=True,
               query_pre_attn_scalar=256, sliding_window=4096, attention_bias=False, pad_token_id=0,
               hidden_size=2304, intermediate_size=9216, num_hidden_layers=26)
_DEFAULTS = {
    "gemma2": dict(_SHARED, vocab_size=256000, max_position_embeddings=8192,
                   final_logit_softcapping=30.0, attn_logit_softcapping=50.0, rope_theta=10000.0),
    "gemma3": dict(_SHARED, vocab_size=262208, max_position_embeddings=131072,
                   rope_theta=1_000_000.0, rope_local_base_freq=10000.0),
}
# Every `sliding_window_pattern`-th layer is global when config.json gives no layer_types.
_PATTERN = {"gemma2": 2, "gemma3": 6}
_ROPE_SCALED = ("llama3", "yarn", "longrope")  # take original_max_position_embeddings


def _layer_types(r: Reader, family: str, layers: int) -> tuple[str, ...] | None:
  if r.c.get("layer_types") is not None:
    return r.layer_types(layers)
  every = _PATTERN[family]
  if family == "gemma3":  # Gemma 2 has no such key
    every = r.opt("sliding_window_pattern", every)
  if isinstance(every, bool) or not isinstance(every, int) or every <= 0:
    r.refuse("sliding_window_pattern", "expected a positive integer")
  types = tuple("sliding" if (i + 1) % every else "full" for i in range(layers))
  return None if "sliding" not in types else types


def _gemma3_rope(r: Reader) -> dict:
  """RoPE fields of Gemma 3: `full_attention`'s rule for global layers, `sliding_attention`'s
  base for sliding ones, merged from both key styles as Gemma3TextConfig merges them."""
  nested = r.c.get("rope_parameters") or {}
  if not isinstance(nested, dict):
    r.refuse("rope_parameters", "expected a dict per layer type")

  def params(layer_type: str, scaling: dict, theta_key: str) -> dict:
    p = nested.get(layer_type)
    if p is not None and not isinstance(p, dict):
      r.refuse("rope_parameters", f"{layer_type} is not a dict")
    p = {**(p or {"rope_type": "default"}), **scaling}
    p.setdefault("rope_theta", r.opt(theta_key))
    p.setdefault("rope_type", p.get("type", "default"))
    if p["rope_type"] in _ROPE_SCALED:
      p.setdefault("original_max_position_embeddings", r.opt("max_position_embeddings"))
    return p

  scaling = r.c.get("rope_scaling") or {}  # older files: the global layers' scaling
  if not isinstance(scaling, dict):
    r.refuse("rope_scaling", "expected a dict")
  full = params("full_attention", scaling, "rope_theta")
  local = params("sliding_attention", {}, "rope_local_base_freq")
  where = f"{r.where} rope_parameters"
  fields = Reader({"rope_parameters": full}, f"{where}.full_attention").rope()
  if local == full:  # sliding layers rotate as global ones
    return fields
  sliding = Reader({"rope_parameters": local}, f"{where}.sliding_attention").rope()["rope"]
  if sliding.scaling != "none" or sliding.partial != 1.0:
    r.refuse("rope_parameters", "sliding_attention must be an unscaled default RoPE, or the same "
             "as full_attention")
  return {"rope": dataclasses.replace(fields["rope"], local_theta=sliding.theta)}


def _read_text(family: str, config: dict, where: str, final_softcap: bool = True) -> dict:
  """ModelConfig fields of a Gemma 2 or Gemma 3 text config."""
  r = Reader(config, where, _DEFAULTS[family])
  fields = dict(r.shape(), mlp_act=r.act("hidden_activation", {"gelu_pytorch_tanh": "gelu_tanh"}),
                norm_offset=True, norm_position="sandwich", embed_scale=True)
  if r.opt("attention_bias"):
    r.refuse("attention_bias", "Gemma's q/k/v and o_proj biases are not in mtjax's gemma family")
  if r.opt("use_bidirectional_attention"):
    r.refuse("use_bidirectional_attention", "mtjax trains causal decoders")
  if family == "gemma2":
    fields.update(r.rope())
  else:
    fields.update(_gemma3_rope(r), qk_norm=True)
  if fields["rope"].partial != 1.0 or r.opt("partial_rotary_factor", 1.0) != 1.0:
    r.refuse("partial_rotary_factor", "Gemma rotates every channel of a head")
  layers = fields["layers"]
  types = _layer_types(r, family, layers)
  window = r.positive("sliding_window", required=False)
  if types is not None and window is None:
    r.refuse("sliding_window", "layer_types has sliding layers")
  head_dim = fields["head_dim"] or fields["hidden"] // fields["heads"]
  scalar = r.positive("query_pre_attn_scalar")
  attn_cap = r.positive("attn_logit_softcapping", required=False) if family == "gemma2" else None
  final_cap = r.positive("final_logit_softcapping", required=False) if final_softcap else None
  return dict(fields, layer_types=types, sliding_window=None if window is None else int(window),
              # None is mtjax's default scale, 1 / sqrt(head_dim): the one spelling of it.
              query_scale=None if scalar == head_dim else float(scalar) ** -0.5,
              attn_softcap=None if attn_cap is None else float(attn_cap),
              final_softcap=None if final_cap is None else float(final_cap))


def _read(family: str):
  def read(config: dict, where: str) -> dict:
    return _read_text(family, config, where)
  return read


# transformers' values for keys a Gemma3Config may leave out: SiglipVisionConfig's and its own.
_SIGLIP = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
               num_attention_heads=12, num_channels=3, image_size=224, patch_size=16,
               hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6)
_VL = dict(tie_word_embeddings=True, mm_tokens_per_image=256, image_token_index=262144)


def _read_vl(config: dict, where: str) -> dict:
  """A Gemma3ForConditionalGeneration config.json: its text model, SigLIP tower and projector."""
  text, vc = (config.get(key) or {} for key in ("text_config", "vision_config"))
  for key, value in (("text_config", text), ("vision_config", vc)):
    if not isinstance(value, dict):
      raise FamilyError(f"{where}: {key}={value!r} unsupported (expected a dict)")
  fields = _read_text("gemma3", text, f"{where} text_config", final_softcap=False)
  r = Reader(config, where, _VL)
  # The head ties by the top level's flag, not text_config's.
  fields["tie_embeddings"] = bool(r.opt("tie_word_embeddings"))
  if vc.get("model_type", "siglip_vision_model") != "siglip_vision_model":
    raise FamilyError(f"{where}: vision_config.model_type={vc.get('model_type')!r} unsupported "
                      "(siglip_vision_model)")
  vwhere = f"{where} vision_config"
  tower = llava.read_tower({**_SIGLIP, **vc}, vwhere, tower="siglip", projector="pool",
                           layers=Reader(vc, vwhere, _SIGLIP).positive("num_hidden_layers"))
  side, ragged = divmod(tower["image_size"], tower["patch"])
  tokens = r.positive("mm_tokens_per_image")
  pooled = math.isqrt(tokens)  # image tokens a side after the average pool
  if ragged or pooled * pooled != tokens or side % pooled:
    r.refuse("mm_tokens_per_image", f"a square whose side divides the {side} patches a side")
  token = config.get("image_token_id", r.opt("image_token_index"))
  if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < fields["vocab_size"]:
    raise FamilyError(f"{where}: image_token_index={token!r} unsupported (a token id below "
                      f"vocab_size {fields['vocab_size']}: mtjax's batches hold no other ids)")
  fields["vision"] = VisionConfig(**tower, image_token_id=token,
                                  tokens_per_image=None if tokens == side * side else tokens,
                                  image_attention="bidirectional")
  return fields


def _write_text(cfg: ModelConfig, arch: str, model_type: str, dtype: str) -> dict:
  out = base_config(cfg, arch, model_type, dtype)
  head_dim = cfg.dim_per_head
  scale = cfg.query_scale
  scalar = head_dim if scale is None else round(scale ** -2)
  if scale is not None and float(scalar) ** -0.5 != scale:
    raise FamilyError(f"model.query_scale={scale} unsupported by {arch} (query_pre_attn_scalar "
                      f"^ -0.5 of an integer)")
  out.update(hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=scalar,
             sliding_window=cfg.sliding_window, layer_types=layer_type_names(cfg),
             attn_logit_softcapping=cfg.attn_softcap, final_logit_softcapping=cfg.final_softcap,
             attention_bias=False, use_bidirectional_attention=False)
  if model_type != "gemma2":  # rope per layer type; no flat keys, which Gemma 3 would not read
    full = rope_parameters(cfg)
    local = (full if cfg.rope.local_theta is None
             else {"rope_type": "default", "rope_theta": cfg.rope.local_theta})
    out.update(rope_parameters={"full_attention": full, "sliding_attention": local})
    for key in ("rope_theta", "rope_scaling"):
      out.pop(key)
  return out


def _write(arch: str, model_type: str):
  def write(cfg: ModelConfig, dtype: str) -> dict:
    return _write_text(cfg, arch, model_type, dtype)
  return write


def _write_vl(cfg: ModelConfig, dtype: str) -> dict:
  """A whole Gemma3Config: the text model's keys as Gemma3ForCausalLM's, the SigLIP tower's, the
  projector's."""
  v = cfg.vision
  if v is None or (v.tower, v.projector) != ("siglip", "pool"):
    raise FamilyError("gemma3_vl: an export needs model.vision with a siglip tower and the pool "
                      "projector (Gemma 3's)")
  text = _write_text(dataclasses.replace(cfg, family="gemma3", vision=None), "Gemma3ForCausalLM",
                     "gemma3_text", dtype)
  text.pop("architectures")
  tower = {"model_type": "siglip_vision_model", "hidden_size": v.hidden,
           "intermediate_size": v.ffn, "num_hidden_layers": v.layers,
           "num_attention_heads": v.heads, "image_size": v.image_size, "patch_size": v.patch,
           "num_channels": v.channels, "layer_norm_eps": v.norm_eps,
           "hidden_act": {a: b for b, a in llava.TOWER_ACTS.items()}[v.act],
           "vision_use_head": False}
  return {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
          "text_config": text, "vision_config": tower, "mm_tokens_per_image": v.image_tokens,
          "image_token_index": v.image_token_id, "tie_word_embeddings": cfg.tie_embeddings,
          "torch_dtype": dtype}


# the projector's parameters -> their tensors (the tower's post-norm is SigLIP's, read there)
_PROJECTOR = {("post_norm", "scale"): "vision_tower.post_layernorm.weight",
              ("post_norm", "bias"): "vision_tower.post_layernorm.bias",
              ("norm", "scale"): "multi_modal_projector.mm_soft_emb_norm.weight",
              ("proj", "kernel"): "multi_modal_projector.mm_input_projection_weight"}


def _pieces_vl(cfg: ModelConfig, group: str, layout: Layout) -> list[Piece]:
  """The tensors as transformers saves Gemma3ForConditionalGeneration: `vision_tower.*`,
  `multi_modal_projector.*` (the projection [tower width, hidden], as stored: no transpose),
  `language_model.model.*` and `language_model.lm_head.weight`."""
  tower = llava.tower_pieces(group, layout, "vision_tower.", llava.EMBED, llava.BLOCK, {})
  if tower is not None:
    return tower
  if group == "projector":
    return [Piece(_PROJECTOR[path], tuple(shape), path)
            for path, shape in zip(layout.paths, layout.shapes)]
  return [Piece(f"language_model.{p.name}", p.shape, p.path, p.src, p.dst, p.transpose)
          for p in standard_pieces(cfg, group, layout)]


def _ignored(config: dict, name: str) -> bool:
  """SigLIP's attention-pooling head (never computed) and RoPE buffers."""
  return name.startswith("vision_tower.head.") or rotary_buffers(config, name)


register(Family(
    "gemma2", ("Gemma2ForCausalLM",), _read("gemma2"), _write("Gemma2ForCausalLM", "gemma2"),
    standard_pieces,
    notes="Gemma 2: attention and final logit soft-caps, sliding layers, query_pre_attn_scalar"))
register(Family(
    "gemma3", ("Gemma3ForCausalLM",), _read("gemma3"), _write("Gemma3ForCausalLM", "gemma3_text"),
    standard_pieces,
    notes="Gemma 3 text (1B and the text of larger ones): q/k norms, local and global RoPE bases, "
          "5:1 sliding layers; no attention soft-cap (transformers applies none)"))
register(Family(
    "gemma3_vl", ("Gemma3ForConditionalGeneration",), _read_vl, _write_vl, _pieces_vl,
    ignored=_ignored, renames=llava.RENAMES,
    notes="Gemma 3 4B/12B/27B with its SigLIP tower and pooled projector; image tokens attend "
          "to each other bidirectionally (model.vision.image_attention)"))
