"""Grouped matmul on TPU through jax's own Mosaic-TPU kernel (megablox `gmm`), with
jax.lax.ragged_dot's semantics: rows sorted by group, rows past sum(group_sizes) are zero.

megablox needs the row count to be a multiple of the row tile and leaves rows past the groups
unwritten; this wrapper pads the rows, picks tiles that divide K and N (128-multiples where the
dims allow, else the whole dim) and zeroes the tail. Our Triton kernels target GPUs only.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def _tile(d: int) -> int:
    """The largest of 512 / 256 / 128 dividing d, else d itself (a block may span a whole dim)."""
    return next((t for t in (512, 256, 128) if d % t == 0), d)


def gmm_tpu(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, interpret: bool = False,
            row_tile: int = 128) -> jax.Array:
    """lhs [M, K] @ rhs[g] [K, N] per row group -> [M, N] in lhs's dtype (fp32 accumulation)."""
    from jax.experimental.pallas.ops.tpu.megablox import gmm
    m, k = lhs.shape
    n = rhs.shape[-1]
    tm = min(row_tile, -(-m // 16) * 16)              # whole (16-aligned) rows when M is small
    mp = -(-m // tm) * tm
    x = jnp.pad(lhs, ((0, mp - m), (0, 0))) if mp != m else lhs
    out = gmm(x, rhs, group_sizes.astype(jnp.int32), preferred_element_type=lhs.dtype,
              tiling=(tm, _tile(k), _tile(n)), interpret=interpret)[:m]
    valid = jnp.arange(m) < jnp.sum(group_sizes)
    return jnp.where(valid[:, None], out, jnp.zeros((), out.dtype))
