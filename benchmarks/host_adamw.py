"""Host AdamW throughput under the conditions of a training step, to find what slows it there.

python3 benchmarks/host_adamw.py   (on the GPU machine)
"""
import concurrent.futures as cf
import os
import subprocess
import threading
import time

import jax
import numba
import numpy as np
from jax.sharding import SingleDeviceSharding

from mtjax import config, state as st
from mtjax.bench import machine_cpu
from mtjax.optimizer import HostOptimizer

print(f"cpus {os.cpu_count()}, numba threads {numba.config.NUMBA_NUM_THREADS}", flush=True)
print(subprocess.run("lscpu | grep -E 'Model name|Thread|Core|Socket|NUMA node\\(|L3'", shell=True,
                     capture_output=True, text=True).stdout, flush=True)
dev = jax.devices()[0]
pinned = SingleDeviceSharding(dev, memory_kind="pinned_host")
n = 113_264_640  # one block of the 3.37B shape
lay = st.Layout.from_shapes({"w": jax.ShapeDtypeStruct((n,), np.float32)})
rng = np.random.default_rng(0)
host = {k: rng.standard_normal(n, dtype=np.float32) for k in ("w", "g")}
host["m"] = np.zeros(n, np.float32)
host["v"] = np.zeros(n, np.float32)


def group(pin):
  bufs = {k: (jax.device_put(host[k], pinned).block_until_ready() if k in pin else host[k].copy())
          for k in ("w", "m", "v", "g")}
  grp = st.Group("x", "block", lay, bufs["w"], bufs["m"], bufs["v"])
  return grp, bufs["g"]


def rate(grp, g, opt, pool=None, reps=4):
  ts = []
  m0, t0 = machine_cpu(), time.perf_counter()
  for i in range(reps):
    t = time.perf_counter()
    if pool is None:
      opt.update(grp, g, i)
    else:
      pool.submit(opt.update, grp, g, i).result()
    ts.append(time.perf_counter() - t)
  wall = time.perf_counter() - t0
  cores = {k: (v - m0[k]) / wall for k, v in machine_cpu().items()}
  print(f"    {n / min(ts[1:]) / 1e9:.2f} Gparam/s (best), {n / np.median(ts[1:]) / 1e9:.2f} (median); "
        "cores busy by state: " + ", ".join(f"{k} {v:.1f}" for k, v in cores.items() if v >= 0.05))


opt = HostOptimizer(config.OptimConfig(), 100)
print("threading layer:", end=" ")
opt.update(*group(()), 0)
print(numba.threading_layer(), flush=True)
for pin in ((), ("w", "g"), ("w", "m", "v", "g")):
  print(f"  main thread, pinned {pin or 'none'}:")
  rate(*group(pin), opt)
grp, g = group(("w", "g"))
print("  worker thread (the engine's), pinned w g:")
rate(grp, g, opt, pool=opt._pool)
for threads in sorted({max(1, numba.config.NUMBA_NUM_THREADS // 2), max(1, 3 * numba.config.NUMBA_NUM_THREADS // 4)}):
  numba.set_num_threads(threads)
  print(f"  main thread, {threads} threads, pinned w g:")
  rate(grp, g, opt)
numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)

stop = threading.Event()
def traffic():
  x = jax.device_put(np.ones(2**28, np.float32), pinned)
  y = jax.device_put(x, SingleDeviceSharding(dev))
  while not stop.is_set():
    jax.block_until_ready((jax.device_put(x, SingleDeviceSharding(dev)), jax.device_put(y, pinned)))
t = threading.Thread(target=traffic)
t.start()
print("  main thread, pinned w g, with both-way 1 GiB copies running:")
rate(grp, g, opt)
stop.set()
t.join()

def matmuls():
  a = jax.device_put(np.ones((8192, 8192), np.float32), SingleDeviceSharding(dev)).astype(jax.numpy.bfloat16)
  f = jax.jit(lambda a: (a @ a) * 1e-4)
  while not stop.is_set():
    a = f(a).block_until_ready()
for name, target in (("bf16 matmuls on the device", matmuls), ("copies both ways", traffic)):
  stop.clear()
  t = threading.Thread(target=target)
  t.start()
  time.sleep(1)
  print(f"  worker thread (the engine's), pinned w g, with {name} running:")
  rate(grp, g, opt, pool=opt._pool, reps=8)
  stop.set()
  t.join()
try:
  import torch
  tw = [torch.from_numpy(host["w"].copy()).requires_grad_()]
  tw[0].grad = torch.from_numpy(host["g"])
  topt = torch.optim.AdamW(tw, lr=1e-3, fused=True)
  ts = []
  for _ in range(4):
    t0 = time.perf_counter(); topt.step(); ts.append(time.perf_counter() - t0)
  print(f"  torch fused AdamW (CPU, {torch.get_num_threads()} threads): {n / min(ts[1:]) / 1e9:.2f} Gparam/s")
except Exception as e:  # noqa: BLE001
  print("  torch:", e)
opt.close()
