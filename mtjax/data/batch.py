"""A training batch, and the synthetic stream: each batch a pure function of the step."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Batch:
  inputs: np.ndarray  # [B, T] int32
  targets: np.ndarray  # [B, T] int32, inputs shifted left by one within a document
  positions: np.ndarray | None = None  # [B, T] int32 RoPE positions, 0 at each document's start
  segments: np.ndarray | None = None  # [B, T] int32 document ids in a row; padding has its own
  loss_weights: np.ndarray | None = None  # [B, T] float32 weight of each target; None: all 1
  images: np.ndarray | None = None  # [B, M, *image_shape] float32 of each row's image slots (model.vision): pixels [C, H, W], or a Qwen-VL tower's patches [S, C x frames x patch^2] (mtjax.models.vision.image_shape); None: no images


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
  """The synthetic stream as a source: batch(step), position(step) and epoch(step)."""

  def __init__(self, batch: int, seq: int, vocab: int, seed: int):
    self.shape, self.vocab, self.seed = (batch, seq), vocab, seed

  def batch(self, step: int) -> Batch:
    return synthetic_batch(step, *self.shape, self.vocab, self.seed)

  def position(self, step: int) -> dict:
    return {"source": "synthetic", "step": step, "epoch": 0, "index": step}

  def epoch(self, step: int) -> int:
    """0: the stream never repeats."""
    return 0
