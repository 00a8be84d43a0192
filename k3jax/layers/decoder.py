"""One decoder layer: input norm -> attention (KDA or MLA) -> post-attention norm -> MLP (dense or MoE),
with or without Attention Residuals (the mixing of earlier blocks' outputs).

Attention Residuals as a fixed-size state: the block history is a buffer [S, ..., D]: sources
0..n-1 are the finished blocks, source n the running sum of the current block, with n = the blocks
started before the layer (a function of the layer index alone, so a scan needs no counter). Slots
past n are zero until their block starts.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.config import ModelConfig
from k3jax.layers.common import AttnRes, DenseMLP, norm_param, add_to_source, rms_norm
from k3jax.layers.kda import KDA
from k3jax.layers.mla import MLA
from k3jax.layers.module import List, Module, read, repeat
from k3jax.layers.moe import MoE
from pallas_kernels.backend import Backend


def num_sources(c: ModelConfig) -> int:
    """Slots of the block-history buffer: every block, plus the running sum."""
    return -(-c.num_layers // c.attn_res_block_size) + 1


def blocks_before(i, B: int):
    """Blocks started before layer i (a block starts at every layer i % B == 0)."""
    return (i + B - 1) // B


class DecoderLayer(Module):
    """input norm -> attention (KDA or MLA) -> post-attention norm -> MLP (DenseMLP or MoE), the
    residual stream plain or an Attention Residuals block history (`block_size`); which kinds layer
    `index` has is the config's."""

    def __init__(self, config: ModelConfig, index: int, *, merged_experts: bool = False, dtype=jnp.bfloat16,
                 rngs: nnx.Rngs | None = None):
        c = config
        self.input_norm = norm_param(c, dtype, rngs)
        self.post_attn_norm = norm_param(c, dtype, rngs)
        self.attn = (KDA if c.layer_types[index] == "kda" else MLA)(c, dtype=dtype, rngs=rngs)
        self.moe = c.mlp_types[index] != "dense"
        self.mlp = (MoE(c, merged_experts=merged_experts, dtype=dtype, rngs=rngs) if self.moe
                    else DenseMLP(c, dtype=dtype, rngs=rngs))
        self.block_size = c.attn_res_block_size or 0
        if self.block_size:
            self.attn_res = AttnRes(c, dtype=dtype, rngs=rngs)

    def feed_forward(self, x, c: ModelConfig, backend: Backend | None = None, real_tokens=None):
        if self.moe:
            return self.mlp(x, c, backend=backend, real_tokens=real_tokens)
        with jax.named_scope("dense_mlp"):
            return self.mlp(x, c)

    def __call__(self, c: ModelConfig, i, stream, cache, attend, backend: Backend, real_tokens=None):
        """i: layer index (int, or traced inside the scan). stream: hidden states (or the AttnRes
        buffer); attend(attn, x, cache) -> (out, cache) runs this layer's attention module.
        real_tokens (traced int, an engine step's): the tokens from row real_tokens on are the shape
        bucket's padding, which the MoE routes to no expert (see MoE.__call__)."""
        eps = c.rms_norm_eps
        B = self.block_size
        mlp = lambda x: self.feed_forward(rms_norm(x, read(self.post_attn_norm), eps), c, backend,  # noqa: E731
                                          real_tokens)
        if not B:
            a, cache = attend(self.attn, rms_norm(stream, read(self.input_norm), eps), cache)
            h = stream + a
            return h + mlp(h), cache
        buf = stream
        h = self.attn_res.before_attn(buf, blocks_before(i, B), eps)
        n = blocks_before(i + 1, B)                         # this layer's block (a new one if i % B == 0)
        a, cache = attend(self.attn, rms_norm(h, read(self.input_norm), eps), cache)
        buf = add_to_source(buf, n, a)
        m_in = self.attn_res.before_mlp(buf, n, eps)
        buf = add_to_source(buf, n, mlp(m_in))
        return buf, cache


class DecoderBlock(List):
    """The repeating unit of layers (Kimi: KDA, KDA, KDA, MLA with the same MLP kind), layers
    `start` .. `start + unit - 1` of the config. The model stacks it over its repeats at construction
    (each parameter with a leading "layers" axis, k3jax.layers.module.stack_modules) and runs it by
    one scan; a call is one repeat: its layers read that repeat's parameters out of the stacks at the
    point of use (k3jax.layers.module.read / matmul). Its parameter tree is the list of its layers' trees."""

    def __init__(self, config: ModelConfig, start: int, unit: int, **kw):
        super().__init__([DecoderLayer(config, start + j, **kw) for j in range(unit)])
        self.start, self.unit = start, unit
        self.kinds = tuple(config.layer_types[start + j] for j in range(unit))

    def __call__(self, c: ModelConfig, r, stream, cache, attend, backend: Backend, real_tokens=None):
        """Repeat r (traced) of the unit: its layers in order. attend(j, attn, x, cache) -> (out,
        cache) runs position j's attention. real_tokens: see DecoderLayer."""
        with repeat(r, backend):
            for j, layer in enumerate(self):
                stream, cache = layer(c, self.start + r * self.unit + j, stream, cache,
                                      lambda m, x, ch, j=j: attend(j, m, x, ch), backend, real_tokens)
        return stream, cache
