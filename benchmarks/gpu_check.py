"""Is the engine right on this device, and how fast are the host updates? One device call's first
minute:

  1. streamed gradients and three clipped AdamW steps against the whole-model reference
     (tests/reference.py) + optax, fp32 with true fp32 matmuls, in every placement mix;
  2. gradients with each attention kernel (cuDNN's fused one on a GPU, XLA's, mtjax's blockwise)
     in bf16 against the fp32 reference, and the layer variants the kernel choice routes to
     cuDNN by jax's cuDNN call (sinks, sinks in a window, MLA's 192/128 widths): output and every
     gradient of models.layers.attend against mtjax.attention.dense_attention in fp32;
  3. the host update rates of the fused AdamW and the general optax path on XLA:CPU.

    PYTHONUNBUFFERED=1 python benchmarks/gpu_check.py [--smoke]

`--smoke` runs one placement mix, one kernel and a 1M-parameter update on the CPU, in seconds.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from mtjax import config, data, engine, launch, store
from mtjax.layout import Layout

BASE = {
    "model": dict(vocab_size=128, hidden=64, layers=3, heads=4, kv_heads=2, ffn=96, qkv_bias=True),
    "engine": dict(compute_dtype="float32", loss_chunk=96, micro_batch=2,
                   matmul_precision="highest", device_state_layers=0, device_update_layers=0),
    "optim": dict(lr=1e-2, warmup_steps=1, clip_norm=0.5),
    "train": dict(batch=4, seq=32, steps=3)}


def with_engine(**engine_keys) -> config.Config:
  return config.from_dict({**BASE, "engine": {**BASE["engine"], **engine_keys}})


def rel(a, b) -> float:
  import numpy as np
  return float(np.linalg.norm(np.asarray(a) - np.asarray(b)) / max(np.linalg.norm(b), 1e-30))


def flat(s, tree) -> list:
  return ([s.embed.layout.flatten(tree["embed"])]
          + [g.layout.flatten(t) for g, t in zip(s.blocks, tree["blocks"])]
          + [s.head.layout.flatten(tree["head"])])


def placements(tiers_list, steps: int = 3) -> float:
  """Worst relative error over the placement mixes (gradients and weights after `steps`)."""
  import jax
  import optax

  import reference as ref
  from mtjax.optimizer import schedule
  worst = 0.0
  for tiers in tiers_list:
    cfg = with_engine(device_state_layers=tiers[0], device_update_layers=tiers[1])
    s = store.create(cfg, jax.random.key(1))
    eng = engine.Engine(cfg, s)
    b = data.synthetic_batch(3, 4, 32, 128, 0)
    params = s.to_tree()
    loss, gs = eng.grads(b)
    with jax.default_matmul_precision("highest"):
      vg = jax.jit(jax.value_and_grad(ref.loss_fn), static_argnums=3)
      rl, rg = vg(params, b.inputs, b.targets, cfg.model)
      o = cfg.optim
      tx = optax.chain(optax.clip_by_global_norm(o.clip_norm), optax.adamw(
          schedule(o, cfg.decay_steps), b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay,
          mask=ref.decay_mask))
      opt_state = tx.init(params)
      for i in range(steps):
        bi = data.synthetic_batch(i, 4, 32, 128, 0)
        eng.step(bi)
        _, gi = vg(params, bi.inputs, bi.targets, cfg.model)
        up, opt_state = tx.update(gi, opt_state, params)
        params = optax.apply_updates(params, up)
    eng.sync()
    gerr = max(rel(a, r) for a, r in zip(gs, flat(s, rg)))
    werr = max(rel(a, r) for a, r in zip(flat(s, s.to_tree()), flat(s, params)))
    print(f"tiers device={tiers[0]} stream={tiers[1]}: loss {loss:.6f} ref {float(rl):.6f}, "
          f"max rel grad err {gerr:.2e}, weights after {steps} steps {werr:.2e}", flush=True)
    eng.close()
    worst = max(worst, gerr, werr)
  return worst


def attention_kernels(impls) -> None:
  """bf16 gradients per attention kernel against the fp32 reference (bf16 rounding, ~1e-2)."""
  import jax

  import reference as ref
  base = with_engine(compute_dtype="bfloat16", matmul_precision="default")
  s = store.create(base, jax.random.key(0))
  b = data.synthetic_batch(0, 4, 32, 128, 0)
  with jax.default_matmul_precision("highest"):
    rl, rg = jax.value_and_grad(ref.loss_fn)(s.to_tree(), b.inputs, b.targets, base.model)
  want = flat(s, rg)
  for impl in impls:
    eng = engine.Engine(with_engine(compute_dtype="bfloat16", matmul_precision="default",
                                    attention=impl), s)
    loss, gs = eng.grads(b)
    print(f"attention {impl}: loss {loss:.5f} (fp32 ref {float(rl):.5f}), max rel grad err "
          f"{max(rel(g, w) for g, w in zip(gs, want)):.2e}", flush=True)
    eng.close()


VARIANTS = {  # name: (B, T, N, K, H, Hv, window, sinks)
    "sinks": (2, 2048, 16, 4, 64, 64, None, True),
    "sinks-window": (2, 2048, 16, 4, 64, 64, 128, True),
    "mla-widths": (2, 2048, 8, 8, 192, 128, None, False),
}


def attention_variants(impl: str, seq: int = 2048) -> float:
  """The worst relative error of output and gradients (q, k, v, sinks) of each variant through
  `impl` (bf16) against the fp32 scores-whole reference; bf16 operands: under 2e-2."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from mtjax import attention
  from mtjax.models import layers
  worst = 0.0
  for name, (B, T, N, K, H, Hv, window, sinks) in VARIANTS.items():
    T = min(T, seq)
    rng = np.random.default_rng(len(name))
    q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in
               ((B, T, N, H), (B, T, K, H), (B, T, K, Hv)))
    s_N = jnp.asarray(rng.standard_normal(N), jnp.float32) if sinks else None
    ct = jnp.asarray(rng.standard_normal((B, T, N, Hv)), jnp.float32)
    args = (q, k, v) + ((s_N,) if sinks else ())

    def run(f, *a):
      y, pull = jax.vjp(f, *a)
      return (y, *pull(ct.astype(y.dtype)))

    def ours(q, k, v, *s):
      return layers.attend(q, k, v, None, implementation=impl, window=window,
                           sinks_N=s[0] if s else None)

    def ref(q, k, v, *s):
      return attention.dense_attention(q, k, v, causal=True, window=window,
                                       sinks_N=s[0] if s else None)
    got = jax.jit(lambda *a: run(ours, *a))(*(a.astype(jnp.bfloat16) if a.ndim == 4 else a
                                              for a in args))
    with jax.default_matmul_precision("highest"):
      want = jax.jit(lambda *a: run(ref, *a))(*args)
    errs = [rel(np.asarray(g, np.float32), np.asarray(w)) for g, w in zip(got, want, strict=True)]
    worst = max(worst, *errs)
    kernel = layers.layer_kernel(impl, seq=T, packed=False, sinks=sinks, same_widths=H == Hv)
    print(f"attention variant {name} ({kernel}): rel err out/dq/dk/dv" + ("/dsinks" if sinks else "")
          + " " + " ".join(f"{e:.1e}" for e in errs), flush=True)
  return worst


def host_rates(n: int) -> None:
  import jax
  import jax.numpy as jnp
  import numpy as np

  from mtjax.optimizer import HostOptimizer, UpdateRule
  lay = Layout.from_shapes({"w": jax.ShapeDtypeStruct((n // 1024, 1024), jnp.float32)})
  rng = np.random.default_rng(0)
  g = rng.standard_normal(n, dtype=np.float32)
  for name, impl in (("adamw", "fused"), ("adamw", "optax"), ("lion", "optax"), ("sgd", "optax")):
    ocfg = config.OptimConfig(name=name, impl=impl)
    rule = UpdateRule(ocfg, 100)
    grp = store.Group("w", "block", lay, "host", rng.standard_normal(n, dtype=np.float32),
                      rule.init_host(lay))
    view = lambda attr, grp=grp: grp.w if attr == "w" else grp.opt[attr]
    opt = HostOptimizer(ocfg, rule)
    opt.update(grp, g, 0, 1.0, view)
    ts = []
    for i in range(3):
      t = time.perf_counter()
      opt.update(grp, g, i + 1, 1.0, view)
      ts.append(time.perf_counter() - t)
    print(f"host update {name} ({impl}): {n / min(ts) / 1e9:.2f} Gparam/s "
          f"({n / 2**20:.0f}M params, best of 3)", flush=True)
    opt.close()


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python benchmarks/gpu_check.py", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--smoke", action="store_true", help="a reduced check on the CPU, in seconds")
  args = p.parse_args(argv)
  launch.plan_run(with_engine())  # before the backend starts: the pinned pool, the device share
  import jax
  if args.smoke:
    jax.config.update("jax_platforms", "cpu")
  dev = jax.devices()[0]
  print("jax", jax.__version__, dev, [m.kind for m in dev.addressable_memories()], flush=True)
  if args.smoke:  # one mix of all three tiers, two steps; the kernel the CPU lacks elsewhere
    worst = placements([(1, 2)], steps=2)  # step 0 has lr 0 (warm-up)
    attention_kernels(["blockwise"])
  else:
    worst = placements([(0, 0), (0, 5), (5, 0), (2, 2)])
    attention_kernels(["xla", "blockwise"] + (["cudnn"] if dev.platform == "gpu" else []))
  variants = attention_variants("cudnn" if dev.platform == "gpu" else "blockwise",
                                256 if args.smoke else 2048)
  host_rates(2**20 if args.smoke else 64 * 2**20)
  if variants > 2e-2:
    print(f"FAILED: an attention variant is {variants:.1e} from the fp32 reference (bf16 wants "
          f"< 2e-2)", file=sys.stderr)
    return 1
  if worst > 1e-5:
    print(f"FAILED: the engine is {worst:.1e} from the reference (fp32 wants < 1e-5)",
          file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
