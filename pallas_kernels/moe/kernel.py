"""Pallas (Triton backend) grouped matmul over expert-sorted rows.

One kernel serves bf16 weights [G, K, N] and MXFP4 weights [G, N, K/2] (+ scales
[G, N, K/32], decoded in registers), with one weight (plain gmm), two weights
sharing the lhs tile (gate and up of a GLU) whose accumulators meet in a fused
activation epilogue, or one "merged" gate/up weight (layout.merge_gate_up: gate and
up columns interleaved) whose single accumulator is split in the epilogue. Grid = (column blocks, row tiles); the column axis runs fastest
so the CTAs in flight share one lhs tile and one expert's weights in L2.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_kernels.moe import mxfp4 as mx
from pallas_kernels.moe import schedule as sch


def glu_activation(g, u, activation: str, situ_beta: float = 4.0,
                   situ_linear_beta: float | None = 25.0):
  """act(gate, up) in fp32: 'silu' -> silu(g) * u; 'situ' -> SiTU-GLU (K3)."""
  g = g.astype(jnp.float32)
  u = u.astype(jnp.float32)
  sig = 1.0 / (1.0 + jnp.exp(-g))
  if activation == "silu":
    return g * sig * u
  if activation == "situ":
    a = situ_beta * jnp.tanh(g / situ_beta) * sig
    if situ_linear_beta is not None:
      u = situ_linear_beta * jnp.tanh(u / situ_linear_beta)
    return a * u
  raise ValueError(f"unknown activation {activation!r}")


def interleave_k(even, odd):
  """[n, k/2] x 2 -> [n, k]: even at columns 2j, odd at 2j + 1 (tt.join + tt.reshape in Triton).

  The halves are joined as uint16, not as the decoder's bf16 results: XLA's Triton
  (speed_up_int4_unpacking.patch in XLA's third_party/triton) lowers a tt.join whose first operand
  comes straight from an inline-asm op with 4 packed elements and a 16-bit result as if the asm had
  produced its own int4-unpacking order: it joins two values of each operand at a time, which
  scrambles K here (the joined MXFP4 MLPs measured rel err 1.2-1.3 on the GPU). A
  bitcast in between costs no instruction and keeps Triton's plain join."""
  bits = lambda a: jax.lax.bitcast_convert_type(a, jnp.uint16)
  joined = jnp.stack([bits(even), bits(odd)], axis=-1).reshape(even.shape[0], 2 * even.shape[1])
  return jax.lax.bitcast_convert_type(joined, even.dtype)


def _kernel(tg_ref, ts_ref, te_ref, off_ref, *refs, fmt, n_x, n_w, m, k, n, g, tiling, act, decoder, shift,
            gather, zero_tail, split_rows, out_scale):
  idx_ref, refs = (refs[0], refs[1:]) if gather else (None, refs)
  x_refs = refs[:n_x]
  w_refs = refs[n_x:-1]
  o_ref = refs[-1]
  bm, bk, bn = tiling.bm, tiling.bk, tiling.bn
  ni = pl.program_id(0)
  t = pl.program_id(1)
  gid = tg_ref[t]
  wid = gid + off_ref[0]  # the group's weights: groups of a layer inside a stack of layers' experts
  start = ts_ref[t]
  end = te_ref[t]
  n0 = pl.multiple_of(ni * bn, bn)
  if split_rows:  # output columns [0, n/2) are weight rows 0, 2, 4, ...; [n/2, n) rows 1, 3, ...
    w_rows = pl.ds(jnp.where(n0 < n // 2, 2 * n0, 2 * (n0 - n // 2) + 1), bn, stride=2)
  else:
    w_rows = pl.ds(n0, bn)

  swap = tiling.swap_ab and fmt == "mxfp4"
  # merged gate/up: one weight with 2 bn columns (rows) per tile, gate / up interleaved
  merged = act is not None and n_w == 1
  wn = 2 * bn if merged else bn
  if merged:
    w_rows = pl.ds(2 * n0, wn)

  def compute(bmx):
    """The tile's rows [start, end) through a window of bmx rows."""
    # Load a full bmx-row window that stays in bounds; rows outside [start, end) are
    # computed but never stored (rows are independent), so loads need no mask.
    lo = jnp.minimum(start, m - bmx)
    rows = lo + jax.lax.broadcasted_iota(jnp.int32, (bmx, bn), 0)
    mask = (rows >= start) & (rows < end)
    out_view = o_ref.at[pl.ds(lo, bmx), pl.ds(n0, bn)]
    # gather: row r of the sorted order is row idx[r] of x (the token), read in place
    x_rows = idx_ref[pl.ds(lo, bmx)] if gather else pl.ds(lo, bmx)

    def body(kk, accs):
      k0 = pl.multiple_of(kk * bk, bk)
      h0 = pl.multiple_of(kk * (bk // 2), bk // 2)
      if fmt == "mxfp4" and tiling.joined:  # x in natural column order (times 2^shift)
        xb = x_refs[0][x_rows, pl.ds(k0, bk)]
      elif fmt == "mxfp4":  # x's even / odd columns: two [M, K/2] arrays or halves of one
        xe = x_refs[0][x_rows, pl.ds(h0, bk // 2)]
        xo = (x_refs[1][x_rows, pl.ds(h0, bk // 2)] if n_x == 2 else
              x_refs[0][x_rows, pl.ds(k // 2 + h0, bk // 2)])
      else:
        xb = x_refs[0][x_rows, pl.ds(k0, bk)]
      new = []
      for i, acc in enumerate(accs):
        if fmt == "bf16":  # w [G, K, N]
          wb = w_refs[i][wid, pl.ds(k0, bk), pl.ds(wn // bn * n0, wn)]
          new.append(acc + plt.dot(xb, wb))
        elif fmt == "bf16t":  # w [G, N, K]
          wb = w_refs[i][wid, w_rows, pl.ds(k0, bk)]
          new.append(acc + plt.dot(xb, wb, trans_b=True))
        else:  # packed [G, N, K/2], scales [G, N, K/32]
          p_ref, s_ref = w_refs[2 * i], w_refs[2 * i + 1]
          pb = p_ref[wid, w_rows, pl.ds(h0, bk // 2)]
          sb = s_ref[wid, w_rows, pl.ds(kk * (bk // 32), bk // 32)]
          w_even, w_odd = mx.decode_halves(pb, sb, decoder, shift)
          if tiling.joined:  # back to natural K order: one MMA per K step
            wj = interleave_k(w_even, w_odd)
            new.append(acc + (plt.dot(wj, xb, trans_b=True) if swap else plt.dot(xb, wj, trans_b=True)))
          elif swap:  # acc^T [bn, bm] += w [bn, bk/2] . x^T
            acc = acc + plt.dot(w_even, xe, trans_b=True)
            new.append(acc + plt.dot(w_odd, xo, trans_b=True))
          else:
            acc = acc + plt.dot(xe, w_even, trans_b=True)
            new.append(acc + plt.dot(xo, w_odd, trans_b=True))
      return tuple(new)

    zero = jnp.zeros((wn, bmx) if swap else (bmx, wn), jnp.float32)
    accs = jax.lax.fori_loop(0, k // bk, body, (zero,) * n_w)
    if merged:  # [bm, 2 bn] -> gate (even columns), up (odd columns)
      full = accs[0].T if swap else accs[0]
      out = act(*jax.lax.unstack(full.reshape(bmx, bn, 2), axis=2))
    else:
      out = accs[0] if act is None else act(*accs)
    if out_scale != 1:
      out = out * jnp.float32(out_scale)
    if swap and not merged:
      out = out.T
    plt.store(out_view, out.astype(o_ref.dtype), mask=mask)

  busy = (end > start) & (gid < g)
  if tiling.half_tail:  # a group's last tile with <= bm/2 rows runs half as many (no wasted half)
    short = end - start <= bm // 2
    pl.when(busy & short)(lambda: compute(bm // 2))
    pl.when(busy & jnp.logical_not(short))(lambda: compute(bm))
  else:
    pl.when(busy)(lambda: compute(bm))

  if zero_tail:
    @pl.when((end > start) & (gid == g))
    def _zero_tail():
      lo = jnp.minimum(start, m - bm)
      rows = lo + jax.lax.broadcasted_iota(jnp.int32, (bm, bn), 0)
      plt.store(o_ref.at[pl.ds(lo, bm), pl.ds(n0, bn)], jnp.zeros((bm, bn), o_ref.dtype),
                mask=(rows >= start) & (rows < end))


def grouped_matmul(x, weights, group_sizes, *, fmt: str, n: int, tiling: sch.Tiling,
                   act=None, out_dtype=None, interpret: bool = False, group_offset=None,
                   decoder: str | None = None, row_index=None, x_halves: bool = False, zero_tail: bool = True,
                   split_rows: bool = False, out_scale: float = 1.0):
  """Pallas grouped matmul.

  x [M, K] (rows sorted by group), group_sizes [G] int32.
  fmt 'bf16': weights = (w [G, K, N], ...); 'bf16t': (w [G, N, K], ...); 'mxfp4':
  (packed [G, N, K/2], scales [G, N, K/32], ...). One weight -> x @ w per group; two ->
  act(x @ w_a, x @ w_b) (act: fp32 (acc_a, acc_b) -> [bm, bn]); one weight with act -> merged
  gate/up: w has 2N columns (rows), column 2j gate j, 2j + 1 up j (layout.merge_gate_up). Returns [M, N]; rows
  past sum(group_sizes) are zero (zero_tail). Requires K % bk == 0, N % bn == 0, M >= bm (the
  public wrappers pad).
  decoder: the MXFP4 decoder (mxfp4.py; None: DECODER; interpret mode runs "jnp" with its x shift).
  group_offset (int32 scalar, may be traced): group j reads weights[group_offset + j], so the
  weights may hold several layers' experts ([L * G, ...]) and a scanned layer passes its own
  without slicing them out (a slice would be a copy of the layer's experts on GPU).

  row_index [M] int32: row r of the sorted order is x[row_index[r]] (x [T, K]), gathered by
  the kernel's loads instead of an XLA gather that writes M rows. x_halves (mxfp4): x is
  already [even columns | odd columns] * 2^shift (mxfp4.to_halves). zero_tail=False leaves
  rows past sum(group_sizes) unwritten (the caller never reads them). split_rows (bf16t,
  mxfp4): output column c < N/2 is weight row 2c, c >= N/2 row 2(c - N/2) + 1, so the output
  is in halves order for an MXFP4 consumer. out_scale: factor on the fp32 result (a power of
  two: exact).
  """
  m = x.shape[0] if row_index is None else row_index.shape[0]
  k = x.shape[1]
  g = group_sizes.shape[0]
  n_w = len(weights) // 2 if fmt == "mxfp4" else len(weights)
  assert k % tiling.bk == 0 and n % tiling.bn == 0 and m >= tiling.bm, (m, k, n, tiling)
  assert act is not None or n_w == 1
  merged = act is not None and n_w == 1  # merged weights carry their own row order
  assert not split_rows or (fmt != "bf16" and n % (2 * tiling.bn) == 0 and not merged), (fmt, n, tiling)
  decoder = decoder or mx.DECODER   # (None: the default, for direct callers; models pass theirs)
  shift = mx.x_shift(decoder)  # interpret mode: the jnp decoder with the GPU decoder's shift
  decoder = "jnp" if interpret else decoder
  if fmt == "mxfp4" and tiling.joined and not x_halves:  # natural order, times 2^shift (exact)
    xs = (x * jnp.asarray(2.0 ** shift, x.dtype) if shift else x,)
  elif fmt == "mxfp4" and not x_halves:  # even / odd columns of x meet the low / high nibbles
    xs = (x[:, 0::2], x[:, 1::2])
    if shift:  # the decoder returns w * 2^-shift: x * 2^shift keeps every product (exact)
      xs = tuple(xi * jnp.asarray(2.0 ** shift, xi.dtype) for xi in xs)
  else:
    xs = (x,)
  tg, ts, te = sch.tile_schedule(group_sizes, m, tiling.bm)
  off = jnp.zeros((1,), jnp.int32) if group_offset is None else jnp.reshape(group_offset, (1,)).astype(jnp.int32)
  grid = (n // tiling.bn, tg.shape[0])
  gather = row_index is not None
  kern = functools.partial(_kernel, fmt=fmt, n_x=len(xs), n_w=n_w, m=m, k=k, n=n, g=g,
                           tiling=tiling, act=act, decoder=decoder, shift=shift, gather=gather,
                           zero_tail=zero_tail, split_rows=split_rows, out_scale=out_scale)
  idx = (row_index.astype(jnp.int32),) if gather else ()
  return pl.pallas_call(
      kern,
      out_shape=jax.ShapeDtypeStruct((m, n), out_dtype or x.dtype),
      grid=grid,
      compiler_params=plt.CompilerParams(num_warps=tiling.num_warps,
                                         num_stages=tiling.num_stages),
      interpret=interpret,
      name=f"moe_gmm_{fmt}_{n_w}",
  )(tg, ts, te, off, *idx, *xs, *weights)
