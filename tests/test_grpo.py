"""GRPO (train.objective=grpo): advantages and token weights against their formulas, the engine's
surrogate gradient against plain JAX on the whole-model reference, the rewards, a run that resumes
exactly, and the CLI's checks."""

import json
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import reference as ref
from numerics import assert_close
from test_engine import make_cfg, new_engine
from mtjax import config, grpo, runlog, train

ROOT = Path(__file__).parent.parent
TINY = ROOT / "configs" / "tiny.yaml"


def test_advantages_and_token_weights_are_the_formulas():
  r = np.array([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5], [3.0, -1.0, 2.0, 0.0]])
  mean = r.mean(1, keepdims=True)
  std = np.sqrt(((r - mean) ** 2).sum(1, keepdims=True) / (r.shape[1] - 1))  # Bessel's
  assert_close(grpo.advantages(r, "none"), r - mean)
  assert_close(grpo.advantages(r, "group"), (r - mean) / (std + 1e-4))
  assert np.all(grpo.advantages(r, "group")[1] == 0)  # one reward for all: no signal, no NaN
  m = np.array([[0, 1, 1, 0], [0, 0, 1, 1], [1, 1, 1, 1]], np.float32)
  assert_close(grpo.token_weights(m, "sequence", 4), m / m.sum(1, keepdims=True) / 3)
  assert_close(grpo.token_weights(m, "token", 4), m / m.sum())
  assert_close(grpo.token_weights(m, "constant", 4), m / (3 * 4))


@pytest.mark.parametrize("completion, answer, want", [
    ("7", "7", 1.0), ("so 3 + 4 = 7.", "7", 1.0), ("7 then 8", "7", 0.0), ("1,250", "1250", 1.0),
    ("-2.50", "-2.5", 1.0), ("no number", "7", 0.0), ("70", "7", 0.0)])
def test_exact_answer_compares_the_last_number(completion, answer, want):
  assert grpo.exact_answer("", completion, answer) == want


def user_reward(prompt, completion, answer):  # named by the test below as a module:function
  return len(completion) / 10


def test_reward_functions_builtin_and_imported():
  s = config.GRPOConfig(rewards=("format", "length", "test_grpo:user_reward", "exact_answer"),
                        format_pattern=r"\d+", max_new_tokens=4)
  c = grpo.Completion("2+2=", "4", "4", tokens=2)
  assert [fn(c) for _, fn in grpo.reward_functions(s)] == [1.0, 0.5, 0.1, 1.0]
  with pytest.raises(ValueError, match="cannot import no_such_module:f"):
    grpo.reward_functions(config.GRPOConfig(rewards=("no_such_module:f",)))
  with pytest.raises(ValueError, match="'speed' is not one of exact_answer, format, length"):
    grpo.reward_functions(config.GRPOConfig(rewards=("speed",)))


def rollout(cfg, rng):
  """A hand-made batch: rows of a prompt then a completion then padding, random advantages."""
  B, T, V = cfg.train.batch, cfg.train.seq, cfg.model.vocab_size
  toks = rng.integers(0, V, (B, T + 1)).astype(np.int32)
  mask = np.zeros((B, T), np.float32)
  for i in range(B):
    p, n = rng.integers(1, 4), rng.integers(1, T - 3)
    mask[i, p - 1:p - 1 + n] = 1
  adv = rng.normal(size=B).astype(np.float32)
  w = grpo.token_weights(mask, cfg.train.grpo.loss_agg, cfg.train.grpo.max_new_tokens)
  return grpo._RolloutBatch(toks[:, :-1], toks[:, 1:], loss_weights=mask, token_weights=w,
                            advantages=adv)


def surrogate(params, b, cfg):
  """-sum w A pi / stop_gradient(pi) on the reference model: the ratio is 1, its gradient is not."""
  logp = ref.token_logps(params, b.inputs, b.targets, cfg.model)
  ratio = jnp.exp(logp - jax.lax.stop_gradient(logp))
  return -jnp.sum(b.token_weights * b.advantages[:, None] * ratio)


def grpo_cfg(grpo_=None, model=None, engine_=None, train_=None):
  raw = config.to_dict(make_cfg(model, engine_))
  raw["train"].update(objective="grpo", grpo={"group": 2, **(grpo_ or {})}, **(train_ or {}))
  raw["data"] = {"source": "synthetic", "path": "prompts.jsonl"}
  return config.from_dict(raw)


@pytest.mark.parametrize("variant", [
    dict(grpo_=dict(loss_agg="sequence")),
    dict(grpo_=dict(loss_agg="token"), model=dict(tie_embeddings=True),
         engine_=dict(loss_chunk=5, device_update_layers=2), train_=dict(batch=8, grad_accum=2)),
    dict(grpo_=dict(loss_agg="constant", max_new_tokens=6), engine_=dict(device_state_layers=4)),
], ids=["sequence", "token-tied-accum", "constant-device"])
def test_grpo_loss_and_gradients_equal_the_formula_on_the_reference_model(variant):
  cfg = grpo_cfg(**variant)
  st, eng = new_engine(cfg)
  b = rollout(cfg, np.random.default_rng(3))
  loss, grads = eng.grads(b)
  want_loss, want_tree = jax.value_and_grad(surrogate)(st.to_tree(), b, cfg)
  assert_close(loss, float(want_loss), name="loss")
  for g, r, grp in zip(grads, ref.flat_grads(st, want_tree), st.groups):
    assert_close(g, r, name=grp.name)
  eng.close()


def arithmetic(tmp_path):
  """The example's character tokenizer and prompts (examples/grpo_arithmetic.py), written here."""
  from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
  vocab = {"<eos>": 0, **{c: i + 1 for i, c in enumerate("0123456789+=")}}
  tok = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
  tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
  tok.decoder = decoders.Fuse()
  tdir = tmp_path / "tok"
  tdir.mkdir()
  tok.save(str(tdir / "tokenizer.json"))
  (tdir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
  prompts = tmp_path / "prompts.jsonl"
  prompts.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n"
                             for a in range(4) for b in range(4)))
  return tdir, prompts, len(vocab)


def run_args(tmp_path, tdir, prompts, vocab, *extra):
  return ["--config", str(TINY), f"model.vocab_size={vocab}", "train.objective=grpo",
          f"data.path={prompts}", f"train.grpo.tokenizer={tdir}", "train.grpo.group=4",
          "train.grpo.max_new_tokens=3", "train.batch=8", "train.seq=8", "optim.lr=1e-2",
          "optim.warmup_steps=0", "engine.compute_dtype=float32", "train.tensorboard=false",
          *extra]


def test_a_grpo_run_logs_rewards_and_resumes_exactly(tmp_path):
  tdir, prompts, vocab = arithmetic(tmp_path)
  whole = config.load(TINY, run_args(tmp_path, tdir, prompts, vocab, "train.steps=6",
                                     f"train.run_dir={tmp_path / 'whole'}")[2:])
  train.run(whole, progress=False)
  records = runlog.read_metrics(tmp_path / "whole")
  assert len(records) == 6
  for r in records:
    assert {"reward_mean", "reward_std", "reward_exact_answer", "completion_tokens_mean",
            "generation_s", "generated_tokens_per_s", "groups_without_signal"} <= set(r)
    assert 1 <= r["completion_tokens_mean"] <= 3 and 0 <= r["reward_mean"] <= 1
  # stopped after 3 steps, resumed: the same samples, rewards and weights as the whole run
  ck = tmp_path / "ck"
  for steps in (3, 6):
    part = config.load(TINY, run_args(tmp_path, tdir, prompts, vocab, f"train.steps={steps}",
                                      "optim.decay_steps=6", f"train.checkpoint_dir={ck}",
                                      f"train.run_dir={tmp_path / 'part'}")[2:])
    train.run(part, progress=False)
  resumed = runlog.read_metrics(tmp_path / "part")
  assert [r["reward_mean"] for r in resumed[-6:]] == [r["reward_mean"] for r in records]
  assert [r["loss"] for r in resumed[-3:]] == [r["loss"] for r in records[-3:]]


@pytest.mark.parametrize("override, message", [
    (["train.batch=6"], "train.batch: 6 completions are not whole groups of train.grpo.group 4"),
    (["train.eval_every=2"], "train.eval_every: 2 needs held-out data"),
    (["train.grpo.rewards=[speed]"], "'speed' is not one of exact_answer, format, length"),
    (["data.path=MISSING"], "is not a file of prompts"),
    (["train.grpo.max_new_tokens=8"], "leaves no room for a prompt in train.seq 8"),
    (["train.grpo.group=1"], "train.grpo.group: 1 completions give no group"),
])
def test_bad_grpo_config_is_one_line_and_exit_2(override, message, tmp_path, capsys):
  tdir, prompts, vocab = arithmetic(tmp_path)
  override = [o.replace("MISSING", str(tmp_path / "none.jsonl")) for o in override]
  argv = ["--no-progress", *run_args(tmp_path, tdir, prompts, vocab), "train.steps=1",
          f"train.run_dir={tmp_path / 'run'}", *override]
  try:
    code = train.main(argv)
  except SystemExit as e:  # the CLI's config parsing exits
    code = e.code
  err = capsys.readouterr().err.strip().splitlines()
  assert code == 2 and len(err) == 1 and message in err[0], err


def test_a_prompt_without_an_answer_is_refused_naming_its_row(tmp_path, capsys):
  tdir, prompts, vocab = arithmetic(tmp_path)
  prompts.write_text(prompts.read_text() + json.dumps({"prompt": "1+1="}) + "\n")
  code = train.main(["--no-progress", *run_args(tmp_path, tdir, prompts, vocab), "train.steps=1",
                     f"train.run_dir={tmp_path / 'run'}"])
  err = capsys.readouterr().err.strip().splitlines()
  assert code == 2 and len(err) == 1 and "row 17 has no answer" in err[0], err


@pytest.mark.soak  # a minute of CPU: the example as a user runs it
def test_the_example_s_reward_rises(tmp_path):
  out = subprocess.run([sys.executable, str(ROOT / "examples" / "grpo_arithmetic.py"),
                        str(tmp_path), "--steps", "60"], capture_output=True, text=True,
                       cwd=ROOT, timeout=600)
  assert out.returncode == 0, out.stderr[-2000:]
  s = json.loads((tmp_path / "summary.json").read_text())
  assert s["steps"] == 60 and s["reward_last"] > 2 * s["reward_first"], s
  assert re.search(r"mean reward of the first \d+ steps", out.stdout)
