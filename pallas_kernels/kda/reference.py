"""Pure-jnp reference ops for KDA (Kimi Delta Attention).

Shapes follow flash-linear-attention: q, k [B, T, H, K] (already l2-normalised),
v [B, T, H, V], g [B, T, H, K] log-space decay, beta [B, T, H]. The state is S[k, v]
(k-first), kept in fp32 (fp64 when the inputs are fp64, so tests can compare in fp64).

Per token:  S <- diag(exp(g_t)) S;  S <- S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = scale S^T q_t.

Varlen (`cu_seqlens`, B == 1): int32 [N+1] traced values, monotone; tokens at or past
cu_seqlens[-1] (or before cu_seqlens[0]) are padding: output 0, never touch a state.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.scipy.linalg import solve_triangular

from pallas_kernels.scatter import set_rows

_HI = jax.lax.Precision.HIGHEST  # keep fp32 matmuls exact on GPU (no TF32)


def _cdtype(*xs):
    """fp32, or fp64 when any input is fp64 (tests run the math in fp64)."""
    return jnp.float64 if any(x is not None and x.dtype == jnp.float64 for x in xs) else jnp.float32


def l2norm(x, eps=1e-6):
    """x / sqrt(sum(x^2, -1) + eps), computed in fp32 (fp64 for fp64 input)."""
    x = x.astype(_cdtype(x))
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def _softplus(x):
    # log1p(exp(x)), linear above 20 like torch/FLA (avoids overflow).
    return jnp.where(x > 20.0, x, jnp.log1p(jnp.exp(jnp.minimum(x, 20.0))))


def kda_gate(f, A_log, dt_bias, *, lower_bound=None):
    """Log-space decay g [..., H, K] (fp32) from the raw f projection f [..., H, K].

    A_log: [H], [1, 1, H, 1] or [>= H] (K3 stores [128], first H used). dt_bias: [H*K] or [H, K]
    (or None). lower_bound None: g = -exp(A_log[h]) * softplus(f + dt_bias);
    otherwise g = lower_bound * sigmoid(exp(A_log[h]) * (f + dt_bias)).
    """
    H, K = f.shape[-2:]
    cd = _cdtype(f)
    x = f.astype(cd)
    if dt_bias is not None:
        x = x + dt_bias.astype(cd).reshape(H, K)
    a = jnp.exp(A_log.astype(cd).reshape(-1)[:H])[:, None]  # [H, 1]
    if lower_bound is None:
        return -a * _softplus(x)
    return lower_bound * jax.nn.sigmoid(a * x)


def _prep(q, k, v, g, beta, scale, initial_state, n_states):
    B, T, H, K = q.shape
    V = v.shape[-1]
    cd = _cdtype(q, k, v, g, beta, initial_state)
    scale = K ** -0.5 if scale is None else scale
    q, k, v, g, beta = (x.astype(cd) for x in (q, k, v, g, beta))
    q = q * scale
    if initial_state is None:
        S0 = jnp.zeros((n_states, H, K, V), cd)
    else:
        S0 = initial_state.astype(cd)
    return q, k, v, g, beta, S0, cd


def _token_step(S, q, k, v, g, beta):
    """One delta-rule step. S [..., K, V]; q, k, g [..., K]; v [..., V]; beta [...]."""
    S = S * jnp.exp(g)[..., None]
    pred = jnp.einsum('...kv,...k->...v', S, k, precision=_HI)
    S = S + k[..., :, None] * (beta[..., None] * (v - pred))[..., None, :]
    o = jnp.einsum('...kv,...k->...v', S, q, precision=_HI)
    return S, o


def _seq_ids(cu, T):
    """Per token: sequence id (clipped to [0, N-1]) and validity mask."""
    t = jnp.arange(T, dtype=cu.dtype)
    sid = jnp.searchsorted(cu, t, side='right', method='compare_all') - 1
    valid = (t >= cu[0]) & (t < cu[-1])
    return jnp.clip(sid, 0, cu.shape[0] - 2), valid


def recurrent_kda_reference(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None):
    """Token-by-token KDA. Returns (o [B, T, H, V] in v.dtype, final_state [N, H, K, V] fp32)."""
    B, T = q.shape[:2]
    out_dtype = v.dtype
    if cu_seqlens is None:
        q, k, v, g, beta, S0, _ = _prep(q, k, v, g, beta, scale, initial_state, B)

        def step(S, xs):
            return _token_step(S, *xs)

        xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta))
        S, o = jax.lax.scan(step, S0, xs)
        return jnp.moveaxis(o, 0, 1).astype(out_dtype), S

    if B != 1:
        raise ValueError("cu_seqlens requires B == 1")
    cu = jnp.asarray(cu_seqlens).astype(jnp.int32)
    N = cu.shape[0] - 1
    q, k, v, g, beta, S0, _ = _prep(q, k, v, g, beta, scale, initial_state, N)
    sid, valid = _seq_ids(cu, T)

    def step(bank, xs):
        i, ok, qt, kt, vt, gt, bt = xs
        S, o = _token_step(bank[i], qt, kt, vt, gt, bt)
        bank = bank.at[i].set(jnp.where(ok, S, bank[i]))
        return bank, jnp.where(ok, o, 0.0)

    bank, o = jax.lax.scan(step, S0, (sid, valid, q[0], k[0], v[0], g[0], beta[0]))
    return o[None].astype(out_dtype), bank


def decode_reference(q, k, v, g, beta, state_pool, state_indices, *, scale=None):
    """One token per sequence against a state pool (already gated g, l2-normalised q/k).

    q, k, g [N, H, K]; v [N, H, V]; beta [N, H]; state_pool [S, H, K, V]; state_indices int32 [N]
    (negative: skip, output 0). Returns (o [N, H, V] v.dtype, new pool; other rows untouched).
    """
    f32 = jnp.float32
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    idx = state_indices.astype(jnp.int32)
    ok = idx >= 0
    S = state_pool[jnp.clip(idx, 0, state_pool.shape[0] - 1)].astype(f32)
    S, o = _token_step(S, q.astype(f32) * scale, k.astype(f32), v.astype(f32), g.astype(f32),
                       beta.astype(f32))
    pool = state_pool.at[jnp.where(ok, idx, state_pool.shape[0])].set(
        S.astype(state_pool.dtype), mode="drop")
    return jnp.where(ok[:, None, None], o, 0).astype(v.dtype), pool


def _chunk_step(S, q, k, v, g, beta):
    """One chunk of the WY/UT-transform algorithm.

    S [B, H, K, V]; q (pre-scaled), k, g [B, C, H, K]; v [B, C, H, V]; beta [B, C, H].
    Masked tokens carry k = q = v = g = beta = 0, which leaves S unchanged.
    Returns (S_new, o [B, C, H, V]).
    """
    C = q.shape[1]
    gc = jnp.cumsum(g, axis=1)  # chunk-local cumulative log decay
    # exp(gc_i - gc_j) per key channel; form the difference first (exp(+-gc) alone overflows).
    diff = gc[:, :, None] - gc[:, None, :]  # [B, Ci, Cj, H, K]
    ii = jnp.arange(C)[:, None]
    jj = jnp.arange(C)[None, :]
    strict = (ii > jj)[None, :, :, None, None]
    incl = (ii >= jj)[None, :, :, None, None]
    e_strict = jnp.exp(jnp.where(strict, diff, -jnp.inf))
    e_incl = jnp.exp(jnp.where(incl, diff, -jnp.inf))
    Akk = jnp.einsum('bihd,bjhd,bijhd->bhij', k, k, e_strict, precision=_HI)
    Aqk = jnp.einsum('bihd,bjhd,bijhd->bhij', q, k, e_incl, precision=_HI)
    bt = jnp.moveaxis(beta, 1, 2)  # [B, H, C]
    M = jnp.eye(C, dtype=q.dtype) + bt[..., :, None] * Akk  # unit lower triangular
    eg = jnp.exp(gc)
    kg = jnp.moveaxis(eg * k, 1, 2)  # [B, H, C, K]
    vh = jnp.moveaxis(v, 1, 2)  # [B, H, C, V]
    # (I + L) [w | u] = beta [exp(gc) k | v]  (forward substitution)
    rhs = jnp.concatenate([kg, vh], axis=-1) * bt[..., None]
    wu = solve_triangular(M, rhs, lower=True, unit_diagonal=True)
    K = k.shape[-1]
    w, u = wu[..., :K], wu[..., K:]
    vnew = u - jnp.einsum('bhck,bhkv->bhcv', w, S, precision=_HI)  # [B, H, C, V]
    qg = jnp.moveaxis(eg * q, 1, 2)
    o = (jnp.einsum('bhck,bhkv->bhcv', qg, S, precision=_HI)
         + jnp.einsum('bhij,bhjv->bhiv', Aqk, vnew, precision=_HI))
    glast = gc[:, -1]  # [B, H, K]
    kd = jnp.moveaxis(jnp.exp(glast[:, None] - gc) * k, 1, 2)  # [B, H, C, K]
    S = (jnp.exp(glast)[..., None] * S
         + jnp.einsum('bhck,bhcv->bhkv', kd, vnew, precision=_HI))
    return S, jnp.moveaxis(o, 1, 2)


def _chunk_scan(S0, q, k, v, g, beta, C):
    """Scan _chunk_step over [B, NT*C, ...] inputs. Returns (S, o [B, NT*C, H, V])."""
    B, TP, H, K = q.shape
    NT = TP // C

    def split(x):
        return jnp.moveaxis(x.reshape(B, NT, C, *x.shape[2:]), 1, 0)

    def step(S, xs):
        return _chunk_step(S, *xs)

    S, o = jax.lax.scan(step, S0, tuple(split(x) for x in (q, k, v, g, beta)))
    return S, jnp.moveaxis(o, 0, 1).reshape(B, TP, H, -1)


def chunk_kda_reference(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None,
                        chunk_size=64):
    """Chunked (WY/UT-transform) KDA, same contract as recurrent_kda_reference."""
    B, T, H, K = q.shape
    C = chunk_size
    out_dtype = v.dtype
    if cu_seqlens is None:
        q, k, v, g, beta, S0, _ = _prep(q, k, v, g, beta, scale, initial_state, B)
        TP = -(-T // C) * C
        pad = [(0, 0), (0, TP - T)]
        xs = [jnp.pad(x, pad + [(0, 0)] * (x.ndim - 2)) for x in (q, k, v, g, beta)]
        S, o = _chunk_scan(S0, *xs, C)
        return o[:, :T].astype(out_dtype), S

    if B != 1:
        raise ValueError("cu_seqlens requires B == 1")
    cu = jnp.asarray(cu_seqlens).astype(jnp.int32)
    N = cu.shape[0] - 1
    q, k, v, g, beta, S0, _ = _prep(q, k, v, g, beta, scale, initial_state, N)
    lay = varlen_chunk_layout(cu, T, C)
    xs = tuple(lay.gather(x[0]) for x in (q, k, v, g, beta))
    cid = lay.chunk_seq

    def step(bank, xs):
        i, qc, kc, vc, gc, bc = xs
        S, o = _chunk_step(bank[i][None], qc[None], kc[None], vc[None], gc[None], bc[None])
        return bank.at[i].set(S[0]), o[0]

    bank, o = jax.lax.scan(step, S0, (cid,) + xs)  # padding chunks leave their state unchanged
    return lay.scatter(o.reshape(-1, H, o.shape[-1]))[None].astype(out_dtype), bank


class VarlenChunkLayout(NamedTuple):
    """Token layout where every sequence starts on a chunk boundary (static chunk count).

    token [NC, C] source token of each laid-out row, ok [NC, C] row holds a real token,
    chunk_seq [NC] sequence of each chunk (clipped), cs [N+1] first chunk of each sequence,
    pos [T] laid-out row of each token, valid [T] token is not padding.
    """
    token: jax.Array
    ok: jax.Array
    chunk_seq: jax.Array
    cs: jax.Array
    pos: jax.Array
    valid: jax.Array

    def gather(self, x):
        """x [T, ...] -> [NC, C, ...]; padding rows are 0 (so they leave any state unchanged)."""
        y = x[self.token]
        return jnp.where(self.ok.reshape(self.ok.shape + (1,) * (y.ndim - 2)), y, 0)

    def scatter(self, y):
        """Laid-out rows y [NC*C, ...] -> tokens [T, ...]; padding tokens get 0."""
        out = y[self.pos]
        return jnp.where(self.valid.reshape((-1,) + (1,) * (out.ndim - 1)), out, 0)


def varlen_chunk_layout(cu, T, C):
    """Layout for cu_seqlens cu (int32 [N+1], traced values) over T tokens, chunk size C."""
    N = cu.shape[0] - 1
    lens = jnp.maximum(cu[1:] - cu[:-1], 0)
    cs = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum((lens + C - 1) // C).astype(jnp.int32)])
    NC = (T + N * (C - 1) + C - 1) // C  # upper bound on sum(ceil(len_i / C))
    j = jnp.arange(NC, dtype=jnp.int32)
    cid = jnp.clip(jnp.searchsorted(cs, j, side='right', method='compare_all') - 1, 0, N - 1).astype(jnp.int32)
    tok = cu[cid][:, None] + (j - cs[cid])[:, None] * C + jnp.arange(C, dtype=jnp.int32)[None]
    ok = (j < cs[N])[:, None] & (tok < cu[cid + 1][:, None])
    sid, valid = _seq_ids(cu, T)
    pos = jnp.clip(cs[sid] * C + jnp.arange(T, dtype=jnp.int32) - cu[sid], 0, NC * C - 1)
    return VarlenChunkLayout(jnp.clip(tok, 0, T - 1), ok, cid, cs, pos, valid)


def decode_positions_by_steps(step, q, k, v, g, beta, state_pool, initial_state, run, dst):
    """W tokens per sequence in order as W decode steps (fused_recurrent_kda_positions' contract, for targets
    without that kernel). step(q, k, v, g, beta, states, rows) -> (o, states) is a decode op on the
    per-sequence state array (rows < 0 untouched, output 0). q, k, g [N, W, H, K]; v [N, W, H, V]; beta
    [N, W, H]; initial_state [N, H, K, V]; run [N, W] bool; dst [N, W] int32 (pool row of the state after
    position t, negative: none). Returns (o [N, W, H, V], the state after the last run position, pool)."""
    n, w = run.shape
    rows = jnp.arange(n, dtype=jnp.int32)
    states, outs = initial_state, []
    for t in range(w):
        o, states = step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], states, jnp.where(run[:, t], rows, -1))
        outs.append(o)
        at = jnp.where(run[:, t] & (dst[:, t] >= 0), dst[:, t], state_pool.shape[0])
        state_pool = set_rows(state_pool, at, states, mode="drop")
    return jnp.stack(outs, axis=1), states, state_pool
