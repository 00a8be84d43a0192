"""The decoder: embedding, hybrid KDA/MLA layers with MLP/MoE, Attention Residuals, LM head.

forward_full(params, c, tokens [B, T], mm_embeds?, mm_mask?) -> logits [B, T, V]   no cache
forward_step(params, c, pools, batch) -> (logits [N, V], pools)  ragged chunks over cache pools
Both share `_decoder`; only the attention call differs.
"""
from __future__ import annotations

from typing import Callable

import jax.numpy as jnp

from k3jax.cache import CachePools, StepBatch
from k3jax.config import ModelConfig
from k3jax.layers.common import attn_res, rms_norm, upcast
from k3jax.layers.kda import kda_full, kda_step
from k3jax.layers.mla import mla_full, mla_step
from k3jax.layers.moe import mlp_or_moe


def _decoder(params, c: ModelConfig, h0, attention: Callable):
    """Runs all layers; attention(i, layer_params, x) -> out. Returns final-normed hidden states."""
    eps = c.rms_norm_eps
    B = c.attn_res_block_size
    if not B:
        h = h0
        for i, lp in enumerate(params["layers"]):
            h = h + attention(i, lp["attn"], rms_norm(h, lp["input_norm"], eps))
            h = h + mlp_or_moe(lp["mlp"], rms_norm(h, lp["post_attn_norm"], eps), c)
        return rms_norm(h, params["final_norm"], eps)
    prefix, blocks = h0, []
    for i, lp in enumerate(params["layers"]):
        r = lp["attn_res"]
        h = attn_res(prefix, blocks, r["attn_proj"], r["attn_norm"], eps) if blocks else prefix
        if i % B == 0:
            blocks.append(prefix)
            prefix = None
        a = attention(i, lp["attn"], rms_norm(h, lp["input_norm"], eps))
        prefix = a if prefix is None else prefix + a
        m_in = attn_res(prefix, blocks, r["mlp_proj"], r["mlp_norm"], eps)
        prefix = prefix + mlp_or_moe(lp["mlp"], rms_norm(m_in, lp["post_attn_norm"], eps), c)
    o = params["output_attn_res"]
    return rms_norm(attn_res(prefix, blocks, o["proj"], o["norm"], eps), params["final_norm"], eps)


def _lm_head(params, h):
    w = params["lm_head"] if "lm_head" in params else params["embed"].T
    return jnp.dot(h, w, preferred_element_type=upcast(h).dtype)


def _embed(params, tokens, mm_embeds=None, mm_mask=None):
    """Token embeddings, replaced by multimodal (image) embeddings where mm_mask is set."""
    x = params["embed"][tokens]
    if mm_embeds is None:
        return x
    return jnp.where(mm_mask[..., None], mm_embeds.astype(x.dtype), x)


def forward_full(params, c: ModelConfig, tokens, mm_embeds=None, mm_mask=None):
    """tokens int32 [B, T] -> logits fp32 [B, T, V]; every sequence starts empty.
    mm_embeds [B, T, D] / mm_mask [B, T]: optional image embeddings at placeholder positions."""
    def attention(i, p, x):
        return kda_full(p, x, c) if c.layer_types[i] == "kda" else mla_full(p, x, c)
    h = _decoder(params, c, _embed(params, tokens, mm_embeds, mm_mask), attention)
    return _lm_head(params, h)


def _token_meta(cu_seqlens, T: int):
    t = jnp.arange(T, dtype=jnp.int32)
    seq = jnp.searchsorted(cu_seqlens[1:], t, side="right").astype(jnp.int32)
    seq = jnp.minimum(seq, cu_seqlens.shape[0] - 2)
    return seq, t - cu_seqlens[seq]


def forward_step(params, c: ModelConfig, pools: CachePools, batch: StepBatch):
    """One engine step. Returns (logits fp32 [N, V] at batch.logits_indices, updated pools)."""
    T = batch.tokens.shape[0]
    seq, local = _token_meta(batch.cu_seqlens, T)
    meta = dict(cu_seqlens=batch.cu_seqlens, token_seq=seq, token_local=local, state_src=batch.state_src,
                state_dst=batch.state_dst, ckpt_dst=batch.ckpt_dst, slot_mapping=batch.slot_mapping,
                block_tables=batch.block_tables, kv_lens=batch.kv_lens, decode_only=batch.decode_only)
    mla_kv, kda_state, kda_conv = list(pools.mla_kv), list(pools.kda_state), list(pools.kda_conv)
    kda_index = {layer: j for j, layer in enumerate(c.kda_layers)}
    mla_index = {layer: j for j, layer in enumerate(c.mla_layers)}

    def attention(i, p, x):
        if c.layer_types[i] == "kda":
            j = kda_index[i]
            out, kda_state[j], kda_conv[j] = kda_step(p, x, c, kda_state[j], kda_conv[j], meta)
        else:
            j = mla_index[i]
            out, mla_kv[j] = mla_step(p, x, c, mla_kv[j], meta)
        return out

    h = _decoder(params, c, _embed(params, batch.tokens, batch.mm_embeds, batch.mm_mask), attention)
    logits = _lm_head(params, h[batch.logits_indices])
    return logits, CachePools(mla_kv=mla_kv, kda_state=kda_state, kda_conv=kda_conv)
