"""The GPT-OSS family (gpt-oss-20b, gpt-oss-120b): attention sinks, biases on q/k/v/o, sliding and
full attention layers alternating (`layer_types`), YaRN RoPE (truncate false), a mixture of experts
in every layer (a router with a bias, softmax over the top-k logits; experts with a clamped SwiGLU
and biases).

The experts are stored stacked as transformers keeps them, not as Linear weights: gate_up_proj
[E, D, 2F] with the gate and up columns interleaved (gate = [..., ::2], up = [..., 1::2]) and
down_proj [E, F, D]. OpenAI's checkpoints store those two in MXFP4 (`<name>_blocks`: two fp4 e2m1
values per byte, `<name>_scales`: one e8m0 exponent per 32 values); `MXFP4` decodes them on import,
bit for bit as transformers' `convert_moe_packed_tensors`. Exports are written dequantized (bf16 or
fp32), as any mtjax export.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

from mtjax.config import ModelConfig, MoEConfig
from mtjax.layout import Layout
from mtjax.models.registry import (Decoder, Family, FamilyError, Piece, Stored, block_index,
                                   register)
from mtjax.models.common import Reader, base_config, layer_type_names, standard_pieces

# transformers' GptOssConfig defaults for keys a config.json may leave out.
_DEFAULTS = dict(rms_norm_eps=1e-5, tie_word_embeddings=False, head_dim=64, num_key_value_heads=8,
                 sliding_window=128, num_experts_per_tok=4, swiglu_alpha=1.702, swiglu_limit=7.0,
                 router_aux_loss_coef=0.001, attention_bias=True, attention_dropout=0.0,
                 rope_theta=150000.0, max_position_embeddings=131072)
_DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                 "truncate": False, "original_max_position_embeddings": 4096}


def _read(config: dict, where: str) -> dict:
  defaults = dict(_DEFAULTS)
  if config.get("rope_parameters") is None and config.get("rope_scaling") is None:
    defaults["rope_parameters"] = _DEFAULT_ROPE
  if config.get("num_local_experts") is None and config.get("num_experts") is not None:
    defaults["num_local_experts"] = config["num_experts"]  # transformers' attribute_map alias
  r = Reader(config, where, defaults)
  if r.opt("attention_dropout") != 0:
    r.refuse("attention_dropout", "mtjax's attention has no dropout")
  fields = dict(r.shape(), **r.rope())
  layers = fields["layers"]
  if r.c.get("layer_types") is None:  # transformers: sliding first, then alternating
    types = tuple("sliding" if i % 2 == 0 else "full" for i in range(layers))
  else:
    types = r.layer_types(layers) or ("full",) * layers
  if "sliding" in types:
    if r.c.get("sliding_window") is None:
      r.refuse("sliding_window", "sliding_attention layers need a window")
    fields.update(sliding_window=int(r.positive("sliding_window")), layer_types=types)
  experts, k = r.positive("num_local_experts"), r.positive("num_experts_per_tok")
  if k > experts:
    r.refuse("num_experts_per_tok", f"more than num_local_experts={experts}")
  coef = r.opt("router_aux_loss_coef")
  if isinstance(coef, bool) or not isinstance(coef, (int, float)) or coef < 0:
    r.refuse("router_aux_loss_coef", "expected a number >= 0")
  bias = bool(r.opt("attention_bias"))
  fields.update(
      qkv_bias=bias, o_bias=bias, attention_sinks=True,
      # The experts apply their own clamped SwiGLU whatever hidden_act says (transformers too).
      mlp_act="swiglu_clamped", mlp_bias=True,
      swiglu_limit=float(r.positive("swiglu_limit")),
      swiglu_alpha=float(r.positive("swiglu_alpha")),
      moe=MoEConfig(experts=int(experts), experts_per_token=int(k), expert_ffn=fields["ffn"],
                    router="topk_softmax", router_bias=True, aux_loss_coef=float(coef)))
  return fields


def _write(cfg: ModelConfig, dtype: str) -> dict:
  m = cfg.moe
  if m is None:
    raise FamilyError("model.moe: a GPT-OSS model has a mixture of experts in every layer; set "
                      "model.moe")
  out = base_config(cfg, "GptOssForCausalLM", "gpt_oss", dtype)
  out.update(intermediate_size=m.expert_ffn, num_local_experts=m.experts,
             num_experts_per_tok=m.experts_per_token, router_aux_loss_coef=m.aux_loss_coef,
             sliding_window=cfg.sliding_window, layer_types=layer_type_names(cfg),
             attention_bias=cfg.qkv_bias, swiglu_limit=cfg.swiglu_limit,
             swiglu_alpha=cfg.swiglu_alpha, hidden_act="silu", attention_dropout=0.0)
  return out


_ROUTER = {("mlp", "router", "kernel"): "mlp.router.weight",
           ("mlp", "router", "bias"): "mlp.router.bias"}
_ALL, _EVEN, _ODD = slice(None), slice(0, None, 2), slice(1, None, 2)
# mtjax expert parameter -> (transformers tensor, the index of its share): gate and up are the
# even and odd columns of gate_up_proj, as GptOssExperts splits them.
_EXPERTS = {
    "gate": ("gate_up_proj", (_ALL, _ALL, _EVEN)), "up": ("gate_up_proj", (_ALL, _ALL, _ODD)),
    "down": ("down_proj", ()),
    "gate_bias": ("gate_up_proj_bias", (_ALL, _EVEN)),
    "up_bias": ("gate_up_proj_bias", (_ALL, _ODD)),
    "down_bias": ("down_proj_bias", ()),
}


def _pieces(cfg: ModelConfig, group: str, layout: Layout) -> list[Piece]:
  i = block_index(group)
  if i is None:
    return standard_pieces(cfg, group, layout)
  experts = lambda path: path[:2] == ("mlp", "experts")
  # standard_pieces names attention, norms and the router; the experts' pieces are made here
  # (a placeholder name keeps it from refusing them).
  named = lambda path: _ROUTER.get(path) or ("-" if experts(path) else None)
  out = [p for p in standard_pieces(cfg, group, layout, named) if not experts(p.path)]
  for path, shape in zip(layout.paths, layout.shapes):
    if experts(path):
      name, src = _EXPERTS[path[2]]
      # Stacked as the parameter (not a Linear's [out, in]); gate/up take every other column.
      stored = (*shape[:-1], 2 * shape[-1]) if src else tuple(shape)
      out.append(Piece(f"model.layers.{i}.mlp.experts.{name}", stored, tuple(path), src=src))
  return out




# ----------------------------------------------------------------------------------------- MXFP4

# The fp4 e2m1 values of a nibble (an e8m0 byte e scales them by 2 ** (e - 127)).
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


def mxfp4_to_float32(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
  """MXFP4 blocks [E, R, G, 16] (uint8, low nibble first) and scales [E, R, G] (uint8 e8m0) as the
  fp32 tensor [E, G * 32, R] transformers' `convert_moe_packed_tensors` gives."""
  blocks, scales = np.asarray(blocks, np.uint8), np.asarray(scales, np.uint8)
  values = np.stack([FP4_VALUES[blocks & 0x0F], FP4_VALUES[blocks >> 4]], axis=-1)
  # x * 2 ** e exactly, rounded once to fp32 (e = 128 overflows to inf but for 0 and 0.5), as
  # torch.ldexp gives.
  with np.errstate(over="ignore"):
    values = np.ldexp(values.reshape(*scales.shape, 32), (scales.astype(np.int32) - 127)[..., None])
  return np.swapaxes(values.reshape(*scales.shape[:-1], -1), 1, 2)


class _Lazy:
  """A dequantized tensor decoded only when read as an array: a slice of its first axis and then
  one index of the others narrow it first, so an import decodes one slab of experts at a time
  (the importer copies a few million elements per slab) instead of a whole layer's in fp32."""

  def __init__(self, blocks, scales, rows: range | None = None, tail: tuple = ()):
    self.blocks, self.scales, self.tail = blocks, scales, tail
    self.rows = range(blocks.shape[0]) if rows is None else rows
    E, R, G, _ = blocks.shape
    full = np.broadcast_to(np.float32(0), (len(self.rows), G * 32, R))
    self.shape = full[(slice(None), *tail)].shape
    self.ndim = len(self.shape)
    self.dtype = np.dtype(np.float32)

  def __getitem__(self, index):
    index = index if isinstance(index, tuple) else (index,)
    first, rest = index[0], index[1:]
    if isinstance(first, slice) and first.step in (None, 1) and not (rest and self.tail):
      return _Lazy(self.blocks, self.scales, self.rows[first], rest or self.tail)
    return np.asarray(self)[index]  # any other index: decoded whole, then indexed

  def __array__(self, dtype=None, copy=None):
    r = slice(self.rows.start, self.rows.stop)
    out = mxfp4_to_float32(self.blocks[r], self.scales[r])[(slice(None), *self.tail)]
    return out if dtype is None else out.astype(dtype)


class MXFP4(Decoder):
  """An expert weight `X` stored as MXFP4 `X_blocks` and `X_scales`, as OpenAI's checkpoints
  keep gate_up_proj and down_proj; decoded bit for bit as transformers does."""

  quant_method = "mxfp4"

  def sources(self, stored: Mapping[str, Stored], config: dict, name: str,
              shape: tuple[int, ...]) -> list[str] | None:
    bn, sn = f"{name}_blocks", f"{name}_scales"
    b, s = stored.get(bn), stored.get(sn)
    if b is None and s is None:
      return None
    if b is None or s is None:
      have, lacks = (bn, sn) if s is None else (sn, bn)
      raise FamilyError(f"{stored[have].file}: tensor {have} without {lacks} (MXFP4 needs both)")
    quant = config.get("quantization_config")
    if not isinstance(quant, dict) or quant.get("quant_method") != self.quant_method:
      raise FamilyError(f"{b.file}: tensor {bn} is MXFP4 but config.json has no "
                        f"quantization_config with quant_method 'mxfp4'")
    for n, e, ndim in ((bn, b, 4), (sn, s, 3)):
      if e.dtype != "U8" or len(e.shape) != ndim:
        raise FamilyError(f"{e.file}: tensor {n} is {e.dtype} {list(e.shape)}, expected uint8 of "
                          f"{ndim} dimensions (MXFP4)")
      if e.nbytes != int(np.prod(e.shape)) or e.start + e.nbytes > e.file.stat().st_size:
        raise FamilyError(f"{e.file}: tensor {n} does not fit its shape or the file (truncated?)")
    if b.shape[-1] != 16 or b.shape[:-1] != s.shape:
      raise FamilyError(f"{b.file}: tensor {bn} {list(b.shape)} does not pair with {sn} "
                        f"{list(s.shape)} (expected [..., 16] blocks over its scales)")
    E, R, G, _ = b.shape
    if (E, G * 32, R) != tuple(shape):
      raise FamilyError(f"{b.file}: tensor {bn} decodes to {[E, G * 32, R]}, expected "
                        f"{list(shape)}")
    return [bn, sn]

  def decode(self, read: Callable[[str], np.ndarray], name: str) -> _Lazy:
    return _Lazy(read(f"{name}_blocks"), read(f"{name}_scales"))


register(Family(
    "gpt_oss", ("GptOssForCausalLM",), _read, _write, _pieces, decoders=(MXFP4(),),
    notes="GPT-OSS 20b/120b: attention sinks, q/k/v/o biases, alternating sliding/full layers, "
          "YaRN, top-k softmax router with a bias, clamped-SwiGLU experts with biases; MXFP4 "
          "experts dequantized on import (exports bf16/fp32)"))
