"""Qwen3-VL against transformers: the tower's learned positions and deepstack mergers, the
deepstack features added after the first decoder layers, and interleaved M-RoPE in a Qwen3 text
model, held to Qwen3VLForConditionalGeneration's fp32 eager forward and torch autograd."""

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# After the skip: the parity harness imports torch and transformers.
import jax
import jax.numpy as jnp
import parity

import mtjax
from mtjax import cli, data, engine as engine_lib, hf, launch, models, store as store_lib
from mtjax.models import vision
from mtjax.models.layers import rope_tables, token_nll
from numerics import assert_close

IMAGE = 127  # the image token
SIDE = 96  # pixels a side: 6 x 6 patches of 16 (the 4 x 4 position table resized), 3 x 3 image tokens
GRID = (1, SIDE // 16, SIDE // 16)
TEXT = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
            num_attention_heads=2, num_key_value_heads=1, head_dim=16,
            rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3],
                             "mrope_interleaved": True, "rope_theta": 10000.0})
TOWER = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=4, out_hidden_size=32,
             patch_size=16, num_position_embeddings=16, deepstack_visual_indexes=[0, 1])


def save_qwen3_vl(directory, seed=0):
  """A random tiny model (its norms and biases moved off their init) saved to `directory`."""
  torch.manual_seed(seed)
  m = transformers.Qwen3VLForConditionalGeneration(transformers.Qwen3VLConfig(
      vision_config=TOWER, text_config=TEXT, image_token_id=IMAGE, video_token_id=IMAGE - 1))
  with torch.no_grad():
    for name, p in m.named_parameters():
      moved = any(k in name for k in ("norm", "bias"))
      p.add_(0.3 * torch.randn_like(p) if moved else 0.5 * p)
  m.save_pretrained(directory)
  return m.eval()


def load(directory, max_images=2):
  """mtjax's model of `directory` at this file's image size."""
  cfg, params = mtjax.load_hf(directory)
  return dataclasses.replace(cfg, vision=dataclasses.replace(
      cfg.vision, image_size=SIDE, max_images=max_images)), params


def rows(cfg, T=24, seed=0):
  """Two rows: one with an image, one with two (text between them); the images as Hugging
  Face's pixel_values [N x S, C x frames x patch^2] and image_grid_thw."""
  P = cfg.vision.image_tokens
  rng = np.random.default_rng(seed)
  ids = rng.integers(0, IMAGE - 1, (2, T + 1)).astype(np.int32)
  ids[0, 3:3 + P] = IMAGE
  ids[1, 1:1 + P] = IMAGE
  ids[1, 3 + P:3 + 2 * P] = IMAGE
  pixels = rng.standard_normal((3 * cfg.vision.seq, 3 * 2 * 16 * 16)).astype(np.float32)
  return ids[:, :-1], ids[:, 1:], pixels, np.array([GRID] * 3)


def torch_inputs(inputs, pixels, grid):
  return dict(input_ids=torch.from_numpy(inputs).long(), pixel_values=torch.from_numpy(pixels),
              image_grid_thw=torch.from_numpy(grid),
              mm_token_type_ids=torch.from_numpy((inputs == IMAGE).astype(np.int64)))


def torch_reference(directory, inputs, targets, pixels, grid):
  m = transformers.Qwen3VLForConditionalGeneration.from_pretrained(
      directory, attn_implementation="eager", dtype=torch.float32).eval()
  out = m(**torch_inputs(inputs, pixels, grid))
  loss = torch.nn.functional.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]),
                                           torch.from_numpy(targets).long().reshape(-1))
  loss.backward()
  grads = {k: (p.grad if p.grad is not None else torch.zeros_like(p)).numpy()
           for k, p in m.named_parameters()}
  return m, out.logits.detach().numpy(), float(loss), parity.as_checkpoint(m, grads)


def logits_of(cfg, params, inputs, pixels, grid):
  return np.asarray(jax.jit(lambda p: mtjax.forward(cfg, p, inputs, pixel_values=pixels,
                                                    image_grid_thw=grid))(params))


@parity.covers("qwen3_vl")
def test_qwen3_vl_equals_transformers(tmp_path):
  """Logits, loss and every gradient (tower, position table, deepstack mergers, merger, text
  model) equal transformers'; M-RoPE's positions are its get_rope_index's, its interleaved
  tables its rotary embedding's. Deepstack matters (by 1e3 x the agreement): with its features
  zero the logits move (the interleaving's effect on them: a soak test below)."""
  save_qwen3_vl(tmp_path)
  cfg, params = load(tmp_path)
  assert cfg.family == "qwen3_vl" and cfg.vision.image_tokens == 9
  assert cfg.vision.deepstack == (0, 1) and cfg.rope.mrope_interleaved
  assert [k for _, k in models.spec(cfg).groups[1:]] == [
      "vision_embed", "vision_deepstack", "vision_deepstack", "vision", "projector",
      "block_deepstack2", "block_deepstack1", "block", "head"]
  inputs, targets, pixels, grid = rows(cfg)
  m, logits, loss, want = torch_reference(tmp_path, inputs, targets, pixels, grid)
  theirs, _ = m.model.get_rope_index(**{k: v for k, v in torch_inputs(inputs, pixels, grid).items()
                                        if k != "pixel_values"})
  positions = vision.rope_positions(cfg, inputs)
  np.testing.assert_array_equal(positions, theirs.numpy().transpose(1, 2, 0))

  @jax.jit
  def loss_and_grad(params):
    def f(p):
      out = mtjax.forward(cfg, p, inputs, pixel_values=pixels, image_grid_thw=grid,
                          positions=positions.transpose(2, 0, 1))
      nll = token_nll(out.reshape(-1, cfg.vocab_size), jnp.asarray(targets).reshape(-1))
      return jnp.mean(nll), out
    return jax.value_and_grad(f, has_aux=True)(params)

  (value, got), grads = loss_and_grad(params)
  got = np.asarray(got)
  assert 0.05 < np.abs(logits).mean() < 20
  assert_close(got, logits, name="logits")
  assert np.max(np.abs(got - logits)) <= 1e-4
  assert_close(float(value), loss, name="loss")
  grads = mtjax.to_hf_names(cfg, grads)
  assert grads.keys() == want.keys(), grads.keys() ^ want.keys()
  for name in grads:
    assert_close(grads[name], want[name], name=name)
  for name in ("model.visual.deepstack_merger_list.0.linear_fc2.weight",
               "model.visual.pos_embed.weight"):
    assert np.abs(grads[name]).max() > 0
  parity.pieces_cover_every_parameter(cfg)

  # the interleaved M-RoPE tables are transformers' (the sectioned ones other), and the
  # deepstack features matter: zeroed (their mergers' last linear), the logits move
  with torch.no_grad():
    cos, sin = m.model.language_model.rotary_emb(torch.zeros(1), theirs)
  ours = rope_tables(cfg, jnp.asarray(positions))
  R2 = ours[0].shape[-1]
  np.testing.assert_allclose(ours[0], cos.numpy()[..., :R2], rtol=0, atol=1e-6)
  np.testing.assert_allclose(ours[1], sin.numpy()[..., :R2], rtol=0, atol=1e-6)
  sections = dataclasses.replace(cfg, rope=dataclasses.replace(cfg.rope, mrope_interleaved=False))
  assert np.abs(np.asarray(rope_tables(sections, jnp.asarray(positions))[0]) - ours[0]).max() > 0.1
  spec = models.spec(cfg)
  zero = lambda p: dict(p, deepstack=dict(p["deepstack"], fc2=jax.tree.map(
      jnp.zeros_like, p["deepstack"]["fc2"])))
  unstacked = dict(params, blocks=[zero(p) if k == "vision_deepstack" else p
                                   for (_, k), p in zip(spec.groups[1:-1], params["blocks"])])
  (_, plain), _ = loss_and_grad(unstacked)
  assert np.abs(np.asarray(plain) - got).max() > 1e-3

@pytest.mark.soak
@pytest.mark.parametrize("freeze", [(), ("vision",), ("language",)])
def test_engine_step_equals_torch_adamw(tmp_path, freeze):
  """One streamed step over every tier equals torch.optim.AdamW on transformers' model: the
  deepstack features travel from the tower through the first decoder layers in the engine's
  carry; a frozen part (the tower with its deepstack mergers, or the text model, whose first
  layers then pass the deepstack features' cotangent down) keeps its weights bit for bit."""
  save_qwen3_vl(tmp_path)
  lr, B, T = 1e-2, 2, 24
  over = [f"model.from_hf={tmp_path}", "model.vision.max_images=2",
          f"model.vision.image_size={SIDE}", "engine.compute_dtype=float32", "engine.devices=1",
          f"train.batch={B}", f"train.seq={T}", f"optim.lr={lr}", "optim.warmup_steps=0",
          "optim.min_lr_ratio=1.0", "optim.weight_decay=0.1", "optim.b2=0.99", "optim.eps=1e-4",
          "engine.device_state_layers=1", "engine.device_update_layers=1",
          f"train.freeze=[{','.join(freeze)}]"]
  cfg, _ = launch.plan_run(cli.load_config(None, over))
  st = store_lib.create(cfg, jax.random.key(0))
  hf.load_into(st, tmp_path)
  before = mtjax.to_hf_names(cfg.model, st.to_tree())
  inputs, targets, pixels, grid = rows(cfg.model, T)
  images, _ = vision.image_inputs(cfg.model, inputs, pixels, grid)
  eng = engine_lib.Engine(cfg, st)
  stats = eng.step(data.Batch(inputs, targets, images=images))
  eng.sync()
  got = mtjax.to_hf_names(cfg.model, st.to_tree())
  eng.close()

  m, _, loss, _ = torch_reference(tmp_path, inputs, targets, pixels, grid)
  assert_close(stats.loss, loss, name="cross-entropy before the step")
  m.zero_grad()
  tower = lambda n: n.startswith("model.visual.") and not n.startswith("model.visual.merger.")
  frozen = lambda n: (("vision" in freeze and tower(n))
                      or ("language" in freeze and n.startswith(("model.language_model.", "lm_head."))))
  named = dict(m.named_parameters())
  assert named.keys() == parity.as_checkpoint(m).keys()
  for n, p in named.items():
    p.requires_grad_(not frozen(n))
  trained = [(n, p) for n, p in named.items() if not frozen(n)]
  decay = [p for n, p in trained if p.ndim >= 2 and not n.endswith("bias")]
  rest = [p for n, p in trained if not (p.ndim >= 2 and not n.endswith("bias"))]
  opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                           {"params": rest, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.99),
                          eps=1e-4)
  out = m(**torch_inputs(inputs, pixels, grid))
  torch.nn.functional.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]),
                                    torch.from_numpy(targets).long().reshape(-1)).backward()
  opt.step()
  want = parity.as_checkpoint(m)
  for name in got:
    if frozen(name):
      np.testing.assert_array_equal(got[name], before[name], err_msg=name)
      continue
    assert_close(got[name], want[name], atol=1e-3 * lr, name=name)


@pytest.mark.soak
def test_export_reloads_in_transformers(tmp_path):
  """The family's own config.json and tensors load in transformers with mtjax's logits, and read
  back as the same config."""
  save_qwen3_vl(tmp_path / "src")
  cfg, params = load(tmp_path / "src")
  spec = models.spec(cfg)
  parts = [params["embed"], *params["blocks"], params["head"]]
  groups = ((g, spec.group_layout(g).flatten(p)) for (g, _), p in zip(spec.groups, parts))
  out = hf.export(tmp_path / "out", cfg, groups, dtype="float32")
  m = transformers.Qwen3VLForConditionalGeneration.from_pretrained(
      out, attn_implementation="eager", dtype=torch.float32).eval()
  inputs, _, pixels, grid = rows(cfg)
  with torch.no_grad():
    theirs = m(**torch_inputs(inputs, pixels, grid)).logits.numpy()
  assert_close(logits_of(cfg, params, inputs, pixels, grid), theirs,
               name="logits of the reloaded export")
  back, _ = load(out)
  assert dataclasses.replace(back, from_hf=None) == dataclasses.replace(cfg, from_hf=None)


def test_the_top_level_spelling_of_the_tensors_loads_the_same(tmp_path):
  """The tower and text model at the top (visual.*, model.*) read as transformers 5's saved
  names (model.visual.*, model.language_model.*)."""
  import safetensors.numpy

  save_qwen3_vl(tmp_path / "src")
  _, base = mtjax.load_hf(tmp_path / "src")
  tensors = safetensors.numpy.load_file(tmp_path / "src" / "model.safetensors")
  assert any(k.startswith("model.visual.") for k in tensors) and "lm_head.weight" in tensors
  rename = lambda k: (k[len("model."):] if k.startswith("model.visual.")
                      else k.replace("model.language_model.", "model.", 1))
  d = tmp_path / "old"
  d.mkdir()
  (d / "config.json").write_text((tmp_path / "src" / "config.json").read_text())
  safetensors.numpy.save_file({rename(k): v for k, v in tensors.items()}, d / "model.safetensors")
  _, params = mtjax.load_hf(d)
  jax.tree.map(np.testing.assert_array_equal, params, base)


@pytest.mark.soak
def test_a_tower_without_deepstack_is_the_model_with_zero_deepstack_features(tmp_path):
  """model.vision.deepstack=() (no features beside x, plain tower blocks and decoder layers)
  computes what the full model does with its deepstack mergers' outputs zeroed; M-RoPE in
  consecutive sections instead of interleaved moves the logits."""
  save_qwen3_vl(tmp_path)
  cfg, params = load(tmp_path)
  inputs, _, pixels, grid = rows(cfg)
  spec = models.spec(cfg)
  zero = lambda p: dict(p, deepstack=dict(p["deepstack"], fc2=jax.tree.map(
      jnp.zeros_like, p["deepstack"]["fc2"])))
  deep = [k == "vision_deepstack" for _, k in spec.groups[1:-1]]
  zeroed = dict(params, blocks=[zero(p) if d else p for d, p in zip(deep, params["blocks"])])
  plain = dict(params, blocks=[{k: v for k, v in p.items() if k != "deepstack"}
                               for p in params["blocks"]])
  no_stack = dataclasses.replace(cfg, vision=dataclasses.replace(cfg.vision, deepstack=()))
  assert "vision_deepstack" not in dict(models.spec(no_stack).groups).values()
  full = logits_of(cfg, zeroed, inputs, pixels, grid)
  np.testing.assert_allclose(logits_of(no_stack, plain, inputs, pixels, grid), full, rtol=0,
                             atol=1e-6)
  sections = dataclasses.replace(cfg, rope=dataclasses.replace(cfg.rope, mrope_interleaved=False))
  assert np.abs(logits_of(sections, zeroed, inputs, pixels, grid) - full).max() > 1e-3
