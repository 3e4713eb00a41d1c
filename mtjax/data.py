"""Token batches: a learnable synthetic stream and a flat token file, both a pure function of step."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from mtjax.config import DataConfig


@dataclasses.dataclass(frozen=True)
class Batch:
  inputs: np.ndarray  # [B, T] int32
  targets: np.ndarray  # [B, T] int32, inputs shifted left by one


def synthetic_batch(step: int, batch: int, seq: int, vocab: int, seed: int) -> Batch:
  """Arithmetic sequences (start + stride * t) mod vocab with a per-sequence random start and a
  stride from {1, 2, 3}: after two tokens every next token is determined, so loss can fall far."""
  rng = np.random.default_rng([seed, step])
  start = rng.integers(0, vocab, size=(batch, 1))
  stride = rng.integers(1, 4, size=(batch, 1))
  toks = (start + stride * np.arange(seq + 1)[None, :]) % vocab
  toks = toks.astype(np.int32)
  return Batch(toks[:, :-1], toks[:, 1:])


class TokenFile:
  """A flat file of token ids (raw uint16 or uint32); batches are windows at seeded offsets."""

  def __init__(self, path: str | Path, dtype: str, vocab: int):
    path = Path(path)
    if not path.exists():
      raise FileNotFoundError(f"data.path: token file {path} does not exist")
    self.tokens = np.memmap(path, dtype=np.dtype(dtype), mode="r")
    self.vocab = vocab
    self.path = path

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


def batches(cfg: DataConfig, batch: int, seq: int, vocab: int, seed: int, start_step: int = 0):
  """Yields the batch of each step from `start_step` on; the same step always gives the same batch."""
  source = TokenFile(cfg.path, cfg.dtype, vocab) if cfg.source == "tokens" else None
  step = start_step
  while True:
    if source is None:
      yield synthetic_batch(step, batch, seq, vocab, seed)
    else:
      yield source.batch(step, batch, seq, seed)
    step += 1
