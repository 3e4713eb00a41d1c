"""Checkpoints of the training state with orbax: per layer group its weights and optimizer state,
plus the step, the layout and the data position.

Layout: DIR/step_<n>/<group name>/ (one orbax checkpoint per layer group, so saving and restoring
hold at most one extra group in memory, never a second copy of the model) and DIR/step_<n>/meta.json.
A step is written under a temporary name and made visible by one rename once complete, and a
committed step is never rewritten; `restore_latest` takes the newest step that restores and says
which ones it skipped and why. Every array's xxh3-64 hash is kept in meta.json and checked on
restore, so a corrupted checkpoint is found and an older one used. A save that fails (a full disk,
permissions, a vanished folder) raises SaveFailed and leaves nothing behind but the committed steps.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import xxhash

from mtjax import config as config_lib, hf
from mtjax.store import LayerStore

_STEP_DIR = re.compile(r"step_(\d+)$")


class CheckpointMismatch(ValueError):
  """A checkpoint of another model (other layer groups or parameter shapes): never skipped over."""


class Damaged(ValueError):
  """A checkpoint that does not read back whole: meta.json missing or unreadable, or a group that
  does not restore, has the wrong shape, fails its checksum or holds non-finite values."""

  def __init__(self, path: str | Path, why: str):
    super().__init__(f"checkpoint {path}: {why}")
    self.path, self.why = Path(path), why

  def __reduce__(self):  # pickled with both arguments, not the message alone
    return type(self), (self.path, self.why)


class SaveFailed(OSError):
  """A checkpoint could not be written; its partial folder is gone and the state is untouched."""


def _layout_record(store: LayerStore) -> list:
  return [[g.name, g.size, [["/".join(p), list(s)] for p, s in zip(g.layout.paths, g.layout.shapes)]]
          for g in store.groups]


# Model fields that do not change what the saved weights mean: where they were imported from and
# how they were first drawn.
_NOT_ARCHITECTURE = ("from_hf", "init_std")


def model_difference(saved: dict | None, model: dict) -> str | None:
  """How a checkpoint's recorded model section differs from `model` (a `to_dict` of the run's
  model config), as 'model.KEY: A in the checkpoint, B in this run'; None when they agree or
  nothing was recorded. Two models can hold the same parameter shapes (heads of another width,
  another RoPE base), so the layout alone does not tell them apart."""
  if not isinstance(saved, dict):
    return None
  saved = config_lib.upgrade_model_section(saved)  # a stored config may spell RoPE flat
  saved, model = config_lib.derived_widths(saved), config_lib.derived_widths(model)
  for key in sorted(saved):  # the checkpoint's keys: a field added since keeps its default meaning
    if key in _NOT_ARCHITECTURE or saved.get(key) == model.get(key):
      continue
    mine, theirs = saved.get(key), model.get(key)
    if isinstance(mine, dict) and isinstance(theirs, dict):  # a section (moe): knobs may differ
      for sub in sorted(mine):
        if sub not in config_lib.run_knobs(mine) and mine.get(sub) != theirs.get(sub):
          return (f"model.{key}.{sub}: {mine.get(sub)!r} in the checkpoint, {theirs.get(sub)!r} "
                  f"in this run")
      continue
    return f"model.{key}: {mine!r} in the checkpoint, {theirs!r} in this run"
  return None


def check_model(directory: str | Path, model: dict) -> None:
  """Refuses (CheckpointMismatch), before anything is allocated, a checkpoint folder whose newest
  readable checkpoint was saved by another model than `model` (a `to_dict` of the model config)."""
  for path in steps(directory):
    try:
      saved = read_meta(path).get("extra", {}).get("config", {}).get("model")
    except (ValueError, OSError, AttributeError):
      continue  # damaged: restore_latest skips it and says why
    diff = model_difference(saved, model)
    if diff:
      raise CheckpointMismatch(f"checkpoint {path} is of another model ({diff}); use another "
                               f"train.checkpoint_dir or the model it was trained with")
    return


CHECKSUM = "xxh3_64"  # meta.json's key for the arrays' hashes (older checkpoints: none checked)


def checksum(a: np.ndarray) -> int:
  """The array's bytes hashed with xxh3-64: any changed, swapped or zeroed run of bytes changes
  it, at memory speed (several GB/s), so a 10B-parameter state is checked in seconds."""
  # as bytes: a buffer of ml_dtypes' bfloat16 (optim.state_dtype) cannot be cast by memoryview
  return xxhash.xxh3_64_intdigest(np.ascontiguousarray(a).reshape(-1).view(np.uint8).data)


SOURCE_DIR = "hf_source"  # a step's copy of its Hugging Face source's config and tokenizer files


def save(store: LayerStore, directory: str | Path, extra: dict | None = None,
         source: str | Path | None = None) -> Path:
  """Writes the state (call `store.sync()` first) to DIRECTORY/step_<store.step>; a step that is
  already committed is left as it is. `extra` (JSON) is kept in meta.json (e.g. the data position).
  `source`, the Hugging Face directory the model was imported from: its config.json and tokenizer
  files are copied into the step (SOURCE_DIR), so an export never depends on it still existing."""
  directory = Path(directory).absolute()
  final = directory / f"step_{store.step}"
  if (final / "meta.json").exists():
    return final
  tmp = directory / f".step_{store.step}.tmp-{os.getpid()}"
  try:
    if final.exists():  # left by a kill inside prune's delete: incomplete, never a committed step
      shutil.rmtree(final)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()  # not parents: a checkpoint_dir that vanished is a failure, not a new folder
    _write(store, tmp, extra, source)
    os.replace(tmp, final)
  except Exception as e:
    shutil.rmtree(tmp, ignore_errors=True)
    failed = SaveFailed(f"cannot write {final.name} in {directory} ({reason(e)})")
    failed.errno = _errno(e)
    raise failed from e
  except BaseException:  # a second signal abandons the save: no partial folder stays
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return final


def reason(e: BaseException) -> str:
  """An exception as a short clause: the OS's words where an OS error lies behind it (tensorstore
  reports one inside its message), else its first line."""
  if isinstance(e, OSError) and e.strerror:
    return e.strerror + (f": {e.filename}" if e.filename else "")
  if (n := _errno(e)) is not None:
    return os.strerror(n)
  cause = e.__cause__ or e.__context__
  if not str(e).strip() and cause is not None:
    return reason(cause)
  return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"


_OS_ERROR_CODE = re.compile(r"os_error_code='(\d+)'")  # how tensorstore names the errno


def _errno(e: BaseException | None) -> int | None:
  """The OS error number behind `e` (orbax and tensorstore wrap it), or None."""
  while e is not None:
    if isinstance(e, OSError) and e.errno:
      return e.errno
    if m := _OS_ERROR_CODE.search(str(e)):
      return int(m.group(1))
    e = e.__cause__ or e.__context__
  return None


def _write(store: LayerStore, tmp: Path, extra: dict | None, source: str | Path | None):
  """The body of `save`: every group into `tmp`, then meta.json last (it marks the step whole)."""
  ckptr = ocp.StandardCheckpointer()
  sums = {}
  try:
    for i, g in enumerate(store.groups):
      state = store.read(i)
      leaves = {str(k): a for k, a in enumerate(jax.tree.leaves(state["opt"]))}
      sums[g.name] = [checksum(state["w"])] + [checksum(a) for a in leaves.values()]
      ckptr.save(tmp / g.name, {"w": state["w"], "opt": leaves})
      ckptr.wait_until_finished()
      del state, leaves  # one group in memory at a time
  finally:
    # An exception inside a save (a second signal abandons the run) must not leave orbax's
    # background thread committing while the interpreter shuts down: it waits for it here.
    ckptr.close()
  if source is not None:
    hf.copy_source_files(source, tmp / SOURCE_DIR)
  with open(tmp / "meta.json", "w") as f:
    f.write(json.dumps({"step": store.step, "groups": _layout_record(store), CHECKSUM: sums,
                        "extra": extra or {}}))
    f.flush()
    os.fsync(f.fileno())  # written through before the rename makes the step visible


def steps(directory: str | Path) -> list[Path]:
  """Committed checkpoints under `directory`, newest first."""
  directory = Path(directory)
  if not directory.is_dir():
    return []
  done = [(int(m.group(1)), p) for p in directory.iterdir()
          if (m := _STEP_DIR.match(p.name)) and (p / "meta.json").exists()]
  return [p for _, p in sorted(done, reverse=True)]


def step_number(path: str | Path) -> int | None:
  """N of a step folder's name step_N; None for any other name."""
  m = _STEP_DIR.match(Path(path).name)
  return int(m.group(1)) if m else None


def latest(directory: str | Path) -> Path | None:
  """The newest committed checkpoint under `directory`, or None."""
  found = steps(directory)
  return found[0] if found else None


def read_meta(path: str | Path) -> dict:
  meta_file = Path(path) / "meta.json"
  if not meta_file.exists():
    raise Damaged(path, "no meta.json (incomplete or not a checkpoint)")
  try:
    meta = json.loads(meta_file.read_text())
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
    raise Damaged(path, f"meta.json unreadable ({type(e).__name__})") from None
  if not isinstance(meta, dict):
    raise Damaged(path, "meta.json is not a mapping")
  return meta


def restore(store: LayerStore, path: str | Path) -> dict:
  """Loads a checkpoint into `store`, one group at a time (no second copy of the model). The layout
  (every group's parameter names and shapes) is checked before anything is written, so a checkpoint
  of another model leaves the state as it was; a group found damaged on the way (unreadable, wrong
  shape, non-finite) raises with the groups before it written, and `restore_latest` then goes on to
  an older checkpoint, which overwrites every group. Returns the checkpoint's `extra`."""
  path = Path(path).absolute()
  meta = read_meta(path)
  diff = model_difference(meta.get("extra", {}).get("config", {}).get("model"),
                          config_lib.to_dict(store.model_cfg))
  if diff:
    raise CheckpointMismatch(f"checkpoint {path} is of another model ({diff})")
  have, want = meta["groups"], _layout_record(store)
  if len(have) != len(want):
    raise CheckpointMismatch(f"checkpoint {path}: {len(have)} layer groups, the model has "
                             f"{len(want)}")
  for h, w in zip(have, want):
    if h != w:
      raise CheckpointMismatch(f"checkpoint {path}: group {h[0]} holds {h[1]} parameters in "
                               f"another layout than the model's {w[0]} ({w[1]} parameters)")
  saved_freeze = meta.get("extra", {}).get("config", {}).get("train", {}).get("freeze", [])
  mine_freeze = list(store.cfg.train.freeze)
  if sorted(saved_freeze) != sorted(mine_freeze):
    raise CheckpointMismatch(f"checkpoint {path} was trained with train.freeze={saved_freeze} and "
                             f"this run has {mine_freeze}: resume with train.freeze="
                             f"{saved_freeze}, or start the next stage from its export "
                             f"(model.from_hf)")
  saved = meta.get("extra", {}).get("config", {}).get("optim", {}).get("state_dtype")
  mine = store.rule.cfg.state_dtype
  if saved is not None and saved != mine and "int8" in (saved, mine):
    raise CheckpointMismatch(state_dtype_line(path, saved, mine))
  ckptr = ocp.StandardCheckpointer()
  for i, g in enumerate(store.groups):
    try:
      tree = ckptr.restore(path / g.name)
    except Exception as e:  # noqa: BLE001 - orbax's many error types, reworded at the boundary
      raise Damaged(path, f"group {g.name} does not restore "
                          f"({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None
    leaves, treedef = jax.tree.flatten(g.opt)
    got = [np.asarray(tree["opt"][str(k)]) for k in range(len(leaves))]
    w = np.asarray(tree["w"], np.float32)
    if w.shape != (g.size,) or any(a.shape != b.shape for a, b in zip(got, leaves)):
      raise Damaged(path, f"group {g.name} has arrays of the wrong shape")
    want_sums = meta.get(CHECKSUM, {}).get(g.name)
    if want_sums is not None and [checksum(a) for a in [w, *got]] != want_sums:
      raise Damaged(path, f"group {g.name} does not match its checksum (corrupted)")
    if not all(np.all(np.isfinite(a)) for a in [w, *got]):
      raise Damaged(path, f"group {g.name} holds non-finite values")
    store.write(i, w=w, opt=jax.tree.unflatten(treedef, got))
  store.step = int(meta["step"])
  return meta.get("extra", {})


def state_dtype_line(path: Path, saved: str, mine: str) -> str:
  """The refusal of a resume whose optimizer state is stored in another form: 8-bit codes and
  float moments do not convert into each other without changing the run (float32 and bfloat16
  moments do, on restore)."""
  return (f"checkpoint {path} holds optim.state_dtype={saved} moments and this run has {mine}: "
          f"resume with optim.state_dtype={saved}, or start afresh (train.resume=false or another "
          f"train.checkpoint_dir)")


def restore_latest(store: LayerStore, directory: str | Path) -> tuple[Path | None, dict, list[str]]:
  """Restores the newest checkpoint that restores; returns (its path or None, its extra, one line
  per newer checkpoint skipped, saying why). Skipped checkpoints are left in place. A checkpoint of
  another model raises CheckpointMismatch: the directory belongs to another run."""
  skipped = []
  for path in steps(directory):
    try:
      extra = restore(store, path)
    except CheckpointMismatch:
      raise
    except (ValueError, KeyError, TypeError, OSError) as e:  # damaged, or meta.json malformed
      # Kept, under a name that no longer counts as a step: a later save of the same step or the
      # pruning of old ones must not treat it as the newest good checkpoint.
      kept = path.with_name(f".damaged-{path.name}")
      shutil.rmtree(kept, ignore_errors=True)
      os.replace(path, kept)
      skipped.append(f"skipped {path.name} (kept as {kept.name}): {e}")
      continue
    return path, extra, skipped
  if skipped:  # the state may hold part of a damaged checkpoint: never train on from it
    raise ValueError(f"checkpoint_dir {directory}: no checkpoint restores ({'; '.join(skipped)})")
  return None, {}, skipped


def read_weights(path: str | Path, name: str, want_sum: int | None = None) -> np.ndarray:
  """One group's fp32 weights from the checkpoint at `path`, checked against its recorded hash
  (`want_sum`, from meta.json); a group that does not restore or match raises Damaged."""
  try:
    w = np.asarray(ocp.StandardCheckpointer().restore(Path(path).absolute() / name)["w"],
                   np.float32)
  except Exception as e:  # noqa: BLE001 - orbax's many error types, reworded at the boundary
    raise Damaged(path, f"group {name} does not restore ({reason(e)})") from None
  if want_sum is not None and checksum(w) != want_sum:
    raise Damaged(path, f"group {name} does not match its checksum (corrupted)")
  return w


def stored_bytes(directory: str | Path) -> int:
  """Bytes of the committed checkpoints under `directory` (what pruning will free as new ones
  are written)."""
  return sum(f.stat().st_size for p in steps(directory) for f in p.rglob("*") if f.is_file())


def prune(directory: str | Path, keep: int) -> list[Path]:
  """Deletes all but the newest `keep` committed checkpoints (keep 0: none deleted) and leftovers
  of interrupted saves; returns what it deleted."""
  directory = Path(directory)
  gone = steps(directory)[keep:] if keep else []
  gone += [p for p in directory.glob(".step_*.tmp-*") if p.is_dir()]
  gone += [p for p in directory.glob("step_*") if p.is_dir() and not (p / "meta.json").exists()]
  for p in gone:
    shutil.rmtree(p, ignore_errors=True)
  return gone


def check_claim(directory: str | Path, resume: bool, overwrite: bool) -> None:
  """Refuses (ValueError) a checkpoint folder a run may not use, changing nothing, so a run that is
  refused later (by the plan, its data) leaves no folder and loses no checkpoint: `directory` must
  be a writable folder or one that can be made, and a fresh run (resume false) never mixes its
  steps with another run's unless asked to overwrite them."""
  directory = Path(directory)
  if directory.exists() and not directory.is_dir():
    raise ValueError(f"train.checkpoint_dir: {directory} exists and is not a folder")
  if not directory.exists():
    parent = directory.absolute().parent
    while not parent.exists():  # the nearest existing folder is where mkdir would begin
      parent = parent.parent
    why = ("Not a directory" if not parent.is_dir()
           else "Read-only file system" if os.statvfs(parent).f_flag & os.ST_RDONLY
           else "Permission denied" if not os.access(parent, os.W_OK | os.X_OK) else None)
    if why:
      raise ValueError(f"train.checkpoint_dir: cannot create {directory} ({why})")
    return
  if not os.access(directory, os.W_OK | os.X_OK):
    raise ValueError(f"train.checkpoint_dir: {directory} is not writable")
  found = steps(directory)
  if found and not resume and not overwrite:
    raise ValueError(f"train.checkpoint_dir: {directory} holds another run's checkpoints "
                     f"({found[0].name} newest); resume it (train.resume=true), delete them "
                     f"(train.overwrite=true) or use another folder")


def claim(directory: str | Path, resume: bool, overwrite: bool) -> None:
  """Takes `directory` for a run's checkpoints once nothing else can refuse the run: `check_claim`,
  then the folder is made and, for a fresh run asked to overwrite, the other run's steps deleted."""
  check_claim(directory, resume, overwrite)
  directory = Path(directory)
  try:
    directory.mkdir(parents=True, exist_ok=True)
  except OSError as e:
    raise ValueError(f"train.checkpoint_dir: cannot create {directory} ({e.strerror})") from None
  if not resume:
    for p in steps(directory):  # only with overwrite: check_claim refused them otherwise
      shutil.rmtree(p)
