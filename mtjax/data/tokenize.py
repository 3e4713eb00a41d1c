"""`prepare`: documents from text, JSONL, JSON, CSV, Parquet, Arrow or `datasets` sources, in any
of the formats of mtjax.data.formats, tokenized with the model's own tokenizer (chat through its
chat template) into a prepared directory read by mtjax.data.sources:

  {split}.bin / .idx / .mask      tokens, uint64 document starts plus the end, uint8 loss mask
                                  (chat: 1 on the tokens the loss counts)
  {split}.chosen.* / .rejected.*  preference data instead: the same three files for each side
  {split}.prefix                  ... and uint64 per pair: the length of the prompt both share
  meta.json                       dtype, vocab, ids, splits, a crc32c of every file, the stats
  stats.json                      per source: rows, documents and tokens per split, skipped rows
                                  by reason with the first one, truncated documents

The directory is written beside --out under a temporary name, checked, and renamed into place:
a prepare that is killed leaves --out as it was (or, between two renames, absent) and a re-run
starts over.
"""

from __future__ import annotations

import array
import collections
import dataclasses
import hashlib
import json
import math
import multiprocessing
import os
import shutil
from pathlib import Path

import numpy as np

from mtjax.data import chat, formats, readers
from mtjax.data.formats import FORMATS, Mapping, Pair
from mtjax.data.readers import BadFile, BadRow
from mtjax.data.sources import SPLITS, checksum, read_pairs, Prepared

_CHUNK = 1024  # documents per encode_batch call / per task of the worker pool
OVERFLOW = ("truncate", "drop")


@dataclasses.dataclass
class Options:
  """How documents become training examples (prepare's keyword arguments, the CLI's options)."""
  train_on_prompt: bool = False  # the loss counts every token of a conversation, not the answers
  last_turn_only: bool = False  # the loss counts the last assistant turn only
  max_len: int | None = None  # longest document in tokens; longer ones are cut or dropped
  overflow: str = "truncate"  # truncate | drop a document longer than max_len


class Stats:
  """Counts of one source: documents and tokens per split, skipped rows by reason, truncations."""

  def __init__(self, name: str):
    self.name, self.rows, self.format = name, 0, None
    self.documents = {s: 0 for s in SPLITS}
    self.tokens = {s: 0 for s in SPLITS}
    self.skipped: dict = {}
    self.truncated = 0

  def skip(self, reason: str, message: str, strict: bool, n: int = 1):
    if strict:
      raise ValueError(message)
    entry = self.skipped.setdefault(reason, {"count": 0, "first": message})
    entry["count"] += n

  def as_dict(self) -> dict:
    return {"input": self.name, "format": self.format, "rows": self.rows,
            "documents": self.documents, "tokens": self.tokens, "skipped": self.skipped,
            "truncated": self.truncated}


# ---- tokenizing, in worker processes when --workers > 1 ----------------------------------------

_WORKER: dict = {}


def _init_worker(tokenizer_path: str, eos_id: int, with_template: bool, last_turn_only: bool):
  from tokenizers import Tokenizer

  template = chat.ChatTemplate.from_tokenizer(tokenizer_path) if with_template else None
  _WORKER.update(tok=Tokenizer.from_file(tokenizer_path), eos=eos_id, template=template,
                 last=last_turn_only)


def _end_with_eos(tok, eos: int, ids: np.ndarray, mask: np.ndarray):
  """A conversation ends with EOS: the template usually ends it with the end-of-turn token, often
  followed by a newline (ChatML); EOS is appended, never as a target, only when it does not already
  end with it (or with it and trailing whitespace)."""
  tail = ids
  while len(tail) and tok.id_to_token(int(tail[-1])) is not None and not tok.decode(
      [int(tail[-1])], skip_special_tokens=False).strip():
    tail = tail[:-1]
  if len(tail) == 0 or tail[-1] != eos:
    ids, mask = np.append(ids, eos), np.append(mask, np.uint8(0))
  return ids, mask


def _encode_conversation(msgs: list, last: bool):
  tok, eos, template = _WORKER["tok"], _WORKER["eos"], _WORKER["template"]
  ids, mask = chat.encode_chat(tok, template, msgs, last_turn_only=last)
  return _end_with_eos(tok, eos, ids, mask)


def _encode_chunk(chunk: list[tuple[str, object]]) -> list[tuple]:
  """Each document of the chunk as ("doc", ids, mask or None), ("pair", chosen ids, mask,
  rejected ids, mask, prefix) or ("bad", reason, message)."""
  tok, eos = _WORKER["tok"], _WORKER["eos"]
  out: list = [None] * len(chunk)
  texts = [(k, d) for k, (_, d) in enumerate(chunk) if isinstance(d, str)]
  # A text is encoded as in pre-training: the post-processor adds what the model saw around each
  # one (a Llama BOS). EOS separates documents, once, also where the post-processor adds it.
  for (k, _), enc in zip(texts, tok.encode_batch([d for _, d in texts], add_special_tokens=True)):
    ids = enc.ids if enc.ids and enc.ids[-1] == eos else enc.ids + [eos]
    out[k] = ("doc", np.asarray(ids, np.int64), None)
  for k, (where, doc) in enumerate(chunk):
    if isinstance(doc, str):
      continue
    try:
      if isinstance(doc, Pair):
        sides = [_encode_conversation(doc.prompt + [{"role": "assistant", "content": a}], True)
                 for a in (doc.chosen, doc.rejected)]
        (c, cm), (r, rm) = sides
        prefix = int(np.argmax(cm))
        if int(np.argmax(rm)) != prefix or not np.array_equal(c[:prefix], r[:prefix]):
          out[k] = ("bad", "prompt differs", f"{where}: the prompt renders differently before "
                    "the chosen and the rejected answer")
          continue
        out[k] = ("pair", c, cm, r, rm, prefix)
      else:
        out[k] = ("doc", *_encode_conversation(doc, _WORKER["last"]))
    except ValueError as e:  # the template fails on this conversation, or marks nothing
      out[k] = ("bad", "template error", f"{where}: {e}")
  return out


def _encoded(chunks, workers: int, init_args: tuple):
  """Yields (chunk, _encode_chunk(chunk)) in order, on a pool of `workers` processes when > 1."""
  if workers <= 1:
    _init_worker(*init_args)
    for c in chunks:
      yield c, _encode_chunk([(w, d) for w, d, *_ in c])
    return
  # spawn, not fork: the tokenizers library's Rust thread pool does not survive a fork.
  with multiprocessing.get_context("spawn").Pool(workers, _init_worker, init_args) as pool:
    pending = collections.deque()
    for c in chunks:  # rows are read and converted here, so a bad row is counted in this process
      pending.append((c, pool.apply_async(_encode_chunk, ([(w, d) for w, d, *_ in c],))))
      if len(pending) >= 2 * workers:
        c, r = pending.popleft()
        yield c, r.get()
    while pending:
      c, r = pending.popleft()
      yield c, r.get()


def _chunks(items, size: int):
  chunk = []
  for d in items:
    chunk.append(d)
    if len(chunk) == size:
      yield chunk
      chunk = []
  if chunk:
    yield chunk


# ---- writing ---------------------------------------------------------------------------------

class _Docs:
  """Appends documents to DIR/NAME.bin, .idx (written at close) and .mask."""

  def __init__(self, directory: Path, name: str, dtype: np.dtype, has_mask: bool):
    self.paths = {"bin": directory / f"{name}.bin", "idx": directory / f"{name}.idx"}
    if has_mask:
      self.paths["mask"] = directory / f"{name}.mask"
    self.dtype = dtype
    self.starts = array.array("q", [0])
    self.files = {}
    for ext in ("bin", "mask"):
      if ext in self.paths:
        self.files[ext] = open(self.paths[ext], "wb")

  def add(self, ids: np.ndarray, mask: np.ndarray | None):
    # write(), not ndarray.tofile: tofile loses a failed write of a small array (a full disk)
    self.files["bin"].write(ids.astype(self.dtype).tobytes())
    if "mask" in self.files:
      self.files["mask"].write((np.ones(len(ids), np.uint8) if mask is None
                                else mask.astype(np.uint8)).tobytes())
    self.starts.append(self.starts[-1] + len(ids))

  def close(self):
    for fh in self.files.values():
      fh.close()  # flushes: where a full disk shows
    self.paths["idx"].write_bytes(np.frombuffer(self.starts, np.int64).astype(np.uint64).tobytes())


class _Split:
  """One split being written: its document files (one set, or chosen and rejected), each
  document's repeat count and source, and for pairs the prompt length."""

  def __init__(self, directory: Path, name: str, dtype: np.dtype, has_mask: bool, pairs: bool):
    sides = ("chosen", "rejected") if pairs else ("",)
    self.sides = {s: _Docs(directory, f"{name}.{s}" if s else name, dtype, has_mask)
                  for s in sides}
    self.repeats, self.sources, self.prefix = (array.array("q"), array.array("q"),
                                               array.array("q"))

  def add(self, pieces: list, repeats: int, source: int, prefix: int | None):
    for docs, (ids, mask) in zip(self.sides.values(), pieces):
      docs.add(ids, mask)
    self.repeats.append(repeats)
    self.sources.append(source)
    if prefix is not None:
      self.prefix.append(prefix)

  def close(self):
    for d in self.sides.values():
      d.close()


def _shuffled(directory: Path, raw: _Split, name: str, order: np.ndarray, pairs: bool):
  """Writes the documents of `raw` in `order` (indices, repeats included) as split `name`."""
  for side, docs in raw.sides.items():
    stem = f"{name}.{side}" if side else name
    starts = np.frombuffer(docs.starts, np.int64)
    lengths = np.diff(starts)
    src = {ext: np.memmap(p, dtype=docs.dtype if ext == "bin" else np.uint8, mode="r")
           for ext, p in docs.paths.items() if ext != "idx" and p.stat().st_size}
    for ext in ("bin", "mask"):
      if ext not in docs.paths:
        continue
      with open(directory / f"{stem}.{ext}", "wb") as f:
        for lo in range(0, len(order), 4096):  # a few thousand documents per write
          part = order[lo:lo + 4096]
          if len(part) and ext in src:
            f.write(np.concatenate([src[ext][starts[d]:starts[d + 1]] for d in part]).tobytes())
    new_starts = np.concatenate([[0], np.cumsum(lengths[order])]).astype(np.uint64)
    (directory / f"{stem}.idx").write_bytes(new_starts.tobytes())
    del src
    for p in docs.paths.values():
      p.unlink()
  if pairs:
    prefix = np.frombuffer(raw.prefix, np.int64)[order].astype(np.uint64)
    (directory / f"{name}.prefix").write_bytes(prefix.tobytes())


# ---- planning: rows, held-out rows, mixture repeats --------------------------------------------

@dataclasses.dataclass
class _Source:
  name: str
  files: list  # [(path, rows)]
  fmt: str
  stats: Stats
  is_val: np.ndarray | None = None
  repeats: np.ndarray | None = None

  @property
  def rows(self) -> int:
    return sum(n for _, n in self.files)


def _whole_text(path: Path, fmt: str) -> bool:
  """A file that is one document: a text file read in the text format."""
  return fmt == "text" and readers.kind(path) == "text"


def _first_row(files: list[Path]) -> dict | None:
  for f in files:
    try:
      for _, row in readers.rows(f):
        if isinstance(row, dict):
          return row
    except BadFile:
      continue
  return None


def _plan(sources: list[_Source], val_fraction: float, seed: int, weights, epochs):
  """Chooses each source's held-out rows (an exact share, by seed) and the number of times each
  training row is taken: once, or as the weights or epochs of a mixture say."""
  for i, s in enumerate(sources):
    n = s.rows
    if val_fraction > 0 and n < 2:
      raise ValueError(f"--val-fraction: {s.name} holds {n} document, which cannot be split; pass "
                       "--val-fraction 0")
    n_val = 0 if val_fraction == 0 else min(n - 1, max(1, round(val_fraction * n)))
    s.is_val = np.zeros(n, bool)
    s.is_val[np.random.default_rng([seed, i]).choice(n, n_val, replace=False)] = True
  n_train = [int((~s.is_val).sum()) for s in sources]
  if weights is not None:
    total = sum(n_train)
    targets = [round(w / sum(weights) * total) for w in weights]
  elif epochs is not None:
    targets = [round(e * n) for e, n in zip(epochs, n_train)]
  else:
    targets = n_train
  for i, (s, n, t) in enumerate(zip(sources, n_train, targets)):
    train = np.flatnonzero(~s.is_val)
    s.repeats = np.zeros(s.rows, np.int64)
    if n == 0:
      continue
    whole, extra = divmod(t, n)
    s.repeats[train] = whole
    s.repeats[np.random.default_rng([seed, i, 1]).choice(train, extra, replace=False)] += 1


def _rows(sources: list[_Source], mapping: Mapping, strict: bool):
  """Yields (where, document, split, repeats, source) for every used row of every source; bad rows
  and unreadable files are counted in the stats (or raised with `strict`)."""
  for i, s in enumerate(sources):
    base = 0
    for f, n in s.files:
      j = base
      try:
        if _whole_text(f, s.fmt):
          items = iter([(str(f), readers.read_text(f))])
        else:
          items = readers.rows(f)
        for where, row in items:
          k, j = j, j + 1
          if k >= base + n:
            raise ValueError(f"{f}: holds more rows than when it was counted (changed while "
                             "prepare read it)")
          split = "val" if s.is_val[k] else "train"
          if split == "train" and s.repeats[k] == 0:
            continue  # not drawn into the mixture
          try:
            if isinstance(row, BadRow):
              raise row
            doc = row if isinstance(row, str) else formats.document(row, s.fmt, mapping, where)
          except BadRow as e:
            s.stats.skip(e.reason, str(e), strict)
            continue
          yield where, doc, split, int(s.repeats[k]), i
      except BadFile as e:  # past the rows already read: the rest of the file is skipped
        s.stats.skip("unreadable file", str(e), strict, n=max(0, base + n - j))
      base += n


# ---- the command -----------------------------------------------------------------------------

def _check_out(out: Path) -> None:
  """Refuses an --out that is a file, lies under one, or is a folder of other files."""
  if out.exists() and not out.is_dir():
    raise ValueError(f"--out: {out} is a file, not a directory")
  if out.is_dir() and any(out.iterdir()) and not (out / "meta.json").is_file():
    raise ValueError(f"--out: {out} holds files but no meta.json: not a prepared directory to "
                     "replace; pass an empty or new folder")
  for parent in out.parents:
    if parent.exists():
      if not parent.is_dir():
        raise ValueError(f"--out: {out} lies under {parent}, a file, not a directory")
      return


# Tokens per input byte: a byte-level BPE makes at most one token per byte of text, and a row's
# markup (JSON keys and quotes, CSV commas, Parquet's page headers) outweighs the tokens the chat
# template adds (tests/test_formats.py: every format's output within 0.66 of the estimate).
TOKENS_PER_INPUT_BYTE = 1.0


def input_bytes(path: Path) -> int:
  """A source's bytes as text: a Parquet file's uncompressed size (its metadata), a datasets
  folder's files, any other file's size."""
  if path.is_dir():
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
  if readers.kind(path) == "parquet":
    try:
      import pyarrow.parquet as pq  # noqa: PLC0415
      meta = pq.ParquetFile(path).metadata
      return max(path.stat().st_size,
                 sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups)))
    except Exception:  # noqa: BLE001 - an unreadable file is counted (and refused) elsewhere
      pass
  return path.stat().st_size


def output_estimate(sources: list[_Source], dtype: np.dtype, has_mask: bool, pairs: bool) -> int:
  """Bytes the prepared files may take, from the inputs': each source's text bytes times the
  times its rows are used (a mixture's repeats), TOKENS_PER_INPUT_BYTE tokens a byte, each token's
  id and mask byte (both sides of a preference pair hold the prompt); plus 1 MiB of index files."""
  total = 0.0
  for src in sources:
    used = (int(src.repeats.sum()) + int(src.is_val.sum())) / max(src.rows, 1)
    total += sum(input_bytes(f) for f, _ in src.files) * max(used, 1.0)
  per_token = dtype.itemsize + (1 if has_mask else 0)
  return int(total * TOKENS_PER_INPUT_BYTE * per_token * (2 if pairs else 1)) + 2**20


def _gib(n: float) -> str:
  return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def check_disk(out: Path, needed: int) -> None:
  """Refuses (ValueError, one line with both numbers) an --out whose file system has less free
  space than `needed` bytes."""
  where = next(p for p in (out, *out.parents) if p.exists())
  free = shutil.disk_usage(where).free
  if free < needed:
    raise ValueError(f"--out: {where} has {_gib(free)} free, the prepared data may take "
                     f"{_gib(needed)} (estimated from the inputs); free space, use another folder "
                     f"or pass --allow-low-disk to accept the risk")


def _numbers(values, option: str, n_inputs: int) -> list[float] | None:
  if values is None:
    return None
  values = [float(v) for v in values]
  if len(values) != n_inputs:
    raise ValueError(f"{option}: {len(values)} values for {n_inputs} inputs")
  bad = [v for v in values if not (math.isfinite(v) and v > 0)]
  if bad:
    raise ValueError(f"{option}: {bad[0]:g} is not a positive number")
  return values


def _fit(ids: np.ndarray, mask, opts: Options, stats: Stats, where: str, strict: bool):
  """ids and mask cut to opts.max_len (or None when dropped: counted as skipped)."""
  if opts.max_len is None or len(ids) <= opts.max_len:
    return ids, mask
  if opts.overflow == "drop":
    stats.skip("longer than --max-len", f"{where}: {len(ids)} tokens > --max-len {opts.max_len}",
               strict)
    return None
  return ids[:opts.max_len], (None if mask is None else mask[:opts.max_len])


def prepare(tokenizer: str | Path, out: str | Path, inputs: list[str], fmt: str = "text",
            text_field: str = "text", val_fraction: float = 0.01, workers: int = 1, seed: int = 0,
            eos: str | None = None, progress: bool = True, *, columns: dict | None = None,
            roles: dict | None = None, weights: list[float] | None = None,
            epochs: list[float] | None = None, options: Options | None = None,
            strict: bool = False, log=None, allow_low_disk: bool = False) -> dict:
  """Tokenizes documents into a prepared directory (see the module docstring for its files).

  Args:
    tokenizer: a directory holding tokenizer.json (and tokenizer_config.json), or tokenizer.json.
    out: the directory to write (replaced whole, atomically, when it holds an earlier prepare).
    inputs: sources, each a file, a folder of files (recursive, sorted) or a datasets folder; each
      is one source of a mixture.
    fmt: one of formats.FORMATS; auto picks each source's format from its first row.
    text_field: the column holding the text (the text format), as --columns text=COLUMN.
    val_fraction: share of each source's rows held out, chosen by `seed`.
    workers: processes tokenizing in parallel (encode_batch is multi-threaded already).
    seed: seeds the held-out choice, the rows a mixture draws and its order.
    eos: EOS token appended to each document; None: tokenizer_config.json's eos_token.
    progress: show a tqdm bar.
    columns: field -> column renames (formats.FIELDS).
    roles: role in the data -> role of the chat template (user, assistant, system, tool).
    weights: each source's share of the training documents (the mixture has as many as the
      sources' training rows together); exclusive with epochs.
    epochs: times each source's training rows are taken (fractions draw a seeded subset).
    options: train_on_prompt, last_turn_only, max_len and overflow.
    strict: a bad row or file is an error instead of being counted and skipped.
    log: called with each line of news (the auto-detected formats); None: quiet.
    allow_low_disk: start even when the free space of --out's file system is below the estimate
      of the output (`output_estimate`).

  Returns:
    The meta.json contents; "stats" holds the per-source counts of stats.json.

  Raises:
    ValueError: a bad argument or input, or --out cannot be written (one line naming it).
  """
  from tokenizers import Tokenizer
  from tqdm import tqdm

  opts = options or Options()
  log = log or (lambda line: None)
  if fmt not in FORMATS:
    raise ValueError(f"--format: {fmt!r} is not one of {', '.join(FORMATS)}")
  if not 0 <= val_fraction < 1:
    raise ValueError(f"--val-fraction: {val_fraction} must be in [0, 1)")
  if workers < 1:
    raise ValueError(f"--workers: {workers} must be >= 1")
  if opts.max_len is not None and opts.max_len < 2:
    raise ValueError(f"--max-len: {opts.max_len} must be >= 2")
  if opts.overflow not in OVERFLOW:
    raise ValueError(f"--overflow: {opts.overflow!r} is not one of {', '.join(OVERFLOW)}")
  if weights is not None and epochs is not None:
    raise ValueError("--weights and --epochs: pass one of them")
  weights = _numbers(weights, "--weights", len(inputs))
  epochs = _numbers(epochs, "--epochs", len(inputs))
  columns = dict(columns or {})
  unknown = sorted(set(columns) - set(formats.FIELDS))
  if unknown:
    raise ValueError(f"--columns: unknown field {unknown[0]!r} (fields: "
                     f"{', '.join(formats.FIELDS)})")
  if text_field != "text":
    columns.setdefault("text", text_field)
  mapping = Mapping(columns, dict(roles or {}))
  out = Path(out)
  _check_out(out)
  tok_file, _ = chat.tokenizer_files(tokenizer)
  tok_cfg = chat.load_tokenizer_config(tokenizer)
  try:
    tok = Tokenizer.from_file(str(tok_file))
  except Exception as e:  # the Rust side raises a plain Exception on a malformed file
    raise ValueError(f"--tokenizer: {tok_file} is not a tokenizers JSON file ({e})") from None
  eos = eos or chat.token_text(tok_cfg.get("eos_token"))
  if eos is None:
    raise ValueError(f"--eos: {tok_file.parent} has no tokenizer_config.json eos_token; pass --eos")
  eos_id = tok.token_to_id(eos)
  if eos_id is None:
    raise ValueError(f"--eos: {eos!r} is not a token of {tok_file}")
  pad = chat.token_text(tok_cfg.get("pad_token"))
  pad_id = tok.token_to_id(pad) if pad is not None and tok.token_to_id(pad) is not None else eos_id
  vocab = tok.get_vocab_size(with_added_tokens=True)
  dtype = np.dtype(np.uint16 if vocab <= 65536 else np.uint32)

  if fmt not in ("text", "jsonl", "auto"):  # no template, or a broken one: an error before reading
    chat.ChatTemplate.from_tokenizer(tok_file)

  # Every source's rows are counted first (Parquet and Arrow from their metadata): the held-out
  # share is exact, and the mixture's draws are fixed before anything is tokenized.
  sources = []
  for name in inputs:
    stats = Stats(name)
    paths = readers.input_files(name)
    src_fmt = fmt
    if fmt == "auto":
      if all(readers.kind(f) == "text" for f in paths):
        src_fmt = "text"
      else:
        row = _first_row(paths)
        if row is None:
          raise ValueError(f"--format auto: {name} holds no readable row to tell its format by")
        src_fmt = formats.detect(row, mapping)
      log(f"{name}: format {src_fmt} (auto)")
    files = []
    for f in paths:
      try:
        files.append((f, readers.count(f, whole=_whole_text(f, src_fmt))))
      except BadFile as e:
        stats.skip("unreadable file", str(e), strict)
    stats.format = src_fmt
    stats.rows = sum(n for _, n in files)
    sources.append(_Source(name, files, src_fmt, stats))
  n_rows = sum(s.rows for s in sources)
  if n_rows == 0:
    skipped = any(s.stats.skipped for s in sources)
    raise ValueError(f"{inputs}: no documents"
                     + (f" ({_skip_summary(sources)})" if skipped else ""))
  pairs = {s.fmt == "preference" for s in sources}
  if len(pairs) > 1:
    raise ValueError("--format: preference sources cannot be mixed with others in one prepare")
  pairs = pairs.pop()
  if pairs and opts.train_on_prompt:
    raise ValueError("--train-on-prompt: preference pairs count their answers only")
  has_mask = any(s.fmt not in ("text", "jsonl") for s in sources)
  mask_method = None
  if has_mask:  # no template, or a broken one, is an error now, not in a worker
    mask_method = chat.ChatTemplate.from_tokenizer(tok_file).mask_method
  _plan(sources, val_fraction, seed, weights, epochs)
  mixture = len(sources) > 1 or weights is not None or epochs is not None
  if not allow_low_disk:
    check_disk(out, output_estimate(sources, dtype, has_mask, pairs))

  meta = {
      "format": fmt if fmt != "auto" else sorted({s.fmt for s in sources})[0]
      if len(sources) == 1 else "mixture",
      "formats": [s.fmt for s in sources], "pairs": pairs,
      "dtype": dtype.name, "vocab_size": vocab, "eos_id": eos_id, "pad_id": pad_id,
      "has_mask": has_mask, "seed": seed, "val_fraction": val_fraction,
      "tokenizer": str(tok_file),
      "tokenizer_sha256": hashlib.sha256(tok_file.read_bytes()).hexdigest(),
      "inputs": list(inputs), "columns": mapping.columns, "roles": mapping.roles,
      "weights": weights, "epochs": epochs, "shuffled": mixture, **dataclasses.asdict(opts),
  }
  if mask_method:
    meta["mask_method"] = mask_method

  tmp = out.parent / f".{out.name}.prepare-tmp"
  old = out.parent / f".{out.name}.prepare-old"
  try:
    shutil.rmtree(tmp, ignore_errors=True)  # what a killed run left: a re-run starts over
    shutil.rmtree(old, ignore_errors=True)
    tmp.mkdir(parents=True)
    splits = {s: _Split(tmp, f"{s}.raw" if s == "train" and mixture else s, dtype, has_mask, pairs)
              for s in SPLITS}
    bar = tqdm(total=n_rows, unit="doc", disable=not progress, desc="tokenizing")
    init = (str(tok_file), eos_id, has_mask, opts.last_turn_only)
    try:
      chunks = _chunks(_rows(sources, mapping, strict), _CHUNK)
      for chunk, encoded in _encoded(chunks, workers, init):
        for (where, _, split, repeats, i), result in zip(chunk, encoded):
          stats = sources[i].stats
          if result[0] == "bad":
            stats.skip(result[1], result[2], strict)
            continue
          sides = [result[1:3]] if result[0] == "doc" else [result[1:3], result[3:5]]
          if opts.train_on_prompt and has_mask:
            sides = [(ids, np.ones(len(ids), np.uint8)) for ids, _ in sides]
          fitted = [_fit(ids, m, opts, stats, where, strict) for ids, m in sides]
          if any(f is None for f in fitted):
            continue
          if any(len(f[0]) < len(s[0]) for f, s in zip(fitted, sides)):
            stats.truncated += 1
          if has_mask and not all(m is None or m[1:].any() for _, m in fitted):
            stats.skip("no target within --max-len", f"{where}: no token the loss counts "
                       f"within --max-len {opts.max_len}", strict)
            continue
          splits[split].add(fitted, repeats if split == "train" else 1, i,
                            result[5] if pairs else None)
          stats.documents[split] += repeats if split == "train" else 1
          stats.tokens[split] += len(fitted[0][0]) * (repeats if split == "train" else 1)
        bar.update(len(chunk))
    finally:
      bar.close()
      for s in splits.values():
        s.close()
    if mixture:  # the training documents with their repeats, in one seeded shuffle
      raw = splits["train"]
      order = np.repeat(np.arange(len(raw.repeats)), np.frombuffer(raw.repeats, np.int64))
      order = order[np.random.default_rng([seed, 2]).permutation(len(order))]
      _shuffled(tmp, raw, "train", order, pairs)
    elif pairs:
      for name, s in splits.items():
        (tmp / f"{name}.prefix").write_bytes(np.frombuffer(s.prefix, np.int64)
                                             .astype(np.uint64).tobytes())
    counts = {s: {"documents": sum(x.stats.documents[s] for x in sources),
                  "tokens": sum(x.stats.tokens[s] for x in sources)} for s in SPLITS}
    if pairs:  # each side's token count, which read_pairs checks the files against
      for name in SPLITS:
        counts[name]["sides"] = {side: (tmp / f"{name}.{side}.bin").stat().st_size
                                 // dtype.itemsize for side in ("chosen", "rejected")}
    if counts["train"]["documents"] == 0:
      raise ValueError(f"{inputs}: no training documents left ({_skip_summary(sources)})")
    meta["splits"] = counts
    meta["stats"] = [s.stats.as_dict() for s in sources]
    meta["checksums"] = {p.name: checksum(p) for p in sorted(tmp.iterdir())}
    (tmp / "stats.json").write_text(json.dumps(meta["stats"], indent=1) + "\n")
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    _verify(tmp, meta)
    if out.exists():
      os.rename(out, old)
    os.rename(tmp, out)
    shutil.rmtree(old, ignore_errors=True)
  except OSError as e:  # a full disk, a read-only or vanished folder: one line, not a traceback
    raise ValueError(f"--out: cannot write {e.filename or out} ({e.strerror or e})") from None
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  return meta


def _verify(directory: Path, meta: dict):
  """Opens every split written as training will: sizes, document starts, ids and checksums."""
  for split in SPLITS:
    if meta["splits"][split]["documents"] == 0:
      continue
    if meta["pairs"]:
      read_pairs(directory, split)
    else:
      Prepared(directory, split, meta["vocab_size"])


def _skip_summary(sources: list[_Source]) -> str:
  parts = [f"{e['count']} {reason}, first: {e['first']}" for s in sources
           for reason, e in s.stats.skipped.items()]
  return "skipped: " + "; ".join(parts) if parts else "every row was held out or dropped"


def summary(meta: dict) -> list[str]:
  """Lines telling what a prepare wrote: per source documents, tokens, skipped and truncated."""
  lines = []
  for s in meta["stats"]:
    d, t = s["documents"], s["tokens"]
    lines.append(f"{s['input']} ({s['format']}): {s['rows']} rows -> train {d['train']} documents "
                 f"/ {t['train']} tokens, val {d['val']} / {t['val']}"
                 + (f", {s['truncated']} truncated" if s["truncated"] else ""))
    for reason, e in s["skipped"].items():
      lines.append(f"  skipped {e['count']} ({reason}); first: {e['first']}")
  return lines
