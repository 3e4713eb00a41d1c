"""Data: token batches for training and evaluation, and `python -m mtjax.data prepare`.

  batch.py       Batch, the synthetic stream
  sources.py     a flat token file, prepared documents (packed or padded, images with padded
                 rows), held-out batches, preference pairs (read_pairs)
  fingerprint.py the tokenizer prepared data was made with, checked against the model's
  readers.py     input files as rows: JSONL, JSON, CSV, Parquet, Arrow, datasets folders, text
  formats.py     rows as documents: text, alpaca, sharegpt, messages, prompt_completion, preference
  chat.py        a tokenizer's chat template rendered as transformers renders it, assistant masks
  tokenize.py    tokenizing sources (a mixture of them) into a prepared directory (prepare)
  images.py      images of vision-language data as each family's HF processor prepares them,
                 their placeholders expanded in the token ids, Qwen's M-RoPE positions
  __main__.py    the prepare command
"""

from mtjax.data.batch import Batch, Synthetic, synthetic_batch
from mtjax.data.fingerprint import check_processor, check_tokenizer, tokenizer_fingerprint
from mtjax.data.sources import (SPLITS, Pairs, Prepared, PreparedSource, TokenFile, batches,
                                position, read_pairs, source, validation_batches)


def prepare(*args, **kwargs):
  """`mtjax.data.tokenize.prepare` (imported on first use: it loads the tokenizers library)."""
  from mtjax.data.tokenize import prepare as run
  return run(*args, **kwargs)


__all__ = ["Batch", "Pairs", "Prepared", "PreparedSource", "SPLITS", "Synthetic", "TokenFile",
           "batches", "check_processor", "check_tokenizer", "position", "prepare", "read_pairs", "source",
           "synthetic_batch", "tokenizer_fingerprint", "validation_batches"]
