"""The OLMo 2 family against transformers through the parity harness (tests/parity.py): norms
after attention and the MLP only, q/k norms over the whole projection."""

import dataclasses
import json
import shutil

import numpy as np
import pytest

import mtjax
from mtjax import hf
from mtjax.models import FamilyError, read_hf_config
from numerics import REL_L2, errors

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# After the skip: the parity harness imports torch and transformers.
import parity


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  d = tmp_path_factory.mktemp("olmo2")
  config = transformers.Olmo2Config(
      vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2, rms_norm_eps=1e-6,
      rope_parameters={"rope_type": "default", "rope_theta": 5e5},
      # OLMo 2's pad id makes torch zero one embedding row's gradient (padding_idx).
      pad_token_id=None, eos_token_id=None)
  parity.save_tiny(config, d / "src")
  return d


def _moves(cfg, params, other_cfg, other_params, factor: float = 100.0) -> float:
  """How far the logits move under another config and parameters (relative L2), asserted beyond
  `factor` times the parity bound, as parity.feature_matters for a change the parameters follow."""
  ids = parity.token_ids(cfg.vocab_size)
  base = np.asarray(mtjax.forward(cfg, params, ids))
  moved = errors(np.asarray(mtjax.forward(other_cfg, other_params, ids)), base)[0]
  assert moved > factor * REL_L2, moved
  return moved


@parity.covers("olmo2")
def test_olmo2_equals_transformers(saved):
  d = saved
  cfg, params, _ = parity.check_logits_and_gradients(d / "src")
  assert (cfg.family, cfg.norm_position, cfg.qk_norm, cfg.qk_norm_scope) == (
      "olmo2", "post", True, "all")
  assert (cfg.rope.theta, cfg.norm_eps) == (5e5, 1e-6)
  parity.feature_matters(cfg, params, qk_norm=False)

  # Per head instead of over the whole projection, with the same scale for each head's channels:
  # only the statistic the norm divides by changes.
  hd = cfg.dim_per_head
  per_head = [{**b, "attn": {**b["attn"], **{n: {"scale": b["attn"][n]["scale"][:hd]}
                                             for n in ("q_norm", "k_norm")}}}
              for b in params["blocks"]]
  tiled = [{**b, "attn": {**b["attn"], **{n: {"scale": np.tile(b["attn"][n]["scale"][:hd],
                                                               len(b["attn"][n]["scale"]) // hd)}
                                          for n in ("q_norm", "k_norm")}}}
           for b in params["blocks"]]
  _moves(cfg, {**params, "blocks": tiled}, dataclasses.replace(cfg, qk_norm_scope="head"),
         {**params, "blocks": per_head})
  # The norms before the sub-layers instead of after them, with the same scales.
  pre = [{**{k: v for k, v in b.items() if not k.startswith("post_")},
          "attn_norm": b["post_attn_norm"], "mlp_norm": b["post_mlp_norm"]}
         for b in params["blocks"]]
  _moves(cfg, params, dataclasses.replace(cfg, norm_position="pre"), {**params, "blocks": pre})

  parity.pieces_cover_every_parameter(cfg)
  parity.check_export(cfg, params, d / "own")  # the family's config.json
  parity.check_adamw_step(d / "src")


def test_olmo2_config_errors_are_one_line(saved, tmp_path):
  d = saved
  good = json.loads((d / "src" / "config.json").read_text())
  bad = {
      "attention_bias=True unsupported": {"attention_bias": True},
      "partial_rotary_factor=0.5 unsupported": {"partial_rotary_factor": 0.5},
      "hidden_act='relu' unsupported": {"hidden_act": "relu"},
      "rope_type 'dynamic' unsupported": {"rope_parameters": {"rope_type": "dynamic", "factor": 2}},
      "required key 'hidden_size' missing": {"hidden_size": None},
  }
  for message, change in bad.items():
    with pytest.raises(FamilyError, match=message) as e:
      read_hf_config({**good, **change}, "x/config.json")
    assert "\n" not in str(e.value) and str(e.value).startswith("x/config.json: ")
  # Tensors of the wrong shape (config.json's key/value heads doubled), named before any read.
  shutil.copytree(d / "src", tmp_path / "m")
  (tmp_path / "m" / "config.json").write_text(json.dumps({**good, "num_key_value_heads": 4}))
  with pytest.raises(hf.HFError, match=r"k_proj.weight has shape \[16, 32\], expected "
                                       r"\[32, 32\]") as e:
    mtjax.load_hf(tmp_path / "m")
  assert "\n" not in str(e.value)
