"""MLA prefill in expanded (non-absorbed) form: per-head keys/values, varlen causal attention.

The absorbed form (paged.py) costs 2*(L+R + L) = 2*(576+512) FLOPs per (query, key) pair and
head. Expanding a step's keys once (the caller multiplies the gathered latents by kv_b_proj)
costs 2*L*(nope+v) per key and head, after which a pair costs 2*(nope+R + v) = 2*(192+128):
cheaper whenever the queries per key are many, i.e. prefill chunks over short contexts.

Key buffer layout: sequence n's cache positions 0..kv_lens[n]-1 (its context and this step's
chunk, already written to the pages) sit at rows kv_start[n] + pos of a flat buffer of a static
`num_keys` rows; rows past sum(kv_lens) are zeros. The caller checks sum(kv_lens) <= num_keys.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.mla.paged import _use_kernel, chunk_schedule
from pallas_kernels.mla.reference import token_positions


def key_starts(kv_lens):
    """[N] int32 row of each sequence's first key in the flat key buffer."""
    kv_lens = kv_lens.astype(jnp.int32)
    return jnp.cumsum(kv_lens) - kv_lens


def gather_latents(kv_pages, block_tables, kv_lens, num_keys):
    """The step's cached rows laid out flat: ([num_keys, L+R] rows, [N] kv_start).

    Rows past sum(kv_lens) are zeros (never read through the pages, so garbage pages cannot
    leak); rows past num_keys are dropped (the caller guarantees they do not exist).
    """
    num_pages, page_size, width = kv_pages.shape
    kv_lens = kv_lens.astype(jnp.int32)
    starts = key_starts(kv_lens)
    k = jnp.arange(num_keys, dtype=jnp.int32)
    ends = starts + kv_lens
    seq = jnp.clip(jnp.searchsorted(ends, k, side="right"), 0, kv_lens.shape[0] - 1)
    pos = k - starts[seq]
    valid = k < ends[-1]
    page = block_tables.astype(jnp.int32)[seq, jnp.where(valid, pos // page_size, 0)]
    rows = kv_pages.reshape(num_pages * page_size, width)[page * page_size + pos % page_size]
    return jnp.where(valid[:, None], rows, jnp.zeros((), rows.dtype)), starts


def expanded_attention_reference(q, kv, latents, cu_seqlens, kv_lens, kv_start, *, nope_dim, scale,
                                 batch_size=8):
    """Pure-jnp varlen causal attention over the flat key buffer.

    q [T, H, Dn + Dr] (nope, then rope), kv [K, H, Dn + Dv] (per-head key nope, then value: the
    latents times kv_b_proj), latents [K, L + Dr] (rope key in the last Dr columns), cu_seqlens [N+1],
    kv_lens [N] (after this step), kv_start [N]; Dn = nope_dim. Returns [T, H, Dv] in q.dtype;
    padding tokens get zeros.
    """
    n_tok = q.shape[0]
    dr = q.shape[-1] - nope_dim
    k_nope, v, k_rope = kv[..., :nope_dim], kv[..., nope_dim:], latents[:, latents.shape[-1] - dr:]
    seq, pos, _ = token_positions(cu_seqlens.astype(jnp.int32), kv_lens.astype(jnp.int32), n_tok)
    keys = jnp.arange(kv.shape[0], dtype=jnp.int32)
    f32 = jnp.float32

    def one(args):
        qt, n, p = args
        lo = kv_start[n]
        visible = (keys >= lo) & (keys <= lo + p)  # p < 0 (padding): nothing visible
        s = (jnp.einsum("hd,khd->hk", qt[:, :nope_dim], k_nope, preferred_element_type=f32)
             + jnp.einsum("hd,kd->hk", qt[:, nope_dim:], k_rope, preferred_element_type=f32))
        s = jnp.where(visible[None, :], s * scale, -jnp.inf)
        m = jnp.max(s, axis=-1, keepdims=True)
        prob = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0))
        denom = jnp.sum(prob, axis=-1, keepdims=True)
        vv = jnp.where(visible[:, None, None], v, jnp.zeros((), v.dtype)).astype(f32)
        o = jnp.einsum("hk,khd->hd", prob, vv)
        return jnp.where(denom > 0, o / jnp.where(denom > 0, denom, 1.0), 0.0)

    out = jax.lax.map(one, (q, seq, pos), batch_size=min(batch_size, n_tok))
    return out.astype(q.dtype)


# The fastest of the tile configs measured at a 4096-token prefill step (docs/performance.md, "Tuning of
# record"); splitting off the unmasked blocks saves ~5%.
DEFAULT_TUNING = dict(bq=128, bk=64, num_warps=8, num_stages=3, split_causal=True)


def _kernel_path(q, kv, latents, cu_seqlens, kv_lens, kv_start, *, nope_dim, scale, interpret, config):
    from pallas_kernels.mla.expanded_triton import varlen_attention_call
    cfg = {**DEFAULT_TUNING, **dict(config or {})}
    bq, bk = cfg["bq"], cfg["bk"]
    n_tok = q.shape[0]
    n_seqs = kv_lens.shape[0]
    cu_seqlens = cu_seqlens.astype(jnp.int32)
    kv_lens = kv_lens.astype(jnp.int32)
    seq, first, n_valid, pos0 = chunk_schedule(cu_seqlens, kv_lens, -(-n_tok // bq) + n_seqs, bq)
    meta = jnp.stack([first, n_valid, pos0, kv_start.astype(jnp.int32)[seq]], axis=-1)
    if interpret:  # the interpreter clamps out-of-range slices (see varlen_attention_call)
        pad = lambda x, n: jnp.pad(x, ((0, n),) + ((0, 0),) * (x.ndim - 1))
        q, kv, latents = pad(q, bq), pad(kv, bk), pad(latents, bk)
    out = varlen_attention_call(meta, q, kv, latents, nope_dim=nope_dim, scale=scale,
                                interpret=bool(interpret), **cfg)[:n_tok]
    tok_ok = jnp.arange(n_tok, dtype=jnp.int32) < cu_seqlens[n_seqs]
    return jnp.where(tok_ok[:, None, None], out, jnp.zeros((), out.dtype))


@functools.partial(jax.jit, static_argnames=("nope_dim", "scale", "interpret", "config"))
def expanded_attention(q, kv, latents, cu_seqlens, kv_lens, kv_start, *, nope_dim, scale, interpret=None,
                       config=None):
    """Varlen causal attention (contract of `expanded_attention_reference`).

    GPU -> Pallas Triton kernel; elsewhere the jnp reference unless ``interpret=True``.
    ``config``: optional hashable tuple of (key, value) pairs over DEFAULT_TUNING's keys.
    """
    if not _use_kernel(interpret):
        return expanded_attention_reference(q, kv, latents, cu_seqlens, kv_lens, kv_start,
                                            nope_dim=nope_dim, scale=scale)
    return _kernel_path(q, kv, latents, cu_seqlens, kv_lens, kv_start, nope_dim=nope_dim, scale=scale,
                        interpret=interpret, config=config)
