"""Dense matmuls of the scanned layer stack as a decode step makes them (prints a table).

  python scripts/bench_dense_in_place.py [--model kimi-linear-48b-a3b] [--rows 16,32,64] [--csv PATH]

Every weight that the scanned units use only as `x @ w` (k3jax.layers.module.right_operand_mask) is
applied in each iteration of one `lax.scan` over the model's repeats, as in the step and compiled with
the step's XLA options (serving.runner.step_compiler_options): "slice" (w[r] sliced out of the stack:
a copy on GPU, then XLA's dot; the scan without pallas_kernels/stacked.py), "in place" (the grouped
kernel reading w[r] in the stack, with stacked.tiling's tiles and a few others) and "separate" (one
array per layer, the loop unrolled: the layout before the scan, an anchor). The weight bytes' rate is
printed next to the copy bandwidth measured in the same run.
"""
from __future__ import annotations

import argparse
import dataclasses
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
from pallas_kernels.moe import schedule as sch  # noqa: E402
from serving.runner import step_compiler_options  # noqa: E402

# in-place tile variants: name -> (m, k, n) -> Tiling (None: stacked.tiling, the default)
def _variant(**kw):
    def tiles(m, k, n):
        t = stacked.tiling(m, k, n)
        return dataclasses.replace(t, **{key: f(t, k, n) for key, f in kw.items()})
    return tiles


VARIANTS = {
    "default": None,
    "bn16": _variant(bn=lambda t, k, n: sch.pow2_divisor(n, 16)),
    "bn64 bk128": _variant(bn=lambda t, k, n: sch.pow2_divisor(n, 64), bk=lambda t, k, n: sch.pow2_divisor(k, 128)),
    "2x warps": _variant(num_warps=lambda t, k, n: 2 * t.num_warps),
    "3 stages": _variant(num_stages=lambda t, k, n: 3),
}


def held_weights(model: str):
    """[(name, (R, K, N))] of the scanned units' in-place weights (unit position in the name)."""
    c = preset_config(model)
    shapes = jax.eval_shape(lambda p: stack_layers(p, c), param_shapes(c, jnp.bfloat16))
    out = []
    for j, u in enumerate(K3Model(c, shapes).layers.units):
        _, held = _hold(split_module(u)[1], right_operand_mask(u))
        out += [(f"{j}{jax.tree_util.keystr(k)}", v.shape) for k, v in jax.tree_util.tree_leaves_with_path(held)]
    return out


def scanned(ws, xs, kernel: bool, tiles=None):
    """Every weight of `ws` ([R, K, N] each) applied to xs[K] in each of R scan iterations."""
    interpret = jax.default_backend() == "cpu"       # (a smoke run here; the numbers are the GPU's)

    def body(carry, r):
        return carry, [stacked.stacked_matmul(xs[w.shape[1]], w, r, kernel=kernel, interpret=interpret,
                                              tiles=tiles and tiles(xs[w.shape[1]].shape[0], *w.shape[1:]))
                       for w in ws]
    return jax.lax.scan(body, 0, jnp.arange(ws[0].shape[0], dtype=jnp.int32))[1]


def unrolled(layers, xs):
    """The same products from one array per layer (outputs stacked as the scan's)."""
    outs = [[xs[w.shape[0]] @ w for w in ws] for ws in layers]
    return [jnp.stack([o[i] for o in outs]) for i in range(len(outs[0]))]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="kimi-linear-48b-a3b")
    ap.add_argument("--rows", default="16,32,64")
    ap.add_argument("--csv", default=None)
    args = ap.parse_args()
    dev = jax.devices()[0]
    bw = copy_bandwidth(4.0 if dev.platform == "gpu" else 1 / 64)
    weights = held_weights(args.model)
    rng = np.random.default_rng(0)
    ws = [jnp.asarray(rng.standard_normal(shape, np.float32) * 0.02, jnp.bfloat16) for _, shape in weights]
    layers = [[w[r] for w in ws] for r in range(ws[0].shape[0])]
    nbytes = sum(w.size * w.dtype.itemsize for w in ws)
    opts = step_compiler_options()
    table = Table(("rows", "rows"), ("path", "path"), ("us", "us per step", ",.1f"),
                  ("tbs", "weight TB/s", ".2f"), ("of_copy", "of copy", ".0%"), ("vs_slice", "slice / this", ".2f"),
                  ("rel_err", "rel err vs slice", ".1e"))
    print(f"# bench_dense_in_place  {args.model}  {dev.device_kind}  {len(weights)} weights x {ws[0].shape[0]} "
          f"repeats, {nbytes / 2**30:.2f} GiB; copy bandwidth {bw / 1e12:.2f} TB/s")
    print(table.header())
    for m in (int(r) for r in args.rows.split(",")):
        xs = {k: jnp.asarray(rng.standard_normal((m, k), np.float32), jnp.bfloat16) for k in {w.shape[1] for w in ws}}
        runs = [("slice", jax.jit(lambda ws, xs: scanned(ws, xs, False), compiler_options=opts), ws)]
        runs += [(f"in place {name}", jax.jit(lambda ws, xs, t=t: scanned(ws, xs, True, t), compiler_options=opts), ws)
                 for name, t in VARIANTS.items()]
        runs.append(("separate (unrolled)", jax.jit(unrolled, compiler_options=opts), layers))
        base, ref = None, None
        for name, fn, arg in runs:
            try:
                t = time_fn(fn, arg, xs)
                out = fn(arg, xs)
            except Exception as e:  # noqa: BLE001 - a variant that fails must not end the run
                print(f"| {m} | {name} | failed: {type(e).__name__}: {str(e)[:120]} | | | | |", flush=True)
                continue
            flat = np.concatenate([np.asarray(o, np.float32).ravel() for o in jax.tree_util.tree_leaves(out)])
            if name == "slice":
                base, ref = t, flat
            err = float(np.abs(flat - ref).max() / max(np.abs(ref).max(), 1e-30)) if ref is not None else None
            print(table.add(rows=m, path=name, us=t * 1e6, tbs=nbytes / t / 1e12, of_copy=nbytes / t / bw,
                            vs_slice=base / t if base else None, rel_err=err), flush=True)
    if args.csv:
        table.write_csv(args.csv)


if __name__ == "__main__":
    main()
