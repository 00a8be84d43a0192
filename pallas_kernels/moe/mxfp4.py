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


# ------------------------------------------------------------------ in-kernel decoders
# The GPU kernel's default decoder (a model's own is Backend.mxfp4_decoder, chosen at load). "ptx4": the first PTX decoder. "ptx8" (default): 18 PTX
# instructions per 8 weights, scale folded into one multiply; with it, schedule.choose_tiling picks
# schedule.DECODE_MXFP4 tiles: ~1.3x ptx4's packed-weight rate at decode (docs/performance.md). Exact only for scales in PTX8_EXACT_SCALES: model
# loading checks the checkpoint's scales (k3jax.api) and falls back to ptx4 outside them.
# "jnp": plain ops. Interpret mode always runs the jnp decoder, with the x shift of the chosen
# decoder (so CPU tests exercise that wiring too).
DECODER = "ptx8"

# log2 of the factor by which a decoder's output is SMALLER than the true weight. The kernel
# multiplies x by 2^shift (exact in bf16), so each product x * w -- exact in the fp32 MMA either
# way -- is unchanged. ptx8 needs it to fold its 2^126 renormalization into the scale multiply.
X_SHIFT = {"jnp": 0, "ptx4": 0, "ptx8": 64}


def x_shift(decoder: str) -> int:
  if decoder not in X_SHIFT:
    raise ValueError(f"unknown MXFP4 decoder {decoder!r}; one of {sorted(X_SHIFT)}")
  return X_SHIFT[decoder]


def to_operand(x: jax.Array, shift: int, joined: bool) -> jax.Array:
  """The MXFP4 kernel's x operand: to_halves(x, shift), or for joined tiles (schedule.Tiling.joined:
  the decoded halves re-interleaved into natural K order) x * 2^shift in natural order."""
  if not joined:
    return to_halves(x, shift)
  return x * jnp.asarray(2.0 ** shift, x.dtype) if shift else x


def to_halves(x: jax.Array, shift: int) -> jax.Array:
  """[..., K] -> [..., K] laid out [even columns | odd columns] * 2^shift: the kernel's x operand
  for MXFP4 weights (even / odd columns meet the low / high nibbles; the power of two is exact)."""
  h = jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
  return h * jnp.asarray(2.0 ** shift, x.dtype) if shift else h


# ptx4: 4 packed bytes -> 4 bf16 of one nibble (call once for low, once for high nibbles): the
# nibble's magnitude bits become a bf16 equal to v * 2^-126 (subnormal for 0.5), sign to bit 15,
# then x 2^126 and x scale with fma.rn.bf16x2 (exact; bf16 arithmetic keeps subnormals).
_ASM4 = """{{
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
_ASM4_LO = _ASM4.format(mmask="0x00070007", smask="0x00080008", mshift=6, sshift=12)
_ASM4_HI = _ASM4.format(mmask="0x00700070", smask="0x00800080", mshift=2, sshift=8)

# ptx8: per 4 packed bytes w = [b3 b2 b1 b0] (8 weights), one block for the 4 even weights (low
# nibbles) and one for the 4 odd ones (high nibbles), 9 instructions each = 18 per 8 weights
# (ptx4: 28, plus its scale handling). Per output pair (bf16x2):
#   an and keeps the block's nibbles; prmt spreads two bytes into the 16-bit halves
#   ([0, b1, 0, b0]); one integer multiply puts the nibble at bits 9..6 and at 15..12 of each
#   half at once (x * (2^6 + 2^12); high nibbles sit 4 bits higher: x * (2^2 + 2^8)); the two
#   copies are 6 bits apart, so no carries mix them; one and keeps sign -> bit 15 and the 3
#   magnitude bits -> bits 8..6: the bf16 of v * 2^-126 (0.5 -> the subnormal 0x0040);
#   one fma by S = 2^(e - 1 - shift) (bf16, built once per scale outside the block) gives
#   w * 2^-shift exactly: one multiply where ptx4 does x 2^126 then x 2^(e-127).
# Exact (equal to dequantize_mxfp4 * 2^-64) for 59 <= e <= 192, i.e. 32-blocks with
# 6 * 2^-68 <= max|w| <= 6 * 2^65 (real checkpoints: e ~ 100-130); outside it the result is
# not defined (no clamp, no NaN scale: see folded_scale_bits). ptx4 was exact for 1 <= e <= 254.
# The recipe is data: tests/kernels/test_moe_kernels.py interprets these same lists in numpy.
PTX8_SHIFT = 64
PTX8_EXACT_SCALES = (59, 192)  # E8M0 exponents ptx8 decodes exactly


def decoder_for_scales(scale_min: int, scale_max: int, preferred: str = DECODER) -> str:
  """The decoder to use for weights whose E8M0 scales span [scale_min, scale_max]: `preferred`
  (default DECODER), unless that is ptx8 and a scale lies outside its exact window (then ptx4)."""
  lo, hi = PTX8_EXACT_SCALES
  if preferred == "ptx8" and not (lo <= scale_min and scale_max <= hi):
    return "ptx4"
  return preferred


_M = 0x81C081C0  # sign bits 31, 15 and magnitude bits 24..22, 8..6 of a bf16x2


def _ptx8_ops(nibble_mask: int, mult: int):
  return (
      ("and", "t", "w", nibble_mask),
      ("prmt", "p01", "t", 0x4140),    # [0, b1, 0, b0]
      ("prmt", "p23", "t", 0x4342),    # [0, b3, 0, b2]
      ("mul", "p01", "p01", mult),
      ("mul", "p23", "p23", mult),
      ("and", "p01", "p01", _M),
      ("and", "p23", "p23", _M),
      ("fma", "out01", "p01", "s01"),
      ("fma", "out23", "p23", "s23"),
  )


PTX8_EVEN = _ptx8_ops(0x0F0F0F0F, (1 << 6) + (1 << 12))
PTX8_ODD = _ptx8_ops(0xF0F0F0F0, (1 << 2) + (1 << 8))
# asm operands: the result's 2 bf16x2 registers, then packed (4 bytes), then 2 bf16x2 scales
_PTX8_OPERANDS = {"out01": "$0", "out23": "$1", "w": "$2", "s01": "$3", "s23": "$4"}


def _render_ptx8(ops) -> str:
  name = lambda r: _PTX8_OPERANDS.get(r, r)
  temps = sorted({op[1] for op in ops} - set(_PTX8_OPERANDS))
  lines = ["{", f".reg .b32 {', '.join(temps)}, zr, z;", "mov.b32 zr, 0;",
           "mov.b32 z, 0x80008000;"]  # fma addend -0.0: keeps the sign of a zero product
  for kind, d, a, b in ops:
    if kind == "and":
      lines.append(f"and.b32 {name(d)}, {name(a)}, {b:#010x};")
    elif kind == "prmt":
      lines.append(f"prmt.b32 {name(d)}, {name(a)}, zr, {b:#06x};")
    elif kind == "mul":
      lines.append(f"mul.lo.u32 {name(d)}, {name(a)}, {b};")
    elif kind == "fma":
      lines.append(f"fma.rn.bf16x2 {name(d)}, {name(a)}, {name(b)}, z;")
    else:
      raise ValueError(kind)
  return "\n".join(lines + ["}"])


_ASM8_EVEN = _render_ptx8(PTX8_EVEN)
_ASM8_ODD = _render_ptx8(PTX8_ODD)


def folded_scale_bits(e: jax.Array, shift: int = PTX8_SHIFT) -> jax.Array:
  """uint16 bf16 bits of S = 2^(e - 1 - shift) (ptx8's one multiplier), e uint8 [...].

  Valid for 59 <= e <= 192 with shift 64 (the exact window above): one add and one shift per
  scale value in the kernel (Triton keeps ~16 scale values per thread per K step, so a clamp
  and a NaN select here cost more than the whole decode of a byte). Outside the window the
  bits are garbage: e = 193 gives inf, e > 193 wraps into the sign bit."""
  return (e.astype(jnp.uint16) + jnp.uint16(126 - shift)) << 7


def _decode_jnp(packed, scales, shift):
  """Same values as decode_fast (times 2^-shift), without the interleave (no stack/slice in
  Triton): (even, odd) bf16 [bn, bk/2]. Exact for 1 <= e <= 240 (shift 0) / 65 <= e <= 240."""
  bn, half = packed.shape
  p = packed.astype(jnp.int32)
  e = jnp.minimum(scales.astype(jnp.int32), 240)
  sc = jax.lax.bitcast_convert_type((e + 14) << 23, jnp.float32)
  if shift:
    sc = sc * jnp.float32(2.0 ** -shift)
  sc = jnp.broadcast_to(sc[:, :, None], (bn, half // 16, 16)).reshape(bn, half)

  def to(bits):
    h = jax.lax.bitcast_convert_type(bits.astype(jnp.uint16), jnp.float16)
    return (h.astype(jnp.float32) * sc).astype(jnp.bfloat16)

  return to(_fp16_code_bits(p, 9, 12)), to(_fp16_code_bits(p, 5, 8))


def _per_weight(s, bn, half):
  """[bn, bk/32] -> [bn, bk/2] (one value per packed byte, 16 bytes per scale)."""
  return jnp.broadcast_to(s[:, :, None], (bn, half // 16, 16)).reshape(bn, half)


def decode_halves(packed: jax.Array, scales: jax.Array, decoder: str, shift: int | None = None):
  """In-kernel decoder: packed uint8 [bn, bk/2], scales uint8 [bn, bk/32] ->
  (even-k weights, odd-k weights), each bf16 [bn, bk/2], both times 2^-shift
  (shift = X_SHIFT[decoder] unless given; the kernel multiplies x by 2^shift).

  Returning the halves separately lets the kernel contract them with the even and odd
  columns of x (two dots) instead of interleaving registers. "ptx4" / "ptx8" are inline
  PTX (GPU only); "jnp" runs anywhere (interpret mode).
  """
  shift = x_shift(decoder) if shift is None else shift
  bn, half = packed.shape
  if decoder == "jnp":
    return _decode_jnp(packed, scales, shift)
  from jax.experimental.pallas import triton as plt  # GPU-only path
  out = jax.ShapeDtypeStruct((bn, half), jnp.bfloat16)
  if decoder == "ptx4":
    assert shift == 0, shift
    bits, asm = scales.astype(jnp.uint16) << 7, (_ASM4_LO, _ASM4_HI)
  elif decoder == "ptx8":
    assert shift == PTX8_SHIFT, shift
    bits, asm = folded_scale_bits(scales), (_ASM8_EVEN, _ASM8_ODD)
  else:
    raise ValueError(f"unknown MXFP4 decoder {decoder!r}")
  sc = _per_weight(jax.lax.bitcast_convert_type(bits, jnp.bfloat16), bn, half)
  # two single-result blocks (Pallas lowers one result per asm op): even / odd elements
  return tuple(plt.elementwise_inline_asm(a, args=[packed, sc], constraints="=r,=r,r,r,r", pack=4,
                                          result_shape_dtypes=[out])[0] for a in asm)
