"""The split intra stage of chunked KDA (FLA's structure): diagonal blocks, off-diagonal blocks +
inverse, and w / u, as three Pallas kernels (see the comment below and chunk_pallas.CONFIG)."""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels.kda.chunk_common import (
    _F32, _LOG2E, _PREC, _brow, _chunk_count, _diag_column, _dot, _dot_nt, _real_chunks_only, _rows, _tp,
    _unit_tril_inv, _unit_tril_inv_many, _unit_tril_inv_power)


# ---- Split intra stage (FLA's structure): three kernels, each with a small register footprint ----
# 1. `_diag_kernel`, parallel over (16-row sub-chunk, head): the exact diagonal 16x16 blocks of
#    A_qk and beta * A_kk, column by column (exp(gc_i - gc_j) only where i >= j).
# 2. `_solve_kernel`, parallel over (chunk, head): the off-diagonal blocks by dots over K slices of
#    width bk (gates anchored at the first row of the later block: every factor <= 1), the full
#    causal A_qk written out, and T = (I + StrictTril(diag(beta) A_kk))^-1 by 16x16 inverses and
#    block forward substitution, written as one [C, C] matrix.
# 3. `_wu_kernel`, parallel over (chunk, head): w = T (beta exp(gc) k), u = T (beta v) as [C, C] x
#    [C, bk] dots, plus qg = q exp(gc) and kd = k exp(g_last - gc).


def _diag_kernel(q_ref, k_ref, g_ref, b_ref, dq_ref, dk_ref, *, mode="loop", prec="highest"):
    """One (sub-chunk, head). q, k, g [bc, K]; beta [bc]; outputs dq (A_qk diagonal block, i >= j)
    and dk (beta_i A_kk, i > j) [bc, bc] fp32.

    mode "loop": 16 column steps. "quad" (bc = 16): the cross-half quadrant (rows 8-15, cols 0-7)
    and the two cross-quarter ones (rows 4-7 x cols 0-3, rows 12-15 x cols 8-11) as three masked
    dots anchored at rows 8 / 4 / 12 (every exponent <= 0, still exact for any g), then the four
    4x4 diagonal blocks in 4 column steps (all four at once)."""
    bc, K = q_ref.shape
    row = lax.broadcasted_iota(jnp.int32, (bc, bc), 0)
    col = lax.broadcasted_iota(jnp.int32, (bc, bc), 1)
    row_k = lax.broadcasted_iota(jnp.int32, (bc, K), 0)
    qI, kI, gI = (r[...].astype(_F32) for r in (q_ref, k_ref, g_ref))
    if mode == "quad":
        assert bc == 16, bc
        pr = _PREC[prec]
        akk = aqk = None
        for a, rhi, clo in ((8, 16, 0), (4, 8, 0), (12, 16, 8)):  # rows [a, rhi) x cols [clo, a)
            ga = g_ref[a, :][None, :]
            er = jnp.exp2(jnp.where((row_k >= a) & (row_k < rhi), gI - ga, -jnp.inf))
            kc = kI * jnp.exp2(jnp.where((row_k >= clo) & (row_k < a), ga - gI, -jnp.inf))
            dk_, dq_ = _dot_nt(kI * er, kc, pr), _dot_nt(qI * er, kc, pr)
            akk = dk_ if akk is None else akk + dk_
            aqk = dq_ if aqk is None else aqk + dq_
        blk_k = lax.shift_right_logical(row_k, 2)  # 4-row block of each row
        sub_k = lax.bitwise_and(row_k, 3)
        blk = lax.shift_right_logical(row, 2)
        sub = lax.bitwise_and(row, 3)
        for j in range(4):  # column 4 * blk + j of every 4x4 diagonal block at once
            kj = gj = None
            for b4 in range(4):
                kr = jnp.broadcast_to(k_ref[4 * b4 + j, :].astype(_F32)[None, :], (bc, K))
                gr = jnp.broadcast_to(g_ref[4 * b4 + j, :][None, :], (bc, K))
                kj = kr if kj is None else jnp.where(blk_k == b4, kr, kj)
                gj = gr if gj is None else jnp.where(blk_k == b4, gr, gj)
            ekj = jnp.exp2(jnp.where(sub_k >= j, gI - gj, -jnp.inf)) * kj
            ck = jnp.sum(kI * ekj, axis=1)
            cq = jnp.sum(qI * ekj, axis=1)
            at = col == blk * 4 + j
            akk = jnp.where(at & (sub > j), ck[:, None], akk)
            aqk = jnp.where(at & (sub >= j), cq[:, None], aqk)
        dk_ref[...] = akk * b_ref[...].astype(_F32)[:, None]
        dq_ref[...] = aqk
        return

    def body(j, carry):
        akk, aqk = carry
        return _diag_column(j, k_ref[j, :].astype(_F32), g_ref[j, :], qI, kI, gI, row, col, row_k, akk, aqk)

    zero = jnp.zeros((bc, bc), _F32)
    akk, aqk = lax.fori_loop(0, bc, body, (zero, zero))
    dk_ref[...] = akk * b_ref[...].astype(_F32)[:, None]
    dq_ref[...] = aqk


def _diag_token_kernel(q_ref, k_ref, kb_ref, gb_ref, b_ref, dq_ref, dk_ref, *, bc, store_cols=True):
    """Token-parallel diagonal blocks (FLA's layout of this step): one program per (token i, bh
    heads). q, k [bh, K] of token i; kb, gb [bc, bh, K] of i's sub-chunk; beta [bh]. Writes row i
    of the sub-chunk's blocks: dq[:, j] = A_qk[i, j] (j <= i), dk[:, j] = beta_i A_kk[i, j] (j < i),
    [bh, bc] fp32. Only the j <= i steps run (exp(g_i - g_j) <= 1 there: exact for any gate)."""
    i = pl.program_id(0) % bc
    qi, ki = q_ref[...].astype(_F32), k_ref[...].astype(_F32)
    gi = gb_ref[i].astype(_F32)
    bh = qi.shape[0]
    if store_cols:  # FLA's way: each column stored as computed (no select over the [bh, bc] tile)
        kb = ki * b_ref[...].astype(_F32)[:, None]
        dq_ref[...] = jnp.zeros(dq_ref.shape, dq_ref.dtype)
        dk_ref[...] = jnp.zeros(dk_ref.shape, dk_ref.dtype)

        def body(j, carry):
            e = kb_ref[j].astype(_F32) * jnp.exp2(gi - gb_ref[j])
            dq_ref[:, pl.ds(j, 1)] = jnp.sum(qi * e, axis=1)[:, None]
            dk_ref[:, pl.ds(j, 1)] = jnp.sum(kb * e, axis=1)[:, None]
            return carry

        lax.fori_loop(0, i, body, 0)  # j < i: both blocks; j = i: A_qk only (A_kk's diagonal is 0)
        e = kb_ref[i].astype(_F32)
        dq_ref[:, pl.ds(i, 1)] = jnp.sum(qi * e, axis=1)[:, None]
        return
    col = lax.broadcasted_iota(jnp.int32, (bh, bc), 1)

    def body(j, carry):
        aq, ak = carry
        e = kb_ref[j].astype(_F32) * jnp.exp2(gi - gb_ref[j])
        cq = jnp.sum(qi * e, axis=1)
        ck = jnp.sum(ki * e, axis=1)
        at = col == j
        return jnp.where(at, cq[:, None], aq), jnp.where(at & (j < i), ck[:, None], ak)

    zero = jnp.zeros((bh, bc), _F32)
    aq, ak = lax.fori_loop(0, i + 1, body, (zero, zero))
    dq_ref[...] = aq
    dk_ref[...] = ak * b_ref[...].astype(_F32)[:, None]


def _solve_kernel(q_ref, k_ref, g_ref, b_ref, *refs, bc, bk, prec, inv, shift=None, unroll=True,
                  passes=1):
    """One (chunk, head). q, k, g [C, K]; beta [C]; then dq, dk [C, bc] (diagonal blocks from
    `_diag_kernel`) unless `shift` is set. Writes a = causal A_qk [C, C] and t = (I + L)^-1 [C, C]
    (in their refs' dtypes).

    shift (safe gates only, every per-token log decay >= -5): the diagonal blocks are computed here
    as two dots per K slice, anchored at C = g_first - shift (FLA's choice for bounded gates: the
    anchor is a past row, so no future gate enters a kept entry; factors <= e^shift and
    <= e^(75 - shift) stay finite in fp32), masked to the causal part afterwards."""
    if shift is None:
        dq_ref, dk_ref, a_ref, t_ref = refs
    else:
        a_ref, t_ref = refs
    pr = _PREC[prec]
    C, K = q_ref.shape
    nc = C // bc
    row = lax.broadcasted_iota(jnp.int32, (bc, bc), 0)
    col = lax.broadcasted_iota(jnp.int32, (bc, bc), 1)
    zero = jnp.zeros((bc, bc), _F32)
    keys = [(I, J) for I in range(nc) for J in range(I + (shift is not None))]

    def slice_step(ks, acc, want_l, want_q):
        """Add one K slice's contribution to the off-diagonal (and, with shift, diagonal) blocks of
        A_kk (want_l) and / or A_qk (want_q); acc maps ("l" | "q", I, J) to a [bc, bc] block."""
        acc = dict(acc)
        kJ = [k_ref[pl.ds(J * bc, bc), ks].astype(_F32) for J in range(nc - 1)]
        gJ = [g_ref[pl.ds(J * bc, bc), ks] for J in range(nc - 1)]
        for I in range(1, nc):
            gI = g_ref[pl.ds(I * bc, bc), ks]
            gn = g_ref[I * bc, ks]
            eI = jnp.exp2(gI - gn[None, :])  # <= 1
            qgI = q_ref[pl.ds(I * bc, bc), ks].astype(_F32) * eI if want_q else None
            kgI = k_ref[pl.ds(I * bc, bc), ks].astype(_F32) * eI if want_l else None
            for J in range(I):  # earlier blocks' k scaled to block I's anchor
                kgJ = kJ[J] * jnp.exp2(gn[None, :] - gJ[J])  # <= 1
                if want_l:
                    acc["l", I, J] = acc["l", I, J] + _dot_nt(kgI, kgJ, pr)
                if want_q:
                    acc["q", I, J] = acc["q", I, J] + _dot_nt(qgI, kgJ, pr)
        if shift is not None:
            for I in range(nc):
                r = pl.ds(I * bc, bc)
                gI = g_ref[r, ks]
                c = g_ref[I * bc, ks][None, :] - shift * _LOG2E  # shift in natural-log units
                kI = k_ref[r, ks].astype(_F32)
                kc = kI * jnp.exp2(c - gI)
                eq = jnp.exp2(gI - c)
                if want_l:
                    acc["l", I, I] = acc["l", I, I] + _dot_nt(kI * eq, kc, pr)
                if want_q:
                    acc["q", I, I] = acc["q", I, I] + _dot_nt(q_ref[r, ks].astype(_F32) * eq, kc, pr)
        return acc

    def accumulate(want_l, want_q):
        names = [("l", *key) for key in keys if want_l] + [("q", *key) for key in keys if want_q]
        acc = {name: zero for name in names}
        if unroll:  # K slices keep the live tiles at [bc, bk]
            for s in range(K // bk):
                acc = slice_step(pl.ds(s * bk, bk), acc, want_l, want_q)
            return acc
        # a loop, not unrolled: the unrolled kernel stalled on instruction fetch (ncu)
        def body(s, carry):
            out = slice_step(pl.ds(pl.multiple_of(s * bk, bk), bk), dict(zip(names, carry)),
                             want_l, want_q)
            return tuple(out[name] for name in names)
        return dict(zip(names, lax.fori_loop(0, K // bk, body, tuple(acc[n] for n in names))))

    if passes == 1:  # both matrices in one pass over K: the k / g slices are loaded once
        acc = accumulate(True, True)
    else:  # A_qk, then A_kk: half the live accumulators per loop (the solve spilled at 255 regs)
        acc = accumulate(False, True)
    L = {key: acc.get(("l", *key), zero) for key in keys}
    Aq = {key: acc.get(("q", *key), zero) for key in keys}
    for I in range(nc):
        r = pl.ds(I * bc, bc)
        bI = b_ref[r].astype(_F32)[:, None]
        if shift is None:
            L[I, I], Aq[I, I] = dk_ref[r, :], dq_ref[r, :]
        else:
            L[I, I] = jnp.where(row > col, L[I, I], 0.0) * bI
            Aq[I, I] = jnp.where(row >= col, Aq[I, I], 0.0)
        for J in range(I):
            L[I, J] = L[I, J] * bI
        for J in range(nc):
            blk = Aq[I, J] if J <= I else zero
            a_ref[r, pl.ds(J * bc, bc)] = blk.astype(a_ref.dtype)
    if passes == 2:
        acc = accumulate(True, False)
        for I in range(nc):
            bI = b_ref[pl.ds(I * bc, bc)].astype(_F32)[:, None]
            for J in range(I + (shift is not None)):
                L[I, J] = acc["l", I, J] * bI
            if shift is not None:
                L[I, I] = jnp.where(row > col, L[I, I], 0.0)
    T = {}
    if inv == "many":  # all diagonal inverses in one loop; rows from dk when it is in memory
        load = None if shift is not None else (
            lambda b, i: dk_ref[b * bc + i, :].astype(_F32))
        for I, X in enumerate(_unit_tril_inv_many([L[I, I] for I in range(nc)], row, col, load)):
            T[I, I] = X
    for I in range(nc):
        if inv != "many":
            T[I, I] = (_unit_tril_inv_power(L[I, I], row, col, pr) if inv == "power"
                       else _unit_tril_inv(L[I, I], row, col))
        for J in range(I - 1, -1, -1):  # T_IJ = -T_II sum_{J<=M<I} L_IM T_MJ
            acc = _dot(L[I, J], T[J, J], pr)
            for M in range(J + 1, I):
                acc = acc + _dot(L[I, M], T[M, J], pr)
            T[I, J] = -_dot(T[I, I], acc, pr)
    for I in range(nc):
        for J in range(nc):
            t_ref[pl.ds(I * bc, bc), pl.ds(J * bc, bc)] = (T[I, J] if J <= I else zero).astype(t_ref.dtype)


def _wu_kernel(q_ref, k_ref, v_ref, g_ref, b_ref, t_ref, w_ref, u_ref, qg_ref, kd_ref, *, bk, bv,
               prec, unroll=True):
    """One (chunk, head): w = T (beta exp(gc) k), u = T (beta v), qg = q exp(gc),
    kd = k exp(g_last - gc). A bf16 T means bf16 operands (FLA's choice); fp32 T uses `prec`.
    unroll=False: the slice loops as fori_loops (smaller code, fewer live registers)."""
    pr = _PREC[prec]
    C, K = k_ref.shape
    V = v_ref.shape[1]
    T = t_ref[...]
    od = T.dtype  # dot operand dtype
    b = b_ref[...].astype(_F32)[:, None]

    def k_slice(ks):
        glast = g_ref[C - 1, ks]
        g = g_ref[:, ks]
        eg = jnp.exp2(g)
        kk = k_ref[:, ks].astype(_F32)
        w_ref[:, ks] = _dot(T, (kk * b * eg).astype(od), pr).astype(w_ref.dtype)
        qg_ref[:, ks] = (q_ref[:, ks].astype(_F32) * eg).astype(qg_ref.dtype)
        kd_ref[:, ks] = (kk * jnp.exp2(glast[None, :] - g)).astype(kd_ref.dtype)

    def v_slice(vs):
        u_ref[:, vs] = _dot(T, (v_ref[:, vs].astype(_F32) * b).astype(od), pr).astype(u_ref.dtype)

    for fn, n, w in ((k_slice, K // bk, bk), (v_slice, V // bv, bv)):
        if unroll:
            for s in range(n):
                fn(pl.ds(s * w, w))
        else:
            def body(s, carry, fn=fn, w=w):
                fn(pl.ds(pl.multiple_of(s * w, w), w))
                return carry
            lax.fori_loop(0, n, body, 0)


@functools.partial(jax.jit, static_argnames=("bc", "mode", "prec", "num_warps", "num_stages", "bh",
                                             "interpret", "backend", "chunk_size"))
def intra_diag(q, k, g, beta, *, bc=16, mode="loop", prec="highest", num_warps=4, num_stages=1, bh=1,
               interpret=False, backend="triton", n_chunks=None, chunk_size=64):
    """Split stage 1a: diagonal blocks dq (A_qk), dk (beta A_kk) [R, H, bc] fp32 (see _diag_kernel;
    mode "token": `_diag_token_kernel` with `bh` heads per program)."""
    R, H, K = q.shape
    n = _chunk_count(n_chunks, R, chunk_size)
    if mode == "token":
        if H % bh:
            raise ValueError(f"H={H} must be a multiple of bh={bh}")
        tok = pl.BlockSpec((None, bh, K), lambda t, h: (t, h, 0))
        sub = pl.BlockSpec((bc, bh, K), lambda t, h: (t // bc, h, 0))
        out = pl.BlockSpec((None, bh, bc), lambda t, h: (t, h, 0))
        return pl.pallas_call(
            _real_chunks_only(functools.partial(_diag_token_kernel, bc=bc), chunk_size, interpret=interpret),
            grid=(R, H // bh),
            in_specs=[pl.no_block_spec, tok, tok, sub, sub, pl.BlockSpec((None, bh), lambda t, h: (t, h))],
            out_specs=[out, out],
            out_shape=[jax.ShapeDtypeStruct((R, H, bc), _F32)] * 2,
            interpret=interpret, name="kda_intra_diag_token", **_tp(backend, num_warps, num_stages),
        )(n, q, k, k, g, beta)
    return pl.pallas_call(
        _real_chunks_only(functools.partial(_diag_kernel, mode=mode, prec=prec), chunk_size // bc, interpret=interpret),
        grid=(R // bc, H),
        in_specs=[pl.no_block_spec, _rows(bc, K), _rows(bc, K), _rows(bc, K), _brow(bc)],
        out_specs=[_rows(bc, bc), _rows(bc, bc)],
        out_shape=[jax.ShapeDtypeStruct((R, H, bc), _F32)] * 2,
        interpret=interpret, name="kda_intra_diag", **_tp(backend, num_warps, 1),
    )(n, q, k, g, beta)


@functools.partial(jax.jit, static_argnames=("chunk_size", "bk", "prec", "inv", "t_dtype",
                                             "a_dtype", "shift", "bc", "unroll", "passes", "num_warps",
                                             "num_stages", "interpret", "backend"))
def intra_solve(q, k, g, beta, dq=None, dk=None, *, chunk_size=64, bk=32, prec="highest",
                inv="loop", t_dtype=_F32, a_dtype=_F32, shift=None, bc=16, unroll=True, passes=1,
                num_warps=4, num_stages=1, interpret=False, backend="triton", n_chunks=None):
    """Split stage 1b: causal A_qk [R, H, C] in a_dtype and T = (I + L)^-1 [R, H, C] in t_dtype.
    dq, dk: the diagonal blocks from intra_diag, or None with `shift` (safe gates: see
    _solve_kernel)."""
    R, H, K = q.shape
    C = chunk_size
    bc = bc if dq is None else dq.shape[-1]
    bk = min(bk, K)
    if K % bk or C % bc:
        raise ValueError(f"K={K} must be a multiple of bk={bk}, C={C} of bc={bc}")
    if (dq is None) != (shift is not None):
        raise ValueError("pass either the diagonal blocks (dq, dk) or a safe-gate shift")
    diag = [] if dq is None else [dq, dk]
    return pl.pallas_call(
        _real_chunks_only(functools.partial(_solve_kernel, bc=bc, bk=bk, prec=prec, inv=inv, shift=shift,
                                            unroll=unroll, passes=passes), interpret=interpret),
        grid=(R // C, H),
        in_specs=[pl.no_block_spec, _rows(C, K), _rows(C, K), _rows(C, K), _brow(C)] + [_rows(C, bc)] * len(diag),
        out_specs=[_rows(C, C), _rows(C, C)],
        out_shape=[jax.ShapeDtypeStruct((R, H, C), a_dtype), jax.ShapeDtypeStruct((R, H, C), t_dtype)],
        interpret=interpret, name="kda_intra_solve", **_tp(backend, num_warps, num_stages),
    )(_chunk_count(n_chunks, R, C), q, k, g, beta, *diag)


@functools.partial(jax.jit, static_argnames=("bk", "prec", "u_dtype", "unroll", "num_warps",
                                             "num_stages", "interpret", "backend"))
def intra_wu(q, k, v, g, beta, t, *, bk=32, prec="highest", u_dtype=_F32, unroll=True, num_warps=4,
             num_stages=2, interpret=False, backend="triton", n_chunks=None):
    """Split stage 1c: w, qg, kd [R, H, K] (q.dtype), u [R, H, V] (u_dtype)."""
    R, H, K = q.shape
    V = v.shape[-1]
    C = t.shape[-1]
    bk, bv = min(bk, K), min(bk, V)
    if K % bk or V % bv:
        raise ValueError(f"K={K}, V={V} must be multiples of bk={bk}")
    sd = q.dtype
    w, u, qg, kd = pl.pallas_call(
        _real_chunks_only(functools.partial(_wu_kernel, bk=bk, bv=bv, prec=prec, unroll=unroll), interpret=interpret),
        grid=(R // C, H),
        in_specs=[pl.no_block_spec, _rows(C, K), _rows(C, K), _rows(C, V), _rows(C, K), _brow(C), _rows(C, C)],
        out_specs=[_rows(C, K), _rows(C, V), _rows(C, K), _rows(C, K)],
        out_shape=[jax.ShapeDtypeStruct((R, H, K), sd), jax.ShapeDtypeStruct((R, H, V), u_dtype),
                   jax.ShapeDtypeStruct((R, H, K), sd), jax.ShapeDtypeStruct((R, H, K), sd)],
        interpret=interpret, name="kda_intra_wu", **_tp(backend, num_warps, num_stages),
    )(_chunk_count(n_chunks, R, C), q, k, v, g, beta, t)
    return w, qg, kd, u


def chunk_intra_split(q, k, v, g, beta, *, chunk_size=64, bc=16, bk=32, prec="highest", inv="loop",
                      t_dtype="f32", u_dtype="f32", a_dtype="f32", warps=(4, 4, 4), stages=(1, 1, 2),
                      diag_mode="loop", diag_bh=1, safe_shift=None, wu_bk=None, solve_unroll=True,
                      solve_passes=1, wu_unroll=True, interpret=False, backend="triton", n_chunks=None):
    """Stage 1 as three kernels (intra_diag / intra_solve / intra_wu); same inputs and outputs as
    `chunk_intra` (u in u_dtype, A_qk in a_dtype: "f32" or "sd" = the dot dtype). t_dtype: the
    stored inverse and the w/u dot operands, "f32" (dots in `prec`) or "sd" (bf16 operands for
    bf16 inputs, FLA's). safe_shift (safe gates only): no diag kernel, the solve kernel computes
    the diagonal blocks (see _solve_kernel)."""
    sd = q.dtype
    dt = lambda name: _F32 if name == "f32" else sd  # noqa: E731
    kw = dict(interpret=interpret, backend=backend, n_chunks=n_chunks)
    diag = ()
    if safe_shift is None:
        diag = intra_diag(q, k, g, beta, bc=bc, mode=diag_mode, prec=prec, num_warps=warps[0],
                          num_stages=stages[0], bh=math.gcd(diag_bh, q.shape[1]), chunk_size=chunk_size, **kw)  # heads per program divide H
    a, t = intra_solve(q, k, g, beta, *diag, chunk_size=chunk_size, bk=bk, prec=prec, inv=inv,
                       t_dtype=dt(t_dtype), a_dtype=dt(a_dtype), shift=safe_shift, bc=bc,
                       unroll=solve_unroll, passes=solve_passes,
                       num_warps=warps[1], num_stages=stages[1], **kw)
    w, qg, kd, u = intra_wu(q, k, v, g, beta, t, bk=wu_bk or bk, prec=prec,
                            u_dtype=dt(u_dtype), unroll=wu_unroll, num_warps=warps[2],
                            num_stages=stages[2], **kw)
    return w, qg, kd, u, a
