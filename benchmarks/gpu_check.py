"""One device call's first minute: the engine's correctness on the GPU in every placement, and the
host update rates of the fused AdamW and the general optax path.

PYTHONUNBUFFERED=1 python benchmarks/gpu_check.py
"""
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from mtjax import config, data, engine, plan, store  # noqa: E402
from mtjax.layout import Layout  # noqa: E402

base = config.from_dict({
    "model": dict(vocab_size=128, hidden=64, layers=3, heads=4, kv_heads=2, ffn=96,
                  qkv_bias=True),
    "engine": dict(compute_dtype="float32", loss_chunk=96, micro_batch=2,
                   matmul_precision="highest", device_state_layers=0,
                   device_update_layers=0),
    "optim": dict(lr=1e-2, warmup_steps=1, clip_norm=0.5),
    "train": dict(batch=4, seq=32, steps=3)})
plan.prepare(base)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import reference as ref  # noqa: E402
from mtjax.optimizer import HostOptimizer, UpdateRule, schedule  # noqa: E402

dev = jax.devices()[0]
print("jax", jax.__version__, dev, [m.kind for m in dev.addressable_memories()], flush=True)


def rel(a, b):
  return float(np.linalg.norm(np.asarray(a) - np.asarray(b)) / max(np.linalg.norm(b), 1e-30))


def flat(s, tree):
  return ([s.embed.layout.flatten(tree["embed"])]
          + [g.layout.flatten(t) for g, t in zip(s.blocks, tree["blocks"])]
          + [s.head.layout.flatten(tree["head"])])


# 1. streamed gradients and three clipped AdamW steps against the whole-model reference + optax,
#    in fp32 with true fp32 matmuls, for every tier mix.
for tiers in ((0, 0), (0, 5), (5, 0), (2, 2)):
  cfg = config.from_dict({**config.to_dict(base), "engine": {
      **config.to_dict(base)["engine"], "device_state_layers": tiers[0],
      "device_update_layers": tiers[1]}})
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
    st_ = tx.init(params)
    for i in range(3):
      bi = data.synthetic_batch(i, 4, 32, 128, 0)
      eng.step(bi)
      _, gi = vg(params, bi.inputs, bi.targets, cfg.model)
      up, st_ = tx.update(gi, st_, params)
      params = optax.apply_updates(params, up)
  eng.sync()
  gerr = max(rel(a, r) for a, r in zip(gs, flat(s, rg)))
  werr = max(rel(a, r) for a, r in zip(flat(s, s.to_tree()), flat(s, params)))
  print(f"tiers device={tiers[0]} stream={tiers[1]}: loss {loss:.6f} ref {float(rl):.6f}, "
        f"max rel grad err {gerr:.2e}, weights after 3 steps {werr:.2e}", flush=True)
  eng.close()

# 2. host update rates: the fused AdamW against the general optax path on XLA:CPU (64M params)
n = 64 * 2**20
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
  print(f"host update {name} ({impl}): {n / min(ts) / 1e9:.2f} Gparam/s (64M params, best of 3)",
        flush=True)
  opt.close()
