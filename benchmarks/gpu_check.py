"""One device call: correctness of the streamed engine on the GPU, then timings of its parts.

PYTHONUNBUFFERED=1 python benchmarks/gpu_check.py OUTDIR
"""
import json
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import reference as ref  # noqa: E402
from mtjax import config, data, engine, state as st  # noqa: E402
from mtjax.optimizer import HostOptimizer  # noqa: E402

out = sys.argv[1] if len(sys.argv) > 1 else "."
dev = jax.devices()[0]
print("jax", jax.__version__, dev, [m.kind for m in dev.addressable_memories()], flush=True)


def rel(a, b):
  return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


# 1. correctness on the GPU: streamed grads vs jax.grad of the reference, fp32 and bf16
for dtype in ("float32", "bfloat16"):
  for tied in (False, True):
    cfg = config.from_dict({"model": dict(vocab_size=128, hidden=64, layers=3, heads=4, kv_heads=2,
                                          ffn=96, tie_embeddings=tied, qkv_bias=True),
                            "engine": dict(compute_dtype=dtype, loss_chunk=96, micro_batch=2),
                            "train": dict(batch=4, seq=32)})
    s = st.create(cfg.model, jax.random.key(1))
    eng = engine.Engine(cfg, s)
    b = data.synthetic_batch(3, 4, 32, 128, 0)
    loss, gs = eng.grads(b)
    tree = s.to_tree()
    with jax.default_matmul_precision("highest"):
      rl, rg = jax.jit(jax.value_and_grad(ref.loss_fn), static_argnums=3)(tree, b.inputs, b.targets,
                                                                          cfg.model)
    flat = ([s.embed.layout.flatten(rg["embed"])]
            + [g.layout.flatten(t) for g, t in zip(s.blocks, rg["blocks"])]
            + [s.head.layout.flatten(rg["head"])])
    errs = [rel(a, r) for a, r in zip(gs, flat)]
    print(f"grad check {dtype} tied={tied}: loss {loss:.6f} ref {float(rl):.6f} "
          f"max rel grad err {max(errs):.2e}", flush=True)
    eng.close()

# 2. host optimizer throughput: fused numba vs optax on XLA:CPU, 256M params
n = 256 * 2**20
ocfg = config.OptimConfig()
lay = st.Layout.from_shapes({"w": jax.ShapeDtypeStruct((n // 1024, 1024), jnp.float32)})
rng = np.random.default_rng(0)
g = rng.standard_normal(n, dtype=np.float32)
res = {}
for impl in ("fused", "optax"):
  opt = HostOptimizer(config.OptimConfig(impl=impl), 100)
  w = rng.standard_normal(n, dtype=np.float32)
  grp = st.Group("w", "block", lay, w, np.zeros(n, np.float32), np.zeros(n, np.float32))
  opt.update(grp, g, 0)
  ts = []
  for i in range(3):
    t = time.perf_counter(); opt.update(grp, g, i + 1); ts.append(time.perf_counter() - t)
  res[impl] = n / min(ts) / 1e9
  print(f"host AdamW {impl}: {res[impl]:.2f} Gparam/s (256M params, best of 3)", flush=True)
  opt.close()

# 3. the CLI on the ~1B config, overlapped and serial
for name, extra in (("1b", []), ("1b_serial", ["engine.overlap=false"]),
                    ("1b_ckpt_host", ["engine.checkpoints=host"])):
  cmd = [sys.executable, "-m", "mtjax.train", "--config", "configs/llama_1b.yaml", "--no-progress",
         "--json", f"{out}/{name}.json", "train.steps=6"] + extra
  print("$", " ".join(cmd[1:]), flush=True)
  t = time.perf_counter()
  r = subprocess.run(cmd, capture_output=True, text=True)
  print(r.stdout[-2000:], r.stderr[-3000:] if r.returncode else "", f"[{time.perf_counter() - t:.0f}s]",
        flush=True)
