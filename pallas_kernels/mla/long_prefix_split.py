"""The long-prefix MLA op (long_prefix.py's contract) split by what the queries see, so that nearly all of its
FLOPs run in cuDNN's fused attention without a mask (the fast case on Hopper; a mask tensor halves its speed).

For a step whose keys belong to one sequence (a lone long prompt's chunk, any decode rows of the step
taking the absorbed form with kv_len 0), the chunk's m queries sit at cache positions ctx..ctx+m-1 with
ctx = kv_len - m, and every one of them sees every key before ctx. So:
  (a) the prefix keys 0..ctx-1 in windows of `block_keys` rows: dense, unmasked attention of the chunk's
      queries; the partial window's ctx mod block_keys rows in unmasked sub-windows of power-of-two sizes (its
      binary digits down to `min_rows`), the last < min_rows rows in one masked call of min_rows keys;
  (b) the chunk's own keys ctx..ctx+m-1 against its queries with a plain causal mask (query i sees keys
      0..i: cuDNN's causal mask type);
and the parts' (output, log-sum-exp) pairs merge exactly (long_prefix.merge). The chunk's queries are moved to
rows 0..m-1 of a T-row buffer (T: the step's token rows, static) and back; rows m.. hold zeros and their results
are dropped, so other sequences' and padding rows cannot leak. A step with keys in more than one sequence (a
varlen batch of several prefills: each has its own prefix, no shared dense window) falls back to the
window-at-a-time op (long_prefix.prefix_attention with `fallback`'s impl).

`attention` picks the dense attention: "cudnn" (jax's cuDNN SDPA, GPU) or "reference" (jnp), which is how the
split itself is checked on a CPU (tests/test_mla_long_prefix_split.py).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.mla import fp8_cache
from pallas_kernels.mla.expanded import gather_latents


def dense_attention_reference(q, k, v, *, scale, causal=False, kv_len=None):
    """q [T, H, D], k [S, H, D], v [S, H, Dv] -> (o [T, H, Dv] fp32, lse [T, H] fp32: natural log-sum-exp of
    the scaled visible scores). causal: query i sees keys 0..i; kv_len (traced scalar): key rows >= kv_len
    unseen. Rows that see no key: o 0, lse -inf."""
    t, s = q.shape[0], k.shape[0]
    scores = jnp.einsum("thd,shd->hts", q.astype(jnp.float32), k.astype(jnp.float32)) * scale
    keys = jnp.arange(s, dtype=jnp.int32)[None, :]
    visible = jnp.ones((t, s), bool)
    if causal:
        visible &= keys <= jnp.arange(t, dtype=jnp.int32)[:, None]
    if kv_len is not None:
        visible &= keys < kv_len
    scores = jnp.where(visible[None], scores, -jnp.inf)
    lse = jax.nn.logsumexp(scores, axis=-1)                                  # [H, T]
    p = jnp.exp(scores - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None])
    return jnp.einsum("hts,shd->thd", p, v.astype(jnp.float32)), lse.T


def dense_attention_cudnn(q, k, v, *, scale, causal=False, kv_len=None):
    """dense_attention_reference's contract by cuDNN's fused attention (GPU). kv_len must be >= 1 (every row
    sees a key): it becomes a boolean mask, the only masked call of the split."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn_attn
    t, s = q.shape[0], k.shape[0]
    mask = None
    if kv_len is not None:
        mask = jnp.broadcast_to((jnp.arange(s, dtype=jnp.int32) < kv_len)[None, None, None, :], (1, 1, t, s))
    mask_type = cudnn_attn.MaskType.CAUSAL if causal else cudnn_attn.MaskType.NO_MASK
    o, lse = cudnn_attn.dot_product_attention(q[None], k[None], v[None], mask=mask, scale=scale,
                                              mask_type=mask_type, qkv_layout="BTNH", return_residual=True)
    return o[0].astype(jnp.float32), lse[0].astype(jnp.float32).T     # the residual is [B, H, T]


ATTENTION = {"cudnn": dense_attention_cudnn, "reference": dense_attention_reference}


def single_sequence(kv_lens):
    """The split applies: exactly one sequence has keys in this op."""
    return jnp.sum((kv_lens > 0).astype(jnp.int32)) == 1


# smallest unmasked sub-window of the prefix's partial window; fewer rows than this left go through one masked call
MIN_ROWS = 256


def tail_windows(block_keys: int, min_rows: int):
    """Sizes of the unmasked sub-windows covering a partial window of rest < block_keys rows: the powers of two
    below block_keys down to min_rows, largest first (each taken when rest still holds it: rest's binary
    digits), leaving fewer than min_rows rows."""
    sizes, size = [], 1
    while size * 2 < block_keys:
        size *= 2
    while size >= min_rows:
        sizes.append(size)
        size //= 2
    return sizes


@functools.partial(jax.jit, static_argnames=("nope_dim", "scale", "block_keys", "attention", "fallback", "min_rows"))
def split_prefix_attention(q, kv_pages, block_tables, cu_seqlens, kv_lens, kv_b, *, nope_dim, scale, block_keys,
                           attention="cudnn", fallback="triton", min_rows=MIN_ROWS):
    """long_prefix.prefix_attention's contract (o [T, H, Dv] in q's dtype; padding tokens and sequences with
    kv_len 0 get zeros), split into unmasked prefix windows and a causal chunk when one sequence holds all the
    keys; otherwise long_prefix.prefix_attention(impl=fallback). attention: "cudnn" | "reference"."""
    from pallas_kernels.mla.long_prefix import merge, prefix_attention
    dense = ATTENTION[attention]
    n_tok, heads, _ = q.shape
    lat = kv_b.shape[0]
    dr = q.shape[-1] - nope_dim
    dv = kv_b.shape[-1] // heads - nope_dim
    kv_lens = kv_lens.astype(jnp.int32)
    cu_seqlens = cu_seqlens.astype(jnp.int32)

    def keys(own, offset, rows_count):
        """K [rows, H, Dn + Dr] (per-head nope | shared rope) and V [rows, H, Dv] of the owning sequence's
        positions offset.. (zeros past its kv_len)."""
        rows, _ = gather_latents(kv_pages, block_tables, own, rows_count, offset)
        rows = fp8_cache.values(rows, q.dtype, lat)
        kv = (rows[:, :lat].astype(kv_b.dtype) @ kv_b).astype(q.dtype).reshape(rows_count, heads, nope_dim + dv)
        k_rope = jnp.broadcast_to(rows[:, None, rows.shape[-1] - dr:], (rows_count, heads, dr)).astype(q.dtype)
        return jnp.concatenate([kv[..., :nope_dim], k_rope], axis=-1), kv[..., nope_dim:]

    def split():
        seq = jnp.argmax(kv_lens > 0).astype(jnp.int32)
        s0 = cu_seqlens[seq]
        m = cu_seqlens[seq + 1] - s0
        ctx = kv_lens[seq] - m
        own = jnp.where(jnp.arange(kv_lens.shape[0]) == seq, kv_lens, 0)   # its positions = flat key rows
        local = jnp.arange(n_tok, dtype=jnp.int32)
        ql = jnp.where((local < m)[:, None, None], q[jnp.clip(s0 + local, 0, n_tok - 1)], jnp.zeros((), q.dtype))

        k, v = keys(own, ctx, n_tok)                               # (b) the chunk's keys, causal
        carry = dense(ql, k, v, scale=scale, causal=True)

        def window(j, carry):                                      # (a) full prefix windows, no mask
            k, v = keys(own, j * block_keys, block_keys)
            return merge(*carry, *dense(ql, k, v, scale=scale))

        full = ctx // block_keys
        carry = jax.lax.fori_loop(0, full, window, carry)
        offset, rest = full * block_keys, ctx - full * block_keys   # rest < block_keys

        for rows in tail_windows(block_keys, min_rows):            # the partial window: its binary digits
            def part(c, rows=rows, offset=offset):
                k, v = keys(own, offset, rows)
                return merge(*c, *dense(ql, k, v, scale=scale))
            take = rest >= rows
            carry = jax.lax.cond(take, part, lambda c: c, carry)
            offset, rest = offset + jnp.where(take, rows, 0), rest - jnp.where(take, rows, 0)

        def last(c):                                               # under min_rows left: the one masked call
            k, v = keys(own, offset, min(min_rows, block_keys))
            return merge(*c, *dense(ql, k, v, scale=scale, kv_len=rest))

        o, _ = jax.lax.cond(rest > 0, last, lambda c: c, carry)
        t = jnp.arange(n_tok, dtype=jnp.int32)
        mine = (t >= s0) & (t < s0 + m)
        return jnp.where(mine[:, None, None], o[jnp.clip(t - s0, 0, n_tok - 1)], 0.0).astype(q.dtype)

    def windows():
        return prefix_attention(q, kv_pages, block_tables, cu_seqlens, kv_lens, kv_b, nope_dim=nope_dim,
                                scale=scale, block_keys=block_keys, impl=fallback)

    return jax.lax.cond(single_sequence(kv_lens), split, windows)
