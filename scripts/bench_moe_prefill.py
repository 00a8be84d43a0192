"""MoE expert MLP at prefill (issue 25): bf16 vs MXFP4, fused MLP vs the plain grouped matmul.

  python scripts/bench_moe.py --prefill [--deadline 140] [--json PATH]   # on the GPU, <= 2.5 min
  python scripts/bench_moe.py --prefill --smoke                          # CPU script check

Per shape (Kimi-Linear 16k tokens, 256 experts top-8; K3 under 8-way EP, 32k tokens, 112 of
896 experts top-16), in one run and one process:
  - the plain bf16 grouped matmul of the up projection (D -> 2I as one weight) on the local
    rows: the rate the fused MLP is held to;
  - each stage alone as the MLP runs it (up = fused gate+up+SiTU reading the token rows in place,
    down = the second grouped matmul): the default tiles next to the variants: merged gate/up
    weights (pallas_kernels.moe.layout), MXFP4 joined tiles (Tiling.joined), bm 256 with
    half-height tail tiles (Tiling.half_tail); each output's rel err on the first experts' rows
    vs plain XLA dots (a wrong variant is never the fastest);
  - the whole expert MLP (sort, up, down, combine): the defaults (two weights, merged) and the
    forms with the fastest up / down tilings measured just before, each with its error vs the
    two-weight bf16 MLP (on the dequantized weights for MXFP4);
  - ratios: MXFP4 MLP / bf16 MLP, fused MLP / plain gmm (TFLOP/s);
  - the MXFP4 decode stream (issue 20) at 256 tokens: plain gmm and fused up, today vs merged, in
    TB/s of the touched experts' packed bytes.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import moe
from tables import Table  # scripts/tables.py (scripts/ is on sys.path: run as a script or from bench_moe)
from pallas_kernels.moe import grouped as gm
from pallas_kernels.moe import kernel as kn
from pallas_kernels.moe import layout
from pallas_kernels.moe import mxfp4 as mx
from pallas_kernels.moe import schedule as sch
from pallas_kernels.moe.schedule import Tiling

T = Tiling
# (bm, bk, bn, warps, stages[, swap_ab, half_tail]); the first of each list is the default
# (schedule.PREFILL_TILES, run 7 of docs/bench_moe.md). "merged" = one gate/up weight with the
# columns (bf16) / rows (MXFP4, features in halves order) interleaved (pallas_kernels.moe.layout):
# one MMA of 2 bn per tile. "tail/2": a group's last tile of <= bm/2 rows runs a bm/2-row loop.
BF16_UP = [T(128, 64, 128, 8, 4)]
BF16_UP_MERGED = [T(128, 64, 128, 8, 3), T(128, 64, 128, 8, 4)]
BF16_DOWN = [T(128, 64, 256, 8, 3)]
Q_UP = [T(128, 128, 128, 8, 3, True)]
# merged, x and h in halves order: bm256 bn64 decodes 128 weight rows per K step for 256 rows
Q_UP_MERGED = [T(256, 128, 64, 8, 3, True, True), T(256, 128, 64, 8, 4, True, True),
               T(256, 64, 64, 8, 4, True, True), T(128, 128, 128, 8, 3, True)]
# "joined": the decoded halves re-interleaved to natural K order, one MMA per K step, x and h in
# natural order (merged weights: x natural, h in halves order, so no merged joined MLP)
J = lambda *a: T(*a, joined=True)
Q_UP_MERGED_J = [J(256, 64, 64, 8, 4, True, True), J(256, 128, 64, 8, 3, True, True)]
Q_UP_J = [J(128, 64, 128, 8, 4, True), J(128, 128, 128, 8, 3, True)]
Q_DOWN = [T(256, 128, 128, 8, 3, True, True), T(256, 128, 128, 8, 4, True, True),
          T(256, 64, 128, 8, 4, True, True), T(128, 64, 128, 8, 3)]
Q_DOWN_J = [J(128, 64, 128, 8, 3), J(256, 64, 128, 8, 4, True, True)]
PLAIN = T(128, 64, 256, 8, 3)  # bench_moe.md run 3's best plain tiling (507 / 547 TFLOP/s)
# MXFP4 decode stream (issue 20): the fused gate+up at decode, two weights (today's tiles,
# schedule.DECODE_MXFP4) vs merged; TB/s of the touched experts' packed bytes
DECODE_UP = [T(16, 256, 64, 2, 3, True)]
DECODE_UP_MERGED = [T(16, 256, 32, 2, 3, True), T(16, 256, 64, 2, 3, True), T(16, 256, 64, 4, 3, True),
                    T(16, 128, 64, 2, 4, True)]
DECODE_SHAPES = [("Kimi decode 256 tok", 256, 2304, 1024, 256, 256, 8),
                 ("K3-EP8 decode 256 tok", 256, 3584, 3072, 896, 112, 16)]

SHAPES = [  # label, tokens, d, inter, e_global, e_local, k (K3 first: the shape with the targets)
    ("K3-EP8 prefill 32k tok", 32768, 3584, 3072, 896, 112, 16),
    ("Kimi prefill 16k tok", 16384, 2304, 1024, 256, 256, 8),
]
COMPILE_THREADS = 8  # XLA / Triton compiles run outside the GIL: compile the variants side by side


def tname(t):
  return (f"bm{t.bm} bk{t.bk} bn{t.bn} w{t.num_warps} s{t.num_stages}" + (" swapAB" if t.swap_ab else "")
          + (" tail/2" if t.half_tail else "") + (" joined" if t.joined else ""))


def rel_err(out, ref):
  out = np.asarray(out, np.float32)
  ref = np.asarray(ref, np.float32)
  return float(np.abs(out - ref).max() / max(np.abs(ref).max(), 1e-6))


def compile_fn(fn, args):
  """Ahead-of-time compile; every array is an argument (a closed-over weight would be captured as
  a constant of the program: GBs, and minutes of compile)."""
  return jax.jit(fn).lower(*args).compile()


class Run:
  """Rows of one run: dicts (shape, op, tiling, us, tflops, note)."""

  def __init__(self, time_fn, log, deadline):
    self.time_fn, self.log, self.deadline, self.t0 = time_fn, log, deadline, time.time()
    self.rows: list[dict] = []

  def late(self, frac=1.0):
    return time.time() - self.t0 > self.deadline * frac

  def _row(self, label, op, tiling, t, flops, note):
    row = dict(shape=label, op=op, tiling=tiling and tname(tiling), us=t and t * 1e6,
               tflops=t and flops / t / 1e12, note=note)
    self.rows.append(row)
    self.log(f"{label} {op} {row['tiling'] or ''}: " +
             (f"{t * 1e6:.1f} us, {row['tflops']:.1f} TFLOP/s {note}" if t else note))

  def time(self, label, op, fn, args, flops, tiling=None, note=""):
    try:
      t = self.time_fn(fn, *args)
    except Exception as e:  # noqa: BLE001 - a failing variant must not end the run
      self._row(label, op, tiling, None, flops, f"failed: {type(e).__name__}: {str(e)[:200]}")
      return None
    self._row(label, op, tiling, t, flops, note)
    return t

  def sweep(self, label, groups, frac):
    """groups: [(op, fn(tiling) -> callable of args, args, flops, tilings[, check])]. Compiles every
    variant side by side, then times them one after another (nothing else running: a compile
    thread holding the GIL would starve the timed loop's dispatch) until frac of the deadline,
    at least one per op. check(output) -> rel err vs a dense reference, in the row's note; a
    variant over CHECK_TOL is never the fastest. Returns {op: fastest tiling or None}."""
    jobs = [(op, t, g[2], g[3], g[1](t), g[5] if len(g) > 5 else None)
            for g in groups for op, t in ((g[0], t) for t in g[4])]
    done = compile_all([(fn, args) for _, _, args, _, fn, _ in jobs])
    best = {g[0]: (None, None) for g in groups}
    for (op, t, args, flops, _, check), (exe, err) in zip(jobs, done):
      if err is not None:
        self._row(label, op, t, None, flops, f"compile failed: {type(err).__name__}: {str(err)[:200]}")
        continue
      if self.late(frac) and best[op][0] is not None:
        self._row(label, op, t, None, flops, "skipped: deadline")
        continue
      err_note, ok = "", True
      if check is not None:
        try:
          e = check(exe(*args))
          err_note, ok = f"rel err {e:.1e}", e < CHECK_TOL
        except Exception as ex:  # noqa: BLE001
          err_note, ok = f"check failed: {type(ex).__name__}: {str(ex)[:200]}", False
      tt = self.time(label, op, exe, args, flops, t, note=err_note)
      if ok and tt is not None and (best[op][1] is None or tt < best[op][1]):
        best[op] = (t, tt)
    return {op: b[0] for op, b in best.items()}


def compile_all(jobs):
  """[(fn, args)] -> [(compiled or None, exception or None)], compiled on a thread pool."""
  from concurrent.futures import ThreadPoolExecutor
  with ThreadPoolExecutor(COMPILE_THREADS) as pool:
    futs = [pool.submit(compile_fn, fn, args) for fn, args in jobs]
  return [(None, f.exception()) if f.exception() else (f.result(), None) for f in futs]


def _inputs(tokens, d, inter, e_global, e_local, k):
  key = jax.random.key(2)
  ids = jnp.argsort(jax.random.uniform(key, (tokens, e_global)), axis=-1)[:, :k]
  ids = jnp.where(ids < e_local, ids, -1).astype(jnp.int32)  # other devices' experts
  wts = jax.random.uniform(jax.random.key(3), (tokens, k), jnp.float32)
  x = jax.random.normal(jax.random.key(4), (tokens, d), jnp.bfloat16)
  mk = lambda s, i: (jax.random.normal(jax.random.key(5 + i), s, jnp.float32) * 0.02).astype(jnp.bfloat16)
  return ids, wts, x, mk((e_local, d, inter), 0), mk((e_local, d, inter), 1), mk((e_local, inter, d), 2)


UP16 = "bf16 up: fused gate+up+SiTU (gather)"
UP16M = "bf16 up: merged gate/up + SiTU (gather)"
DOWN16 = "bf16 down gmm"
UPQ = "mxfp4 up: fused gate+up+SiTU (gather, halves in/out)"
UPQM = "mxfp4 up: merged gate/up + SiTU (gather, halves in)"
UPQMJ = "mxfp4 up: merged gate/up + SiTU, joined (gather)"
UPQJ = "mxfp4 up: fused gate+up+SiTU, joined (gather)"
DOWNQ = "mxfp4 down gmm (halves in)"
DOWNQJ = "mxfp4 down gmm, joined"
MLP16 = "bf16 MLP, two weights, defaults"   # the bf16 rows' reference, fed dequantized weights the MXFP4 rows'
CHECK_EXPERTS = 2  # stages checked on the rows of the first local experts (dense XLA references)
CHECK_TOL = 3e-2   # rel err from which a variant is wrong (a bf16 output's rounding: ~4e-3)


def _up16(act):
  return lambda t: lambda x, tok, gs, *ws: gm.run_bf16(x, ws, gs, tiling=t, act=act, row_index=tok,
                                                      zero_tail=False)


def _upq(act, out_halves=True):
  return lambda t: lambda x, tok, gs, *ws: gm.run_mxfp4(
      x, ws, gs, tiling=t, act=act, mode="kernel", row_index=tok, x_halves=True, zero_tail=False,
      out_halves=out_halves)


def _check_bounds(gs):
  """Row bounds of the first CHECK_EXPERTS experts in the sorted order."""
  return np.concatenate([[0], np.cumsum(np.asarray(gs[:CHECK_EXPERTS]))])


def _dense_up(act, xs, gs, w1, w3):
  """fp32 act(xs @ w1[e], xs @ w3[e]) on the rows of the first CHECK_EXPERTS experts (xs: rows in
  the sorted order; w [E, in, out]): (r, [r, I])."""
  bounds = _check_bounds(gs)
  dot = lambda a, w: jnp.dot(a, w, preferred_element_type=jnp.float32)
  return int(bounds[-1]), jnp.concatenate([act(dot(xs[a:b], w1[e]), dot(xs[a:b], w3[e]))
                                           for e, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]))])


def _dense_refs(act, x, tok, gs, h, ws):
  """fp32 references on the rows [0, r) of the first CHECK_EXPERTS experts (plain XLA dots): the
  up stage (act of the two projections) and the down stage (h's rows), for ws = (w1, w3, w2)
  [E, in, out]. Returns (r, up [r, I], down [r, D])."""
  bounds = _check_bounds(gs)
  r, up = _dense_up(act, x[tok[:int(bounds[-1])]], gs, ws[0], ws[1])
  down = [jnp.dot(h[a:b], ws[2][e], preferred_element_type=jnp.float32)
          for e, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]))]
  return r, up, jnp.concatenate(down)


def _check(ref, rows, halves=False, scaled=False):
  """output -> rel err vs ref on its first `rows` rows, undoing the MXFP4 operand form (halves
  order [even | odd] and / or the decoder's 2^shift) first."""
  def check(out):
    o = out[:rows].astype(jnp.float32)
    if scaled:
      o = o * jnp.float32(2.0 ** -mx.x_shift(mx.DECODER))
    if halves:
      o = jnp.stack(jnp.split(o, 2, axis=-1), axis=-1).reshape(o.shape)
    return rel_err(o, ref)
  return check


def _stage_groups(act, x, tok, gs, h, ws, qs, merged, flops_up, flops_down):
  """The stage sweeps, each array an argument of the function it times, each output checked on
  the first experts' rows against dense references (bf16 weights / the dequantized MXFP4 ones)."""
  w1, w3, w2 = ws
  (p1, s1), (p3, s3), (p2, s2) = qs
  w13, (p13, s13) = merged
  shift = mx.x_shift(mx.DECODER)
  xh, xn = mx.to_operand(x, shift, False), mx.to_operand(x, shift, True)
  hh, hn = mx.to_operand(h, shift, False), mx.to_operand(h, shift, True)  # the same h, both forms
  deq = lambda q: jnp.swapaxes(moe.dequantize_mxfp4(q[0][:CHECK_EXPERTS], q[1][:CHECK_EXPERTS]), 1, 2)
  r, up16, down16 = _dense_refs(act, x, tok, gs, h, ws)
  _, upq, downq_ref = _dense_refs(act, x, tok, gs, h, [deq(q) for q in qs])
  down16_fn = lambda t: lambda h, gs, w2: gm.run_bf16(h, (w2,), gs, tiling=t, zero_tail=False)
  downq = lambda t: lambda h, gs, p2, s2: gm.run_mxfp4(h, (p2, s2), gs, tiling=t, mode="kernel",
                                                       x_halves=True, zero_tail=False)
  return [(UP16, _up16(act), (x, tok, gs, w1, w3), flops_up, BF16_UP, _check(up16, r)),
          (UP16M, _up16(act), (x, tok, gs, w13), flops_up, BF16_UP_MERGED, _check(up16, r)),
          (DOWN16, down16_fn, (h, gs, w2), flops_down, BF16_DOWN, _check(down16, r)),
          (UPQ, _upq(act), (xh, tok, gs, p1, s1, p3, s3), flops_up, Q_UP, _check(upq, r, True, True)),
          (UPQM, _upq(act), (xh, tok, gs, p13, s13), flops_up, Q_UP_MERGED, _check(upq, r, True, True)),
          (UPQMJ, _upq(act, False), (xn, tok, gs, p13, s13), flops_up, Q_UP_MERGED_J, _check(upq, r, True)),
          (UPQJ, _upq(act), (xn, tok, gs, p1, s1, p3, s3), flops_up, Q_UP_J, _check(upq, r, False, True)),
          (DOWNQ, downq, (hh, gs, p2, s2), flops_down, Q_DOWN, _check(downq_ref, r)),
          (DOWNQJ, downq, (hn, gs, p2, s2), flops_down, Q_DOWN_J, _check(downq_ref, r))]


def bench_shape(run, label, tokens, d, inter, e_global, e_local, k, window):
  """All rows of one shape. window = (start, end) fractions of the deadline: past 80% of it the
  sweeps time only one tiling per stage (compiles are a fixed cost; timing is ~0.5 s a variant)."""
  at = lambda f: window[0] + (window[1] - window[0]) * f
  ids, wts, x, w1, w3, w2 = _inputs(tokens, d, inter, e_global, e_local, k)
  tok, gs, _ = moe.sort_by_expert(ids, e_local)
  rows = int(gs.sum())
  flops_up, flops_down = 2.0 * rows * d * 2 * inter, 2.0 * rows * inter * d
  flops_mlp = flops_up + flops_down
  tot = e_global if e_global > e_local else None
  label = f"{label} ({rows} local rows, {d}->{inter}x2->{d})"
  act = functools.partial(kn.glu_activation, activation="situ")

  # the plain grouped matmul, up projection as one weight, on the local rows only
  xs_local = x[tok[:rows]]
  w13 = jnp.concatenate([w1, w3], axis=-1)
  run.time(label, "bf16 plain gmm (D -> 2I, one weight)", jax.jit(functools.partial(moe.gmm, tiling=PLAIN)),
           (xs_local, w13, gs), flops_up, PLAIN)
  del xs_local, w13

  q = lambda w: moe.quantize_mxfp4(jnp.swapaxes(w, 1, 2))
  qs = (q(w1), q(w3), q(w2))
  merged = (layout.merge_gate_up(w1, w3), jax.jit(layout.merge_gate_up_mxfp4)(qs[0], qs[1]))
  h = jax.random.normal(jax.random.key(7), (tok.shape[0], inter), jnp.bfloat16)
  best = run.sweep(label, _stage_groups(act, x, tok, gs, h, (w1, w3, w2), qs, merged, flops_up,
                                        flops_down), at(0.8))
  del h

  # whole MLPs (compiled side by side, then run one after another); the bf16 MLP's program is the
  # MXFP4 rows' reference too (the same shapes, fed the dequantized weights)
  args = (x, ids, wts, w1, w3, w2)
  margs = (x, ids, wts, merged[0], w2)
  qargs = (x, ids, wts, *qs)
  qmargs = (x, ids, wts, merged[1], qs[2])
  mlp = lambda **kw: functools.partial(moe.expert_mlp, activation="situ", num_experts_total=tot, **kw)
  qmlp = lambda **kw: functools.partial(moe.expert_mlp_mxfp4, activation="situ",
                                        num_experts_total=tot, **kw)
  mlp_m = lambda **kw: (lambda x, ids, wts, w13, w2: mlp(**kw)(x, ids, wts, w13, None, w2))
  qmlp_m = lambda **kw: (lambda x, ids, wts, w13, w2: qmlp(**kw)(x, ids, wts, w13, None, w2))
  variants = [(MLP16, mlp(), args, None), ("bf16 MLP, merged gate/up, defaults", mlp_m(), margs, None)]
  if best[UP16M] and best[DOWN16]:
    tl = (best[UP16M], best[DOWN16])
    variants.append(("bf16 MLP, merged gate/up + fastest stages", mlp_m(tiling=tl), margs, tl))
  variants += [("mxfp4 MLP, two weights, defaults", qmlp(), qargs, None),
               ("mxfp4 MLP, merged gate/up, defaults", qmlp_m(), qmargs, None)]
  if best[UPQM] and best[DOWNQ]:
    tl = (best[UPQM], best[DOWNQ])
    variants.append(("mxfp4 MLP, merged gate/up + fastest stages", qmlp_m(tiling=tl), qmargs, tl))
  if best[UPQJ] and best[DOWNQJ]:
    tl = (best[UPQJ], best[DOWNQJ])
    variants.append(("mxfp4 MLP, two weights, joined + fastest stages", qmlp(tiling=tl), qargs, tl))
  deq = lambda q: jnp.swapaxes(moe.dequantize_mxfp4(q[0], q[1], jnp.bfloat16), 1, 2)
  done = compile_all([(fn, a) for _, fn, a, _ in variants] + [(deq, (qs[0],)), (deq, (qs[2],))])
  exes = {op: ex for (op, *_), ex in zip(variants, done)}
  (deq_up, _), (deq_down, _) = done[-2:]
  today16, _ = exes[variants[0][0]]
  ref16 = None if today16 is None else today16(*args)
  refq = None
  if today16 is not None and deq_up is not None and deq_down is not None:
    refq = today16(x, ids, wts, deq_up(qs[0]), deq_up(qs[1]), deq_down(qs[2]))
  for op, _, a, tl in variants:
    exe, err = exes[op]
    if err is not None:
      run._row(label, op, None, None, flops_mlp, f"compile failed: {type(err).__name__}: {str(err)[:200]}")
      continue
    bf16 = a is args or a is margs
    ref = (None if op == MLP16 else ref16) if bf16 else refq
    what = "the two-weight bf16 MLP" if bf16 else "bf16 MLP on dequantized weights"
    err = None
    try:
      err = None if ref is None else rel_err(exe(*a), ref)
      note = "" if err is None else f"rel err vs {what} {err:.1e}"
    except Exception as e:  # noqa: BLE001
      note, err = f"check failed: {type(e).__name__}: {str(e)[:200]}", float("inf")
    if run.time(label, op, exe, a, flops_mlp,
                note=(f"up {tname(tl[0])} / down {tname(tl[1])}; " if tl else "") + note):
      run.rows[-1]["err"] = err
  _ratios(run, label)


def bench_decode(run, label, tokens, d, inter, e_global, e_local, k):
  """The fused gate+up at decode, two weights vs merged: TB/s of the touched experts' bytes (MXFP4:
  packed weights + scales; bf16 at the default tiles, the Kimi-Linear case), each checked on the
  first experts' rows."""
  ids, _, x, *_ = _inputs(tokens, d, 16, e_global, e_local, k)
  tok, gs, _ = moe.sort_by_expert(ids, e_local)
  touched = int((gs > 0).sum())
  nbytes = {"mxfp4": touched * 2 * inter * (d // 2 + d // 32), "bf16": touched * 2 * inter * d * 2}
  key = jax.random.key(9)
  w = lambda i: jax.random.normal(jax.random.fold_in(key, i), (e_local, inter, d), jnp.float32) * 0.02
  q1, q3 = moe.quantize_mxfp4(w(0)), moe.quantize_mxfp4(w(1))
  q13 = jax.jit(layout.merge_gate_up_mxfp4)(q1, q3)
  w1, w3 = (jnp.swapaxes(w(i), 1, 2).astype(jnp.bfloat16) for i in (0, 1))
  w13 = layout.merge_gate_up(w1, w3)
  act = functools.partial(kn.glu_activation, activation="situ")
  xs = x[tok]
  avg = tokens * k / e_global
  deq = lambda q: jnp.swapaxes(moe.dequantize_mxfp4(q[0][:CHECK_EXPERTS], q[1][:CHECK_EXPERTS]), 1, 2)
  r, ref_q = _dense_up(act, xs, gs, deq(q1), deq(q3))
  _, ref_16 = _dense_up(act, xs, gs, w1, w3)
  up = lambda t: lambda x, gs, *ws: gm.run_mxfp4(x, ws, gs, tiling=t, act=act, mode="kernel",
                                                 avg_rows=avg)
  up16 = lambda t: lambda x, gs, *ws: gm.run_bf16(x, ws, gs, tiling=t, act=act, avg_rows=avg)
  t16 = lambda fused: [sch.choose_tiling(xs.shape[0], d, inter, e_local, fused=fused, avg_rows=avg)]
  label = f"{label} ({int(gs.sum())} local rows on {touched} experts, {d}->{inter}x2)"
  plain = lambda t: lambda x, gs, *ws: gm.run_mxfp4(x, ws, gs, tiling=t, mode="kernel")
  groups = [("mxfp4 decode plain gmm D -> 2I (issue 20's stream)", plain, (xs, gs, *q13), 0.0, DECODE_UP),
            ("mxfp4 decode up: two weights", up, (xs, gs, *q1, *q3), 0.0, DECODE_UP, _check(ref_q, r)),
            ("mxfp4 decode up: merged gate/up", up, (xs, gs, *q13), 0.0, DECODE_UP_MERGED,
             _check(ref_q, r, halves=True)),
            ("bf16 decode up: two weights", up16, (xs, gs, w1, w3), 0.0, t16(True), _check(ref_16, r)),
            ("bf16 decode up: merged gate/up", up16, (xs, gs, w13), 0.0, t16("merged"), _check(ref_16, r))]
  n0 = len(run.rows)
  run.sweep(label, groups, 1.0)
  for row in run.rows[n0:]:  # rate in TB/s of the weight bytes in the tflops column's place
    if row["us"]:
      fmt = row["op"].split()[0]
      row["tbs"] = nbytes[fmt] / (row["us"] * 1e-6) / 1e12
      row["note"] = (row["note"] + f" {row['tbs']:.2f} TB/s {'packed' if fmt == 'mxfp4' else 'bf16'}").strip()
      row["tflops"] = None


def _ratios(run, label):
  got = {r["op"]: r for r in run.rows if r["shape"] == label and r["tflops"]
         and (r.get("err") or 0) < CHECK_TOL}  # a wrong variant is no one's best
  best = lambda prefix: max((r for op, r in got.items() if op.startswith(prefix)),
                            key=lambda r: r["tflops"], default=None)
  plain = got.get("bf16 plain gmm (D -> 2I, one weight)")
  b16, q4 = best("bf16 MLP"), best("mxfp4 MLP")
  up16 = best("bf16 up")
  for what, a, b in (("mxfp4 MLP / bf16 MLP (best of each, TFLOP/s)", q4, b16),
                     ("bf16 MLP / plain bf16 gmm", b16, plain),
                     ("mxfp4 MLP / plain bf16 gmm", q4, plain),
                     ("bf16 fused up / plain bf16 gmm", up16, plain)):
    if a and b:
      run.rows.append(dict(shape=label, op="ratio " + what, tiling=None, us=None,
                           tflops=None, ratio=a["tflops"] / b["tflops"],
                           note=f"{a['op']} vs {b['op']}"))


def rows_table() -> Table:
  return Table(("shape", "shape"), ("op", "op"), ("tiling", "tiling"), ("us", "time us", ".1f"),
               ("tflops", "TFLOP/s", ".1f"), ("ratio", "ratio", ".3f"), ("note", "note"))


def table(run, head):
  t = rows_table()
  for r in run.rows:
    t.add(shape=r["shape"], op=r["op"], tiling=r["tiling"] or None, us=r["us"], tflops=r["tflops"],
          ratio=r.get("ratio"), note=r["note"])
  return head + "\n\n" + t.markdown() + "\n", t


def main(a, time_fn, log, peak_f):
  """Entry from bench_moe.py --prefill (a: its parsed args)."""
  g = globals()
  lists = ("BF16_UP", "BF16_UP_MERGED", "BF16_DOWN", "Q_UP", "Q_UP_MERGED", "Q_UP_MERGED_J", "Q_UP_J",
           "Q_DOWN", "Q_DOWN_J", "DECODE_UP", "DECODE_UP_MERGED")
  shapes, dshapes = SHAPES, DECODE_SHAPES
  if a.smoke:  # CPU script check: tiny shapes, two tilings per list, kernels interpreted
    shapes = [(lab, tok // 512, d // 8, inter // 8, eg // 16, max(4, el // 16), k // 2)
              for lab, tok, d, inter, eg, el, k in shapes]
    dshapes = [(lab, tok // 16, d // 8, inter // 8, eg // 16, max(4, el // 16), k // 2)
               for lab, tok, d, inter, eg, el, k in dshapes]
    for name in lists:
      g[name] = [dataclasses.replace(t, bm=32 if t.half_tail else 16, bk=32, bn=16) for t in g[name][:2]]
    g["PLAIN"] = Tiling(16, 32, 32)
  if a.only:
    keep = lambda ss: [s for s in ss if any(o in s[0] for o in a.only.split(","))]
    shapes, dshapes = keep(shapes), keep(dshapes)
  run = Run(time_fn, log, a.deadline)
  dev = jax.devices()[0].device_kind
  head = (f"# MoE prefill (issue 25), {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {dev}, "
          f"jax {jax.__version__}, MXFP4 decoder {mx.DECODER}; bf16 matmul 8192^3 in this run "
          f"{peak_f / 1e12:.0f} TFLOP/s")
  for i, sh in enumerate(shapes):
    log("==", sh[0])
    bench_shape(run, *sh, window=(i / len(shapes), (i + 1) / len(shapes)))
    _write(run, head, a)
  for sh in dshapes:
    log("==", sh[0])
    bench_decode(run, *sh)
    _write(run, head, a)
  print(_write(run, head, a), flush=True)


def _write(run, head, a):
  out, t = table(run, head)
  if getattr(a, "csv", None):
    t.write_csv(a.csv)
  if os.environ.get("OUT"):
    with open(os.path.join(os.environ["OUT"], "bench_moe_prefill.md"), "w") as fh:
      fh.write(out)
  if a.json:
    with open(a.json, "w") as fh:
      json.dump(run.rows, fh, indent=1)
  return out
