"""Gemma 3's vision-language model against transformers: the SigLIP tower and the pooled projector
(mtjax.models.vision) in the block chain, the image tokens attending to each other within each
run of them (mtjax.models.layers.image_groups), held to Gemma3ForConditionalGeneration's fp32
eager forward (given token_type_ids, as its processor returns them) and torch autograd, through
`mtjax.forward` and through the streaming engine.

The tiny model pools a 4 x 4 patch grid to 2 x 2 image tokens, so that each image spans several
positions, and its sliding layer's window (3) is shorter than a run of image tokens: a query sees
its image's later tokens whatever the window, its earlier ones only within it.
"""

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

IMAGE = 95  # the image token (the last of the vocabulary)
TOWER = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             image_size=28, patch_size=7, layer_norm_eps=1e-5, vision_use_head=False)
TEXT = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=3,
            num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"],
            rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}},
            pad_token_id=None, rms_norm_eps=1e-6)


def save_gemma3(directory, seed=0, **config):
  """A random tiny Gemma 3 VLM (its norms, biases and projection moved off their init) saved to
  `directory`."""
  torch.manual_seed(seed)
  c = transformers.Gemma3Config(text_config=TEXT, vision_config=TOWER, mm_tokens_per_image=4,
                                image_token_index=IMAGE, **config)
  m = transformers.Gemma3ForConditionalGeneration(c)
  with torch.no_grad():
    for name, p in m.named_parameters():
      if "norm" in name or "bias" in name or "projection" in name:
        p.add_(0.3 * torch.randn_like(p))
  m.save_pretrained(directory)
  return m.eval()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  d = tmp_path_factory.mktemp("gemma3_vl") / "src"
  save_gemma3(d)
  return d


def rows(T=14, seed=0):
  """Two rows: one with two images a text token apart (two runs), one with two images side by
  side (one run of 8, as transformers' block mask reads it); the images as Hugging Face's
  pixel_values [N, C, H, W] in token order."""
  rng = np.random.default_rng(seed)
  ids = rng.integers(0, IMAGE, (2, T + 1)).astype(np.int32)
  ids[0, 2:6] = ids[0, 7:11] = IMAGE
  ids[1, 1:9] = IMAGE
  pixels = rng.standard_normal((4, 3, 28, 28)).astype(np.float32)
  return ids[:, :-1], ids[:, 1:], pixels


def torch_model(directory):
  return transformers.Gemma3ForConditionalGeneration.from_pretrained(
      directory, attn_implementation="eager", dtype=torch.float32).eval()


def torch_logits(m, inputs, pixels=None, token_types=True):
  """transformers' logits; with `token_types`, the token_type_ids that turn on its image blocks."""
  kw = {} if pixels is None else dict(pixel_values=torch.from_numpy(pixels))
  if token_types and pixels is not None:
    kw["token_type_ids"] = torch.from_numpy((inputs == IMAGE).astype(np.int64))
  return m(input_ids=torch.from_numpy(inputs).long(), **kw).logits


def torch_reference(directory, inputs, targets, pixels):
  m = torch_model(directory)
  logits = torch_logits(m, inputs, pixels)
  loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                           torch.from_numpy(targets).long().reshape(-1))
  loss.backward()
  grads = {k: (p.grad if p.grad is not None else torch.zeros_like(p)).numpy()
           for k, p in m.named_parameters()}
  return m, logits.detach().numpy(), loss.item(), parity.as_checkpoint(m, grads)


def two_images(cfg):
  return dataclasses.replace(cfg, vision=dataclasses.replace(cfg.vision, max_images=2))


@parity.covers("gemma3_vl")
def test_gemma3_vl_equals_transformers(checkpoint):
  """Logits, loss and every gradient (tower, projector, text model) equal transformers'."""
  cfg, params = mtjax.load_hf(checkpoint)
  v = cfg.vision
  assert cfg.family == "gemma3_vl" and (v.tower, v.projector, v.image_attention) == (
      "siglip", "pool", "bidirectional")
  assert (v.seq, v.image_tokens, v.norm_eps, v.act) == (16, 4, 1e-5, "gelu_tanh")
  cfg = two_images(cfg)
  inputs, targets, pixels = rows()
  _, logits, loss, want = torch_reference(checkpoint, inputs, targets, pixels)

  @jax.jit  # one compile: the logits ride along as the loss's auxiliary output
  def loss_and_grad(params):
    def f(p):
      out = mtjax.forward(cfg, p, inputs, pixel_values=pixels)
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
    if name.endswith("k_proj.bias") and name.startswith("vision_tower"):
      # exactly zero: a key bias adds q.b to every score of a query, which the softmax ignores
      # (no RoPE in the tower); both sides hold rounding, measured against the weight's scale
      scale = np.abs(want[name.replace("bias", "weight")]).max()
      assert max(np.abs(grads[name]).max(), np.abs(want[name]).max()) <= 1e-5 * scale, name
      continue
    assert_close(grads[name], want[name], name=name)
  # the images reach the loss: their path's first and last weights have a gradient
  assert np.abs(grads["vision_tower.embeddings.patch_embedding.weight"]).max() > 0
  assert np.abs(grads["multi_modal_projector.mm_input_projection_weight"]).max() > 0
  parity.pieces_cover_every_parameter(cfg)


def test_causal_image_attention_moves_the_logits(checkpoint):
  """With model.vision.image_attention causal the image tokens attend as text: the logits equal
  transformers' without token_type_ids (its causal mask), not those with them (its image
  blocks, which the bidirectional default equals); a text-only batch still runs, as transformers'
  text-only forward, with image slots or with none."""
  cfg, params = mtjax.load_hf(checkpoint)
  cfg = two_images(cfg)
  inputs, _, pixels = rows()
  text = inputs.clip(0, IMAGE - 1)
  m = torch_model(checkpoint)
  with torch.no_grad():
    blocks = torch_logits(m, inputs, pixels).numpy()
    causal = torch_logits(m, inputs, pixels, token_types=False).numpy()
    text_only = torch_logits(m, text).numpy()
  as_text = dataclasses.replace(cfg, vision=dataclasses.replace(cfg.vision,
                                                                image_attention="causal"))
  # model.vision.max_images 0: text-only batches, the tower computing nothing
  no_slots = dataclasses.replace(cfg, vision=dataclasses.replace(cfg.vision, max_images=0))
  got_causal, got_text, got_no_slots = jax.jit(lambda p: (
      mtjax.forward(as_text, p, inputs, pixel_values=pixels), mtjax.forward(cfg, p, text),
      mtjax.forward(no_slots, p, text)))(params)
  assert np.abs(blocks - causal).max() > 1e-2
  assert_close(np.asarray(got_causal), causal, name="causal logits")
  assert_close(np.asarray(got_text), text_only, name="text-only logits")
  assert_close(np.asarray(got_no_slots), text_only, name="text-only logits without image slots")
  with pytest.raises(ValueError, match="row 0: 8 image tokens; 0 image"):
    mtjax.forward(no_slots, params, inputs)


@pytest.mark.soak
def test_blockwise_kernel_equals_transformers(checkpoint):
  """The blockwise kernel (the cuDNN path's fallback beside image groups) in the whole model."""
  cfg, params = mtjax.load_hf(checkpoint)
  cfg = two_images(cfg)
  inputs, _, pixels = rows()
  with torch.no_grad():
    want = torch_logits(torch_model(checkpoint), inputs, pixels).numpy()
  got = jax.jit(lambda p: mtjax.forward(cfg, p, inputs, pixel_values=pixels,
                                        attention="blockwise"))(params)
  assert_close(np.asarray(got), want, name="blockwise logits")


PARTS = {"vision": "vision_tower.", "projector": "multi_modal_projector.",
         "language": ("language_model.", "lm_head.")}


def frozen_name(freeze):
  """Whether a tensor belongs to a frozen part (the tower's post-norm is the projector's group
  in mtjax, the tower's in transformers: neither variant here freezes one without the other)."""
  prefixes = tuple(p for part in freeze for p in np.atleast_1d(PARTS[part]))
  return lambda n: n.startswith(prefixes)


def check_engine_step(directory, freeze):
  """One streamed step over every tier equals torch.optim.AdamW on transformers' model, images
  in the batch [B, M, C, H, W]; with train.freeze, mtjax's frozen groups keep their weights bit
  for bit and the trained ones still equal torch's (the backward through the frozen parts)."""
  lr, B, T = 1e-2, 2, 14
  over = [f"model.from_hf={directory}", "model.vision.max_images=2",
          "engine.compute_dtype=float32", "engine.devices=1", f"train.batch={B}",
          f"train.seq={T}", f"optim.lr={lr}", "optim.warmup_steps=0", "optim.min_lr_ratio=1.0",
          "optim.weight_decay=0.1", "optim.b2=0.99", "optim.eps=1e-4",
          "engine.device_state_layers=1", "engine.device_update_layers=1",
          f"train.freeze=[{','.join(freeze)}]"]
  cfg, _ = launch.plan_run(cli.load_config(None, over))
  assert cfg.model.vision.image_attention == "bidirectional"
  st = store_lib.create(cfg, jax.random.key(0))
  hf.load_into(st, directory)
  before = mtjax.to_hf_names(cfg.model, st.to_tree())
  inputs, targets, pixels = rows(T)
  images, _ = models.vision.image_inputs(cfg.model, inputs, pixels)
  eng = engine_lib.Engine(cfg, st)
  stats = eng.step(data.Batch(inputs, targets, images=images))
  eng.sync()
  got = mtjax.to_hf_names(cfg.model, st.to_tree())
  eng.close()

  # torch trains every parameter: freezing changes no other gradient nor another's AdamW step
  m = torch_model(directory)
  params = list(m.named_parameters())
  decay = [p for n, p in params if p.ndim >= 2 and not n.endswith("bias")]
  rest = [p for n, p in params if not (p.ndim >= 2 and not n.endswith("bias"))]
  opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                           {"params": rest, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.99),
                          eps=1e-4)
  logits = torch_logits(m, inputs, pixels)
  loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                           torch.from_numpy(targets).long().reshape(-1))
  assert_close(stats.loss, float(loss), name="cross-entropy before the step")
  loss.backward()
  opt.step()
  want = parity.as_checkpoint(m)
  frozen = frozen_name(freeze)
  assert any(map(frozen, got)) == bool(freeze)
  for name in got:
    if frozen(name):
      np.testing.assert_array_equal(got[name], before[name], err_msg=name)
      continue
    # Adam's per-coordinate step is up to lr whatever the gradient (tests/numerics.py, atol)
    assert_close(got[name], want[name], atol=1e-3 * lr, name=name)


@pytest.mark.soak
@pytest.mark.parametrize("freeze", [(), ("vision", "projector"), ("language",)])
def test_engine_step_equals_torch_adamw(checkpoint, freeze):
  check_engine_step(checkpoint, freeze)


def test_every_spelling_of_the_tensors_loads_the_same(checkpoint, tmp_path):
  """transformers' own files (vision_tower.*, language_model.model.*), the hub's
  (vision_tower.vision_model.*) and the new-style names (model.vision_tower.*, lm_head.weight)
  read as one model; SigLIP's unused attention-pooling head is tolerated."""
  _, base = mtjax.load_hf(checkpoint)
  tensors = safetensors.numpy.load_file(checkpoint / "model.safetensors")
  assert not any(k.startswith("vision_tower.head.") for k in tensors)
  head = {"vision_tower.head.probe": np.zeros((1, 1, 32), np.float32)}
  spellings = {
      "hub": lambda k: k.replace("vision_tower.", "vision_tower.vision_model.", 1),
      "new": lambda k: ("lm_head.weight" if k == "language_model.lm_head.weight"
                        else "model." + k.replace("language_model.model.", "language_model.", 1)),
  }
  for name, rename in spellings.items():
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text((checkpoint / "config.json").read_text())
    safetensors.numpy.save_file({rename(k): v for k, v in {**tensors, **head}.items()},
                                d / "model.safetensors")
    _, params = mtjax.load_hf(d)
    jax.tree.map(np.testing.assert_array_equal, params, base)


@pytest.mark.soak
@pytest.mark.parametrize("source", [True, False])
def test_export_reloads_in_transformers(checkpoint, tmp_path, source):
  """The export, with the source's config.json or the family's own, loads in
  Gemma3ForConditionalGeneration with mtjax's logits, and back in mtjax as the same model."""
  cfg, params = mtjax.load_hf(checkpoint)
  spec = models.spec(cfg)
  parts = [params["embed"], *params["blocks"], params["head"]]
  groups = ((g, spec.group_layout(g).flatten(p)) for (g, _), p in zip(spec.groups, parts))
  out = hf.export(tmp_path / "out", cfg, groups, dtype="float32",
                  source_dir=checkpoint if source else None)
  if not source:
    assert json.loads((out / "config.json").read_text())["vision_config"]["vision_use_head"] is False
  m = torch_model(out)
  inputs, _, pixels = rows()
  with torch.no_grad():
    theirs = torch_logits(m, inputs, pixels).numpy()
  cfg = two_images(cfg)
  assert_close(np.asarray(mtjax.forward(cfg, params, inputs, pixel_values=pixels)), theirs,
               name="logits of the reloaded export")
  back, _ = mtjax.load_hf(out)
  assert dataclasses.replace(two_images(back), from_hf=None) == dataclasses.replace(cfg,
                                                                                   from_hf=None)


@pytest.mark.parametrize("key, value, named", [
    ("mm_tokens_per_image", 3, "mm_tokens_per_image"),
    ("image_token_index", 96, "image_token_index"),
    ("vision_config", {"model_type": "clip_vision_model"}, "vision_config.model_type"),
])
def test_unsupported_options_are_refused_in_one_line(checkpoint, tmp_path, key, value, named):
  config = json.loads((checkpoint / "config.json").read_text())
  config[key] = value
  with pytest.raises(models.FamilyError, match=named) as e:
    models.read_hf_config(config)
  assert "\n" not in str(e.value)
