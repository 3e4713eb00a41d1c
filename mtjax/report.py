"""`python -m mtjax.report RUN_DIR [--out DIR]`: PNG plots of a run folder's metrics.jsonl.

Writes loss.png (loss and held-out loss against step and tokens), lr.png, throughput.png,
step_time.png (the split of each step as stacked bars), memory.png (host RSS and device peak over
time) and, when RUN_DIR/timeline.json exists, timeline.png (per-layer transfers and compute of one
step), for DPO rewards.png (chosen, rejected rewards and their margin) and
reward_accuracy.png, and for GRPO grpo_rewards.png (reward mean and std, the held-out greedy
reward), grpo_kl.png, grpo_clip.png (share of completion tokens the ratio's clip binds) and
completion_tokens.png. A plot whose fields were never logged is left out. The throughput and
step-time plots leave out the first step, which compiles, and say so in their titles. Needs
matplotlib.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

from mtjax import exits
from mtjax.runlog import METRICS, read_metrics

# The parts of step_s as the trainer logs them (they add up to it); the waits on the host
# optimizer and the device happen inside them and are drawn as lines over the bars.
SPLIT = (("forward_s", "forward (issued)"), ("backward_s", "backward (issued)"),
         ("finish_s", "end of step"))
WAITS = (("opt_wait_s", "waiting on the host optimizer"), ("device_wait_s", "waiting on the device"))


def _series(records: list[dict], field: str, x: list) -> tuple[list, list]:
  """(x, y) of the records where the field is a number (null/NaN and unlogged are left out)."""
  pts = [(xi, r[field]) for xi, r in zip(x, records)
         if isinstance(r.get(field), (int, float)) and not isinstance(r.get(field), bool)]
  return [p[0] for p in pts], [p[1] for p in pts]


def _has(records: list[dict], field: str) -> bool:
  return any(isinstance(r.get(field), (int, float)) for r in records)


def compile_step(records: list[dict]) -> dict | None:
  """The run's first training step, which compiles every layer program: the throughput and
  step-time plots leave it out of their scale (a compile can take a hundred steps' time). None
  when no other step was logged, so a one-step run still shows its step."""
  trained = [r for r in records if _has([r], "step_s") or _has([r], "tokens_per_s")]
  return trained[0] if len(trained) > 1 else None


def _without(records: list[dict], left_out: dict | None) -> list[dict]:
  return [r for r in records if r is not left_out]


def _left_out(first: dict | None) -> str:
  """The title's note on the step a plot leaves out."""
  if first is None:
    return ""
  took = f", {first['step_s']:.1f} s" if _has([first], "step_s") else ""
  return f"\nstep {first['step']} (compilation{took}) left out"


def tokens_seen(records: list[dict]) -> list[float] | None:
  """Tokens seen after each record: the logged `tokens`, else the running sum of
  tokens_per_s * step_s; None when neither was logged."""
  if all(isinstance(r.get("tokens"), (int, float)) for r in records):
    return [float(r["tokens"]) for r in records]
  if not (_has(records, "tokens_per_s") and _has(records, "step_s")):
    return None
  total, out = 0.0, []
  for r in records:
    tps, s = r.get("tokens_per_s"), r.get("step_s")
    if isinstance(tps, (int, float)) and isinstance(s, (int, float)):
      total += tps * s
    out.append(total)
  return out


def _plot_pair(plt, records, fields, ylabel, title, path, tokens, log_y=False) -> Path:
  """One figure: `fields` against step (left) and against tokens seen (right, when known)."""
  steps = [r["step"] for r in records]
  axes_x = [(steps, "step")] + ([(tokens, "tokens seen")] if tokens is not None else [])
  fig, axes = plt.subplots(1, len(axes_x), figsize=(6 * len(axes_x), 4), squeeze=False)
  for ax, (x, xlabel) in zip(axes[0], axes_x):
    for field, label in fields:
      xs, ys = _series(records, field, x)
      if ys:
        ax.plot(xs, ys, marker="o" if len(ys) < 30 else None, markersize=3, label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(f"{title} against {xlabel}")
    if log_y:
      ax.set_yscale("log")
    ax.grid(alpha=0.3)
    if len(fields) > 1:
      ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def _plot_throughput(plt, records, path) -> Path:
  first = compile_step(records)
  records = _without(records, first)
  fig, ax = plt.subplots(figsize=(8, 4))
  steps = [r["step"] for r in records]
  xs, ys = _series(records, "tokens_per_s", steps)
  lines = ax.plot(xs, ys, marker="o" if len(ys) < 30 else None, markersize=3, color="#4c72b0",
                  label="tokens/s")
  ax.set_xlabel("step")
  ax.set_ylabel("tokens/s")
  ax.set_title("Training throughput (tokens/s) against step" + _left_out(first))
  ax.grid(alpha=0.3)
  if _has(records, "model_tflops"):
    right = ax.twinx()
    xs, ys = _series(records, "model_tflops", steps)
    lines += right.plot(xs, ys, linestyle="--", color="#dd8452", label="model TFLOP/s")
    right.set_ylabel("model TFLOP/s")
    ax.legend(lines, [line.get_label() for line in lines], fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def _plot_step_time(plt, records, path) -> Path:
  first = compile_step(records)
  records = _without(records, first)
  fig, ax = plt.subplots(figsize=(max(8, min(20, len(records) * 0.15)), 4))
  steps = [r["step"] for r in records]
  num = lambda r, f: r[f] if isinstance(r.get(f), (int, float)) else 0.0
  bottom = [0.0] * len(records)
  parts = [(f, label) for f, label in SPLIT if _has(records, f)]
  for field, label in parts:
    h = [num(r, field) for r in records]
    ax.bar(steps, h, bottom=bottom, width=0.8, label=label)
    bottom = [b + v for b, v in zip(bottom, h)]
  # What the split does not account for (host work, Python, logging) tops the bar up to step_s.
  rest = [max(num(r, "step_s") - b, 0.0) for r, b in zip(records, bottom)]
  if any(rest):
    ax.bar(steps, rest, bottom=bottom, width=0.8, color="#bbbbbb",
           label="other" if parts else "step")
  for field, label in WAITS:
    if _has(records, field):
      ax.plot(steps, [num(r, field) for r in records], marker=".", linewidth=1, label=label)
  ax.set_xlabel("step")
  ax.set_ylabel("seconds")
  ax.set_title("Step time split per step (stacked)" + _left_out(first))
  ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))  # off the bars
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def _plot_memory(plt, records, path) -> Path:
  fig, ax = plt.subplots(figsize=(8, 4))
  if all(isinstance(r.get("time"), (int, float)) for r in records):
    x, xlabel = [r["time"] - records[0]["time"] for r in records], "seconds since the first record"
  else:
    x, xlabel = [r["step"] for r in records], "step"
  for field, label in (("host_rss_gib", "host RSS"), ("device_peak_gib", "device peak")):
    xs, ys = _series(records, field, x)
    if ys:
      ax.plot(xs, ys, marker="o" if len(ys) < 30 else None, markersize=3, label=label)
  ax.set_xlabel(xlabel)
  ax.set_ylabel("GiB")
  ax.set_title("Memory over time: host RSS and device peak")
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def read_timeline(path: str | Path) -> dict[str, list[tuple[float, float, str, str]]]:
  """Lanes of timeline.json: {lane: [[start_s, end_s, label, phase], ...]} (the dict
  benchmarks/bench.py `lanes()` returns) or the same as a list of [lane, intervals] pairs."""
  raw = json.loads(Path(path).read_text())
  pairs = raw.items() if isinstance(raw, dict) else raw
  return {str(lane): [(float(s), float(e), str(label), str(phase)) for s, e, label, phase in iv]
          for lane, iv in pairs}


def _plot_timeline(plt, lane_map, path) -> Path:
  spans = [iv for ivs in lane_map.values() for iv in ivs]
  t0 = min((s for s, _, _, _ in spans), default=0.0)
  t1 = max((e for _, e, _, _ in spans), default=1.0)
  fig, ax = plt.subplots(figsize=(16, 1.2 + 0.65 * max(len(lane_map), 1)))
  colors = {"fwd": "#4c72b0", "bwd": "#dd8452"}
  names = list(lane_map)
  for row, lane in enumerate(names):
    for s, e, label, phase in lane_map[lane]:
      ax.barh(row, (e - s) * 1e3, left=(s - t0) * 1e3, height=0.6,
              color=colors.get(phase, "#999999"), edgecolor="black", linewidth=0.3)
      if (e - s) / max(t1 - t0, 1e-9) > 0.012:  # label only the bars wide enough to read
        ax.text((s + e) / 2 * 1e3 - t0 * 1e3, row, label, ha="center", va="center", fontsize=6)
  ax.set_yticks(range(len(names)), names)
  ax.invert_yaxis()
  ax.set_xlabel("ms since the step began (blue: forward, orange: backward; labels: layer group)")
  ax.set_ylabel("lane")
  ax.set_title("Per-layer timeline of one step: transfers, compute and host optimizer")
  ax.set_xlim(0, max(t1 - t0, 1e-9) * 1e3)
  fig.tight_layout()
  fig.savefig(path, dpi=130)
  plt.close(fig)
  return path


def render(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
  """Renders the plots of a run folder.

  Args:
    run_dir: a folder with metrics.jsonl (and optionally timeline.json).
    out_dir: where the PNGs go; run_dir/report by default.

  Returns:
    The paths of the PNGs written.
  """
  import matplotlib
  matplotlib.use("Agg")  # files only, no display
  import matplotlib.pyplot as plt

  run_dir = Path(run_dir)
  if not (run_dir / METRICS).is_file():
    raise FileNotFoundError(f"{run_dir}: no {METRICS} (not a run folder?)")
  records = [r for r in read_metrics(run_dir) if isinstance(r, dict) and "step" in r]
  out = Path(out_dir) if out_dir is not None else run_dir / "report"
  out.mkdir(parents=True, exist_ok=True)
  tokens = tokens_seen(records)
  written = []
  if _has(records, "loss") or _has(records, "held_out_loss"):
    written.append(_plot_pair(plt, records, [("loss", "training loss"),
                                             ("held_out_loss", "held-out loss")],
                              "loss", "Loss", out / "loss.png", tokens))
  if _has(records, "lr"):
    written.append(_plot_pair(plt, records, [("lr", "learning rate")], "learning rate",
                              "Learning rate", out / "lr.png", tokens))
  if _has(records, "reward_margin"):  # a preference objective (train.objective: dpo)
    written.append(_plot_pair(plt, records, [("reward_chosen", "chosen"),
                                             ("reward_rejected", "rejected"),
                                             ("reward_margin", "margin")],
                              "reward (beta x log-prob ratio)", "DPO rewards", out / "rewards.png",
                              tokens))
    written.append(_plot_pair(plt, records, [("reward_accuracy", "chosen above rejected")],
                              "share of pairs", "DPO reward accuracy",
                              out / "reward_accuracy.png", tokens))
  if _has(records, "reward_mean"):  # a reinforcement objective (train.objective: grpo)
    written.append(_plot_pair(plt, records, [("reward_mean", "mean"), ("reward_std", "std"),
                                             ("held_out_reward_mean", "held-out mean (greedy)")],
                              "reward", "GRPO rewards", out / "grpo_rewards.png", tokens))
  for field, label, title, name in (
      ("kl", "KL to the initial weights (k3, per token)", "GRPO KL", "grpo_kl.png"),
      ("clip_fraction", "share of completion tokens clipped", "GRPO clip fraction",
       "grpo_clip.png"),
      ("completion_tokens_mean", "tokens per completion", "Completion length",
       "completion_tokens.png")):
    if _has(records, field):
      written.append(_plot_pair(plt, records, [(field, label)], label, title, out / name, tokens))
  if _has(records, "tokens_per_s"):
    written.append(_plot_throughput(plt, records, out / "throughput.png"))
  if _has(records, "step_s") or any(_has(records, f) for f, _ in SPLIT):
    written.append(_plot_step_time(plt, records, out / "step_time.png"))
  if _has(records, "host_rss_gib") or _has(records, "device_peak_gib"):
    written.append(_plot_memory(plt, records, out / "memory.png"))
  if (run_dir / "timeline.json").is_file():
    written.append(_plot_timeline(plt, read_timeline(run_dir / "timeline.json"),
                                  out / "timeline.png"))
  return written


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(prog="python -m mtjax.report", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("run_dir", help="run folder holding metrics.jsonl (train.run_dir; by default the "
                                 "checkpoint_dir, else runs/<time>)")
  p.add_argument("--out", help="folder for the PNGs (default: RUN_DIR/report)")
  args = p.parse_args(argv)
  if not (Path(args.run_dir) / METRICS).is_file():
    return exits.fail("error", f"{args.run_dir}: no {METRICS} (not a run folder?)",
                      exits.BAD_INPUT)
  if importlib.util.find_spec("matplotlib") is None:
    return exits.fail("error", "python -m mtjax.report needs matplotlib (pip install "
                               "'matplotlib>=3.8,<4')", exits.BAD_INPUT)
  try:
    written = render(args.run_dir, args.out)
  except OSError as e:  # an --out that is a file or read-only, a full disk
    where = f": {e.filename}" if e.filename else ""
    return exits.fail("error", f"{e.strerror or exits.one_line(e)}{where}", exits.of_os_error(e))
  for path in written:
    print(path)
  return exits.OK


if __name__ == "__main__":
  sys.exit(main())
