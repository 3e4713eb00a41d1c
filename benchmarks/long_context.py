"""`python benchmarks/long_context.py run|ceiling|table ...`: how fast does training run at long
context, and how much memory does it take? The table of docs/long_context.md.

  run      one row, in processes of its own: `python -m mtjax.train --json` at batch 1 and the
           given context length, and, when `--layers` runs a slice of the model, the planner's
           figures for the whole model at that length (`python -m mtjax.plan --json`):
             python benchmarks/long_context.py run --out DIR --name 8B \\
               --config configs/llama3_8b.yaml --seq 262144 [--layers 4] [--steps 2] [key=value ...]
  ceiling  this machine's bf16 matmul rate (DIR/ceiling.json), what the rows are held against
  table    the rows in DIR as a markdown table; `--plot PNG` draws tokens/s against context length.
           A row whose files a device call did not return may be kept as the call printed it:
           `printed` says so, `printed_whole_model` holds its printed extrapolation.
  --smoke [--out DIR]  one slice row of configs/tiny.yaml and its table, on the CPU, in seconds.

Throughput counts attention: `model TF` is 6 x params x tokens per second, `+attn TF` adds the
causal attention's matmuls (mtjax.plan.flops), `of ceiling` is the latter over the measured
matmul rate. A slice's whole-model step is extrapolated by the planner's ratio of whole-model to slice step
(`whole_model`) and printed beside the planner's whole-model figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: the repository root holds mtjax
  sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mtjax import cli

GiB = 2**30
ROOT = Path(__file__).resolve().parent.parent


def _row_path(out: Path, name: str, seq: int, layers: int | None) -> Path:
  return out / (f"{name}_{seq}.json" if layers is None else f"{name}_{seq}_L{layers}.json")


def run(args, overrides: list[str]) -> int:
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  full = cli.load_config(args.config, overrides)
  common = [f"train.seq={args.seq}", "train.batch=1", *overrides]
  train_over = common + [f"train.steps={args.steps}", "train.eval_every=0"]
  if args.layers is not None:
    train_over.append(f"model.layers={args.layers}")
  path = _row_path(out, args.name, args.seq, args.layers)
  stem = path.with_suffix("")
  for old in (path, Path(str(stem) + ".train.json"), Path(str(stem) + ".plan.json")):
    old.unlink(missing_ok=True)  # never a stale figure beside a fresh one
  cmd = [sys.executable, "-m", "mtjax.train", "--config", args.config, "--no-progress",
         "--show-plan", "--json", str(stem) + ".train.json", *train_over]
  row = {"name": args.name, "config": args.config, "seq": args.seq, "steps": args.steps,
         "layers": args.layers or full.model.layers, "full_layers": full.model.layers,
         "overrides": overrides, "command": shlex.join(["python", "benchmarks/long_context.py",
                                                        *sys.argv[1:]])}
  t = time.perf_counter()
  with open(str(stem) + ".log", "w") as log:
    try:
      rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout,
                          cwd=ROOT).returncode
    except subprocess.TimeoutExpired:
      rc = 124
  row["wall_s"], row["rc"] = time.perf_counter() - t, rc
  row["ceiling_tflops"] = _ceiling(out)  # measured in the same device call, if it was
  summary = Path(str(stem) + ".train.json")
  row["train"] = json.loads(summary.read_text()) if rc == 0 and summary.exists() else None
  if args.layers is not None and args.layers != full.model.layers:
    plan_json = Path(str(stem) + ".plan.json")
    try:  # the whole model's plan: its layers compiled at this length, nothing allocated
      subprocess.run([sys.executable, "-m", "mtjax.plan", "--config", args.config, "--json",
                      str(plan_json), *common], stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL, timeout=args.plan_timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
      pass
    row["full_plan"] = json.loads(plan_json.read_text()) if plan_json.exists() else None
  path.write_text(json.dumps(row, indent=1))
  print(format_rows([row], _ceiling(out)))
  return 0 if rc == 0 else 1


def _ceiling(out: Path) -> float | None:
  f = out / "ceiling.json"
  return json.loads(f.read_text())["matmul_tflops"] if f.exists() else None


def ceiling(args) -> int:
  import jax  # the backend starts here, in this mode only
  sys.path.insert(0, str(ROOT / "benchmarks"))
  from bench import matmul_tflops
  dev = jax.devices()[0]
  mm = matmul_tflops(dev, n=1024 if dev.platform == "cpu" else 8192)
  Path(args.out).mkdir(parents=True, exist_ok=True)
  (Path(args.out) / "ceiling.json").write_text(json.dumps({"matmul_tflops": mm,
                                                          "device": str(dev)}))
  print(f"bf16 matmul {mm:.0f} TFLOP/s on {dev}")
  return 0


def whole_model(row: dict) -> dict | None:
  """A slice's step extrapolated to the whole model: the measured step times the ratio of the
  planner's simulated steps, whole model over slice (the same planner, run in the same device
  call). The planner times each part at its own rate (blocks' matmuls and attention, their re-run
  forwards under the whole model's activations_every, the embedding and the head), which a ratio
  of FLOPs would not: the head's matmuls run faster than attention."""
  if row.get("printed_whole_model"):  # a row kept only as the call printed it (see `table`)
    return row["printed_whole_model"]
  tr, plan = row.get("train"), row.get("full_plan") or {}
  if tr is None or row["layers"] == row["full_layers"] or not plan.get("schedule_s"):
    return None
  ratio = plan["schedule_s"] / tr["plan_schedule_s"]
  return {"step_s": tr["step_s_median"] * ratio, "tokens_per_s": tr["tokens_per_s"] / ratio,
          "activations_every": plan["activations_every"]}


def format_rows(rows: list[dict], mm: float | None, one: float | None = None) -> str:
  """The rows as markdown; `of ceiling` against `one` rate for all rows when given, else each
  row's own call's measured ceiling (or the folder's)."""
  head = ("| model | context | layers run | step s | tokens/s | model TF | +attn TF | of ceiling "
          "| device GiB (plan) | host GiB (plan) | whole model: step s, extrapolated (plan) "
          "| command |")
  lines = [head, "|" + "---|" * (head.count("|") - 1)]
  for r in sorted(rows, key=lambda r: (r["name"], r["seq"], r["layers"])):
    tr = r.get("train")
    ctx = f"{r['seq'] // 1024}k" if r["seq"] >= 1024 else str(r["seq"])
    layers = f"{r['layers']} of {r['full_layers']}" + (" (printed)" if r.get("printed") else "")
    if tr is None:
      lines.append(f"| {r['name']} | {ctx} | {layers} | did not run (rc {r['rc']}, "
                   f"{r['wall_s']:.0f} s) | | | | | | | | `{r['command']}` |")
      continue
    first = " (first step)" if r["steps"] < 2 else ""
    ceil = one or r.get("ceiling_tflops") or mm  # the row's own call's ceiling, else the folder's
    frac = "" if ceil is None else f"{tr['tflops_with_attention'] / ceil:.0%}"
    dev = ("" if tr["device_peak_gib"] is None else
           f"{tr['device_peak_gib']:.1f} ({tr['plan_device_gib']:.1f})")
    whole = whole_model(r)
    plan = r.get("full_plan") or {}
    if r["layers"] == r["full_layers"]:
      extra = "(this row)"
    elif plan.get("refused"):  # no whole-model step to extrapolate to: say why
      extra = f"refused by the planner: {plan['refused'].split(';')[0]}"
    elif whole is None:
      extra = "(no whole-model plan)"
    else:
      extra = f"{whole['step_s']:.1f}"
      if plan:
        extra += (f" (plan {plan['schedule_s'] or float('nan'):.1f} s, device "
                  f"{plan['device_bytes'] / GiB:.1f}, host {plan['host_bytes'] / GiB:.1f} GiB, "
                  f"K={plan['activations_every']}, {plan['activations_on_host']} on host)")
    lines.append(
        f"| {r['name']} | {ctx} | {layers} | {tr['step_s_median']:.2f}{first} | "
        f"{tr['tokens_per_s']:,.0f} | {tr['model_tflops']:.1f} | {tr['tflops_with_attention']:.1f} "
        f"| {frac} | {dev} | {tr['peak_rss_gib']:.1f} ({tr['plan_host_gib']:.1f}) | {extra} | "
        f"`{r['command']}` |")
  return "\n".join(lines)


def table(args) -> int:
  out = Path(args.out)
  rows = [json.loads(f.read_text()) for f in sorted(out.glob("*.json"))
          if not f.name.endswith((".train.json", ".plan.json")) and f.name != "ceiling.json"]
  mm = _ceiling(out)
  if args.ceiling:
    print(f"bf16 matmul ceiling: {args.ceiling:.0f} TFLOP/s (every row held against it)\n")
  elif mm is not None:
    print(f"bf16 matmul ceiling: {mm:.0f} TFLOP/s (measured in the same device call)\n")
  print(format_rows(rows, mm, args.ceiling))
  if args.plot:
    plot(rows, Path(args.plot))
  return 0


def plot(rows: list[dict], path: Path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(7, 4))
  seqs = set()  # the context lengths plotted
  for name in sorted({r["name"] for r in rows}):
    pts = []
    for r in rows:
      if r["name"] == name and r.get("train"):
        whole = whole_model(r)
        if whole is None and r["layers"] != r["full_layers"]:
          continue  # a slice with no whole-model step to extrapolate to (the plan refused it)
        pts.append((r["seq"], whole["tokens_per_s"] if whole else r["train"]["tokens_per_s"],
                    whole is not None))
    pts.sort()
    if not pts:
      continue
    seqs.update(p[0] for p in pts)
    line, = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    ext = [p for p in pts if p[2]]
    if ext:
      ax.plot([p[0] for p in ext], [p[1] for p in ext], marker="o", linestyle="none",
              markerfacecolor="white", color=line.get_color())
  ax.set_xscale("log", base=2)
  ax.set_yscale("log")
  seqs = sorted(seqs)
  ax.set_xticks(seqs, [f"{s // 1024}k" if s >= 1024 else str(s) for s in seqs])
  ax.minorticks_off()
  ax.set_xlabel("context length (tokens, batch 1)")
  ax.set_ylabel("tokens/s (whole model)")
  ax.set_title("mtjax on one H200: throughput against context length\n"
               "(hollow: extrapolated from a slice of the layers)")
  ax.grid(alpha=0.3, which="both")
  ax.legend()
  fig.tight_layout()
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=110)
  plt.close(fig)


SMOKE_ROW = ["--name", "tiny", "--config", str(ROOT / "configs" / "tiny.yaml"), "--seq", "128",
             "--layers", "1", "--steps", "2", "model.layers=3", "engine.activations=auto"]


def smoke(argv: list[str]) -> int:
  """One slice row of a tiny model and its table, on the CPU (the runs' processes inherit it)."""
  p = argparse.ArgumentParser(prog="python benchmarks/long_context.py --smoke")
  p.add_argument("--smoke", action="store_true")
  p.add_argument("--out", help="folder for the row (default: a new temporary folder)")
  out = p.parse_args(argv).out or tempfile.mkdtemp(prefix="long_context.")
  os.environ["JAX_PLATFORMS"] = "cpu"
  return main(["run", "--out", out, *SMOKE_ROW]) or main(["table", "--out", out])


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  if "--smoke" in argv:
    return smoke(argv)
  p = argparse.ArgumentParser(prog="python benchmarks/long_context.py", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = p.add_subparsers(dest="mode", required=True)
  r = sub.add_parser("run", help="one row")
  r.add_argument("--out", required=True)
  r.add_argument("--name", required=True, help="the model's name in the table (1B, 3.37B, 8B)")
  r.add_argument("--config", required=True)
  r.add_argument("--seq", type=int, required=True)
  r.add_argument("--layers", type=int, help="run a slice of this many layers")
  r.add_argument("--steps", type=int, default=2, help="the first includes compilation")
  r.add_argument("--timeout", type=float, default=540, help="seconds for the training run")
  r.add_argument("--plan-timeout", type=float, default=90,
                 help="seconds for the whole model's plan (slices only)")
  c = sub.add_parser("ceiling", help="the matmul ceiling")
  c.add_argument("--out", required=True)
  t = sub.add_parser("table", help="the table (and plot) of the rows in --out")
  t.add_argument("--out", required=True)
  t.add_argument("--ceiling", type=float,
                 help="hold every row against this bf16 matmul TFLOP/s (rows measured in "
                      "different calls: the highest measured on the machine)")
  t.add_argument("--plot")
  args, rest = p.parse_known_args(argv)
  if args.mode == "run":
    return run(args, rest)
  if rest:
    p.error(f"unexpected arguments: {rest}")
  return ceiling(args) if args.mode == "ceiling" else table(args)


if __name__ == "__main__":
  sys.exit(main())
