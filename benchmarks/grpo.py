"""What does a GRPO step cost at the Qwen2.5-7B shape? 64 prompts x 8 completions of 512 new
tokens, sampled from the policy on the same GPU, then one optimizer step on the 512 rollouts:
the step's time split into generation and training, each beside what bounds it.

    python benchmarks/grpo.py [--config configs/qwen2.5_7b_grpo.yaml] [--steps 3] [--out FILE]
    python benchmarks/grpo.py --smoke     # configs/tiny.yaml's shape on the CPU, in seconds

mtjax's own init (random weights: speed does not depend on their values), synthetic arithmetic
prompts ("a+b=", the answer exact_answer checks) and a character tokenizer padded to the model's
vocabulary, both written to a scratch folder; a completion rarely meets the end token, so it runs
to max_new_tokens (the slow case). `python -m mtjax.train` runs it (the default placement, the
planner's choices), and its metrics give each step's generation seconds (`generation_s`, the
sampler's prefill and decode loop, the weights' cast included) and the engine step's (`step_s`).
Beside them: the planner's predicted engine step, and the decode roofline (every weight but the
embedding table's unused rows and the batch's KV cache at its mean length, in bf16, read once per
decoded token at the bandwidth of a device-to-device copy measured here). The medians leave out
the first step (its compiles).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

SMOKE = ["train.batch=8", "train.seq=24", "train.grpo.group=4", "train.grpo.max_new_tokens=12",
         "engine.micro_batch=null", "engine.compute_dtype=float32", "model.vocab_size=256"]


def scratch(folder: Path, vocab_size: int, prompts: int) -> tuple[Path, Path]:
  """A character tokenizer (digits, '+', '=' and an end token, padded with letter-named tokens to
  `vocab_size`) and a JSONL of `prompts` arithmetic prompts with their answers."""
  import numpy as np
  from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
  vocab = {"<eos>": 0, **{c: i + 1 for i, c in enumerate("0123456789+=")}}
  for i in range(len(vocab), vocab_size):  # no digits in a filler's name: rewards never parse one
    vocab[f"<{''.join(chr(97 + int(d)) for d in np.base_repr(i, 10))}>"] = i
  tok = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
  tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
  tok.decoder = decoders.Fuse()
  tdir = folder / "tokenizer"
  tdir.mkdir(parents=True, exist_ok=True)
  tok.save(str(tdir / "tokenizer.json"))
  (tdir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
  rng = np.random.default_rng(0)
  path = folder / "prompts.jsonl"
  with path.open("w") as f:
    for a, b in rng.integers(0, 1000, (prompts, 2)).tolist():
      f.write(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n")
  return tdir, path


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--config", default=str(ROOT / "configs" / "qwen2.5_7b_grpo.yaml"))
  p.add_argument("--steps", type=int, default=3)
  p.add_argument("--out")
  p.add_argument("--smoke", action="store_true")
  p.add_argument("overrides", nargs="*")
  args = p.parse_args(argv)
  import os
  if args.smoke:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    args.config = str(ROOT / "configs" / "tiny.yaml")
    args.overrides = SMOKE + ["train.objective=grpo"] + args.overrides
  import numpy as np
  from mtjax import cli, runlog, train
  import decode
  from mtjax import config
  base = config.load(args.config, args.overrides)  # the shape only: its data comes below
  with tempfile.TemporaryDirectory() as tmp:
    tdir, prompts = scratch(Path(tmp), base.model.vocab_size,
                            args.steps * base.train.batch // base.train.grpo.group)
    cfg = cli.load_config(args.config, args.overrides + [
        f"data.path={prompts}", f"train.grpo.tokenizer={tdir}", f"train.steps={args.steps}",
        f"train.run_dir={Path(tmp) / 'run'}", "train.tensorboard=false"])
    summary = train.run(cfg, progress="lines")
    records = runlog.read_metrics(Path(tmp) / "run")
    prompt = float(np.mean([len(json.loads(line)["prompt"])  # one token a character
                            for line in prompts.read_text().splitlines()]))
  import jax
  on_gpu = jax.devices()[0].platform != "cpu"
  m, t, s = cfg.model, cfg.train, cfg.train.grpo
  later = records[1:] or records
  gen_s = float(np.median([r["generation_s"] for r in later]))
  step_s = float(np.median([r["step_s"] for r in later]))
  new = float(np.median([r["completion_tokens_mean"] for r in later]))
  bw = decode.hbm_gbps() if on_gpu else float("nan")
  cache = 2 * m.layers * m.n_kv_heads * m.dim_per_head * (prompt + new / 2) * t.batch * 2
  roof_s = new * (decode.weight_bytes(m) + cache) / (bw * 1e9)
  row = {"device": str(jax.devices()[0]), "prompts": t.batch // s.group, "group": s.group,
         "max_new_tokens": s.max_new_tokens, "completion_tokens_mean": new,
         "generation_s": gen_s, "generation_roofline_s": roof_s,
         "generated_tokens_per_s": float(np.median([r["generated_tokens_per_s"] for r in later])),
         "train_step_s": step_s, "train_plan_s": summary["plan_schedule_s"],
         "train_model_tflops": float(np.median([r["model_tflops"] for r in later])),
         "train_tokens": t.batch * t.seq, "step_s": gen_s + step_s,
         "placement": {k: summary[k] for k in ("device_state_layers", "device_update_layers",
                                               "host_groups")},
         "peak_rss_gib": summary["peak_rss_gib"], "device_peak_gib": summary["device_peak_gib"],
         "plan_device_gib": summary["plan_device_gib"], "plan_host_gib": summary["plan_host_gib"],
         "reward_mean": [r["reward_mean"] for r in records]}
  print(json.dumps(row), flush=True)
  print(f"\nGRPO, {Path(args.config).name}: {row['prompts']} prompts x {s.group} completions, "
        f"{new:.0f} new tokens each (median), {row['device']}")
  print("| part | measured s | bound s | |")
  print("| --- | --- | --- | --- |")
  print(f"| generation | {gen_s:.2f} | {roof_s:.2f} (decode roofline) | "
        f"{row['generated_tokens_per_s']:,.0f} tokens/s |")
  print(f"| training (engine step) | {step_s:.2f} | {row['train_plan_s']:.2f} (plan) | "
        f"{row['train_model_tflops']:.1f} model TFLOP/s |")
  print(f"| GRPO step | {gen_s + step_s:.2f} | | |")
  if args.out:
    Path(args.out).write_text(json.dumps(row, indent=1))
  return 0


if __name__ == "__main__":
  sys.exit(main())
