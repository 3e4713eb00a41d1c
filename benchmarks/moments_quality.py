"""What 8-bit and bfloat16 AdamW moments do to training: one run per `optim.state_dtype` on the same
prepared text, seed and schedule, the loss curves in one plot, the final losses side by side.

    python benchmarks/moments_quality.py corpus OUT_DIR [--mb 24]
    python benchmarks/moments_quality.py run DATA_DIR OUT_DIR [--steps 2000] [--dtypes D,...]
                                         [overrides ...]
    python benchmarks/moments_quality.py --smoke OUT_DIR

`corpus` (any machine, no accelerator): a text corpus from the Python sources of this interpreter's
standard library and site packages (files sorted by path, the first --mb MiB; deterministic for one
installation), a byte-level BPE tokenizer of 8192 tokens trained on it (`tokenizers`), and the
corpus prepared by `python -m mtjax.data prepare --format text` with 2% held out: OUT_DIR/tokenizer
and OUT_DIR/data.

`run` (the GPU): `python -m mtjax.train` once per state dtype (float32, bfloat16, int8) on
DATA_DIR/data with `configs/llama_1b.yaml`'s shape (0.95B parameters at vocab 8192, trained from
its random init: no pretrained 1B model can be loaded offline), batch 4 x 512, the held-out loss
every 200 steps; then OUT_DIR/moments_quality.png (train loss, smoothed over 50 steps, and the
held-out loss of each) and a table of the final train loss (mean of the last 100 steps) and
held-out loss, each as a ratio to float32's.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DTYPES = ("float32", "bfloat16", "int8")
VOCAB = 8192


def corpus(out: Path, mb: float) -> None:
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  out.mkdir(parents=True, exist_ok=True)
  roots = sorted({sysconfig.get_paths()[k] for k in ("stdlib", "purelib")})
  files = sorted(p for r in roots for p in Path(r).rglob("*.py") if p.is_file())
  budget, rows = int(mb * 2**20), []
  for p in files:
    try:
      text = p.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
      continue
    if text.strip():
      rows.append(text)
      budget -= len(text.encode())
    if budget <= 0:
      break
  jsonl = out / "corpus.jsonl"
  with jsonl.open("w") as f:
    for text in rows:
      f.write(json.dumps({"text": text}) + "\n")
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.train_from_iterator(rows, trainers.BpeTrainer(
      vocab_size=VOCAB, special_tokens=["<|endoftext|>"],
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  tdir = out / "tokenizer"
  tdir.mkdir(exist_ok=True)
  tok.save(str(tdir / "tokenizer.json"))
  (tdir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
  subprocess.run([sys.executable, "-m", "mtjax.data", "prepare", "--tokenizer", str(tdir),
                  "--format", "text", "--val-fraction", "0.02", "--eos", "<|endoftext|>",
                  "--out", str(out / "data"), str(jsonl)], check=True, cwd=ROOT)
  jsonl.unlink()  # the prepared tokens are what travels
  print(f"{len(rows)} files, {mb} MiB of text -> {out / 'data'}")


def run(data: Path, out: Path, steps: int, dtypes: list[str], overrides: list[str]) -> None:
  out.mkdir(parents=True, exist_ok=True)
  saved = out / "moments_quality.json"
  results = json.loads(saved.read_text()) if saved.exists() else {}  # earlier calls' runs
  for dtype in dtypes:
    summary = out / f"{dtype}.json"
    cmd = [sys.executable, "-m", "mtjax.train", "--no-progress", "--log-every", "100",
           "--json", str(summary), "--config", str(ROOT / "configs" / "llama_1b.yaml"),
           f"model.vocab_size={VOCAB}", "data.source=prepared", f"data.path={data / 'data'}",
           f"train.steps={steps}", "train.batch=4", "train.seq=512", "train.eval_every=200",
           "train.eval_batches=16", "train.tensorboard=false", "engine.micro_batch=null",
           f"train.run_dir={out / dtype}", f"optim.state_dtype={dtype}", *overrides]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)
    records = [json.loads(line) for line in (out / dtype / "metrics.jsonl").read_text().splitlines()]
    train = [(r["step"], r["loss"]) for r in records if "loss" in r and not r.get("skipped")]
    held = json.loads(summary.read_text())["held_out"]
    results[dtype] = dict(train=train, held_out=held,
                          final_train=sum(l for _, l in train[-100:]) / len(train[-100:]),
                          final_held_out=held[-1][1], step_s=json.loads(summary.read_text()).get(
                              "step_s"))
    saved.write_text(json.dumps(results))
  results = {d: results[d] for d in DTYPES if d in results}
  plot(results, out / "moments_quality.png")
  base = results.get("float32")
  if base is None:
    return
  print("| moments | final train loss (last 100 steps) | ratio | final held-out loss | ratio |")
  print("| --- | --- | --- | --- | --- |")
  for dtype, r in results.items():
    print(f"| {dtype} | {r['final_train']:.4f} | {r['final_train'] / base['final_train']:.4f} | "
          f"{r['final_held_out']:.4f} | {r['final_held_out'] / base['final_held_out']:.4f} |")


def plot(results: dict, path: Path) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  import numpy as np
  fig, ax = plt.subplots(figsize=(8, 5))
  for dtype, r in results.items():
    steps, loss = np.array(r["train"]).T
    k = min(50, len(loss))
    smooth = np.convolve(loss, np.ones(k) / k, mode="valid")
    line, = ax.plot(steps[k - 1:], smooth, label=f"{dtype} train (mean of {k} steps)", lw=1)
    hs, hl = np.array(r["held_out"]).T
    ax.plot(hs, hl, "o--", color=line.get_color(), label=f"{dtype} held-out", ms=3)
  ax.set_xlabel("step")
  ax.set_ylabel("loss")
  ax.set_ylim(top=min(8.0, ax.get_ylim()[1]))
  ax.set_title("AdamW moments: float32, bfloat16, int8 (0.95B Llama shape, 4 x 512)")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  sub = p.add_subparsers(dest="cmd", required=True)
  c = sub.add_parser("corpus")
  c.add_argument("out", type=Path)
  c.add_argument("--mb", type=float, default=24.0)
  r = sub.add_parser("run")
  r.add_argument("data", type=Path)
  r.add_argument("out", type=Path)
  r.add_argument("--steps", type=int, default=2000)
  p.add_argument("--smoke", action="store_true",
                 help="corpus and runs at toy size on the CPU, in about a minute: OUT_DIR only")
  r.add_argument("--dtypes", default=",".join(DTYPES),
                 help="the state dtypes to run, comma-separated (a later call adds to OUT_DIR's)")
  argv = sys.argv[1:]
  if "--smoke" in argv:  # a 1 MiB corpus, a two-layer model, 6 steps of each dtype
    out = Path(argv[argv.index("--smoke") + 1] if len(argv) > argv.index("--smoke") + 1
               else "moments_smoke")
    corpus(out, 1.0)
    run(out, out / "runs", 6, list(DTYPES), [
        "model.hidden=32", "model.layers=2", "model.heads=2", "model.ffn=64",
        "train.eval_every=3", "train.eval_batches=2", "optim.warmup_steps=1", "train.seq=64"])
    return 0
  a, overrides = p.parse_known_args()  # the rest: mtjax.train's dotted overrides
  if a.cmd == "corpus":
    if overrides:
      p.error(f"unrecognized arguments: {' '.join(overrides)}")
    corpus(a.out, a.mb)
  else:
    run(a.data, a.out, a.steps, a.dtypes.split(","), overrides)
  return 0


if __name__ == "__main__":
  sys.exit(main())
