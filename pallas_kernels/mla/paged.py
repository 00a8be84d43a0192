"""Public paged MLA entry points: tile schedule, config choice, backend dispatch.

GPU -> Pallas Triton kernel (triton_kernel.py). TPU and CPU -> the jnp reference, unless
``interpret=True`` (kernel run by the Pallas interpreter, used by the CPU tests). An FP8 pool (packed rows,
fp8_cache.py) is dequantized per key block by the Triton kernel and by the references; on TPU it takes the
reference.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.device_info import num_sms, smem_per_block
from pallas_kernels.mla import fp8_cache, reference
from pallas_kernels.mla.reference import decode_row_positions
from pallas_kernels.mla.splits import decode_splits, live_seqs, live_splits, pick_splits
from pallas_kernels.mla.triton_kernel import combine_splits, mla_tiles_call

# mla_tiles_call's defaults for knobs a tuning may leave out
KERNEL_DEFAULTS = {"max_rows": 32, "bk": 64, "num_stages": 2, "transposed": False}
MIN_TILE = 16  # Triton's MMA needs >= 16 rows and >= 16 keys a block; padding rows are masked


def _num_sms():
    return num_sms()


def _pow2_ceil(x):
    return 1 << max(0, (int(x) - 1).bit_length())


def pick_config(num_heads, page_size, max_pages, n_chunks, *, max_rows=32, bk=64,
                splits=None, min_rows=16, slots=None, decode=False):
    """Static tiling: rows per tile, heads per tile (bh), tokens per tile (bq), bk, splits (each tile then
    divides its own keys over the splits: splits.split_range)."""
    bh = num_heads
    while bh > max_rows or num_heads % bh:  # largest divisor of H that fits a tile
        bh -= 1
    bq = max(1, max_rows // num_heads) if bh == num_heads and not decode else 1
    rows = max(min_rows, _pow2_ceil(bq * bh))
    max_keys = max_pages * page_size
    bk = min(bk, _pow2_ceil(max_keys))
    n_tiles = n_chunks * (num_heads // bh)
    slots = slots or _num_sms()
    if splits is None:
        # decode: the grid holds a lone sequence's splits, each step uses those its live sequences fill the
        # slots with (splits.decode_splits, live_splits)
        splits = (decode_splits(n_tiles, num_heads // bh, -(-max_keys // bk), slots)
                  if decode else pick_splits(n_tiles, -(-max_keys // bk), slots))
    kps = -(-max_keys // splits)
    kps = -(-kps // bk) * bk
    splits = -(-max_keys // kps)
    return dict(rows=rows, bh=bh, bq=bq, bk=bk, splits=splits)


def default_tuning(num_heads, decode, max_keys=None, page_size=None, fp8=False):
    """Kernel knobs chosen from GPU sweeps (docs/performance.md, "Tuning of record").

    Decode, H <= 32: keys-on-M ("transposed") form, 4 warps, 2 stages, no explicit
    prefetch (2.50 / 2.80 TB/s at 8k / 128k; 3 stages, 1 stage, page-id or register
    prefetch and more splits all measured slower or equal).
    H > 32: row form, 8 warps, 64-row tiles (H=96: 48-head tiles padded to 64 rows), or for
    decode over block tables >= 64k keys wide (``max_keys``) 32-head tiles with 4 warps.
    Decode at H = 64k + 32 (K3's 96): the heads as two groups, H-32 in row form (r64 w8) + 32
    keys-on-M (w4), each with its own tiles (no padding rows), where that measured fastest, which
    flips with the page size (``page_size`` < 64: a 64-key block is gathered from several pages):
      pages >= 64: split < 64k keys (189 vs 171 TFLOP/s at 8k), 32-head tiles >= 64k (218 vs 207);
      pages of 16: 64-row tiles < 64k (153 vs 132 split), split >= 64k (151 vs 138 32-head tiles).
    Ragged prefill: row form, 8 warps (150 TFLOP/s at H=32 vs 140 transposed).
    An FP8 cache (fp8), decode at H <= 32: row form, 8 warps, each latent value dequantized before the MMAs
    (fp8_scale "codes"): 1.8x the keys-on-M form's speed, which reads the codes once per MMA
    (benchmarks/sweep_mla_fp8, page 64).
    """
    if fp8 and decode and num_heads <= 32:
        return {"num_warps": 8, "transposed": False, "fp8_scale": "codes"}
    if num_heads > 32:
        wide = decode and max_keys is not None and max_keys >= 65536
        gathered = page_size is not None and page_size < 64
        if decode and num_heads > 64 and num_heads % 64 == 32 and wide == gathered:
            row_form = (("max_rows", 64), ("num_warps", 8), ("transposed", False))
            return {"head_groups": ((num_heads - 32, row_form),
                                    (32, (("num_warps", 4), ("transposed", True))))}
        if wide:
            return {"max_rows": 32, "num_warps": 4, "transposed": False}
        return {"max_rows": 64, "num_warps": 8, "transposed": False}
    if decode:
        return {"num_warps": 4, "transposed": True}
    return {"num_warps": 8, "transposed": False}


def tuning_for(num_heads, decode, max_keys, page_size, config, fp8=False):
    """default_tuning overridden by config's keys. A config that names anything runs as one head
    group unless it names head_groups itself (so a measured variant is what it says)."""
    base = default_tuning(num_heads, decode, max_keys, page_size, fp8)
    if config:
        base.pop("head_groups", None)
    return {**base, **dict(config or {})}


def smem_estimate(rows, bk, num_stages, lat, rope, itemsize, transposed):
    """Upper estimate of the kernel's shared memory (bytes): num_stages buffers of the cache block
    [bk, L+R], the query tile [rows, L+R] and the probabilities [rows, bk]; in keys-on-M form with
    4-byte inputs also a K-major copy of the latent block (tf32 wgmma reads no transposed operand).
    Triton asked for 425,984 bytes at fp32, rows 64, bk 64, 2 stages (estimate 458,752); every bf16
    default estimates <= 229,376 and compiles."""
    width = lat + rope
    need = (num_stages * bk * width + rows * width + rows * bk) * itemsize
    if transposed and itemsize >= 4:
        need += bk * lat * itemsize
    return need


def fit_shared_memory(tune, num_heads, max_keys, lat, rope, itemsize, decode, smem_limit):
    """tune with max_rows / bk / num_stages shrunk until smem_estimate fits smem_limit: the key
    block first (down to 16), then the pipeline stages, then the rows (fp32 needs twice bf16's).
    Raises ValueError when even 16 rows, 16 keys and one stage do not fit."""
    t = {**KERNEL_DEFAULTS, **tune}
    bk = min(t["bk"], _pow2_ceil(max_keys))
    while True:
        probe = pick_config(num_heads, 1, max_keys, 1, max_rows=t["max_rows"], bk=bk, splits=1,
                            min_rows=MIN_TILE, slots=1, decode=decode)
        need = smem_estimate(probe["rows"], probe["bk"], t["num_stages"], lat, rope, itemsize,
                             t["transposed"])
        if need <= smem_limit:
            return {**t, "bk": bk}
        if bk > MIN_TILE:
            bk //= 2
        elif t["num_stages"] > 1:
            t["num_stages"] -= 1
        elif t["max_rows"] > 1 and probe["rows"] > MIN_TILE:
            t["max_rows"] = max(1, t["max_rows"] // 2)
        else:
            raise ValueError(f"no MLA tile fits {smem_limit} bytes of shared memory "
                             f"(L={lat}, R={rope}, {itemsize}-byte inputs, H={num_heads}): "
                             f"needs {need}")


def chunk_schedule(cu_seqlens, kv_lens, n_chunks, bq):
    """Cut each sequence's query tokens into chunks of <= bq tokens (one sequence per chunk).

    Returns int32 [n_chunks] each: seq, first (flat token index), n_valid (0 = empty chunk) and
    pos0 (cache position of the chunk's first token). n_chunks >= ceil(T / bq) + N covers any
    ragged layout of T tokens over N sequences.
    """
    n_seqs = kv_lens.shape[0]
    c = jnp.arange(n_chunks, dtype=jnp.int32)
    n_tok = cu_seqlens[1:] - cu_seqlens[:-1]
    cu_ch = jnp.concatenate([jnp.zeros((1,), jnp.int32),
                             jnp.cumsum((n_tok + bq - 1) // bq).astype(jnp.int32)])
    seq = jnp.clip(jnp.searchsorted(cu_ch[1:], c, side="right", method="compare_all"), 0, n_seqs - 1)
    seq = seq.astype(jnp.int32)
    local = c - cu_ch[seq]
    first = cu_seqlens[seq] + local * bq
    n_valid = jnp.where(c < cu_ch[n_seqs], jnp.clip(n_tok[seq] - local * bq, 0, bq), 0)
    pos0 = kv_lens[seq] - (cu_seqlens[seq + 1] - first)
    pos0 = jnp.where(n_valid > 0, pos0, 0)  # empty chunk: no keys, no work
    first = jnp.where(n_valid > 0, first, 0)
    return seq, first, n_valid, pos0


def _tile_meta(cu_seqlens, kv_lens, n_chunks, bq, bh, num_heads, decode):
    """[n_chunks * H/bh, 4] int32 tiles (seq, start_row, n_valid, pos of first token)."""
    hb = num_heads // bh
    if decode:  # one chunk per sequence of at most one token (0 = padding sequence: empty tile)
        seq = jnp.arange(n_chunks, dtype=jnp.int32)
        first, n_valid = cu_seqlens[:-1], cu_seqlens[1:] - cu_seqlens[:-1]
        pos0 = jnp.where(n_valid > 0, kv_lens[seq] - 1, 0)
    else:
        seq, first, n_valid, pos0 = chunk_schedule(cu_seqlens, kv_lens, n_chunks, bq)
    j = jnp.arange(hb, dtype=jnp.int32)
    start_row = first[:, None] * num_heads + j[None, :] * bh
    meta = jnp.stack([jnp.broadcast_to(seq[:, None], start_row.shape), start_row,
                      jnp.broadcast_to(n_valid[:, None], start_row.shape),
                      jnp.broadcast_to(pos0[:, None], start_row.shape)], axis=-1)
    return meta.reshape(n_chunks * hb, 4).astype(jnp.int32)


def _token_tile_meta(cu_seqlens, kv_lens, n_tok, bh, num_heads):
    """[n_tok * H/bh, 4] int32 decode tiles, one per token (token_rows): the token's sequence, its rows, one
    valid token and its own cache position (decode_row_positions)."""
    t = jnp.arange(n_tok, dtype=jnp.int32)
    seq, pos, valid = decode_row_positions(cu_seqlens, kv_lens, n_tok)
    n_valid = valid.astype(jnp.int32)
    j = jnp.arange(num_heads // bh, dtype=jnp.int32)
    start_row = t[:, None] * num_heads + j[None, :] * bh
    col = lambda x: jnp.broadcast_to(x[:, None], start_row.shape)    # noqa: E731
    meta = jnp.stack([col(seq), start_row, col(n_valid), col(pos)], axis=-1)
    return meta.reshape(-1, 4).astype(jnp.int32)


def _kernel_path(q_latent, q_rope, kv_pages, block_tables, cu_seqlens, kv_lens, *, scale,
                 decode, interpret, config, token_rows=False):
    n_tok, num_heads, lat = q_latent.shape
    _, page_size, _ = kv_pages.shape
    n_seqs, max_pages = block_tables.shape
    cfg = tuning_for(num_heads, decode, max_pages * page_size, page_size, config, fp8_cache.is_fp8(kv_pages))
    groups = cfg.pop("head_groups", None)
    if groups:  # e.g. H=96 as 64 + 32: each group its own tiles (no padding rows) and tuning
        # an entry is a head count (config's other keys apply) or (heads, config tuple or None)
        rest = {k: v for k, v in dict(config or {}).items() if k != "head_groups"}
        groups = [(g, rest) if isinstance(g, int) else (g[0], dict(g[1] or ())) for g in groups]
        if sum(h for h, _ in groups) != num_heads:
            raise ValueError(f"head_groups {groups} must sum to H={num_heads}")
        outs, a = [], 0
        for h, group_cfg in groups:
            outs.append(_kernel_path(q_latent[:, a:a + h], q_rope[:, a:a + h], kv_pages, block_tables,
                                     cu_seqlens, kv_lens, scale=scale, decode=decode,
                                     interpret=interpret, config=group_cfg, token_rows=token_rows))
            a += h
        return jnp.concatenate(outs, axis=1)
    # an FP8 pool's words hold narrower values (4 codes, or 2 bf16 rope dims): its blocks take no more
    # shared memory than the queries' dtype would
    itemsize = jnp.dtype(q_latent.dtype).itemsize
    if not fp8_cache.is_fp8(kv_pages):
        itemsize = max(itemsize, jnp.dtype(kv_pages.dtype).itemsize)
    cfg = fit_shared_memory(cfg, num_heads, max_pages * page_size, lat, q_rope.shape[-1], itemsize,
                            decode, smem_per_block())
    tune = {k: cfg.pop(k) for k in ("max_rows", "bk", "splits", "slots") if k in cfg}
    probe = pick_config(num_heads, page_size, max_pages, 1, min_rows=MIN_TILE, decode=decode,
                        **tune)
    bq = probe["bq"]
    n_chunks = n_seqs if decode else (n_tok if bq == 1 else -(-n_tok // bq) + n_seqs)
    # token_rows: a tile per token, split as a decode step of the n_seqs sequences (pick_config's splits
    # depend on its tile count): each token's keys cut where that step cuts them
    tc = pick_config(num_heads, page_size, max_pages, n_chunks, min_rows=MIN_TILE,
                     decode=decode, **tune)
    rows = tc["rows"]
    cu_seqlens = cu_seqlens.astype(jnp.int32)
    kv_lens = kv_lens.astype(jnp.int32)
    if token_rows:
        meta = _token_tile_meta(cu_seqlens, kv_lens, n_tok, tc["bh"], num_heads)
    else:
        meta = _tile_meta(cu_seqlens, kv_lens, n_chunks, tc["bq"], tc["bh"], num_heads, decode)
    live = None
    if decode and "splits" not in tune:
        live = live_splits(live_seqs(cu_seqlens), tc["splits"], num_heads // tc["bh"], tune.get("slots") or _num_sms())
    # a decode step's tokens are its first n_seqs at most (one a sequence): the partials need only their rows
    n_rows = min(n_tok, n_seqs) if decode and not token_rows else n_tok
    pad = ((0, rows), (0, 0))
    ql = jnp.pad(q_latent[:n_rows].reshape(n_rows * num_heads, lat), pad)
    qr = jnp.pad(q_rope[:n_rows].reshape(n_rows * num_heads, q_rope.shape[-1]), pad)
    acc, m, l = mla_tiles_call(meta, block_tables.astype(jnp.int32), ql, qr, kv_pages,
                               scale=scale, interpret=bool(interpret), live_splits=live, **tc, **cfg)
    tok_ok = jnp.arange(n_rows, dtype=jnp.int32) < cu_seqlens[n_seqs]
    row_ok = jnp.pad(jnp.repeat(tok_ok, num_heads), (0, rows))
    out = combine_splits(acc, m, l, row_ok, live)[:n_rows * num_heads].reshape(n_rows, num_heads, lat)
    return jnp.pad(out, ((0, n_tok - n_rows), (0, 0), (0, 0))).astype(q_latent.dtype)


def _tpu_kernel(platform, kv_pages):
    """The Mosaic TPU kernel takes the step: on TPU, for 16/32-bit caches. An FP8 pool's packed rows take the
    jnp reference there (the kernel has no per-block dequantization yet)."""
    return (platform or jax.default_backend()) == "tpu" and not fp8_cache.is_fp8(kv_pages)


def _use_kernel(interpret):
    if interpret is not None:
        return True
    return jax.default_backend() == "gpu"


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "config", "platform"))
def mla_paged_decode(q_latent, q_rope, kv_pages, block_tables, kv_lens, *, scale,
                     interpret=None, config=None, platform=None):
    """Paged MLA decode: one query token per sequence, split-K (flash-decoding).

    q_latent [N, H, L], q_rope [N, H, R], kv_pages [P, page_size, L+R],
    block_tables [N, max_pages] int32, kv_lens [N] int32 (the query sits at kv_lens-1).
    Returns o_latent [N, H, L] in q_latent.dtype. ``config``: optional hashable tuple of
    (key, value) tuning pairs (max_rows, bk, splits, slots, num_warps, num_stages, transposed,
    fp8_scale, fp8_reload; see triton_kernel).
    """
    if _tpu_kernel(platform, kv_pages):  # Mosaic kernel (interpreted if asked)
        from pallas_kernels.mla.tpu_kernel import mla_paged_decode_tpu
        return mla_paged_decode_tpu(q_latent, q_rope, kv_pages, block_tables, kv_lens,
                                    scale=scale, interpret=bool(interpret))
    cfg = dict(config) if config else None
    if not _use_kernel(interpret) or (platform or jax.default_backend()) == "tpu":
        return reference.mla_decode_reference(q_latent, q_rope, kv_pages, block_tables,
                                              kv_lens, scale=scale)
    cu = jnp.arange(kv_lens.shape[0] + 1, dtype=jnp.int32)
    return _kernel_path(q_latent, q_rope, kv_pages, block_tables, cu, kv_lens, scale=scale,
                        decode=True, interpret=interpret, config=cfg)


def _mosaic_decode(decode_kernel, q_latent, kv_pages, q_rope):
    """The Mosaic GPU decode kernel takes this step (backend.mla_decode == "mosaic", the default on
    Hopper, where its tiling fits: >= 64 heads, 16-bit cache, mosaic_gpu.supports; an FP8 cache's packed rows
    take the Triton kernel, which dequantizes them per key block)."""
    if decode_kernel != "mosaic":
        return False
    from pallas_kernels.mla import mosaic_gpu
    return mosaic_gpu.supports(q_latent.shape[1], q_latent.shape[2], q_rope.shape[2], kv_pages.shape[1],
                               kv_pages.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "config", "platform",
                                             "decode_only", "decode_kernel", "token_rows"))
def ragged_paged_mla(q_latent, q_rope, kv_pages, block_tables, cu_seqlens, kv_lens, *, scale,
                     interpret=None, config=None, platform=None, decode_only=False, decode_kernel=None,
                     token_rows=False):
    """Ragged paged MLA: prefill chunks (attending to their cached prefix) and decode rows.

    Same contract as `reference.ragged_paged_mla_reference`: q_latent [T, H, L],
    q_rope [T, H, R], kv_pages [P, page_size, L+R], block_tables [N, max_pages],
    cu_seqlens [N+1], kv_lens [N] (cache length after this step's writes).
    Returns o_latent [T, H, L]; tokens past cu_seqlens[N] get zeros.
    decode_only (static): every sequence has at most one token this step (the engine's decode
    steps), so the GPU kernel runs the decode schedule and tuning (one tile per sequence).
    decode_kernel (static): "mosaic" runs decode-only steps on the Mosaic GPU kernel where it fits
    (backend.mla_decode, detect()'s choice on Hopper); None / "triton": the Triton kernel.
    token_rows (static): every token runs as a decode row of its own (its sequence's cache up to its own
    position) on the decode kernel, split as a decode step of these N sequences: a speculative verification
    chunk's tokens get the bits that decoding them one step at a time gives (each token reads its whole
    prefix: for short chunks only). The references compute the same attention.
    """
    if _tpu_kernel(platform, kv_pages):  # Mosaic kernel (interpreted if asked)
        from pallas_kernels.mla.tpu_kernel import ragged_paged_mla_tpu
        return ragged_paged_mla_tpu(q_latent, q_rope, kv_pages, block_tables, cu_seqlens, kv_lens,
                                    scale=scale, interpret=bool(interpret))
    cfg = dict(config) if config else None
    if not _use_kernel(interpret) or (platform or jax.default_backend()) == "tpu":
        return reference.ragged_paged_mla_reference(q_latent, q_rope, kv_pages, block_tables,
                                                    cu_seqlens, kv_lens, scale=scale)
    if (decode_only or token_rows) and _mosaic_decode(decode_kernel, q_latent, kv_pages, q_rope):
        from pallas_kernels.mla.mosaic_gpu import ragged_decode_mosaic, token_rows_mosaic
        decode = token_rows_mosaic if token_rows else ragged_decode_mosaic
        return decode(q_latent, q_rope, kv_pages, block_tables, cu_seqlens, kv_lens, scale=scale,
                      interpret=bool(interpret))
    return _kernel_path(q_latent, q_rope, kv_pages, block_tables, cu_seqlens, kv_lens,
                        scale=scale, decode=bool(decode_only or token_rows), interpret=interpret, config=cfg,
                        token_rows=token_rows)
