"""Compose mtjax in your own loop: your data, your logging, the streamed step underneath.

python examples/custom_loop.py            (tiny shapes, CPU is fine)
"""
import numpy as np

from mtjax import config, data, engine, launch, store

cfg = config.from_dict({
    "model": {"vocab_size": 128, "hidden": 64, "layers": 3, "heads": 4, "kv_heads": 2, "ffn": 160},
    "optim": {"lr": 3e-3, "warmup_steps": 5, "clip_norm": 1.0},
    "engine": {"compute_dtype": "float32"},
    "train": {"steps": 30, "batch": 8, "seq": 32},
})
# Before anything touches jax: plan the run (caps the pinned host pool, sets the device memory it
# may use, places each layer group's state, refuses what cannot fit) and take the resolved config.
cfg, p = launch.plan_run(cfg)
import jax  # after plan_run, as the backend reads its settings when it starts

host = store.create(cfg, jax.random.key(0))  # fp32 weights + AdamW moments, placed by the plan
eng = engine.Engine(cfg, host)

# Gradients alone (no update), streamed layer by layer: one fp32 vector per layer, in host memory.
b = data.synthetic_batch(0, cfg.train.batch, cfg.train.seq, cfg.model.vocab_size, seed=1)
loss, grads = eng.grads(b)
print(f"loss {loss:.4f}; per-layer grad norms", [round(float(np.linalg.norm(g)), 4) for g in grads])

for step in range(cfg.train.steps):
  b = data.synthetic_batch(step, cfg.train.batch, cfg.train.seq, cfg.model.vocab_size, seed=1)
  stats = eng.step(b)
  if step % 10 == 0 or step == cfg.train.steps - 1:
    print(f"step {stats.step:3d} loss {stats.loss:.4f} |g| {stats.grad_norm:.3f} lr {stats.lr:.2e}")
eng.sync()  # the last updates run on the host optimizer thread; wait before reading weights
weights = host.to_tree()  # {'embed': ..., 'blocks': [...], 'head': ...} as numpy
print("q kernel of block 0:", weights["blocks"][0]["attn"]["q"]["kernel"].shape)
eng.close()
