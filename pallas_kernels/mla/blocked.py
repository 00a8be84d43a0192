"""Ragged paged MLA in jnp whose work follows the real cache lengths: the CPU's path.

`reference.ragged_paged_mla_reference` gathers every page of a sequence's block table for every query
token, so its cost grows with max_model_len (the table's width), not with the context: on CPU with the
default 8192-token context a tiny model's decode step spent ~2/3 of its time there. Here each token walks
its pages in blocks with an online softmax and stops after the block holding its own position (a
while loop with a per-token trip count; `lax.map` over token batches runs a batch as long as its
longest token). Same contract and masking as the reference; the softmax is accumulated block by block
in fp32, so results match it to fp32 rounding.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.mla.reference import token_positions
from pallas_kernels.mla import fp8_cache


def ragged_paged_mla_blocked(q_latent, q_rope, kv_pages, block_tables, cu_seqlens, kv_lens, *, scale,
                             pages_per_block: int = 8, batch_size: int = 8):
    """reference.ragged_paged_mla_reference's contract: q_latent [T, H, L], q_rope [T, H, R], kv_pages
    [P, page_size, L+R] (16-bit float bits read as q_latent's dtype; packed FP8 rows dequantized a block at a
    time), block_tables [N, max_pages],
    cu_seqlens [N+1], kv_lens [N] (after this step's writes). Returns o_latent [T, H, L] in q_latent's
    dtype; padding tokens get zeros. Work per token: its pages up to its position, pages_per_block at a
    time; memory per map iteration ~ batch_size * pages_per_block * page_size * (L+R)."""
    num_tokens, _, lat = q_latent.shape
    _, page_size, width = kv_pages.shape
    n_seqs, max_pages = block_tables.shape
    ppb = min(pages_per_block, max_pages)
    n_blocks_max = -(-max_pages // ppb)
    tables = jnp.pad(block_tables.astype(jnp.int32), ((0, 0), (0, n_blocks_max * ppb - max_pages)))
    seq, pos, _ = token_positions(cu_seqlens.astype(jnp.int32), kv_lens.astype(jnp.int32), num_tokens)
    block_keys = ppb * page_size
    f32 = jnp.float32

    def one(args):
        ql, qr, n, p = args                                    # [H, L], [H, R], seq, position (-1: none)
        heads = ql.shape[0]

        def block(j, carry):
            m, l, acc = carry
            pages = jax.lax.dynamic_slice(tables[n], (j * ppb,), (ppb,))
            kv = fp8_cache.values(kv_pages[pages].reshape(block_keys, width), ql.dtype, lat)  # FP8: per block
            keys = j * block_keys + jnp.arange(block_keys, dtype=jnp.int32)
            visible = keys <= p
            kv = jnp.where(visible[:, None], kv, jnp.zeros((), kv.dtype))   # garbage (even NaN) cannot leak
            ckv, krope = kv[:, :lat], kv[:, lat:]
            s = jnp.einsum("hl,sl->hs", ql, ckv, preferred_element_type=f32)
            s = s + jnp.einsum("hr,sr->hs", qr, krope, preferred_element_type=f32)
            s = jnp.where(visible[None, :], s * scale, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))        # finite: block j holds key j * block_keys <= p
            alpha = jnp.exp(m - m_new)
            pr = jnp.exp(s - m_new[:, None])
            return m_new, l * alpha + jnp.sum(pr, axis=-1), acc * alpha[:, None] + pr @ ckv.astype(f32)

        init = (jnp.full((heads,), -jnp.inf, f32), jnp.zeros((heads,), f32), jnp.zeros((heads, lat), f32))
        _, l, acc = jax.lax.fori_loop(0, (p + block_keys) // block_keys, block, init)   # 0 blocks when p < 0
        return jnp.where(l[:, None] > 0, acc / jnp.where(l > 0, l, 1.0)[:, None], 0.0)

    out = jax.lax.map(one, (q_latent, q_rope, seq, pos), batch_size=min(batch_size, num_tokens))
    return out.astype(q_latent.dtype)
