"""Typed, frozen run configuration read from YAML with dotted command-line overrides."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
  """A config value is unknown, of the wrong type or impossible; the message names the key."""


@dataclasses.dataclass(frozen=True)
class MoEConfig:
  """A mixture-of-experts feed-forward: routed experts, optional shared ones, and the router."""
  experts: int = 8  # routed experts E
  experts_per_token: int = 2  # experts each token is sent to (top-k)
  expert_ffn: int = 64  # inner width of each routed expert
  router: Literal["softmax", "topk_softmax", "sigmoid"] = "softmax"  # softmax over all experts then top-k (Mixtral, Qwen, DeepSeek-V2); softmax over the top-k logits (GPT-OSS); sigmoid scores (DeepSeek-V3)
  norm_topk_prob: bool = True  # renormalise the chosen experts' weights to sum to 1
  router_bias: bool = False  # a learned bias on the router logits (GPT-OSS)
  score_correction_bias: bool = False  # a bias added to the scores only to choose experts (DeepSeek-V3)
  groups: int = 1  # group-limited routing: experts fall in this many groups (DeepSeek n_group)
  topk_groups: int = 1  # tokens choose experts only within this many best groups
  group_score: Literal["max", "top2_sum"] = "max"  # a group's score: its best expert (DeepSeek-V2) or its best two summed (V3)
  routed_scaling: float = 1.0  # multiplies the routed experts' weights (routed_scaling_factor)
  shared_experts: int = 0  # experts every token passes through (DeepSeek n_shared_experts; Qwen2-MoE 1)
  shared_ffn: int | None = None  # the shared experts' inner width together; None: shared_experts * expert_ffn
  shared_gate: bool = False  # a sigmoid gate per token on the shared experts' output (Qwen2-MoE)
  first_dense_layers: int = 0  # the first layers use a dense MLP of width model.ffn (first_k_dense_replace)
  dense_layers: tuple[int, ...] = ()  # further layers with a dense MLP (Qwen2-MoE mlp_only_layers)
  every: int = 1  # every k-th layer is a mixture (decoder_sparse_step), the others dense
  aux_loss_coef: float = 0.0  # weight of the load-balancing loss in the training loss
  z_loss_coef: float = 0.0  # weight of the router z-loss (mean squared logsumexp of the logits)
  capacity_factor: float | None = None  # None: dropless; else each expert takes at most factor x (tokens x k / E) and the rest are dropped (and counted)
  weight_inputs: bool = False  # the routing weight scales each chosen expert's input instead of its output (Llama 4)

  def __post_init__(self):
    _positive(self, "experts", "experts_per_token", "expert_ffn", "groups", "topk_groups", "every",
              section="model.moe.")
    if self.experts_per_token > self.experts:
      raise ConfigError(f"model.moe.experts_per_token: {self.experts_per_token} exceeds "
                        f"model.moe.experts ({self.experts})")
    if self.experts % self.groups or self.topk_groups > self.groups:
      raise ConfigError(f"model.moe.groups: {self.groups} must divide model.moe.experts "
                        f"({self.experts}) and be >= model.moe.topk_groups ({self.topk_groups})")
    if self.groups > 1 and self.experts_per_token > self.topk_groups * self.experts // self.groups:
      raise ConfigError(f"model.moe.experts_per_token: {self.experts_per_token} exceed the experts "
                        f"of {self.topk_groups} group(s)")
    if self.shared_experts < 0 or (self.shared_ffn is not None and self.shared_ffn <= 0):
      raise ConfigError("model.moe.shared_experts must be >= 0 and model.moe.shared_ffn > 0")
    if self.first_dense_layers < 0 or any(i < 0 for i in self.dense_layers):
      raise ConfigError("model.moe.first_dense_layers and model.moe.dense_layers must be >= 0")
    if self.aux_loss_coef < 0 or self.z_loss_coef < 0 or self.routed_scaling <= 0:
      raise ConfigError("model.moe.aux_loss_coef and z_loss_coef must be >= 0, routed_scaling > 0")
    if self.capacity_factor is not None and self.capacity_factor <= 0:
      raise ConfigError(f"model.moe.capacity_factor: {self.capacity_factor} must be > 0 or null")

  @property
  def shared_width(self) -> int:
    return self.shared_ffn if self.shared_ffn is not None else self.shared_experts * self.expert_ffn


@dataclasses.dataclass(frozen=True)
class MLAConfig:
  """Multi-head latent attention (DeepSeek-V2/V3): keys and values from a low-rank latent."""
  kv_lora_rank: int = 32  # width of the compressed key/value latent
  q_lora_rank: int | None = None  # width of the compressed query latent; None: a full q projection
  qk_nope_dim: int = 16  # per-head query/key channels without RoPE
  qk_rope_dim: int = 8  # per-head query/key channels with RoPE (the key's are shared by all heads)
  v_dim: int = 16  # per-head value width
  rope_interleave: bool = True  # the RoPE channels come as interleaved pairs (DeepSeek's checkpoints)

  def __post_init__(self):
    _positive(self, "kv_lora_rank", "qk_nope_dim", "qk_rope_dim", "v_dim", section="model.mla.")
    if self.q_lora_rank is not None and self.q_lora_rank <= 0:
      raise ConfigError(f"model.mla.q_lora_rank: {self.q_lora_rank} must be > 0 or null")
    if self.qk_rope_dim % 2:
      raise ConfigError(f"model.mla.qk_rope_dim: {self.qk_rope_dim} must be even for RoPE")


@dataclasses.dataclass(frozen=True)
class LinearAttentionConfig:
  """The gated DeltaNet of a model's "linear" layers (Qwen3-Next): a causal depthwise convolution
  over q/k/v, then the gated delta rule's recurrence over a [key_dim x value_dim] state per head."""
  key_heads: int = 2  # query/key heads (linear_num_key_heads)
  value_heads: int = 4  # value heads, a multiple of key_heads; each key head serves value_heads / key_heads of them
  key_dim: int = 16  # per-head query/key width (linear_key_head_dim)
  value_dim: int = 16  # per-head value width (linear_value_head_dim)
  conv_kernel: int = 4  # taps of the causal depthwise convolution (linear_conv_kernel_dim)
  chunk: int = 64  # tokens per chunk of the chunked scan (the same result for any size; the work is T x chunk)

  def __post_init__(self):
    _positive(self, "key_heads", "value_heads", "key_dim", "value_dim", "conv_kernel", "chunk",
              section="model.linear.")
    if self.value_heads % self.key_heads:
      raise ConfigError(f"model.linear.value_heads: {self.value_heads} is no multiple of "
                        f"model.linear.key_heads ({self.key_heads})")


@dataclasses.dataclass(frozen=True)
class VisionConfig:
  """A vision tower whose image features replace the image tokens' embeddings (LLaVA's CLIP,
  Gemma 3's SigLIP, Qwen2-VL's and Qwen2.5-VL's): patches embedded, `layers` encoder blocks, a
  projector to model.hidden."""
  tower: Literal["clip", "siglip", "qwen2_vl", "qwen2_5_vl", "qwen3_vl"] = "clip"  # CLIP (a class token, a LayerNorm before the blocks), SigLIP (a conv bias, a LayerNorm after them), Qwen2-VL (2D RoPE, LayerNorms, a quick-gelu MLP), Qwen2.5-VL (2D RoPE, RMSNorms, a gated MLP, window attention) or Qwen3-VL (2D RoPE and learned positions, LayerNorms, deepstack)
  hidden: int = 32  # the tower's width
  layers: int = 2  # encoder blocks the features are taken after (a checkpoint's later blocks are not run)
  heads: int = 4  # attention heads of each block
  ffn: int = 64  # inner width of each block's MLP
  image_size: int = 28  # pixels on each side of an image (the processor's output)
  patch: int = 14  # pixels on each side of a patch
  channels: int = 3  # colour channels
  act: Literal["quick_gelu", "gelu", "gelu_tanh", "silu"] = "quick_gelu"  # the blocks' MLP activation
  norm_eps: float = 1e-5  # the tower's LayerNorm epsilon
  drop_cls: bool = True  # features without the class token (LLaVA's "default" strategy); clip only
  projector: Literal["mlp", "pool", "merger"] = "mlp"  # two linears with an activation (LLaVA), average-pooled patches, an RMSNorm and one matrix (Gemma 3), or a norm then merge x merge patches concatenated through two linears (Qwen-VL)
  projector_act: Literal["gelu", "gelu_tanh", "silu"] = "gelu"  # mlp only: the activation between its linears
  projector_bias: bool = True  # mlp only: biases on its linears
  tokens_per_image: int | None = None  # pool only: image tokens after pooling (a square number); None: every patch
  image_token_id: int = 0  # the text token each image feature replaces
  max_images: int = 1  # image slots per sequence (a static shape: rows with fewer images pad them); 0: text-only batches, the tower computing nothing
  image_attention: Literal["causal", "bidirectional"] = "causal"  # how the decoder's image tokens attend: causally as text (LLaVA), or each image's whole run of tokens to each other (Gemma 3, as transformers computes it given token_type_ids)
  temporal_patch: int = 2  # qwen towers: frames per patch (a still image repeats itself)
  merge: int = 2  # qwen towers: merge x merge neighbouring patches become one image token
  window: int | None = None  # qwen2_5_vl: the side of an attention window in pixels (window_size); None: every block attends to the whole image
  full_blocks: tuple[int, ...] = ()  # qwen2_5_vl with a window: the blocks that attend to the whole image (fullatt_block_indexes)
  rope_theta: float = 10000.0  # qwen towers: the base of the 2D rotary embedding
  positions: int = 0  # qwen3_vl: entries of the learned position table (a square grid, bilinearly resized to the image's; num_position_embeddings)
  deepstack: tuple[int, ...] = ()  # qwen3_vl: the blocks whose merged features are added to the image tokens after the first len(deepstack) decoder layers (deepstack_visual_indexes)

  def __post_init__(self):
    _positive(self, "hidden", "layers", "heads", "ffn", "image_size", "patch", "channels",
              "norm_eps", section="model.vision.")
    if self.max_images < 0:
      raise ConfigError(f"model.vision.max_images: {self.max_images} must be >= 0")
    if self.hidden % self.heads:
      raise ConfigError(f"model.vision.heads: {self.heads} does not divide model.vision.hidden "
                        f"({self.hidden})")
    if self.image_size % self.patch:
      raise ConfigError(f"model.vision.patch: {self.patch} does not divide "
                        f"model.vision.image_size ({self.image_size})")
    qwen = self.tower in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
    if qwen != (self.projector == "merger"):
      raise ConfigError(f"model.vision.projector: {self.projector} with tower {self.tower} (the "
                        "merger is the qwen towers' projector, and theirs only)")
    if qwen:
      _positive(self, "temporal_patch", "merge", "rope_theta", section="model.vision.")
      if self.patches_per_side % self.merge:
        raise ConfigError(f"model.vision.image_size: {self.image_size} is not a multiple of "
                          f"patch x merge = {self.patch * self.merge}")
    if self.window is not None and (self.tower != "qwen2_5_vl" or self.window < self.patch * self.merge):
      raise ConfigError(f"model.vision.window: {self.window} needs tower qwen2_5_vl and at least "
                        f"patch x merge = {self.patch * self.merge} pixels")
    if any(not 0 <= b < self.layers for b in self.full_blocks) or (self.full_blocks and self.window is None):
      raise ConfigError(f"model.vision.full_blocks: {list(self.full_blocks)} must be blocks "
                        f"0..{self.layers - 1} of a tower with a window")
    if (self.positions or self.deepstack) and self.tower != "qwen3_vl":
      raise ConfigError("model.vision.positions and model.vision.deepstack: tower qwen3_vl only")
    if self.tower == "qwen3_vl" and (self.positions <= 0
                                     or math.isqrt(self.positions) ** 2 != self.positions):
      raise ConfigError(f"model.vision.positions: {self.positions} must be a square number > 0")
    if (any(not 0 <= b < self.layers for b in self.deepstack)
        or list(self.deepstack) != sorted(set(self.deepstack))):
      raise ConfigError(f"model.vision.deepstack: {list(self.deepstack)} must be increasing "
                        f"blocks 0..{self.layers - 1}")
    if self.tokens_per_image is not None:
      side = math.isqrt(self.tokens_per_image)
      if self.projector != "pool" or side * side != self.tokens_per_image or self.patches_per_side % side:
        raise ConfigError(f"model.vision.tokens_per_image: {self.tokens_per_image} must be a "
                          f"square whose side divides the {self.patches_per_side} patches a side, "
                          "with model.vision.projector pool")

  @property
  def patches_per_side(self) -> int:
    return self.image_size // self.patch

  @property
  def image_shape(self) -> tuple[int, ...]:
    """One image slot's shape in a batch: pixels [C, H, W], or a qwen tower's patches [S, C x
    frames x patch^2] (mtjax.models.qwen_vision)."""
    if self.tower in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl"):
      return (self.seq, self.channels * self.temporal_patch * self.patch ** 2)
    return (self.channels, self.image_size, self.image_size)

  @property
  def seq(self) -> int:
    """Tokens the tower attends over per image: its patches, and CLIP's class token."""
    return self.patches_per_side ** 2 + (self.tower == "clip")

  @property
  def image_tokens(self) -> int:
    """Text positions one image fills: its projected features."""
    if self.projector == "merger":
      return (self.patches_per_side // self.merge) ** 2
    if self.projector == "pool":
      return self.tokens_per_image or self.patches_per_side ** 2
    return self.seq - (self.tower == "clip" and self.drop_cls)


@dataclasses.dataclass(frozen=True)
class RopeConfig:
  """Rotary position embeddings: the base, a frequency scaling rule and its parameters."""
  theta: float = 10000.0  # RoPE base
  scaling: Literal["none", "linear", "llama3", "longrope", "yarn"] = "none"  # frequency scaling rule
  factor: float = 1.0  # scaling factor (linear, llama3, longrope, yarn)
  low_freq_factor: float = 1.0  # llama3: low-frequency cut
  high_freq_factor: float = 4.0  # llama3: high-frequency cut
  original_max_len: int = 8192  # llama3, longrope, yarn: the pre-training context length
  short_factor: tuple[float, ...] = ()  # longrope: per-frequency divisors up to original_max_len
  long_factor: tuple[float, ...] = ()  # longrope: per-frequency divisors beyond it
  beta_fast: float = 32.0  # yarn: the high-frequency edge of the ramp (rotations)
  beta_slow: float = 1.0  # yarn: the low-frequency edge
  mscale: float = 1.0  # yarn (DeepSeek): mscale of the cos/sin scaling
  mscale_all_dim: float = 0.0  # yarn (DeepSeek): mscale_all_dim; also scales the attention logits
  attention_factor: float | None = None  # the cos/sin scaling; None: the rule's own
  truncate: bool = True  # yarn: round the ramp's edges to whole channels (GPT-OSS: false)
  partial: float = 1.0  # share of each head's channels RoPE rotates (partial_rotary_factor)
  interleave: bool = False  # rotate channel pairs (2i, 2i + 1) instead of (i, i + R/2) (GLM-4, Cohere, Llama 4)
  local_theta: float | None = None  # RoPE base of sliding layers, without scaling (Gemma 3)
  mrope_section: tuple[int, ...] = ()  # M-RoPE (Qwen-VL): frequencies rotated by the temporal, height and width positions, in that order from the lowest; () plain RoPE
  mrope_interleaved: bool = False  # M-RoPE's streams interleaved (Qwen3-VL): frequency j turns by height when j % 3 == 1 and j < 3 x the height count, by width when j % 3 == 2 and j < 3 x the width count, else by time

  def __post_init__(self):
    _positive(self, "theta", "factor", "beta_fast", "beta_slow", "original_max_len")
    for key in ("attention_factor", "local_theta"):
      if getattr(self, key) is not None and getattr(self, key) <= 0:
        raise ConfigError(f"model.rope.{key}: {getattr(self, key)} must be > 0 or null")
    if not 0 < self.partial <= 1:
      raise ConfigError(f"model.rope.partial: {self.partial} must be in (0, 1]")
    if self.mrope_section and (len(self.mrope_section) != 3 or min(self.mrope_section) < 0):
      raise ConfigError(f"model.rope.mrope_section: {list(self.mrope_section)} must be three "
                        "frequency counts (temporal, height, width)")


def upgrade_model_section(raw_model: dict) -> dict:
  """A model section with the flat RoPE keys older configs and checkpoints carry (`rope_theta`)
  moved into its `rope` section (`rope.theta`); a key given both ways with two values is an
  error naming both."""
  if not isinstance(raw_model, dict):
    return raw_model
  names = {f.name for f in dataclasses.fields(RopeConfig)}
  flat = {k: v for k, v in raw_model.items() if k.startswith("rope_") and k[5:] in names}
  if not flat:
    return raw_model
  rope = raw_model.get("rope") or {}
  if isinstance(rope, RopeConfig):
    rope = dataclasses.asdict(rope)
  if not isinstance(rope, dict):
    raise ConfigError(f"model.rope: expected a mapping, got {type(rope).__name__}")
  for key, value in flat.items():
    if key[5:] in rope and rope[key[5:]] != value:
      raise ConfigError(f"model.{key}: {value!r} and model.rope.{key[5:]}: {rope[key[5:]]!r} "
                        f"both given; keep model.rope.{key[5:]}")
  out = {k: v for k, v in raw_model.items() if k not in flat}
  out["rope"] = {**{k[5:]: v for k, v in flat.items()}, **rope}
  return out


# Model keys that say how a mixture trains, how a DeltaNet's scan is split or how images are fed,
# not what weights the model holds: a run may set them on an imported model, and a checkpoint
# resumes under other values. (transformers' Gemma 3 runs its image tokens either way too:
# bidirectionally given token_type_ids, causally without.)
TRAINING_KNOBS = ("aux_loss_coef", "z_loss_coef", "capacity_factor", "chunk", "max_images",
                  "image_attention")


def run_knobs(section: dict) -> tuple[str, ...]:
  """The keys of a model section (a dict) a run may set on an imported model: TRAINING_KNOBS,
  and a Qwen-VL tower's image_size (the run's fixed grid; no weight has its shape)."""
  qwen = section.get("tower") in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
  return TRAINING_KNOBS + ("image_size",) * qwen


def derived_widths(model: dict) -> dict:
  """A model section (a dict) with its derivable widths written one way: kv_heads as the query
  heads where null, head_dim null where it is hidden / heads. Two sections that differ only in
  how they write these (a config's `head_dim: 64` and a config.json's omitted head_dim) describe
  the same model; compare their `derived_widths`."""
  m = dict(model)
  heads, hidden = m.get("heads"), m.get("hidden")
  if m.get("kv_heads") is None and heads is not None:
    m["kv_heads"] = heads
  head_dim = m.get("head_dim")
  if isinstance(head_dim, int) and isinstance(heads, int) and head_dim * heads == hidden:
    m["head_dim"] = None
  return m

LayerType = Literal["full", "sliding", "chunked", "linear"]


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A decoder-only transformer. `family` names the model family (mtjax.models): it reads and
  writes the Hugging Face files; the fields say what the layers compute."""
  family: str = "llama"  # the model family (mtjax.models)
  from_hf: str | None = None  # a Hugging Face model directory: its config.json sets the shape, its safetensors the initial weights
  vocab_size: int = 256  # tokens in the vocabulary
  hidden: int = 64  # model width D
  layers: int = 2  # number of transformer blocks
  heads: int = 4  # query heads; head_dim = hidden / heads unless head_dim is set
  kv_heads: int | None = None  # key/value heads for grouped-query attention; None means = heads
  head_dim: int | None = None  # per-head width; None means hidden / heads
  ffn: int = 176  # inner width of the dense MLP
  tie_embeddings: bool = False  # LM head reuses the token embedding table
  pad_token_id: int | None = None  # the padding token: its embedding row gets no gradient (transformers' padding_idx)
  max_position: int | None = None  # the longest sequence the model is made for (config.json's max_position_embeddings); None: not stated
  qkv_bias: bool = False  # bias on q/k/v projections (Qwen2, GPT-OSS)
  o_bias: bool = False  # bias on the attention output projection (GPT-OSS)
  qk_norm: bool = False  # RMSNorm on q and k before RoPE (Qwen3, Gemma 3, OLMo 2)
  qk_norm_scope: Literal["head", "all", "each_head"] = "head"  # over each head's channels, over the whole projection (OLMo 2), or over each head's channels with a weight per head (Cohere)
  qk_l2_norm: bool = False  # q and k RMS-normalised without a weight after RoPE, in RoPE layers only (Llama 4's use_qk_norm)
  layer_types: tuple[LayerType, ...] | None = None  # each layer's attention: full, sliding (a window of sliding_window tokens), chunked (within chunks of attention_chunk tokens) or linear (model.linear's gated DeltaNet); None: all full
  sliding_window: int | None = None  # tokens a sliding layer's query sees, itself included
  attention_chunk: int | None = None  # a chunked layer's query sees only keys of its chunk of this many positions (Llama 4's attention_chunk_size)
  nope_layers: tuple[int, ...] = ()  # layers whose attention applies no rotary embedding (NoPE: SmolLM3, Llama 4's and Cohere2's global layers)
  attn_softcap: float | None = None  # attention logits capped as c * tanh(s / c) (Gemma 2)
  query_scale: float | None = None  # the attention logits' scale; None: 1 / sqrt(head_dim)
  temperature_floor: int | None = None  # NoPE layers scale q by log(floor((position + 1) / this) + 1) * temperature_scale + 1 (Llama 4's attn_temperature_tuning, floor_scale); None: no scaling
  temperature_scale: float = 0.1  # see temperature_floor (Llama 4's attn_scale)
  attention_sinks: bool = False  # a learned logit per head joins each softmax (GPT-OSS)
  attn_output_gate: bool = False  # q_proj also gives a gate per head and channel: sigmoid(gate) scales the attention output (Qwen3-Next)
  rope: RopeConfig = dataclasses.field(default_factory=RopeConfig)  # rotary position embeddings (model.rope)
  norm_eps: float = 1e-5  # the norms' epsilon
  norm_kind: Literal["rms", "layer"] = "rms"  # RMSNorm, or LayerNorm without a bias (mean subtracted: Cohere)
  norm_offset: bool = False  # norms scale by (1 + w), w stored and initialised at 0 (Gemma)
  norm_position: Literal["pre", "sandwich", "post"] = "pre"  # norms before each sub-layer (Llama), before and after (Gemma), after only (OLMo 2)
  parallel_block: bool = False  # attention and MLP both read the one input norm, their outputs added to the residual together (Cohere); needs norm_position pre
  mlp_act: Literal["silu", "gelu_tanh", "swiglu_clamped"] = "silu"  # the gated MLP's activation: SwiGLU, GeGLU (tanh GELU), or GPT-OSS's clamped SwiGLU
  mlp_bias: bool = False  # biases on the MLP (and expert) projections (GPT-OSS)
  swiglu_limit: float = 7.0  # swiglu_clamped: gate clamped above, up within +-limit
  swiglu_alpha: float = 1.702  # swiglu_clamped: gate * sigmoid(alpha * gate)
  embed_scale: bool = False  # the embedding is multiplied by sqrt(hidden) (Gemma)
  final_softcap: float | None = None  # final logits capped as c * tanh(x / c) (Gemma 2)
  embed_multiplier: float = 1.0  # the embedding's output is multiplied by this (Granite's embedding_multiplier)
  residual_multiplier: float = 1.0  # each sub-layer's output is multiplied by this before its residual add (Granite)
  logits_divisor: float = 1.0  # the LM head's logits are divided by this (Granite's logits_scaling)
  logit_scale: float = 1.0  # multiplies the final logits (Cohere's logit_scale)
  moe: MoEConfig | None = None  # a mixture-of-experts feed-forward in the MoE layers
  mla: MLAConfig | None = None  # multi-head latent attention instead of GQA (DeepSeek)
  linear: LinearAttentionConfig | None = None  # the gated DeltaNet of the "linear" layers (Qwen3-Next)
  vision: VisionConfig | None = None  # a vision tower whose features fill the image tokens (LLaVA, Gemma 3)
  init_std: float = 0.02  # std of the normal init of every matrix

  def __post_init__(self):
    _positive(self, "vocab_size", "hidden", "layers", "heads", "ffn")
    for key in ("kv_heads", "head_dim", "sliding_window", "max_position", "attention_chunk",
                "temperature_floor"):  # None: derived, or not used
      if getattr(self, key) is not None and getattr(self, key) <= 0:
        raise ConfigError(f"model.{key}: {getattr(self, key)} must be > 0 or null")
    for key in ("init_std", "norm_eps", "swiglu_limit", "swiglu_alpha", "logit_scale"):
      if getattr(self, key) <= 0:
        raise ConfigError(f"model.{key}: {getattr(self, key)} must be > 0")
    for key in ("embed_multiplier", "residual_multiplier", "logits_divisor"):
      if getattr(self, key) <= 0:
        raise ConfigError(f"model.{key}: {getattr(self, key)} must be > 0")
    for key in ("attn_softcap", "query_scale", "final_softcap"):
      if getattr(self, key) is not None and getattr(self, key) <= 0:
        raise ConfigError(f"model.{key}: {getattr(self, key)} must be > 0 or null")
    kv = self.n_kv_heads
    if kv <= 0 or self.heads % kv:
      raise ConfigError(f"model.kv_heads: {kv} must divide model.heads ({self.heads})")
    if self.pad_token_id is not None and not 0 <= self.pad_token_id < self.vocab_size:
      raise ConfigError(f"model.pad_token_id: {self.pad_token_id} is not a token id (vocab_size "
                        f"{self.vocab_size}) or null")
    if self.head_dim is None and self.hidden % self.heads:
      raise ConfigError(f"model.heads: {self.heads} does not divide model.hidden ({self.hidden}); "
                        "set model.head_dim")
    if self.mla is None and self.rotary_dim % 2:
      raise ConfigError(f"model.head_dim: {self.dim_per_head} x rope.partial {self.rope.partial} "
                        f"= {self.rotary_dim} RoPE channels, which must be even")
    if self.layer_types is not None:
      if len(self.layer_types) != self.layers:
        raise ConfigError(f"model.layer_types: {len(self.layer_types)} entries for "
                          f"{self.layers} layers")
      if "sliding" in self.layer_types and self.sliding_window is None:
        raise ConfigError("model.layer_types: sliding layers need model.sliding_window")
      if "linear" in self.layer_types and self.linear is None:
        raise ConfigError("model.layer_types: linear layers need model.linear")
      if "chunked" in self.layer_types and self.attention_chunk is None:
        raise ConfigError("model.layer_types: chunked layers need model.attention_chunk")
    if self.parallel_block and self.norm_position != "pre":
      raise ConfigError(f"model.parallel_block: needs model.norm_position pre, not "
                        f"{self.norm_position}")
    if self.mla is not None and (self.qk_l2_norm or self.temperature_floor is not None):
      raise ConfigError("model.qk_l2_norm / temperature_floor: not with multi-head latent attention")
    bad = [i for i in self.nope_layers if not 0 <= i < self.layers]
    if bad:
      raise ConfigError(f"model.nope_layers: {bad[0]} is not a layer index (model.layers "
                        f"{self.layers})")
    if self.rope.interleave and self.mla is not None:
      raise ConfigError("model.rope.interleave: multi-head latent attention's pairs are "
                        "model.mla.rope_interleave")
    if self.nope_layers and self.mla is not None:
      raise ConfigError("model.nope_layers: multi-head latent attention always rotates its RoPE "
                        "channels")
    if self.attn_output_gate and (self.mla is not None or self.qk_norm_scope == "all"):
      raise ConfigError("model.attn_output_gate: takes GQA attention with per-head q/k norms, not "
                        "model.mla or qk_norm_scope all")
    rope = self.rope
    if rope.scaling == "longrope":
      half = self.rotary_dim // 2
      if len(rope.short_factor) != half or len(rope.long_factor) != half:
        raise ConfigError(f"model.rope.short_factor / long_factor: longrope needs {half} values "
                          f"each (half the {self.rotary_dim} RoPE channels), got "
                          f"{len(rope.short_factor)} and {len(rope.long_factor)}")
    if rope.mrope_section and sum(rope.mrope_section) != self.rotary_dim // 2:
      raise ConfigError(f"model.rope.mrope_section: {list(rope.mrope_section)} must sum to the "
                        f"{self.rotary_dim // 2} RoPE frequencies (half of {self.rotary_dim})")
    if rope.mrope_interleaved and not rope.mrope_section:
      raise ConfigError("model.rope.mrope_interleaved: needs model.rope.mrope_section")
    if self.vision is not None and len(self.vision.deepstack) > self.layers:
      raise ConfigError(f"model.vision.deepstack: {len(self.vision.deepstack)} feature sets for "
                        f"{self.layers} decoder layers (model.layers)")
    if self.vision is not None and not 0 <= self.vision.image_token_id < self.vocab_size:
      raise ConfigError(f"model.vision.image_token_id: {self.vision.image_token_id} is not a token "
                        f"id (vocab_size {self.vocab_size})")
    if self.moe is not None and self.moe.first_dense_layers > self.layers:
      raise ConfigError(f"model.moe.first_dense_layers: {self.moe.first_dense_layers} exceeds "
                        f"model.layers ({self.layers})")

  @property
  def block_groups(self) -> int:
    """Groups between the embedding and the head: the vision tower's (its embedding, blocks and
    projector) and the decoder's blocks."""
    return self.layers + (0 if self.vision is None else self.vision.layers + 2)

  @property
  def n_kv_heads(self) -> int:
    return self.heads if self.kv_heads is None else self.kv_heads

  @property
  def dim_per_head(self) -> int:
    return self.hidden // self.heads if self.head_dim is None else self.head_dim

  @property
  def rotary_dim(self) -> int:
    """The RoPE channels of each head (the first ones; the rest pass through)."""
    if self.mla is not None:
      return self.mla.qk_rope_dim
    return int(self.dim_per_head * self.rope.partial)

  def layer_type(self, i: int) -> str:
    return "full" if self.layer_types is None else self.layer_types[i]

  def uses_rope(self, i: int) -> bool:
    return i not in self.nope_layers

  def is_moe_layer(self, i: int) -> bool:
    m = self.moe
    return (m is not None and i >= m.first_dense_layers and i not in m.dense_layers
            and (i + 1) % m.every == 0)


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  name: Literal["adamw", "adam", "lion", "sgd", "adafactor"] = "adamw"  # the optax optimizer
  impl: Literal["fused", "optax"] = "fused"  # adamw only; fused: in-place numba AdamW; optax: optax.adamw on XLA:CPU
  lr: float = 3e-4  # peak learning rate
  min_lr_ratio: float = 0.1  # cosine floor as a fraction of lr
  warmup_steps: int = 10  # linear warmup from 0 to lr
  decay_steps: int | None = None  # cosine length incl. warmup; None means train.steps
  b1: float = 0.9  # AdamW beta1
  b2: float = 0.95  # AdamW beta2
  eps: float = 1e-8  # AdamW epsilon
  momentum: float = 0.9  # sgd momentum (0: plain sgd)
  weight_decay: float = 0.1  # decoupled weight decay on matrices (not norms, biases)
  clip_norm: float | None = None  # global-norm clip threshold; None disables clipping
  clip_mode: Literal["host_buffer", "recompute"] = "host_buffer"  # how exact global clipping gets every norm first
  threads: int | None = None  # host optimizer threads; None means all cores
  state_dtype: Literal["float32", "bfloat16", "int8"] = "float32"  # AdamW moments' storage (fused adamw): bfloat16 halves them; int8: a byte each and an fp32 scale per 256 values (2.03 B/param for both); the arithmetic stays fp32

  def __post_init__(self):
    if self.lr < 0 or not 0 <= self.min_lr_ratio <= 1:
      raise ConfigError("optim.lr must be >= 0 and optim.min_lr_ratio in [0, 1]")
    if not (0 <= self.b1 < 1 and 0 <= self.b2 < 1):
      raise ConfigError(f"optim.b1/b2 must be in [0, 1), got {self.b1}, {self.b2}")
    if self.eps <= 0 or self.weight_decay < 0 or self.warmup_steps < 0:
      raise ConfigError("optim.eps must be > 0, optim.weight_decay and optim.warmup_steps >= 0")
    if self.clip_norm is not None and self.clip_norm <= 0:
      raise ConfigError(f"optim.clip_norm: {self.clip_norm} must be > 0 or null")
    if not 0 <= self.momentum < 1:
      raise ConfigError(f"optim.momentum: {self.momentum} must be in [0, 1)")
    if self.threads is not None and self.threads <= 0:
      raise ConfigError(f"optim.threads: {self.threads} must be > 0 or null")
    if self.decay_steps is not None and self.decay_steps <= 0:
      raise ConfigError(f"optim.decay_steps: {self.decay_steps} must be > 0 or null (train.steps)")
    if self.state_dtype != "float32" and (self.name, self.impl) != ("adamw", "fused"):
      raise ConfigError(f"optim.state_dtype: {self.state_dtype} moments need optim.name adamw "
                        f"with optim.impl fused, not {self.name} with {self.impl}")

  @property
  def moment_bytes(self) -> float:
    """Bytes per parameter of the fused AdamW's two moments (m and v); int8: a byte each and an
    fp32 scale per mtjax.quantize.BLOCK (256) values each."""
    return {"float32": 8, "bfloat16": 4, "int8": 2 + 8 / 256}[self.state_dtype]


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  compute_dtype: Literal["bfloat16", "float32"] = "bfloat16"  # dtype of weights and activations on device
  activations: int | Literal["device", "host", "auto"] = "device"  # where the kept block inputs wait for the backward: device memory, pinned host memory (copied out and back overlapped with compute), N: the first N kept inputs on the host, the rest on the device; auto: the planner spills the fewest that make the device fit
  activations_every: int | Literal["auto"] = 1  # keep every K-th block's input; the backward re-runs a segment of K blocks' forward from it; auto: every input while the device holds them, else the smallest K that fits
  micro_batch: int | None = None  # sequences per chunk inside a layer; None means the whole batch
  loss_chunk: int = 1024  # tokens per LM-head chunk, so full logits never exist
  attention: Literal["auto", "xla", "cudnn", "blockwise"] = "auto"  # attention kernel: XLA's, cuDNN's fused one (packed documents as a mask up to 4096 tokens), or mtjax's blockwise (no [T x T] tensor; soft-caps, sinks); auto: cuDNN on a GPU in bf16 for heads up to 128 wide (256 on Hopper), else blockwise from 4096 tokens, XLA below
  matmul_precision: Literal["default", "high", "highest"] = "default"  # highest: true fp32 matmuls on GPU (no TF32)
  inflight_layers: int = 2  # layers the host may queue ahead of the device (bounds device memory)
  grad_queue: int | Literal["auto"] = 4  # host-group gradients awaiting the host optimizer before the device waits (bounds host buffers); auto: the planner picks
  device_state_layers: int | Literal["auto"] = "auto"  # first N layer groups (embedding, block 0, ...) whose weights and optimizer state live in device memory; auto: with device_update_layers, the placement the planner finds fastest among those that fit (all state on the device when it fits)
  device_update_layers: int | Literal["auto"] = "auto"  # the next N groups are updated on the device, their optimizer state streamed through it; auto: see device_state_layers
  device_memory_gb: float | None = None  # device memory the run may use (as on a smaller card); None: 92% of the device
  devices: int | Literal["all"] = "all"  # local devices the step runs on (data-parallel over a Mesh; train.batch splits evenly over them)
  seq_tile: int | None = 16384  # longer sequences run each block's norms, projections and MLP this many tokens at a time (recomputed per tile in the backward); None: the whole sequence at once
  moe_impl: Literal["auto", "ragged", "mosaic", "dense"] = "auto"  # how a mixture of experts multiplies: ragged (tokens sorted by expert, jax.lax.ragged_dot), mosaic (jax's Mosaic-GPU grouped kernels, Hopper GPUs, bf16), dense (every expert on every token, weighted: a reference for tests); auto: mosaic where it applies, else ragged

  def __post_init__(self):
    _positive(self, "loss_chunk", "inflight_layers")
    if self.activations_every != "auto" and self.activations_every <= 0:
      raise ConfigError(f"engine.activations_every: {self.activations_every} must be > 0 or auto")
    if isinstance(self.activations, int) and self.activations < 0:
      raise ConfigError(f"engine.activations: {self.activations} must be >= 0, device, host or auto")
    if self.grad_queue != "auto" and self.grad_queue <= 0:
      raise ConfigError(f"engine.grad_queue: {self.grad_queue} must be > 0 or auto")
    for key in ("device_state_layers", "device_update_layers"):
      n = getattr(self, key)
      if n != "auto" and n < 0:
        raise ConfigError(f"engine.{key}: {n} must be >= 0")
    if self.device_memory_gb is not None and not 0 < self.device_memory_gb < 1e6:
      raise ConfigError(f"engine.device_memory_gb: {self.device_memory_gb} must be > 0")
    if self.micro_batch is not None and self.micro_batch <= 0:
      raise ConfigError(f"engine.micro_batch: {self.micro_batch} must be > 0 or null")
    if self.seq_tile is not None and self.seq_tile <= 0:
      raise ConfigError(f"engine.seq_tile: {self.seq_tile} must be > 0 or null")
    if self.devices != "all" and self.devices <= 0:
      raise ConfigError(f"engine.devices: {self.devices} must be > 0 or all")

  def activations_on_host(self, layers: int) -> int:
    """How many kept block inputs (the first ones) wait in host memory; needs activations_every
    and activations resolved (not auto)."""
    if "auto" in (self.activations, self.activations_every):
      raise ValueError("engine.activations / activations_every: auto is resolved by the planner "
                       "(mtjax.launch.plan_run)")
    kept = -(-layers // self.activations_every)
    if self.activations == "device":
      return 0
    if self.activations == "host":
      return kept
    return min(kept, self.activations)


@dataclasses.dataclass(frozen=True)
class DataConfig:
  source: Literal["synthetic", "tokens", "prepared"] = "synthetic"  # prepared: `mtjax.data prepare` output
  path: str | None = None  # token file (source = tokens) or prepared directory
  dtype: Literal["uint16", "uint32"] = "uint16"  # token file element type (prepared: meta.json)
  mode: Literal["packed", "padded"] = "packed"  # prepared: documents packed per row, or one padded per row
  split: Literal["train", "val"] = "train"  # prepared: the split training batches come from
  allow_other_tokenizer: bool = False  # prepared: train on data tokenized with another tokenizer than model.from_hf's (its ids must still fit the vocabulary)

  def __post_init__(self):
    if self.source in ("tokens", "prepared") and not self.path:
      raise ConfigError(f"data.path: required when data.source is '{self.source}'")


@dataclasses.dataclass(frozen=True)
class DPOConfig:
  """Direct preference optimisation: the policy against the initial weights, on (chosen, rejected)
  pairs sharing a prompt (mtjax.dpo)."""
  beta: float = 0.1  # strength of the tie to the reference model (the rewards' scale)
  loss: Literal["sigmoid", "ipo"] = "sigmoid"  # sigmoid: -log sigmoid(beta * margin) (DPO); ipo: (margin - 1 / (2 beta))^2
  sft_weight: float = 0.0  # weight of the chosen responses' mean token cross-entropy added to the loss

  def __post_init__(self):
    if self.beta <= 0 or self.sft_weight < 0:
      raise ConfigError(f"train.dpo: beta ({self.beta}) must be > 0 and sft_weight "
                        f"({self.sft_weight}) >= 0")


@dataclasses.dataclass(frozen=True)
class GRPOConfig:
  """Group-relative policy optimisation with verifiable rewards (mtjax.grpo): each generation
  batch samples `group` completions of each of train.batch / group prompts from the current
  weights, scores them and weights each completion's tokens by its reward's standing in its group,
  for steps_per_generation optimizer steps of the clipped surrogate (plus kl_coef x a KL to the
  initial weights)."""
  group: int = 8  # completions per prompt (G); train.batch must be a multiple of it
  max_new_tokens: int = 64  # the longest completion; prompt + completion must fit train.seq
  temperature: float = 1.0  # sampling temperature of the completions (> 0)
  top_p: float = 1.0  # nucleus sampling of the completions; 1: off
  top_k: int = 0  # the k likeliest tokens only; 0: off
  rewards: tuple[str, ...] = ("exact_answer",)  # built-in reward functions (exact_answer, format, length; mtjax.grpo.REWARDS) or a user's as module:function
  reward_weights: tuple[float, ...] | None = None  # each reward's weight in the sum; None: all 1
  format_pattern: str = r"(?s).*\S"  # the format reward: 1 where the completion matches this regular expression (re.fullmatch), else 0
  scale_rewards: Literal["group", "none"] = "group"  # advantages divided by their group's std (GRPO), or not (Dr. GRPO)
  loss_agg: Literal["sequence", "token", "constant"] = "sequence"  # mean over each completion's tokens then over completions (GRPO); over all tokens of the batch (DAPO); sum over rows x max_new_tokens (Dr. GRPO)
  chat: bool = True  # prompts as a user message in the tokenizer's chat template, where it has one
  tokenizer: str | None = None  # folder of tokenizer.json (decodes completions for the rewards); None: model.from_hf's
  steps_per_generation: int = 1  # optimizer steps on each generation batch (mu): each one trains on the whole batch again, against the log-probs of the weights that sampled it
  clip_eps: float = 0.2  # the policy ratio's clip below, 1 - clip_eps (and above where clip_eps_high is None); binds only when steps_per_generation > 1
  clip_eps_high: float | None = None  # the ratio's clip above, 1 + clip_eps_high (DAPO's clip-higher); None: clip_eps
  kl_coef: float = 0.0  # weight of the k3 KL estimate to the initial weights in the loss; > 0 keeps a copy of the initial weights in host memory (4 B/param)
  eval_path: str | None = None  # held-out prompts (a file like data.path's) that train.eval_every scores with greedy completions

  def __post_init__(self):
    _positive(self, "group", "max_new_tokens", "temperature", "steps_per_generation")
    if not 0 < self.clip_eps < 1:
      raise ConfigError(f"train.grpo.clip_eps: {self.clip_eps} must be in (0, 1)")
    if self.clip_eps_high is not None and self.clip_eps_high <= 0:
      raise ConfigError(f"train.grpo.clip_eps_high: {self.clip_eps_high} must be > 0 or null")
    if self.kl_coef < 0:
      raise ConfigError(f"train.grpo.kl_coef: {self.kl_coef} must be >= 0")
    if self.group < 2:
      raise ConfigError(f"train.grpo.group: {self.group} completions give no group to compare; "
                        "need >= 2")
    if not 0 < self.top_p <= 1 or self.top_k < 0:
      raise ConfigError(f"train.grpo: top_p ({self.top_p}) must be in (0, 1] and top_k "
                        f"({self.top_k}) >= 0")
    if not self.rewards:
      raise ConfigError("train.grpo.rewards: name at least one reward function")
    if self.reward_weights is not None and len(self.reward_weights) != len(self.rewards):
      raise ConfigError(f"train.grpo.reward_weights: {len(self.reward_weights)} weights for "
                        f"{len(self.rewards)} rewards")
    try:
      re.compile(self.format_pattern)
    except re.error as e:
      raise ConfigError(f"train.grpo.format_pattern: not a regular expression ({e})") from None


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  steps: int = 20  # optimizer steps to run
  batch: int = 8  # sequences per optimizer step (global batch)
  grad_accum: int = 1  # forward/backward passes per optimizer step, each over batch / grad_accum sequences (weights streamed once per pass); the gradient is the whole batch's
  objective: Literal["lm", "dpo", "grpo"] = "lm"  # lm: next-token cross-entropy; dpo: preference pairs (train.dpo, data from mtjax.dpo); grpo: sampled completions scored by rewards (train.grpo, mtjax.grpo); each is a class of mtjax.objectives' registry
  dpo: DPOConfig = dataclasses.field(default_factory=DPOConfig)  # objective dpo only
  grpo: GRPOConfig = dataclasses.field(default_factory=GRPOConfig)  # objective grpo only
  seq: int = 64  # tokens per sequence
  seed: int = 0  # seeds the weight init and the data stream
  log_every: int = 1  # steps between progress-bar updates of the loss
  checkpoint_dir: str | None = None  # where orbax checkpoints go; None saves none
  checkpoint_every: int = 0  # steps between checkpoints; 0 saves only at the end
  resume: bool = True  # continue from the newest checkpoint in checkpoint_dir, if there is one
  keep_checkpoints: int = 3  # committed checkpoints kept in checkpoint_dir, newest first; 0 keeps all
  overwrite: bool = False  # start afresh in a checkpoint_dir that holds another run's checkpoints (deletes them)
  allow_low_disk: bool = False  # start even when the free disk space is below what the checkpoints and export need (the plan's disk lines)
  max_skipped_steps: int = 5  # stop after this many steps in a row with a non-finite loss or gradient
  eval_every: int = 0  # steps between held-out evaluations on the prepared data's val split (grpo: the greedy rewards of train.grpo.eval_path's prompts); 0: none
  eval_batches: int = 16  # at most this many held-out batches per evaluation
  run_dir: str | None = None  # run folder (config, plan, metrics.jsonl, TensorBoard); None: checkpoint_dir, else runs/<time>
  trackers: tuple[Literal["jsonl", "tensorboard", "wandb"], ...] = ("jsonl", "tensorboard")  # where metrics go: metrics.jsonl (required: report and resume read it), TensorBoard files in run_dir/tb, a Weights & Biases run (pip install wandb; WANDB_MODE=offline works)
  tensorboard: bool = True  # false leaves out the tensorboard tracker whatever train.trackers says
  profile_step: int = 0  # record a JAX profiler trace of this step into run_dir/profile; 0: none
  export_dir: str | None = None  # at the end, write the weights as a Hugging Face directory here
  export_dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"  # tensor dtype of that export
  freeze: tuple[Literal["vision", "projector", "language"], ...] = ()  # parts whose weights stay as loaded: vision (the image tower), projector, language (embedding, text blocks, head); frozen groups hold no optimizer state and send no gradient, and the backward stops where nothing below trains

  def __post_init__(self):
    _positive(self, "steps", "batch", "seq", "log_every", "grad_accum")
    if self.batch % self.grad_accum:
      raise ConfigError(f"train.grad_accum: {self.grad_accum} does not divide train.batch "
                        f"({self.batch})")
    if self.checkpoint_every < 0:
      raise ConfigError(f"train.checkpoint_every: {self.checkpoint_every} must be >= 0")
    if self.profile_step < 0:
      raise ConfigError(f"train.profile_step: {self.profile_step} must be >= 0")
    if self.keep_checkpoints < 0 or self.max_skipped_steps <= 0:
      raise ConfigError("train.keep_checkpoints must be >= 0 and train.max_skipped_steps > 0")
    if self.eval_every < 0 or self.eval_batches <= 0:
      raise ConfigError("train.eval_every must be >= 0 and train.eval_batches > 0")
    if "jsonl" not in self.trackers:
      raise ConfigError(f"train.trackers: {list(self.trackers)} leaves out jsonl, which report and "
                        "resume read")
    if "wandb" in self.trackers and importlib.util.find_spec("wandb") is None:
      raise ConfigError("train.trackers: wandb is selected but the wandb package is not installed "
                        "(pip install wandb, or leave wandb out of train.trackers)")


@dataclasses.dataclass(frozen=True)
class Config:
  model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
  optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
  engine: EngineConfig = dataclasses.field(default_factory=EngineConfig)
  data: DataConfig = dataclasses.field(default_factory=DataConfig)
  train: TrainConfig = dataclasses.field(default_factory=TrainConfig)

  def __post_init__(self):
    # grpo's held-out prompts are a file of their own (train.grpo.eval_path; its check)
    if self.train.eval_every and self.data.source != "prepared" and self.train.objective != "grpo":
      raise ConfigError(f"train.eval_every: {self.train.eval_every} needs held-out data: prepared "
                        f"data with a val split (data.source=prepared, from `python -m mtjax.data "
                        f"prepare --val-fraction 0.02`); set train.eval_every=0 to train without it")
    mb, per_pass = self.engine.micro_batch, self.train.batch // self.train.grad_accum
    if mb is not None and per_pass % mb:
      raise ConfigError(f"engine.micro_batch: {mb} does not divide the {per_pass} sequences of a "
                        f"pass (train.batch {self.train.batch} / train.grad_accum "
                        f"{self.train.grad_accum})")
    groups = self.model.block_groups + 2
    fixed = [(k, getattr(self.engine, k)) for k in ("device_state_layers", "device_update_layers")
             if getattr(self.engine, k) != "auto"]
    if sum(n for _, n in fixed) > groups:
      raise ConfigError(f"engine.{fixed[-1][0]}: {' + '.join(str(n) for _, n in fixed)} device "
                        f"groups exceed the {groups} layer groups (embedding, "
                        f"{self.model.block_groups} blocks, head)")
    freeze = set(self.train.freeze)
    if freeze - {"language"} and self.model.vision is None:
      raise ConfigError(f"train.freeze: {sorted(freeze - {'language'})} names parts of an image "
                        f"tower; this model has none (model.vision is null)")
    if freeze >= ({"language"} if self.model.vision is None else {"vision", "projector",
                                                                    "language"}):
      raise ConfigError(f"train.freeze: {list(self.train.freeze)} leaves nothing to train")

  @property
  def decay_steps(self) -> int:
    return self.optim.decay_steps or self.train.steps


def _positive(obj, *names, section=None):
  section = _SECTION_OF.get(type(obj).__name__, "") if section is None else section
  for n in names:
    if getattr(obj, n) <= 0:
      raise ConfigError(f"{section}{n}: {getattr(obj, n)} must be > 0")


_SECTION_OF = {"ModelConfig": "model.", "RopeConfig": "model.rope.", "OptimConfig": "optim.",
               "EngineConfig": "engine.", "DataConfig": "data.", "TrainConfig": "train.",
               "DPOConfig": "train.dpo.", "GRPOConfig": "train.grpo."}


def _coerce(key: str, value: Any, tp: Any) -> Any:
  """Checks `value` against the annotation `tp`, converting only int -> float."""
  origin = typing.get_origin(tp)
  if origin is Literal:
    if value not in typing.get_args(tp):
      raise ConfigError(f"{key}: {value!r} is not one of {list(typing.get_args(tp))}")
    return value
  if origin is tuple:
    if not isinstance(value, (list, tuple)):
      raise ConfigError(f"{key}: expected a list, got {value!r}")
    item = typing.get_args(tp)[0]
    return tuple(_coerce(f"{key}[{i}]", v, item) for i, v in enumerate(value))
  if origin in (typing.Union, types.UnionType):
    args = typing.get_args(tp)
    if value is None:
      if type(None) in args:
        return None
      raise ConfigError(f"{key}: null is not allowed")
    errors = []
    for a in args:
      if a is type(None):
        continue
      try:
        return _coerce(key, value, a)
      except ConfigError as e:
        errors.append(str(e))
    raise ConfigError(errors[0])
  if dataclasses.is_dataclass(tp):
    if isinstance(value, tp):  # already built (a family's config.json reading gives a MoEConfig)
      return value
    if not isinstance(value, dict):
      raise ConfigError(f"{key}: expected a mapping, got {type(value).__name__}")
    return _build(tp, value, key + ".")
  if tp is bool:
    if not isinstance(value, bool):
      raise ConfigError(f"{key}: expected true/false, got {value!r}")
    return value
  if tp is int:
    if isinstance(value, bool) or not isinstance(value, int):
      raise ConfigError(f"{key}: expected an integer, got {value!r}")
    return value
  if tp is float:
    if isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
      try:
        value = float(value)
      except ValueError:
        pass
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      raise ConfigError(f"{key}: expected a number, got {value!r}")
    if not math.isfinite(value):
      raise ConfigError(f"{key}: {value!r} is not a finite number")
    return float(value)
  if tp is str:
    if not isinstance(value, str):
      raise ConfigError(f"{key}: expected a string, got {value!r}")
    return value
  raise TypeError(f"unsupported annotation {tp} for {key}")


def _build(cls, raw: dict, prefix: str = ""):
  hints = typing.get_type_hints(cls)
  names = {f.name for f in dataclasses.fields(cls)}
  for k in raw:
    if k not in names:
      raise ConfigError(f"{prefix}{k}: unknown key (known: {', '.join(sorted(names))})")
  return cls(**{k: _coerce(prefix + k, v, hints[k]) for k, v in raw.items()})


def _parse_scalar(text: str) -> Any:
  try:
    return yaml.safe_load(text) if text.strip() else ""
  except yaml.YAMLError:
    return text  # not YAML: the field's type check names the key


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
  """Applies `a.b=value` strings (values parsed as YAML scalars) to a nested dict, in order."""
  raw = _deepcopy(raw)
  for ov in overrides:
    if "=" not in ov:
      raise ConfigError(f"override {ov!r}: expected key.path=value")
    path, text = ov.split("=", 1)
    keys = path.strip().split(".")
    node = raw
    for k in keys[:-1]:
      node = node.setdefault(k, {})
      if not isinstance(node, dict):
        raise ConfigError(f"{path}: {k} is not a section")
    node[keys[-1]] = _parse_scalar(text)
  return raw


def _deepcopy(d):
  return {k: _deepcopy(v) if isinstance(v, dict) else v for k, v in d.items()}


def from_dict(raw: dict) -> Config:
  """Builds a validated Config; unknown keys, wrong types and impossible values raise ConfigError."""
  if not isinstance(raw, dict):
    raise ConfigError(f"config: expected a mapping at the top level, got {type(raw).__name__}")
  return _build(Config, upgrade(raw))


def upgrade(raw: dict) -> dict:
  """A raw config with its model section in today's spelling (`upgrade_model_section`)."""
  if not isinstance(raw, dict) or "model" not in raw:
    return raw
  return {**raw, "model": upgrade_model_section(raw["model"])}


def read(path: str | Path | None, overrides: list[str] = ()) -> dict:
  """The raw config: YAML (with `base:` files merged first, relative to it), then the dotted
  overrides applied."""
  raw = _read_yaml(Path(path)) if path else {}
  return upgrade(apply_overrides(raw, list(overrides)))


def load(path: str | Path | None, overrides: list[str] = ()) -> Config:
  """A validated Config from YAML and dotted overrides. `model.from_hf` (whose config.json sets
  the model) is read by `mtjax.cli.load_config`, which the commands use."""
  raw = read(path, overrides)
  model = raw.get("model")
  if isinstance(model, dict) and model.get("from_hf"):
    raise ConfigError("model.from_hf: load the config with mtjax.cli.load_config, which reads the "
                      "directory's config.json")
  return from_dict(raw)


def _read_yaml(path: Path, chain: tuple[Path, ...] = ()) -> dict:
  """The mapping in `path`, with its `base:` files merged under it; `chain` holds the files that
  named it as their base, so a loop is an error instead of a recursion without end."""
  if path.resolve() in chain:
    loop = " -> ".join(str(p) for p in (*chain, path.resolve()))
    raise ConfigError(f"config: base files form a loop ({loop})")
  if not path.exists():
    raise ConfigError(f"config: file {path} does not exist")
  if not path.is_file():
    raise ConfigError(f"config: {path} is not a file")
  try:
    raw = yaml.safe_load(path.read_text()) or {}
  except (OSError, UnicodeDecodeError) as e:
    raise ConfigError(f"config: cannot read {path} ({e})") from None
  except yaml.YAMLError as e:
    where = getattr(e, "problem_mark", None)
    at = f" at line {where.line + 1}, column {where.column + 1}" if where else ""
    raise ConfigError(f"config: {path} is not valid YAML{at}: "
                      f"{getattr(e, 'problem', None) or str(e).splitlines()[0]}") from None
  if not isinstance(raw, dict):
    raise ConfigError(f"config: {path} must hold a mapping")
  base = raw.pop("base", None)
  if base is None:
    return raw
  if not isinstance(base, str):
    raise ConfigError(f"config: {path}: base must be a file name, got {base!r}")
  return _merge(_read_yaml(path.parent / base, (*chain, path.resolve())), raw)


def _merge(a: dict, b: dict) -> dict:
  out = _deepcopy(a)
  for k, v in b.items():
    out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
  return out


def to_dict(cfg) -> dict:
  """The config as plain YAML/JSON values (tuples as lists), readable back by `from_dict`."""
  return _plain(dataclasses.asdict(cfg))


def _plain(x):
  if isinstance(x, dict):
    return {k: _plain(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_plain(v) for v in x]
  return x
