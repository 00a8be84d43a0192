"""x @ w[index] where w is a stack of one weight over scanned layers ([L, K, N]) and index is traced.

Inside a `lax.scan`, slicing a layer's weight out of the stack is a copy on GPU (cuBLAS needs its
operand as a buffer of its own): for a decode step that is a read and a write of every dense weight
on top of the matmul's own read. Here a step of few rows runs the grouped-matmul kernel with one
group, which reads layer `index`'s weight where it lies in the stack (as the MoE kernels read a
layer's experts). Larger steps take the slice: their matmuls are compute-bound and the copy is
small next to them.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.moe import grouped
from pallas_kernels.moe import schedule as sch

# Rows up to which the kernel reads in place (decode buckets); above, the slice and XLA's dot.
MAX_ROWS = 64


def tiling(m: int, k: int, n: int, weights: int = 1) -> sch.Tiling:
    """Tiles for one group of m <= MAX_ROWS rows: the whole group in one row tile, long K steps and
    narrow column tiles, so that a weight is streamed by one tile per 32 columns (bk 256, bn 32 the
    fastest of bn 16-64 at 16 and 64 rows: docs/performance.md, "Tuning of record"). weights: 2 for a GLU's
    gate and up streamed by the same tile."""
    bm = 16 if m <= 16 else 32 if m <= 32 else 64 if m <= 64 else 128
    bk, bn = sch.pow2_divisor(k, 256), sch.pow2_divisor(n, 32)
    stages = 4
    # (stages + 1: Triton was seen taking `stages` buffers; bm 64 bk 256 bn 64 at 4 stages did not fit)
    while stages > 2 and sch.pipeline_smem_bytes(bm, bk, bn, stages + 1, weights == 2) > sch.SMEM_LIMIT:
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


def _many_kernel(layer_ref, *refs, plan, bm):
    """One grid of column tiles over several products: tiles [t0, t1) of the grid compute x_i @ w_i[layer]'s
    columns, each through its own static branch (shapes differ per product)."""
    n = len(plan)
    x_refs, w_refs, o_refs = refs[:n], refs[n:2 * n], refs[2 * n:]
    j = pl.program_id(0)
    layer = layer_ref[0]
    for x_ref, w_ref, o_ref, (t0, t1, k, bk, bn) in zip(x_refs, w_refs, o_refs, plan):
        def compute(x_ref=x_ref, w_ref=w_ref, o_ref=o_ref, t0=t0, k=k, bk=bk, bn=bn):
            n0 = pl.multiple_of((j - t0) * bn, bn)

            def body(kk, acc):
                k0 = pl.multiple_of(kk * bk, bk)
                return acc + plt.dot(x_ref[:, pl.ds(k0, bk)], w_ref[layer, pl.ds(k0, bk), pl.ds(n0, bn)])

            acc = jax.lax.fori_loop(0, k // bk, body, jnp.zeros((bm, bn), jnp.float32))
            o_ref[:, pl.ds(n0, bn)] = acc.astype(o_ref.dtype)

        pl.when((j >= t0) & (j < t1))(compute)


def _one_launch_fits(x, w) -> bool:
    """`fits`, and the stack indexable with 32-bit offsets (the kernel reads it whole, where stacked_matmul's
    grouped kernel would copy the layer's slice)."""
    return fits(x, w) and not grouped.overflows_i32_offsets(w.shape, w.dtype)


def stacked_matmuls(pairs, index, *, kernel: bool, interpret: bool = False) -> list:
    """[x @ w[index] for (x, w) in pairs] (w [L, K, N] stacks of one scanned block, index its repeat).

    A decode step's dense projections are small (0.1-20 MB) and each launch of its own pays a kernel's
    ramp and tail (a weight under a megabyte takes as long as one several times larger); the products of one
    input (a layer's projections of x) run here as one launch whose column tiles stream every weight at
    once. With `kernel`, the pairs that `fits` (bf16, few rows: the same rows for all) run in that launch
    and any other is `stacked_matmul`'s, as it would be alone. Each output column is computed as
    `stacked_matmul`'s kernel computes it (the same K steps and column tiles)."""
    pairs = list(pairs)
    one = [i for i, (x, w) in enumerate(pairs) if kernel and _one_launch_fits(x, w)]
    if len(one) < 2 or len({math.prod(pairs[i][0].shape[:-1]) for i in one}) > 1:
        one = []                                  # (rows that differ: never in this model's layers)
    out = [None if i in one else stacked_matmul(x, w, index, kernel=kernel, interpret=interpret)
           for i, (x, w) in enumerate(pairs)]
    for i, y in zip(one, _one_launch([pairs[i] for i in one], index, interpret) if one else ()):
        out[i] = y
    return out


def _one_launch(pairs, index, interpret: bool) -> list:
    m = math.prod(pairs[0][0].shape[:-1])
    tiles = [tiling(m, *w.shape[1:]) for _, w in pairs]
    bm = tiles[0].bm
    plan, t0 = [], 0
    for (_, w), t in zip(pairs, tiles):
        k, n = w.shape[1:]
        plan.append((t0, t0 + n // t.bn, k, t.bk, t.bn))
        t0 += n // t.bn
    stages = min(t.num_stages for t in tiles)
    xs = [jnp.pad(x.reshape(m, x.shape[-1]), ((0, bm - m), (0, 0))) for x, _ in pairs]   # m <= bm (tiling)
    outs = pl.pallas_call(
        functools.partial(_many_kernel, plan=tuple(plan), bm=bm),
        out_shape=[jax.ShapeDtypeStruct((bm, w.shape[2]), x.dtype) for x, w in pairs],
        grid=(t0,),
        compiler_params=plt.CompilerParams(num_warps=tiles[0].num_warps, num_stages=stages),
        interpret=interpret,
        name=f"stacked_matmuls_{len(pairs)}",
    )(jnp.reshape(jnp.asarray(index, jnp.int32), (1,)), *xs, *(w for _, w in pairs))
    return [o[:m].reshape(x.shape[:-1] + (o.shape[-1],)) for o, (x, _) in zip(outs, pairs)]


def stacked_glu(x, w_gate, w_up, index, act, *, kernel: bool, interpret: bool = False):
    """act(x @ w_gate[index], x @ w_up[index]) for stacks [L, K, N] (a GLU's gate and up, index traced).

    act takes and returns x.dtype values: the kernel path (the grouped matmul with two weights and one group,
    read in place where they lie in their stacks) rounds each fp32 accumulator to x.dtype first, as the two
    products would be alone, so both paths apply act to the same values; it saves a step two launches and
    the activation's."""
    if not (kernel and fits(x, w_gate) and fits(x, w_up)):
        return act(stacked_matmul(x, w_gate, index, kernel=kernel, interpret=interpret),
                   stacked_matmul(x, w_up, index, kernel=kernel, interpret=interpret))
    k, n = w_gate.shape[1:]
    m = math.prod(x.shape[:-1])
    y = grouped.run_bf16(x.reshape(m, k), (w_gate[:, None], w_up[:, None]), jnp.full((1,), m, jnp.int32),
                         tiling=tiling(m, k, n, weights=2), interpret=interpret, layer=jnp.asarray(index, jnp.int32),
                         act=lambda g, u: act(g.astype(x.dtype), u.astype(x.dtype)))
    return y.reshape(x.shape[:-1] + (n,))
