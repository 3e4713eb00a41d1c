"""Host and device updates against optax (adamw, lion, sgd, adafactor) applied to the same arrays."""

from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, strategies as hst

from mtjax import checkpoint, config, data, engine, launch, quantize, store as store_lib
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


# ---- optim.state_dtype int8: block-wise 8-bit moments (mtjax.quantize) ----------------------------

INT8 = dict(state_dtype="int8", lr=0.05, warmup_steps=0)


def spread_gradient(rng, n, decades=6):
  """A gradient whose blocks of BLOCK values sit decades apart, as a model's groups do."""
  scale = 10.0 ** rng.uniform(-decades, 0, quantize.n_blocks(n))
  return (rng.standard_normal(n) * np.repeat(scale, quantize.BLOCK)[:n]).astype(np.float32)


def test_int8_state_layout_and_bytes():
  """A flat dict of numpy arrays per group: int8 m codes, uint8 v codes and an fp32 scale per block
  each; its bytes, measured from the arrays, are what state_bytes and moment_bytes give the planner."""
  cfg = config.OptimConfig(state_dtype="int8")
  rule = UpdateRule(cfg, 10)
  lay = Layout.from_shapes({"a": jax.ShapeDtypeStruct((300, 3), jnp.float32),
                            "b": jax.ShapeDtypeStruct((77,), jnp.float32)})
  opt = rule.init_host(lay)
  assert {k: (a.dtype.name, a.shape) for k, a in opt.items()} == {
      "m": ("int8", (977,)), "m_scale": ("float32", (4,)),
      "v": ("uint8", (977,)), "v_scale": ("float32", (4,))}
  assert rule.state_bytes(lay) == sum(a.nbytes for a in opt.values()) == 2 * 977 + 8 * 4
  assert cfg.moment_bytes == 2 + 8 / quantize.BLOCK  # per parameter, for whole blocks
  assert config.OptimConfig(state_dtype="bfloat16").moment_bytes == 4


@pytest.mark.parametrize("name, impl", [("lion", "fused"), ("adamw", "optax")])
def test_int8_moments_need_the_fused_adamw(name, impl):
  with pytest.raises(config.ConfigError, match=f"optim.state_dtype: int8 moments need optim.name "
                                               f"adamw with optim.impl fused, not {name} with {impl}"):
    config.OptimConfig(name=name, impl=impl, state_dtype="int8")


@given(n_mat=hst.integers(1, 260), n_vec=hst.integers(1, 300), wd=hst.sampled_from([0.0, 0.1]),
       scale=hst.sampled_from([1.0, 0.3]), seed=hst.integers(0, 2**16))
def test_int8_host_and_device_updates_are_bit_equal(n_mat, n_vec, wd, scale, seed):
  """The numba loop and its jax twin give the same bytes: weights, codes and scales, step after
  step, on groups with a partial last block and weight decay ending inside a block, gradients over
  six decades. (XLA's CPU backend flushes subnormal results to zero where numba keeps them; these
  gradients keep every intermediate normal.)"""
  cfg = config.OptimConfig(**INT8, weight_decay=wd)
  rule = UpdateRule(cfg, 10)
  rng = np.random.default_rng(seed)
  grp = make_group(n_mat, n_vec, rng, rule)
  w, opt = jax.device_put(jax.tree.map(np.copy, (grp.w, grp.opt)))
  host = HostOptimizer(cfg, rule)
  step = jax.jit(rule.device_update, static_argnums=(4,))
  for i in range(4):
    g = spread_gradient(rng, grp.size)
    host.update(grp, g, i, scale, view_of(grp))
    w, opt = step(w, opt, g * np.float32(scale), rule.scalars(i), grp.layout)
    np.testing.assert_array_equal(np.asarray(w), grp.w, err_msg=f"weights, step {i}")
    for k in grp.opt:
      np.testing.assert_array_equal(np.asarray(opt[k]), grp.opt[k], err_msg=f"{k}, step {i}")
  host.close()


def test_int8_subnormal_moments_differ_only_below_the_smallest_normal_float():
  """Gradients of 1e-24 .. 1e-18 make v = (1 - b2) g^2 subnormal. XLA's CPU backend flushes
  subnormal results to zero (numba keeps them, as XLA's GPU backend does by default), so there the
  device's codes differ from the host's, the decoded moments by a few times 2^-126 at most, and the
  weights not at all: sqrt(v) is far below eps."""
  cfg = config.OptimConfig(**INT8)
  rule = UpdateRule(cfg, 10)
  rng = np.random.default_rng(0)
  grp = make_group(200, 10, rng, rule)
  w, opt = jax.device_put(jax.tree.map(np.copy, (grp.w, grp.opt)))
  step = jax.jit(rule.device_update, static_argnums=(4,))
  tiny = float(np.finfo(np.float32).tiny)
  for i in range(4):
    g = (rng.standard_normal(grp.size) * 10.0 ** rng.uniform(-24, -18, grp.size)).astype(np.float32)
    rule.host_update(grp.w, grp.opt, g, i, 1.0, grp.layout)
    w, opt = step(w, opt, g, rule.scalars(i), grp.layout)
    np.testing.assert_array_equal(np.asarray(w), grp.w)
    for k in ("m", "v"):
      dev = quantize.dequantize(np.asarray(opt[k]), np.asarray(opt[k + "_scale"]))
      host = quantize.dequantize(grp.opt[k], grp.opt[k + "_scale"])
      assert np.max(np.abs(dev - host)) <= 4 * tiny, (k, i)
  assert np.max(grp.opt["v_scale"]) < 1e3 * tiny  # the case this test is about


def test_int8_update_is_fp32_adamw_on_the_decoded_moments():
  """One step against numpy: decode the stored moments, run AdamW's formula in float32 (bias
  corrections as multiplications by their float32 reciprocals, as XLA computes a division by a
  scalar), update w with the unrounded new moments and store those re-quantized. Bit for bit."""
  cfg = config.OptimConfig(**INT8, weight_decay=0.1)
  rule = UpdateRule(cfg, 10)
  rng = np.random.default_rng(3)
  grp = make_group(300, 40, rng, rule)
  m0 = spread_gradient(rng, grp.size) * np.float32(0.1)
  v0 = np.square(spread_gradient(rng, grp.size)) * np.float32(0.01)
  (grp.opt["m"], grp.opt["m_scale"]), (grp.opt["v"], grp.opt["v_scale"]) = (
      quantize.quantize(m0, True), quantize.quantize(v0, False))
  md, vd = quantize.dequantize(grp.opt["m"], grp.opt["m_scale"]), quantize.dequantize(
      grp.opt["v"], grp.opt["v_scale"])
  w0, g = grp.w.copy(), spread_gradient(rng, grp.size)
  h = rule.scalars(3)
  HostOptimizer(cfg, rule).update(grp, g, 3, 0.5, view_of(grp))
  gs = g * np.float32(0.5)
  one = np.float32(1)
  m = h["b1"] * md + (one - h["b1"]) * gs
  v = h["b2"] * vd + (one - h["b2"]) * gs * gs
  wd = np.where(np.arange(grp.size) < grp.layout.n_decay, h["wd"], np.float32(0))
  u = (m * (one / h["bc1"])) / (np.sqrt(v * (one / h["bc2"])) + h["eps"]) + wd * w0
  np.testing.assert_array_equal(grp.w, w0 - h["lr"] * u)
  for k, (codes, scales) in (("m", quantize.quantize(m, True)), ("v", quantize.quantize(v, False))):
    np.testing.assert_array_equal(grp.opt[k], codes)
    np.testing.assert_array_equal(grp.opt[k + "_scale"], scales)


def cell_error(codes, scales):
  """The most any value stored as these codes can be off its decoded level: the scale times the
  larger distance from the code's level to the edges of its cell (the values that encode to it)."""
  signed = codes.dtype == np.int8
  if signed:
    lv, lo = quantize.M_LEVELS[:128].astype(np.float64), quantize.M_EDGES[:128].astype(np.float64)
    lo[0] = 0  # magnitudes: j = 0 holds [0, edge_1]
    k = np.abs(codes.astype(np.int64))
  else:
    lv, lo = quantize.V_LEVELS.astype(np.float64), quantize.V_EDGES.astype(np.float64)
    lo[0] = 0  # v >= 0
    k = codes.astype(np.int64)
  hi = np.append(lo[1:], 1.0)
  cell = np.maximum(lv - lo, hi - lv)
  return cell[k] * np.repeat(scales.astype(np.float64), quantize.BLOCK)[:codes.size]


def adam_direction(m, v, bc1, bc2, eps):
  return (m / bc1) / (np.sqrt(np.maximum(v, 0) / bc2) + eps)


def test_int8_adamw_stays_within_the_quantization_bound_of_optax():
  """20 steps of int8 AdamW against optax.adamw in fp32 on one group and a fixed stream of
  gradients (so both runs see the same moments' inputs), within a bound derived step by step from
  the quantizer's guarantee: a stored moment is off its decoded value by at most its code's cell
  (`cell_error`), so the moment the next step uses is off the exact one by
  E_t = b (E_{t-1} + cell_{t-1}); the update m^ / (sqrt(v^) + eps), monotone in each, is then
  within its largest change over the box m +- E_m, v +- E_v, and the weights within
  W_t = |1 - lr wd| W_{t-1} + lr * that change. Computed in float64 around the exact moments; the
  two runs' float32 rounding adds a few ulps. (The bound is a worst case, about ten times the
  difference seen; the update's exact formula is held by the test above.)"""
  T = 20
  cfg = config.OptimConfig(state_dtype="int8", lr=0.02, warmup_steps=3, weight_decay=0.1)
  rule = UpdateRule(cfg, T)
  rng = np.random.default_rng(11)
  grp = make_group(250, 60, rng, rule)
  n = grp.size
  base = spread_gradient(rng, n, decades=3)  # each element a steady direction, plus noise
  grads = [base + spread_gradient(rng, n, decades=3) * np.float32(0.5) for _ in range(T)]
  w0 = grp.w.astype(np.float64)
  params = grp.layout.unflatten(grp.w.copy())
  tx = REFERENCE["adamw"](cfg, schedule(cfg, T))
  opt_state = tx.init(params)
  host = HostOptimizer(cfg, rule)
  c = cfg
  decay = np.where(np.arange(n) < grp.layout.n_decay, c.weight_decay, 0.0)
  m = v = e_m = e_v = e_w = cell_m = cell_v = np.zeros(n)
  for t in range(T):
    g = grads[t].astype(np.float64)
    host.update(grp, grads[t], t, 1.0, view_of(grp))
    updates, opt_state = tx.update(grp.layout.unflatten(grads[t]), opt_state, params)
    params = optax.apply_updates(params, updates)
    e_m, e_v = c.b1 * (e_m + cell_m), c.b2 * (e_v + cell_v)
    m, v = c.b1 * m + (1 - c.b1) * g, c.b2 * v + (1 - c.b2) * g * g
    bc1, bc2 = 1 - c.b1 ** (t + 1), 1 - c.b2 ** (t + 1)
    u = adam_direction(m, v, bc1, bc2, c.eps)
    du = np.max([np.abs(adam_direction(m + a * e_m, v + b * e_v, bc1, bc2, c.eps) - u)
                 for a in (-1, 1) for b in (-1, 1)], axis=0)
    lr = float(rule.scalars(t)["lr"])
    e_w = np.abs(1 - lr * decay) * e_w + lr * du
    # what this step stored, for the next (enlarged by a few ulps for the float32 division and
    # decoding product)
    cell_m = cell_error(grp.opt["m"], grp.opt["m_scale"]) * (1 + 1e-6)
    cell_v = cell_error(grp.opt["v"], grp.opt["v_scale"]) * (1 + 1e-6)
  host.close()
  want = grp.layout.flatten(params).astype(np.float64)
  diff = np.abs(grp.w - want)
  fp32 = 1e-6 * (np.abs(want) + T * cfg.lr)  # the two runs' own float32 rounding
  assert np.all(diff <= e_w + fp32), f"{np.count_nonzero(diff > e_w + fp32)} weights off bound"
  assert np.median(e_w) < 0.2 * np.median(np.abs(want - w0))  # the bound says something
  assert np.count_nonzero(diff > fp32) > n // 10  # and the quantization shows


def test_int8_block_that_turns_non_finite_is_left_as_it_was():
  """A gradient whose square overflows (which the engine's finite check of each group's squared
  norm stops before it gets here) leaves its block's weights, codes and scales untouched on the
  host and the device alike; the host says so, the other blocks are updated."""
  cfg = config.OptimConfig(**INT8)
  rule = UpdateRule(cfg, 10)
  rng = np.random.default_rng(0)
  grp = make_group(200, 10, rng, rule)  # 610 values: 3 blocks
  host = HostOptimizer(cfg, rule)
  host.update(grp, spread_gradient(rng, grp.size), 0, 1.0, view_of(grp))
  before = jax.tree.map(np.copy, (grp.w, grp.opt))
  g = spread_gradient(rng, grp.size)
  g[quantize.BLOCK + 5] = 1e20  # (1 - b2) g^2 overflows
  step = jax.jit(rule.device_update, static_argnums=(4,))
  w, opt = step(*jax.device_put(before), g, rule.scalars(1), grp.layout)
  with pytest.raises(FloatingPointError, match="1 of 3 blocks of 256 parameters went non-finite"):
    rule.host_update(grp.w, grp.opt, g, 1, 1.0, grp.layout)
  mid = slice(quantize.BLOCK, 2 * quantize.BLOCK)
  np.testing.assert_array_equal(grp.w[mid], before[0][mid])
  np.testing.assert_array_equal(grp.opt["m"][mid], before[1]["m"][mid])
  assert grp.opt["v_scale"][1] == before[1]["v_scale"][1]
  assert not np.array_equal(grp.w[:quantize.BLOCK], before[0][:quantize.BLOCK])
  np.testing.assert_array_equal(np.asarray(w), grp.w)
  for k in grp.opt:
    np.testing.assert_array_equal(np.asarray(opt[k]), grp.opt[k])
  host.close()


TINY = Path(__file__).parent.parent / "configs" / "tiny.yaml"
PLACEMENTS = {"host": ["engine.device_state_layers=0", "engine.device_update_layers=0"],
              "mixed": ["engine.device_state_layers=2", "engine.device_update_layers=1"]}


def tiny_store(state_dtype, placement, seed=0):
  cfg, _ = launch.plan_run(config.load(TINY, [f"optim.state_dtype={state_dtype}",
                                             *PLACEMENTS[placement]]))
  return cfg, store_lib.create(cfg, jax.random.key(seed))


def train_losses(state_dtype, placement, steps):
  cfg, st = tiny_store(state_dtype, placement)
  eng = engine.Engine(cfg, st)
  losses = [eng.step(data.synthetic_batch(i, 8, 64, 256, 0)).loss for i in range(steps)]
  eng.close()
  return st.tiers(), losses


def test_int8_moments_train_a_tiny_model_as_fp32_moments_do():
  """configs/tiny.yaml for 30 steps: the loss with int8 moments ends within 1% of the loss with
  fp32 moments, and is the same bit for bit whether the groups' state lives in device memory,
  streams through it or stays on the host (their updates are bit-equal)."""
  _, fp32 = train_losses("float32", "host", 30)
  tiers, host = train_losses("int8", "host", 30)
  mixed_tiers, mixed = train_losses("int8", "mixed", 30)
  assert set(tiers) == {"host"} and mixed_tiers == ["device", "device", "stream", "host"]
  assert host[-1] < 0.7 * host[0]
  assert abs(host[-1] - fp32[-1]) <= 0.01 * fp32[-1], (host[-1], fp32[-1])
  assert mixed == host


def test_int8_checkpoint_resume_equals_uninterrupted(tmp_path):
  """The codes and scales go through a checkpoint as they are (int8, uint8, float32 arrays) and
  come back bit for bit, into this placement or another; a run resumed from them equals the
  uninterrupted one."""
  batches = [data.synthetic_batch(i, 8, 64, 256, 0) for i in range(4)]
  cfg, st = tiny_store("int8", "mixed")
  eng = engine.Engine(cfg, st)
  for b in batches[:2]:
    eng.step(b)
  eng.sync()
  path = checkpoint.save(st, tmp_path)
  saved = st.opt_trees()
  assert {k: a.dtype.name for k, a in saved["block_0"].items()} == {
      "m": "int8", "m_scale": "float32", "v": "uint8", "v_scale": "float32"}
  for b in batches[2:]:
    eng.step(b)
  eng.close()
  for placement in ("mixed", "host"):
    cfg2, other = tiny_store("int8", placement, seed=5)
    checkpoint.restore(other, path)
    chex.assert_trees_all_equal(other.opt_trees(), saved)
    resumed = engine.Engine(cfg2, other)
    for b in batches[2:]:
      resumed.step(b)
    resumed.close()
    chex.assert_trees_all_equal(other.to_tree(), st.to_tree())
    chex.assert_trees_all_equal(other.opt_trees(), st.opt_trees())
