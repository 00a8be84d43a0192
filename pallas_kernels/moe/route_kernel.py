"""A decode step's routing metadata in one Pallas (Triton) launch.

Between the router's top-k ids and the two grouped matmuls of a routed expert MLP sit the sort of the
token copies by expert (routing.sort_by_expert) and each matmul's tile schedule (schedule.tile_schedule).
In XLA that is a chain of small kernels per MoE layer (one-hot compare, reductions, cumulative sums,
gathers, a scatter, a searchsorted), each a launch of its own for a few hundred integers: at decode the
launches, not the work, are the cost. Here one program computes all of it: sort_by_expert's outputs
(the same stable counting sort) and tile_schedule's for each row tile size the matmuls run, bit for bit.
The program holds the [T*k, E+1] one-hot in one CTA, so it takes few rows only (`fits`); larger steps
keep the XLA path.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.moe import schedule as sch

# Cells of the largest 2-D intermediate (rows x padded keys) one CTA holds: a 16-token decode bucket's
# top-8 over 256 experts is 128 x 512.
MAX_CELLS = 1 << 16
# 8 warps: at MAX_CELLS each thread holds 256 values of an [rows, keys] intermediate (untuned).
NUM_WARPS = 8


def _pow2(x: int) -> int:
  """Triton's block shapes are powers of two: the smallest one >= x."""
  return 1 << max(0, x - 1).bit_length()


def _iota(size: int):
  return jax.lax.broadcasted_iota(jnp.int32, (size,), 0)


def _plans(rows: int, num_experts: int, bms) -> tuple:
  """(bm, m, tiles) of each distinct bm: a grouped matmul pads fewer than bm rows to one tile, so its
  schedule covers m = max(rows, bm) rows."""
  return tuple((bm, max(rows, bm), sch.num_tiles(max(rows, bm), num_experts, bm))
               for bm in sorted(set(bms)))


def fits(rows: int, num_experts: int, bms=()) -> bool:
  """Whether one program takes `rows` (T*k) assignments over num_experts with schedules for bms: its
  largest 2-D intermediates (the [rows, E+1] one-hot, each schedule's [tiles, E+1] group search), padded
  to powers of two, have at most MAX_CELLS cells."""
  longest = max([rows] + [tiles for _, _, tiles in _plans(rows, num_experts, bms)])
  return _pow2(longest) * _pow2(num_experts + 1) <= MAX_CELLS


def route(expert_ids, num_experts: int, bms=(), *, interpret: bool = False):
  """routing.sort_by_expert(expert_ids, num_experts) and the tile schedule of a grouped matmul over the
  sorted rows for each bm in bms, in one launch (see `fits` for the sizes it takes).

  Returns (sorted_token_index [T*k], group_sizes [E], inverse [T*k], {bm: schedule.TileSchedule}).
  """
  t, k = expert_ids.shape
  n = t * k
  plans = _plans(n, num_experts, bms)
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)   # noqa: E731
  out_shape = [i32(n), i32(num_experts), i32(n)] + [i32(tiles) for _, _, tiles in plans for _ in range(3)]
  outs = pl.pallas_call(
      functools.partial(_kernel, n=n, k=k, e=num_experts, plans=plans),
      out_shape=out_shape,
      grid=(1,),
      compiler_params=plt.CompilerParams(num_warps=NUM_WARPS),
      interpret=interpret,
      name="moe_route",
  )(expert_ids.reshape(n).astype(jnp.int32))
  tok, sizes, inverse = outs[:3]
  schedules = {bm: sch.TileSchedule(bm, m, *outs[3 + 3 * i:6 + 3 * i]) for i, (bm, m, _) in enumerate(plans)}
  return tok, sizes, inverse, schedules


def _kernel(ids_ref, tok_ref, sizes_ref, inv_ref, *sched_refs, n, k, e, plans):
  rows, keys = _pow2(n), _pow2(e + 1)
  lane = _iota(rows)
  real = lane < n
  ids = plt.load(ids_ref.at[pl.ds(0, rows)], mask=real, other=e)
  key = jnp.where((ids >= 0) & (ids < e), ids, e)   # other devices' experts, bucket padding: key e, last
  counts, inverse = _counting_sort(key, real, keys)
  _store_first(inv_ref, inverse, n)
  _store_first(sizes_ref, counts, e)
  _scatter_tokens(tok_ref, inverse, jax.lax.div(lane, k), n)
  grouped = jnp.sum(jnp.where(_iota(keys) < e, counts, 0))   # rows in the E groups
  for i, (bm, m, tiles) in enumerate(plans):
    for ref, a in zip(sched_refs[3 * i:3 * i + 3], _tile_schedule(counts, grouped, e, m, bm, _pow2(tiles))):
      _store_first(ref, a, tiles)


def _counting_sort(key, real, keys: int):
  """routing._counting_sort on padded lanes: (counts [keys] of each key over the real lanes, inverse
  [rows]: each real lane's position in the stable sort by key; 0 on padding lanes)."""
  onehot = ((key[:, None] == _iota(keys)[None, :]) & real[:, None]).astype(jnp.int32)
  counts = jnp.sum(onehot, axis=0)
  starts = jnp.cumsum(counts) - counts
  before = jnp.cumsum(onehot, axis=0) - onehot        # earlier lanes with the same key
  return counts, jnp.sum(onehot * (starts[None, :] + before), axis=1)


def _tile_schedule(counts, grouped, e: int, m: int, bm: int, tiles: int):
  """schedule.tile_schedule(counts[:e], m, bm) over `tiles` (padded) tile lanes. Group lanes: j < e
  the experts, e the zero-fill tail (the m - grouped rows after them), past e nothing."""
  col = _iota(counts.shape[0])
  sizes = jnp.where(col < e, counts, jnp.where(col == e, m - grouped, 0))
  ends = jnp.cumsum(sizes)
  starts = ends - sizes
  ntiles = jax.lax.div(sizes + (bm - 1), bm)
  tile_end = jnp.cumsum(ntiles)
  tile_begin = tile_end - ntiles
  t = _iota(tiles)
  # searchsorted(tile_end[:e + 1], t, side="right"): the groups whose tiles all come before tile t
  gid = jnp.sum(((tile_end[None, :] <= t[:, None]) & (col[None, :] <= e)).astype(jnp.int32), axis=1)
  busy = gid <= e
  gid = jnp.minimum(gid, e)
  pick = col[None, :] == gid[:, None]
  # starts[g] + (t - tile_begin[g]) * bm, one select for both of g's terms
  first = jnp.sum(jnp.where(pick, (starts - tile_begin * bm)[None, :], 0), axis=1) + t * bm
  end = jnp.minimum(first + bm, jnp.sum(jnp.where(pick, ends[None, :], 0), axis=1))
  return gid, jnp.where(busy, first, 0), jnp.where(busy, end, 0)


def _store_first(ref, values, count: int):
  """ref[:count] = values[:count] (values padded to a power of two, ref not)."""
  lane = _iota(values.shape[0])
  plt.store(ref.at[pl.ds(0, values.shape[0])], values, mask=lane < count)


def _scatter_tokens(tok_ref, inverse, token, n: int):
  """tok_ref[inverse[i]] = token[i] over the n real lanes. Padding lanes repeat the last real lane's store
  (same address, same value) rather than being masked: interpret mode writes a masked lane's old value
  back, which could land after the real store to that address."""
  lane = _iota(inverse.shape[0])
  real = lane < n
  last = lane == n - 1
  dest = jnp.where(real, inverse, jnp.sum(jnp.where(last, inverse, 0)))
  plt.store(tok_ref.at[dest], jnp.where(real, token, jnp.sum(jnp.where(last, token, 0))))
