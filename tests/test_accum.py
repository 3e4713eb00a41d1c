"""Gradient accumulation (train.grad_accum): K passes over slices of the batch, one update, against
one pass over the whole batch and plain jax.grad + optax."""

from pathlib import Path

import pytest

from numerics import assert_close
from test_engine import (assert_training_matches_optax, batch_for, make_cfg, new_engine,
                         ref_loss_and_grads)
import reference as ref
from mtjax import plan, train

TINY = Path(__file__).parent.parent / "configs" / "tiny.yaml"


@pytest.mark.parametrize("pack", [False, True])
def test_four_passes_give_the_gradient_of_the_whole_batch(pack):
  cfg = make_cfg(engine_=dict(device_state_layers=1, device_update_layers=1),
                 train=dict(batch=8, grad_accum=4))
  st, eng = new_engine(cfg)
  b = batch_for(cfg, pack=pack)  # 8 rows: 4 passes of 2
  loss, grads = eng.grads(b)
  want_loss, want_tree = ref_loss_and_grads(cfg, st.to_tree(), b)
  assert_close(loss, float(want_loss), name="loss")
  for g, r, grp in zip(grads, ref.flat_grads(st, want_tree), st.groups):
    assert_close(g, r, name=grp.name)
  eng.close()


@pytest.mark.parametrize("variant", [
    dict(),
    dict(optim=dict(clip_norm=0.05, clip_mode="host_buffer"),
         engine_=dict(device_state_layers=1, device_update_layers=1)),
    # recompute would re-run every pass: the accumulated sums are held and clipped instead
    dict(optim=dict(clip_norm=0.05, clip_mode="recompute"), model=dict(tie_embeddings=True),
         engine_=dict(device_update_layers=2, micro_batch=1)),
], ids=["host", "clip-tiers", "clip-recompute-tied"])
def test_three_accumulated_steps_equal_plain_optax_on_the_whole_batch(variant):
  train = dict(batch=8, grad_accum=4)
  assert_training_matches_optax(make_cfg(**variant, train=train), pack=True)


def test_each_group_is_updated_once_per_step():
  cfg = make_cfg(train=dict(batch=8, grad_accum=4))
  st, eng = new_engine(cfg)
  submitted = []
  submit = st.host_opt.submit
  st.host_opt.submit = lambda idx, *a, **k: (submitted.append(idx), submit(idx, *a, **k))[1]
  stats = eng.step(batch_for(cfg))
  eng.sync()
  assert sorted(submitted) == list(range(len(st.groups)))  # every host group, once
  assert stats.tokens == 8 * cfg.train.seq and stats.step == 1
  parts = stats.forward_s + stats.backward_s + stats.finish_s
  assert parts == pytest.approx(stats.step_s, rel=1e-6)
  eng.close()


def test_the_plan_counts_the_passes():
  one = plan.make(make_cfg(model=dict(layers=4), train=dict(batch=8)))
  four = plan.make(make_cfg(model=dict(layers=4), train=dict(batch=8, grad_accum=4)))
  # the weights cross the link once per pass (and the host groups' sums beside them)
  assert four.step_s["host->device"] > 3.5 * one.step_s["host->device"]
  # the same FLOPs; each pass's loss runs in chunks of its own (64 tokens in 3 chunks of 24, or
  # 4 passes of one chunk of 16): one more pass over the head's weights
  head = plan.HEAD_CHUNK_BYTES * 64 * 32 / (plan.Rates().hbm_gbps * 1e9)
  assert four.step_s["compute"] - one.step_s["compute"] == pytest.approx(head, rel=1e-6)
  assert four.device["saved activations"] * 4 == one.device["saved activations"]
  assert four.host["gradient accumulation sums"] > 0 and "gradient accumulation sums" not in {
      k for k, v in one.host.items() if v}
  assert four.schedule_s > one.schedule_s


@pytest.mark.parametrize("override, message", [
    (["train.grad_accum=3"], "train.grad_accum: 3 does not divide train.batch (8)"),
    (["train.grad_accum=0"], "train.grad_accum: 0 must be > 0"),
    (["train.grad_accum=4", "engine.micro_batch=4"],
     "engine.micro_batch: 4 does not divide the 2 sequences of a pass"),
])
def test_bad_accumulation_config_is_one_line_and_exit_2(override, message, tmp_path, capsys):
  with pytest.raises(SystemExit) as e:  # the CLI's config parsing exits
    train.main(["--no-progress", "--config", str(TINY), "train.steps=1",
                f"train.run_dir={tmp_path}", *override])
  code = e.value.code
  err = capsys.readouterr().err.strip().splitlines()
  assert code == 2 and len(err) == 1 and message in err[0], err
