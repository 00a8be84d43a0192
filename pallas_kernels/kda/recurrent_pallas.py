"""KDA decode step as a Pallas kernel: one token per sequence, states in a slot pool updated in place.

Grid (sequence n, head h, V block). Each program reads state_pool[idx[n], h, :, vblock] (fp32 [K, BV]),
applies one delta-rule step and writes it back to the same rows; the pool is aliased input->output,
so slots nobody names keep their bytes. idx[n] < 0 is padding: no state traffic, output 0.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

_F32 = jnp.float32


def _softplus(x):
    return jnp.where(x > 20.0, x, jnp.log1p(jnp.exp(jnp.minimum(x, 20.0))))


def _decode_kernel(idx_ref, q_ref, k_ref, v_ref, g_ref, b_ref, a_ref, dt_ref, pool_in_ref,
                   o_ref, pool_ref, *, scale, l2norm, gate, lower_bound, block_v):
    """Refs: idx [N] (full), q/k/g [K], v/o [BV], beta [] (scalar block), a_log [H] (full),
    dt_bias [K], pool [S, H, K, V] (full, aliased to pool_in)."""
    del pool_in_ref  # same buffer as pool_ref
    n, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    slot = idx_ref[n]

    @pl.when(slot >= 0)
    def _():
        q = q_ref[...].astype(_F32)
        k = k_ref[...].astype(_F32)
        if l2norm:
            q = q * lax.rsqrt(jnp.sum(q * q) + 1e-6)
            k = k * lax.rsqrt(jnp.sum(k * k) + 1e-6)
        g = g_ref[...].astype(_F32)
        if gate:
            x = g + dt_ref[...].astype(_F32)
            a = jnp.exp(a_ref[h].astype(_F32))
            g = -a * _softplus(x) if lower_bound is None else lower_bound * jax.nn.sigmoid(a * x)
        beta = b_ref[...].astype(_F32)
        v = v_ref[...].astype(_F32)
        vs = pl.ds(pl.multiple_of(j * block_v, block_v), block_v)
        S = pool_ref[slot, h, :, vs] * jnp.exp(g)[:, None]  # [K, BV]
        vn = beta * (v - jnp.sum(k[:, None] * S, axis=0))
        S = S + k[:, None] * vn[None, :]
        pool_ref[slot, h, :, vs] = S
        o_ref[...] = (scale * jnp.sum(q[:, None] * S, axis=0)).astype(o_ref.dtype)

    @pl.when(slot < 0)
    def _():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)


# Kernel choices (scripts/bench_kda.py sweeps them on the GPU).
CONFIG = dict(block_v=32, num_warps=4)


@functools.partial(jax.jit, static_argnames=("scale", "l2norm", "gate", "lower_bound", "block_v",
                                             "num_warps", "interpret", "backend"))
def fused_recurrent_kda_pallas(q, k, v, g, beta, state_pool, state_indices, a_log, dt_bias, *,
                               scale, l2norm=False, gate=False, lower_bound=None, block_v=32,
                               num_warps=4, interpret=False, backend="triton"):
    """q, k, g [N, H, K]; v [N, H, V]; beta [N, H]; state_pool [S, H, K, V] fp32 (aliased to the
    output: donate it in the caller's jit for an in-place update);
    state_indices int32 [N]; a_log [H] fp32; dt_bias [H, K] fp32. Returns (o [N, H, V] v.dtype,
    new state_pool)."""
    N, H, K = q.shape
    V = v.shape[-1]
    BV = min(block_v, V)
    kw = {}
    if backend == "triton":
        from jax.experimental.pallas import triton as plgpu
        kw = dict(compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1))
    vec = lambda D: pl.BlockSpec((None, None, D), lambda n, h, j: (n, h, 0))  # noqa: E731
    kern = functools.partial(_decode_kernel, scale=scale, l2norm=l2norm, gate=gate,
                             lower_bound=lower_bound, block_v=BV)
    return pl.pallas_call(
        kern,
        grid=(N, H, V // BV),
        in_specs=[pl.no_block_spec, vec(K), vec(K),
                  pl.BlockSpec((None, None, BV), lambda n, h, j: (n, h, j)), vec(K),
                  pl.BlockSpec((None, None), lambda n, h, j: (n, h)), pl.no_block_spec,
                  pl.BlockSpec((None, K), lambda n, h, j: (h, 0)), pl.no_block_spec],
        out_specs=[pl.BlockSpec((None, None, BV), lambda n, h, j: (n, h, j)), pl.no_block_spec],
        out_shape=[jax.ShapeDtypeStruct((N, H, V), v.dtype),
                   jax.ShapeDtypeStruct(state_pool.shape, state_pool.dtype)],
        input_output_aliases={8: 1},
        interpret=interpret,
        name="kda_decode",
        **kw,
    )(state_indices, q, k, v, g, beta, a_log, dt_bias, state_pool)
