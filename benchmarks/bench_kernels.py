"""The kernel table: KDA decode, paged MLA decode (Triton and the Mosaic GPU kernel; FP8 pages), KDA chunked prefill
and the MoE's routed experts (section moe: benchmarks/kernels_moe.py), each timed isolated AND as the model
calls it (the ops entry point with the dtypes, padding and engine layout of a real step of
Kimi-Linear-48B and of K3), with the kernel variants side by side and the anchors measured in the same
run: copy bandwidth, bf16 matmul peak, FLA (chunk_kda / fused_recurrent_kda) when it imports.

  python -m benchmarks.bench_kernels [--budget 120] [--json PATH] [--csv PATH] [--no-fla] [--tiny]
                                     [--only SECTION,...]

Rows run in priority order and no case starts after --budget seconds (a skipped row says so), so the
whole run stays under ~150 s on one H200. `--tiny` runs every row at toy sizes on CPU with the Pallas
kernels in interpret mode (checks the script, not the speed).
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.harness import (ROOT, Table, add_csv_argument, copy_bandwidth, header, matmul_peak, rel_err,
                                time_jax, time_torch, torch_and_fla, write_json)
from benchmarks.kernel_inputs import kda_inputs, kda_torch_inputs, mla_cache, parse_mla_spec, resolve_mla_config

# MLA useful FLOPs per (key, head): scores over L+R, then P @ ckv over L
MLA_FLOP = lambda lat, rope: 2 * (lat + rope) + 2 * lat  # noqa: E731

# FLA chunk_kda on the same shapes on an H200 (M tok/s, docs/performance.md's anchors): quoted where FLA
# does not import, never as a same-run anchor
FLA_PREFILL_QUOTED = {(16, 4096, 32): 9.30, (2, 32768, 32): 8.69, (16, 4096, 96): 3.10, (2, 32768, 96): 2.99}

COLUMNS = (("kernel", "kernel"), ("case", "case"), ("call", "called as"), ("variant", "variant"),
           ("us", "us", ".0f"), ("tb_s", "TB/s", ".2f"), ("tflop_s", "TFLOP/s", ".0f"),
           ("mtok_s", "M tok/s", ".2f"), ("roof", "of roof", ".0%"), ("anchor", "anchor"),
           ("vs_anchor", "vs anchor", ".2f"), ("target", "target"))


class Run:
    """Shared state of one run: sizes (full or tiny), anchors, the budget."""

    def __init__(self, tiny, budget, fla):
        self.tiny, self.budget = tiny, budget
        self.interpret = True if tiny else None
        self.kv = 32 if tiny else 128                      # KDA K = V
        self.lat, self.rope = (64, 16) if tiny else (512, 64)
        self.reps = 1 if tiny else 10
        self.torch, self.fla, why = torch_and_fla() if fla and not tiny else (None, None, "off")
        self.fla_note = why
        self.copy_bw = self.peak = None
        self.t0 = time.time()
        self.table = Table(*COLUMNS)

    def over(self):
        return time.time() - self.t0 > self.budget

    def add(self, **row):
        line = self.table.add(**row)
        print(f"[{time.time() - self.t0:6.1f}s] {line}", flush=True)

    def skip(self, kernel, case, call, variant, why):
        self.add(kernel=kernel, case=case, call=call, variant=variant, target=f"not run ({why})")

    def timed(self, kernel, case, call, variant, fn):
        """fn() -> seconds, or None (a skipped row) past the budget or when it fails: a variant
        that does not compile is a row of the table, not the end of the run."""
        if self.over():
            self.skip(kernel, case, call, variant, "budget")
            return None
        try:
            return fn()
        except Exception as e:  # noqa: BLE001
            self.skip(kernel, case, call, variant, f"{type(e).__name__}: {str(e).splitlines()[0][:120]}")
            return None


def anchors(run):
    """Copy bandwidth (read + write) and the bf16 matmul peak, measured here."""
    bw_jax, bw_torch = copy_bandwidth(gib=1 / 64 if run.tiny else 4.0, torch=run.torch)
    run.copy_bw = bw_torch or bw_jax
    n = 256 if run.tiny else 8192
    run.peak = matmul_peak(n, reps=run.reps)
    print(f"# copy bandwidth: jax x+1 {bw_jax / 1e12:.2f} TB/s, torch copy_ "
          f"{'n/a' if bw_torch is None else f'{bw_torch / 1e12:.2f}'} TB/s (roof uses "
          f"{run.copy_bw / 1e12:.2f}); bf16 matmul {n}^3: {run.peak / 1e12:.0f} TFLOP/s; "
          f"FLA: {'imported' if run.fla else f'n/a ({run.fla_note})'}", flush=True)


# ---- KDA decode ---------------------------------------------------------------------------------
# (block_v, num_warps, block_h), timed beside recurrent_pallas.CONFIG (the default, not repeated).
# 1 warp: the reductions over K stay inside a warp (no shared-memory round trip), as FLA's decode does;
# bv16 / bv8 w1 (65% / 51% of copy on 2026-12-01) are left out
KDA_DECODE_VARIANTS = [(64, 4, 1), (64, 4, 2), (64, 2, 1), (64, 2, 2), (128, 4, 1), (32, 4, 1), (32, 1, 1)]


def _kda_default():
    from pallas_kernels.kda import recurrent_pallas as rp
    return rp.CONFIG["block_v"], rp.CONFIG["num_warps"], rp.CONFIG.get("block_h", 1)


def _kda_label(bv, nw, bh):
    return f"bv{bv} w{nw}" + (f" h{bh}" if bh > 1 else "")


def _time_pool_step(step, args, pool, reps):
    """Seconds per call of step(*args, pool) -> (o, pool), the pool donated and threaded."""
    state = {"p": pool}

    def call():
        state["p"] = step(*args, state["p"])[1]
        return state["p"]
    return time_jax(call, reps=reps)


def _decode_target(frac):
    return "met (>= 85% of copy)" if frac >= 0.85 else f"missed by {0.85 - frac:.0%} of copy"


def kda_decode_rows(run, shapes, variants):
    """variants None: the default only; else those variants minus the default."""
    from pallas_kernels.kda import recurrent_pallas as rp
    K = V = run.kv
    for N, H in shapes:
        case = f"N={N} H={H}"
        q, k, v, g, beta = (x[0] for x in kda_inputs(jax.random.PRNGKey(1), 1, N, H, K, V))
        idx = jnp.arange(N, dtype=jnp.int32)
        nbytes = 2 * N * H * K * V * 4
        anchor, t_fla = None, None
        if run.fla is not None:
            tq = kda_torch_inputs(run.torch, N, 1, H)
            h0 = run.torch.zeros(N, H, K, V, dtype=run.torch.float32, device="cuda")
            t_fla = time_torch(run.torch, lambda: run.fla[1](*tq, initial_state=h0,
                                                                         output_final_state=True), reps=20)
            anchor = f"FLA fused_recurrent {t_fla * 1e6:.0f} us"
            del tq, h0
        default = _kda_default()
        for bv, nw, bh in [default] if variants is None else [v for v in variants if v != default]:
            label = _kda_label(bv, nw, bh) + (" (default)" if (bv, nw, bh) == default else "")
            kw = dict(rp.CONFIG, block_v=bv, num_warps=nw)
            step = jax.jit(lambda q, k, v, g, b, i, p, kw=kw, bh=bh: rp.fused_recurrent_kda_pallas(
                q, k, v, g, b, p, i, jnp.zeros((H,)), jnp.zeros((H, K)), scale=K ** -0.5, block_h=bh,
                interpret=bool(run.interpret), backend="interpret" if run.interpret else "triton", **kw),
                donate_argnums=6)
            t = run.timed("KDA decode", case, "isolated", label, lambda step=step: _time_pool_step(
                step, (q, k, v, g, beta, idx), jnp.zeros((N, H, K, V), jnp.float32), 2 * run.reps))
            if t is None:
                continue
            frac = nbytes / t / run.copy_bw
            run.add(kernel="KDA decode", case=case, call="isolated", variant=label, us=t * 1e6,
                    tb_s=nbytes / t / 1e12, roof=frac, anchor=anchor,
                    vs_anchor=None if t_fla is None else t_fla / t, target=_decode_target(frac))
        del q, k, v, g, beta


def kda_decode_model_rows(run, cases):
    """ops.kda_decode as KDA.step's decode-only path calls it: bf16 q/k/v, fp32 g/beta, a pool with
    more slots than sequences, the sequence bucket's padding rows at slot -1."""
    from pallas_kernels import ops
    K = V = run.kv
    for model, n_real, n_bucket, H, n_slots in cases:
        case = f"N={n_real} of bucket {n_bucket} H={H}, {n_slots} slots"
        q, k, v, g, beta = (x[0] for x in kda_inputs(jax.random.PRNGKey(2), 1, n_bucket, H, K, V))
        beta = beta.astype(jnp.float32)
        slots = np.full(n_bucket, -1, np.int32)
        slots[:n_real] = np.random.default_rng(0).permutation(np.arange(1, n_slots))[:n_real]
        step = jax.jit(lambda q, k, v, g, b, s, p: ops.kda_decode(q, k, v, g, b, p, s, scale=K ** -0.5, backend=run.backend),
                       donate_argnums=6)
        t = run.timed("KDA decode", case, f"as model: {model}", "default", lambda: _time_pool_step(
            step, (q, k, v, g, beta, jnp.asarray(slots)), jnp.zeros((n_slots, H, K, V), jnp.float32),
            2 * run.reps))
        if t is None:
            continue
        nbytes = 2 * n_real * H * K * V * 4
        frac = nbytes / t / run.copy_bw
        run.add(kernel="KDA decode", case=case, call=f"as model: {model}", variant="default",
                us=t * 1e6, tb_s=nbytes / t / 1e12, roof=frac, target=_decode_target(frac))
        del q, k, v, g, beta


# ---- MLA decode ---------------------------------------------------------------------------------
# H=96 variants: tuning spec strings (kernel_inputs.parse_mla_spec), or head groups ((heads, spec or None = default), ...). Left out
# after the 2026-12-01 runs: R-w16-r64 (73-75 TFLOP/s), R-w8-r64-bk32-st3 (122-130), the 64 heads in
# keys-on-M form (163 / 179 vs 189 / 207 row form); at the engine's 16-token pages 16-key blocks (one
# page a block, 2 or 4 stages, either form: 21-45% slower than gathering 64-key blocks).
SPLIT_96 = ((64, "R-w8-r64"), (32, "T-w4"))  # paged.default_tuning's split (pages >= 64 < 64k, pages of 16 >= 64k)
MLA_H96_VARIANTS = [("one group R r64 w8", "R-w8-r64"), ("heads 64 (R r64 w8) + 32 (T w4)", SPLIT_96)]
# the model's call at 16-token pages: the other side of default_tuning's page-size choice
K3_8K_PAGE16 = [("heads 64 (R r64 w8) + 32 (T w4)", SPLIT_96)]
K3_128K_PAGE16 = [("R r32 w4 (default before)", "R-w4-r32")]


def _mla_config(spec, heads, page_size, max_pages, n_seqs):
    """A variant -> the hashable config tuple of mla_paged_decode (None: default_tuning)."""
    if spec is None:
        return None
    if isinstance(spec, str):
        return resolve_mla_config(parse_mla_spec(spec)[0], heads, page_size, max_pages, n_seqs)
    return (("head_groups", tuple((h, _mla_config(s, h, page_size, max_pages, n_seqs)) for h, s in spec)),)


def _mla_target(heads, tb_s, tflop_s):
    if heads > 32:
        return "met (>= 450 TFLOP/s)" if tflop_s >= 450 else f"missed: {tflop_s / 450:.0%} of 450 TFLOP/s"
    return "met (>= 3.0 TB/s)" if tb_s >= 3.0 else f"missed: {tb_s / 3.0:.0%} of 3.0 TB/s"


def _mla_row(run, kernel_case, call, variant, t, n_bytes, flops, heads):
    tb_s, tflop_s = n_bytes / t / 1e12, flops / t / 1e12
    run.add(kernel="MLA decode", case=kernel_case, call=call, variant=variant, us=t * 1e6, tb_s=tb_s,
            tflop_s=tflop_s, roof=max(n_bytes / t / run.copy_bw, flops / t / run.peak),
            target=_mla_target(heads, tb_s, tflop_s))


def mla_decode_rows(run, shapes, variants_by_heads, page_size=64, with_default=True):
    from pallas_kernels.mla import mla_paged_decode
    lat, rope = run.lat, run.rope
    for n, ctx, heads in shapes:
        case = f"N={n} ctx={ctx} H={heads} page {page_size}"
        kv, bt, lens = mla_cache(jax.random.PRNGKey(0), n, ctx, 1, lat, rope, page_size,
                                            jnp.bfloat16)[2:]
        k1, k2 = jax.random.split(jax.random.PRNGKey(heads))
        args = (jax.random.normal(k1, (n, heads, lat), jnp.bfloat16),
                jax.random.normal(k2, (n, heads, rope), jnp.bfloat16), kv, bt, lens)
        n_bytes = n * ctx * (lat + rope) * 2
        flops = float(n) * ctx * heads * MLA_FLOP(lat, rope)
        for label, spec in [("default", None)] * with_default + variants_by_heads.get(heads, []):
            cfg = _mla_config(spec, heads, page_size, bt.shape[1], n)
            f = functools.partial(mla_paged_decode, scale=192 ** -0.5, interpret=run.interpret, config=cfg)
            t = run.timed("MLA decode", case, "isolated", label,
                          lambda f=f: time_jax(f, *args, reps=run.reps, samples=3))
            if t is None:
                continue
            _mla_row(run, case, "isolated", label, t, n_bytes, flops, heads)
        del kv, bt, lens, args


def mla_decode_model_rows(run, cases):
    """ops.mla_ragged_paged as MLA.step's absorbed form calls it in a decode-only step: the engine's
    16-token pages, block tables max_model_len / 16 wide, the sequence bucket's padding rows (no
    token, kv_len 0), bucket-padded tokens; decode_only=True (the engine's decode steps) vs False
    (main before). A mode (label, spec) is a tuning variant: the same call (ragged_paged_mla, which
    ops.mla_ragged_paged dispatches to, decode_only=True) with that config."""
    from pallas_kernels import ops
    from pallas_kernels.mla import ragged_paged_mla
    lat, rope = run.lat, run.rope
    for model, n_real, n_bucket, ctx, heads, page_size, modes in cases:
        case = f"N={n_real} of bucket {n_bucket} ctx={ctx} H={heads} page {page_size}"
        kv, bt, lens = mla_cache(jax.random.PRNGKey(0), n_real, ctx, 1, lat, rope, page_size,
                                            jnp.bfloat16)[2:]
        pad = n_bucket - n_real
        bt = jnp.pad(bt, ((0, pad), (0, 0)))                       # padding rows: garbage page 0
        lens = jnp.pad(lens, (0, pad))
        cu = jnp.asarray(np.concatenate([np.arange(n_real + 1), np.full(pad, n_real)]), jnp.int32)
        k1, k2 = jax.random.split(jax.random.PRNGKey(heads))
        ql = jax.random.normal(k1, (n_bucket, heads, lat), jnp.bfloat16)
        qr = jax.random.normal(k2, (n_bucket, heads, rope), jnp.bfloat16)
        n_bytes = n_real * ctx * (lat + rope) * 2
        flops = float(n_real) * ctx * heads * MLA_FLOP(lat, rope)
        for mode in modes:
            if isinstance(mode, tuple):
                variant = f"decode_only=True, {mode[0]}"
                f = jax.jit(functools.partial(
                    ragged_paged_mla, scale=192 ** -0.5, decode_only=True, interpret=run.interpret,
                    config=_mla_config(mode[1], heads, page_size, bt.shape[1], n_bucket)))
            else:
                variant = "decode_only=True" if mode else "decode_only=False (main before)"
                f = jax.jit(functools.partial(ops.mla_ragged_paged, scale=192 ** -0.5, decode_only=mode,
                                              backend=run.backend))
            t = run.timed("MLA decode", case, f"as model: {model}", variant,
                          lambda f=f: time_jax(f, ql, qr, kv, bt, cu, lens, reps=run.reps, samples=3))
            if t is None:
                continue
            _mla_row(run, case, f"as model: {model}", variant, t, n_bytes, flops, heads)
        del kv, bt, lens, ql, qr


# ---- MLA decode on an FP8 cache (--kv-cache-dtype fp8_e4m3) next to the bf16 cache ---------------
def mla_fp8_rows(run, shapes, page_size=64):
    """mla_paged_decode (the Triton kernel; FP8 pools never take the Mosaic one) on the same cache as bf16
    pages and as packed FP8 rows (pallas_kernels/mla/fp8_cache.py: 656 bytes a token at L=512, R=64, against
    1,152). TB/s counts the bytes each reads; the target is the FP8 kernel's TB/s >= 0.9x the bf16 kernel's.
    `vs anchor`: the FP8 row's speed-up in tokens a second. Each FP8 row also checks its output against the
    jnp reference on the same FP8 pages (rel err in the variant)."""
    from pallas_kernels.mla import fp8_cache, mla_decode_reference, mla_paged_decode
    lat, rope = run.lat, run.rope
    widths = {"bf16": (lat + rope) * 2, "fp8_e4m3": fp8_cache.packed_width(lat, rope)}
    for n, ctx, heads in shapes:
        case = f"N={n} ctx={ctx} H={heads} page {page_size}"
        ql, qr, kv, bt, lens = mla_cache(jax.random.PRNGKey(7), n, ctx, heads, lat, rope, page_size, jnp.bfloat16)
        pools = {"bf16": kv, "fp8_e4m3": jax.jit(fp8_cache.quantize, static_argnums=1)(kv, lat)}
        del kv
        f = functools.partial(mla_paged_decode, scale=192 ** -0.5, interpret=run.interpret)
        times = {}
        for name, pages in pools.items():
            t = run.timed("MLA decode FP8", case, "isolated", f"{name} pages",
                          lambda pages=pages: time_jax(f, ql, qr, pages, bt, lens, reps=run.reps, samples=3))
            if t is None:
                continue
            times[name] = t
            n_bytes = n * ctx * widths[name]
            tb_s = n_bytes / t / 1e12
            variant, target, vs = f"{name} pages", None, None
            if name == "fp8_e4m3":
                want = mla_decode_reference(ql, qr, pages, bt, lens, scale=192 ** -0.5)
                err = rel_err(f(ql, qr, pages, bt, lens), want)
                variant += f" (rel err {err:.1e} vs jnp on the same pages)"
                if "bf16" in times:
                    ratio = tb_s / (n * ctx * widths["bf16"] / times["bf16"] / 1e12)
                    vs = times["bf16"] / t
                    target = (f"met ({ratio:.2f}x bf16's bytes/s >= 0.9x)" if ratio >= 0.9
                              else f"missed: {ratio:.2f}x bf16's bytes/s (< 0.9x)")
            run.add(kernel="MLA decode FP8", case=case, call="isolated", variant=variant, us=t * 1e6, tb_s=tb_s,
                    mtok_s=n * ctx / t / 1e6, roof=n_bytes / t / run.copy_bw,
                    anchor="bf16 pages" if vs is not None else None, vs_anchor=vs, target=target)
        del pools


# ---- MLA decode on Mosaic GPU (opt-in kernel) next to the Triton kernel ---------------------------
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
        done = subprocess.run([sys.executable, "-m", "benchmarks.bench_kernels", "--mosaic-probe"], cwd=ROOT, capture_output=True,
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


# Mosaic kernel tilings (mosaic_gpu.MosaicTiling) timed as the model's decode-only steps call the kernel
# (ragged_decode_mosaic on the engine's padded bucket) at every 64+-head model case: the default is bk 32,
# 3 stages (the most that fit next to the 64-row query tile); bk 16 leaves room for deeper rings; splits x2
# and x1/2 test the split-K plan. The fastest per (padded heads, page size, long context) goes into
# mosaic_gpu.TUNED.
MOSAIC_SWEEP = [(16, 4), (16, 6), (32, 2)]
MOSAIC_CHECK_TOL = 2e-2   # rel err of the check rows from which a kernel is wrong (bf16 output: ~3e-3)


def _mosaic_sweep(heads, max_keys, n_seqs):
    """[(label, MosaicTiling)]: MOSAIC_SWEEP's tilings, then the default tiling with splits x2 and x1/2."""
    from pallas_kernels.mla.mosaic_gpu import DEFAULT_TILING, MosaicTiling, plan
    splits = plan(heads, max_keys, n_seqs, DEFAULT_TILING.bk)[1]
    tilings = [MosaicTiling(bk, st) for bk, st in MOSAIC_SWEEP]
    tilings += [MosaicTiling(splits=s) for s in sorted({2 * splits, max(1, splits // 2)} - {splits})]
    return [(f"mosaic {t.label()}" + (f" (plan: {splits})" if t.splits else ""), t) for t in tilings]


def mla_mosaic_rows(run, shapes, model_cases):
    """The same shapes timed on the Triton kernel (today's default) and the Mosaic kernel: isolated
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
                _mla_row(run, case, "isolated", label, t, n * ctx * (lat + rope) * 2, float(n) * ctx * heads * flop,
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
                _mla_row(run, case, f"as model: {model}", variant, t, n_real * ctx * (lat + rope) * 2,
                         float(n_real) * ctx * heads * flop, heads)
        sweep = [] if run.mosaic_off or heads < mosaic_gpu.MIN_HEADS else \
            _mosaic_sweep(heads, bt.shape[1] * page_size, n_bucket)
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
                _mla_row(run, case, f"as model: {model}", variant, t, n_real * ctx * (lat + rope) * 2,
                         float(n_real) * ctx * heads * flop, heads)
        del kv, bt, lens, ql, qr


def mla_mosaic_section(run, p):
    from pallas_kernels.mla import mosaic_gpu
    print(f"# MLA Mosaic GPU decode: {mosaic_gpu.DEFAULTS}, "
          f"{mosaic_gpu.smem_bytes(sum(_mosaic_dims(run)), **mosaic_gpu.DEFAULTS)} bytes of smem a CTA", flush=True)
    ctx = contextlib.nullcontext()
    if run.tiny:  # interpret mode: compile each warpgroup's program once, not per CTA
        from pallas_kernels.mosaic_gpu_interpret import reuse_compiled_threads
        ctx = reuse_compiled_threads()
    with ctx:
        mla_mosaic_check(run)
        mla_mosaic_rows(run, p["mla_mosaic"], p["mla_mosaic_model"])


# ---- KDA chunked prefill --------------------------------------------------------------------------
def _prefill_target(ratio, quoted):
    if ratio is None:
        return "FLA n/a: not measured"
    verdict = "met (>= 1.0x FLA)" if ratio >= 1.0 else f"missed by {1 - ratio:.0%}"
    return verdict + (" vs quoted FLA" if quoted else "")


def kda_prefill_rows(run, shapes):
    from pallas_kernels.kda import chunk_kda
    for B, T, H in shapes:
        case = f"B={B} T={T} H={H}"
        t = run.timed("KDA prefill", case, "isolated", "default", lambda: time_jax(
            jax.jit(lambda *a: chunk_kda(*a, interpret=run.interpret)),
            *kda_inputs(jax.random.PRNGKey(1), B, T, H, run.kv, run.kv), reps=1 if run.tiny else 3))
        if t is None:
            continue
        mtok = B * T / t / 1e6
        anchor, ratio, quoted = None, None, False
        if run.fla is not None:
            tq = kda_torch_inputs(run.torch, B, T, H)
            ta = time_torch(run.torch, lambda: run.fla[0](*tq, output_final_state=True), reps=3)
            anchor, ratio = f"FLA chunk_kda {B * T / ta / 1e6:.2f} M tok/s", ta / t
            del tq
        elif (B, T, H) in FLA_PREFILL_QUOTED and not run.tiny:
            fla_mtok = FLA_PREFILL_QUOTED[(B, T, H)]
            anchor, ratio, quoted = f"FLA {fla_mtok:.2f} M tok/s (2026-11-29, quoted)", mtok / fla_mtok, True
        run.add(kernel="KDA prefill", case=case, call="isolated", variant="default", us=t * 1e6,
                mtok_s=mtok, anchor=anchor, vs_anchor=ratio, target=_prefill_target(ratio, quoted))


def kda_prefill_model_rows(run, cases):
    """ops.kda_chunk as KDA.step calls it: one flat ragged batch (B=1, cu_seqlens), the token and
    sequence buckets' padding, an fp32 initial state per sequence, bf16 q/k/v, fp32 g/beta, safe_gate
    from the model's gate bound (K3: -5)."""
    from pallas_kernels import ops
    K = V = run.kv
    for model, lens, t_bucket, n_bucket, H, safe in cases:
        case = f"T={t_bucket} ({len(lens)}x{lens[0]} + pad) H={H}"
        q, k, v, g, beta = kda_inputs(jax.random.PRNGKey(3), 1, t_bucket, H, K, V)
        beta = beta.astype(jnp.float32)
        cu = np.concatenate([[0], np.cumsum(lens), np.full(n_bucket - len(lens), sum(lens))]).astype(np.int32)
        s0 = jnp.zeros((n_bucket, H, K, V), jnp.float32)
        f = jax.jit(lambda q, k, v, g, b, s, c: ops.kda_chunk(q, k, v, g, b, scale=K ** -0.5, initial_state=s,
                                                              cu_seqlens=c, safe_gate=safe, backend=run.backend))
        t = run.timed("KDA prefill", case, f"as model: {model}", f"safe_gate={safe}", lambda: time_jax(
            f, q, k, v, g, beta, s0, jnp.asarray(cu), reps=1 if run.tiny else 3))
        del q, k, v, g, beta, s0
        if t is None:
            continue
        run.add(kernel="KDA prefill", case=case, call=f"as model: {model}", variant=f"safe_gate={safe}",
                us=t * 1e6, mtok_s=sum(lens) / t / 1e6)


# ---- MoE routed experts -------------------------------------------------------------------------
def moe_section(run):
    from benchmarks import kernels_moe   # imports the model (k3jax): only when the section runs
    kernels_moe.moe_section(run)


# ---- the variants on this device vs the references (small shapes) ---------------------------------
def checks(run):
    """Max |kernel - reference| / max |reference| of the variants that could become defaults."""
    from pallas_kernels.kda import recurrent_pallas as rp
    from pallas_kernels.kda.reference import decode_reference
    from pallas_kernels.mla import (mla_decode_reference, mla_paged_decode, ragged_paged_mla,
                                    ragged_paged_mla_reference)

    def row(kernel, variant, fn):
        e = run.timed(kernel, "small shapes vs reference", "check", variant, fn)
        if e is not None:
            run.add(kernel=kernel, case="small shapes vs reference", call="check", variant=variant,
                    target=f"rel err {e:.1e}")
    lat, rope, scale = run.lat, run.rope, 192 ** -0.5
    big, small = (4, 2) if run.tiny else (64, 32)    # K3's heads: big + small
    ql, qr, kv, bt, lens = mla_cache(jax.random.PRNGKey(5), 5, 300, big + small, lat, rope, 16,
                                                jnp.float32)
    lens = jnp.array([300, 1, 77, 64, 129], jnp.int32)
    # the configs the table times (fp32 tiles shrink to fit shared memory: paged.fit_shared_memory)
    for label, heads, spec in [
            ("head groups R r64 w8 + T w4, fp32, page 16", big + small, ((big, "R-w8-r64"), (small, "T-w4"))),
            ("R r32 w4, fp32, page 16", big + small, "R-w4-r32")]:
        cfg = _mla_config(spec, heads, 16, bt.shape[1], 5)
        row("MLA decode", label, lambda cfg=cfg, h=heads: rel_err(
            mla_paged_decode(ql[:, :h], qr[:, :h], kv, bt, lens, scale=scale, interpret=run.interpret, config=cfg),
            mla_decode_reference(ql[:, :h], qr[:, :h], kv, bt, lens, scale=scale)))
    pad_bt, pad_lens = jnp.pad(bt, ((0, 2), (0, 0))), jnp.pad(lens, (0, 2))
    cu = jnp.array([0, 1, 2, 3, 4, 5, 5, 5], jnp.int32)
    qlp, qrp = (jnp.pad(x, ((0, 3), (0, 0), (0, 0))) for x in (ql, qr))  # 8 tokens: 3 bucket padding
    for dtype in (jnp.float32, jnp.bfloat16):  # bf16: the tiles the model gets (fp32's are smaller)
        a = [x.astype(dtype) for x in (qlp, qrp, kv)]
        row("MLA decode", f"decode_only ragged default, {jnp.dtype(dtype).name}, padding rows and tokens",
            lambda a=a: rel_err(ragged_paged_mla(a[0], a[1], a[2], pad_bt, cu, pad_lens, scale=scale,
                                             interpret=run.interpret, decode_only=True),
                            ragged_paged_mla_reference(*(x.astype(jnp.float32) for x in a), pad_bt, cu,
                                                       pad_lens, scale=scale)))
    K = run.kv
    q, k, v, g, beta = (x[0].astype(jnp.float32) for x in kda_inputs(jax.random.PRNGKey(6), 1, 6, 4, K, K))
    pool = jax.random.normal(jax.random.PRNGKey(7), (9, 4, K, K))
    idx = jnp.array([4, -1, 0, 8, 2, 5], jnp.int32)
    want = decode_reference(q, k, v, g, beta, pool, idx)
    for bv, nw, bh in KDA_DECODE_VARIANTS:
        row("KDA decode", _kda_label(bv, nw, bh) + ", fp32 (o and pool)", lambda bv=bv, nw=nw, bh=bh: max(
            rel_err(a, b) for a, b in zip(rp.fused_recurrent_kda_pallas(
                q, k, v, g, beta, pool, idx, jnp.zeros((4,)), jnp.zeros((4, K)), scale=K ** -0.5, block_v=bv,
                num_warps=nw, block_h=bh, interpret=bool(run.interpret),
                backend="interpret" if run.interpret else "triton"), want)))


# ---- the run ------------------------------------------------------------------------------------
def plan(tiny):
    """(kind, shapes) in priority order: defaults first, then the variants."""
    if tiny:
        return dict(
            kda_decode=[(4, 2)], kda_decode_variants=[(4, 2)],
            kda_decode_model=[("Kimi-Linear-48B", 3, 4, 2, 6)],
            mla=[(2, 64, 4)], mla_variants={4: [("head groups 2+2", ((2, None), (2, None))),
                                                ("R-w8-bk16", "R-w8-bk16")]},
            mla_model=[("K3", 2, 3, 48, 4, 16, (True, False, ("one group", "R-w8-r64")))],
            prefill=[(1, 64, 2)], prefill_model=[("K3", [30, 20], 64, 3, 2, True)],
            mla_mosaic=[(2, 64, 96, 64), (2, 64, 32, 64)], mla_mosaic_model=[("K3", 2, 3, 48, 96, 16)],
            mla_fp8=[(2, 64, 4)])
    return dict(
        kda_decode=[(256, 32), (256, 96)], kda_decode_variants=[(256, 32), (256, 96)],
        kda_decode_model=[("Kimi-Linear-48B", 250, 256, 32, 312), ("K3 (DP attention)", 250, 256, 96, 312)],
        mla=[(64, 8192, 32), (16, 131072, 32), (64, 8192, 96), (16, 131072, 96)],
        mla_variants={96: MLA_H96_VARIANTS},
        mla_model=[("Kimi-Linear-48B", 60, 64, 8192, 32, 16, (True, False)),
                   ("Kimi-Linear-48B", 60, 64, 8192, 32, 64, (True,)),
                   ("K3 (DP attention)", 60, 64, 8192, 96, 16, (True, False, *K3_8K_PAGE16)),
                   ("K3 (DP attention)", 16, 16, 131072, 96, 16, (True, *K3_128K_PAGE16)),
                   ("K3 (tensor=8: 12 heads)", 60, 64, 8192, 12, 16, (True,))],
        prefill=[(16, 4096, 32), (2, 32768, 32), (16, 4096, 96), (2, 32768, 96)],
        prefill_model=[("Kimi-Linear-48B", [2000, 2000], 4096, 4, 32, False),
                       ("K3 (DP attention)", [2000, 2000], 4096, 4, 96, True)],
        mla_mosaic=[(64, 8192, 96, 64), (16, 131072, 96, 64), (64, 8192, 32, 64)],
        mla_mosaic_model=[("K3 (DP attention)", 60, 64, 8192, 96, 16), ("K3 (DP attention)", 60, 64, 8192, 96, 64),
                          ("K3 (DP attention)", 16, 16, 131072, 96, 16)],
        mla_fp8=[(64, 8192, 32), (16, 131072, 32), (64, 8192, 96), (16, 131072, 96)])


# run order: defaults first, the checks of every timed config, then the variants
SECTIONS = ("kda_decode", "kda_decode_model", "mla_decode", "mla_model", "kda_prefill", "kda_prefill_model",
            "moe", "checks", "kda_decode_variants", "mla_variants", "mla_mosaic", "mla_fp8")


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", "--deadline", type=float, default=120.0, help="start no case after (s)")
    ap.add_argument("--tiny", "--smoke", action="store_true", help="toy shapes, CPU interpret mode")
    ap.add_argument("--no-fla", action="store_true", help="skip the FLA anchor even if it imports")
    ap.add_argument("--only", default=None, metavar="SECTION,...",
                    help=f"run only these sections (anchors always run): {','.join(SECTIONS)}")
    ap.add_argument("--json", default=None, metavar="PATH", help="also write the rows and anchors as JSON")
    ap.add_argument("--mosaic-probe", action="store_true", help=argparse.SUPPRESS)  # mla_mosaic's child
    add_csv_argument(ap)
    args = ap.parse_args(argv)
    if args.mosaic_probe:
        sweep = [f"mosaic bk{bk} st{st}" for bk, st in MOSAIC_SWEEP]   # every timed tiling checked
        print(json.dumps(mla_mosaic_errors(["mosaic", *sweep], None, 512, 64)), flush=True)
        return []
    only = SECTIONS if args.only is None else tuple(x.strip().replace("-", "_") for x in args.only.split(",") if x.strip())
    unknown = sorted(set(only) - set(SECTIONS))
    if unknown:
        ap.error(f"--only: unknown section(s) {unknown}; known: {', '.join(SECTIONS)}")
    run = Run(args.tiny, args.budget, fla=not args.no_fla)
    from pallas_kernels.backend import detect
    run.backend = detect("pallas")     # the model-path rows run the kernels (interpreted on CPU) as the step does
    from pallas_kernels.kda import chunk_pallas, recurrent_pallas
    from pallas_kernels.mla import paged
    print(header("kernel table (anchors and tuning below)"))
    print(f"# KDA chunk CONFIG {chunk_pallas.CONFIG}\n# KDA decode CONFIG {recurrent_pallas.CONFIG}\n# MLA decode tuning H=32 {paged.default_tuning(32, True)}, H=96 "
          + ", ".join(f"page {ps} {'<' if k < 65536 else '>='} 64k keys {paged.default_tuning(96, True, k, ps)}"
                      for ps in (64, 16) for k in (8192, 131072)), flush=True)
    anchors(run)
    p = plan(args.tiny)
    steps = dict(
        kda_decode=lambda: kda_decode_rows(run, p["kda_decode"], None),
        kda_decode_model=lambda: kda_decode_model_rows(run, p["kda_decode_model"]),
        mla_decode=lambda: mla_decode_rows(run, p["mla"], {}),
        mla_model=lambda: mla_decode_model_rows(run, p["mla_model"]),
        kda_prefill=lambda: kda_prefill_rows(run, p["prefill"]),
        kda_prefill_model=lambda: kda_prefill_model_rows(run, p["prefill_model"]),
        kda_decode_variants=lambda: kda_decode_rows(run, p["kda_decode_variants"], KDA_DECODE_VARIANTS),
        moe=lambda: moe_section(run),
        checks=lambda: checks(run),
        mla_variants=lambda: mla_decode_rows(run, [s for s in p["mla"] if s[2] in p["mla_variants"]],
                                             p["mla_variants"], with_default=False),
        mla_mosaic=lambda: mla_mosaic_section(run, p),
        mla_fp8=lambda: mla_fp8_rows(run, p["mla_fp8"]))
    for name in SECTIONS:
        if name in only:
            steps[name]()
    print("\n" + header("kernel table", anchors=f"copy {run.copy_bw / 1e12:.2f} TB/s, bf16 matmul {run.peak / 1e12:.0f} TFLOP/s",
                        roof="copy BW (TB/s rows) or the larger of copy BW and matmul peak (MLA); MoE: matmul peak "
                             "(prefill) or copy BW of the weights touched (decode)"))
    print(run.table.markdown())
    print(f"# total {time.time() - run.t0:.0f} s")
    if args.csv:
        run.table.write_csv(args.csv)
    if args.json:
        write_json(args.json, dict(copy_bw=run.copy_bw, bf16_peak=run.peak, fla=run.fla is not None, rows=run.table.rows))
    return run.table.rows


if __name__ == "__main__":
    main()
