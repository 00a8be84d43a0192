"""Rows of cache pools: read and written without converting the pool.

XLA:CPU computes on bf16 / f16 arrays in f32: a scatter into a 16-bit pool converts the whole pool to
f32 and back, and a gather from one inside a loop (the reference attention's map over tokens) converts
the whole pool once per step, hoisted out of the loop. With the default CPU cache (256 MiB) that was
~0.8 GiB of conversions per decode step of the tiny model, 4x its arithmetic. So on CPU
(`Backend.pool_bits`) 16-bit float pools are *stored* as their uint16 bit patterns: rows are gathered
and scattered as integers (exact, native) and bitcast to the value dtype after the gather. GPUs and TPUs
move 16-bit floats natively and keep the float pools.

The value dtype of a bits pool is not in the array: readers name it (`read_rows(..., dtype)`,
`values(rows, dtype)`), and writers pass rows already in it (`set_rows` bitcasts 16-bit float rows).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

BITS = jnp.uint16


def _is_float16(dtype) -> bool:
    return jnp.dtype(dtype).itemsize == 2 and jnp.issubdtype(dtype, jnp.floating)


def storage_dtype(dtype, bits: bool):
    """The dtype a pool of `dtype` values is stored in: uint16 for 16-bit floats when bits, else dtype."""
    return BITS if bits and _is_float16(dtype) else jnp.dtype(dtype)


def value_dtype(pool, like):
    """The dtype of a pool's values: its own, or `like` (the model's activation dtype, which the engine
    makes its pools in) for a pool of bits or of packed FP8 MLA rows (uint32 words,
    pallas_kernels/mla/fp8_cache.py: written and read in the activations' dtype)."""
    return jnp.dtype(like) if pool.dtype in (BITS, jnp.uint32) else pool.dtype


def values(rows, dtype):
    """rows read from a pool, as `dtype` values: uint16 bits of a 16-bit float bitcast to it; any other
    rows (a float pool's) unchanged."""
    if rows.dtype == BITS and _is_float16(dtype):
        return jax.lax.bitcast_convert_type(rows, dtype)
    return rows


def read_rows(pool, idx, dtype=None):
    """pool[idx], materialized (as `dtype` values when given): for rows that the same step then writes back
    into the pool. Fused into that scatter, the read would make XLA copy the whole pool first to keep the
    old rows (on a GPU: the KDA conv pool, twice per decode step, scanned or not)."""
    one = idx.ndim == 1 and idx.shape[0] == 1
    if one:     # XLA turns a one-row gather into a dynamic slice and fuses it into later readers (see set_rows)
        idx = jnp.concatenate([idx, idx])
    rows = jax.lax.optimization_barrier(pool[idx])
    rows = rows[:1] if one else rows
    return rows if dtype is None else values(rows, dtype)


def set_rows(pool, idx, rows, mode=None):
    """pool.at[idx].set(rows, mode=mode), in place under donation. A bits pool takes 16-bit float rows as
    their bits (or uint16 rows as they are); any other pool casts rows to its dtype."""
    if pool.dtype == BITS and rows.dtype != BITS:
        if not _is_float16(rows.dtype):
            raise TypeError(f"rows of {rows.dtype} for a pool of 16-bit float bits: cast them to the "
                            "pool's value dtype first")
        rows = jax.lax.bitcast_convert_type(rows, BITS)
    if idx.ndim == 1 and idx.shape[0] == 1:
        # XLA rewrites a one-row scatter as select(in bounds, dynamic-update-slice, pool): a select over the
        # whole pool, i.e. a pool copy (every pool, per layer, in steps of one sequence such as
        # k3jax.generate's: ~5x slower decode on CPU). A second, out-of-bounds row (dropped) keeps a scatter.
        idx = jnp.concatenate([idx, jnp.full((1,), pool.shape[0], idx.dtype)])
        rows = jnp.concatenate([rows, rows])
        mode = "drop"
    return pool.at[idx].set(rows.astype(pool.dtype), mode=mode)
