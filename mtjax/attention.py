"""Blockwise (flash-style) attention in plain JAX: memory O(T x block), never a [T, S] score matrix.

The fallback beside cuDNN's fused kernel: CPU, fp32, any head size and document (segment) masks.
The forward keeps a running max and sum per query row in fp32 (online softmax) and saves only the
output and each row's logsumexp; the backward recomputes one block of scores at a time.
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


def blockwise_attention(q_BxTxNxH: jax.Array, k_BxSxKxH: jax.Array, v_BxSxKxH: jax.Array, *,
                        segments_q_BxT: jax.Array | None = None,
                        segments_k_BxS: jax.Array | None = None, causal: bool = True,
                        q_block: int = 512, kv_block: int = 512,
                        scale: float | None = None) -> jax.Array:
  """Scaled dot-product attention computed block by block, as `jax.nn.dot_product_attention`.

  Args:
    q_BxTxNxH: queries; N must be a multiple of K (grouped-query attention: query head n reads
      key/value head n // (N / K), as `jax.nn.dot_product_attention` groups them).
    k_BxSxKxH: keys.
    v_BxSxKxH: values, same shape as the keys.
    segments_q_BxT: integer document ids per query; a query attends only to keys of its own id.
    segments_k_BxS: integer document ids per key; either one alone is used for both (needs T == S).
    causal: query i sees key j only where j <= i (top-left aligned, as `is_causal=True`).
    q_block: query rows per block (clipped to T); T need not be a multiple.
    kv_block: keys per block (clipped to S); S need not be a multiple.
    scale: multiplies the scores; default 1 / sqrt(H).

  Returns:
    [B, T, N, H] in q's dtype. A query row that sees no key at all gets zeros.
  """
  B, T, N, H = q_BxTxNxH.shape
  Bk, S, K, Hk = k_BxSxKxH.shape
  if (Bk, Hk) != (B, H) or v_BxSxKxH.shape != k_BxSxKxH.shape:
    raise ValueError(f"shapes q {q_BxTxNxH.shape}, k {k_BxSxKxH.shape}, v {v_BxSxKxH.shape} "
                     "do not fit [B, T, N, H], [B, S, K, H], [B, S, K, H]")
  if N % K:
    raise ValueError(f"query heads {N} are not a multiple of key/value heads {K}")
  if segments_q_BxT is None and segments_k_BxS is not None:
    segments_q_BxT = segments_k_BxS
  if segments_k_BxS is None and segments_q_BxT is not None:
    segments_k_BxS = segments_q_BxT
  if segments_q_BxT is not None:
    if segments_q_BxT.shape != (B, T) or segments_k_BxS.shape != (B, S):
      raise ValueError(f"segment ids {segments_q_BxT.shape}, {segments_k_BxS.shape} do not fit "
                       f"[B, T] = {(B, T)} and [B, S] = {(B, S)}")
  if q_block < 1 or kv_block < 1:
    raise ValueError(f"block sizes must be positive, got {q_block}, {kv_block}")
  scale = 1.0 / math.sqrt(H) if scale is None else float(scale)
  cfg = _Cfg(bool(causal), min(q_block, T), min(kv_block, S), scale)
  return _attention(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, segments_q_BxT, segments_k_BxS, cfg)


class _Cfg(NamedTuple):
  """Static settings: hashable, so they ride along as the custom_vjp's nondiff argument."""
  causal: bool
  bq: int  # query rows per block
  bk: int  # keys per block
  scale: float


def _ceil_div(a, b):
  return -(-a // b)


def _pad_axis(x, axis, size):
  """Zero-pads `axis` up to `size` (a no-op when it already fits)."""
  if x.shape[axis] == size:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, widths)


class _Layout:
  """The inputs padded to whole blocks, heads moved ahead of time so each block is one dot."""

  def __init__(self, q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, seg_q_BxT, seg_k_BxS, cfg):
    B, T, N, H = q_BxTxNxH.shape
    S, K = k_BxSxKxH.shape[1:3]
    self.B, self.T, self.N, self.H, self.S, self.K, self.G = B, T, N, H, S, K, N // K
    self.nq, self.nk = _ceil_div(T, cfg.bq), _ceil_div(S, cfg.bk)
    self.Tp, self.Sp = self.nq * cfg.bq, self.nk * cfg.bk
    self.cfg = cfg
    self.q_BxKxGxTpxH = self.heads_first(q_BxTxNxH)
    # One transpose of k and v up front (O(S) bytes) rather than one per block visit.
    self.k_BxKxSpxH = _pad_axis(k_BxSxKxH, 1, self.Sp).transpose(0, 2, 1, 3)
    self.v_BxKxSpxH = _pad_axis(v_BxSxKxH, 1, self.Sp).transpose(0, 2, 1, 3)
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

  def heads_first(self, x_BxTxNxH):
    """[B, T, N, H] -> [B, K, G, Tp, H]: the group axis sits beside K, so k/v are never repeated."""
    x = _pad_axis(x_BxTxNxH, 1, self.Tp).reshape(self.B, self.Tp, self.K, self.G, self.H)
    return x.transpose(0, 2, 3, 1, 4)

  def heads_last(self, x_BxKxGxTpxH):
    """[B, K, G, Tp, H] -> [B, T, N, H]."""
    x = x_BxKxGxTpxH.transpose(0, 3, 1, 2, 4).reshape(self.B, self.Tp, self.N, self.H)
    return x[:, :self.T]

  def q_slice(self, x, i, axis=3):
    return lax.dynamic_slice_in_dim(x, i * self.cfg.bq, self.cfg.bq, axis=axis)

  def k_slice(self, x, j, axis=2):
    return lax.dynamic_slice_in_dim(x, j * self.cfg.bk, self.cfg.bk, axis=axis)

  def kv_blocks_seen(self, i):
    """How many leading key blocks query block i can see (causal: later ones are all masked)."""
    if not self.cfg.causal:
      return self.nk
    return jnp.minimum(self.nk, _ceil_div((i + 1) * self.cfg.bq, self.cfg.bk))

  def first_q_block_seeing(self, j):
    """The first query block that sees any key of block j (causal: earlier ones see none)."""
    if not self.cfg.causal:
      return 0
    return (j * self.cfg.bk) // self.cfg.bq

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
    """Scaled fp32 scores of query block i against key block j, and where they are visible."""
    cfg = self.cfg
    k_BxKxbkxH = self.k_slice(self.k_BxKxSpxH, j)
    s_BxKxGxbqxbk = jnp.einsum("bkgqh,bksh->bkgqs", q_BxKxGxbqxH, k_BxKxbkxH,
                               preferred_element_type=jnp.float32) * cfg.scale
    q_pos_bq = i * cfg.bq + jnp.arange(cfg.bq)
    k_pos_bk = j * cfg.bk + jnp.arange(cfg.bk)
    visible_bqxbk = jnp.broadcast_to(k_pos_bk[None, :] < self.S, (cfg.bq, cfg.bk))  # padding
    if cfg.causal:
      visible_bqxbk = visible_bqxbk & (k_pos_bk[None, :] <= q_pos_bq[:, None])
    visible = visible_bqxbk[None, None, None]
    if self.seg_q_BxTp is not None:
      seg_q_Bxbq = self.q_slice(self.seg_q_BxTp, i, axis=1)
      seg_k_Bxbk = self.k_slice(self.seg_k_BxSp, j, axis=1)
      same_Bxbqxbk = seg_q_Bxbq[:, :, None] == seg_k_Bxbk[:, None, :]
      visible = visible & same_Bxbqxbk[:, None, None]
    return jnp.where(visible, s_BxKxGxbqxbk, _NEG), visible


def _forward(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, seg_q_BxT, seg_k_BxS, cfg):
  """Output [B, T, N, H] and the fp32 logsumexp of every (padded) query row, [B, K, G, Tp]."""
  lay = _Layout(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, seg_q_BxT, seg_k_BxS, cfg)
  B, K, G, H, bq = lay.B, lay.K, lay.G, lay.H, cfg.bq

  def q_block(i):
    q_BxKxGxbqxH = lay.q_slice(lay.q_BxKxGxTpxH, i)

    def kv_step(j, carry):
      return lay.if_segments_meet(i, j, functools.partial(kv_update, j), lambda c: c, carry)

    def kv_update(j, carry):
      m_BxKxGxbq, l_BxKxGxbq, acc_BxKxGxbqxH = carry
      s, visible = lay.scores(q_BxKxGxbqxH, i, j)
      m_new = jnp.maximum(m_BxKxGxbq, s.max(axis=-1))
      p = jnp.where(visible, jnp.exp(s - m_new[..., None]), 0.0)
      correction = jnp.exp(m_BxKxGxbq - m_new)
      l_new = l_BxKxGxbq * correction + p.sum(axis=-1)
      v_BxKxbkxH = lay.k_slice(lay.v_BxKxSpxH, j)
      # Probabilities in v's dtype so bf16 inputs get a bf16 matmul, accumulated in fp32.
      pv = jnp.einsum("bkgqs,bksh->bkgqh", p.astype(v_BxKxbkxH.dtype), v_BxKxbkxH,
                      preferred_element_type=jnp.float32)
      return m_new, l_new, acc_BxKxGxbqxH * correction[..., None] + pv

    init = (jnp.full((B, K, G, bq), _NEG, jnp.float32), jnp.zeros((B, K, G, bq), jnp.float32),
            jnp.zeros((B, K, G, bq, H), jnp.float32))
    m, l, acc = lax.fori_loop(0, lay.kv_blocks_seen(i), kv_step, init)
    seen = l > 0  # a row with no visible key gets zeros and a logsumexp the backward never reads
    out_BxKxGxbqxH = acc / jnp.where(seen, l, 1.0)[..., None]
    lse_BxKxGxbq = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), 0.0)
    return out_BxKxGxbqxH.astype(q_BxTxNxH.dtype), lse_BxKxGxbq

  # lax.map runs the query blocks one after another: only one block's state is live at a time.
  out_nqxBxKxGxbqxH, lse_nqxBxKxGxbq = lax.map(q_block, jnp.arange(lay.nq))
  out_BxKxGxTpxH = out_nqxBxKxGxbqxH.transpose(1, 2, 3, 0, 4, 5).reshape(B, K, G, lay.Tp, H)
  lse_BxKxGxTp = lse_nqxBxKxGxbq.transpose(1, 2, 3, 0, 4).reshape(B, K, G, lay.Tp)
  return lay.heads_last(out_BxKxGxTpxH), lse_BxKxGxTp


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _attention(q, k, v, seg_q, seg_k, cfg):
  return _forward(q, k, v, seg_q, seg_k, cfg)[0]


def _attention_fwd(q, k, v, seg_q, seg_k, cfg):
  out, lse = _forward(q, k, v, seg_q, seg_k, cfg)
  return out, (q, k, v, seg_q, seg_k, out, lse)


def _attention_bwd(cfg, residuals, dout_BxTxNxH):
  """Flash-attention-2 backward: one pass over key blocks, each visiting the query blocks it feeds.

  dk and dv of a key block accumulate in the inner loop and leave as that block's scan output;
  dq accumulates across key blocks in one fp32 [B, K, G, Tp, H] carry, updated in place.
  """
  q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, seg_q, seg_k, out_BxTxNxH, lse_BxKxGxTp = residuals
  lay = _Layout(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, seg_q, seg_k, cfg)
  B, K, G, H, bk = lay.B, lay.K, lay.G, lay.H, cfg.bk
  dout_BxKxGxTpxH = lay.heads_first(dout_BxTxNxH)
  # delta_i = sum_j p_ij dp_ij = dout_i . out_i: the softmax backward's row term, computed once.
  delta_BxKxGxTp = jnp.sum(dout_BxKxGxTpxH.astype(jnp.float32)
                           * lay.heads_first(out_BxTxNxH).astype(jnp.float32), axis=-1)

  def kv_block(dq_BxKxGxTpxH, j):
    k_BxKxbkxH = lay.k_slice(lay.k_BxKxSpxH, j)
    v_BxKxbkxH = lay.k_slice(lay.v_BxKxSpxH, j)

    def q_step(i, carry):
      dq, dk_dv = carry
      # The cond carries only this block's terms: the full dq stays outside it, updated in place.
      dq_blk, dk_dv = lay.if_segments_meet(i, j, functools.partial(q_update, i), skip, dk_dv)
      dq = lax.dynamic_update_slice_in_dim(dq, lay.q_slice(dq, i) + dq_blk, i * cfg.bq, axis=3)
      return dq, dk_dv

    def skip(dk_dv):
      return jnp.zeros((B, K, G, cfg.bq, H), jnp.float32), dk_dv

    def q_update(i, dk_dv):
      dk_BxKxbkxH, dv_BxKxbkxH = dk_dv
      q_BxKxGxbqxH = lay.q_slice(lay.q_BxKxGxTpxH, i)
      do_BxKxGxbqxH = lay.q_slice(dout_BxKxGxTpxH, i)
      s, visible = lay.scores(q_BxKxGxbqxH, i, j)
      lse = lay.q_slice(lse_BxKxGxTp, i)
      p = jnp.where(visible, jnp.exp(s - lse[..., None]), 0.0)
      # Contracting over g as well as q sums the query heads that share this key/value head.
      dv_BxKxbkxH = dv_BxKxbkxH + jnp.einsum(
          "bkgqs,bkgqh->bksh", p.astype(do_BxKxGxbqxH.dtype), do_BxKxGxbqxH,
          preferred_element_type=jnp.float32)
      dp = jnp.einsum("bkgqh,bksh->bkgqs", do_BxKxGxbqxH, v_BxKxbkxH,
                      preferred_element_type=jnp.float32)
      ds = p * (dp - lay.q_slice(delta_BxKxGxTp, i)[..., None]) * cfg.scale
      dk_BxKxbkxH = dk_BxKxbkxH + jnp.einsum(
          "bkgqs,bkgqh->bksh", ds.astype(q_BxKxGxbqxH.dtype), q_BxKxGxbqxH,
          preferred_element_type=jnp.float32)
      dq_blk = jnp.einsum("bkgqs,bksh->bkgqh", ds.astype(k_BxKxbkxH.dtype), k_BxKxbkxH,
                          preferred_element_type=jnp.float32)
      return dq_blk, (dk_BxKxbkxH, dv_BxKxbkxH)

    init = (dq_BxKxGxTpxH, (jnp.zeros((B, K, bk, H), jnp.float32),
                            jnp.zeros((B, K, bk, H), jnp.float32)))
    dq, dk_dv = lax.fori_loop(lay.first_q_block_seeing(j), lay.nq, q_step, init)
    return dq, dk_dv

  dq0 = jnp.zeros((B, K, G, lay.Tp, H), jnp.float32)
  dq_BxKxGxTpxH, (dk_nkxBxKxbkxH, dv_nkxBxKxbkxH) = lax.scan(kv_block, dq0, jnp.arange(lay.nk))

  def keys_last(x_nkxBxKxbkxH, like_BxSxKxH):
    x = x_nkxBxKxbkxH.transpose(1, 0, 3, 2, 4).reshape(B, lay.Sp, K, H)
    return x[:, :lay.S].astype(like_BxSxKxH.dtype)

  dq = lay.heads_last(dq_BxKxGxTpxH).astype(q_BxTxNxH.dtype)
  # Segment ids are integers: no cotangent.
  return (dq, keys_last(dk_nkxBxKxbkxH, k_BxSxKxH), keys_last(dv_nkxBxKxbkxH, v_BxSxKxH),
          None, None)


_attention.defvjp(_attention_fwd, _attention_bwd)
