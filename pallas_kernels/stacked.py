"""x @ w[index] where w is a stack of one weight over scanned layers ([L, K, N]) and index is traced.

Inside a `lax.scan`, slicing a layer's weight out of the stack is a copy on GPU (cuBLAS needs its
operand as a buffer of its own): for a decode step that is a read and a write of every dense weight
on top of the matmul's own read. Here a step of few rows runs the grouped-matmul kernel with one
group, which reads layer `index`'s weight where it lies in the stack (as the MoE kernels read a
layer's experts). Larger steps take the slice: their matmuls are compute-bound and the copy is
small next to them.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from pallas_kernels.moe import grouped
from pallas_kernels.moe import schedule as sch

# Rows up to which the kernel reads in place (decode buckets); above, the slice and XLA's dot.
MAX_ROWS = 64


def tiling(m: int, k: int, n: int) -> sch.Tiling:
    """Tiles for one group of m <= MAX_ROWS rows: the whole group in one row tile, long K steps and
    narrow column tiles, so that a weight is streamed by one tile per 32 columns (bk 256, bn 32 the
    fastest of bn 16-64 at 16 and 64 rows: docs/performance.md, "Tuning of record")."""
    bm = 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128
    bk, bn = sch.pow2_divisor(k, 256), sch.pow2_divisor(n, 32)
    stages = 4
    # (stages + 1: Triton was seen taking `stages` buffers; bm 64 bk 256 bn 64 at 4 stages did not fit)
    while stages > 2 and sch.pipeline_smem_bytes(bm, bk, bn, stages + 1, False) > sch.SMEM_LIMIT:
        stages -= 1
    return sch.Tiling(bm=bm, bk=bk, bn=bn, num_warps=2 if bm == 16 else 4, num_stages=stages)


def fits(x, w) -> bool:
    """Whether the kernel path takes x @ w[i]: bf16 operands, K and N multiples of 16, few rows."""
    k, n = w.shape[1:]
    return (x.dtype == w.dtype == jnp.bfloat16 and k % 16 == 0 and n % 16 == 0
            and math.prod(x.shape[:-1]) <= MAX_ROWS)


def stacked_matmul(x, w, index, *, kernel: bool, interpret: bool = False, tiles: sch.Tiling | None = None):
    """x [..., K] @ w[index] for w [L, K, N]. kernel: read in place when `fits` (else the slice)."""
    if not (kernel and fits(x, w)):
        return x @ jax.lax.dynamic_index_in_dim(w, index, keepdims=False)
    k, n = w.shape[1:]
    m = math.prod(x.shape[:-1])
    t = tiles or tiling(m, k, n)
    y = grouped.run_bf16(x.reshape(m, k), (w[:, None],), jnp.full((1,), m, jnp.int32), tiling=t,
                         interpret=interpret, layer=jnp.asarray(index, jnp.int32))
    return y.reshape(x.shape[:-1] + (n,))
