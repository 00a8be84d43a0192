"""Row scatter into cache pools that never converts the pool.

XLA:CPU runs a bf16 / f16 scatter in f32: it converts the whole operand (a cache pool holding every
layer) to f32 and back on every update. On CPU the 16-bit patterns are scattered as uint16 instead
(exact; XLA:CPU still materializes the bitcast once, half the traffic of the two conversions). GPUs
scatter 16-bit floats natively, and there a bitcast-convert of a whole pool risks a pool-sized copy,
so they scatter the pool as it is.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def read_rows(pool, idx):
    """pool[idx], materialized: for rows that the same step then writes back into the pool. Fused
    into that scatter, the read would make XLA copy the whole pool first to keep the old rows
    (on the H200: the KDA conv pool, twice per decode step, scanned or not)."""
    return jax.lax.optimization_barrier(pool[idx])


def set_rows(pool, idx, rows, mode=None, bits: bool = False):
    """pool.at[idx].set(rows cast to pool.dtype, mode=mode), in place under donation. bits: scatter
    16-bit floats as uint16 (Backend.scatter_bits: on CPU)."""
    rows = rows.astype(pool.dtype)
    if bits and pool.dtype.itemsize == 2 and jnp.issubdtype(pool.dtype, jnp.floating):
        u16 = jax.lax.bitcast_convert_type(pool, jnp.uint16)
        new = jax.lax.bitcast_convert_type(rows, jnp.uint16)
        return jax.lax.bitcast_convert_type(u16.at[idx].set(new, mode=mode), pool.dtype)
    return pool.at[idx].set(rows, mode=mode)
