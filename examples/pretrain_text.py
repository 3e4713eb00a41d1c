"""Pre-train a small model from scratch on a folder of text files (a CPU minute at toy size).

python examples/pretrain_text.py WORKDIR [TEXT_DIR]

The steps, each the command a user runs (printed as it runs):
  1. a folder of text files, one document each (default: a few dozen of the Python standard
     library's sources, real text found on any machine);
  2. a byte-level BPE tokenizer trained on that folder (tokenizer.json, tokenizer_config.json);
  3. python -m mtjax.data prepare --format text: tokenizes, holds out a share of the files;
  4. python -m mtjax.train with the model shape as overrides: packed documents, held-out loss
     every few steps, a checkpoint at the end;
  5. python -m mtjax.export: the checkpoint as a Hugging Face directory.
Everything it writes lands under WORKDIR (the run's metrics in WORKDIR/runs); WORKDIR/summary.json
holds the numbers and paths.
"""
import json
import math
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
work = Path(sys.argv[1]).absolute()
work.mkdir(parents=True, exist_ok=True)
t0 = time.perf_counter()


def sh(*args):
  """Runs `python ARGS` as a user would type it, and stops the example if it fails."""
  print(f"[{time.perf_counter() - t0:5.1f}s] $ python {' '.join(map(str, args))}", flush=True)
  env = {**os.environ, "PYTHONPATH": str(ROOT)}
  r = subprocess.run([sys.executable, *map(str, args)], cwd=ROOT, env=env, text=True,
                     capture_output=True)
  print(r.stdout.strip())
  if r.returncode:
    sys.exit(f"failed ({r.returncode}):\n{r.stderr[-3000:]}")


for d in ("tokenizer", "data", "checkpoints", "export", "runs"):
  shutil.rmtree(work / d, ignore_errors=True)

# 1. The corpus. With your own, pass its folder: prepare reads every file under it, recursively.
if len(sys.argv) > 2:
  corpus = Path(sys.argv[2]).absolute()
else:
  corpus = work / "corpus"
  shutil.rmtree(corpus, ignore_errors=True)
  corpus.mkdir()
  stdlib = Path(sysconfig.get_paths()["stdlib"])
  # Mid-sized modules in a fixed order: the same corpus, and so the same run, on every machine.
  files = sorted(p for p in stdlib.glob("*.py") if 4_000 < p.stat().st_size < 40_000)[:48]
  for p in files:
    shutil.copy(p, corpus / (p.stem + ".txt"))
  print(f"corpus: {len(files)} files from {stdlib}")

# 2. A tokenizer of its own: byte-level BPE, so any text encodes; <|endoftext|> ends documents.
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

tok_dir = work / "tokenizer"
tok_dir.mkdir()
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
tok.train(sorted(str(p) for p in corpus.rglob("*") if p.is_file()),
          trainers.BpeTrainer(vocab_size=1024, special_tokens=["<|endoftext|>"],
                              show_progress=False,
                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
tok.save(str(tok_dir / "tokenizer.json"))
(tok_dir / "tokenizer_config.json").write_text(json.dumps(
    {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"}, indent=1))
vocab = tok.get_vocab_size(with_added_tokens=True)

# 3. One document per file; 10% of the files held out for the held-out loss.
data_dir = work / "data"
sh("-m", "mtjax.data", "prepare", "--tokenizer", tok_dir, "--out", data_dir, "--format", "text",
   "--val-fraction", "0.1", "--quiet", corpus)

# 4. Train from scratch: no config file, the shape and the run as overrides. Packed rows: each row
# of train.seq tokens holds pieces of several documents, attention kept within each one.
ck = work / "checkpoints"
model = [f"model.vocab_size={vocab}", "model.hidden=64", "model.layers=2", "model.heads=4",
         "model.kv_heads=2", "model.ffn=176", "model.tie_embeddings=true"]
run = ["data.source=prepared", f"data.path={data_dir}", "data.mode=packed",
       "engine.compute_dtype=float32", "engine.loss_chunk=256", "optim.lr=3e-3",
       "optim.warmup_steps=10", "train.steps=150", "train.batch=8", "train.seq=128",
       "train.eval_every=25", "train.eval_batches=4", f"train.checkpoint_dir={ck}",
       f"train.run_dir={work / 'runs'}"]
# --config is required; an empty file leaves every setting to its default or an override above.
(work / "empty.yaml").write_text("{}\n")
sh("-m", "mtjax.train", "--config", work / "empty.yaml", "--no-progress",
   "--json", work / "train_summary.json", *model, *run)

# 5. The newest checkpoint as a Hugging Face directory (config.json and safetensors; add the
# tokenizer files to use it with transformers).
out = work / "export"
sh("-m", "mtjax.export", "--checkpoint", ck, "--out", out, "--dtype", "float32")
for name in ("tokenizer.json", "tokenizer_config.json"):
  shutil.copy(tok_dir / name, out / name)

held = json.loads((work / "train_summary.json").read_text())["held_out"]
print(f"held-out loss (step, loss): {held}")
print(f"held-out loss before: {held[0][1]:.4f} (step {held[0][0]}; untrained: ln(vocab) = "
      f"{math.log(vocab):.2f})")
print(f"held-out loss after: {held[-1][1]:.4f} (step {held[-1][0]})")
print(f"export: {out} ({', '.join(sorted(p.name for p in out.iterdir()))})")
summary = {"held_out_before": held[0][1], "held_out_after": held[-1][1], "held_out": held,
           "checkpoint_dir": str(ck), "export_dir": str(out), "vocab_size": vocab}
(work / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
print(f"[{time.perf_counter() - t0:5.1f}s] done; {work / 'summary.json'}")
