"""Fine-tune a Hugging Face model on chat conversations, end to end at toy size (a CPU minute).

python examples/finetune_chat.py WORKDIR

The steps, each the command a user runs (printed as it runs):
  1. a tiny "pretrained" model directory: a BPE tokenizer with a ChatML template, and weights that
     mtjax pre-trains for a few steps and exports (a user starts from their own HF directory);
  2. a chat jsonl: {"messages": [{"role": "user", ...}, {"role": "assistant", ...}]} per line;
  3. python -m mtjax.data prepare --format chat: renders with the template, masks the loss to the
     assistant's tokens, holds out a share of conversations;
  4. python -m mtjax.train --config configs/finetune.yaml model.from_hf=BASE data.path=DATA ...
     with held-out loss and a Hugging Face export at the end;
  5. the held-out loss of the base model and of the export, the same batches for both.
Everything it writes lands under WORKDIR (the runs' metrics in WORKDIR/runs); WORKDIR/summary.json
holds the numbers and paths.
"""
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
work = Path(sys.argv[1]).absolute()
work.mkdir(parents=True, exist_ok=True)
t0 = time.perf_counter()

# Qwen2.5's ChatML template, trimmed of tools: the format most chat models use.
CHATML = (
    "{%- for message in messages %}"
    "{%- if loop.first and message['role'] != 'system' %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
WORDS = ("red green blue black white apple pear plum grape lemon cat dog bird fish horse river "
         "stone cloud tree house road ship star moon sun rain snow wind fire sand").split()


def sh(*args):
  """Runs `python ARGS` as a user would type it, and stops the example if it fails."""
  print(f"[{time.perf_counter() - t0:5.1f}s] $ python {' '.join(map(str, args))}", flush=True)
  env = {**os.environ, "PYTHONPATH": str(ROOT)}
  r = subprocess.run([sys.executable, *map(str, args)], cwd=ROOT, env=env, text=True,
                     capture_output=True)
  print(r.stdout.strip())
  if r.returncode:
    sys.exit(f"failed ({r.returncode}):\n{r.stderr[-3000:]}")


rng = random.Random(0)
for d in ("tokenizer", "base_model", "base_data", "chat_data", "finetuned", "runs"):
  shutil.rmtree(work / d, ignore_errors=True)

# 1a. Plain text the base model "knows": sentences over the same words the chats use.
base_text = work / "base_text.jsonl"
with open(base_text, "w") as f:
  for _ in range(600):
    f.write(json.dumps({"text": " ".join(rng.choices(WORDS, k=rng.randint(6, 16))) + "."}) + "\n")

# 1b. A byte-level BPE tokenizer with ChatML's special tokens; tokenizer_config.json carries the
# chat template and the eos token, as a Hugging Face model directory does.
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
tok_dir = work / "tokenizer"
tok_dir.mkdir()
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
phrases = ["system user assistant You are a helpful assistant.", "Repeat these words:",
           "Reverse these words:"]
tok.train_from_iterator(
    phrases * 50 + [json.loads(l)["text"] for l in base_text.read_text().splitlines()],
    trainers.BpeTrainer(vocab_size=384, special_tokens=SPECIALS, show_progress=False,
                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
tok.add_special_tokens(SPECIALS)  # marked special: the renderer never splits them
tok.save(str(tok_dir / "tokenizer.json"))
(tok_dir / "tokenizer_config.json").write_text(json.dumps({
    "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
    "pad_token": "<|endoftext|>", "chat_template": CHATML}, indent=1))
vocab = tok.get_vocab_size(with_added_tokens=True)

# 1c. Base weights: mtjax pre-trains a tiny Llama from scratch and exports it as a Hugging Face
# directory. With a real model, skip all of step 1 and pass its directory as model.from_hf.
base = work / "base_model"
sh("-m", "mtjax.data", "prepare", "--tokenizer", tok_dir, "--out", work / "base_data",
   "--format", "jsonl", "--eos", "<|endoftext|>", "--val-fraction", "0.05", "--quiet", base_text)
sh("-m", "mtjax.train", "--config", "configs/tiny.yaml", "--no-progress",
   f"model.vocab_size={vocab}", "data.source=prepared", f"data.path={work / 'base_data'}",
   "train.steps=60", f"train.export_dir={base}", "train.export_dtype=float32",
   f"train.run_dir={work / 'runs' / 'base'}")
for name in ("tokenizer.json", "tokenizer_config.json"):
  shutil.copy(tok_dir / name, base / name)

# 2. The chat data: the assistant repeats or reverses the user's words, which a tiny model can
# learn in a few dozen steps; one conversation per line.
chats = work / "chats.jsonl"
with open(chats, "w") as f:
  for _ in range(400):
    words = rng.sample(WORDS, rng.randint(3, 6))
    reverse = rng.random() < 0.5
    answer = words[::-1] if reverse else words
    msgs = [{"role": "user", "content": f"{'Reverse' if reverse else 'Repeat'} these words: "
                                        + " ".join(words)},
            {"role": "assistant", "content": " ".join(answer)}]
    f.write(json.dumps({"messages": msgs}) + "\n")

# 3. Render with the model's template, mask the loss to the assistant turns, hold out 10%.
data_dir = work / "chat_data"
sh("-m", "mtjax.data", "prepare", "--tokenizer", base, "--out", data_dir, "--format", "chat",
   "--val-fraction", "0.1", "--quiet", chats)

# 4. Fine-tune. configs/finetune.yaml is sized for a GPU and a real model (bf16, seq 1024, lr 2e-5);
# the overrides shrink it to toy size and raise the learning rate for a model this small.
out = work / "finetuned"
toy = ["engine.compute_dtype=float32", "engine.loss_chunk=256", "train.batch=8", "train.seq=128",
       "optim.lr=3e-3", "optim.warmup_steps=5", "train.eval_batches=4"]
sh("-m", "mtjax.train", "--config", "configs/finetune.yaml", "--no-progress",
   "--json", work / "train_summary.json", f"model.from_hf={base}", f"data.path={data_dir}",
   "train.steps=80", "train.eval_every=20", f"train.export_dir={out}",
   "train.export_dtype=float32", f"train.run_dir={work / 'runs' / 'finetune'}", *toy)

# 5. Held-out loss of the base model and of the export, on the same held-out batches as training
# uses, through the library (loading an export back checks it too).
from mtjax import cli, data, engine, hf, launch, store


def held_out_loss(model_dir: Path) -> float:
  cfg = cli.load_config(ROOT / "configs/finetune.yaml",
                    [f"model.from_hf={model_dir}", f"data.path={data_dir}", *toy])
  cfg, _ = launch.plan_run(cfg)  # before the first jax call, as in examples/custom_loop.py
  import jax
  st = store.create(cfg, jax.random.key(0))
  hf.load_into(st, model_dir)
  eng = engine.Engine(cfg, st)
  tc = cfg.train
  batches = data.validation_batches(cfg.data, tc.batch, tc.seq, cfg.model.vocab_size)
  try:
    return eng.evaluate(b for _, b in zip(range(tc.eval_batches), batches))
  finally:
    eng.close()


before, after = held_out_loss(base), held_out_loss(out)
during = json.loads((work / "train_summary.json").read_text())["held_out"]
print(f"held-out loss during fine-tuning (step, loss): {during}")
print(f"held-out loss before: {before:.4f}")
print(f"held-out loss after: {after:.4f}")
print(f"export: {out} ({', '.join(sorted(p.name for p in out.iterdir()))})")
summary = {"held_out_before": before, "held_out_after": after, "held_out_during": during,
           "base_model": str(base), "export_dir": str(out), "vocab_size": vocab}
(work / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
print(f"[{time.perf_counter() - t0:5.1f}s] done; {work / 'summary.json'}")
