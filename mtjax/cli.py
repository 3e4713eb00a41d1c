"""What every command that reads a config shares: the config as a command reads it (YAML, dotted
overrides, a Hugging Face model's config.json, the model family checked), and a bad config as a
one-line error with exit code 2 (the codes are mtjax.exits')."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from mtjax import config, exits, hf, models, objectives
from mtjax.config import Config, ConfigError, run_knobs

# What --help of a command that reads a config ends with.
CONFIG_HELP = ("Every config key (train.*, data.*, optim.*, engine.*, model.*) with its type, default "
               "and meaning: the config reference in README.md and docs/config.md (python -m "
               "mtjax.config_reference prints it).")

# Model keys a run may set beyond its config.json: the context it is trained to.
LENGTH_KNOBS = ("max_position",)


def load_config(path: str | Path | None, overrides: list[str] = ()) -> Config:
  """Reads YAML (with `base:` files merged first, relative to it), then applies dotted overrides;
  with `model.from_hf` the model comes from that directory's config.json (its family included).
  Raises ConfigError naming the key on anything wrong."""
  raw = with_hf_model(config.read(path, overrides))
  cfg = config.from_dict(raw)
  models.get(cfg.model.family)  # a family mtjax has
  objectives.get(cfg.train).check(cfg)  # what the objective needs of the rest of the config
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
    if k in LENGTH_KNOBS:  # how far this run trains the model, which the export then records
      continue
    if dataclasses.is_dataclass(v) and isinstance(model[k], dict):  # a section: key by key
      section = dataclasses.asdict(v)
      for sub, mine in model[k].items():
        if sub in section and sub not in run_knobs(section) and section[sub] != _plain(mine):
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


def parse_cli(parser, argv=None, extra=None):
  """Adds --config and dotted overrides to `parser`, parses `argv` and loads the config; a bad
  config ends the program with exit code 2 and a one-line message. `extra(args)` may give more
  overrides from the command's own flags (applied last). Returns (args, config)."""
  parser.add_argument("--config", help="YAML config file (default: every setting at its default)")
  parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=5")
  args = parser.parse_args(argv)
  try:
    return args, load_config(args.config, [*args.overrides, *(extra(args) if extra else [])])
  except ConfigError as e:
    print(f"config error: {e}", file=sys.stderr)
    raise SystemExit(exits.BAD_INPUT) from None
