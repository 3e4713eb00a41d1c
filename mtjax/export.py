"""`python -m mtjax.export --checkpoint DIR/step_N --out OUT`: a training checkpoint as a Hugging Face
model directory (config.json, sharded safetensors with index, tokenizer files when the run was
imported from one), streamed one layer group at a time.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import orbax.checkpoint as ocp

from mtjax import checkpoint, config as config_lib, hf


def checkpoint_groups(path: Path, names: list[str]):
  """(name, fp32 weights) of each group of a checkpoint, read one group at a time."""
  ckptr = ocp.StandardCheckpointer()
  for name in names:
    yield name, np.asarray(ckptr.restore(path / name)["w"], np.float32)


def source_of(path: Path, from_hf: str | None, source: str | Path | None = None) -> Path | None:
  """Where the export takes config.json and tokenizer files from: `source` when given, else the
  checkpoint's own copy, else the directory the model was imported from; None for a model
  trained from mtjax's own init (config.json is then written from the model config)."""
  if source is not None:
    if not (Path(source) / "config.json").is_file():
      raise ValueError(f"--source: {source} holds no config.json")
    return Path(source)
  if (path / checkpoint.SOURCE_DIR / "config.json").is_file():
    return path / checkpoint.SOURCE_DIR
  if from_hf is None:
    return None
  if (Path(from_hf) / "config.json").is_file():
    return Path(from_hf)
  raise ValueError(f"checkpoint {path}: its model was imported from {from_hf}, which is gone, and "
                   f"the checkpoint holds no copy of its config.json; pass --source DIR (the "
                   f"Hugging Face directory it came from)")


def export_checkpoint(path: str | Path, out: str | Path, dtype: str = "bfloat16",
                      source: str | Path | None = None) -> Path:
  """Writes the weights of the checkpoint at `path` as a Hugging Face directory at `out`; config
  and tokenizer files come from `source_of`."""
  path = Path(path).absolute()
  meta = checkpoint.read_meta(path)
  raw = meta.get("extra", {}).get("config")
  if raw is None:
    raise ValueError(f"checkpoint {path}: no config recorded (saved by an older mtjax)")
  # The model section as trained: from_hf is not re-read (its shape is recorded already).
  cfg = config_lib.from_dict(raw)
  names = [g[0] for g in meta["groups"]]
  src = source_of(path, cfg.model.from_hf, source)
  return hf.export(out, cfg.model, checkpoint_groups(path, names), dtype, src)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m mtjax.export", description=__doc__)
  p.add_argument("--checkpoint", required=True,
                 help="a checkpoint step folder (DIR/step_N), or a checkpoint_dir for its newest step")
  p.add_argument("--out", required=True, help="the Hugging Face directory to write (new or empty)")
  p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                 help="tensor dtype of the export")
  p.add_argument("--source", help="the Hugging Face directory the model was imported from (default: "
                                  "the checkpoint's copy of its config and tokenizer files)")
  args = p.parse_args(argv)
  path = Path(args.checkpoint)
  if not (path / "meta.json").exists():
    path = checkpoint.latest(path) or path
  try:
    out = export_checkpoint(path, args.out, args.dtype, args.source)
  except (ValueError, OSError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(f"exported {path} -> {out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
