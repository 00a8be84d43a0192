"""Chunked KDA prefill on TPU: the Mosaic kernel (pallas_kernels/kda/chunk_tpu.py) run in jax's TPU
interpreter on CPU against the jnp references, and its lowering through Pallas -> Mosaic
(jax.export for platform "tpu"; Mosaic's own layout passes only run on a chip, so that part stays
unverified here)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.support.kernel_steps import can_export_for_tpu
from pallas_kernels.kda.chunk_tpu import chunk_kda_laid_out_tpu
from pallas_kernels.kda.reference import recurrent_kda_reference, varlen_chunk_layout
from tests.support.tiers import slow_case

pytestmark = pytest.mark.interpret

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
    slow_case(1, 1, 3, 128, 128, -5.0, 0.0),       # one token
    (1, 130, 1, 64, 128, -8.0, -4.0),     # strong decay: exp(g) underflows across a chunk
    slow_case(1, 64, 3, 128, 128, -0.05, 0.0),     # weak decay: the delta rule does the work
    (1, 80, 2, 64, 32, -5.0, 0.0),        # head dims below 128 lanes: the [H, R, D] layout
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


def test_bf16_matches_reference():
    B, T, H, K, V = 1, 200, 2, 128, 128
    q, k, v, g, beta = _inputs(5, B, T, H, K, V, dtype=jnp.bfloat16)
    h0 = jax.random.normal(jax.random.PRNGKey(2), (B, H, K, V))
    o, ht = _run(q, k, v, g, beta, h0)
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731  the reference on the same (rounded) inputs
    ro, rht = recurrent_kda_reference(f32(q), f32(k), f32(v), g, f32(beta), initial_state=h0)
    assert o.dtype == jnp.bfloat16 and ht.dtype == jnp.float32
    assert _rel(o, ro) <= 5e-3, _rel(o, ro)
    assert _rel(ht, rht) <= 5e-3, _rel(ht, rht)


def test_varlen_sequences_zero_length_and_padding():
    """Several sequences (one of 1 token, one empty, one over two chunks) plus trailing padding
    tokens; nonzero initial states; the empty sequence's state passes through unchanged."""
    H, K, V = 2, 128, 128
    lens = [70, 1, 0, 130, 20]
    T = sum(lens) + 9
    q, k, v, g, beta = _inputs(9, 1, T, H, K, V, g_lo=-6.0)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
    h0 = jax.random.normal(jax.random.PRNGKey(3), (len(lens), H, K, V))
    o, ht = _run(q, k, v, g, beta, h0, cu)
    ro, rht = recurrent_kda_reference(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu)
    n = int(cu[-1])
    assert o.shape == (1, T, H, V) and ht.shape == (len(lens), H, K, V)
    assert _rel(o[:, :n], ro[:, :n]) <= 1e-5, _rel(o[:, :n], ro[:, :n])
    assert not np.any(np.asarray(o[:, n:]))                          # padding tokens: 0
    assert np.array_equal(np.asarray(ht[2]), np.asarray(h0[2]))      # empty sequence
    for i in range(len(lens)):
        assert _rel(ht[i], rht[i]) <= 1e-5, (i, _rel(ht[i], rht[i]))


def test_rejects_a_row_count_that_is_not_whole_chunks():
    R, H, K = 100, 1, 128
    x = jnp.zeros((R, H, K))
    with pytest.raises(ValueError, match="divide R"):
        chunk_kda_laid_out_tpu(x, x, x, x, jnp.zeros((R, H)), jnp.zeros((2,), jnp.int32),
                               jnp.zeros((1, H, K, K)), interpret=True)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_lowers_through_mosaic_for_tpu(dtype):
    """K3 prefill shapes: H=32, K=V=128, 4096 laid-out rows (64 chunks), three sequences."""
    if not can_export_for_tpu():
        pytest.skip("this jax cannot export Pallas kernels for TPU")
    H, K, V, R, N = 32, 128, 128, 4096, 3
    sd = jax.ShapeDtypeStruct
    exp = jax.export.export(jax.jit(chunk_kda_laid_out_tpu), platforms=["tpu"])(
        sd((R, H, K), dtype), sd((R, H, K), dtype), sd((R, H, V), dtype), sd((R, H, K), jnp.float32),
        sd((R, H), jnp.float32), sd((N + 1,), jnp.int32), sd((N, H, K, V), jnp.float32))
    text = exp.mlir_module()
    assert "tpu_custom_call" in text and "kda_chunk_tpu" in text


def test_tpu_interpreter_uninitialised_scratch_and_races():
    """jax's TPU interpreter (pltpu.InterpretParams) fills uninitialised VMEM with NaN and looks
    for races: the state scratch must be loaded from h0 before any chunk reads it. Two simulated
    cores split the "parallel" head axis (megacore), each with its own scratch."""
    from jax.experimental.pallas import tpu as pltpu
    H, K, V, C = 2, 128, 128, _C
    lens = [64, 1, 100]
    T = sum(lens)
    q, k, v, g, beta = _inputs(13, 1, T, H, K, V)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
    h0 = jax.random.normal(jax.random.PRNGKey(5), (len(lens), H, K, V))
    lay = varlen_chunk_layout(cu, T, C)
    qs = q * K ** -0.5
    xs = [lay.gather(x[0]).reshape((-1,) + x.shape[2:]) for x in (qs, k, v, g, beta)]
    params = pltpu.InterpretParams(detect_races=True, num_cores_or_threads=2)  # megacore: heads split
    o, ht = chunk_kda_laid_out_tpu(*xs, lay.cs, h0, chunk_size=C, interpret=params)
    ro, rht = recurrent_kda_reference(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu)
    assert _rel(lay.scatter(o)[None], ro) <= 1e-5
    assert _rel(ht, rht) <= 1e-5
    try:
        from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc
    except ImportError:                                               # private; moves between versions
        return
    races = getattr(ipc, "races", None)
    assert races is None or not races.races_found


@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_chunk_kda_on_tpu_runs_the_kernel_with_gate_and_l2norm(monkeypatch, lower_bound):
    """kda.chunk_kda(platform="tpu"): the in-kernel gate applied in XLA, then this kernel (varlen)."""
    from pallas_kernels.kda import chunk_kda, chunk_tpu
    from pallas_kernels.kda.reference import kda_gate, l2norm
    H, K, V = 2, 128, 128
    lens = [5, 90]
    T = sum(lens) + 3
    q, k, v, f, beta = _inputs(21, 1, T, H, K, V, g_lo=-2.0, g_hi=2.0)   # f: raw gate projection
    q, k = q * 3.0, k * 0.5                                              # l2norm has work to do
    rng = np.random.default_rng(22)
    A_log = jnp.asarray(rng.standard_normal(128) * 0.5, jnp.float32)     # K3 stores [128], first H used
    dt_bias = jnp.asarray(rng.standard_normal(H * K), jnp.float32)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
    h0 = jax.random.normal(jax.random.PRNGKey(6), (len(lens), H, K, V))
    calls = []
    real = chunk_tpu.chunk_kda_laid_out_tpu
    monkeypatch.setattr(chunk_tpu, "chunk_kda_laid_out_tpu",
                        lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    o, ht = jax.jit(lambda *a: chunk_kda(
        *a, initial_state=h0, cu_seqlens=cu, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
        A_log=A_log, dt_bias=dt_bias, lower_bound=lower_bound, interpret=True, platform="tpu"),
        compiler_options=_FAST_COMPILE)(q, k, v, f, beta)
    g = kda_gate(f, A_log, dt_bias, lower_bound=lower_bound)
    ro, rht = recurrent_kda_reference(l2norm(q), l2norm(k), v, g, beta, initial_state=h0,
                                      cu_seqlens=cu)
    assert len(calls) == 1 and calls[0]["interpret"] is True
    n = int(cu[-1])
    assert _rel(o[:, :n], ro[:, :n]) <= 1e-5 and _rel(ht, rht) <= 1e-5


def test_ops_routes_tpu_prefill_to_the_mosaic_kernel(monkeypatch):
    """pallas_kernels.ops.kda_chunk with the platform reported as TPU and kernels on: this kernel
    (interpreted on CPU), matching the reference mode's output."""
    from pallas_kernels import ops
    from pallas_kernels.kda import chunk_tpu
    B, T, H, K, V = 2, 70, 2, 128, 128
    q, k, v, g, beta = _inputs(31, B, T, H, K, V)
    h0 = jax.random.normal(jax.random.PRNGKey(7), (B, H, K, V))
    from pallas_kernels.backend import detect
    calls = []
    ro, rht = ops.kda_chunk(q, k, v, g, beta, initial_state=h0, backend=detect("reference"))
    real = chunk_tpu.chunk_kda_laid_out_tpu
    monkeypatch.setattr(chunk_tpu, "chunk_kda_laid_out_tpu",                     # a spy: count the calls
                        lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    tpu = detect("pallas", platform="tpu")
    o, ht = jax.jit(lambda *a: ops.kda_chunk(*a, initial_state=h0, backend=tpu),
                    compiler_options=_FAST_COMPILE)(q, k, v, g, beta)
    assert len(calls) == 1 and calls[0]["interpret"] is True
    assert _rel(o, ro) <= 1e-5 and _rel(ht, rht) <= 1e-5
