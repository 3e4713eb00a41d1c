"""Data-parallel cases, run on 4 simulated CPU devices by tests/test_devices.py in a process of its
own (the device count is fixed when the backend starts):

  XLA_FLAGS=--xla_force_host_platform_device_count=4 python -m pytest tests/data_parallel_cases.py

The batch splits over the devices, weights are replicated from the one host copy, XLA's collectives
sum the gradients. Each case holds the N-device engine to the plain reference (jax.grad + optax)
and to the single-device engine on the same global batch.
"""

import dataclasses
import os

import chex
import jax
import pytest
from hypothesis import given, settings, strategies as hst

from mtjax import store as store_lib
from numerics import assert_close
from test_engine import (assert_training_matches_optax, batch_for, make_cfg, new_engine,
                         streamed_and_reference)

N = 4
WIDE = os.environ.get("MTJAX_SOAK") == "1"  # the soak run's wide sweep (tests/conftest.py)


def setup_module():
  assert jax.device_count() >= N, "run with XLA_FLAGS=--xla_force_host_platform_device_count=4"


def with_devices(cfg, n):
  return dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, devices=n))


@hst.composite
def configs(draw):
  layers = draw(hst.integers(1, 3))
  groups = layers + 2
  n_state = draw(hst.integers(0, groups))  # device, stream and host groups, homes round-robin
  micro = draw(hst.sampled_from([None, 1]))
  model = dict(layers=layers, tie_embeddings=draw(hst.booleans()), qkv_bias=draw(hst.booleans()))
  engine_ = dict(devices=N, micro_batch=micro, loss_chunk=draw(hst.sampled_from([7, 1024])),
                 device_state_layers=n_state,
                 device_update_layers=draw(hst.integers(0, groups - n_state)))
  return make_cfg(model, engine_, train=dict(batch=draw(hst.sampled_from([4, 8])), seq=8))


@settings(max_examples=8 if WIDE else 2)
@given(configs(), hst.booleans())
def test_grads_on_n_devices_equal_the_reference_and_one_device(cfg, pack):
  st, eng = new_engine(cfg)
  assert len(st.devices) == N
  loss, grads, ref_loss, ref_grads = streamed_and_reference(cfg, st, eng, pack=pack)
  assert_close(loss, ref_loss, name="loss")
  for g, r, grp in zip(grads, ref_grads, st.groups):
    assert_close(g, r, name=grp.name)
  eng.close()
  st1, eng1 = new_engine(with_devices(cfg, 1))
  loss1, grads1 = eng1.grads(batch_for(cfg, 0, pack))
  assert_close(loss, loss1, name="loss on one device")
  for g, g1, grp in zip(grads, grads1, st.groups):
    assert_close(g, g1, name=f"{grp.name} on one device")
  eng1.close()


@settings(max_examples=8 if WIDE else 3)
@given(configs(), hst.booleans(), hst.sampled_from([None, "host_buffer", "recompute"]))
def test_steps_on_n_devices_equal_plain_optax(cfg, pack, clip):
  if clip:
    cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, clip_norm=0.05,
                                                             clip_mode=clip))
  assert_training_matches_optax(cfg, pack=pack)


def test_device_tier_state_is_spread_over_the_devices_not_copied():
  cfg = make_cfg({"layers": 6}, dict(devices=N, device_state_layers=8), train=dict(batch=4))
  st = store_lib.create(cfg, jax.random.key(0))
  per_device = {d: 0 for d in st.devices}
  for g in st.groups:
    for a in [g.w, *jax.tree.leaves(g.opt)]:
      (shard,) = a.addressable_shards  # one copy, on the group's home device
      assert shard.device == g.home and a.sharding.memory_kind == "device"
      per_device[shard.device] += a.nbytes
  assert sum(per_device.values()) == st.allocated_bytes()["device"]
  assert max(per_device.values()) < 0.5 * sum(per_device.values())  # 8 groups over 4 devices
  st.close()


def test_host_state_is_one_copy_and_gradients_reach_it_reduced():
  cfg = make_cfg({"layers": 2}, dict(devices=N), train=dict(batch=4))
  st, eng = new_engine(cfg)
  for g in st.groups:
    assert g.tier == "host" and len(g.w.addressable_shards) == 1
  host = st.grad_to_host(eng._block_bwd_keep["block"](st.fetch(1), *_block_args(cfg, st, eng))[1])
  assert len(host.addressable_shards) == 1 and host.sharding.memory_kind == "pinned_host"
  eng.close()


def _block_args(cfg, st, eng):
  b = batch_for(cfg)
  inp, = eng._inputs(b)
  x = eng._embed_fwd(st.fetch(0), inp.tokens)
  return x, inp.ctx, x, {}  # a dense block: no auxiliary sums, no cotangent of them


def test_a_batch_that_does_not_split_is_refused_and_state_untouched():
  cfg = make_cfg({"layers": 1}, dict(devices=N), train=dict(batch=6))
  st, eng = new_engine(cfg)
  before = st.to_tree()
  with pytest.raises(ValueError, match="split evenly over 4 device"):
    eng.step(batch_for(cfg))
  chex.assert_trees_all_equal(st.to_tree(), before)
  assert st.step == 0
  eng.close()


def test_layer_programs_split_the_batch_and_all_reduce_the_gradient():
  cfg = make_cfg({"layers": 1}, dict(devices=N), train=dict(batch=8))
  st, eng = new_engine(cfg)
  x, ctx, dy, daux = _block_args(cfg, st, eng)
  assert x.sharding.spec[0] == "data"  # activations stay split
  hlo = eng._block_bwd_keep["block"].lower(st.fetch(1), x, ctx, dy, daux).compile().as_text()
  assert "all-reduce" in hlo
  dx, g, _ = eng._block_bwd_keep["block"](st.fetch(1), x, ctx, dy, daux)
  assert dx.sharding.spec[0] == "data" and g.sharding.is_fully_replicated
  eng.close()
