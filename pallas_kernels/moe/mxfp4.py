"""MXFP4 (OCP microscaling FP4) weights: exact jnp dequantizer and the in-kernel decoder.

Format (K3 release checkpoint, compressed-tensors `mxfp4-pack-quantized`):
  packed uint8 [..., N, K/2]: two E2M1 codes per byte, LOW nibble = even element;
    code bits: 3 = sign, 0..2 = magnitude index -> 0, 0.5, 1, 1.5, 2, 3, 4, 6.
  scales uint8 [..., N, K/32]: E8M0 exponent e, scale 2^(e - 127), one per 32
    consecutive elements along K (e = 255 gives inf scale, like the reference).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)

# Per magnitude index: exponent offset E and mantissa bit f with |v| = 2^E (1 + f/2).
_EXP = np.array([0, -1, 0, 0, 1, 1, 2, 2], np.int32)
_MANT = np.array([0, 0, 0, 1, 0, 1, 0, 1], np.int32)


def unpack_codes(packed: jax.Array) -> jax.Array:
  """uint8 [..., K/2] -> uint8 codes [..., K] (low nibble first)."""
  lo = packed & 0xF
  hi = packed >> 4
  return jnp.stack([lo, hi], axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def _bf16_bits(codes: jax.Array, e: jax.Array) -> jax.Array:
  """Exact bf16 bit pattern (uint16) of E2M1 code x 2^(e - 127), integer ops only.

  Integer construction keeps subnormal results (e in {0, 1}) exact whatever the
  backend's denormal flushing; rounding never happens (|v| has <= 2 significant bits).
  """
  c = codes.astype(jnp.int32)
  e = e.astype(jnp.int32)
  mag = c & 7
  x = jnp.asarray(_EXP)[mag] + e  # biased bf16 exponent of the result
  f = jnp.asarray(_MANT)[mag]
  normal = (x << 7) | (f << 6)
  sub = (2 + f) << jnp.clip(x + 5, 0, 5)  # x in {-1, 0}: subnormal mantissa
  bits = jnp.where(x >= 255, 0x7F80, jnp.where(x >= 1, normal, sub))
  bits = jnp.where(mag == 0, 0, bits)
  bits = jnp.where(e == 255, jnp.where(mag == 0, 0x7FC0, 0x7F80), bits)
  bits = bits | ((c & 8) << 12)
  return bits.astype(jnp.uint16)


@functools.partial(jax.jit, static_argnames="dtype")
def dequantize_mxfp4(packed: jax.Array, scales: jax.Array, dtype=jnp.bfloat16) -> jax.Array:
  """Dequantize MXFP4 weights: packed uint8 [..., N, K/2], scales uint8 [..., N, K/32] -> [..., N, K].

  Bit-for-bit equal to compressed-tensors' MXFP4 decompressor in bfloat16 (which
  multiplies the bf16 E2M1 value by the bf16 scale 2^(e-127)); other dtypes get the
  exact same values converted.
  """
  packed = jnp.asarray(packed)
  scales = jnp.asarray(scales)
  k = packed.shape[-1] * 2
  if scales.shape[-1] * 32 != k:
    raise ValueError(f"scales {scales.shape} do not match packed {packed.shape} (32 per scale)")
  codes = unpack_codes(packed)
  e = jnp.repeat(scales, 32, axis=-1)
  bits = _bf16_bits(codes, e)
  if jnp.dtype(dtype) == jnp.bfloat16:
    return jax.lax.bitcast_convert_type(bits, jnp.bfloat16)
  f32 = jax.lax.bitcast_convert_type(bits.astype(jnp.uint32) << 16, jnp.float32)
  return f32.astype(dtype)


@jax.jit
def quantize_mxfp4(w: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Round-to-nearest MXFP4 quantizer for tests/benchmarks: [..., N, K] -> (packed, scales).

  Scale exponent ceil(log2(max|w| / 6)) + 127 per 32-block, so every scaled value lies
  in [-6, 6]; codes by nearest E2M1 value (midpoint thresholds, elementwise only, so
  XLA never materializes a [..., 8] distance tensor on big weights).
  """
  w = jnp.asarray(w, jnp.float32)
  *lead, n, k = w.shape
  blocks = w.reshape(*lead, n, k // 32, 32)
  amax = jnp.max(jnp.abs(blocks), axis=-1, keepdims=True)
  e = jnp.where(amax > 0, jnp.ceil(jnp.log2(jnp.maximum(amax, 1e-30) / 6.0)), -127)
  e = jnp.clip(e + 127, 0, 254)
  scaled = blocks / jnp.exp2(e - 127)
  mag = jnp.abs(scaled)
  idx = sum((mag >= t).astype(jnp.uint8) for t in (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0))
  codes = (idx | jnp.where(scaled < 0, 8, 0).astype(jnp.uint8)).reshape(*lead, n, k)
  packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
  return packed.astype(jnp.uint8), e[..., 0].astype(jnp.uint8)


def _fp16_code_bits(p, shift_mag, shift_sign):
  """float16 bits (int32) of v * 2^-14 for the nibble selected by the shifts."""
  return ((p << shift_mag) & 0x0E00) | ((p << shift_sign) & 0x8000)


@functools.partial(jax.jit, static_argnames="dtype")
def decode_fast(packed: jax.Array, scales: jax.Array, dtype=jnp.bfloat16) -> jax.Array:
  """Cheap elementwise decoder, [..., N, K/2] + [..., N, K/32] -> [..., N, K].

  The 3 magnitude bits go straight into a float16's exponent/mantissa (value v * 2^-14,
  an fp16 subnormal for 0.5 that the f16->f32 conversion keeps exact), then one f32
  multiply by 2^(e-113). Equals dequantize_mxfp4 for 1 <= e <= 240 (e = 0 flushes to 0,
  e > 240 is clamped: |w| < 2^116 in any real checkpoint).
  """
  *lead, n, half = packed.shape
  p = packed.astype(jnp.int32)
  e = jnp.minimum(scales.astype(jnp.int32), 240)
  sc = jax.lax.bitcast_convert_type((e + 14) << 23, jnp.float32)
  sc = jnp.broadcast_to(sc[..., None], (*lead, n, half // 16, 16)).reshape(*lead, n, half)

  def to(bits):
    h = jax.lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.float16)
    return (h.astype(jnp.float32) * sc).astype(dtype)

  w = jnp.stack([to(_fp16_code_bits(p, 9, 12)), to(_fp16_code_bits(p, 5, 8))], axis=-1)
  return w.reshape(*lead, n, half * 2)


# The GPU kernel decodes with inline PTX when True. Checked on the H200 (2026-11-29,
# scripts/bench_moe.py): same error vs the dequantized reference as the jnp decoder
# (1.9e-4), and 1.6x its speed (2.0-2.1 vs 1.23-1.30 TB/s of packed weights at decode).
# Interpret mode always uses jnp ops.
USE_ASM = True

# PTX for 4 packed bytes -> 4 bf16 (2 x bf16x2): the selected nibble's magnitude bits
# become a bf16 subnormal/normal equal to v * 2^-126 (sign to bit 15), then
# x 2^126 and x scale with fma.rn.bf16x2 (exact; bf16 arithmetic keeps subnormals).
_ASM = """{{
.reg .b32 t0, t1, a0, a1, b0, b1, c, z, zr;
mov.b32 c, 0x7E807E80;
mov.b32 z, 0x80008000;
mov.b32 zr, 0;
prmt.b32 t0, $2, zr, 0x4140;
prmt.b32 t1, $2, zr, 0x4342;
and.b32 a0, t0, {mmask};
and.b32 b0, t0, {smask};
and.b32 a1, t1, {mmask};
and.b32 b1, t1, {smask};
shl.b32 a0, a0, {mshift};
shl.b32 b0, b0, {sshift};
shl.b32 a1, a1, {mshift};
shl.b32 b1, b1, {sshift};
or.b32 a0, a0, b0;
or.b32 a1, a1, b1;
fma.rn.bf16x2 a0, a0, c, z;
fma.rn.bf16x2 a1, a1, c, z;
fma.rn.bf16x2 $0, a0, $3, z;
fma.rn.bf16x2 $1, a1, $4, z;
}}"""
_ASM_LO = _ASM.format(mmask="0x00070007", smask="0x00080008", mshift=6, sshift=12)
_ASM_HI = _ASM.format(mmask="0x00700070", smask="0x00800080", mshift=2, sshift=8)


def decode_halves(packed: jax.Array, scales: jax.Array, use_asm: bool):
  """In-kernel decoder: packed uint8 [bn, bk/2], scales uint8 [bn, bk/32] ->
  (even-k weights, odd-k weights), each bf16 [bn, bk/2].

  Returning the halves separately lets the kernel contract them with the even and odd
  columns of x (two dots) instead of interleaving registers. use_asm=True (GPU only)
  decodes with inline PTX, about 4 instructions per element; otherwise jnp ops with the
  same values (used in interpret mode).
  """
  bn, half = packed.shape
  if not use_asm:  # same ops as decode_fast, but no interleave (no stack/slice in Triton)
    p = packed.astype(jnp.int32)
    e = jnp.minimum(scales.astype(jnp.int32), 240)
    sc = jax.lax.bitcast_convert_type((e + 14) << 23, jnp.float32)
    sc = jnp.broadcast_to(sc[:, :, None], (bn, half // 16, 16)).reshape(bn, half)

    def to(bits):
      h = jax.lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.float16)
      return (h.astype(jnp.float32) * sc).astype(jnp.bfloat16)

    return to(_fp16_code_bits(p, 9, 12)), to(_fp16_code_bits(p, 5, 8))
  from jax.experimental.pallas import triton as plt  # GPU-only path
  sc = jax.lax.bitcast_convert_type(scales.astype(jnp.uint16) << 7, jnp.bfloat16)
  sc = jnp.broadcast_to(sc[:, :, None], (bn, half // 16, 16)).reshape(bn, half)
  out = jax.ShapeDtypeStruct((bn, half), jnp.bfloat16)
  [lo] = plt.elementwise_inline_asm(_ASM_LO, args=[packed, sc], constraints="=r,=r,r,r,r",
                                    pack=4, result_shape_dtypes=[out])
  [hi] = plt.elementwise_inline_asm(_ASM_HI, args=[packed, sc], constraints="=r,=r,r,r,r",
                                    pack=4, result_shape_dtypes=[out])
  return lo, hi
