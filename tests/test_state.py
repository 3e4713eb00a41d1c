"""Host state: flat layouts, layout-independent init, 12 bytes/param in host memory."""

import chex
import jax
import numpy as np
import pytest

from mtjax import config, state as state_lib


def model_cfg(**kw):
  return config.ModelConfig(**{**dict(vocab_size=64, hidden=32, layers=2, heads=4, ffn=48), **kw})


def test_layout_round_trips_and_puts_matrices_first():
  cfg = model_cfg(qkv_bias=True)
  lay = state_lib.layouts(cfg)["block"]
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
  st = state_lib.create(cfg, jax.random.key(0))
  D, F, V, hd = 32, 48, 64, 8
  block = D * D * 2 + 2 * D * (2 * hd) + 3 * D * F + 2 * D
  assert st.n_params == V * D + 3 * block + D + D * V
  assert st.host_bytes() == 12 * st.n_params


def test_init_is_independent_of_layout_and_model_depth():
  a = state_lib.create(model_cfg(layers=1), jax.random.key(3)).to_tree()
  b = state_lib.create(model_cfg(layers=3), jax.random.key(3)).to_tree()
  chex.assert_trees_all_equal(a["embed"], b["embed"])
  chex.assert_trees_all_equal(a["blocks"][0], b["blocks"][0])
  chex.assert_trees_all_equal(a["head"], b["head"])
  c = state_lib.create(model_cfg(layers=1), jax.random.key(4)).to_tree()
  assert not np.allclose(a["embed"]["table"], c["embed"]["table"])
  w = a["blocks"][0]["attn"]["q"]["kernel"]
  assert abs(w.std() - 0.02) < 0.004 and np.all(a["blocks"][0]["attn_norm"]["scale"] == 1)


def test_load_tree_round_trips_and_checks_depth():
  cfg = model_cfg()
  st = state_lib.create(cfg, jax.random.key(0))
  other = state_lib.create(cfg, jax.random.key(1)).to_tree()
  st.load_tree(other)
  chex.assert_trees_all_equal(st.to_tree(), other)
  with pytest.raises(ValueError, match="blocks"):
    st.load_tree({**other, "blocks": other["blocks"][:1]})


def test_master_weights_live_in_pinned_host_memory_and_are_written_in_place():
  st = state_lib.create(model_cfg(), jax.random.key(0))
  g = st.blocks[0]
  assert g.w.sharding.memory_kind == "pinned_host"
  g.w_np[:3] = [1.0, 2.0, 3.0]
  on_device = jax.device_put(g.w, jax.sharding.SingleDeviceSharding(jax.devices()[0]))
  assert on_device.sharding.memory_kind == "device"
  np.testing.assert_array_equal(np.asarray(on_device)[:3], [1.0, 2.0, 3.0])
