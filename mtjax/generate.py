"""Text generation with a KV cache, for every family: `mtjax.generate(cfg, params, prompts, ...)`
and `python -m mtjax.generate --model DIR --prompt TEXT`.

The cache path runs the layer modules the trainer runs, split where a cache goes: per block,
`Block._qkv` (norm, q/k/v projections, RoPE) for the new tokens, their keys and values written
into the block's cache at the next slot, the queries attended over the cache (`cached_attention`:
fp32 scores masked by each key's position and validity, the layer's own window, soft-cap, scale
and sinks from its `scoring()`), then `Block._out` (output projection, feed-forward or the
mixture's routing, residuals). A windowed layer keeps a full cache masked to its window. MLA
caches the per-head keys and values its `qkv` expands (not the compressed latent).

Prompts are left-padded to one length: padding is never a key, and each row's RoPE positions
count from its first real token. The prefill and the decode step are each compiled once per
(batch, prompt length, cache length); every decoded token reuses the one compiled step. Sampling
follows transformers' order: repetition penalty, temperature, top-k, top-p, min-p; temperature 0
is greedy. One PRNG key per decoded token, split from the seed's key in `generate`. Prompt and
cache lengths are bucketed (`bucket`), so nearby lengths reuse the compiled programs.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import numbers
import sys
import time
import types
from pathlib import Path

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from mtjax import attention, exits, models
from mtjax.config import ModelConfig
from mtjax.models.block import Block



# ---------------------------------------------------------------------------------------- sampling


@dataclasses.dataclass(frozen=True)
class Sampling:
  """How each next token is chosen (transformers' generation options of the same names)."""
  temperature: float = 0.0  # 0: greedy (argmax); else logits are divided by it and sampled
  top_k: int = 0  # keep the k most likely tokens (ties at the k-th kept); 0: off
  top_p: float = 1.0  # keep the smallest set of most likely tokens whose mass reaches top_p; 1: off
  min_p: float = 0.0  # drop tokens below min_p x the top token's probability; 0: off
  repetition_penalty: float = 1.0  # a seen token's logit / penalty (x penalty if negative); 1: off

  def __post_init__(self):
    checks = (("temperature", lambda x: x >= 0, ">= 0"),
              ("top_k", lambda x: x >= 0 and int(x) == x, "an integer >= 0"),
              ("top_p", lambda x: 0 < x <= 1, "in (0, 1]"),
              ("min_p", lambda x: 0 <= x <= 1, "in [0, 1]"),
              ("repetition_penalty", lambda x: x > 0, "> 0"))
    for name, ok, want in checks:
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, numbers.Real) \
          or not math.isfinite(value) or not ok(value):
        raise ValueError(f"{name}={value!r} must be {want}")


def penalize(logits_BxV: jax.Array, seen_BxV: jax.Array, penalty) -> jax.Array:
  """transformers' repetition penalty: a seen token's logit divided by `penalty` where positive,
  multiplied by it where negative."""
  hit = jnp.where(logits_BxV < 0, logits_BxV * penalty, logits_BxV / penalty)
  return jnp.where(seen_BxV, hit, logits_BxV)


def filter_logits(logits_BxV: jax.Array, top_k, top_p, min_p) -> jax.Array:
  """Logits with the tokens top-k, then top-p, then min-p remove set to -inf, as transformers'
  TopK-, TopP- and MinPLogitsWarper (one token always kept). top_k 0, top_p 1 and min_p 0 are off;
  each may be a traced scalar (one compiled step serves every setting)."""
  x = logits_BxV.astype(jnp.float32)
  V = x.shape[-1]
  desc_BxV = jnp.sort(x, axis=-1)[:, ::-1]
  kth_Bx1 = jnp.take(desc_BxV, jnp.clip(top_k - 1, 0, V - 1), axis=-1)[:, None]
  x = jnp.where((top_k > 0) & (x < kth_Bx1), -jnp.inf, x)
  # top-p over the ascending order, as transformers: drop while the mass so far is <= 1 - top_p
  order_BxV = jnp.argsort(x, axis=-1, stable=True)
  asc_BxV = jnp.take_along_axis(x, order_BxV, axis=-1)
  cum_BxV = jnp.cumsum(jax.nn.softmax(asc_BxV, axis=-1), axis=-1)
  drop_BxV = (cum_BxV <= 1 - top_p).at[:, -1].set(False)
  drop_BxV = jnp.zeros_like(drop_BxV).at[jnp.arange(x.shape[0])[:, None], order_BxV].set(drop_BxV)
  x = jnp.where((top_p < 1) & drop_BxV, -jnp.inf, x)
  probs_BxV = jax.nn.softmax(x, axis=-1)
  below_BxV = probs_BxV < min_p * probs_BxV.max(axis=-1, keepdims=True)
  return jnp.where((min_p > 0) & below_BxV, -jnp.inf, x)


def next_logits(logits_BxV, seen_BxV, knobs) -> jax.Array:
  """The logits a token is drawn from: penalized, tempered and filtered (`Sampling`'s order);
  `knobs` is (temperature, top_k, top_p, min_p, repetition_penalty), possibly traced."""
  temperature, top_k, top_p, min_p, penalty = knobs
  x = penalize(logits_BxV.astype(jnp.float32), seen_BxV, penalty)
  return filter_logits(x / jnp.where(temperature > 0, temperature, 1.0), top_k, top_p, min_p)


def choose(key, logits_BxV, seen_BxV, knobs) -> jax.Array:
  """The next token of each row: the argmax of the penalized logits at temperature 0, else a draw
  from softmax(`next_logits`)."""
  greedy_B = jnp.argmax(penalize(logits_BxV.astype(jnp.float32), seen_BxV, knobs[4]), axis=-1)
  drawn_B = jax.random.categorical(key, next_logits(logits_BxV, seen_BxV, knobs), axis=-1)
  return jnp.where(knobs[0] > 0, drawn_B, greedy_B).astype(jnp.int32)


def _knobs(s: Sampling):
  return (jnp.float32(s.temperature), jnp.int32(s.top_k), jnp.float32(s.top_p),
          jnp.float32(s.min_p), jnp.float32(s.repetition_penalty))


# ---------------------------------------------------------------------------------------- the cache


@flax.struct.dataclass
class KVCache:
  """Each block's keys and values at S slots, and what every slot holds: a real token's RoPE
  position (`positions`) or nothing (`valid` false). Slot t is the t-th step of every row."""
  k: tuple  # per block [B, S, K, H]
  v: tuple  # per block [B, S, K, Hv]
  positions: jax.Array  # [B, S] int32
  valid: jax.Array  # [B, S] bool
  length: jax.Array  # () int32: slots written so far


def cached_attention(q_BxTxNxH, k_BxSxKxH, v_BxSxKxV, q_pos_BxT, k_pos_BxS, k_valid_BxS, *,
                     window=None, softcap_=None, scale=None, sinks_N=None,
                     chunk=None) -> jax.Array:
  """Attention of T new queries over a cache's S slots in fp32: a query at position p sees the
  valid keys at positions p - window < position <= p; the scores scaled, soft-capped, then masked,
  and a sink's logit in each row's denominator (mtjax.attention.masked_attention, by
  positions instead of indices); with `chunk`, only keys whose position // chunk is the query's.
  [B, T, N * Hv] in q's dtype; a row that sees nothing gets zeros."""
  B, T, N, H = q_BxTxNxH.shape
  scale = 1.0 / math.sqrt(H) if scale is None else scale
  kp, qp = k_pos_BxS[:, None, :], q_pos_BxT[:, :, None]
  seen_BxTxS = k_valid_BxS[:, None, :] & (kp <= qp)
  if window is not None:
    seen_BxTxS = seen_BxTxS & (kp > qp - window)
  if chunk is not None:  # chunked local attention (Llama 4): keys of the query's own chunk only
    seen_BxTxS = seen_BxTxS & (kp // chunk == qp // chunk)
  out = attention.masked_attention(q_BxTxNxH, k_BxSxKxH, v_BxSxKxV.astype(jnp.float32),
                                   seen_BxTxS, scale=scale, softcap=softcap_, sinks_N=sinks_N)
  return out.reshape(B, T, -1)


def refuse_uncached(cfg: ModelConfig) -> None:
  """ValueError (one line) for a model whose layers have no cache here: linear attention's
  recurrent state (Qwen3-Next's gated DeltaNet) is not kept between decoded tokens; a
  vision-language model's image tower and projector are not in the decoding path."""
  if cfg.vision is not None:
    raise ValueError(f"generate: {cfg.family}'s image tower and projector are not in the decoding "
                     f"path yet (vision-language models train; generation is text-model only)")
  if cfg.layer_types is not None and "linear" in cfg.layer_types:
    raise ValueError(f"generate: {cfg.family}'s linear-attention (gated DeltaNet) layers have no "
                     f"decoding cache yet")


def inference_config(cfg: ModelConfig) -> ModelConfig:
  """The model as generation runs it: a mixture dropless (a capacity limit is a training knob,
  its drops depending on the batch; transformers routes every token), and no source directory
  (the same model from anywhere shares the compiled programs)."""
  if cfg.moe is not None and cfg.moe.capacity_factor is not None:
    cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, capacity_factor=None))
  return dataclasses.replace(cfg, from_hf=None)


def _block_step(cfg, kind, p, x_BxTxD, positions_BxT, valid_BxT, k_cache, v_cache, k_pos, k_valid,
                at, dtype):
  """One block over T new tokens written at slots [at, at + T) of its cache (`k_pos`, `k_valid`
  already mark them): the block's output and its cache."""
  spec = models.spec(cfg)
  block = spec.block(kind)
  bound = {"params": jax.tree.map(lambda a: a.astype(dtype), p)}
  tables = block.apply(bound, positions_BxT, method=lambda m, pos: m.attn.rope(pos))
  q, k, v, *gate = block.apply(bound, x_BxTxD, *tables, method=Block._qkv)
  k_cache = jax.lax.dynamic_update_slice_in_dim(k_cache, k.astype(k_cache.dtype), at, axis=1)
  v_cache = jax.lax.dynamic_update_slice_in_dim(v_cache, v.astype(v_cache.dtype), at, axis=1)
  scoring = block.apply(bound, method=lambda m: m.attn.scoring())
  chunk = cfg.attention_chunk if spec.kinds[kind].layer_type == "chunked" else None
  a = cached_attention(q, k_cache, v_cache, positions_BxT, k_pos, k_valid, **scoring, chunk=chunk)
  if gate:  # the attention's output gate (Qwen3-Next), as its sequence core applies it
    a = a * jax.nn.sigmoid(gate[0]).astype(a.dtype)
  x_BxTxD, _ = block.apply(bound, x_BxTxD, a, valid_BxT.astype(jnp.float32), method=Block._out)
  return x_BxTxD, k_cache, v_cache


def _slots(cache: KVCache, positions_BxT, valid_BxT):
  """The cache's slot positions and validity with T new tokens' written at its next slots."""
  at = cache.length
  return (jax.lax.dynamic_update_slice_in_dim(cache.positions, positions_BxT, at, axis=1),
          jax.lax.dynamic_update_slice_in_dim(cache.valid, valid_BxT, at, axis=1))


def _run_blocks(cfg, params, x_BxTxD, positions_BxT, valid_BxT, cache: KVCache, dtype):
  """Every block over T new tokens written at slots [length, length + T) of `cache`: the residual
  stream after the last block and the cache with the new keys and values."""
  spec = models.spec(cfg)
  k_pos, k_valid = _slots(cache, positions_BxT, valid_BxT)
  ks, vs = [], []
  for (_, kind), p, k_cache, v_cache in zip(spec.groups[1:-1], params["blocks"], cache.k, cache.v):
    x_BxTxD, k_cache, v_cache = _block_step(cfg, kind, p, x_BxTxD, positions_BxT, valid_BxT,
                                            k_cache, v_cache, k_pos, k_valid, cache.length, dtype)
    ks.append(k_cache)
    vs.append(v_cache)
  return x_BxTxD, KVCache(tuple(ks), tuple(vs), k_pos, k_valid, cache.length + x_BxTxD.shape[1])


def _logits(cfg, params, x_BxTxD, dtype):
  spec = models.spec(cfg)
  cast = lambda tree: jax.tree.map(lambda a: a.astype(dtype), tree)
  table = cast(params["embed"]["table"]) if cfg.tie_embeddings else None
  return spec.head().apply({"params": cast(params["head"])}, x_BxTxD, table).astype(jnp.float32)


def empty_cache(cfg: ModelConfig, batch: int, slots: int, dtype=jnp.float32) -> KVCache:
  """A cache of `slots` empty slots per row for every block."""
  _, _, Hv = models.spec(cfg).attention_widths
  if cfg.mla is not None:
    K, H = cfg.heads, cfg.mla.qk_nope_dim + cfg.mla.qk_rope_dim
  else:
    K, H = cfg.n_kv_heads, cfg.dim_per_head
  k = tuple(jnp.zeros((batch, slots, K, H), dtype) for _ in range(cfg.layers))
  v = tuple(jnp.zeros((batch, slots, K, Hv), dtype) for _ in range(cfg.layers))
  return KVCache(k, v, jnp.zeros((batch, slots), jnp.int32), jnp.zeros((batch, slots), bool),
                 jnp.zeros((), jnp.int32))


@functools.partial(jax.jit, static_argnames=("cfg", "slots", "dtype", "every_position"))
def prefill(cfg: ModelConfig, params, ids_BxP, valid_BxP, *, slots: int, dtype=jnp.float32,
            every_position: bool = False):
  """The prompts (left-padded: `valid_BxP` marks the real tokens) through the model into a fresh
  cache of `slots` slots: (logits [B, V] fp32 of each row's last token, or [B, P, V] at
  `every_position`; the cache)."""
  B, _ = ids_BxP.shape
  positions_BxP = jnp.maximum(jnp.cumsum(valid_BxP.astype(jnp.int32), axis=1) - 1, 0)
  x = models.spec(cfg).embed(dtype).apply({"params": params["embed"]}, ids_BxP)
  cache = empty_cache(cfg, B, slots, dtype)
  x, cache = _run_blocks(cfg, params, x, positions_BxP, valid_BxP, cache, dtype)
  return _logits(cfg, params, x if every_position else x[:, -1], dtype), cache


@functools.partial(jax.jit, static_argnames=("cfg", "dtype"), donate_argnames=("cache",))
def decode(cfg: ModelConfig, params, cache: KVCache, tokens_B, positions_B, *, dtype=jnp.float32):
  """One token per row at RoPE position `positions_B` into the next slot: (logits [B, V] fp32,
  the cache)."""
  x = models.spec(cfg).embed(dtype).apply({"params": params["embed"]}, tokens_B[:, None])
  valid_Bx1 = jnp.ones(tokens_B.shape + (1,), bool)
  x, cache = _run_blocks(cfg, params, x, positions_B[:, None], valid_Bx1, cache, dtype)
  return _logits(cfg, params, x[:, 0], dtype), cache


# ---- streamed layers: a model whose weights do not fit the device beside its cache -------------


@functools.partial(jax.jit, static_argnames=("cfg", "kind", "dtype"),
                   donate_argnames=("k_cache", "v_cache"))
def _one_block(cfg, kind, p, x_BxTxD, positions_BxT, valid_BxT, k_cache, v_cache, k_pos, k_valid,
               at, *, dtype):
  return _block_step(cfg, kind, p, x_BxTxD, positions_BxT, valid_BxT, k_cache, v_cache, k_pos,
                     k_valid, at, dtype)


@functools.partial(jax.jit, static_argnames=("cfg", "dtype"))
def _embed_tokens(cfg, ends, ids_BxT, *, dtype):
  return models.spec(cfg).embed(dtype).apply({"params": ends["embed"]}, ids_BxT)


@functools.partial(jax.jit, static_argnames=("cfg", "dtype"))
def _head_logits(cfg, ends, x_BxD, *, dtype):
  return _logits(cfg, ends, x_BxD, dtype)


class Streamed:
  """The blocks' weights in host memory (pinned where the backend has it), sent to the device one
  block at a time for every prefill and decoded token, as training streams them; the embedding
  and head stay on the device. Each pass over the blocks moves every block's weights once, so a
  decoded token costs (block bytes / link bandwidth) whatever the batch: large batches amortise
  it. At most two blocks' weights are on the device at once (the next one's copy overlaps the
  current one's compute)."""

  def __init__(self, cfg: ModelConfig, params: dict, dtype):
    from mtjax.store import host_memory_kind
    self.cfg, self.dtype = cfg, dtype
    device = jax.devices()[0]
    kind = host_memory_kind(device)
    host = jax.sharding.SingleDeviceSharding(device, memory_kind=kind) if kind else None
    self.on_device = jax.sharding.SingleDeviceSharding(device, memory_kind="device" if kind
                                                       else None)
    cast = lambda a: np.asarray(a).astype(dtype)
    self.blocks = [jax.tree.map(lambda a: jax.device_put(cast(a), host) if host else cast(a), b)
                   for b in params["blocks"]]
    self.ends = jax.tree.map(lambda a: jnp.asarray(cast(a)),
                             {"embed": params["embed"], "head": params["head"]})
    self.kinds = [k for _, k in models.spec(cfg).groups[1:-1]]

  def _blocks(self, x_BxTxD, positions_BxT, valid_BxT, cache: KVCache):
    k_pos, k_valid = _slots(cache, positions_BxT, valid_BxT)
    ks, vs, ahead, done = [], [], jax.device_put(self.blocks[0], self.on_device), None
    for i, (kind, k_cache, v_cache) in enumerate(zip(self.kinds, cache.k, cache.v)):
      p = ahead
      if done is not None:
        done.block_until_ready()  # block i-1 has run: its weights are free before i+1's come
      if i + 1 < len(self.blocks):
        ahead = jax.device_put(self.blocks[i + 1], self.on_device)
      x_BxTxD, k_cache, v_cache = _one_block(self.cfg, kind, p, x_BxTxD, positions_BxT,
                                             valid_BxT, k_cache, v_cache, k_pos, k_valid,
                                             cache.length, dtype=self.dtype)
      done = x_BxTxD
      ks.append(k_cache)
      vs.append(v_cache)
    return x_BxTxD, KVCache(tuple(ks), tuple(vs), k_pos, k_valid,
                            cache.length + x_BxTxD.shape[1])

  def prefill(self, ids_BxP, valid_BxP, *, slots: int):
    """As `prefill` (each row's last logits and a fresh cache)."""
    positions_BxP = jnp.maximum(jnp.cumsum(jnp.asarray(valid_BxP, jnp.int32), axis=1) - 1, 0)
    x = _embed_tokens(self.cfg, self.ends, jnp.asarray(ids_BxP), dtype=self.dtype)
    cache = empty_cache(self.cfg, ids_BxP.shape[0], slots, self.dtype)
    x, cache = self._blocks(x, positions_BxP, jnp.asarray(valid_BxP), cache)
    return _head_logits(self.cfg, self.ends, x[:, -1], dtype=self.dtype), cache

  def decode(self, cache: KVCache, tokens_B, positions_B):
    """As `decode` (one token a row into the next slot)."""
    x = _embed_tokens(self.cfg, self.ends, tokens_B[:, None], dtype=self.dtype)
    valid_Bx1 = jnp.ones(tokens_B.shape + (1,), bool)
    x, cache = self._blocks(x, positions_B[:, None], valid_Bx1, cache)
    return _head_logits(self.cfg, self.ends, x[:, 0], dtype=self.dtype), cache


def fits_device(cfg: ModelConfig, params: dict, batch: int, slots: int, dtype) -> bool:
  """Whether the weights in `dtype` and a cache of `batch` rows x `slots` fit the first device's
  free memory with a tenth to spare (True where the backend does not say: the CPU)."""
  stats = jax.devices()[0].memory_stats() or {}
  if "bytes_limit" not in stats:
    return True
  free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
  width = jnp.dtype(dtype).itemsize
  weights = sum(np.size(a) for a in jax.tree.leaves(params)) * width
  cache = jax.eval_shape(lambda: empty_cache(cfg, batch, slots, dtype))
  need = weights + sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(cache))
  return need <= 0.9 * free


@jax.jit
def _choose(key, logits_BxV, seen_BxV, knobs):
  """Each row's next token, and the tokens seen with it: one compiled program per shape, whatever
  the sampling settings (they are traced)."""
  tokens_B = choose(key, logits_BxV, seen_BxV, knobs)
  return tokens_B, seen_BxV.at[jnp.arange(tokens_B.shape[0]), tokens_B].set(True)


def bucket(n: int) -> int:
  """A length rounded up to a multiple of 8 (of 64 past 64 tokens): prompts and caches of nearby
  lengths share one compiled prefill and decode step."""
  step = 8 if n <= 64 else 64
  return -(-n // step) * step


def _longrope_switch(cfg: ModelConfig, longest: int) -> int | None:
  """The position at which a longrope model's RoPE turns from its short factors to its long ones
  (rope_tables decides per call by the longest position), when the prompts are short enough for
  the prefill to have taken the short ones; else None."""
  r = cfg.rope
  if r.scaling != "longrope" or longest > r.original_max_len:
    return None
  return r.original_max_len


def left_pad(prompts: list[list[int]], pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
  """(ids [B, P], valid [B, P]) of ragged prompts, right-aligned in `bucket(longest)` columns."""
  P = bucket(max(len(p) for p in prompts))
  ids = np.full((len(prompts), P), pad_id, np.int32)
  valid = np.zeros((len(prompts), P), bool)
  for i, p in enumerate(prompts):
    ids[i, P - len(p):] = p
    valid[i, P - len(p):] = True
  return ids, valid


def generate(cfg: ModelConfig, params: dict, prompts, *, max_new_tokens: int,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
             repetition_penalty: float = 1.0, eos_ids=(), stop=(), tokenizer=None, seed: int = 0,
             dtype=jnp.float32, stream: bool | None = None,
             stats: dict | None = None) -> list[list[int]]:
  """Completions of `prompts` by the model: the new token ids of each, ending at (and holding) the
  first of `eos_ids`, or at the token whose text completes one of the `stop` strings (`tokenizer`,
  a `tokenizers.Tokenizer`, decodes them), or after `max_new_tokens`.

  Args:
    cfg: the model config (`mtjax.load_hf`'s, or one's own).
    params: the parameter tree (`mtjax.load_hf`'s, `LayerStore.to_tree()`'s).
    prompts: token ids per prompt (ragged lists); left-padded into one batch.
    max_new_tokens: the most tokens each completion gets.
    temperature, top_k, top_p, min_p, repetition_penalty: `Sampling`'s (temperature 0: greedy).
    seed: the PRNG seed of the draws (unused when greedy).
    dtype: the weights' and activations' dtype in the layers (bfloat16 for speed).
    stream: keep the blocks' weights in host memory and send them to the device block by block
      for every pass (`Streamed`); None: stream host-held weights only where they and the cache
      do not fit the device (`fits_device`).
    stats: filled with "prompt_tokens", "new_tokens" and "seconds" (prefill and decoding,
      compiling included), and "decode_tokens" and "decode_seconds" after the second token
      (compiled by then).

  Raises:
    ValueError: an empty prompt list or prompt, a token outside the vocabulary, a bad setting.
  """
  sampling = Sampling(temperature, top_k, top_p, min_p, repetition_penalty)
  prompts = [list(map(int, p)) for p in prompts]
  if not prompts or not all(prompts):
    raise ValueError("prompts: need at least one prompt, each of at least one token")
  if any(t < 0 or t >= cfg.vocab_size for p in prompts for t in p):
    raise ValueError(f"prompts: token ids must lie in [0, {cfg.vocab_size})")
  if isinstance(max_new_tokens, bool) or int(max_new_tokens) != max_new_tokens \
      or max_new_tokens < 1:
    raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an integer >= 1")
  if stop and tokenizer is None:
    raise ValueError("stop strings need a tokenizer to decode the completions")
  refuse_uncached(cfg)
  cfg = inference_config(cfg)
  ids, valid = left_pad(prompts)
  B = len(prompts)
  slots = bucket(ids.shape[1] + max_new_tokens)
  if stream is None:
    held = any(isinstance(a, jax.Array) for a in jax.tree.leaves(params))  # on a device already
    stream = not held and not fits_device(cfg, params, B, slots, dtype)
  if stream:
    streamed = Streamed(cfg, params, dtype)
    run_prefill, run_decode = streamed.prefill, streamed.decode
  else:
    # Cast once, as mtjax.forward casts each layer's weights (the steps then cast nothing).
    params = jax.tree.map(lambda a: jnp.asarray(a).astype(dtype), params)
    run_prefill = lambda ids_BxP, valid_BxP, slots: prefill(cfg, params, ids_BxP, valid_BxP,
                                                            slots=slots, dtype=dtype)
    run_decode = lambda cache, tokens_B, positions_B: decode(cfg, params, cache, tokens_B,
                                                             positions_B, dtype=dtype)
  # The one place keys are made: one per decoded token, each row's draw from it independent.
  keys = jax.random.split(jax.random.key(seed), max_new_tokens)
  knobs = _knobs(sampling)
  seen = np.zeros((B, cfg.vocab_size), bool)
  for i, p in enumerate(prompts):
    seen[i, p] = True
  seen = jnp.asarray(seen)
  start = time.perf_counter()
  logits, cache = run_prefill(jnp.asarray(ids), jnp.asarray(valid), slots=slots)
  positions = jnp.asarray(valid.sum(1), jnp.int32)
  out: list[list[int]] = [[] for _ in prompts]
  done = np.zeros(B, bool)
  eos = set(int(e) for e in eos_ids)
  first = None  # when the first decoded token's successor was chosen: compiling done
  longest = int(valid.sum(1).max())
  switch_at = _longrope_switch(cfg, longest)
  chosen = []
  for t in range(max_new_tokens):
    tokens, seen = _choose(keys[t], logits, seen, knobs)
    chosen.append(tokens)
    if t + 1 < max_new_tokens and longest + t == switch_at:
      # The batch's longest row passes the pre-training length: every key rotates anew by the
      # long factors (transformers' Phi-3 recomputes its cache there too).
      history = np.concatenate([ids, np.stack([np.asarray(c) for c in chosen], 1)], axis=1)
      seen_all = np.concatenate([valid, np.ones((B, t + 1), bool)], axis=1)
      logits, cache = run_prefill(jnp.asarray(history), jnp.asarray(seen_all),
                                  slots=cache.valid.shape[1])
    elif t + 1 < max_new_tokens:  # the last token's successor is never asked for
      logits, cache = run_decode(cache, tokens, positions + t)
    for i, tok in enumerate(np.asarray(tokens).tolist()):  # waits for the step before
      if done[i]:
        continue
      out[i].append(tok)
      if tok in eos or (stop and any(s in tokenizer.decode(out[i]) for s in stop)):
        done[i] = True
    if t == 1:
      first = (time.perf_counter(), sum(map(len, out)))
    if done.all():
      break
  if stats is not None:
    end, new = time.perf_counter(), sum(map(len, out))
    stats.update(prompt_tokens=int(valid.sum()), new_tokens=new, seconds=end - start,
                 decode_tokens=0 if first is None else new - first[1],
                 decode_seconds=0.0 if first is None else end - first[0])
  return out


# ---------------------------------------------------------------------------------------- the CLI


class _Usage(ValueError):
  """A command line argparse refuses."""


class _Parser(argparse.ArgumentParser):
  def error(self, message):  # a usage error is bad input: one line, exit 2 (main prints it)
    raise _Usage(message)


def parser() -> argparse.ArgumentParser:
  p = _Parser(prog="python -m mtjax.generate", description=__doc__.split("\n\n")[0],
              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
  p.add_argument("--model", required=True,
                 help="a Hugging Face model directory (an mtjax export included) with tokenizer.json")
  p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
  p.add_argument("--prompts", help="a file of prompts: one per line, or JSONL with a 'prompt' field")
  p.add_argument("--max-new-tokens", type=int, default=64, help="the most new tokens per prompt")
  d = "default: generation_config.json's, else off"
  p.add_argument("--temperature", type=float, help=f"0 is greedy ({d} (greedy))")
  p.add_argument("--top-k", type=int, help=f"keep the k likeliest tokens ({d})")
  p.add_argument("--top-p", type=float, help=f"nucleus mass in (0, 1] ({d})")
  p.add_argument("--min-p", type=float, help=f"drop tokens below min_p x the top one's ({d})")
  p.add_argument("--repetition-penalty", type=float, help=f"> 0 ({d})")
  p.add_argument("--seed", type=int, default=0, help="the PRNG seed of the draws")
  p.add_argument("--batch", type=int, default=8, help="prompts generated together")
  p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                 help="the layers' weights and activations")
  chat = p.add_mutually_exclusive_group()
  chat.add_argument("--chat", dest="chat", action="store_true", default=None,
                    help="each prompt as a user message in the tokenizer's chat template "
                         "(default: when tokenizer_config.json has one)")
  chat.add_argument("--no-chat", dest="chat", action="store_false", help="prompts as plain text")
  return p


def read_prompts(args) -> list[str]:
  """--prompt's and --prompts' file's prompts, in order; ValueError names what is wrong."""
  prompts = list(args.prompt)
  if args.prompts:
    path = Path(args.prompts)
    if not path.is_file():
      raise ValueError(f"--prompts: {path} does not exist")
    lines = [ln for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
    jsonl = bool(lines) and lines[0].lstrip().startswith("{")
    for n, line in enumerate(lines, 1):
      if not jsonl:
        prompts.append(line)
        continue
      try:
        row = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f"--prompts: {path} line {n}: not JSON ({e.msg})") from None
      if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
        raise ValueError(f"--prompts: {path} line {n}: no string 'prompt' field")
      prompts.append(row["prompt"])
  if not prompts:
    raise ValueError("no prompts: give --prompt TEXT or --prompts FILE")
  if not all(p.strip() for p in prompts):
    raise ValueError("a prompt is empty")
  return prompts


def generation_defaults(model: Path) -> dict:
  """Sampling defaults and EOS ids from generation_config.json (else config.json's eos)."""
  out = {}
  gen = model / "generation_config.json"
  raw = {}
  for f in (model / "config.json", gen):
    if f.is_file():
      try:
        raw.update({k: v for k, v in json.loads(f.read_text()).items() if v is not None})
      except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{f}: not a readable JSON file ({e})") from None
  eos = raw.get("eos_token_id")
  out["eos_ids"] = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
  if gen.is_file() and raw.get("do_sample"):
    out["temperature"] = raw.get("temperature", 1.0)
    for k in ("top_k", "top_p", "min_p"):
      if k in raw:
        out[k] = raw[k]
  if gen.is_file() and "repetition_penalty" in raw:
    out["repetition_penalty"] = raw["repetition_penalty"]
  return out


def load_model(path: str | Path) -> tuple[ModelConfig, dict, Path]:
  """(config, fp32 parameter tree, the directory of its tokenizer and generation files) of a
  Hugging Face directory (an export), a training checkpoint's step folder, or a checkpoint
  directory (its newest step). A checkpoint's files are its copy of its Hugging Face source's."""
  from mtjax import api, checkpoint, export, hf

  path = Path(path)
  # A run's checkpoint directory holds a config.json of its own: steps are looked for first.
  step = path if (path / "meta.json").is_file() else checkpoint.latest(path)
  if step is None and (path / "config.json").is_file():
    try:
      cfg, params = api.load_hf(path)
    except hf.HFError as e:
      raise ValueError(str(e)) from None
    return cfg, params, path
  if step is None:
    raise ValueError(f"--model: {path} is neither a Hugging Face model directory (config.json) "
                     "nor a training checkpoint (meta.json)")
  meta, run_cfg, names = export.recorded(step.absolute())
  source = export.source_of(step, run_cfg.model.from_hf)
  if source is None:
    raise ValueError(f"--model: checkpoint {step} has no Hugging Face source (trained from "
                     "mtjax's init): no tokenizer to read")
  spec = models.spec(run_cfg.model)
  groups = dict(export.checkpoint_groups(step, names, meta.get(checkpoint.CHECKSUM)))
  trees = [spec.group_layout(g).unflatten(groups[g]) for g, _ in spec.groups]
  return run_cfg.model, {"embed": trees[0], "blocks": trees[1:-1], "head": trees[-1]}, source


def main(argv: list[str] | None = None) -> int:
  try:
    return _main(parser().parse_args(argv))
  except (ValueError, OSError, KeyError) as e:
    return exits.fail("error", e, exits.of_os_error(e) if isinstance(e, OSError)
                      else exits.BAD_INPUT)


def _main(args) -> int:
  from tokenizers import Tokenizer

  from mtjax.data import chat

  if not Path(args.model).exists():
    raise ValueError(f"--model: {args.model} does not exist")
  if args.max_new_tokens < 1 or args.batch < 1:
    raise ValueError("--max-new-tokens and --batch must be >= 1")
  cfg, params, model = load_model(args.model)
  if not (model / "tokenizer.json").is_file():
    raise ValueError(f"--model: {model} has no tokenizer.json")
  defaults = generation_defaults(model)
  given = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
               min_p=args.min_p, repetition_penalty=args.repetition_penalty)
  settings = {k: v if v is not None else defaults.get(k, getattr(Sampling, k))
              for k, v in given.items()}
  try:
    Sampling(**settings)
  except ValueError as e:
    raise ValueError(f"--{str(e).replace('_', '-')}") from None
  prompts = read_prompts(args)
  tok = Tokenizer.from_file(str(model / "tokenizer.json"))
  use_chat = args.chat
  if use_chat is None:
    use_chat = bool(chat.load_tokenizer_config(model).get("chat_template")) \
        or (model / "chat_template.jinja").is_file()
  template = chat.ChatTemplate.from_tokenizer(model) if use_chat else None
  if template is None:
    ids = [tok.encode(p).ids for p in prompts]
  else:
    ids = [tok.encode(template.render([{"role": "user", "content": p}], True),
                      add_special_tokens=False).ids for p in prompts]
  dtype = jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32
  total = {"new_tokens": 0, "seconds": 0.0, "decode_tokens": 0, "decode_seconds": 0.0}
  for at in range(0, len(prompts), args.batch):
    stats = {}
    outs = generate(cfg, params, ids[at:at + args.batch], max_new_tokens=args.max_new_tokens,
                    eos_ids=defaults["eos_ids"], seed=args.seed + at, dtype=dtype, stats=stats,
                    **settings)
    total = {k: v + stats[k] for k, v in total.items()}
    for i, out in enumerate(outs):
      print(f"### {at + i + 1}: {prompts[at + i]}")
      print(tok.decode(out, skip_special_tokens=True), flush=True)
  rate = lambda n, s: f"{n / s:.1f}" if s > 0 else "n/a"
  print(f"generated {total['new_tokens']} tokens for {len(prompts)} prompts in "
        f"{total['seconds']:.2f} s, compiling included ({rate(total['new_tokens'], total['seconds'])}"
        f" tokens/s); decoding after compilation: {rate(total['decode_tokens'], total['decode_seconds'])} "
        f"tokens/s")
  return exits.OK


class _Callable(types.ModuleType):
  """`mtjax.generate(...)` is this module's `generate`: the package attribute of that name is the
  module (`python -m mtjax.generate` runs it), so the module calls through."""

  def __call__(self, *args, **kwargs):
    return generate(*args, **kwargs)


sys.modules[__name__].__class__ = _Callable

if __name__ == "__main__":
  sys.exit(main())
