"""KDA prefill stage sweeps for scripts/bench_kda.py (--diag-run, --solve-sweep, --wu-sweep, --sweep): the split
intra kernels' inputs, variant timing, and the fastest variant kept in chunk_pallas.CONFIG."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from pallas_kernels.kda import chunk_kda
from pallas_kernels.kda.reference import recurrent_kda_reference
from bench_kda import _fla_precision, _log, _try_time, make_inputs, rel


def _stage_inputs(cp, T, H, diag=True):
    """Inputs of the split intra kernels at B=1 T H (as chunk_kda prepares them), with the diagonal
    blocks from the CONFIG diag kernel when `diag`."""
    q, k, v, g, beta = (x[0] for x in make_inputs(jax.random.PRNGKey(2), 1, T, H))
    K = q.shape[-1]
    qs = (q.astype(jnp.float32) * K ** -0.5).astype(jnp.bfloat16)
    b32 = beta.astype(jnp.float32)
    gc = cp.chunk_cumsum(g, jnp.ones((T,)), jnp.zeros((H,)), jnp.zeros((H, K)))
    x = dict(qs=qs, k=k, v=v, gc=gc, b32=b32)
    if diag:
        c = cp.CONFIG
        x["dq"], x["dk"] = cp.intra_diag(qs, k, gc, b32, mode=c["split_diag"],
                                         bh=math.gcd(c["diag_bh"], H), num_warps=c["split_warps"][0])
    return x


def _fastest(name, variants, run):
    """Time run(**kw) for each kw; returns (kw, seconds) of the fastest, or None."""
    best = None
    for kw in variants:
        t = _try_time(f"  {name} {kw}", lambda kw=kw: run(**kw))
        if t is not None and (best is None or t < best[1]):
            best = (kw, t)
    _log(f"  best {name} {best}")
    return best


def _keep(c, best, stage, **cfg_of):
    """Put the fastest variant of split stage `stage` (index into split_warps) into CONFIG."""
    if best:
        w, st = list(c["split_warps"]), list(c["split_stages"])
        w[stage] = best[0]["num_warps"]
        st[stage] = best[0].get("num_stages", st[stage])
        c.update(split_warps=tuple(w), split_stages=tuple(st),
                 **{key: best[0][name] for key, name in cfg_of.items()})


def solve_sweep(T=32768, H=32):
    """The solve kernel's variants (K-slice loop unrolled or not, warps, slice width) at B=1 T H;
    the fastest goes into CONFIG."""
    from pallas_kernels.kda import chunk_pallas as cp
    x, c = _stage_inputs(cp, T, H), cp.CONFIG
    _log(f"# solve variants B=1 T={T} H={H}")
    variants = [dict(unroll=False, num_warps=w, bk=bk, num_stages=ns, passes=p) for w, bk, ns, p in (
        (1, 32, 2, 1), (1, 32, 2, 2), (2, 32, 2, 2), (1, 32, 3, 2), (1, 16, 2, 2), (1, 32, 1, 1))]
    best = _fastest("solve", variants, lambda **kw: cp.intra_solve(
        x["qs"], x["k"], x["gc"], x["b32"], x["dq"], x["dk"], prec="tf32", inv=c["inv"],
        a_dtype=jnp.bfloat16, **kw))
    _keep(c, best, 1, solve_unroll="unroll", split_bk="bk", solve_passes="passes")


def wu_sweep(T=32768, H=32):
    """The w/u kernel's variants (slice loops unrolled or not, warps, slice width) at B=1 T H; the
    fastest goes into CONFIG."""
    from pallas_kernels.kda import chunk_pallas as cp
    x, c = _stage_inputs(cp, T, H), cp.CONFIG
    _, t = cp.intra_solve(x["qs"], x["k"], x["gc"], x["b32"], x["dq"], x["dk"], prec="tf32",
                          inv=c["inv"], bk=c["split_bk"], unroll=c["solve_unroll"],
                          passes=c["solve_passes"], num_warps=c["split_warps"][1],
                          num_stages=c["split_stages"][1])
    _log(f"# w/u variants B=1 T={T} H={H}")
    variants = [dict(unroll=False, num_warps=w, bk=bk, num_stages=ns) for w, bk, ns in (
        (2, 32, 2), (1, 32, 2), (2, 32, 1), (2, 32, 3), (2, 64, 2), (4, 32, 2), (1, 64, 2))]
    best = _fastest("wu", variants, lambda **kw: cp.intra_wu(
        x["qs"], x["k"], x["v"], x["gc"], x["b32"], t, prec="tf32", **kw))
    _keep(c, best, 2, wu_unroll="unroll", wu_bk="bk")


def state_sweep(T=32768, H=32, B=1):
    """The state-recurrence kernel's variants (V block width = programs per head, warps, stages)
    at B T H; the fastest goes into CONFIG (block_v, inter_warps, state_stages)."""
    from pallas_kernels.kda import chunk_pallas as cp
    c = cp.CONFIG
    q, k, v, g, beta = (x.reshape((B * T,) + x.shape[2:]) for x in make_inputs(jax.random.PRNGKey(2), B, T, H))
    K, V = q.shape[-1], v.shape[-1]
    qs = (q.astype(jnp.float32) * K ** -0.5).astype(jnp.bfloat16)
    gc = cp.chunk_cumsum(g, jnp.ones((B * T,)), jnp.zeros((H,)), jnp.zeros((H, K)))
    w, _, kd, u, _ = cp.chunk_intra_split(qs, k, v, gc, beta.astype(jnp.float32), inv=c["inv"],
                                          diag_mode=c["split_diag"], diag_bh=c["diag_bh"])
    cs = jnp.arange(B + 1, dtype=jnp.int32) * (T // 64)
    h0 = jnp.zeros((B, H, K, V))
    _log(f"# state variants B={B} T={T} H={H}")
    variants = [dict(block_v=bv, num_warps=nw, num_stages=ns) for bv, nw, ns in (
        (32, 4, 3), (32, 4, 2), (32, 8, 2), (64, 8, 3), (64, 8, 2), (64, 4, 2), (128, 8, 2), (16, 4, 2))]
    best = _fastest("state", variants, lambda **kw: cp.chunk_state(w, kd, u, gc, cs, h0, **kw))
    if best:
        c.update(block_v=best[0]["block_v"], inter_warps=best[0]["num_warps"],
                 state_stages=best[0]["num_stages"])


def _diag_precision(torch, fla, cp):
    """rel RMS of our bf16 paths (CONFIG and its storage / diagonal alternatives) and of FLA vs the
    fp32 token-serial reference, T=1024 H=4."""
    q, k, v, g, beta = make_inputs(jax.random.PRNGKey(5), 1, 1024, 4)
    ref, _ = jax.jit(recurrent_kda_reference)(q, k, v.astype(jnp.float32), g, beta)
    saved = dict(cp.CONFIG)
    for label, over, safe in (("default", {}, False), ("t/u bf16", dict(t_dtype="sd", u_dtype="sd"), False),
                              ("safe gate", {}, True), ("quad diag", dict(split_diag="quad", diag_bh=1), False)):
        cp.CONFIG.update(over)
        o, _ = jax.jit(lambda *a, safe=safe: chunk_kda(*a, safe_gate=safe))(q, k, v, g, beta)
        _log(f"  precision ours {label:10s}: o {rel(o, ref):.2e} (bf16, T=1024 H=4)")
        cp.CONFIG.clear()
        cp.CONFIG.update(saved)
    fe = _fla_precision(torch, fla, (q, k, v, g, beta), ref)
    _log(f"  precision FLA chunk_kda : o {fe if fe is None else f'{fe:.2e}'}")


def _diag_variants(cp, budget, T, H, solve=True):
    """Time the diag kernel's variants (fastest kept in CONFIG) and (solve) the solve's, at B=1 T H."""
    x = _stage_inputs(cp, T, H, diag=False)
    qs, k, gc, b32 = x["qs"], x["k"], x["gc"], x["b32"]
    _log(f"# diag variants B=1 T={T} H={H}")
    variants = [dict(mode="token", bh=bh, num_warps=w, num_stages=ns)
                for bh, w, ns in ((4, 1, 1), (4, 1, 2), (4, 1, 3), (2, 1, 1), (8, 2, 1), (8, 1, 2), (4, 2, 2))]
    best = _fastest("diag", variants, lambda **kw: cp.intra_diag(qs, k, gc, b32, prec="tf32", **kw))
    c = cp.CONFIG
    _keep(c, best, 0, split_diag="mode", diag_bh="bh")
    if not solve:
        return
    dq, dk = cp.intra_diag(qs, k, gc, b32, mode=c["split_diag"], bh=c["diag_bh"])
    variants = [dict(inv=inv, num_warps=w, bk=bk) for inv, w, bk in (
        ("loop", 1, c["split_bk"]), ("many", 1, c["split_bk"]), ("many", 2, c["split_bk"]),
        ("many", 1, 64), ("many", 4, c["split_bk"]))]
    best = _fastest("solve", variants, lambda **kw: cp.intra_solve(
        qs, k, gc, b32, dq, dk, prec="tf32", a_dtype=jnp.bfloat16, **kw))
    _keep(c, best, 1, inv="inv", split_bk="bk")
    for inv in ("loop", "many"):
        _try_time(f"  solve safe gate (diag inside) inv={inv}", lambda inv=inv: cp.intra_solve(
            qs, k, gc, b32, shift=c["safe_shift"] or 15.0, bk=c["split_bk"], prec="tf32",
            a_dtype=jnp.bfloat16, inv=inv, num_warps=1))
