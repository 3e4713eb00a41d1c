"""The grouped expert matmul of a mixture of experts: correctness, then speed against a dense bf16
matmul chain of the same FLOPs.

    python benchmarks/moe_kernels.py [--out DIR] [--smoke]

For each expert shape (Qwen3-30B-A3B, GPT-OSS-20B, Mixtral) and routing (balanced; skewed, the
hottest expert getting 8x the mean), the experts' SwiGLU MLP (gate and up [E, D, F], down
[E, F, D]) forward and backward is timed per implementation: `mosaic` (jax's Pallas Mosaic-GPU
ragged-dot kernels, mtjax.models.grouped), `tokamax-mosaic` and `tokamax-triton` (tokamax's
ragged_dot implementations, with their own VJPs; wheels: benchmarks/attention_wheels.sh), `ragged`
(XLA's jax.lax.ragged_dot: E times the work on the GPU), and the `dense` chain (one [D, F] matrix for every row: the same FLOPs, the ceiling).
Useful TFLOP/s count the real (token, expert) rows only: 3 matmuls x 2 x rows x D x F forward,
twice that backward. Correctness: each implementation's output and gradients against float32
(every expert on every row, each row keeping its own expert's) on a slice of the rows (bf16
operands: relative L2 error under 1e-2).
`--smoke` runs tiny shapes on the CPU (dense and ragged only) in seconds.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from mtjax.models import moe

SHAPES = {  # name: (tokens, experts, top-k, hidden D, expert width F)
    "qwen3-30b-a3b": (16384, 128, 8, 2048, 768),
    "gpt-oss-20b": (16384, 32, 4, 2880, 2880),
    "mixtral-8x7b": (8192, 8, 2, 4096, 14336),
}
SMOKE = {"tiny": (64, 4, 2, 32, 48)}


def routing(tokens, E, k, skew, seed=0):
  """Each token's k distinct experts: uniform, or with the hottest expert `skew` x the mean."""
  rng = np.random.default_rng(seed)
  p = np.ones(E)
  if skew > 1:  # expert 0 drawn skew x as often as the mean (as far as k distinct choices allow)
    p[0] = skew * (E - 1) / max(E - skew, 1)
  p /= p.sum()
  idx = np.stack([rng.choice(E, k, replace=False, p=p) for _ in range(tokens)])
  order = np.argsort(idx.reshape(-1), kind="stable")
  sizes = np.bincount(idx.reshape(-1), minlength=E).astype(np.int32)
  return order, sizes


TOKAMAX = {"tokamax-mosaic": "mosaic", "tokamax-triton": "triton"}


def tokamax_ragged_dot(name):
  """tokamax's ragged_dot with one implementation, or raises where it is absent."""
  sys.path.insert(0, str(Path(__file__).resolve().parent))
  from attention_kernels import _xprof_placeholder  # tokamax imports xprof
  _xprof_placeholder()
  import tokamax  # a wheel on the GPU machine only
  return lambda a, w, sizes: tokamax.ragged_dot(a, w, sizes, implementation=name)


def expert_mlp(impl):
  def f(x_MxD, wg, wu, wd, sizes):
    if impl == "mosaic":
      from mtjax.models import grouped  # Mosaic-GPU: on a GPU only
      mm = lambda a, w: grouped.grouped_matmul(a, w, sizes)
    elif impl in TOKAMAX:
      rd = tokamax_ragged_dot(TOKAMAX[impl])
      mm = lambda a, w: rd(a, w, sizes)
    else:
      mm = lambda a, w: moe.grouped_matmul(a, w, sizes, impl)
    h = jax.nn.silu(mm(x_MxD, wg)) * mm(x_MxD, wu)
    return mm(h, wd)
  return f


def dense_mlp(x_MxD, wg, wu, wd, sizes):
  h = jax.nn.silu(x_MxD @ wg[0]) * (x_MxD @ wu[0])
  return h @ wd[0]


def fwd_bwd(fn):
  def run(x, wg, wu, wd, sizes, ct):
    y, pull = jax.vjp(lambda x, wg, wu, wd: fn(x, wg, wu, wd, sizes), x, wg, wu, wd)
    return y, pull(ct)
  return jax.jit(run)


def median_time(f, *args, reps=10):
  jax.block_until_ready(f(*args))
  ts = []
  for _ in range(reps):
    t = time.perf_counter()
    jax.block_until_ready(f(*args))
    ts.append(time.perf_counter() - t)
  return float(np.median(ts))


def check(impl, shape, sizes, rows=4096, seed=1):
  """Relative L2 errors of output and the three weight gradients (and dx) against float32."""
  _, E, _, D, F = shape
  rng = np.random.default_rng(seed)
  # a slice of the rows keeping the group sizes' proportions
  scale = min(1.0, rows / sizes.sum())
  s = np.floor(sizes * scale).astype(np.int32)
  M = int(s.sum())
  x = rng.standard_normal((M, D), np.float32)
  w = [rng.standard_normal(shape, np.float32) / np.sqrt(shape[1])
       for shape in ((E, D, F), (E, D, F), (E, F, D))]
  ct = rng.standard_normal((M, D), np.float32)
  bf = lambda a: jnp.asarray(a, jnp.bfloat16)
  y, grads = fwd_bwd(expert_mlp(impl))(bf(x), *map(bf, w), jnp.asarray(s), bf(ct))

  with jax.default_matmul_precision("highest"):  # float32, every expert on every row, masked
    want_y, want_g = fwd_bwd(expert_mlp("dense"))(jnp.asarray(x), *map(jnp.asarray, w),
                                                   jnp.asarray(s), jnp.asarray(ct))
  rel = lambda a, b: float(np.linalg.norm(np.float32(a) - b) / max(np.linalg.norm(b), 1e-30))
  return {"out": rel(y, want_y), **{n: rel(g, wg) for n, g, wg in
                                    zip(("dx", "dw_gate", "dw_up", "dw_down"), grads, want_g)}}


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", help="write the rows as JSON here")
  p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, in seconds")
  p.add_argument("--shapes", default=None, help="comma-separated names of SHAPES")
  p.add_argument("--ragged", action="store_true", help="also time XLA's ragged_dot on the GPU "
                 "(0.036 of dense at the GPT-OSS-20B shape: minutes per shape)")
  args = p.parse_args(argv)
  if args.smoke:
    jax.config.update("jax_platforms", "cpu")
  dev = jax.devices()[0]
  gpu = dev.platform == "gpu"
  shapes = SMOKE if args.smoke else SHAPES
  if args.shapes:
    shapes = {k: SHAPES[k] for k in args.shapes.split(",")}
  impls = ["dense", "ragged"] + (["mosaic", *TOKAMAX] if gpu else [])
  rows = []
  for name, shape in shapes.items():
    tokens, E, k, D, F = shape
    M = tokens * k
    for skew in (1, 8):
      _, sizes = routing(tokens, E, k, skew)
      row = {"shape": name, "skew": skew, "rows": M, "max_group": int(sizes.max())}
      for impl in impls:
        if impl == "ragged" and gpu and not args.ragged:
          row[impl] = "skipped (XLA expands the rows E times; --ragged runs it)"
          continue
        try:
          if impl != "dense":
            row[f"{impl} error"] = check(impl, shape, sizes, rows=min(M, 4096))
          rng = np.random.default_rng(2)
          bf = lambda *s: jnp.asarray(rng.standard_normal(s, np.float32) * 0.05, jnp.bfloat16)
          args_ = (bf(M, D), bf(E, D, F), bf(E, D, F), bf(E, F, D), jnp.asarray(sizes),
                   bf(M, D))
          fn = dense_mlp if impl == "dense" else expert_mlp(impl)
          t = median_time(fwd_bwd(fn), *args_, reps=3 if args.smoke else 10)
          flops = 3 * 3 * 2 * M * D * F  # 3 matmuls, forward + 2x backward
          row[impl] = {"s": t, "tflops": flops / t / 1e12}
        except Exception as e:  # noqa: BLE001 - a variant that fails is a row, not the end
          row[impl] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
      if isinstance(row.get("dense"), dict):
        for impl in impls[1:]:
          if isinstance(row.get(impl), dict):
            row[impl]["share_of_dense"] = row["dense"]["s"] / row[impl]["s"]
      rows.append(row)
      print(json.dumps(row), flush=True)
  if args.out:
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "moe_kernels.json").write_text(json.dumps(rows, indent=1))
  print(f"\n{'shape':<16}{'skew':>5}{'impl':>8}{'ms':>9}{'TFLOP/s':>9}{'of dense':>9}  max err")
  for r in rows:
    for impl in impls:
      v = r.get(impl)
      if not isinstance(v, dict):
        print(f"{r['shape']:<16}{r['skew']:>5}{impl:>8}  {v}")
        continue
      err = r.get(f"{impl} error")
      err = max(err.values()) if isinstance(err, dict) else float("nan")
      print(f"{r['shape']:<16}{r['skew']:>5}{impl:>8}{v['s'] * 1e3:>9.2f}{v['tflops']:>9.1f}"
            f"{v.get('share_of_dense', 1.0):>9.2f}  {err:.1e}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
