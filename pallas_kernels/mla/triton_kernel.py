"""Pallas (Triton backend) kernel for paged absorbed MLA attention.

One kernel serves decode and ragged prefill. The work is cut into *tiles*: a tile is M
consecutive rows of the flattened query ``[T*H]`` (one token x a block of bh heads, or bq
tokens x all H heads), all belonging to one sequence. Every tile streams that sequence's
latent cache once per key split, so all heads of the tile share one read of each 576-wide
cache row (the cache is MQA-like: one latent per token for all heads).

Per key block of bk keys (flash attention, base-2 online softmax, fp32 stats):
  s   = (q_lat @ ckv^T + q_rope @ krope^T) * scale*log2(e)      [M, bk]
  p   = exp2(s - m);  acc = acc * alpha + p @ ckv                  [M, L]
The kernel writes per key split the normalised output (q dtype) and fp32 (m, l);
`combine_splits` merges them (flash-decoding) and zeroes rows no tile covered (padding).

`transposed=True` computes S^T = K Q^T and O^T = C^T P^T instead, so the MMA M dimension is
the key block / the latent width (multiples of 64, wgmma-eligible on Hopper) rather than the
32-row head tile.

Grid = (tiles, splits): tiles vary fastest so head blocks of one sequence run together and
share the cache rows through L2. Cache rows past a tile's last key are never loaded (masked
loads read zeros), so garbage or NaN in unused page slots / page 0 cannot leak.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.mla import fp8_cache
from pallas_kernels.mla.splits import split_range

_LOG2E = math.log2(math.e)
_MASK = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite: avoids inf - inf = NaN


def online_softmax(s, visible, qk_scale, m, l):
    """One flash-attention block, rows form: scores s [rows, bk] (masked where not visible, base 2;
    visible None: all) against the running max m / denominator l [rows]. Returns (p, alpha, m_new, l_new)."""
    s = s * qk_scale if visible is None else jnp.where(visible, s * qk_scale, _MASK)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    alpha = jnp.exp2(m - m_new)
    p = jnp.exp2(s - m_new[:, None])
    return p, alpha, m_new, l * alpha + jnp.sum(p, axis=1)


def _pairs(x):
    """x [bk, 2k] -> (x[:, 0::2], x[:, 1::2]) [bk, k] each: a reshape and Triton's split of a last axis of 2
    (in registers), where strided column loads would be byte gathers."""
    n, w = x.shape
    return jnp.unstack(x.reshape(n, w // 2, 2), axis=2)


def _columns(x):
    """x [bk, n] -> its n columns [bk] each (split in halves where n is a power of two, else selected)."""
    n, w = x.shape
    if w & (w - 1) == 0:
        return [c.reshape(n) for c in jax.lax.split(x, (1,) * w, axis=1)] if w > 1 else [x.reshape(n)]
    j = jnp.arange(w, dtype=jnp.int32)[None, :]
    return [jnp.sum(jnp.where(j == t, x, 0), axis=1) for t in range(w)]


def _kernel(meta_ref, live_ref, bt_ref, ql_ref, qr_ref, kv_ref, o_ref, m_ref, l_ref, *,
            rows, bh, bq, bk, page_size, max_pages, splits, lat, scale, transposed, fp8_scale,
            fp8_reload):
    tile = pl.program_id(0)
    split = pl.program_id(1)
    seq = meta_ref[tile, 0]
    start_row = meta_ref[tile, 1]
    n_valid = meta_ref[tile, 2]
    base_pos = meta_ref[tile, 3]
    live = live_ref[0]      # the splits this step uses (<= splits); a program past them loads and stores nothing

    r = jnp.arange(rows, dtype=jnp.int32)
    tok = r // bh
    row_ok = (r < bq * bh) & (tok < n_valid) & (split < live)
    pos = base_pos + tok  # causal limit of each row (keys <= pos are visible)

    rope = qr_ref.shape[1]
    fp8 = kv_ref.dtype == fp8_cache.STORAGE
    # the latent's column tiles: one for a 16-bit cache; an FP8 cache's scale tiles, each dequantized and
    # contracted on its own (Triton has no tensor slicing, so per-tile operands are loaded per tile)
    width = fp8_cache.tile(lat) if fp8 else lat
    col_tiles = [(c0, width) for c0 in range(0, lat, width)]

    row_sl = pl.ds(start_row, rows)
    ql = [plgpu.load(ql_ref.at[row_sl, pl.ds(c0, w)], mask=row_ok[:, None], other=0) for c0, w in col_tiles]
    qr = plgpu.load(qr_ref.at[row_sl, :], mask=row_ok[:, None], other=0)

    kv_end = base_pos + n_valid  # exclusive: last visible key of the tile + 1
    k_lo, k_hi = split_range(split, live, kv_end, bk)
    k_hi = jnp.where(split < live, k_hi, k_lo)
    n_blocks = jnp.maximum(pl.cdiv(k_hi - k_lo, bk), 0)
    qk_scale = scale * _LOG2E
    kdt = ql_ref.dtype if fp8 else kv_ref.dtype
    # An FP8 block's codes feed two MMAs. Triton's pipeliner leaves a load synchronous when its value reaches
    # the MMAs by two routes (one operand in registers, the other transposed or in shared memory: the keys-on-M
    # form, and the row form below 64 rows): there each MMA gets its own load of the codes, the keys-on-M P.V
    # operand loaded transposed ([width, bk]) so that both MMAs take a register operand from a pipelined copy.
    # 64-row tiles in row form read both operands from one pipelined copy (two would not fit in shared memory).
    reload = (transposed or rows < 64) if fp8_reload is None else fp8_reload
    pv_loaded_t = fp8 and reload and transposed
    contiguous = page_size % bk == 0  # block inside one page: contiguous rows

    def lookup(k0):
        """Page id(s) of the block at k0 (clamped: blocks past the table load nothing)."""
        if contiguous:
            return bt_ref[seq * max_pages + jnp.minimum(k0 // page_size, max_pages - 1)]
        keys = k0 + jnp.arange(bk, dtype=jnp.int32)
        pidx = seq * max_pages + jnp.minimum(keys // page_size, max_pages - 1)
        return plgpu.load(bt_ref.at[pidx], mask=keys < k_hi, other=0)

    def load(k0, pages):
        """(ckv tiles [bk, width] each, their scales ([bk] fp32 each) or None, krope [bk, R]) of the block at k0 in
        kdt; keys >= k_hi read as zeros."""
        keys = k0 + jnp.arange(bk, dtype=jnp.int32)
        ok = (keys < k_hi)[:, None]
        offsets = k0 % page_size + jnp.arange(bk, dtype=jnp.int32) if contiguous else keys % page_size
        row_idx = (pages * page_size + offsets)[:, None]                  # the block's pool rows

        def cols(c0, n, eviction_policy=None):
            """Columns [c0, c0 + n) of the block's rows."""
            if contiguous:
                return plgpu.load(kv_ref.at[pl.ds(pages * page_size + k0 % page_size, bk), pl.ds(c0, n)],
                                  mask=ok, other=0, eviction_policy=eviction_policy)
            # gather rows through the block table (int-array rows need int-array cols)
            return plgpu.load(kv_ref.at[row_idx, c0 + jnp.arange(n, dtype=jnp.int32)[None, :]], mask=ok, other=0,
                              eviction_policy=eviction_policy)

        if not fp8:
            ckv = [cols(0, lat)]
            return ckv, ckv, None, cols(lat, rope)
        # packed row (fp8_cache.py): every part is read as whole contiguous byte columns (vectorized loads)
        # and reassembled in registers by even/odd splits (Triton bitcasts only between equal widths).
        # The codes convert to kdt exactly (e4m3 fits bf16); the scales stay fp32 and multiply the scores
        # and the probabilities per key instead of every latent value.
        def codes(eviction_policy=None):
            return [jax.lax.bitcast_convert_type(cols(c0, w, eviction_policy), fp8_cache.FP8) for c0, w in col_tiles]

        def codes_t(eviction_policy=None):
            """The codes as [width, bk] tiles, loaded transposed (the keys-on-M form's P.V operand)."""
            out = []
            for c0, w in col_tiles:
                x = plgpu.load(kv_ref.at[row_idx.reshape(1, bk), (c0 + jnp.arange(w, dtype=jnp.int32))[:, None]],
                               mask=ok.reshape(1, bk), other=0, eviction_policy=eviction_policy)
                out.append(jax.lax.bitcast_convert_type(x, fp8_cache.FP8))
            return out
        n_sc = len(col_tiles)
        b02, b13 = _pairs(cols(lat, 4 * n_sc))                           # bytes 0, 2 / 1, 3 of each scale
        lo, hi = _pairs(b02.astype(jnp.uint32) | (b13.astype(jnp.uint32) << 8))        # low / high 16 bits
        sc = _columns(jax.lax.bitcast_convert_type(lo | (hi << 16), jnp.float32))     # [bk] a tile
        lo, hi = _pairs(cols(lat + 4 * n_sc, 2 * rope))
        kr = jax.lax.bitcast_convert_type(lo.astype(jnp.uint16) | (hi.astype(jnp.uint16) << 8),
                                          fp8_cache.ROPE).astype(kdt)
        codes_scale = fp8_scale == "codes"  # dequantized values (fp32 product rounded to kdt), the 16-bit step
        def dequant(cs, keys_axis=0):
            if not codes_scale:
                return [c.astype(kdt) for c in cs]
            return [(c.astype(jnp.float32) * jnp.expand_dims(k, 1 - keys_axis)).astype(kdt) for c, k in zip(cs, sc)]
        sc_out = None if codes_scale else sc
        if not reload:
            ckv = dequant(codes())
            return ckv, ckv, sc_out, kr
        # each MMA its own load of the codes (see reload); the first read keeps the lines in L2 for the second,
        # and the distinct policies keep the two loads from being merged
        if pv_loaded_t:
            return dequant(codes("evict_last")), dequant(codes_t("evict_first"), keys_axis=1), sc_out, kr
        return dequant(codes("evict_last")), dequant(codes("evict_first")), sc_out, kr

    def step(k0, ckv, ckv_pv, sc, kr, acc, m, l):
        """One online-softmax block. sc: None, or an FP8 block's per-key scale of each column tile [bk], applied
        to that tile's scores and probabilities (the codes enter the MMAs unscaled)."""
        keys = k0 + jnp.arange(bk, dtype=jnp.int32)
        if transposed:  # keys on the MMA M axis: M = bk and M = L are multiples of 64
            part = [plgpu.dot(c, q, trans_b=True) for c, q in zip(ckv, ql)]
            if sc is not None:
                part = [x * k[:, None] for x, k in zip(part, sc)]
            st = part[0]
            for x in part[1:]:
                st = st + x
            st = st + plgpu.dot(kr, qr, trans_b=True)
            st = jnp.where(keys[:, None] <= pos[None, :], st * qk_scale, _MASK)  # [bk, rows]
            m_new = jnp.maximum(m, jnp.max(st, axis=0))
            alpha = jnp.exp2(m - m_new)
            pt = jnp.exp2(st - m_new[None, :])
            l_new = l * alpha + jnp.sum(pt, axis=0)
            if sc is None:
                acc = [a * alpha[None, :] + plgpu.dot(c, pt.astype(kdt), trans_a=not pv_loaded_t)
                       for a, c in zip(acc, ckv_pv)]
            else:
                acc = [a * alpha[None, :] + plgpu.dot(c, (pt * k[:, None]).astype(kdt), trans_a=not pv_loaded_t)
                       for a, c, k in zip(acc, ckv_pv, sc)]
            return acc, m_new, l_new
        part = [plgpu.dot(q, c, trans_b=True) for c, q in zip(ckv, ql)]
        if sc is not None:
            part = [x * k[None, :] for x, k in zip(part, sc)]
        s = part[0]
        for x in part[1:]:
            s = s + x
        s = s + plgpu.dot(qr, kr, trans_b=True)
        p, alpha, m_new, l_new = online_softmax(s, keys[None, :] <= pos[:, None], qk_scale, m, l)
        if sc is None:
            acc = [a * alpha[:, None] + plgpu.dot(p.astype(kdt), c) for a, c in zip(acc, ckv_pv)]
        else:
            acc = [a * alpha[:, None] + plgpu.dot((p * k[None, :]).astype(kdt), c) for a, c, k in zip(acc, ckv_pv, sc)]
        return acc, m_new, l_new

    # One block per iteration: page lookup, load, compute (Triton's pipeliner overlaps the
    # loads; carrying the next page id or block explicitly measured slower).
    def body(i, carry):
        k0 = k_lo + i * bk
        return step(k0, *load(k0, lookup(k0)), *carry)

    acc0 = [jnp.zeros((w, rows) if transposed else (rows, w), jnp.float32) for _, w in col_tiles]
    m0 = jnp.full((rows,), _MASK, jnp.float32)
    l0 = jnp.zeros((rows,), jnp.float32)
    acc, m, l = jax.lax.fori_loop(0, n_blocks, body, (acc0, m0, l0))

    denom = jnp.where(l > 0, l, 1.0)[:, None]
    for (c0, w), a in zip(col_tiles, acc):
        o = (a.T if transposed else a) / denom  # normalised per split: halves bf16 traffic
        plgpu.store(o_ref.at[split, row_sl, pl.ds(c0, w)], o.astype(o_ref.dtype), mask=row_ok[:, None])
    plgpu.store(m_ref.at[split, row_sl], m, mask=row_ok)
    plgpu.store(l_ref.at[split, row_sl], l, mask=row_ok)


def mla_tiles_call(meta, block_tables, ql_rows, qr_rows, kv_pages, *, scale, rows, bh, bq,
                   bk, splits, num_warps=8, num_stages=2, transposed=False,
                   fp8_scale="scores", fp8_reload=None, interpret=False, live_splits=None):
    """Run the kernel over a tile schedule.

    meta: [G, 4] int32 per tile (seq, start_row, n_valid_tokens, pos_of_first_token);
      n_valid 0 = empty tile. ql_rows [T*H + rows, L] / qr_rows [T*H + rows, R]: flattened
      queries padded by `rows` so every tile slice is in bounds. kv_pages [P, page_size, L+R].
    Returns per-split partials: o [splits, T*H + rows, L] (normalised, q dtype) and fp32
    m, l [splits, T*H + rows] (base-2 running max and softmax denominator). A tile's keys are divided over
    the splits by its own context (splits.split_range). live_splits: int32 [1], the splits this step uses
    (default all): the grid's later splits write nothing (combine_splits' `live` masks them), so one program
    serves a full bucket (few splits a tile) and a lone sequence (a split an SM).
    fp8_scale (an FP8 pool): "scores" multiplies each key's tile scale into that tile's scores and
    probabilities (the codes enter the MMAs as exact kdt values); "codes" dequantizes every latent value
    (code x scale in fp32, rounded to kdt) before the MMAs. fp8_reload: load an FP8 block's codes once per
    MMA (True) or once (False); None: the kernel's choice by form (see _kernel).
    """
    if fp8_scale not in ("scores", "codes"):
        raise ValueError(f"fp8_scale must be 'scores' or 'codes', not {fp8_scale!r}")
    num_pages, page_size, width = kv_pages.shape
    n_seqs, max_pages = block_tables.shape
    lat = ql_rows.shape[1]
    n_rows = ql_rows.shape[0]
    assert page_size % bk == 0 or bk % page_size == 0, (page_size, bk)
    kernel = functools.partial(
        _kernel, rows=rows, bh=bh, bq=bq, bk=bk, page_size=page_size, max_pages=max_pages,
        splits=splits, lat=lat, scale=float(scale), transposed=transposed, fp8_scale=fp8_scale,
        fp8_reload=fp8_reload)
    out_shape = [jax.ShapeDtypeStruct((splits, n_rows, lat), ql_rows.dtype),
                 jax.ShapeDtypeStruct((splits, n_rows), jnp.float32),
                 jax.ShapeDtypeStruct((splits, n_rows), jnp.float32)]
    return pl.pallas_call(
        kernel,
        grid=(meta.shape[0], splits),
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=(f"mla_paged_r{rows}_bk{bk}_s{splits}{'_t' if transposed else ''}"
              f"_w{num_warps}_st{num_stages}"
              f"{('_fp8' + ('c' if fp8_scale == 'codes' else '')) if fp8_cache.is_fp8(kv_pages) else ''}"),
    )(meta, jnp.full((1,), splits, jnp.int32) if live_splits is None else live_splits.astype(jnp.int32).reshape(1),
      block_tables.reshape(-1), ql_rows, qr_rows,
      kv_pages.reshape(num_pages * page_size, width))


def combine_splits(o, m, l, row_valid, live=None):
    """Merge per-split partials: o [S, rows, L], m, l [S, rows] -> [rows, L] fp32.

    row_valid [rows] marks rows some tile wrote; other rows (never stored) become zeros. live: the splits
    the kernel used (mla_tiles_call's live_splits; None: all); the others hold no partials and are masked.
    """
    ok = row_valid[None, :] & (l > 0)
    if live is not None:
        ok = ok & (jnp.arange(o.shape[0])[:, None] < jnp.reshape(live, ()))
    m = jnp.where(ok, m, -jnp.inf)
    m_tot = jnp.max(m, axis=0)
    w = jnp.where(ok, jnp.exp2(m - jnp.where(jnp.isfinite(m_tot), m_tot, 0.0)[None]) * l, 0.0)
    o = jnp.where(ok[..., None], o.astype(jnp.float32), 0.0)
    # Split by split, in order: a sum over the splits axis is a reduction whose order XLA picks from the
    # whole shape, so a row's bits would depend on how many rows the step has; speculative verification
    # rows must round as the decode rows they stand for (paged.ragged_paged_mla's token_rows).
    denom, num = w[0], w[0][:, None] * o[0]
    for s in range(1, o.shape[0]):
        denom, num = denom + w[s], num + w[s][:, None] * o[s]
    return jnp.where((denom > 0)[:, None], num / jnp.where(denom > 0, denom, 1.0)[:, None], 0.0)
