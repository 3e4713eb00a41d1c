"""Qwen2.5-VL and Qwen2-VL against transformers: the Qwen vision towers (mtjax.models.qwen_vision)
in the block chain and M-RoPE in the text attention, held to their ForConditionalGeneration's
fp32 eager forward and torch autograd, through `mtjax.forward` and the streaming engine."""

import dataclasses
import json
import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# After the skip: the parity harness imports torch and transformers.
import jax
import jax.numpy as jnp
import parity
import safetensors.numpy

import mtjax
from mtjax import attention, cli, data, engine as engine_lib, hf, launch, models, store as store_lib
from mtjax.config import VisionConfig
from mtjax.models import qwen2_5_vl, qwen_vision, vision
from mtjax.models.layers import Ctx, rope_tables, token_nll
from numerics import assert_close

IMAGE = 127  # the image token
SIDE = 84  # pixels a side: 6 x 6 patches, 3 x 3 image tokens; windows of 2 x 2 tokens split it unevenly
GRID = (1, SIDE // 14, SIDE // 14)
TEXT = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1,
            rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3],
                             "rope_theta": 10000.0})
TOWERS = {
    # block 0 attends within windows of 56 pixels, block 1 to the whole image
    "qwen2_5_vl": dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=4,
                       out_hidden_size=32, window_size=56, fullatt_block_indexes=[1]),
    "qwen2_vl": dict(depth=2, embed_dim=32, mlp_ratio=2, num_heads=4, hidden_size=32),
}
CLASSES = {"qwen2_5_vl": (transformers.Qwen2_5_VLConfig,
                          transformers.Qwen2_5_VLForConditionalGeneration),
           "qwen2_vl": (transformers.Qwen2VLConfig, transformers.Qwen2VLForConditionalGeneration)}


def save_qwen(directory, family="qwen2_5_vl", seed=0):
  """A random tiny model (its norms and biases moved off their init) saved to `directory`."""
  torch.manual_seed(seed)
  config_cls, model_cls = CLASSES[family]
  m = model_cls(config_cls(vision_config=TOWERS[family], text_config=TEXT, image_token_id=IMAGE,
                           video_token_id=IMAGE - 1))
  with torch.no_grad():
    for name, p in m.named_parameters():
      moved = any(k in name for k in ("norm", "bias", "ln_q"))
      p.add_(0.3 * torch.randn_like(p) if moved else 0.5 * p)
  m.save_pretrained(directory)
  return m.eval()


def load(directory, max_images=2):
  """mtjax's model of `directory` at this file's image size."""
  cfg, params = mtjax.load_hf(directory)
  return dataclasses.replace(cfg, vision=dataclasses.replace(
      cfg.vision, image_size=SIDE, max_images=max_images)), params


def rows(cfg, T=30, seed=0):
  """Two rows: one with an image, one with two (text between them); the images as Hugging
  Face's pixel_values [N x S, C x frames x patch^2] and image_grid_thw."""
  P = cfg.vision.image_tokens
  rng = np.random.default_rng(seed)
  ids = rng.integers(0, IMAGE - 1, (2, T + 1)).astype(np.int32)
  ids[0, 3:3 + P] = IMAGE
  ids[1, 1:1 + P] = IMAGE
  ids[1, 3 + P:3 + 2 * P] = IMAGE
  pixels = rng.standard_normal((3 * cfg.vision.seq, 3 * 2 * 14 * 14)).astype(np.float32)
  return ids[:, :-1], ids[:, 1:], pixels, np.array([GRID] * 3)


def torch_inputs(inputs, pixels, grid):
  return dict(input_ids=torch.from_numpy(inputs).long(), pixel_values=torch.from_numpy(pixels),
              image_grid_thw=torch.from_numpy(grid),
              mm_token_type_ids=torch.from_numpy((inputs == IMAGE).astype(np.int64)))


def torch_reference(directory, family, inputs, targets, pixels, grid):
  m = CLASSES[family][1].from_pretrained(directory, attn_implementation="eager",
                                         dtype=torch.float32).eval()
  out = m(**torch_inputs(inputs, pixels, grid))
  loss = torch.nn.functional.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]),
                                           torch.from_numpy(targets).long().reshape(-1))
  loss.backward()
  grads = {k: (p.grad if p.grad is not None else torch.zeros_like(p)).numpy()
           for k, p in m.named_parameters()}
  return m, out.logits.detach().numpy(), float(loss), parity.as_checkpoint(m, grads)


def check_against_transformers(directory, family):
  save_qwen(directory, family)
  cfg, params = load(directory)
  assert cfg.family == family and cfg.vision.image_tokens == 9
  inputs, targets, pixels, grid = rows(cfg)
  m, logits, loss, want = torch_reference(directory, family, inputs, targets, pixels, grid)
  # the positions are transformers' get_rope_index
  theirs, _ = m.model.get_rope_index(**{k: v for k, v in torch_inputs(inputs, pixels, grid).items()
                                        if k != "pixel_values"})
  np.testing.assert_array_equal(vision.rope_positions(cfg, inputs), theirs.numpy().transpose(1, 2, 0))

  @jax.jit
  def loss_and_grad(params, positions_3xBxT):
    def f(p):
      out = mtjax.forward(cfg, p, inputs, pixel_values=pixels, image_grid_thw=grid,
                          positions=positions_3xBxT)
      nll = token_nll(out.reshape(-1, cfg.vocab_size), jnp.asarray(targets).reshape(-1))
      return jnp.mean(nll), out
    return jax.value_and_grad(f, has_aux=True)(params)

  # what mtjax.forward computes without positions (the export test calls it so)
  (value, got), grads = loss_and_grad(params, vision.rope_positions(cfg, inputs).transpose(2, 0, 1))
  got = np.asarray(got)
  assert 0.05 < np.abs(logits).mean() < 20
  assert_close(got, logits, name="logits")
  assert np.max(np.abs(got - logits)) <= 1e-4
  assert_close(float(value), loss, name="loss")
  grads = mtjax.to_hf_names(cfg, grads)
  assert grads.keys() == want.keys(), grads.keys() ^ want.keys()
  for name in grads:
    assert_close(grads[name], want[name], name=name)
  assert np.abs(grads["visual.patch_embed.proj.weight"]).max() > 0
  parity.pieces_cover_every_parameter(cfg)
  return cfg, params, inputs, pixels, grid, got, loss_and_grad


@parity.covers("qwen2_5_vl")
def test_qwen2_5_vl_equals_transformers(tmp_path):
  """Logits, loss and every gradient (tower, merger, text model) equal transformers'; M-RoPE's
  positions are its get_rope_index's. Each feature matters (by 1e3 x the agreement): plain RoPE
  positions move the logits, a window block computes otherwise as a whole-image one; a row
  without images is plain RoPE."""
  cfg, params, inputs, pixels, grid, got, loss_and_grad = check_against_transformers(
      tmp_path, "qwen2_5_vl")
  T = inputs.shape[1]
  mrope = vision.rope_positions(cfg, inputs).transpose(2, 0, 1)
  (_, unrotated), _ = loss_and_grad(params, np.broadcast_to(np.arange(T), mrope.shape))
  assert np.abs(np.asarray(unrotated) - got).max() > 1e-3  # M-RoPE's image positions matter
  # a window block attends within its windows: as a whole-image block it computes otherwise
  assert [k for _, k in models.spec(cfg).groups[1:5]] == [
      "vision_embed", "vision_window", "vision", "projector"]
  x = np.zeros((2, T, cfg.hidden), np.float32)
  images, slots = vision.image_inputs(cfg, inputs, pixels, grid)
  ctx = Ctx(jnp.asarray(mrope.transpose(1, 2, 0)), None, jnp.asarray(images), jnp.asarray(slots))
  block = lambda windowed: jax.jit(lambda p, carry: qwen_vision.Block(cfg.vision, windowed).apply(
      {"params": p}, carry, ctx)[0][1])
  carry = models.spec(cfg).block("vision_embed").apply({"params": params["blocks"][0]}, x, ctx)[0]
  windowed = block(True)(params["blocks"][1], carry)
  assert np.abs(np.asarray(block(False)(params["blocks"][1], carry) - windowed)).max() > 1e-3
  # a row without images: M-RoPE's three streams are its token index, the tables plain RoPE's
  text = np.random.default_rng(1).integers(0, IMAGE - 1, (1, 12)).astype(np.int32)
  streams = vision.rope_positions(cfg, text)
  np.testing.assert_array_equal(streams, np.broadcast_to(np.arange(12)[None, :, None], (1, 12, 3)))
  for a, b in zip(rope_tables(cfg, jnp.asarray(streams)), rope_tables(cfg, jnp.arange(12)[None])):
    np.testing.assert_array_equal(a, b)


def test_windows_that_tile_the_grid_are_gathered_to_the_masked_attention():
  """A window block's attention on a grid its windows tile (8 x 8 patches, windows of 4 x 4)
  runs per window, and equals the whole image's scores masked to each window (the form this
  file's transformers parity holds, on a grid the windows do not tile)."""
  v = VisionConfig(tower="qwen2_5_vl", projector="merger", act="silu", image_size=112,
                   window=56, hidden=32, heads=4)
  ids = qwen_vision.window_ids(v)
  assert np.bincount(ids).tolist() == [16] * 4
  q, k, val = np.random.default_rng(0).standard_normal((3, 2, 64, 4, 8)).astype(np.float32)
  segments = np.broadcast_to(ids, (2, 64))
  want = jax.jit(lambda q, k, val: attention.dense_attention(
      q, k, val, causal=False, segments_q_BxT=segments, segments_k_BxS=segments))(q, k, val)
  got = jax.jit(lambda q, k, val: qwen_vision.window_attention(v, q, k, val))(q, k, val)
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


@pytest.mark.soak
@parity.covers("qwen2_vl")
def test_qwen2_vl_equals_transformers(tmp_path):
  """Qwen2-VL's tower (LayerNorms, a quick-gelu MLP, no windows) and text model: logits, loss and
  every gradient equal transformers'."""
  cfg, *_ = check_against_transformers(tmp_path, "qwen2_vl")
  assert cfg.vision.window is None
  assert {k for _, k in models.spec(cfg).groups} >= {"vision_embed", "vision", "projector"}


PARTS = {"vision": "visual.blocks.", "projector": "visual.merger.",
         "language": ("model.", "lm_head.")}


@pytest.mark.soak
@pytest.mark.parametrize("freeze", [(), ("vision",), ("language",)])
def test_engine_step_equals_torch_adamw(tmp_path, freeze):
  """One streamed step over every tier equals torch.optim.AdamW on transformers' model, the
  patches in the batch [B, M, S, C x frames x patch^2] and M-RoPE's positions from the image
  tokens; a frozen part keeps its weights bit for bit and the trained ones still equal torch's."""
  save_qwen(tmp_path)
  lr, B, T = 1e-2, 2, 30
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

  m, _, loss, _ = torch_reference(tmp_path, "qwen2_5_vl", inputs, targets, pixels, grid)
  assert_close(stats.loss, loss, name="cross-entropy before the step")
  m.zero_grad()
  frozen = lambda n: n.startswith(tuple(p for part in freeze for p in np.atleast_1d(PARTS[part])))
  # transformers 5's module names -> the saved ones
  saved = lambda n: next((re.sub(a, b, n) for a, b in qwen2_5_vl.RENAMES if re.match(a, n)), n)
  named = {saved(n): p for n, p in m.named_parameters()}
  assert named.keys() == parity.as_checkpoint(m).keys()
  # the tower's patch embedding is the vision part's too
  frozen_ = lambda n: frozen(n) or ("vision" in freeze and n.startswith("visual.patch_embed."))
  for n, p in named.items():
    p.requires_grad_(not frozen_(n))
  trained = [(n, p) for n, p in named.items() if not frozen_(n)]
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
    if frozen_(name):
      np.testing.assert_array_equal(got[name], before[name], err_msg=name)
      continue
    assert_close(got[name], want[name], atol=1e-3 * lr, name=name)


def test_both_spellings_of_the_tensors_load_the_same(tmp_path):
  """What transformers saves (visual.*, model.*, lm_head.weight: the published checkpoints'
  names) and transformers 5's module names (model.visual.*, model.language_model.*) read as one
  model."""
  save_qwen(tmp_path / "src")
  _, base = mtjax.load_hf(tmp_path / "src")
  tensors = safetensors.numpy.load_file(tmp_path / "src" / "model.safetensors")
  assert any(k.startswith("visual.") for k in tensors) and "lm_head.weight" in tensors
  rename = lambda k: ("model." + k if k.startswith("visual.")
                      else k.replace("model.", "model.language_model.", 1))
  d = tmp_path / "new"
  d.mkdir()
  (d / "config.json").write_text((tmp_path / "src" / "config.json").read_text())
  safetensors.numpy.save_file({rename(k): v for k, v in tensors.items()}, d / "model.safetensors")
  _, params = mtjax.load_hf(d)
  jax.tree.map(np.testing.assert_array_equal, params, base)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen2_vl"])
def test_the_published_config_layout_reads_the_same(tmp_path, family):
  """The hub's files (transformers 4): the text model's keys at the top level, M-RoPE as
  rope_scaling {"type": "mrope"}, rope_theta beside it, the tower's channels as in_chans."""
  save_qwen(tmp_path, family)
  cfg, _ = mtjax.load_hf(tmp_path)
  path = tmp_path / "config.json"
  config = json.loads(path.read_text())
  text = config.pop("text_config")
  rope = text.pop("rope_parameters")
  text.update(rope_theta=rope["rope_theta"], model_type=config["model_type"],
              rope_scaling={"type": "mrope", "mrope_section": rope["mrope_section"]})
  tower = config["vision_config"]
  tower["in_chans"] = tower.pop("in_channels")
  tower.pop("rope_parameters")
  path.write_text(json.dumps({**config, **text}))
  old, _ = mtjax.load_hf(tmp_path)
  assert old == cfg


@pytest.mark.soak
@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen2_vl"])
def test_export_reloads_in_transformers(tmp_path, family):
  """The family's own config.json and tensors load in transformers with mtjax's logits, and read
  back as the same config."""
  save_qwen(tmp_path / "src", family)
  cfg, params = load(tmp_path / "src")
  spec = models.spec(cfg)
  parts = [params["embed"], *params["blocks"], params["head"]]
  groups = ((g, spec.group_layout(g).flatten(p)) for (g, _), p in zip(spec.groups, parts))
  out = hf.export(tmp_path / "out", cfg, groups, dtype="float32")
  m = CLASSES[family][1].from_pretrained(out, attn_implementation="eager",
                                         dtype=torch.float32).eval()
  inputs, _, pixels, grid = rows(cfg)
  with torch.no_grad():
    theirs = m(**torch_inputs(inputs, pixels, grid)).logits.numpy()
  assert_close(np.asarray(mtjax.forward(cfg, params, inputs, pixel_values=pixels,
                                        image_grid_thw=grid)), theirs,
               name="logits of the reloaded export")
  back, _ = load(out)
  assert dataclasses.replace(back, from_hf=None) == dataclasses.replace(cfg, from_hf=None)


def test_other_grids_and_broken_runs_are_refused_in_one_line(tmp_path):
  save_qwen(tmp_path)
  cfg, params = load(tmp_path)
  inputs, _, pixels, grid = rows(cfg)
  with pytest.raises(ValueError, match=r"image_grid_thw: grid \(1, 8, 6\)") as e:
    mtjax.forward(cfg, params, inputs, pixel_values=pixels, image_grid_thw=[[1, 8, 6]] * 3)
  assert "\n" not in str(e.value)
  joined = inputs.copy()
  joined[1, 1 + 9:3 + 9] = IMAGE  # the row's two images one run of tokens
  with pytest.raises(ValueError, match="row 1: .* one run") as e:
    mtjax.forward(cfg, params, joined, pixel_values=pixels, image_grid_thw=grid)
  assert "\n" not in str(e.value)
  config = json.loads((tmp_path / "config.json").read_text())
  config["vision_config"]["out_hidden_size"] = 48
  (tmp_path / "config.json").write_text(json.dumps(config))
  with pytest.raises(hf.HFError, match="out_hidden_size"):
    mtjax.load_hf(tmp_path)
