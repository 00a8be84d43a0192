"""KDA decode step as a Mosaic-TPU Pallas kernel: same contract as recurrent_pallas (GPU).

Grid (sequence n, head block j), run in order ("arbitrary"). state_indices is scalar-prefetched;
the pool stays in HBM (pl.ANY, aliased input -> output) and each program DMAs its own
[hb, K, V] rows of slot idx[n] into VMEM and back, so padding rows (idx < 0) never touch slot
memory and slots nobody names keep their bytes. Three VMEM buffers pipeline the state: program t
prefetches program t+1's rows while it computes, and waits for program t-1's write-back last.

Mosaic wants (8, 128)-aligned 2-D tiles and has no cheap "lane -> sublane" move, so the per-head
vectors arrive as rows of one packed block and are turned into columns with a masked lane
reduction (exact: it only adds zeros). The math is the GPU kernel's, in fp32 on the VPU.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.tpu_vector import row as _row, lane as _lane, col as _col

_F32 = jnp.float32
_NBUF = 3


def _softplus(x):
    return jnp.where(x > 20.0, x, jnp.log1p(jnp.exp(jnp.minimum(x, 20.0))))


def _decode_kernel(idx_ref, p_ref, v_ref, gp_ref, pool_in_ref, o_ref, pool_ref, buf, rsem, wsem,
                   *, scale, l2norm, gate, lower_bound, hb):
    """idx [N] (SMEM); p [3hb+1, K]: rows q(hb), k(hb), g(hb), beta (first hb lanes);
    v/o [hb, V]; gp [hb+1, K]: dt_bias rows, a_log (first hb lanes); pool [S, H, K, V] in HBM
    (pool_in is the same buffer); buf [3, hb, K, V] VMEM; rsem/wsem DMA semaphores [3]."""
    del pool_in_ref
    n, j = pl.program_id(0), pl.program_id(1)
    N, J = pl.num_programs(0), pl.num_programs(1)
    t = n * J + j
    T = N * J

    # Steps are >= 0, so lax.div/rem (jnp's // and % lower through sign(), which needs a chip).
    def copy(step, to_vmem):
        slot = idx_ref[lax.div(step, J)]
        hbm = pool_ref.at[jnp.maximum(slot, 0), pl.ds(lax.rem(step, J) * hb, hb)]
        b = lax.rem(step, _NBUF)
        if to_vmem:
            return pltpu.make_async_copy(hbm, buf.at[b], rsem.at[b])
        return pltpu.make_async_copy(buf.at[b], hbm, wsem.at[b])

    def valid(step):
        return idx_ref[lax.div(step, J)] >= 0

    @pl.when(jnp.logical_and(t == 0, valid(0)))
    def _():
        copy(0, True).start()

    @pl.when(jnp.logical_and(t + 1 < T, valid(jnp.minimum(t + 1, T - 1))))
    def _():  # buffer (t+1) % 3 was last written back by step t-2, waited for at step t-1
        copy(t + 1, True).start()

    @pl.when(valid(t))
    def _():
        copy(t, True).wait()
        b = lax.rem(t, _NBUF)
        P = p_ref[...].astype(_F32)
        GP = gp_ref[...].astype(_F32)
        betas = _row(P, 3 * hb)
        alogs = _row(GP, hb)
        V = o_ref.shape[-1]
        o = jnp.zeros((hb, V), _F32)
        out_rows = lax.broadcasted_iota(jnp.int32, (hb, V), 0)
        vblk = v_ref[...].astype(_F32)
        for i in range(hb):
            q, k, g = _row(P, i), _row(P, hb + i), _row(P, 2 * hb + i)   # [1, K]
            if l2norm:
                q = q * lax.rsqrt(jnp.sum(q * q, axis=1, keepdims=True) + 1e-6)
                k = k * lax.rsqrt(jnp.sum(k * k, axis=1, keepdims=True) + 1e-6)
            if gate:
                x = g + _row(GP, i)
                a = jnp.exp(_lane(alogs, i))
                g = -a * _softplus(x) if lower_bound is None else lower_bound * jax.nn.sigmoid(a * x)
            kc, qc = _col(k), _col(q)                                        # [K, 1]
            S = buf[b, i] * jnp.exp(_col(g))                                 # [K, V]
            u = _lane(betas, i) * (_row(vblk, i) - jnp.sum(kc * S, axis=0, keepdims=True))
            S = S + kc * u
            buf[b, i] = S
            oi = scale * jnp.sum(qc * S, axis=0, keepdims=True)              # [1, V]
            o = jnp.where(out_rows == i, jnp.broadcast_to(oi, (hb, V)), o)
        o_ref[...] = o.astype(o_ref.dtype)
        copy(t, False).start()

    @pl.when(jnp.logical_not(valid(t)))
    def _():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)

    @pl.when(jnp.logical_and(t > 0, valid(jnp.maximum(t - 1, 0))))
    def _():
        copy(t - 1, False).wait()

    @pl.when(jnp.logical_and(t == T - 1, valid(t)))
    def _():
        copy(t, False).wait()


def _head_block(H, K, want):
    """Largest divisor of H that is <= want and <= K (beta / a_log ride in one K-wide row)."""
    return max(d for d in range(1, min(H, want, K) + 1) if H % d == 0)


# Kernel choices: heads per program (state block hb*K*V*4 bytes, x3 buffers in VMEM).
CONFIG = dict(block_h=8)


@functools.partial(jax.jit, static_argnames=("scale", "l2norm", "gate", "lower_bound", "block_h",
                                             "interpret"))
def fused_recurrent_kda_tpu(q, k, v, g, beta, state_pool, state_indices, a_log, dt_bias, *,
                            scale, l2norm=False, gate=False, lower_bound=None, block_h=8,
                            interpret=False):
    """q, k, g [N, H, K]; v [N, H, V]; beta [N, H]; state_pool [S, H, K, V] fp32 (aliased to the
    output: donate it in the caller's jit for an in-place update); state_indices int32 [N]
    (negative = padding; valid entries must be distinct); a_log [H] fp32; dt_bias [H, K] fp32.
    Returns (o [N, H, V] v.dtype, new state_pool)."""
    N, H, K = q.shape
    V = v.shape[-1]
    if state_pool.shape[1:] != (H, K, V) or state_pool.dtype != _F32:
        raise ValueError(f"state_pool {state_pool.shape} {state_pool.dtype}: expected [S, {H}, {K}, "
                         f"{V}] float32")
    hb = _head_block(H, K, block_h)
    J = H // hb
    f32 = lambda x: x.astype(_F32).reshape(N, J, hb, K)  # noqa: E731
    brow = jnp.pad(beta.astype(_F32).reshape(N, J, 1, hb), [(0, 0)] * 3 + [(0, K - hb)])
    packed = jnp.concatenate([f32(q), f32(k), f32(g), brow], axis=2)      # [N, J, 3hb+1, K]
    arow = jnp.pad(a_log.astype(_F32).reshape(J, 1, hb), [(0, 0), (0, 0), (0, K - hb)])
    gparams = jnp.concatenate([dt_bias.astype(_F32).reshape(J, hb, K), arow], axis=1)  # [J, hb+1, K]
    kern = functools.partial(_decode_kernel, scale=scale, l2norm=l2norm, gate=gate,
                             lower_bound=lower_bound, hb=hb)
    hv = pl.BlockSpec((None, None, hb, V), lambda n, j, idx: (n, j, 0, 0))
    o, pool = pl.pallas_call(
        kern,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(N, J),
            in_specs=[pl.BlockSpec((None, None, 3 * hb + 1, K), lambda n, j, idx: (n, j, 0, 0)),
                      hv,
                      pl.BlockSpec((None, hb + 1, K), lambda n, j, idx: (j, 0, 0)),
                      pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=[hv, pl.BlockSpec(memory_space=pl.ANY)],
            scratch_shapes=[pltpu.VMEM((_NBUF, hb, K, V), _F32),
                            pltpu.SemaphoreType.DMA((_NBUF,)), pltpu.SemaphoreType.DMA((_NBUF,))]),
        out_shape=[jax.ShapeDtypeStruct((N, J, hb, V), v.dtype),
                   jax.ShapeDtypeStruct(state_pool.shape, state_pool.dtype)],
        input_output_aliases={4: 1},   # operands: idx, packed, v, gparams, pool
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary", "arbitrary")),
        interpret=interpret,
        name="kda_decode_tpu",
    )(state_indices.astype(jnp.int32), packed, v.reshape(N, J, hb, V), gparams, state_pool)
    return o.reshape(N, H, V), pool
