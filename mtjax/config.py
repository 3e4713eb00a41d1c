"""Typed, frozen run configuration read from YAML with dotted command-line overrides."""

from __future__ import annotations

import dataclasses
import math
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
  """A config value is unknown, of the wrong type or impossible; the message names the key."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  from_hf: str | None = None  # a Hugging Face model directory: its config.json sets the shape, its safetensors the initial weights
  vocab_size: int = 256  # tokens in the vocabulary
  hidden: int = 64  # model width D
  layers: int = 2  # number of transformer blocks
  heads: int = 4  # query heads; head_dim = hidden / heads unless head_dim is set
  kv_heads: int | None = None  # key/value heads for grouped-query attention; None means = heads
  head_dim: int | None = None  # per-head width; None means hidden / heads
  ffn: int = 176  # SwiGLU inner width
  tie_embeddings: bool = False  # LM head reuses the token embedding table
  qkv_bias: bool = False  # bias on q/k/v projections (Qwen2)
  qk_norm: bool = False  # per-head RMSNorm on q and k before RoPE (Qwen3)
  rope_theta: float = 10000.0  # RoPE base
  rope_scaling: Literal["none", "linear", "llama3"] = "none"  # RoPE frequency scaling rule
  rope_factor: float = 1.0  # scaling factor for linear / llama3
  rope_low_freq_factor: float = 1.0  # llama3 scaling: low-frequency cut
  rope_high_freq_factor: float = 4.0  # llama3 scaling: high-frequency cut
  rope_original_max_len: int = 8192  # llama3 scaling: pre-training context length
  norm_eps: float = 1e-5  # RMSNorm epsilon
  init_std: float = 0.02  # std of the normal init of every matrix

  def __post_init__(self):
    _positive(self, "vocab_size", "hidden", "layers", "heads", "ffn")
    for key in ("kv_heads", "head_dim"):  # None: derived from heads / hidden
      if getattr(self, key) is not None and getattr(self, key) <= 0:
        raise ConfigError(f"model.{key}: {getattr(self, key)} must be > 0 or null")
    if self.init_std <= 0:
      raise ConfigError(f"model.init_std: {self.init_std} must be > 0")
    kv = self.n_kv_heads
    if kv <= 0 or self.heads % kv:
      raise ConfigError(f"model.kv_heads: {kv} must divide model.heads ({self.heads})")
    if self.head_dim is None and self.hidden % self.heads:
      raise ConfigError(f"model.heads: {self.heads} does not divide model.hidden ({self.hidden}); "
                        "set model.head_dim")
    if self.dim_per_head % 2:
      raise ConfigError(f"model.head_dim: {self.dim_per_head} must be even for RoPE")
    if self.rope_theta <= 0 or self.rope_factor <= 0 or self.norm_eps <= 0:
      raise ConfigError("model.rope_theta, model.rope_factor and model.norm_eps must be > 0")

  @property
  def n_kv_heads(self) -> int:
    return self.heads if self.kv_heads is None else self.kv_heads

  @property
  def dim_per_head(self) -> int:
    return self.hidden // self.heads if self.head_dim is None else self.head_dim


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


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  compute_dtype: Literal["bfloat16", "float32"] = "bfloat16"  # dtype of weights and activations on device
  activations: int | Literal["device", "host", "auto"] = "device"  # where the kept block inputs wait for the backward: device memory, pinned host memory (copied out and back overlapped with compute), N: the first N kept inputs on the host, the rest on the device; auto: the planner spills the fewest that make the device fit
  activations_every: int | Literal["auto"] = 1  # keep every K-th block's input; the backward re-runs a segment of K blocks' forward from it; auto: every input while the device holds them, else the smallest K that fits
  micro_batch: int | None = None  # sequences per chunk inside a layer; None means the whole batch
  loss_chunk: int = 1024  # tokens per LM-head chunk, so full logits never exist
  attention: Literal["auto", "xla", "cudnn", "blockwise"] = "auto"  # attention kernel: XLA's, cuDNN's fused one, or mtjax's blockwise (no [T x T] tensor)
  matmul_precision: Literal["default", "high", "highest"] = "default"  # highest: true fp32 matmuls on GPU (no TF32)
  inflight_layers: int = 2  # layers the host may queue ahead of the device (bounds device memory)
  grad_queue: int | Literal["auto"] = 4  # host-group gradients awaiting the host optimizer before the device waits (bounds host buffers); auto: the planner picks
  device_state_layers: int | Literal["auto"] = "auto"  # first N layer groups (embedding, block 0, ...) whose weights and optimizer state live in device memory; auto: as few as make host RAM suffice
  device_update_layers: int | Literal["auto"] = 0  # the next N groups are updated on the device, their optimizer state streamed through it; auto: the planner picks
  device_memory_gb: float | None = None  # device memory the run may use (as on a smaller card); None: 92% of the device
  devices: int | Literal["all"] = "all"  # local devices the step runs on (data-parallel over a Mesh; train.batch splits evenly over them)
  seq_tile: int | None = 16384  # longer sequences run each block's norms, projections and MLP this many tokens at a time (recomputed per tile in the backward); None: the whole sequence at once

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
                       "(mtjax.plan.prepare)")
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

  def __post_init__(self):
    if self.source in ("tokens", "prepared") and not self.path:
      raise ConfigError(f"data.path: required when data.source is '{self.source}'")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  steps: int = 20  # optimizer steps to run
  batch: int = 8  # sequences per optimizer step (global batch)
  seq: int = 64  # tokens per sequence
  seed: int = 0  # seeds the weight init and the data stream
  log_every: int = 1  # steps between progress-bar updates of the loss
  checkpoint_dir: str | None = None  # where orbax checkpoints go; None saves none
  checkpoint_every: int = 0  # steps between checkpoints; 0 saves only at the end
  resume: bool = True  # continue from the newest checkpoint in checkpoint_dir, if there is one
  keep_checkpoints: int = 3  # committed checkpoints kept in checkpoint_dir, newest first; 0 keeps all
  overwrite: bool = False  # start afresh in a checkpoint_dir that holds another run's checkpoints (deletes them)
  max_skipped_steps: int = 5  # stop after this many steps in a row with a non-finite loss or gradient
  eval_every: int = 0  # steps between held-out evaluations on the prepared data's val split; 0: none
  eval_batches: int = 16  # at most this many held-out batches per evaluation
  run_dir: str | None = None  # run folder (config, plan, metrics.jsonl, TensorBoard); None: checkpoint_dir, else runs/<time>
  tensorboard: bool = True  # also write TensorBoard event files into run_dir/tb
  profile_step: int = 0  # record a JAX profiler trace of this step into run_dir/profile; 0: none
  export_dir: str | None = None  # at the end, write the weights as a Hugging Face directory here
  export_dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"  # tensor dtype of that export

  def __post_init__(self):
    _positive(self, "steps", "batch", "seq", "log_every")
    if self.checkpoint_every < 0:
      raise ConfigError(f"train.checkpoint_every: {self.checkpoint_every} must be >= 0")
    if self.profile_step < 0:
      raise ConfigError(f"train.profile_step: {self.profile_step} must be >= 0")
    if self.keep_checkpoints < 0 or self.max_skipped_steps <= 0:
      raise ConfigError("train.keep_checkpoints must be >= 0 and train.max_skipped_steps > 0")
    if self.eval_every < 0 or self.eval_batches <= 0:
      raise ConfigError("train.eval_every must be >= 0 and train.eval_batches > 0")


@dataclasses.dataclass(frozen=True)
class Config:
  model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
  optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
  engine: EngineConfig = dataclasses.field(default_factory=EngineConfig)
  data: DataConfig = dataclasses.field(default_factory=DataConfig)
  train: TrainConfig = dataclasses.field(default_factory=TrainConfig)

  def __post_init__(self):
    if self.train.eval_every and self.data.source != "prepared":
      raise ConfigError(f"train.eval_every: {self.train.eval_every} needs held-out data: prepared "
                        f"data with a val split (data.source=prepared, from `python -m mtjax.data "
                        f"prepare --val-fraction 0.02`); set train.eval_every=0 to train without it")
    mb = self.engine.micro_batch
    if mb is not None and self.train.batch % mb:
      raise ConfigError(f"engine.micro_batch: {mb} does not divide train.batch ({self.train.batch})")
    groups = self.model.layers + 2
    fixed = [(k, getattr(self.engine, k)) for k in ("device_state_layers", "device_update_layers")
             if getattr(self.engine, k) != "auto"]
    if sum(n for _, n in fixed) > groups:
      raise ConfigError(f"engine.{fixed[-1][0]}: {' + '.join(str(n) for _, n in fixed)} device "
                        f"groups exceed the {groups} layer groups (embedding, {self.model.layers} "
                        f"blocks, head)")

  @property
  def decay_steps(self) -> int:
    return self.optim.decay_steps or self.train.steps


def _positive(obj, *names):
  section = _SECTION_OF.get(type(obj).__name__, "")
  for n in names:
    if getattr(obj, n) <= 0:
      raise ConfigError(f"{section}{n}: {getattr(obj, n)} must be > 0")


_SECTION_OF = {"ModelConfig": "model.", "OptimConfig": "optim.", "EngineConfig": "engine.",
               "DataConfig": "data.", "TrainConfig": "train."}


def _coerce(key: str, value: Any, tp: Any) -> Any:
  """Checks `value` against the annotation `tp`, converting only int -> float."""
  origin = typing.get_origin(tp)
  if origin is Literal:
    if value not in typing.get_args(tp):
      raise ConfigError(f"{key}: {value!r} is not one of {list(typing.get_args(tp))}")
    return value
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
  return _build(Config, raw)


def load(path: str | Path | None, overrides: list[str] = ()) -> Config:
  """Reads YAML (with `base:` files merged first, relative to it), then applies dotted overrides;
  with `model.from_hf` the model's shape comes from that directory's config.json."""
  raw = _read_yaml(Path(path)) if path else {}
  return from_dict(with_hf_shape(apply_overrides(raw, list(overrides))))


def with_hf_shape(raw: dict) -> dict:
  """Fills the model section from `model.from_hf`'s config.json; a shape key the user also set
  must agree with it."""
  model = raw.get("model")
  if not isinstance(model, dict) or not model.get("from_hf"):
    return raw
  from mtjax import hf  # noqa: PLC0415 - hf imports this module
  # Resolved now: the path is stored in the config (and every checkpoint) and must still name the
  # same directory when an export runs from another working directory.
  directory = Path(str(model["from_hf"])).expanduser().resolve()
  try:
    fields = hf.Checkpoint(directory).model_fields()
  except (hf.HFError, OSError) as e:
    raise ConfigError(f"model.from_hf: {e}") from None
  for k, v in fields.items():
    if k in model and model[k] != v:
      raise ConfigError(f"model.{k}: {model[k]!r} differs from {directory}/config.json ({v!r}); "
                        "leave it out")
  return {**raw, "model": {**fields, **model, "from_hf": str(directory)}}


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


def parse_cli(parser, argv=None):
  """Adds --config and dotted overrides to `parser`, parses `argv` and loads the config; a bad
  config ends the program with exit code 2 and a one-line message. Returns (args, config)."""
  parser.add_argument("--config", help="YAML config file (default: every setting at its default)")
  parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=5")
  args = parser.parse_args(argv)
  try:
    return args, load(args.config, args.overrides)
  except ConfigError as e:
    print(f"config error: {e}", file=sys.stderr)
    raise SystemExit(2) from None


def to_dict(cfg) -> dict:
  return dataclasses.asdict(cfg)
