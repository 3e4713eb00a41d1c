"""Hugging Face checkpoints in and out: Llama, Mistral, Qwen2 and Qwen3 safetensors directories.

Import reads one tensor at a time through a memory map of its shard and writes it, widened to fp32
and transposed where flax keeps [in, out], straight into the caller's flat group vector: beside the
final state, the host holds at most a bounded slice of one tensor. Export streams the other way,
one group at a time, into size-capped shards, and renames a finished temporary directory into
place so that an output directory is complete or absent.

The safetensors format is read and written here directly (8-byte little-endian header length, a
JSON header of dtype, shape and data_offsets per tensor, then the data) because numpy has no
bfloat16: bf16 travels as uint16 bit patterns. Neither torch nor transformers is imported.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import struct
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from mtjax.config import ModelConfig
from mtjax.state import Layout


class HFError(ValueError):
  """A Hugging Face checkpoint or config that mtjax cannot use; the message names what and where."""


ARCHITECTURES = {  # architecture -> model_type, the four families mtjax computes exactly
    "LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
}
# Values transformers assumes when config.json omits a key (save_pretrained drops some defaults).
_DEFAULTS = {
    "llama": dict(rms_norm_eps=1e-6, tie_word_embeddings=False),
    "mistral": dict(rms_norm_eps=1e-6, tie_word_embeddings=False),
    "qwen2": dict(rms_norm_eps=1e-6, tie_word_embeddings=False),
    "qwen3": dict(rms_norm_eps=1e-6, tie_word_embeddings=False, head_dim=128),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json", "added_tokens.json", "vocab.json", "vocab.txt",
                   "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json")
_DTYPES = {"BF16": (np.uint16, 2), "F16": (np.float16, 2), "F32": (np.float32, 4)}
_EXPORT_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
CHUNK = 1 << 22  # elements converted at a time: bounds the temporaries of a bf16 or transposed copy


# ----------------------------------------------------------------------------- config.json


def model_fields(config: dict, source: str = "config.json") -> dict:
  """ModelConfig keyword arguments from a parsed Hugging Face config.json.

  Args:
    config: the parsed config.json.
    source: how error messages name the file.

  Returns:
    A dict for `ModelConfig(**fields)`; raises HFError on anything mtjax would compute differently.
  """
  archs = config.get("architectures") or []
  if len(archs) != 1 or archs[0] not in ARCHITECTURES:
    raise HFError(f"{source}: architectures {archs} unsupported; supported: "
                  f"{', '.join(ARCHITECTURES)}")
  family = ARCHITECTURES[archs[0]]
  c = {**_DEFAULTS[family], **config}

  def get(key):
    if c.get(key) is None:
      raise HFError(f"{source}: required key {key!r} missing")
    return c[key]

  def refuse(key, why):
    raise HFError(f"{source}: {key}={c.get(key)!r} unsupported ({why})")

  if c.get("hidden_act", "silu") != "silu":
    refuse("hidden_act", "mtjax's MLP is SwiGLU with silu")
  if c.get("mlp_bias"):
    refuse("mlp_bias", "mtjax's MLP has no biases")
  if family in ("llama", "qwen3") and c.get("attention_bias"):
    refuse("attention_bias", "it also puts a bias on o_proj, which mtjax lacks")
  if family == "mistral" and c.get("sliding_window") is not None:
    refuse("sliding_window", "mtjax attends to the whole context")
  if family in ("qwen2", "qwen3") and c.get("use_sliding_window"):
    refuse("use_sliding_window", "mtjax attends to the whole context")
  if any(t != "full_attention" for t in c.get("layer_types") or ()):
    refuse("layer_types", "mtjax attends to the whole context in every layer")

  hidden, heads = get("hidden_size"), get("num_attention_heads")
  head_dim = c.get("head_dim") or hidden // heads
  fields = dict(
      vocab_size=get("vocab_size"), hidden=hidden, layers=get("num_hidden_layers"), heads=heads,
      kv_heads=c.get("num_key_value_heads") or heads,
      head_dim=None if head_dim * heads == hidden else head_dim,
      ffn=get("intermediate_size"), tie_embeddings=bool(c["tie_word_embeddings"]),
      qkv_bias=family == "qwen2", qk_norm=family == "qwen3", norm_eps=float(c["rms_norm_eps"]))
  fields.update(_rope_fields(c, source))
  return fields


def _rope_fields(c: dict, source: str) -> dict:
  # transformers 5 writes `rope_parameters` (theta inside); older files rope_theta, rope_scaling.
  key = "rope_parameters" if c.get("rope_parameters") is not None else "rope_scaling"
  rope = c.get(key) or {}
  if not isinstance(rope, dict):
    raise HFError(f"{source}: {key}={rope!r} unsupported (expected a dict)")
  theta = rope.get("rope_theta", c.get("rope_theta", 10000.0))
  kind = rope.get("rope_type", rope.get("type", "default"))
  if kind == "default":
    return dict(rope_theta=float(theta), rope_scaling="none")

  def need(k):
    if rope.get(k) is None:
      raise HFError(f"{source}: {key} of type {kind!r} lacks {k!r}")
    return rope[k]

  if kind == "linear":
    return dict(rope_theta=float(theta), rope_scaling="linear", rope_factor=float(need("factor")))
  if kind == "llama3":
    return dict(rope_theta=float(theta), rope_scaling="llama3", rope_factor=float(need("factor")),
                rope_low_freq_factor=float(need("low_freq_factor")),
                rope_high_freq_factor=float(need("high_freq_factor")),
                rope_original_max_len=int(need("original_max_position_embeddings")))
  raise HFError(f"{source}: {key} rope_type {kind!r} unsupported (default, linear, llama3 only)")


def hf_config(cfg: ModelConfig, dtype: str = "bfloat16") -> dict:
  """A config.json for `cfg`: Llama, or Qwen2 with q/k/v biases, or Qwen3 with q/k norms."""
  if cfg.qkv_bias and cfg.qk_norm:
    raise HFError("model.qkv_bias with model.qk_norm: no Hugging Face family has both")
  arch = ("Qwen3ForCausalLM" if cfg.qk_norm else "Qwen2ForCausalLM" if cfg.qkv_bias
          else "LlamaForCausalLM")
  rope = {"rope_type": "default"}
  if cfg.rope_scaling == "linear":
    rope = {"rope_type": "linear", "factor": cfg.rope_factor}
  elif cfg.rope_scaling == "llama3":
    rope = {"rope_type": "llama3", "factor": cfg.rope_factor,
            "low_freq_factor": cfg.rope_low_freq_factor,
            "high_freq_factor": cfg.rope_high_freq_factor,
            "original_max_position_embeddings": cfg.rope_original_max_len}
  out = {
      "architectures": [arch], "model_type": ARCHITECTURES[arch],
      "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden, "intermediate_size": cfg.ffn,
      "num_hidden_layers": cfg.layers, "num_attention_heads": cfg.heads,
      "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.dim_per_head,
      "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps,
      "tie_word_embeddings": cfg.tie_embeddings,
      # mtjax has no notion of a maximum length; this is only what generation tools read.
      "max_position_embeddings": cfg.rope_original_max_len * max(1, int(cfg.rope_factor)),
      # Both spellings: transformers >= 5 reads rope_parameters, older readers rope_theta/scaling.
      "rope_theta": cfg.rope_theta, "rope_parameters": {**rope, "rope_theta": cfg.rope_theta},
      "rope_scaling": None if cfg.rope_scaling == "none" else rope,
      "torch_dtype": dtype,
  }
  if arch == "LlamaForCausalLM":
    out.update(attention_bias=False, mlp_bias=False)
  else:
    out.update(use_sliding_window=False, sliding_window=None, attention_bias=False)
  return out


# ----------------------------------------------------------------------------- name mapping


@dataclasses.dataclass(frozen=True)
class Tensor:
  """One Hugging Face tensor and where it sits in a group's flat vector."""
  name: str  # e.g. "model.layers.3.self_attn.q_proj.weight"
  path: tuple[str, ...]  # mtjax parameter path inside the group
  offset: int  # first element in the flat vector
  shape: tuple[int, ...]  # Hugging Face shape ([out, in] for a Linear weight)
  transpose: bool  # flax keeps [in, out]


_BLOCK_NAMES = {
    ("attn", "q_norm", "scale"): "self_attn.q_norm.weight",
    ("attn", "k_norm", "scale"): "self_attn.k_norm.weight",
    ("attn_norm", "scale"): "input_layernorm.weight",
    ("mlp_norm", "scale"): "post_attention_layernorm.weight",
}


def _block_name(path: tuple[str, ...]) -> str | None:
  if path in _BLOCK_NAMES:
    return _BLOCK_NAMES[path]
  if (len(path) == 3 and path[0] == "attn" and path[1] in ("q", "k", "v", "o")
      and path[2] in ("kernel", "bias")):
    return f"self_attn.{path[1]}_proj.{'weight' if path[2] == 'kernel' else 'bias'}"
  if len(path) == 3 and path[0] == "mlp" and path[2] == "kernel":
    return f"mlp.{path[1]}_proj.weight"
  return None


def tensors(layouts: dict[str, Layout], group: str) -> list[Tensor]:
  """The Hugging Face tensors of one group ("embed", "block_<i>" or "head"), in layout order."""
  if group in ("embed", "head"):
    kind, prefix = group, ""
  elif group.startswith("block_") and group[6:].isdigit():
    kind, prefix = "block", f"model.layers.{int(group[6:])}."
  else:
    raise HFError(f"group {group!r} unknown (embed, block_<i> or head)")
  lay = layouts[kind]
  out = []
  for path, shape, off in zip(lay.paths, lay.shapes, lay.offsets):
    name = {("table",): "model.embed_tokens.weight", ("norm", "scale"): "model.norm.weight",
            ("out",): "lm_head.weight"}.get(path) if kind != "block" else _block_name(path)
    if name is None:
      raise HFError(f"{group}: parameter {'/'.join(path)} has no Hugging Face name")
    transpose = path[-1] == "kernel" or path == ("out",)
    out.append(Tensor(prefix + name, path, off, tuple(reversed(shape)) if transpose else shape,
                      transpose))
  return out


def group_names(cfg: ModelConfig) -> list[str]:
  """The layer groups in forward order: embed, block_0 .. block_{L-1}, head."""
  return ["embed"] + [f"block_{i}" for i in range(cfg.layers)] + ["head"]


def hf_tensors(layouts: dict[str, Layout], group: str, flat: np.ndarray
               ) -> Iterator[tuple[str, np.ndarray]]:
  """(Hugging Face name, fp32 array in Hugging Face layout) per tensor of a flat group vector."""
  for t in tensors(layouts, group):
    n = int(np.prod(t.shape))
    arr = np.asarray(flat[t.offset:t.offset + n])
    yield t.name, (arr.reshape(t.shape[::-1]).T if t.transpose else arr.reshape(t.shape))


# ----------------------------------------------------------------------------- import


@dataclasses.dataclass(frozen=True)
class _Entry:
  file: Path
  dtype: str
  shape: tuple[int, ...]
  start: int  # absolute byte offset of the data in the file
  nbytes: int


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
    self.entries: dict[str, _Entry] = {}
    for path in files:
      if not path.exists():
        raise HFError(f"{index}: lists shard {path.name}, which does not exist")
      header, data_start = _read_header(path)
      for name, h in header.items():
        if name in self.entries:
          raise HFError(f"{path}: tensor {name} also in {self.entries[name].file.name}")
        try:
          begin, end = h["data_offsets"]
          entry = _Entry(path, h["dtype"], tuple(h["shape"]), data_start + begin, end - begin)
        except (KeyError, TypeError, ValueError):
          raise HFError(f"{path}: tensor {name} has a malformed header entry") from None
        self.entries[name] = entry
    if weight_map is not None:
      for name, file in weight_map.items():
        if name not in self.entries or self.entries[name].file.name != file:
          raise HFError(f"{index}: tensor {name} not found in {file}")

  def model_fields(self) -> dict:
    """ModelConfig keyword arguments from config.json (see the module-level `model_fields`)."""
    return model_fields(self.config, str(self.dir / "config.json"))

  def check(self, cfg: ModelConfig, layouts: dict[str, Layout]):
    """Raises HFError unless the tensors are exactly what `cfg` needs, before anything is read.

    Every expected tensor must be present with its shape and a float dtype; nothing else may be
    left over, except lm_head.weight of a tied model and rotary inv_freq buffers (derived, not
    weights).
    """
    expected = {t.name: t for g in group_names(cfg) for t in tensors(layouts, g)}
    for name, t in expected.items():
      e = self.entries.get(name)
      if e is None:
        raise HFError(f"{self.dir}: tensor {name} missing")
      where = f"{e.file}: tensor {name}"
      if e.shape != t.shape:
        raise HFError(f"{where} has shape {list(e.shape)}, expected {list(t.shape)}")
      if e.dtype not in _DTYPES:
        raise HFError(f"{where} has dtype {e.dtype}, expected one of {', '.join(_DTYPES)}")
      if e.nbytes != int(np.prod(e.shape)) * _DTYPES[e.dtype][1]:
        raise HFError(f"{where} spans {e.nbytes} bytes, which does not fit its shape and dtype")
      if e.start + e.nbytes > e.file.stat().st_size:
        raise HFError(f"{where} extends past the end of the file (truncated?)")
    for name, e in self.entries.items():
      if name in expected or name.endswith(".rotary_emb.inv_freq"):
        continue
      if name == "lm_head.weight" and cfg.tie_embeddings:
        continue
      raise HFError(f"{e.file}: tensor {name} unexpected for this config")

  def read_group(self, cfg: ModelConfig, layouts: dict[str, Layout], name: str, out: np.ndarray):
    """Fills one group's flat fp32 vector from the checkpoint, one tensor at a time, in place.

    Args:
      cfg: the model config (from `model_fields`); call `check` first.
      layouts: `mtjax.state.layouts(cfg)`.
      name: "embed", "block_<i>" or "head".
      out: the group's flat fp32 vector, written in place.
    """
    kind = name if name in ("embed", "head") else "block"
    if out.shape != (layouts[kind].size,) or out.dtype != np.float32:
      raise HFError(f"{name}: buffer {out.shape} {out.dtype}, expected "
                    f"({layouts[kind].size},) float32")
    for t in tensors(layouts, name):
      e = self.entries.get(t.name)
      if e is None or e.shape != t.shape:
        raise HFError(f"{self.dir}: tensor {t.name} missing or misshapen (run check first)")
      np_dtype, _ = _DTYPES[e.dtype]
      src = np.memmap(e.file, dtype=np_dtype, mode="r", offset=e.start, shape=e.shape or (1,))
      n = int(np.prod(t.shape))
      dst = out[t.offset:t.offset + n]
      # Rows of the Hugging Face tensor a few million elements at a time, so the widened (and, for
      # a Linear weight, transposed) temporary stays small however large the tensor.
      rows = e.shape[0] if len(e.shape) > 1 else 1
      src2 = src.reshape(rows, -1)
      dst2 = dst.reshape(t.shape[::-1]) if t.transpose else dst.reshape(rows, -1)
      step = max(1, CHUNK // max(1, src2.shape[1]))
      for r in range(0, rows, step):
        part = _widen(src2[r:r + step])
        if t.transpose:
          dst2[:, r:r + step] = part.T
        else:
          dst2[r:r + step] = part
        del part  # before the next chunk is widened, or two temporaries coexist


def _widen(part: np.ndarray) -> np.ndarray:
  if part.dtype == np.uint16:  # bf16 is the top half of an fp32
    wide = part.astype(np.uint32)
    wide <<= 16  # in place: one temporary, not two
    return wide.view(np.float32)
  return part.astype(np.float32, copy=False)


# ----------------------------------------------------------------------------- export


def bf16_bits(x: np.ndarray) -> np.ndarray:
  """fp32 -> bf16 bit patterns (uint16), rounding to nearest even as torch does; NaN stays NaN."""
  bits = np.ascontiguousarray(x, np.float32).view(np.uint32)
  rounded = (bits + (np.uint32(0x7FFF) + ((bits >> 16) & 1))) >> 16
  nan = (bits & 0x7FFFFFFF) > 0x7F800000
  return np.where(nan, (bits >> 16) | 0x0040, rounded).astype(np.uint16)


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


def export(out_dir: str | os.PathLike, cfg: ModelConfig, layouts: dict[str, Layout],
           groups: Iterable[tuple[str, np.ndarray]], dtype: str = "bfloat16",
           source_dir: str | os.PathLike | None = None, max_shard_bytes: int = MAX_SHARD_BYTES
           ) -> Path:
  """Writes a Hugging Face model directory from flat fp32 groups, streamed one group at a time.

  Args:
    out_dir: the directory to create; it must not exist or be empty. It appears complete or not
      at all (written under a temporary name beside it, then renamed).
    cfg: the model config.
    layouts: `mtjax.state.layouts(cfg)`.
    groups: (group name, flat fp32 vector) in the order embed, block_0 .. block_{L-1}, head;
      consumed one at a time.
    dtype: "bfloat16" (rounded to nearest even), "float16" or "float32".
    source_dir: a Hugging Face directory whose config.json (dtype updated) and tokenizer files are
      kept; None writes a Llama, Qwen2 or Qwen3 config.json from `cfg`.
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
  config = _export_config(cfg, dtype, source_dir)
  tmp = out_dir.parent / f".{out_dir.name}.tmp-{uuid.uuid4().hex[:8]}"
  tmp.mkdir(parents=True)
  try:
    shards, weight_map, total = _write_shards(tmp, cfg, layouts, groups, st_dtype,
                                              max_shard_bytes)
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
  """Copies a Hugging Face directory's config.json (unless `config` is False) and tokenizer files
  that exist into `dest` (created)."""
  dest = Path(dest)
  dest.mkdir(parents=True, exist_ok=True)
  for f in (("config.json",) if config else ()) + TOKENIZER_FILES:
    if (Path(source_dir) / f).is_file():
      shutil.copy2(Path(source_dir) / f, dest / f)


def _export_config(cfg: ModelConfig, dtype: str, source_dir) -> dict:
  src = Path(source_dir) / "config.json" if source_dir is not None else None
  if src is None or not src.is_file():
    return hf_config(cfg, dtype)
  try:
    config = json.loads(src.read_text())
  except (OSError, json.JSONDecodeError) as e:
    raise HFError(f"{src}: unreadable ({type(e).__name__})") from None
  # The source's config is kept verbatim, so it must describe the weights being written.
  fields = model_fields(config, str(src))
  for key, value in fields.items():
    if getattr(cfg, key) != value:
      raise HFError(f"{src}: gives model.{key}={value!r}, the weights have {getattr(cfg, key)!r}")
  keys = [k for k in ("dtype", "torch_dtype") if k in config] or ["torch_dtype"]
  config.update({k: dtype for k in keys})
  return config


def _write_shards(tmp: Path, cfg: ModelConfig, layouts: dict[str, Layout],
                  groups: Iterable[tuple[str, np.ndarray]], st_dtype: str, max_shard_bytes: int):
  expected = group_names(cfg)
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
    kind = name if name in ("embed", "head") else "block"
    if np.shape(flat) != (layouts[kind].size,):
      raise HFError(f"export: group {name} has shape {np.shape(flat)}, expected "
                    f"({layouts[kind].size},)")
    seen += 1
    for tname, arr in hf_tensors(layouts, name, np.asarray(flat, np.float32)):
      if st_dtype == "BF16":
        arr = bf16_bits(arr)
      else:  # a copy even when no conversion is needed: the caller may reuse `flat` next group
        if st_dtype == "F16":
          top = float(np.max(np.abs(arr), initial=0.0, where=np.isfinite(arr)))
          if top > np.finfo(np.float16).max:
            raise HFError(f"export: {tname} holds {top:.4g}, beyond float16's range (65504); "
                          f"export as bfloat16 or float32")
        arr = np.array(arr, np.float16 if st_dtype == "F16" else np.float32, order="C")
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
  ck.check(store.model_cfg, store.layouts)
  for i, g in enumerate(store.groups):
    if store.owns(i):  # with several processes, each reads the groups it holds
      store.fill(i, lambda out, name=g.name: ck.read_group(store.model_cfg, store.layouts, name, out))


def export_store(store, out_dir: str | os.PathLike, dtype: str = "bfloat16",
                 source_dir: str | os.PathLike | None = None) -> Path:
  """Writes a `LayerStore`'s weights (call `sync()` first) as a Hugging Face directory, one group
  in host memory at a time."""
  groups = ((g.name, store.read(i)["w"]) for i, g in enumerate(store.groups))
  return export(out_dir, store.model_cfg, store.layouts, groups, dtype, source_dir)
