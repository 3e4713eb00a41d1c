"""What every command shares: the config as a command reads it (YAML, dotted overrides, a Hugging
Face model's config.json, the model family checked), a bad config as a one-line error, and the exit
codes every command keeps to (docs/reliability.md).
"""

from __future__ import annotations

import dataclasses
import errno
import sys
from pathlib import Path

from mtjax import config, hf, models
from mtjax.config import TRAINING_KNOBS, Config, ConfigError

# Exit codes: a script tells what happened from the code alone; stderr holds one line saying why.
OK = 0  # the command did what it was asked
FAILED = 1  # an internal failure (a host update that failed, a bug): the last checkpoint is intact
BAD_INPUT = 2  # a bad config, path, data file or checkpoint, refused before anything was changed
DIVERGED = 3  # train.max_skipped_steps steps in a row had a non-finite loss or gradient
IO_FAILURE = 74  # a write failed (full disk, permissions, a vanished folder); sysexits' EX_IOERR
INTERRUPTED = 128  # plus the signal's number (130 SIGINT, 143 SIGTERM): stopped, the step saved

IO_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS)  # the machine's, not the input's


def exit_code_of_os_error(e: OSError) -> int:
  """A write the machine failed (full disk, quota, device error, read-only) is an I/O failure;
  any other OSError is a path the user gave that does not work (bad input)."""
  return IO_FAILURE if e.errno in IO_ERRNOS else BAD_INPUT


def load_config(path: str | Path | None, overrides: list[str] = ()) -> Config:
  """Reads YAML (with `base:` files merged first, relative to it), then applies dotted overrides;
  with `model.from_hf` the model comes from that directory's config.json (its family included).
  Raises ConfigError naming the key on anything wrong."""
  raw = with_hf_model(config.read(path, overrides))
  cfg = config.from_dict(raw)
  models.get(cfg.model.family)  # a family mtjax has
  return cfg


def with_hf_model(raw: dict) -> dict:
  """Fills the model section from `model.from_hf`'s config.json; a key the user also set must
  agree with it."""
  model = raw.get("model")
  if not isinstance(model, dict) or not model.get("from_hf"):
    return raw
  # Resolved now: the path is stored in the config (and every checkpoint) and must still name the
  # same directory when an export runs from another working directory.
  directory = Path(str(model["from_hf"])).expanduser().resolve()
  try:
    fields = hf.Checkpoint(directory).model_fields()
  except (hf.HFError, OSError) as e:
    raise ConfigError(f"model.from_hf: {e}") from None
  merged = {**fields, **model, "from_hf": str(directory)}
  # the widths a section may write either way (head_dim: 64 or null at hidden / heads = 64)
  mine_w = config.derived_widths({**fields, **model})
  theirs_w = config.derived_widths(fields)
  for k, v in fields.items():
    if k not in model or (k in ("kv_heads", "head_dim") and mine_w[k] == theirs_w[k]):
      continue
    if dataclasses.is_dataclass(v) and isinstance(model[k], dict):  # a section: key by key
      section = dataclasses.asdict(v)
      for sub, mine in model[k].items():
        if sub in section and sub not in TRAINING_KNOBS and section[sub] != _plain(mine):
          raise ConfigError(f"model.{k}.{sub}: {mine!r} differs from {directory}/config.json "
                            f"({section[sub]!r}); leave it out")
      merged[k] = {**section, **model[k]}
    elif model[k] != _plain(v):
      raise ConfigError(f"model.{k}: {model[k]!r} differs from {directory}/config.json ({v!r}); "
                        "leave it out")
  return {**raw, "model": merged}



def _plain(v):
  """A config.json value as the YAML would write it (tuples as lists)."""
  return list(v) if isinstance(v, tuple) else v


def parse_cli(parser, argv=None):
  """Adds --config and dotted overrides to `parser`, parses `argv` and loads the config; a bad
  config ends the program with exit code 2 and a one-line message. Returns (args, config)."""
  parser.add_argument("--config", help="YAML config file (default: every setting at its default)")
  parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=5")
  args = parser.parse_args(argv)
  try:
    return args, load_config(args.config, args.overrides)
  except ConfigError as e:
    print(f"config error: {e}", file=sys.stderr)
    raise SystemExit(BAD_INPUT) from None
