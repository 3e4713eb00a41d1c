"""The 8-bit block quantizer of AdamW's moments against a float64 reference, on the host and the device."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as hst

from mtjax import quantize as q

TINY = float(np.finfo(np.float32).tiny)  # the smallest normal float32, 2^-126
EPS = float(np.finfo(np.float32).eps)


def sorted_levels(signed):
  """The map's levels in increasing order, as float64 (m: -1 .. 1 without the unused -128)."""
  lv = q.M_LEVELS[:128] if signed else q.V_LEVELS
  lv = lv.astype(np.float64)
  return np.concatenate([-lv[:0:-1], lv]) if signed else lv


def interval_bound(y, signed):
  """|y - level| of the nearest level in exact arithmetic: half the gap of the two levels around y
  (below v's lowest level: the distance up to it)."""
  lv = sorted_levels(signed)
  i = np.clip(np.searchsorted(lv, y), 1, lv.size - 1)
  gap = (lv[i] - lv[i - 1]) / 2
  return np.where(y < lv[0], lv[0] - y, gap)


def test_levels_and_edges():
  """The host's level formulas are the device's tables; levels rise, v has no zero, +-1 and 0 are
  exact, and every edge lies strictly between its two levels."""
  codes_m = np.arange(256).astype(np.uint8).view(np.int8)
  codes_v = np.arange(256).astype(np.uint8)
  one = np.ones(1, np.float32)
  np.testing.assert_array_equal(q.dequantize(codes_m, one), q.M_LEVELS)
  np.testing.assert_array_equal(q.dequantize(codes_v, one), q.V_LEVELS)
  for codes in (codes_m, codes_v):
    got = q.decode_jax(jnp.asarray(codes), jnp.asarray(one))
    np.testing.assert_array_equal(np.asarray(got), q.dequantize(codes, one))
  m, v = sorted_levels(True), sorted_levels(False)
  assert np.all(np.diff(m) > 0) and np.all(np.diff(v) > 0)
  assert m[0] == -1 and m[-1] == 1 and 0 in m and v[-1] == 1 and v[0] > 0
  for lv, edges in ((q.M_LEVELS[:128], q.M_EDGES), (q.V_LEVELS, q.V_EDGES)):
    assert edges[0] == -np.inf
    assert np.all((lv[:-1] < edges[1:]) & (edges[1:] < lv[1:]))


def near_every_edge(edges):
  """Every float32 within 3 ulps of each finite edge."""
  e = edges[1:].astype(np.float32)
  out = [e]
  up, down = e.copy(), e.copy()
  for _ in range(3):
    up, down = np.nextafter(up, np.float32(2)), np.nextafter(down, np.float32(-2))
    out += [up, down]
  return np.concatenate(out)


@pytest.mark.parametrize("signed", [True, False])
def test_encoding_is_the_nearest_level_at_every_edge(signed):
  """y in [-1, 1] (one block of scale 1, so y is the value itself) gets the level nearest to it in
  float64; where both neighbours are equally near in float32 the tie goes to the level nearer zero.
  Checked at every float32 within 3 ulps of every edge (where the fourth-root guess is corrected),
  on the host and the device. (An exhaustive run over all 1.07e9 float32 values in [0, 1] and
  their negatives agreed too; it takes seconds, too long for the suite.)"""
  y = near_every_edge(q.M_EDGES if signed else q.V_EDGES)
  rng = np.random.default_rng(0)
  y = np.concatenate([y, rng.random(4000, np.float32), np.float32([0, 1, 0.5, 1e-30])])
  y = np.concatenate([y, -y]) if signed else y
  y = np.clip(y, -1 if signed else 0, 1).astype(np.float32)
  blocks = []
  for lo in range(0, y.size, q.BLOCK - 1):  # each block's first value is 1: its scale is 1
    blocks += [np.float32(1), *y[lo:lo + q.BLOCK - 1]]
  x = np.array(blocks, np.float32)
  codes, scales = q.quantize(x, signed)
  assert np.all(scales == 1)
  got = q.dequantize(codes, scales).astype(np.float64)
  lv = sorted_levels(signed)
  i = np.searchsorted(lv, x.astype(np.float64))
  lower, upper = lv[np.clip(i - 1, 0, lv.size - 1)], lv[np.clip(i, 0, lv.size - 1)]
  best = np.minimum(np.abs(x - lower), np.abs(x - upper))
  assert np.all(np.abs(got - x) <= best + 2 * EPS * np.abs(x)), "not the nearest level"
  # the canonical code, by the float32 edges: m by magnitude (ties toward zero), v by value
  if signed:
    mag = np.searchsorted(q.M_EDGES[1:], np.abs(x), side="left")
    want = np.where(x < 0, -mag, mag).astype(np.int8)
  else:
    want = np.searchsorted(q.V_EDGES[1:], x, side="left").astype(np.uint8)
  np.testing.assert_array_equal(codes, want)
  dev_codes, dev_scales = q.quantize_jax(jnp.asarray(x), signed)
  np.testing.assert_array_equal(np.asarray(dev_codes), codes)
  np.testing.assert_array_equal(np.asarray(dev_scales), scales)


@hst.composite
def vectors(draw, signed):
  """A few blocks (the last one partial) of values over 60 decades, each block of its own range,
  with zeros, subnormals, runs of equal values and all-zero blocks among them."""
  n = draw(hst.integers(1, 4 * q.BLOCK + 37))
  seed = draw(hst.integers(0, 2**32 - 1))
  rng = np.random.default_rng(seed)
  top = rng.uniform(-30, 30, q.n_blocks(n))  # each block's decade
  spread = rng.uniform(0, 12, q.n_blocks(n))  # how many decades its values span
  b = np.arange(n) // q.BLOCK
  x = 10.0 ** (top[b] - spread[b] * rng.random(n))
  x[rng.random(n) < 0.1] = 0
  x[rng.random(n) < 0.05] = rng.choice([1e-40, 1e-45, 3e-39])  # subnormal
  if n > 40:
    x[10:30] = x[10]  # equal values
  if draw(hst.booleans()) and n > q.BLOCK:
    x[:q.BLOCK] = 0
  if signed:
    x *= rng.choice([-1, 1], n)
  return x.astype(np.float32)


@pytest.mark.parametrize("signed", [True, False])
@given(data=hst.data())
def test_error_is_within_the_bound_of_each_block(signed, data):
  """Each value's error against float64 is at most its block's scale times half the gap between
  the two levels around value / scale (the nearest level; below v's lowest, the distance to it),
  plus float32 rounding of the division and the decoding product (a few ulps of the scale, and the
  subnormal spacing 2^-149 where the decoded value is subnormal); hence within `max_error` times
  the scale. A block's scale is its largest magnitude, exactly."""
  x = data.draw(vectors(signed))
  codes, scales = q.quantize(x, signed)
  x64 = x.astype(np.float64)
  s = np.repeat(scales.astype(np.float64), q.BLOCK)[:x.size]
  np.testing.assert_array_equal(
      scales, np.abs(np.pad(x, (0, scales.size * q.BLOCK - x.size))).reshape(-1, q.BLOCK).max(1))
  got = q.dequantize(codes, scales).astype(np.float64)
  y = np.divide(x64, s, out=np.zeros_like(x64), where=s > 0)
  slack = 4 * EPS * s + 2.0**-149
  err = np.abs(got - x64)
  assert np.all(err <= interval_bound(y, signed) * s + slack)
  assert np.all(err <= q.max_error(signed) * s + slack)
  assert np.all(got[s == 0] == 0)
  # The device's codes are the host's in every block without subnormal values: XLA's CPU backend
  # reads a subnormal as zero (numba does not), which moves y = x / scale where the scale is tiny.
  dc, ds = (np.asarray(a) for a in q.quantize_jax(jnp.asarray(x), signed))
  normal = (np.abs(x) >= TINY) | (x == 0)
  ok_B = np.array([normal[i:i + q.BLOCK].all() for i in range(0, x.size, q.BLOCK)])
  ok = np.repeat(ok_B, q.BLOCK)[:x.size]
  np.testing.assert_array_equal(dc[ok], codes[ok])
  np.testing.assert_array_equal(ds[ok_B], scales[ok_B])


@pytest.mark.parametrize("signed", [True, False])
def test_equal_values_zeros_and_a_partial_block_are_exact(signed):
  x = np.zeros(2 * q.BLOCK + 3, np.float32)
  x[q.BLOCK:2 * q.BLOCK] = 3.7  # a block of equal values: all at the top level, exact
  x[2 * q.BLOCK:] = [0.25, 1e-3, 0]  # the partial last block
  codes, scales = q.quantize(x, signed)
  assert scales.shape == (3,) and scales[0] == 0 and scales[1] == np.float32(3.7)
  got = q.dequantize(codes, scales)
  np.testing.assert_array_equal(got[:2 * q.BLOCK], x[:2 * q.BLOCK])
  assert got[2 * q.BLOCK] == np.float32(0.25)  # the block's largest: level 1 times the scale
  assert abs(got[2 * q.BLOCK + 1] - 1e-3) <= q.max_error(signed) * 0.25
  assert got[-1] == (0 if signed else np.float32(0.25) * q.V_LEVELS[0])  # v has no zero level


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_values_are_refused(signed, bad):
  x = np.ones(q.BLOCK + 5, np.float32)
  x[q.BLOCK + 2] = bad
  with pytest.raises(ValueError, match="1 of 261 values are not finite"):
    q.quantize(x, signed)


def test_negative_values_are_refused_by_the_unsigned_map():
  with pytest.raises(ValueError, match="no negative values"):
    q.quantize(np.array([1.0, -0.5], np.float32), signed=False)


def test_scales_must_match_the_codes():
  with pytest.raises(ValueError, match="2 scales for 3 codes"):
    q.dequantize(np.zeros(3, np.uint8), np.ones(2, np.float32))


def test_bytes_per_parameter():
  """Measured from the arrays the quantizer makes: 2 codes and 2 scales per BLOCK, 2.03 B/param."""
  n = 10 * q.BLOCK + 1
  arrays = [*q.quantize(np.ones(n, np.float32), True), *q.quantize(np.ones(n, np.float32), False)]
  assert sum(a.nbytes for a in arrays) == q.state_bytes(n) == 2 * n + 8 * 11
  assert q.state_bytes(q.BLOCK) / q.BLOCK == 2 + 8 / q.BLOCK
  assert jax.tree.leaves(arrays)  # plain arrays: what a checkpoint saves leaf by leaf
