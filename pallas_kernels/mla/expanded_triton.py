"""Pallas (Triton backend) varlen causal flash attention for MLA prefill in expanded form.

Queries are flat ``[T, H, Dn + Dr]`` (ragged: a step's sequences one after another); keys and
values are the decompressed caches of those sequences laid out flat in a key buffer
``[K, H, Dn + Dv]`` (kv_b_proj's output as it comes), the rope key in the last Dr columns of the
latent rows ``[K, L + Dr]`` (one per token, shared by all heads). Sequence n's positions
0..kv_len-1 sit at ``kv_start[n]``; a query at cache position p sees keys 0..p of its own
sequence (its cached context plus its chunk, causally). Reading the column ranges in the kernel
saves XLA copying out the slices.

Heads: 128 nope + 64 rope for q.k (two MMAs: Triton blocks must be powers of two, 192 is not)
and 128 for v.

The key buffer may be a window of a longer key space (long contexts are attended block by block,
pallas_kernels/mla/long_prefix.py): a sequence's position 0 may sit before the buffer (negative
kv_start) and its keys may run past it; only rows 0..window-1 are read. Each call returns the
log-sum-exp of every row's scores with its output, so windows merge exactly (online softmax).

Grid = (tiles, heads): a tile is <= bq query tokens of one sequence (meta row: first token,
n_valid, cache position of the first token, the sequence's kv_start). Each program walks key
blocks from its first key in the buffer to the last visible key of the tile, so causal blocks past
the diagonal are skipped: first the blocks every row sees whole (no masks), then the diagonal
blocks and the window's end (masked; keys past them are masked loads that read zeros).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.mla.triton_kernel import _LOG2E, _MASK, online_softmax

_LN2 = 0.6931471805599453


def _kernel(meta_ref, q_ref, kv_ref, lat_ref, o_ref, lse_ref, *, bq, bk, dn, dr, dv, lat, window, scale,
            split_causal):
    tile = pl.program_id(0)
    first = meta_ref[tile, 0]
    n_valid = meta_ref[tile, 1]
    pos0 = meta_ref[tile, 2]
    kv_start = meta_ref[tile, 3]   # buffer row of the sequence's position 0 (< 0: it began in an earlier window)

    r = jnp.arange(bq, dtype=jnp.int32)
    row_ok = r < n_valid
    pos = pos0 + r  # causal limit of each query row
    q_rows = pl.ds(first, bq)
    qn = plgpu.load(q_ref.at[q_rows, pl.ds(0, dn)], mask=row_ok[:, None], other=0)
    qr = plgpu.load(q_ref.at[q_rows, pl.ds(dn, dr)], mask=row_ok[:, None], other=0)

    # the tile's keys, as positions of its sequence: those the buffer holds (rows 0..window-1)
    # up to the last row's position
    p_lo = jnp.maximum(-kv_start, 0)
    p_hi = jnp.minimum(pos0 + n_valid, window - kv_start)  # exclusive
    n_blocks = jnp.maximum(pl.cdiv(p_hi - p_lo, bk), 0)
    qk_scale = scale * _LOG2E
    kdt = kv_ref.dtype
    nope_cols, v_cols, rope_cols = pl.ds(0, dn), pl.ds(dn, dv), pl.ds(lat, dr)

    def block(i, carry, masked):
        acc, m, l = carry
        k0 = p_lo + i * bk
        keys = k0 + jnp.arange(bk, dtype=jnp.int32)
        k_rows = pl.ds(kv_start + k0, bk)
        if masked:  # keys past the window or the tile read zeros; the causal mask cuts the diagonal
            in_range = keys < p_hi
            ok = in_range[:, None]
            kn = plgpu.load(kv_ref.at[k_rows, nope_cols], mask=ok, other=0)
            kr = plgpu.load(lat_ref.at[k_rows, rope_cols], mask=ok, other=0)
            v = plgpu.load(kv_ref.at[k_rows, v_cols], mask=ok, other=0)
            visible = (keys[None, :] <= pos[:, None]) & in_range[None, :]
        else:       # every key of the block is visible to every row
            kn, kr, v = kv_ref[k_rows, nope_cols], lat_ref[k_rows, rope_cols], kv_ref[k_rows, v_cols]
            visible = None
        s = plgpu.dot(qn, kn, trans_b=True) + plgpu.dot(qr, kr, trans_b=True)
        p, alpha, m_new, l_new = online_softmax(s, visible, qk_scale, m, l)
        if masked:  # a row that has seen no key yet (m at the mask value) must add nothing
            p = jnp.where(visible, p, 0.0)
            l_new = l * alpha + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + plgpu.dot(p.astype(kdt), v)
        return acc, m_new, l_new

    carry = (jnp.zeros((bq, dv), jnp.float32), jnp.full((bq,), _MASK, jnp.float32),
             jnp.zeros((bq,), jnp.float32))
    # blocks whose last key is <= the first row's position (and inside the window) need no mask
    # (the context and the chunk's earlier tiles); the rest (the diagonal, the window's end) are masked
    n_full = jnp.clip((jnp.minimum(pos0 + 1, p_hi) - p_lo) // bk, 0, n_blocks) if split_causal else 0
    carry = jax.lax.fori_loop(0, n_full, functools.partial(block, masked=False), carry)
    acc, m, l = jax.lax.fori_loop(n_full, n_blocks, functools.partial(block, masked=True), carry)
    seen = l > 0
    o = acc / jnp.where(seen, l, 1.0)[:, None]
    lse = jnp.where(seen, (m + jnp.log2(jnp.where(seen, l, 1.0))) * _LN2, -jnp.inf)  # natural log
    plgpu.store(o_ref.at[q_rows, :], o.astype(o_ref.dtype), mask=row_ok[:, None])
    plgpu.store(lse_ref.at[q_rows], lse, mask=row_ok)


def varlen_attention_call(meta, q, kv, latents, *, nope_dim, scale, bq, bk, window=None, num_warps=4,
                          num_stages=2, split_causal=True, out_dtype=None, interpret=False):
    """Run the kernel over a tile schedule.

    meta [G, 4] int32 per tile (first token, n_valid, pos of first token, kv_start: the buffer row of
    the sequence's position 0, negative when the buffer is a window starting inside the sequence);
    q [T', H, Dn + Dr], kv [K', H, Dn + Dv], latents [K', L + Dr] (Dn = nope_dim); window: the buffer's
    rows that hold keys (default K'), rows past it are never read. Tiles read past T / past a
    sequence's keys only through masked loads, which on a GPU never touch memory; the interpreter
    clamps slices instead, so there callers pad q by bq rows and kv / latents by bk.
    Returns (o [T', H, Dv] in out_dtype (default q's), lse [T', H] fp32: the natural log-sum-exp of
    each row's scaled scores, -inf where the row saw no key, its o then zeros); rows no tile covers
    are left unwritten.
    """
    n_rows, heads, dq = q.shape
    n_keys, _, dkv = kv.shape
    dr = dq - nope_dim
    kernel = functools.partial(_kernel, bq=bq, bk=bk, dn=nope_dim, dr=dr, dv=dkv - nope_dim,
                               lat=latents.shape[-1] - dr, window=int(n_keys if window is None else window),
                               scale=float(scale), split_causal=split_causal)
    per_head = lambda rows, d: pl.BlockSpec((rows, None, d), lambda t, h: (0, h, 0))
    whole = lambda a: pl.BlockSpec(a.shape, lambda t, h: (0,) * a.ndim)
    return pl.pallas_call(
        kernel,
        grid=(meta.shape[0], heads),
        in_specs=[whole(meta), per_head(n_rows, dq), per_head(n_keys, dkv), whole(latents)],
        out_specs=[per_head(n_rows, dkv - nope_dim), pl.BlockSpec((n_rows, None), lambda t, h: (0, h))],
        out_shape=[jax.ShapeDtypeStruct((n_rows, heads, dkv - nope_dim), out_dtype or q.dtype),
                   jax.ShapeDtypeStruct((n_rows, heads), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"mla_expanded_bq{bq}_bk{bk}_w{num_warps}_st{num_stages}{'' if split_causal else '_m'}",
    )(meta, q, kv, latents)
