"""The host AdamW against optax.adamw (+ clip_by_global_norm) applied to the same arrays."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, strategies as hst

from mtjax import config, state as state_lib
from mtjax.optimizer import HostOptimizer, adamw_on_device, clip_scale, schedule


def make_group(n_mat, n_vec, rng):
  lay = state_lib.Layout.from_shapes({"a": jax.ShapeDtypeStruct((n_mat, 3), jnp.float32),
                                      "b": jax.ShapeDtypeStruct((n_vec,), jnp.float32)})
  w = rng.standard_normal(lay.size).astype(np.float32)
  return state_lib.Group("g", "block", lay, w, np.zeros(lay.size, np.float32),
                         np.zeros(lay.size, np.float32))


@given(impl=hst.sampled_from(["fused", "optax"]), n_mat=hst.integers(1, 50),
       n_vec=hst.integers(1, 20), wd=hst.sampled_from([0.0, 0.1]),
       scale=hst.sampled_from([1.0, 0.3]), warmup=hst.sampled_from([0, 2]))
def test_host_adamw_equals_optax(impl, n_mat, n_vec, wd, scale, warmup):
  cfg = config.OptimConfig(impl=impl, lr=0.05, weight_decay=wd, warmup_steps=warmup)
  rng = np.random.default_rng(n_mat * 100 + n_vec)
  grp = make_group(n_mat, n_vec, rng)
  params = grp.layout.unflatten(grp.w_np.copy())
  tx = optax.adamw(schedule(cfg, 6), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=wd,
                   mask=lambda p: jax.tree.map(lambda a: a.ndim >= 2, p))
  opt_state = tx.init(params)
  opt = HostOptimizer(cfg, 6)
  for step in range(4):
    g = rng.standard_normal(grp.layout.size).astype(np.float32)
    opt.update(grp, g, step, scale)
    updates, opt_state = tx.update(jax.tree.map(lambda a: a * scale, grp.layout.unflatten(g)),
                                   opt_state, params)
    params = optax.apply_updates(params, updates)
  opt.close()
  np.testing.assert_allclose(grp.w_np, grp.layout.flatten(params), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(grp.m_np, grp.layout.flatten(opt_state[0].mu), rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(grp.v_np, grp.layout.flatten(opt_state[0].nu), rtol=1e-5, atol=1e-9)


def test_worker_thread_applies_updates_in_order():
  rng = np.random.default_rng(0)
  a, b = make_group(10, 3, rng), make_group(10, 3, rng)
  a_ref, b_ref = make_group(10, 3, np.random.default_rng(0)), make_group(10, 3, np.random.default_rng(0))
  b_ref.w_np[:] = b.w_np
  opt = HostOptimizer(config.OptimConfig(), 10)
  grads = [rng.standard_normal(a.layout.size).astype(np.float32) for _ in range(3)]
  for step, g in enumerate(grads):
    opt.submit(0, a, g, step)
    opt.wait(0)
    opt.update(a_ref, g, step)
  opt.submit(1, b, grads[0], 0)
  opt.wait_all()
  opt.update(b_ref, grads[0], 0)
  np.testing.assert_array_equal(a.w_np, a_ref.w_np)
  np.testing.assert_array_equal(b.w_np, b_ref.w_np)
  opt.close()


def test_wrong_gradient_is_refused_without_touching_state():
  grp = make_group(4, 2, np.random.default_rng(0))
  before = grp.w_np.copy()
  opt = HostOptimizer(config.OptimConfig(), 10)
  with pytest.raises(ValueError, match="gradient"):
    opt.update(grp, np.zeros(grp.layout.size + 1, np.float32), 0)
  with pytest.raises(ValueError, match="float32"):
    opt.update(grp, np.zeros(grp.layout.size, np.float64), 0)
  np.testing.assert_array_equal(grp.w_np, before)
  assert not grp.m_np.any()
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
  np.testing.assert_allclose(g["a"] * clip_scale(norm, 2.0), clipped["a"], rtol=1e-6)
  assert clip_scale(norm, None) == 1.0


def test_device_adamw_equals_host_kernel():
  cfg = config.OptimConfig(lr=0.05, warmup_steps=0)
  rng = np.random.default_rng(5)
  grp = make_group(30, 7, rng)
  w, m, v = (jnp.asarray(a) for a in (grp.w_np.copy(), grp.m_np.copy(), grp.v_np.copy()))
  opt = HostOptimizer(cfg, 10)
  step = jax.jit(adamw_on_device, static_argnums=(6,))
  for i in range(3):
    g = rng.standard_normal(grp.layout.size).astype(np.float32)
    opt.update(grp, g, i, 0.5)
    w, m, v = step(w, m, v, g, opt.hyper(i), np.float32(0.5), grp.layout.n_decay)
  opt.close()
  np.testing.assert_allclose(w, grp.w_np, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(m, grp.m_np, rtol=1e-6, atol=1e-8)
  np.testing.assert_allclose(v, grp.v_np, rtol=1e-6, atol=1e-9)
