"""Expanded-form MLA over long paged caches, a key window at a time (pallas_kernels/mla/long_prefix.py),
against a float64 numpy attention over each sequence's plain cache with its keys decompressed.

The windows are much smaller than the contexts, so a sequence's keys span several windows, windows
start inside sequences and hold the tails of one and the heads of the next; the pool's unused slots
and page 0 are NaN; a sequence without keys in the expanded form (kv_len 0) and padding tokens get zeros.
"""
import functools

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.mla.long_prefix import merge, prefix_attention
from tests.kernels.test_mla_ops import build_case

pytestmark = pytest.mark.interpret

H, L, R, DN, DV = 2, 32, 16, 16, 8
SCALE = (DN + R) ** -0.5


@functools.lru_cache(maxsize=None)
def _case():
    rng = np.random.default_rng(7)
    # a long resumed chunk, a decode-like row, a fresh prompt, an empty sequence, a chunk on a page boundary
    case = build_case(rng, [83, 40, 0, 0, 24], [21, 1, 37, 0, 8], heads=H, lat=L, rope=R, page_size=8,
                      pad_tokens=5)
    kv_b = (rng.standard_normal((L, H, DN + DV)) / np.sqrt(L)).astype(np.float32)
    q = rng.standard_normal((case["q_latent"].shape[0], H, DN + R)).astype(np.float32)
    return case, kv_b, q


def _numpy_attention(case, kv_b, q):
    """float64: per sequence, keys decompressed from its contiguous cache, causal softmax."""
    kv_b = kv_b.astype(np.float64)
    out = np.zeros((q.shape[0], H, DV))
    cu, kv_lens = case["cu_seqlens"], case["kv_lens"]
    for n, cache in enumerate(case["caches"]):
        c = cache.astype(np.float64)
        kv = np.einsum("kl,lhd->khd", c[:, :L], kv_b)
        for i in range(cu[n], cu[n + 1]):
            pos = kv_lens[n] - (cu[n + 1] - i)
            s = SCALE * (np.einsum("hd,khd->hk", q[i, :, :DN], kv[:pos + 1, :, :DN])
                         + q[i, :, DN:] @ c[:pos + 1, L:].T)
            p = np.exp(s - s.max(-1, keepdims=True))
            out[i] = np.einsum("hk,khd->hd", p / p.sum(-1, keepdims=True), kv[:pos + 1, :, DN:])
    return out


def _run(case, kv_b, q, block_keys, **kw):
    return np.asarray(prefix_attention(
        jnp.asarray(q), jnp.asarray(case["kv_pages"]), jnp.asarray(case["block_tables"]),
        jnp.asarray(case["cu_seqlens"]), jnp.asarray(case["kv_lens"]), jnp.asarray(kv_b.reshape(L, -1)),
        nope_dim=DN, scale=SCALE, block_keys=block_keys, **kw))


@pytest.mark.parametrize("block_keys,kw", [
    (24, dict(impl="reference")),                                                # jnp per window
    (48, dict(impl="triton", interpret=True, config=(("bq", 16), ("bk", 16)))),  # Triton kernel, interpreted
])
def test_windows_equal_float64_attention(block_keys, kw):
    case, kv_b, q = _case()
    assert case["kv_lens"].sum() > 4 * block_keys   # several windows; sequence 0 alone spans > 2
    got = _run(case, kv_b, q, block_keys, **kw)
    want = _numpy_attention(case, kv_b, q)
    assert np.all(np.isfinite(got)), "a NaN page slot leaked"
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    assert np.all(got[case["cu_seqlens"][-1]:] == 0), "padding tokens must be zero"


def test_sequence_without_keys_gets_zeros():
    """kv_len 0 (the model's mark for a sequence the other form takes): its tokens get zeros, the rest
    are unchanged."""
    case, kv_b, q = _case()
    hidden = dict(case, kv_lens=np.where(np.arange(5) == 0, 0, case["kv_lens"]).astype(np.int32))
    got = _run(hidden, kv_b, q, 32, impl="reference")
    want = _run(case, kv_b, q, 32, impl="reference")
    cu = case["cu_seqlens"]
    assert np.all(got[:cu[1]] == 0)
    np.testing.assert_allclose(got[cu[1]:], want[cu[1]:], rtol=1e-6, atol=1e-6)


def test_merge_is_the_union_softmax():
    rng = np.random.default_rng(3)
    s = rng.standard_normal((3, 1, 10)) * 4
    v = rng.standard_normal((10, 5))
    s[1, 0, :4] = -np.inf   # a row with no keys in the first part
    s[2, 0, :] = -np.inf    # a row with no keys at all

    def part(sl):
        x = s[..., sl]
        with np.errstate(divide="ignore"):
            lse = np.log(np.exp(x).sum(-1))
        with np.errstate(invalid="ignore"):
            o = np.nan_to_num(np.exp(x - lse[..., None]) @ v[sl])
        return jnp.asarray(o), jnp.asarray(lse)

    o, lse = merge(*part(slice(0, 4)), *part(slice(4, 10)))
    o_all, lse_all = part(slice(0, 10))
    np.testing.assert_allclose(np.asarray(o), np.asarray(o_all), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(lse_all), rtol=1e-6)
    assert np.all(np.asarray(o)[2] == 0) and np.isneginf(np.asarray(lse)[2]).all()
