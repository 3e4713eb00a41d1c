"""The config reference: a markdown table per config section, read from the dataclasses in
mtjax/config.py (each field's name, type, default and the comment after it), and the table of
model families, read from their registry (mtjax.models).

    python -m mtjax.config_reference                      # print every section
    python -m mtjax.config_reference --write README.md docs/config.md
    python -m mtjax.config_reference --check README.md docs/config.md

`--write` replaces the text between the marker comments
`<!-- config-reference: SECTION [SECTION ...] -->` and `<!-- /config-reference -->` with those
sections' tables, and between `<!-- family-table -->` and `<!-- /family-table -->` with the
families'; `--check` exits 1 when a file differs from what `--write` would make of it.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import re
import sys
import tokenize
import typing
from pathlib import Path

from mtjax import config, exits, models

MARKER = re.compile(r"(<!-- config-reference: ([a-z. ]+) -->\n)(.*?)(<!-- /config-reference -->)",
                    re.S)
FAMILY_MARKER = re.compile(r"(<!-- family-table -->\n)(.*?)(<!-- /family-table -->)", re.S)
# Rows whose meaning ends with what the code knows beyond config.py: the registered families.
_GENERATED = {"model.family": lambda: ", ".join(models.families())}


@dataclasses.dataclass(frozen=True)
class Field:
  """One config key as the reference shows it."""
  key: str  # dotted path, e.g. engine.grad_queue
  type: str  # the annotation, in words
  default: str  # as YAML writes it
  doc: str  # the comment after the field in mtjax/config.py


def _aliases(module_source: str) -> dict[str, ast.expr]:
  """Module-level type aliases (`LayerType = Literal[...]`) by name."""
  out = {}
  for node in ast.parse(module_source).body:
    if (isinstance(node, ast.Assign) and len(node.targets) == 1
        and isinstance(node.targets[0], ast.Name) and isinstance(node.value, ast.Subscript)):
      out[node.targets[0].id] = node.value
  return out


def _type_words(node: ast.expr, aliases: dict[str, ast.expr]) -> str:
  """An annotation as a reader says it: `int | Literal["auto"]` -> `int or auto`."""
  if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
    return f"{_type_words(node.left, aliases)} or {_type_words(node.right, aliases)}"
  if isinstance(node, ast.Constant):
    return "null" if node.value is None else str(node.value)
  if isinstance(node, ast.Name):
    if node.id in aliases:
      return _type_words(aliases[node.id], aliases)
    return {"str": "string", "bool": "bool", "int": "int", "float": "float"}.get(node.id, node.id)
  if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name):
    args = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
    if node.value.id == "Literal":
      return " / ".join(str(a.value) for a in args)
    if node.value.id == "tuple":
      return f"list of {_type_words(args[0], aliases)}"
  return ast.unparse(node)


def _yaml(value) -> str:
  if value is None:
    return "null"
  if isinstance(value, bool):
    return str(value).lower()
  if isinstance(value, tuple):
    return "[" + ", ".join(_yaml(v) for v in value) + "]"
  return str(value)


def _comments(source: str) -> dict[int, str]:
  """Each line's trailing comment, by line number within `source`."""
  return {tok.start[0]: tok.string.lstrip("#").strip()
          for tok in tokenize.generate_tokens(io.StringIO(source).readline)
          if tok.type == tokenize.COMMENT}


def fields(cls, prefix: str) -> list[Field]:
  """The reference rows of dataclass `cls`, keys under `prefix`; nested config dataclasses are
  left out (they are sections of their own, see `sections`)."""
  source = inspect.getsource(cls)
  comments = _comments(source)
  aliases = _aliases(inspect.getsource(config))
  defaults = {f.name: f.default for f in dataclasses.fields(cls)}
  out = []
  for node in ast.parse(source).body[0].body:
    if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
      continue
    name = node.target.id
    if name not in defaults or _nested(cls, name) is not None:
      continue
    doc = comments.get(node.lineno, "")
    if prefix + name in _GENERATED:
      doc = f"{doc}: {_GENERATED[prefix + name]()}"
    out.append(Field(prefix + name, _type_words(node.annotation, aliases), _yaml(defaults[name]),
                     doc))
  return out


def _nested(cls, name: str):
  """The config dataclass field `name` of `cls` holds (possibly `X | None`), else None."""
  tp = typing.get_type_hints(cls)[name]
  for t in (tp, *typing.get_args(tp)):
    if dataclasses.is_dataclass(t):
      return t
  return None


def sections() -> dict[str, list[Field]]:
  """Every section of `config.Config`, parents before their nested sections, in field order."""
  out = {}

  def walk(cls, prefix):
    out[prefix.rstrip(".")] = fields(cls, prefix)
    for f in dataclasses.fields(cls):
      sub = _nested(cls, f.name)
      if sub is not None:
        walk(sub, f"{prefix}{f.name}.")

  for f in dataclasses.fields(config.Config):
    walk(_nested(config.Config, f.name), f.name + ".")
  return out


def _cell(text: str) -> str:
  """`text` safe in a markdown table cell; Python's None as YAML's null."""
  text = re.sub(r"\bNone\b", "null", text)
  return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def table(names: list[str]) -> str:
  """The markdown tables of the named sections."""
  all_ = sections()
  unknown = [n for n in names if n not in all_]
  if unknown:
    raise ValueError(f"unknown config section(s) {unknown}; known: {list(all_)}")
  lines = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
  for name in names:
    lines.append(f"| **{name}** | | | |")
    for f in all_[name]:
      lines.append(f"| `{f.key}` | {_cell(f.type)} | `{_cell(f.default)}` | {_cell(f.doc)} |")
  return "\n".join(lines) + "\n"


def family_table() -> str:
  """The markdown table of the registered model families: name, architectures, notes."""
  lines = ["| `model.family` | Hugging Face architecture | what it reads, and what not |",
           "| --- | --- | --- |"]
  for name, f in models.families().items():
    lines.append(f"| `{name}` | {', '.join(f.architectures)} | {_cell(f.notes)} |")
  return "\n".join(lines) + "\n"


def render(text: str) -> str:
  """`text` with every marked block replaced by its sections' tables, or the families'."""
  text = MARKER.sub(lambda m: m.group(1) + table(m.group(2).split()) + m.group(4), text)
  return FAMILY_MARKER.sub(lambda m: m.group(1) + family_table() + m.group(3), text)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m mtjax.config_reference", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--write", nargs="+", metavar="FILE", help="regenerate the marked tables here")
  p.add_argument("--check", nargs="+", metavar="FILE", help="exit 1 if a marked table is stale")
  args = p.parse_args(argv)
  if not (args.write or args.check):
    print(table(list(sections())), end="")
    return 0
  stale = []
  for name in args.write or args.check:
    path = Path(name)
    try:
      text = path.read_text()
    except OSError as e:
      return exits.fail(name, f"cannot read ({e.strerror})", exits.of_os_error(e))
    if not (MARKER.search(text) or FAMILY_MARKER.search(text)):
      return exits.fail(name, "no <!-- config-reference: SECTION --> or <!-- family-table --> "
                              "marker", exits.BAD_INPUT)
    try:
      new = render(text)
    except ValueError as e:
      return exits.fail(name, e, exits.BAD_INPUT)
    if new != text:
      stale.append(name)
      if args.write:
        try:
          path.write_text(new)
        except OSError as e:
          return exits.fail(name, f"cannot write ({e.strerror})", exits.of_os_error(e))
  if args.check and stale:
    return exits.fail("stale config reference", f"{', '.join(stale)}: run python -m "
                      f"mtjax.config_reference --write {' '.join(stale)}", exits.FAILED)
  return exits.OK


if __name__ == "__main__":
  sys.exit(main())
