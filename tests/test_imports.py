"""The package's layers (docs/architecture.md): no module imports one above it, and no import circle.

Every `import mtjax...` and `from mtjax... import ...` in mtjax/, at the top of a module or inside
a function, is an edge from the importing module to the imported one; importing a package's
submodule does not count its `__init__` (Python runs it, but the submodule does not depend on
what the package re-exports).
"""

import ast
from pathlib import Path

from mtjax import models

ROOT = Path(__file__).parent.parent / "mtjax"
FAMILY_MODULES = sorted({f.module for f in models.families().values()})

# Lowest first. A module may import modules of its own layer or below, never above.
LAYERS = [
    ["mtjax.config", "mtjax.exits"],
    ["mtjax.layout", "mtjax.attention", "mtjax.data", "mtjax.quantize"],
    ["mtjax.models.registry", "mtjax.models.layers", "mtjax.models.grouped"],
    ["mtjax.models.moe", "mtjax.models.mla", "mtjax.models.deltanet", "mtjax.models.common"],
    ["mtjax.models.block", *FAMILY_MODULES],  # each family module, as the registry finds them
    ["mtjax.models.spec", "mtjax.models"],
    ["mtjax.hf", "mtjax.optimizer", "mtjax.dpo", "mtjax.objectives", "mtjax.config_reference"],
    ["mtjax.store", "mtjax.api", "mtjax.programs"],
    ["mtjax.checkpoint", "mtjax.engine"],
    ["mtjax.cli", "mtjax.runlog", "mtjax.report"],
    ["mtjax.plan"],
    ["mtjax.launch"],
    # the commands: `python -m mtjax.plan` plans this machine through launch
    ["mtjax.train", "mtjax.export", "mtjax.generate", "mtjax.plan.__main__", "mtjax"],
]


def module_name(path: Path) -> str:
  parts = ["mtjax", *path.relative_to(ROOT).with_suffix("").parts]
  return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
  return {module_name(p): p for p in ROOT.rglob("*.py")}


def imports(path: Path, known: set[str]) -> set[str]:
  """The mtjax modules `path` imports, anywhere in it."""
  out = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      out |= {a.name for a in node.names if a.name.startswith("mtjax")}
    elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("mtjax"):
      for a in node.names:  # `from mtjax.models import moe` imports the submodule
        sub = f"{node.module}.{a.name}"
        out.add(sub if sub in known else node.module)
  return out


def layer_of(name: str) -> int:
  """The layer of the longest listed prefix of `name` (mtjax.data.chat is mtjax.data's)."""
  best, level = -1, None
  for i, layer in enumerate(LAYERS):
    for prefix in layer:
      if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > best:
        best, level = len(prefix), i
  assert level is not None, f"{name}: in no layer of tests/test_imports.py (add it)"
  return level


def graph() -> dict[str, set[str]]:
  mods = modules()
  return {name: imports(path, set(mods)) - {name} for name, path in mods.items()}


def test_every_module_has_a_layer():
  for name in modules():
    layer_of(name)


def test_no_module_imports_one_above_it():
  upward = [f"{a} (layer {layer_of(a)}) imports {b} (layer {layer_of(b)})"
            for a, deps in graph().items() for b in deps if layer_of(b) > layer_of(a)]
  assert not upward, "\n".join(upward)


def test_no_import_circle():
  g = graph()
  state, stack, cycles = {}, [], []

  def visit(n):
    state[n] = "open"
    stack.append(n)
    for m in sorted(g.get(n, ())):
      if state.get(m) == "open":
        cycles.append(stack[stack.index(m):] + [m])
      elif m not in state:
        visit(m)
    stack.pop()
    state[n] = "done"

  for n in sorted(g):
    if n not in state:
      visit(n)
  assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_the_test_catches_an_upward_import_and_a_circle():
  """The checks find what they look for: a made-up graph with both faults."""
  fake = {"mtjax.config": {"mtjax.store"}, "mtjax.store": {"mtjax.config"}}
  assert layer_of("mtjax.store") > layer_of("mtjax.config")
  assert any(layer_of(b) > layer_of(a) for a, deps in fake.items() for b in deps)
