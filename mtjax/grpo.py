"""Group-relative policy optimisation with verifiable rewards (`train.objective: grpo`).

A generation batch takes train.batch / G prompts, samples G completions of each from the current
weights (mtjax.generate, the KV-cache sampler over the same layer modules), scores every
completion with the reward functions (`REWARDS`, or a user's `module:function`), and turns the
rewards into advantages within each prompt's group:

  A_i = r_i - mean(r of its group)              (train.grpo.scale_rewards: none, Dr. GRPO)
  A_i = (r_i - mean) / (std + 1e-4)             (group, GRPO; std with Bessel's correction)

The batch is reused for train.grpo.steps_per_generation (mu) consecutive optimizer steps, each a
whole step of the engine on the whole batch (no minibatches: the gradient of every step is the
batch's). Per completion token, with the policy's log-prob logp, the sampling weights' old (one
streamed forward under them before the first of the mu steps; with mu = 1 old = stop_gradient(logp))
and the initial weights' ref, the loss is

  r_it  = exp(logp_it - old_it)
  L     = -sum_it w_it min(r_it A_i, clip(r_it, 1 - eps_low, 1 + eps_high) A_i)
          + beta sum_it w_it (exp(ref_it - logp_it) - (ref_it - logp_it) - 1)    (k3 KL)

(`clipped_surrogate`; eps_low = clip_eps, eps_high = clip_eps_high or clip_eps, beta = kl_coef).
w spreads each completion's tokens (train.grpo.loss_agg): 1 / (n_i x rows) (sequence, GRPO),
1 / (all completion tokens) (token, DAPO), 1 / (rows x max_new_tokens) (constant, Dr. GRPO).
The head computes logp by a chunked forward, the loss's gradient c_it with respect to each logp_it
(-w A r where the unclipped branch is active, 0 where the clip binds, plus beta w (1 -
exp(ref - logp))), and the chunked cross-entropy backward weighted -c gives the gradients of the
hidden states and the head weights; with mu = 1 and no KL the ratio is 1 and the backward weighted
w A alone is the gradient (no extra forward). The reference log-probs come from a frozen copy of
the initial weights in host memory (`FrozenWeights`, 4 B/param, kept only when kl_coef > 0),
streamed through the engine's forward every generation batch.

A generation batch is a pure function of its index g = step // mu and the weights at its start:
the prompts come in an order fixed by (train.seed, epoch), the sampler's seed is (train.seed, g).
A checkpoint taken inside a generation batch holds its rollouts and log-probs (`position`), so a
resumed run trains on what the uninterrupted one did. Prompts come from data.path, a JSONL, JSON
or Parquet file of rows with a `prompt` (text) and an optional `answer` (what exact_answer checks
against); train.grpo.eval_path holds the held-out ones that train.eval_every scores with greedy
completions.
"""

from __future__ import annotations

import base64
import dataclasses
import importlib
import io
import json
import math
import re
import time
from collections.abc import Callable
from pathlib import Path

import jax
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


def read_rows(path: str | Path, key: str = "data.path") -> list[dict]:
  """The prompt file's rows: JSONL, a JSON list, or Parquet (errors name `key`)."""
  p = Path(path)
  if not p.is_file():
    raise ValueError(f"{key}: {p} is not a file of prompts (JSONL, JSON or Parquet rows with "
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
        raise ValueError(f"{key}: {p}: line {n} is not JSON") from None
  return rows


def load_prompts(cfg: config_lib.Config, tokenizer, template, key: str = "data.path") -> Prompts:
  """The prompts of the file `key` names (data.path, or train.grpo.eval_path) tokenized (each as
  a user message in `template` when given); raises ValueError naming the key and the first row
  that has no prompt or does not leave room for a completion."""
  s, t = cfg.train.grpo, cfg.train
  path = cfg.data.path if key == "data.path" else s.eval_path
  rows = read_rows(path, key)
  if not rows:
    raise ValueError(f"{key}: {path} holds no rows")
  texts, answers, ids = [], [], []
  room = t.seq + 1 - s.max_new_tokens  # a row holds t.seq + 1 tokens (inputs and targets)
  for n, row in enumerate(rows, 1):
    prompt = row.get("prompt") if isinstance(row, dict) else None
    if not isinstance(prompt, str) or not prompt:
      raise ValueError(f"{key}: row {n} has no prompt text")
    answer = row.get("answer")
    text = template.render([{"role": "user", "content": prompt}], True) if template else prompt
    toks = tokenizer.encode(text, add_special_tokens=template is None).ids
    if not toks or len(toks) > room:
      raise ValueError(f"{key}: row {n}'s prompt is {len(toks)} tokens; train.seq "
                       f"{t.seq} leaves {room} beside train.grpo.max_new_tokens "
                       f"{s.max_new_tokens}")
    if max(toks) >= cfg.model.vocab_size:
      raise ValueError(f"{key}: row {n}: token {max(toks)} is outside the model's vocabulary "
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


# ---- the loss ------------------------------------------------------------------------------------

def clipped_surrogate(logp_BxT, old_BxT, ref_BxT, w_BxT, mask_BxT, adv_B, per_token, low: float,
                      high: float, beta: float):
  """(loss, metrics) of a batch's completion tokens (the module docstring's L): old_BxT None is
  stop_gradient(logp) (ratio 1), ref_BxT None leaves out the KL. Metrics are sums over mask_BxT
  (the completion tokens) times per_token (1 / the step's completion tokens), so a step's passes
  add up to its means: ratio_mean and clip_fraction (tokens where the clip binds: A > 0 above
  `high`, A < 0 below `low`) where old is given, kl (the k3 estimate) where ref is."""
  m = mask_BxT > 0
  a = adv_B[:, None]
  old = jax.lax.stop_gradient(logp_BxT) if old_BxT is None else old_BxT
  # 0 off the completion: a padding target's log-probs may be far apart, and exp of it inf
  r = jnp.exp(jnp.where(m, logp_BxT - old, 0.0))
  loss_BxT = -jnp.minimum(r * a, jnp.clip(r, low, high) * a)
  metrics = {}
  if old_BxT is not None:
    clipped = ((a > 0) & (r > high)) | ((a < 0) & (r < low))
    metrics["ratio_mean"] = jnp.sum(jnp.where(m, r, 0.0)) * per_token
    metrics["clip_fraction"] = jnp.sum((clipped & m).astype(jnp.float32)) * per_token
  if ref_BxT is not None:
    d = jnp.where(m, ref_BxT - logp_BxT, 0.0)
    kl_BxT = jnp.exp(d) - d - 1.0
    loss_BxT = loss_BxT + beta * kl_BxT
    metrics["kl"] = jnp.sum(jnp.where(m, kl_BxT, 0.0)) * per_token
  return jnp.sum(w_BxT * loss_BxT), jax.tree.map(jax.lax.stop_gradient, metrics)


# ---- the reference weights ------------------------------------------------------------------------

class FrozenWeights:
  """A read-only copy of every group's fp32 weights in plain host memory (4 B/param), served to
  the engine's forward as its store serves its own (`Engine.token_logps(batch, store=...)`)."""

  def __init__(self, store):
    store.sync()
    self.store = store
    self.w = [store.read(i)["w"] for i in range(len(store.groups))]  # one group's state at a time

  @property
  def blocks(self):
    return self.store.blocks

  def fetch(self, i: int):
    return jax.device_put(self.w[i], self.store.on_device)  # on every device, like the store's

  def is_resident(self, i: int) -> bool:
    return False

  def to_host(self, x):
    return self.store.to_host(x)


# ---- the source -----------------------------------------------------------------------------------

_ARRAYS = ("inputs", "targets", "loss_weights", "token_weights", "advantages", "old_logps",
           "ref_logps")  # what a checkpoint inside a generation batch holds of it


def _encode(a: np.ndarray) -> str:
  buf = io.BytesIO()
  np.save(buf, np.ascontiguousarray(a), allow_pickle=False)
  return base64.b64encode(buf.getvalue()).decode("ascii")


def _decode(text: str) -> np.ndarray:
  return np.load(io.BytesIO(base64.b64decode(text)), allow_pickle=False)


def score(rewards, weights, completions: list[Completion], where: str) -> tuple[np.ndarray,
                                                                                np.ndarray]:
  """(each reward of each completion [N, F], their weighted sum [N]); raises ValueError naming
  the reward that gave a non-finite value (`where`: the step or evaluation)."""
  scores = np.zeros((len(completions), len(rewards)), np.float64)
  for i, c in enumerate(completions):
    for j, (name, fn) in enumerate(rewards):
      value = fn(c)
      if not math.isfinite(value):
        raise ValueError(f"train.grpo.rewards: {name} gave {value} {where}")
      scores[i, j] = value
  w = np.asarray(weights or [1.0] * len(rewards), np.float64)
  return scores, scores @ w


class RolloutSource:
  """Batches of sampled completions: batch(step), position(step), epoch(step), metrics(step) of
  the step it made last (rewards, completion lengths, the ratio's and KL's are the head's), and
  resume(position) from a checkpoint's. Steps g * mu ... g * mu + mu - 1 share generation batch g."""

  def __init__(self, cfg: config_lib.Config, engine, prompts: Prompts, tokenizer, eos: list[int],
               reference: FrozenWeights | None = None):
    self.cfg, self.engine, self.prompts, self.tok, self.eos = cfg, engine, prompts, tokenizer, eos
    self.s, self.reference = cfg.train.grpo, reference
    self.mu = self.s.steps_per_generation
    self.per = cfg.train.batch // self.s.group  # prompts a generation batch
    self.rewards = reward_functions(self.s)
    self._gen: tuple[int, _RolloutBatch, dict] | None = None  # (g, batch, its metrics)
    self._metrics: dict[int, dict] = {}

  def position(self, step: int) -> dict:
    """Where the data stream is before step `step`: inside a generation batch, the batch itself."""
    g = step // self.mu
    out = {"source": "prompts", "step": step, "generation": g, "epoch": self.epoch(step),
           "index": g * self.per % len(self.prompts.ids)}
    if step % self.mu and self._gen is not None and self._gen[0] == g:
      _, b, metrics = self._gen
      out["rollouts"] = {"metrics": metrics, **{k: _encode(getattr(b, k)) for k in _ARRAYS
                                                if getattr(b, k) is not None}}
    return out

  def resume(self, position) -> None:
    """Takes back the generation batch a checkpoint's position holds (one saved inside it)."""
    held = position.get("rollouts") if isinstance(position, dict) else None
    if held is not None:
      arrays = {k: _decode(held[k]) if k in held else None for k in _ARRAYS}
      self._gen = (int(position["generation"]), _RolloutBatch(**arrays), dict(held["metrics"]))

  def epoch(self, step: int) -> int:
    return step // self.mu * self.per // len(self.prompts.ids)

  def _rows(self, g: int) -> list[int]:
    n, out = len(self.prompts.ids), []
    for k in range(g * self.per, (g + 1) * self.per):
      order = np.random.default_rng([self.cfg.train.seed, k // n]).permutation(n)
      out.append(int(order[k % n]))
    return out

  def batch(self, step: int) -> Batch:
    g = step // self.mu
    if self._gen is None or self._gen[0] != g:
      if step % self.mu:
        raise ValueError(f"train.grpo.steps_per_generation: step {step + 1} lies inside "
                         f"generation batch {g}, whose rollouts the checkpoint does not hold "
                         f"(saved with another steps_per_generation?)")
      self._gen = (g, *self._generate(g, step))
    _, b, metrics = self._gen
    if step % self.mu:  # a reused batch: its sampling and log-probs cost nothing this step
      metrics = {**metrics, "generation_s": 0.0, "old_logps_s": 0.0, "ref_logps_s": 0.0}
    self._metrics = {step: metrics}
    return b

  def _generate(self, g: int, step: int) -> tuple[_RolloutBatch, dict]:
    """Generation batch g, sampled from the current weights, with its metrics."""
    from mtjax.generate import generate
    cfg, s, G = self.cfg, self.s, self.s.group
    rows = self._rows(g)
    self.engine.sync()  # every update of the step before is in the weights sampled from
    dtype = jnp.bfloat16 if cfg.engine.compute_dtype == "bfloat16" else jnp.float32
    params = self.engine.store.device_tree(dtype)  # on the device, no host copy
    prompts = [self.prompts.ids[r] for r in rows for _ in range(G)]
    t0 = time.perf_counter()
    done = generate(cfg.model, params, prompts, max_new_tokens=s.max_new_tokens,
                    temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, eos_ids=self.eos,
                    seed=int(np.random.default_rng([cfg.train.seed, g, 1]).integers(2**31)),
                    dtype=dtype)
    gen_s = time.perf_counter() - t0
    del params
    completions = [Completion(self.prompts.texts[rows[i // G]], self.tok.decode(
        [t for t in new if t not in self.eos]), self.prompts.answers[rows[i // G]], len(new))
        for i, new in enumerate(done)]
    scores, total = score(self.rewards, s.reward_weights, completions, f"at step {step + 1}")
    adv = advantages(total.reshape(self.per, G), s.scale_rewards).reshape(-1)
    T = cfg.train.seq
    toks = np.zeros((len(prompts), T + 1), np.int32)
    mask = np.zeros((len(prompts), T), np.float32)
    for i, (p, new) in enumerate(zip(prompts, done)):
      row = (p + new)[:T + 1]
      toks[i, :len(row)] = row
      mask[i, len(p) - 1:len(row) - 1] = 1.0  # the targets that are completion tokens
    b = _RolloutBatch(toks[:, :-1], toks[:, 1:], loss_weights=mask,
                      token_weights=token_weights(mask, s.loss_agg, s.max_new_tokens),
                      advantages=adv)
    t1 = time.perf_counter()
    old = self.engine.token_logps(b) if self.mu > 1 else None  # the weights that sampled
    t2 = time.perf_counter()
    ref = self.engine.token_logps(b, self.reference) if self.reference is not None else None
    t3 = time.perf_counter()
    b = dataclasses.replace(b, old_logps=old, ref_logps=ref)
    lengths = np.array([len(d) for d in done], np.float64)
    grouped = total.reshape(self.per, G)
    metrics = {
        "reward_mean": float(total.mean()), "reward_std": float(total.std()),
        **{f"reward_{name.rpartition(':')[2]}": float(scores[:, j].mean())
           for j, (name, _) in enumerate(self.rewards)},
        "completion_tokens_mean": float(lengths.mean()),
        "groups_without_signal": float(np.mean(grouped.std(axis=1) == 0)),
        "generation_s": gen_s,
        "generated_tokens_per_s": float(lengths.sum() / max(gen_s, 1e-9)),
        "old_logps_s": t2 - t1, "ref_logps_s": t3 - t2}
    return b, metrics

  def metrics(self, step: int) -> dict:
    return self._metrics.get(step, {})


@dataclasses.dataclass(frozen=True)
class _RolloutBatch(Batch):
  token_weights: np.ndarray | None = None  # [B, T] w_it
  advantages: np.ndarray | None = None  # [B] A_i
  old_logps: np.ndarray | None = None  # [B, T] log-probs under the weights that sampled (mu > 1)
  ref_logps: np.ndarray | None = None  # [B, T] log-probs under the initial weights (kl_coef > 0)


class HeldOutRewards:
  """The rewards of one greedy completion (temperature 0) of each held-out prompt (the first
  train.eval_batches x train.batch of train.grpo.eval_path), sampled train.batch at a time."""

  def __init__(self, cfg: config_lib.Config, prompts: Prompts, tokenizer, eos: list[int]):
    self.cfg, self.tok, self.eos = cfg, tokenizer, eos
    n = min(len(prompts.ids), cfg.train.eval_batches * cfg.train.batch)
    self.prompts = Prompts(prompts.texts[:n], prompts.answers[:n], prompts.ids[:n])
    self.rewards = reward_functions(cfg.train.grpo)

  def evaluate(self, engine) -> dict[str, float]:
    from mtjax.generate import generate
    cfg, s, p = self.cfg, self.cfg.train.grpo, self.prompts
    engine.sync()
    dtype = jnp.bfloat16 if cfg.engine.compute_dtype == "bfloat16" else jnp.float32
    params = engine.store.device_tree(dtype)
    done = []
    for first in range(0, len(p.ids), cfg.train.batch):
      done += generate(cfg.model, params, p.ids[first:first + cfg.train.batch],
                       max_new_tokens=s.max_new_tokens, temperature=0.0, eos_ids=self.eos,
                       dtype=dtype)
    completions = [Completion(p.texts[i], self.tok.decode([t for t in new if t not in self.eos]),
                              p.answers[i], len(new)) for i, new in enumerate(done)]
    scores, total = score(self.rewards, s.reward_weights, completions, "on a held-out prompt")
    return {"held_out_reward_mean": float(total.mean()),
            **{f"held_out_reward_{name.rpartition(':')[2]}": float(scores[:, j].mean())
               for j, (name, _) in enumerate(self.rewards)},
            "held_out_completion_tokens_mean": float(np.mean([len(d) for d in done]))}


# ---- the objective --------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Checked:
  tokenizer: object
  eos: list[int]
  prompts: Prompts
  held_out: Prompts | None


@objectives.register
class GroupRelative(objectives.Objective):
  """GRPO with verifiable rewards (see the module docstring)."""
  name = "grpo"

  def __init__(self, settings: config_lib.GRPOConfig):
    self.settings = settings
    self.reuse, self.beta = settings.steps_per_generation > 1, settings.kl_coef
    # the KL's reference log-probs need the initial weights, copied before a checkpoint's replace
    # them; a ratio other than 1 or a KL needs the head's log-probs before its backward
    self.reads_initial_weights = self.beta > 0
    self.head_forwards = int(self.reuse or self.beta > 0)

  @classmethod
  def of(cls, train):
    return cls(train.grpo)

  def check(self, cfg):
    s, t = cfg.train.grpo, cfg.train
    if t.batch % s.group:
      raise config_lib.ConfigError(f"train.batch: {t.batch} completions are not whole groups "
                                   f"of train.grpo.group {s.group}")
    if cfg.data.path is None:
      raise config_lib.ConfigError("data.path: grpo needs a file of prompts (JSONL, JSON or "
                                   "Parquet rows with a prompt field)")
    if t.eval_every and s.eval_path is None:
      raise config_lib.ConfigError(f"train.eval_every: {t.eval_every} needs held-out data: set "
                                   f"train.grpo.eval_path to a file of held-out prompts, or "
                                   f"train.eval_every=0")
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

  def host_bytes(self, params):
    return 4 * params if self.beta > 0 else 0  # the reference copy (FrozenWeights)

  def device_bytes(self, cfg, params):
    """The sampler's: the weights in the compute dtype, a KV cache of train.batch rows at the
    longest row's slots, the prefill's scores over them, and a few [rows, vocab] fp32 arrays of
    each sampling step (logits, the filters' sorted copies)."""
    from mtjax import generate
    m, t, s = cfg.model, cfg.train, self.settings
    width = 2 if cfg.engine.compute_dtype == "bfloat16" else 4
    dtype = jnp.bfloat16 if width == 2 else jnp.float32
    slots = generate.bucket(t.seq + 1)
    cache = jax.eval_shape(lambda: generate.empty_cache(m, t.batch, slots, dtype))
    prompt = t.seq + 1 - s.max_new_tokens
    scores = 2 * 4 * t.batch * m.heads * prompt * slots  # fp32 scores and probabilities
    return (width * params + sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(cache))
            + scores + 4 * 4 * t.batch * m.vocab_size)

  def head_step(self, fns):
    s = self.settings
    low, high = 1.0 - s.clip_eps, 1.0 + (s.clip_eps if s.clip_eps_high is None
                                         else s.clip_eps_high)
    if not self.head_forwards:
      def step(w_head, w_table, x_BxTxD, targets_BxT, coef_BxT):
        """At ratio 1 the surrogate's gradient is the cross-entropy backward weighted coef = w A;
        its value is -sum(coef)."""
        _, dx, gh, gt = fns.head_step(w_head, w_table, x_BxTxD, targets_BxT, coef_BxT)
        return -jnp.sum(coef_BxT), dx, gh, gt, {}
      return step

    def step(w_head, w_table, x_BxTxD, targets_BxT, w_BxT, mask_BxT, adv_B, *rest):
      """A forward gives each token's log-prob, the loss its gradient c with respect to them; the
      cross-entropy backward weighted -c is then the loss's gradient (as a log-prob is minus its
      cross-entropy)."""
      *logps, per_token = rest
      old = logps.pop(0) if self.reuse else None
      ref = logps.pop(0) if self.beta > 0 else None
      logp = fns.head_token_logps(w_head, w_table, x_BxTxD, targets_BxT)
      (loss, metrics), c = jax.value_and_grad(clipped_surrogate, has_aux=True)(
          logp, old, ref, w_BxT, mask_BxT, adv_B, per_token, low, high, self.beta)
      _, dx, gh, gt = fns.head_step(w_head, w_table, x_BxTxD, targets_BxT, -c)
      return loss, dx, gh, gt, metrics
    return step

  def head_inputs(self, batch):
    B, T = batch.inputs.shape
    w, adv = getattr(batch, "token_weights", None), getattr(batch, "advantages", None)
    if w is None or adv is None or np.shape(adv) != (B,) or np.shape(w) != (B, T):
      raise ValueError("a grpo batch carries token_weights [B, T] and advantages [B] "
                       "(mtjax.grpo.RolloutSource)")
    needs = ([("old_logps", "steps_per_generation > 1")] if self.reuse else []) + (
        [("ref_logps", "kl_coef > 0")] if self.beta > 0 else [])
    logps = []
    for name, why in needs:
      a = getattr(batch, name, None)
      if a is None or np.shape(a) != (B, T):
        raise ValueError(f"batch.{name}: train.grpo.{why} needs each target's log-prob [B, T] "
                         f"(mtjax.grpo.RolloutSource)")
      logps.append(np.asarray(a, np.float32))
    if not all(np.all(np.isfinite(a)) for a in (w, adv, *logps)):
      raise ValueError("a grpo batch's token weights, advantages and log-probs must be finite")
    w, adv = np.asarray(w, np.float32), np.asarray(adv, np.float32)
    if not self.head_forwards:
      return (batch.targets, w * adv[:, None]), ()
    mask = objectives.response_mask(batch)
    per_token = np.float32(1.0 / max(float(mask.sum(dtype=np.float64)), 1.0))
    return (batch.targets, w, mask, adv, *logps), (per_token,)

  def data(self, cfg):
    tok, template, eos = tokenizer_and_template(cfg)
    prompts = load_prompts(cfg, tok, template)
    held = None
    if cfg.train.eval_every:  # checked now, not at the first evaluation
      held = load_prompts(cfg, tok, template, "train.grpo.eval_path")
    if "exact_answer" in cfg.train.grpo.rewards:
      for key, p in (("data.path", prompts), ("train.grpo.eval_path", held)):
        if p is not None and None in p.answers:
          raise ValueError(f"{key}: row {p.answers.index(None) + 1} has no answer, which the "
                           f"exact_answer reward needs")
    return _Checked(tok, eos, prompts, held)

  def sources(self, cfg, engine, checked):
    s = cfg.train.grpo
    reference = FrozenWeights(engine.store) if self.beta > 0 else None  # the initial weights
    src = RolloutSource(cfg, engine, checked.prompts, checked.tokenizer, checked.eos, reference)
    held = (None if checked.held_out is None else
            HeldOutRewards(cfg, checked.held_out, checked.tokenizer, checked.eos))
    line = (f"grpo: {len(checked.prompts.ids)} prompts, {src.per} a generation batch x {s.group} "
            f"completions, {s.steps_per_generation} step(s) each; rewards "
            f"{', '.join(s.rewards)}" + (f"; KL to the initial weights (copied: "
                                         f"{4 * engine.store.n_params / 2**30:.2f} GiB)"
                                         if reference else "")
            + (f"; {len(held.prompts.ids)} held-out prompts" if held else ""))
    return src, held, line
