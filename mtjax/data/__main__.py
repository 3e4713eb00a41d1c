"""`python -m mtjax.data prepare --tokenizer DIR --out DIR [options] INPUT...`: tokenize sources
(files, folders, datasets folders; several make a mixture) into a prepared directory.

Bad input is one `error: ...` line and exit 2, a full disk exit 74; Ctrl-C or SIGTERM stops it
with one line, exit 130 or 143, --out as it was. Formats, sources, mixtures, the output's files
and the exit codes: docs/data.md."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
from pathlib import Path

from mtjax import exits
from mtjax.data.formats import FIELDS, FORMATS, parse_pairs
from mtjax.data.tokenize import OVERFLOW, Options, Request, run, summary


class _Parser(argparse.ArgumentParser):
  """Usage errors as one line on stderr, exit 2, like the errors of prepare itself."""

  def error(self, message):
    self.exit(exits.BAD_INPUT, f"error: {message} (see {self.prog} --help)\n")


class _Help(argparse.RawDescriptionHelpFormatter):
  """Every option's help ends with its default; an option without a value says "off"."""

  def _get_help_string(self, action):
    text = action.help or ""
    if not action.option_strings or "(default" in text or action.default is argparse.SUPPRESS:
      return text
    if action.required:
      return f"{text} (required)"
    return f"{text} (default: {'off' if action.default is False else action.default})"


class Stopped(BaseException):
  """SIGINT or SIGTERM arrived: raised in the main thread, past any `except Exception`, so that
  prepare's clean-up runs (the worker processes, the temporary folder)."""

  def __init__(self, signum: int):
    super().__init__(exits.signal_name(signum))
    self.signum = signum


def _stop(signum, frame):
  for sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(sig, _stop_now)
  raise Stopped(signum)


def _stop_now(signum, frame):
  """A second signal while the first one's clean-up runs: the process ends at once (a re-run
  removes the temporary folder it may leave)."""
  print(f"stopped by {exits.signal_name(signum)} again: clean-up cut short", file=sys.stderr,
        flush=True)
  os._exit(exits.of_signal(signum))


@contextlib.contextmanager
def _stops_raised():
  """SIGINT and SIGTERM raise Stopped inside the block; the old handlers come back after it (in
  the main thread: elsewhere, where handlers cannot be set, the signals keep theirs)."""
  if threading.current_thread() is not threading.main_thread():
    yield
    return
  old = {sig: signal.signal(sig, _stop) for sig in (signal.SIGINT, signal.SIGTERM)}
  try:
    yield
  finally:
    for sig, handler in old.items():
      signal.signal(sig, handler)


def _floats(option: str):
  def parse(text: str) -> list[float]:
    try:
      return [float(x) for x in text.split(",")]
    except ValueError:
      raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers"
                                       ) from None
  parse.__name__ = option
  return parse


def parser() -> argparse.ArgumentParser:
  p = _Parser(prog="python -m mtjax.data", description=__doc__, formatter_class=_Help)
  sub = p.add_subparsers(dest="command", required=True)
  q = sub.add_parser("prepare", help="tokenize documents into a prepared directory",
                     description=__doc__, formatter_class=_Help,
                     epilog="Formats, sources, mixtures and output files: docs/data.md")
  q.add_argument("--tokenizer", required=True, help="directory with tokenizer.json, or the file")
  q.add_argument("--out", required=True, help="directory to write (replaced whole, atomically)")
  q.add_argument("--processor", default=None,
                 help="the model's processor folder, for rows with images (default: the "
                      "--tokenizer folder, where it holds preprocessor_config.json)")
  q.add_argument("--image-size", type=int, default=None, metavar="N",
                 help="Qwen-VL: resize every image to N x N pixels (a multiple of patch x merge, "
                      "e.g. 448 = model.vision.image_size's default) (default: the side the "
                      "processor's min_pixels = max_pixels pins, else refused)")
  q.add_argument("--format", choices=FORMATS, default="auto",
                 help="row format; auto picks each source's from its first row")
  q.add_argument("--columns", default=None,
                 help=f"FIELD=COLUMN,... renames ({', '.join(FIELDS)}) (default: the field's "
                      "own name)")
  q.add_argument("--roles", default=None, help="ROLE=ROLE,... e.g. human=user,gpt=assistant "
                                               "(default: the format's own roles)")
  q.add_argument("--text-field", default="text", help="column holding the text (text format)")
  q.add_argument("--weights", type=_floats("--weights"), default=None,
                 help="W1,W2,...: each input's share of the training documents (default: each "
                      "input's rows once)")
  q.add_argument("--epochs", type=_floats("--epochs"), default=None,
                 help="E1,E2,...: times each input's training rows are taken (default: once)")
  q.add_argument("--val-fraction", type=float, default=0.01, help="share of each input held out")
  q.add_argument("--train-on-prompt", action="store_true",
                 help="the loss counts every token of a conversation, not only the answers")
  q.add_argument("--last-turn-only", action="store_true",
                 help="the loss counts the last assistant turn of each conversation only")
  q.add_argument("--max-len", type=int, default=None,
                 help="longest document in tokens (default: no limit)")
  q.add_argument("--overflow", choices=OVERFLOW, default="truncate",
                 help="what happens to a document longer than --max-len")
  q.add_argument("--strict", action="store_true",
                 help="a bad row or file is an error, not counted, skipped and reported")
  q.add_argument("--json", default=None, metavar="OUT",
                 help="write meta and stats as JSON here (default: not written)")
  q.add_argument("--workers", type=int, default=1, help="tokenizing processes")
  q.add_argument("--seed", type=int, default=0,
                 help="seeds the held-out rows, a mixture's draws and its order")
  q.add_argument("--eos", default=None,
                 help="EOS token (default: tokenizer_config.json's eos_token)")
  q.add_argument("--quiet", action="store_true", help="no progress bar")
  q.add_argument("--allow-low-disk", action="store_true",
                 help="start even when --out's disk has less free space than the output may take")
  q.add_argument("inputs", nargs="+", help="files, folders of them, datasets folders")
  return p


def _request(a: argparse.Namespace) -> Request:
  return Request(a.tokenizer, a.out, tuple(a.inputs), a.format, text_field=a.text_field,
                 columns=parse_pairs(a.columns, "--columns", tuple(FIELDS)),
                 roles=parse_pairs(a.roles, "--roles"), val_fraction=a.val_fraction,
                 weights=a.weights, epochs=a.epochs,
                 options=Options(a.train_on_prompt, a.last_turn_only, a.max_len, a.overflow),
                 workers=a.workers, seed=a.seed, eos=a.eos, strict=a.strict,
                 processor=a.processor, image_size=a.image_size,
                 allow_low_disk=a.allow_low_disk)


def _identity(out: Path):
  """Which meta.json --out holds (a swap in brings a new file), or None."""
  try:
    st = (out / "meta.json").stat()
  except OSError:
    return None
  return st.st_ino, st.st_mtime_ns


def main(argv: list[str] | None = None) -> int:
  """`python -m mtjax.data prepare ...`: exits with one line on stderr on bad input (2), a failed
  write (74), a stop (128 + the signal) or a bug (1)."""
  os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local folders only, never the network
  a = parser().parse_args(argv)
  out = Path(a.out)
  before = _identity(out)
  with _stops_raised():
    try:
      meta = run(_request(a), progress=not a.quiet, log=print)
      if a.json:
        Path(a.json).write_text(json.dumps(meta, indent=1) + "\n")
      for line in _report(meta):
        print(line)
    except Stopped as e:
      kept = "left as it was" if _identity(out) == before else "written (prepare had finished)"
      print(f"stopped by {e}; {out} {kept}", file=sys.stderr, flush=True)
      sys.exit(exits.of_signal(e.signum))
    except ValueError as e:
      sys.exit(exits.fail("error", e, exits.BAD_INPUT))
    except OSError as e:  # a full disk is the machine's (74), a path that does not work the user's
      sys.exit(exits.fail("error", e, exits.of_os_error(e)))
    except Exception as e:  # noqa: BLE001 - a bug: one line, not a traceback
      sys.exit(exits.fail("internal error", f"{type(e).__name__}: {exits.one_line(e)}",
                          exits.FAILED))
  return exits.OK


def _report(meta: dict) -> list[str]:
  """What stdout says of a finished prepare: the loss mask's method, per source counts, splits."""
  lines = []
  if "mask_method" in meta:
    how = {"generation_tags": "the template's {% generation %} tags",
           "render_diff": "renders of the conversation cut before and after each assistant turn"}
    lines.append(f"loss mask: {meta['mask_method']} ({how[meta['mask_method']]})")
  return [*lines, *summary(meta), json.dumps(meta["splits"])]


if __name__ == "__main__":
  sys.exit(main())
