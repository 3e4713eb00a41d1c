"""Blockwise (flash-style) attention in plain JAX: memory O(T x block), never a [T, S] score matrix.

The fallback beside cuDNN's fused kernel: CPU, fp32, any head size and document (segment) masks.
The forward keeps a running max and sum per query row in fp32 (online softmax) and saves only the
output and each row's logsumexp; the backward recomputes one block of scores at a time.

Beside it, `dense_attention` computes the same semantics with a materialised [B, N, T, S] score
matrix and XLA's autodiff, for short sequences where one fused matmul beats a loop of blocks.

Both take the variants that model families use: a causal sliding window (Mistral, Gemma 2/3,
GPT-OSS), logit soft-capping (Gemma 2), attention sinks (GPT-OSS), a value head width other than
the query/key width (DeepSeek's multi-head latent attention) and groups of positions that see each
other whatever their order inside a causal model (Gemma 3's image tokens).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

# Finite stand-in for -inf: a row whose every key so far is masked keeps max == _NEG, and
# _NEG - _NEG == 0 where -inf - -inf would be NaN. Masked probabilities are zeroed explicitly.
_NEG = float(jnp.finfo(jnp.float32).min)


def blockwise_attention(q_BxTxNxH: jax.Array, k_BxSxKxH: jax.Array, v_BxSxKxHv: jax.Array, *,
                        segments_q_BxT: jax.Array | None = None,
                        segments_k_BxS: jax.Array | None = None, causal: bool = True,
                        q_block: int = 512, kv_block: int = 512,
                        scale: float | None = None, window: int | None = None,
                        softcap: float | None = None,
                        sinks_N: jax.Array | None = None,
                        groups_BxT: jax.Array | None = None) -> jax.Array:
  """Scaled dot-product attention computed block by block, as `jax.nn.dot_product_attention`.

  Args:
    q_BxTxNxH: queries; N must be a multiple of K (grouped-query attention: query head n reads
      key/value head n // (N / K), as `jax.nn.dot_product_attention` groups them).
    k_BxSxKxH: keys.
    v_BxSxKxHv: values; their width Hv may differ from H (multi-head latent attention).
    segments_q_BxT: integer document ids per query; a query attends only to keys of its own id.
    segments_k_BxS: integer document ids per key; either one alone is used for both (needs T == S).
    causal: query i sees key j only where j <= i (top-left aligned, as `is_causal=True`).
    q_block: query rows per block (clipped to T); T need not be a multiple.
    kv_block: keys per block (clipped to S); S need not be a multiple.
    scale: multiplies the scores; default 1 / sqrt(H).
    window: sliding window (needs causal): query i sees key j only where i - window < j <= i, the
      last `window` positions including its own, as Hugging Face's `sliding_window`. Key blocks
      wholly outside every window of a query block are skipped, so the cost follows the window.
    softcap: soft-caps the scaled scores to softcap * tanh(scores / softcap) before the mask and
      softmax (Gemma 2's attention logit soft-capping).
    sinks_N: one logit per query head (attention sinks, as GPT-OSS): an extra softmax column that
      has no value, so each row's probabilities sum to less than one. Neither scaled nor capped;
      differentiable.
    groups_BxT: with causal, integer group ids per position (needs T == S), numbered from 0 along
      each row, -1 for none: a query also sees the later keys of its own group (Gemma 3's image
      tokens, bidirectional among themselves); the window and documents still apply, as
      transformers composes them (window AND (causal OR same group)). Beside the causal key
      blocks, a query block visits those its rows' groups reach, and no others.

  Returns:
    [B, T, N, Hv] in q's dtype. A query row that sees no key at all gets zeros.
  """
  seg_q, seg_k, cfg = _settings(q_BxTxNxH, k_BxSxKxH, v_BxSxKxHv, segments_q_BxT, segments_k_BxS,
                                causal, scale, window, softcap, sinks_N, groups_BxT)
  if q_block < 1 or kv_block < 1:
    raise ValueError(f"block sizes must be positive, got {q_block}, {kv_block}")
  T, S = q_BxTxNxH.shape[1], k_BxSxKxH.shape[1]
  cfg = cfg._replace(bq=min(q_block, T), bk=min(kv_block, S))
  groups = groups_BxT if cfg.causal else None  # without causal every key is seen already
  return _attention(q_BxTxNxH, k_BxSxKxH, v_BxSxKxHv, seg_q, seg_k, groups, sinks_N, cfg)


def dense_attention(q_BxTxNxH: jax.Array, k_BxSxKxH: jax.Array, v_BxSxKxHv: jax.Array, *,
                    segments_q_BxT: jax.Array | None = None,
                    segments_k_BxS: jax.Array | None = None, causal: bool = True,
                    scale: float | None = None, window: int | None = None,
                    softcap: float | None = None, sinks_N: jax.Array | None = None,
                    groups_BxT: jax.Array | None = None) -> jax.Array:
  """`blockwise_attention`'s semantics with materialised [B, N, T, S] fp32 scores.

  Plain jax.numpy, differentiated by XLA's autodiff: for short sequences and the CPU, where the
  whole score matrix fits and one matmul beats a loop of blocks. Query heads are grouped beside
  their key/value head (k and v are never repeated per query head); the softmax runs in fp32.

  Args:
    q_BxTxNxH: queries; N a multiple of K.
    k_BxSxKxH: keys.
    v_BxSxKxHv: values; Hv may differ from H.
    segments_q_BxT: integer document ids per query; a query attends only to keys of its own id.
    segments_k_BxS: integer document ids per key; either one alone is used for both (needs T == S).
    causal: query i sees key j only where j <= i (top-left aligned).
    scale: multiplies the scores; default 1 / sqrt(H).
    window: sliding window (needs causal): query i sees key j only where i - window < j <= i.
    softcap: soft-caps the scaled scores to softcap * tanh(scores / softcap).
    sinks_N: one logit per query head that joins each row's softmax denominator, with no value.
    groups_BxT: with causal, group ids per position (needs T == S), -1 for none: a query also
      sees the later keys of its own group.

  Returns:
    [B, T, N, Hv] in q's dtype. A query row that sees no key at all gets zeros.
  """
  seg_q_BxT, seg_k_BxS, cfg = _settings(q_BxTxNxH, k_BxSxKxH, v_BxSxKxHv, segments_q_BxT,
                                        segments_k_BxS, causal, scale, window, softcap, sinks_N,
                                        groups_BxT)
  T, S = q_BxTxNxH.shape[1], k_BxSxKxH.shape[1]
  visible = _position_mask(jnp.arange(T), jnp.arange(S), cfg, groups_BxT, groups_BxT)
  if seg_q_BxT is not None:
    same_BxTxS = seg_q_BxT[:, :, None] == seg_k_BxS[:, None, :]
    visible = same_BxTxS if visible is None else visible & same_BxTxS
  return masked_attention(q_BxTxNxH, k_BxSxKxH, v_BxSxKxHv, visible, scale=cfg.scale,
                          softcap=cfg.softcap, sinks_N=sinks_N)


def masked_attention(q_BxTxNxH, k_BxSxKxH, v_BxSxKxHv, visible_BxTxS, *, scale: float,
                     softcap: float | None = None, sinks_N=None) -> jax.Array:
  """Softmax attention in fp32 where `visible_BxTxS` (None: everywhere; a leading 1 broadcasts)
  lets a query see a key: scores scaled, then soft-capped, then masked, a sink's logit in each
  row's denominator. The one softmax of `dense_attention` and of a KV cache's attention
  (mtjax.generate). [B, T, N, Hv] in q's dtype; a row that sees nothing gets zeros."""
  B, T, N, H = q_BxTxNxH.shape
  S, K, Hv = v_BxSxKxHv.shape[1:]
  G = N // K
  s_BxKxGxTxS = jnp.einsum("btkgh,bskh->bkgts", q_BxTxNxH.reshape(B, T, K, G, H), k_BxSxKxH,
                           preferred_element_type=jnp.float32) * scale
  if softcap is not None:
    s_BxKxGxTxS = softcap * jnp.tanh(s_BxKxGxTxS / softcap)
  visible = None if visible_BxTxS is None else visible_BxTxS[:, None, None]
  if visible is not None:
    s_BxKxGxTxS = jnp.where(visible, s_BxKxGxTxS, _NEG)
  # The max only shifts the exponent (the softmax does not depend on it): no gradient through it.
  m_BxKxGxT = s_BxKxGxTxS.max(axis=-1)
  if sinks_N is not None:
    sink_1xKxGx1 = sinks_N.astype(jnp.float32).reshape(1, K, G, 1)
    m_BxKxGxT = jnp.maximum(m_BxKxGxT, sink_1xKxGx1)
  m_BxKxGxT = lax.stop_gradient(m_BxKxGxT)
  e_BxKxGxTxS = jnp.exp(s_BxKxGxTxS - m_BxKxGxT[..., None])
  if visible is not None:
    e_BxKxGxTxS = jnp.where(visible, e_BxKxGxTxS, 0.0)
  l_BxKxGxT = e_BxKxGxTxS.sum(axis=-1)
  if sinks_N is not None:
    l_BxKxGxT = l_BxKxGxT + jnp.exp(sink_1xKxGx1 - m_BxKxGxT)
  # A row with no visible key and no sink sums to 0: its probabilities stay 0, its output zeros.
  p_BxKxGxTxS = e_BxKxGxTxS / jnp.where(l_BxKxGxT > 0, l_BxKxGxT, 1.0)[..., None]
  out_BxTxKxGxHv = jnp.einsum("bkgts,bskh->btkgh", p_BxKxGxTxS.astype(v_BxSxKxHv.dtype),
                              v_BxSxKxHv, preferred_element_type=jnp.float32)
  return out_BxTxKxGxHv.reshape(B, T, N, Hv).astype(q_BxTxNxH.dtype)


def chunk_segments(positions_BxT: jax.Array, chunk: int,
                   segments_BxT: jax.Array | None = None) -> jax.Array:
  """Ids under which attention keeps to chunks of `chunk` positions (position // chunk) within
  each document: chunked local attention (Llama 4) as document masking, which every kernel
  takes."""
  chunk_BxT = positions_BxT.astype(jnp.int32) // chunk
  if segments_BxT is None:
    return chunk_BxT
  return segments_BxT.astype(jnp.int32) * (jnp.max(chunk_BxT) + 1) + chunk_BxT


class _Cfg(NamedTuple):
  """Static settings: hashable, so they ride along as the custom_vjp's nondiff argument."""
  causal: bool
  bq: int  # query rows per block
  bk: int  # keys per block
  scale: float
  window: int | None = None
  softcap: float | None = None


def _settings(q_BxTxNxH, k_BxSxKxH, v_BxSxKxHv, seg_q_BxT, seg_k_BxS, causal, scale, window,
              softcap, sinks_N, groups_BxT=None):
  """Checks the arguments both entry points share: (segments q, segments k, _Cfg without blocks)."""
  B, T, N, H = q_BxTxNxH.shape
  Bk, S, K, Hk = k_BxSxKxH.shape
  if (Bk, Hk) != (B, H) or v_BxSxKxHv.ndim != 4 or v_BxSxKxHv.shape[:3] != (B, S, K):
    raise ValueError(f"shapes q {q_BxTxNxH.shape}, k {k_BxSxKxH.shape}, v {v_BxSxKxHv.shape} "
                     "do not fit [B, T, N, H], [B, S, K, H], [B, S, K, Hv]")
  if N % K:
    raise ValueError(f"query heads {N} are not a multiple of key/value heads {K}")
  if seg_q_BxT is None and seg_k_BxS is not None:
    seg_q_BxT = seg_k_BxS
  if seg_k_BxS is None and seg_q_BxT is not None:
    seg_k_BxS = seg_q_BxT
  if seg_q_BxT is not None:
    if seg_q_BxT.shape != (B, T) or seg_k_BxS.shape != (B, S):
      raise ValueError(f"segment ids {seg_q_BxT.shape}, {seg_k_BxS.shape} do not fit "
                       f"[B, T] = {(B, T)} and [B, S] = {(B, S)}")
  if window is not None:
    if not causal:
      raise ValueError("a sliding window needs causal=True (it counts back from each query)")
    if int(window) != window or window < 1:
      raise ValueError(f"window must be a positive integer, got {window}")
    window = int(window)
  if softcap is not None:
    if not softcap > 0:
      raise ValueError(f"softcap must be positive, got {softcap}")
    softcap = float(softcap)
  if groups_BxT is not None and (groups_BxT.shape != (B, T) or T != S):
    raise ValueError(f"group ids {groups_BxT.shape} do not fit [B, T] = {(B, T)} of a "
                     f"self-attention (T == S, got S = {S})")
  if sinks_N is not None and tuple(sinks_N.shape) != (N,):
    raise ValueError(f"sinks {tuple(sinks_N.shape)} do not fit [N] = {(N,)}")
  scale = 1.0 / math.sqrt(H) if scale is None else float(scale)
  return seg_q_BxT, seg_k_BxS, _Cfg(bool(causal), 0, 0, scale, window, softcap)


def _position_mask(q_pos_t, k_pos_s, cfg, groups_q_Bxt=None, groups_k_Bxs=None):
  """[1, t, s] bool (with groups [B, t, s]): which keys each query sees by position and group,
  (causal OR same group) AND window; None for all."""
  if not cfg.causal:
    return None
  visible = (k_pos_s[None, :] <= q_pos_t[:, None])[None]
  if groups_q_Bxt is not None:
    same_Bxtxs = ((groups_q_Bxt[:, :, None] == groups_k_Bxs[:, None, :])
                  & (groups_q_Bxt[:, :, None] >= 0))
    visible = visible | same_Bxtxs
  if cfg.window is not None:
    visible = visible & (k_pos_s[None, :] > q_pos_t[:, None] - cfg.window)[None]
  return visible


def _group_extents(groups_BxT):
  """(first, last) [B, T] int32: the first and last position of each position's group (ids
  below T), a position of none (-1) its own."""
  B, T = groups_BxT.shape
  pos_T = jnp.arange(T, dtype=jnp.int32)
  inside_BxT = groups_BxT >= 0
  ids_BxT = jnp.where(inside_BxT, groups_BxT, T).astype(jnp.int32)  # none: a bucket never read
  extent = lambda op: jax.vmap(lambda ids: op(pos_T, ids, num_segments=T + 1))(ids_BxT)
  own = jnp.broadcast_to(pos_T[None], (B, T))
  first_BxT = jnp.where(inside_BxT, jnp.take_along_axis(extent(jax.ops.segment_min), ids_BxT, 1),
                        own)
  last_BxT = jnp.where(inside_BxT, jnp.take_along_axis(extent(jax.ops.segment_max), ids_BxT, 1),
                       own)
  return first_BxT, last_BxT


def _ceil_div(a, b):
  return -(-a // b)


def _pad_axis(x, axis, size):
  """Zero-pads `axis` up to `size` (a no-op when it already fits)."""
  if x.shape[axis] == size:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, widths)


def _kv_block_range(i, cfg, nk, reach=None):
  """[first, end) of the key blocks that query block i visits: causal stops at its last row (or
  at `reach`, the last key a group lets one of its rows see, if later), a window starts at the
  first key its first row sees. Works on Python ints and traced ones."""
  first, end = 0, nk
  if cfg.causal:
    last = (i + 1) * cfg.bq if reach is None else jnp.maximum((i + 1) * cfg.bq, reach + 1)
    end = jnp.minimum(nk, _ceil_div(last, cfg.bk))
  if cfg.window is not None:
    # Floor division: a negative start (the window reaches before the row) clamps to block 0.
    first = jnp.maximum(0, (i * cfg.bq - cfg.window + 1) // cfg.bk)
  return first, end


def _q_block_range(j, cfg, nq, back=None):
  """[first, end) of the query blocks that see any key of block j: causal starts at its first key
  (or at `back`, the first query a group lets see one of its keys, if earlier), a window ends at
  the last query whose window still reaches its last key."""
  first, end = 0, nq
  if cfg.causal:
    first = (j * cfg.bk if back is None else jnp.minimum(j * cfg.bk, back)) // cfg.bq
  if cfg.window is not None:
    end = jnp.minimum(nq, ((j + 1) * cfg.bk + cfg.window - 2) // cfg.bq + 1)
  return first, end


class _Layout:
  """The inputs padded to whole blocks, heads moved ahead of time so each block is one dot."""

  def __init__(self, q_BxTxNxH, k_BxSxKxH, v_BxSxKxHv, seg_q_BxT, seg_k_BxS, groups_BxT, sinks_N,
               cfg):
    B, T, N, H = q_BxTxNxH.shape
    S, K, Hv = v_BxSxKxHv.shape[1:]
    self.B, self.T, self.N, self.H, self.S, self.K, self.G = B, T, N, H, S, K, N // K
    self.Hv = Hv
    self.nq, self.nk = _ceil_div(T, cfg.bq), _ceil_div(S, cfg.bk)
    self.Tp, self.Sp = self.nq * cfg.bq, self.nk * cfg.bk
    self.cfg = cfg
    self.q_BxKxGxTpxH = self.heads_first(q_BxTxNxH)
    # One transpose of k and v up front (O(S) bytes) rather than one per block visit.
    self.k_BxKxSpxH = _pad_axis(k_BxSxKxH, 1, self.Sp).transpose(0, 2, 1, 3)
    self.v_BxKxSpxHv = _pad_axis(v_BxSxKxHv, 1, self.Sp).transpose(0, 2, 1, 3)
    # Query head n = k * G + g, as heads_first splits N.
    self.sink_KxG = None if sinks_N is None else sinks_N.astype(jnp.float32).reshape(K, self.G)
    self.seg_q_BxTp = self.seg_k_BxSp = None
    if seg_q_BxT is not None:
      # Edge padding keeps each block's id range as tight as its real rows (padded keys are
      # masked by position anyway; padded query rows are dropped).
      pad = lambda x, n: jnp.pad(x, ((0, 0), (0, n - x.shape[1])), mode="edge")
      self.seg_q_BxTp, self.seg_k_BxSp = pad(seg_q_BxT, self.Tp), pad(seg_k_BxS, self.Sp)
      q_Bxnqxbq = self.seg_q_BxTp.reshape(B, self.nq, cfg.bq)
      k_Bxnkxbk = self.seg_k_BxSp.reshape(B, self.nk, cfg.bk)
      self.q_lo_Bxnq, self.q_hi_Bxnq = q_Bxnqxbq.min(axis=2), q_Bxnqxbq.max(axis=2)
      self.k_lo_Bxnk, self.k_hi_Bxnk = k_Bxnkxbk.min(axis=2), k_Bxnkxbk.max(axis=2)
    self.grp_q_BxTp = self.grp_k_BxSp = self.reach_nq = self.back_nk = None
    if groups_BxT is not None:
      pad = lambda x, n, value: jnp.pad(x, ((0, 0), (0, n - x.shape[1])), constant_values=value)
      # query and key blocks differ in size: each side padded to its own whole blocks
      self.grp_q_BxTp, self.grp_k_BxSp = pad(groups_BxT, self.Tp, -1), pad(groups_BxT, self.Sp, -1)
      first_BxT, last_BxT = _group_extents(groups_BxT)
      # Per block, the furthest a group reaches: the last key any of a query block's rows sees,
      # the first query that sees any of a key block's keys (padding reaches nothing).
      last_BxTp, first_BxSp = pad(last_BxT, self.Tp, -1), pad(first_BxT, self.Sp, self.Sp)
      self.reach_nq = last_BxTp.reshape(B, self.nq, cfg.bq).max(axis=(0, 2))
      self.back_nk = first_BxSp.reshape(B, self.nk, cfg.bk).min(axis=(0, 2))

  def kv_range(self, i):
    """[first, end) of the key blocks query block i visits."""
    return _kv_block_range(i, self.cfg, self.nk, None if self.reach_nq is None else self.reach_nq[i])

  def q_range(self, j):
    """[first, end) of the query blocks that see any key of block j."""
    return _q_block_range(j, self.cfg, self.nq, None if self.back_nk is None else self.back_nk[j])

  def heads_first(self, x_BxTxNxW):
    """[B, T, N, W] -> [B, K, G, Tp, W]: the group axis sits beside K, so k/v are never repeated."""
    W = x_BxTxNxW.shape[-1]
    x = _pad_axis(x_BxTxNxW, 1, self.Tp).reshape(self.B, self.Tp, self.K, self.G, W)
    return x.transpose(0, 2, 3, 1, 4)

  def heads_last(self, x_BxKxGxTpxW):
    """[B, K, G, Tp, W] -> [B, T, N, W]."""
    W = x_BxKxGxTpxW.shape[-1]
    x = x_BxKxGxTpxW.transpose(0, 3, 1, 2, 4).reshape(self.B, self.Tp, self.N, W)
    return x[:, :self.T]

  def q_slice(self, x, i, axis=3):
    return lax.dynamic_slice_in_dim(x, i * self.cfg.bq, self.cfg.bq, axis=axis)

  def k_slice(self, x, j, axis=2):
    return lax.dynamic_slice_in_dim(x, j * self.cfg.bk, self.cfg.bk, axis=axis)

  def if_segments_meet(self, i, j, compute, skip, *operands):
    """compute(*operands) if query block i and key block j can share a document id, else skip.

    Disjoint id ranges mean no query of the block sees any key of the other; with packed
    documents (ids nondecreasing along the row) this skips all but the blocks near the diagonal
    that a document spans, so the cost follows the documents' lengths, not T.
    """
    if self.seg_q_BxTp is None:
      return compute(*operands)
    meet = jnp.any((self.q_lo_Bxnq[:, i] <= self.k_hi_Bxnk[:, j])
                   & (self.k_lo_Bxnk[:, j] <= self.q_hi_Bxnq[:, i]))
    return lax.cond(meet, compute, skip, *operands)

  def scores(self, q_BxKxGxbqxH, i, j):
    """Query block i against key block j: fp32 scores (scaled, capped, masked to _NEG), where
    they are visible, and the cap's tanh (None without a cap) for the backward's chain rule."""
    cfg = self.cfg
    k_BxKxbkxH = self.k_slice(self.k_BxKxSpxH, j)
    s_BxKxGxbqxbk = jnp.einsum("bkgqh,bksh->bkgqs", q_BxKxGxbqxH, k_BxKxbkxH,
                               preferred_element_type=jnp.float32) * cfg.scale
    tanh_BxKxGxbqxbk = None
    if cfg.softcap is not None:
      tanh_BxKxGxbqxbk = jnp.tanh(s_BxKxGxbqxbk / cfg.softcap)
      s_BxKxGxbqxbk = cfg.softcap * tanh_BxKxGxbqxbk
    q_pos_bq = i * cfg.bq + jnp.arange(cfg.bq)
    k_pos_bk = j * cfg.bk + jnp.arange(cfg.bk)
    visible = jnp.broadcast_to(k_pos_bk[None, :] < self.S, (cfg.bq, cfg.bk))[None]  # padding
    groups = (None, None) if self.grp_q_BxTp is None else (
        self.q_slice(self.grp_q_BxTp, i, axis=1), self.k_slice(self.grp_k_BxSp, j, axis=1))
    by_position = _position_mask(q_pos_bq, k_pos_bk, cfg, *groups)  # [1 or B, bq, bk]
    if by_position is not None:
      visible = visible & by_position
    visible = visible[:, None, None]
    if self.seg_q_BxTp is not None:
      seg_q_Bxbq = self.q_slice(self.seg_q_BxTp, i, axis=1)
      seg_k_Bxbk = self.k_slice(self.seg_k_BxSp, j, axis=1)
      same_Bxbqxbk = seg_q_Bxbq[:, :, None] == seg_k_Bxbk[:, None, :]
      visible = visible & same_Bxbqxbk[:, None, None]
    return jnp.where(visible, s_BxKxGxbqxbk, _NEG), visible, tanh_BxKxGxbqxbk


def _forward(q_BxTxNxH, k_BxSxKxH, v_BxSxKxHv, seg_q_BxT, seg_k_BxS, groups_BxT, sinks_N, cfg):
  """Output [B, T, N, Hv] and the fp32 logsumexp of every (padded) query row, [B, K, G, Tp]."""
  lay = _Layout(q_BxTxNxH, k_BxSxKxH, v_BxSxKxHv, seg_q_BxT, seg_k_BxS, groups_BxT, sinks_N, cfg)
  B, K, G, Hv, bq = lay.B, lay.K, lay.G, lay.Hv, cfg.bq

  def q_block(i):
    q_BxKxGxbqxH = lay.q_slice(lay.q_BxKxGxTpxH, i)

    def kv_step(j, carry):
      return lay.if_segments_meet(i, j, functools.partial(kv_update, j), lambda c: c, carry)

    def kv_update(j, carry):
      m_BxKxGxbq, l_BxKxGxbq, acc_BxKxGxbqxHv = carry
      s, visible, _ = lay.scores(q_BxKxGxbqxH, i, j)
      m_new = jnp.maximum(m_BxKxGxbq, s.max(axis=-1))
      p = jnp.where(visible, jnp.exp(s - m_new[..., None]), 0.0)
      correction = jnp.exp(m_BxKxGxbq - m_new)
      l_new = l_BxKxGxbq * correction + p.sum(axis=-1)
      v_BxKxbkxHv = lay.k_slice(lay.v_BxKxSpxHv, j)
      # Probabilities in v's dtype so bf16 inputs get a bf16 matmul, accumulated in fp32.
      pv = jnp.einsum("bkgqs,bksh->bkgqh", p.astype(v_BxKxbkxHv.dtype), v_BxKxbkxHv,
                      preferred_element_type=jnp.float32)
      return m_new, l_new, acc_BxKxGxbqxHv * correction[..., None] + pv

    if lay.sink_KxG is None:
      m0 = jnp.full((B, K, G, bq), _NEG, jnp.float32)
      l0 = jnp.zeros((B, K, G, bq), jnp.float32)
    else:
      # The sink is the row's first column, valueless: max starts at it, the sum at exp(0) = 1.
      m0 = jnp.broadcast_to(lay.sink_KxG[None, :, :, None], (B, K, G, bq))
      l0 = jnp.ones((B, K, G, bq), jnp.float32)
    init = (m0, l0, jnp.zeros((B, K, G, bq, Hv), jnp.float32))
    m, l, acc = lax.fori_loop(*lay.kv_range(i), kv_step, init)
    seen = l > 0  # a row with no visible key (and no sink) gets zeros and a logsumexp never read
    out_BxKxGxbqxHv = acc / jnp.where(seen, l, 1.0)[..., None]
    lse_BxKxGxbq = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), 0.0)
    return out_BxKxGxbqxHv.astype(q_BxTxNxH.dtype), lse_BxKxGxbq

  # lax.map runs the query blocks one after another: only one block's state is live at a time.
  out_nqxBxKxGxbqxHv, lse_nqxBxKxGxbq = lax.map(q_block, jnp.arange(lay.nq))
  out_BxKxGxTpxHv = out_nqxBxKxGxbqxHv.transpose(1, 2, 3, 0, 4, 5).reshape(B, K, G, lay.Tp, Hv)
  lse_BxKxGxTp = lse_nqxBxKxGxbq.transpose(1, 2, 3, 0, 4).reshape(B, K, G, lay.Tp)
  return lay.heads_last(out_BxKxGxTpxHv), lse_BxKxGxTp


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _attention(q, k, v, seg_q, seg_k, groups, sinks, cfg):
  return _forward(q, k, v, seg_q, seg_k, groups, sinks, cfg)[0]


def _attention_fwd(q, k, v, seg_q, seg_k, groups, sinks, cfg):
  out, lse = _forward(q, k, v, seg_q, seg_k, groups, sinks, cfg)
  return out, (q, k, v, seg_q, seg_k, groups, sinks, out, lse)


def _attention_bwd(cfg, residuals, dout_BxTxNxHv):
  """Flash-attention-2 backward: one pass over key blocks, each visiting the query blocks it feeds.

  dk and dv of a key block accumulate in the inner loop and leave as that block's scan output;
  dq accumulates across key blocks in one fp32 [B, K, G, Tp, H] carry, updated in place.
  """
  (q_BxTxNxH, k_BxSxKxH, v_BxSxKxHv, seg_q, seg_k, groups, sinks_N, out_BxTxNxHv,
   lse_BxKxGxTp) = residuals
  lay = _Layout(q_BxTxNxH, k_BxSxKxH, v_BxSxKxHv, seg_q, seg_k, groups, sinks_N, cfg)
  B, K, G, H, Hv, bk = lay.B, lay.K, lay.G, lay.H, lay.Hv, cfg.bk
  dout_BxKxGxTpxHv = lay.heads_first(dout_BxTxNxHv)
  # delta_i = sum_j p_ij dp_ij = dout_i . out_i: the softmax backward's row term, computed once.
  # The sink column has no value (its dp is 0), so delta is the same with or without one.
  delta_BxKxGxTp = jnp.sum(dout_BxKxGxTpxHv.astype(jnp.float32)
                           * lay.heads_first(out_BxTxNxHv).astype(jnp.float32), axis=-1)

  def kv_block(dq_BxKxGxTpxH, j):
    k_BxKxbkxH = lay.k_slice(lay.k_BxKxSpxH, j)
    v_BxKxbkxHv = lay.k_slice(lay.v_BxKxSpxHv, j)

    def q_step(i, carry):
      dq, dk_dv = carry
      # The cond carries only this block's terms: the full dq stays outside it, updated in place.
      dq_blk, dk_dv = lay.if_segments_meet(i, j, functools.partial(q_update, i), skip, dk_dv)
      dq = lax.dynamic_update_slice_in_dim(dq, lay.q_slice(dq, i) + dq_blk, i * cfg.bq, axis=3)
      return dq, dk_dv

    def skip(dk_dv):
      return jnp.zeros((B, K, G, cfg.bq, H), jnp.float32), dk_dv

    def q_update(i, dk_dv):
      dk_BxKxbkxH, dv_BxKxbkxHv = dk_dv
      q_BxKxGxbqxH = lay.q_slice(lay.q_BxKxGxTpxH, i)
      do_BxKxGxbqxHv = lay.q_slice(dout_BxKxGxTpxHv, i)
      s, visible, tanh = lay.scores(q_BxKxGxbqxH, i, j)
      lse = lay.q_slice(lse_BxKxGxTp, i)
      p = jnp.where(visible, jnp.exp(s - lse[..., None]), 0.0)
      # Contracting over g as well as q sums the query heads that share this key/value head.
      dv_BxKxbkxHv = dv_BxKxbkxHv + jnp.einsum(
          "bkgqs,bkgqh->bksh", p.astype(do_BxKxGxbqxHv.dtype), do_BxKxGxbqxHv,
          preferred_element_type=jnp.float32)
      dp = jnp.einsum("bkgqh,bksh->bkgqs", do_BxKxGxbqxHv, v_BxKxbkxHv,
                      preferred_element_type=jnp.float32)
      ds = p * (dp - lay.q_slice(delta_BxKxGxTp, i)[..., None])
      if tanh is not None:
        ds = ds * (1.0 - tanh * tanh)  # d/dx of c * tanh(x / c)
      ds = ds * cfg.scale
      dk_BxKxbkxH = dk_BxKxbkxH + jnp.einsum(
          "bkgqs,bkgqh->bksh", ds.astype(q_BxKxGxbqxH.dtype), q_BxKxGxbqxH,
          preferred_element_type=jnp.float32)
      dq_blk = jnp.einsum("bkgqs,bksh->bkgqh", ds.astype(k_BxKxbkxH.dtype), k_BxKxbkxH,
                          preferred_element_type=jnp.float32)
      return dq_blk, (dk_BxKxbkxH, dv_BxKxbkxHv)

    init = (dq_BxKxGxTpxH, (jnp.zeros((B, K, bk, H), jnp.float32),
                            jnp.zeros((B, K, bk, Hv), jnp.float32)))
    dq, dk_dv = lax.fori_loop(*lay.q_range(j), q_step, init)
    return dq, dk_dv

  dq0 = jnp.zeros((B, K, G, lay.Tp, H), jnp.float32)
  dq_BxKxGxTpxH, (dk_nkxBxKxbkxH, dv_nkxBxKxbkxHv) = lax.scan(kv_block, dq0, jnp.arange(lay.nk))

  def keys_last(x_nkxBxKxbkxW, like_BxSxKxW):
    W = x_nkxBxKxbkxW.shape[-1]
    x = x_nkxBxKxbkxW.transpose(1, 0, 3, 2, 4).reshape(B, lay.Sp, K, W)
    return x[:, :lay.S].astype(like_BxSxKxW.dtype)

  dsinks_N = None
  if sinks_N is not None:
    # lse_i = log(sum_j exp(s_ij) + exp(sink)), so d out_i / d sink = -p_sink_i out_i and
    # d loss / d sink = -sum_i p_sink_i (dout_i . out_i) = -sum_i p_sink_i delta_i, over b and t.
    # Padded rows have dout = 0, so delta = 0: they add nothing.
    p_sink_BxKxGxTp = jnp.exp(lay.sink_KxG[None, :, :, None] - lse_BxKxGxTp)
    dsink_KxG = -jnp.sum(p_sink_BxKxGxTp * delta_BxKxGxTp, axis=(0, 3))
    dsinks_N = dsink_KxG.reshape(lay.N).astype(sinks_N.dtype)

  dq = lay.heads_last(dq_BxKxGxTpxH).astype(q_BxTxNxH.dtype)
  # Segment and group ids are integers: no cotangent.
  return (dq, keys_last(dk_nkxBxKxbkxH, k_BxSxKxH), keys_last(dv_nkxBxKxbkxHv, v_BxSxKxHv),
          None, None, None, dsinks_N)


_attention.defvjp(_attention_fwd, _attention_bwd)


def with_sinks(fwd, bwd):
  """Attention with sinks (one valueless logit per query head) from a kernel that gives its lse.

  fwd(q, k, v) -> (out [B, T, N, Hv], lse [B, N, T] in natural log, residuals); bwd(residuals,
  out, dout) -> (dq, dk, dv): the kernel's own backward, handed the output and cotangent to use.
  The sink leaves each row keep = sigmoid(lse - sink) of its softmax, so out' = keep * out. Giving
  the kernel's backward keep * out and keep * dout' yields the gradient through the output and the
  lse at once: dv and dp take keep * dout', and its delta, rowsum(dout * out), takes keep^2, which
  is keep * (the delta of out') as the sink's softmax needs. d sink = -sum keep (1 - keep) dout' . out.

  Returns:
    f(q, k, v, sinks_N) -> out' in out's dtype, differentiable in all four.
  """
  def apply(q, k, v, sinks_N):
    out, lse_BxNxT, res = fwd(q, k, v)
    keep_BxNxT = jax.nn.sigmoid(lse_BxNxT.astype(jnp.float32) - sinks_N.astype(jnp.float32)[None, :, None])
    keep_BxTxNx1 = keep_BxNxT.transpose(0, 2, 1)[..., None]
    return (out * keep_BxTxNx1).astype(out.dtype), (res, out, keep_BxTxNx1, sinks_N)

  @jax.custom_vjp
  def f(q, k, v, sinks_N):
    return apply(q, k, v, sinks_N)[0]

  def f_bwd(saved, dout):
    res, out, keep, sinks_N = saved
    dq, dk, dv = bwd(res, (out * keep).astype(out.dtype), (dout * keep).astype(dout.dtype))
    delta_BxTxNx1 = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1, keepdims=True)
    dsinks_N = -jnp.sum(keep * (1 - keep) * delta_BxTxNx1, axis=(0, 1, 3))
    return dq, dk, dv, dsinks_N.astype(sinks_N.dtype)

  f.defvjp(apply, f_bwd)
  return f


def cudnn_attention(q_BxTxNxH, k_BxSxKxH, v_BxSxKxV, *, scale: float, window: int | None = None,
                    sinks_N=None):
  """Causal attention by cuDNN's fused kernel through jax's cuDNN call, which takes a value width
  of its own (MLA's 192/128) and a sliding window of `window` keys, the query's own included; with
  `sinks_N`, the sinks by `with_sinks` over the kernel's log-sum-exp and its own backward (jax's
  fused-attention rules: the jax version this runs on is checked by benchmarks/gpu_check.py).
  GPU only."""
  from jax._src.cudnn import fused_attention_stablehlo as fa  # the GPU's cuDNN: loaded when used
  if sinks_N is None:
    return fa.dot_product_attention(q_BxTxNxH, k_BxSxKxH, v_BxSxKxV, scale=scale,
                                    mask_type=fa.MaskType.CAUSAL, sliding_window_length=window)
  statics = (scale, 42, 0.0, (False, False), fa.MaskType.CAUSAL,
             fa._normalize_layout("BTNH").value, window, fa.check_cudnn_version())

  def fwd(q, k, v):
    unused = jnp.zeros(0, q.dtype)  # no bias, sequence lengths, offsets or pages
    (out, lse), res = fa._dot_product_attention_fwd_rule(q, k, v, *(unused,) * 7, *statics, True)
    return out, lse, res

  def bwd(res, out, dout):
    return fa._dot_product_attention_bwd_rule(*statics, False, (*res[:-1], out), dout)[:3]

  return with_sinks(fwd, bwd)(q_BxTxNxH, k_BxSxKxH, v_BxSxKxV, sinks_N)

