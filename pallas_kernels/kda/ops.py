"""Public KDA ops: pick the Pallas kernel (GPU: Triton backend, TPU: Mosaic) or the jnp reference (CPU).

interpret=None: GPU -> compiled Triton kernels, TPU -> compiled Mosaic kernels, CPU -> pure-jnp
reference.
interpret=True: the Pallas kernels in interpret mode (any platform; used by the CPU tests).
interpret=False: compiled kernels on GPU / TPU, the reference elsewhere.
platform (chunk_kda, fused_recurrent_kda): the target these choices are made for (None: the default backend);
a step's Backend passes its own, so a step lowered for the GPU on another host gets the GPU's kernels.
TPU: the GPU chunk kernels' per-head (C, None, K) blocks break Mosaic's (8, 128) block rule, so
prefill has its own Mosaic kernel over an [H, R, K] layout (chunk_tpu.py), and the decode step its
own too (recurrent_tpu.py). chunk_kda / fused_recurrent_kda run them whenever the target platform
is TPU (compiled, or interpreted with interpret=True; platform="tpu" lets CPU tests pick them).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.kda.chunk_pallas import chunk_cumsum, chunk_kda_laid_out
from pallas_kernels.kda import chunk_tpu
from pallas_kernels.kda import recurrent_pallas
from pallas_kernels.kda.recurrent_pallas import fused_recurrent_kda_pallas, fused_recurrent_kda_positions_pallas
from pallas_kernels.kda import recurrent_tpu
from pallas_kernels.kda.reference import (
    chunk_kda_reference, decode_positions_by_steps, decode_reference, kda_gate, l2norm, varlen_chunk_layout)

_CHUNK = 64


def _mode(interpret, platform=None):
    if interpret:
        return "interpret"
    if (platform or jax.default_backend()) == "gpu":
        return "triton"
    return "reference"


def _dot_dtype(x):
    return x.dtype if x.dtype in (jnp.bfloat16, jnp.float16) else jnp.float32


def chunk_kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=True,
              cu_seqlens=None, use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None,
              dt_bias=None, lower_bound=None, safe_gate=None, interpret=None, platform=None):
    """Chunked KDA prefill.

    q, k [B, T, H, K]; v [B, T, H, V]; g [B, T, H, K] (log-space decay, or the raw f projection
    when use_gate_in_kernel, then A_log [H] | [1,1,H,1] | [>=H], dt_bias [H*K] | [H, K] and
    lower_bound select the gate formula); beta [B, T, H]; initial_state [N, H, K, V] fp32
    (None = zeros); cu_seqlens int32 [N+1] (B == 1) or None (N = B).
    safe_gate: the caller guarantees every decay g >= -5 (K3's gate), which enables a faster
    kernel path; None = True exactly when the in-kernel gate has lower_bound >= -5.
    platform: the backend to target (None = jax.default_backend()); "tpu" runs the Mosaic kernel.
    Returns (o [B, T, H, V] in v.dtype, final_state [N, H, K, V] fp32 or None).
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q).astype(_dot_dtype(q)), l2norm(k).astype(_dot_dtype(k))
    tpu = (platform or jax.default_backend()) == "tpu"
    mode = _mode(interpret, platform)
    if mode == "reference" and not tpu:
        if use_gate_in_kernel:
            g = kda_gate(g, A_log, dt_bias, lower_bound=lower_bound)
        g = g.astype(jnp.float32) if g.dtype != jnp.float64 else g
        o, ht = chunk_kda_reference(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                    cu_seqlens=cu_seqlens, chunk_size=_CHUNK)
        return o, (ht.astype(jnp.float32) if output_final_state else None)

    if tpu and use_gate_in_kernel:  # the TPU kernel takes gated decays: gate in XLA, before layout
        g = kda_gate(g, A_log, dt_bias, lower_bound=lower_bound)
    if safe_gate is None:
        safe_gate = bool(use_gate_in_kernel and lower_bound is not None and lower_bound >= -5.0)
    C = _CHUNK
    scale = K ** -0.5 if scale is None else scale
    sd = _dot_dtype(q)
    qs = (q.astype(jnp.float32) * scale).astype(sd)
    xs = [qs, k.astype(sd), v, g.astype(jnp.float32), beta.astype(jnp.float32),
          jnp.ones((B, T), jnp.float32)]
    if cu_seqlens is None:
        N, TP = B, -(-T // C) * C
        xs = [jnp.pad(x, [(0, 0), (0, TP - T)] + [(0, 0)] * (x.ndim - 2)) for x in xs]
        xs = [x.reshape((B * TP,) + x.shape[2:]) for x in xs]
        cs = (jnp.arange(B + 1, dtype=jnp.int32) * (TP // C))
        lay = None
    else:
        if B != 1:
            raise ValueError("cu_seqlens requires B == 1")
        cu = jnp.asarray(cu_seqlens).astype(jnp.int32)
        N = cu.shape[0] - 1
        lay = varlen_chunk_layout(cu, T, C)
        xs = [lay.gather(x[0]) for x in xs]
        xs = [x.reshape((-1,) + x.shape[2:]) for x in xs]
        cs = lay.cs
    R = xs[0].shape[0]
    h0 = (jnp.zeros((N, H, K, V), jnp.float32) if initial_state is None
          else initial_state.astype(jnp.float32))
    if tpu:  # padding rows carry g = 0 (zero-padded after the gate), as the kernel requires
        o, ht = chunk_tpu.chunk_kda_laid_out_tpu(xs[0], xs[1], xs[2], xs[3], xs[4], cs, h0,
                                                 chunk_size=C, interpret=bool(interpret))
    else:
        a, dt = _gate_params(A_log, dt_bias, H, K)
        kern = dict(interpret=(mode == "interpret"), backend=mode)
        gc = chunk_cumsum(xs[3], xs[5], a, dt, chunk_size=C, gate=bool(use_gate_in_kernel),
                          lower_bound=lower_bound, n_chunks=cs[-1:], **kern)
        o, ht = chunk_kda_laid_out(xs[0], xs[1], xs[2], gc, xs[4], cs, h0, chunk_size=C,
                                   safe_gate=safe_gate, **kern)
    if lay is None:
        o = o.reshape(B, R // B, H, V)[:, :T]
    else:
        o = lay.scatter(o)[None]
    return o, (ht if output_final_state else None)


def _gate_params(A_log, dt_bias, H, K):
    a = (jnp.zeros((H,), jnp.float32) if A_log is None
         else A_log.astype(jnp.float32).reshape(-1)[:H])
    dt = (jnp.zeros((H, K), jnp.float32) if dt_bias is None
          else dt_bias.astype(jnp.float32).reshape(H, K))
    return a, dt


def fused_recurrent_kda(q, k, v, g, beta, state_pool, state_indices, *, scale=None,
                        use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None,
                        dt_bias=None, lower_bound=None, interpret=None, platform=None):
    """One decode token per sequence against a pool of states.

    q, k, g [N, H, K]; v [N, H, V]; beta [N, H]; state_pool [num_slots, H, K, V] fp32;
    state_indices int32 [N] (negative = padding: no state touched, output 0).
    platform: the backend to target (None = jax.default_backend()); "tpu" runs the Mosaic kernel.
    Returns (o [N, H, V] in v.dtype, new_state_pool). Rows not named in state_indices are
    returned bit-identical; donate state_pool in the caller's jit for an in-place update.
    """
    N, H, K = q.shape
    scale = K ** -0.5 if scale is None else scale
    if (platform or jax.default_backend()) == "tpu":
        a, dt = _gate_params(A_log, dt_bias, H, K)
        return recurrent_tpu.fused_recurrent_kda_tpu(
            q, k, v, g, beta, state_pool, state_indices.astype(jnp.int32), a, dt, scale=scale,
            l2norm=use_qk_l2norm_in_kernel, gate=use_gate_in_kernel, lower_bound=lower_bound,
            interpret=bool(interpret), **recurrent_tpu.CONFIG)
    mode = _mode(interpret, platform)
    if mode != "reference":
        a, dt = _gate_params(A_log, dt_bias, H, K)
        return fused_recurrent_kda_pallas(
            q, k, v, g, beta, state_pool, state_indices.astype(jnp.int32), a, dt, scale=scale,
            l2norm=use_qk_l2norm_in_kernel, gate=use_gate_in_kernel, lower_bound=lower_bound,
            interpret=(mode == "interpret"), backend=mode, **recurrent_pallas.CONFIG)
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    if use_gate_in_kernel:
        g = kda_gate(g, A_log, dt_bias, lower_bound=lower_bound)
    return decode_reference(q, k, v, g, beta, state_pool, state_indices, scale=scale)


def fused_recurrent_kda_positions(q, k, v, g, beta, state_pool, initial_state, run, dst, *, scale=None,
                                  interpret=None, platform=None):
    """Each sequence's first W tokens decoded in order from initial_state, the state after every position t
    written to pool row dst[n, t] (speculative verification: K + 1 tokens, a state kept per position).

    q, k, g [N, W, H, K] (gated g, l2-normalised q / k); v [N, W, H, V]; beta [N, W, H]; initial_state
    [N, H, K, V]; run [N, W] bool (the positions computed, a prefix of each row); dst [N, W] int32 (negative:
    not written). Returns (o [N, W, H, V] in v.dtype, 0 where not run; the state after each sequence's last
    run position [N, H, K, V] fp32; the pool). Each token is the decode step's arithmetic: the GPU runs one
    kernel for all positions (recurrent_pallas), other targets the decode op W times."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    mode = _mode(interpret, platform)
    if (platform or jax.default_backend()) != "tpu" and mode != "reference":
        return fused_recurrent_kda_positions_pallas(
            q, k, v, g, beta, state_pool, initial_state, run.astype(jnp.int32), dst.astype(jnp.int32),
            scale=scale, interpret=(mode == "interpret"), backend=mode, **recurrent_pallas.CONFIG)
    step = lambda q, k, v, g, b, s, i: fused_recurrent_kda(q, k, v, g, b, s, i, scale=scale,  # noqa: E731
                                                           interpret=interpret, platform=platform)
    return decode_positions_by_steps(step, q, k, v, g, beta, state_pool, initial_state.astype(jnp.float32),
                                     run, dst)
