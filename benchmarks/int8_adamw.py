"""The fused AdamW's update with fp32, bfloat16 and int8 moments: its speed, and the 8-bit maps' error.

    python benchmarks/int8_adamw.py [--params N] [--threads T] [--reps R] [--out FILE] [--smoke]

Speed: one layer group of N parameters (default 2^25), updated R times in place by
`UpdateRule.host_update` for each `optim.state_dtype`, on T numba threads (default: every core);
prints Gparam/s (best and median of the R) and the bytes each update moves per parameter (w read
and written, g read, both moments read and written), so GB/s beside the machine's memory bandwidth.
Then the device update (`UpdateRule.device_update`, jitted with its state donated, on jax's default
device) of the same group with fp32 and int8 moments.

Maps: what the 8-bit storage does to AdamW's update direction m^ / (sqrt(v^) + eps). A stream of
synthetic gradients (each block of 256 values of its own magnitude, log-normal over a few decades,
each value log-normal within it, a steady mean plus noise, the whole decaying 20x over the run)
feeds fp32 AdamW moments and quantized ones (each step decodes, updates in fp32, re-encodes, as the
fused update does); printed: the relative RMS difference of the update direction over the last 20
steps, and its mean (bias), for the power maps of mtjax.quantize and the dynamic-tree maps of the
8-bit optimizers (Dettmers et al., 2022: signed for m, unsigned for v, both with a zero), at
blocks of 256 and 2048 values, nearest and stochastic rounding, beta2 0.95 (mtjax's default) and
0.999. Nearest rounding here is by float64 midpoints (mtjax.quantize's float32 edges differ at ties).
`--smoke` runs a small group and a short stream in seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numba
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from mtjax import config, quantize
from mtjax.layout import Layout
from mtjax.optimizer import UpdateRule

BYTES_MOVED = {"float32": 28, "bfloat16": 20, "int8": 16 + 16 / quantize.BLOCK}  # per parameter


def time_host(dtype: str, n: int, reps: int) -> list[float]:
  """Seconds of each of `reps` in-place host updates of one group of n parameters."""
  rule = UpdateRule(config.OptimConfig(state_dtype=dtype, warmup_steps=0), reps + 1)
  lay = Layout.from_shapes({"w": jax.ShapeDtypeStruct((n // 1024, 1024), jnp.float32)})
  rng = np.random.default_rng(0)
  w = rng.standard_normal(lay.size, np.float32)
  g = rng.standard_normal(lay.size, np.float32)
  opt = rule.init_host(lay)
  rule.host_update(w, opt, g, 0, 1.0, lay)  # compiles (or loads numba's cache) and fills the state
  out = []
  for step in range(1, reps + 1):
    rule.scalars(step)  # the schedule's value, computed once per step before any group's update
    t0 = time.perf_counter()
    rule.host_update(w, opt, g, step, 1.0, lay)
    out.append(time.perf_counter() - t0)
  return out


def time_device(dtype: str, n: int, reps: int) -> list[float]:
  """Seconds of each of `reps` device updates (state donated, so in place where XLA can)."""
  rule = UpdateRule(config.OptimConfig(state_dtype=dtype, warmup_steps=0), reps + 1)
  lay = Layout.from_shapes({"w": jax.ShapeDtypeStruct((n // 1024, 1024), jnp.float32)})
  step = jax.jit(rule.device_update, static_argnums=(4,), donate_argnums=(0, 1))
  rng = np.random.default_rng(0)
  w = jnp.asarray(rng.standard_normal(lay.size, np.float32))
  g = jnp.asarray(rng.standard_normal(lay.size, np.float32))
  opt = jax.device_put(rule.init_host(lay))
  w, opt = jax.block_until_ready(step(w, opt, g, rule.scalars(0), lay))
  out = []
  for i in range(1, reps + 1):
    h = rule.scalars(i)
    t0 = time.perf_counter()
    w, opt = jax.block_until_ready(step(w, opt, g, h, lay))
    out.append(time.perf_counter() - t0)
  return out


# ---- the maps' error ---------------------------------------------------------------------------------

def dynamic_tree(signed: bool) -> np.ndarray:
  """The dynamic-tree map of the 8-bit optimizers (bitsandbytes' create_dynamic_map, 8 bits):
  decades 1e-6 .. 1 with linear fractions, 0 and 1; 256 levels."""
  data = []
  for i in range(7):
    items = 2 ** i + 1 if signed else 2 ** (i + 1) + 1
    edges = np.linspace(0.1, 1, items)
    means = (edges[:-1] + edges[1:]) / 2 * 10.0 ** (i - 6)
    data += list(means) + (list(-means) if signed else [])
  return np.sort(np.array(data + [0.0, 1.0]))


def power(signed: bool) -> np.ndarray:
  """mtjax.quantize's levels, increasing."""
  if signed:
    mag = quantize.M_LEVELS[:128].astype(np.float64)
    return np.concatenate([-mag[:0:-1], mag])
  return quantize.V_LEVELS.astype(np.float64)


def quantized(x: np.ndarray, levels: np.ndarray, block: int, rng=None) -> np.ndarray:
  """x through a block-wise quantizer with these levels (on [-1, 1]) and absmax scales: nearest
  level, or stochastic rounding between the two around it when `rng` is given."""
  n = x.size
  nb = -(-n // block)
  s = np.repeat(np.abs(np.pad(x, (0, nb * block - n))).reshape(nb, block).max(1), block)[:n]
  y = np.divide(x, s, out=np.zeros_like(x), where=s > 0)
  hi = np.clip(np.searchsorted(levels, y), 1, levels.size - 1)
  lo = hi - 1
  below, above = levels[lo], levels[hi]
  if rng is None:
    pick = np.where(y - below > above - y, hi, lo)
  else:
    p = np.clip((y - below) / (above - below), 0, 1)
    pick = np.where(rng.random(n) < p, hi, lo)
  pick = np.where(y <= levels[0], 0, pick)  # below the lowest level (v with no zero)
  return (levels[pick] * s).astype(np.float32)


def map_error(maps, block: int, b2: float, steps: int, n: int, stochastic: bool) -> tuple[float, float]:
  """(relative RMS, relative mean) of the update direction's difference over the last 20 steps."""
  rng = np.random.default_rng(0)
  sr = np.random.default_rng(1) if stochastic else None
  b1, eps = 0.9, 1e-8
  row = np.repeat(np.exp(rng.normal(0, 1.0, -(-n // quantize.BLOCK))), quantize.BLOCK)[:n]
  scale = (row * np.exp(rng.normal(0, 0.5, n)) * 1e-3).astype(np.float32)
  mean = rng.normal(0, 0.3, n).astype(np.float32)
  m = v = mq = vq = np.zeros(n, np.float32)
  rms, bias = [], []
  for t in range(1, steps + 1):
    g = (np.exp(-3 * t / steps) * scale * (mean + rng.standard_normal(n))).astype(np.float32)
    m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
    mn, vn = b1 * mq + (1 - b1) * g, b2 * vq + (1 - b2) * g * g
    bc1, bc2 = 1 - b1 ** t, 1 - b2 ** t
    u = (m / bc1) / (np.sqrt(v / bc2) + eps)
    uq = (mn / bc1) / (np.sqrt(vn / bc2) + eps)
    norm = np.sqrt(np.mean(u * u))
    rms.append(np.sqrt(np.mean((uq - u) ** 2)) / norm)
    bias.append(np.mean(uq - u) / norm)
    mq = quantized(mn, maps[0], block, sr)
    vq = quantized(vn, maps[1], block, sr)
  return float(np.mean(rms[-20:])), float(np.mean(bias[-20:]))


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python benchmarks/int8_adamw.py", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--params", type=int, default=1 << 25, help="parameters in the timed group")
  p.add_argument("--threads", type=int, default=None, help="numba threads (default: all cores)")
  p.add_argument("--reps", type=int, default=7, help="timed updates per state dtype")
  p.add_argument("--out", type=Path, default=None, help="also write the figures here (JSON)")
  p.add_argument("--smoke", action="store_true", help="a small group and a short stream")
  args = p.parse_args(argv)
  n, reps, stream, steps = args.params, args.reps, 256 * 400, 100
  if args.smoke:
    n, reps, stream, steps = 1 << 16, 2, 256 * 8, 25
  threads = min(args.threads or os.cpu_count() or 1, numba.config.NUMBA_NUM_THREADS)
  numba.set_num_threads(threads)
  out = {"params": n, "threads": threads, "device": str(jax.devices()[0]), "host": {},
         "device_update": {}, "maps": []}
  print(f"host update of {n:,} parameters on {threads} threads ({reps} updates each)")
  for dtype in ("float32", "bfloat16", "int8"):
    ts = time_host(dtype, n, reps)
    best, med = n / min(ts) / 1e9, n / statistics.median(ts) / 1e9
    out["host"][dtype] = {"gparams_best": best, "gparams_median": med,
                          "bytes_per_param": BYTES_MOVED[dtype]}
    print(f"  {dtype:9s} {best:6.2f} Gparam/s best, {med:6.2f} median "
          f"({BYTES_MOVED[dtype]:.2f} B/param moved: {med * BYTES_MOVED[dtype]:.1f} GB/s)")
  print(f"device update on {out['device']}")
  for dtype in ("float32", "int8"):
    ts = time_device(dtype, n, reps)
    med = n / statistics.median(ts) / 1e9
    out["device_update"][dtype] = {"gparams_median": med}
    print(f"  {dtype:9s} {med:6.2f} Gparam/s median")
  print(f"update direction's error with 8-bit moments ({stream:,} values, {steps} steps)")
  maps = {"power (mtjax)": (power(True), power(False)),
          "dynamic tree": (dynamic_tree(True), dynamic_tree(False))}
  cases = [(name, block, b2, sr) for name in maps for block in (256, 2048) for b2 in (0.95, 0.999)
           for sr in (False, True) if not (sr and (block, name) != (256, "power (mtjax)"))]
  for name, block, b2, sr in cases:
    rms, bias = map_error(maps[name], block, b2, steps, stream, sr)
    out["maps"].append({"map": name, "block": block, "b2": b2, "stochastic": sr,
                        "rel_rms": rms, "rel_bias": bias})
    print(f"  {name:14s} block {block:5d} b2 {b2:<6} {'stochastic' if sr else 'nearest':10s} "
          f"rel RMS {rms:7.4f}  bias {bias:+.4f}")
  if args.out:
    args.out.write_text(json.dumps(out, indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
