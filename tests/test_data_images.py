"""Image chats through the data pipeline: prepare (content parts, an images column with <image>
placeholders, JSONL and Parquet bytes) -> {split}.pixels / .images -> Batch.images, held to
transformers' LlavaProcessor (ids, pixel_values), and a LLaVA fine-tuned on them end to end."""

import dataclasses
import json
import shutil

import numpy as np
import pytest
from PIL import Image
from tokenizers import Tokenizer

from mtjax import config, data
from mtjax.data import images as images_lib, tokenize
from numerics import assert_close
from test_chat import SPECIALS, make_tokenizer
from test_data import prepare_cli, prepared_cfg

pa = pytest.importorskip("pyarrow")
import pyarrow.parquet as pq

# A ChatML template over content parts, as a processor's template takes them: each image part is
# the processor's <image> placeholder where it stands.
TEMPLATE = ("{%- for message in messages %}{{- '<|im_start|>' + message['role'] + '\\n' }}"
            "{%- for p in message['content'] %}{%- if p['type'] == 'image' %}{{- '<image>' }}"
            "{%- else %}{{- p['text'] }}{%- endif %}{%- endfor %}{{- '<|im_end|>\\n' }}"
            "{%- endfor %}"
            "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
SIDE, PATCH = 28, 14  # the tower's image side and patch: 4 image tokens an image (CLS dropped)
CLIP = {"crop_size": {"height": SIDE, "width": SIDE}, "do_center_crop": True,
        "do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
        "image_mean": list(images_lib.OPENAI_CLIP_MEAN), "image_std": list(images_lib.OPENAI_CLIP_STD),
        "image_processor_type": "CLIPImageProcessor", "resample": 3,
        "rescale_factor": 1 / 255, "size": {"shortest_edge": SIDE}}


def write_processor(directory, **image):
  """processor_config.json as LlavaProcessor.save_pretrained writes it (transformers 5)."""
  (directory / "processor_config.json").write_text(json.dumps(
      {"image_processor": {**CLIP, **image}, "image_token": "<image>",
       "num_additional_image_tokens": 1, "patch_size": PATCH, "processor_class": "LlavaProcessor",
       "vision_feature_select_strategy": "default"}))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
  d = make_tokenizer(tmp_path_factory.mktemp("model"), template=TEMPLATE,
                     specials=SPECIALS + ["<image>"])
  write_processor(d)
  return d


def save_images(folder):
  """Odd sizes and modes: a tall RGB, a wide palette PNG and a grey JPEG. (No transparency:
  transformers' load_image of a path drops the alpha channel, where its processors composite a
  PIL image onto white, as mtjax's load_image does.)"""
  rng = np.random.default_rng(0)
  (folder / "imgs").mkdir(parents=True, exist_ok=True)
  Image.fromarray(rng.integers(0, 256, (53, 37, 3), np.uint8)).save(folder / "imgs" / "a.png")
  Image.fromarray(rng.integers(0, 256, (30, 45, 3), np.uint8)).quantize(16).save(
      folder / "imgs" / "b.png")
  Image.fromarray(rng.integers(0, 256, (40, 40), np.uint8), "L").save(folder / "imgs" / "c.jpg")
  return folder


def conversations(image):
  """Three chats in content parts (`image(name)` gives each image part): one image, an image in
  each user turn of a multi-turn chat, and one without images."""
  text = lambda t: {"type": "text", "text": t}
  return [
      [{"role": "user", "content": [image("a.png"), text("What is this?")]},
       {"role": "assistant", "content": [text("A cat.")]}],
      [{"role": "user", "content": [text("Compare "), image("b.png")]},
       {"role": "assistant", "content": [text("The first one.")]},
       {"role": "user", "content": [image("c.jpg"), text(" Why?")]},
       {"role": "assistant", "content": [text("It is brighter.")]}],
      [{"role": "user", "content": [text("Hello")]},
       {"role": "assistant", "content": [text("Hi there.")]}]]


# the forms of an image part transformers' chat templates accept, all read
PART_FORMS = {"a.png": lambda n: {"type": "image", "image": f"imgs/{n}"},
              "b.png": lambda n: {"type": "image", "path": f"imgs/{n}"},
              "c.jpg": lambda n: {"type": "image_url", "image_url": {"url": f"file://imgs/{n}"}}}


def write_jsonl(folder):
  rows = [{"messages": c} for c in conversations(lambda n: PART_FORMS[n](n))]
  rows[2]["messages"] = [{"role": m["role"], "content": m["content"][0]["text"]}
                         for m in rows[2]["messages"]]  # plain strings, as text rows are
  f = folder / "chats.jsonl"
  f.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return f


def write_parquet(folder):
  """The same chats in LlamaFactory's form (ShareGPT, <image> in the text, an images column of
  datasets Image values with the bytes inline)."""
  def value(m):
    return "".join("<image>" if p["type"] == "image" else p["text"] for p in m["content"])

  names = {0: ["a.png"], 1: ["b.png", "c.jpg"], 2: []}
  rows = []
  for k, c in enumerate(conversations(lambda n: {"type": "image"})):
    rows.append({"conversations": [{"from": {"user": "human", "assistant": "gpt"}[m["role"]],
                                    "value": value(m)} for m in c],
                 "images": [{"bytes": (folder / "imgs" / n).read_bytes(), "path": n}
                            for n in names[k]]})
  f = folder / "chats.parquet"
  pq.write_table(pa.Table.from_pylist(rows), f)
  return f


def docs(out, split="train"):
  p = data.Prepared(out, split, 10**6)
  return [(p.piece(d, 0, int(p.lengths[d]))[0], p.piece(d, 0, int(p.lengths[d]))[1], p.images(d))
          for d in range(p.n_docs)]


def vision(**kw):
  return config.VisionConfig(image_size=SIDE, patch=PATCH, image_token_id=kw.pop("token"),
                             max_images=2, **kw)


def test_jsonl_content_parts_equal_the_llava_processor(tmp_path, model_dir):
  """Ids equal LlavaProcessor.apply_chat_template's; the pixels after load equal its
  pixel_values (CLIPImageProcessor); the loss counts the assistant turns only, never an image
  token; the pixels are stored as uint8 at the processor's size."""
  transformers = pytest.importorskip("transformers")
  from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
  folder = save_images(tmp_path / "data")
  meta = data.prepare(model_dir, tmp_path / "out", [str(write_jsonl(folder))], fmt="messages",
                      val_fraction=0, progress=False)
  info = meta["images"]
  tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
  image_id = tok.token_to_id("<image>")
  assert info["image_token_id"] == image_id and info["tokens_per_image"] == 4
  assert (info["height"], info["width"], info["family"]) == (SIDE, SIDE, "llava")
  assert meta["splits"]["train"]["images"] == 3
  assert (tmp_path / "out" / "train.pixels").stat().st_size == 3 * SIDE * SIDE * 3
  hf_tok = transformers.PreTrainedTokenizerFast(
      tokenizer_file=str(model_dir / "tokenizer.json"), eos_token="<|im_end|>",
      extra_special_tokens={"image_token": "<image>"})
  proc = transformers.LlavaProcessor(
      CLIPImageProcessorPil(**{k: v for k, v in CLIP.items() if k != "image_processor_type"}),
      hf_tok, patch_size=PATCH, vision_feature_select_strategy="default",
      num_additional_image_tokens=1, chat_template=TEMPLATE)
  got = docs(tmp_path / "out")
  want_msgs = conversations(lambda n: {"type": "image", "path": str(folder / "imgs" / n)})
  p = data.Prepared(tmp_path / "out", "train", 10**6)
  for d, ((ids, mask, _), msgs) in enumerate(zip(got, want_msgs)):
    want = proc.apply_chat_template(msgs, tokenize=True, return_dict=True, return_tensors="np")
    np.testing.assert_array_equal(ids, want["input_ids"][0])
    assert not mask[ids == image_id].any()
    # the loss counts each assistant turn, its end of turn included, and nothing else
    counted = tok.decode(ids[mask == 1].tolist(), skip_special_tokens=False)
    answers = [m["content"][0]["text"] + "<|im_end|>" for m in msgs if m["role"] == "assistant"]
    assert counted == "".join(answers)
    if "pixel_values" in want:
      pixels = p.batch_images([d], vision(token=image_id))[0]
      n = len(want["pixel_values"])
      assert not pixels[n:].any()
      # equal, not close: the same uint8 resize, then the same float32 arithmetic
      np.testing.assert_array_equal(pixels[:n], want["pixel_values"])


def test_parquet_bytes_with_placeholders_equal_the_content_parts(tmp_path, model_dir):
  """LlamaFactory's form (an images column of {"bytes", "path"}, <image> in ShareGPT text) gives
  the documents content parts give; a mixture's shuffle keeps each document's images with it."""
  folder = save_images(tmp_path / "data")
  jsonl, parquet = write_jsonl(folder), write_parquet(folder)
  data.prepare(model_dir, tmp_path / "j", [str(jsonl)], fmt="messages", val_fraction=0,
               progress=False)
  meta = data.prepare(model_dir, tmp_path / "p", [str(parquet)], val_fraction=0, progress=False)
  assert meta["formats"] == ["sharegpt"]
  a, b = docs(tmp_path / "j"), docs(tmp_path / "p")
  for x, y in zip(a, b, strict=True):
    for u, v in zip(x, y):
      np.testing.assert_array_equal(u, v)
  mixed = data.prepare(model_dir, tmp_path / "m", [str(jsonl), str(parquet)], weights=[1, 2],
                       val_fraction=0, progress=False, workers=2)
  assert mixed["shuffled"] and mixed["splits"]["train"]["documents"] == 6
  by_ids = {tuple(ids.tolist()): px for ids, _, px in a}
  for ids, _, px in docs(tmp_path / "m"):
    np.testing.assert_array_equal(px, by_ids[tuple(ids.tolist())])
  # --max-len through the second image's tokens skips the row; one after an image keeps it whole
  image_id = meta["images"]["image_token_id"]
  at = np.flatnonzero(a[1][0] == image_id)
  cut = data.prepare(model_dir, tmp_path / "c", [str(jsonl)], fmt="messages", val_fraction=0,
                     progress=False, options=tokenize.Options(max_len=int(at[5])))
  assert cut["stats"][0]["skipped"]["image cut by --max-len"]["count"] == 1
  kept = docs(tmp_path / "c")
  assert [len(px) for _, _, px in kept] == [1, 0] and cut["splits"]["train"]["images"] == 1


def test_a_missing_image_is_counted_and_skipped_or_refused_with_strict(tmp_path, model_dir):
  folder = save_images(tmp_path / "data")
  f = write_jsonl(folder)
  (folder / "imgs" / "c.jpg").unlink()
  (folder / "imgs" / "b.png").write_bytes(b"not a png")
  (folder / "imgs" / "a.png").unlink()
  r = prepare_cli("--tokenizer", model_dir, "--out", tmp_path / "out", "--val-fraction", "0",
                  "--quiet", f, cwd=tmp_path)
  assert r.returncode == 0, r.stderr
  assert "skipped 1 (missing image); first: " in r.stdout and "chats.jsonl:1: image " in r.stdout
  assert "skipped 1 (unreadable image)" in r.stdout and "chats.jsonl:2" in r.stdout
  meta = json.loads((tmp_path / "out" / "meta.json").read_text())
  assert meta["splits"]["train"] == {"documents": 1, "tokens": meta["splits"]["train"]["tokens"],
                                     "images": 0}
  r = prepare_cli("--tokenizer", model_dir, "--out", tmp_path / "strict", "--val-fraction", "0",
                  "--strict", "--quiet", f, cwd=tmp_path)
  assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
  assert r.stderr.startswith("error: ") and "chats.jsonl:1: image " in r.stderr
  assert "a.png: no such file" in r.stderr
  assert not (tmp_path / "strict").exists()


def test_training_refuses_packing_a_mismatched_model_and_too_many_images(tmp_path, model_dir):
  folder = save_images(tmp_path / "data")
  data.prepare(model_dir, tmp_path / "out", [str(write_jsonl(folder))], val_fraction=0,
               progress=False)
  out = tmp_path / "out"
  image_id = json.loads((out / "meta.json").read_text())["images"]["image_token_id"]
  v = vision(token=image_id)
  with pytest.raises(ValueError, match=r"^data\.mode: packed .* holds images .* set "
                                       r"data\.mode=padded$"):
    data.source(prepared_cfg(out), 2, 64, 10**6, 0, v)
  with pytest.raises(ValueError, match=r"holds images, and the model has no vision tower"):
    data.source(prepared_cfg(out, mode="padded"), 2, 64, 10**6, 0)
  with pytest.raises(ValueError, match=r"for 28x28 images, the model's tower takes 56x56"):
    data.source(prepared_cfg(out, mode="padded"), 2, 64, 10**6, 0,
                config.VisionConfig(image_size=56, patch=PATCH, image_token_id=image_id))
  with pytest.raises(ValueError, match=r"holds 2 images, more than model\.vision\.max_images "
                                       r"\(1\); set model\.vision\.max_images=2"):
    data.source(prepared_cfg(out, mode="padded"), 2, 64, 10**6, 0,
                config.VisionConfig(image_size=SIDE, patch=PATCH, image_token_id=image_id))
  src = data.source(prepared_cfg(out, mode="padded"), 3, 64, 10**6, 0, v)
  b = src.batch(0)
  assert b.images.shape == (3, 2, 3, SIDE, SIDE) and b.images.dtype == np.float32
  counts = (b.inputs == image_id).sum(1)
  assert sorted(counts.tolist()) == [0, 4, 8]
  for row in range(3):  # a row's images fill its first slots; the rest are zeros
    n = counts[row] // 4
    assert all(b.images[row, k].any() == (k < n) for k in range(2))
  assert not b.loss_weights[b.targets == image_id].any()
  held = list(data.validation_batches(prepared_cfg(out, mode="padded"), 2, 64, 10**6,
                                      split="train", vision=v))
  assert [x.images.shape for x in held] == [(2, 2, 3, SIDE, SIDE)] * 2
  assert not held[-1].images[1].any()  # the padding row of the last batch
  stored = data.Prepared(out, "train", 10**6).batch_images([0, 1, 2], v)  # in stored order
  np.testing.assert_array_equal(np.concatenate([x.images for x in held])[:3], stored)
  # the model's processor normalises otherwise: refused in one line naming the setting
  other = tmp_path / "other"
  shutil.copytree(model_dir, other)
  write_processor(other, image_mean=[0.5, 0.5, 0.5])
  data.check_processor(out, model_dir)
  with pytest.raises(ValueError, match=r"^data\.path: .* with mean \[0\.48.*the model's processor "
                                       r"\(.*other\) has \[0\.5, 0\.5, 0\.5\]; prepare it again "
                                       r"with --processor .*other$"):
    data.check_processor(out, other)


def test_dynamic_resolution_images_are_refused_in_one_line(tmp_path, model_dir):
  qwen = tmp_path / "qwen"
  shutil.copytree(model_dir, qwen)
  (qwen / "processor_config.json").unlink()
  (qwen / "preprocessor_config.json").write_text(json.dumps(
      {"image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2VLProcessor"}))
  folder = save_images(tmp_path / "data")
  with pytest.raises(ValueError, match=r"chats\.jsonl:1: qwen2_vl \(QwenVLImages\) resizes each "
                                       r"image to a size of its own"):
    data.prepare(qwen, tmp_path / "out", [str(write_jsonl(folder))], val_fraction=0,
                 progress=False)
  plain = make_tokenizer(tmp_path / "plain", template=TEMPLATE, specials=SPECIALS + ["<image>"])
  with pytest.raises(ValueError, match=r"chats\.jsonl:1: rows with images need the model's image "
                                       r"processor: .*plain holds no preprocessor_config\.json; "
                                       r"pass --processor MODEL_DIR"):
    data.prepare(plain, tmp_path / "out", [str(write_jsonl(folder))], val_fraction=0,
                 progress=False)
  with pytest.raises(ValueError, match=r"^--processor: qwen2_vl"):
    data.prepare(model_dir, tmp_path / "out", [str(write_jsonl(folder))], val_fraction=0,
                 progress=False, processor=qwen)


@pytest.mark.soak  # about 50 s on two shared CPU cores: the tower's and the text model's compiles
def test_fine_tune_llava_on_image_chats_end_to_end(tmp_path, model_dir):
  """A tiny LLaVA saved by transformers, its processor's files beside it: image chats prepared
  with its processor train a few steps (the loss falls), and the export loads in
  LlavaForConditionalGeneration with logits equal to mtjax's forward of the exported weights on
  a prepared row and its images."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  import mtjax
  from mtjax import cli, train
  src = tmp_path / "src"
  shutil.copytree(model_dir, src)
  tok = Tokenizer.from_file(str(src / "tokenizer.json"))
  image_id = tok.token_to_id("<image>")
  torch.manual_seed(0)
  c = transformers.LlavaConfig(
      vision_config=transformers.CLIPVisionConfig(
          hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
          image_size=SIDE, patch_size=PATCH, projection_dim=16),
      text_config=transformers.LlamaConfig(
          vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=48,
          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
      image_token_id=image_id)
  transformers.LlavaForConditionalGeneration(c).save_pretrained(src)
  folder = save_images(tmp_path / "data")
  r = prepare_cli("--tokenizer", src, "--out", tmp_path / "prepared", "--val-fraction", "0",
                  "--quiet", write_jsonl(folder), cwd=tmp_path)
  assert r.returncode == 0, r.stderr
  cfg = cli.load_config(None, [
      f"model.from_hf={src}", "model.vision.max_images=2", "engine.compute_dtype=float32",
      "data.source=prepared", f"data.path={tmp_path / 'prepared'}", "data.mode=padded",
      "train.batch=3", "train.seq=48", "train.steps=4", "optim.lr=3e-3", "optim.warmup_steps=0",
      f"train.export_dir={tmp_path / 'out'}", "train.export_dtype=float32"])
  s = train.run(cfg, progress=False)
  assert s["steps"] == 4 and s["final_loss"] < s["first_loss"]
  m = transformers.LlavaForConditionalGeneration.from_pretrained(
      tmp_path / "out", attn_implementation="eager", dtype=torch.float32).eval()
  got_cfg, params = mtjax.load_hf(tmp_path / "out")
  got_cfg = dataclasses.replace(got_cfg, vision=dataclasses.replace(got_cfg.vision, max_images=2))
  p = data.Prepared(tmp_path / "prepared", "train", tok.get_vocab_size())
  ids = p.piece(1, 0, int(p.lengths[1]))[0][None].astype(np.int32)  # two images
  pixels = images_lib.normalize(p.images(1), p.image_info)
  with torch.no_grad():
    want = m(input_ids=torch.from_numpy(ids).long(),
             pixel_values=torch.from_numpy(pixels)).logits.numpy()
  got = np.asarray(mtjax.forward(got_cfg, params, ids, pixel_values=pixels))
  assert_close(got, want, name="logits of the export")
  source = transformers.LlavaForConditionalGeneration.from_pretrained(src).state_dict()
  trained = m.state_dict()
  moved = {k for k in trained if k in source and not torch.equal(source[k], trained[k])}
  assert any("vision_tower" in k for k in moved) and any("projector" in k for k in moved)


def test_an_image_token_without_an_image_is_skipped(tmp_path, model_dir):
  """A text row whose text holds the placeholder would put image tokens without an image in the
  data: counted and skipped."""
  f = tmp_path / "t.jsonl"
  f.write_text(json.dumps({"messages": [{"role": "user", "content": "Look: <image>"},
                                        {"role": "assistant", "content": "Nothing."}]}) + "\n"
               + json.dumps({"messages": [{"role": "user", "content": "Hi"},
                                          {"role": "assistant", "content": "Hello."}]}) + "\n")
  meta = data.prepare(model_dir, tmp_path / "out", [str(f)], val_fraction=0, progress=False)
  skipped = meta["stats"][0]["skipped"]
  assert skipped["template error"]["count"] == 1
  assert "t.jsonl:1: the rendered conversation holds 1 <image> for 0 images" in \
      skipped["template error"]["first"]
  assert meta["splits"]["train"] == {"documents": 1, "tokens": meta["splits"]["train"]["tokens"],
                                     "images": 0}


@pytest.mark.parametrize("family", ["llava", "gemma3"])
def test_expand_moves_the_spans_with_the_text_they_cover(family):
  """Each placeholder becomes its image's tokens as images.encode replaces it, and every span
  covers the same characters after the expansion as before (Gemma 3's replacement adds blank
  lines and its start and end tokens around the image tokens)."""
  if family == "llava":
    proc = images_lib.ImageProcessor.from_configs(CLIP, {"processor_class": "LlavaProcessor",
                                                         "patch_size": PATCH})
  else:
    proc = images_lib.ImageProcessor.from_configs(
        {"image_processor_type": "Gemma3ImageProcessor", "size": {"height": 28, "width": 28}},
        {"processor_class": "Gemma3Processor", "image_seq_length": 4})
  ph = proc.tokens.placeholder
  text = f"user: {ph}a{ph} look\nassistant: yes {ph}!\nassistant: no\n"
  spans = [(text.index("yes"), text.index("!") + 1), (text.index("no"), len(text) - 1)]
  out, moved = proc.expand(text, spans, 3)
  assert out.count(proc.tokens.marked) == 3 * proc.stored()["tokens_per_image"]
  assert [out[a:b] for a, b in moved] == [text[a:b].replace(ph, proc.tokens.replacement(
      np.zeros((3, 28, 28)), None)) for a, b in spans]
  with pytest.raises(ValueError, match=f"holds 3 {ph} for 2 images"):
    proc.expand(text, spans, 2)
