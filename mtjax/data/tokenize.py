"""`prepare`: documents from text, JSONL, JSON, CSV, Parquet, Arrow or `datasets` sources, in any
of the formats of mtjax.data.formats, tokenized with the model's own tokenizer (chat through its
chat template) into a prepared directory read by mtjax.data.sources:

  {split}.bin / .idx / .mask      tokens, uint64 document starts plus the end, uint8 loss mask
                                  (chat: 1 on the tokens the loss counts)
  {split}.chosen.* / .rejected.*  preference data instead: the same three files for each side
  {split}.prefix                  ... and uint64 per pair: the length of the prompt both share
  {split}.pixels / .images        chats with images: uint8 [N, H, W, 3] images at the processor's
                                  size, not normalised; uint64 image starts per document plus the
                                  end (meta.json "images" holds the size and the normalisation)
  meta.json                       dtype, vocab, ids, the tokenizer's fingerprint, splits, a crc32c
                                  of every file, the stats
  stats.json                      per source: rows, documents and tokens per split, skipped rows
                                  by reason with the first one, truncated documents

`run` takes a Request through five stages, each a function with a typed result: the tokenizer
(Vocabulary), the sources (their files, formats and row counts), the plan (held-out rows, a
mixture's repeats, the disk check), tokenizing into a temporary folder, and finishing it (the
mixture's shuffle, meta.json, the checks). The temporary folder sits beside --out and is renamed
into place at the end; whatever stops a prepare before that (an error, Ctrl-C, SIGTERM, SIGKILL)
leaves --out as it was, and only SIGKILL leaves the temporary folder, which the next run removes.
"""

from __future__ import annotations

import array
import collections
import contextlib
import dataclasses
import json
import math
import multiprocessing
import os
import queue
import shutil
import signal
import threading
from pathlib import Path

import numpy as np

from mtjax.data import chat, formats, readers
from mtjax.data.fingerprint import tokenizer_fingerprint
from mtjax.data.formats import FORMATS, ImageChat, Mapping, Pair
from mtjax.data.readers import BadFile, BadRow
from mtjax.data.sources import SPLITS, Prepared, checksum, read_pairs

_CHUNK = 1024  # documents per encode_batch call / per task of the worker pool
OVERFLOW = ("truncate", "drop")
_STOPS = {signal.SIGINT, signal.SIGTERM}  # the signals that stop a prepare (the CLI's)


@dataclasses.dataclass(frozen=True)
class Options:
  """How documents become training examples (prepare's keyword arguments, the CLI's options)."""
  train_on_prompt: bool = False  # the loss counts every token of a conversation, not the answers
  last_turn_only: bool = False  # the loss counts the last assistant turn only
  max_len: int | None = None  # longest document in tokens; longer ones are cut or dropped
  overflow: str = "truncate"  # truncate | drop a document longer than max_len


@dataclasses.dataclass(frozen=True)
class Request:
  """What to prepare, checked when made: a bad value is a ValueError naming its CLI option.

  Weights share out as many training documents as the sources' training rows together; epochs
  take each source's training rows E times (a fraction draws a seeded subset). They exclude each
  other; either one makes a mixture, whose training documents are stored in one seeded shuffle.
  """
  tokenizer: str | Path  # a folder with tokenizer.json (and tokenizer_config.json), or the file
  out: Path  # the directory to write (replaced whole, atomically, when it holds an earlier prepare)
  inputs: tuple[str, ...]  # each a file, a folder of files or a datasets folder: a mixture's source
  fmt: str = "auto"  # one of formats.FORMATS; auto picks each source's format from its first row
  text_field: str = "text"  # the column holding the text (text format), as columns={"text": ...}
  columns: dict = dataclasses.field(default_factory=dict)  # field -> column (formats.FIELDS)
  roles: dict = dataclasses.field(default_factory=dict)  # role in the data -> the template's role
  val_fraction: float = 0.01  # share of each source's rows held out, chosen by seed
  weights: tuple[float, ...] | None = None  # each source's share of the training documents
  epochs: tuple[float, ...] | None = None  # times each source's training rows are taken
  options: Options = dataclasses.field(default_factory=Options)  # loss mask and length options
  workers: int = 1  # processes tokenizing in parallel (encode_batch is multi-threaded already)
  seed: int = 0  # seeds the held-out choice, the rows a mixture draws and its order
  eos: str | None = None  # EOS token after each document; None: tokenizer_config.json's
  strict: bool = False  # a bad row or file is an error instead of being counted and skipped
  allow_low_disk: bool = False  # start even when --out's free space is below output_estimate
  processor: str | Path | None = None  # the model's processor folder (images); None: the tokenizer's
  image_size: int | None = None  # Qwen-VL: the square side in pixels every image is resized to; None: what the processor pins

  def __post_init__(self):
    opts = self.options
    if self.image_size is not None and self.image_size <= 0:
      raise ValueError(f"--image-size: {self.image_size} must be a positive number of pixels")
    if self.fmt not in FORMATS:
      raise ValueError(f"--format: {self.fmt!r} is not one of {', '.join(FORMATS)}")
    if not 0 <= self.val_fraction < 1:
      raise ValueError(f"--val-fraction: {self.val_fraction} must be in [0, 1)")
    if self.workers < 1:
      raise ValueError(f"--workers: {self.workers} must be >= 1")
    if opts.max_len is not None and opts.max_len < 2:
      raise ValueError(f"--max-len: {opts.max_len} must be >= 2")
    if opts.overflow not in OVERFLOW:
      raise ValueError(f"--overflow: {opts.overflow!r} is not one of {', '.join(OVERFLOW)}")
    if self.weights is not None and self.epochs is not None:
      raise ValueError("--weights and --epochs: pass one of them")
    unknown = sorted(set(self.columns) - set(formats.FIELDS))
    if unknown:
      raise ValueError(f"--columns: unknown field {unknown[0]!r} (fields: "
                       f"{', '.join(formats.FIELDS)})")
    columns = dict(self.columns)
    if self.text_field != "text":
      columns.setdefault("text", self.text_field)
    inputs = tuple(str(i) for i in self.inputs)
    # Normal forms, set once here (a frozen dataclass): every stage reads the same values.
    for name, value in (("out", Path(self.out)), ("inputs", inputs), ("columns", columns),
                        ("roles", dict(self.roles)),
                        ("weights", _numbers(self.weights, "--weights", len(inputs))),
                        ("epochs", _numbers(self.epochs, "--epochs", len(inputs)))):
      object.__setattr__(self, name, value)

  @property
  def mapping(self) -> Mapping:
    return Mapping(self.columns, self.roles)


def _numbers(values, option: str, n_inputs: int) -> tuple[float, ...] | None:
  if values is None:
    return None
  values = tuple(float(v) for v in values)
  if len(values) != n_inputs:
    raise ValueError(f"{option}: {len(values)} values for {n_inputs} inputs")
  bad = [v for v in values if not (math.isfinite(v) and v > 0)]
  if bad:
    raise ValueError(f"{option}: {bad[0]:g} is not a positive number")
  return values


class Stats:
  """Counts of one source: documents and tokens per split, skipped rows by reason, truncations."""

  def __init__(self, name: str):
    self.name, self.rows, self.format = name, 0, None
    self.documents = {s: 0 for s in SPLITS}
    self.tokens = {s: 0 for s in SPLITS}
    self.images = {s: 0 for s in SPLITS}
    self.skipped: dict = {}
    self.truncated = 0

  def skip(self, reason: str, message: str, strict: bool, n: int = 1):
    if strict:
      raise ValueError(message)
    entry = self.skipped.setdefault(reason, {"count": 0, "first": message})
    entry["count"] += n

  def as_dict(self) -> dict:
    return {"input": self.name, "format": self.format, "rows": self.rows,
            "documents": self.documents, "tokens": self.tokens, "images": self.images,
            "skipped": self.skipped,
            "truncated": self.truncated}


# ---- tokenizing, in worker processes when --workers > 1 ----------------------------------------

_WORKER: dict = {}


def _init_worker(tokenizer_path: str, eos_id: int, with_template: bool, last_turn_only: bool,
                 processor: str | None = None, image_size: int | None = None):
  from tokenizers import Tokenizer

  template = chat.ChatTemplate.from_tokenizer(tokenizer_path) if with_template else None
  tok = Tokenizer.from_file(tokenizer_path)
  images = None
  if processor is not None:
    from mtjax.data.images import ImageProcessor
    images = ImageProcessor.from_dir(processor)
    if image_size is not None:
      images = images.at_size(image_size)
  _WORKER.update(tok=tok, eos=eos_id, template=template, last=last_turn_only, images=images)


@contextlib.contextmanager
def _sigint_ignored():
  """SIGINT ignored while the workers start (a few milliseconds), which inherit that through exec:
  a Ctrl-C during their start-up does not reach them either, where it would print a traceback.
  One in those milliseconds is lost (press it again). In the main thread only, where signal
  dispositions are set."""
  if threading.current_thread() is not threading.main_thread():
    yield
    return
  previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
  try:
    yield
  finally:
    signal.signal(signal.SIGINT, previous)


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
  if _WORKER["images"] is not None:  # a processor's template takes every content as parts
    return _encode_images(ImageChat(chat.as_parts(msgs), ()), last)[:2]
  ids, mask = chat.encode_chat(tok, template, msgs, last_turn_only=last)
  return _end_with_eos(tok, eos, ids, mask)


class _BadImage(ValueError):
  """An image of a row that is missing or cannot be read (its reason groups it)."""

  def __init__(self, reason: str, message: str):
    super().__init__(message)
    self.reason = reason


def _encode_images(doc: ImageChat, last: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
  """A conversation with images: ids with each image's tokens in place of its placeholder, the
  loss mask (never on an image token) and the images as stored, [n, H, W, 3] uint8 (None: none;
  a placeholder without an image is an error)."""
  from mtjax.data.images import load_image

  tok, eos, template, proc = (_WORKER[k] for k in ("tok", "eos", "template", "images"))
  pixels = []
  for source in doc.images:
    try:
      pixels.append(proc.uint8(load_image(source, doc.base)))
    except ValueError as e:
      raise _BadImage("missing image" if "no such file" in str(e) else "unreadable image",
                      str(e)) from None
  ids, mask = chat.encode_chat(tok, template, doc.messages, last_turn_only=last,
                               expand=lambda text, spans: proc.expand(text, spans, len(pixels)))
  marked = ids == tok.token_to_id(proc.tokens.marked)
  per_image = proc.stored()["tokens_per_image"]
  if int(marked.sum()) != per_image * len(pixels):
    raise ValueError(f"{int(marked.sum())} {proc.tokens.marked} tokens after tokenizing, "
                     f"{per_image * len(pixels)} expected")
  mask[marked] = 0  # an image token is never a target
  ids, mask = _end_with_eos(tok, eos, ids, mask)
  return ids, mask, np.stack(pixels) if pixels else None


def _encode_chunk(chunk: list[tuple[str, object]]) -> list[tuple]:
  """Each document of the chunk as ("doc", ids, mask or None, images or None), ("pair", chosen
  ids, mask, rejected ids, mask, prefix) or ("bad", reason, message)."""
  tok, eos = _WORKER["tok"], _WORKER["eos"]
  out: list = [None] * len(chunk)
  texts = [(k, d) for k, (_, d) in enumerate(chunk) if isinstance(d, str)]
  # A text is encoded as in pre-training: the post-processor adds what the model saw around each
  # one (a Llama BOS). EOS separates documents, once, also where the post-processor adds it.
  for (k, _), enc in zip(texts, tok.encode_batch([d for _, d in texts], add_special_tokens=True)):
    ids = enc.ids if enc.ids and enc.ids[-1] == eos else enc.ids + [eos]
    out[k] = ("doc", np.asarray(ids, np.int64), None, None)
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
      elif isinstance(doc, ImageChat):
        out[k] = ("doc", *_encode_images(doc, _WORKER["last"]))
      else:
        out[k] = ("doc", *_encode_conversation(doc, _WORKER["last"]), None)
    except _BadImage as e:
      out[k] = ("bad", e.reason, f"{where}: {e}")
    except ValueError as e:  # the template fails on this conversation, or marks nothing
      out[k] = ("bad", "template error", f"{where}: {e}")
  return out


@contextlib.contextmanager
def _encoder(workers: int, init_args: tuple):
  """A function from chunks of rows to (chunk, _encode_chunk(chunk)) in order: in this process, or
  on `workers` processes that end with the block, however it ends."""
  if workers <= 1:
    _init_worker(*init_args)
    yield lambda chunks: ((c, _encode_chunk([(w, d) for w, d, *_ in c])) for c in chunks)
    return
  # spawn, not fork: the tokenizers library's Rust thread pool does not survive a fork. Each
  # worker has pipes of its own, no lock shared with another (as multiprocessing's pools share
  # one): ending a worker in the middle of a write, which a stop does, harms no other, and a pipe
  # that ends mid-message is an EOFError here, not a wait forever.
  ctx = multiprocessing.get_context("spawn")
  procs, links = [], []
  try:
    with _sigint_ignored():
      for _ in range(workers):
        tasks_r, tasks_w = ctx.Pipe(duplex=False)
        results_r, results_w = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_work, args=(tasks_r, results_w, init_args), daemon=True)
        proc.start()
        tasks_r.close()  # the worker's ends: a worker sees EOF when this process is gone
        results_w.close()
        procs.append(proc)
        links.append((tasks_w, results_r))
    yield lambda chunks: _spread(links, chunks)
  finally:
    for proc in procs:
      proc.terminate()
    for proc in procs:
      proc.join()
    for tasks_w, results_r in links:
      tasks_w.close()
      results_r.close()


def _work(tasks, results, init_args: tuple):
  """A tokenizing process: encodes the chunks that arrive on `tasks`, sends each result back."""
  # Ctrl-C reaches the whole process group; the parent answers it by ending the workers.
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  _init_worker(*init_args)
  inbox = queue.SimpleQueue()

  def read():  # takes each chunk as it comes: the parent's send never waits on a result's send
    try:
      while True:
        inbox.put(tasks.recv())
    except (EOFError, OSError):  # the parent is gone
      inbox.put(None)

  threading.Thread(target=read, daemon=True).start()
  while (chunk := inbox.get()) is not None:
    try:
      out = _encode_chunk(chunk)
    except Exception as e:  # noqa: BLE001 - raised again in the parent
      out = e
    results.send(out)


def _spread(links: list, chunks):
  """Chunk k to worker k mod n, at most two chunks a worker ahead of the results, which come
  back in order."""
  pending = collections.deque()
  for k, c in enumerate(chunks):  # rows are read and converted here: bad rows counted here
    tasks_w, results_r = links[k % len(links)]
    tasks_w.send([(w, d) for w, d, *_ in c])
    pending.append((c, results_r))
    if len(pending) >= 2 * len(links):
      yield _received(*pending.popleft())
  while pending:
    yield _received(*pending.popleft())


def _received(chunk: list, results_r) -> tuple:
  try:
    out = results_r.recv()
  except EOFError:
    raise RuntimeError("a tokenizing worker process ended before sending its result") from None
  if isinstance(out, BaseException):
    raise out
  return chunk, out


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
  """Appends documents to DIR/NAME.bin, .idx (written at close) and .mask; with images, each
  document's images to .pixels and their starts to .images (written at close)."""

  def __init__(self, directory: Path, name: str, dtype: np.dtype, has_mask: bool,
               has_images: bool = False):
    self.paths = {"bin": directory / f"{name}.bin", "idx": directory / f"{name}.idx"}
    if has_mask:
      self.paths["mask"] = directory / f"{name}.mask"
    if has_images:
      self.paths["pixels"] = directory / f"{name}.pixels"
      self.paths["images"] = directory / f"{name}.images"
    self.dtype = dtype
    self.starts = array.array("q", [0])
    self.image_starts = array.array("q", [0])
    self.files = {}
    for ext in ("bin", "mask", "pixels"):
      if ext in self.paths:
        self.files[ext] = open(self.paths[ext], "wb")

  def add(self, ids: np.ndarray, mask: np.ndarray | None, images: np.ndarray | None = None):
    # write(), not ndarray.tofile: tofile loses a failed write of a small array (a full disk)
    self.files["bin"].write(ids.astype(self.dtype).tobytes())
    if "mask" in self.files:
      self.files["mask"].write((np.ones(len(ids), np.uint8) if mask is None
                                else mask.astype(np.uint8)).tobytes())
    self.starts.append(self.starts[-1] + len(ids))
    if "pixels" in self.files:
      n = 0 if images is None else len(images)
      if n:
        self.files["pixels"].write(np.ascontiguousarray(images, np.uint8).tobytes())
      self.image_starts.append(self.image_starts[-1] + n)

  def close(self):
    for fh in self.files.values():
      fh.close()  # flushes: where a full disk shows
    self.paths["idx"].write_bytes(np.frombuffer(self.starts, np.int64).astype(np.uint64).tobytes())
    if "images" in self.paths:
      self.paths["images"].write_bytes(np.frombuffer(self.image_starts, np.int64)
                                       .astype(np.uint64).tobytes())


class _Split:
  """One split being written: its document files (one set, or chosen and rejected), each
  document's repeat count and source, and for pairs the prompt length."""

  def __init__(self, directory: Path, name: str, dtype: np.dtype, has_mask: bool, pairs: bool,
               image_bytes: int = 0):
    sides = ("chosen", "rejected") if pairs else ("",)
    self.sides = {s: _Docs(directory, f"{name}.{s}" if s else name, dtype, has_mask,
                           image_bytes > 0) for s in sides}
    self.image_bytes = image_bytes  # of one stored image; 0: no images
    self.repeats, self.sources, self.prefix = (array.array("q"), array.array("q"),
                                               array.array("q"))

  def add(self, pieces: list, repeats: int, source: int, prefix: int | None,
          images: np.ndarray | None = None):
    for docs, (ids, mask) in zip(self.sides.values(), pieces):
      docs.add(ids, mask) if images is None else docs.add(ids, mask, images)
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
    image_starts = np.frombuffer(docs.image_starts, np.int64) * raw.image_bytes
    lengths = np.diff(starts)
    src = {ext: np.memmap(p, dtype=docs.dtype if ext == "bin" else np.uint8, mode="r")
           for ext, p in docs.paths.items() if ext in ("bin", "mask", "pixels")
           and p.stat().st_size}
    for ext in ("bin", "mask", "pixels"):
      if ext not in docs.paths:
        continue
      at = image_starts if ext == "pixels" else starts
      with open(directory / f"{stem}.{ext}", "wb") as f:
        for lo in range(0, len(order), 4096):  # a few thousand documents per write
          part = order[lo:lo + 4096]
          if len(part) and ext in src:
            f.write(np.concatenate([src[ext][at[d]:at[d + 1]] for d in part]).tobytes())
    new_starts = np.concatenate([[0], np.cumsum(lengths[order])]).astype(np.uint64)
    (directory / f"{stem}.idx").write_bytes(new_starts.tobytes())
    if "images" in docs.paths:
      counts = np.diff(np.frombuffer(docs.image_starts, np.int64))[order]
      (directory / f"{stem}.images").write_bytes(
          np.concatenate([[0], np.cumsum(counts)]).astype(np.uint64).tobytes())
    del src
    for p in docs.paths.values():
      p.unlink()
  if pairs:
    prefix = np.frombuffer(raw.prefix, np.int64)[order].astype(np.uint64)
    (directory / f"{name}.prefix").write_bytes(prefix.tobytes())


# ---- stage 1: the tokenizer -------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Vocabulary:
  """The tokenizer prepare encodes with: its file, size and the ids it adds to documents."""
  file: Path  # tokenizer.json
  size: int  # ids, the added tokens included
  eos_id: int  # appended to each document
  pad_id: int  # the pad token's id, else eos_id
  fingerprint: str  # tokenizer_fingerprint(file), which train compares with the model's
  processor: Path | None = None  # the model's processor folder, whose images rows may hold
  images: dict | None = None  # ImageProcessor.stored() with the image token's id (meta.json's)
  no_images: str | None = None  # why rows with images cannot be prepared (None: they can)
  image_size: int | None = None  # Qwen-VL: the square side its processor was set to (at_size)

  @property
  def dtype(self) -> np.dtype:
    return np.dtype(np.uint16 if self.size <= 65536 else np.uint32)

  @property
  def image_bytes(self) -> int:
    """Bytes of one stored image; 0 without a processor."""
    i = self.images
    return 0 if i is None else i["height"] * i["width"] * i["channels"]


_PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")


def load_processor(req: Request, tok
                   ) -> tuple[Path | None, dict | None, str | None, int | None]:
  """(folder, stored record, None, Qwen-VL's square side) of --processor, or of the tokenizer's
  folder where it holds a processor's files; (None, None, why, None) where rows with images
  cannot be prepared. An explicit --processor (or --image-size) that cannot store its images is
  an error at once.

  A Qwen-VL processor resizes every image to --image-size pixels a side, or to the side its
  min_pixels = max_pixels pins; the other families' processors fix their own size."""
  from mtjax.data.images import ImageProcessor, QwenVLImages

  given = req.processor is not None
  folder = Path(req.processor) if given else chat.tokenizer_files(req.tokenizer)[0].parent
  if not any((folder / f).is_file() for f in _PROCESSOR_FILES):
    if given or req.image_size is not None:
      option = "--processor" if given else "--image-size"
      raise ValueError(f"{option}: {folder} holds no {' or '.join(_PROCESSOR_FILES)}")
    return None, None, (f"rows with images need the model's image processor: {folder} holds no "
                        f"{_PROCESSOR_FILES[0]}; pass --processor MODEL_DIR"), None
  try:
    proc = ImageProcessor.from_dir(folder)
  except ValueError as e:
    if given:
      raise ValueError(f"--processor: {e}") from None
    return None, None, f"{e} (the processor of {folder})", None
  side = req.image_size
  if side is None and isinstance(proc.images, QwenVLImages):
    side = proc.images.pinned_side
  if side is not None:
    try:
      proc = proc.at_size(side)
    except ValueError as e:
      raise ValueError(f"--image-size: {e} (the processor of {folder})") from None
  try:
    stored = proc.stored()
  except ValueError as e:
    if given:
      raise ValueError(f"--processor: {e}") from None
    return None, None, f"{e} (the processor of {folder})", None
  image_id = tok.token_to_id(stored["image_token"])
  if image_id is None:
    raise ValueError(f"--processor: the tokenizer has no {stored['image_token']} token, which "
                     f"{folder}'s processor expands each image to")
  return folder, {**stored, "image_token_id": image_id}, None, side


def load_vocabulary(req: Request) -> Vocabulary:
  """The tokenizer of --tokenizer, its EOS and pad ids; a chat format's template is checked too,
  before any input is read."""
  from tokenizers import Tokenizer  # the Rust library, loaded when used

  tok_file, _ = chat.tokenizer_files(req.tokenizer)
  tok_cfg = chat.load_tokenizer_config(req.tokenizer)
  try:
    tok = Tokenizer.from_file(str(tok_file))
  except Exception as e:  # noqa: BLE001 - the Rust side raises a plain Exception on a bad file
    raise ValueError(f"--tokenizer: {tok_file} is not a tokenizers JSON file ({e})") from None
  eos = req.eos or chat.token_text(tok_cfg.get("eos_token"))
  if eos is None:
    raise ValueError(f"--eos: {tok_file.parent} has no tokenizer_config.json eos_token; pass --eos")
  eos_id = tok.token_to_id(eos)
  if eos_id is None:
    raise ValueError(f"--eos: {eos!r} is not a token of {tok_file}")
  pad = chat.token_text(tok_cfg.get("pad_token"))
  pad_id = tok.token_to_id(pad) if pad is not None else None
  if req.fmt not in ("text", "jsonl", "auto"):  # no template, or a broken one: an error now
    chat.ChatTemplate.from_tokenizer(tok_file)
  return Vocabulary(tok_file, tok.get_vocab_size(with_added_tokens=True), eos_id,
                    eos_id if pad_id is None else pad_id, tokenizer_fingerprint(tok_file),
                    *load_processor(req, tok))


# ---- stage 2: the sources: files, formats, rows -----------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Source:
  name: str  # the input as given
  files: tuple  # (path, rows) of each readable file
  fmt: str  # the format its rows are read in (auto resolved)
  stats: Stats  # counted into while the source is read
  is_val: np.ndarray | None = None  # [rows] bool, the held-out rows (the plan's)
  repeats: np.ndarray | None = None  # [rows] int64 times each training row is taken (the plan's)

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


def _format_of(name: str, paths: list[Path], req: Request, log) -> str:
  """The format a source's rows are read in: --format, or under auto the first row's."""
  if req.fmt != "auto":
    return req.fmt
  if all(readers.kind(f) == "text" for f in paths):
    fmt = "text"
  else:
    row = _first_row(paths)
    if row is None:
      raise ValueError(f"--format auto: {name} holds no readable row to tell its format by")
    fmt = formats.detect(row, req.mapping)
  log(f"{name}: format {fmt} (auto)")
  return fmt


def resolve_sources(req: Request, log) -> list[_Source]:
  """Every input's files, format and row count (Parquet and Arrow from their metadata): the
  held-out share is exact, and a mixture's draws are fixed before anything is tokenized."""
  sources = []
  for name in req.inputs:
    stats = Stats(name)
    paths = readers.input_files(name)
    fmt = _format_of(name, paths, req, log)
    files = []
    for f in paths:
      try:
        files.append((f, readers.count(f, whole=_whole_text(f, fmt))))
      except BadFile as e:
        stats.skip("unreadable file", str(e), req.strict)
    stats.format, stats.rows = fmt, sum(n for _, n in files)
    sources.append(_Source(name, tuple(files), fmt, stats))
  if sum(s.rows for s in sources) == 0:
    skipped = any(s.stats.skipped for s in sources)
    raise ValueError(f"{list(req.inputs)}: no documents"
                     + (f" ({_skip_summary(sources)})" if skipped else ""))
  return sources


# ---- stage 3: the plan: held-out rows, a mixture's repeats, the disk ---------------------------

@dataclasses.dataclass(frozen=True)
class Plan:
  """What will be written: each source's held-out rows and repeats, and the kind of files."""
  sources: tuple[_Source, ...]  # with is_val and repeats
  pairs: bool  # preference pairs: chosen and rejected files per split
  has_mask: bool  # a loss mask per token (the chat formats)
  mask_method: str | None  # how the template's assistant tokens are found (chat.ChatTemplate)
  mixture: bool  # several sources, weights or epochs: the training documents are shuffled once

  @property
  def rows(self) -> int:
    return sum(s.rows for s in self.sources)


def _held_out(sources: list[_Source], req: Request) -> list[_Source]:
  """Each source with its held-out rows (an exact share, by seed) and the times each training row
  is taken: once, or as the weights or epochs of a mixture say."""
  is_val = []
  for i, s in enumerate(sources):
    n = s.rows
    if req.val_fraction > 0 and n < 2:
      raise ValueError(f"--val-fraction: {s.name} holds {n} document, which cannot be split; pass "
                       "--val-fraction 0")
    n_val = 0 if req.val_fraction == 0 else min(n - 1, max(1, round(req.val_fraction * n)))
    v = np.zeros(n, bool)
    v[np.random.default_rng([req.seed, i]).choice(n, n_val, replace=False)] = True
    is_val.append(v)
  n_train = [int((~v).sum()) for v in is_val]
  if req.weights is not None:
    targets = [round(w / sum(req.weights) * sum(n_train)) for w in req.weights]
  elif req.epochs is not None:
    targets = [round(e * n) for e, n in zip(req.epochs, n_train)]
  else:
    targets = n_train
  planned = []
  for i, (s, v, n, t) in enumerate(zip(sources, is_val, n_train, targets)):
    train = np.flatnonzero(~v)
    repeats = np.zeros(s.rows, np.int64)
    if n:
      whole, extra = divmod(t, n)
      repeats[train] = whole
      repeats[np.random.default_rng([req.seed, i, 1]).choice(train, extra, replace=False)] += 1
    planned.append(dataclasses.replace(s, is_val=v, repeats=repeats))
  return planned


def plan_splits(req: Request, vocab: Vocabulary, sources: list[_Source]) -> Plan:
  """The plan of what `sources` become; refuses a mix of pairs and documents, and (unless
  allow_low_disk) an --out whose disk has less free space than the output may take."""
  pairs = {s.fmt == "preference" for s in sources}
  if len(pairs) > 1:
    raise ValueError("--format: preference sources cannot be mixed with others in one prepare")
  pairs = pairs.pop()
  if pairs and req.options.train_on_prompt:
    raise ValueError("--train-on-prompt: preference pairs count their answers only")
  has_mask = any(s.fmt not in ("text", "jsonl") for s in sources)
  # no template, or a broken one, is an error here, not in a worker
  mask_method = chat.ChatTemplate.from_tokenizer(vocab.file).mask_method if has_mask else None
  plan = Plan(tuple(_held_out(sources, req)), pairs, has_mask, mask_method,
              len(sources) > 1 or req.weights is not None or req.epochs is not None)
  if not req.allow_low_disk:
    check_disk(req.out, output_estimate(list(plan.sources), vocab.dtype, has_mask, pairs))
  return plan


def _rows(sources, mapping: Mapping, strict: bool, no_images: str | None = None):
  """Yields (where, document, split, repeats, source) for every used row of every source; bad rows
  and unreadable files are counted in the stats (or raised with `strict`). A row with images is
  an error where they cannot be prepared (`no_images` says why)."""
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
          if isinstance(doc, ImageChat):
            if no_images:
              raise ValueError(f"{where}: {no_images}")
            doc = dataclasses.replace(doc, base=str(f.parent))
          yield where, doc, split, int(s.repeats[k]), i
      except BadFile as e:  # past the rows already read: the rest of the file is skipped
        s.stats.skip("unreadable file", str(e), strict, n=max(0, base + n - j))
      base += n


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
      import pyarrow.parquet as pq
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



# ---- stage 4: tokenizing into the temporary folder ---------------------------------------------

def _fit(ids: np.ndarray, mask, opts: Options, stats: Stats, where: str, strict: bool):
  """ids and mask cut to opts.max_len (or None when dropped: counted as skipped)."""
  if opts.max_len is None or len(ids) <= opts.max_len:
    return ids, mask
  if opts.overflow == "drop":
    stats.skip("longer than --max-len", f"{where}: {len(ids)} tokens > --max-len {opts.max_len}",
               strict)
    return None
  return ids[:opts.max_len], (None if mask is None else mask[:opts.max_len])


def _examples(result: tuple, where: str, req: Request, plan: Plan, stats: Stats) -> list | None:
  """A worker's result as the (ids, mask) of each side to write, or None when it is skipped."""
  if result[0] == "bad":
    stats.skip(result[1], result[2], req.strict)
    return None
  opts = req.options
  sides = [result[1:3]] if result[0] == "doc" else [result[1:3], result[3:5]]
  if opts.train_on_prompt and plan.has_mask:
    sides = [(ids, np.ones(len(ids), np.uint8)) for ids, _ in sides]
  fitted = [_fit(ids, m, opts, stats, where, req.strict) for ids, m in sides]
  if any(f is None for f in fitted):
    return None
  if any(len(f[0]) < len(s[0]) for f, s in zip(fitted, sides)):
    stats.truncated += 1
  if plan.has_mask and not all(m is None or m[1:].any() for _, m in fitted):
    stats.skip("no target within --max-len", f"{where}: no token the loss counts within "
               f"--max-len {opts.max_len}", req.strict)
    return None
  return fitted


def _whole_images(ids: np.ndarray, mask: np.ndarray, images: np.ndarray | None,
                  vocab: Vocabulary, where: str, strict: bool, stats: Stats):
  """The images whose tokens a (maybe truncated) document still holds; False (counted as skipped)
  where --max-len cut through an image's tokens."""
  if images is None:
    return None
  info = vocab.images
  mask[ids == info["image_token_id"]] = 0  # --train-on-prompt too: never an image token
  held = int(np.sum(ids == info["image_token_id"]))
  whole, part = divmod(held, info["tokens_per_image"])
  if part:
    stats.skip("image cut by --max-len", f"{where}: --max-len cuts through image {whole + 1}'s "
               "tokens", strict)
    return False
  return images[:whole]


def tokenize_into(tmp: Path, req: Request, vocab: Vocabulary, plan: Plan, progress: bool
                  ) -> dict[str, _Split]:
  """Tokenizes every used row into `tmp` in the sources' order (a mixture's training split as
  train.raw.*, with each document's repeats) and counts it into the sources' stats."""
  from tqdm import tqdm

  splits = {s: _Split(tmp, f"{s}.raw" if s == "train" and plan.mixture else s, vocab.dtype,
                      plan.has_mask, plan.pairs, 0 if plan.pairs else vocab.image_bytes)
            for s in SPLITS}
  init = (str(vocab.file), vocab.eos_id, plan.has_mask, req.options.last_turn_only,
          None if vocab.processor is None or plan.pairs else str(vocab.processor),
          vocab.image_size)
  rows = _chunks(_rows(plan.sources, req.mapping, req.strict, vocab.no_images), _CHUNK)
  try:
    with (_encoder(req.workers, init) as encode,
          tqdm(total=plan.rows, unit="doc", disable=not progress, desc="tokenizing") as bar):
      for chunk, encoded in encode(rows):
        for (where, _, split, repeats, i), result in zip(chunk, encoded):
          stats = plan.sources[i].stats
          fitted = _examples(result, where, req, plan, stats)
          if fitted is None:
            continue
          images = None if plan.pairs else _whole_images(*fitted[0], result[3], vocab, where,
                                                         req.strict, stats)
          if images is False:
            continue
          n = repeats if split == "train" else 1  # held-out rows are never repeated
          splits[split].add(fitted, n, i, result[5] if plan.pairs else None, images)
          stats.images[split] += 0 if images is None else len(images) * n
          stats.documents[split] += n
          stats.tokens[split] += len(fitted[0][0]) * n
        bar.update(len(chunk))
  finally:
    for s in splits.values():
      s.close()
  return splits


# ---- stage 5: finishing: the mixture's order, meta.json, the checks -----------------------------

def _meta(req: Request, vocab: Vocabulary, plan: Plan) -> dict:
  """meta.json's description of the data (the counts and checksums are added when written)."""
  fmts = [s.fmt for s in plan.sources]
  meta = {
      "format": req.fmt if req.fmt != "auto" else fmts[0] if len(fmts) == 1 else "mixture",
      "formats": fmts, "pairs": plan.pairs,
      "dtype": vocab.dtype.name, "vocab_size": vocab.size, "eos_id": vocab.eos_id,
      "pad_id": vocab.pad_id, "has_mask": plan.has_mask, "seed": req.seed,
      "val_fraction": req.val_fraction, "tokenizer": str(vocab.file),
      "tokenizer_fingerprint": vocab.fingerprint, "inputs": list(req.inputs),
      "columns": req.columns, "roles": req.roles,
      "weights": None if req.weights is None else list(req.weights),
      "epochs": None if req.epochs is None else list(req.epochs), "shuffled": plan.mixture,
      **dataclasses.asdict(req.options),
  }
  if plan.mask_method:
    meta["mask_method"] = plan.mask_method
  if vocab.images is not None and not plan.pairs:
    meta["images"] = {**vocab.images, "processor": str(vocab.processor)}
  return meta


def finish(tmp: Path, req: Request, vocab: Vocabulary, plan: Plan, splits: dict[str, _Split]
           ) -> dict:
  """Puts a mixture's training documents in one seeded shuffle (repeats included), writes the
  pairs' prompt lengths, stats.json and meta.json, and opens every split as training will."""
  if plan.mixture:
    raw = splits["train"]
    order = np.repeat(np.arange(len(raw.repeats)), np.frombuffer(raw.repeats, np.int64))
    order = order[np.random.default_rng([req.seed, 2]).permutation(len(order))]
    _shuffled(tmp, raw, "train", order, plan.pairs)
  elif plan.pairs:
    for name, s in splits.items():
      (tmp / f"{name}.prefix").write_bytes(np.frombuffer(s.prefix, np.int64)
                                           .astype(np.uint64).tobytes())
  sources = plan.sources
  counts = {s: {"documents": sum(x.stats.documents[s] for x in sources),
                "tokens": sum(x.stats.tokens[s] for x in sources)} for s in SPLITS}
  if vocab.images is not None and not plan.pairs:
    for s in SPLITS:
      counts[s]["images"] = sum(x.stats.images[s] for x in sources)
  if plan.pairs:  # each side's token count, which read_pairs checks the files against
    for name in SPLITS:
      counts[name]["sides"] = {side: (tmp / f"{name}.{side}.bin").stat().st_size
                               // vocab.dtype.itemsize for side in ("chosen", "rejected")}
  if counts["train"]["documents"] == 0:
    raise ValueError(f"{list(req.inputs)}: no training documents left ({_skip_summary(sources)})")
  meta = {**_meta(req, vocab, plan), "splits": counts,
          "stats": [s.stats.as_dict() for s in sources]}
  meta["checksums"] = {p.name: checksum(p) for p in sorted(tmp.iterdir())}
  (tmp / "stats.json").write_text(json.dumps(meta["stats"], indent=1) + "\n")
  (tmp / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
  _verify(tmp, meta)
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


# ---- the output folder: checked, staged beside --out, swapped in --------------------------------

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


@contextlib.contextmanager
def _staging(out: Path):
  """A temporary folder beside `out`, put in its place when the block ends and removed however it
  ends (an error, Ctrl-C, a signal the CLI raises as an exception): `out` stays as it was.

  A failed write is re-raised as an OSError with the cause's errno and a message naming --out."""
  tmp = out.parent / f".{out.name}.prepare-tmp"
  old = out.parent / f".{out.name}.prepare-old"
  try:
    shutil.rmtree(tmp, ignore_errors=True)  # what a killed run left: a re-run starts over
    shutil.rmtree(old, ignore_errors=True)
    tmp.mkdir(parents=True)
    yield tmp
    _swap(tmp, out, old)
  except OSError as e:  # a full disk, a read-only or vanished folder: one line, not a traceback
    failed = OSError(f"--out: cannot write {e.filename or out} ({e.strerror or e})")
    failed.errno = e.errno  # what exits.of_os_error tells a full disk by
    raise failed from None
  finally:
    shutil.rmtree(tmp, ignore_errors=True)


def _swap(tmp: Path, out: Path, old: Path):
  """Renames `tmp` to `out` (an earlier `out` set aside first, then removed) with SIGINT and
  SIGTERM held back: a stop lands before the swap or after it, never between the renames."""
  held = signal.pthread_sigmask(signal.SIG_BLOCK, _STOPS)
  try:
    if out.exists():
      os.rename(out, old)
    try:
      os.rename(tmp, out)
    except OSError:
      if old.exists() and not out.exists():
        os.rename(old, out)
      raise
    shutil.rmtree(old, ignore_errors=True)
  finally:
    signal.pthread_sigmask(signal.SIG_SETMASK, held)


# ---- the command -------------------------------------------------------------------------------

def run(req: Request, progress: bool = True, log=None) -> dict:
  """Prepares `req` (the module docstring tells the stages and the files).

  Args:
    req: what to prepare.
    progress: show a tqdm bar.
    log: called with each line of news (the auto-detected formats); None: quiet.

  Returns:
    The meta.json contents; "stats" holds the per-source counts of stats.json.

  Raises:
    ValueError: a bad argument or input (one line naming it).
    OSError: an input cannot be read, or --out cannot be written (its errno says why).
  """
  log = log or (lambda line: None)
  _check_out(req.out)
  vocab = load_vocabulary(req)
  plan = plan_splits(req, vocab, resolve_sources(req, log))
  with _staging(req.out) as tmp:
    meta = finish(tmp, req, vocab, plan, tokenize_into(tmp, req, vocab, plan, progress))
  return meta


def prepare(tokenizer: str | Path, out: str | Path, inputs: list[str], fmt: str = "auto", *,
            progress: bool = True, log=None, **settings) -> dict:
  """Tokenizes `inputs` into the prepared directory `out`: run(Request(...), progress, log).

  Args:
    tokenizer: a directory holding tokenizer.json (and tokenizer_config.json), or tokenizer.json.
    out: the directory to write.
    inputs: the sources.
    fmt: one of formats.FORMATS; auto picks each source's format from its first row.
    progress: show a tqdm bar.
    log: called with each line of news; None: quiet.
    **settings: the other fields of Request (val_fraction, columns, weights, options, ...).
  """
  return run(Request(tokenizer, out, tuple(inputs), fmt, **settings), progress, log)


def _skip_summary(sources) -> str:
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
                 + (f", {s['truncated']} truncated" if s["truncated"] else "")
                 + (f", images train {s['images']['train']} / val {s['images']['val']}"
                    if any(s.get("images", {}).values()) else ""))
    for reason, e in s["skipped"].items():
      lines.append(f"  skipped {e['count']} ({reason}); first: {e['first']}")
  return lines
