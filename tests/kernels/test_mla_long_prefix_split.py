"""The long-prefix MLA op split into unmasked prefix windows and a causal chunk
(pallas_kernels/mla/long_prefix_split.py), its dense attention the jnp one, against the window-at-a-time op's jnp
path (long_prefix.prefix_attention, impl "reference"), fp32 on random pages: prefixes a multiple of the window, not
one (the partial window in power-of-two sub-windows and a masked rest, or sub-windows alone), shorter than one and
empty; the prefilling sequence after a decode row (its queries not at row 0) with padding tokens; a step with two
sequences' keys, which falls back to the window op. Unused page slots and page 0 are NaN. One shape for every case
(one compile).
"""
import functools

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.mla.long_prefix import prefix_attention
from pallas_kernels.mla.long_prefix_split import dense_attention_reference, split_prefix_attention

H, L, R, DN, DV, PAGE = 2, 32, 16, 16, 8, 8
SCALE = (DN + R) ** -0.5
T, MAX_PAGES, POOL, WINDOW = 40, 16, 48, 24


def _case(seqs, seed=0):
    """seqs: (context, new tokens, keys in this op) per sequence; a sequence without keys here (the absorbed
    form's rows) has kv_len 0."""
    rng = np.random.default_rng(seed)
    pool = np.full((POOL, PAGE, L + R), np.nan, np.float32)
    free = list(rng.permutation(np.arange(1, POOL)))
    tables = np.zeros((len(seqs), MAX_PAGES), np.int32)
    kv_lens = []
    for n, (ctx, new, keyed) in enumerate(seqs):
        kl = ctx + new
        for j in range(-(-kl // PAGE)):
            tables[n, j] = free.pop()
            rows = min(PAGE, kl - j * PAGE)
            pool[tables[n, j], :rows] = rng.standard_normal((rows, L + R))
        kv_lens.append(kl if keyed else 0)
    cu = np.concatenate([[0], np.cumsum([s[1] for s in seqs])]).astype(np.int32)
    assert cu[-1] <= T
    q = rng.standard_normal((T, H, DN + R)).astype(np.float32)
    kv_b = (rng.standard_normal((L, H * (DN + DV))) / np.sqrt(L)).astype(np.float32)
    return tuple(jnp.asarray(a) for a in (q, pool, tables, cu, np.asarray(kv_lens, np.int32), kv_b))


KW = dict(nope_dim=DN, scale=SCALE, block_keys=WINDOW)


@pytest.mark.parametrize("seqs", [
    [(1, 1, False), (83, 21, True), (0, 0, False)],    # 3 windows + 8 + 3 masked; after a decode row; 18 padding
    [(36, 4, True), (0, 0, False), (0, 0, False)],     # 1 window + 8 + 4, nothing masked
    [(48, 10, True), (0, 0, False), (0, 0, False)],    # exactly 2 windows
    [(5, 30, True), (2, 3, False), (0, 0, False)],     # a prefix shorter than a window: 4 + 1 masked
    [(0, 0, False), (0, 37, True), (0, 0, False)],     # a fresh prompt: the causal part alone
    [(30, 12, True), (20, 9, True), (0, 4, False)],    # two sequences' keys: the window op
])
def test_split_equals_window_reference(seqs):
    args = _case(seqs)
    got = np.asarray(split_prefix_attention(*args, attention="reference", fallback="reference",
                                            min_rows=4, **KW))
    want = np.asarray(prefix_attention(*args, impl="reference", **KW))
    assert np.all(np.isfinite(got)), "a NaN page slot leaked"
    assert np.abs(want).max() > 0.1
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    cu, kv_lens = np.asarray(args[3]), np.asarray(args[4])
    keyless = np.concatenate([np.arange(cu[n], cu[n + 1]) for n in range(len(seqs)) if kv_lens[n] == 0]
                             + [np.arange(cu[-1], T)]).astype(int)
    assert np.all(got[keyless] == 0), "rows without keys here (absorbed rows, padding) must be zero"


@functools.lru_cache(maxsize=None)
def _dense_case():
    rng = np.random.default_rng(3)
    return tuple(rng.standard_normal(s).astype(np.float32) for s in ((6, 2, 5), (9, 2, 5), (9, 2, 3)))


@pytest.mark.parametrize("causal,kv_len", [(False, None), (True, None), (False, 4)])
def test_dense_attention_reference_against_numpy(causal, kv_len):
    q, k, v = _dense_case()
    o, lse = dense_attention_reference(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), scale=0.7, causal=causal,
                                       kv_len=kv_len)
    for t in range(q.shape[0]):
        n = min(t + 1, k.shape[0]) if causal else (kv_len or k.shape[0])
        s = 0.7 * np.einsum("hd,khd->hk", q[t].astype(np.float64), k[:n])
        want_lse = np.log(np.exp(s).sum(-1))
        np.testing.assert_allclose(np.asarray(lse)[t], want_lse, rtol=1e-5)
        want_o = np.einsum("hk,khd->hd", np.exp(s - want_lse[:, None]), v[:n])
        np.testing.assert_allclose(np.asarray(o)[t], want_o, rtol=1e-5, atol=1e-6)
