"""The Llama family's sliding windows (Mistral, Qwen2) against transformers, through the parity
harness (tests/parity.py); the rest of the family is tests/test_hf.py's."""

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# After the skip: the parity harness imports torch and transformers.
import parity

SHAPE = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, initializer_range=0.2)
WINDOWED = {
    "mistral": lambda: transformers.MistralConfig(**SHAPE, sliding_window=4, rope_theta=1e4),
    "qwen2": lambda: transformers.Qwen2Config(**SHAPE, use_sliding_window=True, sliding_window=3,
                                              max_window_layers=1),
}


@pytest.mark.parametrize("family", list(WINDOWED))
@parity.covers("mistral", "qwen2")
def test_sliding_windows_equal_transformers(tmp_path, family):
  parity.save_tiny(WINDOWED[family](), tmp_path / "src")
  cfg, params, _ = parity.check_logits_and_gradients(tmp_path / "src")
  assert cfg.family == family and cfg.sliding_window in (3, 4)
  assert ("sliding" in cfg.layer_types) and (cfg.layer_types[0] == "full") == (family == "qwen2")
  parity.feature_matters(cfg, params, layer_types=None)  # the window changes the logits
  parity.pieces_cover_every_parameter(cfg)
  parity.check_export(cfg, params, tmp_path / "out")
  parity.check_adamw_step(tmp_path / "src")


def test_the_padding_tokens_row_gets_no_gradient_as_in_transformers(tmp_path):
  """transformers' nn.Embedding(padding_idx=pad_token_id) leaves that row's gradient at zero; the
  imported model (model.pad_token_id) and the engine's embedding backward do the same."""
  import numpy as np
  import mtjax
  parity.save_tiny(transformers.LlamaConfig(**{**SHAPE, "num_hidden_layers": 1}, pad_token_id=0),
                   tmp_path)
  cfg, params = mtjax.load_hf(tmp_path)
  assert cfg.pad_token_id == 0
  ids = parity.token_ids(cfg.vocab_size, T=13)
  ids[:, ::3] = 0  # the padding token among the inputs
  want = parity.torch_reference(tmp_path, ids[:, :-1], ids[:, 1:])
  assert not want.grads["model.embed_tokens.weight"][0].any()
  _, got = parity.mtjax_loss_and_grads(cfg, params, ids[:, :-1], ids[:, 1:])
  assert not got["model.embed_tokens.weight"][0].any()
  assert np.abs(got["model.embed_tokens.weight"][1:]).max() > 0
  parity.assert_close(got["model.embed_tokens.weight"], want.grads["model.embed_tokens.weight"],
                      name="embedding gradient")
