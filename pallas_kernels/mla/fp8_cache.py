"""The FP8 MLA cache row: a token's latent in float8_e4m3fn with one fp32 scale per tile, the rope key in bf16.

One cache row of an fp8 pool is `packed_width(L, R)` bytes (uint8), in this order:
  [0, L)                      the latent, float8_e4m3fn codes
  [L, L + 4 * L / tile)       one float32 scale per `tile` latent values (amax / 448)
  [.., + 2 * R)               the rope key, bfloat16
With L = 512, R = 64 that is 656 bytes a token against 1,152 in bf16 (1.76x the tokens in the same memory):
the layout FlashMLA's and vLLM's FP8 MLA caches use. Why these choices:
  - per token (per row), never per page or per layer: a row is written once, by the step that computes it,
    so its scale needs no later rescaling of older rows; the row is the unit every copy (page copy, prefix
    cache, host tier, KV transfer) already moves, and the scales travel inside it.
  - per 128-value tile of the latent, not one per row: the latent is RMS-normalised then scaled by
    kv_a_layernorm's weight, whose channels differ by orders of magnitude; tiles keep the small channels'
    relative error near e4m3's 2^-4 at 1.6% more bytes than a single scale.
  - the 64 rope dims stay bf16: the rope key carries the position-sensitive part of the score and is 11% of
    the row; fp8 there costs score accuracy for 64 bytes.
A latent narrower than 128 values (the small test models) has one tile. The pool is uint8 so that every
generic row move (gathers, scatters, page copies, device <-> host) stays a byte copy; only the readers here
and the kernels that dequantize per key block interpret it.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import scatter

STORAGE = jnp.dtype(jnp.uint8)        # an fp8 pool's element type (its rows are bytes)
FP8 = jnp.dtype(jnp.float8_e4m3fn)
FP8_MAX = 448.0                       # largest finite float8_e4m3fn
TILE = 128                            # latent values per scale
SCALE = jnp.dtype(jnp.float32)
ROPE = jnp.dtype(jnp.bfloat16)


def is_fp8(pool) -> bool:
    """The pool (or its dtype) holds packed FP8 rows."""
    return jnp.dtype(getattr(pool, "dtype", pool)) == STORAGE


def tile(lat: int) -> int:
    """Latent values per scale: TILE, or the whole latent when it is narrower."""
    t = min(TILE, lat)
    if lat % t:
        raise ValueError(f"an FP8 MLA cache needs kv_lora_rank ({lat}) to be a multiple of {TILE} or below it")
    return t


def num_scales(lat: int) -> int:
    return lat // tile(lat)


def packed_width(lat: int, rope: int) -> int:
    """Bytes of one packed row."""
    return lat + num_scales(lat) * SCALE.itemsize + rope * ROPE.itemsize


def latent_dim(width: int, row_width: int) -> int:
    """L of a packed row `width` bytes wide that holds rows of `row_width` = L + R values."""
    for lat in range(1, row_width + 1):
        try:
            if packed_width(lat, row_width - lat) == width:
                return lat
        except ValueError:
            continue
    raise ValueError(f"no latent width packs {row_width}-value rows into {width} bytes")


def quantize(rows, lat: int):
    """rows [..., L + R] (any float) -> packed uint8 rows [..., packed_width(L, R)]."""
    x = rows[..., :lat].astype(jnp.float32)
    t = tile(lat)
    tiles = x.reshape(*x.shape[:-1], lat // t, t)
    amax = jnp.max(jnp.abs(tiles), axis=-1)
    scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0).astype(jnp.float32)        # an all-zero tile stays zero
    codes = jnp.clip(tiles / scale[..., None], -FP8_MAX, FP8_MAX).astype(FP8).reshape(x.shape)
    parts = [jax.lax.bitcast_convert_type(codes, STORAGE),
             jax.lax.bitcast_convert_type(scale, STORAGE).reshape(*x.shape[:-1], -1),
             jax.lax.bitcast_convert_type(rows[..., lat:].astype(ROPE), STORAGE).reshape(*x.shape[:-1], -1)]
    return jnp.concatenate(parts, axis=-1)


def split(packed, lat: int):
    """Packed rows [..., W] -> (fp8 codes [..., L], fp32 scales [..., L / tile], bf16 rope [..., R])."""
    n = num_scales(lat)
    lead = packed.shape[:-1]
    codes = jax.lax.bitcast_convert_type(packed[..., :lat], FP8)
    end = lat + n * SCALE.itemsize
    scales = jax.lax.bitcast_convert_type(packed[..., lat:end].reshape(*lead, n, SCALE.itemsize), SCALE)
    rope = jax.lax.bitcast_convert_type(packed[..., end:].reshape(*lead, -1, ROPE.itemsize), ROPE)
    return codes, scales, rope


def dequantize(packed, lat: int, dtype):
    """Packed rows [..., W] -> rows [..., L + R] in `dtype` (the latent in fp32 before the cast)."""
    codes, scales, rope = split(packed, lat)
    t = tile(lat)
    x = codes.astype(jnp.float32).reshape(*codes.shape[:-1], lat // t, t) * scales[..., None]
    return jnp.concatenate([x.reshape(codes.shape).astype(dtype), rope.astype(dtype)], axis=-1)


def round_trip(rows, lat: int):
    """rows as the cache returns them (quantized, dequantized) in rows' dtype: what the tests and the fp32
    references compare against."""
    return dequantize(quantize(rows, lat), lat, rows.dtype)


def values(rows, dtype, lat: int):
    """Rows read from any MLA pool as [..., L + R] `dtype` values: packed FP8 rows dequantized, 16-bit float
    bits bitcast (pallas_kernels/scatter.py), float rows unchanged."""
    if is_fp8(rows):
        return dequantize(rows, lat, dtype)
    return scatter.values(rows, dtype)


def encode(pool, rows):
    """rows [..., L + R] in the form `pool` stores them: packed when it is an FP8 pool, else unchanged."""
    if not is_fp8(pool):
        return rows
    return quantize(rows, latent_dim(pool.shape[-1], rows.shape[-1]))
