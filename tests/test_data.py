"""Data: deterministic batches from the synthetic stream and from a flat token file."""

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, processors

from mtjax import config, data
from mtjax.data import chat
from test_chat import CHATML_TAGGED, CONVERSATIONS, SPECIALS, TEMPLATES, make_tokenizer


def test_synthetic_is_deterministic_shifted_and_in_range():
  a = data.synthetic_batch(3, 4, 16, 50, seed=1)
  b = data.synthetic_batch(3, 4, 16, 50, seed=1)
  c = data.synthetic_batch(4, 4, 16, 50, seed=1)
  np.testing.assert_array_equal(a.inputs, b.inputs)
  assert not np.array_equal(a.inputs, c.inputs)
  np.testing.assert_array_equal(a.inputs[:, 1:], a.targets[:, :-1])
  assert a.inputs.dtype == np.int32 and a.inputs.min() >= 0 and a.inputs.max() < 50
  step = (a.targets - a.inputs) % 50
  assert np.all(step == step[:, :1])  # one stride per sequence: learnable


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_token_file_windows(tmp_path, dtype):
  toks = np.arange(1000, dtype=dtype) % 300
  path = tmp_path / "toks.bin"
  toks.tofile(path)
  cfg = config.DataConfig(source="tokens", path=str(path), dtype=dtype)
  it = data.batches(cfg, batch=3, seq=8, vocab=300, seed=0)
  b0, b1 = next(it), next(it)
  again = next(data.batches(cfg, batch=3, seq=8, vocab=300, seed=0, start_step=1))
  np.testing.assert_array_equal(b1.inputs, again.inputs)
  for row_in, row_t in zip(b0.inputs, b0.targets):
    start = int(np.flatnonzero(toks == row_in[0])[0])
    np.testing.assert_array_equal(row_in, toks[start:start + 8])
    np.testing.assert_array_equal(row_t, toks[start + 1:start + 9])


def test_token_file_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="data.path"):
    data.TokenFile(tmp_path / "missing.bin", "uint16", 10)
  short = tmp_path / "short.bin"
  np.arange(5, dtype=np.uint16).tofile(short)
  with pytest.raises(ValueError, match="fewer"):
    data.TokenFile(short, "uint16", 10).batch(0, 1, 8, 0)
  big = tmp_path / "big.bin"
  np.full(100, 70, np.uint16).tofile(big)
  with pytest.raises(ValueError, match="vocab_size"):
    data.TokenFile(big, "uint16", 64).batch(0, 1, 8, 0)


# ---------------------------------------------------------------------------------------------
# Prepared documents: prepare (tokenize + split + write), loading checks, packed / padded batches.


PAD = 0


def write_prepared(d, splits, vocab=500, masks=None, dtype="uint16"):
  """Writes a prepared directory by hand: {split: [doc token lists]}, optional {split: [doc masks]}."""
  d.mkdir(parents=True, exist_ok=True)
  meta = {"dtype": dtype, "vocab_size": vocab, "pad_id": PAD, "eos_id": 1,
          "has_mask": masks is not None, "splits": {}}
  for s, docs in splits.items():
    np.concatenate([np.asarray(x) for x in docs]).astype(dtype).tofile(d / f"{s}.bin")
    np.concatenate([[0], np.cumsum([len(x) for x in docs])]).astype(np.uint64).tofile(d / f"{s}.idx")
    if masks is not None:
      np.concatenate([np.asarray(m) for m in masks[s]]).astype(np.uint8).tofile(d / f"{s}.mask")
    meta["splits"][s] = {"documents": len(docs), "tokens": int(sum(len(x) for x in docs))}
  (d / "meta.json").write_text(json.dumps(meta))
  return d


def prepared_cfg(d, **kw):
  return config.DataConfig(source="prepared", path=str(d), **kw)


def test_validation_packing_by_hand(tmp_path):
  a, b, c = [11, 12, 13], [21, 22, 23, 24], [31, 32]
  d = write_prepared(tmp_path, {"train": [a], "val": [a, b, c]},
                     masks={"train": [[1, 1, 1]], "val": [[0, 1, 1], [0, 0, 1, 1], [1, 1]]})
  (b0,) = list(data.validation_batches(prepared_cfg(d), batch=3, seq=4, vocab=500))
  # rows of 5 overlapping by one: [a0 a1 a2 b0 b1] [b1 b2 b3 c0 c1], a padding row fills the batch
  np.testing.assert_array_equal(b0.inputs, [[11, 12, 13, 21], [22, 23, 24, 31], [PAD] * 4])
  assert b0.inputs.shape == (3, 4) and not b0.loss_weights[2].any()
  b0 = data.Batch(*(None if getattr(b0, f.name) is None else getattr(b0, f.name)[:2]
                    for f in dataclasses.fields(b0)))
  np.testing.assert_array_equal(b0.targets, [[12, 13, 21, 22], [23, 24, 31, 32]])
  np.testing.assert_array_equal(b0.positions, [[0, 1, 2, 0], [0, 1, 2, 0]])
  np.testing.assert_array_equal(b0.segments, [[0, 0, 0, 1], [0, 0, 0, 1]])
  # weight = mask of the target, 0 across a document boundary and on padding
  np.testing.assert_array_equal(b0.loss_weights, [[1, 1, 0, 0], [1, 1, 0, 1]])
  short = list(data.validation_batches(prepared_cfg(d), batch=1, seq=5, vocab=500))
  np.testing.assert_array_equal([b.inputs[0] for b in short], [[11, 12, 13, 21, 22],
                                                                [23, 24, 31, 32, PAD]])
  np.testing.assert_array_equal(short[1].segments[0], [0, 0, 1, 1, 2])
  np.testing.assert_array_equal(short[1].loss_weights[0], [1, 0, 1, 0, 0])
  assert b0.inputs.dtype == np.int32 and b0.positions.dtype == np.int32
  assert b0.segments.dtype == np.int32 and b0.loss_weights.dtype == np.float32

  padded = list(data.validation_batches(prepared_cfg(d, mode="padded"), batch=2, seq=3, vocab=500))
  assert len(padded) == 2
  np.testing.assert_array_equal(padded[0].inputs, [[11, 12, 13], [21, 22, 23]])
  np.testing.assert_array_equal(padded[0].targets, [[12, 13, PAD], [22, 23, 24]])  # b truncated
  np.testing.assert_array_equal(padded[0].segments, [[0, 0, 0], [0, 0, 0]])
  np.testing.assert_array_equal(padded[0].loss_weights, [[1, 1, 0], [0, 1, 1]])
  np.testing.assert_array_equal(padded[1].inputs, [[31, 32, PAD], [PAD, PAD, PAD]])
  np.testing.assert_array_equal(padded[1].segments, [[0, 0, 1], [0, 0, 0]])  # pad: own id
  np.testing.assert_array_equal(padded[1].positions[0], [0, 1, 0])
  np.testing.assert_array_equal(padded[1].loss_weights, [[1, 0, 0], [0, 0, 0]])


def doc_tokens(n_docs, rng):
  """Documents whose tokens name them: token = 20 * doc + offset + 1 (doc < 24, len < 20)."""
  return [20 * i + 1 + np.arange(rng.integers(1, 19)) for i in range(n_docs)]


def test_packed_epochs_cover_every_document_once_in_a_seeded_order(tmp_path):
  docs = doc_tokens(23, np.random.default_rng(0))
  d = write_prepared(tmp_path, {"train": docs, "val": docs[:1]})
  B, T = 3, 7
  src = data.source(prepared_cfg(d), B, T, vocab=500, seed=5)
  per_epoch = (sum(len(x) for x in docs) - 1) // T
  steps = 2 * per_epoch // B + 2  # past the second epoch
  rows = [r for s in range(steps) for r in zip(*(getattr(src.batch(s), f) for f in
                                                 ("inputs", "targets", "positions", "segments",
                                                  "loss_weights")))]
  for inp, tgt, pos, seg, w in rows:
    row = np.concatenate([inp, tgt[-1:]])
    doc, off = (row - 1) // 20, (row - 1) % 20
    same = doc[:-1] == doc[1:]
    # segments change exactly at document changes; positions count from each piece's start
    np.testing.assert_array_equal(seg[1:] != seg[:-1], ~same[:-1])
    np.testing.assert_array_equal(pos, off[:-1] - off[:-1][np.r_[0, np.flatnonzero(~same[:-1]) + 1]]
                                  [np.cumsum(np.r_[0, ~same[:-1]])])
    np.testing.assert_array_equal(w, same.astype(np.float32))
    np.testing.assert_array_equal(tgt[same], inp[same] + 1)  # next token of the same document
  orders = []
  for e in range(2):
    epoch = rows[e * per_epoch:(e + 1) * per_epoch]
    stream = np.concatenate([r[0] for r in epoch] + [epoch[-1][1][-1:]])  # rows overlap by one
    first = np.r_[0, np.flatnonzero(np.diff((stream - 1) // 20)) + 1]
    order = ((stream[first] - 1) // 20).tolist()
    for i, start in enumerate(first[1:-1], 1):  # every inner document appears whole, once
      np.testing.assert_array_equal(stream[start:first[i + 1]], docs[order[i]])
    assert len(set(order)) == len(order) >= len(docs) - 2  # the dropped tail holds at most 2
    orders.append(order)
  assert orders[0] != orders[1]  # a fresh shuffle each epoch
  other = data.source(prepared_cfg(d), B, T, vocab=500, seed=6).batch(0)
  assert not np.array_equal(other.inputs, src.batch(0).inputs)


@pytest.mark.parametrize("mode", ["packed", "padded"])
def test_resume_gives_the_same_batches(tmp_path, mode):
  docs = doc_tokens(9, np.random.default_rng(1))
  d = write_prepared(tmp_path, {"train": docs, "val": docs[:2]})
  cfg = prepared_cfg(d, mode=mode)
  it = data.batches(cfg, batch=2, seq=6, vocab=500, seed=3)
  run = [next(it) for _ in range(20)]  # several epochs
  for k in (0, 7, 19):
    again = next(data.batches(cfg, batch=2, seq=6, vocab=500, seed=3, start_step=k))
    for f in ("inputs", "targets", "positions", "segments", "loss_weights"):
      np.testing.assert_array_equal(getattr(run[k], f), getattr(again, f))
  pos = [data.position(cfg, 2, 6, 500, 3, s) for s in range(20)]
  assert pos[0]["epoch"] == 0 and pos[0]["index"] == 0 and pos[-1]["epoch"] >= 2
  assert all(p["index"] < p["per_epoch"] for p in pos)
  assert [p["epoch"] * p["per_epoch"] + p["index"] for p in pos] == [2 * s for s in range(20)]
  json.dumps(pos)  # saved with checkpoints
  if mode == "padded":
    assert all(np.all(b.loss_weights[b.segments == 1] == 0) for b in run)


def test_synthetic_and_token_sources_keep_their_batches(tmp_path):
  cfg = config.DataConfig()
  np.testing.assert_array_equal(next(data.batches(cfg, 2, 8, 50, seed=1, start_step=3)).inputs,
                                data.synthetic_batch(3, 2, 8, 50, seed=1).inputs)
  b = data.synthetic_batch(0, 2, 8, 50, 1)
  assert b.positions is None and b.segments is None and b.loss_weights is None
  assert data.position(cfg, 2, 8, 50, 1, 7)["step"] == 7


def test_prepared_checks(tmp_path):
  docs = [[5, 6, 7], [8, 9]]
  good = write_prepared(tmp_path / "good", {"train": docs, "val": docs})
  cfg = prepared_cfg(good)
  with pytest.raises(config.ConfigError, match="data.path"):
    config.DataConfig(source="prepared")
  with pytest.raises(FileNotFoundError, match="does not exist"):
    data.source(prepared_cfg(tmp_path / "nothing"), 1, 4, 500, 0)
  with pytest.raises(ValueError, match="model.vocab_size"):
    data.source(cfg, 1, 4, 400, 0)
  with pytest.raises(ValueError, match="fewer than train.seq"):
    data.source(cfg, 1, 5, 500, 0)
  data.source(cfg, 1, 4, 500, 0).batch(0)  # exactly one row of 5 tokens fits
  data.source(prepared_cfg(good, mode="padded"), 1, 64, 500, 0).batch(0)  # padding needs no length
  short = write_prepared(tmp_path / "short", {"train": docs, "val": docs})
  with open(short / "train.bin", "ab") as f:
    f.write(b"\0\0")
  with pytest.raises(ValueError, match="train.bin holds 12 bytes"):
    data.source(prepared_cfg(short), 1, 4, 500, 0)
  big = write_prepared(tmp_path / "big", {"train": [[5, 450]], "val": docs}, vocab=300)
  with pytest.raises(ValueError, match="token id 450"):
    data.source(prepared_cfg(big), 1, 1, 500, 0)
  (good / "val.idx").unlink()
  with pytest.raises(FileNotFoundError, match="val.idx"):
    next(data.validation_batches(cfg, 1, 4, 500))
  (good / "meta.json").unlink()
  with pytest.raises(FileNotFoundError, match="meta.json"):
    data.source(cfg, 1, 4, 500, 0)


def test_prepare_text_and_jsonl(tmp_path):
  tok_dir = make_tokenizer(tmp_path / "tok")
  tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
  eos = tok.token_to_id("<|im_end|>")
  corpus = tmp_path / "corpus"
  (corpus / "sub").mkdir(parents=True)
  texts = {f"sub/{i}.txt": f"The quick brown fox {i} jumps over the lazy dog." * (i + 1)
           for i in range(12)}
  texts[".hidden.txt"] = "skipped"
  for name, t in texts.items():
    (corpus / name).write_text(t)
  meta = data.prepare(tok_dir, tmp_path / "out", [str(corpus)], val_fraction=0.25, seed=1,
                      progress=False)
  assert meta["splits"]["train"]["documents"] == 9 and meta["splits"]["val"]["documents"] == 3
  assert meta["dtype"] == "uint16" and meta["vocab_size"] == tok.get_vocab_size()
  expect = {tuple(tok.encode(t, add_special_tokens=False).ids + [eos])
            for n, t in texts.items() if not n.startswith(".")}
  got = {}
  for s in ("train", "val"):
    toks = np.fromfile(tmp_path / "out" / f"{s}.bin", np.uint16)
    idx = np.fromfile(tmp_path / "out" / f"{s}.idx", np.uint64)
    got[s] = {tuple(toks[a:b].tolist()) for a, b in zip(idx[:-1], idx[1:])}
  assert got["train"] | got["val"] == expect and not got["train"] & got["val"]
  again = data.prepare(tok_dir, tmp_path / "again", [str(corpus)], val_fraction=0.25, seed=1,
                       progress=False)
  assert again["splits"] == meta["splits"]
  assert (tmp_path / "again" / "val.bin").read_bytes() == (tmp_path / "out" / "val.bin").read_bytes()
  data.prepare(tok_dir, tmp_path / "other", [str(corpus)], val_fraction=0.25, seed=2,
                       progress=False)
  assert (tmp_path / "other" / "val.bin").read_bytes() != (tmp_path / "out" / "val.bin").read_bytes()
  batch = next(data.batches(prepared_cfg(tmp_path / "out"), 2, 16, tok.get_vocab_size(), 0))
  assert batch.loss_weights.sum() > 0

  lines = tmp_path / "docs.jsonl"
  lines.write_text("\n".join(json.dumps({"body": f"hello world {i}"}) for i in range(5)) + "\n\n")
  meta = data.prepare(tok_dir, tmp_path / "j", [str(lines)], fmt="jsonl", text_field="body",
                      val_fraction=0, progress=False)
  toks = np.fromfile(tmp_path / "j" / "train.bin", np.uint16).tolist()
  want = sum((tok.encode(f"hello world {i}", add_special_tokens=False).ids + [eos]
              for i in range(5)), [])
  assert toks == want and meta["splits"]["val"]["documents"] == 0


def test_prepare_chat_writes_the_assistant_mask(tmp_path):
  tok_dir = make_tokenizer(tmp_path / "tok")
  tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
  lines = [{"messages": m} for m in CONVERSATIONS] + [{"prompt": "Hello?", "response": "Paris."}]
  f = tmp_path / "chat.jsonl"
  f.write_text("".join(json.dumps(x) + "\n" for x in lines))
  meta = data.prepare(tok_dir, tmp_path / "out", [str(f)], fmt="chat", val_fraction=0,
                      progress=False)
  assert meta["has_mask"] and meta["splits"]["train"]["documents"] == 3
  template = chat.ChatTemplate.from_tokenizer(tok_dir)
  msgs = [m["messages"] for m in lines[:2]] + [[{"role": "user", "content": "Hello?"},
                                                {"role": "assistant", "content": "Paris."}]]
  want = [chat.encode_chat(tok, template, m) for m in msgs]
  # the template ends each conversation with "<|im_end|>\n": it ends with EOS (<|im_end|>) and
  # whitespace already, so no second EOS is appended
  eos = tok.token_to_id("<|im_end|>")
  assert all(eos in ids[-3:] for ids, _ in want)
  toks = np.fromfile(tmp_path / "out" / "train.bin", np.uint16)
  mask = np.fromfile(tmp_path / "out" / "train.mask", np.uint8)
  np.testing.assert_array_equal(toks, np.concatenate([i for i, _ in want]))
  np.testing.assert_array_equal(mask, np.concatenate([m for _, m in want]))
  b = next(data.validation_batches(prepared_cfg(tmp_path / "out"), 4, 128, tok.get_vocab_size(),
                                   split="train"))
  counted = b.targets[b.loss_weights > 0]
  assert len(counted) == mask.sum() and eos in counted  # every assistant token, end of turn too
  assert tok.decode(counted.tolist(), skip_special_tokens=True).startswith("I am fine")


def test_prepare_errors(tmp_path):
  tok_dir = make_tokenizer(tmp_path / "tok")
  out = tmp_path / "out"
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"text": "ok"}\n{"text": oops}\n')
  with pytest.raises(ValueError, match=r"bad.jsonl:2: bad JSON"):
    data.prepare(tok_dir, out, [str(bad)], fmt="jsonl", val_fraction=0, progress=False,
                 strict=True)
  bad.write_text('{"text": "ok"}\n\n{"other": 1}\n')
  with pytest.raises(ValueError, match=r"bad.jsonl:3: no column 'text' .*columns other"):
    data.prepare(tok_dir, out, [str(bad)], fmt="jsonl", val_fraction=0, progress=False,
                 strict=True)
  bad.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
  with pytest.raises(ValueError, match=r"bad.jsonl:1: .*no assistant"):
    data.prepare(tok_dir, out, [str(bad)], fmt="chat", val_fraction=0, progress=False,
                 strict=True)
  with pytest.raises(ValueError, match=r"no training documents left \(skipped: 1 no assistant "
                     r"turn, first: .*bad.jsonl:1: "):
    data.prepare(tok_dir, out, [str(bad)], fmt="chat", val_fraction=0, progress=False)
  bad.write_text("\n  \n")
  with pytest.raises(ValueError, match="no documents"):
    data.prepare(tok_dir, out, [str(bad)], fmt="jsonl", progress=False)
  assert not out.exists()
  empty = tmp_path / "empty.txt"
  empty.write_text("")
  with pytest.raises(ValueError, match="empty.txt: empty file"):
    data.prepare(tok_dir, out, [str(empty)], progress=False)
  binary = tmp_path / "bin.txt"
  binary.write_bytes(b"\xff\xfe\x00bad")
  with pytest.raises(ValueError, match="bin.txt: unreadable as UTF-8"):
    data.prepare(tok_dir, out, [str(binary)], progress=False)
  with pytest.raises(FileNotFoundError, match="missing.txt"):
    data.prepare(tok_dir, out, [str(tmp_path / "missing.txt")], progress=False)
  good = tmp_path / "good.txt"
  good.write_text("hello world")
  with pytest.raises(ValueError, match="--eos"):
    data.prepare(tok_dir, out, [str(good)], eos="<|nope|>", val_fraction=0, progress=False)
  with pytest.raises(ValueError, match="--val-fraction: .*good.txt holds 1 document"):
    data.prepare(tok_dir, out, [str(good)], progress=False)
  no_template = make_tokenizer(tmp_path / "plain", template=None)
  with pytest.raises(ValueError, match="no chat_template"):
    data.prepare(no_template, out, [str(bad)], fmt="chat", progress=False)
  assert not out.exists() and not list(tmp_path.glob(".out.*"))


def test_prepare_cli_with_workers_matches_in_process(tmp_path):
  tok_dir = make_tokenizer(tmp_path / "tok")
  f = tmp_path / "docs.jsonl"
  n = 3200  # several tasks of the pool (1024 documents each): the workers' results must be ordered
  f.write_text("".join(json.dumps({"text": f"the quick brown fox {i}"}) + "\n" for i in range(n)))
  data.prepare(tok_dir, tmp_path / "one", [str(f)], fmt="jsonl", progress=False)
  cmd = [sys.executable, "-m", "mtjax.data", "prepare", "--tokenizer", str(tok_dir), "--out",
         str(tmp_path / "two"), "--format", "jsonl", "--workers", "2", "--quiet", str(f)]
  r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
  assert r.returncode == 0, r.stderr
  for name in ("train.bin", "train.idx", "val.bin", "val.idx"):
    assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes()
  r = subprocess.run(cmd[:-1] + [str(tmp_path / "missing.jsonl")], capture_output=True, text=True,
                     timeout=120)
  assert r.returncode != 0 and r.stderr.strip().splitlines()[-1].startswith("error: ")


def test_padded_leaves_out_documents_without_a_counted_target(tmp_path):
  docs = [[5, 6, 7, 8], [9], [10, 11, 12, 13], [14, 15]]
  masks = [[0, 0, 1, 1], [1], [0, 0, 0, 0], [0, 1]]  # [9] predicts nothing; doc 2 is all prompt
  d = write_prepared(tmp_path, {"train": docs, "val": docs}, masks={"train": masks, "val": masks})
  cfg = prepared_cfg(d, mode="padded")
  src = data.source(cfg, 2, 1, 500, seed=0)
  firsts = {int(b.inputs[r, 0]) for s in range(6) for b in [src.batch(s)] for r in range(2)}
  assert firsts == {14} and src.position(0)["per_epoch"] == 1  # doc 0's target 7 is past seq + 1
  rows = np.concatenate([b.inputs for b in data.validation_batches(cfg, 2, 3, 500)])
  np.testing.assert_array_equal(rows, [[5, 6, 7], [14, 15, PAD]])  # doc 0 counts target 7 now
  prompts = write_prepared(tmp_path / "p", {"train": docs[2:3], "val": docs[2:3]},
                           masks={"train": masks[2:3], "val": masks[2:3]})
  with pytest.raises(ValueError, match="no document"):
    data.source(prepared_cfg(prompts, mode="padded"), 2, 8, 500, seed=0)


def prepare_cli(*args, cwd):
  """Runs `python -m mtjax.data prepare ARGS` as a user would, on the mtjax under test."""
  env = {**os.environ, "PYTHONPATH": str(Path(data.__file__).parents[2])}
  return subprocess.run([sys.executable, "-m", "mtjax.data", "prepare", *map(str, args)],
                        capture_output=True, text=True, timeout=60, env=env, cwd=cwd)


CLI_ERRORS = {  # case: what the one line of stderr names
    "missing input": r"missing\.jsonl: no such file",
    "bad json": r"docs\.jsonl:2: bad JSON",
    "out is a file": r"--out: .*taken is a file, not a directory",
    "out under a file": r"--out: .*taken/sub lies under .*taken, a file",
    "out holds other files": r"--out: .*out holds files but no meta\.json",
    "unknown role": r"chat\.jsonl:2: messages\[1\] has unknown role 'bot'",
    "empty assistant message": r"chat\.jsonl:2: messages\[1\] is an empty assistant message",
    "broken template": r"chat template: line 1: ",
    "usage": r"argument --workers: invalid int value",
}


@pytest.mark.parametrize("case", CLI_ERRORS)
def test_prepare_cli_error_is_one_line_and_exit_2(tmp_path, case):
  tok_dir = make_tokenizer(tmp_path / "tok")
  out, taken = tmp_path / "out", tmp_path / "taken"
  taken.write_text("not a folder")
  docs, fmt, extra = tmp_path / "docs.jsonl", "jsonl", ["--strict"]
  docs.write_text('{"text": "hello world"}\n')
  if case == "missing input":
    docs = tmp_path / "missing.jsonl"
  elif case == "bad json":
    docs.write_text('{"text": "hello world"}\n{"text": oops}\n')
  elif case in ("out is a file", "out under a file"):
    # refused before the inputs are read: the missing input is not what the error names
    out = taken if case == "out is a file" else taken / "sub"
    docs = tmp_path / "missing.jsonl"
  elif case == "out holds other files":
    out.mkdir()
    (out / "notes.txt").write_text("mine")
  elif case in ("unknown role", "empty assistant message", "broken template"):
    docs, fmt = tmp_path / "chat.jsonl", "chat"
    line2 = {"unknown role": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "hi"},
                              {"role": "assistant", "content": "hello"}],
             "empty assistant message": [{"role": "user", "content": "hi"},
                                         {"role": "assistant", "content": " \n"}],
             "broken template": CONVERSATIONS[1]}[case]
    docs.write_text("".join(json.dumps({"messages": m}) + "\n" for m in (CONVERSATIONS[0], line2)))
    if case == "broken template":
      cfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
      (tok_dir / "tokenizer_config.json").write_text(json.dumps(
          {**cfg, "chat_template": "{% for m in messages %}{{ m.content }"}))
  elif case == "usage":
    extra += ["--workers", "x"]
  r = prepare_cli("--tokenizer", tok_dir, "--out", out, "--format", fmt, "--val-fraction", "0",
                  "--quiet", *extra, docs, cwd=tmp_path)
  lines = r.stderr.strip().splitlines()
  assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), r.stderr
  assert re.search(CLI_ERRORS[case], lines[0]), lines[0]
  assert taken.read_text() == "not a folder" and not (out / "meta.json").exists()
  assert not list(tmp_path.glob(".*.prepare-*"))  # no temporary folder left behind
  if case == "out holds other files":
    assert [p.name for p in out.iterdir()] == ["notes.txt"]


def test_prepare_refuses_unknown_roles_and_empty_assistant_messages(tmp_path):
  tok_dir = make_tokenizer(tmp_path / "tok")
  f = tmp_path / "chat.jsonl"
  cases = {
      r"chat\.jsonl:2: messages\[2\] has unknown role 'Assistant'":
          [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
           {"role": "Assistant", "content": "hello"}, {"role": "assistant", "content": "hello"}],
      r"chat\.jsonl:2: messages\[3\] is an empty assistant message":
          [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
           {"role": "user", "content": "and?"}, {"role": "assistant", "content": "\t "}],
  }
  for (error, msgs), reason in zip(cases.items(), ["unknown role", "empty assistant turn"]):
    f.write_text(json.dumps({"messages": CONVERSATIONS[0]}) + "\n"
                 + json.dumps({"messages": msgs}) + "\n")
    with pytest.raises(ValueError, match=error):
      data.prepare(tok_dir, tmp_path / "out", [str(f)], fmt="chat", val_fraction=0,
                   progress=False, strict=True)
    meta = data.prepare(tok_dir, tmp_path / "out", [str(f)], fmt="chat", val_fraction=0,
                        progress=False)  # without --strict: counted, skipped, the first named
    (stats,) = meta["stats"]
    assert meta["splits"]["train"]["documents"] == 1 and stats["rows"] == 2
    assert list(stats["skipped"]) == [reason] and stats["skipped"][reason]["count"] == 1
    assert re.search(error, stats["skipped"][reason]["first"])
    assert json.loads((tmp_path / "out" / "stats.json").read_text()) == meta["stats"]
  f.write_text(json.dumps({"prompt": "hi", "response": ""}) + "\n")
  with pytest.raises(ValueError, match=r"chat\.jsonl:1: messages\[1\] is an empty assistant"):
    data.prepare(tok_dir, tmp_path / "out", [str(f)], fmt="chat", val_fraction=0, progress=False,
                 strict=True)


@pytest.mark.parametrize("fmt", ["text", "jsonl"])
@pytest.mark.parametrize("post", ["bos", "bos and eos", "none"])
def test_prepare_encodes_text_as_the_post_processor_does(tmp_path, fmt, post):
  tok_dir = make_tokenizer(tmp_path / "tok")
  plain = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
  bos, eos = plain.token_to_id("<|begin_of_text|>"), plain.token_to_id("<|im_end|>")
  if post != "none":  # as Llama 3's tokenizer.json: byte-level offsets, then a template adding BOS
    single = "<|begin_of_text|> $A" + (" <|im_end|>" if post == "bos and eos" else "")
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=True),
        processors.TemplateProcessing(single=single, special_tokens=[("<|begin_of_text|>", bos),
                                                                     ("<|im_end|>", eos)])])
    tok.save(str(tok_dir / "tokenizer.json"))
  texts = ["hello world", "The quick brown fox jumps over the lazy dog."]
  if fmt == "text":
    for i, t in enumerate(texts):
      (tmp_path / f"{i}.txt").write_text(t)
    inputs = [str(tmp_path / f"{i}.txt") for i in range(len(texts))]
  else:
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    inputs = [str(tmp_path / "docs.jsonl")]
  data.prepare(tok_dir, tmp_path / "out", inputs, fmt=fmt, val_fraction=0, progress=False)
  toks = np.fromfile(tmp_path / "out" / "train.bin", np.uint16).tolist()
  idx = np.fromfile(tmp_path / "out" / "train.idx", np.uint64).tolist()
  # each document as the model saw it in pre-training: BOS first where the post-processor adds one,
  # then the text's tokens, then one EOS between documents
  first = [bos] if post != "none" else []
  want = [first + plain.encode(t, add_special_tokens=False).ids + [eos] for t in texts]
  assert [toks[a:b] for a, b in zip(idx[:-1], idx[1:])] == want


@pytest.mark.parametrize("method", ["render_diff", "generation_tags"])
def test_prepare_chat_records_and_prints_the_mask_method(tmp_path, method):
  if method == "render_diff":  # Qwen3's template, which rewrites earlier turns
    tok_dir = make_tokenizer(tmp_path / "tok", (TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text(),
                             specials=SPECIALS + ["<think>", "</think>"])
  else:
    tok_dir = make_tokenizer(tmp_path / "tok", CHATML_TAGGED)
  msgs = [{"role": "user", "content": "Hello, how are you?"},
          {"role": "assistant", "content": "<think>Be kind.</think>I am fine, thank you."},
          {"role": "user", "content": "And 1234?"}, {"role": "assistant", "content": "A number."}]
  f = tmp_path / "chat.jsonl"
  f.write_text(json.dumps({"messages": msgs}) + "\n" + json.dumps({"messages": msgs[:2]}) + "\n")
  r = prepare_cli("--tokenizer", tok_dir, "--out", tmp_path / "out", "--format", "chat",
                  "--val-fraction", "0", "--quiet", f, cwd=tmp_path)
  assert r.returncode == 0, r.stderr
  assert r.stdout.splitlines()[0].startswith(f"loss mask: {method} (")
  meta = json.loads((tmp_path / "out" / "meta.json").read_text())
  assert meta["mask_method"] == method and meta["splits"]["train"]["documents"] == 2
  tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
  template = chat.ChatTemplate.from_tokenizer(tok_dir)
  want = [chat.encode_chat(tok, template, m) for m in (msgs, msgs[:2])]
  np.testing.assert_array_equal(np.fromfile(tmp_path / "out" / "train.bin", np.uint16),
                                np.concatenate([i for i, _ in want]))
  np.testing.assert_array_equal(np.fromfile(tmp_path / "out" / "train.mask", np.uint8),
                                np.concatenate([m for _, m in want]))
  text = data.prepare(tok_dir, tmp_path / "again", [str(f)], fmt="chat", val_fraction=0,
                      progress=False)
  assert text["mask_method"] == method


# ---------------------------------------------------------------------------------------------
# Epochs: which pass over the data a step's batch ends in.

def test_padded_epoch_is_the_pass_the_steps_last_document_belongs_to(tmp_path):
  """Each padded epoch holds every document once, so a row's epoch is the number of times its
  document came before it; epoch(step) is that of the step's last row, and never goes back."""
  docs = doc_tokens(7, np.random.default_rng(2))
  d = write_prepared(tmp_path, {"train": docs, "val": docs[:1]})
  src = data.source(prepared_cfg(d, mode="padded"), 3, 24, vocab=500, seed=1)
  seen, want = {}, []
  for step in range(12):  # 36 rows: five passes and a bit
    for row in src.batch(step).inputs:
      doc = int(row[0] - 1) // 20
      seen[doc] = seen.get(doc, -1) + 1
    want.append(seen[doc])
  assert [src.epoch(s) for s in range(12)] == want
  assert want[-1] == 5 and want == sorted(want)
  assert [data.source(prepared_cfg(d, mode="padded"), 3, 24, 500, 1).epoch(s)
          for s in range(12)] == want  # a pure function of the step


def test_token_file_epoch_counts_the_files_worth_of_tokens_trained_on(tmp_path):
  path = tmp_path / "toks.bin"
  np.arange(1000, dtype=np.uint16).tofile(path)
  src = data.source(config.DataConfig(source="tokens", path=str(path)), 3, 8, vocab=1000, seed=0)
  trained, want = 0, []
  for _ in range(90):
    trained += 3 * 8
    want.append((trained - 1) // 1000)
  assert [src.epoch(s) for s in range(90)] == want
  assert want.index(1) == 41 and want.index(2) == 83  # 42 * 24 tokens pass the file's 1000
  assert data.source(config.DataConfig(), 3, 8, 50, 0).epoch(10**6) == 0  # synthetic: no end


# ---------------------------------------------------------------------------------------------
# The tokenizer prepared data was made with, against the model's.

def test_tokenizer_fingerprint_is_the_content_not_the_path_or_the_formatting(tmp_path):
  a = make_tokenizer(tmp_path / "a")
  b = tmp_path / "b"
  b.mkdir()
  content = json.loads((a / "tokenizer.json").read_text())
  # the same tokenizer saved again: other whitespace, other key order, another folder
  (b / "tokenizer.json").write_text(json.dumps(dict(reversed(list(content.items()))), indent=4))
  fp = data.tokenizer_fingerprint(a)
  assert re.fullmatch(r"[0-9a-f]{64}", fp)
  assert data.tokenizer_fingerprint(b) == data.tokenizer_fingerprint(a / "tokenizer.json") == fp
  content["added_tokens"][-1]["content"] = "<|other|>"  # one added token differs
  (b / "tokenizer.json").write_text(json.dumps(content))
  assert data.tokenizer_fingerprint(b) != fp
  assert data.tokenizer_fingerprint(make_tokenizer(tmp_path / "c", vocab=300)) != fp
  (a / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
  assert data.tokenizer_fingerprint(a) == fp  # the template is not what an id means


def test_check_tokenizer_refuses_data_of_another_models_tokenizer(tmp_path):
  model = make_tokenizer(tmp_path / "model")
  other = make_tokenizer(tmp_path / "other", vocab=300)
  corpus = tmp_path / "docs.jsonl"
  corpus.write_text("".join(json.dumps({"text": f"hello world {i}"}) + "\n" for i in range(8)))
  prep = tmp_path / "prep"
  meta = data.prepare(model, prep, [str(corpus)], val_fraction=0, progress=False)
  vocab = meta["vocab_size"]
  assert meta["tokenizer_fingerprint"] == data.tokenizer_fingerprint(model)

  copy = tmp_path / "copy"  # the model's folder elsewhere, as an export writes it
  copy.mkdir()
  (copy / "tokenizer.json").write_bytes((model / "tokenizer.json").read_bytes())
  data.check_tokenizer(prep, copy, vocab, allow_other=False)
  with pytest.raises(ValueError) as e:
    data.check_tokenizer(prep, other, 512, allow_other=False)
  line = str(e.value)
  assert "\n" not in line and str(model / "tokenizer.json") in line and str(other) in line
  assert meta["tokenizer_fingerprint"][:12] in line
  assert data.tokenizer_fingerprint(other)[:12] in line
  assert "data.allow_other_tokenizer=true" in line
  data.check_tokenizer(prep, other, 512, allow_other=True)  # the override accepts it
  with pytest.raises(ValueError, match=r"model\.from_hf: .*empty holds no tokenizer\.json .*"
                                       r"data\.allow_other_tokenizer=true"):
    data.check_tokenizer(prep, (tmp_path / "empty").mkdir() or tmp_path / "empty", vocab, False)

  data.check_tokenizer(prep, None, vocab, allow_other=False)  # from scratch: the ids fit
  with pytest.raises(ValueError) as e:
    data.check_tokenizer(prep, None, vocab - 1, allow_other=False)
  line = str(e.value)
  assert f"vocabulary is {vocab}" in line and str(model / "tokenizer.json") in line
  assert "set model.from_hf to that model" in line and f"model.vocab_size ({vocab - 1})" in line

  # a folder prepared before the fingerprint was recorded: the vocabulary check only
  old = {k: v for k, v in meta.items() if k != "tokenizer_fingerprint"}
  (prep / "meta.json").write_text(json.dumps(old))
  data.check_tokenizer(prep, other, vocab, allow_other=False)
  with pytest.raises(ValueError, match="set model.from_hf"):
    data.check_tokenizer(prep, other, vocab - 1, allow_other=False)


def test_a_vocabulary_larger_than_the_models_names_model_from_hf(tmp_path):
  """Prepared data opened by a model built without model.from_hf (a vocabulary too small for the
  data): the refusal names the tokenizer the data was made with and model.from_hf."""
  model = make_tokenizer(tmp_path / "model", CHATML_TAGGED)
  corpus = tmp_path / "docs.jsonl"
  corpus.write_text("".join(json.dumps({"text": f"hello world {i}"}) + "\n" for i in range(8)))
  meta = data.prepare(model, tmp_path / "prep", [str(corpus)], val_fraction=0, progress=False)
  n = meta["vocab_size"]
  with pytest.raises(ValueError) as e:
    data.source(prepared_cfg(tmp_path / "prep"), 1, 4, 64, 0)
  assert re.fullmatch(rf"data\.path: \S*prep was prepared with the tokenizer "
                      rf"\S*model/tokenizer\.json whose vocabulary is {n}, more than "
                      rf"model\.vocab_size \(64\): set "
                      rf"model\.from_hf to that model \(or model\.vocab_size to at least {n}\)",
                      str(e.value)), str(e.value)
  pairs = tmp_path / "p.jsonl"
  pairs.write_text(json.dumps({"prompt": "hi", "chosen": "hello", "rejected": "go"}) + "\n")
  data.prepare(model, tmp_path / "pairs", [str(pairs)], val_fraction=0, progress=False)
  with pytest.raises(ValueError, match=r"whose vocabulary is \d+, .*set model\.from_hf"):
    data.read_pairs(tmp_path / "pairs", vocab=64)
