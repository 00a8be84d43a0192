"""Split-K planning shared by the paged MLA kernels (Triton: paged.py, Mosaic GPU: mosaic_gpu.py)."""
from __future__ import annotations


def pick_splits(n_tiles, max_blocks, slots):
    """Split-K factor: minimise wave-quantised time per tile, with a small per-split cost
    (the partial outputs and the combine pass)."""
    best, best_cost = 1, None
    for s in range(1, min(max_blocks, 64) + 1):
        waves = -(-n_tiles * s // slots)
        cost = waves / s * (1.0 + 0.03 * s)
        if best_cost is None or cost < best_cost - 1e-9:
            best, best_cost = s, cost
    return best
