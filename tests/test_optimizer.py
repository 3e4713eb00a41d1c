"""Host and device updates against optax (adamw, lion, sgd, adafactor) applied to the same arrays."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, strategies as hst

from mtjax import config, store as store_lib
from mtjax.layout import Layout
from mtjax.optimizer import HostOptimizer, UpdateRule, clip_scale, schedule
from numerics import assert_close, assert_trees_close


def make_group(n_mat, n_vec, rng, rule=None):
  lay = Layout.from_shapes({"a": jax.ShapeDtypeStruct((n_mat, 3), jnp.float32),
                                      "b": jax.ShapeDtypeStruct((n_vec,), jnp.float32)})
  w = rng.standard_normal(lay.size).astype(np.float32)
  opt = (rule or UpdateRule(config.OptimConfig(), 10)).init_host(lay)
  return store_lib.Group("g", "block", lay, "host", w, opt)


def view_of(group):
  return lambda attr: group.w if attr == "w" else group.opt[attr]


REFERENCE = {  # built from optax alone, as a user would
    "adamw": lambda c, s: optax.adamw(s, b1=c.b1, b2=c.b2, eps=c.eps, weight_decay=c.weight_decay,
                                      mask=lambda p: jax.tree.map(lambda a: a.ndim >= 2, p)),
    "lion": lambda c, s: optax.lion(s, b1=c.b1, b2=c.b2, weight_decay=c.weight_decay,
                                    mask=lambda p: jax.tree.map(lambda a: a.ndim >= 2, p)),
    "sgd": lambda c, s: optax.sgd(s, momentum=c.momentum),
    "adafactor": lambda c, s: optax.adafactor(
        s, weight_decay_rate=c.weight_decay or None,
        weight_decay_mask=lambda p: jax.tree.map(lambda a: a.ndim >= 2, p)),
}


@given(opt=hst.sampled_from([("adamw", "fused"), ("adamw", "optax"), ("lion", "optax"),
                             ("sgd", "optax"), ("adafactor", "optax")]),
       n_mat=hst.integers(1, 50), n_vec=hst.integers(1, 20), wd=hst.sampled_from([0.0, 0.1]),
       scale=hst.sampled_from([1.0, 0.3]), warmup=hst.sampled_from([0, 2]))
def test_host_updates_equal_optax(opt, n_mat, n_vec, wd, scale, warmup):
  name, impl = opt
  cfg = config.OptimConfig(name=name, impl=impl, lr=0.05, weight_decay=wd, warmup_steps=warmup)
  rule = UpdateRule(cfg, 6)
  rng = np.random.default_rng(n_mat * 100 + n_vec)
  grp = make_group(n_mat, n_vec, rng, rule)
  params = grp.layout.unflatten(grp.w.copy())
  tx = REFERENCE[name](cfg, schedule(cfg, 6))
  opt_state = tx.init(params)
  host = HostOptimizer(cfg, rule)
  for step in range(4):
    g = rng.standard_normal(grp.layout.size).astype(np.float32)
    host.update(grp, g, step, scale, view_of(grp))
    updates, opt_state = tx.update(jax.tree.map(lambda a: a * scale, grp.layout.unflatten(g)),
                                   opt_state, params)
    params = optax.apply_updates(params, updates)
  host.close()
  assert_close(grp.w, grp.layout.flatten(params), name="weights")
  if rule.fused:
    assert_close(grp.opt["m"], grp.layout.flatten(opt_state[0].mu), name="m")
    assert_close(grp.opt["v"], grp.layout.flatten(opt_state[0].nu), name="v")
  else:
    assert_trees_close(grp.opt, opt_state, name="optimizer state")


def test_worker_thread_applies_updates_in_order():
  rng = np.random.default_rng(0)
  a, b = make_group(10, 3, rng), make_group(10, 3, rng)
  a_ref, b_ref = make_group(10, 3, np.random.default_rng(0)), make_group(10, 3, np.random.default_rng(0))
  b_ref.w[:] = b.w
  rule = UpdateRule(config.OptimConfig(), 10)
  opt = HostOptimizer(config.OptimConfig(), rule)
  views = {0: view_of(a), 1: view_of(b)}
  view = lambda idx, attr: views[idx](attr)
  grads = [rng.standard_normal(a.layout.size).astype(np.float32) for _ in range(3)]
  for step, g in enumerate(grads):
    opt.submit(0, a, g, step, 1.0, view)
    opt.wait(0)
    opt.update(a_ref, g, step, 1.0, view_of(a_ref))
  opt.submit(1, b, grads[0], 0, 1.0, view)
  opt.wait_all()
  opt.update(b_ref, grads[0], 0, 1.0, view_of(b_ref))
  np.testing.assert_array_equal(a.w, a_ref.w)
  np.testing.assert_array_equal(b.w, b_ref.w)
  opt.close()


def test_wrong_gradient_is_refused_without_touching_state():
  grp = make_group(4, 2, np.random.default_rng(0))
  before = grp.w.copy()
  opt = HostOptimizer(config.OptimConfig(), UpdateRule(config.OptimConfig(), 10))
  with pytest.raises(ValueError, match="gradient"):
    opt.update(grp, np.zeros(grp.layout.size + 1, np.float32), 0, 1.0, view_of(grp))
  with pytest.raises(ValueError, match="float32"):
    opt.update(grp, np.zeros(grp.layout.size, np.float64), 0, 1.0, view_of(grp))
  np.testing.assert_array_equal(grp.w, before)
  assert not grp.opt["m"].any()
  opt.close()


def test_schedule_warms_up_then_decays_to_floor():
  cfg = config.OptimConfig(lr=1.0, warmup_steps=4, min_lr_ratio=0.1)
  s = schedule(cfg, 20)
  assert float(s(0)) == 0.0 and float(s(4)) == pytest.approx(1.0)
  assert float(s(2)) == pytest.approx(0.5)
  assert float(s(20)) == pytest.approx(0.1)
  assert float(s(12)) == pytest.approx(0.1 + 0.9 * 0.5, rel=1e-5)


@pytest.mark.parametrize("norm", [0.5, 2.0, 10.0])
def test_clip_scale_matches_optax(norm):
  g = {"a": jnp.ones(4) * norm / 2}  # global norm == norm
  clipped, _ = optax.clip_by_global_norm(2.0).update(g, None)
  assert_close(g["a"] * clip_scale(norm, 2.0), clipped["a"], name="clipped")
  assert clip_scale(norm, None) == 1.0


@pytest.mark.parametrize("name", ["adamw", "lion"])
def test_device_update_equals_host_update(name):
  cfg = config.OptimConfig(name=name, lr=0.05, warmup_steps=0)
  rule = UpdateRule(cfg, 10)
  rng = np.random.default_rng(5)
  grp = make_group(30, 7, rng, rule)
  w, opt = jax.device_put(jax.tree.map(np.copy, (grp.w, grp.opt)))  # no aliasing on the CPU
  host = HostOptimizer(cfg, rule)
  step = jax.jit(rule.device_update, static_argnums=(4,))
  for i in range(3):
    g = rng.standard_normal(grp.layout.size).astype(np.float32)
    host.update(grp, g, i, 0.5, view_of(grp))
    w, opt = step(w, opt, g * np.float32(0.5), rule.scalars(i), grp.layout)
  host.close()
  assert_close(w, grp.w, name="weights")
  assert_trees_close(opt, grp.opt, name="optimizer state")


@pytest.mark.parametrize("where", ["host", "device"])
def test_bfloat16_moments_round_the_fp32_update(where):
  """optim.state_dtype bfloat16: each step widens the stored moments, runs the fp32 AdamW formula
  (written here in numpy), updates w with the unrounded moments and stores them rounded to nearest
  even (ml_dtypes' cast). Checked step by step from the state the kernel left, so the reference
  never drifts: weights to fp32 rounding; each moment's bits equal the cast's, or (where the fp32
  value lies within an ulp of a rounding midpoint and fused multiply-adds moved it across) one
  bfloat16 ulp off, for a few elements at most."""
  cfg = config.OptimConfig(lr=0.05, warmup_steps=0, weight_decay=0.1, state_dtype="bfloat16")
  rule = UpdateRule(cfg, 10)
  rng = np.random.default_rng(7)
  grp = make_group(400, 9, rng, rule)
  assert grp.opt["m"].dtype == jnp.bfloat16 and rule.state_bytes(grp.layout) == 4 * grp.size
  host = HostOptimizer(cfg, rule)
  step = jax.jit(rule.device_update, static_argnums=(4,))
  nd = grp.layout.n_decay
  for i in range(3):
    g = rng.standard_normal(grp.size).astype(np.float32)
    w0, m0, v0 = (np.array(a, np.float32) for a in (grp.w, grp.opt["m"], grp.opt["v"]))
    h = rule.scalars(i)
    if where == "host":
      host.update(grp, g, i, 0.5, view_of(grp))
    else:
      w, opt = step(jnp.asarray(w0), jax.device_put(grp.opt), g * np.float32(0.5), h, grp.layout)
      grp.w, grp.opt = np.array(w), jax.tree.map(np.array, opt)
    gs = g * np.float32(0.5)
    m = h["b1"] * m0 + (1 - h["b1"]) * gs
    v = h["b2"] * v0 + (1 - h["b2"]) * gs * gs
    wd = np.where(np.arange(grp.size) < nd, h["wd"], np.float32(0))
    w_ref = w0 - h["lr"] * ((m / h["bc1"]) / (np.sqrt(v / h["bc2"]) + h["eps"]) + wd * w0)
    assert_close(grp.w, w_ref, name=f"weights, step {i}")
    for name, want in (("m", m), ("v", v)):
      got_bits = grp.opt[name].view(np.uint16).astype(np.int32)
      want_bits = want.astype(jnp.bfloat16).view(np.uint16).astype(np.int32)
      off = np.abs(got_bits - want_bits)
      assert off.max() <= 1 and np.count_nonzero(off) <= 3, (name, i, np.count_nonzero(off))
  host.close()


def test_bfloat16_moments_need_the_fused_adamw():
  with pytest.raises(config.ConfigError, match="optim.state_dtype: bfloat16 moments need"):
    config.OptimConfig(name="lion", state_dtype="bfloat16")
