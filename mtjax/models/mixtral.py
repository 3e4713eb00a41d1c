"""Mixtral: Mistral's decoder with a mixture of experts in every layer (softmax router over
`num_local_experts`, the top `num_experts_per_tok` renormalised); Mistral's sliding window in
every layer when config.json sets one.

Checkpoints keep each expert's SwiGLU as its own Linear weights
(`block_sparse_moe.experts.<e>.w1/w3/w2`: gate, up, down), which mtjax stacks into its [E, D, F] /
[E, F, D] expert parameters, one piece per expert. `router_aux_loss_coef` weighs the
load-balancing loss in the training loss, as transformers does with output_router_logits.
"""

from __future__ import annotations

from collections.abc import Callable

from mtjax.config import ModelConfig, MoEConfig
from mtjax.layout import Layout
from mtjax.models.registry import Family, FamilyError, Piece, block_index, register
from mtjax.models.common import Reader, base_config, expert_pieces, standard_pieces

# Values transformers assumes when config.json omits a key (save_pretrained drops some defaults).
_DEFAULTS = dict(rms_norm_eps=1e-5, tie_word_embeddings=False, hidden_act="silu", rope_theta=1e6,
                 num_experts_per_tok=2, router_aux_loss_coef=0.001, router_jitter_noise=0.0)
_EXPERT_W = {"gate": "w1", "up": "w3", "down": "w2"}


def routed(r: Reader, experts_keys: tuple[str, ...], default: int, width: int, **moe) -> MoEConfig:
  """The routed experts' MoEConfig from config.json's expert count, top-k and aux coefficient.

  transformers' attribute_map makes two keys one: of those present, the alias (set after the
  dataclass field) wins. `experts_keys` lists them so, the config class's own field last; neither
  present: `default`.
  """
  experts_key = next((key for key in experts_keys if r.c.get(key) is not None), None)
  E = default if experts_key is None else r.positive(experts_key)
  experts_key = experts_key or experts_keys[-1]
  k = r.positive("num_experts_per_tok")
  if not isinstance(E, int) or not isinstance(k, int) or k > E:
    raise FamilyError(f"{r.where}: num_experts_per_tok={k} must be an integer <= "
                      f"{experts_key}={E}")
  coef = r.opt("router_aux_loss_coef", 0.0)
  if isinstance(coef, bool) or not isinstance(coef, (int, float)) or coef < 0:
    raise FamilyError(f"{r.where}: router_aux_loss_coef={coef!r} must be a number >= 0")
  return MoEConfig(experts=E, experts_per_token=k, expert_ffn=width, router="softmax",
                   aux_loss_coef=float(coef), **moe)


def moe_pieces(names: dict, expert_name: Callable[[int, str], str]):
  """A tensor map of Llama-style names where `names` (mtjax path in a block -> name under
  model.layers.<i>.) places the MoE's router and shared experts and `expert_name(e, w)` names
  expert e's gate, up or down weight (w), one piece per expert of the stacked parameter."""
  def pieces(cfg: ModelConfig, group: str, layout: Layout) -> list[Piece]:
    i = block_index(group)
    shapes = dict(zip(layout.paths, layout.shapes))
    experts = lambda path: path[:2] == ("mlp", "experts")
    block_name = lambda path: "<stacked>" if experts(path) else names.get(path)
    out = []
    for p in standard_pieces(cfg, group, layout, block_name if i is not None else None):
      if experts(p.path):
        if p.path[2] not in _EXPERT_W:
          raise FamilyError(f"{group}: parameter {'/'.join(p.path)} has no Hugging Face name")
        out += expert_pieces(i, p.path, shapes[p.path], lambda e: expert_name(e, p.path[2]))
      else:
        out.append(p)
    return out
  return pieces


def _read(config: dict, where: str) -> dict:
  r = Reader(config, where, _DEFAULTS)
  act = r.act("hidden_act", {"silu": "silu"})
  if r.opt("router_jitter_noise"):  # multiplicative noise on the router input while training
    r.refuse("router_jitter_noise", "mtjax's router takes no noise; 0.0 trains as transformers")
  fields = dict(r.shape(), **r.rope(), mlp_act=act)
  # Every layer is a mixture: intermediate_size is the experts' width (the dense ffn is unused).
  fields["moe"] = routed(r, ("num_experts", "num_local_experts"), 8, fields["ffn"],
                         norm_topk_prob=True)
  window = r.positive("sliding_window", required=False)
  if window is not None:  # Mistral's window, in every layer
    fields.update(sliding_window=int(window), layer_types=("sliding",) * fields["layers"])
  return fields


def _write(cfg: ModelConfig, dtype: str) -> dict:
  m = cfg.moe
  out = base_config(cfg, "MixtralForCausalLM", "mixtral", dtype)
  windowed = cfg.layer_types is not None and "sliding" in cfg.layer_types
  out.update(hidden_act="silu", intermediate_size=m.expert_ffn, num_local_experts=m.experts,
             num_experts_per_tok=m.experts_per_token, router_aux_loss_coef=m.aux_loss_coef,
             router_jitter_noise=0.0, sliding_window=cfg.sliding_window if windowed else None)
  return out


NOTES = ("Mixtral 8x7B / 8x22B (softmax top-k router, renormalised; Mistral's sliding window when "
         "set); config.json's router_aux_loss_coef weighs the load-balancing loss in training, as "
         "transformers with output_router_logits; no router jitter")
register(Family("mixtral", ("MixtralForCausalLM",), _read, _write,
                moe_pieces({("mlp", "router", "kernel"): "block_sparse_moe.gate.weight"},
                           lambda e, w: f"block_sparse_moe.experts.{e}.{_EXPERT_W[w]}.weight"),
                notes=NOTES))
