"""Paged MLA decode on TPU: the Mosaic kernel (pallas_kernels/mla/tpu_kernel.py) run in Pallas
interpret mode on CPU against the float64 oracle and the jnp reference, and its lowering through
Pallas -> Mosaic (jax.export for platform "tpu"; Mosaic's own layout passes only run on a chip)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from tests.support.kernel_steps import can_export_for_tpu
from pallas_kernels.mla.reference import mla_decode_reference
from pallas_kernels.mla.tpu_kernel import mla_paged_decode_tpu, ragged_paged_mla_tpu
from tests.kernels.test_mla_ops import build_case, numpy_attention

pytestmark = pytest.mark.interpret

L, R = 64, 16
SCALE = 0.15
KEYS = ("q_latent", "q_rope", "kv_pages", "block_tables", "kv_lens")


def _args(case):
    return [jnp.asarray(case[k]) for k in KEYS]


@pytest.mark.parametrize("page_size,ppb", [(8, 1), (8, 3), (16, 2), (16, None)])
def test_decode_matches_oracle(page_size, ppb):
    rng = np.random.default_rng(page_size + (ppb or 0))
    ctx = [0, 6, 2 * page_size - 1, 3 * page_size, 45, 17]   # 1 key, page edges, several blocks
    case = build_case(rng, ctx, [1] * len(ctx), heads=4, lat=L, rope=R, page_size=page_size)
    got = np.asarray(mla_paged_decode_tpu(*_args(case), scale=SCALE, pages_per_block=ppb,
                                          interpret=True))
    assert np.all(np.isfinite(got)), "kernel read a NaN page slot"
    np.testing.assert_allclose(got, numpy_attention(case, SCALE), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("page_size,heads,block_q,ppb", [
    (8, 4, 4, 2),       # 16-row tiles, key blocks of 2 pages
    (16, 6, 3, 1),      # odd head count: 18-row tiles
    (8, 4, 1, None),    # one token per tile
])
def test_ragged_matches_oracle(page_size, heads, block_q, ppb):
    rng = np.random.default_rng(10 + page_size + block_q)
    # resumed prefill chunk, decode, fresh prefill, length-1 sequence, decode on a page boundary
    ctx = [13, 20, 0, 0, 2 * page_size - 1]
    new = [7, 1, 5, 1, 1]
    case = build_case(rng, ctx, new, heads=heads, lat=L, rope=R, page_size=page_size, pad_tokens=5)
    got = np.asarray(ragged_paged_mla_tpu(
        *[jnp.asarray(case[k]) for k in ("q_latent", "q_rope", "kv_pages", "block_tables",
                                         "cu_seqlens", "kv_lens")],
        scale=SCALE, block_q=block_q, pages_per_block=ppb, interpret=True))
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, numpy_attention(case, SCALE), rtol=1e-5, atol=1e-5)
    assert not np.any(got[case["cu_seqlens"][-1]:]), "padding tokens must be zero"


def test_garbage_tables_and_empty_sequences_through_the_tpu_interpreter():
    """Table entries past kv_len point outside the pool and an empty sequence (kv_len 0) sits in
    the middle: jax's TPU interpreter raises on an out-of-bounds DMA, models the semaphores and
    looks for races; the empty sequence must come back as zeros."""
    page_size = 8
    rng = np.random.default_rng(3)
    case = build_case(rng, [20, 5, 9, 30], [1, 1, 1, 1], heads=8, lat=L, rope=R, page_size=page_size,
                      max_pages=6)
    want = numpy_attention(case, SCALE)
    want[2] = 0
    case["kv_lens"][2] = 0
    used = -(-case["kv_lens"] // page_size)
    for n, u in enumerate(used):
        case["block_tables"][n, u:] = case["kv_pages"].shape[0] + 1000 + n
    got = np.asarray(mla_paged_decode_tpu(*_args(case), scale=SCALE, pages_per_block=2,
                                          interpret=pltpu.InterpretParams(detect_races=True)))
    assert not np.any(got[2])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    try:
        from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc
    except ImportError:                                               # private; moves between versions
        return
    races = getattr(ipc, "races", None)
    assert races is None or not races.races_found


def test_bf16_close_to_reference():
    rng = np.random.default_rng(5)
    case = build_case(rng, [30, 3, 64], [1, 1, 1], heads=4, lat=L, rope=R, page_size=16)
    bf = [a.astype(jnp.bfloat16) if a.dtype == jnp.float32 else a for a in _args(case)]
    got = mla_paged_decode_tpu(*bf, scale=SCALE, pages_per_block=2, interpret=True)
    ref = mla_decode_reference(*bf, scale=SCALE)
    assert got.dtype == jnp.bfloat16
    g, r = np.asarray(got, np.float32), np.asarray(ref, np.float32)
    assert np.sqrt(np.mean((g - r) ** 2)) / np.sqrt(np.mean(r ** 2)) <= 1e-2


def test_rejects_mismatched_cache_width():
    rng = np.random.default_rng(0)
    case = build_case(rng, [3], [1], heads=2, lat=L, rope=R, page_size=8)
    a = _args(case)
    with pytest.raises(ValueError, match="shapes"):
        mla_paged_decode_tpu(a[0], a[1][..., :8], *a[2:], scale=SCALE, interpret=True)


@pytest.mark.parametrize("dtype,heads,page_size,max_pages", [
    (jnp.bfloat16, 64, 16, 64), (jnp.bfloat16, 16, 64, 33), (jnp.float32, 8, 16, 20)])
@pytest.mark.parametrize("ragged", [False, True])
def test_lowers_through_mosaic_for_tpu(dtype, heads, page_size, max_pages, ragged):
    if not can_export_for_tpu():
        pytest.skip("this jax cannot export Pallas kernels for TPU")
    sd, N, T = jax.ShapeDtypeStruct, 32, 200                          # K3 MLA: 512 latent + 64 rope
    i32 = jnp.int32
    cache = (sd((500, page_size, 576), dtype), sd((N, max_pages), i32))
    if ragged:
        f = lambda *a: ragged_paged_mla_tpu(*a, scale=0.1)            # noqa: E731
        args = (sd((T, heads, 512), dtype), sd((T, heads, 64), dtype), *cache, sd((N + 1,), i32),
                sd((N,), i32))
    else:
        f = lambda *a: mla_paged_decode_tpu(*a, scale=0.1)            # noqa: E731
        args = (sd((N, heads, 512), dtype), sd((N, heads, 64), dtype), *cache, sd((N,), i32))
    text = jax.export.export(jax.jit(f), platforms=["tpu"])(*args).mlir_module()
    assert "tpu_custom_call" in text and "mla_paged_attention_tpu" in text
