"""The MXFP4 format the expert kernels read: dequantize_mxfp4 bit for bit against compressed-tensors' own
decompressor, quantize_mxfp4's rounding, the ptx8 in-kernel decoder's recipe interpreted in numpy against
dequantize_mxfp4 in its exact scale window, and the window check at load time."""
import numpy as np
import pytest

import jax
import jax.numpy as jnp

from pallas_kernels import moe


def _rng(seed):
  return np.random.default_rng(seed)


# --------------------------------------------------------------------------- MXFP4

def _ct_dequant(packed, scales):
  """compressed-tensors' own MXFP4 decompressor (torch CPU), bf16 [N, K]."""
  torch = pytest.importorskip("torch")
  from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
  from compressed_tensors.quantization import QuantizationScheme
  from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES
  scheme = QuantizationScheme(targets=["Linear"], **PRESET_SCHEMES["MXFP4"])
  sd = {"weight_packed": torch.from_numpy(np.ascontiguousarray(packed)),
        "weight_scale": torch.from_numpy(np.ascontiguousarray(scales))}
  w = MXFP4PackedCompressor.decompress(sd, scheme)["weight"]
  assert w.dtype == torch.bfloat16
  return w.view(torch.int16).numpy().view(np.uint16)


def _bits(a):
  return np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint16))


def test_dequantize_mxfp4_bit_exact_all_codes_and_scales():
  # every byte (all 16 codes in both nibbles) under every scale exponent 0..255,
  # including the edges e = 0 (subnormal results), 127, 254 (overflow to inf), 255.
  packed = np.tile(np.arange(256, dtype=np.uint8), (256, 1))      # [N=256, K/2=256]
  scales = np.repeat(np.arange(256, dtype=np.uint8)[:, None], 16, axis=1)
  ref = _ct_dequant(packed, scales)
  ours = _bits(moe.dequantize_mxfp4(packed, scales, jnp.bfloat16))
  ref_f = ref.astype(np.uint32) << 16
  nan = np.isnan(ref_f.view(np.float32))
  ours_nan = np.isnan((ours.astype(np.uint32) << 16).view(np.float32))
  np.testing.assert_array_equal(nan, ours_nan)
  np.testing.assert_array_equal(ref[~nan], ours[~nan])
  for e in (0, 127, 254):  # the named edges really are present and non-trivial
    assert np.any(ref[e] != 0)
  # float32 output holds the same values exactly
  f32 = np.asarray(moe.dequantize_mxfp4(packed, scales, jnp.float32))
  np.testing.assert_array_equal(f32[~nan].view(np.uint32), ref_f[~nan])


def test_dequantize_mxfp4_random_batched():
  r = _rng(3)
  packed = r.integers(0, 256, (3, 64, 48), dtype=np.uint8)
  scales = r.integers(100, 150, (3, 64, 3), dtype=np.uint8)
  ours = _bits(moe.dequantize_mxfp4(packed, scales))
  assert ours.shape == (3, 64, 96)
  for i in range(3):
    np.testing.assert_array_equal(ours[i], _ct_dequant(packed[i], scales[i]))


def test_quantize_mxfp4_round_trip():
  r = _rng(4)
  w = r.standard_normal((4, 32, 64)).astype(np.float32) * 0.05
  p, s = moe.quantize_mxfp4(w)
  wq = np.asarray(moe.dequantize_mxfp4(p, s, jnp.float32))
  blk = np.abs(w).reshape(4, 32, 2, 32).max(-1, keepdims=True)
  # nearest-E2M1 rounding error is at most half the widest gap (2) times the scale
  err = np.abs(wq - w).reshape(4, 32, 2, 32) / (blk / 6.0 * 2 + 1e-12)
  assert err.max() <= 1.0 and np.abs(wq).max() > 0


# ------------------------------- the ptx8 decoder's recipe, interpreted in numpy

def _interpret_ptx8(ops, words, s01, s23):
  """Run one of mxfp4.PTX8_EVEN / PTX8_ODD (the op lists its inline PTX is rendered from) on
  uint32 words, as the PTX instructions define them. Returns (out01, out23) uint32 bf16x2."""
  import ml_dtypes
  regs = {"w": words.astype(np.uint64), "s01": s01.astype(np.uint64),
          "s23": s23.astype(np.uint64)}
  mask32 = np.uint64(0xFFFFFFFF)

  def bf16_val(bits):  # uint64 holding 16 bits -> float64, subnormals kept
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)

  for kind, d, a, b in ops:
    a = regs[a]
    if kind == "and":
      regs[d] = a & np.uint64(b)
    elif kind == "mul":  # mul.lo.u32
      regs[d] = (a * np.uint64(b)) & mask32
    elif kind == "prmt":  # prmt.b32 d, a, 0, sel: byte i <- byte sel[i] of (0:a)
      out = np.zeros_like(a)
      for i in range(4):
        sel = (b >> (4 * i)) & 0xF
        assert sel < 8, "msb-replicate mode is not used"
        byte = (a >> np.uint64(8 * sel)) & np.uint64(0xFF) if sel < 4 else np.zeros_like(a)
        out |= byte << np.uint64(8 * i)
      regs[d] = out
    elif kind == "fma":  # fma.rn.bf16x2 d, a, s, -0.0 per 16-bit half
      s = regs[b]
      halves = []
      for sh in (0, 16):
        sh = np.uint64(sh)
        prod = bf16_val((a >> sh) & np.uint64(0xFFFF)) * bf16_val((s >> sh) & np.uint64(0xFFFF))
        prod = prod + (-0.0)
        bits = prod.astype(np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)
        halves.append(bits.astype(np.uint64) << sh)
      regs[d] = halves[0] | halves[1]
    else:
      raise AssertionError(kind)
  return regs["out01"], regs["out23"]


def test_ptx8_recipe_equals_dequantize_in_its_window():
  """Every byte value in every position of the 4-byte word, per-element scales across the
  documented exact window 59 <= e <= 192 (its ends included): decoded * 2^64 is bit-for-bit
  dequantize_mxfp4, for the even (low-nibble) and the odd (high-nibble) block."""
  from pallas_kernels.moe import mxfp4 as mxm
  r = _rng(11)
  n = 1024
  b = np.stack([np.roll(np.tile(np.arange(256), n // 256), j) for j in range(4)], 1)
  b = b.astype(np.uint8)                                        # [n, 4]: all bytes, all slots
  e = r.integers(59, 193, (n, 4)).astype(np.uint8)
  e[:8] = [[59, 192, 59, 192]] * 8
  words = (b.astype(np.uint64) << (8 * np.arange(4, dtype=np.uint64))).sum(1)
  sbits = np.asarray(mxm.folded_scale_bits(jnp.asarray(e))).astype(np.uint64)
  s01 = sbits[:, 0] | (sbits[:, 1] << np.uint64(16))
  s23 = sbits[:, 2] | (sbits[:, 3] << np.uint64(16))
  for ops, nib in ((mxm.PTX8_EVEN, b & 0xF), (mxm.PTX8_ODD, b >> 4)):
    o01, o23 = _interpret_ptx8(ops, words, s01, s23)
    got = np.stack([o01 & 0xFFFF, o01 >> 16, o23 & 0xFFFF, o23 >> 16], 1).astype(np.uint16)
    got = (got.astype(np.uint32) << 16).view(np.float32).astype(np.float64) * 2.0 ** mxm.PTX8_SHIFT
    # reference: each element as its own [1, 32] block whose first code is the nibble
    packed = np.zeros((n * 4, 16), np.uint8)
    packed[:, 0] = nib.reshape(-1)
    ref = np.asarray(moe.dequantize_mxfp4(packed, e.reshape(-1, 1), jnp.float32))[:, 0]
    np.testing.assert_array_equal(got.reshape(-1), ref.astype(np.float64))
    np.testing.assert_array_equal(np.signbit(got.reshape(-1)), np.signbit(ref))
  assert np.any(nib == 1) and np.any(nib == 9)  # +-0.5: the subnormal path is exercised


def test_ptx8_asm_is_rendered_from_the_recipe():
  from pallas_kernels.moe import mxfp4 as mxm
  for asm, ops in ((mxm._ASM8_EVEN, mxm.PTX8_EVEN), (mxm._ASM8_ODD, mxm.PTX8_ODD)):
    body = [l for l in asm.splitlines() if l.split(" ")[0] in ("and.b32", "prmt.b32", "mul.lo.u32",
                                                                "fma.rn.bf16x2")]
    assert len(body) == len(ops) == 9
    assert asm.count("$0") == asm.count("$1") == 1 and "$2" in asm and "$4" in asm


def test_loading_checks_mxfp4_scales_against_the_ptx8_window(caplog):
  """A checkpoint whose E8M0 scales leave ptx8's exact window gets the exact ptx4 decoder in its
  backend (with a warning); scales inside it keep ptx8. Nothing global changes."""
  from k3jax.api import _backend_for
  from pallas_kernels.moe import mxfp4 as mxm
  lo, hi = mxm.PTX8_EXACT_SCALES
  inside = {"layers": {"experts": {"w1_scale": jnp.asarray([[lo, hi]], jnp.uint8),
                                   "w1_packed": jnp.zeros((1, 2), jnp.uint8)}}}
  assert _backend_for(inside).mxfp4_decoder == "ptx8"
  outside = {"layers": [{"mlp": {"experts": {"w1_scale": jnp.asarray([[lo, hi + 1]], jnp.uint8)}}}],  # a list, as loaded
             "norm_scale": jnp.ones((2,), jnp.float32) * 255}  # not MXFP4: ignored
  assert _backend_for(outside).mxfp4_decoder == "ptx4"
  assert "outside the ptx8 decoder's exact window" in caplog.text
  assert mxm.DECODER == "ptx8"
