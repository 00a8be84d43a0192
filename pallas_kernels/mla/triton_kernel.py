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


def _plane(words, b):
    """Byte b of every uint32 latent word (fp8_cache.py: one plane of latent columns) as float8_e4m3fn codes:
    a shift, a mask and a narrowing cast, all elementwise."""
    x = words >> (8 * b) if b else words
    x = x & 0xFF if b < fp8_cache.PLANES - 1 else x
    return jax.lax.bitcast_convert_type(x.astype(jnp.uint8), fp8_cache.FP8)


def _halves(words):
    """Rope words [bk, R/2] -> (even dims, odd dims) [bk, R/2] fp32, exact: bf16 is the top half of an fp32,
    so each half moved into the top bits is its value."""
    return (jax.lax.bitcast_convert_type(words << 16, jnp.float32),
            jax.lax.bitcast_convert_type(words & jnp.uint32(0xFFFF0000), jnp.float32))


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
    # the latent's column tiles: one for a 16-bit cache; an FP8 cache's segments (fp8_cache.segments: byte
    # planes of its latent words, each inside one scale tile), each dequantized and contracted on its own
    # (Triton has no tensor slicing, so per-segment operands are loaded per segment)
    segs = fp8_cache.segments(lat) if fp8 else None
    col_tiles = [(sg.start, sg.width) for sg in segs] if fp8 else [(0, lat)]

    row_sl = pl.ds(start_row, rows)
    ql = [plgpu.load(ql_ref.at[row_sl, pl.ds(c0, w)], mask=row_ok[:, None], other=0) for c0, w in col_tiles]
    if fp8:  # the rope query as [even dims | odd dims] (mla_tiles_call), the two halves of the rope words
        half = rope // 2
        qr = [plgpu.load(qr_ref.at[row_sl, pl.ds(c0, half)], mask=row_ok[:, None], other=0) for c0 in (0, half)]
    else:
        qr = [plgpu.load(qr_ref.at[row_sl, :], mask=row_ok[:, None], other=0)]

    kv_end = base_pos + n_valid  # exclusive: last visible key of the tile + 1
    k_lo, k_hi = split_range(split, live, kv_end, bk)     # a split past the live ones: lo >= kv_end, no blocks
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
        """(ckv tiles [bk, width] each (the MMAs' operands: QK, then PV), an FP8 block's scales ([bk] fp32 a
        scale tile) or None, krope: [[bk, R]], or an FP8 block's [even dims, odd dims] [bk, R/2] each) of the
        block at k0 in kdt; keys >= k_hi read as zeros."""
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
            return ckv, ckv, None, [cols(lat, rope)]
        # packed row of uint32 words (fp8_cache.py): every part is a whole loaded tile taken apart by
        # elementwise ops (shifts, masks, bitcasts), never rearranged across lanes. The codes convert to kdt
        # exactly (e4m3 fits bf16); the scales stay fp32 and multiply the scores and the probabilities per key
        # instead of every latent value.
        lw = fp8_cache.latent_words(lat)
        n_sc = fp8_cache.num_scales(lat)

        def planes(load_words):
            """Each segment's codes: its word chunk loaded once (load_words(word, width)), a byte plane each."""
            chunks = {}
            for sg in segs:
                if sg.word not in chunks:
                    chunks[sg.word] = load_words(sg.word, sg.width)
                yield _plane(chunks[sg.word], sg.byte)

        def codes(eviction_policy=None):
            return list(planes(lambda c0, w: cols(c0, w, eviction_policy)))

        def codes_t(eviction_policy=None):
            """The codes as [width, bk] tiles, loaded transposed (the keys-on-M form's P.V operand)."""
            return list(planes(lambda c0, w: plgpu.load(
                kv_ref.at[row_idx.reshape(1, bk), (c0 + jnp.arange(w, dtype=jnp.int32))[:, None]],
                mask=ok.reshape(1, bk), other=0, eviction_policy=eviction_policy)))

        def word(c):
            """Word column c of the block's rows as [bk] (a 32-bit load a key, no reshape of a loaded tile)."""
            live = keys < k_hi
            if contiguous:
                return plgpu.load(kv_ref.at[pl.ds(pages * page_size + k0 % page_size, bk), jnp.int32(c)], mask=live,
                                  other=0)
            return plgpu.load(kv_ref.at[pages * page_size + offsets, jnp.full((bk,), c, jnp.int32)], mask=live,
                              other=0)

        sc = [jax.lax.bitcast_convert_type(word(lw + t), jnp.float32) for t in range(n_sc)]   # [bk] a tile
        kr = [x.astype(kdt) for x in _halves(cols(lw + n_sc, rope // 2))]
        codes_scale = fp8_scale == "codes"  # dequantized values (fp32 product rounded to kdt), the 16-bit step
        def dequant(cs, keys_axis=0):
            if not codes_scale:
                return [c.astype(kdt) for c in cs]
            return [(c.astype(jnp.float32) * jnp.expand_dims(sc[sg.scale], 1 - keys_axis)).astype(kdt)
                    for c, sg in zip(cs, segs)]
        sc_out = None if codes_scale else sc
        if not reload:
            ckv = dequant(codes())
            return ckv, ckv, sc_out, kr
        # each MMA its own load of the codes (see reload); the first read keeps the lines in L2 for the second,
        # and the distinct policies keep the two loads from being merged
        if pv_loaded_t:
            return dequant(codes("evict_last")), dequant(codes_t("evict_first"), keys_axis=1), sc_out, kr
        return dequant(codes("evict_last")), dequant(codes("evict_first")), sc_out, kr

    def scaled(part, sc, per_key):
        """An FP8 block's score parts (one a segment) summed within each scale tile, times that tile's scale
        of each key (per_key: [bk] -> its broadcast against a part)."""
        out = []
        for t, k in enumerate(sc):
            xs = [x for x, sg in zip(part, segs) if sg.scale == t]
            y = xs[0]
            for x in xs[1:]:
                y = y + x
            out.append(y * per_key(k))
        return out

    def step(k0, ckv, ckv_pv, sc, kr, acc, m, l):
        """One online-softmax block. sc: None, or an FP8 block's per-key scale of each scale tile [bk], applied
        to that tile's scores and probabilities (the codes enter the MMAs unscaled). kr: the rope keys, paired
        with qr's parts (an FP8 block's even and odd dims)."""
        keys = k0 + jnp.arange(bk, dtype=jnp.int32)
        if transposed:  # keys on the MMA M axis: M = bk and M = L are multiples of 64
            part = [plgpu.dot(c, q, trans_b=True) for c, q in zip(ckv, ql)]
            if sc is not None:
                part = scaled(part, sc, lambda k: k[:, None])
            st = part[0]
            for x in part[1:]:
                st = st + x
            for k, q in zip(kr, qr):
                st = st + plgpu.dot(k, q, trans_b=True)
            st = jnp.where(keys[:, None] <= pos[None, :], st * qk_scale, _MASK)  # [bk, rows]
            m_new = jnp.maximum(m, jnp.max(st, axis=0))
            alpha = jnp.exp2(m - m_new)
            pt = jnp.exp2(st - m_new[None, :])
            l_new = l * alpha + jnp.sum(pt, axis=0)
            if sc is None:
                acc = [a * alpha[None, :] + plgpu.dot(c, pt.astype(kdt), trans_a=not pv_loaded_t)
                       for a, c in zip(acc, ckv_pv)]
            else:
                pk = [(pt * k[:, None]).astype(kdt) for k in sc]
                acc = [a * alpha[None, :] + plgpu.dot(c, pk[sg.scale], trans_a=not pv_loaded_t)
                       for a, c, sg in zip(acc, ckv_pv, segs)]
            return acc, m_new, l_new
        part = [plgpu.dot(q, c, trans_b=True) for c, q in zip(ckv, ql)]
        if sc is not None:
            part = scaled(part, sc, lambda k: k[None, :])
        s = part[0]
        for x in part[1:]:
            s = s + x
        for q, k in zip(qr, kr):
            s = s + plgpu.dot(q, k, trans_b=True)
        p, alpha, m_new, l_new = online_softmax(s, keys[None, :] <= pos[:, None], qk_scale, m, l)
        if sc is None:
            acc = [a * alpha[:, None] + plgpu.dot(p.astype(kdt), c) for a, c in zip(acc, ckv_pv)]
        else:
            pk = [(p * k[None, :]).astype(kdt) for k in sc]
            acc = [a * alpha[:, None] + plgpu.dot(pk[sg.scale], c) for a, c, sg in zip(acc, ckv_pv, segs)]
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
    MMA (True) or once (False); None: the kernel's choice by form (see _kernel). An FP8 pool's rows are
    fp8_cache.py's uint32 words; qr_rows stay in natural order (split into even and odd dims here).
    """
    if fp8_scale not in ("scores", "codes"):
        raise ValueError(f"fp8_scale must be 'scores' or 'codes', not {fp8_scale!r}")
    num_pages, page_size, width = kv_pages.shape
    n_seqs, max_pages = block_tables.shape
    lat = ql_rows.shape[1]
    if fp8_cache.is_fp8(kv_pages):
        # the rope query's even dims, then its odd dims: the kernel pairs them with the halves of the rope
        # words (fp8_cache.py), two contiguous column tiles, so nothing is interleaved in the kernel
        qr_rows = jnp.concatenate([qr_rows[:, 0::2], qr_rows[:, 1::2]], axis=1)
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
