"""DeepSeek-V2 and DeepSeek-V3: multi-head latent attention (mtjax.models.mla) in every layer, a
dense MLP in the first `first_k_dense_replace` layers and a mixture of experts with shared experts
in the rest, YaRN RoPE with DeepSeek's mscale / mscale_all_dim.

The routers are transformers' (which config.json's `scoring_func` and, for V3, `topk_method` do
not change):

- V2: softmax over the experts; `topk_method` greedy (the k best) or group_limited_greedy (the k
  best within the `topk_group` groups of the best single expert); the chosen probabilities times
  `routed_scaling_factor`, never renormalised (transformers' V2 router ignores norm_topk_prob).
- V3: sigmoid scores; experts chosen by score + `e_score_correction_bias` within the `topk_group`
  groups whose two best sum highest; weighted by the scores, renormalised when norm_topk_prob,
  times routed_scaling_factor.

The correction bias is a buffer in transformers, not a trained weight: mtjax imports and exports
it as the `e_bias` parameter, which choosing through top-k gives no gradient, so AdamW (no decay on
vectors) leaves it unchanged (DeepSeek's own update of it by expert load is not done). Checkpoints keep each expert's SwiGLU as its own Linear weights
(`mlp.experts.<e>.gate_proj/up_proj/down_proj`), one piece per expert of the stacked parameters.
transformers adds no auxiliary loss for either model; `moe.aux_loss_coef` is 0.
"""

from __future__ import annotations

from mtjax.config import MLAConfig, ModelConfig, MoEConfig
from mtjax.layout import Layout
from mtjax.models.registry import (Family, FamilyError, Piece, block_index, register,
                                   rotary_buffers)
from mtjax.models.common import Reader, base_config, expert_pieces, standard_pieces

# transformers' defaults for keys a config.json may leave out (DeepseekV2Config, DeepseekV3Config).
_COMMON = dict(rms_norm_eps=1e-6, tie_word_embeddings=False, hidden_act="silu", kv_lora_rank=512,
               q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
               attention_bias=False)
_DEFAULTS = {
    2: dict(_COMMON, first_k_dense_replace=0, n_routed_experts=64, n_shared_experts=2,
            moe_intermediate_size=1407, routed_scaling_factor=1.0, topk_method="greedy",
            mlp_bias=False),
    3: dict(_COMMON, first_k_dense_replace=3, n_routed_experts=256, n_shared_experts=1,
            moe_intermediate_size=2048, routed_scaling_factor=2.5, n_group=8, topk_group=4,
            num_experts_per_tok=8, norm_topk_prob=True, rope_interleave=True,
            num_key_value_heads=128, num_nextn_predict_layers=1),
}
# config.json's other spellings of the expert count (transformers' attribute_map).
_EXPERTS_ALIAS = {2: "num_experts", 3: "num_local_experts"}
_ARCH = {2: ("deepseek_v2", "DeepseekV2ForCausalLM"), 3: ("deepseek_v3", "DeepseekV3ForCausalLM")}


def _int(r: Reader, key: str, minimum: int = 1) -> int:
  value = r.get(key)
  if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
    raise FamilyError(f"{r.where}: {key}={value!r} must be an integer >= {minimum}")
  return value


def _mla(r: Reader, version: int) -> MLAConfig:
  q_rank = r.c.get("q_lora_rank")  # null: a full query projection (V2-Lite)
  if q_rank is not None:
    q_rank = _int(r, "q_lora_rank")
  rope = _int(r, "qk_rope_head_dim")
  if rope % 2:
    r.refuse("qk_rope_head_dim", "RoPE rotates channel pairs")
  # V2 rotates interleaved pairs always (complex multiplication); V3 when rope_interleave.
  interleave = True if version == 2 else bool(r.opt("rope_interleave", True))
  return MLAConfig(kv_lora_rank=_int(r, "kv_lora_rank"), q_lora_rank=q_rank,
                   qk_nope_dim=_int(r, "qk_nope_head_dim"), qk_rope_dim=rope,
                   v_dim=_int(r, "v_head_dim"), rope_interleave=interleave)


def _moe(r: Reader, version: int, layers: int) -> MoEConfig:
  alias = _EXPERTS_ALIAS[version]
  experts_key = alias if r.c.get(alias) is not None else "n_routed_experts"
  E, k = _int(r, experts_key), _int(r, "num_experts_per_tok")
  if k > E:
    raise FamilyError(f"{r.where}: num_experts_per_tok={k} exceeds {experts_key}={E}")
  scaling = r.positive("routed_scaling_factor")
  fields = dict(experts=E, experts_per_token=k, expert_ffn=_int(r, "moe_intermediate_size"),
                shared_experts=_int(r, "n_shared_experts"), routed_scaling=float(scaling),
                # transformers makes every layer from this one on a mixture (moe_layer_freq unread)
                first_dense_layers=min(_int(r, "first_k_dense_replace", 0), layers))
  groups = topk_groups = 1
  if version == 2:
    method = r.opt("topk_method", "greedy")
    if method not in ("greedy", "group_limited_greedy"):
      r.refuse("topk_method", "transformers' DeepSeek-V2 router takes greedy or "
               "group_limited_greedy")
    if method == "group_limited_greedy":
      groups, topk_groups = _int(r, "n_group"), _int(r, "topk_group")
    fields.update(router="softmax", group_score="max", norm_topk_prob=False)
  else:
    groups, topk_groups = _int(r, "n_group"), _int(r, "topk_group")
    fields.update(router="sigmoid", group_score="top2_sum", score_correction_bias=True,
                  norm_topk_prob=bool(r.opt("norm_topk_prob", True)))
  if groups > 1:
    if E % groups or (version == 3 and E // groups < 2):
      r.refuse("n_group", f"must split the {E} experts into equal groups"
               + (" of at least 2 (V3 scores a group by its best two)" if version == 3 else ""))
    if topk_groups > groups:
      r.refuse("topk_group", f"exceeds n_group={groups}")
    if k > topk_groups * (E // groups):
      r.refuse("num_experts_per_tok", f"exceeds the experts of topk_group={topk_groups} groups")
  elif topk_groups != 1:
    r.refuse("topk_group", "one group of experts: only 1 can be kept")
  return MoEConfig(groups=groups, topk_groups=topk_groups, **fields)


def _read(version: int):
  def read(config: dict, where: str) -> dict:
    r = Reader(config, where, _DEFAULTS[version])
    act = r.act("hidden_act", {"silu": "silu"})
    if r.opt("attention_bias"):
      r.refuse("attention_bias", "mtjax's latent attention has no biases")
    if version == 2 and r.opt("mlp_bias"):
      r.refuse("mlp_bias", "mtjax's DeepSeek MLPs have no biases")
    fields = dict(r.shape(), **r.rope(), mlp_act=act)
    if fields["kv_heads"] != fields["heads"]:
      r.refuse("num_key_value_heads", "latent attention expands keys and values for each of "
               f"the num_attention_heads={fields['heads']} heads")
    rope = fields["rope"]
    if rope.scaling not in ("none", "yarn"):
      r.refuse("rope_parameters" if config.get("rope_parameters") else "rope_scaling",
               f"rope_type {rope.scaling!r}: DeepSeek's latent attention takes default or yarn "
               f"RoPE")
    if rope.partial != 1.0:
      r.refuse("partial_rotary_factor", "qk_rope_head_dim sets the rotated channels")
    mla = _mla(r, version)
    # transformers sets head_dim to qk_rope_head_dim; mtjax's heads are the MLA config's widths.
    hidden, heads = fields["hidden"], fields["heads"]
    fields.update(kv_heads=None, mla=mla, moe=_moe(r, version, fields["layers"]),
                  head_dim=None if hidden % heads == 0 else mla.qk_nope_dim + mla.qk_rope_dim)
    return fields
  return read


def _write(version: int):
  model_type, arch = _ARCH[version]

  def write(cfg: ModelConfig, dtype: str) -> dict:
    m, a = cfg.moe, cfg.mla
    if m is None or a is None:
      raise FamilyError(f"{model_type}: a config.json needs model.moe and model.mla")
    out = base_config(cfg, arch, model_type, dtype)
    out.update(hidden_act="silu", attention_bias=False, head_dim=a.qk_rope_dim,
               num_key_value_heads=cfg.heads, kv_lora_rank=a.kv_lora_rank,
               q_lora_rank=a.q_lora_rank, qk_nope_head_dim=a.qk_nope_dim,
               qk_rope_head_dim=a.qk_rope_dim, v_head_dim=a.v_dim,
               n_routed_experts=m.experts, num_experts_per_tok=m.experts_per_token,
               moe_intermediate_size=m.expert_ffn, n_shared_experts=m.shared_experts,
               first_k_dense_replace=m.first_dense_layers, routed_scaling_factor=m.routed_scaling,
               norm_topk_prob=m.norm_topk_prob, n_group=m.groups, topk_group=m.topk_groups)
    if version == 2:
      out.update(mlp_bias=False,
                 topk_method="group_limited_greedy" if m.groups > 1 else "greedy")
    else:
      out["rope_interleave"] = a.rope_interleave
    return out
  return write


# mtjax path in a block -> its name under model.layers.<i>. where the Llama-style names differ.
_NAMES = {
    ("attn", "kv_a", "kernel"): "self_attn.kv_a_proj_with_mqa.weight",
    ("attn", "q_a_norm", "scale"): "self_attn.q_a_layernorm.weight",
    ("attn", "kv_a_norm", "scale"): "self_attn.kv_a_layernorm.weight",
    ("mlp", "router", "kernel"): "mlp.gate.weight",
    ("mlp", "e_bias"): "mlp.gate.e_score_correction_bias",
    ("mlp", "shared", "gate", "kernel"): "mlp.shared_experts.gate_proj.weight",
    ("mlp", "shared", "up", "kernel"): "mlp.shared_experts.up_proj.weight",
    ("mlp", "shared", "down", "kernel"): "mlp.shared_experts.down_proj.weight",
}
_EXPERT_W = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}


def pieces(cfg: ModelConfig, group: str, layout: Layout) -> list[Piece]:
  """Llama-style names, the latent attention's and the mixture's own, one piece per expert."""
  i = block_index(group)
  experts = lambda path: path[:2] == ("mlp", "experts")
  block_name = lambda path: "<stacked>" if experts(path) else _NAMES.get(path)
  shapes = dict(zip(layout.paths, layout.shapes))
  out = []
  for p in standard_pieces(cfg, group, layout, block_name if i is not None else None):
    if experts(p.path):
      w = _EXPERT_W.get(p.path[2])
      if w is None:
        raise FamilyError(f"{group}: parameter {'/'.join(p.path)} has no Hugging Face name")
      out += expert_pieces(i, p.path, shapes[p.path], lambda e, w=w: f"mlp.experts.{e}.{w}.weight")
    else:
      out.append(p)
  return out


def _ignored(version: int):
  def ignored(config: dict, name: str) -> bool:
    """RoPE buffers, and the multi-token-prediction layers (V3: `num_nextn_predict_layers` of
    them after the num_hidden_layers decoder layers), which transformers does not load either."""
    if rotary_buffers(config, name):
      return True
    r = Reader(config, "config.json", _DEFAULTS[version])
    layers, extra = r.opt("num_hidden_layers"), r.opt("num_nextn_predict_layers", 0)
    if not (isinstance(layers, int) and isinstance(extra, int)):
      return False  # no counts to place the layers by
    return any(name.startswith(f"model.layers.{i}.") for i in range(layers, layers + extra))
  return ignored


NOTES = {
    2: ("DeepSeek-V2, V2-Lite: latent attention (low-rank or full query projection), softmax router "
        "greedy or group_limited_greedy (never renormalised, as transformers), shared experts, "
        "YaRN with mscale/mscale_all_dim; no attention or MLP biases, no auxiliary loss (as "
        "transformers)"),
    3: ("DeepSeek-V3 and its architecture in bf16/fp32 (no FP8): sigmoid router, group-limited by "
        "each group's best two, with the score correction bias (a parameter that stays as "
        "imported: no gradient, no load-based update), shared experts, YaRN mscale; the "
        "multi-token-prediction layers (num_nextn_predict_layers) are skipped, as transformers"),
}
for version in (2, 3):
  register(Family(_ARCH[version][0], (_ARCH[version][1],), _read(version), _write(version), pieces,
                  ignored=_ignored(version), notes=NOTES[version]))
