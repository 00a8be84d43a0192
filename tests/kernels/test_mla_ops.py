"""Reference paged MLA (pallas_kernels/mla/reference.py) and the CPU's length-bounded form
(pallas_kernels/mla/blocked.py) vs a float64 numpy oracle."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.mla.blocked import ragged_paged_mla_blocked
from pallas_kernels.mla.reference import (
    mla_decode_reference, ragged_paged_mla_reference, write_kv_pages)
from pallas_kernels.scatter import BITS

# the CPU form with 2-page blocks, so that the cases' contexts span several blocks
RAGGED = {"reference": ragged_paged_mla_reference,
          "blocked": functools.partial(ragged_paged_mla_blocked, pages_per_block=2)}


def build_case(rng, ctx_lens, new_lens, *, heads, lat, rope, page_size, pad_tokens=0,
               extra_pages=3, max_pages=None):
    """Random ragged batch with a paged cache laid out on shuffled page ids.

    ctx_lens[n] tokens already cached, new_lens[n] query tokens this step (their rows are in the
    cache too, i.e. kv_lens = ctx + new). Page 0 and unused slots are NaN so any read of them
    poisons the result. Returns a dict of numpy arrays plus the per-sequence contiguous caches.
    """
    kv_lens = np.asarray(ctx_lens) + np.asarray(new_lens)
    n_seqs = len(kv_lens)
    need = [-(-int(k) // page_size) for k in kv_lens]
    if max_pages is None:
        max_pages = max(need) + 1
    n_pages = 1 + sum(need) + extra_pages
    width = lat + rope
    pool = np.full((n_pages, page_size, width), np.nan, np.float32)
    perm = rng.permutation(np.arange(1, n_pages))
    tables = np.zeros((n_seqs, max_pages), np.int32)  # unused entries -> garbage page 0
    caches, k = [], 0
    for n in range(n_seqs):
        cache = rng.standard_normal((kv_lens[n], width)).astype(np.float32)
        caches.append(cache)
        for j in range(need[n]):
            tables[n, j] = perm[k]
            k += 1
            rows = cache[j * page_size:(j + 1) * page_size]
            pool[tables[n, j], :len(rows)] = rows
    cu = np.concatenate([[0], np.cumsum(new_lens)]).astype(np.int32)
    n_tok = int(cu[-1]) + pad_tokens
    q_lat = rng.standard_normal((n_tok, heads, lat)).astype(np.float32)
    q_rope = rng.standard_normal((n_tok, heads, rope)).astype(np.float32)
    return dict(q_latent=q_lat, q_rope=q_rope, kv_pages=pool, block_tables=tables,
                cu_seqlens=cu, kv_lens=kv_lens.astype(np.int32), caches=caches)


def numpy_attention(case, scale):
    """Float64 plain (non-paged) causal absorbed attention; padding rows are zero."""
    q_lat = case["q_latent"].astype(np.float64)
    q_rope = case["q_rope"].astype(np.float64)
    cu, kv_lens = case["cu_seqlens"], case["kv_lens"]
    lat = q_lat.shape[-1]
    out = np.zeros(q_lat.shape, np.float64)
    for n, cache in enumerate(case["caches"]):
        c = cache.astype(np.float64)
        for i in range(cu[n], cu[n + 1]):
            pos = kv_lens[n] - (cu[n + 1] - i)
            ckv, kr = c[:pos + 1, :lat], c[:pos + 1, lat:]
            s = scale * (q_lat[i] @ ckv.T + q_rope[i] @ kr.T)
            p = np.exp(s - s.max(-1, keepdims=True))
            out[i] = (p / p.sum(-1, keepdims=True)) @ ckv
    return out


H, L, R = 4, 64, 16
SCALE = (L // 4 + R) ** -0.5


def _run_ref(case, impl="reference", **kw):
    f = jax.jit(functools.partial(RAGGED[impl], scale=SCALE, **kw))
    return np.asarray(f(*(jnp.asarray(case[k]) for k in
                          ("q_latent", "q_rope", "kv_pages", "block_tables", "cu_seqlens",
                           "kv_lens"))))


@pytest.mark.parametrize("impl", list(RAGGED))
@pytest.mark.parametrize("page_size", [8, 16])
def test_ragged_mixed_batch(page_size, impl):
    rng = np.random.default_rng(page_size)
    # resumed prefill chunk, decode, fresh prefill, length-1 decode, decode at a page boundary
    ctx = [13, 20, 0, 0, 2 * page_size - 1]
    new = [7, 1, 5, 1, 1]
    case = build_case(rng, ctx, new, heads=H, lat=L, rope=R, page_size=page_size, pad_tokens=6)
    got = _run_ref(case, impl)
    want = numpy_attention(case, SCALE)
    assert np.all(np.isfinite(got)), "read NaN garbage (page 0 or unused slot)"
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    n_valid = case["cu_seqlens"][-1]
    assert np.all(got[n_valid:] == 0)


def test_decode_reference_matches_oracle():
    rng = np.random.default_rng(1)
    ctx = [0, 5, 31, 40, 16]
    case = build_case(rng, ctx, [1] * len(ctx), heads=H, lat=L, rope=R, page_size=8)
    want = numpy_attention(case, SCALE)
    got = jax.jit(functools.partial(mla_decode_reference, scale=SCALE))(
        *(jnp.asarray(case[k]) for k in ("q_latent", "q_rope", "kv_pages", "block_tables",
                                         "kv_lens")))
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)
    # the ragged entries give the same thing for one token per sequence
    for impl in RAGGED:
        np.testing.assert_allclose(_run_ref(case, impl, batch_size=3), want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("impl,bits", [("reference", False), ("blocked", True)])
def test_bf16_cache_close_to_oracle(impl, bits):
    """bits: the pool stored as uint16 bit patterns, as the CPU runner stores 16-bit pools."""
    rng = np.random.default_rng(2)
    case = build_case(rng, [9, 30], [4, 1], heads=H, lat=L, rope=R, page_size=16)
    bf = dict(case)
    for k in ("q_latent", "q_rope", "kv_pages"):
        bf[k] = jnp.asarray(case[k]).astype(jnp.bfloat16)
        case[k] = np.asarray(bf[k].astype(jnp.float32))  # oracle sees the rounded inputs
    case["caches"] = [np.asarray(jnp.asarray(c).astype(jnp.bfloat16).astype(jnp.float32))
                      for c in case["caches"]]
    if bits:
        bf["kv_pages"] = jax.lax.bitcast_convert_type(bf["kv_pages"], BITS)
    got = jax.jit(functools.partial(RAGGED[impl], scale=SCALE))(
        *(jnp.asarray(bf[k]) for k in ("q_latent", "q_rope", "kv_pages", "block_tables",
                                       "cu_seqlens", "kv_lens")))
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got.astype(jnp.float32)), numpy_attention(case, SCALE),
                               rtol=2e-2, atol=2e-2)


def test_write_kv_pages_drops_negative_and_keeps_others():
    rng = np.random.default_rng(3)
    pool = rng.standard_normal((6, 4, L + R)).astype(np.float32)
    new = rng.standard_normal((7, L + R)).astype(np.float32)
    slots = np.array([5, -1, 22, 0 * 4 + 3, -7, 9, 23], np.int32)
    want = pool.copy().reshape(24, L + R)
    for t, s in enumerate(slots):
        if s >= 0:
            want[s] = new[t]
    f = jax.jit(write_kv_pages, donate_argnums=0)
    got = np.asarray(f(jnp.asarray(pool), jnp.asarray(new), jnp.asarray(slots)))
    np.testing.assert_array_equal(got.reshape(24, L + R), want)
    # -1 / -7 must not wrap around onto the last rows of the pool
    assert not np.array_equal(want[-1], new[1]) and not np.array_equal(want[-7], new[4])


def test_write_then_attend_roundtrip():
    """Write the step's new rows with write_kv_pages, then attend: equals the oracle."""
    rng = np.random.default_rng(4)
    ps = 8
    case = build_case(rng, [11, 3], [6, 1], heads=H, lat=L, rope=R, page_size=ps, pad_tokens=3)
    pool = case["kv_pages"].copy()
    slots, rows = [], []
    for n, cache in enumerate(case["caches"]):
        for pos in range(case["kv_lens"][n] - (case["cu_seqlens"][n + 1] - case["cu_seqlens"][n]),
                         case["kv_lens"][n]):
            page = case["block_tables"][n, pos // ps]
            pool[page, pos % ps] = np.nan  # erase: the write must restore it
            slots.append(page * ps + pos % ps)
            rows.append(cache[pos])
    slots += [-1] * 3
    rows += [np.full(L + R, 7.0, np.float32)] * 3
    written = write_kv_pages(jnp.asarray(pool), jnp.asarray(np.stack(rows)),
                             jnp.asarray(np.array(slots, np.int32)))
    case = dict(case, kv_pages=np.asarray(written))
    np.testing.assert_allclose(_run_ref(case), numpy_attention(case, SCALE), rtol=2e-5, atol=2e-5)
