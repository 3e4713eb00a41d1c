"""GPU check: engine gradients with cuDNN flash attention vs the XLA path vs the fp32 reference."""
import os
import sys

import jax
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import reference as ref  # noqa: E402
from mtjax import config, data, engine, state as st  # noqa: E402

cfg0 = dict(model=dict(vocab_size=512, hidden=256, layers=2, heads=2, kv_heads=1, ffn=512),
            engine=dict(compute_dtype="bfloat16", micro_batch=2), train=dict(batch=4, seq=256))
s = st.create(config.from_dict(cfg0).model, jax.random.key(0))
b = data.synthetic_batch(0, 4, 256, 512, 0)
tree = s.to_tree()
with jax.default_matmul_precision("highest"):
  rl, rg = jax.value_and_grad(ref.loss_fn)(tree, b.inputs, b.targets, config.from_dict(cfg0).model)
want = ref.flat_grads(s, rg)
for impl in ("xla", "cudnn"):
  cfg = config.from_dict({**cfg0, "engine": {**cfg0["engine"], "attention": impl}})
  eng = engine.Engine(cfg, s)
  loss, gs = eng.grads(b)
  errs = [float(np.linalg.norm(g - w) / np.linalg.norm(w)) for g, w in zip(gs, want)]
  print(f"attention {impl}: loss {loss:.5f} (fp32 ref {float(rl):.5f}), max rel grad err "
        f"{max(errs):.2e}", flush=True)
  eng.close()
