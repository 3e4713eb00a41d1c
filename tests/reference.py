"""An independent whole-model Llama in plain jax.numpy: the reference the engine is checked against.

It shares no code with mtjax's layer math: attention is the naive masked softmax with key/value
heads repeated, RoPE uses the rotate-half form with frequencies computed in numpy (float64), the
loss is an unchunked log-softmax. Parameters use the tree of `HostState.to_tree()`.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np


def inv_freq_np(cfg) -> np.ndarray:
  hd, r = cfg.dim_per_head, cfg.rope
  inv = 1.0 / (r.theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
  if r.scaling == "linear":
    inv = inv / r.factor
  elif r.scaling == "llama3":
    out = []
    for f in inv:
      wavelen = 2 * math.pi / f
      if wavelen < r.original_max_len / r.high_freq_factor:
        out.append(f)
      elif wavelen > r.original_max_len / r.low_freq_factor:
        out.append(f / r.factor)
      else:
        s = ((r.original_max_len / wavelen - r.low_freq_factor)
             / (r.high_freq_factor - r.low_freq_factor))
        out.append((1 - s) * f / r.factor + s * f)
    inv = np.array(out)
  return inv


def rotate_half(x):
  h = x.shape[-1] // 2
  return jnp.concatenate([-x[..., h:], x[..., :h]], axis=-1)


def rope(x, cfg, positions=None):
  B, T = x.shape[:2]
  pos = np.broadcast_to(np.arange(T), (B, T)) if positions is None else np.asarray(positions)
  freqs = pos[..., None].astype(np.float64) * inv_freq_np(cfg)
  emb = np.concatenate([freqs, freqs], axis=-1)
  cos = jnp.asarray(np.cos(emb), jnp.float32)[:, :, None, :]
  sin = jnp.asarray(np.sin(emb), jnp.float32)[:, :, None, :]
  xf = x.astype(jnp.float32)
  return (xf * cos + rotate_half(xf) * sin).astype(x.dtype)


def rmsnorm(x, scale, eps):
  xf = x.astype(jnp.float32)
  var = jnp.mean(jnp.square(xf), axis=-1, keepdims=True)
  return (xf / jnp.sqrt(var + eps)).astype(x.dtype) * scale.astype(x.dtype)[None, None, :]


def linear(x, p):
  y = x @ p["kernel"].astype(x.dtype)
  if "bias" in p:
    y = y + p["bias"].astype(x.dtype)[None, None, :]
  return y


def attention(x, p, cfg, positions=None, segments=None, rotary=True):
  B, T, _ = x.shape
  H, K, hd = cfg.heads, cfg.n_kv_heads, cfg.dim_per_head
  q = linear(x, p["q"]).reshape(B, T, H, hd)
  k = linear(x, p["k"]).reshape(B, T, K, hd)
  if getattr(cfg, "qk_norm", False):
    q = rmsnorm4(q, p["q_norm"]["scale"], cfg.norm_eps)
    k = rmsnorm4(k, p["k_norm"]["scale"], cfg.norm_eps)
  if rotary:
    q, k = rope(q, cfg, positions), rope(k, cfg, positions)
  v = linear(x, p["v"]).reshape(B, T, K, hd)
  k = jnp.repeat(k, H // K, axis=2)
  v = jnp.repeat(v, H // K, axis=2)
  scores = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), k.astype(jnp.float32))
  scores = scores / math.sqrt(hd)
  mask = np.broadcast_to(np.tril(np.ones((T, T), bool)), (B, T, T))
  if segments is not None:
    seg = np.asarray(segments)
    mask = mask & (seg[:, :, None] == seg[:, None, :])
  scores = jnp.where(mask[:, None], scores, -1e30)
  probs = jax.nn.softmax(scores, axis=-1)
  out = jnp.einsum("bhqk,bkhd->bqhd", probs, v.astype(jnp.float32)).astype(x.dtype)
  return linear(out.reshape(B, T, H * hd), p["o"])


def rmsnorm4(x, scale, eps):
  xf = x.astype(jnp.float32)
  var = jnp.mean(jnp.square(xf), axis=-1, keepdims=True)
  return (xf / jnp.sqrt(var + eps)).astype(x.dtype) * scale.astype(x.dtype)[None, None, None, :]


def block(x, p, cfg, positions=None, segments=None, rotary=True):
  rm = getattr(cfg, "residual_multiplier", 1.0)
  h = x + rm * attention(rmsnorm(x, p["attn_norm"]["scale"], cfg.norm_eps), p["attn"], cfg,
                         positions, segments, rotary)
  m = rmsnorm(h, p["mlp_norm"]["scale"], cfg.norm_eps)
  mp = p["mlp"]
  return h + rm * linear(jax.nn.silu(linear(m, mp["gate"])) * linear(m, mp["up"]), mp["down"])


def loss_fn(params, inputs, targets, cfg, dtype=jnp.float32, positions=None, segments=None,
            loss_weights=None):
  """Next-token cross-entropy of the whole model in one graph: the mean over tokens, or with
  `loss_weights` the weighted sum over their total."""
  nll = -token_logps(params, inputs, targets, cfg, dtype, positions, segments)
  if loss_weights is None:
    return jnp.mean(nll)
  return jnp.sum(nll * loss_weights) / jnp.sum(loss_weights)


def token_logps(params, inputs, targets, cfg, dtype=jnp.float32, positions=None, segments=None):
  """Each target's log-prob under the whole model, [B, T]."""
  cast = jax.tree.map(lambda a: a.astype(dtype), params)
  x = cast["embed"]["table"][inputs] * getattr(cfg, "embed_multiplier", 1.0)
  for i, p in enumerate(cast["blocks"]):
    x = block(x, p, cfg, positions, segments, i not in getattr(cfg, "nope_layers", ()))
  hp = cast["head"]
  x = rmsnorm(x, hp["norm"]["scale"], cfg.norm_eps)
  w = cast["embed"]["table"].T if cfg.tie_embeddings else hp["out"]
  logits = (x @ w).astype(jnp.float32) / getattr(cfg, "logits_divisor", 1.0)
  logp = jax.nn.log_softmax(logits, axis=-1)
  return jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]


def decay_mask(params):
  """Weight decay on matrices only, as mtjax does."""
  return jax.tree.map(lambda a: a.ndim >= 2, params)


def flat_grads(state, tree) -> list:
  """A reference gradient tree laid out as the engine's per-group flat vectors."""
  return ([state.embed.layout.flatten(tree["embed"])]
          + [g.layout.flatten(t) for g, t in zip(state.blocks, tree["blocks"])]
          + [state.head.layout.flatten(tree["head"])])
