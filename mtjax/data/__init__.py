"""Data: token batches for training and evaluation, and `python -m mtjax.data prepare`.

  batch.py    Batch, the synthetic stream
  sources.py  a flat token file, prepared documents (packed or padded), held-out batches
  chat.py     a tokenizer's chat template rendered as transformers renders it, assistant masks
  tokenize.py tokenizing text, jsonl and chat documents into a prepared directory (prepare)
  __main__.py the prepare command
"""

from mtjax.data.batch import Batch, Synthetic, synthetic_batch
from mtjax.data.sources import (SPLITS, Prepared, PreparedSource, TokenFile, batches, position,
                                source, validation_batches)


def prepare(*args, **kwargs):
  """`mtjax.data.tokenize.prepare` (imported on first use: it loads the tokenizers library)."""
  from mtjax.data.tokenize import prepare as run  # noqa: PLC0415
  return run(*args, **kwargs)


__all__ = ["Batch", "Prepared", "PreparedSource", "SPLITS", "Synthetic", "TokenFile", "batches",
           "position", "prepare", "source", "synthetic_batch", "validation_batches"]
