"""LLaVA (LlavaForConditionalGeneration): a CLIP vision tower whose features, taken after the
`vision_feature_layer`-th block (the class token dropped under the "default" strategy), pass a
two-linear projector and replace the image tokens' embeddings in a Llama / Mistral / Qwen2 text
model (mtjax.models.vision).

The tower's blocks after the feature layer and its post-norm change nothing the model computes:
they are left out (tolerated on import; an export with the source leaves transformers to
initialise them). Checkpoints spell the tensors three ways, all read: `vision_tower.*` with
`language_model.model.*` (what transformers writes), the same with `vision_tower.vision_model.*`
(the hub's llava-hf files), and `model.vision_tower.* / model.language_model.* / lm_head.weight`.
"""

from __future__ import annotations

import dataclasses
import re

from mtjax.config import ModelConfig, VisionConfig
from mtjax.layout import Layout
from mtjax.models.common import Reader, standard_pieces
from mtjax.models.registry import Family, FamilyError, Piece, get, register, rotary_buffers

_TEXT = ("llama", "mistral", "qwen2")  # the text models' model_type mtjax reads
_PROJECTOR_ACTS = {"gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh", "silu": "silu"}
TOWER_ACTS = {"quick_gelu": "quick_gelu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh"}

# Other spellings of a stored name -> the one the pieces use (applied in order, first match).
RENAMES = ((r"^(model\.)?vision_tower\.(vision_model\.)?", "vision_tower."),
           (r"^model\.language_model\.", "language_model.model."),
           (r"^lm_head\.", "language_model.lm_head."),
           (r"^model\.multi_modal_projector\.", "multi_modal_projector."))


def _dict(config: dict, key: str, where: str) -> dict:
  value = config.get(key)
  if not isinstance(value, dict):
    raise FamilyError(f"{where}: {key}={value!r} unsupported (expected a dict)")
  return value


def feature_layers(layer: int, blocks: int, where: str) -> int:
  """Tower blocks to run for hidden state `layer` (transformers' hidden_states index: 0 the
  embedding, k after block k, negative from the end) of `blocks`."""
  run = layer if layer >= 0 else blocks + 1 + layer
  if not 1 <= run <= blocks:
    raise FamilyError(f"{where}: vision_feature_layer={layer} unsupported (a block's output, "
                      f"1..{blocks} or -1..-{blocks})")
  return run


def read_tower(vc: dict, where: str, **fields) -> dict:
  """VisionConfig fields of a CLIP or SigLIP vision config (sizes, heads, activation, norm)."""
  r = Reader(vc, where, {"hidden_act": "quick_gelu", "layer_norm_eps": 1e-5, "num_channels": 3})
  act = r.opt("hidden_act")
  if act not in TOWER_ACTS:
    r.refuse("hidden_act", f"the tower's MLP takes {', '.join(TOWER_ACTS)}")
  return dict(hidden=r.positive("hidden_size"), heads=r.positive("num_attention_heads"),
              ffn=r.positive("intermediate_size"), image_size=r.positive("image_size"),
              patch=r.positive("patch_size"), channels=r.positive("num_channels"),
              act=TOWER_ACTS[act], norm_eps=float(r.positive("layer_norm_eps")), **fields)


def _read(config: dict, where: str) -> dict:
  text = _dict(config, "text_config", where)
  kind = text.get("model_type", "llama")
  if kind not in _TEXT:
    raise FamilyError(f"{where}: text_config.model_type={kind!r} unsupported ({', '.join(_TEXT)})")
  fields = get(kind).read_config(text, f"{where} text_config")
  vc = _dict(config, "vision_config", where)
  if vc.get("model_type", "clip_vision_model") != "clip_vision_model":
    raise FamilyError(f"{where}: vision_config.model_type={vc.get('model_type')!r} unsupported "
                      "(clip_vision_model)")
  r = Reader(config, where, {"vision_feature_layer": -2, "vision_feature_select_strategy":
                             "default", "projector_hidden_act": "gelu",
                             "multimodal_projector_bias": True})
  layer = r.opt("vision_feature_layer")
  if not isinstance(layer, int):
    r.refuse("vision_feature_layer", "one layer's features (a list concatenates several)")
  strategy = r.opt("vision_feature_select_strategy")
  if strategy not in ("default", "full"):
    r.refuse("vision_feature_select_strategy", "default or full")
  act = r.opt("projector_hidden_act")
  if act not in _PROJECTOR_ACTS:
    r.refuse("projector_hidden_act", f"{', '.join(_PROJECTOR_ACTS)}")
  token = config.get("image_token_id", config.get("image_token_index"))
  if not isinstance(token, int):
    raise FamilyError(f"{where}: image_token_id={token!r} must be a token id")
  blocks = Reader(vc, f"{where} vision_config").positive("num_hidden_layers")
  fields["vision"] = VisionConfig(**read_tower(
      vc, f"{where} vision_config", tower="clip",
      layers=feature_layers(layer, blocks, where), drop_cls=strategy == "default",
      projector="mlp", projector_act=_PROJECTOR_ACTS[act],
      projector_bias=bool(r.opt("multimodal_projector_bias")), image_token_id=token))
  fields["tie_embeddings"] = bool(config.get("tie_word_embeddings", fields["tie_embeddings"]))
  return fields


def _write(cfg: ModelConfig, dtype: str) -> dict:
  v = cfg.vision
  text_cfg = dataclasses.replace(cfg, family="llama", vision=None)
  text = get("llama").write_config(text_cfg, dtype)
  text.pop("architectures")
  tower = {"model_type": "clip_vision_model", "hidden_size": v.hidden,
           "intermediate_size": v.ffn, "num_hidden_layers": v.layers,
           "num_attention_heads": v.heads, "image_size": v.image_size, "patch_size": v.patch,
           "num_channels": v.channels, "layer_norm_eps": v.norm_eps,
           "hidden_act": {a: b for b, a in TOWER_ACTS.items()}[v.act]}
  return {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava",
          "text_config": text, "vision_config": tower, "image_token_id": v.image_token_id,
          "image_seq_length": v.image_tokens, "vision_feature_layer": -1,
          "vision_feature_select_strategy": "default" if v.drop_cls else "full",
          "projector_hidden_act": {a: b for b, a in _PROJECTOR_ACTS.items()}[v.projector_act],
          "multimodal_projector_bias": v.projector_bias,
          "tie_word_embeddings": cfg.tie_embeddings, "torch_dtype": dtype}


def linear(name: str, path: tuple[str, ...], shape) -> Piece:
  """A flax Dense's kernel ([in, out], from a torch Linear's [out, in]) or bias."""
  if path[-1] == "kernel":
    return Piece(f"{name}.weight", tuple(reversed(shape)), path, transpose=True)
  return Piece(f"{name}.{'bias' if path[-1] == 'bias' else 'weight'}", tuple(shape), path)


# a tower block's parameter (module) -> its name under encoder.layers.<i>.
BLOCK = {"norm1": "layer_norm1", "norm2": "layer_norm2", "q": "self_attn.q_proj",
         "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.out_proj",
         "fc1": "mlp.fc1", "fc2": "mlp.fc2"}
EMBED = {("patch",): "embeddings.patch_embedding.weight", ("cls",): "embeddings.class_embedding",
         ("position",): "embeddings.position_embedding.weight",
         ("patch_bias",): "embeddings.patch_embedding.bias"}


def tower_pieces(group: str, layout: Layout, prefix: str, embed_names: dict, block_names: dict,
                 norm_names: dict) -> list[Piece] | None:
  """The pieces of a vision tower group (its embedding or a block) under `prefix`; None for
  another group."""
  out = []
  if group == "vision_embed":
    for path, shape in zip(layout.paths, layout.shapes):
      if path in embed_names:
        out.append(Piece(prefix + embed_names[path], tuple(shape), path))
      else:
        out.append(linear(prefix + norm_names[path[0]], path, shape))
    return out
  m = re.fullmatch(r"vision_block_(\d+)", group)
  if m is None:
    return None
  return [linear(f"{prefix}encoder.layers.{m.group(1)}.{block_names[path[0]]}", path, shape)
          for path, shape in zip(layout.paths, layout.shapes)]


def _pieces(cfg: ModelConfig, group: str, layout: Layout) -> list[Piece]:
  tower = tower_pieces(group, layout, "vision_tower.", EMBED, BLOCK, {"pre_norm": "pre_layrnorm"})
  if tower is not None:
    return tower
  if group == "projector":
    return [linear(f"multi_modal_projector.linear_{path[0][-1]}", path, shape)
            for path, shape in zip(layout.paths, layout.shapes)]
  return [Piece(f"language_model.{p.name}", p.shape, p.path, p.src, p.dst, p.transpose)
          for p in standard_pieces(cfg, group, layout)]


def _ignored(config: dict, name: str) -> bool:
  """The tower's blocks after the feature layer and its post-norm (never computed)."""
  if name.startswith("vision_tower.post_layernorm.") or rotary_buffers(config, name):
    return True
  m = re.match(r"vision_tower\.encoder\.layers\.(\d+)\.", name)
  if m is None:
    return False
  vc = config.get("vision_config") or {}
  layer = config.get("vision_feature_layer", -2)
  blocks = vc.get("num_hidden_layers", 0)
  return isinstance(layer, int) and int(m.group(1)) >= (layer if layer >= 0 else blocks + 1 + layer)


register(Family(
    "llava", ("LlavaForConditionalGeneration",), _read, _write, _pieces, ignored=_ignored,
    renames=RENAMES,
    notes="LLaVA 1.5 (CLIP tower, MLP projector, Llama / Mistral / Qwen2 text); one feature "
          "layer, the default or full strategy"))
