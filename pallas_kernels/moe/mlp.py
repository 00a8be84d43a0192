"""Routed expert MLP: permute -> fused gate/up grouped matmul + GLU -> down gmm -> combine."""
from __future__ import annotations

import functools

import jax.numpy as jnp

from pallas_kernels.moe import grouped as gm
from pallas_kernels.moe import kernel as kn
from pallas_kernels.moe import layout
from pallas_kernels.moe import mxfp4 as mx
from pallas_kernels.moe import routing
from pallas_kernels.moe import schedule as sch


def _act(activation, situ_beta, situ_linear_beta):
  return functools.partial(kn.glu_activation, activation=activation, situ_beta=situ_beta,
                           situ_linear_beta=situ_linear_beta)


def _reference_path(xs, gs, w1, w3, w2, act, dtype):
  g = gm.gmm_reference(xs, w1, gs).astype(jnp.float32)
  u = gm.gmm_reference(xs, w3, gs).astype(jnp.float32)
  h = act(g, u).astype(dtype)
  return gm.gmm_reference(h, w2, gs)


def _avg_rows(topk_ids, num_experts, num_experts_total):
  """Expected rows per local expert for the tile heuristic: T*k / (experts over all devices).
  Without num_experts_total (no expert parallelism) it is T*k / E_local, as gmm assumes."""
  if num_experts_total is not None and num_experts_total < num_experts:
    raise ValueError(f"num_experts_total={num_experts_total} < local experts {num_experts}")
  return topk_ids.size / (num_experts_total or num_experts)


def _layer_of(ws, layer):
  """One layer's experts out of stacks [L, E, ...] (the reference path; the kernels index in place)."""
  return ws if layer is None else tuple(w[layer] for w in ws)


def _routed_mlp(x, topk_ids, topk_weights, num_experts, kernel, reference, interpret, gather, platform):
  """Shared frame of both expert MLPs: sort token copies by expert, run the kernels, combine the
  weighted rows back to token order. gather=False: `kernel(xs, None, gs, interp)` on the gathered
  rows xs = x[tok]. gather=True: `kernel(x, tok, gs, interp)`, the up kernel reads the token rows
  in place, and rows past the local groups are never written nor read (the combine skips
  them), so other devices' rows under expert parallelism cost nothing. Off-accelerator
  `reference(xs, gs)` (platform: schedule.use_kernel's target)."""
  tok, gs, inv = routing.sort_by_expert(topk_ids, num_experts)
  use, interp = sch.use_kernel(interpret, platform)
  if not use:
    y = reference(x[tok], gs)
  elif gather:
    y = kernel(x, tok, gs, interp)
    return routing.combine(y, topk_weights, inv, out_dtype=x.dtype, valid_rows=jnp.sum(gs))
  else:
    y = kernel(x[tok], None, gs, interp)
  return routing.combine(y, topk_weights, inv, out_dtype=x.dtype)


def _use_gather(gather, avg_rows):
  """None: gather in the kernel from GATHER_MIN_ROWS rows per expert on."""
  return avg_rows >= sch.GATHER_MIN_ROWS if gather is None else gather


def expert_mlp(x, topk_ids, topk_weights, w1, w3, w2, *, activation: str,
               situ_beta: float = 4.0, situ_linear_beta: float | None = 25.0,
               interpret=None, tiling=None, num_experts_total=None, layer=None, gather=None, platform=None):
  """y[t] = sum_j topk_weights[t, j] * w2_e(act(w1_e x[t], w3_e x[t])), e = topk_ids[t, j].

  x [T, D]; topk_ids [T, k] int (ids outside [0, E) contribute nothing);
  topk_weights [T, k] fp32; w1, w3 [E, D, I]; w2 [E, I, D] (bf16, [in, out]). w3 None: w1 is
  the merged gate/up weight [E, D, 2I] (layout.merge_gate_up), run as one matmul per tile.
  activation 'silu' or 'situ' (fp32). tiling: None or (up_tiling, down_tiling).
  num_experts_total: experts over all devices under expert parallelism (ids of other devices'
  experts are outside [0, E)); sizes the default tiles from T*k / num_experts_total rows per
  expert instead of T*k / E. layer (int32, may be traced): w1, w3, w2 are stacks over layers
  ([L, E, ...]) and layer `layer` runs, its experts read in place. gather: rows read in place by
  the up kernel (see _routed_mlp); None picks by rows per expert. platform: the target (None: the
  default backend; schedule.use_kernel). Returns [T, D] in x.dtype.
  """
  act = _act(activation, situ_beta, situ_linear_beta)
  t_up, t_down = tiling if tiling is not None else (None, None)
  E = w1.shape[0 if layer is None else 1]
  avg = _avg_rows(topk_ids, E, num_experts_total)
  keep = not _use_gather(gather, avg)  # materialized rows: the kernels zero the tail
  up = (w1,) if w3 is None else (w1, w3)

  def kernel(xs, tok, gs, interp):
    kw = dict(interpret=interp, avg_rows=avg, layer=layer, zero_tail=keep)
    h = gm.run_bf16(xs, up, gs, tiling=t_up, act=act, row_index=tok, **kw)
    return gm.run_bf16(h, (w2,), gs, tiling=t_down, **kw)

  def reference(xs, gs):
    w1l, w2l = _layer_of((w1, w2), layer)
    g, u = layout.split_gate_up(w1l, 2) if w3 is None else (w1l, _layer_of((w3,), layer)[0])
    return _reference_path(xs, gs, g, u, w2l, act, x.dtype)

  return _routed_mlp(x, topk_ids, topk_weights, E, kernel, reference, interpret, not keep, platform)


def _mxfp4_tilings(t_up, t_down, avg, merged, dims, decoder):
  """The up / down tilings (defaults from avg rows per expert), which must agree on
  Tiling.joined: h goes from one kernel to the other in that operand form. dims (E, D, I)."""
  e, d, i = dims
  if t_up is None:
    t_up = sch.choose_tiling(1, d, i, e, mxfp4=True, fused="merged" if merged else True, avg_rows=avg,
                             decoder=decoder)
  t_up = sch.as_tiling(t_up)
  if t_down is None:
    t_down = sch.choose_tiling(1, i, d, e, mxfp4=True, fused="joined" if t_up.joined else False,
                               avg_rows=avg, decoder=decoder)
  t_down = sch.as_tiling(t_down)
  if t_up.joined != t_down.joined:
    raise ValueError(f"the up and down tilings must agree on joined, got {t_up} / {t_down}")
  return t_up, t_down


def expert_mlp_mxfp4(x, topk_ids, topk_weights, w1, w3, w2, *, activation: str,
                     situ_beta: float = 4.0, situ_linear_beta: float | None = 25.0,
                     interpret=None, tiling=None, num_experts_total=None, layer=None,
                     decoder: str | None = None, gather=None, mode=None, platform=None):
  """expert_mlp with MXFP4 experts; each w is (packed uint8, scales uint8) in HF layout:
  w1, w3: ([E, I, D/2], [E, I, D/32]); w2: ([E, D, I/2], [E, D, I/32]). Returns [T, D].
  layer: each array is a stack over layers ([L, E, ...]), as in expert_mlp. decoder: the kernel's
  MXFP4 decoder (mxfp4.py).
  mode: grouped.run_mxfp4's (None: by rows per expert). With gather and mode 'kernel' x goes
  to the up kernel in MXFP4 halves order and the up kernel writes h in that order for the down
  kernel: no split pass over the rows (joined tiles: x and h in natural order, times 2^shift; the
  up and down tilings must agree on Tiling.joined). w3 None: w1 is the merged gate/up weight
  (layout.merge_gate_up_mxfp4; mode 'kernel' only, not joined tiles): its features are in halves
  order, so h always reaches the down kernel as its operand, also at decode."""
  act = _act(activation, situ_beta, situ_linear_beta)
  t_up, t_down = tiling if tiling is not None else (None, None)
  deq = lambda w: jnp.swapaxes(mx.dequantize_mxfp4(w[0], w[1], x.dtype), 1, 2)
  merged = w3 is None
  E = w1[0].shape[0 if layer is None else 1]
  avg = _avg_rows(topk_ids, E, num_experts_total)
  use_gather = _use_gather(gather, avg)
  if mode is None:
    mode = "predequant" if avg >= sch.PREDEQUANT_MIN_ROWS and not merged else "kernel"
  if merged and mode != "kernel":
    raise ValueError(f"merged MXFP4 gate/up weights run in mode 'kernel' only, not {mode!r}")
  joined = False
  if mode == "kernel":
    t_up, t_down = _mxfp4_tilings(t_up, t_down, avg, merged, (E, x.shape[1], w2[0].shape[-1] * 2),
                                  decoder)
    joined = t_up.joined
  if merged and joined:
    raise ValueError("merged MXFP4 gate/up weights write h in halves order, which joined tiles "
                     "(natural order) cannot read: run them with two weights")
  halves = use_gather and mode == "kernel"  # x handed over as the kernel's operand
  h_halves = halves or merged  # h as the down kernel's operand (merged: halves order by layout)
  kw = dict(avg_rows=avg, mode=mode, zero_tail=not use_gather, layer=layer, decoder=decoder)
  up = tuple(w1) if merged else (*w1, *w3)

  def kernel(xs, tok, gs, interp):
    if halves:
      xs = mx.to_operand(xs, mx.x_shift(decoder or mx.DECODER), joined)
    h = gm.run_mxfp4(xs, up, gs, tiling=t_up, act=act, interpret=interp, row_index=tok,
                     x_halves=halves, out_halves=h_halves, **kw)
    return gm.run_mxfp4(h, tuple(w2), gs, tiling=t_down, interpret=interp, x_halves=h_halves, **kw)

  def reference(xs, gs):
    w1l, w2l = _layer_of(w1, layer), _layer_of(w2, layer)
    g, u = layout.unmerge_gate_up_mxfp4(w1l) if merged else (w1l, _layer_of(w3, layer))
    return _reference_path(xs, gs, deq(g), deq(u), deq(w2l), act, x.dtype)

  return _routed_mlp(x, topk_ids, topk_weights, E, kernel, reference, interpret, use_gather, platform)
