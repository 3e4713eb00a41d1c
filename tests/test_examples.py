"""The workflow examples run end to end, writing only under their work folder: held-out loss falls;
the exports are Hugging Face models."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent


def files(folder: Path) -> set[Path]:
  """Every file under `folder` but Python's bytecode caches."""
  return {p.relative_to(folder) for p in folder.rglob("*")
          if p.is_file() and "__pycache__" not in p.parts}


def run_example(name: str, tmp_path: Path) -> tuple[dict, Path]:
  """Runs examples/NAME from a copy of the repository, which it must leave as it found it (its
  files go to its work folder only); returns its summary and the work folder."""
  repo, work = tmp_path / "repo", tmp_path / "work"
  for part in ("mtjax", "configs", "examples"):
    shutil.copytree(ROOT / part, repo / part, ignore=shutil.ignore_patterns("__pycache__"))
  before = files(repo)
  r = subprocess.run([sys.executable, str(repo / "examples" / name), str(work)], cwd=repo,
                     env={**os.environ, "PYTHONPATH": str(repo)}, capture_output=True, text=True,
                     timeout=300)
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  new = sorted(map(str, files(repo) - before))
  assert not new, f"{name} wrote into the repository: {new[:5]}"
  # The printed lines and summary.json say the same thing; the README shows the printed ones.
  printed = {k: float(line.split(":")[1].split()[0]) for line in r.stdout.splitlines()
             for k in ("before", "after") if line.startswith(f"held-out loss {k}:")}
  s = json.loads((work / "summary.json").read_text())
  assert printed == pytest.approx({"before": s["held_out_before"], "after": s["held_out_after"]},
                                  abs=1e-4)
  return s, work


def assert_hf_directory(path: Path, vocab: int):
  config = json.loads((path / "config.json").read_text())
  assert config["vocab_size"] == vocab and config["architectures"] == ["LlamaForCausalLM"]
  assert list(path.glob("*.safetensors"))
  assert (path / "tokenizer.json").is_file()


@pytest.mark.soak  # half a minute of CPU; the README's tiny run pretrains in the default run
def test_pretrain_text(tmp_path):
  s, work = run_example("pretrain_text.py", tmp_path)
  assert len(s["held_out"]) >= 2 and s["held_out_after"] < s["held_out_before"]
  assert list((work / "checkpoints").glob("step_*"))
  assert (work / "runs" / "metrics.jsonl").is_file()
  assert_hf_directory(Path(s["export_dir"]), s["vocab_size"])


@pytest.mark.soak  # long; the README run's time budget (the soak runs it)
def test_finetune_chat(tmp_path):
  s, work = run_example("finetune_chat.py", tmp_path)
  assert {p.name for p in (work / "runs").iterdir()} == {"base", "finetune"}
  # before: the base model on the held-out chats; after: the export, reloaded, on the same batches.
  assert s["held_out_after"] < s["held_out_before"] - 0.5
  assert s["held_out_after"] == pytest.approx(s["held_out_during"][-1][1], rel=1e-4)
  export = Path(s["export_dir"])
  assert_hf_directory(export, s["vocab_size"])

  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  # transformers reads the export (weights, config, tokenizer with its chat template) on its own.
  tok = transformers.AutoTokenizer.from_pretrained(export)
  msgs = [{"role": "user", "content": "Repeat these words: red cat moon"},
          {"role": "assistant", "content": "red cat moon"}]
  ids = tok.apply_chat_template(msgs, tokenize=True, return_dict=True)["input_ids"]
  prompt = tok.apply_chat_template(msgs[:1], tokenize=True, return_dict=True,
                                   add_generation_prompt=True)["input_ids"]
  assert ids[:len(prompt)] == prompt
  ids = torch.tensor([ids], dtype=torch.long)

  def answer_loss(path):
    m = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
      logits = m(ids).logits
    assert logits.shape == (1, ids.shape[1], s["vocab_size"])
    assert torch.isfinite(logits).all()
    # Loss on the answer and its end-of-turn token, the targets the chat loss mask counts (not the
    # newline the template renders after them).
    nll = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="none")
    return float(nll[len(prompt) - 1:-1].mean())

  assert answer_loss(export) < answer_loss(s["base_model"])
