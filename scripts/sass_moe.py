"""Offline SASS of the MoE kernels' main loops (no GPU): Pallas TTIR lowered on this host, compiled
for sm_90 by Python Triton (`pip install triton`; jaxlib's XLA embeds its own Triton, so this is a
proxy for what runs on the H200).

  python scripts/sass_moe.py --decode    # MXFP4 decode kernels: instructions per packed byte
  python scripts/sass_moe.py --prefill   # prefill kernels: MMA shapes and wgmma waits per K step

Per kernel: registers, the longest loop's instruction count and top opcodes; --prefill also lists
the loop's wgmma ops (HGMMA shape) and its `WARPGROUP.DEPBAR.LE gsb0, N` waits: N = 0 drains the
tensor cores inside the loop, N > 0 keeps MMAs in flight across it.

The TTIR passes run (the dot-add combine among them): triton.compile skips the passes of the stage
an IR file enters at, so the IR goes in one stage earlier (an empty "src" stage). Without them
every `acc + dot(a, b, 0)` shows an FADD per accumulator element that XLA's Triton pipeline folds.
"""
from __future__ import annotations

import argparse
import collections
import functools
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pallas_kernels.moe import grouped as gm  # noqa: E402
from pallas_kernels.moe import kernel as kn  # noqa: E402
from pallas_kernels.moe import mxfp4 as mxm  # noqa: E402
from pallas_kernels.moe.schedule import Tiling  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_moe_prefill import tname  # noqa: E402

S = jax.ShapeDtypeStruct
ACT = functools.partial(kn.glu_activation, activation="situ")


def triton_ir(f, *args):
  """Triton IR text of the (one) Pallas kernel that jax.jit(f)(*args) lowers for CUDA, on any
  host (uses jax internals: a dev tool, not a library path)."""
  from jax._src.pallas.triton import pallas_call_registration as pcr
  got, orig = [], pcr.lowering.lower_jaxpr_to_triton_module

  def grab(*a, **kw):
    r = orig(*a, **kw)
    got.append(getattr(r, "module", r))
    return r

  pcr.lowering.lower_jaxpr_to_triton_module = grab
  try:
    jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
  finally:
    pcr.lowering.lower_jaxpr_to_triton_module = orig
  return got[-1].operation.get_asm(enable_debug_info=False)


def compile_sm90(ir_text: str, t: Tiling) -> dict:
  """{'regs', 'smem' (bytes the launch asks), 'sass'} of the TTIR compiled with the TTIR passes."""
  import triton
  from triton.backends.compiler import GPUTarget
  from triton.compiler import compiler as tc
  bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
  orig = tc.make_backend

  def make_backend(target):  # an empty first stage, so the file enters before "ttir"
    backend = orig(target)
    add = backend.add_stages

    def add_stages(stages, *a, **kw):
      stages["src"] = lambda module, metadata: module
      add(stages, *a, **kw)

    backend.add_stages = add_stages
    return backend

  with tempfile.TemporaryDirectory() as d:
    path = os.path.join(d, "k.src")
    with open(path, "w") as fh:
      fh.write(ir_text)
    tc.make_backend = make_backend
    try:
      ck = triton.compile(path, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=t.num_warps, num_stages=t.num_stages))
    finally:
      tc.make_backend = orig
    with open(os.path.join(d, "k.cubin"), "wb") as fh:
      fh.write(ck.asm["cubin"])
    run = lambda *a: subprocess.run([os.path.join(bin_dir, "cuobjdump"), *a, os.path.join(d, "k.cubin")],
                                    capture_output=True, text=True).stdout
    regs = re.search(r"REG:(\d+)", run("--dump-resource-usage"))
    return dict(regs=regs and int(regs.group(1)), smem=ck.metadata.shared, sass=run("-sass"))


def main_loop(sass: str) -> list[str]:
  """Instructions of the longest backward-branch loop in cuobjdump -sass text."""
  ins = [(int(m.group(1), 16), m.group(2).strip())
         for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*?)\s*;", sass)]
  best = []
  for a, txt in ins:
    m = re.search(r"BRA\s+(0x[0-9a-f]+)", txt)
    if m and int(m.group(1), 16) < a:
      loop = [t for b, t in ins if int(m.group(1), 16) <= b <= a]
      best = loop if len(loop) > len(best) else best
  return best


def opcode(ins: str) -> str:
  return (ins.split()[1] if ins.startswith("@") else ins.split()[0]).split(".")[0]


def decode_report():
  """MXFP4 decode kernels at Kimi decode 256 tokens (2048 rows, 2304 -> 2048, 256 experts)."""
  m, k, n, g = 2048, 2304, 2048, 256
  x, gs = S((m, k), jnp.bfloat16), S((g,), jnp.int32)
  q = lambda rows: (S((g, rows, k // 2), jnp.uint8), S((g, rows, k // 32), jnp.uint8))
  variants = [  # (label, fn, weight arrays, packed bytes per K step, tiling)
      ("plain", lambda t: lambda x, gs, *w: gm.run_mxfp4(x, w, gs, tiling=t, mode="kernel"), q(n), 1,
       Tiling(16, 256, 64, 2, 3, True)),
      ("fused gate+up", lambda t: lambda x, gs, *w: gm.run_mxfp4(x, w, gs, tiling=t, mode="kernel", act=ACT),
       q(n // 2) * 2, 2, Tiling(16, 256, 64, 2, 3, True)),
      ("merged gate/up", lambda t: lambda x, gs, *w: gm.run_mxfp4(x, w, gs, tiling=t, mode="kernel", act=ACT),
       q(n), 2, Tiling(16, 256, 32, 2, 3, True)),
      ("merged gate/up", lambda t: lambda x, gs, *w: gm.run_mxfp4(x, w, gs, tiling=t, mode="kernel", act=ACT),
       q(n), 2, Tiling(16, 256, 64, 2, 3, True)),
      ("plain, joined", lambda t: lambda x, gs, *w: gm.run_mxfp4(x, w, gs, tiling=t, mode="kernel"), q(n), 1,
       Tiling(16, 256, 64, 2, 3, True, joined=True)),
  ]
  print(f"MXFP4 decode kernels, M={m} K={k} N={n} G={g}, decoder {mxm.DECODER}")
  print("| kernel | tiles | regs | loop instr | instr / packed B | top ops |")
  print("|---|---|---|---|---|---|")
  for label, make, ws, rows_mult, t in variants:
    r = compile_sm90(triton_ir(make(t), x, gs, *ws), t)
    loop = main_loop(r["sass"])
    ops = collections.Counter(opcode(i) for i in loop)
    per_thread = rows_mult * t.bn * t.bk // 2 / (32 * t.num_warps)  # packed bytes per K step
    top = ", ".join(f"{o} {c}" for o, c in ops.most_common(6))
    print(f"| {label} | {tname(t)} | {r['regs']} | {len(loop)} | {len(loop) / per_thread:.2f} | {top} |",
          flush=True)


def prefill_report():
  """Prefill kernels at K3-EP8 32k tokens (65536 rows, 3584 -> 3072x2 -> 3584, 112 experts)."""
  m, d, i, g = 65536, 3584, 3072, 112
  x, tok, gs = S((m, d), jnp.bfloat16), S((m,), jnp.int32), S((g,), jnp.int32)
  q = lambda rows, kk: (S((g, rows, kk // 2), jnp.uint8), S((g, rows, kk // 32), jnp.uint8))
  bf = lambda *sh: S(sh, jnp.bfloat16)
  upq = lambda out: lambda t: lambda x, tok, gs, *w: gm.run_mxfp4(
      x, w, gs, tiling=t, act=ACT, mode="kernel", row_index=tok, x_halves=True, zero_tail=False,
      out_halves=out)
  up16 = lambda t: lambda x, tok, gs, *w: gm.run_bf16(x, w, gs, tiling=t, act=ACT, row_index=tok,
                                                      zero_tail=False)
  downq = lambda t: lambda h, gs, *w: gm.run_mxfp4(h, w, gs, tiling=t, mode="kernel", x_halves=True,
                                                   zero_tail=False)
  J = functools.partial(Tiling, joined=True)
  variants = [
      ("bf16 up, two weights", up16, (x, tok, gs, bf(g, d, i), bf(g, d, i)), Tiling(128, 64, 128, 8, 4)),
      ("bf16 up, merged", up16, (x, tok, gs, bf(g, d, 2 * i)), Tiling(128, 64, 128, 8, 3)),
      ("mxfp4 up, two weights", upq(True), (x, tok, gs, *q(i, d), *q(i, d)), Tiling(128, 128, 128, 8, 3, True)),
      ("mxfp4 up, merged", upq(False), (x, tok, gs, *q(2 * i, d)), Tiling(256, 128, 64, 8, 3, True, True)),
      ("mxfp4 up, merged", upq(True), (x, tok, gs, *q(2 * i, d)), J(256, 128, 64, 8, 3, True, True)),
      ("mxfp4 up, two weights", upq(True), (x, tok, gs, *q(i, d), *q(i, d)), J(128, 128, 128, 8, 3, True)),
      ("mxfp4 down", downq, (bf(m, i), gs, *q(d, i)), Tiling(128, 64, 128, 8, 3)),
      ("mxfp4 down", downq, (bf(m, i), gs, *q(d, i)), J(256, 128, 128, 8, 3, True, True)),
  ]
  print(f"Prefill kernels, K3-EP8 shape (M={m}, D={d}, I={i}, G={g}), decoder {mxm.DECODER}")
  print("| kernel | tiles | regs | smem KB | loop instr | MMAs per loop | wgmma waits in the loop | top ops |")
  print("|---|---|---|---|---|---|---|---|")
  for label, make, args, t in variants:
    r = compile_sm90(triton_ir(make(t), *args), t)
    loop = main_loop(r["sass"])
    ops = collections.Counter(opcode(ins) for ins in loop)
    mmas = collections.Counter(ins.split()[0].split(".")[1] for ins in loop if ins.startswith("HGMMA"))
    waits = collections.Counter(re.search(r"gsb0, (0x[0-9a-f]+)", ins).group(1) for ins in loop
                                if "WARPGROUP.DEPBAR" in ins)
    top = ", ".join(f"{o} {c}" for o, c in ops.most_common(5))
    print(f"| {label} | {tname(t)} | {r['regs']} | {r['smem'] // 1024} | {len(loop)} | "
          f"{', '.join(f'{c} x {s}' for s, c in mmas.items())} | "
          f"{', '.join(f'{c} x wait({int(w, 16)})' for w, c in sorted(waits.items()))} | {top} |", flush=True)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--decode", action="store_true")
  ap.add_argument("--prefill", action="store_true")
  a = ap.parse_args(argv)
  if a.decode or not a.prefill:
    decode_report()
  if a.prefill:
    prefill_report()


if __name__ == "__main__":
  main()
