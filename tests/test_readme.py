"""The README's command blocks, run as written on tiny fixtures, so the README cannot drift from
the code: every ```bash block's commands (the pip install and the test command itself excepted)
and the ```python block, with the placeholders (MODEL, DATA, CK, OUT, ...) and the data files it
names (alpaca.json, chats.parquet, prefs.jsonl, image_chats.jsonl) made here at toy size.

Train commands get size overrides appended (the shipped configs are sized for a GPU); nothing else
of a command is changed.
"""

import json
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from test_chat import make_tokenizer

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
# appended to every `mtjax.train` command: a few steps of short sequences in float32 on the CPU
TOY = ["train.steps=2", "train.batch=2", "train.seq=96", "train.eval_batches=1",
       "engine.compute_dtype=float32", "engine.loss_chunk=64", "optim.lr=1e-3"]
SKIPPED = ("python -m pip install", "python -m pytest")  # CI runs these two itself


def blocks(lang: str) -> list[str]:
  return re.findall(rf"```{lang}\n(.*?)```", README.read_text(), re.S)


def commands(block: str) -> list[str]:
  """A bash block's commands: continuation lines joined, comments dropped, `&&` chains split."""
  text = re.sub(r"\\\n\s*", " ", block)
  out = []
  for line in text.splitlines():
    line = line.split(" #")[0].strip()
    if line and not line.startswith("#"):
      out += [c.strip() for c in line.split("&&")]
  return out


def tiny_model(directory: Path):
  """A transformers Llama of a tiny shape with a ChatML BPE tokenizer: a Hugging Face directory."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  make_tokenizer(directory)
  vocab = json.loads((directory / "tokenizer.json").read_text())["model"]["vocab"]
  size = max(vocab.values()) + 1 + 8  # room for the added special tokens
  torch.manual_seed(0)
  hf = transformers.LlamaConfig(vocab_size=size, hidden_size=32, intermediate_size=64,
                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                max_position_embeddings=256, eos_token_id=None)
  transformers.LlamaForCausalLM(hf).save_pretrained(directory)


def data_files(work: Path):
  """The three files the README's data commands name, a few rows of each layout."""
  import pyarrow as pa
  import pyarrow.parquet as pq
  rows = [{"instruction": f"Add {i} and {i + 1}.", "input": "", "output": str(2 * i + 1)}
          for i in range(30)]
  (work / "alpaca.json").write_text(json.dumps(rows))
  chats = [[{"from": "human", "value": f"Say {w}."}, {"from": "gpt", "value": f"{w}!"}]
           for w in ("hello", "paris", "tower", "numbers", "spaces") * 6]
  pq.write_table(pa.table({"conversations": chats}), work / "chats.parquet")
  with open(work / "prefs.jsonl", "w") as f:
    for i in range(200):
      f.write(json.dumps({"prompt": f"What is {i} + {i}?", "chosen": str(2 * i),
                          "rejected": str(2 * i + 1)}) + "\n")


def tiny_llava(directory: Path, work: Path):
  """A transformers LLaVA of a tiny shape with its processor's files (test_data_images' CLIP
  processor and content-part template) and `image_chats.jsonl` of a few one-image chats."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  from PIL import Image
  from tokenizers import Tokenizer
  import test_data_images as di
  from test_chat import SPECIALS
  make_tokenizer(directory, template=di.TEMPLATE, specials=SPECIALS + ["<image>"])
  di.write_processor(directory)
  tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
  torch.manual_seed(0)
  c = transformers.LlavaConfig(
      vision_config=transformers.CLIPVisionConfig(
          hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
          image_size=di.SIDE, patch_size=di.PATCH, projection_dim=16),
      text_config=transformers.LlamaConfig(
          vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=64,
          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
      image_token_id=tok.token_to_id("<image>"))
  transformers.LlavaForConditionalGeneration(c).save_pretrained(directory)
  rng = np.random.default_rng(0)
  (work / "imgs").mkdir()
  with open(work / "image_chats.jsonl", "w") as f:
    for i in range(12):
      Image.fromarray(rng.integers(0, 256, (30 + i, 40, 3), np.uint8)).save(
          work / "imgs" / f"{i}.png")
      f.write(json.dumps({"messages": [
          {"role": "user", "content": [{"type": "image", "image": f"imgs/{i}.png"},
                                       {"type": "text", "text": "What is this?"}]},
          {"role": "assistant", "content": f"Picture {i}."}]}) + "\n")


@pytest.fixture(scope="module")
def work(tmp_path_factory):
  w = tmp_path_factory.mktemp("readme")
  tiny_model(w / "MODEL")
  data_files(w)
  tiny_llava(w / "LLAVA", w)
  return w


def substitute(command: str, work: Path) -> list[str]:
  """The command's words with the README's placeholders as paths under `work`."""
  names = r"\b(MODEL|DATA|CK|OUT2|OUT_DPO|OUT|PREFS|LLAVA|VDATA|VOUT)\b"
  words = []
  for word in shlex.split(command):
    word = re.sub(names, lambda m: str(work / m.group(1)), word)
    for f in ("alpaca.json", "chats.parquet", "prefs.jsonl", "image_chats.jsonl"):
      word = str(work / f) if word == f else word
    words.append(word)
  return words


def run(words: list[str]) -> subprocess.CompletedProcess:
  assert words[0] == "python", words
  return subprocess.run([sys.executable, *words[1:]], cwd=ROOT, capture_output=True, text=True,
                        timeout=600)


def test_readme_bash_blocks_run_as_written(work):
  ran = []
  for block in blocks("bash"):
    for command in commands(block):
      if command.startswith(SKIPPED):
        continue
      words = substitute(command, work)
      if words[1:3] == ["-m", "mtjax.train"] and "configs/tiny.yaml" not in words:
        words += TOY
      r = run(words)
      assert r.returncode == 0, f"README command failed ({r.returncode}): {command}\n{r.stderr[-2000:]}"
      ran.append(words[2] if words[1] == "-m" else words[1])
  # the whole workflow ran: tiny run, prepare, fine-tune, export, preference prepare, DPO
  assert ran.count("mtjax.train") >= 3 and ran.count("mtjax.data") >= 2 and "mtjax.export" in ran
  out = work / "OUT"
  assert (out / "config.json").is_file() and list(out.glob("*.safetensors"))
  assert (work / "OUT_DPO" / "config.json").is_file()
  assert (work / "VOUT" / "processor_config.json").is_file()  # the image chats' fine-tune
  assert json.loads((work / "VDATA" / "meta.json").read_text())["images"]
  transformers = pytest.importorskip("transformers")
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(work / "OUT2")
  assert reloaded.config.num_hidden_layers == 2


def test_readme_python_block_runs(work):
  code, = blocks("python")
  scope = {}
  exec(textwrap.dedent(code).replace('"MODEL"', repr(str(work / "MODEL"))), scope)  # the README's own code
  vocab = scope["cfg"].vocab_size
  assert scope["logits"].shape == (1, 4, vocab)
  assert "model.layers.1.self_attn.q_proj.weight" in scope["tensors"]
  assert all(np.all(np.isfinite(v)) for v in scope["tensors"].values())
