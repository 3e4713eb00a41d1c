"""Group-relative policy optimisation with verifiable rewards (`train.objective: grpo`).

Each step takes train.batch / G prompts, samples G completions of each from the current weights
(mtjax.generate, the KV-cache sampler over the same layer modules), scores every completion with
the reward functions (`REWARDS`, or a user's `module:function`), and turns the rewards into
advantages within each prompt's group:

  A_i = r_i - mean(r of its group)              (train.grpo.scale_rewards: none, Dr. GRPO)
  A_i = (r_i - mean) / (std + 1e-4)             (group, GRPO; std with Bessel's correction)

The loss is the policy-gradient surrogate over the completions' tokens,

  L = -sum_{i,t} w_it * A_i * pi(y_it) / stop_gradient(pi(y_it)),

one optimizer step per generation batch, so the ratio is 1 and its clip never binds: the gradient
is -sum w_it A_i grad log pi(y_it), the cross-entropy backward of the LM head weighted w_it A_i.
w spreads each completion's tokens (train.grpo.loss_agg): 1 / (n_i x rows) (sequence, GRPO),
1 / (all completion tokens) (token, DAPO), 1 / (rows x max_new_tokens) (constant, Dr. GRPO).
There is no KL term to a reference model, and no second optimizer step on a generation batch.

A batch is a pure function of the step and the weights at its start: the prompts come in an order
fixed by (train.seed, epoch), the sampler's seed is (train.seed, step); a resumed run samples what
the uninterrupted one sampled. Prompts come from data.path, a JSONL, JSON or Parquet file of rows
with a `prompt` (text) and an optional `answer` (what exact_answer checks against).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import re
import time
from collections.abc import Callable
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from mtjax import config as config_lib, objectives
from mtjax.data.batch import Batch

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _number(text: str) -> float | None:
  found = _NUMBER.findall(text)
  return float(found[-1].replace(",", "")) if found else None


def exact_answer(prompt: str, completion: str, answer: str | None) -> float:
  """1 where the completion's last number equals the answer's (within 1e-9 of its size), else 0."""
  if answer is None:
    raise ValueError("the exact_answer reward needs an `answer` for every prompt")
  want, got = _number(answer), _number(completion)
  if want is None:
    raise ValueError(f"the exact_answer reward: answer {answer!r} holds no number")
  return float(got is not None and abs(got - want) <= 1e-9 * max(1.0, abs(want)))


REWARDS = ("exact_answer", "format", "length")  # the built-in reward functions


@dataclasses.dataclass(frozen=True)
class Completion:
  prompt: str
  text: str
  answer: str | None
  tokens: int  # the completion's tokens, its end-of-sequence token included


def reward_functions(s: config_lib.GRPOConfig) -> list[tuple[str, Callable[[Completion], float]]]:
  """Each configured reward as (name, function of a Completion). Raises ValueError, naming it, on
  one that cannot be imported."""
  out = []
  for name in s.rewards:
    if name == "exact_answer":
      fn = lambda c: exact_answer(c.prompt, c.text, c.answer)
    elif name == "format":
      fn = lambda c, p=re.compile(s.format_pattern): float(p.fullmatch(c.text) is not None)
    elif name == "length":  # shorter completions score higher: 1 for none, 0 at the limit
      fn = lambda c, n=s.max_new_tokens: 1.0 - c.tokens / n
    elif ":" in name:
      module, _, attr = name.partition(":")
      try:
        user = getattr(importlib.import_module(module), attr)
      except (ImportError, AttributeError) as e:
        raise ValueError(f"train.grpo.rewards: cannot import {name} ({e})") from None
      if not callable(user):
        raise ValueError(f"train.grpo.rewards: {name} is not a function")
      fn = lambda c, user=user: float(user(c.prompt, c.text, c.answer))
    else:
      raise ValueError(f"train.grpo.rewards: {name!r} is not one of {', '.join(REWARDS)} or a "
                       f"module:function")
    out.append((name, fn))
  return out


def advantages(rewards_PxG: np.ndarray, scale: str) -> np.ndarray:
  """Each completion's reward against its group's: minus the group mean, over the group's std
  (Bessel-corrected, plus 1e-4) where `scale` is "group"."""
  r = np.asarray(rewards_PxG, np.float64)
  a = r - r.mean(axis=1, keepdims=True)
  if scale == "group":
    a = a / (r.std(axis=1, ddof=1, keepdims=True) + 1e-4)
  return a.astype(np.float32)


def token_weights(mask_BxT: np.ndarray, agg: str, max_new_tokens: int) -> np.ndarray:
  """w_it of the surrogate (see the module docstring) from the 0/1 mask of completion targets."""
  m = np.asarray(mask_BxT, np.float64)
  B = m.shape[0]
  if agg == "sequence":
    w = m / np.maximum(m.sum(axis=1, keepdims=True), 1.0) / B
  elif agg == "token":
    w = m / max(m.sum(), 1.0)
  else:
    w = m / (B * max_new_tokens)
  return w.astype(np.float32)


# ---- prompts --------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Prompts:
  texts: list[str]
  answers: list[str | None]
  ids: list[list[int]]  # each prompt's tokens, the chat template applied where configured


def read_rows(path: str | Path) -> list[dict]:
  """The prompt file's rows: JSONL, a JSON list, or Parquet."""
  p = Path(path)
  if not p.is_file():
    raise ValueError(f"data.path: {p} is not a file of prompts (JSONL, JSON or Parquet rows with "
                     f"a prompt field)")
  if p.suffix == ".parquet":
    import pyarrow.parquet as pq
    return pq.read_table(p).to_pylist()
  text = p.read_text()
  if p.suffix == ".json":
    rows = json.loads(text)
    return rows if isinstance(rows, list) else []
  rows = []
  for n, line in enumerate(text.splitlines(), 1):
    if line.strip():
      try:
        rows.append(json.loads(line))
      except json.JSONDecodeError:
        raise ValueError(f"data.path: {p}: line {n} is not JSON") from None
  return rows


def load_prompts(cfg: config_lib.Config, tokenizer, template) -> Prompts:
  """The prompts of data.path tokenized (each as a user message in `template` when given); raises
  ValueError naming the first row that has no prompt or does not leave room for a completion."""
  s, t = cfg.train.grpo, cfg.train
  rows = read_rows(cfg.data.path)
  if not rows:
    raise ValueError(f"data.path: {cfg.data.path} holds no rows")
  texts, answers, ids = [], [], []
  room = t.seq + 1 - s.max_new_tokens  # a row holds t.seq + 1 tokens (inputs and targets)
  for n, row in enumerate(rows, 1):
    prompt = row.get("prompt") if isinstance(row, dict) else None
    if not isinstance(prompt, str) or not prompt:
      raise ValueError(f"data.path: row {n} has no prompt text")
    answer = row.get("answer")
    text = template.render([{"role": "user", "content": prompt}], True) if template else prompt
    toks = tokenizer.encode(text, add_special_tokens=template is None).ids
    if not toks or len(toks) > room:
      raise ValueError(f"data.path: row {n}'s prompt is {len(toks)} tokens; train.seq "
                       f"{t.seq} leaves {room} beside train.grpo.max_new_tokens "
                       f"{s.max_new_tokens}")
    if max(toks) >= cfg.model.vocab_size:
      raise ValueError(f"data.path: row {n}: token {max(toks)} is outside the model's vocabulary "
                       f"({cfg.model.vocab_size})")
    texts.append(prompt)
    answers.append(None if answer is None else str(answer))
    ids.append(toks)
  return Prompts(texts, answers, ids)


def tokenizer_and_template(cfg: config_lib.Config):
  """The tokenizer that decodes completions, its chat template (or None) and its EOS ids."""
  from tokenizers import Tokenizer
  from mtjax.data import chat
  s = cfg.train.grpo
  folder = s.tokenizer or cfg.model.from_hf
  if folder is None:
    raise ValueError("train.grpo.tokenizer: a from-scratch model needs the folder of a "
                     "tokenizer.json (model.from_hf's is used otherwise)")
  path = Path(folder)
  file = path / "tokenizer.json" if path.is_dir() else path
  if not file.is_file():
    raise ValueError(f"train.grpo.tokenizer: no tokenizer.json in {folder}")
  tok = Tokenizer.from_file(str(file))
  folder = file.parent
  has_template = bool(chat.load_tokenizer_config(folder).get("chat_template")) or (
      folder / "chat_template.jinja").is_file()
  template = chat.ChatTemplate.from_tokenizer(folder) if s.chat and has_template else None
  eos = []
  for name in ("generation_config.json", "config.json"):
    f = folder / name
    if f.is_file():
      e = json.loads(f.read_text()).get("eos_token_id")
      if e is not None:
        eos = [e] if isinstance(e, int) else list(e)
        break
  if not eos:
    token = chat.token_text(chat.load_tokenizer_config(folder).get("eos_token"))
    if token is not None and tok.token_to_id(token) is not None:
      eos = [tok.token_to_id(token)]
  return tok, template, eos


# ---- the source -----------------------------------------------------------------------------------

class RolloutSource:
  """Batches of sampled completions: batch(step), position(step), epoch(step), and metrics(step)
  of the batch it made last (rewards, completion lengths, generation time)."""

  def __init__(self, cfg: config_lib.Config, engine, prompts: Prompts, tokenizer, eos: list[int]):
    self.cfg, self.engine, self.prompts, self.tok, self.eos = cfg, engine, prompts, tokenizer, eos
    self.s = cfg.train.grpo
    self.per = cfg.train.batch // self.s.group  # prompts a step
    self.rewards = reward_functions(self.s)
    self._metrics: dict[int, dict] = {}

  def position(self, step: int) -> int:
    return step * self.per

  def epoch(self, step: int) -> int:
    return step * self.per // len(self.prompts.ids)

  def _rows(self, step: int) -> list[int]:
    n, out = len(self.prompts.ids), []
    for k in range(step * self.per, (step + 1) * self.per):
      order = np.random.default_rng([self.cfg.train.seed, k // n]).permutation(n)
      out.append(int(order[k % n]))
    return out

  def batch(self, step: int) -> Batch:
    from mtjax.generate import generate
    cfg, s, G = self.cfg, self.s, self.s.group
    rows = self._rows(step)
    self.engine.sync()  # every update of the step before is in the weights sampled from
    params = self.engine.store.to_tree()
    dtype = jnp.bfloat16 if cfg.engine.compute_dtype == "bfloat16" else jnp.float32
    prompts = [self.prompts.ids[r] for r in rows for _ in range(G)]
    stats: dict = {}
    t0 = time.perf_counter()
    done = generate(cfg.model, params, prompts, max_new_tokens=s.max_new_tokens,
                    temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, eos_ids=self.eos,
                    seed=int(np.random.default_rng([cfg.train.seed, step, 1]).integers(2**31)),
                    dtype=dtype, stats=stats)
    gen_s = time.perf_counter() - t0
    scores = np.zeros((len(prompts), len(self.rewards)), np.float64)
    for i, new in enumerate(done):
      r = rows[i // G]
      body = [t for t in new if t not in self.eos]
      c = Completion(self.prompts.texts[r], self.tok.decode(body), self.prompts.answers[r],
                     len(new))
      for j, (_, fn) in enumerate(self.rewards):
        value = fn(c)
        if not math.isfinite(value):
          raise ValueError(f"train.grpo.rewards: {self.rewards[j][0]} gave {value} at step "
                           f"{step + 1}")
        scores[i, j] = value
    weights = np.asarray(s.reward_weights or [1.0] * len(self.rewards), np.float64)
    total = scores @ weights
    adv = advantages(total.reshape(self.per, G), s.scale_rewards).reshape(-1)
    T = cfg.train.seq
    toks = np.zeros((len(prompts), T + 1), np.int32)
    mask = np.zeros((len(prompts), T), np.float32)
    for i, (p, new) in enumerate(zip(prompts, done)):
      row = (p + new)[:T + 1]
      toks[i, :len(row)] = row
      mask[i, len(p) - 1:len(row) - 1] = 1.0  # the targets that are completion tokens
    w = token_weights(mask, s.loss_agg, s.max_new_tokens)
    lengths = np.array([len(d) for d in done], np.float64)
    grouped = total.reshape(self.per, G)
    self._metrics = {step: {
        "reward_mean": float(total.mean()), "reward_std": float(total.std()),
        **{f"reward_{name.rpartition(':')[2]}": float(scores[:, j].mean())
           for j, (name, _) in enumerate(self.rewards)},
        "completion_tokens_mean": float(lengths.mean()),
        "groups_without_signal": float(np.mean(grouped.std(axis=1) == 0)),
        "generation_s": gen_s,
        "generated_tokens_per_s": float(lengths.sum() / max(gen_s, 1e-9))}}
    return _RolloutBatch(toks[:, :-1], toks[:, 1:], loss_weights=mask, token_weights=w,
                         advantages=adv)

  def metrics(self, step: int) -> dict:
    return self._metrics.get(step, {})


@dataclasses.dataclass(frozen=True)
class _RolloutBatch(Batch):
  token_weights: np.ndarray | None = None  # [B, T] w_it
  advantages: np.ndarray | None = None  # [B] A_i


# ---- the objective --------------------------------------------------------------------------------

@objectives.register
class GroupRelative(objectives.Objective):
  """GRPO with verifiable rewards (see the module docstring)."""
  name = "grpo"
  reads_initial_weights = False

  def check(self, cfg):
    s, t = cfg.train.grpo, cfg.train
    if t.batch % s.group:
      raise config_lib.ConfigError(f"train.batch: {t.batch} completions are not whole groups "
                                   f"of train.grpo.group {s.group}")
    if cfg.data.path is None:
      raise config_lib.ConfigError("data.path: grpo needs a file of prompts (JSONL, JSON or "
                                   "Parquet rows with a prompt field)")
    if t.eval_every:
      raise config_lib.ConfigError("train.eval_every: grpo has no held-out evaluation; set 0 "
                                   "(the rewards are logged every step)")
    from mtjax.generate import refuse_uncached
    try:
      refuse_uncached(cfg.model)
    except ValueError as e:
      raise config_lib.ConfigError(f"train.objective: grpo samples completions: {e}") from None
    if s.max_new_tokens >= t.seq:
      raise config_lib.ConfigError(f"train.grpo.max_new_tokens: {s.max_new_tokens} leaves no "
                                   f"room for a prompt in train.seq {t.seq}")

  def carries_documents(self, data):
    return False

  def batch_weight(self, batch):
    return float(batch.inputs.shape[0])

  def head_step(self, fns):
    def step(w_head, w_table, x_BxTxD, targets_BxT, coef_BxT):
      """The surrogate's gradient is the cross-entropy backward weighted coef = w * A; its value
      at ratio 1 is -sum(coef)."""
      _, dx, gh, gt = fns.head_step(w_head, w_table, x_BxTxD, targets_BxT, coef_BxT)
      loss = -jnp.sum(coef_BxT)
      return loss, dx, gh, gt, {}
    return step

  def head_inputs(self, batch):
    w, adv = getattr(batch, "token_weights", None), getattr(batch, "advantages", None)
    B = batch.inputs.shape[0]
    if w is None or adv is None or np.shape(adv) != (B,) or np.shape(w) != batch.inputs.shape:
      raise ValueError("a grpo batch carries token_weights [B, T] and advantages [B] "
                       "(mtjax.grpo.RolloutSource)")
    if not (np.all(np.isfinite(w)) and np.all(np.isfinite(adv))):
      raise ValueError("a grpo batch's token weights and advantages must be finite")
    return (batch.targets, (np.asarray(w) * np.asarray(adv)[:, None]).astype(np.float32)), ()

  def data(self, cfg):
    tok, template, eos = tokenizer_and_template(cfg)
    prompts = load_prompts(cfg, tok, template)
    if "exact_answer" in cfg.train.grpo.rewards and any(a is None for a in prompts.answers):
      first = prompts.answers.index(None) + 1
      raise ValueError(f"data.path: row {first} has no answer, which the exact_answer reward "
                       f"needs")
    return tok, eos, prompts

  def sources(self, cfg, engine, checked):
    tok, eos, prompts = checked
    src = RolloutSource(cfg, engine, prompts, tok, eos)
    line = (f"grpo: {len(prompts.ids)} prompts, {src.per} a step x {cfg.train.grpo.group} "
            f"completions; rewards {', '.join(cfg.train.grpo.rewards)}")
    return src, None, line
