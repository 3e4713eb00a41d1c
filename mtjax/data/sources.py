"""Where training batches come from, each a pure function of the step: the synthetic stream, a flat
token file, and prepared documents (`python -m mtjax.data prepare`), packed with document masks or
padded (with each row's images, for a vision-language model); and the held-out batches of a
prepared val split."""

from __future__ import annotations

import collections
import dataclasses
import json
from pathlib import Path
from typing import Iterator

import numpy as np

from mtjax.config import DataConfig, VisionConfig
from mtjax.data.batch import Batch, Synthetic


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
  """A TokenFile as a source: batch(step), position(step) and epoch(step)."""

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

  def epoch(self, step: int) -> int:
    """The pass over the file `step` ends in, 0 first. Windows start at random offsets, so a pass
    is a file's worth of tokens: steps 0..step train on (step + 1) * batch * seq of them."""
    B, T = self.shape
    return ((step + 1) * B * T - 1) // self.file.tokens.shape[0]


# ---------------------------------------------------------------------------------------------
# Prepared documents: DIR/{split}.bin (tokens), .idx (uint64 document starts plus the end),
# .mask (uint8, chat only: 1 where a token is a target the loss counts), with images .pixels
# (uint8 [N, H, W, 3] at the processor's size) and .images (uint64 image starts per document plus
# the end), and meta.json, which holds a crc32c of every file (checked once per process and file
# when the data is opened).

SPLITS = ("train", "val")
_CHECKED: set = set()  # (path, size, mtime_ns) of the files whose checksum matched meta.json


def checksum(path: str | Path) -> str:
  """The crc32c of a file as 8 hex digits, read in 16 MiB pieces."""
  import google_crc32c

  crc = 0
  with open(path, "rb") as f:
    while piece := f.read(1 << 24):
      crc = google_crc32c.extend(crc, piece)
  return f"{crc:08x}"


def _check_files(path: Path, meta: dict, files: dict[str, int]):
  """Checks each file's size (name -> bytes meta.json implies) and its crc32c in meta.json."""
  sums = meta.get("checksums", {})
  for name, size in files.items():
    f = path / name
    if not f.is_file():
      raise FileNotFoundError(f"data.path: {f} does not exist")
    st = f.stat()
    if st.st_size != size:
      raise ValueError(f"data.path: {f} holds {st.st_size} bytes; meta.json implies {size}")
    key = (str(f.resolve()), st.st_size, st.st_mtime_ns)
    if name in sums and key not in _CHECKED:
      if checksum(f) != sums[name]:
        raise ValueError(f"data.path: {f} does not match its crc32c in meta.json (altered or "
                         "damaged; prepare the data again)")
      _CHECKED.add(key)


def read_meta(path: Path) -> dict:
  """The meta.json of a prepared directory; FileNotFoundError / ValueError naming it otherwise."""
  meta_path = path / "meta.json"
  if not path.is_dir():
    raise FileNotFoundError(f"data.path: prepared directory {path} does not exist")
  if not meta_path.is_file():
    raise FileNotFoundError(f"data.path: {meta_path} does not exist (run python -m mtjax.data "
                            "prepare, which writes it last)")
  try:
    meta = json.loads(meta_path.read_text())
    if not isinstance(meta, dict):
      raise TypeError("not an object")
  except (ValueError, TypeError) as e:
    raise ValueError(f"data.path: {meta_path} is not a prepared-data meta.json ({e!r})") from None
  return meta


def vocab_error(where: str | Path, meta: dict, vocab_size: int) -> str:
  """The one line refusing data whose vocabulary is larger than model.vocab_size: a model built
  without model.from_hf, or from another model than the one whose tokenizer made the data."""
  tok = meta.get("tokenizer")
  made = f"the tokenizer {tok}" if tok else "a tokenizer"
  return (f"data.path: {where} was prepared with {made} whose vocabulary is {meta['vocab_size']}, "
          f"more than model.vocab_size ({vocab_size}): set model.from_hf to that model (or "
          f"model.vocab_size to at least {meta['vocab_size']})")


class Prepared:
  """One split of a prepared directory, checked against meta.json before any batch is built."""

  def __init__(self, path: str | Path, split: str, vocab: int):
    path = Path(path)
    meta_path = path / "meta.json"
    meta = read_meta(path)
    if meta.get("pairs"):
      raise ValueError(f"data.path: {path} holds preference pairs (read by train.objective dpo, "
                       "mtjax.data.read_pairs), not documents")
    try:
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
      raise ValueError(vocab_error(path, meta, vocab))
    if n_docs < 1:
      raise ValueError(f"data.path: split {split!r} of {path} holds no documents")
    files = {f"{split}.bin": n_tokens * dtype.itemsize, f"{split}.idx": (n_docs + 1) * 8}
    if meta.get("has_mask"):
      files[f"{split}.mask"] = n_tokens
    self.image_info = meta.get("images")
    n_images = 0
    if self.image_info is not None:
      try:
        n_images = int(info["images"])
        shape = tuple(int(self.image_info[k]) for k in ("height", "width", "channels"))
      except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"data.path: {meta_path} is not a prepared-data meta.json ({e!r})"
                         ) from None
      files[f"{split}.images"] = (n_docs + 1) * 8
      files[f"{split}.pixels"] = n_images * int(np.prod(shape))
    _check_files(path, meta, files)
    self.path, self.split, self.meta = path, split, meta
    self.vocab, self.pad_id = data_vocab, pad_id
    self.tokens = np.memmap(path / f"{split}.bin", dtype=dtype, mode="r")
    self.starts = np.fromfile(path / f"{split}.idx", dtype=np.uint64).astype(np.int64)
    self.mask = (np.memmap(path / f"{split}.mask", dtype=np.uint8, mode="r")
                 if meta.get("has_mask") else None)
    self.lengths = np.diff(self.starts)
    self.image_starts, self.pixels = None, None
    if self.image_info is not None:
      self.image_starts = np.fromfile(path / f"{split}.images", np.uint64).astype(np.int64)
      if (self.image_starts[0] != 0 or self.image_starts[-1] != n_images
          or np.any(np.diff(self.image_starts) < 0)):
        raise ValueError(f"data.path: {path / (split + '.images')} is not a sorted list of image "
                         f"starts from 0 to {n_images}")
      self.pixels = (np.memmap(path / f"{split}.pixels", np.uint8, mode="r", shape=(n_images, *shape))
                     if n_images else np.zeros((0, *shape), np.uint8))
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

  @property
  def n_images(self) -> int:
    return 0 if self.pixels is None else len(self.pixels)

  def images(self, doc: int) -> np.ndarray:
    """The images of document `doc` as stored: [n, H, W, C] uint8 (n = 0 without images)."""
    if self.pixels is None:
      return np.zeros((0, 1, 1, 3), np.uint8)
    return np.asarray(self.pixels[self.image_starts[doc]:self.image_starts[doc + 1]])

  def check_images(self, vision: VisionConfig | None, mode: str) -> None:
    """Refuses, in one line, images that model.vision cannot take, and packed rows of them."""
    if not self.n_images:
      return
    where, info = self.path, self.image_info
    if mode == "packed":
      raise ValueError(f"data.mode: packed rows cut documents anywhere, and {where} holds images "
                       "(each must come whole with its tokens); set data.mode=padded")
    if vision is None:
      raise ValueError(f"data.path: {where} holds images, and the model has no vision tower "
                       "(model.vision): train a vision-language model on it (model.from_hf)")
    made = f"{where} was prepared by the processor of {info.get('processor')}"
    size = (int(info["height"]), int(info["width"]))
    if size != (vision.image_size, vision.image_size) or int(info["channels"]) != vision.channels:
      raise ValueError(f"data.path: {made} for {size[0]}x{size[1]} images, the model's tower takes "
                       f"{vision.image_size}x{vision.image_size} (model.vision.image_size); "
                       "prepare it again with the model's processor")
    if info.get("patch") is not None and (
        (int(info["patch"]), int(info["merge"]), int(info["temporal_patch"]))
        != (vision.patch, vision.merge, vision.temporal_patch)):
      raise ValueError(f"data.path: {made} for patches of {info['patch']} pixels, "
                       f"{info['merge']} x {info['merge']} to a token, {info['temporal_patch']} "
                       f"frames; the model's tower takes {vision.patch}, {vision.merge} x "
                       f"{vision.merge}, {vision.temporal_patch} (model.vision.patch, merge, "
                       "temporal_patch); prepare it again with the model's processor")
    from mtjax.data.images import pixel_shape
    if pixel_shape(info) != vision.image_shape:
      raise ValueError(f"data.path: {made} ({info.get('family')}) as images of shape "
                       f"{list(pixel_shape(info))}, the model's {vision.tower} tower takes "
                       f"{list(vision.image_shape)}; prepare it again with the model's processor")
    if (int(info["image_token_id"]), int(info["tokens_per_image"])) != (
        vision.image_token_id, vision.image_tokens):
      raise ValueError(f"data.path: {made}: {info['tokens_per_image']} tokens of id "
                       f"{info['image_token_id']} per image, the model takes "
                       f"{vision.image_tokens} of id {vision.image_token_id} "
                       "(model.vision.image_token_id); prepare it again with the model's processor")

  def batch_images(self, docs: list, vision: VisionConfig) -> np.ndarray:
    """The images of one document per row ([B, M, *image_shape] float32: [C, H, W] pixels, or a
    Qwen-VL tower's patches [S, C x frames x patch^2], as the processor gives them; a row's unused
    slots and a row without a document (None) are zeros)."""
    from mtjax.data.images import pixel_values, pixel_shape

    B, M = len(docs), vision.max_images
    out = np.zeros((B, M, *pixel_shape(self.image_info)), np.float32)
    for b, d in enumerate(docs):
      if d is None:
        continue
      px = self.images(d)
      if len(px) > M:
        raise ValueError(f"data.path: document {d} of {self.path} holds {len(px)} images, more "
                         f"than model.vision.max_images ({M})")
      if len(px):
        out[b, :len(px)] = pixel_values(px, self.image_info)
    return out

  def most_images(self, docs: np.ndarray) -> int:
    """The most images one of `docs` holds."""
    if self.image_starts is None or not len(docs):
      return 0
    return int(np.max(self.image_starts[docs + 1] - self.image_starts[docs]))

  def piece(self, doc: int, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray | None]:
    """Tokens [lo, hi) of document `doc` and their loss mask (None: every token counts)."""
    a = int(self.starts[doc])
    toks = np.asarray(self.tokens[a + lo:a + hi]).astype(np.int64)
    mask = None if self.mask is None else np.asarray(self.mask[a + lo:a + hi])
    return toks, mask


@dataclasses.dataclass(frozen=True)
class Pairs:
  """The preference pairs of a prepared split (`prepare --format preference`).

  Pair i is document i of each side: the chosen side's ids are
  chosen[chosen_starts[i]:chosen_starts[i + 1]] with the loss mask chosen_mask over the same range
  (1 on the answer's tokens, its end-of-turn token included), and likewise for the rejected side.
  Both sides begin with the same prefix[i] tokens, the prompt rendered by the chat template; the
  answer starts at prefix[i]. Token arrays are memory maps of the files.
  """
  chosen: np.ndarray  # [N_chosen] token ids, uint16 or uint32
  chosen_starts: np.ndarray  # [n + 1] int64 document starts plus the end
  chosen_mask: np.ndarray  # [N_chosen] uint8
  rejected: np.ndarray  # [N_rejected]
  rejected_starts: np.ndarray  # [n + 1] int64
  rejected_mask: np.ndarray  # [N_rejected] uint8
  prefix: np.ndarray  # [n] int64 length of the prompt both sides share
  vocab_size: int
  pad_id: int
  eos_id: int

  def __len__(self) -> int:
    return len(self.prefix)

  def pair(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(chosen ids, chosen mask, rejected ids, rejected mask) of pair i, as int64 / uint8 arrays."""
    c0, c1 = int(self.chosen_starts[i]), int(self.chosen_starts[i + 1])
    r0, r1 = int(self.rejected_starts[i]), int(self.rejected_starts[i + 1])
    return (np.asarray(self.chosen[c0:c1], np.int64), np.asarray(self.chosen_mask[c0:c1]),
            np.asarray(self.rejected[r0:r1], np.int64), np.asarray(self.rejected_mask[r0:r1]))


def read_pairs(path: str | Path, split: str = "train", vocab: int | None = None) -> Pairs:
  """Opens the preference pairs of a prepared directory, checked against meta.json.

  Files: {split}.chosen.bin/.idx/.mask, {split}.rejected.bin/.idx/.mask (as a document split's
  .bin/.idx/.mask) and {split}.prefix (uint64 per pair: the shared prompt's length).

  Args:
    path: the prepared directory.
    split: train or val.
    vocab: model.vocab_size, when every token id must be below it; None: meta.json's.

  Returns:
    The split's Pairs. Raises ValueError / FileNotFoundError (one line naming the file) on a
    directory that is not preference data, or files of the wrong size or checksum.
  """
  path = Path(path)
  meta = read_meta(path)
  if not meta.get("pairs"):
    raise ValueError(f"data.path: {path} holds documents, not preference pairs (prepare with "
                     "--format preference)")
  try:
    dtype = np.dtype(meta["dtype"])
    info = meta["splits"][split]
    n, sides = int(info["documents"]), info["sides"]
    data_vocab = int(meta["vocab_size"])
  except (ValueError, KeyError, TypeError) as e:
    raise ValueError(f"data.path: {path / 'meta.json'} is not a prepared-data meta.json "
                     f"({e!r})") from None
  if vocab is not None and data_vocab > vocab:
    raise ValueError(vocab_error(path, meta, vocab))
  files = {f"{split}.prefix": n * 8}
  for side in ("chosen", "rejected"):
    t = int(sides[side])
    files.update({f"{split}.{side}.bin": t * dtype.itemsize, f"{split}.{side}.idx": (n + 1) * 8,
                  f"{split}.{side}.mask": t})
  _check_files(path, meta, files)
  arrays = {}
  for side in ("chosen", "rejected"):
    stem = path / f"{split}.{side}"
    starts = np.fromfile(f"{stem}.idx", np.uint64).astype(np.int64)
    if starts[0] != 0 or starts[-1] != int(sides[side]) or np.any(np.diff(starts) <= 0):
      raise ValueError(f"data.path: {stem}.idx is not a sorted list of document starts")
    arrays[side] = np.memmap(f"{stem}.bin", dtype=dtype, mode="r") if starts[-1] else \
        np.zeros(0, dtype)
    arrays[f"{side}_starts"] = starts
    arrays[f"{side}_mask"] = np.memmap(f"{stem}.mask", dtype=np.uint8, mode="r") if starts[-1] \
        else np.zeros(0, np.uint8)
  prefix = np.fromfile(path / f"{split}.prefix", np.uint64).astype(np.int64)
  return Pairs(**arrays, prefix=prefix, vocab_size=data_vocab, pad_id=int(meta["pad_id"]),
               eos_id=int(meta["eos_id"]))


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

  def __init__(self, data: Prepared, mode: str, batch: int, seq: int, seed: int, vocab: int,
               vision: VisionConfig | None = None):
    self.data, self.mode, self.shape, self.seed = data, mode, (batch, seq), seed
    self.model_vocab = vocab
    data.check_images(vision, mode)
    self.vision = vision if data.n_images else None  # rows carry images
    if mode == "packed":
      self.per_epoch = (data.n_tokens - 1) // seq
      if self.per_epoch < 1:
        raise ValueError(f"data.path: split {data.split!r} of {data.path} holds {data.n_tokens} "
                         f"tokens, fewer than train.seq + 1 ({seq + 1})")
      self.docs = np.arange(data.n_docs)
    else:
      self.docs = _with_targets(data, seq)
      self.per_epoch = len(self.docs)
      if self.vision is not None:
        _check_max_images(data, self.docs, self.vision)
    self._epochs: collections.OrderedDict = collections.OrderedDict()

  def _epoch(self, e: int) -> tuple[np.ndarray, np.ndarray]:
    """The epoch's document order and, packed, the stream offset where each of them ends."""
    if e not in self._epochs:
      order = self.docs[np.random.default_rng([self.seed, e]).permutation(len(self.docs))]
      self._epochs[e] = (order, np.cumsum(self.data.lengths[order]))
      while len(self._epochs) > 2:  # a step's rows span at most two epochs
        self._epochs.popitem(last=False)
    return self._epochs[e]

  def _doc(self, g: int) -> int:
    """The document of padded row `g`."""
    e, i = divmod(g, self.per_epoch)
    return int(self._epoch(e)[0][i])

  def _pieces(self, g: int) -> list:
    e, i = divmod(g, self.per_epoch)
    order, ends = self._epoch(e)
    seq = self.shape[1]
    if self.mode == "padded":
      d = self._doc(g)
      return [self.data.piece(d, 0, min(int(self.data.lengths[d]), seq + 1))]
    return _cut(self.data, order, ends, i * seq, i * seq + seq + 1)

  def batch(self, step: int) -> Batch:
    B, T = self.shape
    rows = [_row(self._pieces(step * B + b), T, self.data.pad_id) for b in range(B)]
    out = _stack(rows, self.model_vocab, str(self.data.path))
    if self.vision is None:
      return out
    docs = [self._doc(step * B + b) for b in range(B)]
    return dataclasses.replace(out, images=self.data.batch_images(docs, self.vision))

  def epoch(self, step: int) -> int:
    """The epoch `step`'s batch ends in, 0 first: epoch e begins at the first step with
    epoch(step) == e, the one holding its first row (whose earlier rows may end epoch e - 1)."""
    B = self.shape[0]
    return (step * B + B - 1) // self.per_epoch

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


def _check_max_images(data: Prepared, docs: np.ndarray, vision: VisionConfig) -> None:
  most = data.most_images(docs)
  if most > vision.max_images:
    raise ValueError(f"data.path: a document of {data.path} holds {most} images, more than "
                     f"model.vision.max_images ({vision.max_images}); set "
                     f"model.vision.max_images={most}")


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


def source(cfg: DataConfig, batch: int, seq: int, vocab: int, seed: int,
           vision: VisionConfig | None = None):
  """The configured data as an object with batch(step) -> Batch, position(step) -> dict (where the
  step begins, saved with a checkpoint) and epoch(step) -> int (the pass over the data the step
  ends in, 0 first), each a pure function of the step.

  Args:
    cfg: the data section of the config.
    batch: rows per step (train.batch).
    seq: tokens per row (train.seq).
    vocab: model.vocab_size; every token id must be below it.
    seed: seeds the order of the data (train.seed).
    vision: model.vision: the rows of prepared data with images carry them (Batch.images).

  Returns:
    The source; checks files and sizes when built, before any batch.
  """
  if cfg.source == "tokens":
    return _TokenWindows(cfg, batch, seq, vocab, seed)
  if cfg.source == "prepared":
    return PreparedSource(Prepared(cfg.path, cfg.split, vocab), cfg.mode, batch, seq, seed, vocab,
                          vision)
  return Synthetic(batch, seq, vocab, seed)


def batches(cfg: DataConfig, batch: int, seq: int, vocab: int, seed: int, start_step: int = 0,
            vision: VisionConfig | None = None):
  """Yields the batch of each step from `start_step` on; a step always gives the same batch."""
  src = source(cfg, batch, seq, vocab, seed, vision)
  step = start_step
  while True:
    yield src.batch(step)
    step += 1


def position(cfg: DataConfig, batch: int, seq: int, vocab: int, seed: int, step: int) -> dict:
  """Where `step`'s batch lies in the data (epoch, index in it, ...), saved with a checkpoint."""
  return source(cfg, batch, seq, vocab, seed).position(step)


def validation_batches(cfg: DataConfig, batch: int, seq: int, vocab: int, split: str = "val",
                       vision: VisionConfig | None = None) -> Iterator[Batch]:
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
    vision: model.vision: rows with images carry them (Batch.images).

  Returns:
    A finite iterator of Batch.
  """
  if cfg.source != "prepared":
    raise ValueError(f"data.source: held-out batches need 'prepared' data, not {cfg.source!r}")
  data = Prepared(cfg.path, split, vocab)
  data.check_images(vision, cfg.mode)
  with_images = vision is not None and data.n_images > 0
  order = np.arange(data.n_docs)
  docs = None
  if cfg.mode == "packed":
    ends = np.cumsum(data.lengths)
    n_rows = -(-(data.n_tokens - 1) // seq)
    row = lambda r: _cut(data, order, ends, r * seq, r * seq + seq + 1)
  else:
    docs = _with_targets(data, seq)
    n_rows = len(docs)
    row = lambda r: [data.piece(int(docs[r]), 0, min(int(data.lengths[docs[r]]), seq + 1))]
    if with_images:
      _check_max_images(data, docs, vision)

  def gen():
    for r0 in range(0, n_rows, batch):
      rows = [_row(row(r) if r < n_rows else [], seq, data.pad_id) for r in range(r0, r0 + batch)]
      out = _stack(rows, vocab, str(data.path))
      if with_images:
        held = [int(docs[r]) if r < n_rows else None for r in range(r0, r0 + batch)]
        out = dataclasses.replace(out, images=data.batch_images(held, vision))
      yield out

  return gen()
