"""Paged MLA attention as a Mosaic-TPU Pallas kernel: decode (contract: paged.mla_paged_decode)
and ragged prefill + decode (contract: paged.ragged_paged_mla).

Grid (tile c, key block j), run in order ("arbitrary"). A tile is up to block_q query tokens of one
sequence (decode: one token per sequence), its rows token-major (token * H + head); a key block
is `pages_per_block` pages of the sequence's block table. Tile metadata and the flattened block
tables are scalar-prefetched; the page pool stays in HBM (pl.ANY) and each needed page is DMA'd
into one of two VMEM buffers, program t prefetching program t+1's pages while it computes. Pages
past the tile's last key are never read (their table entries may be garbage), blocks past it are
skipped, and cache rows past it in a partly filled page are zeroed before use, so NaN in unused
slots cannot leak. Each row sees the keys up to its own position (causal).

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


def _attn_kernel(meta_ref, bt_ref, q_ref, kv_hbm, o_ref, buf, sem, m_sc, l_sc, acc_sc, *,
                 scale, ppb, page_size, max_pages, lat, heads, block_q):
    """meta [n_tiles*4] = (seq, pos of first token, valid tokens, keys needed) per tile and
    bt [N*max_pages] (SMEM); q [block_q*H, L+R] (row = token * H + head); kv_hbm [P, page_size, L+R];
    o [block_q*H, L]; buf [2, ppb*page_size, L+R]; sem DMA [2]; m, l [rows, 128]; acc [rows, L]."""
    c, j = pl.program_id(0), pl.program_id(1)
    NB = pl.num_programs(1)
    t = c * NB + j
    T = pl.num_programs(0) * NB
    bk = ppb * page_size

    # Steps are >= 0, so lax.div/rem (jnp's // and % lower through sign(), which needs a chip).
    def page_copy(step, i):
        s_c, s_j = lax.div(step, NB), lax.rem(step, NB)
        page = bt_ref[meta_ref[4 * s_c] * max_pages + jnp.minimum(s_j * ppb + i, max_pages - 1)]
        b = lax.rem(step, _NBUF)
        return pltpu.make_async_copy(kv_hbm.at[page], buf.at[b, pl.ds(i * page_size, page_size)],
                                     sem.at[b])

    def page_needed(step, i):
        s_c, s_j = lax.div(step, NB), lax.rem(step, NB)
        p = s_j * ppb + i
        return jnp.logical_and(p < max_pages, p * page_size < meta_ref[4 * s_c + 3])

    def for_pages(step, fn):
        for i in range(ppb):
            pl.when(page_needed(step, i))(lambda i=i: fn(page_copy(step, i)))

    @pl.when(j == 0)
    def _():
        m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, _F32)
        l_sc[...] = jnp.zeros(l_sc.shape, _F32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, _F32)

    @pl.when(t == 0)
    def _():
        for_pages(t, lambda cp: cp.start())

    @pl.when(t + 1 < T)
    def _():  # buffer (t+1) % 2 was last read by step t-1, which has finished
        for_pages(t + 1, lambda cp: cp.start())

    pos0, n_valid, kv_end = meta_ref[4 * c + 1], meta_ref[4 * c + 2], meta_ref[4 * c + 3]

    @pl.when(j * bk < kv_end)
    def _():
        for_pages(t, lambda cp: cp.wait())
        kv = buf[lax.rem(t, _NBUF)]                                       # [bk, L+R]
        q = q_ref[...]
        cd = jnp.promote_types(q.dtype, kv.dtype)
        rows = j * bk + lax.broadcasted_iota(jnp.int32, kv.shape, 0)
        kv = jnp.where(rows < kv_end, kv, jnp.zeros((), kv.dtype)).astype(cd)
        s = lax.dot_general(q.astype(cd), kv, (((1,), (1,)), ((), ())),
                            preferred_element_type=_F32) * scale        # [rows, bk]
        r = lax.broadcasted_iota(jnp.int32, s.shape, 0)
        tok = jnp.zeros(s.shape, jnp.int32)                               # r // heads, by compares
        for k in range(1, block_q):
            tok = tok + (r >= k * heads).astype(jnp.int32)
        last = jnp.where(tok < n_valid, pos0 + tok, -1)                   # causal: keys <= own pos
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

    @pl.when(j == NB - 1)
    def _():
        den = l_sc[...][:, :1]
        ok = den > 0                                                      # no visible key: zeros
        o_ref[...] = jnp.where(ok, acc_sc[...] / jnp.where(ok, den, 1.0), 0.0).astype(o_ref.dtype)


def pick_pages_per_block(page_size, max_pages, keys=512):
    """Pages per key block: about `keys` cache rows per program."""
    return max(1, min(max_pages, keys // page_size))


def pick_block_q(num_heads, rows=128):
    """Query tokens per prefill tile: about `rows` (token, head) rows for the MXU."""
    return max(1, rows // num_heads)


def _tiles(cu, kv_lens, n_tiles, bq):
    """Per tile (seq, pos of first token, valid tokens, keys needed) and its first token."""
    N = kv_lens.shape[0]
    n_tok = cu[1:] - cu[:-1]
    cu_ch = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(-(-n_tok // bq)).astype(jnp.int32)])
    c = jnp.arange(n_tiles, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(cu_ch[1:], c, side="right"), 0, N - 1).astype(jnp.int32)
    local = c - cu_ch[seq]
    first = cu[seq] + local * bq
    n_valid = jnp.where(c < cu_ch[N], jnp.clip(n_tok[seq] - local * bq, 0, bq), 0)
    pos0 = kv_lens[seq] - (cu[seq + 1] - first)
    kv_end = jnp.where(n_valid > 0, jnp.maximum(pos0 + n_valid, 0), 0)
    meta = jnp.stack([seq, pos0, n_valid, kv_end], axis=1).astype(jnp.int32).reshape(-1)
    return meta, first, n_valid


def _check(q_latent, q_rope, kv_pages, block_tables, kv_lens):
    T, H, L = q_latent.shape
    if (kv_pages.shape[-1] != L + q_rope.shape[-1] or q_rope.shape[:2] != (T, H)
            or block_tables.shape[0] != kv_lens.shape[0]):
        raise ValueError(f"shapes: q_latent {q_latent.shape}, q_rope {q_rope.shape}, kv_pages "
                         f"{kv_pages.shape}, block_tables {block_tables.shape}, kv_lens {kv_lens.shape}")


def _attend_tiles(q, kv_pages, block_tables, meta, n_tiles, *, heads, block_q, lat, out_dtype,
                  scale, pages_per_block, interpret):
    """q [n_tiles, block_q*H, L+R] -> o [n_tiles, block_q*H, L]."""
    _, page_size, W = kv_pages.shape
    max_pages = block_tables.shape[1]
    rows = block_q * heads
    ppb = pages_per_block or pick_pages_per_block(page_size, max_pages)
    kern = functools.partial(_attn_kernel, scale=scale, ppb=ppb, page_size=page_size,
                             max_pages=max_pages, lat=lat, heads=heads, block_q=block_q)
    return pl.pallas_call(
        kern,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(n_tiles, -(-max_pages // ppb)),
            in_specs=[pl.BlockSpec((None, rows, W), lambda c, j, *_: (c, 0, 0)),
                      pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec((None, rows, lat), lambda c, j, *_: (c, 0, 0)),
            scratch_shapes=[pltpu.VMEM((_NBUF, ppb * page_size, W), kv_pages.dtype),
                            pltpu.SemaphoreType.DMA((_NBUF,)),
                            pltpu.VMEM((rows, _LANES), _F32), pltpu.VMEM((rows, _LANES), _F32),
                            pltpu.VMEM((rows, lat), _F32)]),
        out_shape=jax.ShapeDtypeStruct((n_tiles, rows, lat), out_dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary", "arbitrary")),
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
    meta, _, _ = _tiles(jnp.arange(N + 1, dtype=jnp.int32), kv_lens, N, 1)
    q = jnp.concatenate([q_latent, q_rope.astype(q_latent.dtype)], axis=-1)
    o = _attend_tiles(q, kv_pages, block_tables, meta, N, heads=H, block_q=1, lat=L,
                      out_dtype=q_latent.dtype, scale=scale, pages_per_block=pages_per_block,
                      interpret=interpret)
    return o


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
    meta, first, n_valid = _tiles(cu_seqlens.astype(jnp.int32), kv_lens.astype(jnp.int32),
                                  n_tiles, bq)
    off = jnp.arange(bq, dtype=jnp.int32)
    tok = first[:, None] + off[None, :]                                   # [n_tiles, bq]
    ok = off[None, :] < n_valid[:, None]
    q = jnp.concatenate([q_latent, q_rope.astype(q_latent.dtype)], axis=-1)
    qt = q[jnp.clip(tok, 0, T - 1)].reshape(n_tiles, bq * H, -1)
    o = _attend_tiles(qt, kv_pages, block_tables, meta, n_tiles, heads=H, block_q=bq, lat=L,
                      out_dtype=q_latent.dtype, scale=scale, pages_per_block=pages_per_block,
                      interpret=interpret)
    dest = jnp.where(ok, tok, T).reshape(-1)                              # T: dropped
    out = jnp.zeros((T, H, L), q_latent.dtype)
    return out.at[dest].set(o.reshape(n_tiles * bq, H, L), mode="drop")
