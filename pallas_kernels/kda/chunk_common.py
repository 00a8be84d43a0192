"""Shared pieces of the chunked KDA kernels: dot helpers and precisions, the diagonal-block
column step, 16x16 unit-lower-triangular inverses, Triton compiler params and block specs."""
from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

_HI = lax.Precision.HIGHEST  # fp32 operands -> IEEE fp32 dot (no TF32); bf16 operands stay bf16
_F32 = jnp.float32
_LOG2E = math.log2(math.e)


def _exp(x):
    """exp(x) as exp2(x log2 e). Pallas' Triton lowering maps fp32 jnp.exp to libdevice's accurate
    __nv_expf (about 8 SASS instructions) and exp2 to one MUFU.EX2. The chunk kernels keep the
    cumulative gates in log2 units and call jnp.exp2 directly (FLA's choice); this is for the rest."""
    return jnp.exp2(x * _LOG2E)


# Precision of the intra kernel's fp32-operand dots. "highest": IEEE fp32 on the FMA units (the
# fp32 path; Triton's FMA dot is slow); "tf32": tensor cores, 10-bit mantissa (FLA's choice for its
# triangular solve); "bf16x3": three bf16 tensor-core dots, ~fp32 accuracy. Interpret mode on CPU
# computes all three in full fp32.
_PREC = {"highest": _HI, "tf32": lax.Precision.DEFAULT,
         "bf16x3": lax.DotAlgorithmPreset.BF16_BF16_F32_X3}


def _diag_column(j, kj, gj, qI, kI, gI, row, col, row_k, akk, aqk):
    """Column j of a diagonal block's A_kk (strictly below the diagonal) and A_qk (on and below),
    from key row j: exp(g_i - g_j) is taken only where i >= j (elsewhere it could overflow)."""
    ekj = jnp.exp2(jnp.where(row_k >= j, gI - gj[None, :], -jnp.inf)) * kj[None, :]
    ck = jnp.sum(kI * ekj, axis=1)
    cq = jnp.sum(qI * ekj, axis=1)
    akk = jnp.where((col == j) & (row > j), ck[:, None], akk)
    aqk = jnp.where((col == j) & (row >= j), cq[:, None], aqk)
    return akk, aqk


def _dot(a, b, prec=_HI):
    return jnp.dot(a, b, precision=prec, preferred_element_type=_F32)


def _dot_nt(a, b, prec=_HI):  # a @ b.T
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=prec, preferred_element_type=_F32)


def _dot_tn(a, b, prec=_HI):  # a.T @ b
    return lax.dot_general(a, b, (((0,), (0,)), ((), ())), precision=prec, preferred_element_type=_F32)


def _unit_tril_inv_power(L, row, col, prec):
    """(I + L)^-1 for strictly lower-triangular L [16, 16] as the finite Neumann product
    (I - L)(I + L^2)(I + L^4)(I + L^8) (L^16 = 0): six dots instead of 16 dependent row steps."""
    n = L.shape[0]
    assert n == 16, n
    X = (row == col).astype(_F32) - L
    P = L
    for _ in range(3):
        P = _dot(P, P, prec)
        X = X + _dot(X, P, prec)
    return X


def _unit_tril_inv(L, row, col):
    """(I + L)^-1 for strictly lower-triangular L [n, n], by forward substitution over rows."""
    n = L.shape[0]
    eye_row = lax.broadcasted_iota(jnp.int32, (n,), 0)

    def body(i, X):
        li = jnp.sum(jnp.where(row == i, L, 0.0), axis=0)  # li[j] = L[i, j]
        xi = (eye_row == i).astype(_F32) - jnp.sum(li[:, None] * X, axis=0)
        return jnp.where(row == i, xi[None, :], X)

    return lax.fori_loop(0, n, body, jnp.zeros_like(L))


def _unit_tril_inv_many(Ls, row, col, load_row=None):
    """(I + L)^-1 for several strictly lower-triangular [n, n] blocks in ONE row loop, so the
    blocks' dependent chains overlap. load_row(b, i) -> row i of block b (a load from memory is
    cheaper than picking the row out of registers, which costs a cross-lane reduction)."""
    n = Ls[0].shape[0]
    eye_row = lax.broadcasted_iota(jnp.int32, (n,), 0)

    def body(i, Xs):
        out = []
        for b, X in enumerate(Xs):
            li = (load_row(b, i) if load_row is not None
                  else jnp.sum(jnp.where(row == i, Ls[b], 0.0), axis=0))
            xi = (eye_row == i).astype(_F32) - jnp.sum(li[:, None] * X, axis=0)
            out.append(jnp.where(row == i, xi[None, :], X))
        return tuple(out)

    return list(lax.fori_loop(0, n, body, tuple(jnp.zeros_like(L) for L in Ls)))


def _compiler_params(backend, num_warps, num_stages):
    if backend == "triton":
        from jax.experimental.pallas import triton as plgpu
        return dict(compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages))
    return {}


def _real_chunks_only(kernel, programs_per_chunk=1, *, interpret=False):
    """A kernel whose grid's first axis walks laid-out chunks (programs_per_chunk programs each), with an
    extra first ref n [1] = the number of chunks real sequences use: programs past them return at once.
    Their rows are layout padding that no later stage reads (the varlen bound reserves up to N - 1 chunks
    per step that most steps leave empty: 80 chunks for 64 used at 2 x 2048 tokens, 127 for 64 at 64 x 64).
    Interpret mode runs every program: it cannot evaluate program_id inside the skip's cond (jax 0.10)."""
    def run(n_ref, *refs, **kw):
        if interpret:
            return kernel(*refs, **kw)

        @pl.when(pl.program_id(0) < n_ref[0] * programs_per_chunk)
        def _():
            kernel(*refs, **kw)
    return run


def _chunk_count(n_chunks, R, C):
    """n_chunks as the [1] int32 operand of _real_chunks_only (None: all R // C chunks)."""
    if n_chunks is None:
        return jnp.full((1,), R // C, jnp.int32)
    return jnp.asarray(n_chunks, jnp.int32).reshape(1)


def _tp(backend, num_warps, num_stages):
    return _compiler_params(backend, num_warps, num_stages)


def _rows(n, D):
    return pl.BlockSpec((n, None, D), lambda c, h: (c, h, 0))


def _brow(n):
    return pl.BlockSpec((n, None), lambda c, h: (c, h))
