"""`prepare`: text, jsonl or chat documents tokenized with the model's own tokenizer into
DIR/{train,val}.{bin,idx[,mask]} and meta.json (read by mtjax.data.sources.Prepared)."""

from __future__ import annotations

import collections
import hashlib
import json
import multiprocessing
from pathlib import Path

import numpy as np

from mtjax.data import chat
from mtjax.data.sources import SPLITS



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

  template = chat.ChatTemplate.from_tokenizer(tokenizer_path) if fmt == "chat" else None
  _WORKER.update(tok=Tokenizer.from_file(tokenizer_path), fmt=fmt, eos=eos_id, template=template)


def _encode_chunk(chunk: list[tuple[str, object]]) -> list[tuple[np.ndarray, np.ndarray | None]]:
  """Token ids (EOS appended) and, for chat, the loss mask of each document of the chunk."""
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
