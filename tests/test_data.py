"""Data: deterministic batches from the synthetic stream and from a flat token file."""

import numpy as np
import pytest

from mtjax import config, data


def test_synthetic_is_deterministic_shifted_and_in_range():
  a = data.synthetic_batch(3, 4, 16, 50, seed=1)
  b = data.synthetic_batch(3, 4, 16, 50, seed=1)
  c = data.synthetic_batch(4, 4, 16, 50, seed=1)
  np.testing.assert_array_equal(a.inputs, b.inputs)
  assert not np.array_equal(a.inputs, c.inputs)
  np.testing.assert_array_equal(a.inputs[:, 1:], a.targets[:, :-1])
  assert a.inputs.dtype == np.int32 and a.inputs.min() >= 0 and a.inputs.max() < 50
  step = (a.targets - a.inputs) % 50
  assert np.all(step == step[:, :1])  # one stride per sequence: learnable


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_token_file_windows(tmp_path, dtype):
  toks = np.arange(1000, dtype=dtype) % 300
  path = tmp_path / "toks.bin"
  toks.tofile(path)
  cfg = config.DataConfig(source="tokens", path=str(path), dtype=dtype)
  it = data.batches(cfg, batch=3, seq=8, vocab=300, seed=0)
  b0, b1 = next(it), next(it)
  again = next(data.batches(cfg, batch=3, seq=8, vocab=300, seed=0, start_step=1))
  np.testing.assert_array_equal(b1.inputs, again.inputs)
  for row_in, row_t in zip(b0.inputs, b0.targets):
    start = int(np.flatnonzero(toks == row_in[0])[0])
    np.testing.assert_array_equal(row_in, toks[start:start + 8])
    np.testing.assert_array_equal(row_t, toks[start + 1:start + 9])


def test_token_file_errors(tmp_path):
  with pytest.raises(FileNotFoundError, match="data.path"):
    data.TokenFile(tmp_path / "missing.bin", "uint16", 10)
  short = tmp_path / "short.bin"
  np.arange(5, dtype=np.uint16).tofile(short)
  with pytest.raises(ValueError, match="fewer"):
    data.TokenFile(short, "uint16", 10).batch(0, 1, 8, 0)
  big = tmp_path / "big.bin"
  np.full(100, 70, np.uint16).tofile(big)
  with pytest.raises(ValueError, match="vocab_size"):
    data.TokenFile(big, "uint16", 64).batch(0, 1, 8, 0)
