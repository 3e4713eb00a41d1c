"""The OLMoE family (OlmoeForCausalLM): OLMoE-1B-7B, a pre-norm decoder with q and k each
RMS-normalised over the whole projection before RoPE (qk_norm_scope "all", as OLMo 2) and a mixture
of experts in every layer: softmax router over `num_experts`, the top `num_experts_per_tok`,
renormalised when `norm_topk_prob`; experts of width `intermediate_size`. `router_aux_loss_coef`
weighs the load-balancing loss in the training loss, as transformers does with
output_router_logits."""

from __future__ import annotations

from mtjax.config import ModelConfig
from mtjax.models.registry import Family, FamilyError, register
from mtjax.models.common import Reader, base_config
from mtjax.models.mixtral import moe_pieces, routed

# OlmoeConfig's defaults for keys save_pretrained may leave out.
_DEFAULTS = dict(rms_norm_eps=1e-5, tie_word_embeddings=False, hidden_act="silu",
                 num_experts_per_tok=8, router_aux_loss_coef=0.01, norm_topk_prob=False,
                 attention_bias=False, pad_token_id=1)


def _read(config: dict, where: str) -> dict:
  r = Reader(config, where, _DEFAULTS)
  act = r.act("hidden_act", {"silu": "silu"})
  if r.opt("attention_bias"):
    r.refuse("attention_bias", "mtjax's olmoe family has no q/k/v/o biases")
  if r.opt("clip_qkv") is not None:
    r.refuse("clip_qkv", "mtjax does not clamp q, k and v")
  fields = dict(r.shape(), **r.rope(), mlp_act=act, qk_norm=True, qk_norm_scope="all")
  if fields["head_dim"] is not None:  # transformers' q norm spans hidden_size channels
    r.refuse("head_dim", "OLMoE's heads are hidden_size / num_attention_heads wide")
  if fields["rope"].partial != 1.0:
    raise FamilyError(f"{where}: partial_rotary_factor={fields['rope'].partial} unsupported "
                      f"(transformers' OLMoE rotates whole heads)")
  # Every layer is a mixture: intermediate_size is the experts' width (the dense ffn is unused).
  fields["moe"] = routed(r, ("num_local_experts", "num_experts"), 64, fields["ffn"],
                         norm_topk_prob=bool(r.opt("norm_topk_prob")))
  return fields


def _write(cfg: ModelConfig, dtype: str) -> dict:
  m = cfg.moe
  if (m is None or m.first_dense_layers or m.dense_layers or m.every != 1 or m.shared_width
      or (cfg.qk_norm, cfg.qk_norm_scope, cfg.norm_position) != (True, "all", "pre")):
    raise FamilyError("olmoe: a config.json needs model.moe in every layer without shared "
                      "experts, and q/k norms over the whole projection (qk_norm_scope all)")
  out = base_config(cfg, "OlmoeForCausalLM", "olmoe", dtype)
  out.update(hidden_act="silu", attention_bias=False, clip_qkv=None,
             intermediate_size=m.expert_ffn, num_experts=m.experts,
             num_experts_per_tok=m.experts_per_token, norm_topk_prob=m.norm_topk_prob,
             router_aux_loss_coef=m.aux_loss_coef,
             # OlmoeConfig's token ids are OLMoE's tokenizer's: unknown here.
             bos_token_id=None, eos_token_id=None)
  return out


register(Family("olmoe", ("OlmoeForCausalLM",), _read, _write,
                moe_pieces({("mlp", "router", "kernel"): "mlp.gate.weight"},
                           lambda e, w: f"mlp.experts.{e}.{w}_proj.weight"),
                notes="OLMoE (q/k norms over the whole projection, a softmax top-k mixture in "
                      "every layer, norm_topk_prob); router_aux_loss_coef weighs the "
                      "load-balancing loss in training, as transformers with "
                      "output_router_logits; no attention biases, no clip_qkv"))
