"""Hugging Face checkpoints in and out, for every registered model family (mtjax.models).

Import reads one tensor at a time through a memory map of its shard and writes it, widened to fp32
and transposed where flax keeps [in, out], straight into the caller's flat group vector, as the
family's tensor map (`Piece`s) places it: beside the final state, the host holds at most a bounded
slice of one tensor. Export streams the other way, one group at a time, into size-capped shards,
and renames a finished temporary directory into place so that an output directory is complete or
absent.

The safetensors format is read and written here directly (8-byte little-endian header length, a
JSON header of dtype, shape and data_offsets per tensor, then the data) because numpy has no
bfloat16: bf16 travels as uint16 bit patterns. Neither torch nor transformers is imported.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import struct
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path

import ml_dtypes
import numpy as np

from mtjax import models
from mtjax.config import ModelConfig, derived_widths, run_knobs
from mtjax.models import FamilyError, Piece, Stored


class HFError(ValueError):
  """A Hugging Face checkpoint or config that mtjax cannot use; the message names what and where."""


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "added_tokens.json", "vocab.json", "vocab.txt",
                   "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json",
                   # a vision-language model's processor: its image preprocessing and how the
                   # processor joins it to the tokenizer
                   "preprocessor_config.json", "processor_config.json",
                   "video_preprocessor_config.json")
_DTYPES = {"BF16": (np.uint16, 2), "F16": (np.float16, 2), "F32": (np.float32, 4)}
# What a packed weight's stored tensors may be besides (a decoder reads them as they are).
_RAW_DTYPES = {**{k: v[0] for k, v in _DTYPES.items()}, "U8": np.uint8, "I8": np.int8}
_EXPORT_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
CHUNK = 1 << 22  # elements converted at a time: bounds the temporaries of a bf16 or transposed copy


def model_fields(config: dict, source: str = "config.json") -> dict:
  """ModelConfig keyword arguments (the family included) from a parsed config.json; HFError on
  an architecture or option no family computes as transformers does."""
  try:
    return models.read_hf_config(config, source)
  except FamilyError as e:
    raise HFError(str(e)) from None


def hf_tensors(spec: models.ModelSpec, group: str, flat: np.ndarray
               ) -> Iterator[tuple[str, np.ndarray]]:
  """(Hugging Face name, fp32 array in Hugging Face layout) per tensor of a flat group vector."""
  lay = spec.group_layout(group)
  params = lay.unflatten(np.asarray(flat, np.float32))
  tensors: dict[str, np.ndarray] = {}
  for p in spec.family.pieces(spec.cfg, group, lay):
    if p.name not in tensors:
      tensors[p.name] = np.empty(p.shape, np.float32)
    value = _param(params, p.path)[p.dst] if p.dst else _param(params, p.path)
    target = tensors[p.name][p.src] if p.src else tensors[p.name]
    target[...] = np.swapaxes(value, -1, -2) if p.transpose else value
  yield from tensors.items()


def _param(tree: dict, path: tuple[str, ...]):
  for k in path:
    tree = tree[k]
  return tree


# ----------------------------------------------------------------------------- import


def _read_header(path: Path) -> tuple[dict, int]:
  try:
    with open(path, "rb") as f:
      head = f.read(8)
      if len(head) != 8:
        raise HFError(f"{path}: not a safetensors file (shorter than 8 bytes)")
      (n,) = struct.unpack("<Q", head)
      if n > os.path.getsize(path) - 8:
        raise HFError(f"{path}: not a safetensors file (header length {n} beyond the file)")
      header = json.loads(f.read(n))
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
    raise HFError(f"{path}: unreadable safetensors header ({type(e).__name__})") from None
  header.pop("__metadata__", None)
  return header, 8 + n


class Checkpoint:
  """A Hugging Face model directory opened for reading: config.json and its safetensors shards.

  Only the headers are read on opening; tensors are read one at a time, through memory maps.
  """

  def __init__(self, directory: str | os.PathLike):
    self.dir = Path(directory)
    cfg_path = self.dir / "config.json"
    try:
      self.config = json.loads(cfg_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
      raise HFError(f"{cfg_path}: unreadable ({type(e).__name__})") from None
    if not isinstance(self.config, dict):
      raise HFError(f"{cfg_path}: not a JSON object")
    index = self.dir / "model.safetensors.index.json"
    if index.exists():
      try:
        weight_map = json.loads(index.read_text())["weight_map"]
      except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise HFError(f"{index}: unreadable ({type(e).__name__})") from None
      files = [self.dir / f for f in sorted(set(weight_map.values()))]
    else:
      weight_map, files = None, sorted(self.dir.glob("*.safetensors"))
    if not files:
      raise HFError(f"{self.dir}: no *.safetensors files")
    self.entries: dict[str, Stored] = {}
    for path in files:
      if not path.exists():
        raise HFError(f"{index}: lists shard {path.name}, which does not exist")
      header, data_start = _read_header(path)
      for name, h in header.items():
        if name in self.entries:
          raise HFError(f"{path}: tensor {name} also in {self.entries[name].file.name}")
        try:
          begin, end = h["data_offsets"]
          entry = Stored(path, h["dtype"], tuple(h["shape"]), data_start + begin, end - begin)
        except (KeyError, TypeError, ValueError):
          raise HFError(f"{path}: tensor {name} has a malformed header entry") from None
        self.entries[name] = entry
    if weight_map is not None:
      for name, file in weight_map.items():
        if name not in self.entries or self.entries[name].file.name != file:
          raise HFError(f"{index}: tensor {name} not found in {file}")

  def canonical(self, family: models.Family):
    """Renames the stored tensors to the spelling `family`'s pieces use (Family.renames); a
    clash of two stored names on one is refused."""
    if not family.renames or getattr(self, "_renamed", None) == family.name:
      return
    out = {}
    for name, e in self.entries.items():
      new = name
      for pattern, repl in family.renames:
        new, n = re.subn(pattern, repl, name, count=1)
        if n:
          break
      if new in out:
        raise HFError(f"{e.file}: tensors {name} and another both read as {new}")
      out[new] = e
    self.entries, self._renamed = out, family.name

  def model_fields(self) -> dict:
    """ModelConfig keyword arguments from config.json (see the module-level `model_fields`)."""
    return model_fields(self.config, str(self.dir / "config.json"))

  def raw(self, name: str) -> np.ndarray:
    """A stored tensor as it is on disk (a memory map; bf16 as uint16 bit patterns)."""
    e = self.entries[name]
    if e.dtype not in _RAW_DTYPES:
      raise HFError(f"{e.file}: tensor {name} has dtype {e.dtype}")
    return np.memmap(e.file, dtype=_RAW_DTYPES[e.dtype], mode="r", offset=e.start,
                     shape=e.shape or (1,))

  def _packed(self, spec: models.ModelSpec, name: str, shape: tuple[int, ...]):
    """(decoder, the stored tensors) of weight `name` where the family's decoders find it packed,
    else None; HFError on packed tensors that do not decode to `shape`."""
    for d in spec.family.decoders:
      try:
        sources = d.sources(self.entries, self.config, name, shape)
      except FamilyError as e:
        raise HFError(str(e)) from None
      if sources:
        return d, sources
    return None

  def check(self, spec: models.ModelSpec):
    """Raises HFError unless the tensors are exactly what the model needs, before anything is read.

    Every expected tensor must be present with its shape and a float dtype (or stored packed, as
    one of the family's decoders reads it); nothing else may be left over, except lm_head.weight
    of a tied model and what the family tolerates (`Family.ignored`).
    """
    self.canonical(spec.family)
    expected: dict[str, Piece] = {}
    for g, _ in spec.groups:
      for p in spec.family.pieces(spec.cfg, g, spec.group_layout(g)):
        expected.setdefault(p.name, p)
    used = set()
    for name, p in expected.items():
      e = self.entries.get(name)
      if e is None:
        packed = self._packed(spec, name, p.shape)
        if packed:
          used.update(packed[1])
          continue
        raise HFError(f"{self.dir}: tensor {name} missing")
      where = f"{e.file}: tensor {name}"
      if e.shape != p.shape:
        raise HFError(f"{where} has shape {list(e.shape)}, expected {list(p.shape)}")
      if e.dtype not in _DTYPES:
        raise HFError(f"{where} has dtype {e.dtype}, expected one of {', '.join(_DTYPES)}")
      if e.nbytes != int(np.prod(e.shape)) * _DTYPES[e.dtype][1]:
        raise HFError(f"{where} spans {e.nbytes} bytes, which does not fit its shape and dtype")
      if e.start + e.nbytes > e.file.stat().st_size:
        raise HFError(f"{where} extends past the end of the file (truncated?)")
      used.add(name)
    for name, e in self.entries.items():
      if name in used or spec.family.ignored(self.config, name):
        continue
      if name == "lm_head.weight" and spec.cfg.tie_embeddings:
        continue
      raise HFError(f"{e.file}: tensor {name} unexpected for this config")

  def read_group(self, spec: models.ModelSpec, name: str, out: np.ndarray):
    """Fills one group's flat fp32 vector from the checkpoint, one tensor at a time, in place.

    Args:
      spec: the model spec (`mtjax.models.spec(cfg)`); call `check` first.
      name: "embed", "block_<i>" or "head".
      out: the group's flat fp32 vector, written in place.
    """
    self.canonical(spec.family)
    lay = spec.group_layout(name)
    if out.shape != (lay.size,) or out.dtype != np.float32:
      raise HFError(f"{name}: buffer {out.shape} {out.dtype}, expected ({lay.size},) float32")
    views = lay.unflatten(out)
    for p in spec.family.pieces(spec.cfg, name, lay):
      if p.name in self.entries:
        e = self.entries[p.name]
        if e.shape != p.shape:
          raise HFError(f"{self.dir}: tensor {p.name} misshapen (run check first)")
        src = self.raw(p.name)
      else:
        packed = self._packed(spec, p.name, p.shape)
        if packed is None:
          raise HFError(f"{self.dir}: tensor {p.name} missing (run check first)")
        src = packed[0].decode(self.raw, p.name)
      if p.src:
        src = src[p.src]
      dst = _param(views, p.path)
      dst = dst[p.dst] if p.dst else dst
      _copy(src, dst, p.transpose)


def _copy(src: np.ndarray, dst: np.ndarray, transpose: bool):
  """dst[...] = widened src (its last two axes swapped if `transpose`), a few million elements at
  a time along src's first axis, so the widened (and transposed) temporary stays small."""
  if src.ndim < 2:
    dst[...] = _widen(src).reshape(dst.shape)
    return
  rows = src.shape[0]
  step = max(1, CHUNK // max(1, int(np.prod(src.shape[1:]))))
  for r in range(0, rows, step):
    part = _widen(src[r:r + step])
    if transpose and src.ndim == 2:  # a Linear's [out, in] rows are dst's columns
      dst[:, r:r + step] = part.T
    elif transpose:
      dst[r:r + step] = np.swapaxes(part, -1, -2)
    else:
      dst[r:r + step] = part
    del part  # before the next chunk is widened, or two temporaries coexist


def _widen(part: np.ndarray) -> np.ndarray:
  part = np.asarray(part)
  if part.dtype == np.uint16:  # bf16 bit patterns
    return part.view(ml_dtypes.bfloat16).astype(np.float32)
  return part.astype(np.float32, copy=False)


# ----------------------------------------------------------------------------- export


def _bf16_bits(x: np.ndarray) -> np.ndarray:
  """fp32 -> bf16 bit patterns (uint16), rounding to nearest even as torch does; NaN stays NaN."""
  # through fp32 first: a float64 input rounded straight to bf16 could round differently
  return np.ascontiguousarray(x, np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)


def _write_safetensors(path: Path, items: list[tuple[str, str, np.ndarray]]):
  """Writes (name, safetensors dtype, array) items; the data follows the header in item order."""
  header, off = {"__metadata__": {"format": "pt"}}, 0
  for name, dtype, arr in items:
    header[name] = {"dtype": dtype, "shape": list(arr.shape),
                    "data_offsets": [off, off + arr.nbytes]}
    off += arr.nbytes
  blob = json.dumps(header, separators=(",", ":")).encode()
  blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned, as the format recommends
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(blob)))
    f.write(blob)
    for _, _, arr in items:
      f.write(np.ascontiguousarray(arr).data)


MAX_SHARD_BYTES = 5 << 30  # tensor bytes per exported shard (held in memory until written)


def export(out_dir: str | os.PathLike, cfg: ModelConfig, groups: Iterable[tuple[str, np.ndarray]],
           dtype: str = "bfloat16", source_dir: str | os.PathLike | None = None,
           max_shard_bytes: int = MAX_SHARD_BYTES) -> Path:
  """Writes a Hugging Face model directory from flat fp32 groups, streamed one group at a time.

  Args:
    out_dir: the directory to create; it must not exist or be empty. It appears complete or not
      at all (written under a temporary name beside it, then renamed).
    cfg: the model config.
    groups: (group name, flat fp32 vector) in the order embed, block_0 .. block_{L-1}, head;
      consumed one at a time.
    dtype: "bfloat16" (rounded to nearest even), "float16" or "float32".
    source_dir: a Hugging Face directory whose config.json (dtype updated) and tokenizer files are
      kept; None writes the family's config.json for `cfg`.
    max_shard_bytes: the most tensor bytes per shard (a larger single tensor gets its own shard).

  Returns:
    The path of the written directory.
  """
  if dtype not in _EXPORT_DTYPES:
    raise HFError(f"dtype {dtype!r} unsupported ({', '.join(_EXPORT_DTYPES)})")
  st_dtype = _EXPORT_DTYPES[dtype]
  if max_shard_bytes <= 0:
    raise HFError(f"max_shard_bytes: {max_shard_bytes} must be > 0")
  out_dir = Path(out_dir).absolute()
  if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
    raise HFError(f"{out_dir}: exists and is not an empty directory")
  spec = models.spec(cfg)
  config = _export_config(cfg, dtype, source_dir)
  tmp = out_dir.parent / f".{out_dir.name}.tmp-{uuid.uuid4().hex[:8]}"
  tmp.mkdir(parents=True)
  try:
    shards, weight_map, total = _write_shards(tmp, spec, groups, st_dtype, max_shard_bytes)
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if len(shards) == 1:  # Hugging Face's own convention: one file, no index
      shards[0].rename(tmp / "model.safetensors")
    else:
      names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
      for shard, final in zip(shards, names):
        shard.rename(tmp / final)
      index = {"metadata": {"total_size": total},
               "weight_map": {k: names[i] for k, i in sorted(weight_map.items())}}
      (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    if source_dir is not None:
      copy_source_files(source_dir, tmp, config=False)
    if out_dir.exists():
      out_dir.rmdir()  # checked empty above; rename onto a directory needs it gone
    tmp.rename(out_dir)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return out_dir


def copy_source_files(source_dir: str | os.PathLike, dest: str | os.PathLike, config: bool = True):
  """Copies a Hugging Face directory's config.json (unless `config` is False) and the tokenizer and
  processor files that exist into `dest` (created)."""
  dest = Path(dest)
  dest.mkdir(parents=True, exist_ok=True)
  for f in (("config.json",) if config else ()) + TOKENIZER_FILES:
    if (Path(source_dir) / f).is_file():
      shutil.copy2(Path(source_dir) / f, dest / f)


_NOT_ARCHITECTURE = ("family", "from_hf", "init_std")  # fields a config.json need not carry


def _export_config(cfg: ModelConfig, dtype: str, source_dir) -> dict:
  """The exported config.json: the source's (its dtype updated) or the family's, either checked to
  read back as `cfg` (transformers would otherwise compute another model from the weights)."""
  src = Path(source_dir) / "config.json" if source_dir is not None else None
  if src is None or not src.is_file():
    family = models.get(cfg.family)
    config = family.write_config(cfg, dtype)
    where = f"the {family.name} family's config.json"
  else:
    try:
      config = json.loads(src.read_text())
    except (OSError, json.JSONDecodeError) as e:
      raise HFError(f"{src}: unreadable ({type(e).__name__})") from None
    keys = [k for k in ("dtype", "torch_dtype") if k in config] or ["torch_dtype"]
    config.update({k: dtype for k in keys})
    # The tensors are written unpacked (packed weights are decoded on import): a quantization
    # config kept from the source would make a loader expect packed ones.
    config.pop("quantization_config", None)
    where = str(src)
  fields = model_fields(config, where)
  mine = derived_widths({k: getattr(cfg, k) for k in fields})
  theirs = derived_widths(fields)
  for key, value in fields.items():
    if key == "max_position" and cfg.max_position is None:  # a model that states none takes it
      continue
    if dataclasses.is_dataclass(mine[key]) and dataclasses.is_dataclass(theirs[key]):
      ours, file = (dataclasses.asdict(x) for x in (mine[key], theirs[key]))  # a section
      if {k: v for k, v in ours.items() if k not in run_knobs(ours)} == {
          k: v for k, v in file.items() if k not in run_knobs(ours)}:
        continue
    if key not in _NOT_ARCHITECTURE and mine[key] != theirs[key]:
      raise HFError(f"{where}: gives model.{key}={value!r}, the weights have "
                    f"{getattr(cfg, key)!r}")
  return config


def _write_shards(tmp: Path, spec: models.ModelSpec, groups: Iterable[tuple[str, np.ndarray]],
                  st_dtype: str, max_shard_bytes: int):
  expected = [g for g, _ in spec.groups]
  shards: list[Path] = []
  weight_map: dict[str, int] = {}
  pending: list[tuple[str, str, np.ndarray]] = []
  pending_bytes = total = 0

  def flush():
    nonlocal pending, pending_bytes
    if pending:
      path = tmp / f"shard-{len(shards)}.safetensors.part"
      _write_safetensors(path, pending)
      for name, _, _ in pending:
        weight_map[name] = len(shards)
      shards.append(path)
      pending, pending_bytes = [], 0

  seen = 0
  for name, flat in groups:
    if seen >= len(expected) or name != expected[seen]:
      want = expected[seen] if seen < len(expected) else "nothing (all groups written)"
      raise HFError(f"export: got group {name!r}, expected {want}")
    size = spec.group_layout(name).size
    if np.shape(flat) != (size,):
      raise HFError(f"export: group {name} has shape {np.shape(flat)}, expected ({size},)")
    seen += 1
    for tname, arr in hf_tensors(spec, name, flat):
      if st_dtype == "BF16":
        arr = _bf16_bits(arr)
      elif st_dtype == "F16":
        top = float(np.max(np.abs(arr), initial=0.0, where=np.isfinite(arr)))
        if top > np.finfo(np.float16).max:
          raise HFError(f"export: {tname} holds {top:.4g}, beyond float16's range (65504); "
                        f"export as bfloat16 or float32")
        arr = arr.astype(np.float16)
      if pending and pending_bytes + arr.nbytes > max_shard_bytes:
        flush()
      pending.append((tname, st_dtype, arr))
      pending_bytes += arr.nbytes
      total += arr.nbytes
  if seen != len(expected):
    raise HFError(f"export: groups ended after {seen} of {len(expected)} (next: {expected[seen]})")
  flush()
  return shards, weight_map, total


def load_into(store, directory: str | os.PathLike) -> None:
  """Imports a Hugging Face model's weights into a `mtjax.store.LayerStore`, group by group, each
  tensor written straight into the group's buffer (every tensor checked first)."""
  ck = Checkpoint(directory)
  spec = models.spec(store.model_cfg)
  ck.check(spec)
  for i, g in enumerate(store.groups):
    if store.owns(i):  # with several processes, each reads the groups it holds
      store.fill(i, lambda out, name=g.name: ck.read_group(spec, name, out))
