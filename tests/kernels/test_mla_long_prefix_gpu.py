"""The long-prefix MLA op's Triton path on a GPU at the models' shapes (Kimi Linear's 32 heads, K3's 96; qk 128 nope
+ 64 rope, v 128, latent 512), bf16, against the jnp path in fp32 on the same inputs: a long resumed chunk over a
paged context spanning many key windows, a fresh prompt and a short chunk in one step, NaN in every unused page
slot. Skipped without a GPU:

  python -m pytest -p no:xdist -o addopts="" -m gpu tests/kernels/test_mla_long_prefix_gpu.py
"""
import jax.numpy as jnp
import numpy as np
import pytest

from tests.support.gpu_marks import GPU_ONLY

from pallas_kernels.mla.long_prefix import prefix_attention

pytestmark = GPU_ONLY

L, R, DN, DV, PAGE = 512, 64, 128, 128, 16


def _case(heads, ctx, new, seed=0):
    rng = np.random.default_rng(seed)
    kv_lens = np.asarray(ctx) + np.asarray(new)
    need = [-(-int(k) // PAGE) for k in kv_lens]
    n_pages = 1 + sum(need) + 4
    pool = np.full((n_pages, PAGE, L + R), np.nan, np.float32)
    perm = rng.permutation(np.arange(1, n_pages))
    tables = np.zeros((len(kv_lens), max(need) + 2), np.int32)
    k = 0
    for n, kl in enumerate(kv_lens):
        cache = rng.standard_normal((kl, L + R)).astype(np.float32)
        for j in range(need[n]):
            tables[n, j] = perm[k]
            k += 1
            rows = cache[j * PAGE:(j + 1) * PAGE]
            pool[tables[n, j], :len(rows)] = rows
    cu = np.concatenate([[0], np.cumsum(new)]).astype(np.int32)
    t = int(cu[-1]) + 7
    q = rng.standard_normal((t, heads, DN + R)).astype(np.float32)
    kv_b = (rng.standard_normal((L, heads * (DN + DV))) / np.sqrt(L)).astype(np.float32)
    return q, pool, tables, cu, kv_lens.astype(np.int32), kv_b


@pytest.mark.parametrize("impl", ["triton", "cudnn"])
@pytest.mark.parametrize("heads", [32, 96])
def test_kernel_windows_equal_fp32_reference(heads, impl):
    q, pool, tables, cu, kv_lens, kv_b = _case(heads, [20_000, 0, 3_000], [4_096, 1_500, 200])
    kw = dict(nope_dim=DN, scale=(DN + R) ** -0.5, block_keys=8192)
    args = lambda dt: (jnp.asarray(q, dt), jnp.asarray(pool, dt), jnp.asarray(tables), jnp.asarray(cu),  # noqa: E731
                       jnp.asarray(kv_lens), jnp.asarray(kv_b, dt))
    got = np.asarray(prefix_attention(*args(jnp.bfloat16), impl=impl, **kw), np.float32)
    ref_inputs = [np.asarray(jnp.asarray(a, jnp.bfloat16), np.float32) if a.dtype == np.float32 else a
                  for a in (q, pool, tables, cu, kv_lens, kv_b)]   # the kernel's bf16 inputs, in fp32
    want = np.asarray(prefix_attention(*(jnp.asarray(a) for a in ref_inputs), impl="reference", **kw))
    assert np.all(np.isfinite(got)), "a NaN page slot leaked"
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err < 2e-2, err
    assert np.all(got[cu[-1]:] == 0)
