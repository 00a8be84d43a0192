"""Sweep: the Triton paged MLA decode kernel on an FP8 cache (packed rows, pallas_kernels/mla/fp8_cache.py)
under tuning variants, next to the bf16 cache under its default tuning, at the kernel table's FP8 shapes.

  python -m benchmarks.sweep_mla_fp8 [--shapes 64x8192x32,16x131072x32,64x8192x96,16x131072x96]
                                     [--variants default,T-w4,T-w8,R-w4,R-w8,...] [--page-size 64] [--reps 20]

A variant is `default` (paged.default_tuning, as the engine runs it) or a config spec
(benchmarks/kernel_inputs.parse_mla_spec: T/R form, wN warps, stN stages, bkN keys a block, rN rows a tile;
C here: fp8_scale="codes", every latent value dequantized before the MMAs, else the scales multiply the scores;
L1 / L2: the codes loaded once / once per MMA (fp8_reload), else the kernel's choice by form).
`x bf16 bytes/s`: the FP8 row's bytes read per second over the bf16 default's (target >= 0.9); every FP8 row's
output is checked against the jnp reference on the same FP8 pages (rel err).
"""
from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp

from benchmarks.harness import Table, header, rel_err, time_jax
from benchmarks.kernel_inputs import mla_cache, parse_mla_spec, resolve_mla_config

VARIANTS = ("default", "T-w4", "T-w4-L1", "T-w4-C", "T-w8", "T-w4-x2", "T-w4-st3", "T-w4-bk32", "R-w4", "R-w8",
            "R-w8-L1", "R-w8-C", "R-w8-st3", "R-w8-bk32", "R-w8-r64", "R-w8-r64-C")


def _config(spec, heads, page_size, max_pages, n_seqs):
    if spec == "default":
        return None
    toks = spec.split("-")
    knobs, _ = parse_mla_spec("-".join(t for t in toks if t not in ("C", "L1", "L2")))
    config = resolve_mla_config(knobs, heads, page_size, max_pages, n_seqs)
    config += (("fp8_scale", "codes" if "C" in toks else "scores"),)
    if "L1" in toks or "L2" in toks:
        config += (("fp8_reload", "L2" in toks),)
    return tuple(sorted(config))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="64x8192x32,16x131072x32,64x8192x96,16x131072x96",
                    help="N x context x heads, comma-separated")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--lat", type=int, default=512)
    ap.add_argument("--rope", type=int, default=64)
    a = ap.parse_args(argv)
    from pallas_kernels.mla import fp8_cache, mla_decode_reference, mla_paged_decode

    lat, rope, ps = a.lat, a.rope, a.page_size
    widths = {"bf16": (lat + rope) * 2, "fp8": fp8_cache.packed_bytes(lat, rope)}
    print(header("MLA decode on an FP8 cache: tuning sweep (Triton kernel)"), flush=True)
    table = Table(("case", "case"), ("pages", "pages"), ("variant", "variant"), ("us", "us", ".1f"),
                  ("tb_s", "TB/s", ".2f"), ("ratio", "x bf16 bytes/s", ".2f"), ("err", "rel err", ".1e"))
    print(table.header(), flush=True)
    scale = 192 ** -0.5
    for shape in a.shapes.split(","):
        n, ctx, heads = map(int, shape.split("x"))
        case = f"N={n} ctx={ctx} H={heads} page {ps}"
        ql, qr, kv, bt, lens = mla_cache(jax.random.PRNGKey(7), n, ctx, heads, lat, rope, ps, jnp.bfloat16)
        fp8 = jax.jit(fp8_cache.quantize, static_argnums=1)(kv, lat)
        max_pages = bt.shape[1]
        t = time_jax(functools.partial(mla_paged_decode, scale=scale), ql, qr, kv, bt, lens, reps=a.reps, samples=3)
        bf16_tb_s = n * ctx * widths["bf16"] / t / 1e12
        print(table.add(case=case, pages="bf16", variant="default", us=t * 1e6, tb_s=bf16_tb_s), flush=True)
        del kv
        want = mla_decode_reference(ql, qr, fp8, bt, lens, scale=scale)
        for spec in a.variants.split(","):
            f = functools.partial(mla_paged_decode, scale=scale,
                                  config=_config(spec, heads, ps, max_pages, n))
            try:
                t = time_jax(f, ql, qr, fp8, bt, lens, reps=a.reps, samples=3)
                err = rel_err(f(ql, qr, fp8, bt, lens), want)
            except Exception as e:  # a variant that does not compile (shared memory, registers) is a row
                print(f"| {case} | fp8 | {spec} | failed: {type(e).__name__}: {str(e)[:120]} |", flush=True)
                continue
            tb_s = n * ctx * widths["fp8"] / t / 1e12
            print(table.add(case=case, pages="fp8", variant=spec, us=t * 1e6, tb_s=tb_s, ratio=tb_s / bf16_tb_s,
                            err=err), flush=True)
        del fp8, want


if __name__ == "__main__":
    main()
