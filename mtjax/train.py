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
from mtjax import checkpoint, data, hf, plan as plan_lib, store as store_lib
from mtjax.engine import Engine


def peak_rss_bytes() -> int:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def device_peak_bytes(device) -> int | None:
  stats = device.memory_stats() if hasattr(device, "memory_stats") else None
  return None if not stats else stats.get("peak_bytes_in_use")


def run(cfg: config_lib.Config, progress: bool = True, on_plan=None) -> dict:
  """Trains for cfg.train.steps steps and returns a summary of the run; `on_plan(plan)` is called
  once the run is planned, before anything is allocated."""
  cfg, plan = plan_lib.prepare(cfg)  # refuses a run that cannot fit, before any allocation
  if on_plan is not None:
    on_plan(plan)
  device = jax.devices()[0]
  init_key = jax.random.key(cfg.train.seed)  # the only key: data is seeded from train.seed by step
  t0 = time.perf_counter()
  store = store_lib.create(cfg, init_key)
  init_s = time.perf_counter() - t0
  tc = cfg.train
  resumed = None
  if tc.checkpoint_dir and tc.resume:
    resumed, _, skipped = checkpoint.restore_latest(store, tc.checkpoint_dir)
    for line in skipped:
      print(f"checkpoint: {line}", file=sys.stderr)
  if resumed is None and cfg.model.from_hf:
    hf.load_into(store, cfg.model.from_hf)
  engine = Engine(cfg, store)
  src = data.source(cfg.data, tc.batch, tc.seq, cfg.model.vocab_size, tc.seed)

  def meta():  # kept with every checkpoint: export reads the config, a resume the data position
    return {"config": config_lib.to_dict(cfg), "data_position": src.position(store.step)}

  def held_out():
    it = data.validation_batches(cfg.data, tc.batch, tc.seq, cfg.model.vocab_size)
    return engine.evaluate(b for _, b in zip(range(tc.eval_batches), it))

  losses, times, evals = [], [], []
  bar = tqdm(range(store.step, tc.steps), desc="train", disable=not progress, dynamic_ncols=True)
  try:
    for i in bar:
      stats = engine.step(src.batch(i))
      losses.append(stats.loss)
      times.append(stats.step_s)
      if tc.eval_every and (store.step % tc.eval_every == 0 or store.step == tc.steps):
        evals.append((store.step, held_out()))
        bar.set_postfix_str(f"held-out loss {evals[-1][1]:.4f}", refresh=False)
      if i % tc.log_every == 0 or i == tc.steps - 1:
        bar.set_postfix(loss=f"{stats.loss:.4f}", tok_s=f"{stats.tokens / stats.step_s:,.0f}",
                        step_s=f"{stats.step_s:.3f}", gnorm=f"{stats.grad_norm:.3f}")
      if tc.checkpoint_dir and tc.checkpoint_every and store.step % tc.checkpoint_every == 0:
        engine.sync()
        checkpoint.save(store, tc.checkpoint_dir, meta())
    engine.sync()
    if tc.checkpoint_dir and losses:
      checkpoint.save(store, tc.checkpoint_dir, meta())
    if tc.export_dir and losses:
      hf.export_store(store, tc.export_dir, tc.export_dtype, cfg.model.from_hf)
  finally:
    engine.close()
  if not losses:
    raise ValueError(f"train.steps: {tc.steps} reached already by the checkpoint at step "
                     f"{store.step} ({resumed}); raise train.steps to train further")
  timed = times[1:] or times  # the first step includes compilation
  step_s = statistics.median(timed)
  tokens = cfg.train.batch * cfg.train.seq
  n = store.n_params
  allocated = store.allocated_bytes()
  summary = {
      "params": n,
      "steps": len(losses),
      "resumed_from": None if resumed is None else str(resumed),
      "first_loss": losses[0],
      "final_loss": losses[-1],
      "held_out": evals,  # (step, loss) of each evaluation
      "step_s_median": step_s,
      "tokens_per_s": tokens / step_s,
      "model_tflops": 6 * n * tokens / step_s / 1e12,
      "state_bytes_per_param": sum(allocated.values()) / n,
      "state_host_gib": (allocated["host"] + allocated["pinned"]) / 2**30,
      "state_device_gib": allocated["device"] / 2**30,
      "peak_rss_gib": peak_rss_bytes() / 2**30,
      "peak_rss_bytes_per_param": peak_rss_bytes() / n,
      "device_peak_gib": (lambda b: None if b is None else b / 2**30)(device_peak_bytes(device)),
      "init_s": init_s,
      "plan_host_gib": plan.host_total / 2**30,
      "plan_device_gib": plan.device_total / 2**30,
      "plan_step_s": plan.predicted_step_s,
      "plan_schedule_s": plan.schedule_s,
      "plan_schedule_best_s": plan.schedule_best_s,
      "device_state_layers": plan.device_state_layers,
      "device_update_layers": plan.device_update_layers,
      "device": str(device),
      "jax": jax.__version__,
  }
  return summary


def format_summary(s: dict) -> str:
  dev = "n/a" if s["device_peak_gib"] is None else f"{s['device_peak_gib']:.2f} GiB"
  held = (f" (held-out {s['held_out'][0][1]:.4f} -> {s['held_out'][-1][1]:.4f})"
          if s["held_out"] else "")
  return (f"{s['params'] / 1e6:,.1f}M params on {s['device']} | {s['steps']} steps | "
          f"loss {s['first_loss']:.4f} -> {s['final_loss']:.4f}{held} | "
          f"{s['tokens_per_s']:,.0f} tokens/s, {s['step_s_median']:.3f} s/step (median after the "
          f"first), {s['model_tflops']:.2f} model TFLOP/s | state "
          f"{s['state_bytes_per_param']:.2f} B/param ({s['state_host_gib']:.2f} GiB host, "
          f"{s['state_device_gib']:.2f} GiB device), peak RSS {s['peak_rss_gib']:.2f} GiB | "
          f"device peak {dev} | plan: host {s['plan_host_gib']:.2f} GiB, device "
          f"{s['plan_device_gib']:.2f} GiB, step >= {s['plan_step_s']:.3f} s (schedule "
          f"{s['plan_schedule_best_s']:.3f}-{s['plan_schedule_s']:.3f} s; groups: "
          f"{s['device_state_layers']} in device memory, {s['device_update_layers']} streamed)")


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog="python -m mtjax.train", description=__doc__)
  p.add_argument("--json", help="also write the summary as JSON to this path")
  p.add_argument("--no-progress", action="store_true", help="no progress bar")
  p.add_argument("--show-plan", action="store_true", help="print the plan before training")
  args, cfg = config_lib.parse_cli(p, argv)
  show = (lambda plan: print(plan_lib.format_plan(plan), flush=True)) if args.show_plan else None
  try:
    summary = run(cfg, progress=not args.no_progress, on_plan=show)
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
