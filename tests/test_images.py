"""Images: pixels, grids and expanded token ids equal transformers' processors (their PIL
backends), M-RoPE positions equal its get_rope_index, and loading refuses bad files in one line."""

import functools
import io
import json
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image
from tokenizers import Tokenizer

from mtjax.data.images import (ClipImages, ImageProcessor, SiglipImages, encode, load_image,
                               mrope_positions)
from test_chat import SPECIALS, make_tokenizer

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from transformers import (Gemma3Processor, LlavaProcessor, PreTrainedTokenizerFast,
                          Qwen2_5_VLProcessor, Qwen3VLProcessor)
from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil
from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil
from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLConfig
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel
from transformers.processing_utils import ProcessorMixin

VISION = ["<image>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>",
          "<start_of_image>", "<end_of_image>", "<image_soft_token>"]
GEMMA_TOKENS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                "image_token": "<image_soft_token>"}
QWEN_IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"


def images():
  """Odd sizes (PIL's width x height) in the modes a dataset holds: RGB, RGBA, L, P with a
  transparent colour, and one smaller than every crop."""
  rng = np.random.default_rng(0)
  pixels = lambda h, w, c: rng.integers(0, 256, (h, w, c), dtype=np.uint8)
  palette = Image.fromarray(pixels(40, 23, 3)).quantize(16)
  palette.info["transparency"] = 3
  return [Image.fromarray(pixels(53, 37, 3)), Image.fromarray(pixels(29, 41, 4), "RGBA"),
          Image.fromarray(pixels(45, 30, 1)[..., 0], "L"), palette,
          Image.fromarray(pixels(12, 9, 3)), Image.fromarray(pixels(70, 90, 3))]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
  return make_tokenizer(tmp_path_factory.mktemp("tok"), specials=SPECIALS + VISION)


def hf_tokenizer(directory, **extra):
  return PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json"),
                                 extra_special_tokens=extra)


@pytest.fixture
def without_video_processor(monkeypatch):
  """The Qwen processors take no video processor here (it needs torchvision)."""
  check = ProcessorMixin.check_argument_for_proper_class
  monkeypatch.setattr(ProcessorMixin, "check_argument_for_proper_class",
                      lambda self, name, arg: None if arg is None else check(self, name, arg))


def llava_clip(tok_dir):  # crop taller than the resized image: the zero-padded crop
  return LlavaProcessor(CLIPImageProcessorPil(size={"shortest_edge": 30},
                                              crop_size={"height": 32, "width": 28}),
                        hf_tokenizer(tok_dir), patch_size=7, num_additional_image_tokens=1,
                        vision_feature_select_strategy="default")


def llava_padded(tok_dir):
  return LlavaProcessor(LlavaImageProcessorPil(do_pad=True, size={"shortest_edge": 21},
                                               crop_size={"height": 21, "width": 21}),
                        hf_tokenizer(tok_dir), patch_size=7, vision_feature_select_strategy="full")


def gemma3(tok_dir):
  return Gemma3Processor(Gemma3ImageProcessorPil(size={"height": 32, "width": 24}),
                         hf_tokenizer(tok_dir, **GEMMA_TOKENS), image_seq_length=5)


def qwen2_5_vl(tok_dir):  # factor 12: the tiny image is enlarged, the 90x70 one shrunk
  return Qwen2_5_VLProcessor(Qwen2VLImageProcessorPil(patch_size=6, min_pixels=12 * 12 * 4,
                                                      max_pixels=12 * 12 * 16),
                             hf_tokenizer(tok_dir), None)


def qwen3_vl(tok_dir):
  return Qwen3VLProcessor(Qwen2VLImageProcessorPil(patch_size=8, image_mean=[0.5] * 3,
                                                   image_std=[0.5] * 3, min_pixels=16 * 16 * 2,
                                                   max_pixels=16 * 16 * 12),
                          hf_tokenizer(tok_dir), None)


def save(hf, directory):
  """save_pretrained, but a Qwen processor without its video processor as the Hub's folders hold
  one: preprocessor_config.json naming the processor class, beside the tokenizer."""
  if getattr(hf, "video_processor", True) is not None:
    return hf.save_pretrained(directory)
  hf.image_processor.save_pretrained(directory)
  hf.tokenizer.save_pretrained(directory)
  config = json.loads((directory / "preprocessor_config.json").read_text())
  config["processor_class"] = type(hf).__name__
  (directory / "preprocessor_config.json").write_text(json.dumps(config))


CASES = {"llava_clip": (llava_clip, "llava", "<image>"),
         "llava_padded": (llava_padded, "llava", "<image>"),
         "gemma3": (gemma3, "gemma3", "<start_of_image>"),
         "qwen2_5_vl": (qwen2_5_vl, "qwen2_5_vl", QWEN_IMAGE),
         "qwen3_vl": (qwen3_vl, "qwen3_vl", QWEN_IMAGE)}


@pytest.mark.parametrize("case", list(CASES))
def test_pixels_grids_and_ids_equal_the_processors(tmp_path, tokenizer_dir, case,
                                                   without_video_processor):
  build, family, placeholder = CASES[case]
  hf = build(tokenizer_dir)
  save(hf, tmp_path)
  processor = ImageProcessor.from_dir(tmp_path)
  assert processor.family == family
  tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
  ims = images()
  text = ("<|im_start|>user\nLook at " + ", then ".join(f"{i}: {placeholder}" for i in range(len(ims)))
          + "\n\nWhat differs?<|im_end|>\n<|im_start|>assistant\nThe colours.<|im_end|>\n")
  got = encode(text, ims, processor, tok)
  want = hf(images=ims, text=[text], add_special_tokens=False)
  np.testing.assert_array_equal(got.input_ids, want["input_ids"][0])
  assert got.input_ids.dtype == np.int32
  types = want.get("mm_token_type_ids", want.get("token_type_ids"))
  if types is None:  # LLaVA's processor returns none: its image tokens are the <image> ids
    types = [np.asarray(want["input_ids"][0]) == tok.token_to_id("<image>")]
  np.testing.assert_array_equal(got.token_type_ids, types[0])
  assert got.token_type_ids.sum() > len(ims)
  if "image_grid_thw" in want:
    np.testing.assert_array_equal(got.image_grid_thw, want["image_grid_thw"])
    pixels = np.concatenate(got.pixel_values)
  else:
    assert got.image_grid_thw is None
    pixels = np.stack(got.pixel_values)
  assert pixels.dtype == np.float32
  np.testing.assert_allclose(pixels, np.asarray(want["pixel_values"]), rtol=0, atol=1e-5)


@pytest.mark.parametrize("ours, hf", [
    (SiglipImages, SiglipImageProcessorPil(size={"height": 20, "width": 28})),
    (SiglipImages, Gemma3ImageProcessorPil(size={"height": 17, "width": 17}, do_rescale=False,
                                           image_mean=[100, 120, 140], image_std=[50, 60, 70])),
    (ClipImages, CLIPImageProcessorPil(size={"height": 26, "width": 22}, crop_size=20)),
    (ClipImages, CLIPImageProcessorPil(size=25, do_center_crop=False, do_normalize=False)),
])
def test_pixels_of_an_image_processor_alone_equal_its(ours, hf):
  preprocess = ours.from_config(hf.to_dict())
  for image in images():
    want = hf(image)["pixel_values"][0]
    got = preprocess(load_image(image))
    assert got.shape == want.shape and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


def test_the_older_layout_reads_as_the_nested_one(tmp_path, tokenizer_dir):
  """preprocessor_config.json beside a flat processor_config.json (folders saved before
  transformers 5) is the same processor as transformers 5's nested processor_config.json."""
  hf = gemma3(tokenizer_dir)
  hf.save_pretrained(tmp_path / "nested")
  older = tmp_path / "older"
  hf.image_processor.save_pretrained(older)
  (older / "processor_config.json").write_text(
      json.dumps({"image_seq_length": 5, "processor_class": "Gemma3Processor"}))
  (older / "tokenizer_config.json").write_text(
      json.dumps({"extra_special_tokens": GEMMA_TOKENS}))
  assert ImageProcessor.from_dir(older) == ImageProcessor.from_dir(tmp_path / "nested")
  # A Qwen image processor alone, as the Hub's Qwen3-VL folders name it (...Fast), is Qwen2-VL's.
  config = {**Qwen2VLImageProcessorPil(patch_size=16).to_dict(),
            "image_processor_type": "Qwen2VLImageProcessorFast"}
  processor = ImageProcessor.from_configs(config)
  assert processor.family == "qwen2_vl" and processor.images.patch_size == 16
  # Sizes as integers, as the oldest CLIP configs hold them.
  assert (ClipImages.from_config({"size": 25, "crop_size": 20})
          == ClipImages.from_config({"size": {"shortest_edge": 25},
                                     "crop_size": {"height": 20, "width": 20}}))


@pytest.mark.parametrize("config, processor, message", [
    ({"image_processor_type": "ViTImageProcessor"}, {}, "image processor ViTImageProcessor"),
    ({"image_processor_type": "CLIPImageProcessor"}, {"processor_class": "PaliGemmaProcessor"},
     "processor PaliGemmaProcessor"),
    ({"image_processor_type": "SiglipImageProcessor"}, {}, "SiglipImageProcessor without"),
    ({"image_processor_type": "Gemma3ImageProcessor", "do_pan_and_scan": True}, {},
     "do_pan_and_scan"),
    ({"image_processor_type": "CLIPImageProcessor"}, {"processor_class": "Qwen2VLProcessor"},
     "Qwen2VLProcessor with a CLIPImageProcessor"),
    ({"image_processor_type": "CLIPImageProcessor"}, {}, "without a patch_size"),
])
def test_unsupported_processors_are_refused_in_one_line(config, processor, message):
  with pytest.raises(ValueError, match=message) as e:
    ImageProcessor.from_configs(config, processor)
  assert "\n" not in str(e.value)


def test_load_image_reads_paths_bytes_and_datasets_values(tmp_path):
  rgba = Image.fromarray(np.random.default_rng(1).integers(0, 256, (7, 5, 4), np.uint8), "RGBA")
  rgba.save(tmp_path / "a.png")
  want = np.asarray(load_image(rgba))  # transparency composited onto white
  assert want.shape == (7, 5, 3)
  for source in ["a.png", tmp_path / "a.png", (tmp_path / "a.png").read_bytes(),
                 {"bytes": None, "path": str(tmp_path / "a.png")}]:
    np.testing.assert_array_equal(np.asarray(load_image(source, base=tmp_path)), want)
  upright = Image.new("RGB", (6, 4))
  exif = upright.getexif()
  exif[0x0112] = 6  # Orientation: rotate 90 degrees to show
  buf = io.BytesIO()
  upright.save(buf, "JPEG", exif=exif)
  assert load_image(buf.getvalue()).size == (4, 6)


def test_a_missing_or_unreadable_image_is_one_line_naming_it(tmp_path):
  with pytest.raises(ValueError, match=r"image .*gone\.png: no such file") as e:
    load_image("gone.png", base=tmp_path)
  assert "\n" not in str(e.value)
  (tmp_path / "bad.jpg").write_bytes(b"not an image\n at all")
  with pytest.raises(ValueError, match=r"image .*bad\.jpg: unreadable") as e:
    load_image(tmp_path / "bad.jpg")
  assert "\n" not in str(e.value)
  buf = io.BytesIO()
  Image.new("RGB", (16, 16)).save(buf, "PNG")
  with pytest.raises(ValueError, match=r"image <20 bytes>: unreadable"):
    load_image(buf.getvalue()[:20])


def test_placeholders_and_images_must_agree(tmp_path, tokenizer_dir):
  llava_clip(tokenizer_dir).save_pretrained(tmp_path)
  processor = ImageProcessor.from_dir(tmp_path)
  tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
  with pytest.raises(ValueError, match="the text has 2 <image> for 1 images"):
    encode("<image> and <image>", images()[:1], processor, tok)
  with pytest.raises(ValueError, match="no such file"):
    encode("<image>", ["gone.png"], processor, tok, base=tmp_path)


def segments(*parts):
  """Token types and grids of one row from ("text", n), ("image", (t, h, w)) and ("video", ...)
  parts; merge size 2."""
  types, grids = [], {1: [], 2: []}
  for kind, arg in parts:
    if kind == "text":
      types += [0] * arg
    else:
      code = 1 if kind == "image" else 2
      t, h, w = arg
      frames = [(1, h, w)] * t if kind == "frames" else [(t, h, w)]
      for i, grid in enumerate(frames):
        types += [code] * (grid[0] * h * w // 4) + ([0, 0] if i < len(frames) - 1 else [])
      grids[code].append(arg)
  return types, grids[1], grids[2]


def hf_rope_index(model_cls, config, rows, pad_left, seconds=None):
  """transformers' get_rope_index over the padded batch of `rows` (its `self` is only config)."""
  length = max(len(types) for types, _, _ in rows)
  types_BxT, mask_BxT = torch.zeros(len(rows), length, dtype=torch.long), torch.zeros(
      len(rows), length, dtype=torch.long)
  for b, (types, _, _) in enumerate(rows):
    span = slice(length - len(types), length) if pad_left else slice(0, len(types))
    types_BxT[b, span], mask_BxT[b, span] = torch.tensor(types), 1
  grids = lambda i: (torch.tensor([g for row in rows for g in row[i]])
                     if any(row[i] for row in rows) else None)
  self = SimpleNamespace(config=config, get_vision_position_ids=functools.partial(
      model_cls.get_vision_position_ids, None))
  extra = {} if seconds is None else {"second_per_grid_ts": torch.tensor(seconds)}
  positions, deltas = model_cls.get_rope_index(
      self, torch.ones_like(types_BxT), mm_token_type_ids=types_BxT, image_grid_thw=grids(1),
      video_grid_thw=grids(2), attention_mask=mask_BxT, **extra)
  return types_BxT.numpy(), mask_BxT.numpy(), positions.numpy(), deltas.numpy()[:, 0]


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
@pytest.mark.parametrize("pad_left", [False, True])
def test_mrope_positions_equal_get_rope_index(family, pad_left):
  frames = "video" if family == "qwen2_5_vl" else "frames"  # Qwen3-VL: timestamps between frames
  rows = [segments(("text", 7)),
          segments(("text", 3), ("image", (1, 4, 6)), ("text", 5)),
          segments(("text", 2), ("image", (1, 6, 2)), ("text", 1), ("image", (1, 2, 8)),
                   ("text", 4)),
          segments(("text", 2), (frames, (3, 4, 2)), ("text", 2))]
  if family == "qwen2_5_vl":
    config, model, seconds = Qwen2_5_VLConfig(vision_config={"tokens_per_second": 3}), \
        Qwen2_5_VLModel, [0.7]
  else:
    config, model, seconds = Qwen3VLConfig(), Qwen3VLModel, None
  types, mask, want, want_deltas = hf_rope_index(model, config, rows, pad_left, seconds)
  for b, (_, images_, videos) in enumerate(rows):
    got, delta = mrope_positions(types[b], images_ or None, family=family, attention_mask=mask[b],
                                 video_grid_thw=videos or None, second_per_grid_ts=seconds,
                                 tokens_per_second=3)
    assert got.shape == (3, types.shape[1]) and got.dtype == np.int64
    np.testing.assert_array_equal(got, want[:, b])
    assert delta == want_deltas[b]
