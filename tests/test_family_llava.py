"""LLaVA against transformers: the vision tower's layers (mtjax.models.vision) in the block chain,
held to LlavaForConditionalGeneration's fp32 eager forward and torch autograd, through
`mtjax.forward` and through the streaming engine (its (x, features) carry across tiers)."""

import dataclasses
import json

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
from mtjax import cli, data, engine as engine_lib, hf, launch, models, store as store_lib
from mtjax.models.layers import token_nll
from numerics import assert_close

IMAGE = 127  # the image token
TOWER = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
             image_size=28, patch_size=14, projection_dim=16)
TEXT = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2)


def save_llava(directory, seed=0, **config):
  """A random tiny LLaVA (its norms and biases moved off their init) saved to `directory`."""
  torch.manual_seed(seed)
  c = transformers.LlavaConfig(vision_config=transformers.CLIPVisionConfig(**TOWER),
                               text_config=transformers.LlamaConfig(**TEXT),
                               image_token_id=IMAGE, **config)
  m = transformers.LlavaForConditionalGeneration(c)
  with torch.no_grad():
    for name, p in m.named_parameters():
      p.add_(0.3 * torch.randn_like(p) if ("norm" in name or "bias" in name) else 0.1 * p)
  m.save_pretrained(directory)
  return m.eval()


def rows(cfg, T=14, seed=0):
  """Two rows: one with an image, one with two (the second image right after the first); the
  images as Hugging Face's pixel_values [N, C, H, W] in token order."""
  P = cfg.vision.image_tokens
  rng = np.random.default_rng(seed)
  ids = rng.integers(0, IMAGE, (2, T + 1)).astype(np.int32)
  ids[0, 3:3 + P] = IMAGE
  ids[1, 1:1 + 2 * P] = IMAGE
  pixels = rng.standard_normal((3, 3, 28, 28)).astype(np.float32)
  return ids[:, :-1], ids[:, 1:], pixels


def torch_reference(directory, inputs, targets, pixels):
  m = transformers.LlavaForConditionalGeneration.from_pretrained(
      directory, attn_implementation="eager", dtype=torch.float32).eval()
  out = m(input_ids=torch.from_numpy(inputs).long(), pixel_values=torch.from_numpy(pixels))
  loss = torch.nn.functional.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]),
                                           torch.from_numpy(targets).long().reshape(-1))
  loss.backward()
  grads = {k: (p.grad if p.grad is not None else torch.zeros_like(p)).numpy()
           for k, p in m.named_parameters()}
  return m, out.logits.detach().numpy(), float(loss), parity.as_checkpoint(m, grads)


def two_images(cfg):
  return dataclasses.replace(cfg, vision=dataclasses.replace(cfg.vision, max_images=2))


@parity.covers("llava")
def test_llava_equals_transformers(tmp_path):
  """Logits, loss and every gradient (tower, projector, text model) equal transformers'; the
  tower runs only up to the feature layer (its last block and post-norm are never computed)."""
  save_llava(tmp_path)
  cfg, params = mtjax.load_hf(tmp_path)
  v = cfg.vision
  assert cfg.family == "llava" and v.layers == 2 and v.drop_cls and v.image_tokens == 4
  cfg = two_images(cfg)
  inputs, targets, pixels = rows(cfg)
  _, logits, loss, want = torch_reference(tmp_path, inputs, targets, pixels)
  got = np.asarray(mtjax.forward(cfg, params, inputs, pixel_values=pixels))
  assert 0.05 < np.abs(logits).mean() < 20
  assert_close(got, logits, name="logits")
  assert np.max(np.abs(got - logits)) <= 1e-4

  @jax.jit
  def loss_and_grad(params):
    def f(p):
      out = mtjax.forward(cfg, p, inputs, pixel_values=pixels)
      return jnp.mean(token_nll(out.reshape(-1, cfg.vocab_size), jnp.asarray(targets).reshape(-1)))
    return jax.value_and_grad(f)(params)

  value, grads = loss_and_grad(params)
  assert_close(float(value), loss, name="loss")
  grads = mtjax.to_hf_names(cfg, grads)
  # the unused last block and post-norm get no gradient in torch either
  unused = {k for k in want if k.startswith(("vision_tower.encoder.layers.2.",
                                             "vision_tower.post_layernorm."))}
  assert all(not want[k].any() for k in unused)
  assert grads.keys() == want.keys() - unused, grads.keys() ^ (want.keys() - unused)
  for name in grads:
    if name.endswith("k_proj.bias") and name.startswith("vision_tower"):
      # exactly zero: a key bias adds q.b to every score of a query, which the softmax ignores
      # (no RoPE in the tower); both sides hold rounding, measured against the weight's scale
      scale = np.abs(want[name.replace("bias", "weight")]).max()
      assert max(np.abs(grads[name]).max(), np.abs(want[name]).max()) <= 1e-5 * scale, name
      continue
    assert_close(grads[name], want[name], name=name)
  assert np.abs(grads["vision_tower.embeddings.patch_embedding.weight"]).max() > 0
  parity.pieces_cover_every_parameter(cfg)
  # the images matter: other pixels move the logits
  moved = np.asarray(mtjax.forward(cfg, params, inputs, pixel_values=pixels[::-1].copy()))
  assert np.abs(moved - got).max() > 1e-2


def test_backward_modes_of_each_freeze():
  """What the backward does at each group (embed, vision_embed, 2 tower blocks, projector,
  2 text blocks, head) for each train.freeze: a frozen group below which nothing trains ends
  it; a frozen tower with nothing of the tower trained below passes the text stream's
  cotangent; a frozen group with a trained one below passes it through its own vjp."""
  cfg = mtjax.config.load(None, ["model.layers=2", "model.vision.layers=2",
                                 "model.vision.image_token_id=5"]).model
  spec = models.spec(cfg)
  F, D, P, S = "full", "dx", "pass", "skip"
  assert spec.backward_modes(()) == [F] * 8
  assert spec.backward_modes(("vision",)) == [F, P, P, P, F, F, F, F]
  assert spec.backward_modes(("projector",)) == [F, F, F, F, D, F, F, F]
  assert spec.backward_modes(("vision", "projector")) == [F, P, P, P, P, F, F, F]
  assert spec.backward_modes(("language",)) == [S, F, F, F, F, D, D, D]
  assert spec.backward_modes(("projector", "language")) == [S, F, F, F, D, D, D, D]
  assert spec.backward_modes(("vision", "language")) == [S, S, S, S, F, D, D, D]


PARTS = {"vision": "vision_tower.", "projector": "multi_modal_projector.",
         "language": ("language_model.", "lm_head.")}


@pytest.mark.parametrize("freeze", [(), ("vision",), ("projector",), ("vision", "projector"),
                                    ("language",), ("vision", "language")])
def test_engine_step_equals_torch_adamw(tmp_path, freeze):
  """One streamed step over every tier (the embedding on the device, the tower's embedding
  streamed, the rest on the host) equals torch.optim.AdamW on transformers' model, images in
  the batch [B, M, C, H, W]; with train.freeze, torch's frozen parameters are those without
  requires_grad: the frozen groups keep their weights bit for bit, hold no optimizer state, and
  the trained ones still equal torch's (the backward through the frozen parts: a frozen
  projector's cotangent to the text stream, a frozen text model's to the tower)."""
  save_llava(tmp_path)
  lr, B, T = 1e-2, 2, 14
  over = [f"model.from_hf={tmp_path}", "model.vision.max_images=2",
          "engine.compute_dtype=float32", "engine.devices=1", f"train.batch={B}",
          f"train.seq={T}", f"optim.lr={lr}", "optim.warmup_steps=0", "optim.min_lr_ratio=1.0",
          "optim.weight_decay=0.1", "optim.b2=0.99", "optim.eps=1e-4",
          "engine.device_state_layers=1", "engine.device_update_layers=1",
          f"train.freeze=[{','.join(freeze)}]"]
  cfg, _ = launch.plan_run(cli.load_config(None, over))
  assert cfg.model.vision.max_images == 2
  st = store_lib.create(cfg, jax.random.key(0))
  hf.load_into(st, tmp_path)
  before = mtjax.to_hf_names(cfg.model, st.to_tree())
  inputs, targets, pixels = rows(cfg.model, T)
  images, _ = models.vision.image_inputs(cfg.model, inputs, pixels)
  eng = engine_lib.Engine(cfg, st)
  stats = eng.step(data.Batch(inputs, targets, images=images))
  eng.sync()
  got = mtjax.to_hf_names(cfg.model, st.to_tree())
  frozen_groups = [g.name for g in st.groups if not g.opt]
  eng.close()
  assert frozen_groups == [name for name, kind in models.spec(cfg.model).groups
                           if models.spec(cfg.model).part(kind) in freeze]

  m, _, loss, _ = torch_reference(tmp_path, inputs, targets, pixels)
  assert_close(stats.loss, loss, name="cross-entropy before the step")
  m.zero_grad()
  frozen = lambda n: n.startswith(tuple(p for part in freeze for p in np.atleast_1d(PARTS[part])))
  for n, p in m.named_parameters():
    p.requires_grad_(not frozen(n))
  trained = [(n, p) for n, p in m.named_parameters() if not frozen(n)]
  decay = [p for n, p in trained if p.ndim >= 2 and not n.endswith("bias")]
  rest = [p for n, p in trained if not (p.ndim >= 2 and not n.endswith("bias"))]
  opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                           {"params": rest, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.99),
                          eps=1e-4)
  out = m(input_ids=torch.from_numpy(inputs).long(), pixel_values=torch.from_numpy(pixels))
  torch.nn.functional.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]),
                                    torch.from_numpy(targets).long().reshape(-1)).backward()
  opt.step()  # the unused block has no gradient: torch's AdamW leaves it, and mtjax holds none
  want = parity.as_checkpoint(m)
  for name in got:
    if frozen(name):
      np.testing.assert_array_equal(got[name], before[name], err_msg=name)
      continue
    # Adam's per-coordinate step is up to lr whatever the gradient (tests/numerics.py, atol)
    assert_close(got[name], want[name], atol=1e-3 * lr, name=name)
    # what moved is what torch moved (a tower key bias's gradient is exactly zero: it stays)
    assert np.array_equal(got[name], before[name]) == np.array_equal(want[name], before[name]), name


def test_every_spelling_of_the_tensors_loads_the_same(tmp_path):
  """transformers' own files (vision_tower.*, language_model.model.*), the hub's
  (vision_tower.vision_model.*) and the new-style names (model.vision_tower.*, lm_head.weight)
  read as one model."""
  save_llava(tmp_path / "src")
  _, base = mtjax.load_hf(tmp_path / "src")
  tensors = safetensors.numpy.load_file(tmp_path / "src" / "model.safetensors")
  spellings = {
      "hub": lambda k: k.replace("vision_tower.", "vision_tower.vision_model.", 1),
      "new": lambda k: ("lm_head.weight" if k == "language_model.lm_head.weight"
                        else "model." + k.replace("language_model.model.", "language_model.", 1)),
  }
  for name, rename in spellings.items():
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text((tmp_path / "src" / "config.json").read_text())
    safetensors.numpy.save_file({rename(k): v for k, v in tensors.items()},
                                d / "model.safetensors")
    _, params = mtjax.load_hf(d)
    jax.tree.map(np.testing.assert_array_equal, params, base)


def test_export_reloads_in_transformers(tmp_path):
  """The family's own config.json and tensors load in LlavaForConditionalGeneration with
  mtjax's logits (the tower written up to its feature layer, taken as its last)."""
  save_llava(tmp_path / "src")
  cfg, params = mtjax.load_hf(tmp_path / "src")
  spec = models.spec(cfg)
  parts = [params["embed"], *params["blocks"], params["head"]]
  groups = ((g, spec.group_layout(g).flatten(p)) for (g, _), p in zip(spec.groups, parts))
  out = hf.export(tmp_path / "out", cfg, groups, dtype="float32")
  m = transformers.LlavaForConditionalGeneration.from_pretrained(
      out, attn_implementation="eager", dtype=torch.float32).eval()
  cfg = two_images(cfg)
  inputs, _, pixels = rows(cfg)
  with torch.no_grad():
    theirs = m(input_ids=torch.from_numpy(inputs).long(),
               pixel_values=torch.from_numpy(pixels)).logits.numpy()
  assert_close(np.asarray(mtjax.forward(cfg, params, inputs, pixel_values=pixels)), theirs,
               name="logits of the reloaded export")
  back, _ = mtjax.load_hf(out)
  assert dataclasses.replace(two_images(back), from_hf=None) == dataclasses.replace(cfg,
                                                                                   from_hf=None)


@pytest.mark.parametrize("key, value, named", [
    ("vision_feature_layer", [-2, -1], "vision_feature_layer"),
    ("vision_feature_select_strategy", "cls", "vision_feature_select_strategy"),
    ("projector_hidden_act", "relu6", "projector_hidden_act"),
])
def test_unsupported_options_are_refused_in_one_line(tmp_path, key, value, named):
  save_llava(tmp_path)
  path = tmp_path / "config.json"
  config = json.loads(path.read_text())
  config[key] = value
  path.write_text(json.dumps(config))
  with pytest.raises(hf.HFError, match=named) as e:
    mtjax.load_hf(tmp_path)
  assert "\n" not in str(e.value)


def test_image_tokens_without_images_or_beyond_the_slots_are_refused(tmp_path):
  save_llava(tmp_path)
  cfg, params = mtjax.load_hf(tmp_path)  # one image slot
  inputs, _, pixels = rows(two_images(cfg))
  with pytest.raises(ValueError, match="row 1: 8 image tokens"):
    mtjax.forward(cfg, params, inputs, pixel_values=pixels)
  with pytest.raises(ValueError, match="no images"):
    mtjax.forward(two_images(cfg), params, inputs)
