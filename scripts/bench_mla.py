"""Paged MLA decode benchmark: cache TB/s of the Pallas kernel vs the plain-jnp reference.

One GPU run prints one table: N=64 x 8k and N=16 x 128k contexts, H=32 and H=96, L=512,
R=64, bf16, page_size 64, plus a copy bandwidth measured in the same run (the ratio column).
Also checks the kernel against the reference on the GPU (decode and ragged prefill) and
times a few kernel configs. `--smoke` runs tiny shapes on CPU in interpret mode.

Usage: python scripts/bench_mla.py [--smoke] [--budget SECONDS] [--sweep]
  [--configs T-w4,T-w4-st3,...] [--check SPECS] [--shapes 64x8192x32,...] [--no-ref] [--csv PATH]
  [--prefill SPECS]   (spec grammar: see parse_spec)

`--model-prefill` prints instead the MLA prefill table *as the model calls it*: one MLA layer's
`MLA.step` (Kimi-Linear-48B dims, engine-shaped step batch) absorbed vs expanded vs the form
`auto` picks, plus the expanded attention kernel alone over a few tile configs.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pallas_kernels.mla import (mla_decode_reference, mla_paged_decode,  # noqa: E402
                                ragged_paged_mla, ragged_paged_mla_reference)
from tables import Table, add_csv_argument  # noqa: E402  (scripts/tables.py)

T0 = time.time()


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def timeit(f, *args, iters=10, reps=3):
    """Median over reps of the mean time of `iters` back-to-back calls (seconds)."""
    jax.block_until_ready(f(*args))
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(iters):
            out = f(*args)
        jax.block_until_ready(out)
        ts.append((time.perf_counter() - t) / iters)
    return float(np.median(ts))


def copy_bandwidth(nbytes):
    """Read+write TB/s of `a + 1` over an fp32 array of nbytes."""
    a = jnp.ones((nbytes // 4,), jnp.float32)
    f = jax.jit(lambda x: x + 1)
    t = timeit(f, a, iters=10)
    return 2 * nbytes / t / 1e12


def make_cache(key, n_seqs, ctx, heads, lat, rope, page_size, dtype):
    """Random pool with shuffled page ids; every sequence has exactly `ctx` tokens."""
    max_pages = -(-ctx // page_size)
    n_pages = n_seqs * max_pages + 1
    k1, k2, k3, k4 = jax.random.split(key, 4)
    kv = jax.random.normal(k1, (n_pages, page_size, lat + rope), dtype)
    perm = jax.random.permutation(k2, jnp.arange(1, n_pages, dtype=jnp.int32))
    tables = perm.reshape(n_seqs, max_pages)
    ql = jax.random.normal(k3, (n_seqs, heads, lat), dtype)
    qr = jax.random.normal(k4, (n_seqs, heads, rope), dtype)
    lens = jnp.full((n_seqs,), ctx, jnp.int32)
    return ql, qr, kv, tables, lens


def _err(got, want):
    """(max abs error, max abs reference value)."""
    got, want = got.astype(jnp.float32), want.astype(jnp.float32)
    return float(jnp.max(jnp.abs(got - want))), float(jnp.max(jnp.abs(want)))


def prefill_bench(dtype, lat, rope, ps, heads, interpret, configs, iters, n=4, new=1024,
                  ctx=4096):
    """Ragged prefill: n sequences x `new` tokens ending at ctx; useful TFLOP/s."""
    ql, qr, kv, bt, lens = make_cache(jax.random.PRNGKey(3), n, ctx, heads, lat, rope, ps, dtype)
    k1, k2 = jax.random.split(jax.random.PRNGKey(4))
    qlt = jax.random.normal(k1, (n * new, heads, lat), dtype)
    qrt = jax.random.normal(k2, (n * new, heads, rope), dtype)
    cu = jnp.arange(n + 1, dtype=jnp.int32) * new
    keys = n * sum(range(ctx - new + 1, ctx + 1))  # visible keys summed over query tokens
    flops = 2.0 * keys * heads * (lat + rope + lat)
    out = []
    for cname, cfg in configs:
        f = functools.partial(ragged_paged_mla, scale=0.1, interpret=interpret, config=cfg)
        try:
            t = timeit(f, qlt, qrt, kv, bt, cu, lens, iters=iters)
            out.append((cname, t, flops / t / 1e12))
        except Exception as e:  # noqa: BLE001
            log(f"prefill {cname} FAILED: {type(e).__name__}: {str(e)[:400]}")
    return out


def check_gpu(interpret, dtype, lat, rope, heads, config=None):
    """Max |kernel - reference| for decode and a ragged prefill batch (two page sizes)."""
    scale = 192 ** -0.5
    rows = []
    for ps in (64, 16):
        ql, qr, kv, bt, lens = make_cache(jax.random.PRNGKey(ps), 5, 300, heads, lat, rope,
                                          ps, dtype)
        lens = jnp.array([300, 1, 77, 64, 129], jnp.int32)
        want = mla_decode_reference(ql, qr, kv, bt, lens, scale=scale)
        got = mla_paged_decode(ql, qr, kv, bt, lens, scale=scale, interpret=interpret,
                               config=config)
        rows.append((f"decode ps={ps}", _err(got, want)))
        # ragged: 3 prefill chunks resuming after cached prefixes + 2 decodes + padding
        new = np.array([40, 1, 77, 9, 1])
        cu = jnp.asarray(np.concatenate([[0], np.cumsum(new)]), jnp.int32)
        lens2 = jnp.array([300, 1, 77, 64, 129], jnp.int32)
        t = int(new.sum()) + 5
        k = jax.random.PRNGKey(7)
        qlt = jax.random.normal(k, (t, heads, lat), dtype)
        qrt = jax.random.normal(k, (t, heads, rope), dtype)
        want = ragged_paged_mla_reference(qlt, qrt, kv, bt, cu, lens2, scale=scale)
        got = ragged_paged_mla(qlt, qrt, kv, bt, cu, lens2, scale=scale, interpret=interpret,
                               config=config)
        rows.append((f"ragged ps={ps}", _err(got, want)))
    return rows


# Config specs for --configs: tokens joined by "-". T / R = transposed / row form;
# wN num_warps; stN num_stages; bkN key block; rN max rows per tile; xN = N x the picked
# split count; slN = slots (CTAs per wave) for the split choice; hN = only for N heads
# (repeatable). (Run 3's page-id / register prefetch and duplicated-load variants measured
# slower and were removed from the kernel: docs/bench_mla.md.)
DEFAULT_SWEEP = ["T-w4", "T-w4-st3-h32", "T-w4-st1-h32", "T-w4-sl264-h32",
                 "R-w8-r64-h96", "R-w4-h96"]


def parse_spec(spec):
    """'T-w4-st3-h32' -> (knob dict, heads filter tuple); knobs not named keep defaults."""
    knobs, heads = {}, []
    for tok in spec.split("-"):
        for key, name in (("st", "num_stages"), ("bk", "bk"), ("sl", "slots"), ("w", "num_warps"),
                          ("r", "max_rows"), ("x", "split_mult"),
                          ("h", "heads")):
            if tok.startswith(key) and tok[len(key):].isdigit():
                if name == "heads":
                    heads.append(int(tok[1:]))
                else:
                    knobs[name] = int(tok[len(key):])
                break
        else:
            if tok in ("T", "R"):
                knobs["transposed"] = tok == "T"
            else:
                raise ValueError(f"bad config token {tok!r} in {spec!r}")
    return knobs, tuple(heads)


def resolve(knobs, heads, page_size, max_pages, n_seqs):
    """Knob dict -> the hashable config tuple mla_paged_decode takes (split_mult resolved)."""
    if "transposed" not in knobs or "num_warps" not in knobs:
        raise ValueError(f"a config spec names its form (T/R) and warps (wN): {knobs}")
    knobs = {"max_rows": 32, "bk": 64, "num_stages": 2, **knobs}
    mult = knobs.pop("split_mult", None)
    if mult:
        from pallas_kernels.mla.paged import default_tuning, pick_config
        tune = {**default_tuning(heads, True, page_size * max_pages), **knobs}
        base = pick_config(heads, page_size, max_pages, n_seqs, decode=True,
                           **{k: tune[k] for k in ("max_rows", "bk", "slots") if k in tune})
        knobs["splits"] = mult * base["splits"]
    return tuple(sorted(knobs.items()))


# (sequences, new tokens each, context each); the first SWEEP_SHAPES also time the kernel sweep
MODEL_PREFILL_SHAPES = [(2, 2048, 0), (64, 64, 0), (2, 2048, 1024), (64, 64, 1024), (8, 64, 0), (4, 256, 1024)]
SWEEP_SHAPES = 2
EXPANDED_SWEEP = [None, dict(bq=64, bk=64, num_warps=4, num_stages=2), dict(bq=128, bk=64, num_warps=8, num_stages=3),
                  dict(bq=128, bk=128, num_warps=8, num_stages=2), dict(bq=64, bk=64, num_warps=4, num_stages=3),
                  dict(bq=64, bk=128, num_warps=4, num_stages=2),
                  dict(bq=128, bk=64, num_warps=8, num_stages=2, split_causal=False)]  # None: expanded.DEFAULT_TUNING


def _mla_layer(c, dtype, seed=0):
    """Random parameters of one MLA layer of config c (shapes from the model's own param tree)."""
    from k3jax.params import param_shapes
    shapes = param_shapes(c, dtype)["layers"][c.mla_layers[0]]["attn"]
    rng = np.random.default_rng(seed)
    def leaf(s):
        if len(s.shape) == 1:  # norm weights
            return jnp.asarray(1 + 0.1 * rng.standard_normal(s.shape), s.dtype)
        return jnp.asarray(rng.standard_normal(s.shape, np.float32) * s.shape[-2] ** -0.5, s.dtype)
    return jax.tree_util.tree_map(leaf, shapes)


def _step_inputs(c, n, new, ctx, page_size, max_pages, dtype, seed=1):
    """(x [T, D], kv_pages, meta) of an engine step: n sequences of `new` tokens after `ctx` cached
    ones, pages shuffled, block tables as wide as the engine's (max_model_len / page_size)."""
    from k3jax.cache import SeqChunk, make_step_batch
    rng = np.random.default_rng(seed)
    per_seq = -(-(ctx + new) // page_size)
    pages = rng.permutation(np.arange(1, n * per_seq + 1))
    chunks = [SeqChunk(np.zeros(new, np.int32), ctx, pages[i * per_seq:(i + 1) * per_seq], -1, 0)
              for i in range(n)]
    b = make_step_batch(chunks, page_size, num_tokens=n * new, num_seqs=n, max_pages=max_pages)
    kv = jnp.asarray(rng.standard_normal((n * per_seq + 1, page_size, c.mla_cache_dim), np.float32), dtype)
    x = jnp.asarray(rng.standard_normal((n * new, c.hidden_size), np.float32), dtype)
    meta = dict(cu_seqlens=jnp.asarray(b.cu_seqlens), slot_mapping=jnp.asarray(b.slot_mapping),
                block_tables=jnp.asarray(b.block_tables), kv_lens=jnp.asarray(b.kv_lens))
    return x, kv, meta


def _time_step(f, p, x, kv, meta, iters):
    """Median ms of `iters` chained MLA.step calls (pool donated and threaded, as the engine does)."""
    kv = jax.block_until_ready(f(p, x, kv, meta)[1])
    ts = []
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(iters):
            out, kv = f(p, x, kv, meta)
        jax.block_until_ready(out)
        ts.append((time.perf_counter() - t) / iters)
    return float(np.median(ts)) * 1e3, out, kv


def model_prefill_rows(shapes, *, model="kimi-linear-48b-a3b", page_size=16, max_model_len=8192,
                       dtype=jnp.bfloat16, iters=10, interpret=None, sweep=EXPANDED_SWEEP, budget=170.0):
    """One MLA layer's step per shape and form; rows (shape, form, ms, note)."""
    from k3jax.layers import mla
    from k3jax.presets import preset_config
    from pallas_kernels.mla import expanded
    from pallas_kernels.backend import detect
    c = preset_config(model)
    p = _mla_layer(c, dtype)
    H, L, R, DN, DV = c.mla_num_heads, c.kv_lora_rank, c.qk_rope_head_dim, c.qk_nope_head_dim, c.v_head_dim
    rows = []
    for i, (n, new, ctx) in enumerate(shapes):
        if time.time() - T0 > budget:
            log("budget reached, skipping", (n, new, ctx))
            continue
        x, kv, meta = _step_inputs(c, n, new, ctx, page_size, -(-max_model_len // page_size), dtype)
        T, keys = n * new, n * (ctx + new)
        pairs = n * sum(range(ctx + 1, ctx + new + 1))  # (query, visible key) pairs
        label = f"T={T} ({n}x{new}, ctx {ctx})"
        outs = {}
        # expanded: a key buffer just large enough for this step's keys; auto: the model's defaults
        for form, kpt in (("absorbed", None), ("expanded", -(-keys // T)), ("auto", None)):
            default_kpt = mla.EXPANDED_KEYS_PER_TOKEN
            backend = detect(mla_prefill=form)
            mla.EXPANDED_KEYS_PER_TOKEN = kpt or default_kpt
            try:
                f = jax.jit(lambda p_, x_, kv_, m_, b=backend: mla.MLA.of(c, p_).step(
                    x_, c, kv_, {**m_, "decode_only": False}, b), donate_argnums=2)
                ms, outs[form], kv = _time_step(f, p, x, kv, meta, iters)
                budget_keys = mla.expanded_key_budget(T, meta["block_tables"].shape, page_size, False, backend)
                note = (f"key buffer {budget_keys}" + (" (sum kv_lens fits)" if keys <= budget_keys else
                        " (overflow: absorbed fallback)")) if budget_keys else "absorbed"
                rows.append((label, f"mla_step {form}", ms, note))
                log(rows[-1])
            except Exception as e:  # noqa: BLE001 - report and continue
                log(f"{label} {form} FAILED: {type(e).__name__}: {str(e)[:600]}")
            finally:
                mla.EXPANDED_KEYS_PER_TOKEN = default_kpt
        if "absorbed" in outs and "expanded" in outs:
            err, ref = _err(outs["expanded"], outs["absorbed"])
            log(f"{label}: max |expanded - absorbed| = {err:.3e} (max |absorbed| {ref:.2f})")
        # the expanded attention kernel alone, on random K/V laid out as the model lays them out
        ks = jax.random.split(jax.random.PRNGKey(n), 3)
        q = jax.random.normal(ks[0], (T, H, DN + R), dtype)
        kvh = jax.random.normal(ks[1], (keys, H, DN + DV), dtype)
        lat_rows = jax.random.normal(ks[2], (keys, L + R), dtype)
        starts = expanded.key_starts(meta["kv_lens"])
        flops = 2.0 * pairs * H * (DN + R + DV)
        for cfg in sweep if i < SWEEP_SHAPES else sweep[:1]:
            cfg = cfg or expanded.DEFAULT_TUNING
            f = functools.partial(expanded.expanded_attention, nope_dim=DN, scale=0.07, interpret=interpret,
                                  config=tuple(sorted(cfg.items())))
            try:
                t = timeit(f, q, kvh, lat_rows, meta["cu_seqlens"], meta["kv_lens"], starts, iters=iters)
                name = "bq{bq} bk{bk} w{num_warps} st{num_stages}".format(**cfg) + (
                    "" if cfg.get("split_causal", True) else " all-masked")
                rows.append((label, f"expanded kernel {name}", t * 1e3, f"{flops / t / 1e12:.0f} TFLOP/s"))
                log(rows[-1])
            except Exception as e:  # noqa: BLE001
                log(f"{label} kernel {cfg} FAILED: {type(e).__name__}: {str(e)[:600]}")
        absorbed_flops = 2.0 * pairs * H * (L + R + L)
        rows.append((label, "FLOPs per layer", 0.0, f"absorbed {absorbed_flops / 1e9:.0f} G, expanded "
                     f"{flops / 1e9:.0f} G + K/V decompress {2.0 * keys * L * H * (DN + DV) / 1e9:.0f} G"))
        del x, kv, meta, q, kvh, lat_rows
    return rows


def print_model_prefill(rows, device_kind):
    """Prints model_prefill_rows' rows as a table and returns it (a FLOPs row has no time)."""
    table = Table(("step", "step"), ("what", "what"), ("ms", "ms", ".3f"), ("note", "note"))
    print()
    print(f"MLA prefill as the model calls it (one layer's mla_step), {device_kind}, {time.strftime('%Y-%m-%d')}")
    print(table.header())
    for label, what, ms, note in rows:
        print(table.add(step=label, what=what, ms=ms or None, note=note))
    return table


# the decode table: cache bytes read per second, and that over the copy bandwidth measured in the same run
DECODE_TABLE = Table(("shape", "shape"), ("impl", "impl"), ("us", "time (us)", ".0f"),
                     ("cache_tb_s", "cache TB/s", ".2f"), ("of_copy", "/ copy BW", ".2f"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, CPU interpret mode")
    ap.add_argument("--budget", type=float, default=170.0, help="stop sweeping after this")
    ap.add_argument("--sweep", action="store_true", help="also time the --configs list")
    ap.add_argument("--configs", default=",".join(DEFAULT_SWEEP),
                    help="comma-separated config specs for --sweep (see parse_spec)")
    ap.add_argument("--check", default="T-w4,R-w8", help="specs checked vs the reference")
    ap.add_argument("--prefill", default=None,
                    help="comma-separated specs timed on ragged prefill (default: no prefill)")
    ap.add_argument("--shapes", default=None, help="e.g. 64x8192x32,16x131072x96")
    ap.add_argument("--no-ref", action="store_true", help="skip the plain-jnp rows")
    ap.add_argument("--model-prefill", action="store_true",
                    help="only the MLA prefill table as the model calls it (absorbed vs expanded)")
    add_csv_argument(ap)
    args = ap.parse_args()
    if args.model_prefill:
        log("device:", jax.devices()[0].device_kind, "| jax", jax.__version__)
        if args.smoke:
            rows = model_prefill_rows([(2, 24, 0), (3, 8, 20)], model="tiny-random", page_size=8, max_model_len=64,
                                      dtype=jnp.float32, iters=1, interpret=True, sweep=EXPANDED_SWEEP[:1])
        else:
            rows = model_prefill_rows(MODEL_PREFILL_SHAPES, budget=args.budget)
        table = print_model_prefill(rows, jax.devices()[0].device_kind)
        if args.csv:
            table.write_csv(args.csv)
        return
    args.check = [c for c in args.check.split(",") if c]
    args.prefill = None if args.prefill is None else [c for c in args.prefill.split(",") if c]
    sweep = [("default", None)]  # paged.default_tuning
    if args.sweep:  # explicit knobs, so the names mean the same whatever the defaults are
        sweep += [(c, parse_spec(c)) for c in args.configs.split(",") if c]
    dev = jax.devices()[0]
    log("device:", dev.device_kind, "| jax", jax.__version__, "| backend", jax.default_backend())
    interpret = True if args.smoke else None
    if args.smoke:
        lat, rope, ps, dtype = 64, 16, 16, jnp.float32
        shapes = [(4, 64, 4), (2, 200, 8)]
        copy_bytes = 1 << 24
    else:
        lat, rope, ps, dtype = 512, 64, 64, jnp.bfloat16
        shapes = [(64, 8192, 32), (16, 131072, 32), (64, 8192, 96), (16, 131072, 96)]
        copy_bytes = 1 << 30
    if args.shapes:
        shapes = [tuple(int(v) for v in sh.split("x")) for sh in args.shapes.split(",")]

    for cfg in [None] + [parse_spec(c)[0] for c in args.check]:
        cfg = None if cfg is None else resolve(cfg, 32, ps, 8, 5)
        try:
            for name, err in check_gpu(interpret, dtype, lat, rope, 4 if args.smoke else 32,
                                       cfg):
                log(f"check {name} config={cfg}: max abs err vs reference = {err[0]:.3e}"
                    f" (max |ref| {err[1]:.2f})")
        except Exception as e:  # noqa: BLE001
            log(f"check config={cfg} FAILED: {type(e).__name__}: {str(e)[:600]}")

    copy_tbs = copy_bandwidth(copy_bytes)
    log(f"copy bandwidth (fp32 a+1, read+write): {copy_tbs:.2f} TB/s")

    table = DECODE_TABLE
    scale = 192 ** -0.5
    iters = 3 if args.smoke else 10
    caches = {}
    for n, ctx, heads in shapes:  # same cache for both head counts
        if (n, ctx) not in caches:
            caches[(n, ctx)] = make_cache(jax.random.PRNGKey(0), n, ctx, 1, lat, rope, ps,
                                          dtype)[2:]
    ref = jax.jit(functools.partial(mla_decode_reference, scale=scale))

    def run(label, impl, f, ql, qr, kv, bt, lens, nbytes):
        try:
            t = timeit(f, ql, qr, kv, bt, lens, iters=iters)
            table.add(shape=label, impl=impl, us=t * 1e6, cache_tb_s=nbytes / t / 1e12,
                      of_copy=nbytes / t / 1e12 / copy_tbs)
            log(f"{label} {impl}: {t * 1e6:.0f} us {nbytes / t / 1e12:.2f} TB/s")
        except Exception as e:  # noqa: BLE001 - report and continue
            log(f"{label} {impl} FAILED: {type(e).__name__}: {str(e)[:600]}")

    # phase 0: plain jnp and the default kernel config on every shape; then each sweep
    # config over every shape (configs in command-line order: put the important ones first)
    for phase in range(len(sweep)):
        cname, spec = sweep[phase]
        for n, ctx, heads in shapes:
            if spec is not None and spec[1] and heads not in spec[1]:
                continue
            kv, bt, lens = caches[(n, ctx)]
            k1, k2 = jax.random.split(jax.random.PRNGKey(heads))
            ql = jax.random.normal(k1, (n, heads, lat), dtype)
            qr = jax.random.normal(k2, (n, heads, rope), dtype)
            nbytes = n * ctx * (lat + rope) * jnp.dtype(dtype).itemsize
            label = f"N={n} ctx={ctx} H={heads}"
            if phase == 0 and not args.no_ref:
                run(label, "plain jnp", ref, ql, qr, kv, bt, lens, nbytes)
            if phase > 0 and time.time() - T0 > args.budget:
                log("budget reached, skipping", label, cname)
                continue
            cfg = None if spec is None else resolve(spec[0], heads, ps, bt.shape[1], n)
            f = functools.partial(mla_paged_decode, scale=scale, interpret=interpret,
                                  config=cfg)
            run(label, f"pallas {cname}", f, ql, qr, kv, bt, lens, nbytes)

    pre = []
    if args.prefill is not None and time.time() - T0 < args.budget + 10:
        heads = 4 if args.smoke else 32
        shape = dict(n=2, new=8, ctx=20) if args.smoke else dict(n=4, new=1024, ctx=4096)
        pre = prefill_bench(dtype, lat, rope, ps, heads, interpret,
                            [("default", None)] + [(c, resolve(parse_spec(c)[0], heads, ps, 8, 4))
                                                  for c in args.prefill],
                            iters=3, **shape)
        for cname, t, tf in pre:
            log(f"prefill {shape}, H={heads}, {cname}: "
                f"{t * 1e3:.2f} ms {tf:.0f} TFLOP/s")
    print()
    print(f"MLA paged decode, {dev.device_kind}, {time.strftime('%Y-%m-%d')}, "
          f"copy bandwidth {copy_tbs:.2f} TB/s (fp32 a+1, read+write)")
    print(table.markdown())
    if args.csv:
        table.write_csv(args.csv)


if __name__ == "__main__":
    main()
