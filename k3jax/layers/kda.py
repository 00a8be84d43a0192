"""KDA (Kimi Delta Attention) layer: projections, short convs, gate, delta rule, gated norm.

The `KDA` module (output gate full-rank or low-rank, fixed when built) has two entry points over
the same parameters (backend: pallas_kernels/backend.py):
  KDA.full(x [B, T, D], c, backend)                        whole sequences from a zero state;
  KDA.step(x [T, D], c, state, conv, meta, backend)        ragged chunks resuming from pooled states.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.config import ModelConfig
from k3jax.layers.common import upcast
from k3jax.layers.kda_positions import recurrent_step, write_position_states
from k3jax.layers.module import Module, matmul, matmuls, param, read
from pallas_kernels import ops
from pallas_kernels.backend import Backend, resolve
from pallas_kernels.scatter import read_rows, set_rows, value_dtype


def _heads(x, c: ModelConfig):
    return x.reshape(*x.shape[:-1], c.kda_num_heads, c.kda_head_dim)


def causal_conv(x_in, w):
    """Depthwise causal conv over time. x_in [B, T, C], w [Kc, C] -> [B, T, C] (fp32)."""
    kc = w.shape[0]
    xp = jnp.pad(upcast(x_in), ((0, 0), (kc - 1, 0), (0, 0)))
    T = x_in.shape[1]
    return sum(xp[:, j:j + T] * upcast(w[j]) for j in range(kc))


def _safe_gate(c: ModelConfig) -> bool:
    """K3's bounded gate keeps every log decay in [lower_bound, 0]; >= -5 allows the cheaper
    diagonal blocks in the chunk kernel."""
    return c.gate_lower_bound is not None and c.gate_lower_bound >= -5.0


def _gather_state(pool, src, dtype=None):
    """Rows `src` of a pool (as `dtype` values, for a pool of bits); negative src means a fresh (zero) state."""
    rows = read_rows(pool, jnp.maximum(src, 0), dtype)
    keep = (src >= 0).reshape((-1,) + (1,) * (rows.ndim - 1))
    return jnp.where(keep, rows, jnp.zeros_like(rows))


def _step_conv(x_in, w, conv0, meta):
    """Ragged causal conv resuming from per-sequence conv states.

    x_in [T, C]; conv0 [N, Kc-1, C] (last Kc-1 inputs before each chunk, oldest first).
    Returns conv outputs [T, C] (fp32) and the new conv states [N, Kc-1, C].
    """
    kc = w.shape[0]
    T = x_in.shape[0]
    seq, local = meta["token_seq"], meta["token_local"]
    t = jnp.arange(T)
    out = jnp.zeros(x_in.shape, upcast(x_in).dtype)
    for j in range(kc):
        back = kc - 1 - j                       # how many tokens back this tap reads
        idx = local - back
        from_state = conv0[seq, jnp.clip(kc - 1 + idx, 0, kc - 2)]
        from_x = x_in[jnp.clip(t - back, 0, T - 1)]
        val = jnp.where((idx >= 0)[:, None], from_x, from_state)
        out = out + upcast(val) * upcast(w[j])
    cu = meta["cu_seqlens"]
    lens = cu[1:] - cu[:-1]
    new = []
    for r in range(kc - 1):
        idx = lens - (kc - 1) + r               # local index of the r-th kept input
        from_x = x_in[jnp.clip(cu[:-1] + idx, 0, T - 1)]
        from_state = conv0[jnp.arange(lens.shape[0]), jnp.clip(kc - 1 + idx, 0, kc - 2)]
        new.append(jnp.where((idx >= 0)[:, None], from_x, from_state))
    return out, jnp.stack(new, axis=1).astype(conv0.dtype)


class KDA(Module):
    """Kimi Delta Attention: q/k/v projections with short convolutions, the gated delta rule's decay
    (A_log, dt_bias, f_a/f_b) and beta (b_proj), output norm and gate (full-rank g_proj, or low-rank
    g_a/g_b: `full_rank_gate`)."""

    def __init__(self, config: ModelConfig, *, dtype=jnp.bfloat16, rngs: nnx.Rngs | None = None):
        c = config
        D, H, K = c.hidden_size, c.kda_num_heads, c.kda_head_dim
        HK = H * K
        w = lambda shape, axes, kind="w": param(shape, axes, kind, dtype=dtype, rngs=rngs)  # noqa: E731
        into_heads = ("embed", "kda_heads")
        self.q_proj, self.k_proj, self.v_proj = (w((D, HK), into_heads) for _ in range(3))
        self.q_conv, self.k_conv, self.v_conv = (w((c.conv_kernel, HK), ("conv", "kda_heads"), "conv")
                                                 for _ in range(3))
        self.A_log = w((H,), ("kda_heads",), "A_log")
        self.dt_bias = w((HK,), ("kda_heads",), "dt_bias")
        self.f_a_proj = w((D, K), ("embed", "head_dim"))
        self.f_b_proj = w((K, HK), ("head_dim", "kda_heads"))
        self.b_proj = w((D, H), into_heads)
        self.full_rank_gate = bool(c.kda_full_rank_gate)
        if self.full_rank_gate:
            self.g_proj = w((D, HK), into_heads)
        else:
            self.g_a_proj = w((D, K), ("embed", "head_dim"))
            self.g_b_proj = w((K, HK), ("head_dim", "kda_heads"))
        self.o_norm = w((K,), ("head_dim",), "norm")
        self.o_proj = w((HK, D), ("kda_heads", "embed"))

    def conv_weights(self):
        """Depthwise conv weights for the packed [q | k | v] channels: [kernel, 3*H*K]."""
        return jnp.concatenate([read(self.q_conv), read(self.k_conv), read(self.v_conv)], axis=-1)

    def projections(self, x, c: ModelConfig):
        """What the layer computes from x alone: (x_in [..., 3*H*K], the raw pre-conv q | k | v that the conv
        state caches; f [..., H, K], the decay's low-rank projection; beta [..., H] fp32; gate [..., H, K]
        fp32, the output gate's logits). Where a step reads stacked weights in place (few rows on the GPU
        kernels) x's six projections are one kernel launch and the two low-rank second halves another."""
        gate_in = self.g_proj if self.full_rank_gate else self.g_a_proj
        q, k, v, fa, b, gate = matmuls(*((x, p) for p in (self.q_proj, self.k_proj, self.v_proj, self.f_a_proj,
                                                         self.b_proj, gate_in)))
        if self.full_rank_gate:
            (f,) = matmuls((fa, self.f_b_proj))
        else:
            f, gate = matmuls((fa, self.f_b_proj), (gate, self.g_b_proj))
        return (jnp.concatenate([q, k, v], axis=-1), _heads(f, c), jax.nn.sigmoid(upcast(b)),
                upcast(_heads(gate, c)))

    def core(self, x, conv_out, f, c: ModelConfig):
        """From conv outputs and f (`projections`) to the delta rule's q, k (l2-normalised), v and g (fp32)."""
        act = jax.nn.silu(conv_out).astype(x.dtype)
        q, k, v = (_heads(t, c) for t in jnp.split(act, 3, axis=-1))
        # l2norm computes in fp32; the kernels take q, k in the activation dtype (as FLA's do): fp32 q, k
        # would put a bf16 model's prefill on the kernels' IEEE-fp32 path (20-50x slower).
        q, k = ops.l2norm(q).astype(x.dtype), ops.l2norm(k).astype(x.dtype)
        g = ops.kda_gate(f, read(self.A_log), read(self.dt_bias), lower_bound=c.gate_lower_bound)
        return q, k, v, g

    def output(self, x, o, gate, c: ModelConfig):
        """Per-head RMSNorm of o, times sigmoid(gate) (`projections`), then o_proj."""
        of = upcast(o)
        of = of * jax.lax.rsqrt(jnp.mean(of * of, axis=-1, keepdims=True) + c.rms_norm_eps)
        of = of * upcast(read(self.o_norm)) * jax.nn.sigmoid(gate)
        of = of.astype(x.dtype).reshape(*x.shape[:-1], c.kda_dim)
        return matmul(of, self.o_proj)

    def full(self, x, c: ModelConfig, backend: Backend | None = None):
        """x [B, T, D] -> [B, T, D], every sequence starting from a zero state."""
        x_in, f, beta, gate = self.projections(x, c)
        q, k, v, g = self.core(x, causal_conv(x_in, self.conv_weights()), f, c)
        o, _ = ops.kda_chunk(q, k, v, g, beta, scale=c.kda_head_dim ** -0.5, safe_gate=_safe_gate(c),
                             backend=backend)
        return self.output(x, o, gate, c)

    def step(self, x, c: ModelConfig, state_pool, conv_pool, meta, backend: Backend | None = None):
        """One engine step over ragged token chunks.

        x [T, D] flat tokens; state_pool [S, H, K, V] fp32; conv_pool [S, Kc-1, 3*H*K].
        meta: cu_seqlens [N+1], token_seq [T], token_local [T], state_src [N] (slot to resume from,
        -1 = zero state), state_dst [N] (slot to write), ckpt_dst [N] (extra slot to write a prefix
        checkpoint into; 0 = the reserved garbage slot); optional spec_dst [N, W] and static decode_only /
        verify_only (StepBatch). Returns (out [T, D], state_pool, conv_pool).
        """
        b = resolve(backend)
        if meta.get("decode_only"):
            return self._decode_step(x, c, state_pool, conv_pool, meta, b)
        src = meta["state_src"]
        with jax.named_scope("kda_in"):
            x_in, f, beta, gate = self.projections(x, c)
            conv0 = _gather_state(conv_pool, src, x.dtype)
            conv_out, conv_new = _step_conv(x_in, self.conv_weights(), conv0, meta)
            q, k, v, g = self.core(x, conv_out, f, c)
            s0 = _gather_state(state_pool, src)
        # the decode recurrence's inputs (speculative verification, kda_positions)
        inputs = (s0, conv0, x_in, q, k, v, g, beta, meta)
        kw = dict(scale=c.kda_head_dim ** -0.5, backend=b, act_dtype=x.dtype)
        if meta.get("verify_only"):                 # short chunks: the decode recurrence, no chunk kernel
            with jax.named_scope("kda_position_states"):
                state_pool, conv_pool, o = recurrent_step(state_pool, conv_pool, conv_new, *inputs, **kw)
            with jax.named_scope("kda_out"):
                return self.output(x, o, gate, c), state_pool, conv_pool
        with jax.named_scope("kda_chunk"):
            o, s1 = ops.kda_chunk(q[None], k[None], v[None], g[None], beta[None], scale=c.kda_head_dim ** -0.5,
                                  initial_state=s0, cu_seqlens=meta["cu_seqlens"], safe_gate=_safe_gate(c),
                                  backend=b)
        with jax.named_scope("kda_state_write"):
            for dst in (meta["state_dst"], meta["ckpt_dst"]):
                state_pool = set_rows(state_pool, dst, s1)
                conv_pool = set_rows(conv_pool, dst, conv_new.astype(value_dtype(conv_pool, x.dtype)))
        o = o[0]
        if meta.get("spec_dst") is not None:        # speculative verification: a state per position
            with jax.named_scope("kda_position_states"):
                state_pool, conv_pool, o = write_position_states(state_pool, conv_pool, o, *inputs, **kw)
        with jax.named_scope("kda_out"):
            return self.output(x, o, gate, c), state_pool, conv_pool

    def _decode_step(self, x, c: ModelConfig, state_pool, conv_pool, meta, b: Backend):
        """Decode-only step: one token per sequence, each continuing in its own slot, so the delta rule
        runs as the fused decode op updating the pool in place (no chunk padding, no gather/scatter).
        On the GPU kernels everything but the recurrence runs on the step's token rows with the ragged path's
        functions, as a speculative verification step does (`step`, then kda_positions): the same shapes and
        programs, so a verified token rounds as decoding it does. Elsewhere on the sequences' rows (fewer)."""
        cu = meta["cu_seqlens"]
        n = cu.shape[0] - 1
        valid = cu[1:] > cu[:-1]
        slots = jnp.where(valid, meta["state_src"], -1)
        first = jnp.minimum(cu[:-1], x.shape[0] - 1)                       # each sequence's token
        conv0 = read_rows(conv_pool, jnp.maximum(slots, 0), x.dtype)        # [N, Kc-1, C]
        w = self.conv_weights()
        rows = x if b.kernels else x[first]
        x_in, f, beta, gate = self.projections(rows, c)
        if b.kernels:
            conv_out, conv_new = _step_conv(x_in, w, conv0, meta)
        else:   # the ragged path's arithmetic: cached inputs from the pool, the new input at full precision
            conv_out = jnp.sum(upcast(conv0) * upcast(w[:-1])[None], axis=1) + upcast(x_in) * upcast(w[-1])
            conv_new = jnp.concatenate([conv0[:, 1:], x_in[:, None].astype(conv0.dtype)], axis=1)
        q, k, v, g = self.core(rows, conv_out, f, c)
        at = first if b.kernels else slice(None)
        o, state_pool = ops.kda_decode(q[at], k[at], v[at], g[at], beta[at], state_pool, slots,
                                       scale=c.kda_head_dim ** -0.5, backend=b)
        conv_pool = set_rows(conv_pool, jnp.where(valid, meta["state_dst"], conv_pool.shape[0]),
                             conv_new.astype(value_dtype(conv_pool, x.dtype)), mode="drop")
        tok_ok = (jnp.arange(x.shape[0]) < cu[n])[:, None]
        if b.kernels:
            o = jnp.where(tok_ok[..., None], o[meta["token_seq"]], 0).astype(o.dtype)
            return self.output(x, o, gate, c), state_pool, conv_pool
        out = self.output(rows, o, gate, c)                                   # [N, D]
        return jnp.where(tok_ok, out[meta["token_seq"]], 0).astype(out.dtype), state_pool, conv_pool
