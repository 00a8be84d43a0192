"""Merged gate/up expert weights: one array whose columns (bf16) or rows (MXFP4) interleave gate
and up, so the fused GLU kernel runs ONE matmul of 2 bn columns per tile instead of two of bn.

Why: a tile's x operand then feeds one wider MMA (bf16: the plain grouped matmul's 256-column
tiles), and with MXFP4 each decoded weight tile serves twice the rows for the same accumulator
registers (bm 256 with 64 output columns: 128 weight rows decoded per K step). Built once at load.

MXFP4 merged rows also take the down projection's operand order: output feature pairs in "halves"
order (features 0, 2, 4, ..., then 1, 3, 5, ...: mxfp4.to_halves), so the fused up kernel writes h
exactly as the MXFP4 down kernel reads it (two even / odd dots per K step), with no split pass and
no joined tiles (Tiling.joined reads natural order: not for merged MXFP4 weights).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def _interleave(a, b, axis):
  """[..., n, ...] x 2 -> [..., 2n, ...] with a at even, b at odd positions of `axis`."""
  return jnp.stack([a, b], axis=axis + 1).reshape(
      *a.shape[:axis], 2 * a.shape[axis], *a.shape[axis + 1:])


@jax.jit
def merge_gate_up(w1: jax.Array, w3: jax.Array) -> jax.Array:
  """bf16 gate / up weights [..., E, D, I] -> [..., E, D, 2I], column 2j = w1[..., j], 2j + 1 =
  w3[..., j] (leading axes: e.g. a stack over layers)."""
  if w1.shape != w3.shape:
    raise ValueError(f"gate {w1.shape} and up {w3.shape} weights differ in shape")
  return _interleave(w1, w3, w1.ndim - 1)


def halves_order(n: int):
  """Feature order of the MXFP4 kernels' operand (mxfp4.to_halves): even features, then odd."""
  if n % 2:
    raise ValueError(f"the halves order needs an even width, got {n}")
  return np.concatenate([np.arange(0, n, 2), np.arange(1, n, 2)])


@jax.jit
def merge_gate_up_mxfp4(w1, w3):
  """MXFP4 gate / up (packed [..., E, I, D/2], scales [..., E, I, D/32]) -> (packed [..., E, 2I, D/2],
  scales [..., E, 2I, D/32]): rows 2p, 2p + 1 = gate, up rows of feature f(p), f = halves_order(I). Rows are
  whole output features, each with its own scales, so the permutation is lossless."""
  (p1, s1), (p3, s3) = w1, w3
  if p1.shape != p3.shape or s1.shape != s3.shape:
    raise ValueError(f"gate {p1.shape, s1.shape} and up {p3.shape, s3.shape} weights differ")
  axis = p1.ndim - 2
  f = halves_order(p1.shape[axis])
  take = lambda a: jnp.take(a, f, axis=axis)
  return _interleave(take(p1), take(p3), axis), _interleave(take(s1), take(s3), axis)


def split_gate_up(w13: jax.Array, axis: int):
  """Inverse of the interleave: (gate, up) from a merged array along `axis`."""
  idx = [slice(None)] * w13.ndim
  even, odd = list(idx), list(idx)
  even[axis], odd[axis] = slice(0, None, 2), slice(1, None, 2)
  return w13[tuple(even)], w13[tuple(odd)]


def unmerge_gate_up_mxfp4(w13):
  """Inverse of merge_gate_up_mxfp4: ((packed, scales) gate, (packed, scales) up)."""
  p, s = w13
  axis = p.ndim - 2
  inv = np.argsort(halves_order(p.shape[axis] // 2))
  back = lambda a: jnp.take(a, inv, axis=axis)
  (p1, p3), (s1, s3) = split_gate_up(p, axis), split_gate_up(s, axis)
  return (back(p1), back(s1)), (back(p3), back(s3))
