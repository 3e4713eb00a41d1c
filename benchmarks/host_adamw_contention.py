"""Host AdamW with one busy thread beside it (a stand-in for the dispatching thread during a step):
a static split of the loop vs dynamically scheduled chunks (optim.chunk). Runs on any machine.

python benchmarks/host_adamw_contention.py
"""
import threading
import time

import jax
import numpy as np

from mtjax import config, state as st
from mtjax.optimizer import HostOptimizer

n = 32 * 2**20
lay = st.Layout.from_shapes({"w": jax.ShapeDtypeStruct((n,), np.float32)})
rng = np.random.default_rng(0)
g = rng.standard_normal(n, dtype=np.float32)
grp = st.Group("x", "block", lay, rng.standard_normal(n, dtype=np.float32), np.zeros(n, np.float32),
               np.zeros(n, np.float32))


def rate(opt):
  opt.update(grp, g, 0)
  ts = []
  for i in range(5):
    t = time.perf_counter()
    opt.update(grp, g, i + 1)
    ts.append(time.perf_counter() - t)
  return n / np.median(ts) / 1e9


def busy(stop):
  x = 0
  while not stop.is_set():
    x += 1


for chunk in (0, 2**16, 2**18, 2**20):
  opt = HostOptimizer(config.OptimConfig(chunk=chunk), 100)
  idle = rate(opt)
  stop = threading.Event()
  t = threading.Thread(target=busy, args=(stop,))
  t.start()
  loaded = rate(opt)
  stop.set()
  t.join()
  opt.close()
  print(f"optim.chunk={chunk:>8}: {idle:.2f} Gparam/s alone, {loaded:.2f} beside a busy thread")
