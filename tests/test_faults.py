"""Faults and bad input over the whole workflow: configs drawn at random through the planner's check,
a full disk during a save, and a soak of random faults (SIGKILLs, full disks, corrupted checkpoints,
truncated token files) over prepare, train and export whose final export must equal an
uninterrupted run's bit for bit."""

import dataclasses
import math
import time
import typing
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings, strategies as st

from mtjax import cli, config, plan

ROOT = Path(__file__).parent.parent
TINY = ROOT / "configs" / "tiny.yaml"

# ---- configs drawn over the dataclasses' fields --------------------------------------------------

ODD = [0, -1, 1, 2, 3, 5, 64, 10**6, 2**40, 10**18, -(10**9), 0.5, -0.5, 1e-3, 1e30, math.nan,
       math.inf, -math.inf, "x", "auto", "", None, True, False, [], [1, 2], {}, {"bogus": 1}]


def _sections() -> dict[str, type]:
  hints = typing.get_type_hints(config.Config)
  return {f.name: hints[f.name] for f in dataclasses.fields(config.Config)}


def _choices(tp) -> list:
  """The values a field's annotation names (Literal options), found anywhere in a Union."""
  if typing.get_origin(tp) is typing.Literal:
    return list(typing.get_args(tp))
  return [c for a in typing.get_args(tp) for c in _choices(a)]


@st.composite
def section_values(draw, cls, depth=0):
  hints = typing.get_type_hints(cls)
  names = [f.name for f in dataclasses.fields(cls)]
  out = {}
  for name in draw(st.lists(st.sampled_from(names), max_size=4, unique=True)):
    tp = hints[name]
    nested = [a for a in (tp, *typing.get_args(tp)) if dataclasses.is_dataclass(a)]
    if nested and depth < 1 and draw(st.booleans()):
      out[name] = draw(section_values(nested[0], depth + 1))
    else:
      out[name] = draw(st.sampled_from(ODD + _choices(tp)))
  if draw(st.integers(0, 9)) == 0:
    out["no_such_key"] = 1
  return out


@st.composite
def config_files(draw):
  """(top-level mapping, base-file mapping or None): a config and, half the time, a base file
  between it and configs/tiny.yaml (a chain of two), with the drawn keys split between them."""
  sections = _sections()
  top = {}
  for name in draw(st.lists(st.sampled_from(sorted(sections)), max_size=3, unique=True)):
    top[name] = draw(section_values(sections[name]))
  if draw(st.integers(0, 14)) == 0:
    top["no_such_section"] = {}
  mid = None
  if draw(st.booleans()):
    mid = {n: draw(section_values(sections[n])) for n in draw(
        st.lists(st.sampled_from(sorted(sections)), max_size=2, unique=True))}
  return top, mid


def planned(path: Path) -> str:
  """What `python -m mtjax.plan --config PATH` decides, in-process: 'planned', or the one-line
  message of the project's error."""
  try:
    cfg = cli.load_config(path)
    plan.prepare(cfg)
  except (config.ConfigError, plan.PlanError) as e:
    text = str(e)
    assert text and "\n" not in text, f"not one line: {text!r}"
    return text
  return "planned"


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(files=config_files())
def test_drawn_configs_plan_or_are_refused_in_one_line(tmp_path, files):
  top, mid = files
  if mid is not None:
    (tmp_path / "mid.yaml").write_text(yaml.safe_dump({"base": str(TINY), **mid}))
    top = {"base": "mid.yaml", **top}
  else:
    top = {"base": str(TINY), **top}
  (tmp_path / "run.yaml").write_text(yaml.safe_dump(top))
  t = time.perf_counter()
  planned(tmp_path / "run.yaml")  # any other exception fails the test
  assert time.perf_counter() - t < 2.0  # refused or planned from arithmetic, nothing compiled


@pytest.mark.parametrize("over", [
    ["model.layers=2000000"], ["model.hidden=10000000"], ["model.vocab_size=1000000000000"],
    ["model.layers=100000", "model.hidden=1024"]])
def test_absurd_sizes_are_refused_before_anything_is_laid_out(over, monkeypatch):
  from mtjax import models, store as store_lib
  forbidden = lambda *a, **k: pytest.fail("laid out, allocated or compiled an absurd config")
  monkeypatch.setattr(models, "spec", forbidden)
  monkeypatch.setattr(store_lib, "create", forbidden)
  monkeypatch.setattr(plan.probe, "compiled_memory", forbidden)
  t = time.perf_counter()
  with pytest.raises((plan.PlanError, config.ConfigError)) as e:
    plan.prepare(cli.load_config(TINY, over))
  assert "\n" not in str(e.value)
  assert time.perf_counter() - t < 2.0
