"""Sweep the KDA decode kernel's choices (pallas_kernels/kda/recurrent_pallas.py) on the GPU.

  python scripts/sweep_kda_decode.py [--budget 200]   # GPU (FLA wheels on PYTHONPATH for the anchor)
  python scripts/sweep_kda_decode.py --smoke          # tiny shapes, CPU interpret mode

Stage 1 screens every variant at N=256 H=32; stage 2 runs the fastest few (plus the first version
and the current CONFIG) at N=64,256 x H=32,96 next to FLA's fused_recurrent_kda. Each variant is
checked on the GPU against decode_reference with a shuffled slot map holding padding (-1) rows:
max abs error of o and of the pool, and whether the slots nobody names stayed bit-identical.
Times: "call" is bench_kda's metric (median of back-to-back jitted calls, pool donated);
"loop" runs 10 steps in one jit (lax.fori_loop over the pool), i.e. without dispatch cost.
Traffic = 2*N*H*K*V*4 bytes (state read + write).
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_kda  # noqa: E402  (puts the repo root on sys.path)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402

from pallas_kernels.kda import recurrent_pallas as rp  # noqa: E402
from pallas_kernels.kda.reference import decode_reference  # noqa: E402

FIRST = dict(block_v=32, num_warps=4, order="nhv")  # the kernel as first written
VARIANTS = [
    FIRST,
    dict(FIRST, block_v=128, num_warps=8),
    dict(order="vhn", block_v=32, num_warps=4),
    dict(order="vhn", block_v=32, num_warps=4, num_stages=2),
    dict(order="vhn", block_v=32, num_warps=2),
    dict(order="vhn", block_v=32, num_warps=1),
    dict(order="vhn", block_v=32, num_warps=8),
    dict(order="vhn", block_v=16, num_warps=1),
    dict(order="vhn", block_v=16, num_warps=2),
    dict(order="vhn", block_v=16, num_warps=4),
    dict(order="vhn", block_v=64, num_warps=2),
    dict(order="vhn", block_v=64, num_warps=4),
    dict(order="vhn", block_v=64, num_warps=8),
    dict(order="vhn", block_v=128, num_warps=4),
    dict(order="vhn", block_v=128, num_warps=8),
    dict(order="vhn", block_v=32, num_warps=4, block_h=2),
    dict(order="vhn", block_v=32, num_warps=4, block_h=4),
    dict(order="vhn", block_v=64, num_warps=4, block_h=2),
    dict(order="hvn", block_v=32, num_warps=4),
    dict(order="vnh", block_v=32, num_warps=4),
]
CASES = [(64, 32), (256, 32), (64, 96), (256, 96)]
SCREEN = (256, 32)
T0 = time.time()


def label(cfg):
    c = dict(dict(num_stages=1, block_h=1), **cfg)
    s = f"{c['order']} bv{c['block_v']} w{c['num_warps']}"
    s += f" st{c['num_stages']}" * (c["num_stages"] != 1) + f" bh{c['block_h']}" * (c["block_h"] != 1)
    return s


def inputs(N, H, K, V):
    q, k, v, g, beta = (x[0] for x in bench_kda.make_inputs(jax.random.PRNGKey(1), 1, N, H, K, V))
    return q, k, v, g, beta, jnp.zeros((H,), jnp.float32), jnp.zeros((H, K), jnp.float32)


def build(cfg, K, interpret):
    kw = dict(scale=K ** -0.5, interpret=interpret, backend="triton", **cfg)
    kern = functools.partial(rp.fused_recurrent_kda_pallas, **kw)
    step = jax.jit(lambda q, k, v, g, b, p, i, a, dt: kern(q, k, v, g, b, p, i, a, dt),
                   donate_argnums=5)

    def steps(q, k, v, g, b, p, i, a, dt, n=10):
        return lax.fori_loop(0, n, lambda _, p: kern(q, k, v, g, b, p, i, a, dt)[1], p)
    return step, jax.jit(steps, donate_argnums=5)


def check(step, N, H, K, V, ins, ref):
    """Shuffled slots, two padding rows: (max|do|, max|dP|, untouched slots bit-identical)."""
    q, k, v, g, beta, a, dt = ins
    idx = jnp.roll(jnp.arange(N, dtype=jnp.int32), 3).at[jnp.array([1, 5])].set(-1)
    pool = jax.random.normal(jax.random.PRNGKey(2), (N, H, K, V), jnp.float32)
    before = pool + 0.0  # device copy: `pool` is donated
    o, P = step(q, k, v, g, beta, pool, idx, a, dt)
    o2, P2 = ref(q, k, v, g, beta, before, idx)
    free = jnp.array([(1 - 3) % N, (5 - 3) % N])
    same = bool(jnp.array_equal(P[free], before[free]))
    err_o = float(jnp.max(jnp.abs(o.astype(jnp.float32) - o2.astype(jnp.float32))))
    return err_o, float(jnp.max(jnp.abs(P - P2))), same


def timed(step, N, H, K, V, ins, reps, loop=None):
    q, k, v, g, beta, a, dt = ins
    idx = jnp.arange(N, dtype=jnp.int32)
    st = {"p": jnp.zeros((N, H, K, V), jnp.float32)}

    def run():
        st["p"] = step(q, k, v, g, beta, st["p"], idx, a, dt)[1]
        return st["p"]
    t = bench_kda.time_jax(run, reps=reps)
    tl = None
    if loop is not None:
        def run_loop():
            st["p"] = loop(q, k, v, g, beta, st["p"], idx, a, dt)
            return st["p"]
        tl = bench_kda.time_jax(run_loop, reps=max(1, reps // 5)) / 10
    return t, tl


def fla_time(torch, fla, N, H, reps):
    tq = bench_kda.torch_inputs(torch, N, 1, H)
    h0 = torch.zeros(N, H, 128, 128, dtype=torch.float32, device="cuda")
    return bench_kda.time_torch(torch, lambda: fla[1](*tq, initial_state=h0,
                                                      output_final_state=True), reps=reps)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--budget", type=float, default=200.0, help="seconds for the whole run")
    ap.add_argument("--top", type=int, default=5, help="variants kept for stage 2")
    ap.add_argument("--json", default=os.path.join(os.environ.get("OUT", "/tmp"), "sweep_kda.json"))
    args = ap.parse_args()
    if args.smoke:
        jax.config.update("jax_platforms", "cpu")
        K = V = 32
        cases, screen, variants, reps = [(4, 2), (8, 4)], (8, 4), VARIANTS[:4] + VARIANTS[-4:], 1
        torch = fla = None
        bw = None
    else:
        K = V = 128
        cases, screen, variants, reps = CASES, SCREEN, VARIANTS, 20
        torch, fla, why = bench_kda._torch_fla()
        print(f"# FLA anchor: {'yes' if fla else why}")
        bw_jax, bw = bench_kda.copy_bandwidth(torch, gib=2.0)
        bw = bw or bw_jax
        print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}, copy BW {bw/1e12:.2f} TB/s "
              f"(jax x+1: {bw_jax/1e12:.2f}), CONFIG {rp.CONFIG}", flush=True)
    interpret = args.smoke
    cur = {kk: vv for kk, vv in rp.CONFIG.items()}
    if cur not in variants:
        variants = [cur] + variants
    ref = jax.jit(functools.partial(decode_reference, scale=K ** -0.5))
    ins_of = {}
    results = []  # dicts: variant, N, H, us, loop_us, err_o, err_P, same

    def measure(cfg, N, H, loop):
        if (N, H) not in ins_of:
            ins_of[(N, H)] = inputs(N, H, K, V)
        ins = ins_of[(N, H)]
        r = dict(variant=label(cfg), cfg=cfg, N=N, H=H)
        try:
            step, steps = build(cfg, K, interpret)
            r["err_o"], r["err_P"], r["same"] = check(step, N, H, K, V, ins, ref)
            t, tl = timed(step, N, H, K, V, ins, reps, steps if loop else None)
            r["us"], r["loop_us"] = t * 1e6, (tl * 1e6 if tl else None)
        except Exception as e:  # noqa: BLE001 - one bad variant must not end the sweep
            r["error"] = f"{type(e).__name__}: {e}"[:300]
        results.append(r)
        nb = 2 * N * H * K * V * 4
        if "error" in r:
            print(f"  {r['variant']:<26} N={N} H={H}: FAILED {r['error']}", flush=True)
        else:
            lp = f" loop {r['loop_us']:.0f} us" if r["loop_us"] else ""
            print(f"  {r['variant']:<26} N={N} H={H}: {r['us']:.0f} us {nb/r['us']/1e6:.2f} TB/s"
                  f"{lp} err o {r['err_o']:.1e} P {r['err_P']:.1e} untouched={r['same']} "
                  f"[{time.time()-T0:.0f}s]", flush=True)
        return r

    def ok(r):
        return "error" not in r and r["same"] and r["err_P"] < 1e-3 and r["err_o"] < 5e-2

    print(f"# stage 1: {len(variants)} variants at N={screen[0]} H={screen[1]}", flush=True)
    s1 = []
    for cfg in variants:
        if time.time() - T0 > 0.45 * args.budget:
            print("  (stage 1 stopped: budget)")
            break
        s1.append(measure(cfg, *screen, loop=False))
    good = sorted((r for r in s1 if ok(r)), key=lambda r: r["us"])
    keep = [r["cfg"] for r in good[:args.top]]
    for must in (FIRST, cur):
        if must not in keep:
            keep.append(must)
    print(f"# stage 2: {[label(c) for c in keep]}", flush=True)
    anchors = {}
    rows = []
    for N, H in cases:
        if fla is not None and time.time() - T0 < 0.9 * args.budget:
            try:
                anchors[(N, H)] = fla_time(torch, fla, N, H, reps) * 1e6
                print(f"  FLA N={N} H={H}: {anchors[(N, H)]:.0f} us", flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"  FLA N={N} H={H}: FAILED {type(e).__name__}: {e}"[:200], flush=True)
        for cfg in keep:
            if time.time() - T0 > 0.9 * args.budget:
                rows.append((label(cfg), N, H, "skipped (budget)", "", "", "", "", ""))
                continue
            r = measure(cfg, N, H, loop=True)
            if "error" in r:
                rows.append((label(cfg), N, H, "FAILED", "", "", "", "", ""))
                continue
            nb = 2 * N * H * K * V * 4
            fa = anchors.get((N, H))
            rows.append((label(cfg), N, H, f"{r['us']:.0f}",
                         f"{r['loop_us']:.0f}" if r["loop_us"] else "",
                         f"{nb / r['us'] / 1e6:.2f}",
                         f"{nb / r['us'] / 1e6 / (bw / 1e12):.0%}" if bw else "",
                         f"{fa / r['us']:.2f}x" if fa else "n/a",
                         f"o {r['err_o']:.0e} P {r['err_P']:.0e} {'same' if r['same'] else 'CHANGED'}"))
    bench_kda.print_table(("variant", "N", "H", "call us", "loop us", "TB/s", "% copy",
                           "FLA/ours", "max err, untouched"), rows)
    print("FLA us: " + ", ".join(f"N={n} H={h}: {t:.0f}" for (n, h), t in anchors.items()))
    with open(args.json, "w") as f:
        json.dump(dict(bw=bw, fla=[[n, h, t] for (n, h), t in anchors.items()],
                       results=results), f, indent=1, default=str)
    print(f"# done in {time.time() - T0:.0f}s; json {args.json}")


if __name__ == "__main__":
    main()
