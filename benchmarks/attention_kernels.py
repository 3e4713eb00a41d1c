"""Which attention kernel for each layer variant: correctness against float32, then speed.

    python benchmarks/attention_kernels.py [--out FILE] [--smoke] [--variants A,B] [--impls A,B]
                                           [--reps N] [--budget-s S]

Variants (VARIANTS, in the order they run): at 8192 tokens per row Llama-8B's causal GQA (32 query
heads over 8, 128 wide), the same rows packed with 8 documents, Gemma 2 (16 over 8 heads of 256,
logits soft-capped at 50, and its sliding layers: a 4096 window), GPT-OSS-20B (64 over 8 heads of
64, learned sinks, with its 128 window and with full causal attention), DeepSeek's latent attention
widths (q/k 192, v 128, 16 heads) and Gemma 3's 1024 window at 256 wide, with a plain causal row per
head width as the baseline; then the 8 x 2048 rows (Llama 8B, packed documents, 256-wide heads, the
soft-cap, a window).

Candidates (IMPLS; `--impls` picks, `all` adds EXTRA):
- `cudnn`: jax.nn.dot_product_attention's fused kernel; documents as a boolean mask (jax turns it
  into an additive bias), windows by its local_window_size (cuDNN's own sliding window); latent
  attention's widths through jax's cuDNN call beneath it (jax.nn wants v as wide as k).
- `cudnn-packed`: cuDNN's packed layout, each row's documents as offsets and lengths (Hopper).
- `pallas`: jax's Triton flash attention (segment ids; k and v repeated per query head).
- `mgpu`: jax's Mosaic GPU flash attention (Hopper; q pre-scaled, as it takes no scale; float16
  operands, as its shared-memory buffers are). Its backward takes no causal mask, so its rows hold
  the forward alone.
- `xla` (mtjax.attention.dense_attention, the scores whole) and `blockwise`
  (mtjax.attention.blockwise_attention): the project's own, held to the bound (exit code 1).
- `tokamax-mosaic`, `tokamax-triton`, `tokamax-xla-chunked` (EXTRA: `tokamax-cudnn`,
  `tokamax-xla`, which wrap the `cudnn` and `xla` computations): tokamax's implementations with
  masks as key ranges (a document's first key; the window as its CausalMask) and the soft-cap in
  the kernel; imported from the wheels benchmarks/attention_wheels.sh downloads.
Kernels that want v as wide as q and k get v zero-padded (its TFLOP/s still count the real widths).
Sinks (one valueless logit per query head) run on every kernel that returns its log-sum-exp and
whose backward forms its delta from the output it is given (cuDNN, both Pallas kernels of jax,
tokamax's Mosaic GPU and Triton ones), by `with_sinks`; the rest record why not. Not measured:
TransformerEngine-JAX (its CUDA 13 wheel is 276 MB) and flash-attn-jax (77 MB), which cannot travel
to the GPU machine (64 MiB a call, the working tree included).

Correctness: the output and the gradients of q, k, v (and the sinks) against float32 on the same
inputs (the scores-whole reference, or the blockwise one where the scores would pass XLA_GIB),
relative L2 error; bf16 operands: under 2e-2. TFLOP/s count the matmuls of the pairs each query
sees (causal, documents and windows as they cut): forward 2 x N x pairs x (H + Hv), backward
2 x N x pairs x (3 H + 2 Hv) (2.5x the forward at equal widths). A candidate runs only while the
run is inside `--budget-s`; the JSON is rewritten after every variant, so a run cut short keeps
what it measured. A table per variant, fastest first, ends the run, with the best candidate's share
of cuDNN's plain causal rate at the same widths and tokens.
`--smoke` runs tiny shapes on the CPU (xla, blockwise, and pallas in Pallas's interpreter, its
sinks included) in seconds.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
import time
import types
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from mtjax import attention, exits
from mtjax.attention import with_sinks

from moe_kernels import median_time

# name: (B, T, N, K, H, options); options: docs (documents per row), softcap, window, sinks (one
# learned logit per query head), hv (the value width, where it differs from H)
VARIANTS = {
    "llama-8b-8k": (1, 8192, 32, 8, 128, {}),
    "llama-8b-packed-8k": (1, 8192, 32, 8, 128, {"docs": 8}),
    "gemma-hd256-8k": (1, 8192, 16, 8, 256, {}),
    "gemma2-softcap-8k": (1, 8192, 16, 8, 256, {"softcap": 50.0}),
    "gemma2-sliding-8k": (1, 8192, 16, 8, 256, {"softcap": 50.0, "window": 4096}),
    "gptoss-hd64-8k": (1, 8192, 64, 8, 64, {}),
    "gptoss-sinks-window-8k": (1, 8192, 64, 8, 64, {"sinks": True, "window": 128}),
    "gptoss-sinks-8k": (1, 8192, 64, 8, 64, {"sinks": True}),
    "mla-8k": (1, 8192, 16, 16, 192, {"hv": 128}),
    "gemma3-window-8k": (1, 8192, 16, 8, 256, {"window": 1024}),
    "llama-8b": (8, 2048, 32, 8, 128, {}),
    "llama-1b-packed": (8, 1024, 32, 8, 64, {"docs": 8}),
    "llama-8b-packed": (8, 2048, 32, 8, 128, {"docs": 8}),
    "gemma-hd256": (8, 2048, 16, 8, 256, {}),
    "gemma2-softcap": (8, 2048, 16, 8, 256, {"softcap": 50.0}),
    "gemma3-window": (8, 2048, 16, 8, 256, {"window": 1024}),
}
SMOKE = {"tiny-packed": (2, 64, 4, 2, 16, {"docs": 3}),
         "tiny-softcap": (2, 64, 4, 2, 16, {"softcap": 5.0, "window": 16}),
         "tiny-sinks": (2, 64, 4, 2, 16, {"sinks": True}),
         "tiny-mla": (1, 64, 4, 4, 24, {"hv": 16})}
IMPLS = ["cudnn", "cudnn-packed", "pallas", "mgpu", "xla", "blockwise", "tokamax-mosaic",
         "tokamax-triton", "tokamax-xla-chunked"]
EXTRA = ["tokamax-cudnn", "tokamax-xla"]
SMOKE_IMPLS = ["xla", "blockwise", "pallas"]
OWN = ("xla", "blockwise")  # the project's kernels: a failure of theirs fails the run
TOKAMAX = {"tokamax-mosaic": "mosaic_gpu", "tokamax-triton": "triton", "tokamax-cudnn": "cudnn",
           "tokamax-xla": "xla", "tokamax-xla-chunked": "xla_chunked"}
XLA_GIB = 4  # largest fp32 score tensor [B, N, T, S] a scores-whole kernel or reference is given
BOUND = {"gpu": 2e-2, "cpu": 1e-5}  # relative L2 error: bf16 operands on the GPU, fp32 on the CPU
F32 = jnp.float32


class Case(NamedTuple):
  """One variant's shapes and mask, as the kernels are built for it."""
  B: int
  T: int
  N: int
  K: int
  H: int
  Hv: int
  seg: np.ndarray | None  # [B, T] document ids
  window: int | None
  softcap: float | None
  sinks: bool
  interpret: bool  # Pallas kernels in the interpreter (no GPU)


def case_of(B, T, N, K, H, opts, interpret=False) -> Case:
  seg = documents(B, T, opts["docs"]) if "docs" in opts else None
  return Case(B, T, N, K, H, opts.get("hv", H), seg, opts.get("window"), opts.get("softcap"),
              bool(opts.get("sinks")), interpret)


def documents(B, T, docs, seed=0):
  """Segment ids [B, T] (1, 2, ... per row) of `docs` documents of random lengths per row."""
  rng = np.random.default_rng(seed)
  seg = np.zeros((B, T), np.int32)
  for b in range(B):
    cuts = np.sort(rng.choice(np.arange(1, T), docs - 1, replace=False))
    seg[b] = np.searchsorted(cuts, np.arange(T), side="right") + 1
  return seg


def document_starts(seg):
  """Each position's first key: the start of its document ([B, T], for key-range masks)."""
  starts = np.zeros_like(seg)
  for b, s in enumerate(seg):
    first = np.flatnonzero(np.r_[True, s[1:] != s[:-1]])
    starts[b] = first[np.searchsorted(first, np.arange(len(s)), side="right") - 1]
  return starts


def visible_pairs(B, T, seg, window):
  """Query-key pairs the mask keeps (causal, same document, within the window)."""
  i, j = np.arange(T)[:, None], np.arange(T)[None, :]
  keep = j <= i
  if window is not None:
    keep &= i - window < j
  if seg is None:
    return B * int(keep.sum())
  return int(sum((keep & (s[:, None] == s[None, :])).sum() for s in seg))


def flops(c: Case) -> tuple[float, float]:
  """Forward and backward matmul FLOPs over the visible pairs."""
  pairs = visible_pairs(c.B, c.T, c.seg, c.window)
  return 2.0 * c.N * pairs * (c.H + c.Hv), 2.0 * c.N * pairs * (3 * c.H + 2 * c.Hv)


def scores_gib(c: Case) -> float:
  return c.B * c.N * c.T * c.T * 4 / 2**30


def _xprof_placeholder():
  """Registers a stand-in for xprof's kernel-stats tool unless xprof is installed.

  tokamax's benchmarking module imports it at import time and calls it only in its xprof timer;
  xprof with what it needs (gcsfs and the rest) is far too large to travel to the GPU machine.
  """
  if "xprof" in sys.modules or importlib.util.find_spec("xprof") is not None:
    return
  names = ["xprof", "xprof.cli", "xprof.cli.tools", "xprof.cli.tools.get_kernel_stats_tool"]
  mods = [types.ModuleType(n) for n in names]
  for parent, child, name in zip(mods, mods[1:], names[1:]):
    child.__path__ = []
    setattr(parent, name.rsplit(".", 1)[1], child)

  def compute_kernel_stats(*_, **__):
    raise RuntimeError("xprof is not installed: tokamax's xprof timer is unavailable")
  mods[-1].compute_kernel_stats = compute_kernel_stats
  mods[0].__path__ = []
  sys.modules.update(zip(names, mods))


def tokamax_attention():
  """tokamax's attention implementations by name and its mask module (raises where absent)."""
  _xprof_placeholder()
  from tokamax._src.ops.attention import api, base
  return api.IMPLEMENTATIONS, base


def pad_width(x, width):
  """x zero-padded on its last axis to `width` (kernels that want v as wide as q and k)."""
  extra = width - x.shape[-1]
  return x if extra == 0 else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, extra)])


def kernel(impl, c: Case):
  """The candidate as f(q, k, v[, sinks_N]) -> [B, T, N, Hv]."""
  scale = 1.0 / math.sqrt(c.H)
  segs = None if c.seg is None else jnp.asarray(c.seg)
  if impl in OWN:
    fn = attention.blockwise_attention if impl == "blockwise" else attention.dense_attention
    return lambda q, k, v, *s: fn(q, k, v, segments_q_BxT=segs, causal=True, window=c.window,
                                  softcap=c.softcap, sinks_N=s[0] if s else None)
  if impl in TOKAMAX:
    return tokamax_kernel(TOKAMAX[impl], c)
  if impl == "cudnn":
    return cudnn_kernel(c, scale)
  if impl == "cudnn-packed":
    from jax._src.cudnn import fused_attention_stablehlo as fa
    M = int(c.seg.max())
    lens = np.full((c.B, M), -1, np.int32)
    offs = np.full((c.B, M + 1), -1, np.int32)
    for b, s in enumerate(c.seg):
      n = np.bincount(s)[1:]
      lens[b, :len(n)] = n
      offs[b, :len(n) + 1] = np.concatenate([[0], np.cumsum(n)])
    lens, offs = jnp.asarray(lens), jnp.asarray(offs)
    return lambda q, k, v: fa.dot_product_attention(
        q, k, v, None, None, lens, lens, offs, offs, scale=scale,
        mask_type=fa.MaskType.PADDING_CAUSAL)
  if impl == "pallas":
    return pallas_kernel(c, scale, segs)
  if impl == "mgpu":
    return mgpu_kernel(c, scale)
  raise ValueError(f"unknown candidate {impl!r}")


def cudnn_kernel(c: Case, scale):
  from jax._src.cudnn import fused_attention_stablehlo as fa
  if c.sinks:  # jax's cuDNN call returns the lse; its backward rule takes the output to use
    statics = (scale, 42, 0.0, (False, False), fa.MaskType.CAUSAL,
               fa._normalize_layout("BTNH").value, c.window, fa.check_cudnn_version())

    def fwd(q, k, v):
      unused = jnp.zeros(0, q.dtype)
      (out, lse), res = fa._dot_product_attention_fwd_rule(q, k, v, *(unused,) * 7, *statics, True)
      return out, lse, res

    def bwd(res, out, dout):
      return fa._dot_product_attention_bwd_rule(*statics, False, (*res[:-1], out), dout)[:3]
    return with_sinks(fwd, bwd)
  if c.Hv != c.H:
    return lambda q, k, v: fa.dot_product_attention(
        q, k, v, scale=scale, mask_type=fa.MaskType.CAUSAL, sliding_window_length=c.window)
  mask = None if c.seg is None else jnp.asarray(c.seg[:, None, :, None] == c.seg[:, None, None, :])
  local = None if c.window is None else (c.window - 1, 0)
  return lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, mask=mask, is_causal=True, local_window_size=local, implementation="cudnn")


def pallas_kernel(c: Case, scale, segs):
  """jax's Triton flash attention: causal and segment ids; k and v repeated per query head."""
  from jax.experimental.pallas.ops.gpu import attention as pa
  blocks = pa.BlockSizes.get_default()

  def heads(k, v):
    r = c.N // c.K
    return jnp.repeat(k, r, axis=2), jnp.repeat(pad_width(v, c.H), r, axis=2)

  if not c.sinks:
    return lambda q, k, v: pa.mha(q, *heads(k, v), segs, sm_scale=scale, causal=True,
                                  block_sizes=blocks, interpret=c.interpret)[..., :c.Hv]

  def fwd(q, k, v):  # its lse is in base 2
    out, lse2 = pa.mha(q, k, v, segs, sm_scale=scale, causal=True, block_sizes=blocks,
                       interpret=c.interpret, return_residuals=True)
    return out, lse2 * math.log(2.0), (q, k, v, lse2)

  def bwd(res, out, dout):
    q, k, v, lse2 = res
    return pa._mha_backward(scale, True, blocks, "triton", None, 2, None, c.interpret, False,
                            False, (q, k, v, segs, out, lse2), dout)[:3]
  f = with_sinks(fwd, bwd)
  return lambda q, k, v, sinks_N: f(q, *heads(k, v), sinks_N)[..., :c.Hv]


def mgpu_kernel(c: Case, scale):
  """jax's Mosaic GPU flash attention (plain causal; its backward takes no causal mask).

  It takes no scale (q is scaled before it) and its shared-memory buffers are float16, so q, k
  and v go in as float16 and the output comes back in q's dtype.
  """
  from jax.experimental.pallas.ops.gpu import attention_mgpu as am
  cfg = am.TuningConfig(block_q=64, block_kv=64 if c.H >= 256 else 128, max_concurrent_steps=2,
                        causal=True, block_q_dkv=64, block_kv_dkv=64, block_q_dq=64,
                        block_kv_dq=64)

  def operands(q, k, v):
    f16 = lambda x: x.astype(jnp.float16)
    return f16(q * scale), f16(k), f16(pad_width(v, c.H))

  if not c.sinks:
    return lambda q, k, v: am.attention(*operands(q, k, v), cfg)[..., :c.Hv].astype(q.dtype)

  def fwd(q, k, v):  # its lse is in base 2
    out, (lse2,) = am._attention_forward(q, k, v, cfg, save_residuals=True)
    return out, lse2 * math.log(2.0), (q, k, v, lse2)

  def bwd(res, out, dout):
    q, k, v, lse2 = res
    return am._attention_bwd(cfg, False, (q, k, v, out, lse2), dout)
  f = with_sinks(fwd, bwd)
  return lambda q, k, v, sinks_N: f(*operands(q, k, v), sinks_N)[..., :c.Hv].astype(q.dtype)


def tokamax_kernel(name, c: Case):
  """tokamax's implementation `name`, the mask as key ranges; sinks through its residuals."""
  impls, base = tokamax_attention()
  op = impls[name]
  mask = base.Mask(is_causal=True)
  if c.window is not None:
    mask &= base.CausalMask(offset=0, window_size=c.window)
  if c.seg is not None:  # [B, 1 (every head), T]: each query's first visible key
    mask &= base.Mask(k_start=jnp.asarray(document_starts(c.seg))[:, None, :])
  kw = {"mask": mask, "logits_soft_cap": c.softcap}
  if not c.sinks:
    return lambda q, k, v: op(q, k, v, **kw)
  if name not in ("mosaic_gpu", "triton"):
    raise NotImplementedError(f"tokamax's {name}: no backward that forms its delta from the output "
                              "it is given, as the sinks need")

  def fwd(q, k, v):  # residuals: each row's max (None when the kernel needs none) and sum
    out, (m, l) = op(q, k, v, return_residuals=True, **kw)
    return out, jnp.log(l) if m is None else m + jnp.log(l), (q, k, v, (m, l))

  def bwd(res, out, dout):
    q, k, v, residuals = res
    ba = op.bind(q, k, v, **kw)
    kwargs = {n: x for n, x in ba.kwargs.items() if n != "return_residuals"}
    g = op.vjp(residuals, out, dout, *ba.args, **kwargs)
    return g["q"], g["k"], g["v"]
  return with_sinks(fwd, bwd)


def skip_reason(impl, c: Case) -> str | None:
  """Why a candidate is not run on a variant, from its source (None: it is run)."""
  if impl in ("cudnn", "cudnn-packed", "tokamax-cudnn") and c.softcap is not None:
    return "cuDNN through jax takes no soft-cap"
  if impl == "cudnn-packed" and (c.seg is None or c.window is not None or c.sinks):
    return "the packed layout here: packed rows, no window or sinks"
  if impl == "pallas" and (c.softcap is not None or c.window is not None):
    return "jax's Triton kernel: causal and segment ids only"
  if impl == "mgpu" and (c.softcap is not None or c.window is not None or c.seg is not None):
    return "jax's Mosaic GPU kernel: causal only"
  if impl in ("xla", "tokamax-xla") and scores_gib(c) > XLA_GIB:
    return f"the scores whole: {scores_gib(c):.0f} GiB in fp32"
  return None


def fwd_bwd(f):
  def run(ct, *args):
    out, pull = jax.vjp(f, *args)
    return (out,) + pull(ct)
  return jax.jit(run)


@jax.jit
def _rel(got, want):
  return jnp.linalg.norm((got.astype(F32) - want).ravel()) / jnp.linalg.norm(want.ravel())


def errors(got, want, names):
  return {n: float(_rel(g, w)) for n, g, w in zip(names, got, want)}


def one_line(e: Exception) -> str:
  text = str(e).strip().splitlines()
  return f"{type(e).__name__}: {text[0][:160] if text else ''}"


def measure(row, f, args, ct, want, names, fl, reps):
  """Fills row: the forward, then forward and backward; a failure ends the candidate's row."""
  fwd_fl, bwd_fl = fl
  try:
    fwd = jax.jit(f)
    row["errors"] = errors([fwd(*args)], want[:1], names[:1])
    row["fwd_ms"] = 1e3 * median_time(fwd, *args, reps=reps)
    row["fwd_tflops"] = fwd_fl / row["fwd_ms"] / 1e9
    both = fwd_bwd(f)
    row["errors"] = errors(both(ct, *args), want, names)
    row["ms"] = 1e3 * median_time(both, ct, *args, reps=reps)
    row["tflops"] = (fwd_fl + bwd_fl) / row["ms"] / 1e9
  except Exception as e:  # noqa: BLE001 - a kernel that refuses a shape is a row, not a crash
    row["error"] = one_line(e)
  if "errors" in row:
    row["rel_err"] = max(row["errors"].values())


def run(variants, impls, dtype, reps, budget_s, out_path=None, interpret=False, bound=2e-2):
  """One row per (variant, candidate): measured, failed (error) or not run (skip)."""
  rows, unavailable = [], {}
  deadline = time.perf_counter() + budget_s
  for name, (B, T, N, K, H, opts) in variants.items():
    c = case_of(B, T, N, K, H, opts, interpret)
    head = {"variant": name, "B": B, "T": T, "N": N, "K": K, "H": H, "Hv": c.Hv, **opts}
    if time.perf_counter() > deadline:
      rows += [{**head, "impl": i, "skip": "time budget"} for i in impls]
      continue
    ks = jax.random.split(jax.random.key(0), 5)
    q, k, v = (jax.random.normal(ks[i], s, F32) for i, s in
               enumerate([(B, T, N, H), (B, T, K, H), (B, T, K, c.Hv)]))
    ct = jax.random.normal(ks[3], (B, T, N, c.Hv), F32)
    args = (q, k, v) + ((3.0 + jax.random.normal(ks[4], (N,), F32),) if c.sinks else ())
    names = ["out", "dq", "dk", "dv"] + (["dsinks"] if c.sinks else [])
    ref = "xla" if scores_gib(c) <= XLA_GIB else "blockwise"
    try:
      with jax.default_matmul_precision("float32"):
        want = fwd_bwd(kernel(ref, c))(ct, *args)
    except Exception as e:  # noqa: BLE001 - the variant's rows say why, the run goes on
      why = f"the float32 reference ({ref}) failed: {one_line(e)}"
      rows += [{**head, "impl": i, "error": why, "ok": False} for i in impls]
      print(f"{name:22} {why}", flush=True)
      continue
    fl = flops(c)
    low = tuple(x.astype(dtype) for x in args[:3]) + args[3:]  # sinks stay fp32, as parameters
    for impl in impls:
      row = {**head, "impl": impl, "reference": ref}
      if (why := skip_reason(impl, c)) is not None:
        row["skip"] = why
      elif impl in unavailable:
        row["error"] = unavailable[impl]
      elif time.perf_counter() > deadline:
        row["skip"] = "time budget"
      else:
        try:
          f = kernel(impl, c)
        except ImportError as e:  # absent here: not tried again on the variants after this one
          row["error"] = unavailable[impl] = one_line(e)
        except Exception as e:  # noqa: BLE001 - a candidate that cannot be built is a row
          row["error"] = one_line(e)
        else:
          measure(row, f, low, ct.astype(dtype), want, names, fl, reps)
        row["ok"] = "error" not in row and row["rel_err"] <= bound
      rows.append(row)
      print(f"{name:22} {impl:19} {status(row)}", flush=True)
    if out_path:
      out_path.write_text(json.dumps(rows, indent=1))
    jax.clear_caches()  # the variant's programs and the constants they hold (masks)
  return rows


def status(row) -> str:
  parts = []
  if "fwd_ms" in row:
    parts.append(f"fwd {row['fwd_ms']:8.2f} ms")
  if "ms" in row:
    parts.append(f"fwd+bwd {row['ms']:8.2f} ms {row['tflops']:6.1f} TFLOP/s")
  if "rel_err" in row:
    parts.append(f"rel err {row['rel_err']:.1e}")
  if "error" in row:
    parts.append(row["error"])
  if "skip" in row:
    parts.append(f"not run: {row['skip']}")
  return "  ".join(parts)


def plain(row) -> bool:
  return not any(key in row for key in ("docs", "softcap", "window", "sinks"))


def shares(rows):
  """Adds each timed row's share of cuDNN's plain causal rate at its widths and tokens."""
  base = {(r["T"], r["H"], r["Hv"]): r["tflops"] for r in rows
          if r["impl"] == "cudnn" and plain(r) and r.get("ok") and "tflops" in r}
  for r in rows:
    if "tflops" in r and (r["T"], r["H"], r["Hv"]) in base:
      r["cudnn_plain_share"] = r["tflops"] / base[(r["T"], r["H"], r["Hv"])]
  return base


def summary(rows) -> str:
  """A table per variant, fastest first, and the best candidate's share of cuDNN's plain rate."""
  base = shares(rows)
  lines = []
  for name in dict.fromkeys(r["variant"] for r in rows):
    vr = [r for r in rows if r["variant"] == name]
    r0 = vr[0]
    extras = ", ".join(f"{key} {r0[key]}" for key in ("docs", "softcap", "window", "sinks")
                       if key in r0)
    width = f"{r0['H']}" + (f"/{r0['Hv']}" if r0["Hv"] != r0["H"] else "")
    lines.append(f"\n{name}: {r0['B']} x {r0['T']}, {r0['N']}/{r0['K']} heads x {width}, causal"
                 + (f", {extras}" if extras else ""))
    lines.append(f"  {'candidate':19} {'fwd ms':>8} {'f+b ms':>8} {'TFLOP/s':>8} {'share':>6} "
                 f"{'rel err':>8}")
    order = lambda r: (r.get("ms", math.inf), r.get("fwd_ms", math.inf))
    for r in sorted(vr, key=order):
      num = lambda key, fmt, r=r: format(r[key], fmt) if key in r else "-"
      note = r.get("error") or (f"not run: {r['skip']}" if "skip" in r else "")
      if "ok" in r and not r["ok"] and "error" not in r:
        note = "above the error bound"
      lines.append(f"  {r['impl']:19} {num('fwd_ms', '8.2f'):>8} {num('ms', '8.2f'):>8} "
                   f"{num('tflops', '8.1f'):>8} {num('cudnn_plain_share', '6.2f'):>6} "
                   f"{num('rel_err', '8.1e'):>8}  {note}")
    good = [r for r in vr if r.get("ok") and "ms" in r]
    if good:
      best = min(good, key=order)
      key = (r0["T"], r0["H"], r0["Hv"])
      share = (f"{best['tflops'] / base[key]:.2f} of cuDNN's plain causal {base[key]:.0f} TFLOP/s "
               f"at {width} wide" if key in base else "no plain cuDNN row at these widths")
      lines.append(f"  best: {best['impl']}, {best['tflops']:.1f} TFLOP/s, {share}")
    else:
      lines.append("  best: none passed")
  return "\n".join(lines)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(usage=__doc__.split("\n\n")[1].strip())
  p.add_argument("--out", type=Path)
  p.add_argument("--smoke", action="store_true")
  p.add_argument("--variants", help="comma-separated names (default: all)")
  p.add_argument("--impls", help=f"comma-separated candidates, or 'all' (default: {','.join(IMPLS)})")
  p.add_argument("--reps", type=int, default=5)
  p.add_argument("--budget-s", type=float, default=300.0,
                 help="no candidate starts after this many seconds (default 300)")
  a = p.parse_args(argv)
  gpu = jax.devices()[0].platform == "gpu" and not a.smoke
  table = VARIANTS if gpu else SMOKE
  impls = IMPLS if gpu else SMOKE_IMPLS
  if a.impls:
    impls = IMPLS + EXTRA if a.impls == "all" else a.impls.split(",")
  if unknown := [i for i in impls if i not in IMPLS + EXTRA]:
    return exits.fail("attention_kernels", f"unknown candidate {unknown[0]!r} (known: "
                      f"{', '.join(IMPLS + EXTRA)})", exits.BAD_INPUT)
  if a.variants:
    if unknown := [n for n in a.variants.split(",") if n not in table]:
      return exits.fail("attention_kernels", f"unknown variant {unknown[0]!r} (known: "
                        f"{', '.join(table)})", exits.BAD_INPUT)
    table = {n: table[n] for n in a.variants.split(",")}
  bound = BOUND["gpu" if gpu else "cpu"]
  rows = run(table, impls, jnp.bfloat16 if gpu else F32, a.reps if gpu else 2, a.budget_s,
             a.out, interpret=not gpu, bound=bound)
  print(summary(rows))
  if a.out:
    a.out.write_text(json.dumps(rows, indent=1))
  bad = [f"{r['variant']}/{r['impl']}" for r in rows if r["impl"] in OWN and r.get("ok") is False]
  if bad:
    print(f"the project's kernels failed or passed the error bound: {', '.join(bad)}")
  return exits.FAILED if bad else exits.OK


if __name__ == "__main__":
  sys.exit(main())
