"""The layer programs: the pure functions of each layer kind's flat fp32 weights (`layer_fns`) and
their jitted programs, built once (`build`): each runs under the engine's matmul precision, and the
block backward donates its incoming cotangent. The engine runs these programs, and the planner's
memory probe (mtjax.launch.compiled_memory) compiles the same ones at the run's shapes
(`shaped_calls`), so what is measured is what runs."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from mtjax import models
from mtjax.config import EngineConfig, ModelConfig
from mtjax.models import grouped, layers, vision
from mtjax.models.layers import Ctx, token_nll

DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}


@dataclasses.dataclass(frozen=True)
class LayerFns:
  """Pure functions of one layer's flat fp32 weights; `build` jits each once per layer kind.

  A block returns its output and its auxiliary sums (a mixture of experts' router statistics;
  empty for a dense block); its backward takes their cotangent beside the output's.
  """
  embed_fwd: callable  # (w, tokens_BxT) -> x_BxTxD
  embed_bwd: callable  # (tokens_BxT, dx_BxTxD) -> g_w
  block_fwd: dict  # kind -> (w, x_BxTxD, ctx) -> (y_BxTxD, aux)
  block_bwd: dict  # kind -> (w, x_BxTxD, ctx, dy_BxTxD, daux) -> (dx_BxTxD, g_w, |g_w|^2)
  block_dx: dict  # kind -> (w, x_BxTxD, ctx, dy_BxTxD, daux) -> (dx_BxTxD, a scalar of it): a frozen block's backward, no weight gradient computed
  head_step: callable  # (w_head, w_table | None, x_BxTxD, targets_BxT, weights_BxT) -> (loss, dx, g_head, g_table)
  head_logps: callable  # (w_head, w_table | None, x_BxTxD, targets_BxT, mask_BxT) -> each row's sum of masked log-probs
  head_token_logps: callable  # (w_head, w_table | None, x_BxTxD, targets_BxT) -> each target's log-prob [B, T]


def _micro(x, n, strided=True):
  """[B, ...] -> [n, B/n, ...]. Strided: micro-batch k takes rows k, k + n, k + 2n, ...: split
  over the devices along B, every micro-batch then has its rows on every device. On one device
  the chunks are contiguous (a free reshape: no transposed copy, which at long context is a
  sequence's worth of activations)."""
  if not strided:
    return x.reshape((n, x.shape[0] // n) + x.shape[1:])
  return jnp.swapaxes(x.reshape((x.shape[0] // n, n) + x.shape[1:]), 0, 1)


def _unmicro(x, strided=True):
  """The inverse of `_micro`: [n, B/n, ...] -> [B, ...]."""
  return (jnp.swapaxes(x, 0, 1) if strided else x).reshape((-1,) + x.shape[2:])


def layer_fns(spec: models.ModelSpec, compute_dtype, micro_batch: int | None, loss_chunk: int,
              attention: str | None = None, devices: int = 1, seq_tile: int | None = None,
              strided: bool | None = None, moe_impl: str = "ragged") -> LayerFns:
  """The layer functions of every kind of `spec`'s model; `micro_batch` counts sequences per chunk
  on each of `devices`, `seq_tile` tokens per tile of a block's per-token work (see
  models.block.Block). `strided` (default: several devices) splits micro-batches and loss chunks
  so that each spans every device. An objective builds its head step from head_step and
  head_logps (mtjax.objectives)."""
  strided = devices > 1 if strided is None else strided
  embed_fwd, embed_bwd = embedding_fns(spec, compute_dtype)
  blocks = {kind: block_fns(spec, kind, compute_dtype, micro_batch, devices, attention, seq_tile,
                            strided, moe_impl) for kind in spec.kinds}
  head_step, head_logps, head_token_logps = head_fns(spec, compute_dtype, loss_chunk, strided)
  return LayerFns(embed_fwd, embed_bwd, {k: f for k, (f, _, _) in blocks.items()},
                  {k: b for k, (_, b, _) in blocks.items()}, {k: d for k, (_, _, d) in blocks.items()},
                  head_step, head_logps, head_token_logps)


def embedding_fns(spec: models.ModelSpec, cd):
  """(embed_fwd, embed_bwd) of the token embedding (signatures: LayerFns)."""
  cfg, lay = spec.cfg, spec.layouts["embed"]
  embed = spec.embed(cd)
  if lay.paths != (("table",),):
    raise AssertionError("embedding layout must be the table alone")

  def embed_fwd(w, tokens_BxT):
    return embed.apply({"params": lay.unflatten(w)}, tokens_BxT)

  def embed_bwd(tokens_BxT, dx_BxTxD):
    # Scatter-add in fp32: a frequent token sums many rows, which bf16 would round away.
    g_VxD = jnp.zeros((cfg.vocab_size, cfg.hidden), jnp.float32)
    dx = dx_BxTxD.reshape(-1, cfg.hidden).astype(jnp.float32) * embed.scale
    if cfg.pad_token_id is not None:  # the padding token's row gets no gradient (as models.layers.Embed)
      dx = jnp.where((tokens_BxT.reshape(-1) == cfg.pad_token_id)[:, None], 0.0, dx)
    g_VxD = g_VxD.at[tokens_BxT.reshape(-1)].add(dx)
    return g_VxD.reshape(-1)

  return embed_fwd, embed_bwd


def block_fns(spec: models.ModelSpec, kind: str, cd, micro_batch: int | None, devices: int,
              attention: str | None, seq_tile: int | None, strided: bool, moe_impl: str):
  """(block_fwd, block_bwd, block_dx) of one block kind, micro-batched (signatures: LayerFns);
  the backward re-runs the forward under jax.vjp, one micro-batch at a time."""
  block = spec.block(kind, attention, seq_tile, moe_impl, dtype=cd)
  lay = spec.layouts[kind]

  def n_micro(x):  # x: the activations, or a vision tower's (x, features) pair
    return 1 if micro_batch is None else jax.tree.leaves(x)[0].shape[0] // (micro_batch * devices)

  def apply_block(wc, x, ctx):
    return block.apply({"params": lay.unflatten(wc)}, x, ctx)

  def block_fwd(w, x_BxTxD, ctx):
    wc = w.astype(cd)
    n = n_micro(x_BxTxD)
    if n == 1:
      return apply_block(wc, x_BxTxD, ctx)
    split = lambda a: jax.tree.map(lambda b: _micro(b, n, strided), a)
    y, aux = jax.lax.map(lambda xs: apply_block(wc, *xs), (split(x_BxTxD), split(ctx)))
    return jax.tree.map(lambda a: _unmicro(a, strided), y), jax.tree.map(lambda a: a.sum(0), aux)

  def block_bwd(w, x_BxTxD, ctx, dy_BxTxD, daux):
    wc = w.astype(cd)
    n = n_micro(x_BxTxD)

    def one(acc, xs):
      xm, cm, dym = xs
      # re-materialises the forward; the auxiliary sums add over micro-batches, so each one's
      # cotangent is the total's
      _, pullback = jax.vjp(lambda wc, xm: apply_block(wc, xm, cm), wc, xm)
      g, dxm = pullback((dym, daux))
      return acc + g.astype(jnp.float32), dxm

    split = lambda a: jax.tree.map(lambda b: _micro(b, n, strided), a)
    g, dx = jax.lax.scan(one, jnp.zeros(w.shape, jnp.float32),
                         (split(x_BxTxD), split(ctx), split(dy_BxTxD)))
    return jax.tree.map(lambda a: _unmicro(a, strided), dx), g, jnp.sum(g * g)

  def block_dx(w, x_BxTxD, ctx, dy_BxTxD, daux):
    wc = w.astype(cd)
    n = n_micro(x_BxTxD)

    def one(xs):
      xm, cm, dym = xs
      # the weights are constants of the pullback: XLA computes no weight gradient
      _, pullback = jax.vjp(lambda xm: apply_block(wc, xm, cm), xm)
      return pullback((dym, daux))[0]

    split = lambda a: jax.tree.map(lambda b: _micro(b, n, strided), a)
    dx = jax.tree.map(lambda a: _unmicro(a, strided),
                      jax.lax.map(one, (split(x_BxTxD), split(ctx), split(dy_BxTxD))))
    # a scalar that exists once dx does: the engine bounds its run-ahead on it (dx is donated on)
    return dx, jnp.sum(jax.tree.leaves(dx)[0][:1, :1].astype(jnp.float32))

  return block_fwd, block_bwd, block_dx


def head_fns(spec: models.ModelSpec, cd, loss_chunk: int, strided: bool):
  """(head_step, head_logps, head_token_logps) of the LM head over chunks of about `loss_chunk`
  tokens, so full logits never exist (signatures: LayerFns)."""
  cfg, lay = spec.cfg, spec.layouts["head"]
  head = spec.head()

  def chunking(x_BxTxD):
    """(chunks, split) of the flattened batch: chunks of about `loss_chunk` tokens.

    With several devices chunk k takes tokens k, k + n, k + 2n, ... of the flattened batch (n
    chunks), so with the batch split over them every chunk has its tokens on every device."""
    B, T, _ = x_BxTxD.shape
    N = B * T
    n = -(-N // min(loss_chunk, N))  # chunks
    pad = n * -(-N // n) - N
    return n, lambda a: _micro(jnp.pad(a, ((0, pad),) + ((0, 0),) * (a.ndim - 1)), n, strided)

  def chunk_nll(wh, wt, x_CxD, t_C):
    table = None if wt is None else wt.astype(cd).reshape(cfg.vocab_size, x_CxD.shape[-1])
    logits_CxV = head.apply({"params": lay.unflatten(wh.astype(cd))}, x_CxD, table)
    return token_nll(logits_CxV, t_C)

  def head_token_logps(w_head, w_table, x_BxTxD, targets_BxT):
    """Each target's log-prob (a forward, chunked)."""
    B, T, D = x_BxTxD.shape
    _, chunked = chunking(x_BxTxD)
    nll = jax.lax.map(lambda xs: chunk_nll(w_head, w_table, *xs),
                      (chunked(x_BxTxD.reshape(B * T, D)), chunked(targets_BxT.reshape(B * T))))
    return -_unmicro(nll, strided)[:B * T].reshape(B, T)

  def head_logps(w_head, w_table, x_BxTxD, targets_BxT, mask_BxT):
    """Each row's sum of log-probs of its targets where mask_BxT is 1 (a forward, chunked)."""
    return jnp.sum(head_token_logps(w_head, w_table, x_BxTxD, targets_BxT) * mask_BxT, axis=1)

  def head_step(w_head, w_table, x_BxTxD, targets_BxT, weights_BxT):
    """Weighted loss sum and gradients, one chunk of about `loss_chunk` tokens at a time."""
    B, T, D = x_BxTxD.shape
    N = B * T
    _, chunked = chunking(x_BxTxD)
    x_NxD, t_N = x_BxTxD.reshape(N, D), targets_BxT.reshape(N)
    wt_N = weights_BxT.reshape(N)  # padding weighs 0

    def chunk_loss(wh, wt, x_CxD, t_C, wt_C):
      return jnp.sum(chunk_nll(wh, wt, x_CxD, t_C) * wt_C)

    grad_fn = jax.value_and_grad(chunk_loss, argnums=(0, 1, 2))

    def one(carry, xs):
      gh, gt = carry
      loss, (dgh, dgt, dx) = grad_fn(w_head, w_table, *xs)
      gt = None if gt is None else gt + dgt
      return (gh + dgh, gt), (loss, dx)

    init = (jnp.zeros(w_head.shape, jnp.float32),
            None if w_table is None else jnp.zeros(w_table.shape, jnp.float32))
    (gh, gt), (losses, dx) = jax.lax.scan(one, init, (chunked(x_NxD), chunked(t_N), chunked(wt_N)))
    dx = _unmicro(dx, strided)[:N].reshape(B, T, D)
    return jnp.sum(losses), dx, gh, gt

  return head_step, head_logps, head_token_logps


def attention_impl(choice: str, device: jax.Device, compute_dtype: str, cfg: ModelConfig,
                   seq: int = 0) -> str:
  """`engine.attention` resolved for this device and model (models.layers.choose_attention)."""
  return layers.choose_attention(choice, device.platform, device_capability(device), compute_dtype,
                                 models.spec(cfg).attention_widths, seq)


def device_capability(device: jax.Device) -> float:
  """The GPU's compute capability as a number (9.0 on Hopper); 0 for other devices."""
  try:
    return float(getattr(device, "compute_capability", "") or 0)
  except ValueError:
    return 0.0


def moe_impl(choice: str, device: jax.Device, cfg: ModelConfig | None = None,
             compute_dtype: str = "bfloat16") -> str:
  """`auto`: on a Hopper GPU in bf16, the Mosaic-GPU grouped matmul where its tiles divide the
  experts' widths (XLA lowers jax.lax.ragged_dot on the GPU by expanding the rows E times, a small
  share of a dense matmul's rate: docs/performance.md); elsewhere jax.lax.ragged_dot."""
  if choice != "auto":
    return choice
  m = None if cfg is None else cfg.moe
  if (m is not None and device.platform == "gpu" and "9." in str(getattr(device, "compute_capability", ""))
      and grouped.supported(cfg.hidden, m.expert_ffn, jnp.bfloat16 if compute_dtype == "bfloat16"
                            else jnp.float32)):
    return "mosaic"
  return "ragged"


@dataclasses.dataclass(frozen=True)
class Settings:
  """What a model's layer programs are built from: the engine's settings, each choice resolved for
  the device the programs run on."""
  compute_dtype: str  # the layers' activations and matmuls: bfloat16 or float32
  micro_batch: int | None  # sequences per chunk on each device; None: a pass's rows at once
  loss_chunk: int  # tokens per chunk of the LM head's loss
  attention: str  # the attention implementation (`attention_impl`)
  moe_impl: str  # the experts' grouped matmul (`moe_impl`)
  seq_tile: int | None  # tokens per tile of a block's per-token work (models.block.Block)
  matmul_precision: str  # jax.default_matmul_precision inside every program
  devices: int = 1  # devices the batch a program takes is split over
  strided: bool = False  # micro-batches and loss chunks span every device (the batch is split)

  @classmethod
  def of(cls, engine: EngineConfig, model: ModelConfig, seq: int, device: jax.Device,
         devices: int = 1, strided: bool | None = None) -> Settings:
    """The engine's settings resolved for `device`, the batch split over `devices` (strided by
    default where it is split)."""
    return cls(engine.compute_dtype, engine.micro_batch, engine.loss_chunk,
               attention_impl(engine.attention, device, engine.compute_dtype, model, seq),
               moe_impl(engine.moe_impl, device, model, engine.compute_dtype), engine.seq_tile,
               engine.matmul_precision, devices, devices > 1 if strided is None else strided)


@dataclasses.dataclass(frozen=True)
class Programs:
  """A model's jitted layer programs at one Settings: one per layer kind, whichever layer's
  weights it is called with (signatures: LayerFns), and the head step of each objective asked for
  (mtjax.objectives), jitted once."""
  spec: models.ModelSpec
  settings: Settings
  fns: LayerFns  # the pure functions behind them
  jit: Callable  # jax.jit under the settings' matmul precision
  embed_fwd: Callable
  embed_bwd: Callable
  block_fwd: dict  # kind -> program
  block_bwd: dict  # kind -> program; the incoming cotangent's buffer becomes the outgoing one
  block_bwd_keep: dict  # kind -> the same, nothing donated (clip_mode=recompute's norm-only pass)
  block_dx: dict  # kind -> a frozen block's backward: the input's cotangent alone (train.freeze)
  head_step: Callable  # the weighted token loss's (the memory probe's head)
  head_logps: Callable
  head_token_logps: Callable
  heads: dict = dataclasses.field(default_factory=dict)  # objective name -> its head step

  def head(self, objective) -> Callable:
    """The objective's head step, jitted on first use."""
    if objective.name not in self.heads:
      self.heads[objective.name] = self.jit(objective.head_step(self.fns))
    return self.heads[objective.name]


def build(spec: models.ModelSpec, settings: Settings) -> Programs:
  """The jitted layer programs of `spec`'s model at `settings`."""
  s = settings
  fns = layer_fns(spec, DTYPES[s.compute_dtype], s.micro_batch, s.loss_chunk, s.attention,
                  s.devices, s.seq_tile, s.strided, s.moe_impl)

  def jit(fn, **kw):
    def with_precision(*args):
      with jax.default_matmul_precision(s.matmul_precision):
        return fn(*args)
    return jax.jit(with_precision, **kw)

  return Programs(
      spec, s, fns, jit, jit(fns.embed_fwd), jit(fns.embed_bwd),
      {k: jit(f) for k, f in fns.block_fwd.items()},
      {k: jit(f, donate_argnums=(3,)) for k, f in fns.block_bwd.items()},
      {k: jit(f) for k, f in fns.block_bwd.items()},
      {k: jit(f) for k, f in fns.block_dx.items()},
      jit(fns.head_step), jit(fns.head_logps), jit(fns.head_token_logps))


def shaped_calls(programs: Programs, rows: int, seq: int, device: jax.Device,
                 documents: bool = False) -> dict[str, tuple[Callable, tuple]]:
  """Each program the memory probe compiles, named, with abstract arguments of one pass over
  `rows` sequences of `seq` tokens on `device` (`documents`: the batch carries document ids, a
  mask the attention keeps to): `fn.lower(*args).compile().memory_analysis()` measures it."""
  spec, cfg = programs.spec, programs.spec.cfg
  cd = DTYPES[programs.settings.compute_dtype]
  sh = jax.sharding.SingleDeviceSharding(device)
  S = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sh)
  x, tok = S((rows, seq, cfg.hidden), cd), S((rows, seq), jnp.int32)
  pos = S((rows, seq, 3), jnp.int32) if cfg.rope.mrope_section else tok  # M-RoPE: 3 streams
  ctx = Ctx(pos, tok if documents else None)
  if cfg.vision is not None:  # the tower's layers carry (x, features) and read the images
    v = cfg.vision
    ctx = Ctx(pos, ctx.segments, S((rows, v.max_images, *v.image_shape), jnp.float32),
              tok)
  w = {k: S((lay.size,), jnp.float32) for k, lay in spec.layouts.items()}
  table = w["embed"] if cfg.tie_embeddings else None
  calls = {
      "embed forward": (programs.embed_fwd, (w["embed"], tok)),
      "head": (programs.head_step, (w["head"], table, x, tok, S((rows, seq), jnp.float32))),
      "embed backward": (programs.embed_bwd, (tok, x)),
  }
  for kind in spec.kinds:
    fwd, bwd = programs.block_fwd[kind], programs.block_bwd[kind]
    inp = vision.carry(cfg, kind, spec.kinds[kind].deepstack, S, rows, seq, cd)
    out, daux = jax.eval_shape(fwd, w[kind], inp, ctx)
    dy = jax.tree.map(lambda a: S(a.shape, a.dtype), out)
    calls[f"{kind} forward"] = (fwd, (w[kind], inp, ctx))
    calls[f"{kind} backward"] = (bwd, (w[kind], inp, ctx, dy, daux))
  return calls
