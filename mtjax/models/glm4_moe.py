"""The GLM-4.5 MoE family (Glm4MoeForCausalLM): GLM-4.5, GLM-4.5-Air, GLM-4.6. A pre-norm decoder
with GQA attention (q/k/v biases when `attention_bias`, q/k norms per head when `use_qk_norm`,
RoPE on a share of each head: partial_rotary_factor, 0.5 when config.json states none, pairs
(i, i + R/2)), a dense MLP in the first `first_k_dense_replace` layers and in the rest a mixture
with DeepSeek-V3's router (mtjax.models.deepseek): sigmoid scores, experts chosen by score +
`e_score_correction_bias` within the `topk_group` of `n_group` groups whose two best sum highest,
weighted by the scores (renormalised when norm_topk_prob) times routed_scaling_factor, beside
`n_shared_experts` shared experts.

The correction bias is imported and exported as the `e_bias` parameter, which gets no gradient
(see mtjax.models.deepseek). transformers adds no auxiliary loss; `moe.aux_loss_coef` is 0. The
multi-token-prediction layers (`model.layers.<num_hidden_layers>...`, num_nextn_predict_layers of
them) are skipped on import, as transformers skips them.
"""

from __future__ import annotations

from mtjax.config import ModelConfig, MoEConfig
from mtjax.models.registry import Family, FamilyError, register, rotary_buffers
from mtjax.models.common import Reader, base_config
from mtjax.models.deepseek import pieces

# Glm4MoeConfig's defaults for keys save_pretrained may leave out.
_DEFAULTS = dict(rms_norm_eps=1e-5, tie_word_embeddings=False, hidden_act="silu",
                 attention_bias=False, partial_rotary_factor=0.5, moe_intermediate_size=1408,
                 num_experts_per_tok=8, n_shared_experts=1, n_routed_experts=128,
                 routed_scaling_factor=1.0, n_group=1, topk_group=1, first_k_dense_replace=1,
                 norm_topk_prob=True, use_qk_norm=False, num_nextn_predict_layers=1)


def _int(r: Reader, key: str, minimum: int = 1) -> int:
  value = r.get(key)
  if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
    raise FamilyError(f"{r.where}: {key}={value!r} must be an integer >= {minimum}")
  return value


def _moe(r: Reader, layers: int) -> MoEConfig:
  # transformers' attribute_map: num_local_experts, where present, is n_routed_experts
  experts_key = "num_local_experts" if r.c.get("num_local_experts") is not None else (
      "n_routed_experts")
  E, k = _int(r, experts_key), _int(r, "num_experts_per_tok")
  groups, topk_groups = _int(r, "n_group"), _int(r, "topk_group")
  if E % groups or E // groups < 2:
    r.refuse("n_group", f"must split the {E} experts into equal groups of at least 2 (a group "
             f"scores by its best two)")
  if topk_groups > groups:
    r.refuse("topk_group", f"exceeds n_group={groups}")
  if k > topk_groups * (E // groups):
    r.refuse("num_experts_per_tok", f"exceeds the experts of topk_group={topk_groups} groups")
  return MoEConfig(experts=E, experts_per_token=k, expert_ffn=_int(r, "moe_intermediate_size"),
                   router="sigmoid", group_score="top2_sum", score_correction_bias=True,
                   groups=groups, topk_groups=topk_groups,
                   norm_topk_prob=bool(r.opt("norm_topk_prob")),
                   routed_scaling=float(r.positive("routed_scaling_factor")),
                   shared_experts=_int(r, "n_shared_experts"),
                   # transformers makes every layer from this one on a mixture
                   first_dense_layers=min(_int(r, "first_k_dense_replace", 0), layers))


def _read(config: dict, where: str) -> dict:
  r = Reader(config, where, _DEFAULTS)
  act = r.act("hidden_act", {"silu": "silu"})
  fields = dict(r.shape(), **r.rope(), mlp_act=act, qkv_bias=bool(r.opt("attention_bias")),
                qk_norm=bool(r.opt("use_qk_norm")))
  fields["moe"] = _moe(r, fields["layers"])
  return fields


def _write(cfg: ModelConfig, dtype: str) -> dict:
  m = cfg.moe
  if (m is None or m.router != "sigmoid" or m.group_score != "top2_sum"
      or not m.score_correction_bias or m.shared_gate or m.dense_layers or m.every != 1
      or m.shared_ffn is not None or cfg.o_bias or cfg.qk_norm_scope != "head"
      or cfg.rope.interleave):
    raise FamilyError("glm4_moe: a config.json needs model.moe with the sigmoid router, score "
                      "correction bias and top2_sum groups, its mixtures from first_dense_layers "
                      "on, and attention without o_bias, per-head q/k norms, rope pairs (i, i+R/2)")
  out = base_config(cfg, "Glm4MoeForCausalLM", "glm4_moe", dtype)
  out["rope_parameters"]["partial_rotary_factor"] = cfg.rope.partial  # 1.0 too: not the default
  out.update(hidden_act="silu", attention_bias=cfg.qkv_bias, use_qk_norm=cfg.qk_norm,
             partial_rotary_factor=cfg.rope.partial, moe_intermediate_size=m.expert_ffn,
             n_routed_experts=m.experts, num_experts_per_tok=m.experts_per_token,
             n_shared_experts=m.shared_experts, routed_scaling_factor=m.routed_scaling,
             n_group=m.groups, topk_group=m.topk_groups, first_k_dense_replace=m.first_dense_layers,
             norm_topk_prob=m.norm_topk_prob, num_nextn_predict_layers=0,
             bos_token_id=None, eos_token_id=None)
  return out


def _ignored(config: dict, name: str) -> bool:
  """RoPE buffers, and the multi-token-prediction layers after the num_hidden_layers decoder
  layers, which transformers does not load either."""
  if rotary_buffers(config, name):
    return True
  layers = config.get("num_hidden_layers")
  extra = config.get("num_nextn_predict_layers", config.get("num_mtp_layers", 1))
  if not (isinstance(layers, int) and isinstance(extra, int)):
    return False  # no counts to place the layers by
  return any(name.startswith(f"model.layers.{i}.") for i in range(layers, layers + extra))


register(Family("glm4_moe", ("Glm4MoeForCausalLM",), _read, _write, pieces, ignored=_ignored,
                notes="GLM-4.5, GLM-4.5-Air, GLM-4.6: partial RoPE, q/k/v biases, use_qk_norm per "
                      "head, dense first_k_dense_replace layers, DeepSeek-V3's sigmoid router "
                      "(group-limited, score correction bias kept as imported, "
                      "routed_scaling_factor) with shared experts; no auxiliary loss (as "
                      "transformers); the multi-token-prediction layers "
                      "(num_nextn_predict_layers) are skipped, as transformers"))
