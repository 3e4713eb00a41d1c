"""Qwen's mixtures of experts: Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B: q/k/v biases, a shared
expert behind a per-token sigmoid gate beside the routed ones) and Qwen3-MoE (q/k norms per head,
`norm_topk_prob`). Both: softmax router over `num_experts`, the top `num_experts_per_tok`
renormalised only when `norm_topk_prob`; a layer is dense (width `intermediate_size`) when listed
in `mlp_only_layers` or when its index + 1 is no multiple of `decoder_sparse_step`; routed experts
of width `moe_intermediate_size`. `router_aux_loss_coef` weighs the load-balancing loss in the
training loss, as transformers does with output_router_logits.
"""

from __future__ import annotations

from mtjax.config import ModelConfig
from mtjax.models.registry import Family, FamilyError, register
from mtjax.models.common import Reader, base_config, layer_type_names
from mtjax.models.mixtral import moe_pieces, routed

# Values transformers assumes when config.json omits a key (save_pretrained drops some defaults).
_COMMON = dict(rms_norm_eps=1e-6, tie_word_embeddings=False, hidden_act="silu",
               norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[],
               router_aux_loss_coef=0.001, use_sliding_window=False, sliding_window=4096)
_DEFAULTS = {
    "qwen2_moe": dict(_COMMON, num_experts_per_tok=4, moe_intermediate_size=1408,
                      shared_expert_intermediate_size=5632, qkv_bias=True, max_window_layers=28),
    "qwen3_moe": dict(_COMMON, num_experts_per_tok=8, moe_intermediate_size=768,
                      attention_bias=False),
}
# The expert count's keys (see mixtral.routed: the alias first) and transformers' default.
_EXPERTS = {"qwen2_moe": (("num_experts",), 60),
            "qwen3_moe": (("num_local_experts", "num_experts"), 128)}


def sparse_layers(r: Reader, layers: int) -> dict:
  """decoder_sparse_step and mlp_only_layers as MoEConfig fields."""
  step = r.positive("decoder_sparse_step")
  dense = r.opt("mlp_only_layers", [])
  if (not isinstance(step, int) or not isinstance(dense, list)
      or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < layers for i in dense)):
    raise FamilyError(f"{r.where}: decoder_sparse_step={step!r} must be an integer and "
                      f"mlp_only_layers={dense!r} layer indices below {layers}")
  return dict(every=step, dense_layers=tuple(sorted(set(dense))))


def _windows_qwen2_moe(r: Reader, layers: int) -> dict:
  """Sliding layers from `layer_types`, or as transformers derives them for older files: every
  other layer (0, 2, ...) below `max_window_layers` when `use_sliding_window`."""
  use = bool(r.opt("use_sliding_window", False))
  if r.c.get("layer_types") is not None:
    types = r.layer_types(layers)
  else:
    first = r.opt("max_window_layers", 28)
    types = tuple("sliding" if use and (i + 1) % 2 and i < first else "full" for i in range(layers))
    types = None if "sliding" not in types else types
  if types is None:
    return {}
  if not use:  # transformers then sets the window to 0: sliding layers would see nothing
    r.refuse("layer_types", "sliding layers need use_sliding_window true")
  return dict(sliding_window=int(r.positive("sliding_window")), layer_types=types)


def _read(family: str):
  def read(config: dict, where: str) -> dict:
    r = Reader(config, where, _DEFAULTS[family])
    act = r.act("hidden_act", {"silu": "silu"})
    fields = dict(r.shape(), **r.rope(), mlp_act=act)
    layers = fields["layers"]
    moe = dict(norm_topk_prob=bool(r.opt("norm_topk_prob")), **sparse_layers(r, layers))
    if family == "qwen2_moe":
      fields["qkv_bias"] = bool(r.opt("qkv_bias"))
      moe.update(shared_experts=1, shared_ffn=r.positive("shared_expert_intermediate_size"),
                 shared_gate=True)
      fields.update(_windows_qwen2_moe(r, layers))
    else:
      bias = bool(r.opt("attention_bias"))
      fields.update(qk_norm=True, qkv_bias=bias, o_bias=bias)
      if r.opt("use_sliding_window"):  # transformers' window then covers every layer
        fields.update(sliding_window=int(r.positive("sliding_window")),
                      layer_types=("sliding",) * layers)
    keys, default = _EXPERTS[family]
    fields["moe"] = routed(r, keys, default, r.positive("moe_intermediate_size"), **moe)
    return fields
  return read


def _write(arch: str, model_type: str):
  def write(cfg: ModelConfig, dtype: str) -> dict:
    m = cfg.moe
    out = base_config(cfg, arch, model_type, dtype)
    out.update(hidden_act="silu", num_experts=m.experts, num_experts_per_tok=m.experts_per_token,
               moe_intermediate_size=m.expert_ffn, norm_topk_prob=m.norm_topk_prob,
               decoder_sparse_step=m.every,
               # dense layers: first_dense_layers has no key of its own here
               mlp_only_layers=sorted({*range(m.first_dense_layers), *m.dense_layers}),
               router_aux_loss_coef=m.aux_loss_coef)
    windowed = cfg.layer_types is not None and "sliding" in cfg.layer_types
    out.update(use_sliding_window=windowed, sliding_window=cfg.sliding_window if windowed else None)
    if model_type == "qwen2_moe":
      out.update(qkv_bias=cfg.qkv_bias, shared_expert_intermediate_size=m.shared_width,
                 layer_types=layer_type_names(cfg), max_window_layers=cfg.layers)
    else:
      out.update(attention_bias=cfg.qkv_bias)
    return out
  return write


NOTES = {
    "qwen2_moe": ("Qwen1.5-MoE, Qwen2-57B-A14B (q/k/v biases, a sigmoid-gated shared expert, "
                  "mlp_only_layers / decoder_sparse_step dense layers, sliding layer_types); "
                  "router_aux_loss_coef weighs the load-balancing loss in training, as "
                  "transformers with output_router_logits"),
    "qwen3_moe": ("Qwen3-30B-A3B, Qwen3-235B-A22B (q/k norms per head, norm_topk_prob, "
                  "attention_bias, dense layers, a sliding window in every layer when "
                  "use_sliding_window); router_aux_loss_coef weighs the load-balancing loss in "
                  "training, as transformers with output_router_logits"),
}
_ROUTER = {("mlp", "router", "kernel"): "mlp.gate.weight"}
_SHARED = {("mlp", "shared", w, "kernel"): f"mlp.shared_expert.{w}_proj.weight"
           for w in ("gate", "up", "down")}
_SHARED[("mlp", "shared_gate", "kernel")] = "mlp.shared_expert_gate.weight"
for name, arch, names in (("qwen2_moe", "Qwen2MoeForCausalLM", {**_ROUTER, **_SHARED}),
                          ("qwen3_moe", "Qwen3MoeForCausalLM", _ROUTER)):
  register(Family(name, (arch,), _read(name), _write(arch, name),
                  moe_pieces(names, lambda e, w: f"mlp.experts.{e}.{w}_proj.weight"),
                  notes=NOTES[name]))
