"""Split-K planning shared by the paged MLA kernels (Triton: paged.py, Mosaic GPU: mosaic_gpu.py)."""
from __future__ import annotations

import jax.numpy as jnp


def pick_splits(n_tiles, max_blocks, slots, max_splits=64):
    """Split-K factor: minimise wave-quantised time per tile, with a small per-split cost
    (the partial outputs and the combine pass)."""
    best, best_cost = 1, None
    for s in range(1, min(max_blocks, max_splits) + 1):
        waves = -(-n_tiles * s // slots)
        cost = waves / s * (1.0 + 0.03 * s)
        if best_cost is None or cost < best_cost - 1e-9:
            best, best_cost = s, cost
    return best


def decode_splits(n_tiles, tiles_per_seq, max_blocks, slots):
    """The key splits of a decode step's grid (n_tiles: the bucket's sequences x their tiles_per_seq head
    tiles): those of a quarter of the sequences (the engine's buckets grow 4x: 4, 16, 64), at least of one,
    up to a split a slot for a lone sequence. Each step then uses the splits its live sequences fill the slots
    with (live_splits), so a full bucket keeps few splits a tile. Planned for the full bucket, one sequence in
    the 4-sequence bucket read its 128k keys on a quarter of the SMs (33 of 132 splits). Not more: the
    combine reads every split's partials."""
    return pick_splits(max(tiles_per_seq, n_tiles // 4), max_blocks, slots, max_splits=slots)


def live_seqs(cu_seqlens):
    """int32 scalar: the sequences that have a token this step (the live ones live_splits counts)."""
    return jnp.sum((cu_seqlens[1:] - cu_seqlens[:-1]) > 0).astype(jnp.int32)


def live_splits(n_live, splits: int, tiles_per_seq: int, slots: int):
    """int32 [1]: the key splits a decode step uses, of the grid's `splits`: the slots shared by the tiles of
    its n_live live sequences (live_seqs; one CTA a slot), at least one. A function of which sequences run,
    not of their tokens: a verification step's rows split their keys as the decode step of the same sequences
    does (token_rows)."""
    per_tile = slots // jnp.maximum(jnp.asarray(n_live, jnp.int32) * tiles_per_seq, 1)
    return jnp.clip(per_tile, 1, splits).astype(jnp.int32).reshape(1)


def split_range(split, splits, kv_end, bk: int):
    """Keys [lo, hi) of key split `split` (of `splits`: those the step uses, live_splits) for a tile whose
    visible keys end at kv_end: the tile's own context divided evenly in whole bk blocks. The grid's splits are
    planned for the block table's width (max_model_len); a context much shorter than that still spreads over
    every split, where fixed shares of the width would leave it all to the first split's program (one SM
    reading the context alone). A query row's split bounds depend only on its own position, so a verification row splits its
    keys as the decode step at that position does."""
    kv_end = jnp.maximum(kv_end, 0)
    per = (kv_end + splits * bk - 1) // (splits * bk) * bk
    lo = split * per
    return lo, jnp.minimum(lo + per, kv_end)
