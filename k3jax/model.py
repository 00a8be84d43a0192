"""The decoder: embedding, hybrid KDA/MLA layers with MLP/MoE, Attention Residuals, LM head.

forward_full(params, c, tokens [B, T], mm_embeds?, mm_mask?) -> logits [B, T, V]   no cache
forward_step(params, c, pools, batch) -> (logits [N, V], pools)  ragged chunks over cache pools
Both share `_decoder`; only the attention call differs. Both take `backend` (pallas_kernels/backend.py:
kernels, expert parallelism, MXFP4 decoder), which the caller builds once and closes over. With params in the scan layout
(k3jax/layer_stack.py) the repeating block of layers runs as one lax.scan, so trace and compile
time hardly grow with depth; the checkpoint layout (a list of layers) runs unrolled.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from k3jax.cache import CachePools, StepBatch
from k3jax.config import ModelConfig
from k3jax.layer_stack import is_stacked, layer_stack_plan
from k3jax.layers.common import attn_res_stacked, rms_norm, upcast
from k3jax.layers.kda import kda_full, kda_step
from k3jax.layers.mla import mla_full, mla_step
from k3jax.layers.moe import mlp_or_moe
from pallas_kernels.backend import Backend, resolve

# ---- Attention Residuals as a fixed-size state ------------------------------------------------
# The block history is a buffer [S, ..., D]: sources 0..n-1 are the finished blocks, source n the
# running sum of the current block, with n = the blocks started before the layer (a function of the
# layer index alone, so a scan needs no counter). Slots past n are zero until their block starts.


def _num_sources(c: ModelConfig) -> int:
    return -(-c.num_layers // c.attn_res_block_size) + 1


def _blocks_before(i, B: int):
    """Blocks started before layer i (a block starts at every layer i % B == 0)."""
    return (i + B - 1) // B


def _mix(buf, n, proj, norm, eps):
    """attn_res over sources 0..n (n static: exactly the unrolled formula; traced: masked)."""
    if isinstance(n, int):
        return buf[0] if n == 0 else attn_res_stacked(buf[:n + 1], proj, norm, eps)
    return attn_res_stacked(buf, proj, norm, eps, count=n + 1)


def _add_to(buf, n, x):
    if isinstance(n, int):
        return buf.at[n].add(x.astype(buf.dtype))
    cur = jax.lax.dynamic_index_in_dim(buf, n, keepdims=False)
    return jax.lax.dynamic_update_index_in_dim(buf, cur + x.astype(buf.dtype), n, 0)


def _layer(lp, c: ModelConfig, i, stream, cache, attend, backend: Backend, stack_index=None):
    """One decoder layer. i: layer index (int, or traced inside the scan). stream: hidden states
    (or the AttnRes buffer); attend(p, x, cache) -> (out, cache). stack_index: lp's routed experts
    are stacks over the scanned repeats and this layer is repeat `stack_index` (see _decoder)."""
    eps = c.rms_norm_eps
    B = c.attn_res_block_size
    mlp = lambda x: mlp_or_moe(lp["mlp"], rms_norm(x, lp["post_attn_norm"], eps), c, stack_index, backend)  # noqa: E731
    if not B:
        a, cache = attend(lp["attn"], rms_norm(stream, lp["input_norm"], eps), cache)
        h = stream + a
        return h + mlp(h), cache
    r = lp["attn_res"]
    buf = stream
    h = _mix(buf, _blocks_before(i, B), r["attn_proj"], r["attn_norm"], eps)
    n = _blocks_before(i + 1, B)                         # this layer's block (a new one if i % B == 0)
    a, cache = attend(lp["attn"], rms_norm(h, lp["input_norm"], eps), cache)
    buf = _add_to(buf, n, a)
    m_in = _mix(buf, n, r["mlp_proj"], r["mlp_norm"], eps)
    buf = _add_to(buf, n, mlp(m_in))
    return buf, cache


def _split_experts(unit):
    """A scanned unit's layer params -> (the params without routed experts, the experts or None)."""
    mlp = unit.get("mlp", {})
    if "experts" not in mlp:
        return unit, None
    return dict(unit, mlp={k: v for k, v in mlp.items() if k != "experts"}), mlp["experts"]


def _decoder(params, c: ModelConfig, h0, attention: Callable, backend: Backend, cache=None):
    """Runs all layers. attention(kind, ordinal, p, x, cache) -> (out, cache), where ordinal is the
    layer's index among the layers of its kind (traced inside the scan). Returns (final-normed
    hidden states, cache)."""
    eps = c.rms_norm_eps
    B = c.attn_res_block_size
    stream = h0
    if B:
        stream = jnp.zeros((_num_sources(c),) + h0.shape, h0.dtype).at[0].set(h0)
    ordinal = {i: j for kind in ("kda", "mla") for j, i in
               enumerate(k for k, t in enumerate(c.layer_types) if t == kind)}

    def unrolled(lp, i, stream, cache):
        kind = c.layer_types[i]
        return _layer(lp, c, i, stream, cache, lambda p, x, ch: attention(kind, ordinal[i], p, x, ch), backend)

    if not is_stacked(params):
        for i, lp in enumerate(params["layers"]):
            stream, cache = unrolled(lp, i, stream, cache)
    else:
        plan = layer_stack_plan(c)
        st = params["layers"]
        for i, lp in zip(plan.head, st["head"]):
            stream, cache = unrolled(lp, i, stream, cache)
        kinds = [c.layer_types[plan.layer(0, j)] for j in range(plan.unit)]
        per_unit = {k: kinds.count(k) for k in ("kda", "mla")}
        # Routed experts stay whole (closed over, not scanned): the MoE kernels read repeat r's experts
        # inside the stack, where a scanned slice would be a copy of the layer's experts on GPU.
        sliced, experts = zip(*(_split_experts(u) for u in st["units"])) if backend.experts_in_place else \
            (st["units"], (None,) * plan.unit)

        def body(carry, xs):
            stream, cache = carry
            units, r = xs
            for j, lp in enumerate(units):
                kind, i0 = kinds[j], plan.layer(0, j)
                idx = ordinal[i0] + r * per_unit[kind]
                if experts[j] is not None:
                    lp = dict(lp, mlp=dict(lp["mlp"], experts=experts[j]))
                stream, cache = _layer(lp, c, i0 + r * plan.unit, stream, cache,
                                       lambda p, x, ch, kind=kind, idx=idx: attention(kind, idx, p, x, ch),
                                       backend, stack_index=None if experts[j] is None else r)
            return (stream, cache), None

        (stream, cache), _ = jax.lax.scan(body, (stream, cache),
                                          (list(sliced), jnp.arange(plan.repeats, dtype=jnp.int32)))
        for i, lp in zip(plan.tail, st["tail"]):
            stream, cache = unrolled(lp, i, stream, cache)
    if B:
        o = params["output_attn_res"]
        stream = _mix(stream, _blocks_before(c.num_layers, B), o["proj"], o["norm"], eps)
    return rms_norm(stream, params["final_norm"], eps), cache


def _lm_head(params, h):
    w = params["lm_head"] if "lm_head" in params else params["embed"].T
    return jnp.dot(h, w, preferred_element_type=upcast(h).dtype)


def _embed(params, tokens, mm_embeds=None, mm_mask=None):
    """Token embeddings, replaced by multimodal (image) embeddings where mm_mask is set."""
    x = params["embed"][tokens]
    if mm_embeds is None:
        return x
    return jnp.where(mm_mask[..., None], mm_embeds.astype(x.dtype), x)


def forward_full(params, c: ModelConfig, tokens, mm_embeds=None, mm_mask=None, backend: Backend | None = None):
    """tokens int32 [B, T] -> logits fp32 [B, T, V]; every sequence starts empty.
    mm_embeds [B, T, D] / mm_mask [B, T]: optional image embeddings at placeholder positions."""
    b = resolve(backend)

    def attention(kind, _, p, x, cache):
        return (kda_full(p, x, c, b) if kind == "kda" else mla_full(p, x, c)), cache
    h, _ = _decoder(params, c, _embed(params, tokens, mm_embeds, mm_mask), attention, b)
    return _lm_head(params, h)


def _token_meta(cu_seqlens, T: int):
    t = jnp.arange(T, dtype=jnp.int32)
    seq = jnp.searchsorted(cu_seqlens[1:], t, side="right").astype(jnp.int32)
    seq = jnp.minimum(seq, cu_seqlens.shape[0] - 2)
    return seq, t - cu_seqlens[seq]


# ---- per-layer views of the stacked pools --------------------------------------------------------
# A pool [rows, layers, ...] reshaped to [rows * layers, ...] (free: rows is the major, sharded
# axis) is one big pool in which layer l's row r is r * layers + l; the layer functions and kernels
# see ordinary row ids, remapped per layer below.

def _kda_meta(meta, l, n_layers: int):
    src = meta["state_src"]
    return dict(meta, state_src=jnp.where(src >= 0, src * n_layers + l, -1),
                state_dst=meta["state_dst"] * n_layers + l, ckpt_dst=meta["ckpt_dst"] * n_layers + l)


def _mla_meta(meta, l, n_layers: int, page_size: int):
    s = meta["slot_mapping"]
    rows = (s // page_size * n_layers + l) * page_size + s % page_size
    return dict(meta, slot_mapping=jnp.where(s >= 0, rows, -1), block_tables=meta["block_tables"] * n_layers + l)


def _flat(x):
    return x.reshape((x.shape[0] * x.shape[1],) + x.shape[2:])


def forward_step(params, c: ModelConfig, pools: CachePools, batch: StepBatch, backend: Backend | None = None):
    """One engine step. Returns (logits fp32 [N, V] at batch.logits_indices, updated pools)."""
    b = resolve(backend)
    T = batch.tokens.shape[0]
    seq, local = _token_meta(batch.cu_seqlens, T)
    meta = dict(cu_seqlens=batch.cu_seqlens, token_seq=seq, token_local=local, state_src=batch.state_src,
                state_dst=batch.state_dst, ckpt_dst=batch.ckpt_dst, slot_mapping=batch.slot_mapping,
                block_tables=batch.block_tables, kv_lens=batch.kv_lens, decode_only=batch.decode_only)
    n_kda, n_mla = len(c.kda_layers), len(c.mla_layers)
    page_size = pools.page_size

    def attention(kind, l, p, x, cache):
        kv, st, cv = cache
        if kind == "kda":
            out, st, cv = kda_step(p, x, c, st, cv, _kda_meta(meta, l, n_kda), b)
        else:
            out, kv = mla_step(p, x, c, kv, _mla_meta(meta, l, n_mla, page_size), b)
        return out, (kv, st, cv)

    cache = tuple(_flat(x) if x is not None else None for x in (pools.mla_kv, pools.kda_state, pools.kda_conv))
    h, (kv, st, cv) = _decoder(params, c, _embed(params, batch.tokens, batch.mm_embeds, batch.mm_mask),
                               attention, b, cache)
    logits = _lm_head(params, h[batch.logits_indices])
    unflat = lambda x, like: None if x is None else x.reshape(like.shape)
    return logits, CachePools(mla_kv=unflat(kv, pools.mla_kv), kda_state=unflat(st, pools.kda_state),
                              kda_conv=unflat(cv, pools.kda_conv))
