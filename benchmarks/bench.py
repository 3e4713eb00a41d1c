"""`python benchmarks/bench.py --config FILE [options] [key.path=value ...]`: side-by-side step timings.

Measures, in one process: the link and compute ceilings of this machine (bf16 matmul rate,
pinned host<->device bandwidth, host AdamW rate), then each system on the same shape:

  mtjax         the engine as configured
  mtjax-serial  the same engine with every overlap off (Engine(..., overlap=False))
  jax-all-gpu   plain JAX: whole model jitted, params + AdamW state on the GPU, per-block remat
  roofline      max(FLOPs / matmul rate, PCIe bytes / bandwidth, params / host AdamW rate)

prints a table and writes the records (a JSON list) to --out; --timeline draws one traced step.
`--smoke` runs every system on configs/tiny.yaml (one layer) on the CPU in seconds.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import gc
import json
import os
import queue
import statistics
import sys
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import SingleDeviceSharding

if __package__ in (None, ""):  # run as a script: the repository root holds mtjax
  sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mtjax import config as config_lib
from mtjax import cli, data, launch, models, plan as plan_lib, store as store_lib
from mtjax.layout import Layout
from mtjax.models.layers import token_nll
from mtjax.engine import Engine
from mtjax.programs import DTYPES, attention_impl
from mtjax.optimizer import HostOptimizer, UpdateRule, schedule
from mtjax.train import device_peak_bytes

GiB = 2**30


# ---- machine ceilings ---------------------------------------------------------------------------

def _median_time(fn, reps):
  ts = []
  for _ in range(reps):
    t = time.perf_counter()
    jax.block_until_ready(fn())
    ts.append(time.perf_counter() - t)
  return statistics.median(ts)


def matmul_tflops(device, n=8192, reps=10) -> float:
  k = jax.random.split(jax.random.key(0), 2)
  a = jax.device_put(jax.random.normal(k[0], (n, n), jnp.bfloat16), device)
  b = jax.device_put(jax.random.normal(k[1], (n, n), jnp.bfloat16), device)
  f = jax.jit(lambda a, b: a @ b)
  jax.block_until_ready(f(a, b))
  return 2 * n**3 / _median_time(lambda: f(a, b), reps) / 1e12


LINK_BYTES = 2 * GiB  # the link probe's buffer on the GPU


def link_gbps(device, nbytes=LINK_BYTES, reps=5) -> tuple[float, float]:
  """(host->device, device->host) GB/s between pinned host memory and the device."""
  kind = store_lib.host_memory_kind(device)
  if kind is None:
    return float("nan"), float("nan")
  host = SingleDeviceSharding(device, memory_kind=kind)
  dev = SingleDeviceSharding(device)
  x_host = jax.device_put(np.ones(nbytes // 4, np.float32), host)
  x_dev = jax.device_put(x_host, dev)
  jax.block_until_ready((x_host, x_dev))
  h2d = nbytes / _median_time(lambda: jax.device_put(x_host, dev), reps) / 1e9
  d2h = nbytes / _median_time(lambda: jax.device_put(x_dev, host), reps) / 1e9
  return h2d, d2h


def host_adamw_gparams(cfg: config_lib.OptimConfig, n: int, reps=3) -> float:
  """The host update's rate alone, in Gparam/s, on one n-element group."""
  lay = Layout.from_shapes({"w": jax.ShapeDtypeStruct((n, 1), jnp.float32)})
  rng = np.random.default_rng(0)
  rule = UpdateRule(cfg, 100)
  grp = store_lib.Group("probe", "block", lay, "host", rng.standard_normal(n, dtype=np.float32),
                        rule.init_host(lay))
  g = rng.standard_normal(n, dtype=np.float32)
  opt = HostOptimizer(cfg, rule)
  view = lambda attr: grp.w if attr == "w" else grp.opt[attr]
  opt.update(grp, g, 0, 1.0, view)
  best = min(_time_host(lambda i=i: opt.update(grp, g, i + 1, 1.0, view)) for i in range(reps))
  opt.close()
  return n / best / 1e9


def thread_cpu() -> dict[int, tuple[str, float, int]]:
  """{native thread id: (name, CPU seconds, minor page faults)} of this process (Linux /proc)."""
  out = {}
  tick = os.sysconf("SC_CLK_TCK")
  try:
    tids = os.listdir("/proc/self/task")
  except OSError:
    return out
  for tid in tids:
    try:
      with open(f"/proc/self/task/{tid}/stat") as f:
        s = f.read()
    except OSError:
      continue
    rest = s[s.rindex(")") + 2:].split()  # fields after the name: state, ppid, ...
    out[int(tid)] = (s[s.index("(") + 1:s.rindex(")")], (int(rest[11]) + int(rest[12])) / tick,
                     int(rest[7]))
  return out


def machine_cpu() -> dict[str, float]:
  """Core-seconds of the whole machine by state since boot (/proc/stat), steal included."""
  try:
    with open("/proc/stat") as f:
      fields = f.readline().split()[1:]
  except OSError:
    return {}
  names = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
  tick = os.sysconf("SC_CLK_TCK")
  return {n: int(v) / tick for n, v in zip(names, fields)}


def cpu_report(before, after, steps, labels) -> str:
  """CPU seconds per step by thread over an interval, busiest first, grouped by name."""
  groups = collections.defaultdict(lambda: [0, 0.0, 0])
  for tid, (name, cpu, faults) in after.items():
    _, cpu0, faults0 = before.get(tid, (name, 0.0, 0))
    g = groups[labels.get(tid, name)]
    g[0] += 1
    g[1] += (cpu - cpu0) / steps
    g[2] += (faults - faults0) / steps
  rows = sorted(groups.items(), key=lambda kv: -kv[1][1])
  return "; ".join(f"{name} x{n}: {cpu:.2f} s, {faults:,.0f} faults" for name, (n, cpu, faults)
                   in rows if cpu >= 0.01 or faults >= 1000)


def _time_host(fn):
  t = time.perf_counter()
  fn()
  return time.perf_counter() - t


# ---- work counts ----------------------------------------------------------------------------

def flops(cfg: config_lib.Config, attention: str) -> dict:
  """FLOPs of one step: `model` = 6 * params * tokens; `with_attention` adds attention's causal
  matmuls (mtjax.plan.flops); `hw` = what the engine executes (block forward twice: once
  forward, once re-materialised in the backward; attention included, masked half too for XLA's)."""
  m, t = cfg.model, cfg.train
  tokens = t.batch * t.seq
  spec = models.spec(m)
  work = plan_lib.flops(cfg)
  # the matrices a token multiplies by (a mixture's chosen experts), block by block
  block_matmul = sum(spec.matmul_params(kind) for _, kind in spec.groups[1:-1])
  head_matmul = m.hidden * m.vocab_size
  # flash kernels skip the masked half
  attn_fwd = spec.attention_forward_flops(t.batch, t.seq,
                                          causal_half=attention in ("cudnn", "blockwise"))
  hw = 8 * block_matmul * tokens + 4 * attn_fwd + 6 * head_matmul * tokens
  return {"model": work["model"], "with_attention": work["with_attention"], "hw": hw,
          "params": spec.counts["total"], "active": spec.counts["active"], "tokens": tokens}


# ---- systems --------------------------------------------------------------------------------

def run_engine(cfg, batches, warmup, steps, trace_path=None, overlap=True):
  """Times one engine configuration on a store of its own placement (the same seed: same weights)."""
  st = store_lib.create(cfg, jax.random.key(cfg.train.seed))
  eng = Engine(cfg, st, overlap)
  for i in range(warmup):
    eng.step(batches(i))
  eng.sync()
  st.host_opt.log = []
  times, opt_wait = [], []
  labels = {threading.get_native_id(): "main", st.host_opt.worker_thread_id(): "optimizer worker"}
  cpu0, machine0 = thread_cpu(), machine_cpu()
  for i in range(steps):
    s = eng.step(batches(warmup + i))
    times.append(s.step_s)
    opt_wait.append(s.opt_wait_s)
  eng.sync()
  cpu = cpu_report(cpu0, thread_cpu(), steps, labels)
  machine = {k: (v - machine0[k]) / steps for k, v in machine_cpu().items()}
  cpu += "; machine: " + ", ".join(f"{k} {v:.2f}" for k, v in machine.items() if v >= 0.005)
  log = st.host_opt.log
  opt_busy = sum(e - s for _, s, e in log) / steps
  size = {g.name: g.size for g in st.groups}
  opt_params = sum(size[name] for name, _, _ in log) / steps  # host-updated parameters per step
  timeline = None
  if trace_path is not None:
    tracer = Tracer()
    eng.observer, st.host_opt.log = tracer.issued, []
    t0 = time.perf_counter()
    eng.step(batches(warmup + steps))
    eng.sync()
    tracer.close()
    timeline = tracer.events, st.host_opt.log, t0, time.perf_counter()
    eng.observer = None
  allocated = st.allocated_bytes()
  names = [g.name for g in st.groups]
  eng.close()
  del eng, st
  gc.collect()  # the store's pinned buffers go back to the pool before the next system's store
  return {"step_s": statistics.median(times), "opt_wait_s": statistics.median(opt_wait),
          "opt_busy_s": opt_busy, "opt_params": opt_params, "loss": s.loss, "cpu": cpu,
          "allocated": allocated, "names": names}, timeline


def device_compute_s(cfg, batch, reps=3) -> float:
  """Forward + backward through the same compiled layers with every group's weights in device
  memory (nothing crosses the link): the time the GPU needs for its own work, so 1 - this /
  step_s is its idle share. The groups are device-tier with a stateless optimizer (plain SGD, no
  update is made): weights only, 4 B/param."""
  G = cfg.model.layers + 2
  st = store_lib.create(cfg, jax.random.key(cfg.train.seed), ["device"] * G, tx=optax.sgd(0.0))
  eng = Engine(cfg, st)

  def once():
    sink = []
    eng.forward_backward(batch, lambda i, g, s: sink.append(s))
    return sink
  jax.block_until_ready(once())
  t = _median_time(once, reps)
  eng.close()
  return t


def all_gpu_step(cfg: config_lib.Config, lays, attention: str):
  """Plain JAX baseline: the whole model in one jit, fp32 params + AdamW on the device,
  bf16 compute, each block re-materialised in the backward (jax.checkpoint), blocks scanned."""
  m = cfg.model
  spec = models.spec(m)
  cd = DTYPES[cfg.engine.compute_dtype]
  kinds = [kind for _, kind in spec.groups[1:-1]]
  blocks = {k: spec.block(k, attention) for k in set(kinds)}
  embed, head = spec.embed(cd), spec.head()

  def loss_fn(params, tokens, targets):
    x = embed.apply({"params": lays["embed"].unflatten(params["embed"])}, tokens)
    table = params["embed"].astype(cd).reshape(m.vocab_size, m.hidden)

    one = {k: jax.checkpoint(lambda x, wb, k=k: blocks[k].apply(
        {"params": lays[k].unflatten(wb.astype(cd))}, x)[0]) for k in blocks}
    if len(blocks) == 1:  # one kind: the blocks scanned, one compiled body
      x, _ = jax.lax.scan(lambda x, wb: (one[kinds[0]](x, wb), None), x, params["blocks"])
    else:
      for i, kind in enumerate(kinds):
        x = one[kind](x, params["blocks"][i])
    hp = lays["head"].unflatten(params["head"].astype(cd))
    logits = head.apply({"params": hp}, x, table if m.tie_embeddings else None)
    return jnp.mean(token_nll(logits.reshape(-1, m.vocab_size), targets.reshape(-1)))

  o = cfg.optim
  tx = optax.adamw(schedule(o, cfg.decay_steps), b1=o.b1, b2=o.b2, eps=o.eps,
                   weight_decay=o.weight_decay)

  def step(params, opt_state, tokens, targets):
    loss, g = jax.value_and_grad(loss_fn)(params, tokens, targets)
    updates, opt_state = tx.update(g, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return tx, jax.jit(step, donate_argnums=(0, 1))


def run_all_gpu(cfg, batches, warmup, steps, attention):
  st = store_lib.create(cfg, jax.random.key(cfg.train.seed), ["device"] * (cfg.model.layers + 2))
  w = [st.groups[i].w for i in range(len(st.groups))]
  one_kind = len(st.spec.kinds) == 1
  params = {"embed": w[0], "blocks": jnp.stack(w[1:-1]) if one_kind else w[1:-1], "head": w[-1]}
  lays = st.layouts
  st.close()
  del st, w
  tx, step = all_gpu_step(cfg, lays, attention)
  opt_state = jax.jit(tx.init)(params)
  times = []
  for i in range(warmup + steps):
    b = batches(i)
    t = time.perf_counter()
    params, opt_state, loss = step(params, opt_state, b.inputs, b.targets)
    loss = float(loss)
    if i >= warmup:
      times.append(time.perf_counter() - t)
  del params, opt_state
  return {"step_s": statistics.median(times), "loss": loss}


# ---- timeline -------------------------------------------------------------------------------

class Tracer:
  """Records when each traced copy / kernel finishes: one watcher thread per lane blocks on the
  lane's arrays in issue order (each lane is one in-order stream on the device)."""

  def __init__(self):
    self.events = []  # (lane, group, phase, issued, done)
    self._queues = {lane: queue.Queue() for lane in ("h2d", "compute", "d2h")}
    self._threads = [threading.Thread(target=self._watch, args=(lane, q), daemon=True)
                     for lane, q in self._queues.items()]
    for t in self._threads:
      t.start()

  def issued(self, lane, idx, phase, arr):
    self._queues[lane].put((idx, phase, time.perf_counter(), arr))

  def _watch(self, lane, q):
    while (item := q.get()) is not None:
      idx, phase, t_issue, arr = item
      try:
        jax.block_until_ready(arr)
      except jax.errors.JaxRuntimeError:
        # Donated to a later kernel (the device update takes w, m and v) before this thread got to
        # it: its own completion time is lost, so it is drawn as done when noticed.
        if not arr.is_deleted():
          raise
      self.events.append((lane, idx, phase, t_issue, time.perf_counter()))

  def close(self):
    for q in self._queues.values():
      q.put(None)
    for t in self._threads:
      t.join()


def lanes(events, opt_log, names) -> dict[str, list[tuple[float, float, str, str]]]:
  """Busy intervals per lane. An item starts once it was issued, its lane was free and its input
  existed (a kernel's weights had arrived; a gradient's kernel had finished); it ends when seen done."""
  out = {"h2d": [], "compute": [], "d2h": [], "host optimizer": []}
  done = {"h2d": {}, "compute": {}}
  for lane, dep in (("h2d", None), ("compute", "h2d"), ("d2h", "compute")):
    free = 0.0
    for _, idx, phase, t_issue, t_done in sorted((e for e in events if e[0] == lane),
                                                 key=lambda e: e[3]):
      start = max(t_issue, free)
      if dep is not None:
        start = max(start, done[dep].get(idx, start) if dep == "compute"
                    else done[dep].get((idx, phase), start))
      start = min(start, t_done)
      out[lane].append((start, t_done, str(idx), phase))
      free = t_done
      if lane == "h2d":
        done["h2d"][(idx, phase)] = t_done
      elif lane == "compute":
        done["compute"][idx] = t_done
  index = {n: i for i, n in enumerate(names)}
  out["host optimizer"] = [(s, e, str(index.get(n, n)), "bwd") for n, s, e in opt_log]
  return out


def draw_timeline(path, lane_map, t0, t1, title):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(16, 3.8))
  colors = {"fwd": "#4c72b0", "bwd": "#dd8452"}
  names = list(lane_map)
  for row, lane in enumerate(names):
    for s, e, label, phase in lane_map[lane]:
      ax.barh(row, (e - s) * 1e3, left=(s - t0) * 1e3, height=0.6, color=colors[phase],
              edgecolor="black", linewidth=0.3)
      if (e - s) / max(t1 - t0, 1e-9) > 0.012:
        ax.text((s + e) / 2 * 1e3 - t0 * 1e3, row, label, ha="center", va="center", fontsize=6)
  ax.set_yticks(range(len(names)), names)
  ax.invert_yaxis()
  ax.set_xlabel("ms since the step began (blue: forward, orange: backward; labels: layer group)")
  ax.set_title(title)
  ax.set_xlim(0, (t1 - t0) * 1e3)
  fig.tight_layout()
  fig.savefig(path, dpi=130)
  plt.close(fig)


def with_documents(cfg: config_lib.Config, docs: int) -> config_lib.Config:
  """The config as the planner must see it when the synthetic rows carry `docs` documents: as
  prepared data, whose batches carry document ids (the attention's mask and its cost)."""
  if docs <= 1:
    return cfg
  return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, source="prepared",
                                                           path="(synthetic rows, --docs)"))


def packed(b: data.Batch, docs: int, step: int) -> data.Batch:
  """The batch with `docs` documents of random lengths per row: segment ids 1..docs and RoPE
  positions restarting at each document, as `mtjax.data prepare` packs them."""
  if docs <= 1:
    return b
  B, T = b.inputs.shape
  rng = np.random.default_rng([step, docs])
  seg = np.empty((B, T), np.int32)
  pos = np.empty((B, T), np.int32)
  for r in range(B):
    starts = np.concatenate([[0], np.sort(rng.choice(np.arange(1, T), docs - 1, replace=False))])
    seg[r] = np.searchsorted(starts, np.arange(T), side="right")
    pos[r] = np.arange(T) - starts[seg[r] - 1]
  return dataclasses.replace(b, positions=pos, segments=seg)


# ---- main -----------------------------------------------------------------------------------

SMOKE = ["--config", str(Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml"),
         "--warmup", "1", "--steps", "1", "--variant", "dev:engine.device_update_layers=auto"]


def main(argv=None):
  argv = sys.argv[1:] if argv is None else list(argv)
  if "--smoke" in argv:  # tiny shapes on the CPU; later arguments override these
    jax.config.update("jax_platforms", "cpu")
    argv.remove("--smoke")
    argv = SMOKE + argv + ["model.layers=1"]
  p = argparse.ArgumentParser(prog="python benchmarks/bench.py", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--systems", default="mtjax,mtjax-serial,jax-all-gpu,roofline")
  p.add_argument("--warmup", type=int, default=2)
  p.add_argument("--steps", type=int, default=5)
  p.add_argument("--out", help="append records to this JSON list")
  p.add_argument("--timeline", help="PNG of one traced mtjax step (variants: PNG stem + _NAME)")
  p.add_argument("--smoke", action="store_true",
                 help="every system on configs/tiny.yaml, one layer, on the CPU, in seconds")
  p.add_argument("--no-idle", action="store_true",
                 help="skip the GPU-idle column (it times the layers again with every weight "
                      "resident: one more model's weights in device memory)")
  p.add_argument("--docs", type=int, default=0,
                 help="pack each synthetic row with this many documents of random lengths (segment "
                      "ids and positions as prepared data carries them; the mtjax systems only)")
  p.add_argument("--variant", action="append", default=[], metavar="NAME:KEY=VALUE[ KEY=VALUE...]",
                 help="also time the engine with these overrides, as system mtjax:NAME")
  args, cfg = cli.parse_cli(p, argv)
  systems = args.systems.split(",")
  unknown = set(systems) - {"mtjax", "mtjax-serial", "jax-all-gpu", "roofline"}
  if unknown:
    print(f"--systems: unknown {sorted(unknown)}", file=sys.stderr)
    return 2
  variants = {}
  for v in args.variant:
    name, _, ovs = v.partition(":")
    try:
      variants["mtjax:" + name] = cli.load_config(args.config, args.overrides + ovs.split())
    except config_lib.ConfigError as e:
      print(f"--variant {name}: {e}", file=sys.stderr)
      return 2
    c = variants["mtjax:" + name]
    if c.model != cfg.model or (c.train.batch, c.train.seq) != (cfg.train.batch, cfg.train.seq):
      print(f"--variant {name}: changes the model or the batch shape; variants compare settings "
            f"of one shape (run the other shape as a bench of its own)", file=sys.stderr)
      return 2
  cfg, variants = with_documents(cfg, args.docs), {k: with_documents(c, args.docs)
                                                    for k, c in variants.items()}
  # Every variant is planned once; the first plan sets the pinned pool before the backend starts,
  # so it is made for the variant that pins the most.
  pinned = max(plan_lib.make(c, launch.host_memory_limit()).pinned
               for c in [cfg, *variants.values()])
  # The link probe pins two buffers of its own beside what the runs pin.
  os.environ.setdefault("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB",
                        str(plan_lib.pinned_pool_bytes(pinned + 2 * LINK_BYTES) // GiB))
  first = max([cfg, *variants.values()], key=lambda c: plan_lib.make(
      c, launch.host_memory_limit()).pinned)
  launch.plan_run(first)
  prepared = {None: launch.plan_run(cfg)}
  prepared.update({k: launch.plan_run(c) for k, c in variants.items()})
  resolved = {k: c for k, (c, _) in prepared.items()}
  plans = {k: p for k, (_, p) in prepared.items()}
  if variants:
    i = systems.index("mtjax") + 1 if "mtjax" in systems else 0
    systems[i:i] = list(variants)
  dev = jax.devices()[0]
  attention = attention_impl(cfg.engine.attention, dev, cfg.engine.compute_dtype, cfg.model,
                             cfg.train.seq)
  work = flops(cfg, attention)
  print(f"{cfg.model.layers} layers x {cfg.model.hidden} hidden, {work['params'] / 1e9:.2f}B params, "
        f"batch {cfg.train.batch} x seq {cfg.train.seq}, attention {attention}, {dev}", flush=True)

  small = dev.platform == "cpu"  # the ceilings at GPU sizes would take minutes on a CPU
  mm = matmul_tflops(dev, n=512 if small else 8192)
  h2d, d2h = link_gbps(dev, nbytes=16 * 2**20 if small else LINK_BYTES)
  block_size = max(models.spec(cfg.model).counts[k] for k in models.spec(cfg.model).kinds)
  opt_rate = host_adamw_gparams(cfg.optim, max(block_size, 2**20))
  print(f"ceilings: bf16 matmul {mm:.0f} TFLOP/s, H2D {h2d:.1f} GB/s, D2H {d2h:.1f} GB/s, "
        f"host AdamW {opt_rate:.2f} Gparam/s", flush=True)

  n = work["params"]
  batches = lambda i: packed(data.synthetic_batch(i, cfg.train.batch, cfg.train.seq,
                                                  cfg.model.vocab_size, cfg.train.seed),
                             args.docs, i)
  if args.docs and "jax-all-gpu" in systems:
    systems.remove("jax-all-gpu")
    print("jax-all-gpu: skipped (it takes no document mask)")
  # The roofline is the planner's, with this machine's rates measured above.
  measured = plan_lib.Rates(matmul_tflops=mm, h2d_gbps=h2d, d2h_gbps=d2h,
                            host_adamw_gparams=opt_rate)
  roof = plan_lib.make(resolved[None], rates=measured).step_s
  roofline_s = max(roof.values())
  base = {"params": n, "hidden": cfg.model.hidden, "layers": cfg.model.layers,
          "batch": cfg.train.batch, "seq": cfg.train.seq, "h2d_gbps": h2d, "d2h_gbps": d2h,
          "host_opt_gparams_per_s": opt_rate, "roofline_s": roofline_s, "matmul_tflops": mm,
          "attention": attention, "docs_per_row": args.docs, "jax_version": jax.__version__, "device": str(dev)}

  def record(system, step_s, **kw):
    r = dict(system=system, **base, step_s=step_s, tokens_per_s=work["tokens"] / step_s,
             model_tflops=work["model"] / step_s / 1e12, hw_tflops=work["hw"] / step_s / 1e12,
             tflops_with_attention=work["with_attention"] / step_s / 1e12)
    r["ceiling_frac_with_attention"] = r["tflops_with_attention"] / mm
    r.update(kw)
    return r


  records, timelines, names = [], {}, []
  for system in systems:
    if system in ("mtjax", "mtjax-serial") or system in variants:
      c = resolved.get(system, resolved[None])
      r, tl = run_engine(c, batches, args.warmup, args.steps,
                         args.timeline if system != "mtjax-serial" else None,
                         overlap=system != "mtjax-serial")
      names = r["names"]
      if tl is not None:
        timelines[system] = tl
      print(f"  {system}: CPU per step by thread: {r['cpu']}", flush=True)
      peak = device_peak_bytes(dev)  # the process's peak so far, before the idle probe's own
      compute_s = (device_compute_s(c, batches(0))
                   if system != "mtjax-serial" and not args.no_idle else None)
      # This configuration's own lower bound (its placement moves work between host and link).
      own_roofline = plan_lib.make(c, rates=measured).roofline_s
      allocated = r["allocated"]
      records.append(record(
          system, r["step_s"], host_bytes_per_param=(allocated["host"] + allocated["pinned"]) / n,
          device_state_bytes_per_param=allocated["device"] / n,
          device_peak_gib=None if peak is None else peak / GiB,
          gpu_idle_frac=None if compute_s is None else max(0.0, 1 - compute_s / r["step_s"]),
          device_compute_s=compute_s, opt_busy_s=r["opt_busy_s"], opt_wait_s=r["opt_wait_s"],
          achieved_opt_gparams_per_s=(r["opt_params"] / r["opt_busy_s"] / 1e9
                                      if r["opt_busy_s"] else None),
          loss=r["loss"], device_update_layers=c.engine.device_update_layers,
          device_state_layers=c.engine.device_state_layers,
          device_memory_gb=c.engine.device_memory_gb, optim_threads=c.optim.threads,
          devices=c.engine.devices,
          cpu_by_thread=r["cpu"], own_roofline_s=own_roofline,
          # The planner's simulated step with the machine's rates it plans with, as a run prints.
          plan_schedule_s=plans.get(system, plans[None]).schedule_s,
          plan_schedule_best_s=plans.get(system, plans[None]).schedule_best_s))
    elif system == "jax-all-gpu":
      try:
        r = run_all_gpu(resolved[None], batches, args.warmup, args.steps, attention)
        records.append(record(system, r["step_s"], host_bytes_per_param=0.0,
                              device_peak_gib=(device_peak_bytes(dev) or 0) / GiB, loss=r["loss"]))
      except Exception as e:  # noqa: BLE001 - a shape that does not fit is a result, not a crash
        print(f"jax-all-gpu: did not run ({type(e).__name__}: {str(e).splitlines()[0][:200]})")
    elif system == "roofline":
      records.append(record(system, roofline_s, **{f"roofline_{k}_s": v for k, v in roof.items()}))
    print(f"  {records[-1]['system'] if records else system}: done", flush=True)

  # Scaling efficiency of a run on N > 1 devices: tokens/s on N / (N x tokens/s of one device),
  # the one-device figure from the first mtjax row that ran on one device with the same batch.
  one = next((r for r in records if r.get("devices") == 1), None)
  for r in records:
    if one is not None and (r.get("devices") or 1) > 1:
      r["scaling_efficiency"] = r["tokens_per_s"] / (r["devices"] * one["tokens_per_s"])
  print()
  hdr = (f"{'system':<20}{'devs':>5}{'step s':>9}{'tokens/s':>11}{'model TF':>10}{'+attn TF':>10}"
         f"{'of ceil':>9}{'hw TF':>8}{'GPU idle':>10}{'dev GiB':>9}{'opt Gp/s':>10}"
         f"{'own roof':>10}{'plan':>8}{'scaling':>9}")
  print(hdr)
  for r in records:
    idle = r.get("gpu_idle_frac")
    peak = r.get("device_peak_gib")
    opt = r.get("achieved_opt_gparams_per_s")
    own = r.get("own_roofline_s")
    eff = r.get("scaling_efficiency")
    sched = r.get("plan_schedule_s")
    print(f"{r['system']:<20}{r.get('devices') or '':>5}{r['step_s']:>9.3f}"
          f"{r['tokens_per_s']:>11,.0f}{r['model_tflops']:>10.1f}"
          f"{r['tflops_with_attention']:>10.1f}{r['ceiling_frac_with_attention']:>9.1%}"
          f"{r['hw_tflops']:>8.1f}{'' if idle is None else f'{idle:.1%}':>10}"
          f"{'' if peak is None else f'{peak:.1f}':>9}{'' if not opt else f'{opt:.2f}':>10}"
          f"{'' if own is None else f'{own:.3f}':>10}{'' if sched is None else f'{sched:.3f}':>8}"
          f"{'' if eff is None else f'{eff:.0%}':>9}")
  print("roofline terms (s): " + ", ".join(f"{k} {v:.3f}" for k, v in roof.items()))

  if args.out:
    path = Path(args.out)
    old = json.loads(path.read_text()) if path.exists() else []
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(old + records, indent=1))
  for system, (events, opt_log, t0, t1) in timelines.items():
    path = Path(args.timeline)
    if system != "mtjax":  # variants: name_VARIANT.png beside the main one
      path = path.with_name(f"{path.stem}_{system.partition(':')[2]}{path.suffix}")
    draw_timeline(path, lanes(events, opt_log, names), t0, t1,
                  f"{system} step, {work['params'] / 1e9:.2f}B params, batch {cfg.train.batch} x "
                  f"{cfg.train.seq}: {t1 - t0:.3f} s")
  return 0


if __name__ == "__main__":
  sys.exit(main())
