"""KDA states after each of the first W tokens of a chunk (speculative verification).

A verify chunk feeds a sequence's last token and its K drafts (W = K + 1 tokens). Which of its
W states the sequence continues from is known only after the step, so every position's
recurrent state and conv window is written to a slot of its own (StepBatch.spec_dst) and the
host keeps the accepted one: no recompute, no copy. The states come from the decode recurrence,
token by token (the arithmetic of a decode step), and so do the chunk's attention outputs at
these positions: the tokens a verify step accepts are the ones plain decoding would produce.
"""
from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels import ops
from pallas_kernels.scatter import set_rows, value_dtype


def write_position_states(state_pool, conv_pool, o, s0, conv0, x_in, q, k, v, g, beta, meta, *, scale,
                          backend, act_dtype):
    """Run the recurrence over each sequence's first W tokens from s0 and write position j's state to
    meta["spec_dst"][n, j] (a flat pool row; negative = not kept).

    o [T, H, V] the chunk's outputs (replaced at the kept positions); s0 [N, H, K, V] and conv0
    [N, Kc-1, C] the states before the chunk; x_in [T, C] the conv inputs; q, k, g [T, H, K], v
    [T, H, V], beta [T, H]. Returns (state_pool, conv_pool, o)."""
    dst = meta["spec_dst"]
    cu = meta["cu_seqlens"]
    n, w = dst.shape
    T = q.shape[0]
    lens = cu[1:] - cu[:-1]
    pos = jnp.arange(w, dtype=jnp.int32)[None]
    keep = (dst >= 0) & (pos < lens[:, None])                         # [N, W]
    idx = jnp.clip(cu[:-1, None] + pos, 0, T - 1)                     # flat token of position j
    rows = jnp.arange(n, dtype=jnp.int32)
    states = s0
    kc1 = conv0.shape[1]
    window = jnp.concatenate([conv0, x_in[idx].astype(conv0.dtype)], axis=1)   # [N, Kc-1+W, C]
    cdt = value_dtype(conv_pool, act_dtype)
    for j in range(w):
        t = idx[:, j]
        ok = keep[:, j]
        oj, states = ops.kda_decode(q[t], k[t], v[t], g[t], beta[t], states, jnp.where(ok, rows, -1),
                                    scale=scale, backend=backend)
        o = o.at[jnp.where(ok, t, T)].set(oj.astype(o.dtype), mode="drop")
        at = jnp.where(ok, dst[:, j], state_pool.shape[0])
        state_pool = set_rows(state_pool, at, states, mode="drop")
        conv_pool = set_rows(conv_pool, jnp.where(ok, dst[:, j], conv_pool.shape[0]),
                             window[:, j + 1:j + 1 + kc1].astype(cdt), mode="drop")
    return state_pool, conv_pool, o
