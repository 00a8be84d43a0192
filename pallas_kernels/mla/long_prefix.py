"""MLA prefill in expanded form over contexts of any length: the keys a key block at a time.

A step's sequences lay their keys (cache positions 0..kv_len-1: the paged context and this step's
chunk) one after another in a flat key space (expanded.gather_latents). The op walks that space in
windows of `block_keys` rows: gather the window's latent rows from the page pool, decompress them by
kv_b_proj into per-head K (nope) and V (the rope key stays the latent's shared column), run the varlen
causal attention of every query over the window (each query sees its own sequence's keys up to its
position; expanded.block_attention), and merge the windows' (output, log-sum-exp) pairs exactly by
the online-softmax rule. Memory is one window's K/V whatever the context; the window count is a
runtime loop bound, so one compiled program serves any context length.

Costs per window: the gather (block_keys * (L+R) values), the decompress (2 * L * H * (Dn + Dv)
FLOPs a key) and the attention, whose FLOPs are the (query, visible key) pairs' alone: windows and
query tiles that share no keys exit at once.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.mla import fp8_cache
from pallas_kernels.mla.expanded import block_attention, block_attention_reference, gather_latents


def merge(o_a, lse_a, o_b, lse_b):
    """Exact union of two disjoint key sets' attention: o [T, H, Dv] (fp32 out), lse [T, H] (natural
    log-sum-exp of the scaled scores, -inf: no keys)."""
    lse = jnp.logaddexp(lse_a, lse_b)
    ref = jnp.where(jnp.isfinite(lse), lse, 0.0)
    w_a = jnp.exp(lse_a - ref)[..., None]
    w_b = jnp.exp(lse_b - ref)[..., None]
    return o_a.astype(jnp.float32) * w_a + o_b.astype(jnp.float32) * w_b, lse


IMPLS = ("reference", "triton", "cudnn")


@functools.partial(jax.jit, static_argnames=("nope_dim", "scale", "block_keys", "impl", "interpret", "config"))
def prefix_attention(q, kv_pages, block_tables, cu_seqlens, kv_lens, kv_b, *, nope_dim, scale, block_keys,
                     impl="reference", interpret=None, config=None):
    """Expanded-form MLA attention of ragged query chunks over their paged caches, any length.

    q [T, H, Dn + Dr] (nope, then rope; the compute dtype of the attention), kv_pages [P, page_size,
    L + Dr] (16-bit float bits read as q's dtype; an FP8 pool's packed rows dequantized a window at a time),
    block_tables [N, max_pages], cu_seqlens [N+1],
    kv_lens [N] (cache length after this step's writes; a sequence with kv_len 0 gets zeros),
    kv_b [L, H * (Dn + Dv)] (kv_b_proj, per head: key nope then value). block_keys (static): rows of
    a window. impl: each window's attention by "triton" (the Pallas Triton kernel; interpret: in the Pallas
    interpreter; config: its tuning), "cudnn" (long_prefix_cudnn.py, GPU) or "reference" (jnp); the cuDNN split of
    one sequence's prefix (long_prefix_split.py) builds on this op and is chosen in pallas_kernels/ops.py. Returns o [T, H, Dv] in q's dtype; padding tokens get zeros.
    """
    n_tok, heads, _ = q.shape
    lat = kv_b.shape[0]
    dv = kv_b.shape[-1] // heads - nope_dim
    kv_lens = kv_lens.astype(jnp.int32)
    cu_seqlens = cu_seqlens.astype(jnp.int32)
    total = jnp.sum(kv_lens)

    if impl not in IMPLS:
        raise ValueError(f"impl {impl!r}: expected one of {IMPLS}")

    def attend(kv, rows, starts):
        if impl == "cudnn":
            from pallas_kernels.mla.long_prefix_cudnn import block_attention_cudnn
            return block_attention_cudnn(q, kv, rows, cu_seqlens, kv_lens, starts, nope_dim=nope_dim, scale=scale,
                                         window=block_keys)
        if impl == "triton":
            return block_attention(q, kv, rows, cu_seqlens, kv_lens, starts, nope_dim=nope_dim, scale=scale,
                                   window=block_keys, out_dtype=jnp.float32, interpret=interpret, config=config)
        return block_attention_reference(q, kv, rows, cu_seqlens, kv_lens, starts, nope_dim=nope_dim, scale=scale,
                                         window=block_keys)

    def window(j, carry):
        offset = j * block_keys
        rows, starts = gather_latents(kv_pages, block_tables, kv_lens, block_keys, offset)
        rows = fp8_cache.values(rows, q.dtype, lat)       # an FP8 pool's window dequantized here
        kv = (rows[:, :lat].astype(kv_b.dtype) @ kv_b).astype(q.dtype).reshape(block_keys, heads, nope_dim + dv)
        o_b, lse_b = attend(kv, rows, starts - offset)
        return merge(*carry, o_b, lse_b)

    init = (jnp.zeros((n_tok, heads, dv), jnp.float32), jnp.full((n_tok, heads), -jnp.inf, jnp.float32))
    o, _ = jax.lax.fori_loop(0, (total + block_keys - 1) // block_keys, window, init)
    return o.astype(q.dtype)
