"""Which routed-experts call faults on the GPU: K3's MXFP4 experts read in place from a stack over layers.

  python scripts/check_moe_inplace_gpu.py            # H200: each variant in its own process (a fault
  python scripts/check_moe_inplace_gpu.py --tiny     #   poisons the CUDA context), CUDA_LAUNCH_BLOCKING=1

Variants: layout merged (w13) or two weights (w1, w3) x experts one layer's or a 2-layer stack read at
layer 1 x routing from the MoE's router or random top-k; 4096 tokens (the engine's largest default
step). Each prints ok with its error against the dense reference, or the fault's first line.
"""
from __future__ import annotations

import argparse
import itertools
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))


def one(merged: bool, stacked: bool, router: bool, tiny: bool, tokens: int) -> str:
    import jax
    import jax.numpy as jnp
    import check_moe_layer_gpu as layer_check
    from bench_moe_prefill import rel_err
    from k3jax.layers.module import value
    from k3jax.layers.moe import MoE, RoutedExperts
    from k3jax.params import moe_spec, random_values
    from pallas_kernels.backend import detect
    c = layer_check.case_config("kimi-k3", 112, tiny)
    spec = moe_spec(c, merged_experts=merged)
    key = jax.random.key(0)
    values = random_values({k: v for k, v in spec.items() if k != "experts"}, key)
    values["experts"] = random_values(spec["experts"], jax.random.fold_in(key, 1), lead=(2,) if stacked else ())
    layer = jnp.int32(1) if stacked else None
    one_layer = jax.tree_util.tree_map(lambda a: a[1], values["experts"]) if stacked else values["experts"]
    x = jax.random.normal(jax.random.fold_in(key, 2), (tokens, c.hidden_size), jnp.bfloat16)
    if router:
        def inputs(v, x):
            m = MoE(spec, v, c)
            w, ids = m.route(x, c)
            return (x @ value(m.latent_down) if m.latent else x), w, ids
        z, w, ids = jax.jit(inputs)(values, x)
    else:
        z = jax.random.normal(jax.random.fold_in(key, 3), (tokens, c.expert_hidden), jnp.bfloat16)
        w, ids = jax.lax.top_k(jax.random.uniform(jax.random.fold_in(key, 4), (tokens, c.num_experts)),
                               c.num_experts_per_token)
    backend = detect("pallas")
    out = jax.jit(lambda pe, z, w, ids, layer: RoutedExperts(spec["experts"], pe, c)(z, w, ids, c, layer, backend))(
        values["experts"], z, w, ids, layer)
    out.block_until_ready()
    n = min(tokens, layer_check.REF_TOKENS)
    plain = jax.tree_util.tree_map(lambda a: a, one_layer)
    if merged:            # the dense reference takes w1 / w3
        from k3jax.expert_layout import split_experts
        plain = split_experts(plain)
    ref = jax.jit(lambda pe, z, w, ids: layer_check.dense_reference(pe, z, w, ids, c))(plain, z[:n], w[:n], ids[:n])
    return f"ok, rel err {rel_err(out[:n], ref):.1e}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--tokens", type=int, default=None)
    ap.add_argument("--variants", default=None, help="e.g. 111,101: merged, stacked, router as 0/1 (default: all 8)")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    tokens = args.tokens or (64 if args.tiny else 4096)
    if args.one:
        merged, stacked, router = (v == "1" for v in args.one.split(","))
        print(one(merged, stacked, router, args.tiny, tokens), flush=True)
        return
    env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1", PYTHONUNBUFFERED="1")
    print("| layout | experts | routing | result |\n|---|---|---|---|", flush=True)
    variants = ([tuple(ch == "1" for ch in v) for v in args.variants.split(",")] if args.variants else
                list(itertools.product((True, False), (True, False), (True, False))))
    for merged, stacked, router in variants:
        cmd = [sys.executable, __file__, "--one", f"{int(merged)},{int(stacked)},{int(router)}",
               "--tokens", str(tokens)] + (["--tiny"] if args.tiny else [])
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
            lines = [ln for ln in (p.stdout + p.stderr).splitlines() if ln.startswith("ok") or "Error" in ln]
            result = lines[0][:160] if lines else f"exit {p.returncode}: {(p.stdout + p.stderr)[-160:]!r}"
        except subprocess.TimeoutExpired:
            result = "timeout (120 s)"
        print(f"| {'merged w13' if merged else 'w1, w3'} | {'stack, layer 1 in place' if stacked else 'one layer'} "
              f"| {'router' if router else 'random top-k'} | {result} |", flush=True)


if __name__ == "__main__":
    main()
