"""Block-wise 8-bit codes for AdamW's moments (`optim.state_dtype: int8`) and the fused AdamW on them.

A flat fp32 vector is cut into blocks of BLOCK values from its start (the last one may be short);
each block keeps one fp32 scale, its largest magnitude, and one byte per value: the code of the
nearest level of a fixed map to value / scale. Decoding is the code's level times the scale. The
maps are power maps, dense near zero, where most of a block's values lie (a moment's block spans
values of very different sizes, and the update m / sqrt(v) weighs the small ones as much as the
large):

  m (signed, int8 j in [-127, 127]):   sign(j) * (|j| / 127) ** 4 (-128 is never written)
  v (unsigned, uint8 k in [0, 255]):   ((k + 1) / 256) ** 4: all 256 codes, and no zero

each level computed in float32: the root (|j| times float32(1 / 127), or (k + 1) / 256), then its
square squared. v has no zero level because a second moment rounded to zero turns
m / (sqrt(v) + eps) into m / eps; rounding up instead (to 2.3e-10 of the block's scale) only
shortens that step. An all-zero block has scale 0 and decodes to zeros.

Encoding is the exact nearest level: the code whose lower edge (the float32 midpoint (a + b) / 2
of its level and the one below) is below y = value / scale and whose upper edge is not; a tie goes
to the level nearer zero. The fourth root of |y|, rounded in the root's own scale, gives that code
or the one above it (the map is convex: the midpoint of two levels lies above the level at their
roots' midpoint, by far more than a rounding error), so one comparison with the lower edge settles
it. The host loops compute levels and edges by formula (no table lookups, which do not vectorise
well), the device looks them up in tables made by the same float32 operations: both produce the
same bytes from the same y. A value's error is at most half the gap between the two levels around
y, times the scale (below v's lowest level: that level, times the scale); `max_error` bounds it
for the whole map.

BLOCK: 256 values per scale cost 4 / 256 bytes each (2.03 bytes per parameter for both moments) and
keep an outlier's reach to 256 neighbours; 2048 (the block of the original 8-bit optimizers) would
save 0.03 bytes per parameter at a larger error of the update (benchmarks/int8_adamw.py measures
both). Nearest rounding, not stochastic: on the same benchmark stochastic rounding adds error and
removes no bias worth having, at beta2 0.95 and 0.999 alike.

`adamw_inplace` (numba, in place, one pass per block) and `adamw_on_device` (jax) are the update
mtjax.optimizer.UpdateRule runs for these moments; they give the same bytes (XLA's CPU backend
flushes subnormal results to zero, numba does not: there the moments differ below 2^-126).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numba
import numpy as np

BLOCK = 256  # values per fp32 scale

_HALF = np.float32(0.5)
_M_STEP = np.float32(1 / 127)  # 127 times it is exactly 1
_V_STEP = np.float32(1 / 256)


# ---- the maps --------------------------------------------------------------------------------------

@numba.njit(inline="always")
def m_level(j):  # pragma: no cover (compiled)
  """The level of m's code j (an integer in [-128, 127])."""
  r = np.float32(abs(j)) * _M_STEP
  r = r * r
  return -(r * r) if j < 0 else r * r


@numba.njit(inline="always")
def v_level(k):  # pragma: no cover (compiled)
  """The level of v's code k (an integer in [0, 255]; -1 gives 0)."""
  r = np.float32(k + 1) * _V_STEP
  r = r * r
  return r * r


def _tables():
  """The levels by code byte and the lower edges (by |j| for m, by k for v), as float32 arrays
  computed with the same operations as `m_level` and `v_level`."""
  j = np.arange(256).astype(np.uint8).view(np.int8).astype(np.int64)  # the byte's int8 value
  r = np.abs(j).astype(np.float32) * _M_STEP
  r = r * r
  m = np.where(j < 0, -(r * r), r * r).astype(np.float32)
  r = (np.arange(256) + 1).astype(np.float32) * _V_STEP
  r = r * r
  v = r * r
  mag = m[:128]
  m_edges = np.concatenate([[-np.inf], (mag[:-1] + mag[1:]) * _HALF]).astype(np.float32)
  v_edges = np.concatenate([[-np.inf], (v[:-1] + v[1:]) * _HALF]).astype(np.float32)
  return m, m_edges, v, v_edges


M_LEVELS, M_EDGES, V_LEVELS, V_EDGES = _tables()


def n_blocks(n: int) -> int:
  return -(-n // BLOCK)


def state_bytes(n: int) -> int:
  """Bytes of both moments of n parameters: a code each and a scale per block each."""
  return 2 * (n + 4 * n_blocks(n))


def max_error(signed: bool) -> float:
  """The largest |value - decoded| of any value over its block's scale: half the map's widest gap
  (v: or its lowest level, the error of the values below it, whichever is larger)."""
  levels = np.sort((M_LEVELS[:128] if signed else V_LEVELS).astype(np.float64))
  worst = float(np.max(np.diff(levels))) / 2
  return worst if signed else max(worst, float(levels[0]))


# ---- host (numba) ----------------------------------------------------------------------------------

@numba.njit(inline="always")
def m_code(y):  # pragma: no cover (compiled)
  """The int8 code of the nearest m level to y in [-1, 1]."""
  a = abs(y)
  j = np.int32(min(np.uint32(np.sqrt(np.sqrt(a)) * np.float32(127) + _HALF), np.uint32(127)))
  j -= np.int32(a <= (m_level(j - 1) + m_level(j)) * _HALF)  # j = 0: a negative edge
  return np.int8(-j if y < 0 else j)


@numba.njit(inline="always")
def v_code(y):  # pragma: no cover (compiled)
  """The uint8 code of the nearest v level to y in [0, 1]."""
  k = np.int32(min(max(np.uint32(np.sqrt(np.sqrt(y)) * np.float32(256) + _HALF), np.uint32(1)),
                   np.uint32(256))) - np.int32(1)
  k -= np.int32((y <= (v_level(k - 1) + v_level(k)) * _HALF) & (k > 0))
  return np.uint8(k)


@numba.njit(parallel=True, nogil=True, cache=True, error_model="numpy")
def _encode(x, signed, codes, scales):  # pragma: no cover (compiled)
  """Fills codes (uint8 bits) and scales from finite x."""
  n = x.size
  for b in numba.prange(scales.size):
    lo, hi = b * BLOCK, min(n, (b + 1) * BLOCK)
    s = np.float32(0)
    for i in range(lo, hi):
      s = max(s, abs(x[i]))
    scales[b] = s
    for i in range(lo, hi):
      y = x[i] / s if s > 0 else np.float32(0)
      codes[i] = np.uint8(m_code(y)) if signed else v_code(y)


@numba.njit(parallel=True, nogil=True, cache=True, error_model="numpy")
def _decode(codes, scales, signed, out):  # pragma: no cover (compiled)
  for b in numba.prange(scales.size):
    s = scales[b]
    for i in range(b * BLOCK, min(out.size, (b + 1) * BLOCK)):
      c = codes[i]
      out[i] = (m_level(np.int32(np.int8(c))) if signed else v_level(np.int32(c))) * s


def quantize(x: np.ndarray, signed: bool) -> tuple[np.ndarray, np.ndarray]:
  """A float32 vector as (codes, scales): int8 codes of the m map (signed) or uint8 codes of the v
  map, and one float32 scale per block. Refuses non-finite values and, unsigned, negative ones."""
  x = np.ascontiguousarray(x, np.float32).reshape(-1)
  bad = x.size - np.count_nonzero(np.isfinite(x))
  if bad:
    raise ValueError(f"quantize: {bad} of {x.size} values are not finite")
  if not signed and np.any(x < 0):
    raise ValueError("quantize: the unsigned (v) map holds no negative values")
  codes = np.empty(x.size, np.int8 if signed else np.uint8)
  scales = np.empty(n_blocks(x.size), np.float32)
  _encode(x, signed, codes.view(np.uint8), scales)
  return codes, scales


def dequantize(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
  """The float32 values of (codes, scales); the map follows from the codes' dtype (int8: m)."""
  if scales.shape != (n_blocks(codes.size),):
    raise ValueError(f"dequantize: {scales.size} scales for {codes.size} codes")
  out = np.empty(codes.size, np.float32)
  _decode(codes.view(np.uint8), scales, codes.dtype == np.int8, out)
  return out


# ---- device (jax) ----------------------------------------------------------------------------------

def per_block(x, fill=0):
  """A flat vector as [blocks, BLOCK], the last block padded with `fill`."""
  n = x.shape[0]
  return jnp.pad(x, (0, n_blocks(n) * BLOCK - n), constant_values=fill).reshape(-1, BLOCK)


def per_value(x_B, n: int):
  """One value per block spread over the block's n values (the last block's may be fewer)."""
  return jnp.broadcast_to(x_B[:, None], (x_B.shape[0], BLOCK)).reshape(-1)[:n]


def block_absmax(x):
  return per_block(jnp.abs(x)).max(axis=1)


def encode_jax(x, scale_B, signed: bool):
  """The codes of x given its blocks' scales, as `m_code` and `v_code` choose them."""
  s = per_value(scale_B, x.shape[0])
  y = jnp.where(s > 0, x / jnp.where(s > 0, s, 1), 0)
  if signed:
    a = jnp.abs(y)
    j = jnp.minimum((jnp.sqrt(jnp.sqrt(a)) * np.float32(127) + _HALF).astype(jnp.int32), 127)
    j = j - (a <= jnp.asarray(M_EDGES)[j]).astype(jnp.int32)
    return jnp.where(y < 0, -j, j).astype(jnp.int8)
  k = jnp.clip((jnp.sqrt(jnp.sqrt(y)) * np.float32(256) + _HALF).astype(jnp.int32), 1, 256) - 1
  return (k - (y <= jnp.asarray(V_EDGES)[k]).astype(jnp.int32)).astype(jnp.uint8)


def decode_jax(codes, scale_B):
  """The float32 values of codes (int8: the m map; uint8: v) and their blocks' scales."""
  levels = jnp.asarray(M_LEVELS if codes.dtype == jnp.int8 else V_LEVELS)
  idx = jax.lax.bitcast_convert_type(codes, jnp.uint8).astype(jnp.int32)
  return levels[idx] * per_value(scale_B, codes.shape[0])


def quantize_jax(x, signed: bool):
  """`quantize` as a jax function (no refusal: a non-finite value gives a non-finite scale)."""
  scale_B = block_absmax(x)
  return encode_jax(x, scale_B, signed), scale_B


# ---- the fused AdamW on these codes (mtjax.optimizer's rule for optim.state_dtype int8) -------------
# Here, beside the maps it inlines: numba's cache checks only the file a function is defined in, so
# a change to the maps or BLOCK anywhere else would leave a stale compiled loop.

_BLOCKS_PER_ITEM = 16  # blocks per work item of the parallel loop
_NONFINITE = np.uint32(0x7F800000)  # |x|'s bits from here up: inf or NaN
_ABS = np.uint32(0x7FFFFFFF)


@numba.njit(parallel=True, nogil=True, cache=True, error_model="numpy")
def adamw_inplace(w, g, m, m_scale, v, v_scale, lr, b1, b2, eps, wd, bc1, bc2, scale,
                  n_decay):  # pragma: no cover (compiled)
  """One AdamW update of w (weight decay on [0, n_decay)) with gradient g * scale, in place, with
  both moments as codes and scales: per block, decode m and v, update them and w in fp32, and
  store the new moments encoded with the block's new largest magnitude as its scale (this step's
  update uses them unrounded). Every operation is rounded as written (no fastmath; numpy's error
  model, so that a division needs no zero check and the loops vectorise), which `adamw_on_device`
  reproduces. A block whose new w, m or v is not finite is left as it was; returns the number of
  such blocks."""
  one, zero = np.float32(1.0), np.float32(0.0)
  rc1, rc2 = one / bc1, one / bc2  # XLA turns a division by a scalar into this multiplication
  c1, c2 = one - b1, one - b2
  B = BLOCK
  n, nb = w.size, m_scale.size
  items = (nb + _BLOCKS_PER_ITEM - 1) // _BLOCKS_PER_ITEM
  refused = np.zeros(items, np.int64)
  for it in numba.prange(items):
    tmp = np.empty(3 * B, np.float32)
    new_m, new_v, new_w = tmp[:B], tmp[B:2 * B], tmp[2 * B:]
    bits_m, bits_v, bits_w = new_m.view(np.uint32), new_v.view(np.uint32), new_w.view(np.uint32)
    top = np.empty(2, np.uint32)
    for b in range(it * _BLOCKS_PER_ITEM, min(nb, (it + 1) * _BLOCKS_PER_ITEM)):
      lo = b * B
      hi = min(n, lo + B)
      size = hi - lo
      # Views of the block, indexed from 0: an index known non-negative needs no wraparound
      # check, which is what lets these loops vectorise.
      wb, gb, mb, vb = w[lo:hi], g[lo:hi], m[lo:hi], v[lo:hi]
      sm, sv = m_scale[b], v_scale[b]
      for j in range(size):
        gi = gb[j] * scale
        new_m[j] = b1 * (m_level(np.int32(mb[j])) * sm) + c1 * gi
        new_v[j] = b2 * (v_level(np.int32(vb[j])) * sv) + c2 * gi * gi
      if hi <= n_decay or lo >= n_decay:  # weight decay on [0, n_decay)
        wdb = wd if lo < n_decay else zero
        for j in range(size):
          u = (new_m[j] * rc1) / (np.sqrt(new_v[j] * rc2) + eps) + wdb * wb[j]
          new_w[j] = wb[j] - lr * u
      else:
        for j in range(size):
          wdj = wd if lo + j < n_decay else zero
          u = (new_m[j] * rc1) / (np.sqrt(new_v[j] * rc2) + eps) + wdj * wb[j]
          new_w[j] = wb[j] - lr * u
      # The largest magnitude as the largest bit pattern of |x|: an integer max, which vectorises
      # without fastmath and finds an inf or NaN too.
      am = av = aw = np.uint32(0)
      for j in range(size):
        am = max(am, bits_m[j] & _ABS)
        av = max(av, bits_v[j] & _ABS)
        aw = max(aw, bits_w[j] & _ABS)
      if max(am, av, aw) >= _NONFINITE:
        refused[it] += 1
        continue
      top[0], top[1] = am, av
      sm, sv = top.view(np.float32)[0], top.view(np.float32)[1]
      m_scale[b], v_scale[b] = sm, sv
      for j in range(size):
        wb[j] = new_w[j]
      if sm == zero:
        sm = one  # an all-zero block: any scale gives code 0
      if sv == zero:
        sv = one
      for j in range(size):
        mb[j] = m_code(new_m[j] / sm)
      for j in range(size):
        vb[j] = v_code(new_v[j] / sv)
  return refused.sum()


def _rounded(x, keep):
  """x, its bits and-ed with `keep` (all ones, a traced scalar XLA cannot see through): a product
  stays a rounded float32 instead of being fused into a multiply-add, as the host loop has it."""
  return jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(x, jnp.uint32) & keep,
                                      jnp.float32)


def adamw_on_device(w, opt: dict, g, hyper: dict, n_decay: int):
  """`adamw_inplace` as a jax function, for groups updated on the device: the same float32
  operations in the same order, every product rounded before it is added, the same encoding; g is
  already scaled, `hyper` is UpdateRule.scalars' (with `keep`). Returns (w, opt)."""
  n = w.shape[0]
  keep = hyper["keep"]
  r = lambda x: _rounded(x, keep)
  m = decode_jax(opt["m"], opt["m_scale"])
  v = decode_jax(opt["v"], opt["v_scale"])
  m = r(hyper["b1"] * m) + r((1 - hyper["b1"]) * g)
  v = r(hyper["b2"] * v) + r((1 - hyper["b2"]) * g * g)
  wd = jnp.where(jnp.arange(n) < n_decay, hyper["wd"], jnp.float32(0))
  u = (m * (1 / hyper["bc1"])) / (jnp.sqrt(v * (1 / hyper["bc2"])) + hyper["eps"]) + r(wd * w)
  new_w = w - r(hyper["lr"] * u)
  am, av = block_absmax(m), block_absmax(v)
  finite = jnp.isfinite(m) & jnp.isfinite(v) & jnp.isfinite(new_w)
  ok_B = per_block(finite, True).all(axis=1)  # as the host: a non-finite block stays
  ok = per_value(ok_B, n)
  new = {"m": jnp.where(ok, encode_jax(m, am, True), opt["m"]),
         "m_scale": jnp.where(ok_B, am, opt["m_scale"]),
         "v": jnp.where(ok, encode_jax(v, av, False), opt["v"]),
         "v_scale": jnp.where(ok_B, av, opt["v_scale"])}
  return jnp.where(ok, new_w, w), new
