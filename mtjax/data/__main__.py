"""`python -m mtjax.data prepare --tokenizer DIR --out DIR [options] INPUT...`: tokenize documents
into a prepared directory; one `error: ...` line and exit 2 on bad input."""

from __future__ import annotations

import argparse
import json
import sys

from mtjax.data.tokenize import FORMATS, prepare


class _Parser(argparse.ArgumentParser):
  """Usage errors as one line on stderr, exit 2, like the errors of prepare itself."""

  def error(self, message):
    self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def main(argv: list[str] | None = None):
  """`python -m mtjax.data prepare ...`: exits 2 with one `error: ...` line on bad input."""
  p = _Parser(prog="python -m mtjax.data", description=__doc__)
  sub = p.add_subparsers(dest="command", required=True)
  q = sub.add_parser("prepare", help="tokenize documents into a prepared directory")
  q.add_argument("--tokenizer", required=True, help="directory with tokenizer.json, or the file")
  q.add_argument("--out", required=True, help="directory to write")
  q.add_argument("--format", choices=FORMATS, default="text")
  q.add_argument("--text-field", default="text", help="jsonl field holding the text")
  q.add_argument("--val-fraction", type=float, default=0.01, help="share of documents held out")
  q.add_argument("--workers", type=int, default=1, help="tokenizing processes")
  q.add_argument("--seed", type=int, default=0, help="seeds the held-out choice")
  q.add_argument("--eos", default=None, help="EOS token (default: tokenizer_config.json eos_token)")
  q.add_argument("--quiet", action="store_true", help="no progress bar")
  q.add_argument("inputs", nargs="+", help="text files, folders of them, or jsonl files")
  a = p.parse_args(argv)
  try:
    meta = prepare(a.tokenizer, a.out, a.inputs, a.format, a.text_field, a.val_fraction,
                   a.workers, a.seed, a.eos, progress=not a.quiet)
  except (ValueError, OSError) as e:
    print("error: " + " ".join(str(e).split("\n")), file=sys.stderr)
    sys.exit(2)
  if "mask_method" in meta:
    how = {"generation_tags": "the template's {% generation %} tags",
           "render_diff": "renders of the conversation cut before and after each assistant turn"}
    print(f"loss mask: {meta['mask_method']} ({how[meta['mask_method']]})")
  print(json.dumps(meta["splits"]))


if __name__ == "__main__":
  main()
