"""prepare on the dataset formats and sources users bring: token ids and loss masks equal to
transformers' apply_chat_template (generation tags) of the conversations written out by hand; the
same rows in every source kind give the same files; mixtures; bad rows; atomic output; checksums."""

import csv
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from mtjax import config, data
from mtjax.data.tokenize import Options
from test_chat import CHATML_TAGGED, hf_tokenizer, make_tokenizer, runs
from test_data import prepare_cli

pa = pytest.importorskip("pyarrow")
import pyarrow.parquet as pq

SYSTEM = "Be brief."

# Each format: rows, and the conversations (or texts) they hold, written out by hand.
ROWS = {
    "alpaca": (
        [{"instruction": "What is the capital of France?", "input": "", "output": "Paris."},
         {"instruction": "Add these numbers.", "input": "1234 and 56", "output": "1290",
          "system": SYSTEM}],
        [[{"role": "user", "content": "What is the capital of France?"},
          {"role": "assistant", "content": "Paris."}],
         [{"role": "system", "content": SYSTEM},
          {"role": "user", "content": "Add these numbers.\n1234 and 56"},
          {"role": "assistant", "content": "1290"}]]),
    "sharegpt": (
        [{"conversations": [{"from": "human", "value": "Hello, how are you?"},
                            {"from": "gpt", "value": "I am fine, thank you."}]},
         {"conversations": [{"from": "system", "value": SYSTEM},
                            {"from": "human", "value": "What is the capital of France?"},
                            {"from": "gpt", "value": "Paris."},
                            {"from": "human", "value": "And 1234?"},
                            {"from": "gpt", "value": "A number."}]}],
        [[{"role": "user", "content": "Hello, how are you?"},
          {"role": "assistant", "content": "I am fine, thank you."}],
         [{"role": "system", "content": SYSTEM},
          {"role": "user", "content": "What is the capital of France?"},
          {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And 1234?"},
          {"role": "assistant", "content": "A number."}]]),
    "messages": (
        [{"messages": [{"role": "user", "content": "Hello world."},
                       {"role": "assistant", "content": "Hello, how are you?"}]},
         {"messages": [{"role": "system", "content": SYSTEM},
                       {"role": "user", "content": "The quick brown fox?"},
                       {"role": "assistant", "content": "Jumps over the lazy dog."}]}],
        [[{"role": "user", "content": "Hello world."},
          {"role": "assistant", "content": "Hello, how are you?"}],
         [{"role": "system", "content": SYSTEM},
          {"role": "user", "content": "The quick brown fox?"},
          {"role": "assistant", "content": "Jumps over the lazy dog."}]]),
    "prompt_completion": (
        [{"prompt": "What is the capital of France?", "completion": "Paris."},
         {"prompt": "Numbers like 1234?", "completion": "And 56.", "system": SYSTEM}],
        [[{"role": "user", "content": "What is the capital of France?"},
          {"role": "assistant", "content": "Paris."}],
         [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Numbers like 1234?"},
          {"role": "assistant", "content": "And 56."}]]),
    "text": (
        [{"text": "The quick brown fox jumps over the lazy dog."}, {"text": "hello world"}],
        ["The quick brown fox jumps over the lazy dog.", "hello world"]),
}
FLAT = ("alpaca", "prompt_completion", "text")  # formats a CSV file can hold
FILES = ("jsonl", "json", "csv", "parquet")  # source kinds that are one file


def write_source(rows, kind, path):
  """The rows as a file (or datasets folder) of `kind`; returns its path."""
  names = list(dict.fromkeys(k for r in rows for k in r))  # every row's columns, absent as None
  columns = {k: [r.get(k) for r in rows] for k in names}
  if kind == "jsonl":
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  elif kind == "json":
    path.write_text(json.dumps(rows))
  elif kind == "csv":
    with open(path, "w", newline="") as f:
      w = csv.DictWriter(f, names)
      w.writeheader()
      w.writerows(rows)
  elif kind == "parquet":
    pq.write_table(pa.table(columns), path)
  elif kind == "shards":  # a folder: the first row in a Parquet shard, the rest in an Arrow file
    path.mkdir()
    table = pa.table(columns)
    pq.write_table(table.slice(0, 1), path / "part-0.parquet")
    with pa.ipc.new_file(str(path / "part-1.arrow"), table.schema) as f:
      f.write_table(table.slice(1))
  elif kind == "datasets":
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict(columns).save_to_disk(str(path))
  return path


def documents(d, split="train", stem=None):
  """The prepared documents of a split as [(ids, mask or None)]."""
  stem = d / (stem or split)
  meta = json.loads((d / "meta.json").read_text())
  toks = np.fromfile(f"{stem}.bin", meta["dtype"]).astype(np.int64)
  idx = np.fromfile(f"{stem}.idx", np.uint64).astype(np.int64)
  mask = np.fromfile(f"{stem}.mask", np.uint8) if Path(f"{stem}.mask").exists() else None
  return [(toks[a:b], None if mask is None else mask[a:b]) for a, b in zip(idx[:-1], idx[1:])]


def reference(hf, msgs):
  """transformers' ids and assistant mask of a conversation."""
  out = hf.apply_chat_template(msgs, tokenize=True, return_dict=True,
                               return_assistant_tokens_mask=True)
  return np.asarray(out["input_ids"]), np.asarray(out["assistant_masks"], np.uint8)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
  return make_tokenizer(tmp_path_factory.mktemp("tok"), CHATML_TAGGED)


@pytest.fixture(scope="module")
def hf(tok_dir):
  return hf_tokenizer(tok_dir)


def prep(tok_dir, out, inputs, fmt, **kw):
  kw.setdefault("val_fraction", 0)
  return data.prepare(tok_dir, out, [str(i) for i in inputs], fmt, progress=False, **kw)


@pytest.mark.parametrize("fmt", list(ROWS))
def test_formats_and_sources_give_the_template_rendering(tmp_path, tok_dir, hf, fmt):
  rows, want = ROWS[fmt]
  tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
  eos = tok.token_to_id("<|im_end|>")
  kinds = ["jsonl", "json", "parquet", "shards", "datasets"] + (["csv"] if fmt in FLAT else [])
  files = {}
  for kind in kinds:
    src = write_source(rows, kind, tmp_path / (f"rows.{kind}" if kind in FILES else kind))
    out = tmp_path / f"out_{kind}"
    meta = prep(tok_dir, out, [src], fmt)
    assert meta["splits"]["train"]["documents"] == len(rows)
    assert not meta["stats"][0]["skipped"]
    files[kind] = {n: (out / n).read_bytes() for n in ("train.bin", "train.idx", "train.mask")
                   if (out / n).exists()}
  for kind in kinds[1:]:  # the same rows, whatever holds them: the same bytes
    assert files[kind] == files["jsonl"], kind
  got = documents(tmp_path / "out_jsonl")
  for (ids, mask), w in zip(got, want):
    if fmt == "text":
      np.testing.assert_array_equal(ids, tok.encode(w, add_special_tokens=False).ids + [eos])
      assert mask is None
    else:
      ref_ids, ref_mask = reference(hf, w)
      np.testing.assert_array_equal(ids, ref_ids)
      np.testing.assert_array_equal(mask, ref_mask)
  # auto tells each source's format from its first row, and says which it picked
  lines = []
  meta = data.prepare(tok_dir, tmp_path / "auto", [str(tmp_path / "rows.parquet")], "auto",
                      val_fraction=0, progress=False, log=lines.append)
  assert meta["formats"] == [fmt] and lines == [f"{tmp_path / 'rows.parquet'}: format {fmt} (auto)"]
  assert (tmp_path / "auto" / "train.bin").read_bytes() == files["jsonl"]["train.bin"]


def test_columns_roles_history_and_mask_options(tmp_path, tok_dir, hf):
  rows = [{"q": "hi", "a": "hello", "ctx": "", "sys": SYSTEM, "past": [["Hello world.", "Hi."]]}]
  src = write_source(rows, "jsonl", tmp_path / "a.jsonl")
  prep(tok_dir, tmp_path / "a", [src], "alpaca",
       columns={"instruction": "q", "output": "a", "input": "ctx", "system": "sys",
                "history": "past"})
  want = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello world."},
          {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "hi"},
          {"role": "assistant", "content": "hello"}]
  ((ids, mask),) = documents(tmp_path / "a")
  ref_ids, ref_mask = reference(hf, want)
  np.testing.assert_array_equal(ids, ref_ids)
  np.testing.assert_array_equal(mask, ref_mask)
  # --last-turn-only: the last assistant turn's tokens only; --train-on-prompt: every token
  prep(tok_dir, tmp_path / "last", [src], "alpaca", columns={
      "instruction": "q", "output": "a", "system": "sys", "history": "past"},
      options=Options(last_turn_only=True))
  ((ids2, last),) = documents(tmp_path / "last")
  turns = runs(ref_mask.astype(int))
  assert len(turns) == 2
  want_last = np.zeros_like(ref_mask)
  want_last[turns[-1][0]:turns[-1][1]] = 1
  np.testing.assert_array_equal(ids2, ref_ids)
  np.testing.assert_array_equal(last, want_last)
  prep(tok_dir, tmp_path / "all", [src], "alpaca", columns={
      "instruction": "q", "output": "a", "system": "sys", "history": "past"},
      options=Options(train_on_prompt=True))
  ((_, every),) = documents(tmp_path / "all")
  assert every.all()
  # ShareGPT items under other keys and roles: --columns role/content, --roles
  rows = [{"chat": [{"speaker": "bot", "text": "hi"}, {"speaker": "me", "text": "Hello world."},
                    {"speaker": "bot", "text": "Hello, how are you?"}]}]
  src = write_source(rows, "parquet", tmp_path / "s.parquet")
  prep(tok_dir, tmp_path / "s", [src], "sharegpt",
       columns={"conversations": "chat", "role": "speaker", "content": "text"},
       roles={"bot": "assistant", "me": "user"})
  ((ids, mask),) = documents(tmp_path / "s")
  ref = reference(hf, [{"role": "assistant", "content": "hi"},
                       {"role": "user", "content": "Hello world."},
                       {"role": "assistant", "content": "Hello, how are you?"}])
  np.testing.assert_array_equal(ids, ref[0])
  np.testing.assert_array_equal(mask, ref[1])


def test_max_len_truncates_or_drops(tmp_path, tok_dir, hf):
  rows, want = ROWS["messages"]
  src = write_source(rows, "jsonl", tmp_path / "m.jsonl")
  ref = [reference(hf, w) for w in want]
  n = len(ref[1][0]) - 3  # cuts the second conversation's answer, not the first one
  assert len(ref[0][0]) <= n and ref[1][1][:n].any()
  meta = prep(tok_dir, tmp_path / "t", [src], "messages", options=Options(max_len=n))
  got = documents(tmp_path / "t")
  np.testing.assert_array_equal(got[1][0], ref[1][0][:n])
  np.testing.assert_array_equal(got[1][1], ref[1][1][:n])
  assert meta["stats"][0]["truncated"] == 1
  meta = prep(tok_dir, tmp_path / "d", [src], "messages",
              options=Options(max_len=n, overflow="drop"))
  ((ids, _),) = documents(tmp_path / "d")
  np.testing.assert_array_equal(ids, ref[0][0])
  assert meta["stats"][0]["skipped"]["longer than --max-len"]["count"] == 1


def test_preference_pairs_share_the_prompt(tmp_path, tok_dir, hf):
  rows = [{"prompt": "What is the capital of France?", "chosen": "Paris.", "rejected": "Rome."},
          {"prompt": "Add 1234 and 56.", "chosen": "1290", "rejected": "I do not know, sorry.",
           "system": SYSTEM}]
  convo = [{"prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}],
            "chosen": [{"role": "assistant", "content": "Hello, how are you?"}],
            "rejected": [{"role": "assistant", "content": "Go away."}]}]
  files = {}
  for kind in ("jsonl", "parquet", "datasets"):
    src = write_source(rows, kind, tmp_path / f"p.{kind}")
    meta = prep(tok_dir, tmp_path / kind, [src], "preference")
    files[kind] = {p.name: p.read_bytes() for p in (tmp_path / kind).iterdir()
                   if p.name not in ("meta.json", "stats.json")}
  assert files["parquet"] == files["jsonl"] == files["datasets"]
  assert meta["pairs"] and sorted(files["jsonl"]) == sorted(
      [f"{s}.{side}.{ext}" for s in ("train", "val") for side in ("chosen", "rejected")
       for ext in ("bin", "idx", "mask")] + ["train.prefix", "val.prefix"])
  extra = write_source(convo, "jsonl", tmp_path / "c.jsonl")
  prep(tok_dir, tmp_path / "both", [tmp_path / "p.jsonl", extra], "preference")
  pairs = data.read_pairs(tmp_path / "both", "train")
  assert len(pairs) == 3
  prompts = [[{"role": "user", "content": rows[0]["prompt"]}],
             [{"role": "system", "content": SYSTEM},
              {"role": "user", "content": rows[1]["prompt"]}],
             convo[0]["prompt"]]
  answers = [(r["chosen"], r["rejected"]) for r in rows] + [("Hello, how are you?", "Go away.")]
  want = {}
  for p, (c, r) in zip(prompts, answers):
    prefix = len(hf.apply_chat_template(p, tokenize=True, add_generation_prompt=True,
                                        return_dict=True)["input_ids"])
    sides = [reference(hf, p + [{"role": "assistant", "content": a}]) for a in (c, r)]
    want[tuple(sides[0][0])] = (sides, prefix)
  for i in range(len(pairs)):  # a mixture of two sources: stored in a seeded shuffle
    c, cm, r, rm = pairs.pair(i)
    (ref_c, ref_r), prefix = want.pop(tuple(c))
    np.testing.assert_array_equal(cm, ref_c[1])
    np.testing.assert_array_equal(r, ref_r[0])
    np.testing.assert_array_equal(rm, ref_r[1])
    assert pairs.prefix[i] == prefix and not cm[:prefix].any() and cm[prefix]
  assert not want
  with pytest.raises(ValueError, match="holds preference pairs"):
    data.source(config.DataConfig(source="prepared", path=str(tmp_path / "both")), 1, 8, 320, 0)


def test_mixture_weights_epochs_and_held_out_per_source(tmp_path, tok_dir):
  tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
  alpha, beta = tok.token_to_id("a"), tok.token_to_id("b")
  a = write_source([{"text": f"a {i}"} for i in range(120)], "jsonl", tmp_path / "a.jsonl")
  b = write_source([{"text": f"b {i}"} for i in range(60)], "parquet", tmp_path / "b.parquet")

  def sources(out, split="train"):
    docs = documents(out, split)
    first = np.array([ids[0] for ids, _ in docs])
    assert set(first) <= {alpha, beta}
    return first == alpha, [tuple(ids) for ids, _ in docs]

  meta = prep(tok_dir, tmp_path / "w", [a, b], "text", weights=[1, 3], seed=4)
  is_a, docs = sources(tmp_path / "w")
  # 180 training documents, a quarter from a (each row at most once), three quarters from b
  # (every row twice, 15 of them three times)
  assert len(docs) == 180 and is_a.sum() == 45
  assert [s["documents"]["train"] for s in meta["stats"]] == [45, 135]
  a_docs, b_docs = [d for d, x in zip(docs, is_a) if x], [d for d, x in zip(docs, is_a) if not x]
  assert len(set(a_docs)) == 45 and len(set(b_docs)) == 60
  assert sorted(np.unique([b_docs.count(d) for d in set(b_docs)])) == [2, 3]
  # the order is one seeded shuffle: a's share of any stretch is near a quarter
  for lo in (0, 90):
    share = is_a[lo:lo + 90].mean()
    assert abs(share - 0.25) < 3 * np.sqrt(0.25 * 0.75 / 90), share
  again = prep(tok_dir, tmp_path / "w2", [a, b], "text", weights=[1, 3], seed=4)
  assert (tmp_path / "w2" / "train.bin").read_bytes() == (tmp_path / "w" / "train.bin").read_bytes()
  assert again["checksums"] == meta["checksums"]
  prep(tok_dir, tmp_path / "w3", [a, b], "text", weights=[1, 3], seed=5)
  assert (tmp_path / "w3" / "train.bin").read_bytes() != (tmp_path / "w" / "train.bin").read_bytes()

  meta = prep(tok_dir, tmp_path / "e", [a, b], "text", epochs=[0.5, 2], val_fraction=0.1)
  is_a, docs = sources(tmp_path / "e")
  assert is_a.sum() == 54 and (~is_a).sum() == 108  # 108 of a's rows, half; 54 of b's, twice
  val_a, val_docs = sources(tmp_path / "e", "val")
  assert val_a.sum() == 12 and (~val_a).sum() == 6  # a tenth of each source, once
  assert not set(val_docs) & set(docs)
  assert [s["documents"] for s in meta["stats"]] == [{"train": 54, "val": 12},
                                                     {"train": 108, "val": 6}]
  with pytest.raises(ValueError, match="--weights: 0 is not a positive number"):
    prep(tok_dir, tmp_path / "bad", [a, b], "text", weights=[1, 0])
  with pytest.raises(ValueError, match="--epochs: 1 values for 2 inputs"):
    prep(tok_dir, tmp_path / "bad", [a, b], "text", epochs=[1])
  assert not (tmp_path / "bad").exists()


BAD = {  # case: (format, rows or file bytes, columns, reason, what the first one says)
    "missing mapped column": ("alpaca", [{"instruction": "hi", "output": "ok"},
                                         {"instruction": "hi", "answer": "ok"}],
                              {}, "missing column",
                              r"rows\.jsonl:2: no column 'output' .*--columns output=COLUMN.*"
                              r"the row has columns instruction, answer"),
    "unknown role": ("sharegpt", [{"conversations": [{"from": "human", "value": "hi"},
                                                     {"from": "gpt", "value": "ok"}]},
                                  {"conversations": [{"from": "human", "value": "hi"},
                                                     {"from": "bot", "value": "ok"}]}],
                     {}, "unknown role",
                     r"rows\.jsonl:2: messages\[1\] has unknown role 'bot' .*--roles bot=ROLE"),
    "empty assistant turn": ("messages", [{"messages": [{"role": "user", "content": "hi"},
                                                        {"role": "assistant", "content": "ok"}]},
                                          {"messages": [{"role": "user", "content": "hi"},
                                                        {"role": "assistant", "content": ""}]}],
                             {}, "empty assistant turn",
                             r"rows\.jsonl:2: messages\[1\] is an empty assistant message"),
    "no rejected answer": ("preference", [{"prompt": "hi", "chosen": "a", "rejected": "b"},
                                          {"prompt": "hi", "chosen": "a"}],
                           {}, "no rejected answer",
                           r"rows\.jsonl:2: no rejected answer \(column 'rejected'\)"),
    "not parquet": ("text", None, {}, "unreadable file", r"bad\.parquet: not a Parquet file"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_rows_are_counted_and_skipped_or_refused_with_strict(tmp_path, tok_dir, case):
  fmt, rows, columns, reason, first = BAD[case]
  good = write_source([{"text": "hello world"}], "jsonl", tmp_path / "good.jsonl")
  if rows is None:
    src = tmp_path / "bad.parquet"
    src.write_text('{"text": "a JSON line under a Parquet name"}\n')
    inputs = [good, src]
  else:
    inputs = [write_source(rows, "jsonl", tmp_path / "rows.jsonl")]
  meta = prep(tok_dir, tmp_path / "out", inputs, fmt, columns=columns)
  skipped = meta["stats"][-1]["skipped"]
  assert list(skipped) == [reason] and skipped[reason]["count"] == 1
  assert re.search(first, skipped[reason]["first"]), skipped[reason]["first"]
  assert meta["splits"]["train"]["documents"] == 1
  # --strict: one line, exit 2, and --out as it was
  before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
  r = prepare_cli("--tokenizer", tok_dir, "--out", tmp_path / "out", "--format", fmt,
                  "--val-fraction", "0", "--quiet", "--strict", *inputs, cwd=tmp_path)
  lines = r.stderr.strip().splitlines()
  assert r.returncode == 2 and len(lines) == 1 and re.search(first, lines[0]), r.stderr
  assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == before
  assert not list(tmp_path.glob(".out.prepare-*"))


def test_cli_summary_json_and_weight_errors(tmp_path, tok_dir):
  a = write_source(ROWS["alpaca"][0], "jsonl", tmp_path / "a.jsonl")
  b = write_source(ROWS["sharegpt"][0], "parquet", tmp_path / "b.parquet")
  r = prepare_cli("--tokenizer", tok_dir, "--out", tmp_path / "out", "--format", "auto",
                  "--weights", "1,1", "--val-fraction", "0", "--quiet", "--json",
                  tmp_path / "s.json", a, b, cwd=tmp_path)
  assert r.returncode == 0, r.stderr
  assert f"{a}: format alpaca (auto)" in r.stdout and f"{b}: format sharegpt (auto)" in r.stdout
  summary = json.loads((tmp_path / "s.json").read_text())
  assert summary == json.loads((tmp_path / "out" / "meta.json").read_text())
  assert [s["format"] for s in summary["stats"]] == ["alpaca", "sharegpt"]
  assert sum(s["documents"]["train"] for s in summary["stats"]) == 4
  for weights, error in (("1,-2", r"--weights: -2 is not a positive number"),
                         ("1,x", r"argument --weights: '1,x' is not a comma-separated list")):
    r = prepare_cli("--tokenizer", tok_dir, "--out", tmp_path / "o2", "--weights", weights,
                    "--quiet", a, b, cwd=tmp_path)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and re.search(error, lines[0]), r.stderr


def test_checksums_refuse_altered_files(tmp_path, tok_dir):
  src = write_source([{"text": f"hello world {i}"} for i in range(40)], "jsonl",
                     tmp_path / "t.jsonl")
  meta = prep(tok_dir, tmp_path / "out", [src], "text", val_fraction=0.1)
  assert set(meta["checksums"]) == {"train.bin", "train.idx", "val.bin", "val.idx"}
  cfg = config.DataConfig(source="prepared", path=str(tmp_path / "out"))
  data.source(cfg, 1, 4, 320, 0).batch(0)
  f = tmp_path / "out" / "train.bin"
  raw = bytearray(f.read_bytes())
  raw[7] ^= 1  # one bit of one token: sizes and ids still pass, the checksum does not
  f.write_bytes(bytes(raw))
  with pytest.raises(ValueError, match=r"train\.bin does not match its crc32c in meta\.json"):
    data.source(cfg, 1, 4, 320, 0)
  f.write_bytes(bytes(raw[:-2]))
  with pytest.raises(ValueError, match=r"train\.bin holds \d+ bytes; meta\.json implies"):
    data.source(cfg, 1, 4, 320, 0)


def test_a_killed_prepare_leaves_out_as_it_was_and_a_rerun_finishes(tmp_path, tok_dir):
  small = write_source([{"text": "hello world"}] * 4, "jsonl", tmp_path / "small.jsonl")
  prep(tok_dir, tmp_path / "out", [small], "text")
  before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
  big = tmp_path / "big.jsonl"
  big.write_text("".join(json.dumps({"text": f"the quick brown fox {i}"}) + "\n"
                         for i in range(30_000)))
  env = {**os.environ, "PYTHONPATH": str(Path(data.__file__).parents[2])}
  proc = subprocess.Popen([sys.executable, "-m", "mtjax.data", "prepare", "--tokenizer",
                           str(tok_dir), "--out", str(tmp_path / "out"), "--quiet", str(big)],
                          env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  part = tmp_path / ".out.prepare-tmp" / "train.bin"
  deadline = time.time() + 60
  while not (part.exists() and part.stat().st_size > 0) and proc.poll() is None \
      and time.time() < deadline:
    time.sleep(0.005)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  assert part.exists(), "prepare ended before it could be killed mid-way"
  assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == before
  meta = prep(tok_dir, tmp_path / "out", [big], "text", val_fraction=0.01)
  prep(tok_dir, tmp_path / "ref", [big], "text", val_fraction=0.01)
  assert not (tmp_path / ".out.prepare-tmp").exists()
  for name in meta["checksums"]:
    assert (tmp_path / "out" / name).read_bytes() == (tmp_path / "ref" / name).read_bytes()


def test_a_failed_write_leaves_out_as_it_was(tmp_path, tok_dir, monkeypatch):
  src = write_source([{"text": "hello world"}] * 4, "jsonl", tmp_path / "t.jsonl")
  prep(tok_dir, tmp_path / "out", [src], "text")
  before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
  from mtjax.data import tokenize

  def full(self, ids, mask):
    raise OSError(28, "No space left on device", str(self.paths["bin"]))

  monkeypatch.setattr(tokenize._Docs, "add", full)
  with pytest.raises(OSError, match=r"--out: cannot write .*train\.bin \(No space left") as e:
    prep(tok_dir, tmp_path / "out", [src], "text")
  assert e.value.errno == 28  # kept for the exit code: a full disk is the machine's, not the input's
  assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == before
  assert not list(tmp_path.glob(".out.prepare-*"))


def test_the_disk_estimate_holds_the_output_and_a_short_disk_is_refused(tmp_path, tok_dir,
                                                                         monkeypatch, capsys):
  """prepare's estimate of its output (from the inputs' bytes, Parquet uncompressed) is at least
  what every format writes from JSONL and Parquet, repeats of a mixture included; with less free
  space than the estimate, `prepare` is refused in one line with both numbers (exit 2) and writes
  nothing, and --allow-low-disk runs it."""
  from mtjax.data import tokenize
  from mtjax.data.__main__ import main as prepare_main
  pref = [{"prompt": "What is the capital of France?", "chosen": "Paris.", "rejected": "Rome."}]
  estimates, ratios = {}, {}
  real_usage = tokenize.shutil.disk_usage

  def recorded(out, needed):  # the estimate each prepare checks
    estimates[out] = needed
  monkeypatch.setattr(tokenize, "check_disk", recorded)
  for fmt, (rows, _) in {**ROWS, "preference": (pref * 3, None)}.items():
    for kind in ("jsonl", "parquet"):
      src = write_source(rows * 4, kind, tmp_path / f"{fmt}.{kind}")
      out = tmp_path / f"out-{fmt}-{kind}"
      prep(tok_dir, out, [src, src], fmt, epochs=[2.0, 1.5])
      # tokens and masks against the estimate less its 1 MiB for the index files
      written = sum(f.stat().st_size for f in out.iterdir()
                    if f.suffix not in (".json", ".idx", ".prefix"))
      assert written <= estimates[out] - 2**20, (fmt, kind, written, estimates[out])
      ratios[fmt, kind] = written / (estimates[out] - 2**20)
  monkeypatch.undo()
  assert max(ratios.values()) > 0.3, ratios  # a bound, not a multiple of the output

  src = write_source(ROWS["alpaca"][0] * 50, "jsonl", tmp_path / "a.jsonl")
  free = real_usage(tmp_path).free
  monkeypatch.setattr(tokenize.shutil, "disk_usage",
                      lambda p: real_usage(p)._replace(free=1000))
  args = ["--tokenizer", str(tok_dir), "--out", str(tmp_path / "short"), "--format", "alpaca",
          "--quiet", str(src)]
  with pytest.raises(SystemExit) as e:
    prepare_main(["prepare", *args])
  err = capsys.readouterr().err.strip().splitlines()
  assert e.value.code == 2 and len(err) == 1, err
  assert re.search(r"--out: .* has 0\.0 MiB free, the prepared data may take \d+\.\d MiB", err[0])
  assert "--allow-low-disk" in err[0] and not (tmp_path / "short").exists()
  assert not list(tmp_path.glob(".short.*"))
  prepare_main(["prepare", *args, "--allow-low-disk"])
  assert (tmp_path / "short" / "meta.json").is_file() and free > 0
