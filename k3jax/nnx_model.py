"""The model as Flax NNX modules, used functionally.

`K3Model` (k3jax/model.py) is an `nnx.Module` tree: embedding, a `LayerStack` of `DecoderLayer`s
(attention `KDA` or `MLA`, MLP `DenseMLP` or `MoE` with `RoutedExperts`, `AttnRes` mixing weights):
unrolled head and tail layers around the repeating unit, one `DecoderBlock` whose parameters are
stacked over its repeats and which one scan runs over the repeat index (each layer reads its repeat's
parameters where it uses them: k3jax/layers/module.py `read` / `matmul`). Every parameter is an `nnx.Param` named as in the checkpoint and carrying the
logical axes it was declared with (k3jax/params.py; metadata `logical_axes`), which sharding/rules.py
maps to a mesh. Each module's variants are fixed from the config when it is built and its methods are
the layer maths (k3jax/layers/).

Used functionally, the way the JAX serving stacks do it: `split_model` splits a model once, at load,
into a `ModelGraph` (nnx graphdef + the state's tree structure) and the parameter tree of plain
arrays; a jitted step is a pure function of (params, pools, batch) that calls `graph.merge(params)`
inside the trace (`make_step`). No nnx.jit and no split or merge on the host per step: the jitted function gets
the same dict of arrays as before, so its dispatch costs the same.
"""
from __future__ import annotations

import jax
from flax import nnx

from k3jax.config import ModelConfig
from k3jax.expert_layout import experts_merged
from k3jax.layer_stack import layer_stack_plan, stack_layers
from k3jax.layers.common import AttnRes, DenseMLP, OutputAttnRes
from k3jax.layers.decoder import DecoderBlock, DecoderLayer
from k3jax.layers.kda import KDA
from k3jax.layers.mla import MLA
from k3jax.layers.module import Graph, Group, List, Module, split_module
from k3jax.layers.moe import MoE, RoutedExperts
from k3jax.model import K3Model, LayerStack
from k3jax.params import tree_parameter_count
from pallas_kernels.backend import Backend, resolve

__all__ = ["AttnRes", "DecoderBlock", "DecoderLayer", "DenseMLP", "Graph", "Group", "K3Model", "KDA", "LayerStack",
           "List", "MLA", "Module", "MoE", "ModelGraph", "make_step", "OutputAttnRes", "RoutedExperts", "graph_for", "logical_axes",
           "model_graph", "named_params", "split_model", "split_module", "summary"]


class ModelGraph(Graph):
    """A whole model's graph: merge(params) rebuilds the K3Model."""


def split_model(model: K3Model) -> tuple[ModelGraph, dict]:
    """(graph, params): once per model / runner, on the host. params is the dict of the model's own
    arrays, in the order of the nnx state's leaves (checked), so `graph.merge(params)` rebuilds it."""
    graph, params = split_module(model)
    return ModelGraph(graph.graphdef, graph.treedef), params


_graphs: dict = {}


def model_graph(config: ModelConfig, merged_experts: bool = False) -> ModelGraph:
    """The graph of a model of this config, from abstract parameters (nothing allocated;
    memoized: configs hold dicts, so they are keyed by repr)."""
    key = (repr(config), merged_experts)
    if key not in _graphs:
        _graphs[key] = split_model(K3Model(config, merged_experts=merged_experts))[0]
    return _graphs[key]


def graph_for(config: ModelConfig, params) -> ModelGraph:
    """The graph for a parameter tree of the model's layout (experts merged or not)."""
    return model_graph(config, experts_merged(params))


def make_step(config: ModelConfig, backend: Backend | None = None, graph: ModelGraph | None = None):
    """The engine step's body, the one every jitted step wraps (the engine's, the sharded one, the
    scratch-memory measurement): (params, pools, batch) -> (logits [N, V], pools), the model merged
    from `graph` and params inside the trace (graph None: the graph of the config and the params'
    layout; a checkpoint-layout tree is stacked in the trace), closed over one backend (None: detected now, once)."""
    backend = resolve(backend)

    def step(params, pools, batch):
        if graph is None:           # a tree of the checkpoint layout is stacked here (a copy in the step)
            params = stack_layers(params, config)
        model = (graph or graph_for(config, params)).merge(params)
        with jax.named_scope("model"):
            return model(batch.tokens, pools, batch, backend=backend)
    return step


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
        elif isinstance(v, List):
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
    plan = layer_stack_plan(c)
    by_index = dict(zip(plan.head, model.layers.head)) | dict(zip(plan.tail, model.layers.tail))
    block = model.layers.units if plan.repeats else ()
    scanned = {plan.layer(r, j): (u, plan.repeats) for j, u in enumerate(block) for r in range(plan.repeats)}
    rows = []
    for i in range(c.num_layers):
        layer, share = scanned.get(i, (by_index.get(i), 1))
        rows.append({"layer": i, "attention": type(layer.attn).__name__, "mlp": type(layer.mlp).__name__,
                     "scanned": i in scanned, "params": tree_parameter_count(layer.tree()) // share})
    return rows
