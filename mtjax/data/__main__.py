"""`python -m mtjax.data prepare --tokenizer DIR --out DIR [options] INPUT...`: tokenize sources
(files, folders, datasets folders; several make a mixture) into a prepared directory; one
`error: ...` line and exit 2 on bad input."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from mtjax.data.formats import FIELDS, FORMATS, parse_pairs
from mtjax.data.tokenize import OVERFLOW, Options, prepare, summary


class _Parser(argparse.ArgumentParser):
  """Usage errors as one line on stderr, exit 2, like the errors of prepare itself."""

  def error(self, message):
    self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def _floats(option: str):
  def parse(text: str) -> list[float]:
    try:
      return [float(x) for x in text.split(",")]
    except ValueError:
      raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers")
  parse.__name__ = option
  return parse


def main(argv: list[str] | None = None):
  """`python -m mtjax.data prepare ...`: exits 2 with one `error: ...` line on bad input."""
  os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local folders only, never the network
  p = _Parser(prog="python -m mtjax.data", description=__doc__)
  sub = p.add_subparsers(dest="command", required=True)
  q = sub.add_parser("prepare", help="tokenize documents into a prepared directory")
  q.add_argument("--tokenizer", required=True, help="directory with tokenizer.json, or the file")
  q.add_argument("--out", required=True, help="directory to write (replaced whole, atomically)")
  q.add_argument("--format", choices=FORMATS, default="text",
                 help="row format; auto picks each source's from its first row")
  q.add_argument("--columns", default=None,
                 help=f"FIELD=COLUMN,... renames ({', '.join(FIELDS)})")
  q.add_argument("--roles", default=None, help="ROLE=ROLE,... e.g. human=user,gpt=assistant")
  q.add_argument("--text-field", default="text", help="column holding the text (text format)")
  q.add_argument("--weights", type=_floats("--weights"), default=None,
                 help="W1,W2,...: each input's share of the training documents")
  q.add_argument("--epochs", type=_floats("--epochs"), default=None,
                 help="E1,E2,...: times each input's training rows are taken")
  q.add_argument("--val-fraction", type=float, default=0.01, help="share of each input held out")
  q.add_argument("--train-on-prompt", action="store_true",
                 help="the loss counts every token of a conversation, not only the answers")
  q.add_argument("--last-turn-only", action="store_true",
                 help="the loss counts the last assistant turn of each conversation only")
  q.add_argument("--max-len", type=int, default=None, help="longest document in tokens")
  q.add_argument("--overflow", choices=OVERFLOW, default="truncate",
                 help="what happens to a document longer than --max-len")
  q.add_argument("--strict", action="store_true",
                 help="a bad row or file is an error (default: counted, skipped, reported)")
  q.add_argument("--json", default=None, metavar="OUT", help="write meta and stats as JSON here")
  q.add_argument("--workers", type=int, default=1, help="tokenizing processes")
  q.add_argument("--seed", type=int, default=0,
                 help="seeds the held-out rows, a mixture's draws and its order")
  q.add_argument("--eos", default=None, help="EOS token (default: tokenizer_config.json eos_token)")
  q.add_argument("--quiet", action="store_true", help="no progress bar")
  q.add_argument("--allow-low-disk", action="store_true",
                 help="start even when --out's disk has less free space than the output may take")
  q.add_argument("inputs", nargs="+", help="files, folders of them, datasets folders")
  a = p.parse_args(argv)
  try:
    opts = Options(a.train_on_prompt, a.last_turn_only, a.max_len, a.overflow)
    meta = prepare(a.tokenizer, a.out, a.inputs, a.format, a.text_field, a.val_fraction,
                   a.workers, a.seed, a.eos, progress=not a.quiet,
                   columns=parse_pairs(a.columns, "--columns", tuple(FIELDS)),
                   roles=parse_pairs(a.roles, "--roles"), weights=a.weights, epochs=a.epochs,
                   options=opts, strict=a.strict, log=print, allow_low_disk=a.allow_low_disk)
    if a.json:
      Path(a.json).write_text(json.dumps(meta, indent=1) + "\n")
  except (ValueError, OSError) as e:
    print("error: " + " ".join(str(e).split("\n")), file=sys.stderr)
    sys.exit(2)
  if "mask_method" in meta:
    how = {"generation_tags": "the template's {% generation %} tags",
           "render_diff": "renders of the conversation cut before and after each assistant turn"}
    print(f"loss mask: {meta['mask_method']} ({how[meta['mask_method']]})")
  for line in summary(meta):
    print(line)
  print(json.dumps(meta["splits"]))


if __name__ == "__main__":
  main()
