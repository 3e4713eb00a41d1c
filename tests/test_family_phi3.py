"""The Phi-3 family against transformers through the parity harness (tests/parity.py): fused
qkv_proj / gate_up_proj, longrope with its short factors up to original_max_position_embeddings and
its long ones beyond, partial rotary, a sliding window in every layer."""

import json
import shutil

import numpy as np
import pytest

import mtjax
from mtjax import hf
from mtjax.config import ModelConfig
from mtjax.models import FamilyError, read_hf_config
from mtjax.models.layers import rope_inv_freq
from numerics import assert_close

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# After the skip: the parity harness imports torch and transformers.
import parity

ORIG = 8  # original_max_position_embeddings: a 12-token sequence is long, a 6-token one short
LONG_T, SHORT_T = 12, 6
# Per-frequency divisors far from 1 and from each other, so the set chosen moves the logits; 6 each:
# half of the 12 RoPE channels of a 16-wide head at partial_rotary_factor 0.75 (as Phi-4-mini).
SHORT = [1.0, 1.5, 2.5, 4.0, 6.0, 9.0]
LONG = [4.0, 7.0, 11.0, 19.0, 30.0, 50.0]


def phi3_config(**kw):
  """A tiny Phi-4-mini: tied, partial rotary, longrope (max/orig = 8: attention factor sqrt(2)),
  and a window of 5 that both sequence lengths exceed."""
  args = dict(vocab_size=96, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2,
              tie_word_embeddings=True, partial_rotary_factor=0.75, sliding_window=5,
              rope_scaling={"type": "longrope", "short_factor": SHORT, "long_factor": LONG},
              original_max_position_embeddings=ORIG, max_position_embeddings=8 * ORIG,
              # Phi-3's pad id (32000) lies beyond a tiny vocabulary; None also keeps torch from
              # zeroing one embedding row's gradient (nn.Embedding's padding_idx).
              pad_token_id=None, eos_token_id=None)
  return transformers.Phi3Config(**{**args, **kw})


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  d = tmp_path_factory.mktemp("phi3")
  model = parity.save_tiny(phi3_config(), d / "src")
  return d, model


@parity.covers("phi3")
def test_phi3_equals_transformers_on_short_and_long_sequences(saved):
  d, model = saved
  # Long: 12 positions > original_max_position_embeddings, so the long factors (logits, loss and
  # every gradient, through the fused tensors split and fused again).
  cfg, params, _ = parity.check_logits_and_gradients(d / "src", T=LONG_T)
  assert (cfg.family, cfg.rope.scaling, cfg.rope.original_max_len) == ("phi3", "longrope", ORIG)
  assert (cfg.rope.partial, cfg.rotary_dim, cfg.rope.factor) == (0.75, 12, 8.0)
  assert cfg.layer_types == ("sliding",) * 2 and cfg.sliding_window == 5 and cfg.tie_embeddings
  # Short: 6 positions, the short factors.
  ids = parity.token_ids(cfg.vocab_size, T=SHORT_T)
  with torch.no_grad():
    want = model(torch.from_numpy(ids).long()).logits.numpy()
  assert_close(np.asarray(mtjax.forward(cfg, params, ids)), want, name="short sequence's logits")

  # Each feature moves the logits far beyond the parity bound: the factor set picked per length,
  # the attention factor, partial rotation, the window.
  parity.feature_matters(cfg, params, T=LONG_T, rope=dict(long_factor=tuple(SHORT)))
  parity.feature_matters(cfg, params, T=SHORT_T, rope=dict(short_factor=tuple(LONG)))
  parity.feature_matters(cfg, params, rope=dict(factor=1.0))
  parity.feature_matters(cfg, params, rope=dict(partial=1.0, short_factor=(*SHORT, 1.0, 1.0),
                                                long_factor=(*LONG, 1.0, 1.0)))
  parity.feature_matters(cfg, params, layer_types=None)

  parity.pieces_cover_every_parameter(cfg)
  parity.check_export(cfg, params, d / "own")  # the family's config.json
  parity.check_export(cfg, params, d / "kept", source=d / "src")
  # One engine step on short sequences (loss before the step, weights after) equals torch AdamW.
  # eps 1e-4 bounds the step's sensitivity to a gradient element at lr / eps: at the default 1e-8,
  # this model's gradient elements near 1e-7 turn their fp32 rounding (1e-8) into weight
  # differences of 5e-5, beyond the harness's 1e-3 lr.
  parity.check_adamw_step(d / "src", T=SHORT_T, **{"optim.eps": 1e-4})


def _tables(cfg_dict: dict):
  """(mtjax's short and long inverse frequencies and factor, transformers') of one config.json."""
  ours = ModelConfig(**read_hf_config(cfg_dict))
  short, factor = rope_inv_freq(ours)
  long, _ = rope_inv_freq(ours, long=True)
  config = transformers.Phi3Config.from_dict(cfg_dict)
  assert config.rope_parameters["rope_type"] == "longrope"
  init = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS["longrope"]
  t_short, t_factor = init(config)
  t_long, _ = init(config, seq_len=config.rope_parameters["original_max_position_embeddings"] + 1)
  return (np.asarray(short), np.asarray(long), factor), (t_short.numpy(), t_long.numpy(), t_factor)


@pytest.mark.parametrize("variant", ["su_outer_orig", "rope_parameters_inner_orig", "factor"])
def test_phi3_rope_keys_read_as_transformers_reads_them(variant):
  """Older and newer RoPE spellings give transformers' frequencies and factor: "su" is longrope,
  the top-level original_max_position_embeddings overrides the RoPE dict's, rope_scaling wins over
  rope_parameters, an explicit factor replaces max/orig."""
  base = {**phi3_config().to_dict(), "architectures": ["Phi3ForCausalLM"]}
  base.pop("rope_parameters")
  rope = {"short_factor": SHORT, "long_factor": LONG}
  if variant == "su_outer_orig":
    c = {**base, "rope_scaling": {"type": "su", **rope}, "rope_theta": 5e4,
         "original_max_position_embeddings": 16, "max_position_embeddings": 160}
  elif variant == "rope_parameters_inner_orig":  # the top level's 8 wins over the dict's 32
    c = {**base, "rope_scaling": None, "rope_parameters": {
        "rope_type": "longrope", "rope_theta": 2e4, "original_max_position_embeddings": 32,
        "partial_rotary_factor": 0.75, **rope}}
  else:
    c = {**base, "rope_scaling": {"rope_type": "longrope", "factor": 3.0, **rope},
         "rope_parameters": {"rope_type": "default"}}
  (short, long, factor), (t_short, t_long, t_factor) = _tables(c)
  assert_close(short, t_short, name="short inverse frequencies")
  assert_close(long, t_long, name="long inverse frequencies")
  assert abs(factor - t_factor) < 1e-12 and factor > 1.1
  assert not np.allclose(short, long)


def test_phi3_config_errors_are_one_line(saved, tmp_path):
  d, _ = saved
  good = json.loads((d / "src" / "config.json").read_text())
  bad = {
      "rope_type 'dynamic' unsupported": {"rope_parameters": {"rope_type": "dynamic", "factor": 2}},
      "short_factor has 5 values, expected 6": {"rope_parameters": {
          **good["rope_parameters"], "short_factor": SHORT[:5]}},
      "lacks 'long_factor'": {"rope_parameters": {"rope_type": "longrope", "short_factor": SHORT}},
      "hidden_act='gelu' unsupported": {"hidden_act": "gelu"},
      "sliding_window=0 must be a positive number": {"sliding_window": 0},
      "required key 'num_hidden_layers' missing": {"num_hidden_layers": None},
  }
  for message, change in bad.items():
    with pytest.raises(FamilyError, match=message) as e:
      read_hf_config({**good, **change}, "x/config.json")
    assert "\n" not in str(e.value) and str(e.value).startswith("x/config.json: ")
  # A fused tensor of the wrong shape, named before anything is read.
  shutil.copytree(d / "src", tmp_path / "m")
  (tmp_path / "m" / "config.json").write_text(json.dumps({**good, "num_key_value_heads": 4}))
  with pytest.raises(hf.HFError, match=r"qkv_proj.weight has shape \[128, 64\], expected "
                                       r"\[192, 64\]") as e:
    mtjax.load_hf(tmp_path / "m")
  assert "\n" not in str(e.value)
