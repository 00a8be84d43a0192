"""KDA Pallas kernels in interpret mode (CPU) vs the pure-jnp reference ops."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.kda import chunk_kda, fused_recurrent_kda, fused_recurrent_kda_positions
from pallas_kernels.kda.reference import (
    decode_reference, kda_gate, l2norm, recurrent_kda_reference)

from tests.support.tiers import slow_case

pytestmark = pytest.mark.interpret


# Interpret-mode kernels are big unrolled HLO: skip XLA's backend optimisations to keep this
# file's CPU time (mostly compile time) low. Only affects the functions jitted here.
_FAST_COMPILE = {"xla_backend_optimization_level": 0}


def _chunk(*args, **kw):
    return jax.jit(lambda *a: chunk_kda(*a, interpret=True, **kw),
                   compiler_options=_FAST_COMPILE)(*args)


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2)) / (np.sqrt(np.mean(b ** 2)) + 1e-30))


def _inputs(seed, B, T, H, K, V):
    """l2-normalised q/k, g in (-5, 0) from the safe gate, beta in (0, 1), fp32."""
    r = np.random.default_rng(seed)
    nrm = lambda x: x / np.sqrt((x ** 2).sum(-1, keepdims=True) + 1e-6)  # noqa: E731
    q = nrm(r.standard_normal((B, T, H, K)))
    k = nrm(r.standard_normal((B, T, H, K)))
    v = r.standard_normal((B, T, H, V))
    g = -5.0 / (1 + np.exp(-2 * r.standard_normal((B, T, H, K))))
    beta = 1 / (1 + np.exp(-r.standard_normal((B, T, H))))
    return [jnp.asarray(x, jnp.float32) for x in (q, k, v, g, beta)]


@pytest.mark.parametrize("B,T,H,K,V", [(2, 100, 3, 16, 32), (1, 1, 8, 16, 16), (1, 40, 1, 128, 128)])
def test_chunk_fp32_vs_reference(B, T, H, K, V):
    q, k, v, g, beta = _inputs(B * T + H, B, T, H, K, V)
    h0 = jax.random.normal(jax.random.PRNGKey(T), (B, H, K, V))
    o, S = _chunk(q, k, v, g, beta, initial_state=h0)
    o2, S2 = recurrent_kda_reference(q, k, v, g, beta, initial_state=h0)
    assert o.shape == (B, T, H, V) and S.shape == (B, H, K, V) and S.dtype == jnp.float32
    assert _rel(o, o2) < 1e-5 and _rel(S, S2) < 1e-5


def test_chunk_varlen_zero_length_and_padding():
    H, K, V = 2, 16, 16
    lens = [10, 0, 70, 1]
    T = sum(lens) + 7
    q, k, v, g, beta = _inputs(3, 1, T, H, K, V)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
    h0 = jax.random.normal(jax.random.PRNGKey(1), (len(lens), H, K, V))
    run = jax.jit(lambda *a, cu: chunk_kda(*a, initial_state=h0, cu_seqlens=cu, interpret=True),
                  compiler_options=_FAST_COMPILE)
    o, S = run(q, k, v, g, beta, cu=cu)
    o2, S2 = recurrent_kda_reference(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu)
    n = int(cu[-1])
    assert _rel(o[:, :n], o2[:, :n]) < 1e-5 and _rel(S, S2) < 1e-5
    np.testing.assert_array_equal(np.asarray(S[1]), np.asarray(h0[1]))  # zero-length sequence
    assert np.all(np.asarray(o[:, n:]) == 0)
    # same executable, other boundaries (cu_seqlens values are traced)
    cu_b = jnp.asarray([0, 40, 41, 41, 88], jnp.int32)
    o, S = run(q, k, v, g, beta, cu=cu_b)
    o2, S2 = recurrent_kda_reference(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu_b)
    assert _rel(o[:, :88], o2[:, :88]) < 1e-5 and _rel(S, S2) < 1e-5


@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_chunk_gate_and_l2norm_in_kernel(lower_bound):
    B, T, H, K, V = 1, 70, 8, 16, 16  # 70: padded chunk with the gate applied in the kernel
    r = np.random.default_rng(4)
    q, k, v, _, beta = _inputs(5, B, T, H, K, V)
    q, k = q * 3.0, k * 0.5  # not normalised: the op must do it
    f = jnp.asarray(r.standard_normal((B, T, H, K)), jnp.float32)
    A_log = jnp.asarray(np.concatenate([r.uniform(-1, 1, H), r.standard_normal(120)]), jnp.float32)
    dt = jnp.asarray(r.standard_normal(H * K) * 0.5, jnp.float32)
    o, S = _chunk(q, k, v, f, beta, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                  A_log=A_log, dt_bias=dt, lower_bound=lower_bound)
    g = kda_gate(f, A_log, dt, lower_bound=lower_bound)
    o2, S2 = recurrent_kda_reference(l2norm(q), l2norm(k), v, g, beta)
    assert _rel(o, o2) < 1e-5 and _rel(S, S2) < 1e-5


def test_chunk_bf16():
    B, T, H, K, V = 2, 90, 2, 16, 16
    q, k, v, g, beta = _inputs(6, B, T, H, K, V)
    bf = lambda x: x.astype(jnp.bfloat16)  # noqa: E731
    h0 = jax.random.normal(jax.random.PRNGKey(2), (B, H, K, V))
    o, S = _chunk(bf(q), bf(k), bf(v), g, bf(beta), initial_state=h0)
    assert o.dtype == jnp.bfloat16
    o2, S2 = recurrent_kda_reference(bf(q), bf(k), bf(v).astype(jnp.float32), g, bf(beta),
                                     initial_state=h0)
    assert _rel(o, o2) < 5e-3 and _rel(S, S2) < 5e-3


@pytest.mark.parametrize("gate", [None, "softplus", "lower_bound"])
def test_decode_pool_slots(gate):
    N, H, K, V, slots = 6, 4, 16, 32, 11
    r = np.random.default_rng(7)
    q, k, v, g, beta = (x[0] for x in _inputs(8, 1, N, H, K, V))
    pool = jnp.asarray(r.standard_normal((slots, H, K, V)), jnp.float32)
    idx = jnp.asarray([9, -1, 0, 4, 7, -3], jnp.int32)
    kw, g_ref, q_ref, k_ref = {}, g, q, k
    if gate is not None:
        lb = None if gate == "softplus" else -5.0
        g = jnp.asarray(r.standard_normal((N, H, K)), jnp.float32)
        A_log = jnp.asarray(r.uniform(-1, 1, (1, 1, H, 1)), jnp.float32)
        dt = jnp.asarray(r.standard_normal((H, K)), jnp.float32)
        kw = dict(use_gate_in_kernel=True, A_log=A_log, dt_bias=dt, lower_bound=lb,
                  use_qk_l2norm_in_kernel=True)
        q, k = q * 2.0, k * 0.3
        g_ref = kda_gate(g, A_log, dt, lower_bound=lb)
        q_ref, k_ref = l2norm(q), l2norm(k)
    before = np.asarray(pool).copy()
    o, P = jax.jit(lambda *a: fused_recurrent_kda(*a, interpret=True, **kw),
                   compiler_options=_FAST_COMPILE)(q, k, v, g, beta, pool, idx)
    o2, P2 = decode_reference(q_ref, k_ref, v, g_ref, beta, pool, idx)
    P = np.asarray(P)
    untouched = [1, 2, 3, 5, 6, 8, 10]
    np.testing.assert_array_equal(P[untouched], before[untouched])  # bit-identical
    assert _rel(o, o2) < 1e-5 and _rel(P[[9, 0, 4, 7]], np.asarray(P2)[[9, 0, 4, 7]]) < 1e-5
    assert np.all(np.asarray(o)[[1, 5]] == 0)
    # the new state continues the sequence exactly like one more recurrent step would
    S_seq = recurrent_kda_reference(q_ref[None, 3:4], k_ref[None, 3:4], v[None, 3:4],
                                    g_ref[None, 3:4], beta[None, 3:4],
                                    initial_state=jnp.asarray(before[4:5]))[1]
    assert _rel(P[4], S_seq[0]) < 1e-5


def test_decode_bf16_and_donated_jit():
    N, H, K, V = 4, 2, 32, 32
    q, k, v, g, beta = (x[0] for x in _inputs(9, 1, N, H, K, V))
    pool = jax.random.normal(jax.random.PRNGKey(3), (N + 2, H, K, V))
    idx = jnp.asarray([5, 0, 2, 3], jnp.int32)
    bf = lambda x: x.astype(jnp.bfloat16)  # noqa: E731
    o2, P2 = decode_reference(bf(q), bf(k), bf(v).astype(jnp.float32), g, bf(beta), pool, idx)
    before = np.asarray(pool).copy()
    step = jax.jit(lambda *a: fused_recurrent_kda(*a, interpret=True), donate_argnums=5,
                   compiler_options=_FAST_COMPILE)
    o, P = step(bf(q), bf(k), bf(v), g, bf(beta), pool, idx)
    assert o.dtype == jnp.bfloat16 and P.dtype == jnp.float32
    assert _rel(o, o2) < 5e-3 and _rel(P, P2) < 1e-5
    np.testing.assert_array_equal(np.asarray(P)[[1, 4]], before[[1, 4]])


def _positions_case(seed=11):
    """Three sequences of a verification step (W = 5): one runs every position, one a single token, one three
    with the middle state not kept; one padding row. Pool rows 20-23 are nobody's."""
    N, W, H, K, V, slots = 4, 5, 2, 16, 32, 24
    r = np.random.default_rng(seed)
    q, k, v, g, beta = (x.reshape((N, W) + x.shape[2:]) for x in _inputs(seed, 1, N * W, H, K, V))
    pool = jnp.asarray(r.standard_normal((slots, H, K, V)), jnp.float32)
    s0 = jnp.asarray(r.standard_normal((N, H, K, V)) * 0.3, jnp.float32)
    run = np.zeros((N, W), bool)
    run[0], run[1, :1], run[2, :3] = True, True, True
    dst = np.full((N, W), -1, np.int32)
    dst[0], dst[1, 0], dst[2, :3] = [3, 4, 5, 6, 7], 9, [11, -1, 13]
    return (q, k, v, g, beta, pool, s0, jnp.asarray(run), jnp.asarray(dst))


def test_decode_positions_kernel_is_the_decode_kernel_per_token():
    """The verification chunk's kernel (one launch for W tokens) against the decode kernel run W times on the
    state array: every output, kept state and last state bit for bit; unnamed pool rows untouched; and against
    the float64 recurrence."""
    q, k, v, g, beta, pool, s0, run, dst = _positions_case()
    before = np.asarray(pool).copy()
    o, last, P = jax.jit(lambda *a: fused_recurrent_kda_positions(*a, interpret=True),
                         compiler_options=_FAST_COMPILE)(q, k, v, g, beta, pool, s0, run, dst)
    rows = jnp.arange(q.shape[0], dtype=jnp.int32)
    states, P_steps = s0, pool
    step = jax.jit(lambda *a: fused_recurrent_kda(*a, interpret=True), compiler_options=_FAST_COMPILE)
    for t in range(q.shape[1]):
        o_t, states = step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], states, jnp.where(run[:, t], rows, -1))
        np.testing.assert_array_equal(np.asarray(o[:, t]), np.asarray(o_t))
        for n in range(q.shape[0]):
            if run[n, t] and dst[n, t] >= 0:
                np.testing.assert_array_equal(np.asarray(P[dst[n, t]]), np.asarray(states[n]))
                P_steps = P_steps.at[dst[n, t]].set(states[n])
    np.testing.assert_array_equal(np.asarray(last), np.asarray(states))
    np.testing.assert_array_equal(np.asarray(P), np.asarray(P_steps))
    untouched = [0, 1, 2, 8, 10, 12] + list(range(14, 24))
    np.testing.assert_array_equal(np.asarray(P)[untouched], before[untouched])
    np.testing.assert_array_equal(np.asarray(last[3]), np.asarray(s0[3]))     # nothing run: the initial state
    assert not np.asarray(o)[3].any() and not np.asarray(o)[1, 1:].any()
    # float64: sequence 2's three tokens from its initial state
    f64 = lambda x: np.asarray(x, np.float64)  # noqa: E731
    o64, s64 = recurrent_kda_reference(*(jnp.asarray(f64(x[2:3, :3])) for x in (q, k, v, g, beta)),
                                       initial_state=jnp.asarray(f64(s0[2:3])))
    assert _rel(o[2, :3], o64[0]) < 1e-5 and _rel(last[2], s64[0]) < 1e-5 and _rel(P[13], s64[0]) < 1e-5


def test_decode_positions_elsewhere_is_the_decode_op_per_token():
    """Targets without the positions kernel (the jnp reference, TPU) run the decode op W times: the same
    outputs, states and pool as the GPU kernel's interpret run, to fp32 rounding."""
    case = _positions_case(5)
    got = jax.jit(lambda *a: fused_recurrent_kda_positions(*a, interpret=True),
                  compiler_options=_FAST_COMPILE)(*case)
    for platform in ("cpu", "tpu"):
        ref = jax.jit(lambda *a: fused_recurrent_kda_positions(*a, interpret=platform == "tpu", platform=platform),
                      compiler_options=_FAST_COMPILE)(*case)
        for a, b in zip(got, ref):
            assert _rel(a, b) < 1e-5, platform


@pytest.mark.parametrize("cfg", [
    slow_case(dict(intra="fused", inter="fused", split=True, inv="loop", intra_prec="highest")),  # first version
    slow_case(dict(intra="fused", inter="two_pass", inv="power", intra_prec="bf16x3")),
    slow_case(dict(intra="fused", inter="two_pass", inv="loop", intra_prec="tf32", diag="reg")),
    # split intra with bf16 inverse / u (FLA's storage) and 16-wide K slices
    dict(intra="split", split_bk=16, wu_bk=16, t_dtype="sd", u_dtype="sd", inv="power",
         split_diag="loop"),
    # token-parallel diagonal blocks, 2 heads per program; A_qk stored in fp32 for bf16 inputs;
    # the four diagonal inverses in one row loop with rows loaded from the diag kernel's output
    slow_case(dict(intra="split", split_diag="quad", a_dtype="f32", inv="loop", solve_unroll=True,
                   wu_unroll=True, wu_bk=64)),
    # the solve's A_qk and A_kk accumulated in two passes over K (fewer live registers)
    dict(intra="split", solve_passes=2),
])
def test_chunk_kernel_variants(cfg, monkeypatch):
    """The other kernel configurations (CONFIG picks one by GPU timing) compute the same function:
    fused vs split intra stage, fused vs two-pass inter stage, row-loop vs Neumann-product inverse, dot precisions (CPU
    interpret mode computes every precision in fp32: the GPU precision check is in bench_kda)."""
    from pallas_kernels.kda import chunk_pallas as cp
    for k_, v_ in cfg.items():
        monkeypatch.setitem(cp.CONFIG, k_, v_)
    B, T, H, K, V = 1, 100, 2, 16, 32
    q, k, v, g, beta = _inputs(11, B, T, H, K, V)
    h0 = jax.random.normal(jax.random.PRNGKey(3), (B, H, K, V))
    o, S = _chunk(q, k, v, g, beta, initial_state=h0)
    o2, S2 = recurrent_kda_reference(q, k, v, g, beta, initial_state=h0)
    assert _rel(o, o2) < 1e-5 and _rel(S, S2) < 1e-5
    bf = lambda x: x.astype(jnp.bfloat16)  # noqa: E731
    o, S = _chunk(bf(q), bf(k), bf(v), g, bf(beta), initial_state=h0)
    o2, S2 = recurrent_kda_reference(bf(q), bf(k), bf(v).astype(jnp.float32), g, bf(beta),
                                     initial_state=h0)
    assert _rel(o, o2) < 5e-3 and _rel(S, S2) < 5e-3


@pytest.mark.parametrize("gate,passes", [slow_case("random", 1), ("strongest", 1), slow_case("none", 1),
                                         ("strongest", 2)])
def test_chunk_safe_gate_diagonal_in_solve(gate, passes, monkeypatch):
    """Safe gates (every log decay in [-5, 0], K3's): the split solve kernel computes the diagonal
    blocks itself from a shifted past anchor (no diag kernel). Extremes: every decay -5 (factors up
    to e^60 inside the dots) and no decay at all."""
    from pallas_kernels.kda import chunk_pallas as cp
    monkeypatch.setitem(cp.CONFIG, "intra", "split")
    monkeypatch.setitem(cp.CONFIG, "inv", "many")  # rows picked from registers on this path
    monkeypatch.setitem(cp.CONFIG, "safe_shift", 15.0)
    monkeypatch.setitem(cp.CONFIG, "solve_unroll", False)
    monkeypatch.setitem(cp.CONFIG, "solve_passes", passes)
    calls = []
    from pallas_kernels.kda import chunk_intra_split
    monkeypatch.setattr(chunk_intra_split, "intra_diag", lambda *a, **k: calls.append(1))  # not run
    B, T, H, K, V = 1, 77, 2, 32, 16
    q, k, v, g, beta = _inputs(21, B, T, H, K, V)
    if gate == "strongest":
        g = jnp.full_like(g, -5.0)
    elif gate == "none":
        g = jnp.zeros_like(g)
    h0 = jax.random.normal(jax.random.PRNGKey(4), (B, H, K, V))
    o, S = _chunk(q, k, v, g, beta, initial_state=h0, safe_gate=True)
    o2, S2 = recurrent_kda_reference(q, k, v, g, beta, initial_state=h0)
    assert not calls
    assert _rel(o, o2) < 1e-5 and _rel(S, S2) < 1e-5
    bf = lambda x: x.astype(jnp.bfloat16)  # noqa: E731
    o, S = _chunk(bf(q), bf(k), bf(v), g, bf(beta), initial_state=h0, safe_gate=True)
    o2, S2 = recurrent_kda_reference(bf(q), bf(k), bf(v).astype(jnp.float32), g, bf(beta),
                                     initial_state=h0)
    assert _rel(o, o2) < 5e-3 and _rel(S, S2) < 5e-3


@pytest.mark.parametrize("cfg", [
    dict(block_v=32, num_warps=4, order="nhv"),  # the first version's grid order
    dict(block_v=16, order="hvn", block_h=4, num_stages=2),  # 4 heads per program, H=6 -> 2
    slow_case(dict(block_v=32, order="vnh", block_h=2)),  # V fastest, then sequence; 2 heads per program
])
def test_decode_kernel_variants(cfg, monkeypatch):
    """Grid orders and heads per program (recurrent_pallas options) keep the pool semantics."""
    from pallas_kernels.kda import recurrent_pallas as rp
    for key, val in cfg.items():
        monkeypatch.setitem(rp.CONFIG, key, val)
    N, H, K, V, slots = 5, 6, 16, 32, 8
    q, k, v, g, beta = (x[0] for x in _inputs(31, 1, N, H, K, V))
    pool = jax.random.normal(jax.random.PRNGKey(5), (slots, H, K, V))
    idx = jnp.asarray([6, -1, 0, 3, 5], jnp.int32)
    before = np.asarray(pool).copy()
    o, P = jax.jit(lambda *a: fused_recurrent_kda(*a, interpret=True),
                   compiler_options=_FAST_COMPILE)(q, k, v, g, beta, pool, idx)
    o2, P2 = decode_reference(q, k, v, g, beta, pool, idx)
    P = np.asarray(P)
    np.testing.assert_array_equal(P[[1, 2, 4, 7]], before[[1, 2, 4, 7]])  # bit-identical
    assert _rel(o, o2) < 1e-5 and _rel(P, P2) < 1e-5
    assert np.all(np.asarray(o)[1] == 0)


def test_state_tiles_fill_one_wave_then_widen():
    """The state kernel's V block: narrowest whose programs fit one wave of SMs, else 128 wide
    (one program per SM fits; see chunk_pallas.state_tiles), never wider than V."""
    from pallas_kernels.kda.chunk_pallas import state_tiles
    assert state_tiles(32, 128, sms=132)[0] == 32      # 128 programs
    assert state_tiles(64, 128, sms=132)[0] == 64      # 256 programs at 32 wide: two waves
    assert state_tiles(512, 128, sms=132)[0] == 128    # many sequences: fewest programs
    assert state_tiles(512, 32, sms=132)[0] == 32      # capped at V


def test_state_tiles_follow_the_live_sequence_count(monkeypatch):
    """A padded sequence bucket picks the state kernel's tiles by the sequences that have tokens (a runtime
    switch): the same executable is exact for 1 live sequence (narrow V blocks) and for 3 (wide)."""
    from pallas_kernels.kda import chunk_pallas
    monkeypatch.setattr(chunk_pallas, "num_sms", lambda: 4)
    H, K, V, T = 2, 16, 64, 70
    assert len({chunk_pallas.state_tiles(n * H, V) for n in (1, 2, 3)}) == 3
    q, k, v, g, beta = _inputs(5, 1, T, H, K, V)
    h0 = jax.random.normal(jax.random.PRNGKey(2), (4, H, K, V))
    run = jax.jit(lambda *a, cu: chunk_kda(*a, initial_state=h0, cu_seqlens=cu, interpret=True),
                  compiler_options=_FAST_COMPILE)
    for cu in ([0, 70, 70, 70, 70], [0, 20, 21, 60, 60]):
        cu = jnp.asarray(cu, jnp.int32)
        o, S = run(q, k, v, g, beta, cu=cu)
        o2, S2 = recurrent_kda_reference(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu)
        n = int(cu[-1])
        assert _rel(o[:, :n], o2[:, :n]) < 1e-5 and _rel(S, S2) < 1e-5
