"""The streamed engine against an independent whole-model reference (tests/reference.py + optax)."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, strategies as hst

import dataclasses

import reference as ref
from numerics import assert_close, assert_trees_close
from mtjax import config, data, engine, store as store_lib
from mtjax.optimizer import schedule


def make_cfg(model=None, engine_=None, optim=None, train=None) -> config.Config:
  base_model = dict(vocab_size=64, hidden=32, layers=2, heads=4, kv_heads=2, ffn=48)
  return config.from_dict({
      "model": {**base_model, **(model or {})},
      "engine": {"compute_dtype": "float32", "loss_chunk": 24, "device_state_layers": 0,
                 "device_update_layers": 0,
                 **(engine_ or {})},
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
  if draw(hst.booleans()):  # Granite's scalars: the embedding's backward, residuals, loss chunks
    model.update(embed_multiplier=2.0, residual_multiplier=0.7, logits_divisor=3.0)
  # NoPE layers: a kind of their own, compiled apart from the rotary ones. Not with q/k/v biases:
  # without RoPE the softmax is exactly shift-invariant in the keys, so the k bias's gradient is
  # zero and both sides hold only rounding noise, which no relative bound can compare.
  if not model["qkv_bias"]:
    model["nope_layers"] = tuple(draw(hst.sets(hst.integers(0, model["layers"] - 1), max_size=2)))
  groups = model["layers"] + 2
  n_state = draw(hst.integers(0, groups))  # tiered placements: device, stream, host groups
  accum = draw(hst.sampled_from([k for k in (1, 2, 4) if batch % k == 0]))  # passes per step
  per_pass = batch // accum
  engine_ = dict(micro_batch=draw(hst.sampled_from([None] + [d for d in (1, 2) if per_pass % d == 0])),
                 loss_chunk=draw(hst.sampled_from([5, 16, 1024])), device_state_layers=n_state,
                 seq_tile=draw(hst.sampled_from([None, 5])),  # tiles that do not divide seq
                 activations_every=draw(hst.sampled_from([1, 2, 3])),
                 activations=draw(hst.sampled_from(["device", 1, "host"])),  # kept inputs spilled
                 device_update_layers=draw(hst.integers(0, groups - n_state)))
  train = dict(batch=batch, seq=draw(hst.sampled_from([4, 8, 12])), grad_accum=accum)
  return make_cfg(model, engine_, train=train)


@dataclasses.dataclass(frozen=True)
class PackedBatch:
  """A batch of packed documents: what the engine reads beyond inputs and targets."""
  inputs: np.ndarray
  targets: np.ndarray
  positions: np.ndarray
  segments: np.ndarray
  loss_weights: np.ndarray


def packed(b, seed):
  """`b` cut into documents at random places: positions restart, segments split, and the loss
  weighs a random subset of tokens (an SFT mask) and never a document's last token."""
  rng = np.random.default_rng(seed)
  B, T = b.inputs.shape
  seg = np.cumsum(rng.random((B, T)) < 0.3, axis=1).astype(np.int32)
  pos = np.zeros((B, T), np.int32)
  for r in range(B):
    for t in range(1, T):
      pos[r, t] = 0 if seg[r, t] != seg[r, t - 1] else pos[r, t - 1] + 1
  last = np.concatenate([seg[:, 1:] != seg[:, :-1], np.ones((B, 1), bool)], axis=1)
  lw = ((rng.random((B, T)) < 0.7) & ~last).astype(np.float32)
  lw[0, 0] = 1.0  # never all zero
  return PackedBatch(b.inputs, b.targets, pos, seg, lw)


@functools.partial(jax.jit, static_argnums=(3, 4))
def ref_value_and_grad(params, inputs, targets, cfg, dtype=jnp.float32):
  return jax.value_and_grad(ref.loss_fn)(params, inputs, targets, cfg, dtype)


def batch_for(cfg, step=0, pack=False):
  b = data.synthetic_batch(step, cfg.train.batch, cfg.train.seq, cfg.model.vocab_size, seed=7)
  return packed(b, step) if pack else b


def new_engine(cfg, seed=0, overlap=True):
  st = store_lib.create(cfg, jax.random.key(seed))
  return st, engine.Engine(cfg, st, overlap)


def ref_loss_and_grads(cfg, params, b):
  extra = {k: getattr(b, k) for k in ("positions", "segments", "loss_weights") if hasattr(b, k)}
  return jax.value_and_grad(ref.loss_fn)(params, b.inputs, b.targets, cfg.model, **extra)


def streamed_and_reference(cfg, st, eng, step=0, pack=False):
  """(loss, per-group grads) from the engine and from jax.grad of the reference at st's weights."""
  b = batch_for(cfg, step, pack)
  loss, grads = eng.grads(b)
  ref_loss, ref_tree = ref_loss_and_grads(cfg, st.to_tree(), b)
  return loss, grads, float(ref_loss), ref.flat_grads(st, ref_tree)


@given(configs(), hst.booleans())
def test_streamed_grads_equal_whole_model_grad(cfg, pack):
  st, eng = new_engine(cfg)
  loss, grads, ref_loss, ref_grads = streamed_and_reference(cfg, st, eng, pack=pack)
  assert_close(loss, ref_loss, name="loss")
  for g, r, grp in zip(grads, ref_grads, st.groups):
    assert_close(g, r, name=grp.name)
  eng.close()


def reference_tx(o, decay_steps):
  """The optax transformation a config names, built here from optax alone."""
  sched = schedule(o, decay_steps)
  tx = {
      "adamw": lambda: optax.adamw(sched, b1=o.b1, b2=o.b2, eps=o.eps,
                                   weight_decay=o.weight_decay, mask=ref.decay_mask),
      "lion": lambda: optax.lion(sched, b1=o.b1, b2=o.b2, weight_decay=o.weight_decay,
                                 mask=ref.decay_mask),
      "sgd": lambda: optax.sgd(sched, momentum=o.momentum),
      "adam": lambda: optax.adam(sched, b1=o.b1, b2=o.b2, eps=o.eps),
  }[o.name]()
  return tx if o.clip_norm is None else optax.chain(optax.clip_by_global_norm(o.clip_norm), tx)


def reference_training(cfg, params, batches):
  """Plain optax on the whole-model reference: the semantics the engine must reproduce."""
  tx = reference_tx(cfg.optim, cfg.decay_steps)
  opt_state = tx.init(params)
  losses = []
  for b in batches:
    loss, grads = ref_loss_and_grads(cfg, params, b)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    losses.append(float(loss))
  return params, opt_state, losses


def assert_training_matches_optax(cfg, steps=3, overlap=True, pack=False):
  st, eng = new_engine(cfg, overlap=overlap)
  batches = [batch_for(cfg, i, pack) for i in range(steps)]
  want_w, want_state, want_losses = reference_training(cfg, st.to_tree(), batches)
  losses = [eng.step(b).loss for b in batches]
  eng.sync()
  assert_close(losses, want_losses, name="losses")
  # Adam scales every coordinate's step to O(lr) whatever its gradient's size, so where a gradient
  # nearly cancels (the k bias: softmax is almost shift-invariant) a summation-order difference of
  # the fp32 gradient moves the step. 1e-3 * lr bounds that; a real bug (schedule, bias correction,
  # decay mask, clipping) moves weights by O(0.1 * lr) or more.
  assert_trees_close(st.to_tree(), want_w, atol=1e-3 * cfg.optim.lr, name="weights")
  if cfg.optim.name == "adamw" and cfg.optim.impl == "fused":
    adam = want_state[0] if cfg.optim.clip_norm is None else want_state[1][0]
    m, v = st.moments_tree()
    assert_trees_close(m, adam.mu, name="m")
    assert_trees_close(v, adam.nu, name="v")
  assert st.step == steps
  eng.close()


@given(configs(), hst.booleans())
def test_k_streamed_steps_equal_plain_optax(cfg, pack):
  assert_training_matches_optax(cfg, pack=pack)


def test_serial_engine_equals_plain_optax():
  assert_training_matches_optax(make_cfg(engine_=dict(device_update_layers=1,
                                                      device_state_layers=1)), overlap=False)


@pytest.mark.parametrize("variant", [
    dict(engine_=dict(activations="host", micro_batch=2, seq_tile=3)),  # 8 tokens: 3 + 3 + 2
    dict(optim=dict(impl="optax")),
    dict(optim=dict(name="lion", lr=1e-3)),
    dict(optim=dict(name="sgd", momentum=0.9), engine_=dict(device_state_layers=2)),
    dict(optim=dict(name="adam", clip_norm=0.05), engine_=dict(device_update_layers=2)),
    dict(optim=dict(clip_norm=0.05, clip_mode="host_buffer")),
    dict(optim=dict(clip_norm=0.05, clip_mode="recompute"), model=dict(tie_embeddings=True)),
    dict(optim=dict(clip_norm=1e3, clip_mode="host_buffer")),  # threshold above the norm: no clip
    dict(engine_=dict(device_update_layers=2)),
    dict(engine_=dict(device_update_layers=4, activations_every=2), model=dict(tie_embeddings=True),
         optim=dict(clip_norm=0.05, clip_mode="recompute")),
    dict(engine_=dict(device_update_layers=1, device_state_layers=2),
         optim=dict(clip_norm=0.05, clip_mode="host_buffer")),
    dict(engine_=dict(device_state_layers=4), model=dict(tie_embeddings=True),
         optim=dict(clip_norm=0.05, clip_mode="recompute")),
], ids=["host-activations-seq-tiles", "optax-impl", "lion", "sgd-device-tier", "adam-streamed-clip",
        "clip-host-buffer", "clip-recompute-tied", "clip-inactive", "device-update-2",
        "device-update-all-tied-clip", "tiers-mixed-clip", "device-tier-all-tied-recompute"])
def test_engine_variants_equal_plain_optax(variant):
  assert_training_matches_optax(make_cfg(**variant))


def test_every_kth_block_input_is_kept_and_the_plan_counts_it():
  cfg = make_cfg({"layers": 5}, dict(activations_every=2))
  st, eng = new_engine(cfg)
  saved = eng._forward(eng._inputs(batch_for(cfg))[0]).saved
  assert [x is not None for x in saved] == [True, False, True, False, True]  # blocks 0, 2, 4
  eng.close()
  from mtjax import plan
  act = lambda k: plan.make(make_cfg({"layers": 12}, dict(activations_every=k))).device[
      "saved activations"]
  assert act(1) * (3 + 5) == 12 * act(4)  # 12 kept vs 3 kept + a 4-block segment re-run + 1
  # auto: all kept while they fit, else the fewest kept that fit the device
  big = make_cfg({"layers": 12}, dict(activations_every="auto"), train=dict(batch=64, seq=512))
  full = plan.make(dataclasses.replace(big, engine=dataclasses.replace(big.engine,
                                                                       activations_every=1)))
  assert plan.make(big, device_limit=10 * full.device_total).activations_every == 1
  tight = plan.make(big, device_limit=full.device_total - full.device["saved activations"] // 5)
  assert tight.activations_every > 1 and tight.fits_device
  assert tight.resolve(big).engine.activations_every == tight.activations_every


def test_the_first_kept_inputs_spill_to_host_and_the_plan_spills_the_fewest_that_fit():
  cfg = make_cfg({"layers": 5}, dict(activations_every=2, activations=2))
  st, eng = new_engine(cfg)
  saved = eng._forward(eng._inputs(batch_for(cfg))[0]).saved
  kinds = [None if x is None else x.sharding.memory_kind for x in saved]
  device_kind = jax.devices()[0].default_memory().kind
  assert kinds == ["pinned_host", None, "pinned_host", None, device_kind]  # kept: blocks 0, 2, 4
  eng.close()
  from mtjax import plan
  big = make_cfg({"layers": 12}, dict(activations="auto"), train=dict(batch=64, seq=512))
  at = lambda n: plan.make(dataclasses.replace(big, engine=dataclasses.replace(big.engine,
                                                                              activations=n)))
  full, one = at(0), at(1)
  ckpt = 64 * 512 * big.model.hidden * {"bfloat16": 2, "float32": 4}[big.engine.compute_dtype]
  assert full.device["saved activations"] == 12 * ckpt and full.host["activations on host"] == 0
  assert one.device["saved activations"] == (11 + 2) * ckpt  # two in flight back from the host
  assert at("host").host["activations on host"] == 12 * ckpt
  assert plan.make(big, device_limit=10 * full.device_total).activations_on_host == 0
  limit = at(7).device_total  # seven spilled fit exactly (12 - 7 + 2 = 7 kept on the device)
  assert full.device_total - limit >= 5 * ckpt
  tight = plan.make(big, device_limit=limit)
  assert tight.fits_device and tight.activations_every == 1
  assert tight.activations_on_host == 7  # the fewest that fit
  assert not at(6).device_total <= limit  # six would not fit
  assert tight.resolve(big).engine.activations == 7
  assert tight.host["activations on host"] == 7 * ckpt
  # both auto: spilling competes with re-running segments on the simulated step
  both = dataclasses.replace(big, engine=dataclasses.replace(big.engine, activations_every="auto"))
  chosen = plan.make(both, device_limit=limit)
  assert chosen.fits_device and chosen.fits_host
  rivals = [plan.make(dataclasses.replace(big, engine=dataclasses.replace(
      big.engine, activations_every=k)), device_limit=limit) for k in plan.ACTIVATIONS_EVERY]
  assert chosen.schedule_s == min(p.schedule_s for p in rivals if p.fits_device)
  # and the choice is a real one: the policies that fit predict different steps
  assert len({round(p.schedule_s, 9) for p in rivals if p.fits_device}) > 1


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


@pytest.mark.parametrize("n_state,n_stream", [(0, 0), (0, 2), (2, 1), (4, 0)])
def test_state_bytes_are_where_the_placement_says(n_state, n_stream):
  cfg = make_cfg(engine_=dict(device_state_layers=n_state, device_update_layers=n_stream))
  st, eng = new_engine(cfg)
  eng.step(batch_for(cfg))
  eng.sync()
  # Counted from the buffers the store holds, by the memory each one sits in.
  got = {"host": 0, "pinned_host": 0, "device": 0}
  for g in st.groups:
    for a in [g.w, *jax.tree.leaves(g.opt)]:
      assert a.dtype == np.float32
      got["host" if isinstance(a, np.ndarray) else a.sharding.memory_kind] += a.size * 4
  sizes = [g.size for g in st.groups]
  dev, stream, host = sizes[:n_state], sizes[n_state:n_state + n_stream], sizes[n_state + n_stream:]
  assert got == {"device": 12 * sum(dev), "pinned_host": 12 * sum(stream) + 4 * sum(host),
                 "host": 8 * sum(host)}
  assert st.tiers() == ["device"] * n_state + ["stream"] * n_stream + ["host"] * len(host)
  eng.close()


def test_weights_loaded_between_steps_replace_device_copies():
  cfg = make_cfg(engine_=dict(device_update_layers=2, device_state_layers=1))
  st, eng = new_engine(cfg)
  eng.step(batch_for(cfg))
  eng.sync()
  st.load_tree(store_lib.create(cfg, jax.random.key(9)).to_tree())
  loss, grads, ref_loss, ref_grads = streamed_and_reference(cfg, st, eng, step=1)
  assert_close(loss, ref_loss, name="loss")
  for g, r, grp in zip(grads, ref_grads, st.groups):
    assert_close(g, r, name=grp.name)
  eng.close()


def test_device_tree_is_every_tiers_current_weights_cast_on_the_device():
  # one group of each tier, after a step (stream weights resident until sync): the sampler's
  # tree equals the host copy, exactly in fp32 and as numpy's cast in bf16
  cfg = make_cfg(engine_=dict(device_state_layers=1, device_update_layers=1))
  st, eng = new_engine(cfg)
  eng.step(batch_for(cfg))
  eng.sync()
  host = st.to_tree()
  chex.assert_trees_all_equal(jax.device_get(st.device_tree(jnp.float32)), host)
  got = st.device_tree(jnp.bfloat16)
  assert all(a.dtype == jnp.bfloat16 and a.sharding.memory_kind == "device"
             for a in jax.tree.leaves(got))
  chex.assert_trees_all_equal(jax.device_get(got),
                              jax.tree.map(lambda a: a.astype(jnp.bfloat16), host))
  assert st.tiers() == ["device", "stream"] + ["host"] * (len(st.groups) - 2)
  eng.close()


def test_bad_batch_is_refused_without_touching_state():
  cfg = make_cfg()
  st, eng = new_engine(cfg)
  before = st.to_tree()
  bad = data.Batch(np.full((4, 8), 64, np.int32), np.zeros((4, 8), np.int32))
  with pytest.raises(ValueError, match="batch.inputs"):
    eng.step(bad)
  b = batch_for(cfg)
  with pytest.raises(ValueError, match="batch.loss_weights"):
    eng.step(PackedBatch(b.inputs, b.targets, np.zeros((4, 8), np.int32),
                         np.zeros((4, 8), np.int32), np.zeros((4, 8), np.float32)))
  chex.assert_trees_all_equal(st.to_tree(), before)
  assert st.step == 0
  eng.close()


def test_streamed_weights_reach_the_host_at_sync_and_loaded_weights_win():
  cfg = make_cfg(engine_=dict(device_update_layers=3))
  st, eng = new_engine(cfg)
  eng.step(batch_for(cfg))
  eng.sync()
  synced = st.to_tree()
  eng.step(batch_for(cfg, 1))
  st.host_opt.wait_all()  # host updates done; the streamed groups' host weights still lag
  assert np.array_equal(np.asarray(st.embed.w), st.embed.layout.flatten(synced["embed"]))
  eng.sync()
  assert not np.allclose(np.asarray(st.embed.w), st.embed.layout.flatten(synced["embed"]))
  eng.step(batch_for(cfg, 2))
  st.host_opt.wait_all()
  fresh = store_lib.create(cfg, jax.random.key(9)).to_tree()
  st.load_tree(fresh)  # overwrites the host weights while the device holds newer ones
  eng.close()  # syncs: the loaded weights must survive it
  chex.assert_trees_all_equal(st.to_tree(), fresh)


def test_error_in_the_optimizer_thread_reaches_the_caller_and_spares_the_group():
  cfg = make_cfg(model=dict(layers=3))
  st, eng = new_engine(cfg)
  eng.step(batch_for(cfg))
  eng.sync()
  before = st.read(2)
  real = st.rule.host_update

  def failing(w, opt, g, step, scale, layout):
    if layout is st.groups[2].layout and w is st._host_view(2, "w"):
      raise RuntimeError("injected failure in the host update of block_1")
    return real(w, opt, g, step, scale, layout)

  st.rule.host_update = failing
  with pytest.raises(RuntimeError, match="host update of block_1 at step 2 failed: .*injected"):
    eng.step(batch_for(cfg, 1))
    eng.sync()
  after = st.read(2)
  np.testing.assert_array_equal(after["w"], before["w"])  # the failed group was not touched
  chex.assert_trees_all_equal(after["opt"], before["opt"])
  st.rule.host_update = real
  eng.close()


@pytest.mark.parametrize("device_updates", [0, 2])
def test_schedule_runs_on_the_cpu_once_per_step(device_updates):
  # On the default device (the GPU) the schedule's tiny computation queues behind the layer being
  # computed, so evaluating it per update made every host update wait for the device's work.
  cfg = make_cfg(engine_={"device_update_layers": device_updates})
  st, eng = new_engine(cfg)
  seen, sched = [], st.rule.schedule
  def recording(step):
    seen.append((step, jax.config.jax_default_device))
    return sched(step)
  st.rule.schedule = recording
  for step in range(3):
    eng.step(batch_for(cfg, step))
  eng.close()
  assert [s for s, _ in seen] == [0, 1, 2]
  assert all(d is not None and d.platform == "cpu" for _, d in seen), seen
