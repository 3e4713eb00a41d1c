"""The layer programs: built once, run by the engine, compiled as they are by the memory probe."""

from pathlib import Path

import jax

from mtjax import config, engine, launch, programs, store as store_lib

TINY = Path(__file__).parent.parent / "configs" / "tiny.yaml"


def test_the_memory_probe_compiles_the_engines_own_programs(monkeypatch):
  """The engine and the planner's memory probe take their programs from one builder at equal
  settings: the block backward lowers to the same program (its donated cotangent included), and
  XLA's analysis of the probe's compile counts the donated buffer as aliased."""
  built = []
  build = programs.build
  monkeypatch.setattr(programs, "build", lambda *a, **k: built.append(build(*a, **k)) or built[-1])
  # a shape of its own: the probe's answers are cached per shape in the process
  cfg, _ = launch.plan_run(config.load(TINY, ["engine.device_state_layers=0", "train.batch=2",
                                           "train.seq=40"]))
  st = store_lib.create(cfg, jax.random.key(0))
  eng = engine.Engine(cfg, st)
  working = launch.compiled_memory(cfg)
  assert len(built) == 2 and built[0] is eng.programs
  ran, probed = built
  assert ran.settings == probed.settings
  fn, args = programs.shaped_calls(probed, 2, 40, eng.device)["block backward"]
  assert fn is probed.block_bwd["block"]
  text = fn.lower(*args).as_text()
  assert text == ran.block_bwd["block"].lower(*args).as_text()
  assert "tf.aliasing_output" in text  # the cotangent's buffer becomes the outgoing one
  assert working["block backward"]["alias"] == 2 * 40 * cfg.model.hidden * 4  # [B, T, D] fp32
  eng.close()
