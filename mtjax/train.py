"""`python -m mtjax.train --config FILE [key.path=value ...]`: train with host-resident state."""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import statistics
import sys
import time

import jax
from tqdm.auto import tqdm

from mtjax import config as config_lib
from mtjax import checkpoint, data, plan as plan_lib, state as state_lib
from mtjax.engine import Engine


def peak_rss_bytes() -> int:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def device_peak_bytes(device) -> int | None:
  stats = device.memory_stats() if hasattr(device, "memory_stats") else None
  return None if not stats else stats.get("peak_bytes_in_use")


def check_fits(cfg: config_lib.Config) -> plan_lib.Plan:
  """Plans the run and refuses (PlanError) one that cannot fit, before anything is allocated; caps
  the pinned host pool to what the run pins when the jax backend has not started yet."""
  plan = plan_lib.make(cfg, host_limit=plan_lib.host_memory_limit())  # assumes an accelerator
  plan_lib.configure_pinned_pool(plan)
  device = jax.devices()[0]
  plan = plan_lib.make(cfg, plan.host_limit, plan_lib.device_memory_limit(device),
                       plan_lib.Rates(accelerator=device.platform != "cpu"))
  plan_lib.check(plan)
  return plan


def run(cfg: config_lib.Config, progress: bool = True) -> dict:
  """Trains for cfg.train.steps steps and returns a summary of the run."""
  plan = check_fits(cfg)
  if cfg.engine.device_update_layers == "auto":  # the plan's choice, made within both limits
    cfg = dataclasses.replace(cfg, engine=dataclasses.replace(
        cfg.engine, device_update_layers=plan.device_update_layers))
  device = jax.devices()[0]
  init_key = jax.random.key(cfg.train.seed)  # the only key: data is seeded from train.seed by step
  t0 = time.perf_counter()
  st = state_lib.create(cfg.model, init_key, device)
  init_s = time.perf_counter() - t0
  tc = cfg.train
  resumed = checkpoint.latest(tc.checkpoint_dir) if tc.checkpoint_dir and tc.resume else None
  if resumed is not None:
    checkpoint.restore(st, resumed)
  engine = Engine(cfg, st, device)
  batches = data.batches(cfg.data, tc.batch, tc.seq, cfg.model.vocab_size, tc.seed,
                         start_step=st.step)
  losses, times = [], []
  bar = tqdm(range(st.step, tc.steps), desc="train", disable=not progress, dynamic_ncols=True)
  try:
    for i in bar:
      stats = engine.step(next(batches))
      losses.append(stats.loss)
      times.append(stats.step_s)
      if i % tc.log_every == 0 or i == tc.steps - 1:
        bar.set_postfix(loss=f"{stats.loss:.4f}", tok_s=f"{stats.tokens / stats.step_s:,.0f}",
                        step_s=f"{stats.step_s:.3f}", gnorm=f"{stats.grad_norm:.3f}")
      if tc.checkpoint_dir and tc.checkpoint_every and st.step % tc.checkpoint_every == 0:
        engine.sync()
        checkpoint.save(st, tc.checkpoint_dir)
    engine.sync()
    if tc.checkpoint_dir and losses:
      checkpoint.save(st, tc.checkpoint_dir)
  finally:
    engine.close()
  if not losses:
    raise ValueError(f"train.steps: {tc.steps} reached already by the checkpoint at step "
                     f"{st.step} ({resumed}); raise train.steps to train further")
  timed = times[1:] or times  # the first step includes compilation
  step_s = statistics.median(timed)
  tokens = cfg.train.batch * cfg.train.seq
  n = st.n_params
  summary = {
      "params": n,
      "steps": len(losses),
      "resumed_from": None if resumed is None else str(resumed),
      "first_loss": losses[0],
      "final_loss": losses[-1],
      "step_s_median": step_s,
      "tokens_per_s": tokens / step_s,
      "model_tflops": 6 * n * tokens / step_s / 1e12,
      "host_state_bytes_per_param": st.host_bytes() / n,
      "peak_rss_gib": peak_rss_bytes() / 2**30,
      "peak_rss_bytes_per_param": peak_rss_bytes() / n,
      "device_peak_gib": (lambda b: None if b is None else b / 2**30)(device_peak_bytes(device)),
      "init_s": init_s,
      "plan_host_gib": plan.host_total / 2**30,
      "plan_device_gib": plan.device_total / 2**30,
      "plan_step_s": plan.predicted_step_s,
      "plan_schedule_s": plan.schedule_s,
      "plan_schedule_best_s": plan.schedule_best_s,
      "device_update_layers": plan.device_update_layers,
      "device": str(device),
      "jax": jax.__version__,
  }
  return summary


def format_summary(s: dict) -> str:
  dev = "n/a" if s["device_peak_gib"] is None else f"{s['device_peak_gib']:.2f} GiB"
  return (f"{s['params'] / 1e6:,.1f}M params on {s['device']} | {s['steps']} steps | "
          f"loss {s['first_loss']:.4f} -> {s['final_loss']:.4f} | "
          f"{s['tokens_per_s']:,.0f} tokens/s, {s['step_s_median']:.3f} s/step (median after the "
          f"first), {s['model_tflops']:.2f} model TFLOP/s | host state "
          f"{s['host_state_bytes_per_param']:.2f} B/param, peak RSS {s['peak_rss_gib']:.2f} GiB | "
          f"device peak {dev} | plan: host {s['plan_host_gib']:.2f} GiB, device "
          f"{s['plan_device_gib']:.2f} GiB, step >= {s['plan_step_s']:.3f} s (schedule "
          f"{s['plan_schedule_best_s']:.3f}-{s['plan_schedule_s']:.3f} s, "
          f"{s['device_update_layers']} device-updated groups)")


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog="python -m mtjax.train", description=__doc__)
  p.add_argument("--json", help="also write the summary as JSON to this path")
  p.add_argument("--no-progress", action="store_true", help="no progress bar")
  args, cfg = config_lib.parse_cli(p, argv)
  try:
    summary = run(cfg, progress=not args.no_progress)
  except plan_lib.PlanError as e:
    print(f"refused: {e}", file=sys.stderr)
    return 2
  except (ValueError, FileNotFoundError) as e:  # bad data file, checkpoint, or nothing to do
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(format_summary(summary))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(summary, f, indent=2)
  return 0


if __name__ == "__main__":
  sys.exit(main())
