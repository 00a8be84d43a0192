"""The decoder as a Flax NNX module: embedding, hybrid KDA/MLA layers with MLP/MoE, Attention
Residuals, LM head.

One layout: the layers are a `LayerStack` (k3jax/layer_stack.py plans it) whose repeating unit is one
`DecoderBlock` stacked over its repeats and run by one lax.scan, so trace and compile time hardly
grow with depth. `K3Model(config, params)` wraps a parameter tree of the scan layout (the same arrays);
one of the checkpoint layout (params["layers"] a list) is stacked first (a copy). Each module's
variants are fixed when it is built from the config; the layer maths are the modules' methods
(k3jax/layers/).
  model(tokens [B, T], mm_embeds=, mm_mask=, backend=) -> logits [B, T, V]        no cache
  model(tokens [T], pools, batch, backend=) -> (logits [N, V], pools)      ragged chunks over cache pools
Both share `K3Model.decode`; only the attention call differs. k3jax.nnx_model.make_step is the jitted
engine step's body. `backend` (pallas_kernels/backend.py:
kernels, expert parallelism, MXFP4 decoder) is built once by the caller and closed over.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.cache import CachePools, StepBatch
from k3jax.config import ModelConfig
from k3jax.expert_layout import experts_merged
from k3jax.layer_stack import layer_stack_plan, stack_layers
from k3jax.layers.common import OutputAttnRes, norm_param, rms_norm, upcast
from k3jax.layers.decoder import DecoderBlock, DecoderLayer, blocks_before, num_sources
from k3jax.layers.module import List, Module, fill, param, stack_modules, value
from pallas_kernels.backend import Backend, resolve


class LayerStack(Module):
    """The decoder's layers: unrolled `head` layers, the repeating unit as one `DecoderBlock` stacked
    over its repeats (`units`; every parameter with a leading "layers" axis), `tail` layers
    (k3jax/layer_stack.py plans which)."""

    def __init__(self, config: ModelConfig, **kw):
        plan = self.plan = layer_stack_plan(config)
        self.head = List([DecoderLayer(config, i, **kw) for i in plan.head])
        if plan.repeats:
            # random parameters: one draw per repeat; abstract ones: one block stacked abstractly
            repeats = plan.repeats if kw.get("rngs") is not None else 1
            self.units = stack_modules([DecoderBlock(config, plan.layer(r, 0), plan.unit, **kw)
                                        for r in range(repeats)], plan.repeats)
        self.tail = List([DecoderLayer(config, i, **kw) for i in plan.tail])

    def __getitem__(self, i: int) -> DecoderLayer:
        """Layer i's module (a scanned layer's: its block position, parameters stacked over the repeats)."""
        plan = self.plan
        if i in plan.head:
            return self.head[i]
        if i in plan.tail:
            return self.tail[i - plan.stop]
        return self.units[(i - plan.start) % plan.unit]

    def __call__(self, c: ModelConfig, stream, cache, attention: Callable, backend: Backend, real_tokens=None):
        """Every layer: head, the block scanned over its repeats, tail. attention(kind, ordinal, attn,
        x, cache) -> (out, cache), ordinal the layer's index among its kind's (traced in the scan).
        real_tokens: see DecoderLayer."""
        plan = self.plan
        ordinal = {i: j for kind in ("kda", "mla") for j, i in
                   enumerate(k for k, t in enumerate(c.layer_types) if t == kind)}

        def unrolled(layer, i, stream, cache):
            kind = c.layer_types[i]
            return layer(c, i, stream, cache, lambda m, x, ch: attention(kind, ordinal[i], m, x, ch), backend,
                         real_tokens)

        for i, layer in zip(plan.head, self.head):
            stream, cache = unrolled(layer, i, stream, cache)
        if plan.repeats:
            stream, cache = self._scan(c, stream, cache, attention, backend, ordinal, real_tokens)
        for i, layer in zip(plan.tail, self.tail):
            stream, cache = unrolled(layer, i, stream, cache)
        return stream, cache

    def _scan(self, c: ModelConfig, stream, cache, attention: Callable, backend: Backend, ordinal: dict,
              real_tokens=None):
        """The block over its repeats, one lax.scan over the repeat index alone: the block keeps its
        parameters stacked (closed over, not scanned) and each layer reads repeat r's where it uses
        them (k3jax.layers.module.read / matmul: a slice, or in place in the stack where a kernel
        reads it there: routed experts under backend.experts_in_place, the weights used as `x @ w`
        under backend.dense_in_place; a scanned slice would be a copy on GPU)."""
        plan, block = self.plan, self.units
        kinds = block.kinds
        per_unit = {k: kinds.count(k) for k in ("kda", "mla")}

        def body(carry, r):
            stream, cache = carry

            def attend(j, m, x, ch):
                kind = kinds[j]
                return attention(kind, ordinal[plan.layer(0, j)] + r * per_unit[kind], m, x, ch)
            return block(c, r, stream, cache, attend, backend, real_tokens), None

        (stream, cache), _ = jax.lax.scan(body, (stream, cache), jnp.arange(plan.repeats, dtype=jnp.int32))
        return stream, cache


class K3Model(Module):
    """A Kimi K3 / Kimi Linear decoder (see the module docstring).

    K3Model(config, rngs=nnx.Rngs(0))   random parameters;
    K3Model(config)                     abstract ones (jax.ShapeDtypeStruct), for the loaders to fill;
    K3Model(config, params)             over a parameter dict (the same arrays in the scan layout;
                                        the checkpoint layout is stacked first, a copy).
    merged_experts: routed experts with one gate/up weight (k3jax/expert_layout.py); read off
    `params` when it is given."""

    def __init__(self, config: ModelConfig, params: dict | None = None, *, merged_experts: bool = False,
                 dtype=jnp.bfloat16, rngs: nnx.Rngs | None = None):
        if params is not None:
            params = stack_layers(params, config)
            merged_experts, rngs = experts_merged(params), None
        c = self.config = config
        D, V = c.hidden_size, c.vocab_size
        self.tied_embeddings = bool(c.tie_word_embeddings)
        kw = dict(merged_experts=merged_experts, dtype=dtype, rngs=rngs)
        self.embed = param((V, D), ("vocab", "embed"), dtype=dtype, rngs=rngs)
        self.layers = LayerStack(c, **kw)
        self.final_norm = norm_param(c, dtype, rngs)
        if not self.tied_embeddings:
            self.lm_head = param((D, V), ("embed", "vocab"), dtype=dtype, rngs=rngs)
        if c.attn_res_block_size:
            self.output_attn_res = OutputAttnRes(c, dtype=dtype, rngs=rngs)
        if params is not None:
            fill(self, params)

    def embed_tokens(self, tokens, mm_embeds=None, mm_mask=None):
        """Token embeddings, replaced by multimodal (image) embeddings where mm_mask is set."""
        x = value(self.embed)[tokens]
        if mm_embeds is None:
            return x
        return jnp.where(mm_mask[..., None], mm_embeds.astype(x.dtype), x)

    def lm_logits(self, h):
        w = value(self.embed).T if self.tied_embeddings else value(self.lm_head)
        return jnp.dot(h, w, preferred_element_type=upcast(h).dtype)

    def _step_logits(self, h, batch: StepBatch):
        """Logits at batch.logits_indices. A verification step's (spec_dst [N, W]: N * W rows) are computed a
        position at a time, N rows each as a decode step computes them: a GPU dot's algorithm, so its
        rounding, may change with its row count, and a verified token must round as decoding it does."""
        if batch.spec_dst is None:
            return self.lm_logits(h[batch.logits_indices])
        n, w = batch.spec_dst.shape
        idx = batch.logits_indices.reshape(n, w)
        return jnp.stack([self.lm_logits(h[idx[:, j]]) for j in range(w)], axis=1).reshape(n * w, -1)

    def decode(self, h0, attention: Callable, backend: Backend, cache=None, real_tokens=None):
        """Runs all layers. attention(kind, ordinal, attn, x, cache) -> (out, cache), where ordinal is
        the layer's index among the layers of its kind (traced inside the scan). real_tokens (traced
        int): rows of h0 from it on are a step's bucket padding (see DecoderLayer). Returns
        (final-normed hidden states, cache)."""
        c = self.config
        eps = c.rms_norm_eps
        B = c.attn_res_block_size
        stream = h0
        if B:
            stream = jnp.zeros((num_sources(c),) + h0.shape, h0.dtype).at[0].set(h0)
        stream, cache = self.layers(c, stream, cache, attention, backend, real_tokens)
        if B:
            stream = self.output_attn_res(stream, blocks_before(c.num_layers, B), eps)
        return rms_norm(stream, value(self.final_norm), eps), cache

    def __call__(self, tokens, cache: CachePools | None = None, metadata: StepBatch | None = None, *,
                 mm_embeds=None, mm_mask=None, backend: Backend | None = None):
        """The one way to run the model.

        cache None: tokens int32 [B, T] -> logits fp32 [B, T, V], every sequence starting empty;
          mm_embeds [B, T, D] / mm_mask [B, T]: optional image embeddings at placeholder positions.
        cache (CachePools) and metadata (the step's StepBatch: chunk boundaries, cache rows, KDA
          slots, logits rows, image embeddings): one engine step over ragged chunks, tokens int32
          [T] flat -> (logits fp32 [N, V] at metadata.logits_indices, updated pools)."""
        b = resolve(backend)
        if cache is None:
            if metadata is not None:
                raise ValueError("step metadata without cache pools")
            return self._full(tokens, mm_embeds, mm_mask, b)
        if metadata is None:
            raise ValueError("a step over cache pools needs its metadata (a StepBatch)")
        return self._step(tokens, cache, metadata, b)

    def _full(self, tokens, mm_embeds, mm_mask, b: Backend):
        c = self.config

        def attention(kind, _, attn, x, cache):
            return attn.full(x, c, b), cache
        h, _ = self.decode(self.embed_tokens(tokens, mm_embeds, mm_mask), attention, b)
        return self.lm_logits(h)

    def _step(self, tokens, pools: CachePools, batch: StepBatch, b: Backend):
        c = self.config
        T = tokens.shape[0]
        seq, local = _token_meta(batch.cu_seqlens, T)
        meta = dict(cu_seqlens=batch.cu_seqlens, token_seq=seq, token_local=local, state_src=batch.state_src,
                    state_dst=batch.state_dst, ckpt_dst=batch.ckpt_dst, slot_mapping=batch.slot_mapping,
                    block_tables=batch.block_tables, kv_lens=batch.kv_lens, decode_only=batch.decode_only,
                    spec_dst=batch.spec_dst, verify_only=batch.verify_only)
        n_kda, n_mla = len(c.kda_layers), len(c.mla_layers)
        page_size = pools.page_size

        def attention(kind, l, attn, x, cache):
            kv, st, cv = cache
            if kind == "kda":
                out, st, cv = attn.step(x, c, st, cv, _kda_meta(meta, l, n_kda), b)
            else:
                out, kv = attn.step(x, c, kv, _mla_meta(meta, l, n_mla, page_size), b)
            return out, (kv, st, cv)

        cache = tuple(_flat(x) if x is not None else None for x in (pools.mla_kv, pools.kda_state, pools.kda_conv))
        # the bucket's padding rows follow the chunks' tokens (cu_seqlens[-1] of them)
        h, (kv, st, cv) = self.decode(self.embed_tokens(tokens, batch.mm_embeds, batch.mm_mask),
                                      attention, b, cache, real_tokens=batch.cu_seqlens[-1])
        logits = self._step_logits(h, batch)
        unflat = lambda x, like: None if x is None else x.reshape(like.shape)  # noqa: E731
        return logits, CachePools(mla_kv=unflat(kv, pools.mla_kv), kda_state=unflat(st, pools.kda_state),
                                  kda_conv=unflat(cv, pools.kda_conv))


def _token_meta(cu_seqlens, T: int):
    t = jnp.arange(T, dtype=jnp.int32)
    seq = jnp.searchsorted(cu_seqlens[1:], t, side="right", method="compare_all").astype(jnp.int32)
    seq = jnp.minimum(seq, cu_seqlens.shape[0] - 2)
    return seq, t - cu_seqlens[seq]


# ---- per-layer views of the stacked pools --------------------------------------------------------
# A pool [rows, layers, ...] reshaped to [rows * layers, ...] (free: rows is the major, sharded
# axis) is one big pool in which layer l's row r is r * layers + l; the layer functions and kernels
# see ordinary row ids, remapped per layer below.

def _kda_meta(meta, l, n_layers: int):
    src, spec = meta["state_src"], meta.get("spec_dst")
    return dict(meta, state_src=jnp.where(src >= 0, src * n_layers + l, -1),
                state_dst=meta["state_dst"] * n_layers + l, ckpt_dst=meta["ckpt_dst"] * n_layers + l,
                spec_dst=None if spec is None else jnp.where(spec >= 0, spec * n_layers + l, -1))


def _mla_meta(meta, l, n_layers: int, page_size: int):
    s = meta["slot_mapping"]
    rows = (s // page_size * n_layers + l) * page_size + s % page_size
    return dict(meta, slot_mapping=jnp.where(s >= 0, rows, -1), block_tables=meta["block_tables"] * n_layers + l)


def _flat(x):
    return x.reshape((x.shape[0] * x.shape[1],) + x.shape[2:])

