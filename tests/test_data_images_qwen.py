"""Qwen2.5-VL and Qwen2-VL image chats through the data pipeline at one fixed square size
(`--image-size N`, or the side the processor's min_pixels = max_pixels pins): prepare ->
{split}.pixels -> Batch.images as the tower's patches, held to transformers' Qwen2_5_VLProcessor
(ids, pixel_values, image_grid_thw), and a Qwen2.5-VL fine-tuned on them end to end."""

import dataclasses
import json
import shutil

import numpy as np
import pytest
from PIL import Image
from tokenizers import Tokenizer

from mtjax import config, data
from mtjax.data import images as images_lib
from numerics import assert_close
from test_chat import SPECIALS, make_tokenizer
from test_data import prepare_cli, prepared_cfg
from test_data_images import conversations, docs, save_images, write_jsonl
from test_data_images import write_processor as write_llava

# Qwen2-VL's template over content parts, trimmed: an image part is its vision block.
TEMPLATE = ("{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' }}"
            "{%- for p in message['content'] %}{%- if p['type'] == 'image' %}"
            "{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
            "{%- else %}{{- p['text'] }}{%- endif %}{%- endfor %}{{- '<|im_end|>\\n' }}"
            "{%- endfor %}"
            "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
VISION = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
SIDE, PATCH, MERGE = 56, 14, 2  # 4 x 4 patches, 2 x 2 image tokens an image
QWEN = {"image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor",
        "patch_size": PATCH, "merge_size": MERGE, "temporal_patch_size": 2, "resample": 3,
        "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "image_mean": list(images_lib.OPENAI_CLIP_MEAN),
        "image_std": list(images_lib.OPENAI_CLIP_STD),
        "size": {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280}}  # dynamic


def write_processor(directory, **image):
  """preprocessor_config.json naming the processor class, as the Hub's Qwen folders hold it."""
  (directory / "preprocessor_config.json").write_text(json.dumps({**QWEN, **image}))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
  d = make_tokenizer(tmp_path_factory.mktemp("model"), template=TEMPLATE, specials=SPECIALS + VISION)
  write_processor(d)
  return d


def vision(image_id, **kw):
  return config.VisionConfig(**{**dict(
      tower="qwen2_5_vl", projector="merger", act="silu", image_size=SIDE, patch=PATCH,
      merge=MERGE, image_token_id=image_id, max_images=2), **kw})


def hf_processor(model_dir, monkeypatch, **image):
  """Qwen2_5_VLProcessor whose min_pixels = max_pixels = SIDE^2 unless `image` says otherwise
  (no video processor: it needs torchvision)."""
  transformers = pytest.importorskip("transformers")
  from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
  from transformers.processing_utils import ProcessorMixin
  check = ProcessorMixin.check_argument_for_proper_class
  monkeypatch.setattr(ProcessorMixin, "check_argument_for_proper_class",
                      lambda self, name, arg: None if arg is None else check(self, name, arg))
  tok = transformers.PreTrainedTokenizerFast(
      tokenizer_file=str(model_dir / "tokenizer.json"), eos_token="<|im_end|>",
      extra_special_tokens={"image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
                            "vision_start_token": "<|vision_start|>",
                            "vision_end_token": "<|vision_end|>"})
  images = Qwen2VLImageProcessorPil(**{**dict(
      patch_size=PATCH, merge_size=MERGE, temporal_patch_size=2, min_pixels=SIDE * SIDE,
      max_pixels=SIDE * SIDE), **image})
  return transformers.Qwen2_5_VLProcessor(images, tok, None, chat_template=TEMPLATE)


def reference_images(folder):
  """The images transformers is given: a square one as it is (min = max = SIDE^2 resizes it to
  SIDE x SIDE with the same Pillow call); a non-square one stretched to SIDE x SIDE first, as
  prepare does (transformers would keep its aspect ratio, a grid of its own)."""
  ref = folder / "ref"
  ref.mkdir()
  for f in (folder / "imgs").iterdir():
    image = images_lib.load_image(f)
    if image.width != image.height:
      image = image.resize((SIDE, SIDE), resample=Image.Resampling.BICUBIC)
    image.save(ref / (f.name + ".png"))
  return ref


def test_fixed_size_qwen_chats_equal_the_qwen2_5_vl_processor(tmp_path, model_dir, monkeypatch):
  """Ids equal Qwen2_5_VLProcessor.apply_chat_template's (each image SIDE^2 / (patch merge)^2
  <|image_pad|> inside its vision block); Batch.images are its pixel_values, image by image, of
  grid (1, SIDE/patch, SIDE/patch); the loss counts the answers only; the images are stored as
  uint8 SIDE x SIDE."""
  folder = save_images(tmp_path / "data")
  meta = data.prepare(model_dir, tmp_path / "out", [str(write_jsonl(folder))], fmt="messages",
                      val_fraction=0, progress=False, image_size=SIDE)
  info = meta["images"]
  tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
  image_id = tok.token_to_id("<|image_pad|>")
  assert {k: info[k] for k in ("family", "height", "width", "patch", "merge", "temporal_patch",
                               "tokens_per_image", "image_token_id", "resample")} == {
      "family": "qwen2_5_vl", "height": SIDE, "width": SIDE, "patch": PATCH, "merge": MERGE,
      "temporal_patch": 2, "tokens_per_image": 4, "image_token_id": image_id, "resample": 3}
  assert (tmp_path / "out" / "train.pixels").stat().st_size == 3 * SIDE * SIDE * 3
  proc = hf_processor(model_dir, monkeypatch)
  ref = reference_images(folder)
  want_msgs = conversations(lambda n: {"type": "image", "path": str(ref / (n + ".png"))})
  p = data.Prepared(tmp_path / "out", "train", 10**6)
  v = vision(image_id)
  for d, ((ids, mask, _), msgs) in enumerate(zip(docs(tmp_path / "out"), want_msgs)):
    want = proc.apply_chat_template(msgs, tokenize=True, return_dict=True, return_tensors="np")
    np.testing.assert_array_equal(ids, want["input_ids"][0])
    assert not mask[ids == image_id].any()
    counted = tok.decode(ids[mask == 1].tolist(), skip_special_tokens=False)
    assert counted == "".join(m["content"][0]["text"] + "<|im_end|>" for m in msgs
                              if m["role"] == "assistant")
    if "pixel_values" in want:
      n = len(want["image_grid_thw"])
      np.testing.assert_array_equal(want["image_grid_thw"], [[1, SIDE // PATCH, SIDE // PATCH]] * n)
      patches = p.batch_images([d], v)[0]
      assert patches.shape == (2, (SIDE // PATCH) ** 2, 3 * 2 * PATCH * PATCH)
      assert not patches[n:].any()
      # equal, not close: the same uint8 resize, then the same float32 arithmetic and order
      np.testing.assert_array_equal(patches[:n].reshape(-1, patches.shape[-1]),
                                    want["pixel_values"])


def test_min_pixels_equal_to_max_pixels_pin_the_size(tmp_path, model_dir):
  """A processor whose min_pixels = max_pixels = N^2 (N a multiple of patch x merge) prepares at
  N without --image-size; --image-size overrides it; Qwen2-VL's processor prepares as
  Qwen2.5-VL's."""
  pinned = tmp_path / "pinned"
  shutil.copytree(model_dir, pinned)
  write_processor(pinned, size={"shortest_edge": 84 * 84, "longest_edge": 84 * 84})
  f = str(write_jsonl(save_images(tmp_path / "data")))
  meta = data.prepare(pinned, tmp_path / "a", [f], val_fraction=0, progress=False)
  assert (meta["images"]["height"], meta["images"]["tokens_per_image"]) == (84, 9)
  meta = data.prepare(pinned, tmp_path / "b", [f], val_fraction=0, progress=False,
                      image_size=SIDE)
  assert (meta["images"]["height"], meta["images"]["tokens_per_image"]) == (SIDE, 4)
  qwen2 = tmp_path / "qwen2"
  shutil.copytree(model_dir, qwen2)
  write_processor(qwen2, processor_class="Qwen2VLProcessor")
  meta = data.prepare(qwen2, tmp_path / "c", [f], val_fraction=0, progress=False,
                      image_size=SIDE)
  assert meta["images"]["family"] == "qwen2_vl"
  for x, y in zip(docs(tmp_path / "b"), docs(tmp_path / "c"), strict=True):
    for u, v in zip(x, y):
      np.testing.assert_array_equal(u, v)


def test_bad_sizes_and_mixed_processors_are_refused_in_one_line(tmp_path, model_dir):
  folder = save_images(tmp_path / "data")
  f = str(write_jsonl(folder))
  prepare = lambda tok=model_dir, **kw: data.prepare(tok, tmp_path / "out", [f], val_fraction=0,
                                                     progress=False, **kw)
  llava = tmp_path / "llava"
  shutil.copytree(model_dir, llava)
  (llava / "preprocessor_config.json").unlink()
  write_llava(llava)
  mixed = tmp_path / "mixed"
  shutil.copytree(model_dir, mixed)
  write_processor(mixed, processor_class="LlavaProcessor")
  plain = make_tokenizer(tmp_path / "plain", template=TEMPLATE, specials=SPECIALS)
  cases = [
      (dict(), r"chats\.jsonl:1: qwen2_5_vl \(QwenVLImages\) resizes each image to a size of its "
               r"own .*: pass --image-size N \(a multiple of patch_size x merge_size = 28\)"),
      (dict(processor=model_dir), r"^--processor: qwen2_5_vl .*pass --image-size N"),
      (dict(image_size=50), r"^--image-size: image size 50 is not a positive multiple of "
                            r"patch_size x merge_size = 28 \(the processor of .*\)$"),
      (dict(image_size=-28), r"^--image-size: -28 must be a positive number of pixels$"),
      (dict(image_size=SIDE, processor=llava), r"^--image-size: llava's processor resizes every "
                                               r"image to 28x28 itself"),
      (dict(processor=mixed, image_size=SIDE), r"^--processor: LlavaProcessor with a "
                                               r"Qwen2VLImageProcessor is not supported$"),
      (dict(tok=plain, processor=model_dir, image_size=SIDE),
       r"^--processor: the tokenizer has no <\|image_pad\|> token"),
      (dict(tok=plain, image_size=SIDE), r"^--image-size: .*plain holds no "
                                         r"preprocessor_config\.json"),
  ]
  for kw, message in cases:
    with pytest.raises(ValueError, match=message) as e:
      prepare(**kw)
    assert "\n" not in str(e.value)
  assert not (tmp_path / "out").exists()
  r = prepare_cli("--tokenizer", model_dir, "--out", tmp_path / "out", "--image-size", "30",
                  "--quiet", f, cwd=tmp_path)
  assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
  assert r.stderr.startswith("error: --image-size: image size 30 is not a positive multiple")


def test_training_takes_the_patches_and_refuses_another_grid(tmp_path, model_dir):
  """Padded rows carry each image as the tower's patches [B, M, S, C x frames x patch^2]; a model
  of another image size, patch or merge, or another kind of tower, and a model folder whose
  processor normalises otherwise, are refused in one line."""
  data.prepare(model_dir, tmp_path / "out", [str(write_jsonl(save_images(tmp_path / "data")))],
               val_fraction=0, progress=False, image_size=SIDE)
  out = tmp_path / "out"
  image_id = json.loads((out / "meta.json").read_text())["images"]["image_token_id"]
  b = data.source(prepared_cfg(out, mode="padded"), 3, 64, 10**6, 0, vision(image_id)).batch(0)
  assert b.images.shape == (3, 2, 16, 3 * 2 * PATCH * PATCH) and b.images.dtype == np.float32
  assert sorted((b.inputs == image_id).sum(1).tolist()) == [0, 4, 8]
  src = lambda v: data.source(prepared_cfg(out, mode="padded"), 3, 64, 10**6, 0, v)
  refused = [
      (vision(image_id, image_size=84), r"for 56x56 images, the model's tower takes 84x84"),
      (vision(image_id, patch=7), r"for patches of 14 pixels, 2 x 2 to a token, 2 frames; the "
                                  r"model's tower takes 7, 2 x 2, 2 \(model\.vision\.patch"),
      (config.VisionConfig(image_size=SIDE, patch=PATCH, image_token_id=image_id, max_images=2),
       r"\(qwen2_5_vl\) as images of shape \[16, 1176\], the model's clip tower takes "
       r"\[3, 56, 56\]"),
  ]
  for v, message in refused:
    with pytest.raises(ValueError, match=message) as e:
      src(v)
    assert "\n" not in str(e.value)
  data.check_processor(out, model_dir)  # the model's own (dynamic) processor, at the data's size
  other = tmp_path / "other"
  shutil.copytree(model_dir, other)
  write_processor(other, merge_size=1)
  with pytest.raises(ValueError, match=r"^data\.path: .* with tokens_per_image 4, the model's "
                                       r"processor \(.*other\) has 16; prepare it again"):
    data.check_processor(out, other)


# the tiny model: the tower attends within windows of 28 pixels in block 0, to the whole image in 1
TOWER = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=4, out_hidden_size=32,
             window_size=28, fullatt_block_indexes=[1], patch_size=PATCH, spatial_merge_size=MERGE)


@pytest.mark.soak  # about 30 s on two shared CPU cores: the tower's and the text model's compiles
def test_fine_tune_qwen2_5_vl_on_image_chats_end_to_end(tmp_path, model_dir, monkeypatch):
  """A tiny Qwen2.5-VL saved by transformers, its processor's files beside it: image chats
  prepared with --image-size train a few steps (the loss falls), and the export loads in
  Qwen2_5_VLForConditionalGeneration with logits equal to mtjax's forward of the exported
  weights on a prepared row and its patches."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  import mtjax
  from mtjax import cli, train
  src = tmp_path / "src"
  shutil.copytree(model_dir, src)
  (src / "preprocessor_config.json").unlink()
  proc = hf_processor(model_dir, monkeypatch, min_pixels=SIDE * SIDE, max_pixels=28 * 28 * 64)
  proc.image_processor.save_pretrained(src)  # as the Hub's folders: the processor class named
  saved = json.loads((src / "preprocessor_config.json").read_text())
  (src / "preprocessor_config.json").write_text(json.dumps(
      {**saved, "processor_class": "Qwen2_5_VLProcessor"}))
  tok = Tokenizer.from_file(str(src / "tokenizer.json"))
  ids_of = {t: tok.token_to_id(t) for t in VISION}
  torch.manual_seed(0)
  c = transformers.Qwen2_5_VLConfig(
      vision_config=TOWER,
      text_config=dict(vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=48,
                       num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                       rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3],
                                        "rope_theta": 10000.0}),
      image_token_id=ids_of["<|image_pad|>"], video_token_id=ids_of["<|video_pad|>"],
      vision_start_token_id=ids_of["<|vision_start|>"], vision_end_token_id=ids_of["<|vision_end|>"])
  transformers.Qwen2_5_VLForConditionalGeneration(c).save_pretrained(src)
  folder = save_images(tmp_path / "data")
  r = prepare_cli("--tokenizer", src, "--out", tmp_path / "prepared", "--val-fraction", "0",
                  "--image-size", SIDE, "--quiet", write_jsonl(folder), cwd=tmp_path)
  assert r.returncode == 0, r.stderr
  common = [f"model.from_hf={src}", "model.vision.max_images=2", "engine.compute_dtype=float32",
            "data.source=prepared", f"data.path={tmp_path / 'prepared'}", "data.mode=padded",
            "train.batch=3", "train.seq=48", "train.steps=4", "optim.lr=3e-3",
            "optim.warmup_steps=0", f"train.export_dir={tmp_path / 'out'}",
            "train.export_dtype=float32"]
  with pytest.raises(ValueError, match=r"for 56x56 images, the model's tower takes 448x448"):
    train.run(cli.load_config(None, common), progress=False)  # model.vision.image_size unset
  s = train.run(cli.load_config(None, [*common, f"model.vision.image_size={SIDE}"]),
                progress=False)
  assert s["steps"] == 4 and s["final_loss"] < s["first_loss"]
  m = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
      tmp_path / "out", attn_implementation="eager", dtype=torch.float32).eval()
  got_cfg, params = mtjax.load_hf(tmp_path / "out")
  got_cfg = dataclasses.replace(got_cfg, vision=dataclasses.replace(
      got_cfg.vision, image_size=SIDE, max_images=2))
  p = data.Prepared(tmp_path / "prepared", "train", tok.get_vocab_size())
  ids = p.piece(1, 0, int(p.lengths[1]))[0][None].astype(np.int32)  # two images
  patches = images_lib.pixel_values(p.images(1), p.image_info)
  pixels = patches.reshape(-1, patches.shape[-1])
  grid = np.array([[1, SIDE // PATCH, SIDE // PATCH]] * len(patches))
  image_tokens = (ids == ids_of["<|image_pad|>"]).astype(np.int64)
  with torch.no_grad():
    want = m(input_ids=torch.from_numpy(ids).long(), pixel_values=torch.from_numpy(pixels),
             image_grid_thw=torch.from_numpy(grid),
             mm_token_type_ids=torch.from_numpy(image_tokens)).logits.numpy()
  got = np.asarray(mtjax.forward(got_cfg, params, ids, pixel_values=pixels, image_grid_thw=grid))
  assert_close(got, want, name="logits of the export")
  source = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(src).state_dict()
  trained = m.state_dict()
  moved = {k for k in trained if k in source and not torch.equal(source[k], trained[k])}
  assert any("visual.blocks" in k for k in moved) and any("merger" in k for k in moved)
