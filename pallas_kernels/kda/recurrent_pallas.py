"""KDA decode step as a Pallas kernel: one token per sequence, states in a slot pool updated in place.

Grid over (sequence n, head group h, V block j); `order` says which is fastest (the first letter
is CUDA's x, launched first). Each program reads state_pool[idx[n], h*BH:(h+1)*BH, :, vblock]
(fp32 [K, BV] per head), applies one delta-rule step and writes it back to the same rows; the pool
is aliased input->output, so slots nobody names keep their bytes. idx[n] < 0 is padding: no state
traffic, output 0.

Why order "vhn" (V block fastest, like FLA's 1-D grid): the programs that run side by side then
cover one head's [K, V] tile and the next heads of the same slot, i.e. consecutive memory. With
the sequence fastest ("nhv", the first version) neighbours hit different slots 128 B at a time and
the kernel stopped near 70% of copy bandwidth; "vhn" with 64-wide V blocks reaches 82-86%
(docs/performance.md, "Tuning of record").
BV 16 and 8 warps were slower; 2 heads per program, num_stages=2 and an evict_first hint (since
removed) changed < 2%.
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


def _delta_step(S, q, k, v, g, beta, scale):
    """One token of the gated delta rule on a [K, BV] fp32 state tile: (new state, output [BV] fp32). Both
    kernels below run exactly these operations, so a token rounds the same in either."""
    S = S * jnp.exp(g)[:, None]
    vn = beta * (v - jnp.sum(k[:, None] * S, axis=0))
    S = S + k[:, None] * vn[None, :]
    return S, scale * jnp.sum(q[:, None] * S, axis=0)


def _decode_kernel(idx_ref, q_ref, k_ref, v_ref, g_ref, b_ref, a_ref, dt_ref, pool_in_ref,
                   o_ref, pool_ref, *, scale, l2norm, gate, lower_bound, block_v, block_h,
                   order):
    """Refs: idx [N] (full), q/k/g/dt [BH, K], v/o [BH, BV], beta [BH], a_log [H] (full),
    pool [S, H, K, V] (full, aliased to pool_in)."""
    del pool_in_ref  # same buffer as pool_ref
    n, hb, j = (pl.program_id(order.index(c)) for c in "nhv")
    slot = idx_ref[n]
    vs = pl.ds(pl.multiple_of(j * block_v, block_v), block_v)

    @pl.when(slot >= 0)
    def _():
        for i in range(block_h):  # static: BH independent 2-D tiles, no 3-D layouts
            h = hb * block_h + i
            q = q_ref[i, :].astype(_F32)
            k = k_ref[i, :].astype(_F32)
            if l2norm:
                q = q * lax.rsqrt(jnp.sum(q * q) + 1e-6)
                k = k * lax.rsqrt(jnp.sum(k * k) + 1e-6)
            g = g_ref[i, :].astype(_F32)
            if gate:
                x = g + dt_ref[i, :].astype(_F32)
                a = jnp.exp(a_ref[h].astype(_F32))
                g = -a * _softplus(x) if lower_bound is None else lower_bound * jax.nn.sigmoid(a * x)
            beta = b_ref[i].astype(_F32)
            v = v_ref[i, :].astype(_F32)
            S, o = _delta_step(pool_ref[slot, h, :, vs], q, k, v, g, beta, scale)
            pool_ref[slot, h, :, vs] = S
            o_ref[i, :] = o.astype(o_ref.dtype)

    @pl.when(slot < 0)
    def _():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)


def _grid_setup(V, block_v, order, backend, num_warps, num_stages):
    """(V block width, pallas_call keyword arguments) of both kernels' grids, after checking order and block_v."""
    if sorted(order) != ["h", "n", "v"]:
        raise ValueError(f"order must be a permutation of 'nhv', got {order!r}")
    BV = min(block_v, V)
    if V % BV:
        raise ValueError(f"V={V} is not a multiple of block_v={BV}")
    kw = {}
    if backend == "triton":
        from jax.experimental.pallas import triton as plgpu
        kw = dict(compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages))
    return BV, kw


# Kernel choices (benchmarks/bench_kernels.py times the variants beside them on the GPU).
# (block_h stays 1: 2 heads a program measured no faster)
CONFIG = dict(block_v=64, num_warps=4, order="vhn")


@functools.partial(jax.jit, static_argnames=("scale", "l2norm", "gate", "lower_bound", "block_v",
                                             "num_warps", "num_stages", "block_h", "order",
                                             "interpret", "backend"))
def fused_recurrent_kda_pallas(q, k, v, g, beta, state_pool, state_indices, a_log, dt_bias, *,
                               scale, l2norm=False, gate=False, lower_bound=None, block_v=64,
                               num_warps=4, num_stages=1, block_h=1, order="vhn",
                               interpret=False, backend="triton"):
    """q, k, g [N, H, K]; v [N, H, V]; beta [N, H]; state_pool [S, H, K, V] fp32 (aliased to the
    output: donate it in the caller's jit for an in-place update);
    state_indices int32 [N]; a_log [H] fp32; dt_bias [H, K] fp32. Returns (o [N, H, V] v.dtype,
    new state_pool). block_h heads per program (halved until it divides H); order: grid axes
    fastest first, a permutation of "nhv"."""
    N, H, K = q.shape
    V = v.shape[-1]
    BV, kw = _grid_setup(V, block_v, order, backend, num_warps, num_stages)
    BH = max(1, min(block_h, H))
    while H % BH:
        BH //= 2
    sizes = dict(n=N, h=H // BH, v=V // BV)
    pos = {c: order.index(c) for c in "nhv"}

    def spec(shape, fn):  # fn(n, h, j) -> block index; grid ids arrive in `order`
        return pl.BlockSpec(shape, lambda *ids: fn(ids[pos["n"]], ids[pos["h"]], ids[pos["v"]]))

    vec = lambda D: spec((None, BH, D), lambda n, h, j: (n, h, 0))  # noqa: E731
    vblk = spec((None, BH, BV), lambda n, h, j: (n, h, j))
    kern = functools.partial(_decode_kernel, scale=scale, l2norm=l2norm, gate=gate,
                             lower_bound=lower_bound, block_v=BV, block_h=BH, order=order)
    return pl.pallas_call(
        kern,
        grid=tuple(sizes[c] for c in order),
        in_specs=[pl.no_block_spec, vec(K), vec(K), vblk, vec(K),
                  spec((None, BH), lambda n, h, j: (n, h)), pl.no_block_spec,
                  spec((BH, K), lambda n, h, j: (h, 0)), pl.no_block_spec],
        out_specs=[vblk, pl.no_block_spec],
        out_shape=[jax.ShapeDtypeStruct((N, H, V), v.dtype),
                   jax.ShapeDtypeStruct(state_pool.shape, state_pool.dtype)],
        input_output_aliases={8: 1},
        interpret=interpret,
        name="kda_decode",
        **kw,
    )(state_indices, q, k, v, g, beta, a_log, dt_bias, state_pool)


def _positions_kernel(run_ref, dst_ref, q_ref, k_ref, v_ref, g_ref, b_ref, s0_ref, pool_in_ref,
                      o_ref, last_ref, pool_ref, *, scale, width, block_v, order):
    """W tokens of one sequence in order, the state tile kept in registers between them. Refs (all full):
    run / dst [N, W]; q, k, g [N, W, H, K]; v [N, W, H, V]; beta [N, W, H]; s0 [N, H, K, V]; outputs o
    [N, W, H, V], last [N, H, K, V] and the pool [S, H, K, V] (aliased to pool_in)."""
    del pool_in_ref  # same buffer as pool_ref
    n, h, j = (pl.program_id(order.index(c)) for c in "nhv")
    vs = pl.ds(pl.multiple_of(j * block_v, block_v), block_v)
    S = s0_ref[n, h, :, vs]
    for t in range(width):    # static: the chunk's positions
        ok = run_ref[n, t] != 0
        S_t, o = _delta_step(S, q_ref[n, t, h, :].astype(_F32), k_ref[n, t, h, :].astype(_F32),
                             v_ref[n, t, h, vs].astype(_F32), g_ref[n, t, h, :].astype(_F32),
                             b_ref[n, t, h].astype(_F32), scale)
        o_ref[n, t, h, vs] = jnp.where(ok, o, 0.0).astype(o_ref.dtype)
        S = jnp.where(ok, S_t, S)
        row = dst_ref[n, t]

        @pl.when(ok & (row >= 0))
        def _():
            pool_ref[row, h, :, vs] = S
    last_ref[n, h, :, vs] = S


@functools.partial(jax.jit, static_argnames=("scale", "block_v", "num_warps", "num_stages", "order",
                                             "interpret", "backend"))
def fused_recurrent_kda_positions_pallas(q, k, v, g, beta, state_pool, initial_state, run, dst, *, scale,
                                         block_v=64, num_warps=4, num_stages=1, block_h=1, order="vhn",
                                         interpret=False, backend="triton"):
    """The decode step for each of a chunk's W tokens in one launch (speculative verification): q, k, g
    [N, W, H, K]; v [N, W, H, V]; beta [N, W, H]; initial_state [N, H, K, V] fp32; run [N, W] int32 (position
    t computed when nonzero; the positions a sequence runs come first); dst [N, W] int32 (the pool row that
    takes the state after position t; negative: none); state_pool [S, H, K, V] fp32, aliased to the output
    (donate it). Returns (o [N, W, H, V] in v.dtype, 0 where not run; the state after each sequence's last
    run position [N, H, K, V]; the pool). Every token is `_delta_step` on the same tile as the decode
    kernel's, so each position's output and state are the decode step's. Rows named in dst must not be
    rows another sequence reads (initial_state is an array, so none is read from the pool). block_h is
    accepted for CONFIG's sake and must be 1."""
    if block_h != 1:
        raise ValueError("the positions kernel runs one head a program")
    N, W, H, K = q.shape
    V = v.shape[-1]
    BV, kw = _grid_setup(V, block_v, order, backend, num_warps, num_stages)
    sizes = dict(n=N, h=H, v=V // BV)
    kern = functools.partial(_positions_kernel, scale=scale, width=W, block_v=BV, order=order)
    full = pl.no_block_spec
    return pl.pallas_call(
        kern,
        grid=tuple(sizes[c] for c in order),
        in_specs=[full] * 9,
        out_specs=[full] * 3,
        out_shape=[jax.ShapeDtypeStruct((N, W, H, V), v.dtype),
                   jax.ShapeDtypeStruct((N, H, K, V), jnp.float32),
                   jax.ShapeDtypeStruct(state_pool.shape, state_pool.dtype)],
        input_output_aliases={8: 2},
        interpret=interpret,
        name="kda_decode_positions",
        **kw,
    )(run, dst, q, k, v, g, beta, initial_state.astype(jnp.float32), state_pool)
