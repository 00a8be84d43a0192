"""Mixture of experts: sigmoid router, routed experts (bf16 or MXFP4), latent MoE, shared experts.

`MoE` / `RoutedExperts` are the layer's modules (variants fixed when built: MXFP4 or bf16 experts,
latent MoE with or without its norm, shared experts). The reference routed experts sort tokens by
expert (no dense one-hot) and run the three expert projections as grouped matmuls through `ops.gmm`
(jax.lax.ragged_dot semantics); on accelerators `ops.expert_mlp` runs the fused kernels.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from k3jax.config import ModelConfig
from k3jax.expert_layout import split_experts
from k3jax.layers.common import DenseMLP, glu_act, rms_norm, upcast
from k3jax.layers.module import Module, fill, matmul, param, read, stacked
from pallas_kernels import ops
from pallas_kernels.backend import Backend, resolve


def expert_weights(pe, dtype, mxfp4: bool):
    """(w1, w3, w2) as [E, in, out] arrays from an experts dict (merged gate/up split again: a copy);
    MXFP4 experts are dequantized on the fly."""
    pe = split_experts(pe)
    if not mxfp4:
        return pe["w1"], pe["w3"], pe["w2"]
    from pallas_kernels.moe.mxfp4 import dequantize_mxfp4
    return tuple(jnp.swapaxes(dequantize_mxfp4(pe[f"{n}_packed"], pe[f"{n}_scale"], dtype), -1, -2)
                 for n in ("w1", "w3", "w2"))


def sort_by_expert(ids, num_experts: int):
    """Flat (token, slot) pairs sorted by expert: (order [T*k], token of each row, group sizes [E])."""
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    group_sizes = jnp.zeros((num_experts,), jnp.int32).at[flat].add(1)
    return order, order // ids.shape[-1], group_sizes


def layer_experts(pe, layer):
    """One layer's experts out of stacked ones ([L, E, ...] leaves); layer None: pe itself."""
    return pe if layer is None else jax.tree_util.tree_map(lambda w: w[layer], pe)


def routed_experts_reference(pe, z, weights, ids, c: ModelConfig, backend: Backend | None = None, *,
                             mxfp4: bool | None = None):
    """The jnp formula, accumulated in fp32: sort by expert, three grouped matmuls, weighted scatter-add.
    pe: an experts dict, MXFP4 when `mxfp4` (None: the config's expert format)."""
    mxfp4 = c.expert_format == "mxfp4" if mxfp4 is None else mxfp4
    w1, w3, w2 = expert_weights(pe, z.dtype, mxfp4)
    order, tok, gs = sort_by_expert(ids, c.num_experts)
    xs = z[tok]
    h = glu_act(ops.gmm(xs, w1, gs, backend=backend), ops.gmm(xs, w3, gs, backend=backend), c)
    y = upcast(ops.gmm(h, w2, gs, backend=backend)) * weights.reshape(-1)[order][:, None]
    return jnp.zeros(z.shape, y.dtype).at[tok].add(y).astype(z.dtype)


def _is_merged(values: dict) -> bool:
    return "w13" in values or "w13_packed" in values


class RoutedExperts(Module):
    """The routed experts [E, ...] (bf16 w1/w3/w2, or MXFP4 packed values and E8M0 scales: `mxfp4`;
    gate and up as one w13 in the merged layout, k3jax.expert_layout: `merged`). E over "experts",
    the intermediate width over "expert_mlp" (MXFP4 in the checkpoint's [out, in] orientation, so
    w1/w3 carry it first and w2 last)."""

    def __init__(self, config: ModelConfig, *, merged: bool = False, dtype=jnp.bfloat16,
                 rngs: nnx.Rngs | None = None):
        c = config
        E, Dp, I = c.num_experts, c.expert_hidden, c.moe_intermediate_size
        into, out_of = ("experts", "expert_mlp", "expert_embed"), ("experts", "expert_embed", "expert_mlp")
        w = lambda shape, axes, kind="w": param(shape, axes, kind, dtype=dtype, rngs=rngs)  # noqa: E731
        self.mxfp4 = c.expert_format == "mxfp4"
        self.merged = merged
        if merged and self.mxfp4:
            self.w13_packed = w((E, 2 * I, Dp // 2), into, "mx_packed")
            self.w13_scale = w((E, 2 * I, Dp // 32), into, "mx_scale")
        elif merged:
            self.w13 = w((E, Dp, 2 * I), out_of)
        elif self.mxfp4:
            self.w1_packed = w((E, I, Dp // 2), into, "mx_packed")
            self.w1_scale = w((E, I, Dp // 32), into, "mx_scale")
            self.w3_packed = w((E, I, Dp // 2), into, "mx_packed")
            self.w3_scale = w((E, I, Dp // 32), into, "mx_scale")
        else:
            self.w1 = w((E, Dp, I), out_of)
            self.w3 = w((E, Dp, I), out_of)
        if self.mxfp4:
            self.w2_packed = w((E, Dp, I // 2), out_of, "mx_packed")
            self.w2_scale = w((E, Dp, I // 32), out_of, "mx_scale")
        else:
            self.w2 = w((E, I, Dp), into)

    @classmethod
    def of(cls, config, values: dict, **kwargs):
        """The experts over a dict of either layout (merged gate/up or not: read off its names)."""
        return fill(cls(config, **{"merged": _is_merged(values), **kwargs}), values)

    def at(self, layer=None, backend: Backend | None = None):
        """(experts dict, layer): the arrays the kernels take. layer given: the arrays are stacks
        over layers ([L, E, ...]) and the kernels read that layer's experts in place. Experts of a
        scanned block: the whole stacks and the current repeat where backend.experts_in_place (the
        kernels read it in place), else that repeat's slices (layer None)."""
        if layer is not None:
            return self.tree(), layer
        params = {name: p for name, p in vars(self).items() if isinstance(p, nnx.Param)}
        _, index = stacked(next(iter(params.values())))
        if index is not None and resolve(backend).experts_in_place:
            return {name: stacked(p)[0] for name, p in params.items()}, index
        return {name: read(p) for name, p in params.items()}, None

    def __call__(self, z, weights, ids, c: ModelConfig, layer=None, backend: Backend | None = None):
        """z [T, D'] -> sum_k weights[t, k] * expert_{ids[t, k]}(z[t]) (fused Pallas kernel on
        accelerators). layer: the experts are stacks over layers ([L, E, ...]) and the kernels read
        this layer's in place (see `at`)."""
        pe, layer = self.at(layer, backend)
        return ops.expert_mlp(z, ids, weights, pe, mxfp4=self.mxfp4, activation=c.hidden_act, situ_beta=c.situ_beta,
                              situ_linear_beta=c.situ_linear_beta, num_experts_total=c.num_experts, layer=layer,
                              backend=backend,
                              reference=lambda: routed_experts_reference(layer_experts(pe, layer), z, weights, ids,
                                                                         c, backend, mxfp4=self.mxfp4))


class MoE(Module):
    """Sigmoid router, routed experts (optionally in a latent space, optionally normed there), shared experts."""

    def __init__(self, config: ModelConfig, *, merged_experts: bool = False, dtype=jnp.bfloat16,
                 rngs: nnx.Rngs | None = None):
        c = config
        D = c.hidden_size
        self.latent = bool(c.routed_expert_hidden_size)
        self.latent_normed = self.latent and bool(c.latent_moe_norm)
        self.with_shared = bool(c.num_shared_experts)
        self.router = param((D, c.num_experts), ("embed", "routes"), "router", dtype=dtype, rngs=rngs)
        self.router_bias = param((c.num_experts,), ("routes",), "zeros32", dtype=dtype, rngs=rngs)
        self.experts = RoutedExperts(c, merged=merged_experts, dtype=dtype, rngs=rngs)
        if self.with_shared:
            self.shared = DenseMLP(c, c.moe_intermediate_size * c.num_shared_experts, dtype=dtype, rngs=rngs)
        if self.latent:
            self.latent_down = param((D, c.expert_hidden), ("embed", "mlp"), dtype=dtype, rngs=rngs)
            self.latent_up = param((c.expert_hidden, D), ("mlp", "embed"), dtype=dtype, rngs=rngs)
            if self.latent_normed:
                self.latent_norm = param((c.expert_hidden,), ("latent",), "norm", dtype=dtype, rngs=rngs)

    @classmethod
    def of(cls, config, values: dict, **kwargs):
        """The layer over a dict of either expert layout (read off the experts' names)."""
        merged = _is_merged(values.get("experts", {}))
        return fill(cls(config, **{"merged_experts": merged, **kwargs}), values)

    def route(self, x, c: ModelConfig):
        """Router in fp32. x [T, D] -> (weights [T, k] fp32, expert ids [T, k] int32).

        Chooses the top-k of sigmoid scores + correction bias; weights are the unbiased scores of the
        chosen experts, renormalized (optional) and scaled.
        """
        scores = jax.nn.sigmoid(upcast(x) @ upcast(read(self.router)))
        choice = scores + upcast(read(self.router_bias))
        E, G = c.num_experts, c.num_expert_group
        if G > 1:
            grouped = choice.reshape(-1, G, E // G)
            group_score = jax.lax.top_k(grouped, 2)[0].sum(-1)                    # [T, G]
            _, top_groups = jax.lax.top_k(group_score, c.topk_group)
            keep = jnp.zeros(group_score.shape, bool).at[
                jnp.arange(group_score.shape[0])[:, None], top_groups].set(True)
            choice = jnp.where(jnp.repeat(keep, E // G, axis=-1), choice, -jnp.inf)
        _, ids = jax.lax.top_k(choice, c.num_experts_per_token)
        w = jnp.take_along_axis(scores, ids, axis=-1)
        if c.moe_renormalize:
            w = w / (w.sum(-1, keepdims=True) + 1e-20)
        return w * c.routed_scaling_factor, ids.astype(jnp.int32)

    def __call__(self, x, c: ModelConfig, layer=None, backend: Backend | None = None, real_tokens=None):
        """x [..., D] -> [..., D]. layer: the routed experts hold every scanned layer's experts
        ([L, E, ...]) and this one runs. backend.routed_experts (expert parallelism,
        sharding/moe_ep.py) replaces the single-device routed experts. real_tokens (traced int): rows
        of x from it on are an engine step's bucket padding; they get no expert (an id past the experts,
        which every routed-experts path skips), so a one-sequence decode step in a 16-token bucket
        reads its own token's experts only, not 15 padding rows' as well (their outputs are never read)."""
        b = resolve(backend)
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        with jax.named_scope("moe_route"):
            weights, ids = self.route(x2, c)
            if real_tokens is not None:
                real = (jnp.arange(x2.shape[0]) < real_tokens)[:, None]
                ids = jnp.where(real, ids, c.num_experts)
                weights = jnp.where(real, weights, 0.0)
            z = matmul(x2, self.latent_down) if self.latent else x2
        with jax.named_scope("moe_experts"):
            if b.routed_experts is None:
                y = self.experts(z, weights, ids, c, layer, b)
            else:
                y = b.routed_experts(layer_experts(*self.experts.at(layer, b)), z, weights, ids, c, b)
        with jax.named_scope("moe_shared"):
            if self.latent_normed:
                y = rms_norm(y, read(self.latent_norm), c.rms_norm_eps)
            if self.latent:
                y = matmul(y, self.latent_up)
            if self.with_shared:
                y = y + self.shared(x2, c)
            return y.reshape(shape)
