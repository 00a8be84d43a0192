"""The FP8 MLA cache (pallas_kernels/mla/fp8_cache.py): the packed row's word layout (planes, scales, rope
halves), its values against the quantization formula, its quantization error, its write path, and every
reader of the pool (jnp reference, blocked CPU path, Triton kernel in interpret mode, expanded
long-prefix prefill) against float64 / fp32 oracles on the dequantized rows and on the original rows."""
import numpy as np
import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.mla import fp8_cache, mla_paged_decode, ragged_paged_mla, write_kv_pages
from pallas_kernels.mla.blocked import ragged_paged_mla_blocked
from pallas_kernels.mla.reference import ragged_paged_mla_reference
from tests.kernels.test_mla_ops import build_case, numpy_attention

pytestmark = pytest.mark.interpret

L, R = 256, 16                       # two scale tiles of 128
SCALE = 0.05
# outputs are convex combinations of unit-normal latents, each off by <= 2^-4 of its tile's max (~3) after
# e4m3 rounding, the softmax weights shifted by the scores' own rounding: 0.15 absolute (a wrong dequantization
# is off by O(1))
QUANT_ATOL = 0.15
ARGS = ("q_latent", "q_rope", "kv_pages", "block_tables", "cu_seqlens", "kv_lens")


def _fp8_case(case):
    """The case with its pool packed to FP8 (NaN garbage rows stay garbage) and, for the oracles, the
    caches as the pool returns them."""
    fp8 = dict(case)
    fp8["kv_pages"] = np.asarray(fp8_cache.quantize(jnp.asarray(case["kv_pages"]), L))
    fp8["caches"] = [np.asarray(fp8_cache.round_trip(jnp.asarray(c), L)) for c in case["caches"]]
    return fp8


def _args(case, keys=ARGS):
    return [jnp.asarray(case[k]) for k in keys]


def _formula(x, lat):
    """What the cache returns for float32 rows x [..., L + R], from the quantization rule itself: per 128-value
    tile (the whole latent when narrower) scale = amax / 448 (1 for an all-zero tile), the codes the e4m3
    rounding of x / scale clipped to +-448, times the scale in fp32; the rope rounded to bf16. Also the codes
    and the scales (numpy). In jnp, so that the division by 448 rounds as the platform's XLA rounds it."""
    t = min(128, lat)
    xl = jnp.asarray(x[..., :lat], jnp.float32).reshape(*x.shape[:-1], lat // t, t)
    amax = jnp.max(jnp.abs(xl), axis=-1)
    scale = jnp.where(amax > 0, amax / 448.0, 1.0)
    codes = jnp.clip(xl / scale[..., None], -448.0, 448.0).astype(jnp.float8_e4m3fn)
    lat_vals = (codes.astype(jnp.float32) * scale[..., None]).reshape(*x.shape[:-1], lat)
    rope = jnp.asarray(x[..., lat:], jnp.float32).astype(jnp.bfloat16)
    return (np.asarray(jnp.concatenate([lat_vals, rope.astype(jnp.float32)], -1)),
            np.asarray(codes).reshape(*x.shape[:-1], lat), np.asarray(scale), np.asarray(rope))


@pytest.mark.parametrize("lat,rope", [(512, 64), (256, 16), (128, 64), (64, 16), (32, 8), (1024, 64)])
def test_word_layout(lat, rope):
    """Byte b of latent word j is the code of latent index b*L/4 + j (each byte plane inside one scale tile),
    a scale is its word's bits, and a rope word's halves moved to the top of an fp32 are its even and odd
    dims; split returns the parts in natural order."""
    rng = np.random.default_rng(lat + rope)
    x = (rng.standard_normal((3, 5, lat + rope)) * rng.uniform(0.01, 100, lat + rope)).astype(np.float32)
    packed = fp8_cache.quantize(jnp.asarray(x), lat)
    q, n = lat // 4, max(1, lat // 128)
    assert packed.dtype == fp8_cache.STORAGE == jnp.uint32
    assert packed.shape == (3, 5, q + n + rope // 2) and packed.shape[-1] == fp8_cache.packed_width(lat, rope)
    assert fp8_cache.packed_bytes(lat, rope) == lat + 4 * n + 2 * rope
    _, codes, scale, rope_bf16 = _formula(x, lat)
    w = np.asarray(packed)
    code_bits = codes.view(np.uint8)
    tile = min(128, lat)
    for b in range(4):
        plane = ((w[..., :q] >> np.uint32(8 * b)) & np.uint32(0xFF)).astype(np.uint8)
        np.testing.assert_array_equal(plane, code_bits[..., b * q:(b + 1) * q])
    for sg in fp8_cache.segments(lat):      # a segment: one byte plane of its word chunk, inside one scale tile
        assert sg.start // tile == (sg.start + sg.width - 1) // tile == sg.scale
        plane = ((w[..., sg.word:sg.word + sg.width] >> np.uint32(8 * sg.byte)) & np.uint32(0xFF)).astype(np.uint8)
        np.testing.assert_array_equal(plane, code_bits[..., sg.start:sg.start + sg.width])
    assert sorted(c for sg in fp8_cache.segments(lat) for c in range(sg.start, sg.start + sg.width)) == list(range(lat))
    np.testing.assert_array_equal(w[..., q:q + n].view(np.float32), scale)
    r = w[..., q + n:]
    np.testing.assert_array_equal((r << np.uint32(16)).view(np.float32), rope_bf16[..., 0::2].astype(np.float32))
    np.testing.assert_array_equal((r & np.uint32(0xFFFF0000)).view(np.float32), rope_bf16[..., 1::2].astype(np.float32))
    got_codes, got_scales, got_rope = fp8_cache.split(packed, lat)
    np.testing.assert_array_equal(np.asarray(got_codes).view(np.uint8), code_bits)
    np.testing.assert_array_equal(np.asarray(got_scales), scale)
    np.testing.assert_array_equal(np.asarray(got_rope).view(np.uint16), rope_bf16.view(np.uint16))
    assert fp8_cache.latent_dim(packed.shape[-1], lat + rope) == lat


def test_unsupported_widths_raise():
    for lat in (384, 640, 768, 130, 66):              # a plane would straddle two scale tiles, or L % 4
        with pytest.raises(ValueError, match="kv_lora_rank"):
            fp8_cache.packed_width(lat, 64)
    with pytest.raises(ValueError, match="qk_rope_head_dim"):
        fp8_cache.packed_width(512, 63)
    with pytest.raises(ValueError):
        fp8_cache.quantize(jnp.zeros((2, 384 + 64)), 384)


def test_values_are_the_quantization_formulas():
    """dequantize(quantize(x)) equals, bit for bit, the formula's codes x scales and bf16 rope (what the byte
    row returned: the words change where the bytes lie, not what they hold)."""
    rng = np.random.default_rng(5)
    for lat, rope in ((512, 64), (64, 16)):
        x = rng.standard_normal((40, lat + rope)) * np.logspace(-4, 4, lat + rope)[rng.permutation(lat + rope)]
        x[3] = 0.0
        x[4, :64] = 1e-30
        x[5, :lat] = 1e4                                           # the clip at 448 and exact tiles
        x = x.astype(np.float32)
        want = _formula(x, lat)[0]
        for dtype in (jnp.float32, jnp.bfloat16):
            got = np.asarray(fp8_cache.dequantize(fp8_cache.quantize(jnp.asarray(x), lat), lat, dtype))
            np.testing.assert_array_equal(got.astype(np.float32), want.astype(dtype).astype(np.float32))
            np.testing.assert_array_equal(np.asarray(fp8_cache.round_trip(jnp.asarray(x).astype(dtype), lat),
                                                     np.float32),
                                          _formula(np.asarray(jnp.asarray(x).astype(dtype), np.float32), lat)[0]
                                          .astype(dtype).astype(np.float32))


def test_packed_row_layout_and_round_trip_error():
    assert fp8_cache.packed_width(512, 64) == 164 and fp8_cache.packed_bytes(512, 64) == 656   # FlashMLA's bytes
    assert fp8_cache.latent_dim(164, 576) == 512 and fp8_cache.latent_dim(fp8_cache.packed_width(64, 16), 80) == 64
    rng = np.random.default_rng(0)
    # channels over six orders of magnitude (the latent norm's weight spreads them), a zero row, tiny values
    x = rng.standard_normal((64, 512 + 64)) * np.logspace(-3, 3, 576)[rng.permutation(576)]
    x[3] = 0.0
    x[4, :128] = 1e-30
    packed = fp8_cache.quantize(jnp.asarray(x, jnp.float32), 512)
    assert packed.dtype == jnp.uint32 and packed.shape == (64, 164)
    y = np.asarray(fp8_cache.dequantize(packed, 512, jnp.float32), np.float64)
    lat, xl = y[:, :512], x[:, :512]
    amax = np.abs(xl).reshape(64, 4, 128).max(-1).repeat(128, axis=1)
    # e4m3 rounding: half a step of 3 mantissa bits (2^-4 relative) for normals, 2^-10 of the scale below them
    bound = 2.0 ** -4 * np.abs(xl) + 2.0 ** -10 * amax / fp8_cache.FP8_MAX + 1e-6 * np.abs(xl)
    assert np.all(np.abs(lat - xl) <= bound)
    assert np.abs(lat - xl).max() > 0                          # it does quantize
    assert np.all(y[3] == 0)
    np.testing.assert_allclose(y[:, 512:], x[:, 512:], rtol=2.0 ** -8)   # rope: bf16 rounding only


def test_write_path_packs_rows():
    pool = jnp.zeros((4, 8, fp8_cache.packed_width(L, R)), fp8_cache.STORAGE)
    rows = jax.random.normal(jax.random.key(1), (5, L + R), jnp.float32)
    slots = jnp.asarray([9, -1, 0, 31, 17], jnp.int32)
    out = write_kv_pages(pool, rows, slots).reshape(32, -1)
    want = fp8_cache.quantize(rows, L)
    for i, s in enumerate([9, -1, 0, 31, 17]):
        if s >= 0:
            np.testing.assert_array_equal(np.asarray(out[s]), np.asarray(want[i]))
    assert int(jnp.sum(out[1:9].astype(jnp.int32))) == 0       # only the written rows changed


@pytest.mark.parametrize("reader", [pytest.param(ragged_paged_mla_reference, marks=pytest.mark.slow),
                                    ragged_paged_mla_blocked])                   # the CPU engine's path
def test_jnp_readers_on_fp8_pages(reader):
    rng = np.random.default_rng(1)
    case = build_case(rng, [13, 20, 0, 15], [7, 1, 5, 1], heads=4, lat=L, rope=R, page_size=8, pad_tokens=3)
    fp8 = _fp8_case(case)
    got = np.asarray(jax.jit(reader, static_argnames="scale")(*_args(fp8), scale=SCALE))
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, numpy_attention(fp8, SCALE), rtol=1e-5, atol=1e-5)   # the dequantized rows'
    np.testing.assert_allclose(got, numpy_attention(case, SCALE), atol=QUANT_ATOL)       # within quantization


@pytest.mark.parametrize("page_size,config", [
    (8, None),                                             # bk spans pages: gathered rows, keys-on-M form
    pytest.param(16, (("bk", 8), ("splits", 3), ("transposed", False)),   # bk inside a page, split-K, row form
                 marks=pytest.mark.slow),
    pytest.param(16, (("fp8_scale", "codes"), ("transposed", True)),   # every latent value dequantized before the MMAs
                 marks=pytest.mark.slow),
])
def test_triton_decode_on_fp8_pages(page_size, config):
    rng = np.random.default_rng(page_size)
    ctx = [0, 2 * page_size - 1, 45]
    case = build_case(rng, ctx, [1] * len(ctx), heads=4, lat=L, rope=R, page_size=page_size)
    fp8 = _fp8_case(case)
    got = np.asarray(mla_paged_decode(*_args(fp8, ("q_latent", "q_rope", "kv_pages", "block_tables", "kv_lens")),
                                      scale=SCALE, interpret=True, config=config))
    assert np.all(np.isfinite(got)), "kernel read a NaN page slot"
    np.testing.assert_allclose(got, numpy_attention(fp8, SCALE), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, numpy_attention(case, SCALE), atol=QUANT_ATOL)


@pytest.mark.parametrize("heads,page_size", [
    (32, 16),      # Kimi-Linear's heads, default FP8 decode tuning: row form, codes dequantized, a 64-key block
                   # gathered from 4 pages
    # K3's heads: two head groups (64 in row form, 32 keys-on-M), blocks inside a page
    pytest.param(96, 64, marks=pytest.mark.slow),
])
def test_triton_decode_on_fp8_pages_at_model_widths(heads, page_size):
    """The model's row (L=512: four scale tiles, R=64) through the default tuning of each head count."""
    lat, rope = 512, 64
    rng = np.random.default_rng(heads)
    ctx = [130, 0, 64 + page_size - 1]
    case = build_case(rng, ctx, [1] * len(ctx), heads=heads, lat=lat, rope=rope, page_size=page_size, extra_pages=1)
    fp8 = dict(case, kv_pages=np.asarray(fp8_cache.quantize(jnp.asarray(case["kv_pages"]), lat)),
               caches=[np.asarray(fp8_cache.round_trip(jnp.asarray(c), lat)) for c in case["caches"]])
    got = np.asarray(mla_paged_decode(*_args(fp8, ("q_latent", "q_rope", "kv_pages", "block_tables", "kv_lens")),
                                      scale=SCALE, interpret=True))
    assert np.all(np.isfinite(got)), "kernel read a NaN page slot"
    np.testing.assert_allclose(got, numpy_attention(fp8, SCALE), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, numpy_attention(case, SCALE), atol=QUANT_ATOL)


# the kernel's FP8 forms: row form and keys-on-M, the scales on the scores or on the codes, the codes loaded
# once per MMA (the default at 16 rows; keys-on-M then loads the P.V operand transposed) or once
FORMS = {"row": (("transposed", False),),
         "row-codes-once": (("transposed", False), ("fp8_scale", "codes"), ("fp8_reload", False)),
         "keys-on-M": (("transposed", True),),
         "keys-on-M-codes-once": (("transposed", True), ("fp8_scale", "codes"), ("fp8_reload", False))}


def _word_cases():
    """(lat, rope, page_size, form): the model's row in both forms at both page sizes (64-key blocks gathered
    from 4 pages / inside one page) by default; the small test models' row and the codes-once forms widen them
    (slow tier)."""
    for lat, rope in ((512, 64), (64, 16)):
        for page_size in (16, 64):
            for form in FORMS:
                widen = lat != 512 or form.endswith("codes-once")
                yield pytest.param(lat, rope, page_size, form, marks=[pytest.mark.slow] if widen else [])


@pytest.mark.parametrize("lat,rope,page_size,form", list(_word_cases()))
def test_triton_decode_on_fp8_words(lat, rope, page_size, form):
    """The interpret-mode kernel on the word rows against the float64 oracle on the dequantized rows, at the
    model's widths (four planes, a scale tile each) and the test models' (four planes in one tile)."""
    rng = np.random.default_rng(lat + page_size)
    ctx = [page_size + 69, 0, 3]                       # several blocks, an empty sequence, a part block
    case = build_case(rng, ctx, [1] * len(ctx), heads=4, lat=lat, rope=rope, page_size=page_size, extra_pages=1)
    fp8 = dict(case, kv_pages=np.asarray(fp8_cache.quantize(jnp.asarray(case["kv_pages"]), lat)),
               caches=[np.asarray(fp8_cache.round_trip(jnp.asarray(c), lat)) for c in case["caches"]])
    got = np.asarray(mla_paged_decode(*_args(fp8, ("q_latent", "q_rope", "kv_pages", "block_tables", "kv_lens")),
                                      scale=SCALE, interpret=True, config=FORMS[form] + (("bk", 64),)))
    assert np.all(np.isfinite(got)), "kernel read a NaN page slot"
    np.testing.assert_allclose(got, numpy_attention(fp8, SCALE), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, numpy_attention(case, SCALE), atol=QUANT_ATOL)


@pytest.mark.slow
@pytest.mark.parametrize("config", [(("bk", 16),), (("bk", 16), ("transposed", True))])
def test_triton_ragged_on_fp8_pages_bf16_queries(config):
    rng = np.random.default_rng(3)
    case = build_case(rng, [13, 0], [3, 5], heads=4, lat=L, rope=R, page_size=8, pad_tokens=2)
    fp8 = _fp8_case(case)
    args = _args(fp8)
    args[0], args[1] = args[0].astype(jnp.bfloat16), args[1].astype(jnp.bfloat16)
    got = ragged_paged_mla(*args, scale=SCALE, interpret=True, config=config)
    assert got.dtype == jnp.bfloat16
    ref = ragged_paged_mla_reference(*args, scale=SCALE)         # the jnp path on the same pages
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref, np.float32), rtol=2e-2, atol=2e-2)
    assert np.all(np.asarray(got[int(case["cu_seqlens"][-1]):], np.float32) == 0)


def test_long_prefix_on_fp8_pages():
    from pallas_kernels.mla.long_prefix import prefix_attention
    rng = np.random.default_rng(4)
    heads, nope, dv = 2, 8, 8
    case = build_case(rng, [21, 0], [5, 6], heads=heads, lat=L, rope=R, page_size=8)
    fp8 = _fp8_case(case)
    kv_b = jnp.asarray(rng.standard_normal((L, heads * (nope + dv))) * 0.1, jnp.float32)
    q = jnp.asarray(rng.standard_normal((11, heads, nope + R)), jnp.float32)
    deq = np.where(np.isnan(case["kv_pages"]), 0.0,
                   np.asarray(fp8_cache.dequantize(jnp.asarray(fp8["kv_pages"]), L, jnp.float32)))

    def run(pages):
        meta = _args(case, ("block_tables", "cu_seqlens", "kv_lens"))
        return np.asarray(prefix_attention(q, jnp.asarray(pages), *meta, kv_b, nope_dim=nope, scale=SCALE,
                                           block_keys=16))
    got = run(fp8["kv_pages"])
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, run(deq), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("page_size,transposed,fp8_scale,reload,lat,rope", [
    (16, True, "scores", None, 512, 64), (64, False, "scores", None, 512, 64), (64, True, "codes", None, 512, 64),
    (64, True, "scores", False, 512, 64), (16, False, "codes", None, 512, 64),
    (16, False, "scores", None, 128, 16), (64, True, "scores", None, 64, 16)])      # the tiny models' widths
def test_triton_fp8_decode_lowers_for_the_gpu(page_size, transposed, fp8_scale, reload, lat, rope):
    """The kernel's FP8 path (word shifts and masks, bitcasts, fp8 -> bf16 casts) lowers to Triton for a GPU at K3's
    dims (Kimi-Linear's 32 heads) and at the tiny models': pages gathered (16) and contiguous (64), both MMA forms,
    both scale placements, the codes loaded once per MMA (the default at 32 rows) and once."""
    from pallas_kernels.mla.paged import _kernel_path
    n, heads, pages = 2, 32, 4
    args = (jax.ShapeDtypeStruct((n, heads, lat), jnp.bfloat16), jax.ShapeDtypeStruct((n, heads, rope), jnp.bfloat16),
            jax.ShapeDtypeStruct((n * pages + 1, page_size, fp8_cache.packed_width(lat, rope)), jnp.uint32),
            jax.ShapeDtypeStruct((n, pages), jnp.int32), jax.ShapeDtypeStruct((n,), jnp.int32))

    def decode(ql, qr, kv, bt, lens):
        return _kernel_path(ql, qr, kv, bt, jnp.arange(n + 1, dtype=jnp.int32), lens, scale=0.1, decode=True,
                            interpret=None,
                            config={"transposed": transposed, "fp8_scale": fp8_scale, "fp8_reload": reload})
    text = jax.jit(decode).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text and "mla_paged_r" in text      # the kernel, as a Triton custom call
