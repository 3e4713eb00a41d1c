"""Token batches, each a pure function of step: a learnable synthetic stream, a flat token file, and
prepared documents (`python -m mtjax.data prepare`), packed with document masks or padded."""

from __future__ import annotations

import argparse
import collections
import dataclasses
import hashlib
import json
import multiprocessing
import sys
from pathlib import Path
from typing import Iterator

import numpy as np

from mtjax.config import DataConfig


@dataclasses.dataclass(frozen=True)
class Batch:
  inputs: np.ndarray  # [B, T] int32
  targets: np.ndarray  # [B, T] int32, inputs shifted left by one within a document
  positions: np.ndarray | None = None  # [B, T] int32 RoPE positions, 0 at each document's start
  segments: np.ndarray | None = None  # [B, T] int32 document ids in a row; padding has its own
  loss_weights: np.ndarray | None = None  # [B, T] float32 weight of each target; None: all 1


def synthetic_batch(step: int, batch: int, seq: int, vocab: int, seed: int) -> Batch:
  """Arithmetic sequences (start + stride * t) mod vocab with a per-sequence random start and a
  stride from {1, 2, 3}: after two tokens every next token is determined, so loss can fall far."""
  rng = np.random.default_rng([seed, step])
  start = rng.integers(0, vocab, size=(batch, 1))
  stride = rng.integers(1, 4, size=(batch, 1))
  toks = (start + stride * np.arange(seq + 1)[None, :]) % vocab
  toks = toks.astype(np.int32)
  return Batch(toks[:, :-1], toks[:, 1:])


class Synthetic:
  """The synthetic stream as a source: batch(step) and position(step)."""

  def __init__(self, batch: int, seq: int, vocab: int, seed: int):
    self.shape, self.vocab, self.seed = (batch, seq), vocab, seed

  def batch(self, step: int) -> Batch:
    return synthetic_batch(step, *self.shape, self.vocab, self.seed)

  def position(self, step: int) -> dict:
    return {"source": "synthetic", "step": step, "epoch": 0, "index": step}


class TokenFile:
  """A flat file of token ids (raw uint16 or uint32); batches are windows at seeded offsets."""

  def __init__(self, path: str | Path, dtype: str, vocab: int):
    path = Path(path)
    if not path.exists():
      raise FileNotFoundError(f"data.path: token file {path} does not exist")
    if not path.is_file():
      raise ValueError(f"data.path: {path} is not a file")
    size, item = path.stat().st_size, np.dtype(dtype).itemsize
    if size == 0:
      raise ValueError(f"data.path: token file {path} is empty")
    if size % item:
      raise ValueError(f"data.path: {path} holds {size} bytes, not a whole number of {dtype} "
                       f"tokens (truncated, or another data.dtype)")
    self.tokens = np.memmap(path, dtype=np.dtype(dtype), mode="r")
    self.vocab = vocab
    self.path = path
    # Up front and cheap: ids of about a million evenly spread tokens must fit the vocabulary.
    sample = self.tokens[::max(1, self.tokens.shape[0] // 1_000_000)]
    if int(sample.max()) >= vocab:
      raise ValueError(f"data.path: {path} holds token id {int(sample.max())} >= model.vocab_size "
                       f"({vocab})")

  def batch(self, step: int, batch: int, seq: int, seed: int) -> Batch:
    n = self.tokens.shape[0]
    if n < seq + 1:
      raise ValueError(f"data.path: {self.path} holds {n} tokens, fewer than train.seq + 1 "
                       f"({seq + 1})")
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, n - seq, size=batch)
    toks = np.stack([np.asarray(self.tokens[s:s + seq + 1]) for s in starts]).astype(np.int64)
    if toks.max() >= self.vocab:
      raise ValueError(f"data.path: token id {int(toks.max())} >= model.vocab_size ({self.vocab})")
    toks = toks.astype(np.int32)
    return Batch(toks[:, :-1], toks[:, 1:])


class _TokenWindows:
  """A TokenFile as a source: batch(step) and position(step)."""

  def __init__(self, cfg: DataConfig, batch: int, seq: int, vocab: int, seed: int):
    self.file = TokenFile(cfg.path, cfg.dtype, vocab)
    self.shape, self.seed = (batch, seq), seed
    n = self.file.tokens.shape[0]
    if n < seq + 1:
      raise ValueError(f"data.path: {cfg.path} holds {n} tokens, fewer than train.seq + 1 ({seq + 1})")

  def batch(self, step: int) -> Batch:
    return self.file.batch(step, *self.shape, self.seed)

  def position(self, step: int) -> dict:
    return {"source": "tokens", "step": step, "epoch": 0, "index": step}


# ---------------------------------------------------------------------------------------------
# Prepared documents: DIR/{split}.bin (tokens), .idx (uint64 document starts plus the end),
# .mask (uint8, chat only: 1 where a token is a target the loss counts) and meta.json.

SPLITS = ("train", "val")


class Prepared:
  """One split of a prepared directory, checked against meta.json before any batch is built."""

  def __init__(self, path: str | Path, split: str, vocab: int):
    path = Path(path)
    meta_path = path / "meta.json"
    if not path.is_dir():
      raise FileNotFoundError(f"data.path: prepared directory {path} does not exist")
    if not meta_path.is_file():
      raise FileNotFoundError(f"data.path: {meta_path} does not exist (run python -m mtjax.data "
                              "prepare, which writes it last)")
    try:
      meta = json.loads(meta_path.read_text())
      dtype = np.dtype(meta["dtype"])
      info = meta["splits"][split]
      n_docs, n_tokens = int(info["documents"]), int(info["tokens"])
      data_vocab, pad_id = int(meta["vocab_size"]), int(meta["pad_id"])
    except (ValueError, KeyError, TypeError) as e:
      raise ValueError(f"data.path: {meta_path} is not a prepared-data meta.json ({e!r})") from None
    if dtype.name not in ("uint16", "uint32") or not 0 <= pad_id < data_vocab:
      raise ValueError(f"data.path: {meta_path}: dtype {dtype.name} (uint16/uint32) or pad_id "
                       f"{pad_id} (< vocab_size {data_vocab}) is wrong")
    if data_vocab > vocab:
      raise ValueError(f"data.path: {meta_path} has vocab_size {data_vocab} > model.vocab_size "
                       f"({vocab})")
    if n_docs < 1:
      raise ValueError(f"data.path: split {split!r} of {path} holds no documents")
    files = {"bin": (n_tokens * dtype.itemsize), "idx": (n_docs + 1) * 8}
    if meta.get("has_mask"):
      files["mask"] = n_tokens
    for ext, size in files.items():
      f = path / f"{split}.{ext}"
      if not f.is_file():
        raise FileNotFoundError(f"data.path: {f} does not exist")
      if f.stat().st_size != size:
        raise ValueError(f"data.path: {f} holds {f.stat().st_size} bytes; meta.json implies {size}")
    self.path, self.split, self.meta = path, split, meta
    self.vocab, self.pad_id = data_vocab, pad_id
    self.tokens = np.memmap(path / f"{split}.bin", dtype=dtype, mode="r")
    self.starts = np.fromfile(path / f"{split}.idx", dtype=np.uint64).astype(np.int64)
    self.mask = (np.memmap(path / f"{split}.mask", dtype=np.uint8, mode="r")
                 if meta.get("has_mask") else None)
    self.lengths = np.diff(self.starts)
    if self.starts[0] != 0 or self.starts[-1] != n_tokens or np.any(self.lengths <= 0):
      raise ValueError(f"data.path: {path / (split + '.idx')} is not a sorted list of document "
                       f"starts from 0 to {n_tokens}")
    # A sample of windows, not a full scan: a wrong tokenizer or vocab shows up anywhere.
    for s in np.linspace(0, max(n_tokens - 4096, 0), 16).astype(np.int64):
      top = int(np.asarray(self.tokens[s:s + 4096]).max())
      if top >= data_vocab:
        raise ValueError(f"data.path: {path / (split + '.bin')} holds token id {top} >= meta.json "
                         f"vocab_size ({data_vocab})")

  @property
  def n_docs(self) -> int:
    return len(self.lengths)

  @property
  def n_tokens(self) -> int:
    return int(self.starts[-1])

  def piece(self, doc: int, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray | None]:
    """Tokens [lo, hi) of document `doc` and their loss mask (None: every token counts)."""
    a = int(self.starts[doc])
    toks = np.asarray(self.tokens[a + lo:a + hi]).astype(np.int64)
    mask = None if self.mask is None else np.asarray(self.mask[a + lo:a + hi])
    return toks, mask


def _row(pieces: list[tuple[np.ndarray, np.ndarray | None]], seq: int, pad_id: int
         ) -> tuple[np.ndarray, ...]:
  """Lays document pieces into one row of seq + 1 tokens and pads the rest.

  Returns:
    (inputs, targets, positions, segments, loss_weights), each [seq].
  """
  n = seq + 1
  toks = np.full(n, pad_id, np.int64)
  seg = np.full(n, len(pieces), np.int32)  # padding is a segment of its own
  pos = np.zeros(n, np.int32)
  counts = np.zeros(n, np.float32)  # 1 where the token, as a target, counts for the loss
  o = 0
  for k, (t, m) in enumerate(pieces):
    m_len = len(t)
    toks[o:o + m_len] = t
    seg[o:o + m_len] = k
    # Every piece starts at position 0, also one that continues a document from the previous row:
    # positions stay within the trained context length whatever the document's length.
    pos[o:o + m_len] = np.arange(m_len)
    counts[o:o + m_len] = 1 if m is None else m
    o += m_len
  pos[o:] = np.arange(n - o)
  # A target counts only inside its input's document: a document's last token predicts nothing.
  same = (seg[:-1] == seg[1:]) & (seg[1:] < len(pieces))
  weights = (same * counts[1:]).astype(np.float32)
  return toks[:-1], toks[1:], pos[:-1], seg[:-1], weights


def _stack(rows: list[tuple[np.ndarray, ...]], vocab: int, where: str) -> Batch:
  inputs, targets, pos, seg, w = (np.stack(x) for x in zip(*rows))
  top = max(int(inputs.max()), int(targets.max()))
  if top >= vocab:
    raise ValueError(f"data.path: {where} holds token id {top} >= model.vocab_size ({vocab})")
  return Batch(inputs.astype(np.int32), targets.astype(np.int32), pos, seg, w)


class PreparedSource:
  """Training batches from a prepared split, a pure function of (data, mode, seed, step).

  packed: each epoch concatenates the documents in a seeded shuffle and cuts the stream into rows
  of seq + 1 tokens, each starting on the previous row's last token so that every token is a target
  once (the tail that fills no row is dropped); padded: each epoch takes the documents
  in a seeded shuffle, one per row, truncated to seq + 1 tokens (those without a counted target in
  that window, such as an SFT prompt longer than a row, are left out).
  """

  def __init__(self, data: Prepared, mode: str, batch: int, seq: int, seed: int, vocab: int):
    self.data, self.mode, self.shape, self.seed = data, mode, (batch, seq), seed
    self.model_vocab = vocab
    if mode == "packed":
      self.per_epoch = (data.n_tokens - 1) // seq
      if self.per_epoch < 1:
        raise ValueError(f"data.path: split {data.split!r} of {data.path} holds {data.n_tokens} "
                         f"tokens, fewer than train.seq + 1 ({seq + 1})")
      self.docs = np.arange(data.n_docs)
    else:
      self.docs = _with_targets(data, seq)
      self.per_epoch = len(self.docs)
    self._epochs: collections.OrderedDict = collections.OrderedDict()

  def _epoch(self, e: int) -> tuple[np.ndarray, np.ndarray]:
    """The epoch's document order and, packed, the stream offset where each of them ends."""
    if e not in self._epochs:
      order = self.docs[np.random.default_rng([self.seed, e]).permutation(len(self.docs))]
      self._epochs[e] = (order, np.cumsum(self.data.lengths[order]))
      while len(self._epochs) > 2:  # a step's rows span at most two epochs
        self._epochs.popitem(last=False)
    return self._epochs[e]

  def _pieces(self, g: int) -> list:
    e, i = divmod(g, self.per_epoch)
    order, ends = self._epoch(e)
    seq = self.shape[1]
    if self.mode == "padded":
      d = int(order[i])
      return [self.data.piece(d, 0, min(int(self.data.lengths[d]), seq + 1))]
    return _cut(self.data, order, ends, i * seq, i * seq + seq + 1)

  def batch(self, step: int) -> Batch:
    B, T = self.shape
    rows = [_row(self._pieces(step * B + b), T, self.data.pad_id) for b in range(B)]
    return _stack(rows, self.model_vocab, str(self.data.path))

  def position(self, step: int) -> dict:
    """Where `step` begins in the data: epoch, row (packed) or document (padded) within it, ..."""
    B, T = self.shape
    e, i = divmod(step * B, self.per_epoch)
    pos = {"source": "prepared", "mode": self.mode, "split": self.data.split, "seed": self.seed,
           "step": step, "epoch": int(e), "index": int(i), "per_epoch": int(self.per_epoch)}
    if self.mode == "packed":
      _, ends = self._epoch(e)
      pos["token"] = int(i * T)
      pos["document"] = int(np.searchsorted(ends, i * T, side="right"))
    return pos


def _with_targets(data: Prepared, seq: int) -> np.ndarray:
  """The documents with a target the loss counts in their first seq + 1 tokens, for padded rows."""
  # A row without one would only add a weight-0 row, and a batch of them has no loss at all (an
  # SFT prompt longer than the row, say): such documents are left out of padded epochs.
  keep = data.lengths >= 2
  if data.mask is not None:
    keep &= np.array([data.mask[a + 1:a + min(n, seq + 1)].any()
                      for a, n in zip(data.starts[:-1], data.lengths)], dtype=bool)
  if not keep.any():
    raise ValueError(f"data.path: no document of split {data.split!r} of {data.path} has a target "
                     f"the loss counts within train.seq + 1 ({seq + 1}) tokens")
  return np.flatnonzero(keep)


def _cut(data: Prepared, order: np.ndarray, ends: np.ndarray, a: int, b: int) -> list:
  """The pieces of the documents (in `order`, ending at stream offsets `ends`) covering [a, b)."""
  pieces = []
  j = int(np.searchsorted(ends, a, side="right"))
  while j < len(order) and a < b:
    d = int(order[j])
    start = int(ends[j]) - int(data.lengths[d])
    hi = min(b, int(ends[j]))
    pieces.append(data.piece(d, a - start, hi - start))
    a = hi
    j += 1
  return pieces


def source(cfg: DataConfig, batch: int, seq: int, vocab: int, seed: int):
  """The configured data as an object with batch(step) -> Batch and position(step) -> dict.

  Args:
    cfg: the data section of the config.
    batch: rows per step (train.batch).
    seq: tokens per row (train.seq).
    vocab: model.vocab_size; every token id must be below it.
    seed: seeds the order of the data (train.seed).

  Returns:
    The source; checks files and sizes when built, before any batch.
  """
  if cfg.source == "tokens":
    return _TokenWindows(cfg, batch, seq, vocab, seed)
  if cfg.source == "prepared":
    return PreparedSource(Prepared(cfg.path, cfg.split, vocab), cfg.mode, batch, seq, seed, vocab)
  return Synthetic(batch, seq, vocab, seed)


def batches(cfg: DataConfig, batch: int, seq: int, vocab: int, seed: int, start_step: int = 0):
  """Yields the batch of each step from `start_step` on; a step always gives the same batch."""
  src = source(cfg, batch, seq, vocab, seed)
  step = start_step
  while True:
    yield src.batch(step)
    step += 1


def position(cfg: DataConfig, batch: int, seq: int, vocab: int, seed: int, step: int) -> dict:
  """Where `step`'s batch lies in the data (epoch, index in it, ...), saved with a checkpoint."""
  return source(cfg, batch, seq, vocab, seed).position(step)


def validation_batches(cfg: DataConfig, batch: int, seq: int, vocab: int, split: str = "val"
                       ) -> Iterator[Batch]:
  """One deterministic pass over a prepared split for held-out loss, in stored order, no shuffle.

  packed: the split's documents concatenated and cut into rows of seq + 1 that overlap by one token
  (the last row padded);
  padded: one document per row, truncated to seq + 1 (as in training, those without a counted
  target are left out). The last batch is filled with padding rows
  of weight 0, so sum(nll * w) / sum(w) over all batches is the mean loss over the split's targets.

  Args:
    cfg: the data section of the config (source must be prepared).
    batch: rows per batch.
    seq: tokens per row.
    vocab: model.vocab_size.
    split: the split to evaluate.

  Returns:
    A finite iterator of Batch.
  """
  if cfg.source != "prepared":
    raise ValueError(f"data.source: held-out batches need 'prepared' data, not {cfg.source!r}")
  data = Prepared(cfg.path, split, vocab)
  order = np.arange(data.n_docs)
  if cfg.mode == "packed":
    ends = np.cumsum(data.lengths)
    n_rows = -(-(data.n_tokens - 1) // seq)
    row = lambda r: _cut(data, order, ends, r * seq, r * seq + seq + 1)
  else:
    docs = _with_targets(data, seq)
    n_rows = len(docs)
    row = lambda r: [data.piece(int(docs[r]), 0, min(int(data.lengths[docs[r]]), seq + 1))]

  def gen():
    for r0 in range(0, n_rows, batch):
      rows = [_row(row(r) if r < n_rows else [], seq, data.pad_id) for r in range(r0, r0 + batch)]
      yield _stack(rows, vocab, str(data.path))

  return gen()


# ---------------------------------------------------------------------------------------------
# prepare: tokenize text, jsonl or chat jsonl into DIR/{train,val}.{bin,idx[,mask]} + meta.json.

FORMATS = ("text", "jsonl", "chat")
_CHUNK = 1024  # documents per encode_batch call / per task of the worker pool


def _input_files(inputs: list[str]) -> list[Path]:
  files = []
  for name in inputs:
    p = Path(name)
    if p.is_dir():
      found = sorted(f for f in p.rglob("*") if f.is_file()
                     and not any(part.startswith(".") for part in f.relative_to(p).parts))
      if not found:
        raise ValueError(f"{p}: folder holds no files")
      files += found
    elif p.is_file():
      files.append(p)
    else:
      raise FileNotFoundError(f"{p}: no such file or folder")
  for f in files:
    if f.stat().st_size == 0:
      raise ValueError(f"{f}: empty file")
  return files


def _read_text(f: Path) -> str:
  try:
    return f.read_text(encoding="utf-8")
  except (OSError, UnicodeDecodeError) as e:
    raise ValueError(f"{f}: unreadable as UTF-8 text ({e})") from None


def _count_docs(f: Path, fmt: str) -> int:
  text = _read_text(f)  # an unreadable file fails here, before any tokenization
  return 1 if fmt == "text" else sum(1 for line in text.splitlines() if line.strip())


def _parse_line(f: Path, lineno: int, line: str, fmt: str, text_field: str):
  from mtjax import chat
  where = f"{f}:{lineno}"
  try:
    obj = json.loads(line)
  except json.JSONDecodeError as e:
    raise ValueError(f"{where}: bad JSON ({e.msg} at column {e.colno})") from None
  if not isinstance(obj, dict):
    raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
  if fmt == "jsonl":
    if not isinstance(obj.get(text_field), str):
      raise ValueError(f"{where}: no string field {text_field!r}")
    return obj[text_field]
  if "messages" in obj:
    msgs = obj["messages"]
    if (not isinstance(msgs, list) or not msgs or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in msgs)):
      raise ValueError(f"{where}: 'messages' must be a non-empty list of {{role, content}} strings")
    if not any(m["role"] == "assistant" for m in msgs):
      raise ValueError(f"{where}: conversation has no assistant message to train on")
    try:
      chat.check_messages(msgs)
    except ValueError as e:
      raise ValueError(f"{where}: {e}") from None
    return msgs
  if isinstance(obj.get("prompt"), str) and isinstance(obj.get("response"), str):
    if not obj["response"].strip():
      raise ValueError(f"{where}: empty 'response': nothing to train on")
    return [{"role": "user", "content": obj["prompt"]},
            {"role": "assistant", "content": obj["response"]}]
  raise ValueError(f"{where}: expected 'messages' or string 'prompt' and 'response'")


def _documents(files: list[Path], fmt: str, text_field: str):
  """Yields (where, document) in order: a text file's content, a jsonl line's text or messages."""
  for f in files:
    if fmt == "text":
      yield str(f), _read_text(f)
      continue
    for lineno, line in enumerate(_read_text(f).splitlines(), 1):
      if line.strip():
        yield f"{f}:{lineno}", _parse_line(f, lineno, line, fmt, text_field)


_WORKER: dict = {}


def _init_worker(tokenizer_path: str, fmt: str, eos_id: int):
  from tokenizers import Tokenizer

  from mtjax import chat
  template = chat.ChatTemplate.from_tokenizer(tokenizer_path) if fmt == "chat" else None
  _WORKER.update(tok=Tokenizer.from_file(tokenizer_path), fmt=fmt, eos=eos_id, template=template)


def _encode_chunk(chunk: list[tuple[str, object]]) -> list[tuple[np.ndarray, np.ndarray | None]]:
  """Token ids (EOS appended) and, for chat, the loss mask of each document of the chunk."""
  from mtjax import chat
  tok, eos = _WORKER["tok"], _WORKER["eos"]
  out = []
  if _WORKER["fmt"] != "chat":
    # A document is encoded as in pre-training: the post-processor adds what the model saw around
    # each one (a Llama BOS). EOS separates documents, once, also where the post-processor adds it.
    for enc in tok.encode_batch([doc for _, doc in chunk], add_special_tokens=True):
      ids = enc.ids if enc.ids and enc.ids[-1] == eos else enc.ids + [eos]
      out.append((np.asarray(ids, np.int64), None))
    return out
  for where, msgs in chunk:
    try:
      ids, mask = chat.encode_chat(tok, _WORKER["template"], msgs)
    except ValueError as e:
      raise ValueError(f"{where}: {e}") from None
    # The template usually ends a conversation with the end-of-turn token, often followed by a
    # newline (ChatML); EOS separates documents and is appended only when the conversation does
    # not already end with it (or with it and trailing whitespace), never as a target.
    tail = ids
    while len(tail) and tok.id_to_token(int(tail[-1])) is not None and not tok.decode(
        [int(tail[-1])], skip_special_tokens=False).strip():
      tail = tail[:-1]
    if len(tail) == 0 or tail[-1] != eos:
      ids, mask = np.append(ids, eos), np.append(mask, np.uint8(0))
    out.append((ids, mask))
  return out


def _encoded(chunks, workers: int, init_args: tuple):
  """Yields _encode_chunk of each chunk in order, on a pool of `workers` processes when > 1."""
  if workers <= 1:
    _init_worker(*init_args)
    for c in chunks:
      yield _encode_chunk(c)
    return
  # spawn, not fork: the tokenizers library's Rust thread pool does not survive a fork.
  with multiprocessing.get_context("spawn").Pool(workers, _init_worker, init_args) as pool:
    pending = collections.deque()
    for c in chunks:  # chunks are parsed here, so a bad line fails in this process, named
      pending.append(pool.apply_async(_encode_chunk, (c,)))
      if len(pending) >= 2 * workers:
        yield pending.popleft().get()
    while pending:
      yield pending.popleft().get()


def _chunks(docs, size: int):
  chunk = []
  for d in docs:
    chunk.append(d)
    if len(chunk) == size:
      yield chunk
      chunk = []
  if chunk:
    yield chunk


def _check_out(out: Path) -> None:
  """Refuses an --out that is a file or lies under one, before anything is read or tokenized."""
  if out.exists() and not out.is_dir():
    raise ValueError(f"--out: {out} is a file, not a directory")
  for parent in out.parents:
    if parent.exists():
      if not parent.is_dir():
        raise ValueError(f"--out: {out} lies under {parent}, a file, not a directory")
      return


def _write(out: Path, files: list[Path], fmt: str, text_field: str, is_val: np.ndarray,
           dtype: np.dtype, workers: int, init_args: tuple, progress: bool) -> dict:
  """Tokenizes the documents into out/{split}.bin/.idx[/.mask]; returns each split's counts."""
  from tqdm import tqdm
  out.mkdir(parents=True, exist_ok=True)
  (out / "meta.json").unlink(missing_ok=True)  # no meta.json until every file is complete
  has_mask = fmt == "chat"
  handles = {}
  starts = {s: [0] for s in SPLITS}
  doc = 0
  try:
    for s in SPLITS:
      handles[s] = {"bin": open(out / f"{s}.bin", "wb")}
      if has_mask:
        handles[s]["mask"] = open(out / f"{s}.mask", "wb")
    bar = tqdm(total=len(is_val), unit="doc", disable=not progress, desc="tokenizing")
    chunks = _chunks(_documents(files, fmt, text_field), _CHUNK)
    for encoded in _encoded(chunks, workers, init_args):
      for ids, mask in encoded:
        s = "val" if is_val[doc] else "train"
        # write(), not ndarray.tofile: tofile loses a failed write of a small array (a full disk)
        handles[s]["bin"].write(ids.astype(dtype).tobytes())
        if has_mask:
          handles[s]["mask"].write(mask.astype(np.uint8).tobytes())
        starts[s].append(starts[s][-1] + len(ids))
        doc += 1
      bar.update(len(encoded))
    bar.close()
  finally:
    for h in handles.values():
      for fh in h.values():
        try:
          fh.close()  # flushes: where a full disk shows
        except OSError as e:
          raise OSError(e.errno, e.strerror, fh.name) from None
  for s in SPLITS:
    (out / f"{s}.idx").write_bytes(np.asarray(starts[s], np.uint64).tobytes())
  return {s: {"documents": len(starts[s]) - 1, "tokens": starts[s][-1]} for s in SPLITS}


def prepare(tokenizer: str | Path, out: str | Path, inputs: list[str], fmt: str = "text",
            text_field: str = "text", val_fraction: float = 0.01, workers: int = 1, seed: int = 0,
            eos: str | None = None, progress: bool = True) -> dict:
  """Tokenizes documents into DIR/{train,val}.bin/.idx (and .mask for chat) plus meta.json.

  Args:
    tokenizer: a directory holding tokenizer.json (and tokenizer_config.json), or tokenizer.json.
    out: the directory to write.
    inputs: text files, folders of them (recursive, sorted) or jsonl files.
    fmt: text (a file is a document), jsonl (a line's `text_field`) or chat (a line's messages, or
      prompt and response, rendered with the tokenizer's chat template; the loss mask marks the
      assistant tokens).
    text_field: the jsonl field holding the text.
    val_fraction: share of whole documents held out, chosen by `seed`.
    workers: processes tokenizing in parallel (encode_batch is multi-threaded already).
    seed: seeds the held-out choice.
    eos: EOS token appended to each document; None: tokenizer_config.json's eos_token.
    progress: show a tqdm bar.

  Returns:
    The meta.json contents; for chat, mask_method says how the loss mask found the assistant tokens
    (generation_tags or render_diff, see chat.ChatTemplate).

  Raises:
    ValueError: a bad argument or input, or --out cannot be written (one line naming it).
  """
  from tokenizers import Tokenizer

  from mtjax import chat
  if fmt not in FORMATS:
    raise ValueError(f"--format: {fmt!r} is not one of {list(FORMATS)}")
  if not 0 <= val_fraction < 1:
    raise ValueError(f"--val-fraction: {val_fraction} must be in [0, 1)")
  if workers < 1:
    raise ValueError(f"--workers: {workers} must be >= 1")
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
  mask_method = None
  if fmt == "chat":  # no template, or a broken one, is an error now, not in a worker
    mask_method = chat.ChatTemplate.from_tokenizer(tok_file).mask_method
  vocab = tok.get_vocab_size(with_added_tokens=True)
  dtype = np.dtype(np.uint16 if vocab <= 65536 else np.uint32)
  files = _input_files(inputs)

  # Counting first lets the held-out split be an exact share, chosen before any tokenization.
  n = sum(_count_docs(f, fmt) for f in files)
  if n == 0:
    raise ValueError(f"{inputs}: no documents")
  n_val = 0 if val_fraction == 0 else min(n - 1, max(1, round(val_fraction * n)))
  if val_fraction > 0 and n < 2:
    raise ValueError(f"--val-fraction: {n} document cannot be split; pass --val-fraction 0")
  is_val = np.zeros(n, bool)
  is_val[np.random.default_rng(seed).choice(n, n_val, replace=False)] = True

  meta = {
      "format": fmt, "dtype": dtype.name, "vocab_size": vocab, "eos_id": eos_id, "pad_id": pad_id,
      "has_mask": fmt == "chat", "seed": seed, "val_fraction": val_fraction,
      "tokenizer": str(tok_file),
      "tokenizer_sha256": hashlib.sha256(tok_file.read_bytes()).hexdigest(),
      "inputs": [str(f) for f in files],
  }
  if mask_method:
    meta["mask_method"] = mask_method
  try:
    meta["splits"] = _write(out, files, fmt, text_field, is_val, dtype, workers,
                            (str(tok_file), fmt, eos_id), progress)
    (out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
  except OSError as e:  # a full disk, a read-only or vanished folder: one line, not a traceback
    raise ValueError(f"--out: cannot write {e.filename or out} ({e.strerror or e})") from None
  return meta


class _Parser(argparse.ArgumentParser):
  """Usage errors as one line on stderr, exit 2, like the errors of prepare itself."""

  def error(self, message):
    self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def main(argv: list[str] | None = None):
  """`python -m mtjax.data prepare ...`: exits 2 with one `error: ...` line on bad input."""
  p = _Parser(prog="python -m mtjax.data", description=__doc__)
  sub = p.add_subparsers(dest="command", required=True)
  q = sub.add_parser("prepare", help="tokenize documents into a prepared directory")
  q.add_argument("--tokenizer", required=True, help="directory with tokenizer.json, or the file")
  q.add_argument("--out", required=True, help="directory to write")
  q.add_argument("--format", choices=FORMATS, default="text")
  q.add_argument("--text-field", default="text", help="jsonl field holding the text")
  q.add_argument("--val-fraction", type=float, default=0.01, help="share of documents held out")
  q.add_argument("--workers", type=int, default=1, help="tokenizing processes")
  q.add_argument("--seed", type=int, default=0, help="seeds the held-out choice")
  q.add_argument("--eos", default=None, help="EOS token (default: tokenizer_config.json eos_token)")
  q.add_argument("--quiet", action="store_true", help="no progress bar")
  q.add_argument("inputs", nargs="+", help="text files, folders of them, or jsonl files")
  a = p.parse_args(argv)
  try:
    meta = prepare(a.tokenizer, a.out, a.inputs, a.format, a.text_field, a.val_fraction,
                   a.workers, a.seed, a.eos, progress=not a.quiet)
  except (ValueError, OSError) as e:
    print("error: " + " ".join(str(e).split("\n")), file=sys.stderr)
    sys.exit(2)
  if "mask_method" in meta:
    how = {"generation_tags": "the template's {% generation %} tags",
           "render_diff": "renders of the conversation cut before and after each assistant turn"}
    print(f"loss mask: {meta['mask_method']} ({how[meta['mask_method']]})")
  print(json.dumps(meta["splits"]))


if __name__ == "__main__":
  # Run the imported module's main, not this __main__ copy: the pool pickles its functions by
  # module name, and spawned workers import mtjax.data.
  from mtjax import data as _data
  _data.main()
