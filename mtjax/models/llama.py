"""The Llama family and its close relatives: Llama 2/3/3.1/3.2, Mistral (a sliding window in every
layer when config.json sets one), Qwen2/2.5 (q/k/v biases; sliding windows from
`max_window_layers` on when `use_sliding_window`), Qwen3 (q/k norms per head)."""

from __future__ import annotations

from mtjax.config import ModelConfig
from mtjax.models.registry import Family, register
from mtjax.models.common import Reader, base_config, layer_type_names, standard_pieces

# Values transformers assumes when config.json omits a key (save_pretrained drops some defaults).
_DEFAULTS = dict(rms_norm_eps=1e-6, tie_word_embeddings=False, hidden_act="silu")


def _read(family: str):
  def read(config: dict, where: str) -> dict:
    r = Reader(config, where, {**_DEFAULTS, **({"head_dim": 128} if family == "qwen3" else {})})
    act = r.act("hidden_act", {"silu": "silu"})
    if r.opt("mlp_bias"):
      r.refuse("mlp_bias", "this family's MLP has no biases in transformers' implementation")
    if family in ("llama", "qwen3", "mistral") and r.opt("attention_bias"):
      r.refuse("attention_bias", "a bias on q/k/v and o_proj is not in mtjax's llama family")
    fields = dict(r.shape(), **r.rope(), mlp_act=act)
    if family == "qwen2":
      fields["qkv_bias"] = True
    if family == "qwen3":
      fields["qk_norm"] = True
    layers = fields["layers"]
    window = r.opt("sliding_window")
    if family == "mistral" and window is not None:
      fields.update(sliding_window=int(window), layer_types=("sliding",) * layers)
    elif family in ("qwen2", "qwen3") and r.opt("use_sliding_window", False) and window:
      types = r.layer_types(layers)
      if types is None and config.get("layer_types") is None:  # older files: from max_window_layers
        first = int(r.opt("max_window_layers", layers))
        types = tuple("sliding" if i >= first else "full" for i in range(layers))
        types = None if all(t == "full" for t in types) else types
      if types is not None:
        fields.update(sliding_window=int(window), layer_types=types)
    elif family == "llama" and r.opt("layer_types") and r.layer_types(layers) is not None:
      r.refuse("layer_types", "Llama attends to the whole context in every layer")
    return fields
  return read


def _write(arch: str, model_type: str):
  def write(cfg: ModelConfig, dtype: str) -> dict:
    out = base_config(cfg, arch, model_type, dtype)
    out["hidden_act"] = "silu"
    if model_type == "llama":
      out.update(attention_bias=False, mlp_bias=False)
    elif model_type == "mistral":
      out["sliding_window"] = cfg.sliding_window
    else:
      windowed = cfg.layer_types is not None and "sliding" in cfg.layer_types
      out.update(use_sliding_window=windowed, sliding_window=cfg.sliding_window,
                 max_window_layers=(cfg.layer_types.index("sliding") if windowed else cfg.layers),
                 layer_types=layer_type_names(cfg), attention_bias=cfg.qkv_bias)
    return out
  return write


def _write_llama(cfg: ModelConfig, dtype: str) -> dict:
  """A model configured from scratch as `llama` with Qwen's options is written as that Qwen."""
  if cfg.qk_norm:
    return _write("Qwen3ForCausalLM", "qwen3")(cfg, dtype)
  if cfg.qkv_bias:
    return _write("Qwen2ForCausalLM", "qwen2")(cfg, dtype)
  return _write("LlamaForCausalLM", "llama")(cfg, dtype)


NOTES = {
    "llama": "Llama 2, 3, 3.1 (llama3 RoPE), 3.2 (tied); no attention or MLP biases",
    "mistral": "Mistral 7B v0.1-v0.3, Nemo; the sliding window as a real window",
    "qwen2": "Qwen2, Qwen2.5 (q/k/v biases); sliding layers when use_sliding_window",
    "qwen3": "Qwen3 dense (q/k norms per head)",
}
for name, arch in (("llama", "LlamaForCausalLM"), ("mistral", "MistralForCausalLM"),
                   ("qwen2", "Qwen2ForCausalLM"), ("qwen3", "Qwen3ForCausalLM")):
  register(Family(name, (arch,), _read(name),
                  _write_llama if name == "llama" else _write(arch, name), standard_pieces,
                  notes=NOTES[name]))
