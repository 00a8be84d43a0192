"""Chunked KDA prefill as one Mosaic-TPU Pallas kernel: same math as the GPU chunk kernels
(chunk_pallas.py, chunk_intra_split.py), laid out for Mosaic.

The GPU kernels' per-head blocks (C, None, K) over [R, H, K] break Mosaic's rule that a block's
last two dims be multiples of (8, 128) or the full dims, so here every block is one head's whole
(C, K) = (64, 128) tile (layouts below). Grid (head, chunk): heads
"parallel", chunks "arbitrary" (in order), the state S [K, V] fp32 carried across chunks in a
VMEM scratch. Per chunk the sequence id and whether the chunk is a sequence's first / last are
scalar-prefetched: the h0 / ht blocks are indexed through the sequence id (so Pallas fetches h0
and writes ht back once per sequence), S is loaded from h0 at a first chunk and copied to ht at a
last one. Sequences with no chunk keep h0 (patched in XLA after the call). When K and V are
multiples of 128 (K3: 128) the tiles are read straight from [R, H*D] views of the inputs (column
block h), so XLA moves no data; other head sizes go through an [H, R, D] transpose.

Per (head, chunk), gates gc = chunk-local cumsum of the log decay (natural log, done in XLA):
  * A_kk / A_qk in 16-row sub-blocks: off-diagonal blocks by one masked [C, K] x [K, C] dot per
    row block I, anchored at block I's first row (every exponent <= 0); the diagonal blocks
    exactly, one key column j at a time for all four blocks at once (exp(gc_i - gc_j) only where
    i >= j). Exact for any decaying gate.
  * T = (I + L)^-1, L = StrictTril(diag(beta) A_kk): the 16x16 diagonal inverses as the Neumann
    product (I - D)(I + D^2)(I + D^4)(I + D^8) on the block-diagonal part, then block forward
    substitution over the three lower row blocks (chunk_pallas' inv="power" + its block solve).
  * w = T (beta exp(gc) k), u = T (beta v); v' = u - w S; o = (q exp(gc)) S + A_qk v';
    S = exp(g_last) S + (k exp(g_last - gc))^T v'.
Dots accumulate in fp32. fp32 inputs: fp32 operands at HIGHEST precision. bf16 inputs: like the
GPU kernels (FLA's choice), T, w, A_qk, q exp(gc), k exp(g_last - gc), S and v' enter their dots
in bf16; the intra-chunk matrices (A_kk, A_qk, the inverse) are built from fp32 operands.

Mosaic wants aligned 2-D tiles and has no cheap lane -> sublane move, so rows are picked by masked
sublane sums and row vectors turned into columns with a masked lane sum over an identity mask
(pallas_kernels/tpu_vector.py): both exact (they only add zeros).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.tpu_vector import row as _row, col as _col

_F32 = jnp.float32
_HI = lax.Precision.HIGHEST
_BC = 16  # sub-block rows (as the GPU kernels): diagonal blocks are built exactly, column by column


def _mm(a, b, dims):
    """fp32 operands: full fp32 contraction (HIGHEST); bf16 operands: the MXU's native bf16 dot.
    Both accumulate in fp32."""
    prec = _HI if a.dtype == _F32 else None
    return lax.dot_general(a, b, (dims, ((), ())), precision=prec, preferred_element_type=_F32)


def _dot(a, b):
    return _mm(a, b, ((1,), (0,)))


def _dot_nt(a, b):  # a @ b.T
    return _mm(a, b, ((1,), (1,)))



def _intra(q, k, g, beta_c):
    """Intra-chunk matrices of one chunk. q, k, g [C, K] fp32 (g the chunk-local cumsum),
    beta_c [C, 1]. Returns (A_qk [C, C] causal, T = (I + L)^-1 [C, C]), fp32."""
    C, K = k.shape
    nb = C // _BC
    row = lax.broadcasted_iota(jnp.int32, (C, C), 0)
    col = lax.broadcasted_iota(jnp.int32, (C, C), 1)
    row_k = lax.broadcasted_iota(jnp.int32, (C, K), 0)
    blk_k = lax.shift_right_logical(row_k, 4)        # 16-row block of each row
    sub_k = lax.bitwise_and(row_k, _BC - 1)          # row within its block
    sub = lax.bitwise_and(row, _BC - 1)
    base = row - sub                                 # first row (= column) of the row's block
    zero = jnp.zeros((C, C), _F32)

    # Off-diagonal blocks: rows of block I against all earlier rows, anchored at block I's first
    # row gn: exp(g_i - gn) <= 1 for i in block I, exp(gn - g_j) <= 1 for j before it.
    akk_off, aqk_off = zero, zero
    for I in range(1, nb):
        gn = _row(g[I * _BC:I * _BC + 8], 0)
        e_i = jnp.exp(jnp.where(blk_k == I, g - gn, -jnp.inf))
        kc = k * jnp.exp(jnp.where(blk_k < I, gn - g, -jnp.inf))
        akk_off = akk_off + _dot_nt(k * e_i, kc)
        aqk_off = aqk_off + _dot_nt(q * e_i, kc)

    # Diagonal blocks, exact: key column j of every block at once; row i of the [C, K] tiles
    # holds key row base(i) + j, and exp(g_i - g_j) is only taken where sub(i) >= j.
    ks = [k[b * _BC:(b + 1) * _BC] for b in range(nb)]
    gs = [g[b * _BC:(b + 1) * _BC] for b in range(nb)]

    def column(j, carry):
        akk, aqk = carry
        kj, gj = _row(ks[0], j), _row(gs[0], j)
        kj, gj = jnp.broadcast_to(kj, (C, K)), jnp.broadcast_to(gj, (C, K))
        for b in range(1, nb):
            kj = jnp.where(blk_k == b, _row(ks[b], j), kj)
            gj = jnp.where(blk_k == b, _row(gs[b], j), gj)
        e = jnp.exp(jnp.where(sub_k >= j, g - gj, -jnp.inf)) * kj
        ck = jnp.sum(k * e, axis=1, keepdims=True)
        cq = jnp.sum(q * e, axis=1, keepdims=True)
        at = col == base + j
        akk = jnp.where(at & (sub > j), ck, akk)
        aqk = jnp.where(at & (sub >= j), cq, aqk)
        return akk, aqk

    akk_d, aqk_d = lax.fori_loop(0, _BC, column, (zero, zero))

    # T: block-diagonal inverse by the Neumann product (D^16 = 0), then block forward
    # substitution T_I = Dinv_I (delta_I - sum_{M<I} L_IM T_M), one row block at a time.
    D = akk_d * beta_c
    E = akk_off * beta_c
    eye = jnp.where(row == col, 1.0, 0.0)  # (not a bool cast: i1 -> f32 may not lower)
    X, P = eye - D, D
    for _ in range(3):
        P = _dot(P, P)
        X = X + _dot(X, P)
    Dinv = X
    blk = lax.shift_right_logical(row, 4)
    T = Dinv
    for I in range(1, nb):
        T = T - _dot(Dinv, jnp.where(blk == I, _dot(E, T), 0.0))
    return aqk_off + aqk_d, T


def _kernel(sid_ref, first_ref, last_ref, q_ref, k_ref, v_ref, g_ref, b_ref, h0_ref, o_ref,
            ht_ref, s_ref):
    """One (head, chunk). q, k, g [C, K]; v, o [C, V]; beta [1, C]; h0, ht, s (scratch) [K, V]."""
    del sid_ref
    c = pl.program_id(1)
    sd = q_ref.dtype if q_ref.dtype != _F32 else _F32  # dot operand dtype of the state part
    C = q_ref.shape[0]

    @pl.when(first_ref[c] != 0)
    def _():
        s_ref[...] = h0_ref[...].astype(_F32)

    q = q_ref[...].astype(_F32)
    k = k_ref[...].astype(_F32)
    g = g_ref[...].astype(_F32)
    beta_c = _col(b_ref[...].astype(_F32))                       # [C, 1]
    A, T = _intra(q, k, g, beta_c)
    eg = jnp.exp(g)
    glast = _row(g[C - 8:], 7)                                   # [1, K]
    td = T.astype(sd)
    w = _dot(td, (k * eg * beta_c).astype(sd)).astype(sd)
    u = _dot(td, (v_ref[...].astype(_F32) * beta_c).astype(sd))
    qg = (q * eg).astype(sd)
    # k exp(g_last - gc), transposed as fp32 (splash attention's pattern) so the state update is
    # a plain [K, C] x [C, V] dot rather than one contracting the lhs's row axis
    kdt = (k * jnp.exp(glast - g)).T.astype(sd)

    S = s_ref[...]
    Sd = S.astype(sd)
    vq = (u - _dot(w, Sd)).astype(sd)
    o_ref[...] = (_dot(qg, Sd) + _dot(A.astype(sd), vq)).astype(o_ref.dtype)
    S = S * _col(jnp.exp(glast)) + _dot(kdt, vq)
    s_ref[...] = S

    @pl.when(last_ref[c] != 0)
    def _():
        ht_ref[...] = S


def _chunk_info(cs, NC):
    """Per chunk: sequence id (clipped), first / last chunk of its sequence (0 for chunks no
    sequence owns), all int32 [NC]."""
    N = cs.shape[0] - 1
    j = jnp.arange(NC, dtype=jnp.int32)
    sid = jnp.clip(jnp.searchsorted(cs, j, side="right", method="compare_all") - 1, 0, N - 1).astype(jnp.int32)
    owned = (j >= cs[0]) & (j < cs[N])
    first = owned & (j == cs[sid])
    last = owned & (j == cs[sid + 1] - 1)
    return sid, first.astype(jnp.int32), last.astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("chunk_size", "interpret"))
def chunk_kda_laid_out_tpu(q, k, v, g, beta, cs, h0, *, chunk_size=64, interpret=False):
    """Chunked KDA on laid-out rows (see ops.chunk_kda): every sequence starts on a chunk boundary,
    padding rows carry k = v = beta = 0 and g = 0.

    q (already scaled), k [R, H, K]; v [R, H, V]; g [R, H, K] the per-token log decay (natural
    log, already gated; NOT the cumsum); beta [R, H]; cs int32 [N+1] first chunk of each sequence
    (cs[N] = chunks used); h0 [N, H, K, V] fp32.
    interpret: False (compile with Mosaic), True or a pltpu.InterpretParams (TPU interpreter).
    Returns (o [R, H, V] in v.dtype, rows of chunks no sequence owns undefined; ht [N, H, K, V] fp32).
    """
    R, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    N = h0.shape[0]
    if C % _BC or R % C:
        raise ValueError(f"chunk_size={C} must be a multiple of {_BC} and divide R={R}")
    if k.shape != (R, H, K) or g.shape != (R, H, K) or v.shape[:2] != (R, H) or beta.shape != (R, H):
        raise ValueError(f"shapes q {q.shape} k {k.shape} v {v.shape} g {g.shape} beta {beta.shape}")
    if h0.shape != (N, H, K, V):
        raise ValueError(f"h0 {h0.shape}: expected [N, {H}, {K}, {V}]")
    NC = R // C
    gc = jnp.cumsum(g.astype(_F32).reshape(NC, C, H, K), axis=1).reshape(R, H, K)
    brow = beta.astype(_F32).T.reshape(H, NC, 1, C)
    cs = cs.astype(jnp.int32)
    sid, first, last = _chunk_info(cs, NC)

    if H == 1 or (K % 128 == 0 and V % 128 == 0):
        # [R, H*D] views (free reshapes): head h's (C, D) tile is column block h, lane-aligned.
        ins = [x.reshape(R, H * x.shape[-1]) for x in (q, k, v, gc)]
        rows = lambda D: pl.BlockSpec((C, D), lambda h, c, *_: (c, h))  # noqa: E731
        o_shape = (R, H * V)
        unlay = lambda o: o.reshape(R, H, V)  # noqa: E731
    else:
        # head dims that are not lane multiples: transpose to [H, R, D] (full-width tiles)
        ins = [jnp.swapaxes(x, 0, 1) for x in (q, k, v, gc)]
        rows = lambda D: pl.BlockSpec((None, C, D), lambda h, c, *_: (h, c, 0))  # noqa: E731
        o_shape = (H, R, V)
        unlay = lambda o: jnp.swapaxes(o, 0, 1)  # noqa: E731
    state = pl.BlockSpec((None, None, K, V), lambda h, c, sid, *_: (sid[c], h, 0, 0))
    o, ht = pl.pallas_call(
        _kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3,
            grid=(H, NC),
            in_specs=[rows(K), rows(K), rows(V), rows(K),
                      pl.BlockSpec((None, None, 1, C), lambda h, c, *_: (h, c, 0, 0)), state],
            out_specs=[rows(V), state],
            scratch_shapes=[pltpu.VMEM((K, V), _F32)]),
        out_shape=[jax.ShapeDtypeStruct(o_shape, v.dtype),
                   jax.ShapeDtypeStruct((N, H, K, V), _F32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
        name="kda_chunk_tpu",
    )(sid, first, last, *ins, brow, h0.astype(_F32))
    has_chunks = (cs[1:] > cs[:-1])[:, None, None, None]
    return unlay(o), jnp.where(has_chunks, ht, h0.astype(_F32))
