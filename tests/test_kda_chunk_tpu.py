"""Chunked KDA prefill on TPU: the Mosaic kernel (pallas_kernels/kda/chunk_tpu.py) run in jax's TPU
interpreter on CPU against the jnp references, and its lowering through Pallas -> Mosaic
(jax.export for platform "tpu"; Mosaic's own layout passes only run on a chip, so that part stays
unverified here)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from pallas_kernels.kda.chunk_tpu import chunk_kda_laid_out_tpu
from pallas_kernels.kda.reference import recurrent_kda_reference, varlen_chunk_layout

_C = 64
# Interpret-mode kernels are big HLO: skip XLA's backend optimisations to keep compile time low.
_FAST_COMPILE = {"xla_backend_optimization_level": 0}


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2)) / (np.sqrt(np.mean(b ** 2)) + 1e-30))


def _laid_out(q, k, v, g, beta, h0, cu_seqlens=None):
    """Lay the inputs out as ops.chunk_kda does (sequences on chunk boundaries, zero padding rows),
    run the TPU kernel in interpret mode, and put the output back in token order."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    sd = q.dtype
    qs = (q.astype(jnp.float32) * K ** -0.5).astype(sd)
    xs = [qs, k, v, g.astype(jnp.float32), beta.astype(jnp.float32)]
    if cu_seqlens is None:
        TP = -(-T // _C) * _C
        xs = [jnp.pad(x, [(0, 0), (0, TP - T)] + [(0, 0)] * (x.ndim - 2)) for x in xs]
        xs = [x.reshape((B * TP,) + x.shape[2:]) for x in xs]
        cs = jnp.arange(B + 1, dtype=jnp.int32) * (TP // _C)
        lay = None
    else:
        lay = varlen_chunk_layout(cu_seqlens, T, _C)
        xs = [lay.gather(x[0]).reshape((-1,) + x.shape[2:]) for x in xs]
        cs = lay.cs
    o, ht = chunk_kda_laid_out_tpu(*xs, cs, h0, chunk_size=_C, interpret=True)
    o = o.reshape(B, -1, H, V)[:, :T] if lay is None else lay.scatter(o)[None]
    return o, ht


_run = jax.jit(_laid_out, compiler_options=_FAST_COMPILE)


def _inputs(seed, B, T, H, K, V, g_lo=-5.0, g_hi=0.0, dtype=jnp.float32):
    """l2-normalised q/k, per-token log decay g uniform in (g_lo, g_hi), beta in (0, 1)."""
    r = np.random.default_rng(seed)
    nrm = lambda x: x / np.sqrt((x ** 2).sum(-1, keepdims=True) + 1e-6)  # noqa: E731
    q = nrm(r.standard_normal((B, T, H, K)))
    k = nrm(r.standard_normal((B, T, H, K)))
    v = r.standard_normal((B, T, H, V))
    g = r.uniform(g_lo, g_hi, (B, T, H, K))
    beta = 1 / (1 + np.exp(-r.standard_normal((B, T, H))))
    cast = lambda x, d=dtype: jnp.asarray(x, d)  # noqa: E731
    return cast(q), cast(k), cast(v), cast(g, jnp.float32), cast(beta)


@pytest.mark.parametrize("B,T,H,K,V,g_lo,g_hi", [
    (2, 100, 2, 128, 128, -5.0, 0.0),     # T not a multiple of 64, K3's head size
    (1, 1, 3, 128, 128, -5.0, 0.0),       # one token
    (1, 130, 1, 64, 128, -8.0, -4.0),     # strong decay: exp(g) underflows across a chunk
    (1, 64, 4, 128, 64, -0.05, 0.0),      # weak decay: the delta rule does the work
])
def test_fp32_matches_recurrent_reference(B, T, H, K, V, g_lo, g_hi):
    q, k, v, g, beta = _inputs(T * H + B, B, T, H, K, V, g_lo, g_hi)
    h0 = jax.random.normal(jax.random.PRNGKey(T), (B, H, K, V))
    o, ht = _run(q, k, v, g, beta, h0)
    ro, rht = recurrent_kda_reference(q, k, v, g, beta, initial_state=h0)
    assert o.shape == (B, T, H, V) and o.dtype == jnp.float32
    assert ht.shape == (B, H, K, V) and ht.dtype == jnp.float32
    assert _rel(o, ro) <= 1e-5, _rel(o, ro)
    assert _rel(ht, rht) <= 1e-5, _rel(ht, rht)
