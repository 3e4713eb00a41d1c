"""What does a vision-language fine-tune cost, its tower trained or frozen? The LLaVA-1.5-7B
shape (configs/llava_7b.yaml, mtjax's own init, the default placement) at 8 x 2048 tokens, each
row one image (576 image tokens, random pixels) and text: every train.freeze variant planned and
timed in one process, its step beside the plan's.

    python benchmarks/vlm.py [--config FILE] [--steps 5] [--variants none,vision,...] [--out FILE]
    python benchmarks/vlm.py --smoke      # a tiny tower and text model on the CPU, in seconds

Model TFLOP/s count the work each variant must do: the text model's 6 x parameters x tokens and
its causal attention (mtjax.plan.flops), and the tower's groups at 3 x their forward trained, 1 x
frozen (mtjax.models.vision.forward_flops; a frozen text model's blocks still pass the
cotangent: 4 of their 6).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

GiB = 2**30
SMOKE = ["model.vocab_size=256", "model.hidden=64", "model.layers=2", "model.heads=4",
         "model.kv_heads=2", "model.ffn=128", "model.vision.hidden=32", "model.vision.layers=2",
         "model.vision.heads=4", "model.vision.ffn=64", "model.vision.image_size=56",
         "model.vision.image_token_id=255", "train.batch=2", "train.seq=64",
         "engine.micro_batch=1", "engine.compute_dtype=float32"]


def batches(cfg, step: int):
  """Row r: its image's tokens first, then arithmetic text (data.synthetic_batch, kept off the
  image token); pixels standard normal, as a processor's normalised output."""
  from mtjax import data, models
  v, t = cfg.model.vision, cfg.train
  b = data.synthetic_batch(step, t.batch, t.seq, v.image_token_id, t.seed)
  inputs, targets = b.inputs.copy(), b.targets.copy()
  inputs[:, :v.image_tokens] = v.image_token_id
  rng = np.random.default_rng([t.seed, step])
  pixels = rng.standard_normal((t.batch, v.channels, v.image_size, v.image_size), np.float32)
  images, _ = models.vision.image_inputs(cfg.model, inputs, pixels)
  return data.Batch(inputs, targets, images=images)


def work_flops(cfg) -> float:
  """The FLOPs a step of this variant must do (see the module docstring)."""
  from mtjax import models, plan as plan_lib
  from mtjax.models import vision
  spec = models.spec(cfg.model)
  modes = spec.backward_modes(cfg.train.freeze)
  tokens = cfg.train.batch * cfg.train.seq
  text = plan_lib.flops(cfg)["with_attention"]
  tower_params = sum(spec.counts[k] for _, k in spec.groups if k in vision.KINDS)
  text -= 6 * tower_params * tokens  # plan.flops counts every parameter per text token
  if "language" in cfg.train.freeze:
    text *= 4 / 6
  factor = {"full": 3, "dx": 2, "pass": 1, "skip": 1}
  tower = sum(factor[mode] * vision.forward_flops(cfg.model, k, cfg.train.batch)
              for (_, k), mode in zip(spec.groups, modes) if k in vision.KINDS)
  return text + tower


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python benchmarks/vlm.py", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--config", default=str(ROOT / "configs" / "llava_7b.yaml"))
  p.add_argument("--variants", default="none,vision,vision+projector",
                 help="comma-separated train.freeze sets, parts joined by +; none: nothing frozen")
  p.add_argument("--warmup", type=int, default=2)
  p.add_argument("--steps", type=int, default=5)
  p.add_argument("--out")
  p.add_argument("--smoke", action="store_true")
  p.add_argument("overrides", nargs="*")
  args = p.parse_args(argv)
  if args.smoke:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    args.overrides = SMOKE + args.overrides
    args.warmup, args.steps = 1, 1

  from mtjax import cli, launch, plan as plan_lib
  import bench

  freezes = [() if v == "none" else tuple(v.split("+")) for v in args.variants.split(",")]
  cfgs = [cli.load_config(args.config, args.overrides + [f"train.freeze=[{','.join(f)}]"])
          for f in freezes]
  # the pinned pool is sized before the backend starts, for the variant that pins the most
  limit = launch.host_memory_limit()
  pinned = max(plan_lib.make(c, limit).pinned for c in cfgs)
  os.environ.setdefault("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB",
                        str(plan_lib.pinned_pool_bytes(pinned) // GiB + 1))
  import jax
  print(f"{jax.devices()[0]}; {cfgs[0].model.vision.image_tokens} image tokens a row, batch "
        f"{cfgs[0].train.batch} x {cfgs[0].train.seq}", flush=True)
  rows = []
  for f, cfg in zip(freezes, cfgs):
    cfg, plan = launch.plan_run(cfg)
    out, _ = bench.run_engine(cfg, lambda i, cfg=cfg: batches(cfg, i), args.warmup, args.steps)
    tokens = cfg.train.batch * cfg.train.seq
    row = {"freeze": list(f), "step_s": out["step_s"], "plan_s": plan.schedule_s,
           "tokens_per_s": tokens / out["step_s"],
           "model_tflops": work_flops(cfg) / out["step_s"] / 1e12,
           "params": plan.params, "tiers": "".join(t[0] for t in plan.tiers),
           "host_gib": sum(plan.host.values()) / GiB, "loss": out["loss"],
           "device": str(jax.devices()[0])}
    rows.append(row)
    print(json.dumps(row), flush=True)
  print(f"\n{'train.freeze':<22}{'step s':>8}{'plan s':>8}{'tokens/s':>10}{'TFLOP/s':>9}"
        f"{'host GiB':>10}")
  for r in rows:
    print(f"{'+'.join(r['freeze']) or 'none':<22}{r['step_s']:>8.3f}{r['plan_s']:>8.3f}"
          f"{r['tokens_per_s']:>10,.0f}{r['model_tflops']:>9.1f}{r['host_gib']:>10.1f}")
  if args.out:
    Path(args.out).write_text(json.dumps(rows, indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
