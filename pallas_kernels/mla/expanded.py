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


def gather_latents(kv_pages, block_tables, kv_lens, num_keys, offset=0):
    """The step's cached rows laid out flat: ([num_keys, L+R] rows, [N] kv_start).

    Row i holds flat key offset + i (sequence n's positions at kv_start[n] .. kv_start[n] + kv_lens[n]
    - 1 of the flat key space; offset > 0 reads a window of it). Rows past sum(kv_lens) are zeros
    (never read through the pages, so garbage pages cannot leak); keys past the window are left out.
    """
    num_pages, page_size, width = kv_pages.shape
    kv_lens = kv_lens.astype(jnp.int32)
    starts = key_starts(kv_lens)
    k = offset + jnp.arange(num_keys, dtype=jnp.int32)
    ends = starts + kv_lens
    seq = jnp.clip(jnp.searchsorted(ends, k, side="right", method="compare_all"), 0, kv_lens.shape[0] - 1)
    pos = k - starts[seq]
    valid = k < ends[-1]
    page = block_tables.astype(jnp.int32)[seq, jnp.where(valid, pos // page_size, 0)]
    rows = kv_pages.reshape(num_pages * page_size, width)[jnp.where(valid, page * page_size + pos % page_size, 0)]
    return jnp.where(valid[:, None], rows, jnp.zeros((), rows.dtype)), starts


def block_attention_reference(q, kv, latents, cu_seqlens, kv_lens, kv_start, *, nope_dim, scale, window=None,
                              batch_size=8):
    """Pure-jnp varlen causal attention over the flat key buffer, with each row's log-sum-exp.

    q [T, H, Dn + Dr] (nope, then rope), kv [K, H, Dn + Dv] (per-head key nope, then value: the
    latents times kv_b_proj), latents [K, L + Dr] (rope key in the last Dr columns), cu_seqlens [N+1],
    kv_lens [N] (after this step), kv_start [N] (buffer row of each sequence's position 0; negative
    when the buffer is a window that starts inside the sequence); Dn = nope_dim; window: rows of the
    buffer that hold keys (default K). Returns (o [T, H, Dv] in q.dtype, lse [T, H] fp32, natural
    log-sum-exp of the scaled visible scores, -inf where none); rows without keys and padding tokens
    get zeros.
    """
    n_tok = q.shape[0]
    dr = q.shape[-1] - nope_dim
    k_nope, v, k_rope = kv[..., :nope_dim], kv[..., nope_dim:], latents[:, latents.shape[-1] - dr:]
    seq, pos, _ = token_positions(cu_seqlens.astype(jnp.int32), kv_lens.astype(jnp.int32), n_tok)
    keys = jnp.arange(kv.shape[0], dtype=jnp.int32)
    in_window = keys < (kv.shape[0] if window is None else window)
    f32 = jnp.float32

    def one(args):
        qt, n, p = args
        lo = kv_start.astype(jnp.int32)[n]
        visible = (keys >= lo) & (keys <= lo + p) & in_window  # p < 0 (padding): nothing visible
        s = (jnp.einsum("hd,khd->hk", qt[:, :nope_dim], k_nope, preferred_element_type=f32)
             + jnp.einsum("hd,kd->hk", qt[:, nope_dim:], k_rope, preferred_element_type=f32))
        s = jnp.where(visible[None, :], s * scale, -jnp.inf)
        m = jnp.max(s, axis=-1, keepdims=True)
        m = jnp.where(jnp.isfinite(m), m, 0.0)
        prob = jnp.exp(s - m)
        denom = jnp.sum(prob, axis=-1, keepdims=True)
        vv = jnp.where(visible[:, None, None], v, jnp.zeros((), v.dtype)).astype(f32)
        o = jnp.einsum("hk,khd->hd", prob, vv)
        seen = denom > 0
        o = jnp.where(seen, o / jnp.where(seen, denom, 1.0), 0.0)
        lse = jnp.where(seen, m + jnp.log(jnp.where(seen, denom, 1.0)), -jnp.inf)[:, 0]
        return o, lse

    out, lse = jax.lax.map(one, (q, seq, pos), batch_size=min(batch_size, n_tok))
    return out.astype(q.dtype), lse


def expanded_attention_reference(q, kv, latents, cu_seqlens, kv_lens, kv_start, *, nope_dim, scale,
                                 batch_size=8):
    """`block_attention_reference`'s output alone (the whole buffer, kv_start >= 0)."""
    return block_attention_reference(q, kv, latents, cu_seqlens, kv_lens, kv_start, nope_dim=nope_dim,
                                     scale=scale, batch_size=batch_size)[0]


# The fastest of the tile configs measured at a 4096-token prefill step (docs/performance.md, "Tuning of
# record"); splitting off the unmasked blocks saves ~5%.
DEFAULT_TUNING = dict(bq=128, bk=64, num_warps=8, num_stages=3, split_causal=True)


def _kernel_path(q, kv, latents, cu_seqlens, kv_lens, kv_start, *, nope_dim, scale, window, out_dtype,
                 interpret, config):
    from pallas_kernels.mla.expanded_triton import varlen_attention_call
    cfg = {**DEFAULT_TUNING, **dict(config or {})}
    bq, bk = cfg["bq"], cfg["bk"]
    n_tok = q.shape[0]
    n_seqs = kv_lens.shape[0]
    n_keys = kv.shape[0]
    cu_seqlens = cu_seqlens.astype(jnp.int32)
    kv_lens = kv_lens.astype(jnp.int32)
    seq, first, n_valid, pos0 = chunk_schedule(cu_seqlens, kv_lens, -(-n_tok // bq) + n_seqs, bq)
    meta = jnp.stack([first, n_valid, pos0, kv_start.astype(jnp.int32)[seq]], axis=-1)
    if interpret:  # the interpreter clamps out-of-range slices (see varlen_attention_call)
        pad = lambda x, n: jnp.pad(x, ((0, n),) + ((0, 0),) * (x.ndim - 1))
        q, kv, latents = pad(q, bq), pad(kv, bk), pad(latents, bk)
    out, lse = varlen_attention_call(meta, q, kv, latents, nope_dim=nope_dim, scale=scale, interpret=bool(interpret),
                                     window=n_keys if window is None else window, out_dtype=out_dtype, **cfg)
    tok_ok = (jnp.arange(n_tok, dtype=jnp.int32) < cu_seqlens[n_seqs])[:, None]
    return (jnp.where(tok_ok[..., None], out[:n_tok], jnp.zeros((), out.dtype)),
            jnp.where(tok_ok, lse[:n_tok], -jnp.inf))


def kernel_fits(q, kv, nope_dim: int) -> bool:
    """The Triton kernel loads a head's key-nope, rope and value columns as blocks, and Triton blocks are
    powers of two wide: Kimi-Linear's and K3's 128 / 64 / 128 are, the trained tiny's 48-wide nope is not."""
    return all(d > 0 and d & (d - 1) == 0 for d in (nope_dim, q.shape[-1] - nope_dim, kv.shape[-1] - nope_dim))


@functools.partial(jax.jit, static_argnames=("nope_dim", "scale", "window", "out_dtype", "interpret", "config"))
def block_attention(q, kv, latents, cu_seqlens, kv_lens, kv_start, *, nope_dim, scale, window=None,
                    out_dtype=None, interpret=None, config=None):
    """Varlen causal attention with log-sum-exp (contract of `block_attention_reference`; o in
    out_dtype, default q's). GPU -> Pallas Triton kernel; elsewhere (and for head widths the kernel cannot
    load, `kernel_fits`) the jnp reference unless ``interpret=True``. ``config``: optional hashable tuple of
    (key, value) pairs over DEFAULT_TUNING's keys.
    """
    if not _use_kernel(interpret) or not kernel_fits(q, kv, nope_dim):
        o, lse = block_attention_reference(q, kv, latents, cu_seqlens, kv_lens, kv_start, nope_dim=nope_dim,
                                           scale=scale, window=window)
        return o.astype(out_dtype or q.dtype), lse
    return _kernel_path(q, kv, latents, cu_seqlens, kv_lens, kv_start, nope_dim=nope_dim, scale=scale,
                        window=window, out_dtype=out_dtype, interpret=interpret, config=config)


def expanded_attention(q, kv, latents, cu_seqlens, kv_lens, kv_start, *, nope_dim, scale, interpret=None,
                       config=None):
    """Varlen causal attention over the whole buffer (kv_start >= 0): `block_attention`'s output alone."""
    return block_attention(q, kv, latents, cu_seqlens, kv_lens, kv_start, nope_dim=nope_dim, scale=scale,
                           interpret=interpret, config=config)[0]
