"""The exit codes every command keeps to (docs/reliability.md), and the one line it prints.

A script tells what happened from the code alone; stderr holds one line saying why. Every command
(`train`, `plan`, `export`, `data prepare`, `report`, `config_reference`) takes its codes from
here and nowhere else.
"""

from __future__ import annotations

import errno
import signal
import sys

OK = 0  # the command did what it was asked
FAILED = 1  # an internal failure (a host update that failed, a bug): the last checkpoint is intact
BAD_INPUT = 2  # a bad config, path, data file or checkpoint, or a run that does not fit: refused before anything was changed
DIVERGED = 3  # train.max_skipped_steps steps in a row had a non-finite loss or gradient
IO_FAILURE = 74  # a write failed (full disk, permissions, a vanished folder); sysexits' EX_IOERR
INTERRUPTED = 128  # plus the signal's number (130 SIGINT, 143 SIGTERM): stopped, nothing half-written kept

IO_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS)  # the machine's, not the input's


def of_os_error(e: OSError) -> int:
  """A write the machine failed (full disk, quota, device error, read-only) is an I/O failure;
  any other OSError is a path the user gave that does not work (bad input)."""
  return IO_FAILURE if e.errno in IO_ERRNOS else BAD_INPUT


def of_signal(signum: int) -> int:
  """The exit code of a command stopped by signal `signum` (130 for SIGINT, 143 for SIGTERM)."""
  return INTERRUPTED + int(signum)


def signal_name(signum: int) -> str:
  return signal.Signals(signum).name


def one_line(e: BaseException) -> str:
  """An exception's message on one line (its type's name where it has none)."""
  return " ".join(str(e).split()) or type(e).__name__


def fail(prefix: str, e: BaseException | str, code: int) -> int:
  """Prints `prefix: message` as one line on stderr and returns `code` (for `return fail(...)`)."""
  text = e if isinstance(e, str) else one_line(e)
  print(f"{prefix}: {text}", file=sys.stderr, flush=True)
  return code
