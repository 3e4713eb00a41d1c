"""Qwen2-VL (Qwen2VLForConditionalGeneration) and Qwen2.5-VL (Qwen2_5_VLForConditionalGeneration):
a Qwen vision tower (mtjax.models.qwen_vision) whose merged patch features replace the image
tokens' embeddings in a Qwen2 text model with M-RoPE (`rope.mrope_section`: the rotary
frequencies split between temporal, height and width positions, mtjax.models.vision's
rope_positions from the image tokens as transformers' get_rope_index).

Images are one fixed grid per run: `model.vision.image_size` pixels a side (448 unless set: 32 x 32
patches, 256 image tokens), every image resized to it; another `image_grid_thw` is refused. Videos
are not read. Checkpoints spell the tensors two ways, both read: `visual.* / model.* / lm_head.*`
(what transformers 4 and 5 save and the published checkpoints hold, what an export writes) and
`model.visual.* / model.language_model.*` (transformers 5's module names).
"""

from __future__ import annotations

import dataclasses
import re

from mtjax.config import ModelConfig, VisionConfig
from mtjax.layout import Layout
from mtjax.models.common import Reader, standard_pieces
from mtjax.models.llava import linear
from mtjax.models.registry import Family, FamilyError, Piece, get, register

IMAGE_SIZE = 448  # pixels a side of a run's images unless model.vision.image_size says otherwise
MROPE_SECTION = (16, 24, 24)  # transformers' default where a config names none
_ACTS = {"silu": "silu", "quick_gelu": "quick_gelu", "gelu": "gelu",
         "gelu_pytorch_tanh": "gelu_tanh"}
_VISION_TYPES = {"qwen2_vl": "qwen2_vl_vision", "qwen2_5_vl": "qwen2_5_vl_vision"}
_ARCH = {"qwen2_vl": "Qwen2VLForConditionalGeneration",
         "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration"}

RENAMES = ((r"^model\.visual\.", "visual."), (r"^model\.language_model\.", "model."))

# a block's parameter (module) -> its name under visual.blocks.<i>.
BLOCK = {"norm1": "norm1", "norm2": "norm2", "qkv": "attn.qkv", "proj": "attn.proj",
         "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj",
         "fc1": "mlp.fc1", "fc2": "mlp.fc2"}
MERGER = {"ln_q": "merger.ln_q", "fc1": "merger.mlp.0", "fc2": "merger.mlp.2"}


def _text_config(config: dict, where: str) -> tuple[dict, tuple[int, ...]]:
  """The text model's config (text_config, or the top level of older files) with M-RoPE taken
  out of its rope dict, and the mrope_section."""
  text = dict(config.get("text_config") or config)
  key = "rope_parameters" if text.get("rope_parameters") is not None else "rope_scaling"
  rope = dict(text.get(key) or {})
  section = tuple(rope.pop("mrope_section", None) or MROPE_SECTION)
  if rope.get("type") == "mrope":  # older files: "mrope" is the default rule plus sections
    rope["type"] = "default"
  if rope.get("rope_type") == "mrope":
    rope["rope_type"] = "default"
  text[key] = rope
  if not all(isinstance(n, int) for n in section):
    raise FamilyError(f"{where}: mrope_section={list(section)} unsupported (three counts)")
  return text, section


def _read(family: str):
  def read(config: dict, where: str) -> dict:
    text, section = _text_config(config, where)
    fields = get("qwen2").read_config(text, f"{where} text_config")
    fields["rope"] = dataclasses.replace(fields["rope"], mrope_section=section)
    vc = config.get("vision_config")
    if not isinstance(vc, dict):
      raise FamilyError(f"{where}: vision_config={vc!r} unsupported (expected a dict)")
    vw = f"{where} vision_config"
    r = Reader(vc, vw, {"hidden_act": "silu" if family == "qwen2_5_vl" else "quick_gelu",
                        "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2})
    act = r.opt("hidden_act")
    if act not in _ACTS:
      r.refuse("hidden_act", f"the tower's MLP takes {', '.join(_ACTS)}")
    if family == "qwen2_5_vl":
      hidden, ffn, out = r.positive("hidden_size"), r.positive("intermediate_size"), "out_hidden_size"
      window = int(r.positive("window_size"))
      full = tuple(int(b) for b in (r.opt("fullatt_block_indexes") or ()))
    else:
      hidden, out = r.positive("embed_dim"), "hidden_size"
      ffn, window, full = int(hidden * r.positive("mlp_ratio")), None, ()
    if r.positive(out) != fields["hidden"]:
      r.refuse(out, f"the merger's output must be the text model's hidden_size {fields['hidden']}")
    rope = vc.get("rope_parameters") or {}
    token = config.get("image_token_id")
    if not isinstance(token, int):
      raise FamilyError(f"{where}: image_token_id={token!r} must be a token id")
    layers = int(r.positive("depth"))
    if any(not 0 <= b < layers for b in full):
      r.refuse("fullatt_block_indexes", f"blocks 0..{layers - 1}")
    try:
      fields["vision"] = VisionConfig(
          tower=family, hidden=hidden, layers=layers, heads=r.positive("num_heads"), ffn=ffn,
          image_size=IMAGE_SIZE, patch=r.positive("patch_size"),
          channels=int(vc.get("in_channels", vc.get("in_chans", 3))), act=_ACTS[act],
          norm_eps=1e-6, projector="merger", image_token_id=token,
          temporal_patch=r.positive("temporal_patch_size"), merge=r.positive("spatial_merge_size"),
          window=window, full_blocks=full if window else (),
          rope_theta=float(rope.get("rope_theta", 10000.0)))
    except ValueError as e:
      raise FamilyError(f"{vw}: {e}") from None
    tie = config.get("tie_word_embeddings", text.get("tie_word_embeddings"))
    fields["tie_embeddings"] = bool(fields["tie_embeddings"] if tie is None else tie)
    return fields
  return read


def _write(family: str):
  def write(cfg: ModelConfig, dtype: str) -> dict:
    v = cfg.vision
    text_cfg = dataclasses.replace(cfg, family="qwen2", vision=None,
                                   rope=dataclasses.replace(cfg.rope, mrope_section=()))
    text = get("qwen2").write_config(text_cfg, dtype)
    for key in ("architectures", "rope_scaling", "rope_theta", "torch_dtype"):
      text.pop(key, None)
    text["model_type"] = f"{family}_text"
    text["rope_parameters"] = {**text["rope_parameters"], "mrope_section": list(cfg.rope.mrope_section)}
    tower = {"model_type": _VISION_TYPES[family], "depth": v.layers, "num_heads": v.heads,
             "patch_size": v.patch, "spatial_merge_size": v.merge,
             "temporal_patch_size": v.temporal_patch, "in_channels": v.channels,
             "hidden_act": {b: a for a, b in _ACTS.items()}[v.act],
             "rope_parameters": {"rope_type": "axial", "rope_theta": v.rope_theta}}
    if family == "qwen2_5_vl":
      # no window: one as wide as the image, every block a full-attention one
      window = v.window or v.image_size
      full = list(v.full_blocks) if v.window else list(range(v.layers))
      tower.update(hidden_size=v.hidden, intermediate_size=v.ffn, out_hidden_size=cfg.hidden,
                   window_size=window, fullatt_block_indexes=full)
    else:
      # transformers 5 takes an integer ratio; older readers a float
      ratio = v.ffn // v.hidden if v.ffn % v.hidden == 0 else v.ffn / v.hidden
      tower.update(embed_dim=v.hidden, mlp_ratio=ratio, hidden_size=cfg.hidden)
    return {"architectures": [_ARCH[family]], "model_type": family, "text_config": text,
            "vision_config": tower, "image_token_id": v.image_token_id,
            "tie_word_embeddings": cfg.tie_embeddings, "dtype": dtype}
  return write


def _pieces(cfg: ModelConfig, group: str, layout: Layout) -> list[Piece]:
  if group == "vision_embed":
    return [Piece("visual.patch_embed.proj.weight", tuple(shape), path)
            for path, shape in zip(layout.paths, layout.shapes)]
  m = re.fullmatch(r"vision_block_(\d+)", group)
  if m is not None:
    return [linear(f"visual.blocks.{m.group(1)}.{BLOCK[path[0]]}", path, shape)
            for path, shape in zip(layout.paths, layout.shapes)]
  if group == "projector":
    return [linear(f"visual.{MERGER[path[0]]}", path, shape)
            for path, shape in zip(layout.paths, layout.shapes)]
  return standard_pieces(cfg, group, layout)


NOTES = {
    "qwen2_vl": "Qwen2-VL (LayerNorm / quick-gelu tower, 2D RoPE, patch merger; M-RoPE text); "
                "images of one fixed size (model.vision.image_size), no videos",
    "qwen2_5_vl": "Qwen2.5-VL (RMSNorm / SwiGLU tower with window and full-attention blocks, 2D "
                  "RoPE, patch merger; M-RoPE text); images of one fixed size "
                  "(model.vision.image_size), no videos",
}
for _name in ("qwen2_vl", "qwen2_5_vl"):
  register(Family(_name, (_ARCH[_name],), _read(_name), _write(_name), _pieces,
                  renames=RENAMES, notes=NOTES[_name]))
