"""Images of vision-language data, prepared as each family's Hugging Face processor prepares them.

  load_image       an RGB image from a path (relative to a base folder), bytes or a PIL image
  ImageProcessor   a model's processor folder: its pixel preprocessing and image placeholders
                   (`at_size`: Qwen-VL's at one square size, which prepared data stores)
  pixel_values     stored uint8 images as the tower takes them (normalised; Qwen-VL: patches)
  encode           chat-templated text and its images -> input ids, token types, pixels, grids
  mrope_positions  Qwen2-VL / Qwen2.5-VL / Qwen3-VL's [3, T] positions and rope delta of one row

The references are transformers' PIL backends (`image_processing_pil_*.py`), its processors
(`processing_*.py`) and `get_rope_index`: the same Pillow resize of the uint8 RGB image, then the
same float32 arithmetic, so the pixels are theirs.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
from PIL import Image, ImageOps

from mtjax.data.chat import token_text

Family = Literal["llava", "gemma3", "qwen2_vl", "qwen2_5_vl", "qwen3_vl"]
Source = str | os.PathLike | bytes | Image.Image | dict

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
HALF = (0.5, 0.5, 0.5)  # SigLIP's and Gemma 3's mean and std (transformers' IMAGENET_STANDARD_*)
BILINEAR, BICUBIC = 2, 3  # PIL.Image.Resampling values, as a config's `resample` stores them

# A processor's class -> the family whose placeholders it expands.
FAMILIES: dict[str, Family] = {
    "LlavaProcessor": "llava", "Gemma3Processor": "gemma3", "Qwen2VLProcessor": "qwen2_vl",
    "Qwen2_5_VLProcessor": "qwen2_5_vl", "Qwen3VLProcessor": "qwen3_vl"}
# The family of an image processor saved without a processor class.
_DEFAULT_FAMILY: dict[str, Family] = {
    "CLIPImageProcessor": "llava", "LlavaImageProcessor": "llava",
    "Gemma3ImageProcessor": "gemma3", "Qwen2VLImageProcessor": "qwen2_vl"}

_UNREADABLE = (OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombError)


def to_rgb(image: Image.Image) -> Image.Image:
  """RGB as transformers' `convert_to_rgb`: transparency is composited onto white."""
  if "A" in image.getbands() or image.info.get("transparency") is not None:
    rgba = image.convert("RGBA")
    white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    return Image.alpha_composite(white, rgba).convert("RGB")
  return image.convert("RGB")


def load_image(source: Source, base: str | os.PathLike | None = None) -> Image.Image:
  """An RGB image, decoded whole.

  A file (or bytes) is turned upright by its EXIF orientation, as transformers' `load_image` and
  `datasets` do; a PIL image is taken as it is. Either way it becomes RGB as the processors'
  `convert_to_rgb` makes it.

  Args:
    source: a path (relative to `base` unless absolute), the file's bytes, a `datasets` Image
      value ({"bytes", "path"}) or a PIL image.
    base: the folder a relative path is read from.

  Returns:
    The image in mode RGB.

  Raises:
    ValueError: naming the path, when the file is missing or is not a readable image.
  """
  if isinstance(source, Image.Image):
    return to_rgb(source)
  if isinstance(source, dict):
    if source.get("bytes") is not None:
      source = source["bytes"]
    elif source.get("path"):
      source = source["path"]
    else:
      raise ValueError("image: a dict with neither bytes nor a path")
  if isinstance(source, (bytes, bytearray, memoryview)):
    data = bytes(source)
    name, opener = f"<{len(data)} bytes>", lambda: Image.open(io.BytesIO(data))
  else:
    path = Path(source)
    if base is not None and not path.is_absolute():
      path = Path(base) / path
    if not path.is_file():
      raise ValueError(f"image {path}: no such file")
    name, opener = str(path), lambda: Image.open(path)
  try:
    with opener() as image:
      image.load()
      return to_rgb(ImageOps.exif_transpose(image))
  except _UNREADABLE as e:
    reason = (str(e).splitlines() or [type(e).__name__])[0]
    raise ValueError(f"image {name}: unreadable ({reason})") from e


@dataclasses.dataclass(frozen=True)
class Norm:
  """Rescale, then normalize per channel, in transformers' arithmetic (float64 product, float32)."""
  rescale_factor: float | None = 1 / 255  # multiplies the uint8 values; None: do_rescale false
  mean: tuple[float, ...] | None = OPENAI_CLIP_MEAN  # per RGB channel; None: do_normalize false
  std: tuple[float, ...] | None = OPENAI_CLIP_STD  # per RGB channel

  @classmethod
  def from_config(cls, cfg: dict, mean: tuple[float, ...], std: tuple[float, ...]) -> Norm:
    """From an image processor config; `mean` and `std` are the class defaults."""
    rescale = cfg.get("rescale_factor", 1 / 255) if cfg.get("do_rescale", True) else None
    if not cfg.get("do_normalize", True):
      return cls(rescale, None, None)
    return cls(rescale, _channels(cfg.get("image_mean", mean)), _channels(cfg.get("image_std", std)))

  def __call__(self, x_HxWxC: np.ndarray) -> np.ndarray:
    if self.rescale_factor is not None:
      x_HxWxC = (x_HxWxC.astype(np.float64) * self.rescale_factor).astype(np.float32)
    else:
      x_HxWxC = x_HxWxC.astype(np.float32)
    if self.mean is not None:
      x_HxWxC = (x_HxWxC - np.array(self.mean, np.float32)) / np.array(self.std, np.float32)
    return x_HxWxC


def _channels(value: float | Sequence[float]) -> tuple[float, ...]:
  return tuple(float(v) for v in value) if isinstance(value, (list, tuple)) else (float(value),) * 3


def _resize(image: Image.Image, height: int, width: int, resample: int) -> np.ndarray:
  return np.asarray(image.resize((width, height), resample=resample))


def _center_crop(x_HxWxC: np.ndarray, height: int, width: int) -> np.ndarray:
  """transformers' center_crop: the middle, zero-padded first where the image is smaller."""
  h, w = x_HxWxC.shape[:2]
  top, left = (h - height) // 2, (w - width) // 2
  if top >= 0 and left >= 0:
    return x_HxWxC[top:top + height, left:left + width]
  new_h, new_w = max(height, h), max(width, w)
  padded = np.zeros((new_h, new_w, x_HxWxC.shape[2]), x_HxWxC.dtype)
  pad_top, pad_left = -(-(new_h - h) // 2), -(-(new_w - w) // 2)
  padded[pad_top:pad_top + h, pad_left:pad_left + w] = x_HxWxC
  top, left = top + pad_top, left + pad_left
  return padded[max(0, top):min(new_h, top + height), max(0, left):min(new_w, left + width)]


def _pad_to_square(image: Image.Image, fill: tuple[int, ...]) -> Image.Image:
  """LlavaImageProcessor's pad_to_square: centred on the longer side, filled with `fill`."""
  w, h = image.size
  if w == h:
    return image
  side = max(w, h)
  square = np.empty((side, side, 3), np.uint8)
  square[:] = np.array(fill, np.uint8)
  top, left = (side - h) // 2 if w > h else 0, (side - w) // 2 if h > w else 0
  square[top:top + h, left:left + w] = np.asarray(image)
  return Image.fromarray(square)


@dataclasses.dataclass(frozen=True)
class ClipImages:
  """CLIPImageProcessor (LLaVA) and LlavaImageProcessor: resize, center crop, normalize."""
  shortest_edge: int | None = 224  # the shorter side is resized to this, keeping the aspect ratio
  size: tuple[int, int] | None = None  # (height, width) to resize to, when shortest_edge is None
  crop: tuple[int, int] | None = (224, 224)  # (height, width) of the center crop; None: no crop
  resample: int = BICUBIC  # PIL resampling filter
  pad_fill: tuple[int, ...] | None = None  # LlavaImageProcessor's do_pad: square, this colour
  norm: Norm = Norm()  # rescale and normalize

  @classmethod
  def from_config(cls, cfg: dict) -> ClipImages:
    size = cfg.get("size", {"shortest_edge": 224}) if cfg.get("do_resize", True) else None
    shortest, hw = None, None
    if isinstance(size, int):  # CLIP's default_to_square=False: an int is the shortest edge
      shortest = size
    elif isinstance(size, dict) and set(size) == {"shortest_edge"}:
      shortest = size["shortest_edge"]
    elif isinstance(size, dict) and set(size) == {"height", "width"}:
      hw = (size["height"], size["width"])
    elif size is not None:
      raise ValueError(f"{cfg.get('image_processor_type')} size {size}: expected shortest_edge or "
                       "height and width")
    crop = None
    if cfg.get("do_center_crop", True):
      c = cfg.get("crop_size", {"height": 224, "width": 224})
      crop = (c, c) if isinstance(c, int) else (c["height"], c["width"])
    norm = Norm.from_config(cfg, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD)
    fill = None
    if cfg.get("do_pad"):  # transformers fills with the mean colour, 0 without normalizing
      fill = tuple(int(m * 255) for m in norm.mean) if norm.mean else (0,)
    return cls(shortest, hw, crop, cfg.get("resample", BICUBIC), fill, norm)

  def geometry(self, image: Image.Image) -> np.ndarray:
    """The image padded, resized and cropped, before any arithmetic: [H, W, 3] uint8."""
    if self.pad_fill is not None:
      image = _pad_to_square(image, self.pad_fill)
    if self.shortest_edge is not None:
      x = _resize(image, *shortest_edge_size(image.height, image.width, self.shortest_edge),
                  self.resample)
    elif self.size is not None:
      x = _resize(image, *self.size, self.resample)
    else:
      x = np.asarray(image)
    if self.crop is not None:
      x = _center_crop(x, *self.crop)
    return x

  @property
  def fixed_size(self) -> tuple[int, int] | None:
    """(height, width) of every image after geometry; None where it follows the input's."""
    return self.crop or self.size

  def __call__(self, image: Image.Image) -> np.ndarray:
    """pixel_values [3, H, W] float32 of an RGB image."""
    return np.ascontiguousarray(self.norm(self.geometry(image)).transpose(2, 0, 1))


def shortest_edge_size(height: int, width: int, edge: int) -> tuple[int, int]:
  """(height, width) with the shorter side `edge`, the longer truncated (transformers' rule)."""
  short, long = (width, height) if width <= height else (height, width)
  new_long = int(edge * long / short)
  return (new_long, edge) if width <= height else (edge, new_long)


@dataclasses.dataclass(frozen=True)
class SiglipImages:
  """SiglipImageProcessor and Gemma3ImageProcessor (without pan and scan): a fixed-size resize."""
  size: tuple[int, int] | None = (224, 224)  # (height, width) to resize to; None: no resize
  resample: int = BILINEAR  # PIL resampling filter (Gemma 3's default; SigLIP's is bicubic)
  norm: Norm = Norm(mean=HALF, std=HALF)  # rescale and normalize

  @classmethod
  def from_config(cls, cfg: dict) -> SiglipImages:
    kind = cfg["image_processor_type"]
    gemma = kind == "Gemma3ImageProcessor"
    if cfg.get("do_pan_and_scan"):
      raise ValueError(f"{kind}: do_pan_and_scan is not supported")
    size = cfg.get("size", {"height": 224, "width": 224}) if cfg.get("do_resize", True) else None
    if isinstance(size, int) and gemma:  # Gemma 3's default_to_square: an int is a square
      size = {"height": size, "width": size}
    if size is not None and not (isinstance(size, dict) and set(size) == {"height", "width"}):
      raise ValueError(f"{kind} size {size}: expected height and width")
    hw = None if size is None else (size["height"], size["width"])
    return cls(hw, cfg.get("resample", BILINEAR if gemma else BICUBIC),
               Norm.from_config(cfg, HALF, HALF))

  def geometry(self, image: Image.Image) -> np.ndarray:
    """The image resized, before any arithmetic: [H, W, 3] uint8."""
    return np.asarray(image) if self.size is None else _resize(image, *self.size, self.resample)

  @property
  def fixed_size(self) -> tuple[int, int] | None:
    """(height, width) of every image after geometry; None where it follows the input's."""
    return self.size

  def __call__(self, image: Image.Image) -> np.ndarray:
    """pixel_values [3, H, W] float32 of an RGB image."""
    return np.ascontiguousarray(self.norm(self.geometry(image)).transpose(2, 0, 1))


def smart_resize(height: int, width: int, factor: int, min_pixels: int,
                 max_pixels: int) -> tuple[int, int]:
  """Qwen2-VL's resize target: sides multiples of `factor`, area within [min, max] pixels."""
  if max(height, width) / min(height, width) > 200:
    raise ValueError(f"image {width}x{height}: aspect ratio above 200")
  h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
  if h_bar * w_bar > max_pixels:
    beta = math.sqrt(height * width / max_pixels)
    h_bar = max(factor, math.floor(height / beta / factor) * factor)
    w_bar = max(factor, math.floor(width / beta / factor) * factor)
  elif h_bar * w_bar < min_pixels:
    beta = math.sqrt(min_pixels / (height * width))
    h_bar = math.ceil(height * beta / factor) * factor
    w_bar = math.ceil(width * beta / factor) * factor
  return h_bar, w_bar


@dataclasses.dataclass(frozen=True)
class QwenVLImages:
  """Qwen2VLImageProcessor (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): smart resize, then patches."""
  min_pixels: int = 56 * 56  # least area after resizing, pixels
  max_pixels: int = 28 * 28 * 1280  # largest area after resizing, pixels
  patch_size: int = 14  # the vision encoder's patch side, pixels
  temporal_patch_size: int = 2  # frames per patch: a still image is repeated this many times
  merge_size: int = 2  # merge_size x merge_size patches become one LLM token
  resample: int = BICUBIC  # PIL resampling filter
  resize: bool = True  # do_resize; without it the sides must be multiples of patch * merge
  norm: Norm = Norm()  # rescale and normalize
  side: int | None = None  # every image resized to side x side (mtjax's fixed grid); None: smart resize

  @classmethod
  def from_config(cls, cfg: dict) -> QwenVLImages:
    size = dict(cfg.get("size") or {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280})
    if cfg.get("min_pixels") is not None:  # the older keys override size, as in transformers
      size["shortest_edge"] = cfg["min_pixels"]
    if cfg.get("max_pixels") is not None:
      size["longest_edge"] = cfg["max_pixels"]
    if not (size.get("shortest_edge") and size.get("longest_edge")):
      raise ValueError(f"Qwen2VLImageProcessor size {size}: expected shortest_edge and longest_edge")
    return cls(size["shortest_edge"], size["longest_edge"], cfg.get("patch_size", 14),
               cfg.get("temporal_patch_size", 2), cfg.get("merge_size", 2),
               cfg.get("resample", BICUBIC), cfg.get("do_resize", True),
               Norm.from_config(cfg, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD))

  @property
  def factor(self) -> int:
    """Pixels a side of one merged token: patch_size x merge_size."""
    return self.patch_size * self.merge_size

  @property
  def pinned_side(self) -> int | None:
    """The side min_pixels = max_pixels = side^2 pins (a multiple of the factor), else None."""
    side = math.isqrt(self.min_pixels)
    if self.min_pixels == self.max_pixels == side * side and side % self.factor == 0:
      return side
    return None

  def square(self, side: int) -> QwenVLImages:
    """The same processor resizing every image to side x side (its aspect ratio not kept)."""
    if side <= 0 or side % self.factor:
      raise ValueError(f"image size {side} is not a positive multiple of patch_size x merge_size "
                       f"= {self.factor}")
    if not self.resize:
      raise ValueError("do_resize is false: images keep their own sizes, not one square size")
    return dataclasses.replace(self, side=side)

  @property
  def fixed_size(self) -> tuple[int, int] | None:
    """(height, width) of every image after geometry; None where it follows the input's."""
    return None if self.side is None else (self.side, self.side)

  def geometry(self, image: Image.Image) -> np.ndarray:
    """The image resized, before any arithmetic: [H, W, 3] uint8."""
    if self.side is not None:
      return _resize(image, self.side, self.side, self.resample)
    if not self.resize:
      return np.asarray(image)
    return _resize(image, *smart_resize(image.height, image.width, self.factor, self.min_pixels,
                                        self.max_pixels), self.resample)

  def __call__(self, image: Image.Image) -> tuple[np.ndarray, np.ndarray]:
    """Patches [grid_h * grid_w, 3 * temporal_patch_size * patch^2] float32, grid (1, h, w)."""
    x = self.geometry(image)
    h, w, _ = x.shape
    if h % self.factor or w % self.factor:
      raise ValueError(f"image {w}x{h}: sides not multiples of patch_size * merge_size = "
                       f"{self.factor}")
    patches = qwen_patches(self.norm(x)[None], self.patch_size, self.merge_size,
                           self.temporal_patch_size)[0]
    return patches, np.array([1, h // self.patch_size, w // self.patch_size])


def qwen_patches(x_NxHxWxC: np.ndarray, patch: int, merge: int, frames: int) -> np.ndarray:
  """Normalised images [N, H, W, C] as Qwen-VL's patches [N, (H/p)(W/p), C * frames * p^2].

  The patches of each merge window are consecutive (row-major within it, windows row-major),
  each flattened as (channel, frame, row, column): transformers' order, which the vision tower's
  patch embedding and merger expect; a still image is repeated over the frames.
  """
  n, h, w, c = x_NxHxWxC.shape
  p, m = patch, merge
  gh, gw = h // p, w // p
  x = x_NxHxWxC.reshape(n, gh // m, m, p, gw // m, m, p, c)
  x = x.transpose(0, 1, 4, 2, 5, 7, 3, 6)  # (N, gh/m, gw/m, m, m, C, p, p)
  x = np.broadcast_to(x[:, :, :, :, :, :, None], (*x.shape[:6], frames, p, p))
  return np.ascontiguousarray(x.reshape(n, gh * gw, c * frames * p * p))


@dataclasses.dataclass(frozen=True)
class LlavaTokens:
  """LlavaProcessor: `<image>` repeated once per patch of the vision tower (its CLS dropped)."""
  image_token: str = "<image>"  # the placeholder, repeated
  patch_size: int = 14  # the vision tower's patch side, pixels
  extra_tokens: int = 0  # num_additional_image_tokens: tokens the tower adds (CLIP's CLS: 1)
  drop_cls: bool = True  # vision_feature_select_strategy "default" drops one (the CLS) feature

  @property
  def placeholder(self) -> str:
    return self.image_token

  @property
  def marked(self) -> str:
    return self.image_token

  def replacement(self, pixels: np.ndarray, grid: np.ndarray | None) -> str:
    _, h, w = pixels.shape
    return self.image_token * ((h // self.patch_size) * (w // self.patch_size)
                               + self.extra_tokens - int(self.drop_cls))


@dataclasses.dataclass(frozen=True)
class Gemma3Tokens:
  """Gemma3Processor: `<start_of_image>` becomes the image's soft tokens between blank lines."""
  boi_token: str = "<start_of_image>"  # the placeholder in the text, kept at the start
  image_token: str = "<image_soft_token>"  # repeated tokens_per_image times
  eoi_token: str = "<end_of_image>"  # closes the image
  tokens_per_image: int = 256  # image_seq_length (the model's mm_tokens_per_image)

  @property
  def placeholder(self) -> str:
    return self.boi_token

  @property
  def marked(self) -> str:
    return self.image_token

  def replacement(self, pixels: np.ndarray, grid: np.ndarray | None) -> str:
    return f"\n\n{self.boi_token}{self.image_token * self.tokens_per_image}{self.eoi_token}\n\n"


@dataclasses.dataclass(frozen=True)
class QwenVLTokens:
  """Qwen2(.5)-VL and Qwen3-VL: `<|image_pad|>` repeated once per merged patch window."""
  image_token: str = "<|image_pad|>"  # the placeholder, inside <|vision_start|>...<|vision_end|>
  merge_size: int = 2  # merge_size^2 patches per token

  @property
  def placeholder(self) -> str:
    return self.image_token

  @property
  def marked(self) -> str:
    return self.image_token

  def replacement(self, pixels: np.ndarray, grid: np.ndarray | None) -> str:
    return self.image_token * (int(np.prod(grid)) // self.merge_size ** 2)


_IMAGES = {"CLIPImageProcessor": ClipImages, "LlavaImageProcessor": ClipImages,
           "SiglipImageProcessor": SiglipImages, "Gemma3ImageProcessor": SiglipImages,
           "Qwen2VLImageProcessor": QwenVLImages}
_FAMILY_IMAGES = {"llava": ClipImages, "gemma3": SiglipImages, "qwen2_vl": QwenVLImages,
                  "qwen2_5_vl": QwenVLImages, "qwen3_vl": QwenVLImages}


def _special(tokenizer_cfg: dict, name: str) -> str | None:
  """A named special token of tokenizer_config.json (top level or extra_special_tokens)."""
  extra = tokenizer_cfg.get("extra_special_tokens")
  value = tokenizer_cfg.get(name, extra.get(name) if isinstance(extra, dict) else None)
  return token_text(value)


def _read_json(path: Path) -> dict | None:
  if not path.is_file():
    return None
  try:
    return json.loads(path.read_text())
  except json.JSONDecodeError as e:
    raise ValueError(f"{path}: not JSON ({e})") from e


@dataclasses.dataclass(frozen=True)
class ImageProcessor:
  """A model's image preprocessing and the placeholder expansion of its processor."""
  family: Family  # which processor's placeholders (and M-RoPE rules) apply
  images: ClipImages | SiglipImages | QwenVLImages  # pixels of one image
  tokens: LlavaTokens | Gemma3Tokens | QwenVLTokens  # what its placeholder becomes

  @classmethod
  def from_dir(cls, path: str | os.PathLike) -> ImageProcessor:
    """From a folder that `save_pretrained` wrote, or a model folder from the Hub.

    transformers 5 writes processor_config.json with the image processor nested under
    "image_processor"; older folders keep it in preprocessor_config.json beside a
    processor_config.json of the processor's own arguments. tokenizer_config.json, when there,
    names the family's special tokens.
    """
    path = Path(path)
    processor = _read_json(path / "processor_config.json") or {}
    image = processor.get("image_processor") or _read_json(path / "preprocessor_config.json")
    if image is None:
      raise ValueError(f"{path}: no preprocessor_config.json, nor an image_processor in "
                       "processor_config.json")
    return cls.from_configs(image, processor, _read_json(path / "tokenizer_config.json") or {})

  @classmethod
  def from_configs(cls, image: dict, processor: dict | None = None,
                   tokenizer: dict | None = None) -> ImageProcessor:
    """From the image processor's config, the processor's and the tokenizer's (as dicts)."""
    processor, tokenizer = processor or {}, tokenizer or {}
    if not image.get("image_processor_type"):
      raise ValueError("the image processor config has no image_processor_type")
    kind = image["image_processor_type"].removesuffix("Fast").removesuffix("Pil")
    if kind not in _IMAGES:
      raise ValueError(f"image processor {kind} is not supported (supported: {', '.join(_IMAGES)})")
    image = {**image, "image_processor_type": kind}
    processor_class = processor.get("processor_class") or image.get("processor_class")
    if processor_class is None:
      if kind not in _DEFAULT_FAMILY:
        raise ValueError(f"{kind} without a processor_class: its image placeholders are unknown")
      family = _DEFAULT_FAMILY[kind]
    elif processor_class in FAMILIES:
      family = FAMILIES[processor_class]
    else:
      raise ValueError(f"processor {processor_class} is not supported "
                       f"(supported: {', '.join(FAMILIES)})")
    images = _IMAGES[kind].from_config(image)
    if not isinstance(images, _FAMILY_IMAGES[family]):
      raise ValueError(f"{processor_class} with a {kind} is not supported")
    if family == "llava":
      if processor.get("patch_size") is None:
        raise ValueError("LlavaProcessor without a patch_size (processor_config.json): its number "
                         "of image tokens is unknown")
      tokens = LlavaTokens(
          _special(tokenizer, "image_token") or processor.get("image_token") or "<image>",
          processor["patch_size"], processor.get("num_additional_image_tokens") or 0,
          processor.get("vision_feature_select_strategy") == "default")
    elif family == "gemma3":
      tokens = Gemma3Tokens(
          _special(tokenizer, "boi_token") or "<start_of_image>",
          _special(tokenizer, "image_token") or "<image_soft_token>",
          _special(tokenizer, "eoi_token") or "<end_of_image>",
          processor.get("image_seq_length") or image.get("image_seq_length") or 256)
    else:
      tokens = QwenVLTokens(_special(tokenizer, "image_token") or "<|image_pad|>",
                            images.merge_size)
    return cls(family, images, tokens)

  def preprocess(self, image: Image.Image) -> tuple[np.ndarray, np.ndarray | None]:
    """pixel_values of an RGB image, and its grid (t, h, w) in patches (Qwen; else None)."""
    if isinstance(self.images, QwenVLImages):
      return self.images(image)
    return self.images(image), None

  def at_size(self, side: int) -> ImageProcessor:
    """A Qwen-VL processor resizing every image to side x side (a fixed grid), which prepared
    data can store. Raises ValueError for a side that is not a multiple of patch_size x
    merge_size, and for the other families, whose processors fix their own size."""
    if not isinstance(self.images, QwenVLImages):
      h, w = self.images.fixed_size or ("?", "?")
      raise ValueError(f"{self.family}'s processor resizes every image to {h}x{w} itself; an "
                       "image size is for Qwen-VL's processors")
    return dataclasses.replace(self, images=self.images.square(side))

  def _fixed_replacement(self) -> str:
    """What each placeholder becomes when every image has the one fixed size."""
    h, w = self.images.fixed_size
    grid = None
    if isinstance(self.images, QwenVLImages):
      grid = np.array([1, h // self.images.patch_size, w // self.images.patch_size])
    return self.tokens.replacement(np.zeros((3, h, w), np.uint8), grid)

  def stored(self) -> dict:
    """What prepared data records of this processor (meta.json's "images"): the size its images
    are stored at as uint8, the arithmetic that normalises them at load (and Qwen-VL's patches),
    the placeholder and the image token it expands to. Raises ValueError for a processor whose
    images have no one size (Qwen-VL's dynamic resolution unless `at_size` fixed one, a CLIP
    processor without a crop), which the files cannot hold.
    """
    size = self.images.fixed_size
    if size is None:
      kind = type(self.images).__name__
      fix = (": pass --image-size N (a multiple of patch_size x merge_size = "
             f"{self.images.factor}) to resize every image to N x N"
             if isinstance(self.images, QwenVLImages) else "")
      raise ValueError(f"{self.family} ({kind}) resizes each image to a size of its own (dynamic "
                       f"resolution), which prepared data cannot store{fix}")
    norm = self.images.norm
    h, w = size
    tokens = self._fixed_replacement().count(self.tokens.marked)
    out = {"family": self.family, "height": h, "width": w, "channels": 3,
           "resample": self.images.resample, "rescale_factor": norm.rescale_factor,
           "mean": None if norm.mean is None else list(norm.mean),
           "std": None if norm.std is None else list(norm.std),
           "placeholder": self.tokens.placeholder, "image_token": self.tokens.marked,
           "tokens_per_image": tokens}
    if isinstance(self.images, QwenVLImages):  # the load cuts each image into the tower's patches
      out.update(patch=self.images.patch_size, merge=self.images.merge_size,
                 temporal_patch=self.images.temporal_patch_size)
    return out

  def uint8(self, image: Image.Image) -> np.ndarray:
    """An RGB image as stored in prepared data: [H, W, 3] uint8, resized, not yet normalised."""
    return np.ascontiguousarray(self.images.geometry(image))

  def expand(self, text: str, spans: list[tuple[int, int]], n_images: int
             ) -> tuple[str, list[tuple[int, int]]]:
    """A rendered conversation with each placeholder replaced by its image's tokens (as `encode`
    does), and its character spans moved with the text they cover. Raises ValueError when the
    rendering holds another number of placeholders than `n_images`."""
    ph = self.tokens.placeholder
    pieces = text.split(ph)
    if len(pieces) - 1 != n_images:
      raise ValueError(f"the rendered conversation holds {len(pieces) - 1} {ph} for "
                       f"{n_images} images")
    rep = self._fixed_replacement()
    ends = np.cumsum([len(p) + len(ph) for p in pieces[:-1]])  # where each placeholder ends
    grow = len(rep) - len(ph)
    moved = lambda c: c + grow * int(np.searchsorted(ends, c, side="right"))
    return rep.join(pieces), [(moved(a), moved(b)) for a, b in spans]


@dataclasses.dataclass(frozen=True)
class Encoded:
  """A text with its images, as the family's processor returns them."""
  input_ids: np.ndarray  # [T] int32, the placeholders expanded
  token_type_ids: np.ndarray  # [T] int32, 1 on image tokens (Gemma 3's token_type_ids)
  pixel_values: tuple[np.ndarray, ...]  # per image: [3, H, W], or Qwen's patches [t*h*w, 3*T*P*P]
  image_grid_thw: np.ndarray | None  # [images, 3] int64 grids in patches (Qwen), else None


def normalize(pixels_NxHxWxC: np.ndarray, stored: dict) -> np.ndarray:
  """Stored uint8 images ([N, H, W, C], ImageProcessor.uint8) as the processor's pixel_values
  [N, C, H, W] float32, by the arithmetic `stored` (ImageProcessor.stored) records."""
  return np.ascontiguousarray(_norm(stored)(np.asarray(pixels_NxHxWxC)).transpose(0, 3, 1, 2))


def pixel_values(pixels_NxHxWxC: np.ndarray, stored: dict) -> np.ndarray:
  """Stored uint8 images as the model's tower takes each: normalised [N, C, H, W], or Qwen-VL's
  patches [N, (H/p)(W/p), C * temporal_patch * p^2] (transformers' pixel_values of the N images
  are these reshaped to [N * (H/p)(W/p), C * temporal_patch * p^2])."""
  if stored.get("patch") is None:
    return normalize(pixels_NxHxWxC, stored)
  x = _norm(stored)(np.asarray(pixels_NxHxWxC))
  return qwen_patches(x, int(stored["patch"]), int(stored["merge"]), int(stored["temporal_patch"]))


def pixel_shape(stored: dict) -> tuple[int, ...]:
  """The shape of one image's `pixel_values`: [C, H, W], or Qwen-VL's [patches, patch values]."""
  c, h, w = (int(stored[k]) for k in ("channels", "height", "width"))
  if stored.get("patch") is None:
    return (c, h, w)
  p = int(stored["patch"])
  return ((h // p) * (w // p), c * int(stored["temporal_patch"]) * p * p)


def _norm(stored: dict) -> Norm:
  mean, std = stored.get("mean"), stored.get("std")
  return Norm(stored.get("rescale_factor"), None if mean is None else tuple(mean),
              None if std is None else tuple(std))


def encode(text: str, images: Sequence[Source], processor: ImageProcessor, tokenizer: Any, *,
           base: str | os.PathLike | None = None, add_special_tokens: bool = False) -> Encoded:
  """Tokenizes a chat-templated text whose placeholders stand for `images`, in order.

  Each placeholder (`<image>`, Gemma 3's `<start_of_image>`, Qwen's `<|image_pad|>`) is replaced
  by its image's tokens in the text, as the processor does, and the whole text is then tokenized:
  the ids equal the processor's `input_ids` for the same text and images.

  Args:
    text: the rendered conversation, one placeholder per image.
    images: each a path (relative to `base`), bytes, a `datasets` Image value or a PIL image.
    processor: the model's ImageProcessor.
    tokenizer: a `tokenizers.Tokenizer` with the family's special tokens.
    base: the folder relative image paths are read from.
    add_special_tokens: add the tokenizer's post-processor tokens (BOS); a rendered chat has them.

  Returns:
    The Encoded text and images.

  Raises:
    ValueError: placeholders and images differ in number, an image is missing or unreadable, or
      the tokenizer lacks the image token.
  """
  tokens = processor.tokens
  pieces = text.split(tokens.placeholder)
  if len(pieces) - 1 != len(images):
    raise ValueError(f"the text has {len(pieces) - 1} {tokens.placeholder} for {len(images)} images")
  processed = [processor.preprocess(load_image(im, base)) for im in images]
  marked = tokenizer.token_to_id(tokens.marked)
  if marked is None:
    raise ValueError(f"the tokenizer has no {tokens.marked} token")
  replacements = [tokens.replacement(pixels, grid) for pixels, grid in processed]
  expanded = pieces[0] + "".join(r + p for r, p in zip(replacements, pieces[1:]))
  ids = np.asarray(tokenizer.encode(expanded, add_special_tokens=add_special_tokens).ids, np.int32)
  types = (ids == marked).astype(np.int32)
  want = sum(r.count(tokens.marked) for r in replacements)
  if int(types.sum()) != want:
    raise ValueError(f"{int(types.sum())} {tokens.marked} tokens after tokenizing, {want} expected")
  grids = None
  if isinstance(processor.images, QwenVLImages):
    grids = np.array([grid for _, grid in processed], np.int64).reshape(-1, 3)
  return Encoded(ids, types, tuple(pixels for pixels, _ in processed), grids)


def mrope_positions(token_type_ids: np.ndarray, image_grid_thw: np.ndarray | None = None, *,
                    family: Family, spatial_merge_size: int = 2,
                    attention_mask: np.ndarray | None = None,
                    video_grid_thw: np.ndarray | None = None,
                    second_per_grid_ts: Sequence[float] | None = None,
                    tokens_per_second: int | None = None) -> tuple[np.ndarray, int]:
  """Qwen's 3D (t, h, w) positions of one row, as transformers' `get_rope_index`.

  Text tokens advance all three together; each run of image (video) tokens takes the next grid
  and gets its merged grid coordinates offset by the position after the preceding text, which
  then advances by the larger merged side. Qwen2.5-VL spaces a video's frames by
  tokens_per_second * second_per_grid_ts (images: t = 0); Qwen3-VL takes each video frame as a
  grid of its own (timestamps separate them in the text).

  Args:
    token_type_ids: [T]: 0 text, 1 image, 2 video (Encoded.token_type_ids).
    image_grid_thw: [images, 3], the row's image grids in order.
    family: qwen2_vl, qwen2_5_vl or qwen3_vl.
    spatial_merge_size: the vision config's spatial_merge_size.
    attention_mask: [T], 0 on padding: padding is skipped and gets position 0.
    video_grid_thw: [videos, 3], the row's video grids in order.
    second_per_grid_ts: per video, seconds per temporal grid step (Qwen2.5-VL).
    tokens_per_second: the vision config's tokens_per_second (Qwen2.5-VL videos).

  Returns:
    positions [3, T] int64, and the rope delta (the position after the last token minus the
    row's unpadded length), which generation adds to the positions of later tokens.
  """
  types = np.asarray(token_type_ids).reshape(-1)
  keep = (np.ones(types.shape, bool) if attention_mask is None
          else np.asarray(attention_mask).reshape(-1).astype(bool))
  kept = types[keep]
  if kept.size == 0:
    raise ValueError("mrope_positions: a row without tokens")
  videos = np.zeros((0, 3), np.int64) if video_grid_thw is None else np.asarray(video_grid_thw)
  videos = videos.reshape(-1, 3)
  if family == "qwen3_vl":  # one grid per frame
    videos = np.repeat(videos, videos[:, 0], axis=0)
    videos[:, 0] = 1
  grids: dict[int, Iterator] = {
      1: iter(np.zeros((0, 3), np.int64) if image_grid_thw is None
              else np.asarray(image_grid_thw).reshape(-1, 3)),
      2: iter(videos)}
  seconds = None if second_per_grid_ts is None else iter(second_per_grid_ts)
  m = spatial_merge_size
  edges = np.flatnonzero(np.diff(kept)) + 1
  pos, pieces = 0, []
  for start, end in zip([0, *edges], [*edges, kept.size]):
    kind = int(kept[start])
    if kind == 0:
      pieces.append(np.broadcast_to(np.arange(end - start) + pos, (3, end - start)))
      pos += end - start
      continue
    grid = next(grids[kind], None)
    if grid is None:
      raise ValueError(f"mrope_positions: more {('', 'image', 'video')[kind]} runs than grids")
    t, h, w = int(grid[0]), int(grid[1]) // m, int(grid[2]) // m
    if t * h * w != end - start:
      raise ValueError(f"mrope_positions: a run of {end - start} tokens for a grid {t}x{h}x{w}")
    t_pos = np.arange(t)
    if kind == 2 and family == "qwen2_5_vl":
      if tokens_per_second is None:
        raise ValueError("mrope_positions: Qwen2.5-VL videos need tokens_per_second")
      if seconds is None:
        t_pos = t_pos * tokens_per_second
      else:  # transformers multiplies in float32 and truncates
        step = np.float32(tokens_per_second) * np.float32(next(seconds))
        t_pos = (t_pos.astype(np.float32) * step).astype(np.int64)
    tt, hh, ww = np.meshgrid(t_pos, np.arange(h), np.arange(w), indexing="ij")
    pieces.append(np.stack([tt, hh, ww]).reshape(3, -1) + pos)
    pos += max(h, w)
  positions = np.concatenate(pieces, axis=1).astype(np.int64)
  out = np.zeros((3, types.size), np.int64)
  out[:, keep] = positions
  return out, int(positions.max()) + 1 - kept.size
