"""Sweep: the few-row kernels of a one-sequence decode step under tiling variants, as the model calls them.

  python -m benchmarks.sweep_decode_tiles [--model kimi-linear-48b-a3b] [--tokens 1,4] [--reps 5]

Each figure times one program that makes many calls back to back (a scan over a stack's layers, as the
model's scanned block runs), so a few-microsecond kernel is not hidden behind the host's dispatch.

Two tables. Dense: every distinct [K, N] of the model's bf16 weights stacked over scanned layers, one row
@ each layer of a stack of that shape through ops.stacked_matmul (read in place: pallas_kernels/stacked.py)
under its default tiles and variants, beside XLA's dot on each layer's weight as a buffer of its own (the
anchor: no slice copy to pay). Routed experts: ops.expert_mlp on the model's expert shapes at `--tokens`
tokens (random top-k, other experts each call, a 4-layer stack read in place) with the up or the down
kernel's tiles varied one at a time. Figures are the weight bytes a
call reads over its time (TB/s) and the ratio to the default tiles; each variant's output is checked
against the default's.
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.harness import Table, copy_bandwidth, header, rel_err, time_jax
from pallas_kernels import moe as moe_kernels
from pallas_kernels import stacked
from pallas_kernels.moe import schedule as sch

# (bk, bn, warps, stages) at bm 16
DENSE_VARIANTS = ((256, 16, 2, 4), (256, 64, 2, 4), (256, 32, 4, 4), (128, 32, 2, 4), (512, 16, 2, 3),
                  (256, 32, 2, 2), (128, 16, 2, 4))
EXPERT_VARIANTS = ((256, 32, 4, 3), (256, 32, 2, 3), (256, 16, 2, 3), (128, 32, 4, 4), (128, 64, 4, 3),
                   (256, 64, 4, 2), (512, 32, 4, 3), (256, 32, 4, 2))

CPU = jax.default_backend() == "cpu"    # (interpret mode: checks the script, times nothing real)

STACK_BYTES = 256 * 10**6    # a dense stack at least this large (past the 50 MB L2), at most 64 layers


def _tiling(v) -> sch.Tiling:
    bk, bn, w, s = v
    return sch.Tiling(bm=16, bk=bk, bn=bn, num_warps=w, num_stages=s)


def _label(t: sch.Tiling) -> str:
    return f"bk{t.bk} bn{t.bn} w{t.num_warps} s{t.num_stages}"


def dense_shapes(config):
    """{(K, N): count} of the bf16 weights stacked over scanned layers in the model of `config`."""
    from k3jax.params import is_leaf, param_spec
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(param_spec(config, stacked=True), is_leaf=is_leaf)[0]:
        name = jax.tree_util.keystr(path)
        if len(leaf.shape) == 3 and "expert" not in name and "norm" not in name:
            kn = tuple(leaf.shape[1:])
            if kn[0] % 16 == 0 and kn[1] % 16 == 0:
                out[kn] = out.get(kn, 0) + 1
    return out


def _per_call(fn, args, calls: int, reps: int) -> float:
    """Seconds per kernel call of `fn`, a program that makes `calls` of them back to back."""
    return time_jax(fn, *args, reps=reps, samples=3) / calls


def dense_table(shapes, reps: int, bw: float):
    table = Table(("K", "K"), ("N", "N"), ("weights", "weights"), ("variant", "variant"), ("us", "us", ".1f"),
                  ("tb_s", "TB/s", ".2f"), ("of_copy", "of copy", ".0%"), ("ratio", "x default", ".2f"),
                  ("err", "rel err vs default", ".1e"))
    print("\n## dense weights stacked over layers, one row (one program runs the matmul of every layer of a "
          f"stack of >= {STACK_BYTES / 1e6:.0f} MB, as the model's scan does)\n" + table.header(), flush=True)
    key = jax.random.PRNGKey(1)
    for (k, n), count in sorted(shapes.items()):
        nbytes = k * n * 2
        layers = max(4, min(64, -(-STACK_BYTES // nbytes)))
        w = (jax.random.normal(key, (layers, k, n), jnp.float32) * 0.02).astype(jnp.bfloat16)
        x = jax.random.normal(key, (1, k), jnp.bfloat16)
        default = stacked.tiling(1, k, n)
        runs = [("default " + _label(default), default)] + [(_label(_tiling(v)), _tiling(v)) for v in DENSE_VARIANTS
                                                              if _tiling(v) != default and k % v[0] == 0
                                                              and n % v[1] == 0]
        base_t, base_out = None, None
        for label, t in runs:
            def every_layer(x, w, t=t):
                def body(acc, i):
                    y = stacked.stacked_matmul(x, w, i, kernel=True, tiles=t, interpret=CPU)
                    return acc + y.astype(jnp.float32), None
                return jax.lax.scan(body, jnp.zeros((1, n), jnp.float32), jnp.arange(layers))[0]
            fn = jax.jit(every_layer)
            out = fn(x, w)
            s = _per_call(fn, (x, w), layers, reps)
            if base_t is None:
                base_t, base_out = s, out
            print(table.add(K=k, N=n, weights=count, variant=label, us=s * 1e6, tb_s=nbytes / s / 1e12,
                            of_copy=nbytes / s / bw, ratio=base_t / s, err=rel_err(out, base_out)), flush=True)
        own = [w[i] + 0 for i in range(layers)]      # each layer's weight a buffer of its own
        fn = jax.jit(lambda x, own: sum((x @ wi).astype(jnp.float32) for wi in own))
        s = _per_call(fn, (x, own), layers, reps)
        print(table.add(K=k, N=n, weights=count, variant="XLA dot, own buffers (anchor)", us=s * 1e6,
                        tb_s=nbytes / s / 1e12, of_copy=nbytes / s / bw, ratio=base_t / s,
                        err=rel_err(fn(x, own), base_out)), flush=True)
        del w, own


def expert_table(config, tokens: int, reps: int, bw: float, layers: int = 4, calls: int = 16):
    c = config
    E, D, I, k = c.num_experts, c.expert_hidden, c.moe_intermediate_size, c.num_experts_per_token
    key = jax.random.split(jax.random.PRNGKey(2), 5)
    w1, w3 = ((jax.random.normal(kk, (layers, E, D, I), jnp.float32) * 0.02).astype(jnp.bfloat16) for kk in key[:2])
    w2 = (jax.random.normal(key[2], (layers, E, I, D), jnp.float32) * 0.02).astype(jnp.bfloat16)
    x = jax.random.normal(key[3], (tokens, D), jnp.bfloat16)
    rng = np.random.default_rng(0)
    ids = jnp.asarray(np.stack([[rng.choice(E, k, replace=False) for _ in range(tokens)] for _ in range(calls)]),
                      jnp.int32)                                            # [calls, T, k]: other experts each call
    wts = jnp.full((tokens, k), 1.0 / k, jnp.float32)
    touched = np.mean([len(np.unique(np.asarray(ids[r]))) for r in range(calls)])
    nbytes = touched * 3 * D * I * 2
    avg = tokens * k / E
    up0 = sch.choose_tiling(1, D, I, E, fused=True, avg_rows=avg)
    down0 = sch.choose_tiling(1, I, D, E, avg_rows=avg)
    table = Table(("T", "T"), ("experts", "experts"), ("variant", "variant"), ("us", "us", ".1f"),
                  ("tb_s", "TB/s", ".2f"), ("of_copy", "of copy", ".0%"), ("ratio", "x default", ".2f"),
                  ("err", "rel err vs default", ".1e"))
    print(f"\n## routed experts, {tokens} token(s), {touched:.0f} of {E} experts a call, {c.hidden_act} ({calls} "
          f"calls in one program over a {layers}-layer stack read in place)\n" + table.header(), flush=True)
    runs = [(f"default up {_label(up0)} / down {_label(down0)}", (up0, down0))]
    runs += [(f"up {_label(_tiling(v))}", (_tiling(v), down0)) for v in EXPERT_VARIANTS]
    runs += [(f"down {_label(_tiling(v))}", (up0, _tiling(v))) for v in EXPERT_VARIANTS]
    base_t, base_out = None, None
    for label, tiling in runs:
        def every_call(x, ids, w1, w3, w2, tiling=tiling):
            def body(acc, r):
                y = moe_kernels.expert_mlp(x, ids[r], wts, w1, w3, w2, activation=c.hidden_act, tiling=tiling,
                                           interpret=CPU or None, layer=r % layers)
                return acc + y.astype(jnp.float32), None
            return jax.lax.scan(body, jnp.zeros(x.shape, jnp.float32), jnp.arange(calls))[0]
        fn = jax.jit(every_call)
        out = fn(x, ids, w1, w3, w2)
        s = _per_call(fn, (x, ids, w1, w3, w2), calls, reps)
        if base_t is None:
            base_t, base_out = s, out
        print(table.add(T=tokens, experts=touched, variant=label, us=s * 1e6, tb_s=nbytes / s / 1e12,
                        of_copy=nbytes / s / bw, ratio=base_t / s, err=rel_err(out, base_out)), flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="kimi-linear-48b-a3b")
    ap.add_argument("--tokens", default="1,4", help="routed-expert rows: tokens a step, comma-separated")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--only", default="dense,experts")
    a = ap.parse_args(argv)
    from k3jax.presets import preset_config
    c = preset_config(a.model)
    print(header(f"decode tile sweep, {a.model}"), flush=True)
    bw = copy_bandwidth(1.0 if jax.default_backend() == "cpu" else 4.0)[0]
    print(f"# copy {bw / 1e12:.2f} TB/s", flush=True)
    if "dense" in a.only:
        dense_table(dense_shapes(c), a.reps, bw)
    if "experts" in a.only:
        for t in (int(v) for v in a.tokens.split(",")):
            expert_table(c, t, a.reps, bw)


if __name__ == "__main__":
    main()
