"""Public grouped matmul entry points (bf16 and MXFP4) with backend dispatch."""
from __future__ import annotations

import dataclasses
import logging
import math

import jax
import jax.numpy as jnp

from pallas_kernels.moe import kernel as kn
from pallas_kernels.moe import mxfp4 as mx
from pallas_kernels.moe import schedule as sch

log = logging.getLogger(__name__)


def gmm_reference(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
  """jax.lax.ragged_dot: lhs [M, K] rows sorted by group, rhs [G, K, N] -> [M, N].

  Rows past sum(group_sizes) are zero. Accumulates in fp32, returns lhs.dtype.
  """
  out = jax.lax.ragged_dot(lhs, rhs, group_sizes.astype(jnp.int32),
                           preferred_element_type=jnp.float32)
  return out.astype(lhs.dtype)


def gmm_mxfp4_reference(lhs, rhs_packed, rhs_scales, group_sizes):
  """gmm on the dequantized, transposed MXFP4 weights ([G, N, K/2] -> [G, K, N])."""
  w = mx.dequantize_mxfp4(rhs_packed, rhs_scales, lhs.dtype)
  return gmm_reference(lhs, jnp.swapaxes(w, 1, 2), group_sizes)


def _as_tiling(tiling, m, k, n, g, **kw) -> sch.Tiling:
  """Heuristic tiling, or the given one with bk / bn shrunk to powers of two dividing K / N."""
  if tiling is None:
    return sch.choose_tiling(m, k, n, g, **kw)
  tiling = sch.as_tiling(tiling)
  kw.pop("avg_rows", None)
  kw.pop("decoder", None)
  floor = 32 if kw.get("mxfp4") else 16
  return dataclasses.replace(tiling, bk=sch.pow2_divisor(k, tiling.bk, floor),
                             bn=sch.pow2_divisor(n, tiling.bn))


def _pad_rows(x, bm):
  m = x.shape[0]
  return x if m >= bm else jnp.pad(x, ((0, bm - m), (0, 0)))


def _pad_last(a, mult):
  r = (-a.shape[-1]) % mult
  if not r:
    return a
  return jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, r)])


def _check_groups(group_sizes, num_groups: int):
  """ragged_dot's rule: one group size per weight group. The kernel would otherwise read only
  the first len(group_sizes) experts without complaint (a reference routing over fewer experts
  than the weights hold once looked like a kernel error)."""
  if group_sizes.ndim != 1 or group_sizes.shape[0] != num_groups:
    raise ValueError(f"group_sizes {group_sizes.shape} must be [G] with G = {num_groups}, the "
                     f"number of weight groups")


def _merged(ws, act, arrays_per_weight):
  """One weight with an activation: the merged gate/up layout (gate / up columns interleaved)."""
  if act is not None and len(ws) not in (arrays_per_weight, 2 * arrays_per_weight):
    raise ValueError(f"a GLU needs gate and up weights or one merged weight, got {len(ws)} arrays")
  return act is not None and len(ws) == arrays_per_weight


def _fused(act, merged):
  """choose_tiling's `fused`: no activation, two weights or one merged gate/up weight."""
  return "merged" if merged else act is not None


def overflows_i32_offsets(shape, dtype) -> bool:
  """Pallas' Triton lowering indexes an array with 32-bit offsets while it holds <= 2**32 bytes, but
  the offsets are signed: an array of more than 2**31 - 1 elements in that range (1-byte MXFP4 packed
  weights of 2-4 GiB) reads past its start at high offsets (CUDA_ERROR_ILLEGAL_ADDRESS on a GPU with
  jax 0.11.2). Larger arrays get 64-bit offsets."""
  size = math.prod(shape)
  return size > 2**31 - 1 and size * jnp.dtype(dtype).itemsize <= 2**32


def _wide_offsets(ws):
  """ws with every array that would overflow 32-bit offsets padded (zero groups, never read) past
  2**32 bytes, so the kernel indexes it with 64-bit offsets. A copy: rare shapes only."""
  out = []
  for w in ws:
    if overflows_i32_offsets(w.shape, w.dtype):
      per_group = math.prod(w.shape[1:]) * w.dtype.itemsize
      extra = -(-(2**32 + 1 - w.size * w.dtype.itemsize) // per_group)
      log.warning("expert weights %s %s: padded by %d groups for 64-bit kernel offsets (a copy per call)",
                  w.shape, w.dtype, extra)
      w = jnp.pad(w, ((0, extra),) + ((0, 0),) * (w.ndim - 1))
    out.append(w)
  return tuple(out)


def _layer_groups(ws, layer):
  """Stacked weights ([L, G, ...] each) as one flat group axis [L * G, ...] (a free reshape) and the
  layer's first group; layer None: ws unchanged ([G, ...]), offset None. A flat stack whose 32-bit
  offsets would overflow (overflows_i32_offsets) is read through the layer's slice instead (a copy)."""
  if layer is None:
    return _wide_offsets(ws), None
  g = ws[0].shape[1]
  flat = tuple(w.reshape((-1,) + w.shape[2:]) for w in ws)
  if any(overflows_i32_offsets(w.shape, w.dtype) for w in flat):
    log.warning("stacked expert weights %s: the layer's slice is copied (in place, 32-bit kernel offsets "
                "would overflow)", [w.shape for w in flat])
    return _wide_offsets(tuple(w[layer] for w in ws)), None
  return flat, layer * g


def _rows(lhs, row_index):
  return lhs.shape[0] if row_index is None else row_index.shape[0]


def _pad_rows_or_index(lhs, row_index, bm):
  """Pad the sorted rows to bm: x itself, or (gathered) the row index with row 0."""
  if row_index is None:
    return _pad_rows(lhs, bm), None
  m = row_index.shape[0]
  return lhs, (row_index if m >= bm else jnp.pad(row_index, (0, bm - m)))


def run_bf16(lhs, ws, group_sizes, *, tiling, act=None, interpret=False, avg_rows=None, layer=None,
             row_index=None, zero_tail=True):
  """Kernel call for bf16 weights ws = (w [G, K, N], ...) with K/N/M padding as needed.
  avg_rows: expected rows per group for the tile heuristic (schedule.choose_tiling).
  layer (int32, may be traced): ws are stacks over layers ([L, G, K, N]) and this layer's groups
  are used, read in place by the kernel (no per-layer copy of the experts).
  row_index, zero_tail: see kernel.grouped_matmul (rows gathered from lhs [T, K] in the kernel;
  rows past the groups left unwritten). One weight with act: merged gate/up ([G, K, 2N],
  layout.merge_gate_up), output [M, N]."""
  m, k = _rows(lhs, row_index), lhs.shape[1]
  _check_groups(group_sizes, ws[0].shape[0 if layer is None else 1])
  ws, offset = _layer_groups(ws, layer)
  if ws[0].shape[1] != k:
    raise ValueError(f"lhs K={k} does not match weights {ws[0].shape}")
  per_col = 2 if _merged(ws, act, 1) else 1  # weight columns per output column
  n = ws[0].shape[-1] // per_col
  kp = k + (-k) % 16
  if kp != k:  # rare: contraction not a multiple of 16 -> zero-pad both operands
    lhs = _pad_last(lhs, 16)
    ws = tuple(jnp.pad(w, ((0, 0), (0, kp - k), (0, 0))) for w in ws)
  ws = tuple(_pad_last(w, 16 * per_col) for w in ws)  # merged: zero (gate, up) pairs
  np_ = ws[0].shape[-1] // per_col
  t = _as_tiling(tiling, m, kp, np_, group_sizes.shape[0], fused=_fused(act, per_col == 2),
                 avg_rows=avg_rows)
  x, idx = _pad_rows_or_index(lhs, row_index, t.bm)
  out = kn.grouped_matmul(x, ws, group_sizes, fmt="bf16", n=np_, tiling=t, act=act,
                          interpret=interpret, group_offset=offset, row_index=idx, zero_tail=zero_tail)
  return out[:m, :n]


def run_mxfp4(lhs, ws, group_sizes, *, tiling, act=None, interpret=False, mode=None,
              avg_rows=None, layer=None, decoder: str | None = None, row_index=None, x_halves=False,
              zero_tail=True, out_halves=False):
  """Kernel call for MXFP4 weights ws = (packed [G, N, K/2], scales [G, N, K/32], ...).

  mode 'kernel': decode in the kernel's main loop, each weight tile decoded once per row tile
  (decode tiles when few rows per expert, schedule.choose_tiling's prefill tiles otherwise).
  mode 'predequant': one XLA pass writes bf16 [G, N, K] and the bf16 kernel reads it.
  None: 'predequant' when the average group has >= schedule.PREDEQUANT_MIN_ROWS rows (avg_rows, else
  M / G), else 'kernel'.
  layer: ws are stacks over layers ([L, G, ...]), as in run_bf16. decoder: the in-kernel decoder.
  row_index, zero_tail: as run_bf16. x_halves: lhs is already the kernel's x operand,
  mxfp4.to_operand(x, shift, tiling.joined) ([even | odd] columns, or natural order for joined
  tiles; times 2^shift). out_halves: write the output as the next MXFP4 kernel's x operand of the
  same form (halves order needs N % (2 bn) == 0 and two weights or one). Merged gate/up (one
  weight with act: packed [G, 2N, K/2], layout.merge_gate_up_mxfp4) holds its features in halves
  order, so its output is in halves order whatever the tiles; out_halves adds the 2^shift (and is
  refused with joined tiles, whose consumer would read natural order).
  """
  m, k = _rows(lhs, row_index), lhs.shape[1]
  g = group_sizes.shape[0]
  merged = _merged(ws, act, 2)
  if ws[0].shape[-1] * 2 != k:
    raise ValueError(f"lhs K={k} does not match packed weights {ws[0].shape}")
  if mode is None:
    avg = m / g if avg_rows is None else avg_rows
    mode = "predequant" if avg >= sch.PREDEQUANT_MIN_ROWS and not x_halves else "kernel"
  if layer is not None and mode == "predequant":
    ws, layer = tuple(w[layer] for w in ws), None      # the decode pass reads the layer's slice
  _check_groups(group_sizes, ws[0].shape[0 if layer is None else 1])
  ws, offset = _layer_groups(ws, layer)
  n = ws[0].shape[1] // (2 if merged else 1)
  rn = (-n) % 16
  if rn:   # (a copy of the stack when layer is set: the models' widths are multiples of 16)
    if out_halves:
      raise ValueError(f"out_halves needs N % 16 == 0 (N={n})")
    ws = tuple(jnp.pad(w, ((0, 0), (0, rn * (2 if merged else 1)), (0, 0))) for w in ws)
  if mode == "predequant":
    if x_halves:
      raise ValueError("predequant takes x in plain column order")
    wd = tuple(mx.decode_fast(ws[i], ws[i + 1], lhs.dtype) for i in range(0, len(ws), 2))
    t = _as_tiling(tiling, m, k, n + rn, g, fused=_fused(act, merged), avg_rows=avg_rows)
    fmt = "bf16t"
  else:
    wd = ws
    t = _as_tiling(tiling, m, k, n + rn, g, mxfp4=True, fused=_fused(act, merged),
                   avg_rows=avg_rows, decoder=decoder)
    fmt = "mxfp4"
  if out_halves and merged and t.joined:
    raise ValueError("merged MXFP4 gate/up weights write h in halves order "
                     "(layout.merge_gate_up_mxfp4): out_halves cannot take joined tiles (natural order)")
  split = out_halves and not t.joined and not merged  # joined: natural order; merged: halves already
  if split and (n + rn) % (2 * t.bn):
    t = dataclasses.replace(t, bn=sch.pow2_divisor((n + rn) // 2, t.bn))
  x, idx = _pad_rows_or_index(lhs, row_index, t.bm)
  shift = mx.x_shift(decoder or mx.DECODER)
  out = kn.grouped_matmul(x, wd, group_sizes, fmt=fmt, n=n + rn, tiling=t, act=act,
                          interpret=interpret, group_offset=offset, decoder=decoder, row_index=idx,
                          x_halves=x_halves, zero_tail=zero_tail, split_rows=split,
                          out_scale=2.0 ** shift if out_halves else 1.0)
  return out[:m, :n]


def gmm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, interpret=None,
        tiling=None, platform=None) -> jax.Array:
  """Grouped matmul, ragged_dot semantics: lhs [M, K], rhs [G, K, N], group_sizes [G] -> [M, N].

  GPU: Pallas Triton kernel. CPU: reference unless interpret=True. TPU: reference.
  tiling: None (heuristic), Tiling, dict or tuple (bm, bk, bn, num_warps, num_stages).
  platform: the target (None: the default backend; schedule.use_kernel).
  """
  use, interp = sch.use_kernel(interpret, platform)
  if not use:
    return gmm_reference(lhs, rhs, group_sizes)
  return run_bf16(lhs, (rhs,), group_sizes, tiling=tiling, interpret=interp)


def gmm_mxfp4(lhs: jax.Array, rhs_packed: jax.Array, rhs_scales: jax.Array,
              group_sizes: jax.Array, *, interpret=None, tiling=None, mode=None,
              decoder: str | None = None, platform=None) -> jax.Array:
  """Grouped matmul with MXFP4 weights decoded inside the kernel.

  lhs [M, K] bf16, rhs_packed uint8 [G, N, K/2], rhs_scales uint8 [G, N, K/32]
  (HF [out, in] orientation), group_sizes [G] -> [M, N] = gmm(lhs, dequant(rhs)^T).
  mode: None (auto), 'kernel' or 'predequant' (see run_mxfp4).
  """
  use, interp = sch.use_kernel(interpret, platform)
  if not use:
    return gmm_mxfp4_reference(lhs, rhs_packed, rhs_scales, group_sizes)
  return run_mxfp4(lhs, (rhs_packed, rhs_scales), group_sizes, tiling=tiling,
                   interpret=interp, mode=mode, decoder=decoder)
