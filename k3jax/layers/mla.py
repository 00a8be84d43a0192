"""MLA (multi-head latent attention, no rotary) layer.

kda-like pair of entry points: `mla_full` expands keys/values per head (the plain form), and
`mla_step` runs the absorbed form directly on the paged 576-wide latent cache. The two forms are
mathematically equal, which the tests exploit.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from k3jax.config import ModelConfig
from k3jax.layers.common import rms_norm, upcast
from pallas_kernels import ops
from pallas_kernels.backend import Backend

# q_a_layernorm / kv_a_layernorm use the norm class default, not rms_norm_eps (spec section 3).
_LATENT_NORM_EPS = 1e-6


def _queries(p, x, c: ModelConfig):
    if "q_a_proj" in p:
        q = rms_norm(x @ p["q_a_proj"], p["q_a_norm"], _LATENT_NORM_EPS) @ p["q_b_proj"]
    else:
        q = x @ p["q_proj"]
    q = q.reshape(*x.shape[:-1], c.mla_num_heads, c.qk_head_dim)
    return q[..., :c.qk_nope_head_dim], q[..., c.qk_nope_head_dim:]


def latent_kv(p, x, c: ModelConfig):
    """The per-token cache entry: [normalized latent (kv_lora_rank), k_rope (qk_rope_head_dim)]."""
    kv = x @ p["kv_a_proj"]
    ckv = rms_norm(kv[..., :c.kv_lora_rank], p["kv_a_norm"], _LATENT_NORM_EPS)
    return jnp.concatenate([ckv, kv[..., c.kv_lora_rank:]], axis=-1)


def _kv_b(p, c: ModelConfig):
    """kv_b_proj split per head: W_uk [L, H, nope], W_uv [L, H, v]."""
    w = p["kv_b_proj"].reshape(c.kv_lora_rank, c.mla_num_heads, c.qk_nope_head_dim + c.v_head_dim)
    return w[..., :c.qk_nope_head_dim], w[..., c.qk_nope_head_dim:]


def _output(p, x, o, c: ModelConfig):
    """o [..., H, v] -> optional sigmoid output gate -> o_proj."""
    o = o.reshape(*x.shape[:-1], c.mla_num_heads * c.v_head_dim)
    if "g_proj" in p:
        o = (upcast(o) * jax.nn.sigmoid(upcast(x @ p["g_proj"]))).astype(x.dtype)
    return o @ p["o_proj"]


def scale(c: ModelConfig) -> float:
    return c.qk_head_dim ** -0.5


def mla_full(p, x, c: ModelConfig):
    """x [B, T, D] -> [B, T, D], causal attention within each sequence."""
    q_nope, q_rope = _queries(p, x, c)
    kv = latent_kv(p, x, c)
    ckv, k_rope = kv[..., :c.kv_lora_rank], kv[..., c.kv_lora_rank:]
    w_uk, w_uv = _kv_b(p, c)
    k_nope = jnp.einsum("btl,lhd->bthd", ckv, w_uk)
    v = jnp.einsum("btl,lhd->bthd", ckv, w_uv)
    s = (jnp.einsum("bqhd,bkhd->bhqk", q_nope, k_nope, preferred_element_type=upcast(x).dtype)
         + jnp.einsum("bqhd,bkd->bhqk", q_rope, k_rope, preferred_element_type=upcast(x).dtype)) * scale(c)
    T = x.shape[1]
    causal = jnp.tril(jnp.ones((T, T), bool))
    s = jnp.where(causal, s, -jnp.inf)
    prob = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("bhqk,bkhd->bqhd", prob.astype(v.dtype), v)
    return _output(p, x, o, c)


def mla_step(p, x, c: ModelConfig, kv_pages, meta, backend: Backend | None = None):
    """One engine step over ragged chunks, absorbed form on the paged latent cache.

    x [T, D]; kv_pages [P, page_size, L+R]; meta: slot_mapping [T] (cache row of each new token,
    -1 = padding), block_tables [N, max_pages], cu_seqlens [N+1], kv_lens [N] (cache length after
    this step). Returns (out [T, D], kv_pages).
    """
    with jax.named_scope("mla_in"):
        q_nope, q_rope = _queries(p, x, c)
        kv_pages = ops.write_kv_pages(kv_pages, latent_kv(p, x, c).astype(kv_pages.dtype), meta["slot_mapping"],
                                      backend=backend)
        w_uk, w_uv = _kv_b(p, c)
        q_lat = jnp.einsum("thd,lhd->thl", q_nope, w_uk)
    with jax.named_scope("mla_attn"):
        o_lat = ops.mla_ragged_paged(q_lat.astype(kv_pages.dtype), q_rope.astype(kv_pages.dtype), kv_pages,
                                     meta["block_tables"], meta["cu_seqlens"], meta["kv_lens"], scale=scale(c),
                                     backend=backend)
    with jax.named_scope("mla_out"):
        o = jnp.einsum("thl,lhd->thd", o_lat.astype(x.dtype), w_uv)
        return _output(p, x, o, c), kv_pages
