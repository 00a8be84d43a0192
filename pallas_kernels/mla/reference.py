"""Pure-jnp reference for paged MLA attention in absorbed form (576-wide latent cache).

Cache layout per MLA layer: ``kv_pages [num_pages, page_size, L + R]`` where the first L
(kv_lora_rank = 512) values of a row are the normalized latent ``ckv`` and the last R (64)
are ``k_rope`` (never rotated). Page 0 is a reserved garbage page that padding writes hit.

Absorbed attention: score(t, j) = scale * (q_latent[t] . ckv_j + q_rope[t] . krope_j) and
o_latent[t] = softmax_j(score) @ ckv. Softmax is in fp32.

Everything here is jittable with static shapes; values (lengths, tables) are dynamic.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.mla import fp8_cache
from pallas_kernels.scatter import set_rows


def write_kv_pages(kv_pages, new_kv, slot_mapping):
    """Scatter new cache rows into the page pool.

    Args:
      kv_pages: [P, page_size, L+R] page pool (donate it under jit for an in-place update).
      new_kv: [T, L+R] rows to write (cast to kv_pages.dtype; a pool of 16-bit float bits takes them in its
        value dtype, pallas_kernels/scatter.py; an FP8 pool quantizes them, fp8_cache.py).
      slot_mapping: [T] int32, ``page_id * page_size + offset``; negative = padding, dropped.
    Returns:
      the updated kv_pages [P, page_size, L+R].
    """
    num_pages, page_size, width = kv_pages.shape
    total = num_pages * page_size
    flat = kv_pages.reshape(total, width)
    slots = slot_mapping.astype(jnp.int32)
    # .at[] wraps negative indices numpy-style, so send them out of bounds explicitly.
    slots = jnp.where(slots < 0, total, slots)
    flat = set_rows(flat, slots, fp8_cache.encode(flat, new_kv), mode="drop")
    return flat.reshape(num_pages, page_size, width)


def token_positions(cu_seqlens, kv_lens, num_tokens):
    """Per query token: (sequence id [T], absolute position [T], valid [T]).

    Token i of sequence n sits at ``kv_lens[n] - (cu_seqlens[n+1] - i)``; tokens at or past
    ``cu_seqlens[N]`` are padding (valid False, seq id clamped, position -1).
    """
    n_seqs = kv_lens.shape[0]
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.searchsorted(cu_seqlens[1:], t, side="right", method="compare_all").astype(jnp.int32)
    valid = t < cu_seqlens[n_seqs]
    seq = jnp.clip(seq, 0, n_seqs - 1)
    pos = kv_lens[seq] - (cu_seqlens[seq + 1] - t)
    pos = jnp.where(valid, pos, -1)
    return seq, pos, valid


def decode_row_positions(cu_seqlens, kv_lens, num_tokens):
    """token_positions for the token_rows form (each token a decode row of its own): positions clamped to 0
    and not valid where a token is padding or its sequence has no keys (kv_len 0)."""
    seq, pos, valid = token_positions(cu_seqlens.astype(jnp.int32), kv_lens.astype(jnp.int32), num_tokens)
    valid = valid & (pos >= 0)
    return seq, jnp.where(valid, pos, 0), valid


def _attend_one(q_lat, q_rope, kv, pos, scale):
    """One query token vs one gathered sequence cache.

    q_lat [H, L], q_rope [H, R], kv [S, L+R], pos scalar (keys 0..pos are visible; pos < 0
    means no key is visible and the output is zeros). Returns [H, L] fp32.
    """
    lat = q_lat.shape[-1]
    keys = jnp.arange(kv.shape[0], dtype=jnp.int32)
    visible = keys <= pos
    # Zero invisible rows so garbage (even NaN) in unused page slots cannot leak via 0 * NaN.
    kv = jnp.where(visible[:, None], kv, jnp.zeros((), kv.dtype))
    ckv, krope = kv[:, :lat], kv[:, lat:]
    f32 = jnp.float32
    s = jnp.einsum("hl,sl->hs", q_lat, ckv, preferred_element_type=f32)
    s = s + jnp.einsum("hr,sr->hs", q_rope, krope, preferred_element_type=f32)
    s = jnp.where(visible[None, :], s * scale, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum("hs,sl->hl", p, ckv.astype(f32))
    return jnp.where(denom > 0, o / jnp.where(denom > 0, denom, 1.0), 0.0)


def ragged_paged_mla_reference(q_latent, q_rope, kv_pages, block_tables, cu_seqlens, kv_lens,
                               *, scale, batch_size=8):
    """Ragged paged MLA attention (prefill chunks with cached prefix, and decode).

    Args:
      q_latent: [T, H, L] queries folded through kv_b_proj's key half.
      q_rope: [T, H, R].
      kv_pages: [P, page_size, L+R] page pool (16-bit float bits are read as q_latent's dtype; an FP8 pool's
        packed rows [P, page_size, fp8_cache.packed_width(L, R)] (uint32 words) are dequantized to it).
      block_tables: [N, max_pages] int32 page ids per sequence.
      cu_seqlens: [N+1] int32; tokens cu_seqlens[n]..cu_seqlens[n+1]-1 belong to sequence n.
      kv_lens: [N] int32 cache length of each sequence AFTER this step's writes.
      scale: softmax scale.
      batch_size: tokens processed together by lax.map (memory ~ batch * max_pages*page_size*(L+R)).
    Returns:
      o_latent [T, H, L] in q_latent.dtype; padding tokens get zeros.
    """
    num_tokens = q_latent.shape[0]
    _, page_size, width = kv_pages.shape
    seq, pos, _ = token_positions(cu_seqlens.astype(jnp.int32), kv_lens.astype(jnp.int32),
                                  num_tokens)

    def one(args):
        ql, qr, n, p = args
        kv = fp8_cache.values(kv_pages[block_tables[n]].reshape(-1, width), ql.dtype, ql.shape[-1])  # as stored
        return _attend_one(ql, qr, kv, p, scale)

    out = jax.lax.map(one, (q_latent, q_rope, seq, pos), batch_size=min(batch_size, num_tokens))
    return out.astype(q_latent.dtype)


def mla_decode_reference(q_latent, q_rope, kv_pages, block_tables, kv_lens, *, scale):
    """Decode (one query per sequence) in plain jnp: gather all pages, masked softmax.

    q_latent [N, H, L], q_rope [N, H, R], block_tables [N, max_pages], kv_lens [N] (the
    query sits at position kv_lens[n] - 1). Returns o_latent [N, H, L] in q_latent.dtype.
    This is the "plain jnp" baseline the Pallas decode kernel is benchmarked against.
    """
    _, page_size, width = kv_pages.shape
    n_seqs, max_pages = block_tables.shape
    kv = fp8_cache.values(kv_pages[block_tables].reshape(n_seqs, max_pages * page_size, width), q_latent.dtype,
                          q_latent.shape[-1])
    out = jax.vmap(lambda ql, qr, k, p: _attend_one(ql, qr, k, p, scale))(
        q_latent, q_rope, kv, kv_lens.astype(jnp.int32) - 1)
    return out.astype(q_latent.dtype)
