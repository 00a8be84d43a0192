"""The FP8 MLA cache row: a token's latent in float8_e4m3fn with one fp32 scale per tile, the rope key in bf16.

One cache row of an fp8 pool is `packed_width(L, R)` uint32 words (`packed_bytes(L, R)` bytes), in this order:
  [0, L/4)                    the latent's float8_e4m3fn codes, four a word, planar: byte b of word j
                              (`(w >> 8*b) & 0xFF`) holds latent index b*L/4 + j
  [L/4, L/4 + L/tile)         one float32 scale per `tile` latent values (amax / 448), a word each (its bits)
  [.., + R/2)                 the rope key, two bfloat16 a word: the low half holds dim 2i, the high half 2i+1
With L = 512, R = 64 that is 164 words = 656 bytes a token against 1,152 in bf16 (1.76x the tokens in the same
memory): the bytes of FlashMLA's and vLLM's FP8 MLA rows, arranged differently. Why these choices:
  - per token (per row), never per page or per layer: a row is written once, by the step that computes it,
    so its scale needs no later rescaling of older rows; the row is the unit every copy (page copy, prefix
    cache, host tier, KV transfer) already moves, and the scales travel inside it.
  - per 128-value tile of the latent, not one per row: the latent is RMS-normalised then scaled by
    kv_a_layernorm's weight, whose channels differ by orders of magnitude; tiles keep the small channels'
    relative error near e4m3's 2^-4 at 1.6% more bytes than a single scale.
  - the 64 rope dims stay bf16: the rope key carries the position-sensitive part of the score and is 11% of
    the row; fp8 there costs score accuracy for 64 bytes.
  - words, planar codes: a GPU kernel reads every part with elementwise ops on whole loaded tiles and no
    register reassembly. Byte b of a block's latent words [bk, L/4] is one [bk, L/4] plane of latent columns
    (a shift, a mask, a narrowing cast, the fp8 bitcast); a scale is one word column (a bitcast); a rope word
    gives its even dim as `bitcast_f32(w << 16)` and its odd dim as `bitcast_f32(w & 0xFFFF0000)` exactly
    (bf16 is the top half of an fp32), so the rope score is q_even . k_even + q_odd . k_odd. A byte row
    needed even/odd splits of the loaded tile to assemble each scale and rope value (layout conversions in
    registers), which bounded the kernel well below its memory bandwidth.
The latent rule for any L: planes of L/4 values, each inside one scale tile (tile = min(128, L)). That holds
when L/4 divides the tile (L <= 128, the small test models: one tile; L = 256: two planes a tile; L = 512:
a plane a tile) or the tile divides L/4 (L = 1024, ...: a plane spans whole tiles, which a kernel reads as
tile-wide word columns); other L (384, 640, ...) raise ValueError. `segments` lists the pieces a reader takes.
The pool is uint32 so that every generic row move (gathers, scatters, page copies, device <-> host) stays an
opaque copy of whole rows; only the readers here and the kernels that dequantize per key block interpret it.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels import scatter

STORAGE = jnp.dtype(jnp.uint32)       # an fp8 pool's element type (its rows are words)
FP8 = jnp.dtype(jnp.float8_e4m3fn)
FP8_MAX = 448.0                       # largest finite float8_e4m3fn
TILE = 128                            # latent values per scale
SCALE = jnp.dtype(jnp.float32)
ROPE = jnp.dtype(jnp.bfloat16)
PLANES = STORAGE.itemsize             # latent codes a word: one plane per byte


class Segment(NamedTuple):
    """A piece of the latent a reader takes whole: latent columns [start, start + width), which are byte
    `byte` of latent words [word, word + width), all scaled by scale number `scale`."""
    start: int
    width: int
    word: int
    byte: int
    scale: int


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


def latent_words(lat: int) -> int:
    """Words of the latent's codes (L/4): the width of each plane. ValueError where a plane would straddle
    two scale tiles (see the module docstring)."""
    t = tile(lat)
    q, r = divmod(lat, PLANES)
    if r or (t % q and q % t):
        raise ValueError(f"an FP8 MLA cache stores kv_lora_rank ({lat}) as {PLANES} planes of L/{PLANES} values, "
                         f"each inside one scale tile of {t}: L must be a multiple of {PLANES} with L/{PLANES} "
                         f"dividing {t} or a multiple of it (e.g. 64, 128, 256, 512, 1024)")
    return q


def rope_words(rope: int) -> int:
    if rope % 2:
        raise ValueError(f"an FP8 MLA cache packs the rope key two bf16 a word: qk_rope_head_dim ({rope}) must be even")
    return rope // 2


def packed_width(lat: int, rope: int) -> int:
    """Words (uint32 elements) of one packed row: the pool's last dimension."""
    return latent_words(lat) + num_scales(lat) + rope_words(rope)


def packed_bytes(lat: int, rope: int) -> int:
    """Bytes of one packed row (what memory planning and bandwidth count)."""
    return packed_width(lat, rope) * STORAGE.itemsize


def segments(lat: int) -> list[Segment]:
    """The latent's pieces in latent order, each a byte plane of whole word columns inside one scale tile:
    plane b of word chunk c holds latent columns b*L/4 + c*w + [0, w), w = min(L/4, tile)."""
    q, t = latent_words(lat), tile(lat)
    w = min(q, t)
    return [Segment(b * q + c, w, c, b, (b * q + c) // t) for b in range(PLANES) for c in range(0, q, w)]


def latent_dim(width: int, row_width: int) -> int:
    """L of a packed row `width` words wide that holds rows of `row_width` = L + R values."""
    for lat in range(1, row_width + 1):
        try:
            if packed_width(lat, row_width - lat) == width:
                return lat
        except ValueError:
            continue
    raise ValueError(f"no latent width packs {row_width}-value rows into {width} words")


def _u32(x):
    return x.astype(jnp.uint32)


def quantize(rows, lat: int):
    """rows [..., L + R] (any float) -> packed uint32 rows [..., packed_width(L, R)]."""
    lead = rows.shape[:-1]
    q = latent_words(lat)
    rope_words(rows.shape[-1] - lat)
    x = rows[..., :lat].astype(jnp.float32)
    t = tile(lat)
    tiles = x.reshape(*lead, lat // t, t)
    amax = jnp.max(jnp.abs(tiles), axis=-1)
    scale = jnp.where(amax > 0, amax / FP8_MAX, 1.0).astype(jnp.float32)        # an all-zero tile stays zero
    codes = jnp.clip(tiles / scale[..., None], -FP8_MAX, FP8_MAX).astype(FP8).reshape(x.shape)
    planes = _u32(jax.lax.bitcast_convert_type(codes, jnp.uint8)).reshape(*lead, PLANES, q)
    latent = planes[..., 0, :]
    for b in range(1, PLANES):                                    # byte b of word j: latent index b*q + j
        latent = latent | (planes[..., b, :] << (8 * b))
    rope = _u32(jax.lax.bitcast_convert_type(rows[..., lat:].astype(ROPE), jnp.uint16))
    rope = rope[..., 0::2] | (rope[..., 1::2] << 16)              # low half: dim 2i, high half: dim 2i+1
    return jnp.concatenate([latent, jax.lax.bitcast_convert_type(scale, STORAGE), rope], axis=-1)


def split(packed, lat: int):
    """Packed rows [..., W] -> (fp8 codes [..., L] in latent order, fp32 scales [..., L / tile], bf16 rope
    [..., R])."""
    q, n = latent_words(lat), num_scales(lat)
    lead = packed.shape[:-1]
    w = packed[..., :q]
    planes = jnp.stack([((w >> (8 * b)) & 0xFF).astype(jnp.uint8) for b in range(PLANES)], axis=-2)
    codes = jax.lax.bitcast_convert_type(planes.reshape(*lead, lat), FP8)
    scales = jax.lax.bitcast_convert_type(packed[..., q:q + n], SCALE)
    r = packed[..., q + n:]
    halves = jnp.stack([(r & 0xFFFF).astype(jnp.uint16), (r >> 16).astype(jnp.uint16)], axis=-1)
    rope = jax.lax.bitcast_convert_type(halves.reshape(*lead, -1), ROPE)
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
