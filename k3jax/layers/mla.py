"""MLA (multi-head latent attention, no rotary) layer.

The `MLA` module (queries low-rank or full, output gate or none: fixed when built) has a kda-like
pair of entry points: `MLA.full` expands keys/values per head (the plain form), and `MLA.step`
runs an engine step on the paged 576-wide latent cache, in one of two equal forms:
absorbed (queries folded into the latent space; decode and small steps) or expanded (the step's
cached latents decompressed by kv_b_proj into per-head K/V, then varlen causal flash attention:
3.4x fewer FLOPs per (query, key) pair, the better form for prefill). The forms are
mathematically equal, which the tests exploit.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.config import ModelConfig
from k3jax.layers.common import rms_norm, upcast
from k3jax.layers.module import Module, param, value
from pallas_kernels import ops, scatter
from pallas_kernels.backend import Backend, resolve

# q_a_layernorm / kv_a_layernorm use the norm class default, not rms_norm_eps (spec section 3).
_LATENT_NORM_EPS = 1e-6


# "auto": expanded for steps of at least this many tokens (decode-only steps never) when the GPU
# kernel is available, with a key buffer of EXPANDED_KEYS_PER_TOKEN rows per step token; a step
# whose sequences hold more keys than that (long contexts) runs absorbed (a runtime lax.cond).
# "expanded" forces the expanded form whatever the shape (same buffer, same fallback).
# H200 per layer (docs/bench_mla.md): T=4096 of 2x2048 1.05 ms vs 2.69 absorbed, of 64x64 0.90 vs
# 1.00; T=512 of 8x64 0.35 vs 0.22 (the gather, decompress and cond cost ~0.1-0.3 ms whatever the
# work), so steps under 2048 tokens stay absorbed. Overflow costs the cond, ~0.1 ms over absorbed.
EXPANDED_MIN_TOKENS = 2048
EXPANDED_KEYS_PER_TOKEN = 2


def expanded_key_budget(num_tokens: int, block_tables_shape, page_size: int, decode_only: bool,
                        backend: Backend | None = None) -> int:
    """Static key-buffer rows of the expanded form for a step shape; 0 = absorbed only. At most
    the keys the block tables can hold (a buffer that large needs no runtime fallback). The form
    is the backend's mla_prefill (K3JAX_MLA_PREFILL when the backend was built)."""
    b = resolve(backend)
    if decode_only or b.mla_prefill == "absorbed":
        return 0
    if b.mla_prefill == "auto" and (num_tokens < EXPANDED_MIN_TOKENS or not ops.expanded_kernel_available(b)):
        return 0
    return min(EXPANDED_KEYS_PER_TOKEN * num_tokens, block_tables_shape[0] * block_tables_shape[1] * page_size)


def scale(c: ModelConfig) -> float:
    return c.qk_head_dim ** -0.5


class MLA(Module):
    """Multi-head latent attention (no rotary): queries low-rank (q_a/q_b, `low_rank_q`) or full
    (q_proj), the 576-wide latent cache entry, an optional sigmoid output gate (`output_gate`)."""

    right_operands = ("q_a_proj", "q_b_proj", "q_proj", "kv_a_proj", "g_proj", "o_proj")
    def __init__(self, config: ModelConfig, *, dtype=jnp.bfloat16, rngs: nnx.Rngs | None = None):
        c = config
        D, H = c.hidden_size, c.mla_num_heads
        w = lambda shape, axes, kind="w": param(shape, axes, kind, dtype=dtype, rngs=rngs)  # noqa: E731
        self.low_rank_q = bool(c.q_lora_rank)
        self.output_gate = bool(c.mla_output_gate)
        if self.low_rank_q:
            self.q_a_proj = w((D, c.q_lora_rank), ("embed", "q_lora"))
            self.q_a_norm = w((c.q_lora_rank,), ("q_lora",), "norm")
            self.q_b_proj = w((c.q_lora_rank, H * c.qk_head_dim), ("q_lora", "mla_heads"))
        else:
            self.q_proj = w((D, H * c.qk_head_dim), ("embed", "mla_heads"))
        self.kv_a_proj = w((D, c.kv_lora_rank + c.qk_rope_head_dim), ("embed", "kv_lora"))
        self.kv_a_norm = w((c.kv_lora_rank,), ("kv_lora",), "norm")
        self.kv_b_proj = w((c.kv_lora_rank, H * (c.qk_nope_head_dim + c.v_head_dim)), ("kv_lora", "mla_heads"))
        self.o_proj = w((H * c.v_head_dim, D), ("mla_heads", "embed"))
        if self.output_gate:
            self.g_proj = w((D, H * c.v_head_dim), ("embed", "mla_heads"))

    def queries_joint(self, x, c: ModelConfig):
        """q [..., H, nope + rope]."""
        if self.low_rank_q:
            q = rms_norm(x @ value(self.q_a_proj), value(self.q_a_norm), _LATENT_NORM_EPS) @ value(self.q_b_proj)
        else:
            q = x @ value(self.q_proj)
        return q.reshape(*x.shape[:-1], c.mla_num_heads, c.qk_head_dim)

    def latent_kv(self, x, c: ModelConfig):
        """The per-token cache entry: [normalized latent (kv_lora_rank), k_rope (qk_rope_head_dim)]."""
        kv = x @ value(self.kv_a_proj)
        ckv = rms_norm(kv[..., :c.kv_lora_rank], value(self.kv_a_norm), _LATENT_NORM_EPS)
        return jnp.concatenate([ckv, kv[..., c.kv_lora_rank:]], axis=-1)

    def kv_b(self, c: ModelConfig):
        """kv_b_proj split per head: W_uk [L, H, nope], W_uv [L, H, v]."""
        w = value(self.kv_b_proj).reshape(c.kv_lora_rank, c.mla_num_heads, c.qk_nope_head_dim + c.v_head_dim)
        return w[..., :c.qk_nope_head_dim], w[..., c.qk_nope_head_dim:]

    def output(self, x, o, c: ModelConfig):
        """o [..., H, v] -> optional sigmoid output gate -> o_proj."""
        o = o.reshape(*x.shape[:-1], c.mla_num_heads * c.v_head_dim)
        if self.output_gate:
            o = (upcast(o) * jax.nn.sigmoid(upcast(x @ value(self.g_proj)))).astype(x.dtype)
        return o @ value(self.o_proj)

    def full(self, x, c: ModelConfig, backend: Backend | None = None):
        """x [B, T, D] -> [B, T, D], causal attention within each sequence (plain jnp: no backend)."""
        q = self.queries_joint(x, c)
        q_nope, q_rope = q[..., :c.qk_nope_head_dim], q[..., c.qk_nope_head_dim:]
        kv = self.latent_kv(x, c)
        ckv, k_rope = kv[..., :c.kv_lora_rank], kv[..., c.kv_lora_rank:]
        w_uk, w_uv = self.kv_b(c)
        k_nope = jnp.einsum("btl,lhd->bthd", ckv, w_uk)
        v = jnp.einsum("btl,lhd->bthd", ckv, w_uv)
        s = (jnp.einsum("bqhd,bkhd->bhqk", q_nope, k_nope, preferred_element_type=upcast(x).dtype)
             + jnp.einsum("bqhd,bkd->bhqk", q_rope, k_rope, preferred_element_type=upcast(x).dtype)) * scale(c)
        T = x.shape[1]
        causal = jnp.tril(jnp.ones((T, T), bool))
        s = jnp.where(causal, s, -jnp.inf)
        prob = jax.nn.softmax(s, axis=-1)
        o = jnp.einsum("bhqk,bkhd->bqhd", prob.astype(v.dtype), v)
        return self.output(x, o, c)

    def _absorbed(self, c: ModelConfig, q, kv_pages, meta, dtype, backend: Backend):
        """o [T, H, v]: attention on the latent cache with queries folded through W_uk."""
        w_uk, w_uv = self.kv_b(c)
        q_lat = jnp.einsum("thd,lhd->thl", q[..., :c.qk_nope_head_dim], w_uk)
        kv_dtype = scatter.value_dtype(kv_pages, dtype)
        o_lat = ops.mla_ragged_paged(q_lat.astype(kv_dtype), q[..., c.qk_nope_head_dim:].astype(kv_dtype),
                                     kv_pages, meta["block_tables"], meta["cu_seqlens"], meta["kv_lens"],
                                     scale=scale(c), decode_only=bool(meta.get("decode_only", False)),
                                     backend=backend)
        return jnp.einsum("thl,lhd->thd", o_lat.astype(dtype), w_uv)

    def _expanded(self, c: ModelConfig, q, kv_pages, meta, dtype, num_keys: int, backend: Backend):
        """o [T, H, v]: the step's cached latents (num_keys rows, sum(kv_lens) <= num_keys) decompressed
        by kv_b_proj into per-head K/V, then varlen causal attention."""
        kv_dtype = scatter.value_dtype(kv_pages, dtype)
        rows, starts = ops.mla_gather_latents(kv_pages, meta["block_tables"], meta["kv_lens"], num_keys)
        rows = scatter.values(rows, kv_dtype)
        kv = (rows[:, :c.kv_lora_rank].astype(dtype) @ value(self.kv_b_proj)).astype(kv_dtype)
        kv = kv.reshape(num_keys, c.mla_num_heads, c.qk_nope_head_dim + c.v_head_dim)
        o = ops.mla_expanded_attention(q.astype(kv_dtype), kv, rows, meta["cu_seqlens"], meta["kv_lens"],
                                       starts, nope_dim=c.qk_nope_head_dim, scale=scale(c), backend=backend)
        return o.astype(dtype)

    def step(self, x, c: ModelConfig, kv_pages, meta, backend: Backend | None = None):
        """One engine step over ragged chunks on the paged latent cache (form: `expanded_key_budget`).

        x [T, D]; kv_pages [P, page_size, L+R]; meta: slot_mapping [T] (cache row of each new token,
        -1 = padding), block_tables [N, max_pages], cu_seqlens [N+1], kv_lens [N] (cache length after
        this step), optional static decode_only. Returns (out [T, D], kv_pages).
        """
        with jax.named_scope("mla_in"):
            q = self.queries_joint(x, c)
            kv_pages = ops.write_kv_pages(kv_pages, self.latent_kv(x, c).astype(scatter.value_dtype(kv_pages, x.dtype)),
                                          meta["slot_mapping"])
        backend = resolve(backend)
        num_keys = expanded_key_budget(x.shape[0], meta["block_tables"].shape, kv_pages.shape[1],
                                       bool(meta.get("decode_only", False)), backend)
        with jax.named_scope("mla_attn"):
            absorbed = lambda: self._absorbed(c, q, kv_pages, meta, x.dtype, backend)  # noqa: E731
            expanded = lambda: self._expanded(c, q, kv_pages, meta, x.dtype, num_keys, backend)  # noqa: E731
            n_seqs, max_pages = meta["block_tables"].shape
            if num_keys and num_keys == n_seqs * max_pages * kv_pages.shape[1]:  # every key fits: no fallback
                o = expanded()
            elif num_keys:
                o = jax.lax.cond(jnp.sum(meta["kv_lens"]) <= num_keys, expanded, absorbed)
            else:
                o = absorbed()
        with jax.named_scope("mla_out"):
            return self.output(x, o, c), kv_pages
