"""Dense matmuls of the scanned layer stack as a decode step makes them (prints tables).

  python scripts/bench_dense_in_place.py [--model kimi-linear-48b-a3b] [--rows 16,64,256] [--csv PATH]

For each weight that a scanned unit uses only as `x @ w` (k3jax.layers.module.right_operand_mask), a
`lax.scan` over the model's repeats runs x @ w[r] three ways: "slice" (w[r] sliced out of the stack:
a copy on GPU, then XLA's dot; the scan without pallas_kernels/stacked.py), "in place" (the grouped
kernel reading w[r] in the stack) and "separate" (one array per layer, the loop unrolled: the layout
before the scan, an anchor). Rows per weight and for the whole unit, with the weight bytes' rate next
to the copy bandwidth measured in the same run.
"""
from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_e2e import copy_bandwidth  # noqa: E402
from bench_moe import time_fn  # noqa: E402
from tables import Table  # noqa: E402

from k3jax.layer_stack import stack_layers  # noqa: E402
from k3jax.layers.module import right_operand_mask, split_module  # noqa: E402
from k3jax.model import K3Model, _hold  # noqa: E402
from k3jax.params import param_shapes  # noqa: E402
from k3jax.presets import preset_config  # noqa: E402
from pallas_kernels import stacked  # noqa: E402


def held_weights(model: str):
    """[(name, (R, K, N))] of the scanned units' in-place weights (unit position in the name)."""
    c = preset_config(model)
    shapes = jax.eval_shape(lambda p: stack_layers(p, c), param_shapes(c, jnp.bfloat16))
    out = []
    for j, u in enumerate(K3Model(c, shapes).layers.units):
        _, held = _hold(split_module(u)[1], right_operand_mask(u))
        out += [(f"{j}{jax.tree_util.keystr(k)}", v.shape) for k, v in jax.tree_util.tree_leaves_with_path(held)]
    return out


def scanned(ws, x, kernel: bool, tiles=None):
    """Every weight of `ws` ([R, K, N] each) applied to x in each of R scan iterations."""
    interpret = jax.default_backend() == "cpu"       # (a smoke run here; the numbers are the GPU's)

    def body(carry, r):
        return carry, [stacked.stacked_matmul(x, w, r, kernel=kernel, interpret=interpret, tiles=tiles) for w in ws]
    return jax.lax.scan(body, 0, jnp.arange(ws[0].shape[0], dtype=jnp.int32))[1]


def unrolled(layers, x):
    return [[x @ w for w in ws] for ws in layers]


def sweep(weights, stacks, rows, rng):
    """In-place tiles around the default (bn, bk, warps) per distinct weight shape of >= 1 MB, first two row counts."""
    import dataclasses
    table = Table(("rows", "rows"), ("shape", "[R, K, N]"), ("tiles", "tiles"), ("us", "in place us", ",.1f"),
                  ("default", "default tiles"))
    print("\n" + table.header())
    seen = set()
    for name, shape in weights:
        if shape in seen or np.prod(shape[1:]) * 2 < 1 << 20:
            continue
        seen.add(shape)
        for m in rows[:2]:
            x = jnp.asarray(rng.standard_normal((m, shape[1]), np.float32), jnp.bfloat16)
            base = stacked.tiling(m, shape[1], shape[2])
            for bn in (16, 32, 64):
                for bk, st, wp in ((128, 4, 4), (256, 4, 4), (256, 4, 2)):
                    t = dataclasses.replace(base, bn=bn, bk=bk, num_stages=st, num_warps=wp)
                    if shape[2] % bn or shape[1] % bk:
                        continue
                    fn = jax.jit(lambda ws, x, t=t: scanned(ws, x, True, tiles=t))
                    try:
                        us = time_fn(fn, [stacks[name]], x) * 1e6
                    except Exception as e:  # noqa: BLE001 - a tile that does not fit must not end the run
                        print(f"| {m} | {shape} | {t} | failed: {type(e).__name__} | |")
                        continue
                    print(table.add(rows=m, shape=str(tuple(shape)),
                                    tiles=f"bm{t.bm} bk{t.bk} bn{t.bn} w{t.num_warps} s{t.num_stages}", us=us,
                                    default="yes" if t == base else ""), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="kimi-linear-48b-a3b")
    ap.add_argument("--rows", default="16,64,256")
    ap.add_argument("--csv", default=None)
    ap.add_argument("--sweep", action="store_true", help="also time other in-place tiles per distinct weight shape")
    args = ap.parse_args()
    dev = jax.devices()[0]
    bw = copy_bandwidth(4.0 if dev.platform == "gpu" else 1 / 64)
    everything = held_weights(args.model)
    count = {}                                  # one row per distinct shape, counted in the unit's total
    for name, shape in everything:
        count[shape] = count.get(shape, 0) + 1
    weights = [next((n, s) for n, s in everything if s == shape) for shape in count]
    rng = np.random.default_rng(0)
    stacks = {name: jnp.asarray(rng.standard_normal(shape, np.float32) * 0.02, jnp.bfloat16)
              for name, shape in weights}
    table = Table(("rows", "rows"), ("weight", "weight"), ("shape", "[R, K, N]"), ("count", "per unit"),
                  ("tiles", "in-place tiles"),
                  ("slice_us", "slice us", ",.1f"), ("in_place_us", "in place us", ",.1f"),
                  ("separate_us", "separate us", ",.1f"), ("in_place_tbs", "in place TB/s", ".2f"),
                  ("speedup", "slice / in place", ".2f"), ("rel_err", "rel err", ".1e"))
    print(f"# bench_dense_in_place  {args.model}  {dev.device_kind}  copy bandwidth {bw / 1e12:.2f} TB/s")
    print(table.header())
    slice_fn = jax.jit(lambda ws, x: scanned(ws, x, False))
    place_fn = jax.jit(lambda ws, x: scanned(ws, x, True))
    sep_fn = jax.jit(unrolled)
    for m in (int(r) for r in args.rows.split(",")):
        x = jnp.asarray(rng.standard_normal((m, weights[0][1][1]), np.float32), jnp.bfloat16)
        tot = dict(slice_us=0.0, in_place_us=0.0, separate_us=0.0, nbytes=0)
        for name, shape in weights:
            w = stacks[name]
            xk = x if shape[1] == x.shape[1] else jnp.asarray(rng.standard_normal((m, shape[1]), np.float32),
                                                                jnp.bfloat16)
            layers = [[w[r]] for r in range(shape[0])]
            t_s = time_fn(slice_fn, [w], xk) * 1e6
            t_p = time_fn(place_fn, [w], xk) * 1e6
            t_u = time_fn(sep_fn, layers, xk) * 1e6
            got, want = np.asarray(place_fn([w], xk)[0], np.float32), np.asarray(slice_fn([w], xk)[0], np.float32)
            err = float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))
            nbytes = w.size * w.dtype.itemsize
            t = stacked.tiling(m, shape[1], shape[2]) if stacked.fits(xk, w) else None
            print(table.add(rows=m, weight=name, shape=str(tuple(shape)), count=count[shape],
                            tiles=f"bm{t.bm} bk{t.bk} bn{t.bn} w{t.num_warps} s{t.num_stages}" if t else "slice",
                            slice_us=t_s, in_place_us=t_p, separate_us=t_u, in_place_tbs=nbytes / t_p / 1e6,
                            speedup=t_s / t_p, rel_err=err), flush=True)
            for k, v in (("slice_us", t_s), ("in_place_us", t_p), ("separate_us", t_u), ("nbytes", nbytes)):
                tot[k] += v * count[shape]
        print(table.add(rows=m, weight="all (one step's scanned dense matmuls)", shape="", count=len(everything),
                        tiles="",
                        slice_us=tot["slice_us"], in_place_us=tot["in_place_us"], separate_us=tot["separate_us"],
                        in_place_tbs=tot["nbytes"] / tot["in_place_us"] / 1e6,
                        speedup=tot["slice_us"] / tot["in_place_us"], rel_err=None), flush=True)
    if args.sweep:
        sweep(weights, stacks, [int(r) for r in args.rows.split(",")], rng)
    if args.csv:
        table.write_csv(args.csv)


if __name__ == "__main__":
    main()
