"""Does fine-tuning a Hugging Face model work end to end, and how fast is it beside mtjax's own
init? With no hub: build a ~1B Llama-3.2-shaped model with transformers, train a BPE tokenizer on
real text found on the machine (Python's standard library sources), prepare the data, fine-tune
with `model.from_hf` (held-out loss every 50 steps), export, time the same shape from mtjax's own
init, then load the export with transformers and compare its logits with mtjax's. Each mtjax
command runs in a process of its own, as a user runs it.

    PYTHONUNBUFFERED=1 python benchmarks/finetune.py OUTDIR [--steps 200] [--smoke]

Writes OUTDIR/finetune.json, own_init.json and summary.json. `--smoke` runs the whole script at
toy sizes on the CPU (a 2-layer model, 4 steps) in seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # mtjax itself, imported below for the logits comparison

# vocab, hidden, layers, heads, kv heads, ffn, seq
FULL = (32000, 2048, 16, 32, 8, 8192, 1024)
SMOKE = (512, 64, 2, 4, 2, 128, 64)
T0 = time.perf_counter()


def log(msg):
  print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


def sh(*args, timeout=600):
  """Runs `python ARGS...` from the repository root; ends the script if it fails."""
  log("$ " + " ".join(args))
  r = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout,
                     cwd=ROOT, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                         [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])})
  print(r.stdout[-3000:], r.stderr[-3000:] if r.returncode else "", flush=True)
  if r.returncode:
    raise SystemExit(f"failed: {args}")
  return r


def phases(metrics: Path) -> dict:
  """Medians of the step's parts after the first step (metrics.jsonl), and of the step over each
  quarter of the run (does it drift?)."""
  rows = [r for r in map(json.loads, metrics.read_text().splitlines()) if "step_s" in r][1:]
  if not rows:
    return {}
  n = len(rows)
  quarters = [rows[i * n // 4:(i + 1) * n // 4] for i in range(4)]
  parts = ("step_s", "forward_s", "backward_s", "finish_s", "device_wait_s")
  return {**{k: statistics.median(r[k] for r in rows) for k in parts},
          "step_s_by_quarter": [statistics.median(r["step_s"] for r in part)
                                for part in quarters if part]}


def corpus(work: Path, smoke: bool) -> Path:
  """The standard library's sources, one document per file."""
  stdlib = Path(sysconfig.get_paths()["stdlib"])
  files = sorted(p for p in stdlib.rglob("*.py")
                 if "test" not in p.parts and p.stat().st_size > 500)
  files = files[:40] if smoke else files
  (work / "corpus").mkdir(parents=True)
  for i, p in enumerate(files):
    try:
      (work / "corpus" / f"{i:05d}.txt").write_text(p.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
      pass
  n_bytes = sum(p.stat().st_size for p in (work / "corpus").iterdir())
  log(f"corpus: {len(files)} files, {n_bytes / 1e6:.1f} MB from {stdlib}")
  return work / "corpus"


def hf_model(work: Path, shape) -> tuple[Path, int]:
  """A byte-level BPE tokenizer of its own and a Llama-3.2-shaped model built by transformers."""
  import torch
  import transformers
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  V, D, L, H, KV, F, _ = shape
  model_dir = work / "hf_model"
  model_dir.mkdir()
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  tok.train([str(p) for p in sorted((work / "corpus").iterdir())],
            trainers.BpeTrainer(vocab_size=V, special_tokens=["<|endoftext|>"],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  tok.save(str(model_dir / "tokenizer.json"))
  (model_dir / "tokenizer_config.json").write_text(json.dumps(
      {"eos_token": "<|endoftext|>", "tokenizer_class": "PreTrainedTokenizerFast"}))
  log(f"tokenizer: vocab {tok.get_vocab_size()}")
  hf_cfg = transformers.LlamaConfig(
      vocab_size=V, hidden_size=D, intermediate_size=F, num_hidden_layers=L,
      num_attention_heads=H, num_key_value_heads=KV, tie_word_embeddings=True, rms_norm_eps=1e-5,
      rope_theta=500000.0, max_position_embeddings=131072,
      rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
      eos_token_id=0, bos_token_id=0)
  torch.manual_seed(0)
  m = transformers.LlamaForCausalLM(hf_cfg).to(torch.bfloat16)
  n_params = sum(p.numel() for p in m.parameters())
  m.save_pretrained(model_dir, max_shard_size="1GB")
  log(f"hf model: {n_params / 1e9:.3f}B params, bf16, "
      f"{len(list(model_dir.glob('*.safetensors')))} shards")
  return model_dir, n_params


def export_vs_mtjax(work: Path, model_dir: Path, data_dir: Path, vocab: int, device: str):
  """Relative L2 error and argmax agreement of the export's logits (transformers, fp32) against
  mtjax's for the trained weights."""
  import jax
  import numpy as np
  import torch
  import transformers

  import mtjax
  from mtjax import checkpoint, cli, store
  cfg = cli.load_config(ROOT / "configs/finetune.yaml", [
      f"model.from_hf={model_dir}", f"data.path={data_dir}", "engine.device_state_layers=0",
      "engine.device_update_layers=0"])
  st = store.create(cfg, jax.random.key(0))
  checkpoint.restore(st, checkpoint.latest(work / "ck"))
  ids = np.random.default_rng(0).integers(0, vocab, (2, 256)).astype(np.int32)
  with jax.default_matmul_precision("highest"):
    ours = np.asarray(mtjax.forward(st.model_cfg, st.to_tree(), ids))
  torch.backends.cuda.matmul.allow_tf32 = False
  exported = transformers.AutoModelForCausalLM.from_pretrained(
      work / "export", dtype=torch.float32, attn_implementation="eager").to(device).eval()
  with torch.no_grad():
    theirs = exported(torch.tensor(ids, dtype=torch.long).to(device)).logits.float().cpu().numpy()
  rel = float(np.linalg.norm(ours - theirs) / np.linalg.norm(theirs))
  agree = float(np.mean(ours.argmax(-1) == theirs.argmax(-1)))
  log(f"export vs mtjax logits (fp32, 2x256 tokens): rel err {rel:.2e}, max abs "
      f"{np.abs(ours - theirs).max():.2e}, argmax agreement {agree:.4f}")
  return rel, agree


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python benchmarks/finetune.py", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("out", help="folder for the run summaries")
  p.add_argument("--steps", type=int, default=200)
  p.add_argument("--smoke", action="store_true", help="toy sizes on the CPU, in seconds")
  args = p.parse_args(argv)
  shape = SMOKE if args.smoke else FULL
  steps = 4 if args.smoke else args.steps
  V, D, L, H, KV, F, SEQ = shape
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  with tempfile.TemporaryDirectory(prefix="finetune.") as tmp:
    work = Path(tmp)
    corpus(work, args.smoke)
    model_dir, n_params = hf_model(work, shape)
    data_dir = work / "data"
    sh("-m", "mtjax.data", "prepare", "--tokenizer", str(model_dir), "--out", str(data_dir),
       "--format", "text", "--val-fraction", "0.05", "--workers", "8", str(work / "corpus"))
    common = [f"engine.compute_dtype={'float32' if args.smoke else 'bfloat16'}", "train.batch=8",
              f"train.seq={SEQ}", "optim.lr=3e-4",
              "optim.warmup_steps=20", "optim.weight_decay=0.0", "train.log_every=10"]
    if args.smoke:
      common.append("engine.device_state_layers=0")  # the CPU: nothing to gain on the device
    sh("-m", "mtjax.train", "--config", "configs/finetune.yaml", "--no-progress", "--show-plan",
       "--json", str(out / "finetune.json"), f"model.from_hf={model_dir}",
       "data.source=prepared", f"data.path={data_dir}", f"train.steps={steps}",
       f"train.eval_every={min(50, steps)}", "train.eval_batches=8",
       f"train.checkpoint_dir={work / 'ck'}", f"train.export_dir={work / 'export'}",
       "train.export_dtype=float32", f"train.run_dir={work / 'run'}", *common)
    ft = json.loads((out / "finetune.json").read_text())
    ft["phases"] = phases(work / "run" / "metrics.jsonl")
    log(f"fine-tune: loss {ft['first_loss']:.3f} -> {ft['final_loss']:.3f}, held-out "
        f"{ft['held_out']}, {ft['tokens_per_s']:,.0f} tokens/s")
    sh("-m", "mtjax.train", "--config", "configs/finetune.yaml", "--no-progress",
       "--json", str(out / "own_init.json"), "data.source=prepared", f"data.path={data_dir}",
       f"train.steps={min(20, steps)}", f"model.vocab_size={V}", f"model.hidden={D}",
       f"model.layers={L}", f"model.heads={H}", f"model.kv_heads={KV}", f"model.ffn={F}",
       "model.tie_embeddings=true", "model.rope_theta=500000.0",
       f"train.run_dir={work / 'run_own'}", *common)
    # Last: this process's own jax and torch then hold GPU memory that no run of mtjax plans for.
    rel, agree = export_vs_mtjax(work, model_dir, data_dir, V, "cpu" if args.smoke else "cuda")
  own = json.loads((out / "own_init.json").read_text())
  summary = {"hf_params": n_params, "finetune": ft, "own_init": own, "logits_rel_err": rel,
             "argmax_agreement": agree}
  (out / "summary.json").write_text(json.dumps(summary, indent=1))
  log(f"step: fine-tune {ft['step_s_median']:.3f} s vs own init {own['step_s_median']:.3f} s")
  return 0


if __name__ == "__main__":
  sys.exit(main())
