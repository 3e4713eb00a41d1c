"""A model's spec: everything the rest of mtjax asks of a model, from its config alone (layer kinds
and their order, flat layouts, parameter counts, FLOPs, the auxiliary loss, the init rule)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from mtjax.config import ModelConfig
from mtjax.layout import Layout
from mtjax.models import deltanet, moe, vision
from mtjax.models.block import Block
from mtjax.models.layers import Embed, Head, block_kind
from mtjax.models.registry import Family, get


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """Everything the rest of mtjax needs to know of a model, from its config alone."""
  cfg: ModelConfig
  family: Family
  groups: tuple[tuple[str, str], ...]  # (group name, kind) in forward order
  kinds: dict  # block kind name -> BlockKind
  layouts: dict  # kind name ("embed", "head", each block kind) -> Layout

  def block(self, kind: str, implementation: str | None = None, seq_tile: int | None = None,
            moe_impl: str = "ragged", dtype=jnp.float32):
    """The module of a block kind: a decoder Block, or a vision tower layer (mtjax.models.vision,
    computing in `dtype`)."""
    if kind in vision.KINDS:
      return vision.module(self.cfg, kind, dtype)
    return Block(self.cfg, self.kinds[kind], implementation, seq_tile, moe_impl)

  @property
  def tower(self) -> int:
    """Block groups before the decoder's: the vision tower's (embedding, blocks, projector)."""
    return len(vision.group_kinds(self.cfg))

  def part(self, kind: str) -> str:
    """The part of the model a group of `kind` belongs to (train.freeze's names)."""
    return "projector" if kind == "projector" else "vision" if kind in vision.KINDS else "language"

  def backward_modes(self, freeze=()) -> list[str]:
    """What the backward does at each group, in forward order, with the parts `freeze` names
    held: "full" (a gradient for its weights), "dx" (frozen: only its input's cotangent, for a
    trained group below), "pass" (a frozen tower group with no trained tower group below: the
    text stream's cotangent passes it, the features' is never needed) or "skip" (frozen, nothing
    below trains: the backward has ended)."""
    kinds = [k for _, k in self.groups]
    frozen = [self.part(k) in freeze for k in kinds]
    first = frozen.index(False)
    modes = []
    for i, k in enumerate(kinds):
      if not frozen[i]:
        modes.append("full")
      elif i < first:
        modes.append("skip")
      elif k in vision.KINDS and all(frozen[j] for j in range(i) if kinds[j] in vision.KINDS):
        modes.append("pass")
      else:
        modes.append("dx")
    return modes

  def text_layer(self, block: int) -> int | None:
    """The decoder layer index of the `block`-th block group, None for a tower group."""
    return None if block < self.tower else block - self.tower

  def embed(self, dtype=jnp.float32) -> Embed:
    return Embed(self.cfg, dtype)

  def head(self) -> Head:
    return Head(self.cfg)

  def group_layout(self, group: str) -> Layout:
    return self.layouts[dict(self.groups)[group]]

  @functools.cached_property
  def counts(self) -> dict[str, int]:
    """Parameters: `total`, `active` per token (a mixture's unchosen experts left out), and of
    each kind (`embed`, `head`, each block kind) one group's."""
    out = {k: lay.size for k, lay in self.layouts.items()}
    out["total"] = sum(self.layouts[k].size for _, k in self.groups)
    out["active"] = out["total"] - sum(self.inactive(k) for _, k in self.groups)
    return out

  def inactive(self, kind: str) -> int:
    """Parameters of one group of `kind` a token does not use: the routed experts it is not sent
    to (their stacked tensors' share (E - k) / E)."""
    return self._per_kind[kind][0]

  def matmul_params(self, kind: str) -> int:
    """One group's matrix parameters a token multiplies by (active experts only)."""
    return self._per_kind[kind][1]

  @functools.cached_property
  def _per_kind(self) -> dict[str, tuple[int, int]]:
    """(inactive, matmul) parameters of each kind, counted once (the planner asks often)."""
    out = {}
    moe = self.cfg.moe
    for kind, lay in self.layouts.items():
      sizes = [(p, int(np.prod(s)), len(s)) for p, s in zip(lay.paths, lay.shapes)]
      inactive = 0
      if kind in self.kinds and self.kinds[kind].moe:
        experts = sum(n for p, n, _ in sizes if "experts" in p)
        inactive = experts * (moe.experts - moe.experts_per_token) // moe.experts
      out[kind] = (inactive, sum(n for _, n, nd in sizes if nd >= 2) - inactive)
    return out

  def attention_pairs(self, layer: int, batch: int, seq: int, causal_half: bool) -> float:
    """(query, key) pairs one layer scores over a batch: all T^2 of them, or the causal ones a
    flash kernel computes; a sliding layer only those within its window."""
    window = self.cfg.sliding_window if self.cfg.layer_type(layer) == "sliding" else None
    if window is not None and window < seq:  # sum over queries of min(i + 1, W)
      return float(batch * (window * seq - window * (window - 1) / 2))
    return float(batch * seq * (seq + 1) / 2 if causal_half else batch * seq * seq)

  @property
  def attention_widths(self) -> tuple[int, int, int]:
    """(query heads, query/key width, value width) per head."""
    m = self.cfg
    if m.mla is not None:
      return m.heads, m.mla.qk_nope_dim + m.mla.qk_rope_dim, m.mla.v_dim
    return m.heads, m.dim_per_head, m.dim_per_head

  def mixer_forward_flops(self, layer: int, batch: int, seq: int, causal_half: bool) -> float:
    """One layer's matmuls along the sequence in the forward, beside its parameters': attention's
    scores and values over its (query, key) pairs, or a gated DeltaNet's chunked scan."""
    if self.cfg.layer_type(layer) == "linear":
      return deltanet.scan_flops(self.cfg, batch, seq)
    N, dqk, dv = self.attention_widths
    return 2 * N * (dqk + dv) * self.attention_pairs(layer, batch, seq, causal_half)

  def attention_forward_flops(self, batch: int, seq: int, causal_half: bool) -> float:
    """All blocks' matmuls along the sequence (`mixer_forward_flops`) in the forward."""
    return sum(self.mixer_forward_flops(i, batch, seq, causal_half)
               for i in range(self.cfg.layers))

  def aux_loss(self, sums: list[dict]):
    """(loss, metrics) of the blocks' auxiliary sums, one dict per block in order (empty for a
    dense block): the family's auxiliary loss, else a mixture's load balance and z-loss
    (mtjax.models.moe.aux_loss, weighted by the config's coefficients)."""
    if not self.has_aux:
      return jnp.zeros((), jnp.float32), {}
    return (self.family.aux_loss or moe.aux_loss)(self.cfg, sums)

  @property
  def has_aux(self) -> bool:
    """Whether blocks return sums an auxiliary loss (and its metrics) is made of."""
    return any(k.moe for k in self.kinds.values())

  def init_value(self, path: tuple[str, ...]) -> str:
    """How a parameter starts: "normal" (N(0, init_std)), "ones" or "zeros"."""
    leaf = path[-1]
    if leaf == "scale":  # a DeltaNet's gated norm and the vision tower's LayerNorms scale by w
      plain = path[-2] in ("out_norm", "norm1", "norm2", "pre_norm", "post_norm")
      return "zeros" if self.cfg.norm_offset and not plain else "ones"
    if leaf in ("bias", "sinks", "e_bias", "A_log"):  # A_log 0: a decay rate of 1 per step
      return "zeros"
    if leaf == "dt_bias":
      return "ones"
    return "normal"


def _layouts(cfg: ModelConfig, kinds: dict) -> dict[str, Layout]:
  """The flat layouts of every layer kind, from shapes alone: nothing is allocated and the jax
  backend does not start (the planner runs before it may)."""
  def shapes(module, *args):
    # Inputs made inside the traced function: abstract, no device array.
    return jax.eval_shape(lambda: module.init(jax.random.key(0), *(
        jnp.zeros(shape, dtype) for shape, dtype in args)))["params"]

  x = ((1, 2, cfg.hidden), jnp.float32)
  out = {"embed": shapes(Embed(cfg), ((1, 2), jnp.int32)),
         "head": shapes(Head(cfg), x, ((cfg.vocab_size, cfg.hidden), jnp.float32))}
  for name, kind in kinds.items():
    if name in vision.KINDS:
      out[name] = jax.eval_shape(lambda k=name: vision.module(cfg, k).init(
          jax.random.key(0), *vision.sample_carry(cfg, k)))["params"]
    elif kind.deepstack:
      out[name] = jax.eval_shape(lambda k=kind: Block(cfg, k).init(
          jax.random.key(0), *vision.sample_carry(cfg, k.name, deepstack=k.deepstack)))["params"]
    else:
      out[name] = shapes(Block(cfg, kind), x)
  return {k: Layout.from_shapes(v) for k, v in out.items()}


@functools.lru_cache(maxsize=64)
def spec(cfg: ModelConfig) -> ModelSpec:
  """The model spec of `cfg`: its family, layer kinds in order, layouts and counts."""
  family = get(cfg.family)
  tower = vision.group_kinds(cfg)
  order = [block_kind(cfg, i) for i in range(cfg.layers)]
  kinds = {k.name: k for _, k in tower} | {k.name: k for k in order}
  groups = (("embed", "embed"), *((g, k.name) for g, k in tower),
            *((f"block_{i}", k.name) for i, k in enumerate(order)), ("head", "head"))
  return ModelSpec(cfg, family, groups, kinds, _layouts(cfg, kinds))
