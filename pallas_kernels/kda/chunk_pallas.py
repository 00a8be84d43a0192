"""Chunked KDA prefill as Pallas kernels (written for the Triton backend, run in interpret mode on CPU).

Stages (as in flash-linear-attention's chunk_kda):
  0. XLA prologue (see ops.py): optional l2norm, sequences laid out so each starts on a chunk
     boundary; padding rows carry k = v = beta = 0 and get g = 0 (no state effect).
     `_cumsum_kernel`: optional gate + chunk-local cumsum of the log decay (log2 units).
  1. `_intra_kernel`, parallel over (chunk, head): intra-chunk matrices in 16-row sub-blocks,
     off-diagonal blocks by matmul against a per-block reference decay (all exponents <= 0),
     diagonal blocks exactly, token by token. Block forward substitution gives
     T = (I + StrictTril(diag(beta) A_kk))^-1, then w = T diag(beta) (exp(gc) k), u = T diag(beta) v.
     Also writes qg = q exp(gc), kd = k exp(g_last - gc) and the causal A_qk.
     Default (CONFIG intra="split"): the same stage as three smaller kernels, FLA's structure
     (`intra_diag`, `intra_solve`, `intra_wu` in chunk_intra_split.py).
  2. `_inter_kernel`, parallel over (sequence, head, V block), sequential over chunks: state
     recurrence fused with the output:  v' = u - w S;  o = qg S + A_qk v';  S = exp(g_last) S + kd^T v'.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.device_info import num_sms
from pallas_kernels.kda.chunk_common import (
    _F32, _LOG2E, _PREC, _chunk_count, _diag_column, _dot, _dot_nt, _dot_tn, _exp, _real_chunks_only, _tp,
    _unit_tril_inv, _unit_tril_inv_power)
from pallas_kernels.kda.chunk_intra_split import (  # noqa: F401 - re-exported for benchmarks
    chunk_intra_split, intra_diag, intra_solve, intra_wu)


def _intra_kernel(q_ref, k_ref, v_ref, g_ref, b_ref, w_ref, u_ref, qg_ref, kd_ref, a_ref, *, bc,
                  diag, prec="highest", inv="loop"):
    """One (chunk, head). Refs: q, k, g [C, K]; v [C, V]; beta [C]; outputs w, qg, kd [C, K],
    u [C, V], a (A_qk) [C, C]. g is the chunk-local cumulative log decay (fp32, log2 units).

    diag: how the 16x16 diagonal blocks get exp(gc_i - gc_j): "loop" / "reg" column by column,
    exact for any g (rows loaded from the refs / picked from registers); "mid": one matmul,
    valid only when every g >= -5.
    prec: precision of the fp32-operand dots (see _PREC); inv: "loop" (row substitution) or
    "power" (Neumann product) for the 16x16 diagonal inverses."""
    pr = _PREC[prec]
    C, K = q_ref.shape
    nc = C // bc
    row = lax.broadcasted_iota(jnp.int32, (bc, bc), 0)
    col = lax.broadcasted_iota(jnp.int32, (bc, bc), 1)
    row_k = lax.broadcasted_iota(jnp.int32, (bc, K), 0)
    zero = jnp.zeros((bc, bc), _F32)
    glast = g_ref[C - 1, :]

    def blk(ref, i):
        return ref[pl.ds(i * bc, bc), :].astype(_F32)

    L, Aq = {}, {}
    for I in range(nc):
        qI, kI, gI = blk(q_ref, I), blk(k_ref, I), blk(g_ref, I)
        bI = b_ref[pl.ds(I * bc, bc)].astype(_F32)
        gn = g_ref[I * bc, :]  # reference decay: first row of block I
        eI = jnp.exp2(gI - gn[None, :])  # <= 1
        kgI, qgI = kI * eI, qI * eI
        for J in range(I):
            kgJ = blk(k_ref, J) * jnp.exp2(gn[None, :] - blk(g_ref, J))  # <= 1
            L[I, J] = _dot_nt(kgI, kgJ, pr) * bI[:, None]
            Aq[I, J] = _dot_nt(qgI, kgJ, pr)

        if diag == "mid":
            # caller guarantees g >= -5 (safe gate): anchor at the block's middle row; every
            # factor is <= exp(8 * 5), every product (even masked ones) <= exp(15 * 5): no overflow.
            gm = g_ref[I * bc + bc // 2, :]
            kb = kI * jnp.exp2(gm[None, :] - gI)
            ea = jnp.exp2(gI - gm[None, :])
            akk = jnp.where(row > col, _dot_nt(kI * ea, kb, pr), 0.0)
            aqk = jnp.where(row >= col, _dot_nt(qI * ea, kb, pr), 0.0)
        else:
            def diag_col(j, carry, I=I, qI=qI, kI=kI, gI=gI):
                akk, aqk = carry
                if diag == "reg":  # row j taken from registers (no dependent load in the loop)
                    sel = row_k == j
                    kj = jnp.sum(jnp.where(sel, kI, 0.0), axis=0)
                    gj = jnp.sum(jnp.where(sel, gI, 0.0), axis=0)
                else:
                    kj = k_ref[I * bc + j, :].astype(_F32)
                    gj = g_ref[I * bc + j, :]
                return _diag_column(j, kj, gj, qI, kI, gI, row, col, row_k, akk, aqk)

            akk, aqk = lax.fori_loop(0, bc, diag_col, (zero, zero))
        L[I, I] = akk * bI[:, None]
        Aq[I, I] = aqk
        qg_ref[pl.ds(I * bc, bc), :] = (qI * jnp.exp2(gI)).astype(qg_ref.dtype)
        kd_ref[pl.ds(I * bc, bc), :] = (kI * jnp.exp2(glast[None, :] - gI)).astype(kd_ref.dtype)
        for J in range(nc):
            a_ref[pl.ds(I * bc, bc), pl.ds(J * bc, bc)] = (Aq[I, J] if J <= I else zero).astype(a_ref.dtype)

    # Block forward substitution: T_II = (I + L_II)^-1, T_IJ = -T_II sum_{J<=M<I} L_IM T_MJ.
    T = {}
    for I in range(nc):
        T[I, I] = (_unit_tril_inv_power(L[I, I], row, col, pr) if inv == "power"
                   else _unit_tril_inv(L[I, I], row, col))
        for J in range(I):
            acc = _dot(L[I, J], T[J, J], pr)
            for M in range(J + 1, I):
                acc = acc + _dot(L[I, M], T[M, J], pr)
            T[I, J] = -_dot(T[I, I], acc, pr)

    for I in range(nc):
        w = u = None
        for J in range(I + 1):
            bJ = b_ref[pl.ds(J * bc, bc)].astype(_F32)[:, None]
            rk = blk(k_ref, J) * jnp.exp2(blk(g_ref, J)) * bJ
            rv = blk(v_ref, J) * bJ
            dw, du = _dot(T[I, J], rk, pr), _dot(T[I, J], rv, pr)
            w = dw if w is None else w + dw
            u = du if u is None else u + du
        w_ref[pl.ds(I * bc, bc), :] = w.astype(w_ref.dtype)
        u_ref[pl.ds(I * bc, bc), :] = u.astype(u_ref.dtype)


def _cumsum_kernel(g_ref, m_ref, a_ref, dt_ref, o_ref, *, gate, lower_bound):
    """Chunk-local cumulative log decay of one (chunk, head) [C, K], optionally applying the
    KDA gate to the raw f first (a_log [H] full ref, dt_bias [K]). m [C]: 1 for real tokens,
    0 for layout padding (which must not decay anything)."""
    g = g_ref[...].astype(_F32)
    if gate:
        x = g + dt_ref[...].astype(_F32)[None, :]
        a = _exp(a_ref[pl.program_id(1)].astype(_F32))
        if lower_bound is None:
            g = -a * jnp.where(x > 20.0, x, jnp.log1p(_exp(jnp.minimum(x, 20.0))))
        else:
            g = lower_bound * jax.nn.sigmoid(a * x)
    # log2 units: every consumer takes exp2 of g differences (one MUFU.EX2, no scaling multiply)
    o_ref[...] = jnp.cumsum(g * (m_ref[...] * _LOG2E)[:, None], axis=0)


def _inter_kernel(cs_ref, w_ref, u_ref, qg_ref, kd_ref, a_ref, g_ref, h0_ref, o_ref, ht_ref, *, C,
                  split):
    """One (sequence n, head, V block): loop over the sequence's chunks cs[n] .. cs[n+1].

    Row refs are [R, K | BV | C] over all laid-out rows; h0 / ht are [K, BV] fp32. With bf16 inputs
    the dots run in bf16 like FLA; `split` feeds S and v' as two bf16 halves for ~fp32 accuracy."""
    n = pl.program_id(0)
    sd = w_ref.dtype  # dot operand dtype (bf16 for bf16 inputs, like FLA; fp32 for fp32)

    def parts(x):  # fp32 x as dot operands: [x] or, with `split`, [hi, lo] in sd (bf16x2 accuracy)
        if sd == _F32:
            return [x]
        hi = x.astype(sd)
        return [hi, (x - hi.astype(_F32)).astype(sd)] if split else [hi]

    def mm(dot, a, b):
        return sum(dot(a, p) for p in parts(b))

    def body(c, S):
        r0 = pl.multiple_of(c * C, C)
        r = pl.ds(r0, C)
        vnew = u_ref[r, :].astype(_F32) - mm(_dot, w_ref[r, :], S)
        A = a_ref[r, :]
        av = _dot(A, vnew) if split else mm(_dot, A.astype(sd), vnew)
        o = mm(_dot, qg_ref[r, :], S) + av
        o_ref[r, :] = o.astype(o_ref.dtype)
        glast = g_ref[r0 + C - 1, :]
        return S * jnp.exp2(glast)[:, None] + mm(_dot_tn, kd_ref[r, :], vnew)

    S = lax.fori_loop(cs_ref[n], cs_ref[n + 1], body, h0_ref[...].astype(_F32))
    ht_ref[...] = S


def _state_kernel(cs_ref, w_ref, u_ref, kd_ref, g_ref, h0_ref, h_ref, vn_ref, ht_ref, *, C):
    """Two-pass stage 2a, one (sequence n, head, V block): only the state recurrence sits in the
    sequential loop (2 dots per chunk, as FLA's chunk_gated_delta_rule_fwd_h). Writes the state
    entering each chunk, h [chunk, K, BV] in the dot dtype, and v' = u - w S in the dot dtype;
    the output is left to the parallel `_out_kernel`."""
    n = pl.program_id(0)
    sd = w_ref.dtype

    def body(c, S):
        r0 = pl.multiple_of(c * C, C)
        r = pl.ds(r0, C)
        h_ref[c, :, :] = S.astype(h_ref.dtype)
        vnew = u_ref[r, :].astype(_F32) - _dot(w_ref[r, :], S.astype(sd))
        vq = vnew.astype(sd)
        vn_ref[r, :] = vq.astype(vn_ref.dtype)
        glast = g_ref[r0 + C - 1, :]
        return S * jnp.exp2(glast)[:, None] + _dot_tn(kd_ref[r, :], vq)

    S = lax.fori_loop(cs_ref[n], cs_ref[n + 1], body, h0_ref[...].astype(_F32))
    ht_ref[...] = S


def _out_kernel(qg_ref, h_ref, a_ref, vn_ref, o_ref):
    """Two-pass stage 2b, one (chunk, head): o = qg h_c + A_qk v' (parallel over chunks)."""
    sd = qg_ref.dtype
    o = _dot(qg_ref[...], h_ref[...]) + _dot(a_ref[...].astype(sd), vn_ref[...])
    o_ref[...] = o.astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("chunk_size", "gate", "lower_bound", "interpret",
                                             "backend"))
def chunk_cumsum(g, mask, a_log, dt_bias, *, chunk_size=64, gate=False, lower_bound=None,
                 interpret=False, backend="triton", n_chunks=None):
    """g [R, H, K] (raw f when gate) -> chunk-local cumsum of the log decay [R, H, K] fp32, in log2
    units (times log2 e: the kernels below take exp2 of it).
    mask [R] fp32 (0 on layout padding rows), a_log [H] fp32, dt_bias [H, K] fp32 (gate only)."""
    R, H, K = g.shape
    C = chunk_size
    spec = pl.BlockSpec((C, None, K), lambda c, h: (c, h, 0))
    return pl.pallas_call(
        _real_chunks_only(functools.partial(_cumsum_kernel, gate=gate, lower_bound=lower_bound), interpret=interpret),
        grid=(R // C, H),
        in_specs=[pl.no_block_spec, spec, pl.BlockSpec((C,), lambda c, h: (c,)), pl.no_block_spec,
                  pl.BlockSpec((None, K), lambda c, h: (h, 0))],
        out_specs=spec,
        out_shape=jax.ShapeDtypeStruct((R, H, K), _F32),
        interpret=interpret, name="kda_chunk_cumsum", **_tp(backend, 4, 1),
    )(_chunk_count(n_chunks, R, C), g, mask, a_log, dt_bias)


@functools.partial(jax.jit, static_argnames=("chunk_size", "bc", "diag", "num_warps", "prec", "inv",
                                             "interpret", "backend"))
def chunk_intra(q, k, v, g, beta, *, chunk_size=64, bc=16, diag="loop", num_warps=4,
                prec="highest", inv="loop", interpret=False, backend="triton"):
    """Stage 1, parallel over (chunk, head). q (scaled), k [R, H, K] (dot dtype), v [R, H, V],
    g [R, H, K] fp32 chunk-local cumsum, beta [R, H] fp32.
    Returns w, qg, kd [R, H, K] (dot dtype), u [R, H, V] fp32, A_qk [R, H, C] fp32."""
    R, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    sd = q.dtype
    row_spec = lambda D: pl.BlockSpec((C, None, D), lambda c, h: (c, h, 0))  # noqa: E731
    w, u, qg, kd, a = pl.pallas_call(
        functools.partial(_intra_kernel, bc=bc, diag=diag, prec=prec, inv=inv),
        grid=(R // C, H),
        in_specs=[row_spec(K), row_spec(K), row_spec(V), row_spec(K),
                  pl.BlockSpec((C, None), lambda c, h: (c, h))],
        out_specs=[row_spec(K), row_spec(V), row_spec(K), row_spec(K), row_spec(C)],
        out_shape=[jax.ShapeDtypeStruct((R, H, K), sd), jax.ShapeDtypeStruct((R, H, V), _F32),
                   jax.ShapeDtypeStruct((R, H, K), sd), jax.ShapeDtypeStruct((R, H, K), sd),
                   jax.ShapeDtypeStruct((R, H, C), _F32)],
        interpret=interpret, name="kda_chunk_intra", **_tp(backend, num_warps, 1),
    )(q, k, v, g, beta)
    return w, qg, kd, u, a


@functools.partial(jax.jit, static_argnames=("chunk_size", "block_v", "num_warps", "split",
                                             "out_dtype", "interpret", "backend"))
def chunk_inter(w, qg, kd, u, a, g, cs, h0, *, chunk_size=64, block_v=32, num_warps=4, split=True,
                out_dtype=None, interpret=False, backend="triton"):
    """Stage 2, parallel over (sequence, head, V block), sequential over the sequence's chunks
    cs[n] .. cs[n+1] (cs int32 [N+1]). h0 [N, H, K, V] fp32.
    Returns o [R, H, V] (rows of unused chunks undefined) and ht [N, H, K, V] fp32."""
    R, H, K = w.shape
    V = u.shape[-1]
    C = chunk_size
    N = h0.shape[0]
    BV = min(block_v, V)
    full = lambda D, bv=False: pl.BlockSpec(  # noqa: E731
        (R, None, D), (lambda n, h, j: (0, h, j)) if bv else (lambda n, h, j: (0, h, 0)))
    st_spec = pl.BlockSpec((None, None, K, BV), lambda n, h, j: (n, h, 0, j))
    return pl.pallas_call(
        functools.partial(_inter_kernel, C=C, split=split),
        grid=(N, H, V // BV),
        in_specs=[pl.no_block_spec, full(K), full(BV, True), full(K), full(K), full(C), full(K),
                  st_spec],
        out_specs=[full(BV, True), st_spec],
        out_shape=[jax.ShapeDtypeStruct((R, H, V), out_dtype or w.dtype),
                   jax.ShapeDtypeStruct((N, H, K, V), _F32)],
        interpret=interpret, name="kda_chunk_inter", **_tp(backend, num_warps, 2),
    )(cs, w, u, qg, kd, a, g, h0)


@functools.partial(jax.jit, static_argnames=("chunk_size", "block_v", "num_warps", "num_stages",
                                             "interpret", "backend"))
def chunk_state(w, kd, u, g, cs, h0, *, chunk_size=64, block_v=32, num_warps=4, num_stages=2,
                interpret=False, backend="triton"):
    """Two-pass stage 2a, parallel over (sequence, head, V block), sequential over chunks.
    Returns h [R/C, H, K, V] (state entering each chunk, dot dtype; chunks no sequence owns are
    left unwritten), v' [R, H, V] (dot dtype) and ht [N, H, K, V] fp32."""
    R, H, K = w.shape
    V = u.shape[-1]
    C = chunk_size
    N = h0.shape[0]
    BV = min(block_v, V)
    sd = w.dtype
    full = lambda D, bv=False: pl.BlockSpec(  # noqa: E731
        (R, None, D), (lambda n, h, j: (0, h, j)) if bv else (lambda n, h, j: (0, h, 0)))
    st_spec = pl.BlockSpec((None, None, K, BV), lambda n, h, j: (n, h, 0, j))
    return pl.pallas_call(
        functools.partial(_state_kernel, C=C),
        grid=(N, H, V // BV),
        in_specs=[pl.no_block_spec, full(K), full(BV, True), full(K), full(K), st_spec],
        out_specs=[pl.BlockSpec((R // C, None, K, BV), lambda n, h, j: (0, h, 0, j)),
                   full(BV, True), st_spec],
        out_shape=[jax.ShapeDtypeStruct((R // C, H, K, V), sd),
                   jax.ShapeDtypeStruct((R, H, V), sd),
                   jax.ShapeDtypeStruct((N, H, K, V), _F32)],
        interpret=interpret, name="kda_chunk_state", **_tp(backend, num_warps, num_stages),
    )(cs, w, u, kd, g, h0)


@functools.partial(jax.jit, static_argnames=("chunk_size", "num_warps", "out_dtype", "interpret",
                                             "backend"))
def chunk_out(qg, h, a, vn, *, chunk_size=64, num_warps=4, out_dtype=None, interpret=False,
              backend="triton", n_chunks=None):
    """Two-pass stage 2b, parallel over (chunk, head): o [R, H, V] = qg h_c + A_qk v'."""
    R, H, K = qg.shape
    V = vn.shape[-1]
    C = chunk_size
    row_spec = lambda D: pl.BlockSpec((C, None, D), lambda c, hh: (c, hh, 0))  # noqa: E731
    return pl.pallas_call(
        _real_chunks_only(_out_kernel, interpret=interpret),
        grid=(R // C, H),
        in_specs=[pl.no_block_spec, row_spec(K), pl.BlockSpec((None, None, K, V), lambda c, hh: (c, hh, 0, 0)),
                  row_spec(C), row_spec(V)],
        out_specs=row_spec(V),
        out_shape=jax.ShapeDtypeStruct((R, H, V), out_dtype or vn.dtype),
        interpret=interpret, name="kda_chunk_out", **_tp(backend, num_warps, 1),
    )(_chunk_count(n_chunks, R, C), qg, h, a, vn)


# Kernel choices for chunk_kda (docs/performance.md, "Tuning of record", has the measurements).
# inter: "fused" = one sequential kernel doing state and output (split: fp32-like dots through
# bf16 hi/lo halves); "two_pass" = chunk_state (2 dots per chunk in the sequential loop, FLA's
# structure and precision) + the parallel chunk_out: ~3x faster.
# intra: "split" = chunk_intra_split (diag / solve / wu kernels, FLA's structure; split_bk / wu_bk
# the K-slice widths of solve / wu, split_warps and split_stages per kernel, split_diag the diagonal
# method, t_dtype / u_dtype "f32" or "sd" (bf16) for bf16 inputs); "fused" = the one-kernel
# chunk_intra (diag, intra_warps). tf32 dots with the Neumann-product inverse: 1.5x faster than IEEE
# fp32 at the same error against the fp32 reference.
# The diagonal is token-parallel ("token"); the solve's K-slice loop is a fori_loop (unrolled, it
# stalled on instruction fetch); gates live in log2 units so every kernel takes one exp2 (Pallas'
# Triton lowering sends fp32 jnp.exp to libdevice's accurate expf); t/u are stored in bf16 (FLA's
# storage: rel RMS 3.7e-3 against the 5e-3 bound). safe_shift (the diagonal inside the solve for
# safe gates) measured slower, so it is off.
CONFIG = dict(intra="split", split_bk=32, wu_bk=32, split_warps=(1, 1, 2), split_stages=(1, 2, 3),
              split_diag="token", diag_bh=2, safe_shift=None, solve_unroll=False, solve_passes=1,
              wu_unroll=False,
              t_dtype="sd", u_dtype="sd", a_dtype="sd",
              diag="loop", intra_warps=4, intra_prec="tf32", inv="many", block_v="auto",
              inter_warps=4, split=True, inter="two_pass", state_stages=3, out_warps=4)


def state_tiles(n_seq_heads, V, sms=None):
    """(block_v, num_warps, num_stages) of the state kernel for n_seq_heads (sequence, head) pairs.
    One program per SM fits (shared memory), so the narrowest V block whose programs fit in one
    wave, else the widest (docs/performance.md, "Tuning of record")."""
    sms = sms or num_sms()
    for bv, nw, ns in ((32, 4, 3), (64, 8, 3)):
        if n_seq_heads * -(-V // bv) <= sms:
            return min(bv, V), nw, ns
    return min(128, V), 8, 2


def _state_for_live_sequences(w, kd, u, g, cs, h0, **kw):
    """chunk_state with the tiles state_tiles picks for the sequences that have tokens, not the padded
    count: an engine step of 2 prompts in a 16-sequence bucket would otherwise run 128-wide V blocks on
    64 of the SMs (1.9x the time of the exact count). The choice is a runtime switch between the
    (at most three) distinct tilings."""
    N, H = h0.shape[:2]
    V = u.shape[-1]
    per_count = [state_tiles(max(n, 1) * H, V) for n in range(N + 1)]
    options = sorted(set(per_count))
    run = [functools.partial(chunk_state, block_v=bv, num_warps=nw, num_stages=ns, **kw) for bv, nw, ns in options]
    if len(run) == 1:
        return run[0](w, kd, u, g, cs, h0)
    live = jnp.sum((cs[1:] > cs[:-1]).astype(jnp.int32))
    which = jnp.asarray([options.index(t) for t in per_count], jnp.int32)[live]
    return lax.switch(which, run, w, kd, u, g, cs, h0)


def chunk_kda_laid_out(q, k, v, g, beta, cs, h0, *, chunk_size=64, safe_gate=False,
                       interpret=False, backend="triton", **overrides):
    """Stages 1 + 2 on laid-out rows (g already the chunk-local cumsum in log2 units, chunk_cumsum's). See chunk_intra / chunk_inter.
    safe_gate: caller guarantees every g >= -5, which allows the one-matmul diagonal blocks."""
    n_chunks = cs[-1:]          # chunk-parallel kernels skip the layout's unused tail (see _real_chunks_only)
    cfg = dict(CONFIG, **overrides)
    diag = "mid" if safe_gate else cfg["diag"]
    # fp32 inputs keep IEEE fp32 dots (the 1e-5 path); bf16 inputs use cfg["intra_prec"]
    prec = "highest" if q.dtype == _F32 else cfg["intra_prec"]
    if cfg["intra"] == "split":
        low = q.dtype != _F32  # storage knobs apply to bf16 inputs; fp32 keeps fp32 everywhere
        w, qg, kd, u, a = chunk_intra_split(
            q, k, v, g, beta, chunk_size=chunk_size, bk=cfg["split_bk"], prec=prec, inv=cfg["inv"],
            t_dtype=cfg["t_dtype"] if low else "f32", u_dtype=cfg["u_dtype"] if low else "f32",
            a_dtype=cfg["a_dtype"] if low and cfg["inter"] == "two_pass" else "f32",
            warps=cfg["split_warps"], diag_mode=cfg["split_diag"], diag_bh=cfg["diag_bh"],
            safe_shift=cfg["safe_shift"] if safe_gate else None, wu_bk=cfg["wu_bk"],
            solve_unroll=cfg["solve_unroll"], solve_passes=cfg["solve_passes"], wu_unroll=cfg["wu_unroll"],
            stages=cfg["split_stages"], interpret=interpret, backend=backend, n_chunks=n_chunks)
    else:
        w, qg, kd, u, a = chunk_intra(q, k, v, g, beta, chunk_size=chunk_size, diag=diag,
                                      num_warps=cfg["intra_warps"], prec=prec, inv=cfg["inv"],
                                      interpret=interpret, backend=backend)
    if cfg["inter"] == "two_pass":
        kw = dict(chunk_size=chunk_size, interpret=interpret, backend=backend)
        if cfg["block_v"] == "auto":
            h, vn, ht = _state_for_live_sequences(w, kd, u, g, cs, h0, **kw)
        else:
            h, vn, ht = chunk_state(w, kd, u, g, cs, h0, block_v=cfg["block_v"], num_warps=cfg["inter_warps"],
                                    num_stages=cfg["state_stages"], **kw)
        o = chunk_out(qg, h, a, vn, chunk_size=chunk_size, num_warps=cfg["out_warps"],
                      out_dtype=v.dtype, interpret=interpret, backend=backend, n_chunks=n_chunks)
        return o, ht
    bv = cfg["block_v"] if cfg["block_v"] != "auto" else 32
    return chunk_inter(w, qg, kd, u, a, g, cs, h0, chunk_size=chunk_size, block_v=bv,
                       num_warps=cfg["inter_warps"], split=cfg["split"], out_dtype=v.dtype,
                       interpret=interpret, backend=backend)
