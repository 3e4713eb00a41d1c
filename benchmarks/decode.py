"""Decode speed of `mtjax.generate` with the bf16 weights in device memory, beside transformers'
`generate` on the same GPU, against the HBM-bandwidth roofline.

    python benchmarks/decode.py [--config configs/llama3_8b.yaml] [--prompt 128] [--new 128]
                                [--batches 1,64,256] [--systems mtjax,transformers] [--out FILE]

Random weights of the config's shape (speed does not depend on their values), prompts of --prompt
random tokens, --new tokens each, greedy. Each system runs in a process of its own (their weights
never share the GPU). A batch's decode rate is the new tokens after the first over their time:
generation with --new tokens minus generation with one (the prefill and the first token), so
neither side's compile or prefill counts. The roofline of a decode step is the bytes it must read
from HBM (every weight but the embedding table's unused rows, in bf16, and the KV cache of the
batch at its mean length, bf16) over the bandwidth of a device-to-device
copy measured in the same process. `--smoke` runs configs/tiny.yaml on the CPU in seconds.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def hbm_gbps() -> float:
  """A device-to-device copy of 1 GiB, read and written: bytes moved per second."""
  import jax
  import jax.numpy as jnp
  x = jnp.ones((2**28,), jnp.float32)
  copy = jax.jit(lambda a: a + 0)
  copy(x).block_until_ready()
  t0 = time.perf_counter()
  for _ in range(10):
    y = copy(x)
  y.block_until_ready()
  return 10 * 2 * x.nbytes / (time.perf_counter() - t0) / 1e9


def weight_bytes(cfg) -> int:
  """bf16 bytes a decode step reads: every parameter but the embedding table's (one row each)."""
  from mtjax import plan
  counts = plan.param_counts(cfg)
  read = counts["total"] - (0 if cfg.tie_embeddings else cfg.vocab_size * cfg.hidden)
  return 2 * read


def run_mtjax(cfg, args) -> list[dict]:
  import jax
  import jax.numpy as jnp
  import numpy as np
  from mtjax import models
  from mtjax.generate import generate
  spec = models.spec(cfg)
  keys = iter(jax.random.split(jax.random.key(0), len(spec.groups)))
  trees = []
  for _, kind in spec.groups:
    lay = spec.layouts[kind]
    flat = (jax.random.normal(next(keys), (lay.size,), jnp.float32) * 0.02).astype(jnp.bfloat16)
    trees.append(lay.unflatten(flat))
  params = {"embed": trees[0], "blocks": trees[1:-1], "head": trees[-1]}
  bw = hbm_gbps() if jax.devices()[0].platform != "cpu" else float("nan")
  rng = np.random.default_rng(0)
  out = []
  for B in args.batches:
    prompts = rng.integers(0, cfg.vocab_size, (B, args.prompt)).tolist()
    times = {}
    for n in (1, args.new, 1, args.new):  # the second pair, compiled by the first
      stats: dict = {}
      t0 = time.perf_counter()
      got = generate(cfg, params, prompts, max_new_tokens=n, dtype=jnp.bfloat16, stats=stats)
      times[n] = time.perf_counter() - t0
      assert all(len(g) == n for g in got)
    decode_s = times[args.new] - times[1]
    slots = args.prompt + args.new / 2  # the mean cache length of the decode steps
    cache = 2 * cfg.layers * cfg.n_kv_heads * cfg.dim_per_head * slots * B * 2  # bf16 cache
    step_bytes = weight_bytes(cfg) + cache
    step_s = decode_s / (args.new - 1)
    out.append(dict(system="mtjax", batch=B, decode_tokens_per_s=B * (args.new - 1) / decode_s,
                    step_ms=1e3 * step_s, roofline_ms=1e3 * step_bytes / (bw * 1e9),
                    hbm_gbps=bw, prefill_s=times[1]))
  return out


def run_transformers(cfg, args) -> list[dict]:
  import numpy as np
  import torch
  from deepspeed_baseline import hf_model
  torch.manual_seed(0)
  device = "cuda" if torch.cuda.is_available() else "cpu"
  torch.set_default_dtype(torch.bfloat16)
  with torch.device(device):  # built in place: no fp32 copy on the host first
    model = hf_model(cfg, args.prompt + args.new).eval()
  model.generation_config.pad_token_id = 0
  rng = np.random.default_rng(0)
  out = []
  for B in args.batches:
    ids = torch.from_numpy(rng.integers(0, cfg.vocab_size, (B, args.prompt))).to(device)
    times = {}
    for n in (1, args.new, 1, args.new):
      if device == "cuda":
        torch.cuda.synchronize()
      t0 = time.perf_counter()
      with torch.no_grad():
        got = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=n, min_new_tokens=n, use_cache=True)
      if device == "cuda":
        torch.cuda.synchronize()
      times[n] = time.perf_counter() - t0
      assert got.shape[1] == args.prompt + n
    decode_s = times[args.new] - times[1]
    out.append(dict(system="transformers", batch=B,
                    decode_tokens_per_s=B * (args.new - 1) / decode_s,
                    step_ms=1e3 * decode_s / (args.new - 1), prefill_s=times[1],
                    torch_version=torch.__version__))
  return out


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--config", default=str(ROOT / "configs" / "llama3_8b.yaml"))
  p.add_argument("--prompt", type=int, default=128)
  p.add_argument("--new", type=int, default=128)
  p.add_argument("--batches", default="1,64,256")
  p.add_argument("--systems", default="mtjax,transformers")
  p.add_argument("--out")
  p.add_argument("--smoke", action="store_true")
  p.add_argument("--one", help=argparse.SUPPRESS)  # the child process: one system, JSON out
  args = p.parse_args()
  args.batches = [int(b) for b in args.batches.split(",")]
  if args.smoke:
    args.config, args.prompt, args.new, args.batches = str(ROOT / "configs" / "tiny.yaml"), 8, 4, [1, 2]
  from mtjax import config
  cfg = config.load(args.config).model
  if args.one:
    rows = (run_mtjax if args.one == "mtjax" else run_transformers)(cfg, args)
    print("ROWS " + json.dumps(rows), flush=True)
    return 0
  rows = []
  for system in args.systems.split(","):
    cmd = [sys.executable, __file__, "--one", system, "--config", args.config, "--prompt",
           str(args.prompt), "--new", str(args.new), "--batches",
           ",".join(map(str, args.batches))]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                          env={**__import__("os").environ, "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.9",
                               "PYTHONPATH": f"{ROOT}:{ROOT / 'benchmarks'}"})
    found = [line for line in done.stdout.splitlines() if line.startswith("ROWS ")]
    if done.returncode or not found:
      print(f"{system} failed:\n{done.stderr[-3000:]}", file=sys.stderr)
      continue
    rows += json.loads(found[-1][5:])
  print(f"decode, {Path(args.config).name}, prompt {args.prompt}, {args.new} new tokens, greedy, "
        f"bf16 weights in device memory")
  print("| system | batch | decode tokens/s | ms a step | roofline ms (share) | prefill + first s |")
  print("| --- | --- | --- | --- | --- | --- |")
  for r in rows:
    roof = (f"{r['roofline_ms']:.2f} ({r['roofline_ms'] / r['step_ms']:.0%})"
            if r.get("roofline_ms") == r.get("roofline_ms") and "roofline_ms" in r else "-")
    print(f"| {r['system']} | {r['batch']} | {r['decode_tokens_per_s']:,.0f} | "
          f"{r['step_ms']:.2f} | {roof} | {r['prefill_s']:.2f} |")
  if args.out:
    Path(args.out).write_text(json.dumps(rows, indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
