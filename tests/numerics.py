"""Comparing a result with an independent reference at the precision float32 allows.

Two float32 computations of the same math differ by rounding that depends on the order of every
reduction: thread counts, XLA's fusions, torch's kernels. An element-wise tolerance
(`rtol * |want| + atol`) fails at random on the elements that are sums of cancelling terms: a bias
gradient summing terms of +-0.1 to 0.002 carries the rounding of the terms, not of the result
(-0.0023127 against torch's -0.0023108 failed a fresh machine's run). Rounding is bounded by the
magnitude of what was summed, so the criteria here scale with the whole tensor:

- relative L2 error: ||got - want|| <= rel_l2 * ||want||;
- every element: |got - want| <= rel_max * max|want|.

The float32 bounds: over 20 runs of the Hugging Face parity tests (Llama 3, tied Llama, Mistral,
Qwen2, Qwen3; 1 or 2 threads, XLA's multi-threaded Eigen on and off) the worst gradient tensor was
at 2.1e-6 relative L2 and 4.0e-6 of its max magnitude (about 33 float32 epsilons), logits at 1e-6.
REL_L2 and REL_MAX leave 5x that. They still catch real defects by a wide margin
(test_hf.py::test_parity_criterion_catches_a_wrong_norm_epsilon_or_rope_base): a norm epsilon of
1e-5 for 1e-6 moves the gradients by 2.6e-4 to 1.2e-3, a RoPE base 1% off by 1.2e-4 to 2.2e-3.
"""

import jax
import numpy as np

FP32_EPS = float(np.finfo(np.float32).eps)  # 1.19e-7
REL_L2 = 1e-5  # about 84 float32 epsilons
REL_MAX = 2e-5  # about 170


def errors(got, want, zero_scale: float = 0.0) -> tuple[float, float]:
  """(relative L2 error, largest element error over the largest |want|) of got against want.

  An all-zero `want` (a gradient that vanishes exactly, such as a query's for a lone token) has no
  scale of its own: its errors are measured against `zero_scale`, the magnitude of the computation
  it came from, and with none given only exact zeros match it."""
  got = np.asarray(got, np.float64)
  want = np.asarray(want, np.float64)
  if got.shape != want.shape:
    raise AssertionError(f"shape {got.shape}, expected {want.shape}")
  diff = got - want
  if not np.all(np.isfinite(got)) and not np.array_equal(np.isnan(got), np.isnan(want)):
    return float("inf"), float("inf")
  norm, top = np.linalg.norm(want), np.max(np.abs(want), initial=0.0)
  if top == 0:
    worst = float(np.max(np.abs(diff), initial=0.0))
    if worst == 0:
      return 0.0, 0.0
    if zero_scale == 0:
      return float("inf"), float("inf")
    size = np.sqrt(diff.size)
    return float(np.linalg.norm(diff) / (zero_scale * size)), worst / zero_scale
  return float(np.linalg.norm(diff) / norm), float(np.max(np.abs(diff)) / top)


def assert_close(got, want, rel_l2: float = REL_L2, rel_max: float = REL_MAX, name: str = "",
                 zero_scale: float = 0.0, atol: float = 0.0):
  """Fails unless `got` is within rel_l2 (relative L2) and rel_max (of max|want|) of `want`.

  `atol` widens both by an absolute amount per element, for values that rounding can move by a
  known absolute size whatever their own: weights after Adam steps, whose per-coordinate step is up
  to lr however small the gradient, so a gradient that cancels to rounding level (a key bias: the
  softmax is shift-invariant) moves its weight by a fraction of lr."""
  if atol:
    diff = np.abs(np.asarray(got, np.float64) - np.asarray(want, np.float64))
    got = np.asarray(want, np.float64) + np.sign(diff) * np.maximum(diff - atol, 0.0)
  l2, top = errors(got, want, zero_scale)
  if not (l2 <= rel_l2 and top <= rel_max):
    raise AssertionError(f"{name or 'array'}: relative L2 error {l2:.3g} (bound {rel_l2:.3g}), "
                         f"largest element error {top:.3g} of max|want| (bound {rel_max:.3g})"
                         + (f" beyond {atol:.3g} per element" if atol else ""))


def assert_trees_close(got, want, rel_l2: float = REL_L2, rel_max: float = REL_MAX,
                       name: str = "", atol: float = 0.0):
  """`assert_close` on every leaf of two trees of the same structure, each leaf on its own; an
  all-zero leaf of `want` is measured against the largest magnitude in the whole tree."""
  flat_got, tree_got = jax.tree_util.tree_flatten_with_path(got)
  flat_want, tree_want = jax.tree_util.tree_flatten_with_path(want)
  if tree_got != tree_want:
    raise AssertionError(f"{name}: tree structures differ: {tree_got} vs {tree_want}")
  scale = max((float(np.max(np.abs(np.asarray(w, np.float64)), initial=0.0)) for _, w in flat_want),
              default=0.0)
  for (path, g), (_, w) in zip(flat_got, flat_want):
    assert_close(g, w, rel_l2, rel_max, f"{name}{jax.tree_util.keystr(path)}", scale, atol)
