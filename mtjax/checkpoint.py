"""Checkpoints of the host state with orbax: per layer group its weights and AdamW moments, plus
the step. Data batches are a pure function of the step, so a resumed run continues exactly.

Layout: DIR/step_<n>/<group name>/ (one orbax checkpoint per layer group, so saving and restoring
hold at most one extra layer in memory, never a second copy of the model), DIR/step_<n>/step.json
written last: a step directory without it is incomplete and ignored.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import orbax.checkpoint as ocp

from mtjax.state import HostState

_STEP_DIR = re.compile(r"step_(\d+)$")


def save(state: HostState, directory: str | Path) -> Path:
  """Writes the state (call Engine.sync() first) to DIRECTORY/step_<state.step>."""
  path = Path(directory).absolute() / f"step_{state.step}"
  path.mkdir(parents=True, exist_ok=True)
  ckptr = ocp.StandardCheckpointer()
  for g in state.groups:
    ckptr.save(path / g.name, {"w": g.w_np, "m": g.m_np, "v": g.v_np}, force=True)
    ckptr.wait_until_finished()
  (path / "step.json").write_text(json.dumps({
      "step": state.step, "groups": [[g.name, g.layout.size] for g in state.groups]}))
  return path


def latest(directory: str | Path) -> Path | None:
  """The newest complete checkpoint under `directory`, or None."""
  directory = Path(directory)
  if not directory.is_dir():
    return None
  done = [(int(m.group(1)), p) for p in directory.iterdir()
          if (m := _STEP_DIR.match(p.name)) and (p / "step.json").exists()]
  return max(done)[1] if done else None


def restore(state: HostState, path: str | Path) -> None:
  """Loads a checkpoint into `state` in place. Every group's presence and shape is checked before
  anything is written, so a mismatched checkpoint leaves the state as it was."""
  path = Path(path).absolute()
  meta_file = path / "step.json"
  if not meta_file.exists():
    raise ValueError(f"checkpoint {path}: no step.json (incomplete or not a checkpoint)")
  meta = json.loads(meta_file.read_text())
  have = [tuple(x) for x in meta["groups"]]
  want = [(g.name, g.layout.size) for g in state.groups]
  if len(have) != len(want):
    raise ValueError(f"checkpoint {path}: {len(have)} layer groups, the model has {len(want)}")
  for h, w in zip(have, want):
    if h != w:
      raise ValueError(f"checkpoint {path}: group {h[0]} holds {h[1]} parameters, the model's "
                       f"{w[0]} needs {w[1]}")
  ckptr = ocp.StandardCheckpointer()
  for g in state.groups:
    tree = ckptr.restore(path / g.name)
    for k in ("w", "m", "v"):
      np.copyto(getattr(g, f"{k}_np"), np.asarray(tree[k], np.float32))
  state.step = int(meta["step"])
  state.version += 1  # device-resident copies of weights are stale now
