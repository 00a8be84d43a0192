"""bench_kernels' mla_mosaic section: the Mosaic GPU MLA decode kernel (decode-only steps with >= 64 heads on
Hopper) next to the Triton kernel, isolated and as MLA.step's decode-only steps call ops.mla_ragged_paged, with
its tiling sweep (the source of mosaic_gpu.TUNED) and check rows against the reference.

On a GPU the kernel's first run is a child process (`python -m benchmarks.kernels_mla_mosaic` prints the check
errors as JSON) so that a kernel that faults or hangs turns its rows into "not run" rows instead of ending the
run. Every function takes bench_kernels' Run (sizes, anchors, budget, the table) and adds rows to it.
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.harness import ROOT, time_jax
from benchmarks.kernel_inputs import mla_cache
from benchmarks.kernels_mla import MLA_FLOP, mla_row

# Mosaic kernel tilings (mosaic_gpu.MosaicTiling) timed as the model's decode-only steps call the kernel
# (ragged_decode_mosaic on the engine's padded bucket) at every 64+-head model case: the default is bk 32,
# 3 stages (the most that fit next to the 64-row query tile); bk 16 leaves room for deeper rings; splits x2
# and x1/2 test the split-K plan. The fastest per (padded heads, page size, long context) goes into
# mosaic_gpu.TUNED.
MOSAIC_SWEEP = [(16, 4), (16, 6), (32, 2)]
MOSAIC_CHECK_TOL = 2e-2   # rel err of the check rows from which a kernel is wrong (bf16 output: ~3e-3)


def _mosaic_dims(run):
    """(L, R): the Mosaic kernel needs L % 128 == 0 and (L + R) % 64 == 0, so --tiny runs it at 128 / 64."""
    return (128, 64) if run.tiny else (run.lat, run.rope)


def mla_mosaic_errors(kernels, interpret, lat, rope, page_sizes=(16, 64)):
    """{variant: max |kernel - reference| / max |reference|} at a small bf16 shape: K3's 96 heads, ragged
    lengths incl. 1 and a padding sequence, up to 10 blocks a sequence. kernels: "mosaic", "mosaic bkB stS" (a
    MOSAIC_SWEEP tiling) and / or "triton (default)"."""
    from pallas_kernels.mla import mla_decode_reference, mla_paged_decode
    from pallas_kernels.mla.mosaic_gpu import MosaicTiling, mla_paged_decode_mosaic
    fns = {"mosaic": mla_paged_decode_mosaic, "triton (default)": mla_paged_decode}
    for bk, st in MOSAIC_SWEEP:
        t = MosaicTiling(bk, st)
        fns[f"mosaic {t.label()}"] = functools.partial(mla_paged_decode_mosaic, config=t)
    n_lens = [70, 1, 33, 0] if interpret else [300, 1, 77, 0, 129]
    errs = {}
    for ps in page_sizes:
        ql, qr, kv, bt, _ = mla_cache(jax.random.PRNGKey(5), len(n_lens), max(n_lens), 96, lat, rope,
                                                 ps, jnp.bfloat16)
        lens = jnp.asarray(n_lens, jnp.int32)
        want = np.asarray(mla_decode_reference(ql, qr, kv, bt, lens, scale=192 ** -0.5), np.float32)
        for name in kernels:
            try:
                got = np.asarray(fns[name](ql, qr, kv, bt, lens, scale=192 ** -0.5, interpret=interpret),
                                 np.float32)
                errs[f"{name}, bf16, page {ps}"] = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
            except Exception:  # noqa: BLE001  (a swept tiling that fails: its rows are skipped, not the run)
                if name == kernels[0]:
                    raise
                errs[f"{name}, bf16, page {ps}"] = float("nan")
    return errs


def _mosaic_probe(timeout=100):
    """The Mosaic kernel's first run on this GPU, in a child process with a timeout: a kernel that does
    not compile, faults or hangs (a barrier never completing) turns the section's Mosaic rows into
    'not run' rows instead of killing the run. Returns (errors, None) or (None, why). The child allocates
    on demand: this process already holds XLA's preallocated share of the GPU."""
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    try:
        done = subprocess.run([sys.executable, "-m", "benchmarks.kernels_mla_mosaic"], cwd=ROOT, capture_output=True,
                              text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return None, f"probe timed out after {timeout} s (hang?)"
    lines = done.stdout.strip().splitlines()
    if done.returncode or not lines:
        err = done.stderr.strip().splitlines() or ["no output"]
        named = [x for x in err if "Error" in x.split(":")[0] or "Exception" in x.split(":")[0]]
        return None, f"probe rc {done.returncode}: {(named or err)[-1][:160]}"
    return json.loads(lines[-1]), None


def mla_mosaic_check(run):
    """Check rows: the Mosaic kernel (in a child process on a GPU, see _mosaic_probe) and the Triton kernel
    against the reference on the same inputs. Sets run.mosaic_off when the Mosaic kernel failed."""
    lat, rope = _mosaic_dims(run)
    run.mosaic_off = None
    if run.tiny:
        errs = mla_mosaic_errors(["mosaic"], run.interpret, lat, rope)
    else:
        errs, run.mosaic_off = _mosaic_probe()
        if run.mosaic_off:
            run.skip("MLA decode", "small shapes vs reference", "check", "mosaic", run.mosaic_off)
            errs = {}
    t = run.timed("MLA decode", "small shapes vs reference", "check", "triton (default)",
                  lambda: mla_mosaic_errors(["triton (default)"], run.interpret, lat, rope))
    for variant, e in sorted({**errs, **(t or {})}.items()):
        run.add(kernel="MLA decode", case="small shapes vs reference", call="check", variant=variant,
                target=f"rel err {e:.1e}" + ("" if e <= MOSAIC_CHECK_TOL else " WRONG"))
    # swept tilings that failed or missed the check (rel err NaN or > tol): their timed rows are skipped
    run.mosaic_bad = {v.split(",")[0] for v, e in errs.items() if not e <= MOSAIC_CHECK_TOL}


def _mosaic_sweep(heads, max_keys, n_seqs, n_live):
    """[(label, MosaicTiling)]: MOSAIC_SWEEP's tilings, then the default tiling with x2 and x1/2 the splits a
    step of n_live live sequences in the n_seqs bucket uses (plan's grid, plan_live's share of it)."""
    from pallas_kernels.mla.mosaic_gpu import DEFAULT_TILING, MosaicTiling, plan, plan_live
    heads_padded, grid = plan(heads, max_keys, n_seqs, DEFAULT_TILING.bk)
    splits = int(plan_live(n_live, heads_padded, grid, DEFAULT_TILING)[0])
    tilings = [MosaicTiling(bk, st) for bk, st in MOSAIC_SWEEP]
    tilings += [MosaicTiling(splits=s) for s in sorted({2 * splits, max(1, splits // 2)} - {splits})]
    return [(f"mosaic {t.label()}" + (f" (plan: {splits})" if t.splits else ""), t) for t in tilings]


def mla_mosaic_rows(run, shapes, model_cases):
    """The same shapes timed on the Triton kernel and the Mosaic kernel: isolated
    (page 64) and as MLA.step's decode-only steps call ops.mla_ragged_paged (backend mla_decode auto vs
    mosaic, the engine's bucket padding)."""
    from pallas_kernels import ops
    from pallas_kernels.mla import mla_paged_decode, mosaic_gpu
    from pallas_kernels.mla.mosaic_gpu import mla_paged_decode_mosaic
    lat, rope = _mosaic_dims(run)
    flop = MLA_FLOP(lat, rope)
    for n, ctx, heads, page_size in shapes:
        case = f"N={n} ctx={ctx} H={heads} page {page_size}"
        kv, bt, lens = mla_cache(jax.random.PRNGKey(0), n, ctx, 1, lat, rope, page_size, jnp.bfloat16)[2:]
        k1, k2 = jax.random.split(jax.random.PRNGKey(heads))
        args = (jax.random.normal(k1, (n, heads, lat), jnp.bfloat16),
                jax.random.normal(k2, (n, heads, rope), jnp.bfloat16), kv, bt, lens)
        kernels = [("triton (default)", mla_paged_decode, None), ("mosaic", mla_paged_decode_mosaic, None)]
        for label, fn, cfg in kernels:
            if fn is mla_paged_decode_mosaic and run.mosaic_off:
                run.skip("MLA decode", case, "isolated", label, run.mosaic_off)
                continue
            f = functools.partial(fn, scale=192 ** -0.5, interpret=run.interpret, **({"config": cfg} if cfg else {}))
            t = run.timed("MLA decode", case, "isolated", label,
                          lambda f=f: time_jax(f, *args, reps=run.reps, samples=3))
            if t is not None:
                mla_row(run, case, "isolated", label, t, n * ctx * (lat + rope) * 2, float(n) * ctx * heads * flop,
                         heads)
        del kv, bt, lens, args
    for model, n_real, n_bucket, ctx, heads, page_size in model_cases:
        case = f"N={n_real} of bucket {n_bucket} ctx={ctx} H={heads} page {page_size}"
        kv, bt, lens = mla_cache(jax.random.PRNGKey(0), n_real, ctx, 1, lat, rope, page_size,
                                            jnp.bfloat16)[2:]
        pad = n_bucket - n_real
        bt, lens = jnp.pad(bt, ((0, pad), (0, 0))), jnp.pad(lens, (0, pad))
        cu = jnp.asarray(np.concatenate([np.arange(n_real + 1), np.full(pad, n_real)]), jnp.int32)
        k1, k2 = jax.random.split(jax.random.PRNGKey(heads))
        ql = jax.random.normal(k1, (n_bucket, heads, lat), jnp.bfloat16)
        qr = jax.random.normal(k2, (n_bucket, heads, rope), jnp.bfloat16)
        for kernel in ("auto", "mosaic"):
            variant = f"decode_only=True, mla_decode={kernel}"
            if kernel == "mosaic" and run.mosaic_off:
                run.skip("MLA decode", case, f"as model: {model}", variant, run.mosaic_off)
                continue
            f = jax.jit(functools.partial(ops.mla_ragged_paged, scale=192 ** -0.5, decode_only=True,
                                          backend=run.backend.replace(mla_decode=kernel)))
            t = run.timed("MLA decode", case, f"as model: {model}", variant,
                          lambda f=f: time_jax(f, ql, qr, kv, bt, cu, lens, reps=run.reps, samples=3))
            if t is not None:
                mla_row(run, case, f"as model: {model}", variant, t, n_real * ctx * (lat + rope) * 2,
                         float(n_real) * ctx * heads * flop, heads)
        sweep = [] if run.mosaic_off or heads < mosaic_gpu.MIN_HEADS else \
            _mosaic_sweep(heads, bt.shape[1] * page_size, n_bucket, n_real)
        for label, cfg in sweep:  # the decode-only dispatch's own call, with the tiling given
            variant = f"decode_only=True, {label}"
            if label in getattr(run, "mosaic_bad", ()):
                run.skip("MLA decode", case, f"as model: {model}", variant, "failed the check")
                continue
            f = jax.jit(functools.partial(mosaic_gpu.ragged_decode_mosaic, scale=192 ** -0.5,
                                          interpret=bool(run.interpret), config=cfg))
            t = run.timed("MLA decode", case, f"as model: {model}", variant,
                          lambda f=f: time_jax(f, ql, qr, kv, bt, cu, lens, reps=run.reps, samples=3))
            if t is not None:
                mla_row(run, case, f"as model: {model}", variant, t, n_real * ctx * (lat + rope) * 2,
                         float(n_real) * ctx * heads * flop, heads)
        del kv, bt, lens, ql, qr


def mla_mosaic_section(run, shapes, model_cases):
    from pallas_kernels.mla import mosaic_gpu
    print(f"# MLA Mosaic GPU decode: {mosaic_gpu.DEFAULTS}, "
          f"{mosaic_gpu.smem_bytes(sum(_mosaic_dims(run)), **mosaic_gpu.DEFAULTS)} bytes of smem a CTA", flush=True)
    ctx = contextlib.nullcontext()
    if run.tiny:  # interpret mode: compile each warpgroup's program once, not per CTA
        from pallas_kernels.mosaic_gpu_interpret import reuse_compiled_threads
        ctx = reuse_compiled_threads()
    with ctx:
        mla_mosaic_check(run)
        mla_mosaic_rows(run, shapes, model_cases)


if __name__ == "__main__":          # _mosaic_probe's child: every timed tiling checked
    sweep = [f"mosaic bk{bk} st{st}" for bk, st in MOSAIC_SWEEP]
    print(json.dumps(mla_mosaic_errors(["mosaic", *sweep], None, 512, 64)), flush=True)
