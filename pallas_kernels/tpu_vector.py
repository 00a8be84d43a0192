"""Mosaic-TPU-friendly reshuffles of small 2-D values inside kernels: masked sums instead of
unaligned slices, dynamic row picks or transposes of vectors (all exact: they only add zeros)."""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def row(x, r):
    """Row r (static or traced) of a 2-D value as [1, W], by a masked sublane sum."""
    rows = lax.broadcasted_iota(jnp.int32, x.shape, 0)
    return jnp.sum(jnp.where(rows == r, x, 0.0), axis=0, keepdims=True)


def lane(x, c):
    """Element c (static or traced) of a [1, W] row as [1, 1]."""
    lanes = lax.broadcasted_iota(jnp.int32, x.shape, 1)
    return jnp.sum(jnp.where(lanes == c, x, 0.0), axis=1, keepdims=True)


def col(x):
    """[1, W] row -> [W, 1] column: x on the diagonal of a [W, W] tile, summed over lanes."""
    W = x.shape[1]
    eye = lax.broadcasted_iota(jnp.int32, (W, W), 0) == lax.broadcasted_iota(jnp.int32, (W, W), 1)
    return jnp.sum(jnp.where(eye, jnp.broadcast_to(x, (W, W)), 0.0), axis=1, keepdims=True)
