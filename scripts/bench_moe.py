"""MoE grouped-matmul benchmark on one GPU; prints ONE table (and writes it to $OUT).

  python scripts/bench_moe.py [--deadline 180] [--no-check] [--quick] [--no-anchors]
  python scripts/bench_moe.py --ncu   # two MXFP4 decode launches (new, old decoder) for ncu
  python scripts/bench_moe.py --sass  # no GPU: main-loop SASS per variant (scripts/sass_moe.py)
  python scripts/bench_moe.py --prefill --no-check  # issue 25: prefill expert MLP (bench_moe_prefill.py)

Shapes (random routing, uniform top-k without replacement):
  Kimi-Linear: E=256, top-8, d=2304, I=1024 -> up gmm 2304 -> 2048 (w1|w3), down 1024 -> 2304.
  K3 latent, 8-way EP: 896 experts (112 local), top-16, 3584 -> 3072 (up gmm 3584 -> 6144).
  prefill: Kimi 16384 tokens (131072 rows), K3 32768 tokens (65536 local rows: the anchor
  shape of targets.md); decode: 64 and 256 tokens.
Rows per op: ours (Pallas Triton, best of a few tilings), XLA ragged_dot (where its dense
operand fits), jax's example Mosaic GPU ragged_dot (the anchor), dense matmul of the same
FLOPs, our MXFP4 gmm per decoder (mxfp4.DECODER: jnp, ptx4 = the first PTX decoder, ptx8 =
the current one) and tiling, each with its error vs gmm on the dequantized weights, and the
whole expert MLP (bf16 / MXFP4; expert-parallel shapes also with the num_experts_total tile
hint). Weight TB/s counts the bytes of the experts actually touched. Peaks (big matmul, big
copy) are measured in the same run.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_kernels import moe  # noqa: E402
from pallas_kernels.moe import grouped as gm  # noqa: E402
from pallas_kernels.moe import kernel as kn  # noqa: E402
from pallas_kernels.moe.schedule import Tiling  # noqa: E402
from pallas_kernels.moe import mxfp4 as _mxm  # noqa: E402

from bench_moe_prefill import tname  # noqa: E402 (one tiling label for both tables)
from tables import Table, add_csv_argument  # noqa: E402

DECODER_DEFAULT = _mxm.DECODER  # rows name their decoder; each variant restores the default


def with_decoder(dec, fn, *args):
  """Trace + run fn under mxfp4.DECODER = dec (read at trace time: pass a fresh jit)."""
  _mxm.DECODER = dec
  try:
    return fn(*args)
  finally:
    _mxm.DECODER = DECODER_DEFAULT

T0 = time.time()
ROWS: list[tuple] = []
SAMPLES = [5]  # timed samples per measurement (1 in --smoke)


def log(*a):
  print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def time_fn(fn, *args, reps=None):
  """Median seconds per call over 5 samples of back-to-back calls (after compile+warmup)."""
  jax.block_until_ready(fn(*args))
  t = time.perf_counter()
  jax.block_until_ready(fn(*args))
  one = time.perf_counter() - t
  reps = reps or max(2, min(50, int(0.05 / max(one, 1e-6))))
  if SAMPLES[0] == 1:
    return one
  samples = []
  for _ in range(SAMPLES[0]):
    t = time.perf_counter()
    for _ in range(reps):
      out = fn(*args)
    jax.block_until_ready(out)
    samples.append((time.perf_counter() - t) / reps)
  return statistics.median(samples)


def try_time(name, fn, *args):
  try:
    return time_fn(fn, *args)
  except Exception as e:  # noqa: BLE001 - a failing variant must not end the run
    log(f"{name} FAILED: {type(e).__name__}: {str(e)[:300]}")
    return None


def peaks(n=8192, copy_elems=1 << 30):
  a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
  mm = jax.jit(lambda a, b: a @ b)
  t = time_fn(mm, a, a)
  flops = 2 * n ** 3 / t
  x = jnp.zeros((copy_elems,), jnp.float32)  # 4 GiB
  cp = jax.jit(lambda x: x + 1)
  t2 = time_fn(cp, x)
  bw = 2 * x.nbytes / t2
  del a, x
  return flops, bw


def routing(key, tokens, k, e_global, e_local):
  """Random top-k routing; returns local group sizes (experts [0, e_local)) as np.int32."""
  ids = jnp.argsort(jax.random.uniform(key, (tokens, e_global)), axis=-1)[:, :k]
  return np.bincount(np.asarray(ids).ravel(), minlength=e_global)[:e_local].astype(np.int32)


def rel_err(out, ref):
  out = np.asarray(out, np.float32)
  ref = np.asarray(ref, np.float32)
  return float(np.abs(out - ref).max() / max(np.abs(ref).max(), 1e-6))


def _safe(res, name, fn):
  try:
    res[name] = fn()
  except Exception as e:  # noqa: BLE001 - report and continue
    log(f"check {name} FAILED: {type(e).__name__}: {str(e)[:400]}")
    res[name] = float("nan")


def check(m=4096):
  """GPU kernels vs references at mid shapes (all tilings classes, both formats)."""
  r = np.random.default_rng(0)
  k, n, g = 512, 512, 24
  sizes = np.diff(np.sort(np.concatenate([[0, m - 96], r.integers(0, m - 96, g - 1)]))).astype(np.int32)
  sizes[3] = 0
  gs = jnp.asarray(sizes)
  x = jnp.asarray(r.standard_normal((m, k)), jnp.bfloat16)
  w = jnp.asarray(r.standard_normal((g, k, n)) / np.sqrt(k), jnp.bfloat16)
  ref = gm.gmm_reference(x, w, gs)
  res = {}
  for t in (Tiling(128, 64, 128, 8, 3), Tiling(16, 128, 64, 4, 4)):
    out = jax.jit(functools.partial(moe.gmm, tiling=t))(x, w, gs)
    res[f"gmm {t}"] = rel_err(out, ref)
    res[f"gmm {t} tail zero"] = float(np.abs(np.asarray(out[m - 96:], np.float32)).max())
  t16 = Tiling(16, 64, 32, 4, 3)  # group sizes not multiples of 16, bk < K, bn < N
  gs2 = jnp.asarray([7, 0, 33, 1, 50, 100] + [0] * (g - 6), jnp.int32)  # sum 191 < 200
  _safe(res, "gmm odd rows", lambda: rel_err(
      jax.jit(functools.partial(moe.gmm, tiling=t16))(x[:200], w, gs2),
      gm.gmm_reference(x[:200], w, gs2)))
  p, s = moe.quantize_mxfp4(jnp.swapaxes(w, 1, 2))
  refq = gm.gmm_mxfp4_reference(x, p, s, gs)
  for t, mode, dec in ((Tiling(16, 256, 64, 4, 3), "kernel", "jnp"),
                       (Tiling(16, 256, 64, 4, 3), "kernel", "ptx4"),
                       (Tiling(16, 256, 64, 4, 3), "kernel", "ptx8"),
                       (Tiling(16, 128, 64, 2, 3, True), "kernel", "ptx8"),
                       (Tiling(128, 64, 128, 8, 3), "kernel", "ptx8"),
                       (Tiling(128, 64, 128, 8, 3), "predequant", "jnp")):
    f = jax.jit(functools.partial(moe.gmm_mxfp4, tiling=t, mode=mode))
    _safe(res, f"gmm_mxfp4 {mode} {dec} {tname(t)}",
          lambda: rel_err(with_decoder(dec, f, x, p, s, gs), refq))
  for act in ("situ",):
    f = functools.partial(kn.glu_activation, activation=act)
    ref_h = f(gm.gmm_reference(x, w, gs).astype(jnp.float32),
              gm.gmm_reference(x, w[::-1], gs).astype(jnp.float32))
    fb = jax.jit(lambda x, a, b, gs: gm.run_bf16(x, (a, b), gs, tiling=None, act=f))
    _safe(res, f"glu bf16 {act}", lambda: rel_err(fb(x, w, w[::-1], gs)[:m - 96],
                                                   ref_h[:m - 96]))
    hq = gm.gmm_mxfp4_reference(x, p, s, gs).astype(jnp.float32)
    for dec, tq in (("ptx4", Tiling(16, 256, 64, 4, 3)), ("ptx8", Tiling(16, 128, 64, 2, 3, True)),
                    ("ptx8", Tiling(16, 128, 64, 4, 3))):
      fq = jax.jit(lambda x, p, s, gs, tq=tq: gm.run_mxfp4(x, (p, s, p, s), gs, tiling=tq, act=f,
                                                           mode="kernel"))
      _safe(res, f"glu mxfp4 {act} {dec} {tname(tq)}",
            lambda: rel_err(with_decoder(dec, fq, x, p, s, gs)[:m - 96], f(hq, hq)[:m - 96]))
  # expert_mlp end to end vs its own reference path (jnp ragged_dot)
  nt = m // 8
  ids = jnp.asarray(r.integers(0, g, (nt, 4)), jnp.int32)
  wts = jnp.asarray(r.random((nt, 4)), jnp.float32)
  w1, w3 = w[:, :, :256], w[:, :, 256:]
  w2 = w[:, :256, :]  # [E, I=256, D=512]
  args = (x[:nt], ids, wts, w1, w3, w2)
  from pallas_kernels.moe import mlp as em
  act = functools.partial(kn.glu_activation, activation="situ")
  tok, gsm, inv = moe.sort_by_expert(ids, g)
  ref_m = moe.combine(em._reference_path(x[:nt][tok], gsm, w1, w3, w2, act, jnp.bfloat16),
                      wts, inv)
  _safe(res, "expert_mlp bf16", lambda: rel_err(
      jax.jit(functools.partial(moe.expert_mlp, activation="situ"))(*args), ref_m))
  for kname, v in res.items():
    log(f"check {kname}: {v:.2e}")
  return max((v for kk, v in res.items() if "tail" not in kk), default=float("nan"))


def _force_interpret():
  from pallas_kernels.moe import schedule as sch
  orig = kn.grouped_matmul
  sch.use_kernel = lambda interpret: (True, True)
  gm.kn.grouped_matmul = lambda *a, **k: orig(*a, **{**k, "interpret": True})


def mgpu_anchor():
  try:
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu as rdm
    return rdm.ragged_dot
  except Exception as e:  # noqa: BLE001
    log(f"mgpu anchor unavailable: {type(e).__name__}: {e}")
    return None


def bench_gmm(label, gs_np, k, n, peak_f, peak_bw, tilings, tilings_q, mgpu_cfgs, deadline,
              glu_tilings=(), anchors=True):
  """One shape: ours bf16 (best tiling), ragged_dot, mgpu anchor, dense, ours mxfp4 per
  (tiling, mode, decoder) in tilings_q."""
  g = len(gs_np)
  m = int(gs_np.sum())
  touched = int((gs_np > 0).sum())
  flops = 2.0 * m * k * n
  wbytes = touched * k * n * 2
  wbytes_q = touched * n * (k // 2 + k // 32)
  key = jax.random.key(1)
  x = jax.random.normal(key, (m, k), jnp.bfloat16)
  w = (jax.random.normal(key, (g, k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
  gs = jnp.asarray(gs_np)
  res = {}

  def row(op, t, wb=wbytes, note=""):
    if t is None:
      ROWS.append((label, op, None, None, None, None, None, note or "failed"))
      return
    ROWS.append((label, op, t * 1e6, flops / t / 1e12, wb / t / 1e12,
                 flops / t / peak_f, wb / t / peak_bw, note))
    res[op] = t

  best, best_t, ours_out = None, None, None
  for t in tilings:
    if time.time() - T0 > deadline:
      break
    f = jax.jit(functools.partial(moe.gmm, tiling=t))
    tt = try_time(f"ours {t}", f, x, w, gs)
    log(f"{label} ours {t}: {tt and tt * 1e6:.1f} us" if tt else f"{label} ours {t}: failed")
    if tt and (best_t is None or tt < best_t):
      best, best_t = t, tt
  if best is not None:
    ours_out = jax.jit(functools.partial(moe.gmm, tiling=best))(x, w, gs)
  row("ours bf16", best_t, note=f"bm{best.bm} bk{best.bk} bn{best.bn} w{best.num_warps} s{best.num_stages}" if best else "")

  if not anchors:
    pass
  elif m * g * k * 2 < 16e9:
    rd = jax.jit(gm.gmm_reference)
    trd = try_time("ragged_dot", rd, x, w, gs)
    row("xla ragged_dot", trd)
    if trd and ours_out is not None:
      log(f"{label} ours vs ragged_dot rel err {rel_err(ours_out, rd(x, w, gs)):.2e}")
  else:
    ROWS.append((label, "xla ragged_dot", None, None, None, None, None, "skipped: dense operand"))

  anchor = mgpu_anchor() if anchors else None
  xa = jnp.pad(x, ((0, (-m) % 64), (0, 0)))  # the anchor needs M % 8 == 0; extra rows in no group
  if anchor is not None:
    best_a = None
    for cfg in mgpu_cfgs:
      if n % (cfg[4] * cfg[1]) or time.time() - T0 > deadline:
        continue
      f = jax.jit(functools.partial(anchor, group_sizes=gs, block_m=cfg[0], block_n=cfg[1],
                                    block_k=cfg[2], max_concurrent_steps=cfg[3],
                                    grid_block_n=cfg[4]))
      ta = try_time(f"mgpu {cfg}", f, xa, w)
      log(f"{label} mgpu {cfg}: {ta and ta * 1e6}")
      if ta and (best_a is None or ta < best_a[0]):
        best_a = (ta, cfg, f)
    if best_a:
      row("mgpu example (anchor)", best_a[0], note=f"cfg {best_a[1]}")
      if ours_out is not None:
        log(f"{label} ours vs mgpu rel err {rel_err(ours_out, best_a[2](xa, w)[:m]):.2e}")

  if anchors:
    row("dense matmul same FLOPs", try_time("dense", jax.jit(lambda a, b: a @ b), x, w[0]),
        wb=k * n * 2, note="one [K,N] weight")

  for t in glu_tilings:
    if time.time() - T0 > deadline:
      break
    act = functools.partial(kn.glu_activation, activation="situ")
    half = n // 2
    fg = jax.jit(lambda x, w, gs, t=t: gm.run_bf16(x, (w[:, :, :half], w[:, :, half:]), gs,
                                                  tiling=t, act=act))
    row("ours fused gate+up+SiTU", try_time(f"glu {t}", fg, x, w, gs),
        note=f"bm{t.bm} bk{t.bk} bn{t.bn} w{t.num_warps} s{t.num_stages} (incl. weight slicing)")

  p, s = moe.quantize_mxfp4(jnp.swapaxes(w, 1, 2))
  del w
  refq = None
  try:  # gmm on the dequantized weights (ragged_dot: only where its dense operand fits)
    if m * g * k * 2 < 16e9:
      refq = jax.jit(gm.gmm_mxfp4_reference)(x, p, s, gs)
  except Exception as e:  # noqa: BLE001
    log(f"{label} mxfp4 reference FAILED: {type(e).__name__}: {str(e)[:200]}")
  for t, mode, dec in tilings_q:
    if time.time() - T0 > deadline:
      break
    f = jax.jit(functools.partial(moe.gmm_mxfp4, tiling=t, mode=mode))
    tt = try_time(f"mxfp4 {dec} {t} {mode}", lambda *a: with_decoder(dec, f, *a), x, p, s, gs)
    err = ""
    if tt and refq is not None:
      err = f", rel err {rel_err(with_decoder(dec, f, x, p, s, gs), refq):.1e}"
    log(f"{label} mxfp4 {dec} {tname(t)} {mode}: {tt and tt * 1e6}{err}")
    what = f"{dec} decoder" if mode == "kernel" else "predequant"
    row(f"ours mxfp4 {what} (packed bytes)", tt, wb=wbytes_q, note=tname(t) + err)
  if "ours bf16" in res and "mgpu example (anchor)" in res:
    ROWS.append((label, "ours / anchor speedup", res["mgpu example (anchor)"] / res["ours bf16"],
                 None, None, None, None, "target >= 1.3 (prefill)"))
  return best


def bench_mlp(label, tokens, d, inter, e_global, e_local, k, peak_bw, deadline):
  """Whole routed-expert layer (permute, fused gate/up+GLU, down, combine), default tiles.
  Expert-parallel shapes (e_global > e_local) also with the num_experts_total tile hint, and the
  old decoder with forced decode tiles (separates the tile effect from the decoder's)."""
  if time.time() - T0 > deadline:
    return
  key = jax.random.key(2)
  ids = jnp.argsort(jax.random.uniform(key, (tokens, e_global)), axis=-1)[:, :k]
  ids = jnp.where(ids < e_local, ids, -1).astype(jnp.int32)  # other devices' experts
  wts = jax.random.uniform(key, (tokens, k), jnp.float32)
  x = jax.random.normal(key, (tokens, d), jnp.bfloat16)
  mk = lambda s: (jax.random.normal(key, s, jnp.float32) * 0.02).astype(jnp.bfloat16)
  w1, w3, w2 = mk((e_local, d, inter)), mk((e_local, d, inter)), mk((e_local, inter, d))
  touched = int(np.unique(np.asarray(ids)[np.asarray(ids) >= 0]).size)
  flops = 2.0 * 3 * d * inter * int((np.asarray(ids) >= 0).sum())
  ep = e_global > e_local
  hints = (None, e_global) if ep else (None,)
  wb = touched * 3 * d * inter * 2
  for tot in hints:
    f = jax.jit(functools.partial(moe.expert_mlp, activation="situ", num_experts_total=tot))
    t = try_time("mlp bf16", f, x, ids, wts, w1, w3, w2)
    if t:
      ROWS.append((label, f"expert_mlp bf16 (situ){', num_experts_total=%d' % tot if tot else ''}",
                   t * 1e6, flops / t / 1e12, wb / t / 1e12, None, wb / t / peak_bw,
                   f"{touched} experts touched"))
  q = lambda w: moe.quantize_mxfp4(jnp.swapaxes(w, 1, 2))
  q1, q3, q2 = q(w1), q(w3), q(w2)
  del w1, w3, w2
  deq = lambda w: jnp.swapaxes(moe.dequantize_mxfp4(w[0], w[1], jnp.bfloat16), 1, 2)
  ref = None
  try:  # bf16 kernel on the dequantized experts: the MXFP4 rows' error reference
    ref = jax.jit(lambda x, ids, wts, q1, q3, q2: moe.expert_mlp(
        x, ids, wts, deq(q1), deq(q3), deq(q2), activation="situ"))(x, ids, wts, q1, q3, q2)
  except Exception as e:  # noqa: BLE001
    log(f"{label} mlp reference FAILED: {type(e).__name__}: {str(e)[:200]}")
  wq = touched * 3 * d * inter * (0.5 + 1 / 32)
  td16 = Tiling(16, 256, 64, 4, 3)
  variants = [("ptx4", None, None), ("ptx8", None, None)]
  if ep:
    variants += [("ptx4", None, (td16, td16)), ("ptx8", e_global, None)]
  for dec, tot, tiling in variants:
    if time.time() - T0 > deadline:
      break
    fq = jax.jit(functools.partial(moe.expert_mlp_mxfp4, activation="situ", tiling=tiling,
                                   num_experts_total=tot))
    tq = try_time(f"mlp mxfp4 {dec}", lambda *a: with_decoder(dec, fq, *a), x, ids, wts, q1, q3, q2)
    err = ""
    if tq and ref is not None:
      err = f", rel err {rel_err(with_decoder(dec, fq, x, ids, wts, q1, q3, q2), ref):.1e}"
    what = (f"num_experts_total={tot}" if tot else
            f"forced tiles {tname(td16)}" if tiling else "default tiles")
    if tq:
      ROWS.append((label, f"expert_mlp mxfp4 in-kernel (situ, {dec} decoder, {what})",
                   tq * 1e6, flops / tq / 1e12, wq / tq / 1e12, None, wq / tq / peak_bw,
                   "packed bytes" + err))
  log(f"{label}: " + ", ".join(f"{r[1]} {r[2]:.1f} us" for r in ROWS if r[0] == label and r[2]))


def ncu_target():
  """Two MXFP4 decode launches for ncu (-k regex:gmm --launch-count 2): the ptx8 decoder with
  its default decode tiles (schedule.DECODE_MXFP4), then the ptx4 decoder with its old tiles;
  Kimi decode 256 tokens (2048 rows, 2304 -> 2048, 256 experts)."""
  gs = routing(jax.random.key(256 + 256), 256, 8, 256, 256)
  m, k, n, g = int(gs.sum()), 2304, 2048, 256
  key = jax.random.key(1)
  x = jax.random.normal(key, (m, k), jnp.bfloat16)
  w = (jax.random.normal(key, (g, n, k), jnp.float32) / np.sqrt(k))
  p, s = moe.quantize_mxfp4(w)
  del w
  gsj = jnp.asarray(gs)
  for dec, t in (("ptx8", None), ("ptx4", Tiling(16, 256, 64, 4, 3))):
    f = jax.jit(functools.partial(moe.gmm_mxfp4, tiling=t, mode="kernel"))
    jax.block_until_ready(with_decoder(dec, f, x, p, s, gsj))
    log(f"ncu target ran: {dec} {t}")


def _pct(key):
  return lambda r: "" if r.get(key) is None else f"{100 * r[key]:.0f}%"


def rows_table():
  """The decode/prefill gmm table: raw values in the CSV, the markdown as it always read ("ours /
  anchor" rows show their speedup in the TFLOP/s column)."""
  def tflops(r):
    if r.get("speedup") is not None:
      return f"{r['speedup']:.2f}x"
    return "" if r.get("tflops") is None else f"{r['tflops']:.1f}"
  return Table(("shape", "shape"), ("op", "op"), ("us", "time us", ".1f"), ("tflops", None),
               ("speedup", None), ("tflops_cell", "TFLOP/s", tflops), ("weight_tb_s", "weight TB/s", ".2f"),
               ("of_peak_flop", None), ("of_peak_bw", None), ("pf_cell", "% peak FLOP", _pct("of_peak_flop")),
               ("pb_cell", "% peak BW", _pct("of_peak_bw")), ("note", "note"))


def table(peak_f, peak_bw, dev):
  head = (f"# MoE benchmark, {datetime.date.today()}, {dev}, jax {jax.__version__}\n"
          f"peaks measured in this run: bf16 matmul 8192^3 {peak_f / 1e12:.0f} TFLOP/s, "
          f"copy (x+1 fp32 4 GiB, read+write) {peak_bw / 1e12:.2f} TB/s\n\n")
  t = rows_table()
  for (lab, op, us, tf, tb, pf, pb, note) in ROWS:
    if op.startswith("ours / anchor"):
      t.add(shape=lab, op=op, speedup=us, note=note)
    else:
      t.add(shape=lab, op=op, us=us, tflops=tf, weight_tb_s=tb, of_peak_flop=pf, of_peak_bw=pb, note=note)
  return head + t.markdown() + "\n", t


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--deadline", type=float, default=180.0)
  ap.add_argument("--no-check", action="store_true")
  ap.add_argument("--quick", action="store_true")
  ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU script check)")
  ap.add_argument("--only", default="", help="comma-separated label substrings (e.g. 'decode')")
  ap.add_argument("--no-mlp", action="store_true", help="skip the whole-expert-MLP rows")
  ap.add_argument("--no-anchors", action="store_true",
                  help="skip the ragged_dot / Mosaic example / dense rows")
  ap.add_argument("--ncu", action="store_true", help="only the two launches ncu_target() makes")
  ap.add_argument("--sass", action="store_true",
                  help="offline: main-loop SASS of the MoE kernel variants (scripts/sass_moe.py)")
  ap.add_argument("--prefill", action="store_true",
                  help="issue 25: the expert MLP at the prefill shapes, bf16 vs MXFP4 variants")
  ap.add_argument("--json", default="", help="--prefill: also write its rows here as JSON")
  add_csv_argument(ap)
  a = ap.parse_args()
  if a.ncu:
    return ncu_target()
  if a.sass:
    import sass_moe
    return sass_moe.main(["--decode", "--prefill"])
  dev = jax.devices()[0].device_kind
  log("device", dev, jax.__version__)
  if a.smoke and jax.default_backend() == "cpu":
    _force_interpret()  # script check only: kernels in interpret mode on CPU
  if not a.no_check:
    log(f"check max rel err {check(256 if a.smoke else 4096):.2e}")
  peak_f, peak_bw = peaks(512, 1 << 20) if a.smoke else peaks()
  log(f"peaks {peak_f / 1e12:.0f} TFLOP/s, {peak_bw / 1e12:.2f} TB/s")
  if a.prefill:
    import bench_moe_prefill
    if a.smoke:
      SAMPLES[0] = 1
    return bench_moe_prefill.main(a, time_fn, log, peak_f)
  pre_t = [Tiling(128, 64, 256, 8, 3), Tiling(128, 64, 256, 8, 4), Tiling(128, 64, 128, 4, 4)]
  pre_glu = [Tiling(128, 64, 64, 8, 3), Tiling(128, 64, 128, 8, 3)]
  pre_q = [(Tiling(128, 64, 256, 8, 3), "predequant", "jnp"),
           (Tiling(128, 64, 128, 8, 3), "kernel", "ptx4"), (Tiling(128, 64, 128, 8, 3), "kernel", "ptx8")]
  dec_t = [Tiling(16, 128, 64, 4, 4), Tiling(16, 256, 64, 4, 3)]
  dec_q = [(Tiling(16, 256, 64, 4, 3), "kernel", "ptx4"),  # the first PTX decoder's best
           (Tiling(16, 256, 64, 4, 3), "kernel", "ptx8"),
           (Tiling(16, 128, 128, 4, 3), "kernel", "ptx8"),
           (Tiling(16, 128, 64, 2, 3, True), "kernel", "ptx8"),  # the decode default
           (Tiling(16, 128, 64, 2, 2, True), "kernel", "ptx8"),
           (Tiling(16, 256, 64, 2, 3, True), "kernel", "ptx8"),
           (Tiling(16, 128, 128, 2, 3, True), "kernel", "ptx8"),
           (Tiling(16, 128, 64, 1, 3, True), "kernel", "ptx8"),
           (Tiling(16, 256, 32, 2, 3, True), "kernel", "ptx8")]
  pre_mgpu = [(128, 128, 64, 4, 4), (128, 128, 64, 5, 2)]
  dec_mgpu = [(64, 128, 64, 4, 1)]
  if a.quick:
    pre_t, pre_q, dec_t, dec_q, pre_mgpu = pre_t[:1], pre_q[:1], dec_t[:1], dec_q[:4], pre_mgpu[:1]
    pre_glu = pre_glu[:1]
  shapes = [  # label, tokens, d, inter, e_global, e_local, k, prefill
      ("Kimi prefill 16k tok", 16384, 2304, 1024, 256, 256, 8, True),
      ("K3-EP8 prefill 32k tok", 32768, 3584, 3072, 896, 112, 16, True),
      ("Kimi decode 256 tok", 256, 2304, 1024, 256, 256, 8, False),
      ("K3-EP8 decode 256 tok", 256, 3584, 3072, 896, 112, 16, False),
      ("Kimi decode 64 tok", 64, 2304, 1024, 256, 256, 8, False),
      ("K3-EP8 decode 64 tok", 64, 3584, 3072, 896, 112, 16, False),
  ]
  if a.smoke:  # script check on CPU: tiny shapes, one sample
    SAMPLES[0] = 1
    shapes = [(lab, max(8, tok // 256), d // 8, inter // 8, eg // 16, max(4, el // 16),
               k // 2, pre) for lab, tok, d, inter, eg, el, k, pre in shapes]
  if a.only:
    shapes = [sh for sh in shapes if any(o in sh[0] for o in a.only.split(","))]
  for lab, tok, d, inter, eg, el, k, pre in shapes:
    gs = routing(jax.random.key(tok + el), tok, k, eg, el)
    lab2 = f"{lab} ({int(gs.sum())} rows, {d}->{2 * inter})"
    log("==", lab2)
    bench_gmm(lab2, gs, d, 2 * inter, peak_f, peak_bw, pre_t if pre else dec_t,
              pre_q if pre else dec_q, pre_mgpu if pre else dec_mgpu, a.deadline,
              glu_tilings=pre_glu if pre else (), anchors=not a.no_anchors)
    write_table(peak_f, peak_bw, dev, a.csv)
  for lab, tok, d, inter, eg, el, k, pre in ([] if a.no_mlp else shapes):
    bench_mlp(f"{lab} MLP", tok, d, inter, eg, el, k, peak_bw, a.deadline + 25)
    write_table(peak_f, peak_bw, dev, a.csv)
  print(write_table(peak_f, peak_bw, dev, a.csv), flush=True)


def write_table(peak_f, peak_bw, dev, csv_path=None):
  """Render the table and (re)write it to $OUT/bench_moe.md (and --csv) so a timeout keeps it."""
  out, t = table(peak_f, peak_bw, dev)
  if os.environ.get("OUT"):
    with open(os.path.join(os.environ["OUT"], "bench_moe.md"), "w") as fh:
      fh.write(out)
  if csv_path:
    t.write_csv(csv_path)
  return out


if __name__ == "__main__":
  main()
