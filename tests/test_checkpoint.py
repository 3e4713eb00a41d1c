"""Checkpoints: a resumed run equals the uninterrupted one; a mismatched checkpoint is refused."""

import shutil
from pathlib import Path

import chex
import jax
import numpy as np
import pytest

from mtjax import checkpoint, config, data, engine, state as state_lib, train

TINY = Path(__file__).parent.parent / "configs" / "tiny.yaml"


def test_resume_equals_uninterrupted(tmp_path):
  # decay_steps is fixed so that both runs share one schedule.
  over = ["train.steps=5", "train.checkpoint_every=3", "optim.decay_steps=5",
          f"train.checkpoint_dir={tmp_path}"]
  train.run(config.load(TINY, over), progress=False)
  final = tmp_path / "step_5"
  shutil.move(final, tmp_path.parent / "uninterrupted_step_5")
  summary = train.run(config.load(TINY, over), progress=False)  # resumes from step_3
  assert summary["resumed_from"].endswith("step_3") and summary["steps"] == 2
  m = config.load(TINY).model
  a, b = state_lib.create(m, jax.random.key(1)), state_lib.create(m, jax.random.key(2))
  checkpoint.restore(a, tmp_path.parent / "uninterrupted_step_5")
  checkpoint.restore(b, checkpoint.latest(tmp_path))
  assert a.step == b.step == 5
  chex.assert_trees_all_close(a.to_tree(), b.to_tree(), rtol=1e-6, atol=1e-7)
  chex.assert_trees_all_close(a.moments_tree(), b.moments_tree(), rtol=1e-6, atol=1e-9)


def test_save_restore_round_trip_drops_stale_device_copies(tmp_path):
  cfg = config.load(TINY, ["engine.device_update_layers=2"])
  st = state_lib.create(cfg.model, jax.random.key(0))
  eng = engine.Engine(cfg, st)
  eng.step(data.synthetic_batch(0, 8, 64, 256, 0))
  eng.sync()
  path = checkpoint.save(st, tmp_path)
  saved = st.to_tree()
  eng.step(data.synthetic_batch(1, 8, 64, 256, 0))
  eng.sync()
  checkpoint.restore(st, path)
  chex.assert_trees_all_equal(st.to_tree(), saved)
  assert st.step == 1
  b = data.synthetic_batch(2, 8, 64, 256, 0)
  fresh = state_lib.create(cfg.model, jax.random.key(5))
  checkpoint.restore(fresh, path)
  other = engine.Engine(cfg, fresh)
  np.testing.assert_allclose(eng.grads(b)[0], other.grads(b)[0], rtol=1e-6)
  eng.close()
  other.close()


def test_mismatched_checkpoint_is_refused_without_touching_state(tmp_path):
  small = state_lib.create(config.load(TINY).model, jax.random.key(0))
  path = checkpoint.save(small, tmp_path)
  wide = state_lib.create(config.load(TINY, ["model.ffn=64"]).model, jax.random.key(0))
  before = wide.to_tree()
  with pytest.raises(ValueError, match="group block_0 holds"):
    checkpoint.restore(wide, path)
  chex.assert_trees_all_equal(wide.to_tree(), before)
  deep = state_lib.create(config.load(TINY, ["model.layers=3"]).model, jax.random.key(0))
  with pytest.raises(ValueError, match="layer groups"):
    checkpoint.restore(deep, path)
  (tmp_path / "step_9").mkdir()  # no step.json: incomplete, ignored
  assert checkpoint.latest(tmp_path) == path
