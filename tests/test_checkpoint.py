"""Checkpoints: a resumed run equals the uninterrupted one; a mismatched or damaged one is refused."""

import os
import shutil
from pathlib import Path

import chex
import jax
import numpy as np
import pytest

from mtjax import checkpoint, config, data, engine, launch, store as store_lib, train

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
  cfg = config.load(TINY, ["engine.device_state_layers=0", "engine.device_update_layers=0"])
  a, b = store_lib.create(cfg, jax.random.key(1)), store_lib.create(cfg, jax.random.key(2))
  checkpoint.restore(a, tmp_path.parent / "uninterrupted_step_5")
  checkpoint.restore(b, checkpoint.latest(tmp_path))
  assert a.step == b.step == 5
  chex.assert_trees_all_equal(a.to_tree(), b.to_tree())  # resume is exact, bit for bit
  chex.assert_trees_all_equal(a.moments_tree(), b.moments_tree())


def new(over=(), seed=0):
  cfg, _ = launch.plan_run(config.load(TINY, ["engine.device_state_layers=0", *over]))
  return cfg, store_lib.create(cfg, jax.random.key(seed))


@pytest.mark.parametrize("placement", [(0, 2, "float32"), (2, 1, "float32"), (1, 1, "bfloat16")])
def test_save_restore_round_trip_drops_stale_device_copies(tmp_path, placement):
  over = [f"engine.device_state_layers={placement[0]}", f"engine.device_update_layers={placement[1]}",
          f"optim.state_dtype={placement[2]}"]
  cfg, st = new(over)
  eng = engine.Engine(cfg, st)
  eng.step(data.synthetic_batch(0, 8, 64, 256, 0))
  eng.sync()
  path = checkpoint.save(st, tmp_path)
  saved, saved_opt = st.to_tree(), st.opt_trees()
  eng.step(data.synthetic_batch(1, 8, 64, 256, 0))
  eng.sync()
  checkpoint.restore(st, path)
  chex.assert_trees_all_equal(st.to_tree(), saved)
  chex.assert_trees_all_equal(st.opt_trees(), saved_opt)
  assert {a.dtype.name for a in jax.tree.leaves(st.opt_trees())} == {placement[2]}
  assert st.step == 1
  b = data.synthetic_batch(2, 8, 64, 256, 0)
  _, fresh = new(over, seed=5)  # another placement reads the same checkpoint
  checkpoint.restore(fresh, path)
  other = engine.Engine(cfg, fresh)
  assert eng.grads(b)[0] == other.grads(b)[0]  # the same weights give the same loss exactly
  eng.close()
  other.close()


def test_mismatched_checkpoint_is_refused_without_touching_state(tmp_path):
  _, small = new()
  path = checkpoint.save(small, tmp_path)
  _, wide = new(["model.ffn=64"])
  before = wide.to_tree()
  with pytest.raises(ValueError, match="group block_0 holds .* another layout"):
    checkpoint.restore(wide, path)
  chex.assert_trees_all_equal(wide.to_tree(), before)
  _, deep = new(["model.layers=3"])
  with pytest.raises(ValueError, match="layer groups"):
    checkpoint.restore(deep, path)
  (tmp_path / "step_9").mkdir()  # no meta.json: incomplete, ignored
  assert checkpoint.latest(tmp_path) == path


def test_a_damaged_newest_checkpoint_falls_back_to_the_one_before(tmp_path):
  cfg, st = new()
  eng = engine.Engine(cfg, st)
  eng.step(data.synthetic_batch(0, 8, 64, 256, 0))
  eng.sync()
  good = checkpoint.save(st, tmp_path)
  want = st.to_tree()
  eng.step(data.synthetic_batch(1, 8, 64, 256, 0))
  eng.sync()
  bad = checkpoint.save(st, tmp_path)
  eng.close()
  shutil.rmtree(bad / "block_1")  # a group lost from the newest step
  _, fresh = new(seed=3)
  path, _, skipped = checkpoint.restore_latest(fresh, tmp_path)
  assert path == good and fresh.step == 1
  assert len(skipped) == 1 and "step_2" in skipped[0] and "block_1" in skipped[0]
  assert not bad.exists() and (tmp_path / ".damaged-step_2").exists()  # set aside, not deleted
  assert checkpoint.latest(tmp_path) == good  # no longer counted as the newest step
  chex.assert_trees_all_equal(fresh.to_tree(), want)


def test_a_committed_step_is_never_rewritten(tmp_path):
  cfg, st = new()
  path = checkpoint.save(st, tmp_path)
  stamp = (path / "meta.json").stat().st_mtime_ns
  st.write(1, w=np.zeros(st.groups[1].size, np.float32))
  assert checkpoint.save(st, tmp_path) == path  # the same step again: left as it was
  assert (path / "meta.json").stat().st_mtime_ns == stamp
  _, fresh = new(seed=3)
  checkpoint.restore(fresh, path)
  assert np.any(fresh.read(1)["w"] != 0)


def test_a_corrupted_group_is_caught_by_its_checksum(tmp_path):
  cfg, st = new()
  good = checkpoint.save(st, tmp_path)
  st.step = 1
  bad = checkpoint.save(st, tmp_path)
  # Silent corruption of the stored data: one weight of block_0 changed under the same metadata.
  import orbax.checkpoint as ocp
  ckptr = ocp.StandardCheckpointer()
  tree = ckptr.restore(bad / "block_0")
  tree = jax.tree.map(np.asarray, tree)
  tree["w"] = tree["w"].copy()
  tree["w"][5] += 1.0
  shutil.rmtree(bad / "block_0")
  ckptr.save(bad / "block_0", tree)
  ckptr.wait_until_finished()
  _, fresh = new(seed=3)
  with pytest.raises(ValueError, match="block_0 does not match its checksum"):
    checkpoint.restore(fresh, bad)
  path, _, skipped = checkpoint.restore_latest(fresh, tmp_path)
  assert path == good and "checksum" in skipped[0]
  # With no good checkpoint left, a part-restored state is never trained on.
  bad_again = tmp_path / ".damaged-step_1"
  import os as _os
  _os.replace(good, tmp_path / "step_0_moved")
  _os.replace(bad_again, tmp_path / "step_1")
  with pytest.raises(ValueError, match="no checkpoint restores"):
    checkpoint.restore_latest(fresh, tmp_path)


def test_the_hash_catches_what_a_sum_of_words_misses():
  # Two words swapped, or a value moved between words, keep a sum of the words; the hash changes.
  a = np.arange(1, 1001, dtype=np.float32)
  swapped = a.copy()
  swapped[[3, 700]] = swapped[[700, 3]]
  words = a.view(np.uint32).copy()
  moved = words.copy()
  moved[0] += 1
  moved[1] -= 1
  assert words.sum(dtype=np.uint64) == moved.sum(dtype=np.uint64)
  assert len({checkpoint.checksum(x) for x in (a, swapped, moved.view(np.float32))}) == 3
  assert checkpoint.checksum(a) == checkpoint.checksum(a.copy())  # a function of the bytes only


def _enospc_on(group_index):
  """A StandardCheckpointer.save that writes the first groups, then finds the disk full."""
  import errno
  import orbax.checkpoint as ocp
  real, calls = ocp.StandardCheckpointer.save, []

  def save(self, path, *a, **k):
    calls.append(path)
    if len(calls) > group_index:
      Path(path).mkdir(parents=True, exist_ok=True)
      (Path(path) / "partial").write_bytes(b"x" * 100)  # what a full disk leaves: part of a file
      raise OSError(errno.ENOSPC, "No space left on device")
    return real(self, path, *a, **k)
  return save


def test_a_failed_save_leaves_nothing_behind_and_the_state_untouched(tmp_path, monkeypatch):
  import orbax.checkpoint as ocp
  _, st = new()
  good = checkpoint.save(st, tmp_path)
  before = (jax.tree.map(np.copy, st.to_tree()), jax.tree.map(np.copy, st.opt_trees()))
  st.step = 1
  monkeypatch.setattr(ocp.StandardCheckpointer, "save", _enospc_on(1))
  with pytest.raises(checkpoint.SaveFailed) as e:
    checkpoint.save(st, tmp_path)
  assert e.value.errno == 28 and "\n" not in str(e.value)
  assert str(e.value) == f"cannot write step_1 in {tmp_path} (No space left on device)"
  assert sorted(p.name for p in tmp_path.iterdir()) == ["step_0"]  # no partial folder
  chex.assert_trees_all_equal((st.to_tree(), st.opt_trees()), before)
  monkeypatch.undo()
  assert checkpoint.save(st, tmp_path).name == "step_1"  # the retry writes it whole
  assert checkpoint.steps(tmp_path) == [tmp_path / "step_1", good]
  # A checkpoint_dir that vanished is a failed save, never a folder silently made again.
  shutil.rmtree(tmp_path)
  st.step = 2
  with pytest.raises(checkpoint.SaveFailed, match="No such file or directory"):
    checkpoint.save(st, tmp_path)
  assert not tmp_path.exists()


def test_export_of_a_damaged_step_names_the_intact_one(tmp_path, capsys):
  from mtjax import exits, export
  cfg, st = new()
  ck = tmp_path / "ck"
  ck.mkdir()
  for step in (1, 2, 3):
    st.step = step
    checkpoint.save(st, ck, {"config": config.to_dict(cfg)})
  shutil.rmtree(ck / "step_3" / "block_1")  # a group lost from the newest step
  (ck / "step_2" / "meta.json").write_text('{"step": 2, "gro')  # torn
  out = tmp_path / "out"

  def run(arg):
    code = export.main(["--checkpoint", str(arg), "--out", str(out)])
    return code, capsys.readouterr().err

  for arg in (ck, ck / "step_3"):  # the checkpoint_dir's newest step, or that step by name
    code, err = run(arg)
    assert code == exits.BAD_INPUT and err.count("\n") == 1, err
    assert err.startswith(f"error: {ck / 'step_3'} is damaged (group block_1 does not restore ")
    assert err.endswith(f"); {ck / 'step_1'} is intact: --checkpoint {ck / 'step_1'}\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]  # nothing written, nothing beside
  code, err = run(ck / "step_2")
  assert code == exits.BAD_INPUT and err == (f"error: {ck / 'step_2'} is damaged (meta.json "
                                             f"unreadable (JSONDecodeError)); {ck / 'step_1'} is "
                                             f"intact: --checkpoint {ck / 'step_1'}\n")
  assert run(ck / "step_1")[0] == exits.OK and (out / "config.json").is_file()
  shutil.rmtree(out)
  shutil.rmtree(ck / "step_1" / "block_0")
  code, err = run(ck)
  assert code == exits.BAD_INPUT and err.endswith(f"; no older step in {ck} is intact\n")
  code, err = run(tmp_path / "nothing")
  assert code == exits.BAD_INPUT and err == (f"error: --checkpoint: {tmp_path / 'nothing'} is "
                                             f"neither a checkpoint (no meta.json) nor a folder "
                                             f"holding one (step_N)\n")
  assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


def test_export_help_shows_the_defaults(capsys):
  from mtjax import exits, export
  with pytest.raises(SystemExit) as e:
    export.main(["--help"])
  text = " ".join(capsys.readouterr().out.split())
  assert e.value.code == exits.OK
  assert "(default: bfloat16)" in text and "(default: the checkpoint's copy" in text


def test_checking_a_claim_changes_nothing_and_claiming_takes_the_folder(tmp_path):
  ck = tmp_path / "runs" / "ck"
  checkpoint.check_claim(ck, resume=False, overwrite=False)
  assert not (tmp_path / "runs").exists()  # a run refused after this check leaves no folder
  checkpoint.claim(ck, resume=False, overwrite=False)
  assert ck.is_dir() and not any(ck.iterdir())
  _, st = new()
  checkpoint.save(st, ck)  # another run's step
  with pytest.raises(ValueError, match="holds another run's checkpoints .step_0 newest."):
    checkpoint.check_claim(ck, resume=False, overwrite=False)
  checkpoint.check_claim(ck, resume=False, overwrite=True)
  checkpoint.check_claim(ck, resume=True, overwrite=False)
  assert checkpoint.latest(ck) == ck / "step_0"  # kept until the run is claimed
  checkpoint.claim(ck, resume=True, overwrite=False)
  assert checkpoint.latest(ck) == ck / "step_0"  # a resume keeps them
  checkpoint.claim(ck, resume=False, overwrite=True)
  assert checkpoint.latest(ck) is None and ck.is_dir()
  (tmp_path / "file").write_text("x")
  with pytest.raises(ValueError, match="file exists and is not a folder"):
    checkpoint.check_claim(tmp_path / "file", resume=False, overwrite=False)
  with pytest.raises(ValueError, match=r"cannot create .*file/ck \(Not a directory\)"):
    checkpoint.check_claim(tmp_path / "file" / "ck", resume=False, overwrite=False)
  if os.geteuid() != 0:  # root writes anywhere
    (tmp_path / "locked").mkdir(mode=0o500)
    with pytest.raises(ValueError, match=r"cannot create .*locked/a/ck \(Permission denied\)"):
      checkpoint.check_claim(tmp_path / "locked" / "a" / "ck", resume=False, overwrite=False)
  assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["runs", "file"] + (
      ["locked"] if os.geteuid() != 0 else []))
