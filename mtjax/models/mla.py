"""Multi-head latent attention (DeepSeek-V2/V3): keys and values expanded per head from one
low-rank latent per token, and a RoPE key shared by every head.

Per token: the query from a full projection, or a low-rank one (q_a, its norm, q_b); the latent
and the shared RoPE key from one projection (kv_a); the latent normed and expanded (kv_b) into each
head's non-rotated key channels and its value. A head's key is its own non-rotated channels and the
shared rotated ones; its value has a width of its own. The interface is `Attention`'s (rope, qkv,
core, out), so the generic Block, its sequence tiles and the attention kernels take it as is.
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from mtjax.config import ModelConfig
from mtjax.models.layers import Ctx, RMSNorm, apply_rope, attend, dense, rope_tables, yarn_mscale

# transformers' (and DeepSeek's) q_a_layernorm and kv_a_layernorm take the RMSNorm's default
# epsilon, not config.json's rms_norm_eps.
LATENT_NORM_EPS = 1e-6


def score_scale(cfg: ModelConfig) -> float:
  """The attention logits' scale: 1 / sqrt(q/k head width), times YaRN's mscale(mscale_all_dim)
  squared (DeepSeek scales the non-rotated channels' logits as well)."""
  if cfg.query_scale is not None:
    return cfg.query_scale
  m = cfg.mla
  scale = (m.qk_nope_dim + m.qk_rope_dim) ** -0.5
  if cfg.rope.scaling == "yarn" and cfg.rope.mscale_all_dim:
    scale *= yarn_mscale(cfg.rope.factor, cfg.rope.mscale_all_dim) ** 2
  return scale


class LatentAttention(nn.Module):
  """Causal multi-head latent attention, in per-token (`qkv`, `out`) and sequence (`core`) parts."""
  cfg: ModelConfig
  layer_type: str = "full"
  implementation: str | None = None

  def setup(self):
    cfg, m = self.cfg, self.cfg.mla
    H = cfg.heads
    if m.q_lora_rank is None:
      self.q = dense(H * (m.qk_nope_dim + m.qk_rope_dim))
    else:
      self.q_a = dense(m.q_lora_rank)
      self.q_a_norm = RMSNorm(LATENT_NORM_EPS)
      self.q_b = dense(H * (m.qk_nope_dim + m.qk_rope_dim))
    self.kv_a = dense(m.kv_lora_rank + m.qk_rope_dim)
    self.kv_a_norm = RMSNorm(LATENT_NORM_EPS)
    self.kv_b = dense(H * (m.qk_nope_dim + m.v_dim))
    self.o = dense(cfg.hidden)

  def rope(self, positions_BxT):
    """This layer's RoPE tables over the rotated channels (`rope_tables`)."""
    return rope_tables(self.cfg, positions_BxT, self.layer_type)

  def qkv(self, x_BxTxD, cos_BxTxR2, sin_BxTxR2):
    """Queries [B, T, N, Dn + Dr], keys [B, T, N, Dn + Dr] and values [B, T, N, Dv], RoPE on the
    last Dr query/key channels; each token's from its own input alone."""
    m = self.cfg.mla
    B, T, _ = x_BxTxD.shape
    N, Dn, Dr = self.cfg.heads, m.qk_nope_dim, m.qk_rope_dim
    q = self.q(x_BxTxD) if m.q_lora_rank is None else self.q_b(self.q_a_norm(self.q_a(x_BxTxD)))
    q_BxTxNxQ = q.reshape(B, T, N, Dn + Dr)
    kv_a = self.kv_a(x_BxTxD)
    latent_BxTxC, k_rope_BxTxR = kv_a[..., :m.kv_lora_rank], kv_a[..., m.kv_lora_rank:]
    kv_BxTxNxE = self.kv_b(self.kv_a_norm(latent_BxTxC)).reshape(B, T, N, Dn + m.v_dim)
    rot = lambda x: apply_rope(x, cos_BxTxR2, sin_BxTxR2, interleaved=m.rope_interleave)
    q_rope = rot(q_BxTxNxQ[..., Dn:])
    # One rotated key per token, shared by every head.
    k_rope_BxTx1xR = rot(k_rope_BxTxR[:, :, None, :])
    q_BxTxNxQ = jnp.concatenate([q_BxTxNxQ[..., :Dn], q_rope], axis=-1)
    k_BxTxNxQ = jnp.concatenate(
        [kv_BxTxNxE[..., :Dn], jnp.broadcast_to(k_rope_BxTx1xR, (B, T, N, Dr))], axis=-1)
    return q_BxTxNxQ, k_BxTxNxQ, kv_BxTxNxE[..., Dn:]

  def scoring(self) -> dict:
    """How this layer scores keys: `attend`'s window, softcap_, scale and sinks_N (none here)."""
    return dict(window=self.cfg.sliding_window if self.layer_type == "sliding" else None,
                softcap_=self.cfg.attn_softcap, scale=score_scale(self.cfg), sinks_N=None)

  def core(self, qkv, segments_BxT, groups_BxT=None):
    """Attention over the sequence of `qkv`'s queries, keys and values: [B, T, N * Dv], before
    the output projection; `groups_BxT` the image groups (mtjax.models.layers.image_groups)."""
    q_BxTxNxQ, k_BxTxNxQ, v_BxTxNxV = qkv
    B, T = q_BxTxNxQ.shape[:2]
    out = attend(q_BxTxNxQ, k_BxTxNxQ, v_BxTxNxV, segments_BxT, implementation=self.implementation,
                 groups_BxT=groups_BxT, **self.scoring())
    return out.reshape(B, T, -1)

  def out(self, a_BxTxE):
    return self.o(a_BxTxE)

  def __call__(self, x_BxTxD, ctx: Ctx | None = None):
    B, T, _ = x_BxTxD.shape
    ctx = Ctx.default(B, T) if ctx is None else ctx
    return self.out(self.core(self.qkv(x_BxTxD, *self.rope(ctx.positions)), ctx.segments))
