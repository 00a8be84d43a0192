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
    state_pool, conv_pool, o, _ = _recurrence(state_pool, conv_pool, o, s0, conv0, x_in, q, k, v, g, beta, meta,
                                              every_token=False, scale=scale, backend=backend, act_dtype=act_dtype)
    return state_pool, conv_pool, o


def recurrent_step(state_pool, conv_pool, conv_new, s0, conv0, x_in, q, k, v, g, beta, meta, *, scale, backend,
                   act_dtype):
    """A verification step of short chunks (StepBatch.verify_only: every chunk at most W tokens) without the
    chunk kernel: every token's output and state from the decode recurrence, position j's state written to
    meta["spec_dst"][n, j] where kept, and each chunk's last state and conv window (conv_new [N, Kc-1, C], from
    the step's conv) to its state_dst and ckpt_dst, as the chunk path writes them. Returns (state_pool,
    conv_pool, o [T, H, V])."""
    o = jnp.zeros(v.shape, v.dtype)
    state_pool, conv_pool, o, last = _recurrence(state_pool, conv_pool, o, s0, conv0, x_in, q, k, v, g, beta, meta,
                                                 every_token=True, scale=scale, backend=backend, act_dtype=act_dtype)
    cdt = value_dtype(conv_pool, act_dtype)
    for dst in (meta["state_dst"], meta["ckpt_dst"]):
        state_pool = set_rows(state_pool, dst, last)
        conv_pool = set_rows(conv_pool, dst, conv_new.astype(cdt))
    return state_pool, conv_pool, o


def _recurrence(state_pool, conv_pool, o, s0, conv0, x_in, q, k, v, g, beta, meta, *, every_token, scale, backend,
                act_dtype):
    """The decode recurrence over each sequence's first W tokens (W = spec_dst's width): the output of every
    computed position into o, its state and conv window into spec_dst's kept slots. Computed: the kept positions,
    or with every_token every token of the chunk. One gather of the positions' inputs, one recurrence op for all
    of them (a kernel launch on the GPU), one write each of outputs and conv windows. Returns (state_pool,
    conv_pool, o, each sequence's state after its last computed token [N, H, K, V])."""
    dst = meta["spec_dst"]
    cu = meta["cu_seqlens"]
    n, w = dst.shape
    T = q.shape[0]
    lens = cu[1:] - cu[:-1]
    pos = jnp.arange(w, dtype=jnp.int32)[None]
    inside = pos < lens[:, None]
    kept = (dst >= 0) & inside                                        # [N, W]
    run = inside if every_token else kept
    idx = jnp.clip(cu[:-1, None] + pos, 0, T - 1)                     # flat token of position j
    o_pos, last, state_pool = ops.kda_decode_positions(q[idx], k[idx], v[idx], g[idx], beta[idx], state_pool, s0,
                                                       run, jnp.where(kept, dst, -1), scale=scale, backend=backend)
    o = o.at[jnp.where(run, idx, T)].set(o_pos.astype(o.dtype), mode="drop")
    kc1 = conv0.shape[1]
    window = jnp.concatenate([conv0, x_in[idx].astype(conv0.dtype)], axis=1)   # [N, Kc-1+W, C]
    windows = window[:, pos[0][:, None] + 1 + jnp.arange(kc1)]                  # [N, W, Kc-1, C]: after position j
    cdt = value_dtype(conv_pool, act_dtype)
    at = jnp.where(kept, dst, conv_pool.shape[0]).reshape(-1)
    conv_pool = set_rows(conv_pool, at, windows.reshape((n * w,) + windows.shape[2:]).astype(cdt), mode="drop")
    return state_pool, conv_pool, o, last
