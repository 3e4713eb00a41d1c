"""Flat layouts, layout-independent init, and the store's host views of each group."""

import chex
import jax
import numpy as np
import pytest

from mtjax import config, models, store as store_lib


def model_cfg(**kw):
  return config.ModelConfig(**{**dict(vocab_size=64, hidden=32, layers=2, heads=4, ffn=48), **kw})


def create(m, key, tiers=None):
  cfg = config.Config(model=m, engine=config.EngineConfig(device_state_layers=0, device_update_layers=0))
  return store_lib.create(cfg, key, tiers)


def test_layout_round_trips_and_puts_matrices_first():
  cfg = model_cfg(qkv_bias=True)
  lay = models.spec(cfg).layouts["block"]
  flat = np.arange(lay.size, dtype=np.float32)
  tree = lay.unflatten(flat)
  np.testing.assert_array_equal(lay.flatten(tree), flat)
  for path, shape, off in zip(lay.paths, lay.shapes, lay.offsets):
    assert (off < lay.n_decay) == (len(shape) >= 2), path
  assert lay.n_decay == sum(int(np.prod(s)) for s in lay.shapes if len(s) >= 2)
  with pytest.raises(ValueError, match="shape"):
    bad = jax.tree.map(lambda a: a, tree)
    bad["attn"]["q"]["kernel"] = np.zeros((3, 3))
    lay.flatten(bad)


def test_param_count_matches_llama_formula():
  cfg = model_cfg(layers=3, kv_heads=2)
  st = create(cfg, jax.random.key(0))
  D, F, V, hd = 32, 48, 64, 8
  block = D * D * 2 + 2 * D * (2 * hd) + 3 * D * F + 2 * D
  assert st.n_params == V * D + 3 * block + D + D * V


def test_init_is_independent_of_layout_and_model_depth():
  a = create(model_cfg(layers=1), jax.random.key(3)).to_tree()
  b = create(model_cfg(layers=3), jax.random.key(3), ["device", "stream", "host", "device", "host"]
             ).to_tree()  # placement changes nothing either
  chex.assert_trees_all_equal(a["embed"], b["embed"])
  chex.assert_trees_all_equal(a["blocks"][0], b["blocks"][0])
  chex.assert_trees_all_equal(a["head"], b["head"])
  c = create(model_cfg(layers=1), jax.random.key(4)).to_tree()
  assert not np.allclose(a["embed"]["table"], c["embed"]["table"])
  w = a["blocks"][0]["attn"]["q"]["kernel"]
  assert abs(w.std() - 0.02) < 0.004 and np.all(a["blocks"][0]["attn_norm"]["scale"] == 1)


@pytest.mark.parametrize("tier", ["host", "stream", "device"])
def test_write_read_and_load_tree_round_trip_in_every_tier(tier):
  cfg = model_cfg()
  st = create(cfg, jax.random.key(0), [tier] * 4)
  other = create(cfg, jax.random.key(1)).to_tree()
  st.load_tree(other)
  chex.assert_trees_all_equal(st.to_tree(), other)
  m = np.arange(st.groups[1].size, dtype=np.float32)
  st.write(1, opt={"m": m, "v": 2 * m})
  got = st.read(1)["opt"]
  np.testing.assert_array_equal(got["m"], m)
  np.testing.assert_array_equal(got["v"], 2 * m)
  with pytest.raises(ValueError, match="blocks"):
    st.load_tree({**other, "blocks": other["blocks"][:1]})
  with pytest.raises(ValueError, match="block_0: weights of shape"):
    st.write(1, w=np.zeros(3, np.float32))
  chex.assert_trees_all_equal(st.to_tree(), other)  # refused writes changed nothing


def test_master_weights_live_in_pinned_host_memory_and_are_written_in_place():
  st = create(model_cfg(), jax.random.key(0))
  g = st.blocks[0]
  assert g.w.sharding.memory_kind == "pinned_host"
  st.write(1, w=np.arange(g.size, dtype=np.float32))
  on_device = st.fetch(1)
  assert on_device.sharding.memory_kind == "device"
  np.testing.assert_array_equal(np.asarray(on_device)[:3], [0.0, 1.0, 2.0])
