"""Training objectives: what a step's loss is (computed at the LM head), what a batch must carry for
it, and where its training and held-out batches come from.

The engine asks the run's objective for its head step and for a batch's head inputs; `train` asks
it for the data; the planner for its head's cost and whether its batches carry documents. Nothing
else knows an objective by name: a new one is a class here (or in a module of its own listed in
_MODULES) registered under the name `train.objective` takes.

  lm   next-token cross-entropy over the batch's loss weights (mtjax.data's sources)
  dpo  preference pairs against the initial weights (mtjax.dpo)
  grpo sampled completions scored by verifiable rewards, group-relative (mtjax.grpo)
"""

from __future__ import annotations

import functools
import importlib
from typing import ClassVar

import numpy as np

from mtjax import config as config_lib, data

_MODULES = ("mtjax.dpo", "mtjax.grpo")  # modules that register objectives of their own
_REGISTRY: dict[str, type[Objective]] = {}


def register(cls: type[Objective]) -> type[Objective]:
  _REGISTRY[cls.name] = cls
  return cls


@functools.cache
def _load_all():
  for m in _MODULES:
    importlib.import_module(m)


def get(train: config_lib.TrainConfig) -> Objective:
  """The objective `train.objective` names, with its settings."""
  _load_all()
  if train.objective not in _REGISTRY:
    raise config_lib.ConfigError(f"train.objective: {train.objective!r} is not one of "
                                 f"{', '.join(sorted(_REGISTRY))}")
  return _REGISTRY[train.objective].of(train)


class Objective:
  """What the engine, the trainer and the planner ask of an objective.

  A head step is `(w_head, w_table | None, x_BxTxD, *head_args) -> (loss, dx_BxTxD, g_head,
  g_table | None, metrics)`, jitted by the engine once; `head_args` are what `head_inputs` gives
  for a batch: per-row arrays (split over the devices and the step's passes) and scalars.
  """
  name: ClassVar[str]
  rows_per_example: ClassVar[int] = 1  # rows that belong together in a batch (a pair: 2)
  head_forwards: ClassVar[int] = 0  # extra forward passes of the LM head before its backward
  reads_initial_weights: ClassVar[bool] = False  # `sources` needs the initial weights (a reference model), before a checkpoint replaces them

  @classmethod
  def of(cls, train: config_lib.TrainConfig) -> Objective:
    return cls()

  def check(self, cfg: config_lib.Config) -> None:
    """Raises ConfigError on a config this objective cannot train (before anything is read)."""

  def carries_documents(self, data: config_lib.DataConfig) -> bool:
    """Whether the batches carry document ids (a mask the attention keeps to)."""
    return data.source == "prepared"

  def host_bytes(self, params: int) -> int:
    """Host memory it holds beside the training state for a model of `params` parameters (the
    planner counts it)."""
    return 0

  def device_bytes(self, cfg: config_lib.Config, params: int) -> int:
    """Device memory it needs between steps (beside the device tier's state, in place of the
    step's own buffers) for a model of `params` parameters (the planner counts it)."""
    return 0

  def batch_weight(self, batch) -> float:
    """A batch's weight among held-out batches (its loss is a mean over what this counts)."""
    raise NotImplementedError

  def head_step(self, fns):
    """The jittable head step built from the engine's layer functions (see the class docstring)."""
    raise NotImplementedError

  def head_inputs(self, batch) -> tuple[tuple[np.ndarray, ...], tuple]:
    """(per-row arrays, scalars) for the head step; raises ValueError on a batch it cannot use."""
    raise NotImplementedError

  def data(self, cfg: config_lib.Config):
    """Checks the data files before anything is allocated; returns what `sources` needs."""
    raise NotImplementedError

  def sources(self, cfg: config_lib.Config, engine, checked) -> tuple:
    """(training source, held-out evaluation or None, a line to log or None) once the store holds
    the initial weights. A source has batch(step), position(step) (JSON, kept in a checkpoint) and
    epoch(step), and may have metrics(step) (merged into the step's record) and resume(position)
    (given the restored checkpoint's); an evaluation has evaluate(engine) -> {metric: value}, the
    one the run's summary follows first (held_out_loss, or grpo's held_out_reward_mean)."""
    raise NotImplementedError


@register
class LanguageModel(Objective):
  """Next-token cross-entropy, each target weighted by the batch's loss weights (1 where absent),
  the weights normalised over the batch: the loss is their weighted mean."""
  name = "lm"

  def head_step(self, fns):
    def step(w_head, w_table, x, targets, weights):
      return (*fns.head_step(w_head, w_table, x, targets, weights), {})
    return step

  def batch_weight(self, batch):
    lw = getattr(batch, "loss_weights", None)
    return float(np.prod(batch.inputs.shape)) if lw is None else float(np.sum(lw, dtype=np.float64))

  def head_inputs(self, batch):
    B, T = batch.inputs.shape
    lw = getattr(batch, "loss_weights", None)
    if lw is None:
      weights = np.full((B, T), 1.0 / (B * T), np.float32)
    else:
      total = float(np.sum(lw, dtype=np.float64))
      if not total > 0 or not np.all(np.isfinite(lw)) or np.min(lw) < 0:
        raise ValueError("batch.loss_weights: must be finite, >= 0 and not all 0")
      weights = (np.asarray(lw, np.float64) / total).astype(np.float32)
    return (batch.targets, weights), ()

  def data(self, cfg):
    t = cfg.train
    if cfg.data.source == "prepared":  # refuses data of another model's tokenizer
      data.check_tokenizer(cfg.data.path, cfg.model.from_hf, cfg.model.vocab_size,
                           cfg.data.allow_other_tokenizer)
    if cfg.data.source == "prepared" and cfg.model.vision is not None:  # and its processor's
      data.check_processor(cfg.data.path, cfg.model.from_hf)
    source = data.source(cfg.data, t.batch, t.seq, cfg.model.vocab_size, t.seed, cfg.model.vision)
    if t.eval_every:  # the held-out split is checked now, not at the first evaluation
      try:
        data.Prepared(cfg.data.path, "val", cfg.model.vocab_size)
      except ValueError as e:
        raise ValueError(f"train.eval_every: {t.eval_every} needs held-out documents ({e}); "
                         f"prepare the data with --val-fraction 0.02, or set train.eval_every=0"
                         ) from None
    return source

  def sources(self, cfg, engine, checked):
    return checked, (_HeldOutTokens(cfg) if cfg.train.eval_every else None), None


class _HeldOutTokens:
  """The token loss over the first train.eval_batches batches of the prepared val split."""

  def __init__(self, cfg: config_lib.Config):
    self.cfg = cfg

  def evaluate(self, engine) -> dict[str, float]:
    c, t = self.cfg, self.cfg.train
    batches = data.validation_batches(c.data, t.batch, t.seq, c.model.vocab_size,
                                      vision=c.model.vision)
    return {"held_out_loss": engine.evaluate(b for _, b in zip(range(t.eval_batches), batches))}


def response_mask(batch) -> np.ndarray:
  """The batch's 0/1 response mask (its loss weights): each row's log-prob sums its targets where
  it is 1."""
  lw = getattr(batch, "loss_weights", None)
  if lw is None or not np.all((lw == 0) | (lw == 1)):
    raise ValueError("batch.loss_weights: a pair objective needs a 0/1 response mask")
  return np.asarray(lw, np.float32)
