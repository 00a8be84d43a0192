"""Paged MLA decode as a Mosaic-TPU Pallas kernel (contract: paged.mla_paged_decode).

Grid (sequence n, key block j), run in order ("arbitrary"): a key block is `pages_per_block`
pages of the sequence's block table. kv_lens and the flattened block tables are scalar-prefetched;
the page pool stays in HBM (pl.ANY) and each needed page is DMA'd into one of two VMEM buffers,
program t prefetching program t+1's pages while it computes. Pages at or past kv_len are never
read (their table entries may be garbage), blocks past it are skipped, and rows past kv_len in
a partly filled page are zeroed before use, so NaN in unused slots cannot leak.

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


def _decode_kernel(lens_ref, bt_ref, q_ref, kv_hbm, o_ref, buf, sem, m_sc, l_sc, acc_sc, *,
                   scale, ppb, page_size, max_pages, lat):
    """lens [N], bt [N*max_pages] (SMEM); q [H, L+R]; kv_hbm [P, page_size, L+R]; o [H, L];
    buf [2, ppb*page_size, L+R]; sem DMA [2]; m, l [H, 128] (lane-replicated); acc [H, L]."""
    n, j = pl.program_id(0), pl.program_id(1)
    NB = pl.num_programs(1)
    t = n * NB + j
    T = pl.num_programs(0) * NB
    bk = ppb * page_size

    # Steps are >= 0, so lax.div/rem (jnp's // and % lower through sign(), which needs a chip).
    def page_copy(step, i):
        s_n, s_j = lax.div(step, NB), lax.rem(step, NB)
        page = bt_ref[s_n * max_pages + jnp.minimum(s_j * ppb + i, max_pages - 1)]
        b = lax.rem(step, _NBUF)
        return pltpu.make_async_copy(kv_hbm.at[page], buf.at[b, pl.ds(i * page_size, page_size)],
                                     sem.at[b])

    def page_needed(step, i):
        s_n, s_j = lax.div(step, NB), lax.rem(step, NB)
        p = s_j * ppb + i
        return jnp.logical_and(p < max_pages, p * page_size < lens_ref[s_n])

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
        for_pages(t, lambda c: c.start())

    @pl.when(t + 1 < T)
    def _():  # buffer (t+1) % 2 was last read by step t-1, which has finished
        for_pages(t + 1, lambda c: c.start())

    kv_len = lens_ref[n]

    @pl.when(j * bk < kv_len)
    def _():
        for_pages(t, lambda c: c.wait())
        kv = buf[lax.rem(t, _NBUF)]                                       # [bk, L+R]
        q = q_ref[...]
        cd = jnp.promote_types(q.dtype, kv.dtype)
        rows = j * bk + lax.broadcasted_iota(jnp.int32, kv.shape, 0)
        kv = jnp.where(rows < kv_len, kv, jnp.zeros((), kv.dtype)).astype(cd)
        s = lax.dot_general(q.astype(cd), kv, (((1,), (1,)), ((), ())),
                            preferred_element_type=_F32) * scale        # [H, bk]
        keys = j * bk + lax.broadcasted_iota(jnp.int32, s.shape, 1)
        s = jnp.where(keys < kv_len, s, -jnp.inf)
        m_prev = m_sc[...]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))  # [H, 128]
        alpha = jnp.exp(m_prev - m_new)
        p = jnp.exp(s - m_new[:, :1])
        l_sc[...] = alpha * l_sc[...] + jnp.sum(p, axis=1, keepdims=True)
        m_sc[...] = m_new
        pv = lax.dot_general(p.astype(cd), kv[:, :lat], (((1,), (0,)), ((), ())),
                             preferred_element_type=_F32)                 # [H, L]
        acc_sc[...] = acc_sc[...] * alpha[:, :1] + pv

    @pl.when(j == NB - 1)
    def _():
        den = l_sc[...][:, :1]
        ok = den > 0                                                      # kv_len <= 0: zeros
        o_ref[...] = jnp.where(ok, acc_sc[...] / jnp.where(ok, den, 1.0), 0.0).astype(o_ref.dtype)


def pick_pages_per_block(page_size, max_pages, keys=512):
    """Pages per key block: about `keys` cache rows per program."""
    return max(1, min(max_pages, keys // page_size))


@functools.partial(jax.jit, static_argnames=("scale", "pages_per_block", "interpret"))
def mla_paged_decode_tpu(q_latent, q_rope, kv_pages, block_tables, kv_lens, *, scale,
                         pages_per_block=None, interpret=False):
    """q_latent [N, H, L], q_rope [N, H, R], kv_pages [P, page_size, L+R], block_tables
    [N, max_pages] int32, kv_lens [N] int32 (the query sits at kv_lens-1; <= 0: output zeros).
    Returns o_latent [N, H, L] in q_latent.dtype."""
    N, H, L = q_latent.shape
    R = q_rope.shape[-1]
    _, page_size, W = kv_pages.shape
    max_pages = block_tables.shape[1]
    if W != L + R or q_rope.shape[:2] != (N, H) or block_tables.shape[0] != N:
        raise ValueError(f"shapes: q_latent {q_latent.shape}, q_rope {q_rope.shape}, kv_pages "
                         f"{kv_pages.shape}, block_tables {block_tables.shape}")
    ppb = pages_per_block or pick_pages_per_block(page_size, max_pages)
    NB = -(-max_pages // ppb)
    q = jnp.concatenate([q_latent, q_rope.astype(q_latent.dtype)], axis=-1)
    kern = functools.partial(_decode_kernel, scale=scale, ppb=ppb, page_size=page_size,
                             max_pages=max_pages, lat=L)
    return pl.pallas_call(
        kern,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(N, NB),
            in_specs=[pl.BlockSpec((None, H, W), lambda n, j, *_: (n, 0, 0)),
                      pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec((None, H, L), lambda n, j, *_: (n, 0, 0)),
            scratch_shapes=[pltpu.VMEM((_NBUF, ppb * page_size, W), kv_pages.dtype),
                            pltpu.SemaphoreType.DMA((_NBUF,)),
                            pltpu.VMEM((H, _LANES), _F32), pltpu.VMEM((H, _LANES), _F32),
                            pltpu.VMEM((H, L), _F32)]),
        out_shape=jax.ShapeDtypeStruct((N, H, L), q_latent.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary", "arbitrary")),
        interpret=interpret,
        name="mla_paged_decode_tpu",
    )(kv_lens.astype(jnp.int32), block_tables.astype(jnp.int32).reshape(-1), q, kv_pages)
