"""The family registry: what a family declares (config translation, tensor map), and the lookups by
name and by config.json architecture. The family modules register themselves on import; the
registry imports them (by name, on the first lookup) so that every family is known."""

from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Callable

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
class Family:
  """A model family: its Hugging Face names, config translation and tensor map.

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
    ignored: names of checkpoint tensors that are not weights (derived buffers), tolerated.
    notes: what it supports and what not, one line (README's family table).
  """
  name: str
  architectures: tuple[str, ...]
  read_config: Callable[[dict, str], dict]
  write_config: Callable[[ModelConfig, str], dict]
  pieces: Callable[[ModelConfig, str, Layout], list[Piece]]
  aux_loss: Callable | None = None
  ignored: Callable[[str], bool] = lambda name: name.endswith(".rotary_emb.inv_freq")
  notes: str = ""


FAMILIES: dict[str, Family] = {}
_MODULES = ("llama", "gemma", "phi3", "olmo2", "deepseek", "gpt_oss", "mixtral",
            "qwen_moe")  # the family modules (each registers its own)


def register(family: Family) -> Family:
  FAMILIES[family.name] = family
  return family


@functools.cache
def _load_all():
  for m in _MODULES:
    importlib.import_module(f"mtjax.models.{m}")


def families() -> dict[str, Family]:
  """Every registered family by name."""
  _load_all()
  return FAMILIES


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
  return {"family": family.name, **family.read_config(config, where)}


def group_names(cfg: ModelConfig) -> list[str]:
  """The layer groups in forward order: embed, block_0 .. block_{L-1}, head."""
  return ["embed"] + [f"block_{i}" for i in range(cfg.layers)] + ["head"]


def block_index(group: str) -> int | None:
  """i of "block_<i>", else None."""
  if group.startswith("block_") and group[6:].isdigit():
    return int(group[6:])
  return None
