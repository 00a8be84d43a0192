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


def split_range(split, splits: int, kv_end, bk: int):
    """Keys [lo, hi) of key split `split` (of `splits`, the grid's) for a tile whose visible keys end at kv_end:
    the tile's own context divided evenly in whole bk blocks. The grid's splits are planned for the block
    table's width (max_model_len); a context much shorter than that still spreads over every split, where
    fixed shares of the width would leave it all to the first split's program (one SM reading the context
    alone). A query row's split bounds depend only on its own position, so a verification row splits its
    keys as the decode step at that position does."""
    kv_end = jnp.maximum(kv_end, 0)
    per = (kv_end + splits * bk - 1) // (splits * bk) * bk
    lo = split * per
    return lo, jnp.minimum(lo + per, kv_end)
