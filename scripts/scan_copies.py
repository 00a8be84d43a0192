"""Scanned vs unrolled decoder: step time, scratch memory and the copies XLA put into the step.

  python scripts/scan_copies.py --model kimi-linear-48b-a3b --layers 13           # random weights, timed
  python scripts/scan_copies.py --model kimi-linear-48b-a3b --abstract --variants scan,unrolled
                                                                                   # full depth, compile only

Variants (comma list, --variants):
  unrolled   every layer traced (the checkpoint layout)
  scan       the scanned decoder as the runner runs it (routed experts read in place from their stack,
             16-bit pools stored as floats off CPU, as uint16 bits on CPU: pallas_kernels/scatter.py)
  scan-old   the first scanned decoder: experts sliced per repeat, 16-bit pools stored as uint16 bits
  scan-slice scan, but experts sliced per repeat          scan-bits: scan, but pools stored as bits
  scan-floats scan, but 16-bit pools stored as floats (on CPU: what XLA:CPU converts to f32 per step)
  scan-dsf   scan compiled with XLA's dynamic-slice fusion (--xla_gpu_enable_dynamic_slice_fusion)
Two steps per variant: decode (16 sequences x 1 token after a 1024-token context, the fused decode
path) and prefill (2 fresh sequences x 2048 tokens, T=4096). For each: compile seconds, XLA's scratch
(temp) bytes, the data moves XLA materializes (k3jax.hlo_stats: copies, slices, conversions) of at
least the smallest pool ("pool-sized") and of at least 1 MiB inside the layer loop, the largest ones
named, and (unless --abstract) the median wall time of the step.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

VARIANTS = {  # name: (scanned layout, Backend.experts_in_place, Backend.pool_bits (None: detected), XLA options)
    "unrolled": (False, True, None, {}),
    "scan": (True, True, None, {}),
    "scan-old": (True, False, True, {}),
    "scan-slice": (True, False, None, {}),
    "scan-bits": (True, True, True, {}),
    "scan-floats": (True, True, False, {}),
    "scan-dsf": (True, True, None, {"xla_gpu_enable_dynamic_slice_fusion": True}),
}


def step_batches(page_size: int, context: int = 1024, decode_seqs: int = 16, prefill=(2, 2048)):
    """{name: StepBatch}: a decode step (decode_seqs sequences, one token each after `context`) and a
    prefill step (prefill[0] fresh sequences of prefill[1] tokens), on distinct pages and slots."""
    from k3jax.cache import SeqChunk, make_step_batch
    pages_per = -(-(context + 1) // page_size)
    dec = [SeqChunk([1], context, list(range(1 + i * pages_per, 1 + (i + 1) * pages_per)), 1 + i, 1 + i)
           for i in range(decode_seqs)]
    n, L = prefill
    pp = -(-L // page_size)
    pre = [SeqChunk([1] * L, 0, list(range(1 + i * pp, 1 + (i + 1) * pp)), -1, 1 + i) for i in range(n)]
    max_pages = max(pages_per, pp)
    return {"decode": make_step_batch(dec, page_size, num_seqs=decode_seqs, max_pages=max_pages),
            "prefill": make_step_batch(pre, page_size, num_tokens=n * L, num_seqs=max(4, n), max_pages=max_pages)}


def run(model: str, layers: int | None, variants, abstract: bool, num_pages: int, num_slots: int,
        iters: int = 10, dump: str | None = None, on_row=None) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from k3jax import hlo_stats
    from k3jax.cache import pool_shapes, make_pools
    from k3jax.layer_stack import layer_stack_plan, stack_layers, unstack_layers
    from k3jax.params import param_shapes
    from k3jax.presets import preset_config
    from pallas_kernels.backend import detect
    from serving.runner import make_step_fn

    jax.config.update("jax_enable_compilation_cache", False)
    name = model
    if layers:
        from bench_e2e import truncated_preset
        name = truncated_preset(model, layers)
    c = preset_config(name)
    page_size = 16
    abstract_pools = pool_shapes(c, num_pages, page_size, num_slots, jnp.bfloat16)
    pool_min = min(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree_util.tree_leaves(abstract_pools))
    t0 = time.perf_counter()
    if abstract:
        stacked = jax.eval_shape(lambda p: stack_layers(p, c), param_shapes(c, jnp.bfloat16))
    else:
        from k3jax.api import load_model
        stacked = load_model(name, dtype="bfloat16", seed=0).params
        jax.block_until_ready(stacked)
    load_s = time.perf_counter() - t0
    batches = step_batches(page_size)
    rows = []
    for v in variants:
        scanned, in_place, bits, opts = VARIANTS[v]
        backend = detect().replace(experts_in_place=in_place)
        if bits is not None:
            backend = backend.replace(pool_bits=bits)
        params = stacked if scanned else (jax.eval_shape(lambda p: unstack_layers(p, c), stacked) if abstract
                                          else unstack_layers(stacked, c))
        step = jax.jit(make_step_fn(c, backend), donate_argnums=(1,))
        for kind, batch in batches.items():
            row = {"variant": v, "step": kind}
            try:
                t = time.perf_counter()
                pools_in = pool_shapes(c, num_pages, page_size, num_slots, jnp.bfloat16, bits=backend.pool_bits)
                compiled = step.lower(params, pools_in, batch).compile(compiler_options=opts or None)
                row["compile_s"] = round(time.perf_counter() - t, 1)
            except Exception as e:  # noqa: BLE001 - e.g. an XLA option this build does not know
                row["error"] = str(e).splitlines()[0][:160]
                rows.append(row)
                on_row and on_row(row)
                continue
            ma = compiled.memory_analysis()
            row["temp_mib"] = round((ma.temp_size_in_bytes if ma else 0) / 2**20, 1)
            text = compiled.as_text()
            big = hlo_stats.data_moves(text, pool_min)
            loop = [b for b in hlo_stats.data_moves(text, 1 << 20) if b.in_loop]
            row["pool_sized_moves"] = len(big)
            row["pool_sized_mib"] = round(sum(b.nbytes for b in big) / 2**20, 1)
            row["loop_moves"] = len(loop)
            row["loop_moves_mib"] = round(sum(b.nbytes for b in loop) / 2**20, 1)
            row["largest"] = [f"{b.op} {b.shape} {b.nbytes / 2**20:.0f}MiB {b.op_name[-70:]}" for b in (big or loop)[:4]]
            if dump:
                os.makedirs(dump, exist_ok=True)
                with gzip.open(os.path.join(dump, f"{name}_{v}_{kind}.hlo.gz"), "wt") as f:
                    f.write(text)
            if not abstract:
                pools = make_pools(c, num_pages, page_size, num_slots, jnp.bfloat16, bits=backend.pool_bits)
                for _ in range(2):
                    _, pools = compiled(params, pools, batch)
                jax.block_until_ready(pools)
                times = []
                for _ in range(iters):
                    t = time.perf_counter()
                    logits, pools = compiled(params, pools, batch)
                    jax.block_until_ready(logits)
                    times.append(time.perf_counter() - t)
                row["step_ms"] = round(statistics.median(times) * 1e3, 2)
                del pools
            rows.append(row)
            on_row and on_row(row)
        del params         # the unrolled copy of the stacked layers goes with its last reference
    plan = layer_stack_plan(c)
    return {"model": name, "layers": c.num_layers, "scanned_layers": plan.unit * plan.repeats,
            "device": jax.devices()[0].device_kind, "jax": jax.__version__,
            "abstract": abstract, "load_s": round(load_s, 1), "num_pages": num_pages, "num_slots": num_slots,
            "smallest_pool_mib": round(pool_min / 2**20, 1), "rows": rows}


def _print_row(r):
    if "error" in r:
        print(f"| {r['variant']} | {r['step']} | error: {r['error']} |", flush=True)
        return
    print(f"| {r['variant']} | {r['step']} | {r.get('step_ms', '-')} | {r['compile_s']} | {r['temp_mib']} | "
          f"{r['pool_sized_moves']} ({r['pool_sized_mib']} MiB) | {r['loop_moves']} ({r['loop_moves_mib']} MiB) | "
          f"{'; '.join(r['largest'])} |", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="kimi-linear-48b-a3b")
    ap.add_argument("--layers", type=int, default=None, help="keep the first N layers (same pattern; Kimi Linear "
                    "scans from 9: layer 0 + at least two (KDA, KDA, KDA, MLA) units)")
    ap.add_argument("--variants", default="unrolled,scan-old,scan-slice,scan-bits,scan,scan-dsf")
    ap.add_argument("--abstract", action="store_true", help="compile only, abstract weights (nothing allocated)")
    ap.add_argument("--num-pages", type=int, default=16385)
    ap.add_argument("--num-slots", type=int, default=66)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--dump", default=None, help="directory for the optimized HLO of every variant (gzip)")
    ap.add_argument("--json", default=None, help="also write the result as JSON to this file")
    a = ap.parse_args(argv)
    variants = a.variants.split(",")
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        ap.error(f"unknown variants {sorted(unknown)}; known: {', '.join(VARIANTS)}")
    print("| variant | step | ms | compile s | temp MiB | pool-sized moves | moves >= 1 MiB in the layer loop | "
          "largest |\n|---|---|---|---|---|---|---|---|", flush=True)
    res = run(a.model, a.layers, variants, a.abstract, a.num_pages, a.num_slots, a.iters, a.dump, on_row=_print_row)
    print(f"{res['model']} ({res['layers']} layers, {res['scanned_layers']} in the scan) on {res['device']}, jax {res['jax']}; weights "
          f"{'abstract' if a.abstract else 'loaded in %.1fs' % res['load_s']}; pools {a.num_pages} pages, "
          f"{a.num_slots} slots (smallest pool {res['smallest_pool_mib']} MiB)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f)


if __name__ == "__main__":
    main()
