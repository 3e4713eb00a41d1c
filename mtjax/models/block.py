"""One decoder layer, the template every block kind compiles: a token mixer (GQA or multi-head
latent attention, or a gated DeltaNet) and a feed-forward (the dense gated MLP or a mixture of
experts) with residuals and norms."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from mtjax.config import ModelConfig
from mtjax.models import deltanet, mla, moe
from mtjax.models.layers import (MLP, Attention, BlockKind, Ctx, add_at_image_slots, image_groups,
                                 layer_segments, norm_layer)


class Block(nn.Module):
  """One decoder layer: attention and feed-forward sub-layers with residuals, the norms where the
  config puts them (`pre`: before each, Llama; `sandwich`: before and after, Gemma; `post`: after
  only, OLMo 2). A parallel block (Cohere) feeds attention and MLP the one input norm and adds both
  to the residual. Returns (output, auxiliary sums).

  With `seq_tile`, everything but the mixer's core (attention, which is blockwise already, or
  [T x T] anyway; a DeltaNet's convolution and recurrence, which carry state along the sequence)
  runs `seq_tile` tokens at a time, each tile recomputed in the backward: the input norm and
  q/k/v projections before it, the output projection, MLP and residuals after it. A layer's
  working set is then bounded by the tile, not by T x ffn. Same parameters either way.
  """
  cfg: ModelConfig
  kind: BlockKind = BlockKind()
  implementation: str | None = None
  seq_tile: int | None = None
  moe_impl: str = "ragged"

  def setup(self):
    cfg = self.cfg
    norm = lambda: norm_layer(cfg)
    if cfg.parallel_block:
      self.attn_norm = norm()
    elif cfg.norm_position != "post":
      self.attn_norm, self.mlp_norm = norm(), norm()
    if cfg.norm_position != "pre":
      self.post_attn_norm, self.post_mlp_norm = norm(), norm()
    if self.kind.layer_type == "linear":
      self.attn = deltanet.GatedDeltaNet(cfg)
    elif cfg.mla is not None:
      self.attn = mla.LatentAttention(cfg, self.kind.layer_type, self.implementation)
    else:
      self.attn = Attention(cfg, self.kind.layer_type, self.implementation, self.kind.rope)
    if self.kind.moe:
      self.mlp = moe.MoE(cfg, self.moe_impl)
    else:
      self.mlp = MLP(cfg, cfg.ffn)

  def _qkv(self, x_BxTxD, *tables):
    h = x_BxTxD if self.cfg.norm_position == "post" else self.attn_norm(x_BxTxD)
    return self.attn.qkv(h, *tables)

  def _out(self, x_BxTxD, a_BxTxE, valid_BxT):
    """The residual stream after attention's output projection and the feed-forward sub-layer,
    and the feed-forward's auxiliary sums over the tokens `valid_BxT` marks."""
    post = self.cfg.norm_position != "pre"
    o = self.attn.out(a_BxTxE)
    h = self._residual(x_BxTxD, self.post_attn_norm(o) if post else o)
    if self.cfg.parallel_block:  # the MLP reads the attention's input norm, recomputed
      m_in = self.attn_norm(x_BxTxD)
    else:
      m_in = h if self.cfg.norm_position == "post" else self.mlp_norm(h)
    if self.kind.moe:
      m, aux = self.mlp(m_in, valid_BxT)
    else:
      m, aux = self.mlp(m_in), {}
    return self._residual(h, self.post_mlp_norm(m) if post else m), aux

  def _residual(self, x_BxTxD, y_BxTxD):
    """x + y, y multiplied first by the config's residual multiplier (Granite: in fp32, rounded
    once, as torch multiplies a bf16 tensor by a Python float)."""
    rm = self.cfg.residual_multiplier
    if rm != 1.0:
      y_BxTxD = (y_BxTxD.astype(jnp.float32) * rm).astype(y_BxTxD.dtype)
    return x_BxTxD + y_BxTxD

  def __call__(self, x_BxTxD, ctx: Ctx | None = None):
    if self.kind.deepstack:  # (x, the deepstack features [B, k, F, D] not yet added)
      x_BxTxD, d_BxKxFxD = x_BxTxD
      y, aux = self.decoder(x_BxTxD, ctx)
      y = add_at_image_slots(y, d_BxKxFxD[:, 0], ctx.image_slots)
      return (y if self.kind.deepstack == 1 else (y, d_BxKxFxD[:, 1:])), aux
    return self.decoder(x_BxTxD, ctx)

  def decoder(self, x_BxTxD, ctx: Ctx | None = None):
    B, T, _ = x_BxTxD.shape
    ctx = Ctx.default(B, T) if ctx is None else ctx
    qkv = self._per_token(Block._qkv, x_BxTxD, *self.attn.rope(ctx.positions))
    a_BxTxE = self.attn.core(qkv, layer_segments(self.cfg, self.kind.layer_type, ctx),
                             image_groups(self.cfg, ctx))
    valid_BxT = jnp.ones((B, T), jnp.float32)
    y, aux = self._per_token(Block._out, x_BxTxD, a_BxTxE, valid_BxT, sums=True)
    return y, aux

  def _per_token(self, method, *xs_BxT, sums: bool = False):
    """`method(self, *xs_BxT)`, for a method that treats each token alone, `seq_tile` at a time.

    Each tile runs under jax.checkpoint inside lax.map: differentiated, only the tiles' inputs are
    kept and a tile's intermediates (the MLP's [B, tile, ffn]) are recomputed in its backward, so
    the working set is bounded by the tile, not by T. The tiles apply this block's own params (the
    tree is the untiled one), taken into the loop in fp32 so that their gradient sums over the
    tiles in fp32: bf16 weights get it rounded once, not once per tile (for one fp32 copy of the
    layer's weights). A T that is no multiple of the tile is padded with copies of its last token:
    finite wherever the real tokens are, and their outputs are dropped, so they add exact zeros to
    every gradient. With `sums`, the method returns (per-token outputs, sums over the tokens) and
    its last input marks the real tokens: the padding is marked 0, so no sum counts it.
    """
    B, T = xs_BxT[0].shape[:2]
    tile = self.seq_tile
    if tile is None or T <= tile or self.is_initializing():  # init: the untiled tree, as is
      return method(self, *xs_BxT)
    params = self.variables["params"]
    dtypes = jax.tree.map(lambda p: p.dtype, params)
    template = self.clone(parent=None)  # unbound: a pure function

    @jax.checkpoint
    def one(params32, xs):
      params = jax.tree.map(lambda p, dtype: p.astype(dtype), params32, dtypes)
      return template.apply({"params": params}, *xs, method=method)

    params32 = jax.tree.map(lambda p: p.astype(jnp.float32), params)
    n = -(-T // tile)

    def pad(a, last):
      widths = [(0, 0), (0, n * tile - T)] + [(0, 0)] * (a.ndim - 2)
      return jnp.pad(a, widths) if last else jnp.pad(a, widths, mode="edge")

    last = len(xs_BxT) - 1 if sums else -1
    tiles = tuple(jnp.moveaxis(pad(a, i == last).reshape(B, n, tile, *a.shape[2:]), 1, 0)
                  for i, a in enumerate(xs_BxT))
    ys = jax.lax.map(lambda xs: one(params32, xs), tiles)
    untile = lambda y: jnp.moveaxis(y, 0, 1).reshape(B, n * tile, *y.shape[3:])[:, :T]
    if sums:
      y, aux = ys
      return jax.tree.map(untile, y), jax.tree.map(lambda a: a.sum(0), aux)
    return jax.tree.map(untile, ys)
