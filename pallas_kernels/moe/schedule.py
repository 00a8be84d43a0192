"""Tile schedule and backend choice for the grouped matmul kernels.

Rows of `lhs` are sorted by group. Each row tile of the kernel covers rows of ONE
group only, starting at the group's first row (not at a multiple of the tile), so a
group with r rows costs cdiv(r, bm) tiles and its weights are streamed
cdiv(r, bm) times per column block, never more (no straddling tiles). Empty groups
get no tile at all, which is what makes decode read only the experts it uses.
Rows past sum(group_sizes) form one extra pseudo-group whose tiles write zeros.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.moe import mxfp4 as mx


@dataclasses.dataclass(frozen=True)
class Tiling:
  """Static kernel configuration: row/contraction/column block sizes, Triton knobs.

  swap_ab (MXFP4 in-kernel decode only): compute out^T = W . x^T, so the decoded weights
  are the MMA's A operand straight from the decoder's registers (with x as A, Triton's
  8-bit-source operand layout costs ~1 register move per decoded pair).

  half_tail: a group's last row tile with <= bm/2 rows runs a bm/2-row loop (a second code path
  in the same kernel), so bm 256 computes no more padding rows than bm 128 (random routing at
  ~500-600 rows per expert: 76-80% of the computed rows are real at bm 256, 89-91% at bm 128).
  """
  bm: int
  bk: int
  bn: int
  num_warps: int = 4
  num_stages: int = 3
  swap_ab: bool = False
  half_tail: bool = False
  joined: bool = False


def num_tiles(m: int, g: int, bm: int) -> int:
  """Static upper bound on the number of row tiles: sum_g cdiv(s_g, bm) over G+1 groups (the tail
  included) whose sizes add up to m. A non-empty group of s rows takes at most (s - 1) / bm + 1
  tiles, so n non-empty groups take at most (m - n) / bm + n, largest at the most groups that can
  be non-empty: min(G + 1, m). The grid is this many row tiles, and at decode most groups are empty
  (one token: 8 rows over 256 experts), so counting every group (m / bm + G + 2 tiles, 259 at
  one token) launched ~16x more CTAs than could ever work; each holds its pipeline's shared memory
  while it finds nothing to do."""
  busy = min(g + 1, m)
  return (m - busy) // bm + busy


def tile_schedule(group_sizes: jax.Array, m: int, bm: int):
  """Per row tile: (group id, first row, end row), each int32 [num_tiles(m, G, bm)].

  group id == G marks the zero-fill tail (rows past sum(group_sizes)); tiles past the
  last used one have start == end == 0 and do nothing.
  """
  g = group_sizes.shape[0]
  sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
  ends = jnp.minimum(jnp.cumsum(sizes), m)  # ragged_dot ignores rows past m
  starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
  total = ends[-1]
  starts = jnp.concatenate([starts, total[None]])
  ends = jnp.concatenate([ends, jnp.full((1,), m, jnp.int32)])
  ntiles = (ends - starts + bm - 1) // bm  # [G+1]
  tile_end = jnp.cumsum(ntiles)
  tile_begin = tile_end - ntiles
  t = jnp.arange(num_tiles(m, g, bm), dtype=jnp.int32)
  # compare_all: one fused op (the default "scan" is a device while loop, slow on GPU)
  gid = jnp.searchsorted(tile_end, t, side="right", method="compare_all").astype(jnp.int32)
  valid = gid <= g
  gid_c = jnp.minimum(gid, g)
  row_start = starts[gid_c] + (t - tile_begin[gid_c]) * bm
  row_end = jnp.minimum(row_start + bm, ends[gid_c])
  row_start = jnp.where(valid, row_start, 0)
  row_end = jnp.where(valid, row_end, 0)
  return gid_c, row_start.astype(jnp.int32), row_end.astype(jnp.int32)


def platform() -> str:
  """'gpu', 'tpu' or 'cpu' for the default backend."""
  p = jax.default_backend()
  return "gpu" if p in ("gpu", "cuda", "rocm") else p


def use_kernel(interpret: bool | None, target: str | None = None) -> tuple[bool, bool]:
  """(run the Pallas kernel?, in interpret mode?) for the target platform (None: the default backend's).

  GPU runs the Triton kernel; CPU runs it only when interpret=True; TPU uses the
  reference (XLA's native ragged_dot lowering on TPU is reasonable). A step's Backend names its
  target, so a step lowered for the GPU on another host (jit(...).lower(lowering_platforms=("cuda",)))
  gets the kernels it runs there.
  """
  if interpret:
    return True, True
  return (target or platform()) == "gpu", False


def pow2_divisor(n: int, cap: int, floor: int = 16) -> int:
  """Largest power of two <= cap dividing n (n is a multiple of `floor`)."""
  b = cap
  while b > floor and n % b:
    b //= 2
  return b


def choose_tiling(m: int, k: int, n: int, g: int, *, mxfp4: bool = False,
                  fused: bool | str = False, avg_rows: float | None = None,
                  decoder: str | None = None) -> Tiling:
  """Default tiles from the average rows per group (decode: small bm, many columns).

  fused: False (one weight), True (gate and up weights) or "merged" (one gate/up weight with 2n
  columns, layout.merge_gate_up); n is the output width. MXFP4 with one weight: fused="joined"
  picks the prefill tiles that read x in the joined form (the down projection after a joined up).

  avg_rows: expected rows per group when m // g misleads, e.g. under expert parallelism,
  where most of the T*k rows go to other devices' experts (sorted last, never multiplied):
  K3-EP8 at 256 tokens has 4096 rows but ~4.7 per local expert, and m // g = 36 picked
  bm = 64 tiles (the MXFP4 MLP at twice the bf16 one's time).
  decoder: the MXFP4 decoder the kernel will run (None: mxfp4.DECODER; ptx8 brings its own decode tiles).
  """
  avg = max(1, m // max(g, 1)) if avg_rows is None else max(1, int(avg_rows))
  if avg <= 16:
    bm = 16
  elif avg <= 32:
    bm = 32
  elif avg <= 64:
    bm = 64
  else:
    bm = 128
  decode = bm <= 32
  if decode and mxfp4 and bm == 16 and (decoder or mx.DECODER) == "ptx8":
    t = decode_mxfp4_tiles(fused, k, n)
    return dataclasses.replace(t, bk=pow2_divisor(k, t.bk, 32), bn=pow2_divisor(n, t.bn))
  if bm == 128:
    t = PREFILL_TILES[(mxfp4, fused)]
    t = dataclasses.replace(t, bm=t.bm if avg >= t.bm else 128, bk=pow2_divisor(k, t.bk, 32 if mxfp4 else 16),
                            bn=pow2_divisor(n, t.bn))
    # stages + 1: these 8-warp tiles were seen taking `stages` buffers (294912 B asked at bm128 bk128
    # bn128 3 stages fused), one more than the decode tiles' stages - 1
    while (not mxfp4 and t.num_stages > 2
           and pipeline_smem_bytes(t.bm, t.bk, t.bn, t.num_stages + 1, fused in (True, "merged"))
           > SMEM_LIMIT):
      t = dataclasses.replace(t, num_stages=t.num_stages - 1)
    return t
  two = fused in (True, "merged")  # two weight tiles (or one of 2 bn) per K step
  bn = pow2_divisor(n, 64 if decode else (64 if two else 128))
  bk = pow2_divisor(k, 256 if decode else 64, 32 if mxfp4 else 16)
  warps = 4 if (decode or bm * bn <= 64 * 64) else 8
  stages = 4 if decode else 3
  while stages > 2 and pipeline_smem_bytes(bm, bk, bn, stages, two) > SMEM_LIMIT:
    stages -= 1
  return Tiling(bm=bm, bk=bk, bn=bn, num_warps=warps, num_stages=stages)


# Prefill (more than 64 rows per expert: bm 128 and up) tiles by (MXFP4 weights, fused gate+up):
# the fastest correct tiling of each stage at K3-EP8 32k tokens and Kimi-Linear 16k tokens
# (docs/performance.md, "Tuning of record"). MXFP4 swap_ab: the decoded weights as
# the MMA's A operand; bm 256 with half-height tails (Tiling.half_tail). "merged": one gate/up
# weight (pallas_kernels.moe.layout), MXFP4 with h written in halves order for the down kernel.
# "joined": the down kernel after a joined up kernel (callers passing joined tilings).
PREFILL_TILES = {
    (False, False): Tiling(128, 64, 256, 8, 3),
    (False, True): Tiling(128, 64, 128, 8, 4),
    # MXFP4 down: checked on the GPU, ~1.45x bm128 bk64; 4 stages do not fit shared memory
    (True, False): Tiling(256, 128, 128, 8, 3, swap_ab=True, half_tail=True),
    (True, True): Tiling(128, 128, 128, 8, 3, swap_ab=True),
    (False, "merged"): Tiling(128, 64, 128, 8, 3),
    (True, "merged"): Tiling(256, 128, 64, 8, 3, swap_ab=True, half_tail=True),
    (True, "joined"): Tiling(128, 64, 128, 8, 3, joined=True),
}
# The MXFP4 down kernel reads h in the operand form the up kernel wrote (Tiling.joined)
assert not any(PREFILL_TILES[(True, f)].joined for f in (False, True, "merged"))
assert PREFILL_TILES[(True, "joined")].joined


def as_tiling(t) -> Tiling:
  """A Tiling from a Tiling, dict or tuple (bm, bk, bn, num_warps, num_stages, ...)."""
  if isinstance(t, Tiling):
    return t
  return Tiling(**t) if isinstance(t, dict) else Tiling(*t)


# Rows per expert from which the expert MLP lets the up kernel gather token rows in place
# (instead of an XLA gather writing T*k rows) and skips the rows of other devices' experts.
GATHER_MIN_ROWS = 65
# Rows per expert from which MXFP4 grouped matmuls would dequantize all weights in one XLA pass
# first (grouped.run_mxfp4 mode None): never by default, the in-kernel decode was faster at both
# prefill shapes (still selectable as mode="predequant").
PREDEQUANT_MIN_ROWS = float("inf")


# Hopper's shared memory per block (227 KiB) less room for the epilogue.
SMEM_LIMIT = 232448 - 4096


def pipeline_smem_bytes(bm: int, bk: int, bn: int, stages: int, fused: bool, itemsize: int = 2) -> int:
  """Shared memory of the K loop's software pipeline: stages - 1 buffers of the x tile and the weight
  tiles (two of them in the fused gate+up kernel). Triton asked for exactly this at bm=32, bk=256,
  bn=64, 4 stages, fused (245760 B > 232448: a Kimi-Linear step of 1024 tokens failed to compile)."""
  return (stages - 1) * (bm * bk + (2 if fused else 1) * bk * bn) * itemsize


# MXFP4 decode tiles (bm = 16) for the ptx8 decoder: weights as the MMA's A operand, 2 warps
# (Triton picks mma.v2, not wgmma, below 4 warps), 64 columns, K step 256: the fastest of 8 tilings at
# 3 decode shapes (docs/performance.md, "Tuning of record").
DECODE_MXFP4 = Tiling(bm=16, bk=256, bn=64, num_warps=2, num_stages=3, swap_ab=True)
# Merged gate/up at decode: 64 weight rows per tile (32 gate/up pairs), the plain gmm's stream
# (faster than two weights and than merged bn 64: docs/performance.md, "Tuning of record").
DECODE_MXFP4_MERGED = dataclasses.replace(DECODE_MXFP4, bn=32)
# Per-shape decode tiles (ptx8, bm 16) where a sweep (benchmarks/kernels_moe.py's DECODE_TILE_SWEEP rows)
# found better ones than the two above: (fused, K, N) -> Tiling, fused as choose_tiling's (False: one
# weight, e.g. the down projection; "merged": merged gate/up), K the contraction, N the output width.
DECODE_MXFP4_BY_SHAPE: dict = {}


def decode_mxfp4_tiles(fused, k: int, n: int) -> Tiling:
  """The ptx8 decode tiles for one grouped matmul: DECODE_MXFP4_BY_SHAPE's entry, else DECODE_MXFP4_MERGED
  (merged gate/up) or DECODE_MXFP4."""
  t = DECODE_MXFP4_BY_SHAPE.get((fused, k, n))
  if t is not None:
    return t
  return DECODE_MXFP4_MERGED if fused == "merged" else DECODE_MXFP4
