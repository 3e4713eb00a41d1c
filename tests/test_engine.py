"""The streamed engine against an independent whole-model reference (tests/reference.py + optax)."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, strategies as hst

import reference as ref
from mtjax import config, data, engine, state as state_lib
from mtjax.optimizer import schedule


def make_cfg(model=None, engine_=None, optim=None, train=None) -> config.Config:
  base_model = dict(vocab_size=64, hidden=32, layers=2, heads=4, kv_heads=2, ffn=48)
  return config.from_dict({
      "model": {**base_model, **(model or {})},
      "engine": {"compute_dtype": "float32", "loss_chunk": 24, **(engine_ or {})},
      "optim": {"lr": 1e-2, "warmup_steps": 2, "weight_decay": 0.1, **(optim or {})},
      "train": {"batch": 4, "seq": 8, "steps": 4, **(train or {})},
  })


@hst.composite
def configs(draw):
  heads = draw(hst.sampled_from([2, 4]))
  kv = draw(hst.sampled_from([k for k in (1, 2, 4) if heads % k == 0]))
  head_dim = draw(hst.sampled_from([4, 8]))
  hidden = draw(hst.sampled_from([heads * head_dim, 24]))
  batch = draw(hst.sampled_from([1, 2, 4]))
  model = dict(vocab_size=draw(hst.sampled_from([32, 96])), hidden=hidden,
               layers=draw(hst.integers(1, 4)), heads=heads, kv_heads=kv, head_dim=head_dim,
               ffn=draw(hst.sampled_from([16, 40])), tie_embeddings=draw(hst.booleans()),
               qkv_bias=draw(hst.booleans()),
               rope_scaling=draw(hst.sampled_from(["none", "linear", "llama3"])),
               rope_factor=2.0, rope_original_max_len=16)
  engine_ = dict(micro_batch=draw(hst.sampled_from([None] + [d for d in (1, 2) if batch % d == 0])),
                 loss_chunk=draw(hst.sampled_from([5, 16, 1024])))
  train = dict(batch=batch, seq=draw(hst.sampled_from([4, 8, 12])))
  return make_cfg(model, engine_, train=train)


@functools.partial(jax.jit, static_argnums=(3, 4))
def ref_value_and_grad(params, inputs, targets, cfg, dtype=jnp.float32):
  return jax.value_and_grad(ref.loss_fn)(params, inputs, targets, cfg, dtype)


def batch_for(cfg, step=0):
  return data.synthetic_batch(step, cfg.train.batch, cfg.train.seq, cfg.model.vocab_size, seed=7)


def new_engine(cfg, seed=0):
  st = state_lib.create(cfg.model, jax.random.key(seed))
  return st, engine.Engine(cfg, st)


def streamed_and_reference(cfg, st, eng, step=0):
  """(loss, per-group grads) from the engine and from jax.grad of the reference at st's weights."""
  b = batch_for(cfg, step)
  loss, grads = eng.grads(b)
  ref_loss, ref_tree = ref_value_and_grad(st.to_tree(), b.inputs, b.targets, cfg.model)
  return loss, grads, float(ref_loss), ref.flat_grads(st, ref_tree)


@given(configs())
def test_streamed_grads_equal_whole_model_grad(cfg):
  st, eng = new_engine(cfg)
  loss, grads, ref_loss, ref_grads = streamed_and_reference(cfg, st, eng)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  for g, r, grp in zip(grads, ref_grads, st.groups):
    chex.assert_trees_all_close(g, r, rtol=1e-4, atol=1e-6, custom_message=grp.name)
  eng.close()


def reference_training(cfg, params, batches):
  """Plain optax on the whole-model reference: the semantics the engine must reproduce."""
  o = cfg.optim
  adamw = optax.adamw(schedule(o, cfg.decay_steps), b1=o.b1, b2=o.b2, eps=o.eps,
                      weight_decay=o.weight_decay, mask=ref.decay_mask)
  tx = adamw if o.clip_norm is None else optax.chain(optax.clip_by_global_norm(o.clip_norm), adamw)
  opt_state = tx.init(params)
  losses = []
  for b in batches:
    loss, grads = ref_value_and_grad(params, b.inputs, b.targets, cfg.model)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    losses.append(float(loss))
  adam_state = opt_state[0] if o.clip_norm is None else opt_state[1][0]
  return params, adam_state.mu, adam_state.nu, losses


def assert_training_matches_optax(cfg, steps=3):
  st, eng = new_engine(cfg)
  batches = [batch_for(cfg, i) for i in range(steps)]
  want_w, want_m, want_v, want_losses = reference_training(cfg, st.to_tree(), batches)
  losses = [eng.step(b).loss for b in batches]
  eng.sync()
  m, v = st.moments_tree()
  np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
  # Adam scales every coordinate's step to O(lr) whatever its gradient's size, so where a gradient
  # nearly cancels (the k bias: softmax is almost shift-invariant) a summation-order difference of
  # the fp32 gradient moves the step. 1e-3 * lr bounds that; a real bug (schedule, bias correction,
  # decay mask, clipping) moves weights by O(0.1 * lr) or more.
  atol_w = 1e-3 * cfg.optim.lr
  chex.assert_trees_all_close(st.to_tree(), jax.tree.map(np.asarray, want_w), rtol=1e-5, atol=atol_w)
  chex.assert_trees_all_close(m, jax.tree.map(np.asarray, want_m), rtol=1e-4, atol=1e-7)
  chex.assert_trees_all_close(v, jax.tree.map(np.asarray, want_v), rtol=1e-4, atol=1e-9)
  assert st.step == steps
  eng.close()


@given(configs())
def test_k_streamed_steps_equal_plain_optax(cfg):
  assert_training_matches_optax(cfg)


@pytest.mark.parametrize("variant", [
    dict(engine_=dict(overlap=False)),
    dict(engine_=dict(checkpoints="host", micro_batch=2)),
    dict(optim=dict(impl="optax")),
    dict(optim=dict(clip_norm=0.05, clip_mode="host_buffer")),
    dict(optim=dict(clip_norm=0.05, clip_mode="recompute"), model=dict(tie_embeddings=True)),
    dict(optim=dict(clip_norm=1e3, clip_mode="host_buffer")),  # threshold above the norm: no clip
    dict(engine_=dict(device_update_layers=2)),
    dict(engine_=dict(device_update_layers=4), model=dict(tie_embeddings=True),
         optim=dict(clip_norm=0.05, clip_mode="recompute")),
    dict(engine_=dict(device_update_layers=3, overlap=False),
         optim=dict(clip_norm=0.05, clip_mode="host_buffer")),
], ids=["serial", "host-checkpoints", "optax-impl", "clip-host-buffer", "clip-recompute-tied",
        "clip-inactive", "device-update-2", "device-update-all-tied-clip", "device-update-serial"])
def test_engine_variants_equal_plain_optax(variant):
  assert_training_matches_optax(make_cfg(**variant))


def test_clipping_is_active_in_the_clip_tests():
  cfg = make_cfg(optim=dict(clip_norm=0.05))
  st, eng = new_engine(cfg)
  assert eng.step(batch_for(cfg)).grad_norm > 0.05 * 4  # so clip_by_global_norm really rescales
  eng.close()


@pytest.mark.parametrize("tied", [False, True])
def test_bf16_compute_within_bf16_tolerance(tied):
  cfg = make_cfg(model=dict(tie_embeddings=tied, layers=3), engine_=dict(compute_dtype="bfloat16"))
  st, eng = new_engine(cfg)
  loss, grads, ref_loss, ref_grads = streamed_and_reference(cfg, st, eng)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-2)
  for g, r, grp in zip(grads, ref_grads, st.groups):
    rel = np.linalg.norm(g - r) / np.linalg.norm(r)
    assert rel < 3e-2, (grp.name, rel)  # bf16 has an 8-bit mantissa: ~0.4% per rounding
  eng.close()


def test_loss_falls_on_learnable_task():
  cfg = make_cfg(model=dict(vocab_size=32, hidden=32, layers=2),
                 optim=dict(lr=1e-2, warmup_steps=3, weight_decay=0.0),
                 train=dict(batch=8, seq=16, steps=40))
  st, eng = new_engine(cfg)
  losses = [eng.step(batch_for(cfg, i)).loss for i in range(40)]
  eng.close()
  assert losses[0] == pytest.approx(np.log(32), rel=0.1)
  assert np.mean(losses[-5:]) < 0.6 * losses[0], losses


def count_compiles(fn):
  n = [0]

  def listener(event, duration, **kw):
    if event == "/jax/core/compile/backend_compile_duration":
      n[0] += 1

  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    fn()
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)
  return n[0]


@pytest.mark.parametrize("clip", [None, 0.05])
def test_compilations_do_not_grow_with_layers_or_steps(clip):
  def compiles(layers, steps):
    cfg = make_cfg(model=dict(layers=layers), optim=dict(clip_norm=clip, clip_mode="recompute"))
    st, eng = new_engine(cfg)
    b = batch_for(cfg)
    first = count_compiles(lambda: eng.step(b))
    later = count_compiles(lambda: [eng.step(b) for _ in range(steps - 1)])
    eng.close()
    return first, later

  one_layer, three_layers = compiles(1, 1), compiles(3, 3)
  assert three_layers[1] == 0  # later steps reuse every executable
  assert one_layer[0] == three_layers[0]  # one executable per layer kind, not per layer
  assert one_layer[0] <= 10


def test_state_is_host_resident_at_12_bytes_per_param():
  cfg = make_cfg()
  st, eng = new_engine(cfg)
  eng.step(batch_for(cfg))
  eng.sync()
  assert st.host_bytes() == 12 * st.n_params
  for g in st.groups:
    assert g.w.sharding.memory_kind == "pinned_host"
    assert g.w_np.dtype == g.m_np.dtype == g.v_np.dtype == np.float32
  eng.close()


def test_weights_loaded_between_steps_replace_device_copies():
  cfg = make_cfg(engine_=dict(device_update_layers=3))
  st, eng = new_engine(cfg)
  eng.step(batch_for(cfg))
  eng.sync()
  st.load_tree(state_lib.create(cfg.model, jax.random.key(9)).to_tree())
  loss, grads, ref_loss, ref_grads = streamed_and_reference(cfg, st, eng, step=1)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  for g, r in zip(grads, ref_grads):
    chex.assert_trees_all_close(g, r, rtol=1e-4, atol=1e-6)
  eng.close()


def test_bad_batch_is_refused_without_touching_state():
  cfg = make_cfg()
  st, eng = new_engine(cfg)
  before = st.to_tree()
  bad = data.Batch(np.full((4, 8), 64, np.int32), np.zeros((4, 8), np.int32))
  with pytest.raises(ValueError, match="batch.inputs"):
    eng.step(bad)
  chex.assert_trees_all_equal(st.to_tree(), before)
  assert st.step == 0
  eng.close()


def test_device_updated_weights_reach_the_host_at_sync_and_loaded_weights_win():
  cfg = make_cfg(engine_=dict(device_update_layers=3))
  st, eng = new_engine(cfg)
  eng.step(batch_for(cfg))
  eng.sync()
  synced = st.to_tree()
  eng.step(batch_for(cfg, 1))
  eng.opt.wait_all()  # host updates done; the device-updated groups' host weights still lag
  assert np.array_equal(st.embed.w_np, st.embed.layout.flatten(synced["embed"]))
  eng.sync()
  assert not np.allclose(st.embed.w_np, st.embed.layout.flatten(synced["embed"]))
  eng.step(batch_for(cfg, 2))
  eng.opt.wait_all()
  fresh = state_lib.create(cfg.model, jax.random.key(9)).to_tree()
  st.load_tree(fresh)  # overwrites the host weights while the device holds newer ones
  eng.close()  # syncs: the loaded weights must survive it
  chex.assert_trees_all_equal(st.to_tree(), fresh)


@pytest.mark.parametrize("device_updates", [0, 2])
def test_schedule_runs_on_the_cpu_once_per_step(device_updates):
  # On the default device (the GPU) the schedule's tiny computation queues behind the layer being
  # computed, so evaluating it per update made every host update wait for the device's work.
  cfg = make_cfg(engine_={"device_update_layers": device_updates})
  st, eng = new_engine(cfg)
  seen, sched = [], eng.opt.schedule
  def recording(step):
    seen.append((step, jax.config.jax_default_device))
    return sched(step)
  eng.opt.schedule = recording
  for step in range(3):
    eng.step(batch_for(cfg, step))
  eng.close()
  assert [s for s, _ in seen] == [0, 1, 2]
  assert all(d is not None and d.platform == "cpu" for _, d in seen), seen
