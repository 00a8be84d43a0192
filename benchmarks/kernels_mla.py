"""bench_kernels' MLA decode sections (Triton kernel): paged MLA decode isolated (the default tuning and its
H=96 variants) and as MLA.step's absorbed form calls ops.mla_ragged_paged in a decode-only step; the same
kernel on FP8 pages next to bf16 pages; the tuned configs' check rows against the reference. The Mosaic GPU
kernel's section is benchmarks/kernels_mla_mosaic.py.

Every function takes bench_kernels' Run (sizes, anchors, budget, the table) and adds rows to it.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.harness import rel_err, time_jax
from benchmarks.kernel_inputs import mla_cache, parse_mla_spec, resolve_mla_config

# MLA useful FLOPs per (key, head): scores over L+R, then P @ ckv over L
MLA_FLOP = lambda lat, rope: 2 * (lat + rope) + 2 * lat  # noqa: E731


# ---- MLA decode ---------------------------------------------------------------------------------
# H=96 variants: tuning spec strings (kernel_inputs.parse_mla_spec), or head groups ((heads, spec or None = default), ...).
# Left out after measuring (docs/performance.md, "Tuning of record"): R-w16-r64, R-w8-r64-bk32-st3, the 64
# heads in keys-on-M form; at the engine's 16-token pages 16-key blocks (one page a block, 2 or 4 stages).
SPLIT_96 = ((64, "R-w8-r64"), (32, "T-w4"))  # paged.default_tuning's split (pages >= 64 < 64k, pages of 16 >= 64k)
MLA_H96_VARIANTS = [("one group R r64 w8", "R-w8-r64"), ("heads 64 (R r64 w8) + 32 (T w4)", SPLIT_96)]
# the model's call at 16-token pages: the other side of default_tuning's page-size choice
K3_8K_PAGE16 = [("heads 64 (R r64 w8) + 32 (T w4)", SPLIT_96)]
K3_128K_PAGE16 = [("R r32 w4 (one group)", "R-w4-r32")]


def mla_config(spec, heads, page_size, max_pages, n_seqs):
    """A variant -> the hashable config tuple of mla_paged_decode (None: default_tuning)."""
    if spec is None:
        return None
    if isinstance(spec, str):
        return resolve_mla_config(parse_mla_spec(spec)[0], heads, page_size, max_pages, n_seqs)
    return (("head_groups", tuple((h, mla_config(s, h, page_size, max_pages, n_seqs)) for h, s in spec)),)


def _mla_target(heads, tb_s, tflop_s):
    if heads > 32:
        return "met (>= 450 TFLOP/s)" if tflop_s >= 450 else f"missed: {tflop_s / 450:.0%} of 450 TFLOP/s"
    return "met (>= 3.0 TB/s)" if tb_s >= 3.0 else f"missed: {tb_s / 3.0:.0%} of 3.0 TB/s"


def mla_row(run, kernel_case, call, variant, t, n_bytes, flops, heads):
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
            cfg = mla_config(spec, heads, page_size, bt.shape[1], n)
            f = functools.partial(mla_paged_decode, scale=192 ** -0.5, interpret=run.interpret, config=cfg)
            t = run.timed("MLA decode", case, "isolated", label,
                          lambda f=f: time_jax(f, *args, reps=run.reps, samples=3))
            if t is None:
                continue
            mla_row(run, case, "isolated", label, t, n_bytes, flops, heads)
        del kv, bt, lens, args


def mla_decode_model_rows(run, cases):
    """ops.mla_ragged_paged as MLA.step's absorbed form calls it in a decode-only step: the engine's
    16-token pages, block tables max_model_len / 16 wide, the sequence bucket's padding rows (no
    token, kv_len 0), bucket-padded tokens; decode_only=True (the engine's decode steps) vs False
    (the path of a step that also prefills). A mode (label, spec) is a tuning variant: the same call (ragged_paged_mla, which
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
                    config=mla_config(mode[1], heads, page_size, bt.shape[1], n_bucket)))
            else:
                variant = "decode_only=True" if mode else "decode_only=False (a prefilling step's path)"
                f = jax.jit(functools.partial(ops.mla_ragged_paged, scale=192 ** -0.5, decode_only=mode,
                                              backend=run.backend))
            t = run.timed("MLA decode", case, f"as model: {model}", variant,
                          lambda f=f: time_jax(f, ql, qr, kv, bt, cu, lens, reps=run.reps, samples=3))
            if t is None:
                continue
            mla_row(run, case, f"as model: {model}", variant, t, n_bytes, flops, heads)
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
    widths = {"bf16": (lat + rope) * 2, "fp8_e4m3": fp8_cache.packed_bytes(lat, rope)}
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


# ---- the tuned configs vs the reference (small shapes) --------------------------------------------
def check_rows(run):
    """Max |kernel - reference| / max |reference| of the configs the table times: K3's head groups and one
    group at fp32 (the tiles shrink to fit shared memory: paged.fit_shared_memory), and the ragged
    decode-only default with bucket padding rows and tokens in fp32 and bf16 (the tiles the model gets)."""
    from pallas_kernels.mla import (mla_decode_reference, mla_paged_decode, ragged_paged_mla,
                                    ragged_paged_mla_reference)
    lat, rope, scale = run.lat, run.rope, 192 ** -0.5
    big, small = (4, 2) if run.tiny else (64, 32)    # K3's heads: big + small
    ql, qr, kv, bt, lens = mla_cache(jax.random.PRNGKey(5), 5, 300, big + small, lat, rope, 16,
                                                jnp.float32)
    lens = jnp.array([300, 1, 77, 64, 129], jnp.int32)
    for label, heads, spec in [
            ("head groups R r64 w8 + T w4, fp32, page 16", big + small, ((big, "R-w8-r64"), (small, "T-w4"))),
            ("R r32 w4, fp32, page 16", big + small, "R-w4-r32")]:
        cfg = mla_config(spec, heads, 16, bt.shape[1], 5)
        run.check("MLA decode", label, lambda cfg=cfg, h=heads: rel_err(
            mla_paged_decode(ql[:, :h], qr[:, :h], kv, bt, lens, scale=scale, interpret=run.interpret, config=cfg),
            mla_decode_reference(ql[:, :h], qr[:, :h], kv, bt, lens, scale=scale)))
    pad_bt, pad_lens = jnp.pad(bt, ((0, 2), (0, 0))), jnp.pad(lens, (0, 2))
    cu = jnp.array([0, 1, 2, 3, 4, 5, 5, 5], jnp.int32)
    qlp, qrp = (jnp.pad(x, ((0, 3), (0, 0), (0, 0))) for x in (ql, qr))  # 8 tokens: 3 bucket padding
    for dtype in (jnp.float32, jnp.bfloat16):
        a = [x.astype(dtype) for x in (qlp, qrp, kv)]
        run.check("MLA decode", f"decode_only ragged default, {jnp.dtype(dtype).name}, padding rows and tokens",
                  lambda a=a: rel_err(ragged_paged_mla(a[0], a[1], a[2], pad_bt, cu, pad_lens, scale=scale,
                                                       interpret=run.interpret, decode_only=True),
                                      ragged_paged_mla_reference(*(x.astype(jnp.float32) for x in a), pad_bt, cu,
                                                                 pad_lens, scale=scale)))
