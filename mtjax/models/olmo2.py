"""The OLMo 2 family (Olmo2ForCausalLM): a Llama-style decoder whose norms follow the attention and
the MLP instead of preceding them (norm_position "post"), with q and k each RMS-normalised over
the whole projection, all heads together, before RoPE (qk_norm_scope "all")."""

from __future__ import annotations

from mtjax.config import ModelConfig
from mtjax.models.registry import Family, FamilyError, register
from mtjax.models.common import Reader, base_config, standard_pieces

# Olmo2Config's defaults for keys save_pretrained may leave out.
_DEFAULTS = dict(rms_norm_eps=1e-5, tie_word_embeddings=False, hidden_act="silu",
                 max_position_embeddings=2048)


def _read(config: dict, where: str) -> dict:
  r = Reader(config, where, _DEFAULTS)
  act = r.act("hidden_act", {"silu": "silu"})
  if r.opt("attention_bias"):
    r.refuse("attention_bias", "mtjax's olmo2 family has no q/k/v/o biases")
  fields = dict(r.shape(), **r.rope(), mlp_act=act, norm_position="post", qk_norm=True,
                qk_norm_scope="all")
  if fields["rope"].partial != 1.0:
    raise FamilyError(f"{where}: partial_rotary_factor={fields['rope'].partial} unsupported "
                      f"(transformers' OLMo 2 rotates whole heads)")
  return fields


def _write(cfg: ModelConfig, dtype: str) -> dict:
  out = base_config(cfg, "Olmo2ForCausalLM", "olmo2", dtype)
  # Olmo2Config's default token ids are OLMo 2's tokenizer's: unknown here, and its pad id makes
  # an embedding row transformers never trains.
  out.update(hidden_act="silu", attention_bias=False, pad_token_id=None, bos_token_id=None,
             eos_token_id=None)
  return out


register(Family("olmo2", ("Olmo2ForCausalLM",), _read, _write, standard_pieces,
                notes="OLMo 2 (norms after attention and MLP, q/k norms over the whole "
                      "projection); no attention biases"))
