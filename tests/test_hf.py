"""Hugging Face import/export against transformers' own models (torch, transformers: tests only)."""

import dataclasses
import json
import os
import tracemalloc
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy

import mtjax
from mtjax import cli, hf, models
from mtjax.config import ModelConfig
from mtjax.models.layers import token_nll
from numerics import assert_close, errors, REL_L2, REL_MAX

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# After the skip: the parity harness imports torch and transformers.
import parity

BASE = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=48, initializer_range=0.2)
FAMILIES = {  # name -> (config class, extra config kwargs, shard size: small = several shards)
    "llama3": (transformers.LlamaConfig, dict(
        rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                           "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                           "original_max_position_embeddings": 16}), "20KB"),
    "llama_tied": (transformers.LlamaConfig, dict(
        tie_word_embeddings=True, rope_scaling={"rope_type": "linear", "factor": 2.0}), "10MB"),
    "mistral": (transformers.MistralConfig, dict(sliding_window=None, rope_theta=1e6), "20KB"),
    "qwen2": (transformers.Qwen2Config, dict(), "20KB"),
    "qwen3": (transformers.Qwen3Config, dict(head_dim=16), "20KB"),
}
ROOT = Path(__file__).parent.parent
TOKENIZER = {"tokenizer.json": '{"version": "1.0"}', "tokenizer_config.json": '{"x": 1}',
             "merges.txt": "a b\n", "chat_template.jinja": "{{ messages }}",
             "preprocessor_config.json": '{"size": 336}', "processor_config.json": '{"y": 2}'}


def build(family, directory, dtype=torch.float32, seed=0):
  """A random tiny transformers model, norms and biases moved off 1 and 0, saved to `directory`."""
  cls, extra, shard = FAMILIES[family]
  torch.manual_seed(seed)
  m = transformers.AutoModelForCausalLM.from_config(cls(**BASE, **extra),
                                                    attn_implementation="eager")
  with torch.no_grad():
    for name, p in m.named_parameters():
      if name.endswith("norm.weight"):
        p.add_(0.3 * torch.randn_like(p))
      elif name.endswith(".bias"):
        p.normal_(0.0, 0.3)
  m = m.to(dtype).eval()
  m.save_pretrained(directory, max_shard_size=shard)
  return m


def load(directory):
  """Imports a directory through the public API: (config, parameter tree)."""
  return mtjax.load_hf(directory)


def flats_of(cfg, params):
  """{group: flat fp32 vector} of a parameter tree, in forward order (what a store holds)."""
  spec = models.spec(cfg)
  parts = [params["embed"], *params["blocks"], params["head"]]
  return {g: spec.group_layout(g).flatten(p) for (g, _), p in zip(spec.groups, parts)}


def logits(cfg, params, ids):
  """mtjax's whole model (its layer modules composed) in fp32."""
  return mtjax.forward(cfg, params, ids)


def token_ids(V, seed=0):
  return np.random.default_rng(seed).integers(0, V, (2, 12)).astype(np.int32)


def state_dict_bits(m):
  """Every tensor's bit pattern (integer view), so NaN payloads and -0.0 compare exactly."""
  ints = {2: torch.int16, 4: torch.int32}
  return {k: v.detach().contiguous().view(ints[v.element_size()]).numpy()
          for k, v in m.state_dict().items()}


def assert_bits_equal(got: dict, want: dict):
  assert got.keys() == want.keys()
  for k in want:
    np.testing.assert_array_equal(got[k], want[k], err_msg=k)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """family -> (directory, fp32 torch model), each built once for the module."""
  cache = {}

  def get(family):
    if family not in cache:
      d = tmp_path_factory.mktemp(family)
      cache[family] = (d, build(family, d))
    return cache[family]
  return get


@pytest.mark.parametrize("family", list(FAMILIES))
@parity.covers("llama", "mistral", "qwen2", "qwen3")
def test_logits_match_transformers(saved, family):
  d, m = saved(family)
  n_shards = len(list(d.glob("*.safetensors")))
  assert (n_shards == 1) == (family == "llama_tied")
  assert (d / "model.safetensors.index.json").exists() == (n_shards > 1)
  cfg, params = load(d)
  assert (cfg.tie_embeddings, cfg.qkv_bias, cfg.qk_norm) == (
      family == "llama_tied", family == "qwen2", family == "qwen3")
  ids = token_ids(cfg.vocab_size)
  with torch.no_grad():
    want = m(torch.from_numpy(ids).long()).logits.numpy()
  assert 0.5 < np.abs(want).mean() < 5  # logits of magnitude ~1, so the tolerance means fp32
  got = logits(cfg, params, ids)
  assert_close(got, want, name="logits")


def test_model_fields_llama3_rope(saved):
  d, _ = saved("llama3")
  f = hf.Checkpoint(d).model_fields()
  rope = f["rope"]
  assert rope.scaling == "llama3" and rope.theta == 500000.0
  assert (rope.factor, rope.low_freq_factor, rope.high_freq_factor, rope.original_max_len) == (
      8.0, 1.0, 4.0, 16)
  legacy = json.loads((d / "config.json").read_text())  # transformers 4 spelling
  rope = legacy.pop("rope_parameters")
  legacy["rope_theta"] = rope.pop("rope_theta")
  legacy["rope_scaling"] = {**rope, "type": rope.pop("rope_type")}
  assert hf.model_fields(legacy) == f


def torch_loss_and_grads(d, ids):
  """transformers' fp32 eager loss and every parameter's gradient by torch autograd."""
  m = transformers.AutoModelForCausalLM.from_pretrained(d, attn_implementation="eager",
                                                        dtype=torch.float32)
  out = m(torch.from_numpy(ids).long(), labels=torch.from_numpy(ids).long())
  out.loss.backward()
  return out.loss.item(), {k: p.grad.numpy() for k, p in m.named_parameters()}


def mtjax_loss_and_grads(cfg, params, ids):
  """The same loss through mtjax's layer modules and its gradient by jax, by Hugging Face name."""
  def loss_fn(params):
    lg = logits(cfg, params, ids)[:, :-1].reshape(-1, cfg.vocab_size)
    return jnp.mean(token_nll(lg, jnp.asarray(ids[:, 1:].reshape(-1))))

  loss, grads = jax.value_and_grad(loss_fn)(params)
  return float(loss), mtjax.to_hf_names(cfg, grads)


@pytest.mark.parametrize("family", list(FAMILIES))
@parity.covers("llama", "mistral", "qwen2", "qwen3")
def test_loss_and_gradients_match_torch_autograd(saved, family):
  d, _ = saved(family)
  cfg, params = load(d)
  ids = token_ids(cfg.vocab_size, seed=1)
  want_loss, want = torch_loss_and_grads(d, ids)
  loss, got = mtjax_loss_and_grads(cfg, params, ids)
  assert_close(loss, want_loss, name="loss")
  assert got.keys() == want.keys()
  for k in want:
    assert_close(got[k], want[k], name=k)


def scaled(cfg, field: str, factor: float):
  """`cfg` with the field at the dotted path `field` (`rope.theta`) multiplied by `factor`."""
  head, _, rest = field.partition(".")
  value = getattr(cfg, head)
  return dataclasses.replace(cfg, **{head: scaled(value, rest, factor) if rest else value * factor})


@pytest.mark.parametrize("family,field,factor", [("llama3", "norm_eps", 10.0),
                                                 ("qwen3", "norm_eps", 10.0),
                                                 ("llama3", "rope.theta", 1.01),
                                                 ("qwen3", "rope.theta", 1.01)])
def test_parity_criterion_catches_a_wrong_norm_epsilon_or_rope_base(saved, family, field, factor):
  """The tolerance of the parity tests (tests/numerics.py) is no wider than the defects it must
  catch: a norm epsilon 10x off or a RoPE base 1% off fails it by a wide margin."""
  d, _ = saved(family)
  cfg, params = load(d)
  ids = token_ids(cfg.vocab_size, seed=1)
  _, want = torch_loss_and_grads(d, ids)
  _, got = mtjax_loss_and_grads(scaled(cfg, field, factor), params, ids)
  worst = max(errors(got[k], want[k]) for k in want)
  assert worst[0] > 5 * REL_L2 and worst[1] > 5 * REL_MAX, worst


@pytest.mark.parametrize("family,dtype", [("qwen2", torch.bfloat16), ("qwen3", torch.float16),
                                          ("llama_tied", torch.bfloat16)])
def test_half_precision_import_is_exact(tmp_path, monkeypatch, family, dtype):
  monkeypatch.setattr(hf, "CHUNK", 100)  # each matrix is converted in several row blocks
  m = build(family, tmp_path, dtype)
  assert json.loads((tmp_path / "config.json").read_text())["dtype"] == str(dtype)[6:]
  cfg, params = load(tmp_path)
  got = mtjax.to_hf_names(cfg, params)
  for name, p in m.named_parameters():
    want = p.detach().float().numpy()
    np.testing.assert_array_equal(got[name].view(np.int32), want.view(np.int32), err_msg=name)


def special_values(m):
  """Writes fp32 bit patterns that test bf16 rounding into the embedding table's first row."""
  bits = np.array([0x3F808000, 0x3F818000, 0xBF808000, 0x3F80C000, 0x3F807FFF, 0x7F7FFFFF,
                   0xFF7FFFFF, 0x7FC00001, 0x7F800001, 0x7F800000, 0x80000000, 0x00008000,
                   0x00018000, 0x807FFFFF, 0x00000001, 0x3EAAAAAB], np.uint32)
  with torch.no_grad():
    m.model.embed_tokens.weight[0, :bits.size] = torch.from_numpy(bits.view(np.float32))


def reused_buffer(flats):
  """Groups streamed the way a device download would: one buffer, overwritten for each group."""
  buf = np.empty(max(f.size for f in flats.values()), np.float32)
  for name, flat in flats.items():
    buf[:flat.size] = flat
    yield name, buf[:flat.size]
    buf[:] = np.nan


def test_export_round_trip_with_source(tmp_path):
  src = tmp_path / "src"
  m = build("llama3", src)
  special_values(m)
  m.save_pretrained(src, max_shard_size="20KB")
  for name, text in TOKENIZER.items():
    (src / name).write_text(text)
  cfg, params = load(src)
  want = state_dict_bits(m)

  out32 = hf.export(tmp_path / "f32", cfg, reused_buffer(flats_of(cfg, params)), dtype="float32",
                    source_dir=src, max_shard_bytes=20_000)
  n = len(list(out32.glob("model-*-of-*.safetensors")))
  assert n > 2 and (out32 / f"model-{n:05d}-of-{n:05d}.safetensors").exists()
  config = json.loads((out32 / "config.json").read_text())
  assert config["dtype"] == "float32" and config["initializer_range"] == 0.2
  for name, text in TOKENIZER.items():
    assert (out32 / name).read_text() == text
  assert (out32 / "generation_config.json").read_bytes() == (
      src / "generation_config.json").read_bytes()
  m32 = transformers.AutoModelForCausalLM.from_pretrained(out32)
  assert m32.dtype == torch.float32
  assert_bits_equal(state_dict_bits(m32), want)

  out16 = hf.export(tmp_path / "bf16", cfg, iter(flats_of(cfg, params).items()), dtype="bfloat16",
                    source_dir=src)
  assert sorted(p.name for p in out16.glob("*.safetensors")) == ["model.safetensors"]
  assert json.loads((out16 / "config.json").read_text())["dtype"] == "bfloat16"
  m16 = transformers.AutoModelForCausalLM.from_pretrained(out16)
  assert m16.dtype == torch.bfloat16
  source_nan = np.isnan(m.model.embed_tokens.weight.detach().numpy())
  got, want16 = state_dict_bits(m16), state_dict_bits(m.to(torch.bfloat16))
  # NaN stays NaN, but its bits are torch's choice (0xFFFF from its vectorized loop, 0x7FC0 from
  # its scalar one); every other value must be torch's rounding exactly.
  nan = np.isnan(m16.model.embed_tokens.weight.detach().float().numpy())
  assert nan.sum() == 2 and (nan == source_nan).all()
  got["model.embed_tokens.weight"][nan] = want16["model.embed_tokens.weight"][nan]
  assert_bits_equal(got, want16)
  assert not list(tmp_path.glob(".*"))  # no temporary directory left behind


@pytest.mark.parametrize("family", ["llama3", "llama_tied", "qwen2", "qwen3"])
def test_export_without_source_writes_a_config_transformers_reads(saved, tmp_path, family):
  d, m = saved(family)
  cfg, params = load(d)
  out = hf.export(tmp_path / "out", cfg, iter(flats_of(cfg, params).items()), dtype="float32",
                  max_shard_bytes=30_000)
  assert ModelConfig(**hf.Checkpoint(out).model_fields(), from_hf=cfg.from_hf) == cfg
  m2 = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
  assert type(m2) is type(m)
  assert_bits_equal(state_dict_bits(m2), state_dict_bits(m))
  ids = torch.from_numpy(token_ids(cfg.vocab_size)).long()
  with torch.no_grad():
    np.testing.assert_array_equal(m2(ids).logits.numpy(), m(ids).logits.numpy())


def test_export_is_all_or_nothing(saved, tmp_path):
  d, _ = saved("llama3")
  cfg, params = load(d)
  flats = flats_of(cfg, params)

  def failing():
    yield "embed", flats["embed"]
    yield "block_0", flats["block_0"]
    raise RuntimeError("disk full")

  with pytest.raises(RuntimeError, match="disk full"):
    hf.export(tmp_path / "out", cfg, failing(), max_shard_bytes=10_000)
  assert list(tmp_path.iterdir()) == []
  with pytest.raises(hf.HFError, match=r"got group 'head', expected block_1"):
    hf.export(tmp_path / "out", cfg, [(k, flats[k]) for k in ("embed", "block_0", "head")])
  assert list(tmp_path.iterdir()) == []
  (tmp_path / "out").mkdir()
  (tmp_path / "out" / "keep").write_text("x")
  with pytest.raises(hf.HFError, match="not an empty directory"):
    hf.export(tmp_path / "out", cfg, iter(flats.items()))


def one_line(excinfo, *parts):
  msg = str(excinfo.value)
  assert "\n" not in msg, msg
  for p in parts:
    assert p in msg, msg


@pytest.mark.parametrize("edit,parts", [
    (dict(architectures=["GPT2LMHeadModel"]), ["GPT2LMHeadModel", "unsupported"]),
    (dict(attention_bias=True), ["attention_bias=True"]),
    (dict(mlp_bias=True), ["mlp_bias=True"]),
    (dict(hidden_act="gelu"), ["hidden_act='gelu'"]),
    (dict(rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e4}),
     ["'dynamic'"]),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}),
     ["original_max_position_embeddings"]),
    (dict(rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4}),
     ["low_freq_factor"]),
    (dict(hidden_size=None), ["hidden_size", "missing"]),
    (dict(quantization_config={"quant_method": "gptq"}), ["quant_method='gptq'", "llama"]),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 2}),
     ["model.rope.partial: 2.0 must be in (0, 1]"]),
])
def test_unsupported_config_is_a_one_line_error(saved, edit, parts):
  d, _ = saved("llama3")
  config = {**json.loads((d / "config.json").read_text()), **edit}
  with pytest.raises(hf.HFError) as e:
    hf.model_fields(config, "x/config.json")
  one_line(e, "x/config.json", *parts)


@pytest.mark.parametrize("change,parts", [
    ("missing", ["model.layers.1.mlp.up_proj.weight", "missing"]),
    ("misshapen", ["model.layers.1.mlp.up_proj.weight", "[47, 32]", "[48, 32]"]),
    ("unexpected", ["model.layers.2.mlp.up_proj.weight", "unexpected"]),
    ("truncated", ["model.safetensors: tensor", "past the end of the file"]),
])
def test_bad_tensors_are_one_line_errors_before_anything_is_read(tmp_path, change, parts):
  build("llama_tied", tmp_path)
  path = tmp_path / "model.safetensors"
  tensors = safetensors.numpy.load_file(path)
  name = "model.layers.1.mlp.up_proj.weight"
  if change == "missing":
    del tensors[name]
  elif change == "misshapen":
    tensors[name] = tensors[name][:-1]
  elif change == "unexpected":
    tensors["model.layers.2.mlp.up_proj.weight"] = tensors[name]
  safetensors.numpy.save_file(tensors, path)
  if change == "truncated":
    with open(path, "r+b") as f:
      f.truncate(path.stat().st_size - 4)
  ckpt = hf.Checkpoint(tmp_path)
  cfg = ModelConfig(**ckpt.model_fields())
  with pytest.raises(hf.HFError) as e:
    ckpt.check(models.spec(cfg))
  one_line(e, str(tmp_path), *parts)


def test_tied_lm_head_and_rotary_buffers_are_tolerated(tmp_path):
  m = build("llama_tied", tmp_path)
  path = tmp_path / "model.safetensors"
  tensors = safetensors.numpy.load_file(path)
  tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
  tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(4, np.float32)
  safetensors.numpy.save_file(tensors, path)
  cfg, params = load(tmp_path)
  np.testing.assert_array_equal(params["embed"]["table"],
                                m.model.embed_tokens.weight.detach().numpy())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_import_holds_at_most_one_tensor_beside_the_state(tmp_path, dtype):
  torch.manual_seed(0)
  c = transformers.LlamaConfig(**{**BASE, "vocab_size": 2048, "hidden_size": 64,
                                  "intermediate_size": 1024, "num_hidden_layers": 1})
  transformers.AutoModelForCausalLM.from_config(c).to(dtype).save_pretrained(tmp_path)
  ckpt = hf.Checkpoint(tmp_path)
  cfg = ModelConfig(**ckpt.model_fields())
  spec = models.spec(cfg)
  ckpt.check(spec)
  for g, _ in spec.groups:
    lay = spec.group_layout(g)
    out = np.zeros(lay.size, np.float32)
    largest = max(int(np.prod(p.shape)) for p in spec.family.pieces(cfg, g, lay)) * 4
    assert out.nbytes > 2 * largest or g != "block_0"  # a whole-group temporary would show
    tracemalloc.start()
    try:
      ckpt.read_group(spec, g, out)
      peak = tracemalloc.get_traced_memory()[1]
    finally:
      tracemalloc.stop()
    assert peak < largest + 64 * 1024, (g, peak, largest)


def test_engine_gradients_on_an_imported_model_match_torch(tmp_path):
  from mtjax import data, engine, launch, store as store_lib
  build("qwen3", tmp_path / "src")
  cfg = cli.load_config(None, [f"model.from_hf={tmp_path / 'src'}", "engine.compute_dtype=float32",
                           "engine.device_state_layers=1", "engine.device_update_layers=1",
                           "train.batch=2", "train.seq=12"])
  assert cfg.model.qk_norm and cfg.model.head_dim == 16  # the shape came from config.json
  cfg, _ = launch.plan_run(cfg)
  st = store_lib.create(cfg, jax.random.key(0))
  hf.load_into(st, cfg.model.from_hf)
  b = data.synthetic_batch(0, 2, 12, cfg.model.vocab_size, seed=3)
  eng = engine.Engine(cfg, st)
  loss, grads = eng.grads(b)
  eng.close()
  m = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "src", attn_implementation="eager")
  out = m(torch.tensor(b.inputs, dtype=torch.long))
  want = torch.nn.functional.cross_entropy(out.logits.reshape(-1, cfg.model.vocab_size),
                                           torch.tensor(b.targets, dtype=torch.long).reshape(-1))
  want.backward()
  assert_close(loss, want.item(), name="loss")
  torch_grads = {n: p.grad.numpy() for n, p in m.named_parameters()}
  for g, (name, _) in zip(grads, st.spec.groups):
    for hf_name, arr in hf.hf_tensors(st.spec, name, g):
      assert_close(arr, torch_grads[hf_name], name=hf_name)


def test_fine_tune_from_hf_exports_a_model_transformers_loads(tmp_path):
  import subprocess
  import sys
  from mtjax import checkpoint, store as store_lib, train
  src = tmp_path / "src"
  build("llama3", src)
  for name, text in TOKENIZER.items():
    (src / name).write_text(text)
  cfg = cli.load_config(None, [f"model.from_hf={src}", "engine.compute_dtype=float32",
                           "train.batch=2", "train.seq=12", "train.steps=3", "optim.lr=1e-3",
                           "optim.warmup_steps=0", f"train.checkpoint_dir={tmp_path / 'ck'}",
                           f"train.export_dir={tmp_path / 'out'}", "train.export_dtype=float32"])
  s = train.run(cfg, progress=False)
  assert s["steps"] == 3
  # The export at the end of training is the trained state, bit for bit, and loads unchanged.
  cfg_r = cli.load_config(None, [f"model.from_hf={src}", "engine.device_state_layers=0",
                                 "engine.device_update_layers=0"])
  st = store_lib.create(cfg_r, jax.random.key(1))
  checkpoint.restore(st, checkpoint.latest(tmp_path / "ck"))
  trained = {g.name: st.read(i)["w"] for i, g in enumerate(st.groups)}
  m = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager")
  sd = {k: v.numpy() for k, v in m.state_dict().items()}
  for name, flat in trained.items():
    for hf_name, arr in hf.hf_tensors(st.spec, name, flat):
      np.testing.assert_array_equal(sd[hf_name], arr, err_msg=hf_name)
  ids = token_ids(cfg.model.vocab_size)
  want = logits(st.model_cfg, st.to_tree(), ids)
  got = m(torch.tensor(ids, dtype=torch.long)).logits.detach().numpy()
  assert_close(got, want, name="logits of the export")
  assert (tmp_path / "out" / "tokenizer.json").exists()
  # The export command reads the same checkpoint into the same tensors.
  r = subprocess.run([sys.executable, "-m", "mtjax.export", "--checkpoint", str(tmp_path / "ck"),
                      "--out", str(tmp_path / "out2"), "--dtype", "float32"],
                     capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr
  again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out2")
  assert_bits_equal(state_dict_bits(again), state_dict_bits(m))
  r = subprocess.run([sys.executable, "-m", "mtjax.export", "--checkpoint", str(tmp_path / "ck"),
                      "--out", str(tmp_path / "out2")], capture_output=True, text=True, timeout=300)
  assert r.returncode == 2 and r.stderr.startswith("error:") and r.stderr.count("\n") == 1


@pytest.mark.soak  # long; the README run's time budget (the soak runs it)
def test_export_keeps_the_source_identity_from_any_directory(tmp_path, monkeypatch):
  """A relative model.from_hf is resolved when the config loads; each checkpoint keeps a copy of
  the source's config.json and tokenizer files, so an export run from another directory, or after
  the source is gone, writes the source's own config (a Mistral stays a Mistral); without either,
  it refuses in one line instead of writing a generated config."""
  import shutil
  import subprocess
  import sys
  from mtjax import checkpoint, train
  build("mistral", tmp_path / "src")
  for name, text in TOKENIZER.items():
    (tmp_path / "src" / name).write_text(text)
  want = json.loads((tmp_path / "src" / "config.json").read_text())
  monkeypatch.chdir(tmp_path)
  cfg = cli.load_config(None, ["model.from_hf=src", "engine.compute_dtype=float32", "train.batch=2",
                           "train.seq=8", "train.steps=1", "train.checkpoint_dir=ck"])
  assert cfg.model.from_hf == str(tmp_path / "src")
  train.run(cfg, progress=False)
  (tmp_path / "elsewhere").mkdir()

  def export(out, *extra):
    return subprocess.run([sys.executable, "-m", "mtjax.export", "--checkpoint", str(tmp_path / "ck"),
                           "--out", str(tmp_path / out), "--dtype", "float32", *extra],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path / "elsewhere",
                          env={**os.environ, "PYTHONPATH": str(ROOT)})

  def exported_config(out):
    got = json.loads((tmp_path / out / "config.json").read_text())
    assert got["architectures"] == ["MistralForCausalLM"] and got["model_type"] == "mistral"
    assert {k: v for k, v in got.items() if k not in ("dtype", "torch_dtype")} == {
        k: v for k, v in want.items() if k not in ("dtype", "torch_dtype")}
    for name, text in TOKENIZER.items():
      assert (tmp_path / out / name).read_text() == text

  r = export("out1")
  assert r.returncode == 0, r.stderr
  exported_config("out1")
  shutil.rmtree(tmp_path / "src")  # the source is gone: the checkpoint's copy serves
  r = export("out2")
  assert r.returncode == 0, r.stderr
  exported_config("out2")
  shutil.rmtree(checkpoint.latest(tmp_path / "ck") / checkpoint.SOURCE_DIR)  # nothing left
  r = export("out3")
  assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
  assert "which is gone" in r.stderr and "--source" in r.stderr
  assert not (tmp_path / "out3").exists()
  r = export("out4", "--source", str(tmp_path / "out1"))  # the user says where the source is
  assert r.returncode == 0, r.stderr
  exported_config("out4")


def test_a_head_dim_written_out_is_the_same_model_as_one_left_derived(tmp_path):
  """`model.head_dim: 16` at hidden / heads = 16 is the model a config.json without head_dim
  describes (as transformers reads both): the export of such a run writes its config, a run from that export may repeat the key
  and resume the other's checkpoint; another head_dim is still refused in one line."""
  from mtjax import checkpoint, config, train
  tiny = ROOT / "configs" / "tiny.yaml"  # hidden 64, 4 heads
  base = ["engine.compute_dtype=float32", "train.steps=1", "train.batch=2", "train.seq=8"]
  train.run(config.load(tiny, [*base, "model.head_dim=16", f"train.export_dir={tmp_path / 'x'}",
                               f"train.run_dir={tmp_path / 'r1'}"]), progress=False)
  assert json.loads((tmp_path / "x" / "config.json").read_text())["head_dim"] == 16
  cfg = cli.load_config(tiny, [*base, "model.head_dim=16", f"model.from_hf={tmp_path / 'x'}"])
  assert cfg.model.dim_per_head == 16
  with pytest.raises(config.ConfigError, match=r"model\.head_dim: 32 differs from .*config\.json"):
    cli.load_config(tiny, [*base, "model.head_dim=32", f"model.from_hf={tmp_path / 'x'}"])
  saved = config.to_dict(config.load(tiny, ["model.head_dim=16"]).model)
  assert checkpoint.model_difference(saved, config.to_dict(config.load(tiny).model)) is None
  assert "model.head_dim" in checkpoint.model_difference(
      saved, config.to_dict(config.load(tiny, ["model.head_dim=8"]).model))


def test_max_position_is_read_from_config_json_and_written_back(saved, tmp_path):
  """config.json's max_position_embeddings is model.max_position: read on import (from_hf keeps
  it), written back by an export with its own config.json, and a model that states none exports
  its RoPE's context."""
  d, _ = saved("llama3")
  src = tmp_path / "src"
  src.mkdir()
  for f in d.iterdir():
    (src / f.name).write_bytes(f.read_bytes())
  config = json.loads((src / "config.json").read_text())
  (src / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 77}))
  cfg, params = load(src)
  assert cfg.max_position == 77
  out = hf.export(tmp_path / "out", cfg, iter(flats_of(cfg, params).items()), dtype="float32")
  assert json.loads((out / "config.json").read_text())["max_position_embeddings"] == 77
  assert load(out)[0].max_position == 77
  run = cli.load_config(None, [f"model.from_hf={src}"])
  assert run.model.max_position == 77
  # the one model key a run may set beyond its config.json: how far it trains the model
  assert cli.load_config(None, [f"model.from_hf={src}", "model.max_position=99"]
                         ).model.max_position == 99
  own = dataclasses.replace(cfg, max_position=None, from_hf=None)
  out = hf.export(tmp_path / "own", own, iter(flats_of(cfg, params).items()), dtype="float32")
  assert json.loads((out / "config.json").read_text())["max_position_embeddings"] == 16 * 8


def test_every_registered_family_has_a_parity_test():
  """Each family is held to transformers by a test marked `parity.covers` (which fails unless it
  imports a checkpoint of its families): a family registered without one fails here, and so does
  a mark naming a family that is not registered."""
  import ast
  covered = {}
  for path in sorted(Path(__file__).parent.glob("test_*.py")):
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.FunctionDef):
        for d in node.decorator_list:
          if (isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute)
              and d.func.attr == "covers" and ast.unparse(d.func.value) == "parity"):
            for a in d.args:
              covered.setdefault(a.value, []).append(f"{path.name}::{node.name}")
  registered = set(models.families())
  assert registered - covered.keys() == set(), "families without a parity test"
  assert covered.keys() - registered == set(), "parity marks naming no registered family"


def test_a_family_is_declared_in_its_module_alone(tmp_path):
  """A family module dropped into mtjax.models (here: a directory on its package path) is found
  without a list to extend, its decoder of packed weights and its tolerated tensors are used by
  the importer, and the generated README table and model.family row name it."""
  import subprocess
  import sys
  import textwrap
  (tmp_path / "fams").mkdir()
  (tmp_path / "fams" / "tinypack.py").write_text(textwrap.dedent('''
      """Llama's layers, with each weight stored as int8 rows and their fp32 scales."""
      import numpy as np
      from mtjax.models.common import standard_pieces
      from mtjax.models.registry import Decoder, Family, FamilyError, get, register

      class Int8Rows(Decoder):
        quant_method = "int8rows"

        def sources(self, stored, config, name, shape):
          q = stored.get(name + "_q")
          if q is None:
            return None
          if q.dtype != "I8" or q.shape != tuple(shape):
            raise FamilyError(f"{q.file}: tensor {name}_q is {q.dtype} {list(q.shape)}")
          return [name + "_q", name + "_scale"]

        def decode(self, read, name):
          return read(name + "_q").astype(np.float32) * read(name + "_scale")[:, None]

      def read_config(config, where):
        return get("llama").read_config(config, where)

      register(Family("tinypack", ("TinyPackForCausalLM",), read_config,
                      lambda cfg, dtype: {}, standard_pieces, decoders=(Int8Rows(),),
                      ignored=lambda config, name: name.startswith("extra."),
                      notes="made up for a test"))
      '''))
  script = textwrap.dedent(f'''
      import json, sys
      import numpy as np, safetensors.numpy
      import mtjax
      from mtjax import config_reference, hf, models
      from mtjax.config import ModelConfig
      sys.modules["mtjax.models"].__path__.append({str(tmp_path / "fams")!r})
      d = {str(tmp_path / "ck")!r}
      cfg = ModelConfig(vocab_size=64, hidden=16, layers=1, heads=2, ffn=24)
      spec = models.spec(cfg)
      rng = np.random.default_rng(0)
      hf.export(d, cfg, [(g, rng.standard_normal(spec.group_layout(g).size).astype(np.float32))
                         for g, _ in spec.groups], dtype="float32")
      tensors = safetensors.numpy.load_file(d + "/model.safetensors")
      name = "model.layers.0.mlp.up_proj.weight"
      w = tensors.pop(name)
      scale = (np.abs(w).max(1) / 127).astype(np.float32)
      tensors[name + "_q"] = np.round(w / scale[:, None]).astype(np.int8)
      tensors[name + "_scale"] = scale
      tensors["extra.buffer"] = np.zeros(3, np.float32)
      safetensors.numpy.save_file(tensors, d + "/model.safetensors")
      config = json.load(open(d + "/config.json"))
      config.update(architectures=["TinyPackForCausalLM"],
                    quantization_config={{"quant_method": "int8rows"}})
      json.dump(config, open(d + "/config.json", "w"))
      got, params = mtjax.load_hf(d)
      assert got.family == "tinypack" and models.get("tinypack").module == "mtjax.models.tinypack"
      want = tensors[name + "_q"].astype(np.float32) * scale[:, None]
      np.testing.assert_array_equal(mtjax.to_hf_names(got, params)[name], want)
      assert "| `tinypack` | TinyPackForCausalLM | made up for a test |" in (
          config_reference.family_table())
      row = [r for r in config_reference.table(["model"]).splitlines() if "`model.family`" in r]
      assert "tinypack" in row[0], row
      print("found")
      ''')
  r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
  assert r.returncode == 0 and r.stdout.strip() == "found", r.stderr[-3000:]


def test_every_public_name_of_hf_is_used():
  """hf holds no dead code: each public function or class is used outside hf.py."""
  import inspect
  root = Path(__file__).parent.parent
  texts = [p.read_text() for d in ("mtjax", "tests", "benchmarks", "examples")
           for p in (root / d).rglob("*.py") if p != root / "mtjax" / "hf.py"]
  names = [n for n, v in vars(hf).items() if not n.startswith("_") and
           (inspect.isfunction(v) or inspect.isclass(v)) and v.__module__ == hf.__name__]
  unused = [n for n in names if not any(f"hf.{n}" in t or f" {n}(" in t for t in texts)]
  assert not unused, unused
