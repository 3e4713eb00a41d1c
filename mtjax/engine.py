"""The streaming engine: one training step over host-resident state, one layer on the device at a time.

Data flow of a step (group index g: 0 = embedding, 1..L = blocks, L+1 = head):

  forward   for each layer: copy weights host->device (layer g+1's copy is issued before layer g's
            kernel, so it overlaps), save the layer's input (device, or host by policy), run the
            compiled layer template.
  head      chunked LM head + cross-entropy; returns the mean loss, its gradient w.r.t. the last
            hidden state, and the head's weight gradient, without ever holding [tokens x vocab].
  backward  for each block in reverse: prefetch the previous block's weights (and saved input),
            re-run this block's forward from its saved input under `jax.vjp`, pull back the
            cotangent; the fp32 weight gradient leaves for pinned host memory at once.
  update    the host optimizer applies AdamW to each layer as its gradient lands, on a worker
            thread, while the device works on the next layer. The next step's forward copies a
            layer only after that layer's update has finished.

With exact global-norm clipping the updates need the global norm first: `host_buffer` keeps every
gradient in host memory until the backward ends (+4 bytes/param, updates start after the backward);
`recompute` runs a norm-only backward first and a second, applying backward after it (no extra
host bytes, one more backward of device work).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding

from mtjax import model, plan as plan_lib
from mtjax.config import Config, ModelConfig
from mtjax.data import Batch
from mtjax.optimizer import HostOptimizer, adamw_on_device, clip_scale
from mtjax.state import HostState, Layout, host_memory_kind

DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}


@dataclasses.dataclass(frozen=True)
class LayerFns:
  """Pure functions of one layer's flat fp32 weights; the engine jits each once per layer kind."""
  embed_fwd: callable  # (w, tokens_BxT) -> x_BxTxD
  embed_bwd: callable  # (tokens_BxT, dx_BxTxD) -> g_w
  block_fwd: callable  # (w, x_BxTxD) -> y_BxTxD
  block_bwd: callable  # (w, x_BxTxD, dy_BxTxD) -> (dx_BxTxD, g_w, |g_w|^2)
  head_step: callable  # (w_head, w_table | None, x_BxTxD, targets_BxT, weight) -> (loss, dx, g_head, g_table)


def _micro(x, n):
  """[B, ...] -> [n, B/n, ...]"""
  return x.reshape((n, x.shape[0] // n) + x.shape[1:])


def layer_fns(cfg: ModelConfig, lays: dict[str, Layout], compute_dtype, micro_batch: int | None,
              loss_chunk: int, attention: str | None = None) -> LayerFns:
  cd = compute_dtype
  block = model.Block(cfg, attention)
  head = model.Head(cfg)
  if lays["embed"].paths != (("table",),):
    raise AssertionError("embedding layout must be the table alone")

  def embed_fwd(w, tokens_BxT):
    return jnp.take(w.astype(cd).reshape(cfg.vocab_size, cfg.hidden), tokens_BxT, axis=0)

  def embed_bwd(tokens_BxT, dx_BxTxD):
    # Scatter-add in fp32: a frequent token sums many rows, which bf16 would round away.
    g_VxD = jnp.zeros((cfg.vocab_size, cfg.hidden), jnp.float32)
    g_VxD = g_VxD.at[tokens_BxT.reshape(-1)].add(dx_BxTxD.reshape(-1, cfg.hidden).astype(jnp.float32))
    return g_VxD.reshape(-1)

  def apply_block(wc, x):
    return block.apply({"params": lays["block"].unflatten(wc)}, x)

  def n_micro(x):
    return 1 if micro_batch is None else x.shape[0] // micro_batch

  def block_fwd(w, x_BxTxD):
    wc = w.astype(cd)
    n = n_micro(x_BxTxD)
    if n == 1:
      return apply_block(wc, x_BxTxD)
    return jax.lax.map(lambda xm: apply_block(wc, xm), _micro(x_BxTxD, n)).reshape(x_BxTxD.shape)

  def block_bwd(w, x_BxTxD, dy_BxTxD):
    wc = w.astype(cd)
    n = n_micro(x_BxTxD)

    def one(acc, xs):
      xm, dym = xs
      _, pullback = jax.vjp(apply_block, wc, xm)  # re-materialises this chunk's forward
      g, dxm = pullback(dym)
      return acc + g.astype(jnp.float32), dxm

    g, dx = jax.lax.scan(one, jnp.zeros(w.shape, jnp.float32),
                         (_micro(x_BxTxD, n), _micro(dy_BxTxD, n)))
    return dx.reshape(x_BxTxD.shape), g, jnp.sum(g * g)

  def head_step(w_head, w_table, x_BxTxD, targets_BxT, weight):
    """Mean-loss value and gradients, one chunk of `loss_chunk` tokens at a time."""
    B, T, D = x_BxTxD.shape
    N = B * T
    C = min(loss_chunk, N)
    pad = (-N) % C
    x_NxD = jnp.pad(x_BxTxD.reshape(N, D), ((0, pad), (0, 0)))
    t_N = jnp.pad(targets_BxT.reshape(N), (0, pad))
    wt_N = jnp.pad(jnp.full((N,), weight, jnp.float32), (0, pad))  # padding weighs 0

    def chunk_loss(wh, wt, x_CxD, t_C, wt_C):
      table = None if wt is None else wt.astype(cd).reshape(cfg.vocab_size, D)
      logits_CxV = head.apply({"params": lays["head"].unflatten(wh.astype(cd))}, x_CxD, table)
      return jnp.sum(model.token_nll(logits_CxV, t_C) * wt_C)

    grad_fn = jax.value_and_grad(chunk_loss, argnums=(0, 1, 2))

    def one(carry, xs):
      gh, gt = carry
      loss, (dgh, dgt, dx) = grad_fn(w_head, w_table, *xs)
      gt = None if gt is None else gt + dgt
      return (gh + dgh, gt), (loss, dx)

    init = (jnp.zeros(w_head.shape, jnp.float32),
            None if w_table is None else jnp.zeros(w_table.shape, jnp.float32))
    n = (N + pad) // C
    (gh, gt), (losses, dx) = jax.lax.scan(
        one, init, (x_NxD.reshape(n, C, D), t_N.reshape(n, C), wt_N.reshape(n, C)))
    dx = dx.reshape(N + pad, D)[:N].reshape(B, T, D)
    return jnp.sum(losses), dx, gh, gt

  return LayerFns(embed_fwd, embed_bwd, block_fwd, block_bwd, head_step)


def attention_impl(choice: str, device: jax.Device, compute_dtype: str, cfg: ModelConfig) -> str:
  """`auto` takes cuDNN's fused (flash) attention where it applies: on a GPU, in bf16, for head
  widths it supports; jax's own default is the XLA path that materialises [T x T] scores."""
  if choice != "auto":
    return choice
  hd = cfg.dim_per_head
  if device.platform == "gpu" and compute_dtype == "bfloat16" and hd % 8 == 0 and hd <= 128:
    return "cudnn"
  return "xla"


@dataclasses.dataclass
class StepStats:
  step: int  # update number just applied (1-based)
  loss: float  # mean token cross-entropy before the update
  grad_norm: float  # global L2 norm of the unclipped gradient
  lr: float  # learning rate of this update
  step_s: float  # wall time of the step as seen by the host
  opt_wait_s: float  # host time spent waiting for the optimizer thread
  tokens: int  # tokens in the global batch


class Engine:
  """Runs training steps over a HostState, streaming one layer at a time through `device`."""

  def __init__(self, cfg: Config, state: HostState, device: jax.Device | None = None):
    self.cfg = cfg
    self.state = state
    self.device = device or jax.devices()[0]
    self.on_device = SingleDeviceSharding(self.device)
    kind = host_memory_kind(self.device)
    self.on_host = SingleDeviceSharding(self.device, memory_kind=kind) if kind else None
    e = cfg.engine
    self.overlap = e.overlap
    self.attention = attention_impl(e.attention, self.device, e.compute_dtype, cfg.model)
    fns = layer_fns(cfg.model, state.layouts, DTYPES[e.compute_dtype], e.micro_batch,
                    e.loss_chunk, self.attention)
    self.fns = fns

    def jit(fn, **kw):
      def with_precision(*args):
        with jax.default_matmul_precision(e.matmul_precision):
          return fn(*args)
      return jax.jit(with_precision, **kw)

    self._embed_fwd = jit(fns.embed_fwd)
    self._embed_bwd = jit(fns.embed_bwd)
    self._block_fwd = jit(fns.block_fwd)
    # The incoming cotangent dies here: its buffer becomes the outgoing one.
    self._block_bwd = jit(fns.block_bwd, donate_argnums=(2,))
    self._block_bwd_keep = jit(fns.block_bwd)  # norm-only pass of clip_mode=recompute
    self._head = jit(fns.head_step)
    self._sumsq = jax.jit(lambda g: jnp.sum(g * g))
    self._add = jax.jit(jnp.add)
    self.opt = HostOptimizer(cfg.optim, cfg.decay_steps)
    # Groups [0, n_device) -- the last ones the backward reaches -- are updated on the device:
    # their moments cross the link (pinned buffers, so by DMA) and their updated weights stay on
    # the device for the next forward, which needs exactly these layers first.
    self.n_device = e.device_update_layers
    if self.n_device == "auto":
      self.n_device = plan_lib.choose_device_updates(
          cfg, plan_lib.device_memory_limit(self.device), host_limit=plan_lib.host_memory_limit())
    for g in state.groups[:self.n_device]:
      g.pin(self.device, ("m", "v"))
    self._device_adamw = jax.jit(adamw_on_device, static_argnums=(6,), donate_argnums=(0, 1, 2))
    self._resident: dict[int, jax.Array] = {}  # group -> its current fp32 weights on the device
    self._stale: set[int] = set()  # groups whose host w lags the device's until sync()
    self._resident_version = state.version
    self._moments: dict[int, tuple] = {}  # group -> (m, v) on the device, prefetched
    self.tracer = None  # benchmarks set an object with .issued(lane, group, phase, array)
    self._phase = "fwd"

  def _trace(self, lane: str, idx: int, arr):
    if self.tracer is not None:
      self.tracer.issued(lane, idx, self._phase, arr)

  # ---- transfers -------------------------------------------------------------------------------

  def _fetch(self, idx: int):
    """Copies group `idx`'s master weights to the device, once its last update has finished."""
    if idx in self._resident:
      return self._resident[idx]
    t = time.perf_counter()
    self.opt.wait(idx)
    self._opt_wait += time.perf_counter() - t
    w = jax.device_put(self.state.groups[idx].w, self.on_device)
    self._trace("h2d", idx, w)
    return w if self.overlap else w.block_until_ready()

  def _prefetch_moments(self, idx: int):
    if idx < self.n_device and idx not in self._moments:
      g = self.state.groups[idx]
      self._moments[idx] = (self._to_device(g.m), self._to_device(g.v))
      self._trace("h2d", idx, self._moments[idx][1])

  def _to_host(self, x):
    if self.on_host is None:
      return x
    y = jax.device_put(x, self.on_host)
    return y if self.overlap else y.block_until_ready()

  def _to_device(self, x):
    y = jax.device_put(x, self.on_device)
    return y if self.overlap else y.block_until_ready()

  def _ready(self, x):
    """Bounds how far the host runs ahead of the device (and so how many layers are resident)."""
    if not self.overlap:
      jax.block_until_ready(x)
      return
    self._inflight.append(x)
    if len(self._inflight) > self.cfg.engine.inflight_layers:
      jax.block_until_ready(self._inflight.popleft())

  # ---- gradients -> optimizer ----------------------------------------------------------------

  def _apply(self, idx: int, g, scale: float, w=None):
    """Hands group `idx`'s gradient (device or host array) to its optimizer: the device update for
    the last `n_device` groups (w: the weights the device already holds, if any), else the host."""
    group = self.state.groups[idx]
    if idx < self.n_device:
      w = self._fetch(idx) if w is None else w
      self._prefetch_moments(idx)
      m, v = self._moments.pop(idx)
      w, m, v = self._device_adamw(w, m, v, g, self.opt.hyper(self.state.step), np.float32(scale),
                                   group.layout.n_decay)
      self._resident[idx] = w
      # The device's copy of w is the current one: the host copy is refreshed by sync(), not every
      # step, so only the moments cross back (8 B/param, not 12).
      self._stale.add(idx)
      group.swap(m=self._to_host(m), v=self._to_host(v))
      self._trace("d2h", idx, group.v)
      return
    g_host = self._to_host(g)
    self._trace("d2h", idx, g_host)
    if not self.overlap:
      self.opt.update(group, g_host, self.state.step, scale)
      return
    self.opt.submit(idx, group, g_host, self.state.step, scale)
    while self.opt.queued() > self.cfg.engine.grad_queue:
      t = time.perf_counter()
      self.opt.wait_oldest()
      self._opt_wait += time.perf_counter() - t

  # ---- the step --------------------------------------------------------------------------------

  def _forward(self, tokens, targets, weight):
    L = len(self.state.blocks)
    tied = self.cfg.model.tie_embeddings
    checkpoint_on_host = self.cfg.engine.checkpoints == "host"
    self._phase = "fwd"
    w_embed = self._fetch(0)
    w_next = self._fetch(1)  # issued before the embedding kernel so the copy overlaps it
    x = self._embed_fwd(w_embed, tokens)
    self._trace("compute", 0, x)
    saved = []
    for i in range(L):
      w_cur, w_next = w_next, self._fetch(i + 2)
      saved.append(self._to_host(x) if checkpoint_on_host else x)
      x = self._block_fwd(w_cur, x)
      self._trace("compute", i + 1, x)
      self._ready(x)
    loss, dx, g_head, g_table = self._head(w_next, w_embed if tied else None, x, targets, weight)
    self._trace("compute", L + 1, loss)
    weights = {L + 1: w_next}
    if self.n_device > 0:
      weights[0] = w_embed  # its device update needs it after the backward
    return loss, dx, g_head, g_table, saved, weights

  def _backward(self, saved, dx, tokens, g_head, g_table, weights, emit, last_pass=True,
                update=True):
    """Walks the blocks in reverse; calls emit(group index, device gradient, device |g|^2, device
    weights or None) for the head, each block and the embedding, in that order.

    On the last pass over `saved` each checkpoint is released as soon as its block is done; when
    the pass `update`s, the moments of device-updated groups are prefetched alongside weights."""
    L = len(self.state.blocks)
    bwd = self._block_bwd if last_pass else self._block_bwd_keep
    self._inflight.clear()
    self._phase = "bwd"
    if update:
      self._prefetch_moments(L + 1)
    emit(L + 1, g_head, self._sumsq(g_head), weights.pop(L + 1, None) if last_pass else weights.get(L + 1))

    def take(i):
      x = self._to_device(saved[i])
      if last_pass:
        saved[i] = None
      return x

    if L:
      w_next, x_next = self._fetch(L), take(L - 1)
      if update:
        self._prefetch_moments(L)
    for i in reversed(range(L)):
      w_cur, x_cur = w_next, x_next
      if i > 0:  # prefetch block i-1 before queuing block i's kernel
        w_next, x_next = self._fetch(i), take(i - 1)
      if update:
        self._prefetch_moments(i)
      dx, g, sq = bwd(w_cur, x_cur, dx)
      del x_cur
      self._trace("compute", i + 1, sq)
      emit(i + 1, g, sq, w_cur)
      del w_cur
      self._ready(sq)  # never a donated buffer
    g_embed = self._embed_bwd(tokens, dx)
    if g_table is not None:
      g_embed = self._add(g_embed, g_table)
    sq = self._sumsq(g_embed)
    self._trace("compute", 0, sq)
    emit(0, g_embed, sq, weights.get(0))

  def step(self, batch: Batch) -> StepStats:
    """One optimizer step on `batch`. Updates may still run when this returns; `sync()` waits."""
    t0 = time.perf_counter()
    self._opt_wait = 0.0
    self._inflight = collections.deque()
    st, ocfg = self.state, self.cfg.optim
    B, T = batch.inputs.shape
    V = self.cfg.model.vocab_size
    for name, a in (("inputs", batch.inputs), ("targets", batch.targets)):
      if a.shape != (B, T) or a.min(initial=0) < 0 or a.max(initial=0) >= V:
        raise ValueError(f"batch.{name}: expected shape {(B, T)} with ids in [0, {V}), got shape "
                         f"{a.shape}, range [{a.min(initial=0)}, {a.max(initial=0)}]")
    self._check_resident()
    tokens = jax.device_put(batch.inputs, self.on_device)
    targets = jax.device_put(batch.targets, self.on_device)
    loss, dx, g_head, g_table, saved, weights = self._forward(tokens, targets,
                                                              np.float32(1.0 / (B * T)))
    sq = {}
    if ocfg.clip_norm is None:
      def emit(idx, g, s, w):
        sq[idx] = s
        self._apply(idx, g, 1.0, w)
      self._backward(saved, dx, tokens, g_head, g_table, weights, emit)
      norm = math.sqrt(sum(float(s) for s in sq.values()))
    elif ocfg.clip_mode == "host_buffer":
      held = {}
      def emit(idx, g, s, w):  # host-updated groups' gradients wait in host memory
        sq[idx] = s
        held[idx] = (g if idx < self.n_device else self._to_host(g), w)
      self._backward(saved, dx, tokens, g_head, g_table, weights, emit)
      norm = math.sqrt(sum(float(s) for s in sq.values()))  # waits for the backward to end
      scale = clip_scale(norm, ocfg.clip_norm)
      for idx, (g, w) in held.items():  # in backward order, as they were produced
        self._apply(idx, g, scale, w)
      del held
    else:  # recompute: a norm-only backward, then the applying one
      self._backward(saved, dx, tokens, g_head, g_table, weights,
                     lambda idx, g, s, w: sq.__setitem__(idx, s), last_pass=False, update=False)
      norm = math.sqrt(sum(float(s) for s in sq.values()))
      scale = clip_scale(norm, ocfg.clip_norm)
      self._backward(saved, dx, tokens, g_head, g_table, weights,
                     lambda idx, g, s, w: self._apply(idx, g, scale, w))

    lr = float(self.opt.hyper(st.step)["lr"])
    st.step += 1
    loss = float(loss)
    return StepStats(st.step, loss, norm, lr, time.perf_counter() - t0, self._opt_wait, B * T)

  def grads(self, batch: Batch) -> tuple[float, list[np.ndarray]]:
    """Mean loss and every group's fp32 gradient (host copies), streamed like a step; no update."""
    B, T = batch.inputs.shape
    self._opt_wait, self._inflight = 0.0, collections.deque()
    self._check_resident()
    tokens = jax.device_put(batch.inputs, self.on_device)
    loss, dx, g_head, g_table, saved, weights = self._forward(
        tokens, jax.device_put(batch.targets, self.on_device), np.float32(1.0 / (B * T)))
    out = {}
    self._backward(saved, dx, tokens, g_head, g_table, weights,
                   lambda idx, g, s, w: out.__setitem__(idx, self._to_host(g)), update=False)
    return float(loss), [np.array(out[i]) for i in range(len(self.state.groups))]

  def _check_resident(self):
    """Drops device copies of weights that were overwritten on the host (HostState.load_tree)."""
    if self.state.version != self._resident_version:
      self._resident.clear()
      self._stale.clear()  # the host's new weights win over the device's
      self._resident_version = self.state.version

  def sync(self):
    """Waits for every queued update and copy and brings device-updated weights back: afterwards
    the host state is the post-step state (call it before reading or saving the state)."""
    self.opt.wait_all()
    self._check_resident()
    for idx in sorted(self._stale):
      self.state.groups[idx].swap(w=self._to_host(self._resident[idx]))
    self._stale.clear()
    jax.block_until_ready([(g.w, g.m, g.v) for g in self.state.groups[:self.n_device]])

  def close(self):
    """Syncs the host state, then stops the optimizer thread."""
    self.sync()
    self.opt.close()
