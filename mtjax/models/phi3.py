"""The Phi-3 family (Phi3ForCausalLM): Phi-3 and Phi-3.5 mini/medium, Phi-4, Phi-4-mini.

A Llama-style decoder whose checkpoints fuse q/k/v into `qkv_proj` and gate/up into
`gate_up_proj`: each fused tensor is several pieces here, split into mtjax's separate parameters on
import and fused again on export. RoPE is plain or `longrope` (short factors up to
original_max_position_embeddings, long ones beyond), rotating a share of each head
(partial_rotary_factor: Phi-4-mini 0.75). A `sliding_window` in config.json windows every layer
(transformers 5 builds one sliding causal mask for all layers when it is set).
"""

from __future__ import annotations

from mtjax.config import ModelConfig
from mtjax.layout import Layout
from mtjax.models.registry import Family, FamilyError, Piece, block_index, register
from mtjax.models.common import Reader, base_config, standard_pieces

# Phi3Config's defaults for keys save_pretrained may leave out.
_DEFAULTS = dict(rms_norm_eps=1e-5, tie_word_embeddings=False, hidden_act="silu",
                 max_position_embeddings=4096, original_max_position_embeddings=4096)


def _rope_config(config: dict, where: str) -> dict:
  """config.json with its RoPE keys as Phi3Config reads them, in the form `Reader.rope` reads.

  Phi3Config prefers `rope_scaling` to `rope_parameters`, reads the older types "su" and "yarn" as
  longrope, and lets the top-level original_max_position_embeddings (default 4096) override the
  one inside the RoPE dict.
  """
  key = "rope_scaling" if config.get("rope_scaling") else "rope_parameters"
  rope = config.get(key)
  if rope is None:
    rope = {}
  if not isinstance(rope, dict):
    raise FamilyError(f"{where}: {key}={rope!r} unsupported (expected a dict)")
  rope = dict(rope)
  kind = rope.get("rope_type", rope.get("type", "default"))
  if kind in ("su", "yarn"):
    kind = "longrope"
  if kind not in ("default", "longrope"):
    raise FamilyError(f"{where}: {key} rope_type {kind!r} unsupported (Phi-3 takes default or "
                      f"longrope)")
  rope["rope_type"] = kind
  if kind == "longrope":
    rope["original_max_position_embeddings"] = config.get(
        "original_max_position_embeddings") or _DEFAULTS["original_max_position_embeddings"]
  return {**config, "rope_parameters": rope, "rope_scaling": None}


def _read(config: dict, where: str) -> dict:
  r = Reader(_rope_config(config, where), where, _DEFAULTS)
  act = r.act("hidden_act", {"silu": "silu"})
  fields = dict(r.shape(), **r.rope(), mlp_act=act)
  rope = fields["rope"]
  if rope.scaling == "longrope":
    half = int((fields["head_dim"] or fields["hidden"] // fields["heads"]) * rope.partial) // 2
    for k in ("short_factor", "long_factor"):
      n = len(getattr(rope, k))
      if n != half:
        raise FamilyError(f"{where}: rope {k} has {n} values, expected {half} (half the RoPE "
                          f"channels of a head)")
  window = r.positive("sliding_window", required=False)
  if window is not None:
    fields.update(sliding_window=int(window), layer_types=("sliding",) * fields["layers"])
  return fields


def _write(cfg: ModelConfig, dtype: str) -> dict:
  types = set(cfg.layer_types or ("full",))
  out = base_config(cfg, "Phi3ForCausalLM", "phi3", dtype)
  out.update(hidden_act="silu", original_max_position_embeddings=cfg.rope.original_max_len,
             sliding_window=cfg.sliding_window if types == {"sliding"} else None,
             # Phi3Config's token ids are Phi-3's tokenizer's: unknown here, and a pad id beyond
             # the vocabulary would not load.
             pad_token_id=None, bos_token_id=None, eos_token_id=None)
  return out


def _pieces(cfg: ModelConfig, group: str, layout: Layout) -> list[Piece]:
  """Llama's names, but q/k/v rows of one `qkv_proj` and gate/up rows of one `gate_up_proj`."""
  i = block_index(group)
  pieces = standard_pieces(cfg, group, layout)
  if i is None:
    return pieces
  H, K, hd, F = cfg.heads, cfg.n_kv_heads, cfg.dim_per_head, cfg.ffn
  qkv = f"model.layers.{i}.self_attn.qkv_proj.weight"
  gate_up = f"model.layers.{i}.mlp.gate_up_proj.weight"
  rows = {("attn", "q", "kernel"): (qkv, 0, H * hd), ("attn", "k", "kernel"): (qkv, H * hd, K * hd),
          ("attn", "v", "kernel"): (qkv, (H + K) * hd, K * hd),
          ("mlp", "gate", "kernel"): (gate_up, 0, F), ("mlp", "up", "kernel"): (gate_up, F, F)}
  fused_rows = {qkv: (H + 2 * K) * hd, gate_up: 2 * F}
  out = []
  for p in pieces:
    if p.path in rows:
      name, start, n = rows[p.path]
      p = Piece(name, (fused_rows[name], p.shape[1]), p.path, src=(slice(start, start + n),),
                transpose=True)
    out.append(p)
  return out


register(Family("phi3", ("Phi3ForCausalLM",), _read, _write, _pieces,
                notes="Phi-3/3.5 mini and medium, Phi-4, Phi-4-mini: fused qkv/gate_up, longrope "
                      "(short/long factors), partial rotary, sliding window in every layer"))
