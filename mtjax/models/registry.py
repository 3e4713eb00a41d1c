"""The family registry: what a family declares (config translation, tensor map, packed weights'
decoders, tolerated tensors, notes), and the lookups by name and by config.json architecture.

A family is declared in its module alone: the module registers it when imported, and the first
lookup imports every module of mtjax.models, so a new module is found without a list to extend.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np

from mtjax.config import ConfigError, ModelConfig
from mtjax.layout import Layout


class FamilyError(ValueError):
  """A Hugging Face checkpoint or config that no family can use; the message names what and where."""


@dataclasses.dataclass(frozen=True)
class Piece:
  """One Hugging Face tensor's share of one mtjax parameter: param[dst] = T(tensor[src]).

  T swaps the last two axes when `transpose` (a torch Linear keeps [out, in], flax [in, out]).
  A fused tensor (Phi-3's qkv_proj) is several pieces of one name; a stacked parameter (experts
  [E, D, F]) is filled by one piece per per-expert tensor.
  """
  name: str  # the Hugging Face tensor
  shape: tuple[int, ...]  # its shape in the checkpoint
  path: tuple[str, ...]  # the mtjax parameter inside its group
  src: tuple = ()  # index into the Hugging Face tensor; () is all of it
  dst: tuple = ()  # index into the mtjax parameter; () is all of it
  transpose: bool = False


@dataclasses.dataclass(frozen=True)
class Stored:
  """A tensor as a checkpoint's header describes it: what a decoder checks before anything is
  read."""
  file: Path  # the shard that holds it
  dtype: str  # the safetensors dtype: "BF16", "F32", "U8", ...
  shape: tuple[int, ...]
  start: int  # absolute byte offset of its data in the file
  nbytes: int


class Decoder:
  """A weight a checkpoint stores in another form than the tensor itself (MXFP4 blocks and
  scales, say), decoded on import; a family lists its own (`Family.decoders`)."""

  quant_method: str  # config.json's quantization_config.quant_method whose tensors this decodes

  def sources(self, stored: Mapping[str, Stored], config: dict, name: str,
              shape: tuple[int, ...]) -> list[str] | None:
    """The stored tensors weight `name` (of `shape`) decodes from, checked against their headers
    and config.json; None when the checkpoint holds none of them. Raises FamilyError, naming the
    tensor, on any that cannot be decoded."""
    raise NotImplementedError

  def decode(self, read: Callable[[str], np.ndarray], name: str) -> np.ndarray:
    """Weight `name` as fp32 (an array, or a lazy object numpy reads as one), its stored tensors
    read by `read(stored name)` as they are on disk."""
    raise NotImplementedError


def rotary_buffers(config: dict, name: str) -> bool:
  """Derived RoPE buffers (`*.rotary_emb.inv_freq`) some checkpoints carry: not weights."""
  return name.endswith(".rotary_emb.inv_freq")


@dataclasses.dataclass(frozen=True)
class Family:
  """A model family: its Hugging Face names, config translation and tensor map, all declared by
  its module under mtjax/models (the registry finds every module there).

  Attributes:
    name: the registry name (`model.family`).
    architectures: the config.json `architectures` it reads.
    read_config: (config.json dict, where) -> ModelConfig fields; raises FamilyError on what mtjax
      would compute differently.
    write_config: (ModelConfig, dtype) -> config.json dict for an export without a source.
    pieces: (ModelConfig, group name, layout) -> the Pieces of one group ("embed", "block_<i>",
      "head").
    aux_loss: the model's auxiliary loss from the blocks' sums (see `ModelSpec.aux_loss`); None
      takes mtjax.models.moe.aux_loss for a mixture of experts.
    decoders: the packed forms of weights its checkpoints may store (`Decoder`s); a
      quantization_config whose quant_method none of them decodes is refused.
    ignored: (config.json dict, tensor name) -> whether a checkpoint tensor that is no weight of
      the model (a derived buffer, a head transformers does not load either) is tolerated.
    renames: (pattern, replacement) regular expressions that turn the other spellings of a stored
      tensor's name into the one `pieces` uses (the first that matches applies).
    notes: what it supports and what not, one line (README's family table).
    module: the module that declares it (its config translation's).
  """
  name: str
  architectures: tuple[str, ...]
  read_config: Callable[[dict, str], dict]
  write_config: Callable[[ModelConfig, str], dict]
  pieces: Callable[[ModelConfig, str, Layout], list[Piece]]
  aux_loss: Callable | None = None
  decoders: tuple[Decoder, ...] = ()
  ignored: Callable[[dict, str], bool] = rotary_buffers
  renames: tuple[tuple[str, str], ...] = ()
  notes: str = ""
  module: str = dataclasses.field(init=False)

  def __post_init__(self):
    object.__setattr__(self, "module", self.read_config.__module__)


_REGISTERED: dict[str, Family] = {}


def register(family: Family) -> Family:
  """Adds a family (its module calls this when imported); a second family of the same name or
  architecture is a bug in the module that declares it."""
  taken = {a: f.name for f in _REGISTERED.values() if f.name != family.name
           for a in f.architectures}
  clash = [a for a in family.architectures if a in taken]
  if clash:
    raise ValueError(f"family {family.name}: architecture {clash[0]} is {taken[clash[0]]}'s")
  _REGISTERED[family.name] = family
  return family


def families() -> dict[str, Family]:
  """Every family by name, sorted: each module of the mtjax.models package is imported first (a
  family module registers its families on import; one imported already costs a lookup)."""
  package = importlib.import_module(__package__)
  for m in pkgutil.iter_modules(package.__path__):
    importlib.import_module(f"{__package__}.{m.name}")
  return dict(sorted(_REGISTERED.items()))


def get(name: str) -> Family:
  fams = families()
  if name not in fams:
    raise ConfigError(f"model.family: {name!r} is not one of {', '.join(sorted(fams))}")
  return fams[name]


def for_architecture(arch: str, where: str = "config.json") -> Family:
  for f in families().values():
    if arch in f.architectures:
      return f
  supported = sorted(a for f in families().values() for a in f.architectures)
  raise FamilyError(f"{where}: architecture {arch!r} unsupported; supported: "
                    f"{', '.join(supported)}")


def read_hf_config(config: dict, where: str = "config.json") -> dict:
  """ModelConfig fields (family included) from a parsed Hugging Face config.json."""
  archs = config.get("architectures") or []
  if not isinstance(archs, list) or len(archs) != 1:
    raise FamilyError(f"{where}: architectures {archs} unsupported (expected one name)")
  family = for_architecture(archs[0], where)
  quant = config.get("quantization_config")
  if quant is not None:
    method = quant.get("quant_method") if isinstance(quant, dict) else quant
    decoded = [d.quant_method for d in family.decoders]
    if method not in decoded:
      raise FamilyError(f"{where}: quantization_config.quant_method={method!r} unsupported (mtjax "
                        f"reads {family.name} in bf16, fp16 or fp32"
                        + "".join(f", or {m} weights decoded on import" for m in decoded) + ")")
  return {"family": family.name, **family.read_config(config, where)}


def group_names(cfg: ModelConfig) -> list[str]:
  """The layer groups in forward order: embed, block_0 .. block_{L-1}, head."""
  return ["embed"] + [f"block_{i}" for i in range(cfg.layers)] + ["head"]


def block_index(group: str) -> int | None:
  """i of "block_<i>", else None."""
  if group.startswith("block_") and group[6:].isdigit():
    return int(group[6:])
  return None
