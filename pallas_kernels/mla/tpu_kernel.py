"""Paged MLA attention as a Mosaic-TPU Pallas kernel: decode (contract: paged.mla_paged_decode)
and ragged prefill + decode (contract: paged.ragged_paged_mla).

Grid (tile c,), run in order ("arbitrary"). A tile is up to block_q query tokens of one sequence
(decode: one token per sequence), its rows token-major (token * H + head). The kernel loops over
the tile's key blocks (`pages_per_block` pages of the block table each), only as many as its last
position needs, so long tables cost no empty grid steps. Tile metadata and the flattened block
tables are scalar-prefetched; the page pool stays in HBM (pl.ANY) and each needed page is DMA'd
into one of two VMEM buffers, each key block prefetching the next one (at a tile's end, the next
tile's first) while it computes. Pages past a tile's last key are never read (their table
entries may be garbage), and cache rows past it in a partly filled page are zeroed before use, so
NaN in unused slots cannot leak. Each row sees the keys up to its own position (causal).

Absorbed form: score = scale * [q_latent, q_rope] . kv_row (one 576-wide contraction against the
cache rows as stored), online softmax in fp32, o = softmax @ kv_row[:L].
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

_F32 = jnp.float32
_NBUF = 2
_LANES = 128
_META = 6     # per-tile scalars, see _tiles


def _attn_kernel(meta_ref, bt_ref, q_ref, kv_hbm, o_ref, buf, sem, m_sc, l_sc, acc_sc, *,
                 scale, ppb, page_size, max_pages, lat, heads, block_q):
    """meta [n_tiles*_META] (SMEM; fields below) and bt [N*max_pages] (SMEM); q [block_q*H, L+R]
    (row = token * H + head); kv_hbm [P, page_size, L+R]; o [block_q*H, L];
    buf [2, ppb*page_size, L+R]; sem DMA [2]; m, l [rows, 128] (lane-replicated); acc [rows, L]."""
    c = pl.program_id(0)
    C = pl.num_programs(0)
    bk = ppb * page_size
    field = lambda tile, f: meta_ref[_META * tile + f]  # noqa: E731
    seq, pos0, n_valid, kv_end, nb, blk0 = (field(c, f) for f in range(_META))

    def page_copy(tile, j, i):
        page = bt_ref[field(tile, 0) * max_pages + jnp.minimum(j * ppb + i, max_pages - 1)]
        b = lax.rem(field(tile, 5) + j, _NBUF)          # global block counter: buffers alternate
        return pltpu.make_async_copy(kv_hbm.at[page], buf.at[b, pl.ds(i * page_size, page_size)],
                                     sem.at[b])

    def for_pages(tile, j, fn):
        for i in range(ppb):
            p = j * ppb + i
            need = jnp.logical_and(p < max_pages, p * page_size < field(tile, 3))
            pl.when(need)(lambda i=i: fn(page_copy(tile, j, i)))

    m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, _F32)
    l_sc[...] = jnp.zeros(l_sc.shape, _F32)
    acc_sc[...] = jnp.zeros(acc_sc.shape, _F32)

    # The previous tile's last block prefetched this tile's first one, unless it had no blocks.
    prefetched = jnp.logical_and(c > 0, field(jnp.maximum(c - 1, 0), 4) > 0)

    @pl.when(jnp.logical_and(nb > 0, jnp.logical_not(prefetched)))
    def _():
        for_pages(c, 0, lambda cp: cp.start())

    # Row r is token r // heads of the tile (by compares: no vector integer division).
    rows_shape = (block_q * heads, bk)
    r = lax.broadcasted_iota(jnp.int32, rows_shape, 0)
    tok = jnp.zeros(rows_shape, jnp.int32)
    for k in range(1, block_q):
        tok = tok + (r >= k * heads).astype(jnp.int32)
    last = jnp.where(tok < n_valid, pos0 + tok, -1)                       # causal: keys <= own pos

    def block(j, carry):
        @pl.when(j + 1 < nb)
        def _():
            for_pages(c, j + 1, lambda cp: cp.start())

        @pl.when(jnp.logical_and(j + 1 == nb, c + 1 < C))
        def _():
            nxt = jnp.minimum(c + 1, C - 1)
            pl.when(field(nxt, 4) > 0)(lambda: for_pages(nxt, 0, lambda cp: cp.start()))

        for_pages(c, j, lambda cp: cp.wait())
        kv = buf[lax.rem(blk0 + j, _NBUF)]                                # [bk, L+R]
        q = q_ref[...]
        cd = jnp.promote_types(q.dtype, kv.dtype)
        krow = j * bk + lax.broadcasted_iota(jnp.int32, kv.shape, 0)
        kv = jnp.where(krow < kv_end, kv, jnp.zeros((), kv.dtype)).astype(cd)
        s = lax.dot_general(q.astype(cd), kv, (((1,), (1,)), ((), ())),
                            preferred_element_type=_F32) * scale        # [rows, bk]
        keys = j * bk + lax.broadcasted_iota(jnp.int32, s.shape, 1)
        s = jnp.where(keys <= last, s, -jnp.inf)
        m_prev = m_sc[...]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))  # [rows, 128]
        m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)                  # rows with no key yet
        alpha = jnp.exp(m_prev - m_use)
        p = jnp.exp(s - m_use[:, :1])
        l_sc[...] = alpha * l_sc[...] + jnp.sum(p, axis=1, keepdims=True)
        m_sc[...] = m_new
        pv = lax.dot_general(p.astype(cd), kv[:, :lat], (((1,), (0,)), ((), ())),
                             preferred_element_type=_F32)                 # [rows, L]
        acc_sc[...] = acc_sc[...] * alpha[:, :1] + pv
        return carry

    lax.fori_loop(0, nb, block, 0)
    den = l_sc[...][:, :1]
    ok = den > 0                                                          # no visible key: zeros
    o_ref[...] = jnp.where(ok, acc_sc[...] / jnp.where(ok, den, 1.0), 0.0).astype(o_ref.dtype)


def pick_pages_per_block(page_size, max_pages, keys=512):
    """Pages per key block: about `keys` cache rows per program."""
    return max(1, min(max_pages, keys // page_size))


def pick_block_q(num_heads, rows=128):
    """Query tokens per prefill tile: about `rows` (token, head) rows for the MXU."""
    return max(1, rows // num_heads)


def _tiles(cu, kv_lens, n_tiles, bq, bk):
    """Per tile (seq, pos of first token, valid tokens, keys needed, key blocks, blocks in earlier
    tiles) flattened, its first token and its valid tokens; bk keys per block."""
    N = kv_lens.shape[0]
    n_tok = cu[1:] - cu[:-1]
    cu_ch = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(-(-n_tok // bq)).astype(jnp.int32)])
    c = jnp.arange(n_tiles, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(cu_ch[1:], c, side="right", method="compare_all"), 0, N - 1).astype(jnp.int32)
    local = c - cu_ch[seq]
    first = cu[seq] + local * bq
    n_valid = jnp.where(c < cu_ch[N], jnp.clip(n_tok[seq] - local * bq, 0, bq), 0)
    pos0 = kv_lens[seq] - (cu[seq + 1] - first)
    kv_end = jnp.where(n_valid > 0, jnp.maximum(pos0 + n_valid, 0), 0)
    nb = -(-kv_end // bk)
    blk0 = jnp.cumsum(nb) - nb
    meta = jnp.stack([seq, pos0, n_valid, kv_end, nb, blk0], axis=1).astype(jnp.int32).reshape(-1)
    return meta, first, n_valid


def _check(q_latent, q_rope, kv_pages, block_tables, kv_lens):
    T, H, L = q_latent.shape
    if (kv_pages.shape[-1] != L + q_rope.shape[-1] or q_rope.shape[:2] != (T, H)
            or block_tables.shape[0] != kv_lens.shape[0]):
        raise ValueError(f"shapes: q_latent {q_latent.shape}, q_rope {q_rope.shape}, kv_pages "
                         f"{kv_pages.shape}, block_tables {block_tables.shape}, kv_lens {kv_lens.shape}")


def _attend_tiles(q, kv_pages, block_tables, meta, n_tiles, *, heads, block_q, lat, out_dtype,
                  scale, ppb, interpret):
    """q [n_tiles, block_q*H, L+R] -> o [n_tiles, block_q*H, L]; ppb pages per key block."""
    _, page_size, W = kv_pages.shape
    max_pages = block_tables.shape[1]
    rows = block_q * heads
    kern = functools.partial(_attn_kernel, scale=scale, ppb=ppb, page_size=page_size,
                             max_pages=max_pages, lat=lat, heads=heads, block_q=block_q)
    return pl.pallas_call(
        kern,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(n_tiles,),
            in_specs=[pl.BlockSpec((None, rows, W), lambda c, *_: (c, 0, 0)),
                      pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec((None, rows, lat), lambda c, *_: (c, 0, 0)),
            scratch_shapes=[pltpu.VMEM((_NBUF, ppb * page_size, W), kv_pages.dtype),
                            pltpu.SemaphoreType.DMA((_NBUF,)),
                            pltpu.VMEM((rows, _LANES), _F32), pltpu.VMEM((rows, _LANES), _F32),
                            pltpu.VMEM((rows, lat), _F32)]),
        out_shape=jax.ShapeDtypeStruct((n_tiles, rows, lat), out_dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
        interpret=interpret,
        name="mla_paged_attention_tpu",
    )(meta, block_tables.astype(jnp.int32).reshape(-1), q, kv_pages)


@functools.partial(jax.jit, static_argnames=("scale", "pages_per_block", "interpret"))
def mla_paged_decode_tpu(q_latent, q_rope, kv_pages, block_tables, kv_lens, *, scale,
                         pages_per_block=None, interpret=False):
    """q_latent [N, H, L], q_rope [N, H, R], kv_pages [P, page_size, L+R], block_tables
    [N, max_pages] int32, kv_lens [N] int32 (the query sits at kv_lens-1; <= 0: output zeros).
    Returns o_latent [N, H, L] in q_latent.dtype. One tile per sequence (block_q = 1)."""
    _check(q_latent, q_rope, kv_pages, block_tables, kv_lens)
    N, H, L = q_latent.shape
    kv_lens = kv_lens.astype(jnp.int32)
    ppb = pages_per_block or pick_pages_per_block(kv_pages.shape[1], block_tables.shape[1])
    meta, _, _ = _tiles(jnp.arange(N + 1, dtype=jnp.int32), kv_lens, N, 1, ppb * kv_pages.shape[1])
    q = jnp.concatenate([q_latent, q_rope.astype(q_latent.dtype)], axis=-1)
    return _attend_tiles(q, kv_pages, block_tables, meta, N, heads=H, block_q=1, lat=L,
                         out_dtype=q_latent.dtype, scale=scale, ppb=ppb, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("scale", "block_q", "pages_per_block", "interpret"))
def ragged_paged_mla_tpu(q_latent, q_rope, kv_pages, block_tables, cu_seqlens, kv_lens, *, scale,
                         block_q=None, pages_per_block=None, interpret=False):
    """Contract of reference.ragged_paged_mla_reference: q_latent [T, H, L], q_rope [T, H, R],
    kv_pages [P, page_size, L+R], block_tables [N, max_pages], cu_seqlens [N+1], kv_lens [N]
    (cache length after this step's writes). Returns o_latent [T, H, L]; tokens past
    cu_seqlens[N] get zeros. Tiles of block_q tokens of one sequence; the wrapper gathers their
    queries and scatters the outputs back (cheap next to the cache reads)."""
    _check(q_latent, q_rope, kv_pages, block_tables, kv_lens)
    T, H, L = q_latent.shape
    N = kv_lens.shape[0]
    bq = block_q or pick_block_q(H)
    n_tiles = T if bq == 1 else -(-T // bq) + N      # each sequence wastes at most one partial tile
    ppb = pages_per_block or pick_pages_per_block(kv_pages.shape[1], block_tables.shape[1])
    meta, first, n_valid = _tiles(cu_seqlens.astype(jnp.int32), kv_lens.astype(jnp.int32),
                                  n_tiles, bq, ppb * kv_pages.shape[1])
    off = jnp.arange(bq, dtype=jnp.int32)
    tok = first[:, None] + off[None, :]                                   # [n_tiles, bq]
    ok = off[None, :] < n_valid[:, None]
    q = jnp.concatenate([q_latent, q_rope.astype(q_latent.dtype)], axis=-1)
    qt = q[jnp.clip(tok, 0, T - 1)].reshape(n_tiles, bq * H, -1)
    o = _attend_tiles(qt, kv_pages, block_tables, meta, n_tiles, heads=H, block_q=bq, lat=L,
                      out_dtype=q_latent.dtype, scale=scale, ppb=ppb, interpret=interpret)
    dest = jnp.where(ok, tok, T).reshape(-1)                              # T: dropped
    out = jnp.zeros((T, H, L), q_latent.dtype)
    return out.at[dest].set(o.reshape(n_tiles * bq, H, L), mode="drop")
