"""The objective registry: the engine, the trainer and the planner ask an objective for what they
need and never compare its name; a new objective is a class, not edits across the package; DPO's
held-out evaluation."""

import ast
import json
from pathlib import Path

import jax
import numpy as np
import pytest

from test_engine import batch_for, make_cfg, new_engine
from mtjax import config, engine, objectives, runlog, store as store_lib, train

ROOT = Path(__file__).parent.parent
TINY = ROOT / "configs" / "tiny.yaml"
# the modules that may name objectives: the registry, an objective's own module, the config
# (its Literal of names), and the config reference's prose
DECLARING = {"objectives.py", "dpo.py", "config.py", "config_reference.py"}


def test_no_module_compares_an_objective_by_name():
  """No `== "dpo"` / `!= "lm"` / `in ("lm", ...)` outside the modules that declare objectives."""
  names = {"lm", "dpo"}
  found = []
  for path in (ROOT / "mtjax").rglob("*.py"):
    if path.name in DECLARING:
      continue
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Compare):
        consts = [c.value for c in ast.walk(node) if isinstance(c, ast.Constant)]
        if names & {c for c in consts if isinstance(c, str)}:
          found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
  assert not found, found


class Doubled(objectives.LanguageModel):
  """A third objective, defined here only: twice the language-model loss."""
  name = "lm-doubled"

  def head_step(self, fns):
    lm = super().head_step(fns)

    def step(*args):
      loss, dx, gh, gt, metrics = lm(*args)
      return 2 * loss, 2 * dx, 2 * gh, None if gt is None else 2 * gt, metrics
    return step


def test_a_new_objective_plugs_into_the_engine_unchanged():
  cfg = make_cfg()
  _, eng = new_engine(cfg)
  b = batch_for(cfg, 0)
  loss, grads = eng.grads(b)
  st2 = store_lib.create(cfg, jax.random.key(0))  # a second engine over the same initial weights
  eng2 = engine.Engine(cfg, st2, objective=Doubled())
  loss2, grads2 = eng2.grads(b)
  assert loss2 == pytest.approx(2 * loss, rel=1e-6)
  for g, g2 in zip(grads, grads2, strict=True):
    np.testing.assert_allclose(g2, 2 * g, rtol=1e-5, atol=1e-7 * np.abs(g).max())
  eng.close()
  eng2.close()


def test_unknown_objective_is_a_config_error_naming_the_registry():
  t = config.TrainConfig()
  object.__setattr__(t, "objective", "ppo")
  with pytest.raises(config.ConfigError, match="train.objective: 'ppo' is not one of dpo, grpo, lm"):
    objectives.get(t)


def test_dpo_evaluates_held_out_pairs(tmp_path):
  """`prepare --format preference` holds pairs out by default; a DPO run with train.eval_every
  evaluates its loss and rewards on them: log 2 and zero rewards at the initial weights."""
  from test_chat import CHATML_TAGGED, make_tokenizer
  from mtjax import data
  tok = make_tokenizer(tmp_path / "tok", CHATML_TAGGED)
  rows = [{"prompt": f"What is {a} and {a + 1}?", "chosen": f"{2 * a + 1}.", "rejected": "No."}
          for a in range(60)]
  (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  out = tmp_path / "pairs"
  data.prepare(tok, out, [str(tmp_path / "p.jsonl")], "preference", progress=False,
               val_fraction=0.1)
  run = tmp_path / "run"
  cfg = config.load(TINY, ["train.objective=dpo", "train.steps=4", "train.batch=4",
                           "train.seq=64", "model.vocab_size=320", "data.source=prepared",
                           f"data.path={out}", f"train.run_dir={run}", "train.tensorboard=false",
                           "train.eval_every=2", "train.eval_batches=2", "optim.lr=1e-2"])
  s = train.run(cfg, progress=False)
  assert [step for step, _ in s["held_out"]] == [0, 2, 4]
  assert s["held_out"][0][1] == pytest.approx(np.log(2.0), rel=1e-5)  # policy == reference
  records = {r["step"]: r for r in runlog.read_metrics(run)}
  assert records[0]["held_out_reward_margin"] == pytest.approx(0.0, abs=1e-6)
  assert {"held_out_reward_accuracy", "held_out_reward_chosen"} <= set(records[4])
  assert (out / "ref_logps.val.npy").is_file()
