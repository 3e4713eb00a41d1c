"""The streaming engine: one training step over the layer store, one layer on the device at a time.

A step, as `Engine.step` reads top to bottom (group index g: 0 = embedding, 1..L = blocks,
L+1 = head):

  forward   for each group: ask the store for its weights (group g+1's copy is issued before
            group g's kernel, so it overlaps), keep the block's input (every
            `engine.activations_every`-th; in device memory, or copied out to pinned host memory
            for the first `engine.activations` ones), run the compiled layer template
            `(weights, x, ctx)`.
  head      chunked LM head + cross-entropy: the loss, its gradient w.r.t. the last hidden state
            and the head's weight gradient, without ever holding [tokens x vocab].
  backward  for each block in reverse: the previous block's weights (and saved input) are
            prefetched, this block's forward is re-run from its saved input under `jax.vjp` and the
            cotangent pulled back; the fp32 weight gradient goes to the clip policy at once.
  update    the clip policy hands each gradient to the store (`commit`), which updates the group
            where its state lives: the host optimizer thread for host groups (overlapped with the
            device's work on the next layer), the device for device and stream groups.

Clipping is a policy the loop calls, not a copy of the loop: `none` commits each gradient as it
lands; `host_buffer` holds them (host groups' in pinned host memory, +4 B/param) until the global
norm is known after the backward; `recompute` runs a norm-only backward first and an applying one
after it (no extra memory, one more backward of device work). Device scalars (loss, norms) are read
once a step, after the backward has been queued.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from mtjax import objectives, programs
from mtjax.config import Config
from mtjax.data import Batch
from mtjax.models import vision
from mtjax.models.layers import Ctx
from mtjax.optimizer import clip_scale
from mtjax.store import LayerStore

@dataclasses.dataclass
class StepStats:
  step: int  # update number just applied (1-based)
  loss: float  # mean token cross-entropy before the update (weighted by the batch's loss weights)
  grad_norm: float  # global L2 norm of the unclipped gradient
  lr: float  # learning rate of this update
  step_s: float  # wall time of the step as seen by the host
  opt_wait_s: float  # host time spent waiting for the host optimizer
  tokens: int  # tokens in the global batch
  skipped: bool = False  # the loss or a gradient was not finite: the update was not applied
  # The host's view of the step, which parts add up to step_s: issuing the forward, issuing the
  # backward (work is queued asynchronously, at most engine.inflight_layers ahead of the device),
  # and finishing (the device ends the backward; buffered clipping commits). Inside those, seconds
  # blocked on the device (its compute and copies); opt_wait_s above are those on the host optimizer.
  forward_s: float = 0.0
  backward_s: float = 0.0
  finish_s: float = 0.0
  device_wait_s: float = 0.0
  # The auxiliary loss (in the gradient, not in `loss`) and what a mixture of experts reports:
  # aux_loss, expert_tokens_min / _max (tokens an expert got, over experts and layers), dropped.
  # With train.grad_accum > 1, the mean over the step's passes.
  aux: dict = dataclasses.field(default_factory=dict)
  # What the objective reports beside its loss (dpo: reward accuracy, chosen and rejected
  # rewards, margin; means over the batch's pairs).
  objective: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class _Forward:
  """What the forward leaves for the backward (device arrays)."""
  loss: jax.Array  # the head's loss (this pass's share of the step's)
  dx: jax.Array  # its gradient with respect to the last block's output
  head_grads: tuple  # (head weights', tied table's or None)
  saved: list  # each block's kept input (None: re-computed from its segment's first)
  keep: dict  # group index -> weights on the device the backward reuses
  aux_loss: jax.Array = 0.0  # the model's auxiliary loss
  aux_metrics: dict = dataclasses.field(default_factory=dict)
  daux: list = dataclasses.field(default_factory=list)  # d aux_loss / d each block's sums
  head_metrics: dict = dataclasses.field(default_factory=dict)  # the objective's (dpo)


@dataclasses.dataclass
class _Inputs:
  """One pass's rows on the device."""
  tokens: jax.Array  # [B, T] int32 on the device
  ctx: Ctx
  # after the last hidden state: lm: (targets, weights: each target's share of the step's loss,
  # summing to 1 over the step's passes); dpo: (targets, response mask, reference log-probs [B],
  # 1 / the step's pairs, 1 / the step's chosen response tokens)
  head_args: tuple


# ---- clip policies: what happens to each gradient the backward produces --------------------------

class _NoClip:
  """Each gradient goes to the store as soon as it exists.

  Non-finite steps: the update of each group is gated on a device flag, "the loss and every
  gradient produced so far are finite", read by the update itself (device groups) or by the host
  optimizer's thread (host groups), so the loop never waits for it. A non-finite loss skips the
  whole step; a gradient that turns non-finite under a finite loss skips its group and every group
  after it in the backward, while the groups before it are already updated. For an all-or-nothing
  skip in that case too, set optim.clip_norm: clipping knows the global norm before any update.
  """
  passes = (True,)

  def __init__(self, engine, loss):
    self.engine, self.sq = engine, {}
    self.ok = engine._finite(loss)  # a device bool, and-ed with each gradient's

  def sink(self, applying: bool):
    def take(idx, g, sq, w):
      self.sq[idx] = sq
      self.ok = self.engine._and_finite(self.ok, sq)
      self.engine._commit(idx, g, 1.0, w, self.ok)
    return take

  def norm(self) -> float:
    return math.sqrt(sum(float(s) for s in self.sq.values()))

  def between_passes(self):
    pass

  def finish(self) -> float:
    return self.norm()

  def skipped(self) -> bool:
    return not bool(self.ok)


class _HostBuffer(_NoClip):
  """Gradients wait (host groups' in pinned host memory) until the global norm is known."""

  def __init__(self, engine, loss):
    super().__init__(engine, loss)
    self.held = {}

  def sink(self, applying):
    store = self.engine.store

    def take(idx, g, sq, w):
      self.sq[idx] = sq
      if not store.owns(idx):  # its owner process holds and applies it
        return
      if store.groups[idx].tier == "host":  # the gradient waits in pinned host memory, w unneeded
        self.held[idx] = (store.grad_to_host(g, store.groups[idx].home), None)
      else:  # held on the device until the norm is known (the planner counts it); a stream
        # group's update uses the weights the backward had, a device group's its own
        self.held[idx] = (g, w if store.groups[idx].tier == "stream" else None)
    return take

  def finish(self):
    norm = self.norm()  # waits for the backward to end
    self.ok = bool(self.ok) and math.isfinite(norm)  # known before any update: all or nothing
    scale = clip_scale(norm, self.engine.cfg.optim.clip_norm) if self.ok else 0.0
    for idx, (g, w) in self.held.items():  # in backward order, as they were produced
      self.engine._commit(idx, g, scale, w, self.ok)
    self.held.clear()
    return norm


class _Recompute(_NoClip):
  """A norm-only backward first, then an applying one with the scale known."""
  passes = (False, True)

  def __init__(self, engine, loss):
    super().__init__(engine, loss)
    self.scale = None

  def sink(self, applying):
    if not applying:
      return lambda idx, g, sq, w: self.sq.__setitem__(idx, sq)
    return lambda idx, g, sq, w: self.engine._commit(idx, g, self.scale, w, self.ok)

  def between_passes(self):
    norm = self.norm()
    self.ok = bool(self.ok) and math.isfinite(norm)  # known before any update: all or nothing
    self.scale = clip_scale(norm, self.engine.cfg.optim.clip_norm) if self.ok else 0.0


def _clip_policy(engine, loss, accumulated: bool = False):
  """The configured policy; after accumulation (every gradient summed and held already) exact
  clipping is the held one: a recomputing backward would re-run every pass."""
  o = engine.cfg.optim
  if o.clip_norm is None:
    return _NoClip(engine, loss)
  held = o.clip_mode == "host_buffer" or accumulated
  return (_HostBuffer if held else _Recompute)(engine, loss)


class _Accumulator:
  """Each group's gradient summed over a step's passes before the last (train.grad_accum).

  A host group's sum waits in pinned host memory (copied out after each pass, and in again to be
  added to the next pass's gradient: its weights cross anyway, the sum crosses beside them), a
  device or stream group's in device memory. The last pass hands each group's full sum on (`total`).
  """

  def __init__(self, engine):
    self.engine, self.sums = engine, {}

  def _take(self, idx, g):
    """g plus the sum so far (removed), on the device."""
    store = self.engine.store
    if idx not in self.sums:
      return g
    s = self.sums.pop(idx)
    if store.groups[idx].tier == "host" and store.host_kind is not None:
      s = jax.device_put(s, store.on_device)
    return self.engine._add(s, g)

  def add(self, idx, g, sq, w):
    store = self.engine.store
    g = self._take(idx, g)
    host = store.groups[idx].tier == "host"
    self.sums[idx] = store.grad_to_host(g, store.groups[idx].home) if host else g

  def total(self, sink):
    """`sink` (a clip policy's) given each group's sum over every pass and its |g|^2."""
    def take(idx, g, sq, w):
      if idx in self.sums:
        g = self._take(idx, g)
        sq = self.engine._sumsq(g)
      sink(idx, g, sq, w)
    return take


def _one_document_rows(pos, seg, T: int) -> bool:
  """Whether each row is one document from its first token (positions 0, 1, ...), then padding
  in a segment of its own (a padded row): the rows M-RoPE's positions, computed from each whole
  row's ids, are right for."""
  idx = np.arange(T)
  if seg is None:
    return pos is None or bool((np.asarray(pos) == idx).all())
  seg = np.asarray(seg)
  doc = idx < np.cumprod(seg == 0, axis=1).sum(1, keepdims=True)  # the first segment's tokens
  return bool(((seg == 0) == doc).all() and np.where(doc, True, seg == seg[:, -1:]).all()
              and (pos is None or np.where(doc, np.asarray(pos) == idx, True).all()))


class Engine:
  """Runs training steps over a LayerStore, streaming one layer at a time through its device.

  Args:
    cfg: a resolved config (no `auto` left: `mtjax.launch.plan_run` resolves it).
    store: the training state.
    overlap: False waits for every copy and update as it is issued (the benchmark's ablation).
    objective: the loss at the head (mtjax.objectives); default the one train.objective names.
  """

  def __init__(self, cfg: Config, store: LayerStore, overlap: bool = True,
               objective: objectives.Objective | None = None):
    self.cfg = cfg
    self.store = store
    self.overlap = overlap
    self.device = store.mesh.devices.flat[0]
    e = cfg.engine
    # The first kept block inputs wait in host memory (raises while activations are still auto).
    self.on_host = e.activations_on_host(cfg.model.block_groups)
    self.spec = store.spec
    tc = cfg.train
    self.objective = objective or objectives.get(tc)
    if tc.grad_accum > 1 and store.multiprocess:
      raise ValueError("train.grad_accum: not supported yet in a run over several processes "
                       "(hosts); set it to 1")
    # The layer programs, built once; the planner's memory probe compiles the same ones.
    self.programs = programs.build(self.spec, programs.Settings.of(
        e, cfg.model, tc.seq, self.device, len(store.devices)))
    progs = self.programs
    self._embed_fwd, self._embed_bwd = progs.embed_fwd, progs.embed_bwd
    self._block_fwd, self._block_bwd = progs.block_fwd, progs.block_bwd
    self._block_bwd_keep = progs.block_bwd_keep
    self._block_dx = progs.block_dx
    self._kinds = [g.kind for g in store.groups]  # each group's layer kind
    # What the backward does at each group (train.freeze): full, dx, pass or skip
    self._modes = self.spec.backward_modes(tc.freeze)
    # a frozen projector passed: the text stream's cotangent, nothing at the image tokens
    self._pass_projector = jax.jit(
        lambda dy, slots: jnp.where((slots >= 0)[..., None], jnp.zeros_like(dy), dy))
    # The model's auxiliary loss (a mixture's load balance) from the blocks' sums, its gradient
    # with respect to them (each block's backward takes its share) and its metrics.
    self._aux = jax.jit(lambda sums: jax.value_and_grad(self.spec.aux_loss, has_aux=True)(sums))
    # The objective's head step (and any other objective's an evaluation asks for).
    self._head = progs.head(self.objective)
    self._logps = progs.head_logps
    self._scale = jax.jit(lambda tree, s: jax.tree.map(lambda a: a * s, tree))
    self._sumsq = jax.jit(lambda g: jnp.sum(g * g))
    self._add = jax.jit(jnp.add)
    self._finite = jax.jit(jnp.isfinite)
    self._and_finite = jax.jit(lambda ok, x: ok & jnp.isfinite(x))
    # Benchmarks set a callable(lane, group, phase, array) told of every copy and kernel issued.
    self.observer = None
    self._phase = "fwd"
    self._inflight = collections.deque()
    self._device_wait = 0.0

  # ---- small helpers ---------------------------------------------------------------------------

  def _observe(self, lane: str, idx: int, arr):
    if self.observer is not None and arr is not None:
      self.observer(lane, idx, self._phase, arr)

  def _wait(self, x):
    return x if self.overlap else jax.block_until_ready(x)

  def _fetch(self, idx: int):
    copied = not self.store.is_resident(idx)
    w = self.store.fetch(idx)
    if copied:
      self._observe("h2d", idx, w)
    return self._wait(w)

  def _ready(self, x):
    """Bounds how far the host runs ahead of the device (and so how many layers are resident)."""
    t = time.perf_counter()
    if not self.overlap:
      jax.block_until_ready(x)
    else:
      self._inflight.append(x)
      if len(self._inflight) > self.cfg.engine.inflight_layers:
        jax.block_until_ready(self._inflight.popleft())
    self._device_wait += time.perf_counter() - t

  def _commit(self, idx, g, scale, w, ok=True):
    out = self.store.commit(idx, g, scale, w, max_queued=self.cfg.engine.grad_queue, ok=ok)
    self._observe("d2h", idx, out)
    if not self.overlap:
      self.store.wait(idx)
      jax.block_until_ready(out)

  def _inputs(self, batch: Batch, passes: int | None = None, head_inputs=None
              ) -> list[_Inputs]:
    """Checks the batch and puts it on the device as `passes` (default train.grad_accum) slices
    of consecutive rows, with the head's inputs from `head_inputs(batch)` (default the run's
    objective's: mtjax.objectives), which normalises over the whole batch so that the passes'
    losses and gradients add up to the batch's."""
    B, T = batch.inputs.shape
    V = self.cfg.model.vocab_size
    K = self.cfg.train.grad_accum if passes is None else passes
    n, mb = len(self.store.devices), self.cfg.engine.micro_batch
    group = self.objective.rows_per_example
    if B % (K * n * (mb or 1)) or B % (K * group):
      raise ValueError(f"batch of {B} sequences: must split evenly over {n} device(s)"
                       + (f" in {K} passes" if K > 1 else "")
                       + (f" of groups of {group} rows ({self.objective.name})" if group > 1
                          else "")
                       + (f" in micro-batches of {mb}" if mb else ""))
    for name, a in (("inputs", batch.inputs), ("targets", batch.targets)):
      if a.shape != (B, T) or a.min(initial=0) < 0 or a.max(initial=0) >= V:
        raise ValueError(f"batch.{name}: expected shape {(B, T)} with ids in [0, {V}), got shape "
                         f"{a.shape}, range [{a.min(initial=0)}, {a.max(initial=0)}]")
    for name in ("positions", "segments", "loss_weights"):
      a = getattr(batch, name, None)
      if a is not None and np.shape(a) != (B, T):
        raise ValueError(f"batch.{name}: expected shape {(B, T)}, got {np.shape(a)}")
    images = self._images(batch)
    rows, scalars = (head_inputs or self.objective.head_inputs)(batch)
    pos = getattr(batch, "positions", None)
    seg = getattr(batch, "segments", None)
    mrope = self._mrope(batch)
    if mrope is not None:
      if not _one_document_rows(pos, seg, T):
        raise ValueError("batch.positions: an M-RoPE model's positions come from its image "
                         "tokens (model.rope.mrope_section); packed documents are unsupported")
      pos = mrope  # a padded row's padding keeps its own segment
    if pos is None:
      pos = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T))
    out = []
    for k in range(K):
      part = lambda a: a[k * B // K:(k + 1) * B // K]
      put = lambda a, dtype=np.int32: self._split(np.asarray(part(a), dtype))
      ctx = Ctx(put(pos), None if seg is None else put(seg))
      if images is not None:
        ctx = Ctx(ctx.positions, ctx.segments, put(images[0], np.float32), put(images[1]))
      args = tuple(put(a, np.int32 if a.dtype.kind in "iu" else np.float32) for a in rows)
      out.append(_Inputs(put(batch.inputs), ctx, args + scalars))
    return out

  def _images(self, batch: Batch) -> tuple[np.ndarray, np.ndarray] | None:
    """(images, image slots) of a model with a vision tower (mtjax.models.vision.image_inputs),
    else None."""
    if self.cfg.model.vision is None:
      return None
    try:
      return vision.image_inputs(self.cfg.model, batch.inputs, getattr(batch, "images", None))
    except ValueError as e:
      raise ValueError(f"batch: {e}") from None

  def _mrope(self, batch: Batch) -> np.ndarray | None:
    """M-RoPE positions [B, T, 3] (mtjax.models.vision.rope_positions), None without M-RoPE."""
    try:
      return vision.rope_positions(self.cfg.model, batch.inputs)
    except ValueError as e:
      raise ValueError(f"batch: {e}") from None

  def _split(self, a: np.ndarray) -> jax.Array:
    """A host array of the global batch split over the devices' `data` axis: each process puts
    only its own devices' rows (every process holds the same global batch)."""
    return jax.make_array_from_callback(a.shape, self.store.batch_sharding, lambda idx: a[idx])

  # ---- the step --------------------------------------------------------------------------------

  def _forward(self, inp: _Inputs, aux: bool = True, passes: int = 1, head=None) -> "_Forward":
    """Runs embedding, blocks and head (and, with `aux`, the auxiliary loss of the blocks' sums,
    1 / `passes` of it: a step of several passes takes the mean of theirs). `head` replaces the
    objective's head: its result is returned alone (the log-probs of `logps`)."""
    store = self.store
    L = len(store.blocks)
    self._phase = "fwd"
    self._inflight.clear()
    w_embed = self._fetch(0)
    w_next = self._fetch(1)  # issued before the embedding kernel so the copy overlaps it
    x = self._embed_fwd(w_embed, inp.tokens)
    self._observe("compute", 0, x)
    saved, sums = [], []
    every = self.cfg.engine.activations_every
    for i in range(L):
      w_cur, w_next = w_next, self._fetch(i + 2)
      if i % every:  # not kept: the backward re-runs this block's segment from its first input
        saved.append(None)
      else:
        saved.append(store.to_host(x) if i // every < self.on_host else x)
      x, block_sums = self._block_fwd[self._kinds[i + 1]](w_cur, x, inp.ctx)
      sums.append(block_sums)
      self._observe("compute", i + 1, x)
      self._ready(x)
    tied = w_embed if self.cfg.model.tie_embeddings else None
    if head is not None:
      return head(w_next, tied, x, *inp.head_args)
    loss, dx, g_head, g_table, metrics = self._head(w_next, tied, x, *inp.head_args)
    self._observe("compute", L + 1, loss)
    out = _Forward(loss, dx, (g_head, g_table), saved, {L + 1: w_next, 0: w_embed},
                   daux=[{} for _ in sums], head_metrics=metrics)
    if aux and self.spec.has_aux:
      (out.aux_loss, out.aux_metrics), out.daux = self._aux(sums)
      if passes > 1:
        out.aux_loss, out.aux_metrics, out.daux = self._scale(
            (out.aux_loss, out.aux_metrics, out.daux), np.float32(1.0 / passes))
    return out

  def _backward(self, fwd: "_Forward", inp: _Inputs, emit, last_pass: bool, update: bool):
    """Walks the blocks in reverse; calls emit(group index, device gradient, device |g|^2, device
    weights or None) for the head, each block and the embedding, in that order.

    On the last pass over `saved` each saved input is released as soon as its block is done; when
    the pass `update`s, stream groups' optimizer state is prefetched alongside the weights."""
    store = self.store
    L = len(store.blocks)
    bwd = self._block_bwd if last_pass else self._block_bwd_keep
    self._inflight.clear()
    self._phase = "bwd"
    saved, dx, keep, kinds, modes = fwd.saved, fwd.dx, fwd.keep, self._kinds, self._modes
    g_head, g_table = fwd.head_grads
    if modes[L + 1] == "full":
      if update:
        store.prefetch(L + 1)
      emit(L + 1, g_head, self._sumsq(g_head), keep[L + 1])

    every = self.cfg.engine.activations_every
    inputs = {}  # block inputs re-computed from a kept one (engine.activations_every > 1)

    def take(i):
      """Block i's input on the device: kept by the forward, or re-computed from the first input
      of its segment (the blocks before i in it, their inputs held for their own backward)."""
      if i in inputs:
        return inputs.pop(i)
      s = i - i % every
      x = self._wait(jax.device_put(saved[s], store.batch_sharding))
      if last_pass:
        saved[s] = None
      for t in range(s, i):
        inputs[t] = x
        x, _ = self._block_fwd[kinds[t + 1]](self._fetch(t + 1), x, inp.ctx)
      return x

    def load(i):
      """Block i's weights and input, and (updating) a stream group's optimizer state."""
      w, x = self._fetch(i + 1), take(i)
      if update and modes[i + 1] == "full":
        store.prefetch(i + 1)
      return w, x

    # the blocks whose backward runs a program, in backward order; the next one's weights and
    # input are asked for before the current one's kernel is queued
    run = [i for i in reversed(range(L)) if modes[i + 1] in ("full", "dx")]
    after = dict(zip(run, run[1:]))
    if run:
      w_next, x_next = load(run[0])
    for i in reversed(range(L)):
      mode = modes[i + 1]
      if mode == "skip":  # frozen, and nothing below trains
        break
      if mode == "pass":  # a frozen tower group below which nothing of the tower trains
        # (the projector's: the text stream's, without Qwen3-VL's deepstack features' beside it)
        dx = (self._pass_projector(dx[0] if isinstance(dx, tuple) else dx, inp.ctx.image_slots)
              if kinds[i + 1] == "projector"
              else dx[0] if isinstance(dx, tuple) else dx)
        continue
      w_cur, x_cur = w_next, x_next
      if i in after:
        w_next, x_next = load(after[i])
      if mode == "dx":
        dx, probe = self._block_dx[kinds[i + 1]](w_cur, x_cur, inp.ctx, dx, fwd.daux[i])
        del x_cur, w_cur
        self._observe("compute", i + 1, probe)
        self._ready(probe)
        continue
      dx, g, sq = bwd[kinds[i + 1]](w_cur, x_cur, inp.ctx, dx, fwd.daux[i])
      del x_cur
      self._observe("compute", i + 1, sq)
      emit(i + 1, g, sq, w_cur)
      del w_cur
      self._ready(sq)  # never a donated buffer
    if modes[0] != "full":
      return
    g_embed = self._embed_bwd(inp.tokens, dx)
    if g_table is not None:
      g_embed = self._add(g_embed, g_table)
    sq = self._sumsq(g_embed)
    self._observe("compute", 0, sq)
    emit(0, g_embed, sq, keep[0])

  def _passes(self, batch: Batch, policy, times: list | None = None):
    """The step's forward/backward passes over slices of `batch` (train.grad_accum of them):
    before the last, each group's gradient joins its sum (no update); the last pass hands every
    group's full sum to a policy made by `policy(device loss incl. auxiliary)`, whose sinks
    commit them. Returns (policy, head loss, auxiliary metrics, objective metrics) on the device;
    `times` gets the seconds of each forward and backward."""
    slices = self._inputs(batch)
    K = len(slices)
    acc = _Accumulator(self) if K > 1 else None
    loss = total = aux = metrics = None
    add = lambda a, b: b if a is None else jax.tree.map(self._add, a, b)
    for k, inp in enumerate(slices):
      t = time.perf_counter()
      fwd = self._forward(inp, passes=K)
      loss, aux, metrics = add(loss, fwd.loss), add(aux, fwd.aux_metrics), add(metrics,
                                                                             fwd.head_metrics)
      total = add(total, self._add(fwd.loss, fwd.aux_loss) if self.spec.has_aux else fwd.loss)
      t_fwd = time.perf_counter()
      if k < K - 1:
        self._backward(fwd, inp, acc.add, last_pass=True, update=False)
      else:
        clip = policy(total)
        for applying in clip.passes:
          sink = clip.sink(applying)
          self._backward(fwd, inp, sink if acc is None else acc.total(sink), last_pass=applying,
                         update=applying)
          if not applying:
            clip.between_passes()
      if times is not None:
        times += [t_fwd - t, time.perf_counter() - t_fwd]
    return clip, loss, aux, metrics

  def step(self, batch: Batch) -> StepStats:
    """One optimizer step on `batch`. Host updates may still run when this returns; `sync()` waits."""
    t0 = time.perf_counter()
    store = self.store
    store.wait_s, self._device_wait = 0.0, 0.0
    times = []
    accumulated = self.cfg.train.grad_accum > 1
    clip, loss, aux, metrics = self._passes(batch, lambda total: _clip_policy(self, total,
                                                                              accumulated), times)
    t_bwd = time.perf_counter()
    norm = clip.finish()  # the step's one read of device scalars: waits for the backward to end
    loss = float(loss)
    aux, metrics = ({k: float(v) for k, v in d.items()} for d in jax.device_get((aux, metrics)))
    t_end = time.perf_counter()
    lr = store.rule.lr(store.step)
    store.end_step()  # a skipped step still counts: batches and the schedule follow the step
    return StepStats(store.step, loss, norm, lr, t_end - t0, store.wait_s,
                     int(np.prod(batch.inputs.shape)), clip.skipped(), sum(times[0::2]),
                     t_bwd - t0 - sum(times[0::2]), t_end - t_bwd, self._device_wait, aux,
                     metrics)

  def forward_backward(self, batch: Batch, sink) -> jax.Array:
    """Streams a step's passes without updating anything: `sink(group index, device gradient,
    device |g|^2)` gets each group's gradient (summed over the passes), head first. Returns the
    device loss (with the auxiliary loss)."""
    out = {}

    class Collect(_NoClip):
      def __init__(self, engine, loss):
        out["loss"] = loss

      def sink(self, applying):
        return lambda idx, g, s, w: sink(idx, g, s)

    self._passes(batch, lambda total: Collect(self, total))
    return out["loss"]

  def logps(self, batch: Batch) -> np.ndarray:
    """Each row's sum of log-probs of its targets where batch.loss_weights (a 0/1 response mask)
    is 1, under the current weights: one streamed forward, nothing kept, no update."""
    inp, = self._inputs(batch, passes=1,
                        head_inputs=lambda b: ((b.targets, objectives.response_mask(b)), ()))
    return np.asarray(jax.device_get(self._forward(inp, aux=False, head=self._logps)),
                      np.float32)

  def token_logps(self, batch: Batch, store=None) -> np.ndarray:
    """Each target's log-prob [B, T] under the current weights, or under `store`'s (another
    holder of this model's weights with the LayerStore methods the forward calls: blocks, fetch,
    is_resident, to_host; a frozen reference copy), in train.grad_accum passes like a step's:
    streamed forwards, nothing kept, no update."""
    slices = self._inputs(batch, head_inputs=lambda b: ((b.targets,), ()))
    head, own = self.programs.head_token_logps, self.store
    self.store = store or own  # the forward fetches from self.store
    try:
      return np.concatenate([np.asarray(jax.device_get(self._forward(inp, aux=False, head=head)),
                                        np.float32) for inp in slices])
    finally:
      self.store = own

  def evaluate(self, batches) -> float:
    """Token loss over the targets of several batches (held-out data), no gradient kept, no
    update: sum(nll * w) / sum(w) with each batch's loss weights. Batches weighing nothing are
    skipped."""
    return self.held_out(batches, objectives.LanguageModel())["held_out_loss"]

  def held_out(self, batches, objective: objectives.Objective | None = None) -> dict[str, float]:
    """An objective's loss (default the run's) and metrics over several batches, no update, each
    batch weighted by the objective's `batch_weight`: {"held_out_loss": ..., "held_out_<metric>":
    ...}. Batches weighing nothing are skipped."""
    objective = objective or self.objective
    head = self.programs.head(objective)
    sums, weight = collections.Counter(), 0.0
    for b in batches:
      w = objective.batch_weight(b)
      if w <= 0:
        continue
      inp, = self._inputs(b, passes=1, head_inputs=objective.head_inputs)
      # the head's gradient work is the price of reuse
      loss, _, _, _, metrics = self._forward(inp, aux=False, head=head)
      values = jax.device_get({"loss": loss, **metrics})
      for k, v in values.items():
        sums[k] += float(v) * w
      weight += w
    if weight == 0:
      raise ValueError("held-out data: no batch has a target the loss counts")
    return {f"held_out_{k}": v / weight for k, v in sums.items()}

  def grads(self, batch: Batch) -> tuple[float, list[np.ndarray | None]]:
    """Loss and every group's fp32 gradient (host copies), streamed like a step; no update. A
    frozen group's (train.freeze) is None."""
    out = {}
    loss = self.forward_backward(batch,
                                 lambda idx, g, s: out.__setitem__(idx, self.store.grad_to_host(g)))
    return float(loss), [np.array(out[i]) if i in out else None
                         for i in range(len(self.store.groups))]

  def sync(self):
    """Waits for every queued update and copy: afterwards the store's host copies are current."""
    self.store.sync()

  def close(self):
    """Syncs the state and stops the host optimizer's thread."""
    self.store.close()
