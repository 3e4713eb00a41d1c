"""Direct preference optimisation: the pair loss, preference batches and the reference log-probs.

A preference example is a prompt with two responses, chosen and rejected. A batch holds them as
rows 2i (chosen) and 2i+1 (rejected), each a whole sequence (prompt + response, padded at the
end); its loss weights are 1 on the response's targets, 0 elsewhere. The log-prob of a response
is the sum of log softmax over those targets. With the policy's log-probs pi and the reference
model's r (the initial weights, computed once before training), the margin of a pair is
m = (pi_c - r_c) - (pi_r - r_r), and the loss of a batch is the mean over its pairs of

  sigmoid  -log sigmoid(beta * m)
  ipo      (m - 1 / (2 beta))^2

plus, with sft_weight > 0, sft_weight x the chosen responses' mean token cross-entropy. The rewards
reported are beta (pi - r) of each response. The engine computes all of it at the LM head: the
per-row log-prob sums, the loss of the pairs and its gradient with respect to each row's sum,
which weighs that row's tokens in the ordinary cross-entropy backward.

Data on disk (`load_pairs`): a folder prepared by `python -m mtjax.data prepare --format
preference` (`mtjax.data.read_pairs`; each side is cut to train.seq + 1 tokens and padded with the
tokenizer's pad id), or a folder with `chosen.npy`, `rejected.npy` (int tokens, [N, S]) and
`chosen_mask.npy`, `rejected_mask.npy` ([N, S], 1 where a token is a response token), S =
train.seq + 1. The reference log-probs are stored beside them in `ref_logps.npy` with
`ref_logps.json`, the key of the model and data they came from; a different key recomputes them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from mtjax import config as config_lib, data as data_lib, objectives

PAIR_FILES = ("chosen.npy", "chosen_mask.npy", "rejected.npy", "rejected_mask.npy")
REF_FILE, REF_KEY_FILE = "ref_logps.npy", "ref_logps.json"
log = logging.getLogger(__name__)


def pair_objective(beta: float, loss: str, sft_weight: float):
  """The loss of a batch as a function of its rows' log-probs.

  Returns f(policy_B, ref_B, pair_scale, sft_scale) -> (loss, metrics): rows alternate chosen,
  rejected; the pairs' losses are summed and multiplied by pair_scale (1 / pairs in the global
  batch), the chosen rows' negative log-probs by sft_scale (1 / chosen response tokens in the
  global batch) and sft_weight, so the sums over a step's passes give the means. Metrics (each a
  sum times pair_scale): reward accuracy (pairs with chosen reward above rejected), chosen and
  rejected rewards, margin (chosen minus rejected reward).
  """
  def f(policy_B, ref_B, pair_scale, sft_scale):
    pol_Px2 = policy_B.reshape(-1, 2)
    rewards_Px2 = beta * (pol_Px2 - ref_B.reshape(-1, 2))
    h_P = (rewards_Px2[:, 0] - rewards_Px2[:, 1]) / beta  # (pi_c - r_c) - (pi_r - r_r)
    if loss == "sigmoid":
      pair_P = -jax.nn.log_sigmoid(beta * h_P)
    else:
      pair_P = jnp.square(h_P - 1.0 / (2.0 * beta))
    total = jnp.sum(pair_P) * pair_scale
    if sft_weight:
      total = total - sft_weight * sft_scale * jnp.sum(pol_Px2[:, 0])
    rewards = jax.lax.stop_gradient(rewards_Px2)
    metrics = {
        "reward_accuracy": jnp.sum((rewards[:, 0] > rewards[:, 1]).astype(jnp.float32)) * pair_scale,
        "reward_chosen": jnp.sum(rewards[:, 0]) * pair_scale,
        "reward_rejected": jnp.sum(rewards[:, 1]) * pair_scale,
        "reward_margin": jnp.sum(rewards[:, 0] - rewards[:, 1]) * pair_scale,
    }
    return total, metrics
  return f


@dataclasses.dataclass(frozen=True)
class PairBatch:
  """A batch of preference pairs as the engine reads it (rows 2i chosen, 2i+1 rejected)."""
  inputs: np.ndarray  # [B, T] int32
  targets: np.ndarray  # [B, T] int32
  loss_weights: np.ndarray  # [B, T] float32: 1 on response targets
  ref_logps: np.ndarray | None = None  # [B] float32 the reference model's log-prob of each row's response


@dataclasses.dataclass(frozen=True)
class Pairs:
  """Preference pairs: tokens and response masks of the chosen and rejected sequences, [N, S]."""
  chosen: np.ndarray
  chosen_mask: np.ndarray
  rejected: np.ndarray
  rejected_mask: np.ndarray

  def __post_init__(self):
    shape = np.shape(self.chosen)
    for name in ("chosen", "chosen_mask", "rejected", "rejected_mask"):
      a = getattr(self, name)
      if np.ndim(a) != 2 or np.shape(a) != shape:
        raise ValueError(f"preference pairs: {name} has shape {np.shape(a)}, expected "
                         f"{shape} like chosen ([pairs, tokens])")
    if shape[0] == 0 or shape[1] < 2:
      raise ValueError(f"preference pairs: shape {shape} holds no pair of 2 tokens or more")

  def __len__(self) -> int:
    return self.chosen.shape[0]

  @property
  def seq(self) -> int:
    """Tokens per input row (one fewer than stored: the last token is only a target)."""
    return self.chosen.shape[1] - 1

  def batch(self, first: int, pairs: int, ref_logps: np.ndarray | None = None) -> PairBatch:
    """Pairs first, first + 1, ... (wrapping around) interleaved as rows chosen, rejected."""
    idx = (first + np.arange(pairs)) % len(self)
    toks = np.stack([self.chosen[idx], self.rejected[idx]], 1).reshape(2 * pairs, -1)
    mask = np.stack([self.chosen_mask[idx], self.rejected_mask[idx]], 1).reshape(2 * pairs, -1)
    ref = None if ref_logps is None else np.asarray(ref_logps, np.float32).reshape(-1, 2)[idx]
    return PairBatch(toks[:, :-1].astype(np.int32), toks[:, 1:].astype(np.int32),
                     (mask[:, 1:] != 0).astype(np.float32),
                     None if ref is None else ref.reshape(-1))


def from_prepared(prepared: data_lib.Pairs, seq: int) -> tuple[Pairs, int]:
  """Fixed-width pairs of seq + 1 tokens from a prepared split's variable-length ones: each side
  is cut at seq + 1 tokens (its mask with it) and padded with the pad id (mask 0).

  Returns (pairs, pairs cut). Raises ValueError naming the first pair whose chosen or rejected
  answer loses every token to the cut (a prompt of seq + 1 tokens or more leaves it no room).
  """
  n, width = len(prepared), seq + 1
  arrays = {name: np.full((n, width), prepared.pad_id, np.int32) if "mask" not in name else
            np.zeros((n, width), np.uint8)
            for name in ("chosen", "chosen_mask", "rejected", "rejected_mask")}
  cut = 0
  for i in range(n):
    sides = prepared.pair(i)
    long = False
    for name, ids, mask in (("chosen", *sides[:2]), ("rejected", *sides[2:])):
      k = min(len(ids), width)
      long |= len(ids) > width
      arrays[name][i, :k] = ids[:k]
      arrays[name + "_mask"][i, :k] = mask[:k]
      if not arrays[name + "_mask"][i].any():
        raise ValueError(f"data.path: preference pair {i}: its {name} answer has no token within "
                         f"train.seq + 1 = {width} tokens (its prompt is {int(prepared.prefix[i])} "
                         f"tokens); raise train.seq or prepare with --max-len")
    cut += long
  return Pairs(**arrays), cut


def load_pairs(path: str | Path, seq: int, vocab: int, split: str = "train") -> Pairs:
  """The pairs of a split in a folder (see the module's docstring), checked against train.seq and
  the vocab; a folder of .npy files holds a train split only."""
  path = Path(path)
  if (path / "meta.json").is_file():  # prepared by mtjax.data (checked against its checksums)
    pairs, cut = from_prepared(data_lib.read_pairs(path, split, vocab), seq)
    if cut:
      log.warning("dpo: %d of %d pairs%s are longer than train.seq + 1 = %d tokens and were cut",
                  cut, len(pairs), "" if split == "train" else f" ({split})", seq + 1)
    return pairs
  if split != "train":
    raise ValueError(f"data.path: {path} holds .npy pairs, which have no {split} split; prepare "
                     f"them with `python -m mtjax.data prepare --format preference "
                     f"--val-fraction 0.05`, or set train.eval_every=0")
  missing = [f for f in PAIR_FILES if not (path / f).is_file()]
  if missing:
    raise ValueError(f"train.objective: dpo needs preference pairs in data.path ({path}): "
                     f"prepare them with `python -m mtjax.data prepare --format preference`, or "
                     f"write {', '.join(PAIR_FILES)} (missing {', '.join(missing)})")
  try:
    arrays = {f[:-4]: np.load(path / f, mmap_mode="r", allow_pickle=False) for f in PAIR_FILES}
  except (OSError, ValueError) as e:
    raise ValueError(f"data.path: {path}: cannot read the preference pairs ({e})") from None
  pairs = Pairs(**arrays)
  if pairs.seq != seq:
    raise ValueError(f"data.path: {path}: pairs hold {pairs.seq + 1} tokens per sequence; "
                     f"train.seq {seq} needs {seq + 1}")
  for name in ("chosen", "rejected"):
    a = getattr(pairs, name)
    if not np.issubdtype(a.dtype, np.integer) or a.min() < 0 or a.max() >= vocab:
      raise ValueError(f"data.path: {path}: {name}.npy must hold token ids in [0, {vocab})")
    if not np.all(np.asarray(getattr(pairs, name + "_mask"))[:, 1:].any(axis=1)):
      raise ValueError(f"data.path: {path}: some {name} response has no token in its mask")
  return pairs


def reference_logps(engine, pairs: Pairs, batch: int) -> np.ndarray:
  """Each row's response log-prob under the engine's current weights, one streamed forward pass
  per batch of `batch` rows; [2N] in row order (chosen, rejected of pair 0, ...)."""
  out = []
  per = batch // 2
  for first in range(0, len(pairs), per):
    n = min(per, len(pairs) - first)
    b = pairs.batch(first, per)  # a short last batch wraps around; its extra rows are dropped
    out.append(engine.logps(b)[:2 * n])
  return np.concatenate(out).astype(np.float32)


def _digest(h, a: np.ndarray):
  h.update(str((a.dtype.str, a.shape)).encode())
  a = np.ascontiguousarray(a)
  step = 1 << 24
  flat = a.reshape(-1)
  for i in range(0, flat.size, step):
    h.update(flat[i:i + step].tobytes())


def data_key(pairs: Pairs) -> str:
  """A hash of the pairs' tokens and masks."""
  h = hashlib.sha256()
  for name in ("chosen", "chosen_mask", "rejected", "rejected_mask"):
    _digest(h, np.asarray(getattr(pairs, name)))
  return h.hexdigest()


def model_key(model: dict, seed: int, engine: dict, from_hf: str | None) -> str:
  """A hash of what the initial weights and their forward depend on: the model's config, the init
  seed or the Hugging Face files (names, sizes, modification times), the compute dtype and matmul
  precision."""
  ident = {"model": {k: v for k, v in model.items() if k != "from_hf"},
           "engine": {k: engine[k] for k in ("compute_dtype", "matmul_precision")}}
  if from_hf:
    root = Path(from_hf)
    ident["from_hf"] = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns)
                              for p in root.iterdir() if p.is_file())
  else:
    ident["seed"] = seed
  return hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()


def cached_reference(folder: str | Path, key: dict, compute, split: str = "train"
                     ) -> tuple[np.ndarray, bool]:
  """The reference log-probs of a split's pairs stored in `folder` under `key`, or `compute()`'s,
  then stored (the train split's as ref_logps.npy, another's as ref_logps.SPLIT.npy).

  Returns (log-probs, whether they were computed now). The array and its key are written to
  temporary names and renamed, the key last, so an interrupted write is recomputed next time."""
  folder = Path(folder)
  stem = lambda name: name if split == "train" else name.replace(".", f".{split}.", 1)
  arr_path, key_path = folder / stem(REF_FILE), folder / stem(REF_KEY_FILE)
  try:
    if json.loads(key_path.read_text()) == key:
      return np.load(arr_path, allow_pickle=False), False
  except (OSError, ValueError):
    pass
  logps = compute()
  tmp = folder / (arr_path.name + ".tmp.npy")
  np.save(tmp, logps)
  os.replace(tmp, arr_path)
  tmp_key = folder / (key_path.name + ".tmp")
  tmp_key.write_text(json.dumps(key, sort_keys=True))
  os.replace(tmp_key, key_path)
  return logps, True


class PairSource:
  """Preference pairs as a training source: batch(step) and position(step), batches in order
  through the pairs (wrapping around), each row with its reference log-prob."""

  def __init__(self, pairs: Pairs, batch: int, ref_logps: np.ndarray):
    self.pairs, self.per, self.ref = pairs, batch // 2, ref_logps

  def batch(self, step: int) -> PairBatch:
    return self.pairs.batch(step * self.per, self.per, self.ref)

  def position(self, step: int) -> dict:
    n = step * self.per
    return {"source": "pairs", "step": step, "epoch": n // len(self.pairs),
            "index": n % len(self.pairs)}

  def epoch(self, step: int) -> int:
    """The pass over the pairs that step `step`'s batch starts in (0 first)."""
    return step * self.per // len(self.pairs)


def _reference(cfg, engine, pairs: Pairs, split: str) -> tuple[np.ndarray, bool]:
  """The reference log-probs of `pairs` under `engine`'s current (initial) weights: read from
  beside the pairs when stored for this model and data, else computed (one streamed forward over
  the pairs) and stored. Returns (log-probs, whether they were computed now)."""
  tc = cfg.train
  key = {"model": model_key(config_lib.to_dict(cfg.model), tc.seed, config_lib.to_dict(cfg.engine),
                            cfg.model.from_hf),
         "data": data_key(pairs), "rows": 2 * len(pairs)}
  return cached_reference(cfg.data.path, key, lambda: reference_logps(
      engine, pairs, tc.batch // tc.grad_accum), split)


def training_source(cfg, engine, pairs: Pairs) -> tuple[PairSource, bool]:
  """The run's pair source with the reference log-probs of `engine`'s current (initial) weights
  (`_reference`). Returns (source, whether they were computed now)."""
  ref, computed = _reference(cfg, engine, pairs, "train")
  return PairSource(pairs, cfg.train.batch, ref), computed


@dataclasses.dataclass(frozen=True)
class _Checked:
  train: Pairs
  val: Pairs | None


class _HeldOutPairs:
  """The DPO loss and rewards over the val split's pairs (at most train.eval_batches batches of
  the run's batch), each row against its reference log-prob computed like the training pairs'."""

  def __init__(self, pairs: Pairs, ref: np.ndarray, batch: int, batches: int):
    self.pairs, self.ref, self.per = pairs, ref, batch // 2
    self.batches = min(batches, -(-len(pairs) // self.per))

  def evaluate(self, engine) -> dict[str, float]:
    return engine.held_out(self.pairs.batch(k * self.per, self.per, self.ref)
                           for k in range(self.batches))


@objectives.register
class DirectPreference(objectives.Objective):
  """Direct preference optimisation (the module's docstring): rows alternate chosen, rejected."""
  name = "dpo"
  rows_per_example = 2
  head_forwards = 1  # the rows' log-probs first, then the cross-entropy backward they weigh
  reads_initial_weights = True  # the reference log-probs are the initial weights'

  def __init__(self, beta: float, loss: str, sft_weight: float):
    self.settings = config_lib.DPOConfig(beta, loss, sft_weight)
    self.loss = pair_objective(beta, loss, sft_weight)

  @classmethod
  def of(cls, train):
    return cls(train.dpo.beta, train.dpo.loss, train.dpo.sft_weight)

  def check(self, cfg):
    t = cfg.train
    if (t.batch // t.grad_accum) % 2:
      raise config_lib.ConfigError(
          f"train.objective: dpo takes (chosen, rejected) pairs, so each pass's train.batch / "
          f"train.grad_accum ({t.batch} / {t.grad_accum}) sequences must be even")
    if cfg.data.source != "prepared":
      raise config_lib.ConfigError(
          f"train.objective: dpo needs preference pairs: set data.source=prepared and data.path "
          f"to their folder (`python -m mtjax.data prepare --format preference`, or chosen.npy, "
          f"rejected.npy and their masks; mtjax.dpo), not data.source={cfg.data.source}")

  def carries_documents(self, data):
    return False  # one sequence a row, padded

  def batch_weight(self, batch):
    return batch.inputs.shape[0] / 2  # pairs: the loss is a mean over them

  def head_step(self, fns):
    def step(w_head, w_table, x_BxTxD, targets_BxT, mask_BxT, ref_B, pair_scale, sft_scale):
      """A forward gives each row's log-prob, the pair loss its gradient c_B with respect to them;
      as a row's log-prob is minus its masked tokens' cross-entropy, the cross-entropy backward
      weighted -c_b on row b's masked tokens is the gradient of the loss (the head runs forward
      twice: the price of never holding logits)."""
      policy_B = fns.head_logps(w_head, w_table, x_BxTxD, targets_BxT, mask_BxT)
      (loss, metrics), c_B = jax.value_and_grad(self.loss, has_aux=True)(policy_B, ref_B,
                                                                         pair_scale, sft_scale)
      _, dx, gh, gt = fns.head_step(w_head, w_table, x_BxTxD, targets_BxT, -c_B[:, None] * mask_BxT)
      return loss, dx, gh, gt, metrics
    return step

  def head_inputs(self, batch):
    B = batch.inputs.shape[0]
    mask = objectives.response_mask(batch)
    ref = getattr(batch, "ref_logps", None)
    if ref is None or np.shape(ref) != (B,) or not np.all(np.isfinite(ref)):
      raise ValueError(f"batch.ref_logps: a dpo batch needs the reference model's finite "
                       f"log-prob of each of its {B} rows (mtjax.dpo)")
    chosen = float(mask[0::2].sum())
    if self.settings.sft_weight and not chosen:
      raise ValueError("batch.loss_weights: train.dpo.sft_weight needs chosen response tokens")
    return ((batch.targets, mask, np.asarray(ref, np.float32)),
            (np.float32(2.0 / B), np.float32(1.0 / max(chosen, 1.0))))

  def data(self, cfg):
    t = cfg.train
    if (Path(cfg.data.path) / "meta.json").is_file():  # prepared: it records its tokenizer
      data_lib.check_tokenizer(cfg.data.path, cfg.model.from_hf, cfg.model.vocab_size,
                               cfg.data.allow_other_tokenizer)
    pairs, val = load_pairs(cfg.data.path, t.seq, cfg.model.vocab_size), None
    if t.eval_every:  # the held-out split is checked now, not at the first evaluation
      try:
        val = load_pairs(cfg.data.path, t.seq, cfg.model.vocab_size, "val")
      except ValueError as e:
        raise ValueError(f"train.eval_every: {t.eval_every} needs held-out pairs ({e}); prepare "
                         f"with --val-fraction 0.05, or set train.eval_every=0") from None
    return _Checked(pairs, val)

  def sources(self, cfg, engine, checked):
    src, computed = training_source(cfg, engine, checked.train)
    held = None
    if checked.val is not None:
      ref, _ = _reference(cfg, engine, checked.val, "val")
      held = _HeldOutPairs(checked.val, ref, cfg.train.batch, cfg.train.eval_batches)
    line = (f"dpo: reference log-probs {'computed into' if computed else 'read from'} "
            f"{cfg.data.path}")
    return src, held, line
