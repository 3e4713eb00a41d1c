"""Which tokenizer prepared data was made with: the fingerprint `prepare` records in meta.json."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

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
