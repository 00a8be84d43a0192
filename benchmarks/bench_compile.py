"""Cold-start cost of the engine step: trace and compile every warm-up shape with abstract weights.

  python -m benchmarks.bench_compile --model kimi-k3 [--json] [--buckets cpu|accelerator] [--max-shapes N]

Nothing is allocated: parameters and cache pools are ShapeDtypeStructs, each shape is
`jit(step).trace(...)` (seconds to trace) then `.lower().compile()` (seconds to compile). The
shapes are those ModelRunner.warmup compiles for the default EngineArgs (`--buckets` picks the
CPU or the accelerator bucket set; default: this machine's). The persistent compilation cache is
off, so every number is a cold compile.
"""
from __future__ import annotations

import argparse
import json
import time

from benchmarks.harness import header


def measure(model: str, buckets: str | None = None, max_shapes: int | None = None, dtype: str = "bfloat16",
            on_shape=None) -> dict:
    import jax
    import jax.numpy as jnp

    from k3jax.cache import pool_shapes
    from k3jax.layer_stack import stack_layers
    from k3jax.nnx_model import make_step
    from k3jax.params import param_shapes
    from k3jax.presets import preset_config
    from serving.engine_args import EngineArgs, batch_defaults
    from serving.step_shapes import padding_step_args, step_buckets, step_compiler_options, warmup_shapes

    jax.config.update("jax_enable_compilation_cache", False)
    c = preset_config(model)
    dt = jnp.dtype(dtype)
    on_cpu = (buckets or ("cpu" if jax.default_backend() == "cpu" else "accelerator")) == "cpu"
    seqs, tokens = batch_defaults(on_cpu)
    args = EngineArgs(max_num_seqs=seqs, max_num_batched_tokens=tokens)
    max_len = min(args.max_model_len or 8192, c.max_position_embeddings)
    max_pages = -(-max_len // args.page_size)
    tb, sb = step_buckets(args.max_num_seqs, args.max_num_batched_tokens, on_cpu=on_cpu)
    shapes = warmup_shapes(tb, sb)[:max_shapes]
    params = jax.eval_shape(lambda p: stack_layers(p, c), param_shapes(c, dt))   # the runner's layout
    from pallas_kernels.backend import detect
    pools = pool_shapes(c, args.max_num_seqs * max_pages + 1, args.page_size, args.max_num_seqs + 2, dt,
                        bits=detect().pool_bits)                  # as the runner stores them
    step = jax.jit(make_step(c), donate_argnums=(1,), compiler_options=step_compiler_options())  # as the runner
    rows = []
    for T, N, decode, mm in shapes:
        batch, _, _ = padding_step_args(c, args.page_size, max_pages, T, N, decode, mm, dt)
        t0 = time.perf_counter()
        traced = step.trace(params, pools, batch)
        t1 = time.perf_counter()
        traced.lower().compile()
        t2 = time.perf_counter()
        row = {"tokens": T, "seqs": N, "decode_only": decode, "trace_s": round(t1 - t0, 2),
               "compile_s": round(t2 - t1, 2)}
        rows.append(row)
        if on_shape:
            on_shape(row)
    return {"model": model, "layers": c.num_layers, "backend": jax.default_backend(),
            "buckets": "cpu" if on_cpu else "accelerator", "jax": jax.__version__, "shapes": rows,
            "total_s": round(sum(r["trace_s"] + r["compile_s"] for r in rows), 2),
            "shapes_total": len(warmup_shapes(tb, sb))}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-random", help="preset name (tiny-random, kimi-linear-48b-a3b, kimi-k3)")
    ap.add_argument("--buckets", choices=("cpu", "accelerator"), default=None,
                    help="bucket set of the runner on this kind of backend (default: this machine's)")
    ap.add_argument("--max-shapes", type=int, default=None, help="measure only the first N warm-up shapes")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    a = ap.parse_args(argv)
    if not a.json:
        print(header(f"bench_compile: {a.model}, every warm-up shape traced and compiled (abstract weights)"), flush=True)
    show = None if a.json else (lambda r: print(f"T={r['tokens']:5d} N={r['seqs']:3d} decode={int(r['decode_only'])}"
                                                f"  trace {r['trace_s']:7.2f}s  compile {r['compile_s']:7.2f}s",
                                                flush=True))
    res = measure(a.model, a.buckets, a.max_shapes, a.dtype, on_shape=show)
    if a.json:
        print(json.dumps(res))
    else:
        print(f"{res['model']} ({res['layers']} layers, {res['backend']}, "
              f"{res['buckets']} buckets): "
              f"{len(res['shapes'])}/{res['shapes_total']} shapes in {res['total_s']:.1f}s")


if __name__ == "__main__":
    main()
