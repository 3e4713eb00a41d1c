"""`python -m mtjax.data prepare` as a user meets it: the README's commands as written, `--help`,
the errors that point to the option to change, the exit codes of a full disk and of a stop."""

import errno
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mtjax import data, exits
from test_chat import CHATML_TAGGED, make_tokenizer
from test_data import prepare_cli

pa = pytest.importorskip("pyarrow")
import pyarrow.parquet as pq

README = Path(__file__).parent.parent / "README.md"
ALPACA = [{"instruction": "What is the capital of France?", "input": "", "output": "Paris."},
          {"instruction": "Add these numbers.", "input": "1234 and 56", "output": "1290"},
          {"instruction": "Say hello.", "input": "", "output": "Hello world."}]
SHAREGPT = [[{"from": "human", "value": "Hello, how are you?"},
             {"from": "gpt", "value": "I am fine, thank you."}],
            [{"from": "human", "value": "The quick brown fox?"},
             {"from": "gpt", "value": "Jumps over the lazy dog."}],
            [{"from": "human", "value": "And 1234?"}, {"from": "gpt", "value": "A number."}]]
PREFS = [{"prompt": "What is the capital of France?", "chosen": "Paris.", "rejected": "Rome."},
         {"prompt": "Add 1234 and 56.", "chosen": "1290", "rejected": "I do not know."}]


def readme_prepare_commands() -> list[str]:
  """The README's `python -m mtjax.data prepare` lines, from its bash blocks, as written."""
  blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), re.S)
  return [line.strip() for b in blocks for line in b.splitlines()
          if line.strip().startswith("python -m mtjax.data prepare")]


def test_the_readme_prepare_commands_run_as_written(tmp_path):
  """Each README prepare command, word for word, in a folder holding what it names: a model
  directory MODEL (and OUT, the fine-tuned model) with the tokenizer, an Alpaca JSON file, a
  ShareGPT Parquet file and preference JSONL rows."""
  commands = readme_prepare_commands()
  assert len(commands) >= 2 and "alpaca.json chats.parquet" in commands[0], commands
  for model in ("MODEL", "OUT"):
    make_tokenizer(tmp_path / model, CHATML_TAGGED)
  (tmp_path / "alpaca.json").write_text(json.dumps(ALPACA))
  pq.write_table(pa.table({"conversations": SHAREGPT}), tmp_path / "chats.parquet")
  (tmp_path / "prefs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in PREFS))
  # a LLaVA directory's tokenizer and processor, and one image chat
  import test_data_images as di
  from test_chat import SPECIALS
  di.write_processor(make_tokenizer(tmp_path / "LLAVA", template=di.TEMPLATE,
                                    specials=SPECIALS + ["<image>"]))
  di.save_images(tmp_path)
  (tmp_path / "image_chats.jsonl").write_text("".join(json.dumps({"messages": [
      {"role": "user", "content": [{"type": "image", "image": f"imgs/{name}"},
                                   {"type": "text", "text": "What is this?"}]},
      {"role": "assistant", "content": f"Picture {name}."}]}) + "\n"
      for name in ("a.png", "b.png", "c.jpg")))
  env = {**os.environ, "PYTHONPATH": str(Path(data.__file__).parents[2])}
  for command in commands:
    argv = shlex.split(command)
    assert argv[:3] == ["python", "-m", "mtjax.data"]
    r = subprocess.run([sys.executable, *argv[1:], "--quiet"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (command, r.stderr)
    out = tmp_path / argv[argv.index("--out") + 1]
    meta = json.loads((out / "meta.json").read_text())
    inputs = [a for a in argv[3:] if (tmp_path / a).is_file()]
    assert meta["inputs"] == inputs and meta["splits"]["train"]["documents"] > 0
  meta = json.loads((tmp_path / "DATA" / "meta.json").read_text())
  assert meta["formats"] == ["alpaca", "sharegpt"] and meta["has_mask"]
  assert [s["documents"] for s in meta["stats"]] == [{"train": 2, "val": 1}] * 2  # 0.02 of 3: 1


def test_help_shows_every_default_and_points_to_the_data_docs():
  r = subprocess.run([sys.executable, "-m", "mtjax.data", "prepare", "--help"], capture_output=True,
                     text=True, timeout=60,
                     env={**os.environ, "PYTHONPATH": str(Path(data.__file__).parents[2])})
  assert r.returncode == 0, r.stderr
  assert "docs/data.md" in r.stdout
  entries = re.split(r"\n  (?=-)", r.stdout.split("options:\n", 1)[1].split("\n\n")[0])
  helps = {e.split()[0].rstrip(","): " ".join(e.split()) for e in entries if e.strip()}
  assert len(helps) == 23, sorted(helps)  # -h and the 22 options of prepare
  for name, text in helps.items():
    if name != "-h":
      assert "(default: " in text or text.endswith("(required)"), (name, text)
  assert helps["--format"].endswith("(default: auto)")
  assert helps["--val-fraction"].endswith("(default: 0.01)")
  assert helps["--strict"].endswith("(default: off)")
  assert helps["--tokenizer"].endswith("(required)")


@pytest.mark.parametrize("fmt,rows,looks", [
    ("text", ALPACA, "alpaca"),
    ("alpaca", [{"conversations": c} for c in SHAREGPT], "sharegpt"),
    ("messages", [{"question": "hi", "answer": "ok"}] * 2, None),
])
def test_a_row_without_the_formats_column_points_to_format(tmp_path, fmt, rows, looks):
  """The README's alpaca file read as --format text (the old default) is refused in one line that
  names --format alpaca; a row no format reads points to --format and --columns."""
  tok = make_tokenizer(tmp_path / "tok", CHATML_TAGGED)
  src = tmp_path / "rows.jsonl"
  src.write_text("".join(json.dumps(r) + "\n" for r in rows))
  r = prepare_cli("--tokenizer", tok, "--out", tmp_path / "out", "--format", fmt, "--quiet",
                  "--val-fraction", "0", src, cwd=tmp_path)
  lines = r.stderr.strip().splitlines()
  assert r.returncode == exits.BAD_INPUT and len(lines) == 1, r.stderr
  assert re.search(r"rows\.jsonl:1: no column '\w+' .*--columns \w+=COLUMN", lines[0]), lines[0]
  if looks:
    assert f"it looks like --format {looks}" in lines[0], lines[0]
  else:
    assert "pass the --format the rows are in" in lines[0], lines[0]
  assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("code,expect", [(errno.ENOSPC, exits.IO_FAILURE),
                                         (errno.EDQUOT, exits.IO_FAILURE),
                                         (errno.EIO, exits.IO_FAILURE),
                                         (errno.EROFS, exits.IO_FAILURE),
                                         (errno.EACCES, exits.BAD_INPUT)])
def test_a_failed_write_exits_74_for_the_machines_fault_and_2_for_the_users(
    tmp_path, monkeypatch, capsys, code, expect):
  """A full disk, a quota, a device error or a read-only disk while the output is written: one
  line naming --out and the cause, exit 74; a folder the user may not write: exit 2. Either way
  --out is as it was and no temporary folder is left."""
  from mtjax.data import tokenize
  from mtjax.data.__main__ import main

  tok = make_tokenizer(tmp_path / "tok", CHATML_TAGGED)
  src = tmp_path / "t.jsonl"
  src.write_text("".join(json.dumps({"text": f"hello world {i}"}) + "\n" for i in range(8)))
  args = ["prepare", "--tokenizer", str(tok), "--out", str(tmp_path / "out"), "--quiet", str(src)]
  main(args)
  capsys.readouterr()
  assert (tmp_path / "out" / "meta.json").is_file()
  before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}

  def failing(self, ids, mask):
    raise OSError(code, os.strerror(code), str(self.paths["bin"]))

  monkeypatch.setattr(tokenize._Docs, "add", failing)
  with pytest.raises(SystemExit) as e:
    main(args)
  err = capsys.readouterr().err.strip().splitlines()
  assert e.value.code == expect and len(err) == 1, err
  cause = re.escape(os.strerror(code))
  assert re.fullmatch(rf"error: --out: cannot write \S*train\.bin \({cause}\)", err[0]), err[0]
  assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == before
  assert not list(tmp_path.glob(".out.prepare-*"))


def _children(pid: int) -> list[int]:
  """The live processes whose parent is `pid` (from /proc)."""
  kids = []
  for stat in Path("/proc").glob("[0-9]*/stat"):
    try:
      fields = stat.read_text().rsplit(")", 1)[1].split()
    except OSError:
      continue
    if int(fields[1]) == pid and fields[0] not in "ZX":
      kids.append(int(stat.parent.name))
  return kids


def _alive(pid: int) -> bool:
  try:
    state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
  except OSError:
    return False
  return state not in "ZX"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_stopped_prepare_says_so_in_one_line_and_leaves_out_as_it_was(tmp_path, sig):
  """SIGINT to the whole process group (Ctrl-C in a terminal) or SIGTERM to prepare alone (kill),
  mid-tokenize with two worker processes: exit 128 + the signal, one line on stderr, --out as it
  was, no temporary folder, no worker left running."""
  tok = make_tokenizer(tmp_path / "tok", CHATML_TAGGED)
  small = tmp_path / "small.jsonl"
  small.write_text("".join(json.dumps({"text": "hello world"}) + "\n" for _ in range(4)))
  r = prepare_cli("--tokenizer", tok, "--out", tmp_path / "out", "--quiet", small, cwd=tmp_path)
  assert r.returncode == 0, r.stderr
  before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
  big = tmp_path / "big.jsonl"
  big.write_text("".join(json.dumps({"text": f"the quick brown fox {i}"}) + "\n"
                         for i in range(60_000)))
  env = {**os.environ, "PYTHONPATH": str(Path(data.__file__).parents[2])}
  proc = subprocess.Popen([sys.executable, "-m", "mtjax.data", "prepare", "--tokenizer", str(tok),
                           "--out", str(tmp_path / "out"), "--workers", "2", "--quiet", str(big)],
                          env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          start_new_session=True)
  part = tmp_path / ".out.prepare-tmp" / "train.bin"
  deadline = time.time() + 90
  while not (part.exists() and part.stat().st_size > 0) and proc.poll() is None \
      and time.time() < deadline:
    time.sleep(0.005)
  workers = _children(proc.pid)
  mid_way = part.exists() and proc.poll() is None
  if sig == signal.SIGINT:
    os.killpg(proc.pid, sig)
  else:
    proc.send_signal(sig)
  try:
    _, err = proc.communicate(timeout=60)
  finally:  # a prepare that hangs is killed, workers and all, not left behind
    if proc.poll() is None:
      os.killpg(proc.pid, signal.SIGKILL)
      proc.communicate()
  assert mid_way, "prepare ended before it could be stopped mid-way"
  name = signal.Signals(sig).name
  lines = err.strip().splitlines()
  assert proc.returncode == exits.of_signal(sig) and len(lines) == 1, err
  assert lines[0] == f"stopped by {name}; {tmp_path / 'out'} left as it was", lines[0]
  assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == before
  assert not list(tmp_path.glob(".out.prepare-*"))
  assert len(workers) >= 2, workers  # the pool was running (its resource tracker may be a third)
  deadline = time.time() + 10
  while any(map(_alive, workers)) and time.time() < deadline:
    time.sleep(0.05)
  assert not [w for w in workers if _alive(w)]
