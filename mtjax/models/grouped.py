"""The grouped matmul of a mixture of experts on Hopper GPUs: jax's Pallas Mosaic-GPU ragged-dot
kernels, forward and both gradients, behind one custom_vjp.

XLA lowers `jax.lax.ragged_dot` (and its gradients) on the GPU by expanding the rows into a
zero-masked [rows, E x K] operand: E times the work and memory. The Mosaic-GPU kernels walk each
expert's rows in tiles instead (wgmma from shared memory, TMA copies), at a cost that follows the
rows whatever the routing's skew:

  y  = ragged_dot(x, w)               x [M, D] rows sorted by group, w [E, D, F]
  dx = ragged_dot(dy, w^T)            w^T [E, F, D], materialised once per call (E x D x F)
  dw = transposed_ragged_dot(x, dy)   [E, D, F]: each group's rows contracted

Each kernel's tiles must divide the dimensions it tiles (`tiles`); anything else falls back to
the caller's other implementation. Imported only on a GPU: the kernels import Mosaic-GPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def tiles(dim: int, candidates=(128, 64)) -> int | None:
  """The largest tile in `candidates` that divides `dim`, or None."""
  return next((t for t in candidates if dim % t == 0), None)


def supported(D: int, F: int, dtype) -> bool:
  """Whether the kernels take x [M, D] by w [E, D, F] (and back) in `dtype`."""
  return jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) and all(
      tiles(n) for n in (D, F))


def _forward(x_MxD, w_ExDxF, sizes_E, block_m=128, max_concurrent_steps=4, grid_block_n=1):
  # Imported where it runs: the kernels import Mosaic-GPU, which a host without a GPU may lack.
  from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu
  D, F = w_ExDxF.shape[1:]
  return ragged_dot_mgpu.ragged_dot(
      x_MxD, w_ExDxF, group_sizes=sizes_E.astype(jnp.int32), block_m=block_m,
      block_n=tiles(F), block_k=tiles(D, (64,)) or tiles(D), max_concurrent_steps=max_concurrent_steps,
      grid_block_n=grid_block_n)


def _weight_grad(x_MxD, dy_MxF, sizes_E):
  # Imported where it runs, as in _forward.
  from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu as t
  D, F = x_MxD.shape[1], dy_MxF.shape[1]
  return t.transposed_ragged_dot(x_MxD, dy_MxF, group_sizes=sizes_E.astype(jnp.int32),
                                 block_m=tiles(D), block_n=tiles(F), block_k=64,
                                 max_concurrent_steps=1, grid_block_n=1)


ROWS = 128  # the kernels tile the rows: M is padded to a multiple (rows in no group, dropped)


def _pad_rows(a):
  pad = -a.shape[0] % ROWS
  return jnp.pad(a, ((0, pad), (0, 0))) if pad else a


def grouped_matmul(x_MxD, w_ExDxF, sizes_E):
  """Rows of x sorted by group times their group's matrix, [M, F], on Mosaic-GPU kernels."""
  M = x_MxD.shape[0]
  return _grouped(_pad_rows(x_MxD), w_ExDxF, sizes_E)[:M]


@jax.custom_vjp
def _grouped(x_MxD, w_ExDxF, sizes_E):
  return _forward(x_MxD, w_ExDxF, sizes_E)


def _fwd(x, w, sizes):
  return _forward(x, w, sizes), (x, w, sizes)


def _bwd(residuals, dy_MxF):
  x_MxD, w_ExDxF, sizes_E = residuals
  dy = dy_MxF.astype(x_MxD.dtype)
  dx = _forward(dy, jnp.swapaxes(w_ExDxF, 1, 2), sizes_E)
  dw = _weight_grad(x_MxD, dy, sizes_E).astype(w_ExDxF.dtype)
  return dx, dw, None


_grouped.defvjp(_fwd, _bwd)
