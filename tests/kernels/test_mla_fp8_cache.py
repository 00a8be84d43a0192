"""The FP8 MLA cache (pallas_kernels/mla/fp8_cache.py): the packed row's quantization error, its write path,
and every reader of the pool (jnp reference, blocked CPU path, Triton kernel in interpret mode, expanded
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


def test_packed_row_layout_and_round_trip_error():
    assert fp8_cache.packed_width(512, 64) == 656            # FlashMLA / vLLM's FP8 MLA row
    assert fp8_cache.latent_dim(656, 576) == 512 and fp8_cache.latent_dim(fp8_cache.packed_width(64, 16), 80) == 64
    rng = np.random.default_rng(0)
    # channels over six orders of magnitude (the latent norm's weight spreads them), a zero row, tiny values
    x = rng.standard_normal((64, 512 + 64)) * np.logspace(-3, 3, 576)[rng.permutation(576)]
    x[3] = 0.0
    x[4, :128] = 1e-30
    packed = fp8_cache.quantize(jnp.asarray(x, jnp.float32), 512)
    assert packed.dtype == jnp.uint8 and packed.shape == (64, 656)
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
    pool = jnp.zeros((4, 8, fp8_cache.packed_width(L, R)), jnp.uint8)
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


@pytest.mark.parametrize("page_size,transposed,fp8_scale,reload", [
    (16, True, "scores", None), (64, False, "scores", None), (64, True, "codes", None), (64, True, "scores", False),
    (16, False, "codes", None)])
def test_triton_fp8_decode_lowers_for_the_gpu(page_size, transposed, fp8_scale, reload):
    """The kernel's FP8 path (byte splits and assembly, fp8 -> bf16 casts) lowers to Triton for a GPU at K3's dims
    (Kimi-Linear's 32 heads): pages gathered (16) and contiguous (64), both MMA forms, both scale placements, the
    codes loaded once per MMA (the default at 32 rows) and once."""
    from pallas_kernels.mla.paged import _kernel_path
    n, heads, pages = 2, 32, 4
    args = (jax.ShapeDtypeStruct((n, heads, 512), jnp.bfloat16), jax.ShapeDtypeStruct((n, heads, 64), jnp.bfloat16),
            jax.ShapeDtypeStruct((n * pages + 1, page_size, 656), jnp.uint8),
            jax.ShapeDtypeStruct((n, pages), jnp.int32), jax.ShapeDtypeStruct((n,), jnp.int32))

    def decode(ql, qr, kv, bt, lens):
        return _kernel_path(ql, qr, kv, bt, jnp.arange(n + 1, dtype=jnp.int32), lens, scale=0.1, decode=True,
                            interpret=None,
                            config={"transposed": transposed, "fp8_scale": fp8_scale, "fp8_reload": reload})
    text = jax.jit(decode).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text and "mla_paged_r" in text      # the kernel, as a Triton custom call
