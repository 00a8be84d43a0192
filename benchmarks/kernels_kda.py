"""bench_kernels' KDA sections: the recurrent decode kernel (isolated, its variants, and as KDA.step's decode-only
path calls ops.kda_decode) and the chunked prefill (isolated against FLA's chunk_kda, and as KDA.step calls
ops.kda_chunk on a ragged, bucket-padded batch); the decode variants' check rows against the reference.

Every function takes bench_kernels' Run (sizes, anchors, budget, the table) and adds rows to it.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.harness import rel_err, time_jax, time_torch
from benchmarks.kernel_inputs import kda_inputs, kda_torch_inputs

# FLA chunk_kda on the same shapes on an H200 (M tok/s, docs/performance.md's anchors): quoted where FLA
# does not import, never as a same-run anchor
FLA_PREFILL_QUOTED = {(16, 4096, 32): 9.31, (2, 32768, 32): 8.72, (16, 4096, 96): 3.09, (2, 32768, 96): 2.99}


# ---- KDA decode ---------------------------------------------------------------------------------
# (block_v, num_warps, block_h), timed beside recurrent_pallas.CONFIG (the default, not repeated).
# 1 warp: the reductions over K stay inside a warp (no shared-memory round trip), as FLA's decode does;
# bv16 / bv8 w1 are left out (well below bv32-128: docs/performance.md, "Tuning of record")
KDA_DECODE_VARIANTS = [(64, 4, 1), (64, 4, 2), (64, 2, 1), (64, 2, 2), (128, 4, 1), (32, 4, 1), (32, 1, 1)]


def _kda_default():
    from pallas_kernels.kda import recurrent_pallas as rp
    return rp.CONFIG["block_v"], rp.CONFIG["num_warps"], rp.CONFIG.get("block_h", 1)


def kda_label(bv, nw, bh):
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
            label = kda_label(bv, nw, bh) + (" (default)" if (bv, nw, bh) == default else "")
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
            anchor, ratio, quoted = f"FLA {fla_mtok:.2f} M tok/s (quoted)", mtok / fla_mtok, True
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


# ---- the decode variants vs the reference (small shapes) ------------------------------------------
def check_rows(run):
    """Max |kernel - reference| / max |reference| of every KDA decode variant, fp32, with padding slots."""
    from pallas_kernels.kda import recurrent_pallas as rp
    from pallas_kernels.kda.reference import decode_reference
    K = run.kv
    q, k, v, g, beta = (x[0].astype(jnp.float32) for x in kda_inputs(jax.random.PRNGKey(6), 1, 6, 4, K, K))
    pool = jax.random.normal(jax.random.PRNGKey(7), (9, 4, K, K))
    idx = jnp.array([4, -1, 0, 8, 2, 5], jnp.int32)
    want = decode_reference(q, k, v, g, beta, pool, idx)
    for bv, nw, bh in KDA_DECODE_VARIANTS:
        run.check("KDA decode", kda_label(bv, nw, bh) + ", fp32 (o and pool)", lambda bv=bv, nw=nw, bh=bh: max(
            rel_err(a, b) for a, b in zip(rp.fused_recurrent_kda_pallas(
                q, k, v, g, beta, pool, idx, jnp.zeros((4,)), jnp.zeros((4, K)), scale=K ** -0.5, block_v=bv,
                num_warps=nw, block_h=bh, interpret=bool(run.interpret),
                backend="interpret" if run.interpret else "triton"), want)))
