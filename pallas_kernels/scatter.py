"""Row scatter into cache pools that never converts the pool.

XLA:CPU runs a bf16 / f16 scatter in f32: it converts the whole operand (a cache pool holding every
layer) to f32 and back on every update. Scattering the 16-bit patterns as uint16 is exact and
costs only the rows written, on every backend.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def set_rows(pool, idx, rows, mode=None):
    """pool.at[idx].set(rows cast to pool.dtype, mode=mode), in place under donation."""
    rows = rows.astype(pool.dtype)
    if pool.dtype.itemsize == 2 and jnp.issubdtype(pool.dtype, jnp.floating):
        bits = jax.lax.bitcast_convert_type(pool, jnp.uint16)
        new = jax.lax.bitcast_convert_type(rows, jnp.uint16)
        return jax.lax.bitcast_convert_type(bits.at[idx].set(new, mode=mode), pool.dtype)
    return pool.at[idx].set(rows, mode=mode)
