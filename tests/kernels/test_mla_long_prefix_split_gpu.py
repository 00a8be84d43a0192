"""The long-prefix MLA op's cuDNN split path (impl "cudnn-split": one sequence's prefix windows unmasked, its chunk
causal) on a GPU at the models' shapes (Kimi Linear's 32 heads, K3's 96; qk 128 nope + 64 rope, v 128, latent 512),
bf16, against the jnp window op in fp32 on the same inputs: a lone long chunk behind a decode row (prefix 3 windows
and a part), a fresh prompt, a step of 32 token rows (cuDNN's [H, T] log-sum-exp when T == H), and a step with
several sequences' keys (the Triton fallback); NaN in every unused page slot. Skipped without a GPU:

  JAX_PLATFORMS=cuda python -m pytest -n 0 -m gpu tests/test_mla_long_prefix_split_gpu.py
"""
import jax.numpy as jnp
import numpy as np
import pytest

from tests.support.gpu_marks import GPU_ONLY

from pallas_kernels.mla.long_prefix import prefix_attention
from pallas_kernels.mla.long_prefix_split import split_prefix_attention

pytestmark = GPU_ONLY

from tests.kernels.test_mla_long_prefix_gpu import DN, R, _case as _paged_case  # noqa: E402


def _case(heads, ctx, new, keyed, seed=0):
    """The paged case of the plain long-prefix GPU test, with the sequences not `keyed` given no keys (decode
    rows as `_mixed` passes them)."""
    q, pool, tables, cu, kv_lens, kv_b = _paged_case(heads, ctx, new, seed)
    return q, pool, tables, cu, np.where(keyed, kv_lens, 0).astype(np.int32), kv_b


@pytest.mark.parametrize("seqs", [
    ([1, 27_000, 0], [1, 4_096, 0], [False, True, False]),   # 3 x 8192, 2048 + 256 + 120 masked; after a decode row
    ([0], [3_000], [True]),                                  # a fresh prompt: the causal part alone
    ([100], [25], [True]),                                   # 32 token rows: as many as Kimi Linear's heads
    ([20_000, 0, 3_000], [4_096, 1_500, 200], [True, True, True]),   # several sequences' keys: the fallback
])
@pytest.mark.parametrize("heads", [32, 96])
def test_cudnn_split_equals_fp32_reference(heads, seqs):
    q, pool, tables, cu, kv_lens, kv_b = _case(heads, *seqs)
    kw = dict(nope_dim=DN, scale=(DN + R) ** -0.5, block_keys=8192)
    args = lambda dt: (jnp.asarray(q, dt), jnp.asarray(pool, dt), jnp.asarray(tables), jnp.asarray(cu),  # noqa: E731
                       jnp.asarray(kv_lens), jnp.asarray(kv_b, dt))
    got = np.asarray(split_prefix_attention(*args(jnp.bfloat16), attention="cudnn", fallback="triton", **kw),
                     np.float32)
    ref_inputs = [np.asarray(jnp.asarray(a, jnp.bfloat16), np.float32) if a.dtype == np.float32 else a
                  for a in (q, pool, tables, cu, kv_lens, kv_b)]   # the kernel's bf16 inputs, in fp32
    want = np.asarray(prefix_attention(*(jnp.asarray(a) for a in ref_inputs), impl="reference", **kw))
    assert np.all(np.isfinite(got)), "a NaN page slot leaked"
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err < 2e-2, err
    keyless = np.concatenate([np.arange(cu[n], cu[n + 1]) for n in range(len(kv_lens)) if kv_lens[n] == 0]
                             + [np.arange(cu[-1], len(q))]).astype(int)
    assert np.all(got[keyless] == 0)
