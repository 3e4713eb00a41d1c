"""Qwen3-VL (Qwen3VLForConditionalGeneration, the dense text model): a Qwen vision tower
(mtjax.models.qwen_vision: LayerNorm blocks with a gelu-tanh MLP, 2D RoPE, learned positions
resized to the grid, no windows) whose merged patch features replace the image tokens'
embeddings in a Qwen3 text model (q/k norms) with interleaved M-RoPE (`rope.mrope_interleaved`).

Deepstack: the outputs of the `model.vision.deepstack` tower blocks, each through a merger of its
own, are added to the image tokens' hidden states after the first len(deepstack) decoder layers.
They travel with the text stream: from the tower's embedding on, x is (x, the features
[B, k, M x image_tokens, D]); the tower's deepstack blocks shift theirs in, the projector passes
them on, and decoder layer i < k adds the first and passes the rest (layer k - 1 returns x).

Images are one fixed grid per run (`model.vision.image_size`, 448 unless set), as for Qwen2.5-VL;
videos are not read. Checkpoints spell the tensors as transformers 5 saves them
(`model.visual.* / model.language_model.* / lm_head.*`, what an export writes) or with the
tower and text model at the top (`visual.* / model.*`), both read.
"""

from __future__ import annotations

import dataclasses
import re

from mtjax.config import ModelConfig, VisionConfig
from mtjax.layout import Layout
from mtjax.models.common import Reader, standard_pieces
from mtjax.models.llava import linear
from mtjax.models.qwen2_5_vl import IMAGE_SIZE
from mtjax.models.registry import Family, FamilyError, Piece, get, register

ARCH = "Qwen3VLForConditionalGeneration"
MROPE_SECTION = (24, 20, 20)  # transformers' default where a config names none
_ACTS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "silu": "silu",
         "quick_gelu": "quick_gelu"}

RENAMES = ((r"^visual\.", "model.visual."),
           (r"^model\.(?!visual\.|language_model\.)", "model.language_model."))

# a block's parameter (module) -> its name under model.visual.blocks.<i>.
BLOCK = {"norm1": "norm1", "norm2": "norm2", "qkv": "attn.qkv", "proj": "attn.proj",
         "fc1": "mlp.linear_fc1", "fc2": "mlp.linear_fc2"}
MERGER = {"ln_q": "norm", "fc1": "linear_fc1", "fc2": "linear_fc2"}


def _read(config: dict, where: str) -> dict:
  text = dict(config.get("text_config") or {})
  rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
  section = tuple(rope.pop("mrope_section", None) or MROPE_SECTION)
  rope.pop("mrope_interleaved", None)  # transformers' Qwen3-VL interleaves whatever it says
  if rope.get("rope_type", rope.get("type")) == "mrope":
    rope["rope_type"] = "default"
  rope.pop("type", None)
  text["rope_parameters"] = rope
  text.pop("rope_scaling", None)
  fields = get("qwen3").read_config(text, f"{where} text_config")
  fields["rope"] = dataclasses.replace(fields["rope"], mrope_section=section,
                                       mrope_interleaved=True)
  vc = config.get("vision_config")
  if not isinstance(vc, dict):
    raise FamilyError(f"{where}: vision_config={vc!r} unsupported (expected a dict)")
  vw = f"{where} vision_config"
  r = Reader(vc, vw, {"hidden_act": "gelu_pytorch_tanh", "patch_size": 16,
                      "spatial_merge_size": 2, "temporal_patch_size": 2,
                      "deepstack_visual_indexes": [8, 16, 24], "num_position_embeddings": 2304})
  act = r.opt("hidden_act")
  if act not in _ACTS:
    r.refuse("hidden_act", f"the tower's MLP takes {', '.join(_ACTS)}")
  if r.positive("out_hidden_size") != fields["hidden"]:
    r.refuse("out_hidden_size",
             f"the merger's output must be the text model's hidden_size {fields['hidden']}")
  token = config.get("image_token_id")
  if not isinstance(token, int):
    raise FamilyError(f"{where}: image_token_id={token!r} must be a token id")
  vrope = vc.get("rope_parameters") or {}
  try:
    fields["vision"] = VisionConfig(
        tower="qwen3_vl", hidden=r.positive("hidden_size"), layers=int(r.positive("depth")),
        heads=r.positive("num_heads"), ffn=r.positive("intermediate_size"),
        image_size=IMAGE_SIZE, patch=r.positive("patch_size"),
        channels=int(vc.get("in_channels", 3)), act=_ACTS[act], norm_eps=1e-6,
        projector="merger", image_token_id=token,
        temporal_patch=r.positive("temporal_patch_size"), merge=r.positive("spatial_merge_size"),
        rope_theta=float(vrope.get("rope_theta", 10000.0)),
        positions=int(r.positive("num_position_embeddings")),
        deepstack=tuple(int(b) for b in r.opt("deepstack_visual_indexes")))
  except ValueError as e:
    raise FamilyError(f"{vw}: {e}") from None
  if len(fields["vision"].deepstack) > fields["layers"]:
    r.refuse("deepstack_visual_indexes", f"at most the text model's {fields['layers']} layers")
  tie = config.get("tie_word_embeddings", text.get("tie_word_embeddings"))
  fields["tie_embeddings"] = bool(fields["tie_embeddings"] if tie is None else tie)
  return fields


def _write(cfg: ModelConfig, dtype: str) -> dict:
  v = cfg.vision
  text_cfg = dataclasses.replace(cfg, family="qwen3", vision=None, rope=dataclasses.replace(
      cfg.rope, mrope_section=(), mrope_interleaved=False))
  text = get("qwen3").write_config(text_cfg, dtype)
  for key in ("architectures", "rope_scaling", "rope_theta", "torch_dtype", "dtype"):
    text.pop(key, None)
  text["model_type"] = "qwen3_vl_text"
  text["rope_parameters"] = {**text["rope_parameters"],
                             "mrope_section": list(cfg.rope.mrope_section),
                             "mrope_interleaved": cfg.rope.mrope_interleaved}
  tower = {"model_type": "qwen3_vl_vision", "depth": v.layers, "num_heads": v.heads,
           "hidden_size": v.hidden, "intermediate_size": v.ffn, "out_hidden_size": cfg.hidden,
           "patch_size": v.patch, "spatial_merge_size": v.merge,
           "temporal_patch_size": v.temporal_patch, "in_channels": v.channels,
           "hidden_act": {b: a for a, b in _ACTS.items()}[v.act],
           "num_position_embeddings": v.positions, "deepstack_visual_indexes": list(v.deepstack),
           "rope_parameters": {"rope_type": "axial", "rope_theta": v.rope_theta}}
  return {"architectures": [ARCH], "model_type": "qwen3_vl", "text_config": text,
          "vision_config": tower, "image_token_id": v.image_token_id,
          "tie_word_embeddings": cfg.tie_embeddings, "dtype": dtype}


EMBED = {("patch",): "model.visual.patch_embed.proj.weight",
         ("patch_bias",): "model.visual.patch_embed.proj.bias",
         ("position",): "model.visual.pos_embed.weight"}


def _pieces(cfg: ModelConfig, group: str, layout: Layout) -> list[Piece]:
  items = list(zip(layout.paths, layout.shapes))
  if group == "vision_embed":
    return [Piece(EMBED[path], tuple(shape), path) for path, shape in items]
  m = re.fullmatch(r"vision_block_(\d+)", group)
  if m is not None:
    i = int(m.group(1))
    merger = f"model.visual.deepstack_merger_list.{cfg.vision.deepstack.index(i)}." if (
        i in cfg.vision.deepstack) else None
    return [linear(merger + MERGER[path[1]], path, shape) if path[0] == "deepstack"
            else linear(f"model.visual.blocks.{i}.{BLOCK[path[0]]}", path, shape)
            for path, shape in items]
  if group == "projector":
    return [linear(f"model.visual.merger.{MERGER[path[0]]}", path, shape) for path, shape in items]
  out = standard_pieces(cfg, group, layout)
  return [dataclasses.replace(p, name=re.sub(r"^model\.", "model.language_model.", p.name))
          for p in out]


register(Family("qwen3_vl", (ARCH,), _read, _write, _pieces, renames=RENAMES,
                notes="Qwen3-VL dense (LayerNorm / gelu-tanh tower, 2D RoPE and learned "
                      "positions, patch merger, deepstack; Qwen3 text with interleaved M-RoPE); "
                      "images of one fixed size (model.vision.image_size), no videos"))
