"""KDA pure-jnp reference ops vs flash-linear-attention's torch naive ops (CPU, fp64/fp32)."""
import importlib.util
import os
import re
import types

import jax
import numpy as np
import pytest

import jax.numpy as jnp  # noqa: E402

from pallas_kernels.kda.reference import (  # noqa: E402
    chunk_kda_reference, kda_gate, l2norm, recurrent_kda_reference)


@pytest.fixture(autouse=True, scope="module")
def _x64():
    """fp64 comparisons need x64; switch it on for this module only (other tests expect fp32)."""
    prev = bool(jax.config.jax_enable_x64)
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", prev)

torch = pytest.importorskip("torch")
pytest.importorskip("einops")


def _load_fla_naive(fp64):
    """FLA's naive.py by file path (never `import fla`: its package needs triton).

    The file computes in torch.float (fp32); the fp64 variant swaps that dtype in its source
    so the math can be compared at fp64 precision.
    """
    spec = importlib.util.find_spec("fla")
    if spec is None:
        pytest.skip("flash-linear-attention not installed", allow_module_level=True)
    path = os.path.join(list(spec.submodule_search_locations)[0], "ops", "kda", "naive.py")
    src = open(path).read()
    if fp64:
        src = re.sub(r"torch\.float\b", "torch.float64", src)
        assert "torch.float64" in src
    mod = types.ModuleType("_fla_kda_naive64" if fp64 else "_fla_kda_naive")
    exec(compile(src, path, "exec"), mod.__dict__)
    return mod


FLA = _load_fla_naive(fp64=True)
FLA32 = _load_fla_naive(fp64=False)


def _inputs(rng, B, T, H, K, V, dtype=np.float64, lb=True):
    """Realistic inputs: l2-normalised q/k, g in (-5, 0) from a gate formula, beta in (0, 1)."""
    q = rng.standard_normal((B, T, H, K))
    k = rng.standard_normal((B, T, H, K))
    q /= np.sqrt((q ** 2).sum(-1, keepdims=True) + 1e-6)
    k /= np.sqrt((k ** 2).sum(-1, keepdims=True) + 1e-6)
    v = rng.standard_normal((B, T, H, V))
    f = rng.standard_normal((B, T, H, K)) * 2
    A = rng.uniform(-1, 1, H)
    if lb:
        g = -5.0 / (1 + np.exp(-np.exp(A)[:, None] * f))
    else:
        g = np.maximum(-np.exp(A)[:, None] * np.log1p(np.exp(f - 2)), -5.0)
    beta = 1 / (1 + np.exp(-rng.standard_normal((B, T, H))))
    return [x.astype(dtype) for x in (q, k, v, g, beta)]


def _fla(fn, q, k, v, g, beta, h0=None, scale=None):
    t = [torch.from_numpy(np.asarray(x, np.float64)) for x in (q, k, v, g, beta)]
    h = None if h0 is None else torch.from_numpy(np.asarray(h0, np.float64))
    o, S = fn(*t, scale=scale, initial_state=h, output_final_state=True)
    return o.numpy(), S.numpy()


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.sqrt(np.mean((a - b) ** 2)) / (np.sqrt(np.mean(b ** 2)) + 1e-30)


@pytest.mark.parametrize("B,T,H,K,V", [(2, 37, 2, 16, 8), (1, 1, 1, 8, 8), (1, 100, 4, 16, 32),
                                       (3, 65, 3, 8, 16)])
@pytest.mark.parametrize("with_h0", [False, True])
def test_recurrent_and_chunk_vs_fla_fp64(B, T, H, K, V, with_h0):
    rng = np.random.default_rng(T * 10 + H + with_h0)
    q, k, v, g, beta = _inputs(rng, B, T, H, K, V, lb=(H % 2 == 0))
    h0 = rng.standard_normal((B, H, K, V)) if with_h0 else None
    o_ref, S_ref = _fla(FLA.naive_recurrent_kda, q, k, v, g, beta, h0)
    o, S = recurrent_kda_reference(*map(jnp.asarray, (q, k, v, g, beta)), initial_state=h0)
    assert o.dtype == jnp.float64
    assert _rel(o, o_ref) < 1e-12 and _rel(S, S_ref) < 1e-12
    for C in (16, 64):
        o2, S2 = chunk_kda_reference(*map(jnp.asarray, (q, k, v, g, beta)), initial_state=h0,
                                     chunk_size=C)
        assert _rel(o2, o_ref) < 1e-10 and _rel(S2, S_ref) < 1e-10


@pytest.mark.parametrize("with_h0", [False, True])
def test_chunk_vs_fla_naive_chunk_fp32(with_h0):
    B, T, H, K, V = 2, 128, 2, 32, 16
    rng = np.random.default_rng(7)
    q, k, v, g, beta = _inputs(rng, B, T, H, K, V, dtype=np.float32)
    h0 = rng.standard_normal((B, H, K, V)).astype(np.float32) if with_h0 else None
    o_ref, S_ref = _fla(FLA32.naive_chunk_kda, q, k, v, g, beta, h0, scale=0.3)
    o, S = chunk_kda_reference(*map(jnp.asarray, (q, k, v, g, beta)), initial_state=h0, scale=0.3)
    assert o.dtype == jnp.float32 and S.dtype == jnp.float32
    assert _rel(o, o_ref) < 1e-5 and _rel(S, S_ref) < 1e-5
    o1, S1 = recurrent_kda_reference(*map(jnp.asarray, (q, k, v, g, beta)), initial_state=h0,
                                     scale=0.3)
    assert _rel(o1, o_ref) < 1e-5 and _rel(S1, S_ref) < 1e-5


def test_bf16_output_dtype_and_accuracy():
    rng = np.random.default_rng(3)
    q, k, v, g, beta = _inputs(rng, 1, 50, 2, 16, 16)
    o_ref, S_ref = _fla(FLA.naive_recurrent_kda, q, k, v, g, beta)
    args = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)] + [jnp.asarray(g, jnp.float32),
                                                                 jnp.asarray(beta, jnp.bfloat16)]
    o, S = chunk_kda_reference(*args, chunk_size=16)
    assert o.dtype == jnp.bfloat16 and S.dtype == jnp.float32
    assert _rel(o, o_ref) < 2e-2 and _rel(S, S_ref) < 2e-2


@pytest.mark.parametrize("fn", ["recurrent", "chunk"])
def test_varlen_vs_separate_sequences(fn):
    """cu_seqlens with a zero-length sequence and a padding tail == each sequence run alone."""
    H, K, V = 2, 16, 8
    lens = [5, 0, 70, 1, 20]
    T = sum(lens) + 9  # 9 padding tokens
    rng = np.random.default_rng(11)
    q, k, v, g, beta = _inputs(rng, 1, T, H, K, V)
    N = len(lens)
    h0 = rng.standard_normal((N, H, K, V))
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    if fn == "recurrent":
        run = jax.jit(recurrent_kda_reference)
    else:
        run = jax.jit(lambda *a, **kw: chunk_kda_reference(*a, chunk_size=16, **kw))
    o, S = run(*map(jnp.asarray, (q, k, v, g, beta)), initial_state=jnp.asarray(h0),
               cu_seqlens=jnp.asarray(cu))
    o, S = np.asarray(o), np.asarray(S)
    for i in range(N):
        a, b = cu[i], cu[i + 1]
        if a == b:
            np.testing.assert_array_equal(S[i], h0[i])  # zero-length: state untouched
            continue
        sl = [x[:, a:b] for x in (q, k, v, g, beta)]
        o_ref, S_ref = _fla(FLA.naive_recurrent_kda, *sl, h0[i:i + 1])
        assert _rel(o[:, a:b], o_ref) < 1e-10 and _rel(S[i], S_ref[0]) < 1e-10
    assert np.all(o[:, cu[-1]:] == 0)


def test_varlen_values_are_traced():
    """Same compiled function, different cu_seqlens values -> different (correct) answers."""
    H, K, V, T = 1, 8, 8, 40
    rng = np.random.default_rng(5)
    q, k, v, g, beta = map(jnp.asarray, _inputs(rng, 1, T, H, K, V))
    run = jax.jit(lambda cu: chunk_kda_reference(q, k, v, g, beta, cu_seqlens=cu, chunk_size=16))
    for cu in ([0, 13, 40], [0, 33, 35]):
        o, S = run(jnp.asarray(cu, jnp.int32))
        o2, S2 = recurrent_kda_reference(q, k, v, g, beta, cu_seqlens=jnp.asarray(cu, jnp.int32))
        assert _rel(o, o2) < 1e-10 and _rel(S, S2) < 1e-10
    assert run._cache_size() == 1


def test_l2norm():
    x = np.random.default_rng(0).standard_normal((3, 4, 16)).astype(np.float32)
    y = l2norm(jnp.asarray(x, jnp.bfloat16))
    assert y.dtype == jnp.float32
    ref = x / np.sqrt((x ** 2).sum(-1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(np.asarray(l2norm(jnp.asarray(x))), ref, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("layout", ["h", "11h1", "padded"])
@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_kda_gate(layout, lower_bound):
    H, K = 3, 8
    rng = np.random.default_rng(1)
    f = (rng.standard_normal((2, 5, H, K)) * 8).astype(np.float32)
    f[0, 0, 0, :2] = [30.0, -30.0]  # exercise the softplus linear branch
    A = rng.uniform(-1, 1, H).astype(np.float32)
    dt = rng.standard_normal(H * K).astype(np.float32)
    A_in = {"h": A, "11h1": A.reshape(1, 1, H, 1),
            "padded": np.concatenate([A, rng.standard_normal(125).astype(np.float32)])}[layout]
    x = f.astype(np.float64) + dt.reshape(H, K)
    a = np.exp(A.astype(np.float64))[:, None]
    if lower_bound is None:
        ref = -a * np.logaddexp(0.0, x)
    else:
        ref = lower_bound / (1 + np.exp(-a * x))
    out = kda_gate(jnp.asarray(f), jnp.asarray(A_in), jnp.asarray(dt), lower_bound=lower_bound)
    assert out.dtype == jnp.float32 and out.shape == f.shape
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-6)
    out2 = kda_gate(jnp.asarray(f), jnp.asarray(A_in), jnp.asarray(dt.reshape(H, K)),
                    lower_bound=lower_bound)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(out2))
