"""GRPO (train.objective=grpo): advantages and token weights against their formulas, the head's
clipped surrogate and KL against full-vocabulary logits, the engine's gradient against plain JAX
on the whole-model reference, the rewards, the reference copy's bytes in the plan, runs that
resume exactly (inside a reused generation batch too) and evaluate held-out prompts, and the
CLI's checks."""

import dataclasses
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
from mtjax import config, grpo, models, objectives, programs, runlog, train

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


def rollout(cfg, rng, params=None):
  """A hand-made batch: rows of a prompt then a completion then padding, random advantages; with
  `params` (steps_per_generation > 1 or kl_coef > 0) old and reference log-probs that are the
  reference model's moved by +-0.1 or +-0.5 on the completion tokens, so the ratios fall inside
  and on both sides outside the clip."""
  B, T, V = cfg.train.batch, cfg.train.seq, cfg.model.vocab_size
  s = cfg.train.grpo
  toks = rng.integers(0, V, (B, T + 1)).astype(np.int32)
  mask = np.zeros((B, T), np.float32)
  for i in range(B):
    p, n = rng.integers(1, 4), rng.integers(1, T - 3)
    mask[i, p - 1:p - 1 + n] = 1
  adv = rng.normal(size=B).astype(np.float32)
  w = grpo.token_weights(mask, s.loss_agg, s.max_new_tokens)
  b = grpo._RolloutBatch(toks[:, :-1], toks[:, 1:], loss_weights=mask, token_weights=w,
                         advantages=adv)
  if params is None:
    return b
  logp = np.asarray(ref.token_logps(params, b.inputs, b.targets, cfg.model))
  moved = lambda: logp - mask * rng.choice([-0.5, -0.1, 0.1, 0.5], (B, T)).astype(np.float32)
  return dataclasses.replace(b, old_logps=moved() if s.steps_per_generation > 1 else None,
                             ref_logps=moved() if s.kl_coef else None)


def surrogate(params, b, cfg):
  """The clipped surrogate plus the k3 KL on the reference model, in plain JAX: without old
  log-probs the ratio is pi / stop_gradient(pi), 1, and its gradient is not."""
  s = cfg.train.grpo
  logp = ref.token_logps(params, b.inputs, b.targets, cfg.model)
  old = jax.lax.stop_gradient(logp) if b.old_logps is None else b.old_logps
  ratio, a = jnp.exp(logp - old), b.advantages[:, None]
  high = s.clip_eps if s.clip_eps_high is None else s.clip_eps_high
  loss = -jnp.sum(b.token_weights * jnp.minimum(ratio * a,
                                                jnp.clip(ratio, 1 - s.clip_eps, 1 + high) * a))
  if b.ref_logps is not None:
    d = b.ref_logps - logp
    loss = loss + s.kl_coef * jnp.sum(b.token_weights * (jnp.exp(d) - d - 1))
  return loss


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
    dict(grpo_=dict(steps_per_generation=2, clip_eps_high=0.28, kl_coef=0.5),
         engine_=dict(loss_chunk=5), train_=dict(batch=8, grad_accum=2)),
], ids=["sequence", "token-tied-accum", "constant-device", "clip-kl-accum"])
def test_grpo_loss_and_gradients_equal_the_formula_on_the_reference_model(variant):
  cfg = grpo_cfg(**variant)
  st, eng = new_engine(cfg)
  s = cfg.train.grpo
  b = rollout(cfg, np.random.default_rng(3),
              st.to_tree() if s.steps_per_generation > 1 or s.kl_coef else None)
  loss, grads = eng.grads(b)
  want_loss, want_tree = jax.value_and_grad(surrogate)(st.to_tree(), b, cfg)
  assert_close(loss, float(want_loss), name="loss")
  for g, r, grp in zip(grads, ref.flat_grads(st, want_tree), st.groups):
    assert_close(g, r, name=grp.name)
  eng.close()


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_the_head_step_s_clipped_surrogate_and_kl_equal_a_full_vocab_formula(tied):
  """The chunked head step's loss, metrics and gradients (hidden state, head weights, tied table)
  against jax.grad of the loss written on full logits, on a batch whose ratios lie inside the
  clip and outside it on both sides, with advantages of both signs and a KL term."""
  cfg = grpo_cfg(dict(steps_per_generation=2, clip_eps=0.2, clip_eps_high=0.28, kl_coef=0.3),
                 model=dict(tie_embeddings=tied), engine_=dict(loss_chunk=7))
  m = cfg.model
  spec = models.spec(m)
  fns = programs.layer_fns(spec, jnp.float32, None, cfg.engine.loss_chunk)
  step = jax.jit(objectives.get(cfg.train).head_step(fns))
  rng = np.random.default_rng(0)
  B, T, D, V = 4, 6, m.hidden, m.vocab_size
  lay = spec.layouts["head"]
  w_head = jnp.asarray(rng.normal(size=lay.size), jnp.float32) * 0.3
  table = jnp.asarray(rng.normal(size=V * D), jnp.float32) * 0.3 if tied else None
  x = jnp.asarray(rng.normal(size=(B, T, D)), jnp.float32)
  targets = jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32)
  mask = np.ones((B, T), np.float32)
  mask[:, 0] = mask[-1, -2:] = 0  # a prompt target per row, padding in the last row
  adv = jnp.asarray([1.5, -0.7, 0.4, -1.2], jnp.float32)
  w = jnp.asarray(grpo.token_weights(mask, "token", 6))

  def logps(w_head, table, x):  # full [B, T, V] logits: no chunks
    p = lay.unflatten(w_head)
    out = table.reshape(V, D).T if tied else p["out"]
    logits = ref.rmsnorm(x, p["norm"]["scale"], m.norm_eps) @ out
    return jnp.take_along_axis(jax.nn.log_softmax(logits, -1), targets[..., None], -1)[..., 0]

  logp = logps(w_head, table, x)
  moved = lambda d: logp - jnp.asarray(mask * np.resize(np.float32(d), (B, T)))
  old = moved([0.5, -0.1, 0.1, -0.5, 0.5])  # ratios 1.65, 0.90, 1.11, 0.61 against [0.8, 1.28]
  ref_ = moved([-0.4, 0.3])

  def loss_fn(w_head, table, x):
    lp = logps(w_head, table, x)
    r = jnp.exp(lp - old)
    a = adv[:, None]
    d = ref_ - lp
    return jnp.sum(w * (-jnp.minimum(r * a, jnp.clip(r, 0.8, 1.28) * a)
                        + 0.3 * (jnp.exp(d) - d - 1)))

  want_loss, (want_gh, want_gt, want_dx) = jax.value_and_grad(loss_fn, argnums=(0, 1, 2))(
      w_head, table, x)
  per_token = np.float32(1 / mask.sum())
  loss, dx, gh, gt, metrics = step(w_head, table, x, targets, w, jnp.asarray(mask), adv, old,
                                   ref_, per_token)
  # fp32 on both sides, reductions in another order (chunks of 7 tokens, a two-pass backward):
  # rounding bounded by the magnitudes summed, so the bounds scale with each tensor's norm
  assert_close(loss, want_loss, name="loss")
  assert_close(dx, want_dx, name="d hidden")
  assert_close(gh, want_gh, name="d head")
  if tied:
    assert_close(gt, want_gt, name="d table")
  r = np.exp(np.asarray(logp - old))
  a = np.asarray(adv)[:, None]
  clipped = mask * (((a > 0) & (r > 1.28)) | ((a < 0) & (r < 0.8)))
  assert clipped[np.asarray(adv) > 0].any() and clipped[np.asarray(adv) < 0].any()  # both sides
  d = np.asarray(ref_ - logp)
  assert_close(metrics["clip_fraction"], clipped.sum() / mask.sum(), name="clip_fraction")
  assert_close(metrics["ratio_mean"], (r * mask).sum() / mask.sum(), name="ratio_mean")
  assert_close(metrics["kl"], ((np.exp(d) - d - 1) * mask).sum() / mask.sum(), name="kl")


def test_the_plan_counts_the_reference_copy_kl_coef_keeps():
  from mtjax import plan, store as store_lib
  cfg = grpo_cfg(dict(kl_coef=0.1))
  copy = grpo.FrozenWeights(store_lib.create(cfg, jax.random.key(0)))
  item = "reference weights (train.grpo.kl_coef)"
  assert plan.make(cfg).host[item] == sum(w.nbytes for w in copy.w)  # 4 B/param
  assert plan.make(grpo_cfg()).host[item] == 0


def test_the_plan_counts_the_sampler_s_device_bytes_beyond_the_step_s():
  from mtjax import generate, plan, store as store_lib
  cfg = grpo_cfg(dict(max_new_tokens=6))
  t, m = cfg.train, cfg.model
  st = store_lib.create(cfg, jax.random.key(0))
  params = st.device_tree(jnp.float32)
  prompt = t.seq + 1 - 6  # the longest prompt train.seq leaves beside the completion
  ids = np.ones((t.batch, prompt), np.int32)
  _, cache = generate.prefill(m, params, ids, np.ones_like(ids, bool),
                              slots=generate.bucket(prompt + 6))
  held = sum(a.nbytes for a in jax.tree.leaves((params, cache)))  # what a rollout allocates
  got = objectives.get(t).device_bytes(cfg, st.n_params)
  slots = cache.valid.shape[1]
  # beside them: the prefill's fp32 scores and probabilities, four [rows, vocab] fp32 arrays
  assert got == held + 8 * t.batch * m.heads * prompt * slots + 16 * t.batch * m.vocab_size
  made = plan.make(cfg)
  step = sum(v for k, v in made.device.items()
             if k not in ("weights and optimizer state (device tier)",
                          "sampler beyond the step's buffers (train.grpo)"))
  largest = max(g.size for g in st.groups)
  assert made.device["sampler beyond the step's buffers (train.grpo)"] == max(
      0, got + 4 * largest - step)
  assert "sampler beyond the step's buffers (train.grpo)" not in plan.make(
      config.from_dict({**config.to_dict(cfg), "train": {**config.to_dict(cfg)["train"],
                                                         "objective": "lm"}})).device


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


def test_reused_generation_batches_clip_keep_a_kl_evaluate_and_resume_mid_batch_exactly(tmp_path):
  """Two optimizer steps a generation batch with a KL to the initial weights: the second step's
  ratio moves off 1 and its clip fraction is logged, the held-out greedy reward is logged, and a
  run stopped inside a generation batch (after step 3 of 6) resumes to the same weights and
  optimizer state, bit for bit (the checkpoints' checksums), as the run that went straight on."""
  from mtjax import checkpoint
  tdir, prompts, vocab = arithmetic(tmp_path)
  held = tmp_path / "held.jsonl"
  held.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n"
                          for a, b in ((0, 1), (2, 2), (3, 1))))
  # the format reward (a + or = in the completion) splits a random model's groups: advantages
  opts = ["train.grpo.steps_per_generation=2", "train.grpo.clip_eps=0.02",
          "train.grpo.kl_coef=0.1", "train.grpo.rewards=[exact_answer,format]",
          "train.grpo.format_pattern=.*[+=].*", "train.eval_every=3",
          f"train.grpo.eval_path={held}", "optim.decay_steps=6"]
  args = lambda steps, name, ck: config.load(TINY, run_args(
      tmp_path, tdir, prompts, vocab, *opts, f"train.steps={steps}", f"train.checkpoint_dir={ck}",
      f"train.run_dir={tmp_path / name}")[2:])
  train.run(args(6, "whole", tmp_path / "ck_whole"), progress=False)
  records = runlog.read_metrics(tmp_path / "whole")
  steps = [r for r in records if r["step"] > 0]
  assert [r["step"] for r in records if "held_out_reward_mean" in r] == [0, 3, 6]
  assert all(0 <= r["held_out_reward_mean"] <= 1 for r in records if "held_out_reward_mean" in r)
  first, second = steps[0::2], steps[1::2]  # each generation batch's first and second step
  for r in first:  # the weights that sampled: ratio 1 (to rounding), nothing clipped
    assert abs(r["ratio_mean"] - 1) < 1e-5 and r["clip_fraction"] == 0 and r["generation_s"] > 0
  for r in second:  # one update later, on the same completions
    assert abs(r["ratio_mean"] - 1) > 1e-3 and r["clip_fraction"] > 0
    assert r["generation_s"] == 0 and r["old_logps_s"] == 0 and r["ref_logps_s"] == 0
  assert abs(steps[0]["kl"]) < 1e-6 and steps[-1]["kl"] > 0  # the policy leaves the reference
  assert [r["reward_mean"] for r in first] == [r["reward_mean"] for r in second]
  train.run(args(3, "part", tmp_path / "ck_part"), progress=False)
  saved = checkpoint.read_meta(tmp_path / "ck_part" / "step_3")["extra"]["data_position"]
  assert saved["generation"] == 1 and "old_logps" in saved["rollouts"]  # inside batch 1
  train.run(args(6, "part", tmp_path / "ck_part"), progress=False)
  resumed = runlog.read_metrics(tmp_path / "part")
  assert [r["loss"] for r in resumed if r["step"] > 3] == [r["loss"] for r in steps[3:]]
  sums = lambda ck: checkpoint.read_meta(ck / "step_6")[checkpoint.CHECKSUM]
  assert sums(tmp_path / "ck_part") == sums(tmp_path / "ck_whole")


@pytest.mark.parametrize("override, message", [
    (["train.batch=6"], "train.batch: 6 completions are not whole groups of train.grpo.group 4"),
    (["train.eval_every=2"], "train.eval_every: 2 needs held-out data"),
    (["train.eval_every=2", "train.grpo.eval_path=MISSING"],
     "train.grpo.eval_path: MISSING is not a file of prompts"),
    (["train.grpo.clip_eps=0"], "train.grpo.clip_eps: 0.0 must be in (0, 1)"),
    (["train.grpo.clip_eps_high=-0.1"], "train.grpo.clip_eps_high: -0.1 must be > 0 or null"),
    (["train.grpo.steps_per_generation=0"], "train.grpo.steps_per_generation: 0 must be > 0"),
    (["train.grpo.kl_coef=-0.1"], "train.grpo.kl_coef: -0.1 must be >= 0"),
    (["train.grpo.rewards=[speed]"], "'speed' is not one of exact_answer, format, length"),
    (["data.path=MISSING"], "is not a file of prompts"),
    (["train.grpo.max_new_tokens=8"], "leaves no room for a prompt in train.seq 8"),
    (["train.grpo.group=1"], "train.grpo.group: 1 completions give no group"),
])
def test_bad_grpo_config_is_one_line_and_exit_2(override, message, tmp_path, capsys):
  tdir, prompts, vocab = arithmetic(tmp_path)
  override = [o.replace("MISSING", str(tmp_path / "none.jsonl")) for o in override]
  message = message.replace("MISSING", str(tmp_path / "none.jsonl"))
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
