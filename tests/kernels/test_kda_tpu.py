"""KDA decode on TPU: the Mosaic kernel (pallas_kernels/kda/recurrent_tpu.py) run in Pallas
interpret mode on CPU against the jnp reference, the dispatch that routes TPU to it, and its
lowering through Pallas -> Mosaic (jax.export for platform "tpu"; Mosaic's own layout passes only
run on a chip, so that part stays unverified here)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from tests.support.kernel_steps import can_export_for_tpu
from pallas_kernels import ops
from pallas_kernels.backend import detect
from pallas_kernels.kda import fused_recurrent_kda
from pallas_kernels.kda import recurrent_tpu
from pallas_kernels.kda.recurrent_tpu import fused_recurrent_kda_tpu
from pallas_kernels.kda.reference import decode_reference, kda_gate, l2norm
from tests.support.tiers import slow_case

pytestmark = pytest.mark.interpret


def _case(seed, N, H, K, V, S, dtype=jnp.float32, n_pad=2):
    rng = np.random.default_rng(seed)
    x = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    idx = rng.permutation(S)[:N].astype(np.int32)
    idx[rng.permutation(N)[:n_pad]] = -1
    idx[0] = -1                                               # padding first in the grid ...
    if n_pad >= 2:
        idx[-1] = -3                                          # ... and last (any negative pads)
    q = jnp.asarray(l2norm(jnp.asarray(x(N, H, K))), dtype)
    k = jnp.asarray(l2norm(jnp.asarray(x(N, H, K))), dtype)
    v = jnp.asarray(x(N, H, V), dtype)
    g = jnp.asarray(-np.abs(x(N, H, K)) * 0.5, dtype)
    beta = jnp.asarray(1 / (1 + np.exp(-x(N, H))), dtype)
    pool = jnp.asarray(x(S, H, K, V))
    return q, k, v, g, beta, pool, jnp.asarray(idx)


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return np.sqrt(np.mean((a - b) ** 2)) / np.sqrt(np.mean(b ** 2))


def _check_pool(pool, new, ref_new, idx, tol):
    named = sorted({int(i) for i in np.asarray(idx) if i >= 0})
    other = [s for s in range(pool.shape[0]) if s not in named]
    assert other and np.array_equal(np.asarray(new)[other], np.asarray(pool)[other])   # bit-identical
    assert _rel(np.asarray(new)[named], np.asarray(ref_new)[named]) <= tol


@pytest.mark.parametrize("N,H,K,V,S,block_h,dtype,tol", [
    (7, 4, 128, 128, 12, 2, jnp.float32, 1e-5),      # K3's head size, 2 head blocks per sequence
    slow_case(5, 3, 64, 32, 9, 8, jnp.float32, 1e-5),   # small, odd head count (one block of 3)
    slow_case(6, 4, 128, 128, 10, 4, jnp.bfloat16, 5e-3),
])
def test_decode_matches_reference(N, H, K, V, S, block_h, dtype, tol):
    q, k, v, g, beta, pool, idx = _case(N * H, N, H, K, V, S, dtype)
    scale = K ** -0.5
    o, new = fused_recurrent_kda_tpu(q, k, v, g, beta, pool, idx, jnp.zeros((H,)), jnp.zeros((H, K)),
                                     scale=scale, block_h=block_h, interpret=True)
    ro, rnew = decode_reference(q, k, v, g, beta, pool, idx, scale=scale)
    assert o.shape == (N, H, V) and o.dtype == dtype and new.dtype == jnp.float32
    pad = np.asarray(idx) < 0
    assert not np.any(np.asarray(o, np.float32)[pad])                 # padding rows: output 0
    assert _rel(np.asarray(o, np.float32)[~pad], np.asarray(ro, np.float32)[~pad]) <= tol
    _check_pool(pool, new, rnew, idx, 1e-5)


@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_gate_and_l2norm_in_kernel(lower_bound):
    N, H, K, V, S = 5, 4, 128, 128, 8
    q, k, v, f, beta, pool, idx = _case(3, N, H, K, V, S)
    rng = np.random.default_rng(4)
    q, k = q * 3.0, k * 0.5                                           # l2norm has work to do
    A_log = jnp.asarray(rng.standard_normal(128) * 0.5, jnp.float32)  # K3 stores [128], first H used
    dt_bias = jnp.asarray(rng.standard_normal(H * K), jnp.float32)
    o, new = fused_recurrent_kda(q, k, v, f, beta, pool, idx, use_qk_l2norm_in_kernel=True,
                                 use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
                                 lower_bound=lower_bound, interpret=True, platform="tpu")
    g = kda_gate(f, A_log, dt_bias, lower_bound=lower_bound)
    ro, rnew = decode_reference(l2norm(q), l2norm(k), v, g, beta, pool, idx)
    assert _rel(o, ro) <= 1e-5
    _check_pool(pool, new, rnew, idx, 1e-5)


def test_tpu_interpreter_semaphores_and_races():
    """jax's TPU interpreter models the DMAs and semaphores (a wait without its copy hangs or
    raises; uninitialised VMEM reads come back NaN) and looks for races between the copies."""
    N, H, K, V, S = 4, 4, 128, 128, 6
    q, k, v, g, beta, pool, idx = _case(7, N, H, K, V, S, n_pad=1)
    params = pltpu.InterpretParams(detect_races=True)
    o, new = fused_recurrent_kda_tpu(q, k, v, g, beta, pool, idx, jnp.zeros((H,)), jnp.zeros((H, K)),
                                     scale=K ** -0.5, block_h=2, interpret=params)
    ro, rnew = decode_reference(q, k, v, g, beta, pool, idx)
    assert _rel(o, ro) <= 1e-5
    _check_pool(pool, new, rnew, idx, 1e-5)
    try:
        from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc
    except ImportError:                                               # private; moves between versions
        return
    races = getattr(ipc, "races", None)
    assert races is None or not races.races_found


def test_ops_routes_tpu_decode_to_the_mosaic_kernel(monkeypatch):
    N, H, K, V, S = 6, 4, 128, 128, 9
    q, k, v, g, beta, pool, idx = _case(11, N, H, K, V, S)
    ro, rnew = ops.kda_decode(q, k, v, g, beta, pool, idx, backend=detect("reference"))
    calls = []
    real = recurrent_tpu.fused_recurrent_kda_tpu
    monkeypatch.setattr(recurrent_tpu, "fused_recurrent_kda_tpu",              # a spy: count the calls
                        lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    tpu = functools.partial(ops.kda_decode, backend=detect("pallas", platform="tpu"))
    o, new = jax.jit(tpu, donate_argnums=5)(q, k, v, g, beta, pool + 0, idx)
    assert len(calls) == 1 and calls[0]["interpret"] is True
    assert _rel(o, ro) <= 1e-5
    _check_pool(pool, new, rnew, idx, 1e-5)


def test_rejects_a_pool_that_is_not_fp32():
    q, k, v, g, beta, pool, idx = _case(0, 3, 2, 128, 128, 4, n_pad=1)
    with pytest.raises(ValueError, match="float32"):
        fused_recurrent_kda_tpu(q, k, v, g, beta, pool.astype(jnp.bfloat16), idx, jnp.zeros((2,)),
                                jnp.zeros((2, 128)), scale=1.0, interpret=True)


@pytest.mark.parametrize("dtype,gate,lower_bound", [
    (jnp.bfloat16, True, -5.0), (jnp.float32, True, None), (jnp.bfloat16, False, None)])
def test_lowers_through_mosaic_for_tpu(dtype, gate, lower_bound):
    if not can_export_for_tpu():
        pytest.skip("this jax cannot export Pallas kernels for TPU")
    N, H, K, V, S = 64, 32, 128, 128, 80                              # K3 decode shapes
    sd = jax.ShapeDtypeStruct
    f = jax.jit(lambda *a: fused_recurrent_kda_tpu(*a, scale=K ** -0.5, l2norm=gate, gate=gate,
                                                   lower_bound=lower_bound), donate_argnums=5)
    exp = jax.export.export(f, platforms=["tpu"])(
        sd((N, H, K), dtype), sd((N, H, K), dtype), sd((N, H, V), dtype), sd((N, H, K), dtype),
        sd((N, H), dtype), sd((S, H, K, V), jnp.float32), sd((N,), jnp.int32), sd((H,), jnp.float32),
        sd((H, K), jnp.float32))
    text = exp.mlir_module()
    assert "tpu_custom_call" in text and "kda_decode_tpu" in text


@pytest.mark.slow                   # a whole engine step interpreted (CI's time budget); the kernels' own tests above run
def test_model_step_on_the_tpu_path_matches_reference(monkeypatch):
    """The model's steps (prefill, then fused decode) with ops routed as on a TPU: KDA prefill and
    decode, and MLA, on their Mosaic kernels (interpret mode here), MoE on megablox."""
    from tests.support.kernel_steps import two_step_logits
    from pallas_kernels.kda import chunk_tpu
    from pallas_kernels.mla import tpu_kernel

    calls = []
    for mod, name in ((recurrent_tpu, "fused_recurrent_kda_tpu"), (tpu_kernel, "ragged_paged_mla_tpu"),
                      (chunk_tpu, "chunk_kda_laid_out_tpu")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _r=real, _n=name, **kw: calls.append(_n) or _r(*a, **kw))
    out = {mode: two_step_logits(detect(mode, platform="tpu"))[0] for mode in ("reference", "pallas")}
    assert {"fused_recurrent_kda_tpu", "ragged_paged_mla_tpu", "chunk_kda_laid_out_tpu"} <= set(calls)
    for ref, ker in zip(out["reference"], out["pallas"]):
        assert np.abs(ref - ker).max() / np.abs(ref).max() < 5e-4
