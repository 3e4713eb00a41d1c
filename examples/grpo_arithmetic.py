"""Reinforce a tiny model on arithmetic with a verifiable reward (GRPO), on a CPU in about a minute.

python examples/grpo_arithmetic.py WORKDIR [--steps N]

  1. a character tokenizer (digits, "+", "=", an end token) and prompts "a+b=" with their answers,
     written by the example (no download): WORKDIR/tokenizer, WORKDIR/prompts.jsonl;
  2. python -m mtjax.train with train.objective=grpo: each step samples 8 completions of each of
     8 prompts from the current weights, scores them with the exact_answer reward (the last number
     of the completion against the answer) and trains on their group-relative advantages;
  3. the mean reward of the first and last steps, from the run's metrics.jsonl.
WORKDIR/summary.json holds the numbers.
"""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
work = Path(sys.argv[1]).absolute()
steps = int(sys.argv[sys.argv.index("--steps") + 1]) if "--steps" in sys.argv else 60
work.mkdir(parents=True, exist_ok=True)

# 1. the tokenizer and the prompts
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

chars = [*"0123456789+="]
vocab = {"<eos>": 0, **{c: i + 1 for i, c in enumerate(chars)}}
tok = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
tok.decoder = decoders.Fuse()
tdir = work / "tokenizer"
tdir.mkdir(exist_ok=True)
tok.save(str(tdir / "tokenizer.json"))
(tdir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
prompts = work / "prompts.jsonl"
with prompts.open("w") as f:
  for a in range(10):
    for b in range(10 - a):  # single-digit sums: 55 prompts
      f.write(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n")

# 2. GRPO
run = work / "run"
cmd = [sys.executable, "-m", "mtjax.train", "--no-progress", "--log-every", "10",
       "--config", str(ROOT / "configs" / "tiny.yaml"),
       f"model.vocab_size={len(vocab)}", "model.hidden=64", "model.layers=2", "model.heads=4",
       "model.ffn=128", "train.objective=grpo", f"data.path={prompts}",
       f"train.grpo.tokenizer={tdir}", "train.grpo.group=8", "train.grpo.max_new_tokens=2",
       "train.batch=64", "train.seq=8", f"train.steps={steps}", "optim.lr=1e-2",
       "optim.warmup_steps=0", "optim.weight_decay=0", "engine.compute_dtype=float32",
       "train.tensorboard=false", f"train.run_dir={run}", "train.checkpoint_dir=null"]
print("+", " ".join(cmd), flush=True)
subprocess.run(cmd, check=True, cwd=ROOT)

# 3. the reward, before and after
records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
rewards = [r["reward_mean"] for r in records if "reward_mean" in r]
k = max(1, len(rewards) // 6)
first, last = sum(rewards[:k]) / k, sum(rewards[-k:]) / k
summary = {"steps": len(rewards), "reward_first": first, "reward_last": last,
           "rewards": rewards}
(work / "summary.json").write_text(json.dumps(summary, indent=1))
print(f"mean reward of the first {k} steps {first:.3f}, of the last {k} {last:.3f}")
