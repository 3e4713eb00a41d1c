"""Which tokenizer prepared data was made with: the fingerprint `prepare` records in meta.json, and
the check `train` makes of it against the model's tokenizer and vocabulary."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from mtjax.data.sources import read_meta, vocab_error

OVERRIDE = "data.allow_other_tokenizer=true"  # the config key that accepts another tokenizer's data


def tokenizer_fingerprint(path: str | Path) -> str:
  """The sha256 (hex) of a tokenizer's content: tokenizer.json in a model directory, or that file.

  tokenizer.json alone fixes what each id means and which ids a text becomes (vocabulary, merges,
  added tokens, normalizer, pre-tokenizer, post-processor). It is hashed as parsed JSON with sorted
  keys, so a copy that was reformatted or saved again with its keys in another order has the same
  fingerprint, and the path does not count. tokenizer_config.json is left out: its chat template
  and special-token names change how a conversation is rendered, not what an id means, and a base
  model and its instruct model share one vocabulary under different templates.

  Raises:
    FileNotFoundError: no tokenizer.json there. ValueError: it is not JSON.
  """
  path = Path(path)
  file = path / "tokenizer.json" if path.is_dir() else path
  if not file.is_file():
    raise FileNotFoundError(f"{file} does not exist")
  try:
    content = json.loads(file.read_text(encoding="utf-8"))
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise ValueError(f"{file} is not a tokenizer.json ({e})") from None
  canonical = json.dumps(content, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
  return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def check_tokenizer(data_path: str | Path, model_dir: str | Path | None, vocab_size: int,
                    allow_other: bool) -> None:
  """Refuses prepared data made with another tokenizer than the model's, or too large a vocabulary.

  A folder whose meta.json records no tokenizer_fingerprint (prepared by an older mtjax) is
  accepted with the vocabulary check only.

  Args:
    data_path: the prepared directory (data.path of data.source prepared).
    model_dir: the model's Hugging Face directory (model.from_hf); None for a model trained from
      scratch, whose tokenizer is unknown: then only the vocabulary is checked.
    vocab_size: model.vocab_size; every id of the data must be below it.
    allow_other: data.allow_other_tokenizer: data of another tokenizer is accepted (its vocabulary
      must still fit).

  Raises:
    ValueError: one line naming the data's tokenizer (its path and fingerprint's first digits) and
      the model directory, and the override key; or naming model.from_hf when the data's
      vocabulary is larger than vocab_size.
    FileNotFoundError: data_path holds no meta.json.
  """
  meta = read_meta(Path(data_path))
  recorded = meta.get("tokenizer_fingerprint")
  if model_dir is not None and recorded and not allow_other:
    made = f"the tokenizer {meta.get('tokenizer')} ({recorded[:12]})"
    try:
      model = tokenizer_fingerprint(model_dir)
    except FileNotFoundError:
      raise ValueError(f"model.from_hf: {model_dir} holds no tokenizer.json to compare with "
                       f"{made}, which {data_path} was prepared with; set {OVERRIDE} to train on "
                       "it anyway") from None
    if model != recorded:
      raise ValueError(f"data.path: {data_path} was prepared with {made}, not with the tokenizer "
                       f"of model.from_hf {model_dir} ({model[:12]}); prepare it again with "
                       f"--tokenizer {model_dir}, or set {OVERRIDE} to train on it anyway")
  try:
    data_vocab = int(meta["vocab_size"])
  except (KeyError, TypeError, ValueError) as e:
    raise ValueError(f"data.path: {Path(data_path) / 'meta.json'} is not a prepared-data "
                     f"meta.json ({e!r})") from None
  if data_vocab > vocab_size:
    raise ValueError(vocab_error(data_path, meta, vocab_size))


# The processor settings prepared images depend on: the stored size and the load's arithmetic.
_PROCESSOR_KEYS = ("height", "width", "resample", "rescale_factor", "mean", "std",
                   "tokens_per_image", "image_token", "patch", "merge", "temporal_patch")


def check_processor(data_path: str | Path, model_dir: str | Path | None) -> None:
  """Refuses, in one line naming the setting, prepared images made with another image processor
  than the model's (its size, resampling filter, rescale, mean or std, or the image tokens).

  Data without images, a model without a directory or one whose directory holds no processor
  files pass: the model's own shape is checked against the data when the source opens it.
  """
  meta = read_meta(Path(data_path))
  made = meta.get("images")
  if made is None or model_dir is None:
    return
  model_dir = Path(model_dir)
  if not any((model_dir / f).is_file() for f in ("preprocessor_config.json",
                                                 "processor_config.json")):
    return
  from mtjax.data.images import ImageProcessor

  try:
    proc = ImageProcessor.from_dir(model_dir)
    if made.get("patch") is not None:  # Qwen-VL: the data fixed the size the model's processor takes
      proc = proc.at_size(int(made["height"]))
    want = proc.stored()
  except ValueError as e:
    raise ValueError(f"model.from_hf: {model_dir}'s processor: {e}") from None
  for key in _PROCESSOR_KEYS:
    a, b = made.get(key), want.get(key)
    if a != b and not (isinstance(a, list) and isinstance(b, list) and len(a) == len(b)
                       and all(abs(x - y) <= 1e-9 for x, y in zip(a, b))):
      raise ValueError(f"data.path: {data_path} was prepared by the processor of "
                       f"{made.get('processor')} with {key} {a}, the model's processor "
                       f"({model_dir}) has {b}; prepare it again with --processor {model_dir}")
