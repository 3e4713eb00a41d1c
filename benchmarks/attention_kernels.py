"""Which attention kernel for each layer variant: correctness against float32, then speed.

    python benchmarks/attention_kernels.py [--out FILE] [--smoke]

For each variant a model family's layers take (plain causal GQA; packed documents, as prepared
chat data is; a head width of 256; Gemma 2's soft-capped logits; a sliding window), the attention
forward and backward (the gradients of q, k and v) is timed per kernel that takes the variant:
`cudnn` (jax.nn.dot_product_attention's fused kernel; packed documents as a boolean mask, which
jax turns into an additive bias), `cudnn-packed` (cuDNN's packed layout: each row's documents as
offsets and lengths, no [T x S] tensor; Hopper GPUs), `pallas` (jax's Triton flash attention,
segment ids, keys and values repeated per query head), `xla` (mtjax.attention.dense_attention, the
scores whole) and `blockwise` (mtjax.attention.blockwise_attention). Correctness: the output and
the three gradients against the float32 scores-whole reference on the same inputs, relative L2
error (bf16 operands: under 2e-2). TFLOP/s count the matmuls of the keys each query sees (causal,
documents and windows counted as they cut): forward 4 x B x N x H x pairs, backward 2.5x that.
`--smoke` runs tiny shapes on the CPU (xla and blockwise) in seconds.
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
from mtjax import attention  # noqa: E402

from moe_kernels import median_time  # noqa: E402  (benchmarks/ is on the path beside it)

# name: (B, T, N, K, H, options); options: docs (documents per row), softcap, window
VARIANTS = {
    "llama-8b": (8, 2048, 32, 8, 128, {}),
    "llama-1b-packed": (8, 1024, 32, 8, 64, {"docs": 8}),
    "llama-8b-packed": (8, 2048, 32, 8, 128, {"docs": 8}),
    "gemma-hd256": (8, 2048, 16, 8, 256, {}),
    "gemma2-softcap": (8, 2048, 16, 8, 256, {"softcap": 50.0}),
    "gemma3-window": (8, 2048, 16, 8, 256, {"window": 1024}),
}
SMOKE = {"tiny-packed": (2, 64, 4, 2, 16, {"docs": 3}),
         "tiny-softcap": (2, 64, 4, 2, 16, {"softcap": 5.0, "window": 16})}


def documents(B, T, docs, seed=0):
  """Segment ids [B, T] (1, 2, ... per row) of `docs` documents of random lengths per row."""
  rng = np.random.default_rng(seed)
  seg = np.zeros((B, T), np.int32)
  for b in range(B):
    cuts = np.sort(rng.choice(np.arange(1, T), docs - 1, replace=False))
    seg[b] = np.searchsorted(cuts, np.arange(T), side="right") + 1
  return seg


def visible_pairs(B, T, seg, window):
  """Query-key pairs the mask keeps (causal, same document, within the window)."""
  i, j = np.arange(T)[:, None], np.arange(T)[None, :]
  keep = j <= i
  if window is not None:
    keep &= i - window < j
  if seg is None:
    return B * int(keep.sum())
  return int(sum((keep & (s[:, None] == s[None, :])).sum() for s in seg))


def kernel(impl, seg, opts):
  window, softcap = opts.get("window"), opts.get("softcap")
  if impl == "cudnn":
    mask = None if seg is None else (seg[:, None, :, None] == seg[:, None, None, :])
    local = None if window is None else (window - 1, 0)
    return lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, mask=mask, is_causal=True, local_window_size=local, implementation="cudnn")
  if impl == "cudnn-packed":
    from jax._src.cudnn import fused_attention_stablehlo as fa  # noqa: PLC0415
    M = int(seg.max())
    lens = np.full((seg.shape[0], M), -1, np.int32)
    offs = np.full((seg.shape[0], M + 1), -1, np.int32)
    for b, s in enumerate(seg):
      n = np.bincount(s)[1:]
      lens[b, :len(n)] = n
      offs[b, :len(n) + 1] = np.concatenate([[0], np.cumsum(n)])
    lens, offs = jnp.asarray(lens), jnp.asarray(offs)
    return lambda q, k, v: fa.dot_product_attention(
        q, k, v, None, None, lens, lens, offs, offs, scale=1.0 / np.sqrt(q.shape[-1]),
        mask_type=fa.MaskType.PADDING_CAUSAL)
  if impl == "pallas":  # jax's Triton flash attention: segment ids, no window or cap; k, v repeated
    from jax.experimental.pallas.ops.gpu import attention as pallas_attention  # noqa: PLC0415
    segs = None if seg is None else jnp.asarray(seg)

    def f(q, k, v):
      r = q.shape[2] // k.shape[2]
      return pallas_attention.mha(q, jnp.repeat(k, r, axis=2), jnp.repeat(v, r, axis=2), segs,
                                  sm_scale=1.0 / np.sqrt(q.shape[-1]), causal=True)
    return f
  fn = attention.blockwise_attention if impl == "blockwise" else attention.dense_attention
  segs = None if seg is None else jnp.asarray(seg)
  return lambda q, k, v: fn(q, k, v, segments_q_BxT=segs, causal=True, window=window,
                            softcap=softcap)


def fwd_bwd(f):
  def run(q, k, v, ct):
    out, pull = jax.vjp(f, q, k, v)
    return (out,) + pull(ct)
  return jax.jit(run)


def rel(got, want):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def median_s(f, args, reps):
  jax.block_until_ready(f(*args))
  ts = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(f(*args))
    ts.append(time.perf_counter() - t0)
  return float(np.median(ts))


def run(variants, impls, dtype, reps):
  rows = []
  for name, (B, T, N, K, H, opts) in variants.items():
    seg = documents(B, T, opts["docs"]) if "docs" in opts else None
    ks = jax.random.split(jax.random.key(0), 4)
    q, k, v = (jax.random.normal(ks[i], s, jnp.float32) for i, s in
               enumerate([(B, T, N, H), (B, T, K, H), (B, T, K, H)]))
    ct = jax.random.normal(ks[3], (B, T, N, H), jnp.float32)
    want = fwd_bwd(kernel("xla", seg, opts))(q, k, v, ct)
    flops = 4 * N * H * visible_pairs(B, T, seg, opts.get("window")) * 3.5
    args = tuple(x.astype(dtype) for x in (q, k, v, ct))
    for impl in impls:
      if ((impl.startswith("cudnn") and "softcap" in opts) or (impl == "cudnn-packed" and seg is None)
          or (impl == "pallas" and ("softcap" in opts or "window" in opts))):
        continue  # the fused kernels take no soft-cap (Triton's no window); packed layout: packed rows
      row = {"variant": name, "impl": impl, "B": B, "T": T, "N": N, "K": K, "H": H, **opts}
      try:
        f = fwd_bwd(kernel(impl, seg, opts))
        got = f(*args)
        row["rel_err"] = max(rel(g, w) for g, w in zip(got, want))
        row["ms"] = 1e3 * median_time(f, *args, reps=reps)
        row["tflops"] = flops / row["ms"] / 1e9
      except Exception as e:  # noqa: BLE001 - a kernel that refuses a shape is a row, not a crash
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
      rows.append(row)
      print(f"{name:18} {impl:13} " + (f"{row['ms']:8.2f} ms {row['tflops']:7.1f} TFLOP/s "
                                        f"rel err {row['rel_err']:.1e}" if "ms" in row
                                        else row["error"]), flush=True)
  return rows


def main(argv=None) -> int:
  p = argparse.ArgumentParser(usage=__doc__.split("\n\n")[1].strip())
  p.add_argument("--out", type=Path)
  p.add_argument("--smoke", action="store_true")
  p.add_argument("--reps", type=int, default=10)
  a = p.parse_args(argv)
  gpu = jax.devices()[0].platform == "gpu" and not a.smoke
  impls = ["cudnn", "cudnn-packed", "pallas", "xla", "blockwise"] if gpu else ["xla", "blockwise"]
  rows = run(SMOKE if a.smoke else VARIANTS, impls, jnp.bfloat16 if gpu else jnp.float32,
             2 if a.smoke else a.reps)
  bad = [r for r in rows if r.get("rel_err", 0) > (2e-2 if gpu else 1e-5)]
  if a.out:
    a.out.write_text(json.dumps(rows, indent=1))
  if bad:
    print(f"errors above the bound: {bad}")
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
