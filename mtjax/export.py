"""`python -m mtjax.export --checkpoint DIR/step_N --out OUT`: a training checkpoint as a Hugging Face
model directory (config.json, sharded safetensors with index, tokenizer files when the run was
imported from one), streamed one layer group at a time.

The export is written beside OUT under a hidden name, verified (every tensor read back with the
shape the model needs, finite) and renamed into place: OUT is complete or absent, and running the
command again after a kill or a full disk finishes the job (leftovers of the attempt are removed).
A checkpoint that does not read back whole (a lost group, a failed checksum, a torn meta.json) is
refused in one line that names the newest intact step beside it, and nothing is written.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

import numpy as np

from mtjax import checkpoint, config as config_lib, exits, hf, models


def checkpoint_groups(path: Path, names: list[str], sums: dict | None = None):
  """(name, fp32 weights) of each group of a checkpoint, read one group at a time and checked
  against its recorded hash (`sums`, meta.json's per group: weights first)."""
  for name in names:
    want = (sums or {}).get(name)
    yield name, checkpoint.read_weights(path, name, want[0] if want else None)


def staging_dir(out: Path) -> Path:
  """Where an export to `out` is written and verified before its rename (beside it, hidden)."""
  return out.parent / f".{out.name}.partial"


def clear_leftovers(out: Path) -> None:
  """Removes what a killed or failed export to `out` left beside it."""
  for p in (staging_dir(out), *out.parent.glob(f".{out.name}.tmp-*"),
            *out.parent.glob(f".{staging_dir(out).name}.tmp-*")):
    shutil.rmtree(p, ignore_errors=True)


def verify(directory: Path, model: config_lib.ModelConfig) -> None:
  """Raises ValueError unless `directory` holds every tensor the model needs, each readable to its
  last byte with the expected shape and finite values."""
  ck = hf.Checkpoint(directory)
  ck.check(models.spec(model))
  for name in ck.entries:
    if not np.all(np.isfinite(np.asarray(ck.raw(name), np.float32))):
      raise ValueError(f"export {directory}: tensor {name} holds non-finite values")


def export_verified(out: str | Path, model: config_lib.ModelConfig, groups, dtype: str,
                    source: str | Path | None) -> Path:
  """`hf.export` written beside `out`, verified, then renamed to `out` (complete or absent)."""
  out = Path(out).absolute()
  if out.exists() and (not out.is_dir() or any(out.iterdir())):
    raise ValueError(f"--out: {out} exists and is not an empty folder")
  clear_leftovers(out)
  staging = staging_dir(out)
  try:
    hf.export(staging, model, groups, dtype, source)
    verify(staging, model)
    if out.exists():
      out.rmdir()  # checked empty above; a rename onto a folder needs it gone
    staging.rename(out)
  except BaseException:
    shutil.rmtree(staging, ignore_errors=True)
    raise
  return out


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


def recorded(path: Path) -> tuple[dict, config_lib.Config, list[str]]:
  """meta.json, the config trained with and the layer groups' names of the checkpoint at `path`."""
  meta = checkpoint.read_meta(path)
  raw = meta.get("extra", {}).get("config")
  if raw is None:
    raise ValueError(f"checkpoint {path}: no config recorded (saved by an older mtjax)")
  try:
    names = [g[0] for g in meta["groups"]]
  except (KeyError, TypeError, IndexError):
    raise checkpoint.Damaged(path, "meta.json lists no layer groups") from None
  # The model section as trained: from_hf is not re-read (its shape is recorded already).
  return meta, config_lib.from_dict(raw), names


def export_checkpoint(path: str | Path, out: str | Path, dtype: str = "bfloat16",
                      source: str | Path | None = None) -> Path:
  """Writes the weights of the checkpoint at `path` as a Hugging Face directory at `out`; config
  and tokenizer files come from `source_of`. A checkpoint that does not read back whole raises
  checkpoint.Damaged, with nothing written."""
  path = Path(path).absolute()
  meta, cfg, names = recorded(path)
  src = source_of(path, cfg.model.from_hf, source)
  groups = checkpoint_groups(path, names, meta.get(checkpoint.CHECKSUM))
  return export_verified(out, cfg.model, groups, dtype, src)


def intact_before(path: Path) -> Path | None:
  """The newest committed step beside the step folder `path` and older than it whose every group's
  weights read back and match their hashes (all an export reads); None when there is none."""
  n = checkpoint.step_number(path)
  if n is None:
    return None
  for older in checkpoint.steps(path.parent):
    if checkpoint.step_number(older) >= n:
      continue
    try:
      meta, _, names = recorded(older)
      for _ in checkpoint_groups(older, names, meta.get(checkpoint.CHECKSUM)):
        pass  # read and checked one group at a time; nothing kept
    except (ValueError, OSError):
      continue
    return older
  return None


def damaged_line(path: Path, e: checkpoint.Damaged) -> str:
  """The one line for a damaged checkpoint, naming the intact step to export instead."""
  good = intact_before(path)
  instead = (f"{good} is intact: --checkpoint {good}" if good is not None
             else f"no older step in {path.parent} is intact")
  return f"{path} is damaged ({' '.join(e.why.split())}); {instead}"


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m mtjax.export", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--checkpoint", required=True,
                 help="a checkpoint step folder (DIR/step_N), or a checkpoint_dir for its newest step")
  p.add_argument("--out", required=True, help="the Hugging Face directory to write (new or empty)")
  p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                 help="tensor dtype of the export (default: %(default)s)")
  p.add_argument("--source", help="the Hugging Face directory the model was imported from (default: "
                                  "the checkpoint's copy of its config and tokenizer files, else "
                                  "the model.from_hf it was trained with)")
  args = p.parse_args(argv)
  path = Path(args.checkpoint)
  if not (path / "meta.json").exists() and checkpoint.step_number(path) is None:
    path = checkpoint.latest(path)
    if path is None:
      return exits.fail("error", f"--checkpoint: {args.checkpoint} is neither a checkpoint (no "
                                 f"meta.json) nor a folder holding one (step_N)", exits.BAD_INPUT)
  try:
    out = export_checkpoint(path, args.out, args.dtype, args.source)
  except checkpoint.Damaged as e:
    return exits.fail("error", damaged_line(path, e), exits.BAD_INPUT)
  except ValueError as e:
    return exits.fail("error", e, exits.BAD_INPUT)
  except OSError as e:
    return exits.fail("error", checkpoint.reason(e), exits.of_os_error(e))
  except Exception as e:  # noqa: BLE001 - a bug: one line, not a traceback
    return exits.fail("internal error", f"{type(e).__name__}: {exits.one_line(e)[:300]}",
                      exits.FAILED)
  print(f"exported {path} -> {out}")
  return exits.OK


if __name__ == "__main__":
  sys.exit(main())
