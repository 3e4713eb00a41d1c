"""Do the recipes users run after `prepare` work end to end, and what do they cost? On the
Llama-3.2-1B shape (configs/llama3.2_1b.yaml, mtjax's own init), with a byte-level BPE tokenizer
trained here and a ChatML template: SFT from a ShareGPT file, exported, then DPO from that export
on a preference file of the same kind of questions (the answer chosen, a refusal
rejected), and the SFT batch in one pass beside the same batch in 4 passes (train.grad_accum). Each command runs in a process of its own,
as a user runs it; `python -m mtjax.report` draws each run's curves.

    PYTHONUNBUFFERED=1 python benchmarks/recipes.py OUTDIR [--steps 100] [--smoke]

Writes OUTDIR/summary.json (one row per run: step time beside the plan's, tokens/s, losses, DPO's
rewards), OUTDIR/RUN.json (each run's own summary) and OUTDIR/RUN/ (its folder and report). `--smoke`: a 2-layer model, a few
steps, on the CPU in seconds.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from finetune import ROOT, corpus, log, sh

sys.path.insert(0, str(ROOT))
from mtjax import runlog

CHATML = ("{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' }}"
          "{%- if message['role'] == 'assistant' %}{% generation %}"
          "{{- message['content'] + '<|im_end|>' }}{% endgeneration %}"
          "{%- else %}{{- message['content'] + '<|im_end|>' }}{%- endif %}{{- '\\n' }}"
          "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
SMOKE_MODEL = ["model.vocab_size=1024", "model.hidden=64", "model.layers=2", "model.heads=4",
               "model.kv_heads=2", "model.ffn=128", "model.head_dim=16"]


def tokenizer(work: Path, vocab: int) -> Path:
  """A byte-level BPE with ChatML's special tokens and template, trained on the corpus."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  out = work / "tokenizer"
  out.mkdir()
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.train([str(p) for p in sorted((work / "corpus").iterdir())],
            trainers.BpeTrainer(vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"]))
  tok.save(str(out / "tokenizer.json"))
  (out / "tokenizer_config.json").write_text(json.dumps(
      {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": CHATML,
       "tokenizer_class": "PreTrainedTokenizerFast"}))
  return out


def questions(n: int, seed: int = 0):
  """(question, answer, a refusal) of sums: a preference a model learns within 100 steps."""
  rng = random.Random(seed)
  refusals = ["I do not know.", "Ask someone else.", "That is not my job.", "No idea, sorry."]
  for _ in range(n):
    a, b = rng.randrange(1000), rng.randrange(1000)
    yield f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}.", rng.choice(refusals)


def write_sources(work: Path, n: int, pairs: int) -> tuple[Path, Path]:
  """A ShareGPT file of n conversations (two sums each) and a preference file of `pairs` sums."""
  qs = list(questions(2 * n))
  chats = [{"conversations": [{"from": "system", "value": "You add numbers."},
                              {"from": "human", "value": q1}, {"from": "gpt", "value": r1},
                              {"from": "human", "value": q2}, {"from": "gpt", "value": r2}]}
           for (q1, r1, _), (q2, r2, _) in zip(qs[0::2], qs[1::2])]
  prefs = [{"prompt": q, "chosen": r, "rejected": w} for q, r, w in qs[:pairs]]
  sharegpt, preference = work / "chats.json", work / "prefs.jsonl"
  sharegpt.write_text(json.dumps(chats))  # a JSON array, as ShareGPT dumps come
  preference.write_text("".join(json.dumps(p) + "\n" for p in prefs))
  return sharegpt, preference


def train(out: Path, name: str, config: str, *overrides: str) -> dict:
  """`python -m mtjax.train`, its report drawn; the summary row of the run."""
  run = out / name
  sh("-m", "mtjax.train", "--config", config, "--no-progress", "--show-plan", "--json",
     str(out / f"{name}.json"), f"train.run_dir={run}", *overrides)
  sh("-m", "mtjax.report", str(run))
  s = json.loads((out / f"{name}.json").read_text())
  row = {"run": name, "steps": s["steps"], "batch": s["batch"], "seq": s["seq"],
         "step_s": s["step_s_median"],
         "plan_s": [s["plan_schedule_best_s"], s["plan_schedule_s"]],
         "tokens_per_s": s["tokens_per_s"], "first_loss": s["first_loss"],
         "final_loss": s["final_loss"], "device_state_layers": s["device_state_layers"]}
  last = runlog.read_metrics(run)[-1]
  row.update({k: last[k] for k in ("reward_accuracy", "reward_margin") if k in last})
  log(f"{name}: {row}")
  return row


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python benchmarks/recipes.py", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("out", help="folder for the runs and summary.json")
  p.add_argument("--steps", type=int, default=100)
  p.add_argument("--smoke", action="store_true", help="toy sizes on the CPU, in seconds")
  args = p.parse_args(argv)
  out = Path(args.out).resolve()
  out.mkdir(parents=True, exist_ok=True)
  steps, accum_steps = (3, 2) if args.smoke else (args.steps, 20)
  model = SMOKE_MODEL if args.smoke else []
  cpu = ["engine.compute_dtype=float32", "engine.device_state_layers=0"] if args.smoke else []
  config = "configs/llama3.2_1b.yaml"
  rows = []
  with tempfile.TemporaryDirectory(prefix="recipes.") as tmp:
    work = Path(tmp)
    corpus(work, smoke=True)  # 40 files: enough text for a tokenizer of sums and chat markup
    tok = tokenizer(work, 1024 if args.smoke else 8192)
    # DPO's reference pass reads every pair once: as many as its steps take, and a few more
    sharegpt, preference = write_sources(work, 200 if args.smoke else 20000,
                                         400 if args.smoke else 10 * steps)
    sft, dpo = work / "sft", work / "dpo"
    sh("-m", "mtjax.data", "prepare", "--tokenizer", str(tok), "--format", "sharegpt", "--out",
       str(sft), "--quiet", str(sharegpt))
    sh("-m", "mtjax.data", "prepare", "--tokenizer", str(tok), "--format", "preference", "--out",
       str(dpo), "--quiet", str(preference))
    seq = 64 if args.smoke else 1024
    common = [*model, *cpu, "data.source=prepared", "optim.warmup_steps=10", "train.log_every=10"]
    rows.append(train(out, "sft_sharegpt", config, *common, f"data.path={sft}",
                      f"train.steps={steps}", "train.batch=8", f"train.seq={seq}",
                      f"train.export_dir={work / 'sft_export'}", "train.export_dtype=float32"))
    # a model trained from scratch exports no tokenizer: the one its data was prepared with goes
    # beside it, as a Hugging Face directory holds (the DPO run checks its data against it)
    for name in ("tokenizer.json", "tokenizer_config.json"):
      shutil.copy(tok / name, work / "sft_export" / name)
    rows.append(train(out, "dpo_preference", config, *common, f"data.path={dpo}",
                      f"model.from_hf={work / 'sft_export'}",
                      "train.objective=dpo", "train.dpo.beta=0.1", "optim.lr=2e-5",
                      f"train.steps={steps}", "train.batch=16", "train.seq=64"))
    for k in (1, 4):
      rows.append(train(out, f"sft_b32_accum{k}", config, *common, f"data.path={sft}",
                        f"train.steps={accum_steps}", "train.batch=32", f"train.seq={seq}",
                        f"train.grad_accum={k}"))
  (out / "summary.json").write_text(json.dumps(rows, indent=1))
  print(f"{'run':<18} {'batch x seq':>12} {'step s':>8} {'plan s':>13} {'tokens/s':>9} "
        f"{'loss':>15} {'reward acc':>10}")
  for r in rows:
    print(f"{r['run']:<18} {r['batch']:>5} x {r['seq']:<5} {r['step_s']:8.3f} "
          f"{r['plan_s'][0]:6.3f}-{r['plan_s'][1]:.3f} {r['tokens_per_s']:9,.0f} "
          f"{r['first_loss']:6.3f} -> {r['final_loss']:.3f} "
          f"{r.get('reward_accuracy', float('nan')):10.2f}")
  k1, k4 = rows[-2]["step_s"], rows[-1]["step_s"]
  print(f"grad_accum 4 against 1 at the same batch: {k4 / k1:.2f}x the step time")
  return 0


if __name__ == "__main__":
  sys.exit(main())
