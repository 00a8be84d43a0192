"""Merged gate/up expert weights: one array whose columns (bf16) or rows (MXFP4) interleave gate
and up, so the fused GLU kernel runs ONE matmul of 2 bn columns per tile instead of two of bn.

Why: a tile's x operand then feeds one wider MMA (bf16: the plain grouped matmul's 256-column
tiles), and with MXFP4 each decoded weight tile serves twice the rows for the same accumulator
registers (bm 256 with 64 output columns: 128 weight rows decoded per K step). Built once at load.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def _interleave(a, b, axis):
  """[..., n, ...] x 2 -> [..., 2n, ...] with a at even, b at odd positions of `axis`."""
  return jnp.stack([a, b], axis=axis + 1).reshape(
      *a.shape[:axis], 2 * a.shape[axis], *a.shape[axis + 1:])


def halves_order(a: jax.Array, axis: int) -> jax.Array:
  """Entries of `axis` reordered [even | odd]: the column order in which an MXFP4 kernel reads
  its x (mxfp4.to_halves), so an up projection with rows in this order writes h ready for it."""
  idx = [slice(None)] * a.ndim
  even, odd = list(idx), list(idx)
  even[axis], odd[axis] = slice(0, None, 2), slice(1, None, 2)
  return jnp.concatenate([a[tuple(even)], a[tuple(odd)]], axis=axis)


@jax.jit
def merge_gate_up(w1: jax.Array, w3: jax.Array) -> jax.Array:
  """bf16 gate / up weights [E, D, I] -> [E, D, 2I], column 2j = w1[..., j], 2j + 1 = w3[..., j]."""
  if w1.shape != w3.shape:
    raise ValueError(f"gate {w1.shape} and up {w3.shape} weights differ in shape")
  return _interleave(w1, w3, 2)


def merge_gate_up_mxfp4(w1, w3, *, halves: bool = True):
  """MXFP4 gate / up (packed [E, I, D/2], scales [E, I, D/32]) -> (packed [E, 2I, D/2], scales
  [E, 2I, D/32]): row 2j = gate row r(j), 2j + 1 = up row r(j). Rows are whole output features
  (each with its own scales), so reordering them is lossless. halves (the expert MLP's layout):
  r(j) = j in halves order (layout.halves_order), so the up kernel writes h [even | odd] for the
  down kernel's MXFP4 x operand; else r(j) = j."""
  (p1, s1), (p3, s3) = w1, w3
  if p1.shape != p3.shape or s1.shape != s3.shape:
    raise ValueError(f"gate {p1.shape, s1.shape} and up {p3.shape, s3.shape} weights differ")
  if halves and p1.shape[-2] % 2:
    raise ValueError(f"halves order needs an even intermediate size, got {p1.shape[-2]}")
  order = (lambda a: halves_order(a, a.ndim - 2)) if halves else (lambda a: a)
  return tuple(_interleave(order(a), order(b), a.ndim - 2) for a, b in ((p1, p3), (s1, s3)))


def split_gate_up(w13: jax.Array, axis: int):
  """Inverse of the interleave: (gate, up) from a merged array along `axis`."""
  idx = [slice(None)] * w13.ndim
  even, odd = list(idx), list(idx)
  even[axis], odd[axis] = slice(0, None, 2), slice(1, None, 2)
  return w13[tuple(even)], w13[tuple(odd)]


def plain_order(a: jax.Array, axis: int) -> jax.Array:
  """Inverse of halves_order."""
  n = a.shape[axis] // 2
  lo = jax.lax.slice_in_dim(a, 0, n, axis=axis)
  hi = jax.lax.slice_in_dim(a, n, 2 * n, axis=axis)
  return _interleave(lo, hi, axis)


def unmerge_gate_up_mxfp4(w13, *, halves: bool = True):
  """Inverse of merge_gate_up_mxfp4: ((packed, scales) gate, (packed, scales) up)."""
  p, s = w13
  order = (lambda a: plain_order(a, a.ndim - 2)) if halves else (lambda a: a)
  (p1, p3), (s1, s3) = split_gate_up(p, p.ndim - 2), split_gate_up(s, s.ndim - 2)
  return (order(p1), order(s1)), (order(p3), order(s3))
