"""Layer math: each Flax template against the naive reference, one layer at a time."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as hst

import reference as ref
from numerics import assert_close, assert_trees_close
from mtjax import config, models, programs
from mtjax.models import block as block_lib, layers


def model_cfg(**kw):
  base = dict(vocab_size=64, hidden=32, layers=1, heads=4, kv_heads=2, ffn=48)
  return config.ModelConfig(**{**base, **kw})


def random_block(cfg, seed=0):
  lay = models.spec(cfg).layouts["block"]
  w = np.asarray(jax.random.normal(jax.random.key(seed), (lay.size,))) * 0.2
  return lay, lay.unflatten(w)


def packed_ctx(B, T, seed):
  """Random document boundaries per row: segment ids and positions restarting at each."""
  rng = np.random.default_rng(seed)
  seg = np.cumsum(rng.random((B, T)) < 0.25, axis=1).astype(np.int32)
  pos = np.zeros((B, T), np.int32)
  for b in range(B):
    for t in range(1, T):
      pos[b, t] = 0 if seg[b, t] != seg[b, t - 1] else pos[b, t - 1] + 1
  return pos, seg


@given(heads=hst.sampled_from([2, 4, 8]), kv=hst.sampled_from([1, 2]), bias=hst.booleans(),
       scaling=hst.sampled_from(["none", "linear", "llama3"]), T=hst.sampled_from([1, 7, 16]),
       qk_norm=hst.booleans(), packed=hst.booleans(), impl=hst.sampled_from(["xla", "blockwise"]),
       rotary=hst.booleans())
def test_block_equals_naive_reference(heads, kv, bias, scaling, T, qk_norm, packed, impl, rotary):
  cfg = model_cfg(heads=heads, kv_heads=kv, head_dim=8, qkv_bias=bias, qk_norm=qk_norm,
                  rope=config.RopeConfig(scaling=scaling, factor=4.0, original_max_len=8))
  _, p = random_block(cfg)
  x = jax.random.normal(jax.random.key(1), (2, T, cfg.hidden))
  pos, seg = packed_ctx(2, T, T) if packed else (None, None)
  ctx = layers.Ctx(jnp.asarray(pos), jnp.asarray(seg)) if packed else None
  kind = layers.BlockKind(rope=rotary)  # rotary False: a NoPE layer
  got, aux = block_lib.Block(cfg, kind, implementation=impl).apply({"params": p}, x, ctx)
  assert aux == {}  # a dense block has no auxiliary sums
  want = ref.block(x, p, cfg, pos, seg, rotary)
  assert_close(got, want, name="block output")


@pytest.mark.parametrize("scaling", ["none", "linear", "llama3"])
def test_rope_frequencies_match_reference(scaling):
  cfg = model_cfg(head_dim=64, heads=2, rope=config.RopeConfig(
      scaling=scaling, factor=8.0, original_max_len=64, theta=500000.0))
  assert_close(layers.rope_inv_freq(cfg)[0], ref.inv_freq_np(cfg), name="inv_freq")


def test_rope_is_a_rotation_that_depends_on_relative_position():
  cfg = model_cfg(heads=1, kv_heads=1, head_dim=16, hidden=16)
  q = jax.random.normal(jax.random.key(0), (1, 1, 1, 16))
  k = jax.random.normal(jax.random.key(1), (1, 1, 1, 16))
  T = 12
  tables = layers.rope_tables(cfg, jnp.arange(T)[None, :])
  qs = layers.apply_rope(jnp.broadcast_to(q, (1, T, 1, 16)), *tables)
  ks = layers.apply_rope(jnp.broadcast_to(k, (1, T, 1, 16)), *tables)
  np.testing.assert_allclose(jnp.linalg.norm(qs, axis=-1), jnp.linalg.norm(q), rtol=1e-5)
  dots = jnp.einsum("td,sd->ts", qs[0, :, 0], ks[0, :, 0])
  np.testing.assert_allclose(dots[5, 2], dots[9, 6], rtol=1e-4)  # both 3 apart


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("chunk", [1, 5, 48, 4096])
def test_chunked_head_equals_full_logits_loss(tied, chunk):
  cfg = model_cfg(tie_embeddings=tied)
  lays = models.spec(cfg).layouts
  fns = programs.layer_fns(models.spec(cfg), jnp.float32, None, chunk)
  k = jax.random.split(jax.random.key(0), 4)
  wh = jax.random.normal(k[0], (lays["head"].size,)) * 0.3
  wt = jax.random.normal(k[1], (lays["embed"].size,)) * 0.3 if tied else None
  x = jax.random.normal(k[2], (3, 16, cfg.hidden))
  t = jax.random.randint(k[3], (3, 16), 0, cfg.vocab_size)
  loss, dx, gh, gt = jax.jit(fns.head_step)(wh, wt, x, t, np.full((3, 16), 1 / 48, np.float32))

  def full(wh, wt, x):
    hp = lays["head"].unflatten(wh)
    h = ref.rmsnorm(x, hp["norm"]["scale"], cfg.norm_eps)
    w = wt.reshape(cfg.vocab_size, cfg.hidden).T if tied else hp["out"]
    logp = jax.nn.log_softmax(h @ w, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, t[..., None], axis=-1))

  want_loss, (want_gh, want_gt, want_dx) = jax.value_and_grad(full, argnums=(0, 1, 2))(wh, wt, x)
  assert_close(loss, want_loss, name="loss")
  assert_trees_close((dx, gh, gt), (want_dx, want_gh, want_gt), name="(dx, g_head, g_table)")





def compiled(fn, *args):
  """jit(fn) for `args`, with LLVM at -O0: the same HLO (and memory plan), half the compile time."""
  return jax.jit(fn).lower(*args).compile({"xla_backend_optimization_level": 0})


def block_vjps(cfg, impl, variants, x, ctx, kind=layers.BlockKind()):
  """Per (seq_tile, dtype) variant: the block's output and its vjp w.r.t. params and input."""
  rng = np.random.default_rng(0)
  lay = models.spec(cfg).layouts[kind.name]
  p = lay.unflatten(rng.normal(size=lay.size).astype(np.float32) * 0.2)
  dy = rng.normal(size=x.shape).astype(np.float32)

  def run(p, x, dy):
    outs = []
    for seq_tile, dtype in variants:
      block = block_lib.Block(cfg, kind, implementation=impl, seq_tile=seq_tile)
      p_, x_, dy_ = jax.tree.map(lambda a: a.astype(dtype), (p, x, dy))
      y, pullback = jax.vjp(lambda p, x: block.apply({"params": p}, x, ctx)[0], p_, x_)
      outs.append((y, pullback(dy_)))
    return outs

  return compiled(run, p, x, dy)(p, x, dy)


@pytest.mark.parametrize("T,packed,qk_norm", [(16, False, False), (19, False, True),
                                              (16, True, True), (19, True, False)])
def test_tiled_block_equals_untiled(T, packed, qk_norm):
  """Tiles of 4 tokens (T = 19: a padded last tile): output, d/dparams and d/dx as untiled."""
  cfg = model_cfg(qkv_bias=qk_norm, qk_norm=qk_norm)
  x = np.random.default_rng(1).normal(size=(2, T, cfg.hidden)).astype(np.float32)
  ctx = layers.Ctx(*map(jnp.asarray, packed_ctx(2, T, T))) if packed else None
  with jax.default_matmul_precision("highest"):
    want, got = block_vjps(cfg, "xla", [(None, jnp.float32), (4, jnp.float32)], x, ctx)
  assert_trees_close(got, want, name="tiled")


@pytest.mark.parametrize("variant", ["parallel", "nope_temperature", "chunked"])
def test_tiled_block_variants_equal_untiled(variant):
  """Cohere's parallel LayerNorm block (per-head q/k norms, interleaved RoPE), Llama 4's NoPE
  layer with its query temperature and its chunked layer with weightless q/k norms, packed rows
  in tiles of 4 (T = 19): output, d/dparams and d/dx as untiled."""
  cfg, kind = {
      "parallel": (model_cfg(norm_kind="layer", parallel_block=True, qk_norm=True,
                             qk_norm_scope="each_head", rope=config.RopeConfig(interleave=True)),
                   layers.BlockKind()),
      "nope_temperature": (model_cfg(nope_layers=(0,), temperature_floor=2,
                                     temperature_scale=0.5), layers.BlockKind(rope=False)),
      "chunked": (model_cfg(layer_types=("chunked",), attention_chunk=5, qk_l2_norm=True),
                  layers.BlockKind("chunked")),
  }[variant]
  x = np.random.default_rng(1).normal(size=(2, 19, cfg.hidden)).astype(np.float32)
  ctx = layers.Ctx(*map(jnp.asarray, packed_ctx(2, 19, 19)))
  with jax.default_matmul_precision("highest"):
    want, got = block_vjps(cfg, "xla", [(None, jnp.float32), (4, jnp.float32)], x, ctx, kind)
  assert_trees_close(got, want, name="tiled")


def test_tiled_block_has_the_untiled_parameters():
  cfg = model_cfg(qkv_bias=True, qk_norm=True)
  x = jax.ShapeDtypeStruct((1, 19, cfg.hidden), jnp.float32)
  untiled = jax.eval_shape(block_lib.Block(cfg).init, jax.random.key(0), x)
  tiled = jax.eval_shape(block_lib.Block(cfg, seq_tile=4).init, jax.random.key(0), x)
  assert jax.tree.structure(tiled) == jax.tree.structure(untiled)
  chex.assert_trees_all_equal_shapes_and_dtypes(tiled, untiled)


def test_tiled_block_in_bf16():
  """bf16 weights and activations, tiled: within bf16 rounding of the fp32 untiled block."""
  cfg = model_cfg()
  x = np.random.default_rng(1).normal(size=(2, 19, cfg.hidden)).astype(np.float32)
  want, got = block_vjps(cfg, "xla", [(None, jnp.float32), (4, jnp.bfloat16)], x, None)
  assert all(a.dtype == jnp.bfloat16 for a in jax.tree.leaves(got))
  rel_err = lambda a, b: np.linalg.norm(np.float32(a) - b) / np.linalg.norm(b)
  errs = jax.tree.leaves(jax.tree.map(rel_err, got, want))
  assert max(errs) < 2e-2, errs


def test_tiling_bounds_the_blocks_working_set():
  """Compiled vjp temp memory at T = 2048 with a wide MLP, whose [T x ffn] dominates untiled."""
  cfg = model_cfg(hidden=64, heads=4, kv_heads=2, ffn=2048)
  p = jax.eval_shape(block_lib.Block(cfg).init, jax.random.key(0), jnp.zeros((1, 1, cfg.hidden)))
  x = jax.ShapeDtypeStruct((1, 2048, cfg.hidden), jnp.float32)

  def temp_bytes(seq_tile):
    block = block_lib.Block(cfg, implementation="blockwise", seq_tile=seq_tile)

    def vjp(p, x, dy):
      return jax.vjp(lambda p, x: block.apply(p, x)[0], p, x)[1](dy)

    return compiled(vjp, p, x, x).memory_analysis().temp_size_in_bytes

  untiled, tiled = temp_bytes(None), temp_bytes(256)
  print(f"block vjp temp, T=2048 hidden=64 ffn=2048: untiled {untiled / 2**20:.1f} MiB, "
        f"seq_tile=256 {tiled / 2**20:.1f} MiB")
  assert tiled < 0.5 * untiled
