"""The model as Flax NNX modules, used functionally.

`K3Model` is an `nnx.Module` tree: embedding, one `DecoderLayer` per layer (attention `KDA` or `MLA`,
MLP `DenseMLP` or `MoE` with `RoutedExperts`, `AttnRes` mixing weights), or in the scan layout a
`LayerStack` whose `units` hold each unit position's parameters stacked over the scanned repeats.
Every parameter is an `nnx.Param` named as in the checkpoint and carrying the logical axes it was
declared with (k3jax/params.py; metadata `logical_axes`), which sharding/rules.py maps to a mesh.

Used functionally, the way the JAX serving stacks do it: `split_model` splits a model once, at load,
into a `ModelGraph` (nnx graphdef + the state's tree structure) and the parameter tree of plain
arrays; a jitted step is a pure function of (params, pools, batch) that calls `graph.merge(params)`
inside the trace. No nnx.jit and no split or merge on the host per step: the jitted function gets
the same dict of arrays as before, so its dispatch costs the same. The modules' `__call__` / `step`
run the functional core (k3jax/model.py: the layer math, the scan over stacked layers, the cache
pools) on their parameters, so both paths give identical results by construction.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from flax import nnx

from k3jax.config import ModelConfig
from k3jax.layer_stack import is_stacked, layer_stack_plan
from k3jax.params import Leaf, is_leaf, param_spec, tree_parameter_count

# split_model / ModelGraph.merge calls in this process (tests check the runner splits once and only
# merges while tracing).
COUNTS = {"split": 0, "merge": 0}

# flax >= 0.12 wants lists of modules wrapped (older flax took plain lists as pytree attributes)
_List = getattr(nnx, "List", list)


def _value(p: nnx.Param):
    """A Param's array (get_value where flax has it; .value is deprecated there)."""
    get = getattr(p, "get_value", None)
    return get() if get is not None else p.value


class Group(nnx.Module):
    """Named parameters (nnx.Param with logical axes) and sub-groups of one part of the model."""

    _children: dict = {}        # attribute name -> Group subclass for a sub-dict (default: Group)

    def __init__(self, spec: dict, values: dict, config: ModelConfig):
        for name, leaf in spec.items():
            if isinstance(leaf, Leaf):
                setattr(self, name, nnx.Param(values[name], logical_axes=leaf.axes))
            else:
                setattr(self, name, self._child(name, leaf, config)(leaf, values[name], config))

    def _child(self, name: str, spec: dict, config: ModelConfig) -> type:
        return self._children.get(name, Group)

    def tree(self) -> dict:
        """The parameters as the functional core takes them: a dict of arrays (the same arrays)."""
        out = {}
        for name, v in vars(self).items():
            if isinstance(v, nnx.Param):
                out[name] = _value(v)
            elif isinstance(v, Group):
                out[name] = v.tree()
            elif isinstance(v, _List):
                out[name] = [x.tree() for x in v]
        return out


class KDA(Group):
    """Kimi Delta Attention: q/k/v projections with short convolutions, the gated delta rule's
    decay (A_log, dt_bias, f_a/f_b) and beta (b_proj), output norm and gate."""


class MLA(Group):
    """Multi-head latent attention (no rotary): low-rank queries, the 576-wide latent cache entry."""


class DenseMLP(Group):
    """gate/up/down GLU MLP (the dense first layer, shared experts)."""


class RoutedExperts(Group):
    """The routed experts [E, ...] (bf16 w1/w3/w2, or MXFP4 packed values and E8M0 scales)."""


class MoE(Group):
    """Sigmoid router, routed experts (optionally in a latent space), shared experts."""
    _children = {"experts": RoutedExperts, "shared": DenseMLP}


class AttnRes(Group):
    """Attention Residuals: the learned query vectors and norms that mix earlier blocks' outputs."""


class DecoderLayer(Group):
    """input norm -> attention (KDA or MLA) -> post-attention norm -> MLP (dense or MoE)."""

    def _child(self, name, spec, config):
        if name == "attn":
            return MLA if "kv_a_proj" in spec else KDA
        if name == "mlp":
            return MoE if "router" in spec else DenseMLP
        if name == "attn_res":
            return AttnRes
        return Group


def _layers(specs, values, config):
    return _List([DecoderLayer(s, v, config) for s, v in zip(specs, values)])


class LayerStack(nnx.Module):
    """The scan layout: unrolled `head` layers, the scanned `units` (one DecoderLayer per position of
    the repeating unit, each parameter with a leading "layers" axis over the repeats), `tail` layers."""

    def __init__(self, spec: dict, values: dict, config: ModelConfig):
        for part in ("head", "units", "tail"):
            setattr(self, part, _layers(spec[part], values[part], config))

    def tree(self) -> dict:
        return {part: [x.tree() for x in getattr(self, part)] for part in ("head", "units", "tail")}


class K3Model(Group):
    """A Kimi K3 / Kimi Linear decoder (see the module docstring). `K3Model(config, params)` wraps a
    parameter tree in either layout (no copies); `model(tokens)` gives logits, `model.step(pools,
    batch)` runs an engine step."""

    def __init__(self, config: ModelConfig, params: dict):
        self.config = config
        spec = param_spec(config, stacked=is_stacked(params))
        for name, leaf in spec.items():
            if name == "layers":
                self.layers = (LayerStack(leaf, params[name], config) if isinstance(leaf, dict)
                               else _layers(leaf, params[name], config))
            elif isinstance(leaf, Leaf):
                setattr(self, name, nnx.Param(params[name], logical_axes=leaf.axes))
            else:
                setattr(self, name, AttnRes(leaf, params[name], config))

    def tree(self) -> dict:
        out = super().tree()
        out["layers"] = self.layers.tree() if isinstance(self.layers, LayerStack) else [x.tree() for x in self.layers]
        return out

    def __call__(self, tokens, mm_embeds=None, mm_mask=None, *, backend=None):
        """tokens int32 [B, T] -> logits fp32 [B, T, V] (k3jax.model.forward_full)."""
        from k3jax.model import forward_full
        return forward_full(self.tree(), self.config, tokens, mm_embeds, mm_mask, backend=backend)

    def step(self, pools, batch, *, backend=None):
        """One engine step over the cache pools -> (logits [N, V], pools) (k3jax.model.forward_step)."""
        from k3jax.model import forward_step
        return forward_step(self.tree(), self.config, pools, batch, backend)


# ---- functional use ------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True, eq=False)
class ModelGraph:
    """What a split leaves besides the arrays: nnx's graphdef and the state's tree structure."""
    graphdef: Any
    treedef: Any

    def merge(self, params) -> K3Model:
        """The module over `params` (a parameter tree in the split layout; inside a trace, tracers)."""
        COUNTS["merge"] += 1
        leaves = jax.tree_util.tree_leaves(params)
        if len(leaves) != self.treedef.num_leaves:
            raise ValueError(f"{len(leaves)} parameter arrays for a model graph of {self.treedef.num_leaves}")
        return nnx.merge(self.graphdef, jax.tree_util.tree_unflatten(self.treedef, leaves))


def split_model(model: K3Model) -> tuple[ModelGraph, dict]:
    """(graph, params): once per model / runner, on the host. params is the dict of the model's own
    arrays, in the order of the nnx state's leaves (checked), so `graph.merge(params)` rebuilds it."""
    COUNTS["split"] += 1
    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree_util.tree_flatten(state)
    params = model.tree()
    if any(a is not b for a, b in zip(jax.tree_util.tree_leaves(params), leaves)) or \
            len(jax.tree_util.tree_leaves(params)) != len(leaves):
        raise AssertionError("the nnx state's leaf order differs from the parameter tree's")
    return ModelGraph(graphdef, treedef), params


_graphs: dict = {}


def model_graph(config: ModelConfig, stacked: bool) -> ModelGraph:
    """The graph of a model of this config and layout, from abstract parameters (nothing allocated;
    memoized: configs hold dicts, so they are keyed by repr)."""
    key = (repr(config), stacked)
    if key not in _graphs:
        shapes = jax.tree_util.tree_map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, np.float32),
                                        param_spec(config, stacked=stacked), is_leaf=is_leaf)
        _graphs[key] = split_model(K3Model(config, shapes))[0]
    return _graphs[key]


def graph_for(config: ModelConfig, params) -> ModelGraph:
    """The graph for a parameter tree of either layout."""
    return model_graph(config, is_stacked(params))


# ---- inspection ----------------------------------------------------------------------------------

def named_params(module, prefix: str = "") -> dict[str, nnx.Param]:
    """{'layers.0.attn.q_proj': Param, ...}: every parameter by its checkpoint path (walks the module's
    attributes, so it does not depend on how a flax version flattens its state)."""
    out = {}
    for name, v in vars(module).items():
        if isinstance(v, nnx.Param):
            out[prefix + name] = v
        elif isinstance(v, nnx.Module):
            out.update(named_params(v, f"{prefix}{name}."))
        elif isinstance(v, _List):
            for i, x in enumerate(v):
                out.update(named_params(x, f"{prefix}{name}.{i}."))
    return out


def logical_axes(model: nnx.Module) -> dict[str, tuple]:
    """{'layers.0.attn.q_proj': ('embed', 'kda_heads'), ...} for every parameter."""
    return {path: tuple(p.logical_axes) for path, p in named_params(model).items()}


def summary(model: K3Model) -> list[dict]:
    """One row per decoder layer: index, attention and MLP module types, parameter count (as
    k3jax.info counts them: MXFP4 bytes hold two, scales are none; a scanned position's parameters
    split evenly over its repeats)."""
    c = model.config
    if isinstance(model.layers, LayerStack):
        plan = layer_stack_plan(c)
        by_index = dict(zip(plan.head, model.layers.head)) | dict(zip(plan.tail, model.layers.tail))
        scanned = {plan.layer(r, j): (u, plan.repeats) for j, u in enumerate(model.layers.units)
                   for r in range(plan.repeats)}
    else:
        by_index, scanned = dict(enumerate(model.layers)), {}
    rows = []
    for i in range(c.num_layers):
        layer, share = scanned.get(i, (by_index.get(i), 1))
        rows.append({"layer": i, "attention": type(layer.attn).__name__, "mlp": type(layer.mlp).__name__,
                     "scanned": i in scanned, "params": tree_parameter_count(layer.tree()) // share})
    return rows
