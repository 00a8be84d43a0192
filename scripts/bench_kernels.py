"""One table for issue 6: KDA prefill and decode vs flash-linear-attention, MLA paged decode vs
plain jnp, each with its ratio to the anchor and to the copy bandwidth measured in the same run.

  python scripts/bench_kernels.py [--deadline 420] [--prefill "16,4096,32;2,32768,32;..."]

Run on the GPU (FLA wheels on PYTHONPATH; see docs/benchmarks.md). FLA autotunes for 70-100 s at
each new prefill shape on the H200, so the default prefill list (the issue's B*T = 64k shapes)
needs most of a 10-minute device call; pass fewer shapes for a shorter run. `--smoke` runs tiny
shapes in CPU interpret mode (no anchors) to check the script itself.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_kda  # noqa: E402
import bench_mla  # noqa: E402

DECODE = [(64, 32), (256, 32), (64, 96), (256, 96)]
PREFILL = [(16, 4096, 32), (2, 32768, 32), (16, 4096, 96), (2, 32768, 96)]
MLA = [(64, 8192, 32), (16, 131072, 32), (64, 8192, 96), (16, 131072, 96)]


def _shapes(text):
    return [tuple(int(x) for x in sh.split(",")) for sh in text.split(";") if sh]


def _smoke():
    """Tiny shapes through the Pallas kernels in interpret mode (CPU): exercises the script only."""
    import jax.numpy as jnp
    from pallas_kernels import kda
    bench_kda.chunk_kda = functools.partial(kda.chunk_kda, interpret=True)
    bench_kda.fused_recurrent_kda = functools.partial(kda.fused_recurrent_kda, interpret=True)
    make = bench_kda.make_inputs
    bench_kda.make_inputs = lambda key, B, T, H, K=128, V=128: make(key, B, T, H, 32, 32)
    rows = (bench_kda.decode_rows(None, None, [(4, 2)], 1.0, 1e9, K=32, V=32)
            + bench_kda.prefill_rows(None, None, [(1, 64, 2)], 1.0, 1e9)
            + bench_mla.decode_rows([(2, 64, 4)], 1.0, lat=64, rope=16, ps=16, dtype=jnp.float32,
                                    interpret=True, iters=2))
    bench_kda.print_table(bench_kda.TABLE_HEADER, rows)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--deadline", type=float, default=420.0, help="start no case after (s)")
    ap.add_argument("--decode", default=";".join(f"{n},{h}" for n, h in DECODE), help='"N,H;..."')
    ap.add_argument("--prefill", default=";".join(",".join(map(str, s)) for s in PREFILL),
                    help='"B,T,H;..."')
    ap.add_argument("--mla", default=";".join(",".join(map(str, s)) for s in MLA), help='"N,ctx,H;..."')
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    if args.smoke:
        _smoke()
        return
    import jax
    from pallas_kernels.kda import chunk_pallas, recurrent_pallas
    from pallas_kernels.mla import paged
    print(f"# jax {jax.__version__} on {jax.devices()[0].device_kind}, {time.strftime('%Y-%m-%d')}")
    print(f"# KDA chunk CONFIG {chunk_pallas.CONFIG}\n# KDA decode CONFIG {recurrent_pallas.CONFIG}\n"
          f"# MLA decode tuning H=32 {paged.default_tuning(32, True)}, H=96 {paged.default_tuning(96, True)}")
    torch, fla, why = bench_kda._torch_fla()
    if fla is None:
        print(f"# FLA anchor unavailable ({why}): KDA anchor columns n/a")
    bw_jax, bw_torch = bench_kda.copy_bandwidth(torch)
    bw = bw_torch or bw_jax
    print(f"# copy bandwidth (read+write): jax x+1 {bw_jax / 1e12:.2f} TB/s, torch copy_ "
          f"{'n/a' if bw_torch is None else f'{bw_torch / 1e12:.2f}'} TB/s; ratios use {bw / 1e12:.2f}")
    rows = bench_kda.decode_rows(torch, fla, _shapes(args.decode), bw, args.deadline)
    rows += bench_mla.decode_rows(_shapes(args.mla), bw / 1e12)
    rows += bench_kda.prefill_rows(torch, fla, _shapes(args.prefill), bw, args.deadline)
    bench_kda.print_table(bench_kda.TABLE_HEADER, rows)


if __name__ == "__main__":
    main()
