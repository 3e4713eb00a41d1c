"""The documentation against the code: the config reference is what mtjax/config.py says, every
relative link resolves, the README stays short, its set-up commands are the ones CI runs, and its
functional-API example runs."""

import re
import textwrap
from pathlib import Path

import numpy as np
import pytest

from mtjax import config, config_reference

ROOT = Path(__file__).parent.parent
README = ROOT / "README.md"
DOCS = [README, ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
# Pages the README links that other branches write; drop each once it is merged.
def test_config_reference_matches_the_dataclasses(capsys):
  rc = config_reference.main(["--check", str(README), str(ROOT / "docs" / "config.md")])
  assert rc == 0, capsys.readouterr().err


def test_config_reference_shows_every_field_with_its_default_and_comment():
  text = "".join(m.group(3) for page in (README, ROOT / "docs" / "config.md")
                 for m in config_reference.MARKER.finditer(page.read_text()))
  for section, cls in (("model", config.ModelConfig), ("optim", config.OptimConfig),
                       ("engine", config.EngineConfig), ("data", config.DataConfig),
                       ("train", config.TrainConfig), ("train.dpo", config.DPOConfig),
                       ("train.grpo", config.GRPOConfig),
                       ("model.rope", config.RopeConfig), ("model.moe", config.MoEConfig),
                       ("model.mla", config.MLAConfig),
                       ("model.linear", config.LinearAttentionConfig),
                       ("model.vision", config.VisionConfig)):
    for f in cls.__dataclass_fields__.values():
      if f.name in ("rope", "moe", "mla", "linear", "vision", "dpo", "grpo"):
        continue
      row = re.search(rf"^\| `{re.escape(section)}\.{f.name}` \|.*$", text, re.M)
      assert row, f"{section}.{f.name} missing from the config reference"
      cells = [c.strip() for c in row.group(0).strip("|").split(" | ")]
      assert cells[2] == f"`{config_reference._yaml(f.default)}`", (section, f.name, cells)
      assert cells[3], f"{section}.{f.name}: no comment after the field in mtjax/config.py"


def test_check_fails_on_a_stale_table_and_write_repairs_it(tmp_path, capsys):
  page = tmp_path / "page.md"
  marked = "x\n<!-- config-reference: data -->\n<!-- /config-reference -->\n"
  fresh = config_reference.render(marked)
  page.write_text(fresh.replace("`packed`", "`padded`"))
  assert config_reference.main(["--check", str(page)]) == 1
  assert "stale config reference" in capsys.readouterr().err
  assert config_reference.main(["--write", str(page)]) == 0
  assert page.read_text() == fresh and "| `data.mode` | packed / padded | `packed` |" in fresh
  page.write_text("no marker")
  assert config_reference.main(["--check", str(page)]) == 2


def test_the_family_table_and_the_family_key_are_the_registry(tmp_path, capsys):
  """README's family table and model.family's row are generated from the registry: a family
  whose row is missing or stale fails the check, and --write restores it."""
  from mtjax import models
  names = list(models.families())
  table = config_reference.FAMILY_MARKER.search(README.read_text()).group(2)
  for name, f in models.families().items():
    assert f"| `{name}` | {', '.join(f.architectures)} | {f.notes} |" in table
  assert len(table.strip().splitlines()) == 2 + len(names)
  row = re.search(r"^\| `model\.family` \|.*$", (ROOT / "docs" / "config.md").read_text(), re.M)
  assert row.group(0).endswith(f": {', '.join(names)} |")
  page = tmp_path / "page.md"
  fresh = config_reference.render("x\n<!-- family-table -->\n<!-- /family-table -->\n")
  page.write_text("\n".join(line for line in fresh.splitlines() if "`phi3`" not in line) + "\n")
  assert config_reference.main(["--check", str(page)]) == 1
  assert "stale config reference" in capsys.readouterr().err
  assert config_reference.main(["--write", str(page)]) == 0 and page.read_text() == fresh


def test_every_relative_link_points_to_an_existing_file():
  broken = []
  for doc in DOCS:
    for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
      if re.match(r"[a-z]+:", target) or target.startswith("#"):
        continue
      path = (doc.parent / target.split("#")[0]).resolve()
      if not path.exists():
        broken.append(f"{doc.relative_to(ROOT)}: {target}")
  assert not broken, broken


def test_readme_is_short():
  assert len(README.read_text().splitlines()) <= 250  # the rest lives in docs/


def test_readme_setup_commands_are_the_ones_ci_runs():
  """The README's two set-up commands, as .ci/run runs them (CI adds only --quiet/--no-progress)."""
  ci = re.sub(r" --quiet| --no-progress", "", (ROOT / ".ci" / "run").read_text())
  blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), re.S)
  install, tests = blocks[0].strip(), blocks[1].strip()
  for command in [*install.split(" && "), tests]:
    assert command in ci, command


def test_readme_functional_api_example_runs(tmp_path):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  torch.manual_seed(0)
  hf = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
  transformers.LlamaForCausalLM(hf).save_pretrained(tmp_path)
  code = re.search(r"```python\n(.*?)```", README.read_text(), re.S).group(1)
  scope = {}
  # The README's own code, as a reader would paste it.
  exec(textwrap.dedent(code).replace('"MODEL"', repr(str(tmp_path))), scope)
  assert scope["logits"].shape == (1, 4, 64)
  names = scope["tensors"]
  assert "model.layers.1.self_attn.q_proj.weight" in names
  assert all(np.all(np.isfinite(v)) for v in names.values())
