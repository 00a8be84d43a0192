"""The base of the layer modules: an nnx.Module built from a parameter spec (k3jax/params.py).

Each parameter becomes an `nnx.Param` named as in the checkpoint, carrying its logical axes; a
sub-dict of the spec becomes a child module. Subclasses read their variants (MXFP4 experts, low-rank
queries, ...) from the config when they are built and keep them as plain attributes, so their
methods (the layer maths) branch on those, never on which keys a parameter dict holds.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
from flax import nnx

from k3jax.config import ModelConfig
from k3jax.params import Leaf

# flax >= 0.12 wants lists of modules wrapped (older flax took plain lists as pytree attributes)
List = getattr(nnx, "List", list)


def value(p: nnx.Param):
    """A Param's array (get_value where flax has it; .value is deprecated there)."""
    get = getattr(p, "get_value", None)
    return get() if get is not None else p.value


class StackedWeight:
    """A scanned layer's weight left in its stack ([L, K, N]) with the layer's index, standing in for
    the layer's [K, N] slice: `x @ w` reads it in place (ops.stacked_matmul). Only the parameters a
    Group lists in `right_operands` become one, so any other use fails at trace time."""

    __slots__ = ("stack", "index", "backend")

    def __init__(self, stack, index, backend):
        self.stack, self.index, self.backend = stack, index, backend

    def __rmatmul__(self, x):
        from pallas_kernels import ops
        return ops.stacked_matmul(x, self.stack, self.index, backend=self.backend)


class Group(nnx.Module):
    """Named parameters (nnx.Param with logical axes) and sub-groups of one part of the model."""

    _children: dict = {}        # attribute name -> Group subclass for a sub-dict (default: Group)
    right_operands: tuple = ()  # parameters whose only use is `x @ w` (a scan may pass StackedWeights)
    spec_for = None             # config -> this group's spec, for `of` (a staticmethod where set)

    def __init__(self, spec: dict, values: dict, config: ModelConfig):
        missing = [name for name in spec if name not in values]
        if missing:
            raise ValueError(f"{type(self).__name__}: no parameter(s) {missing} in {sorted(values)}; the config's "
                             "variant needs them (parameters made or converted for another config?)")
        for name, leaf in spec.items():
            if isinstance(leaf, Leaf):
                setattr(self, name, nnx.Param(values[name], logical_axes=leaf.axes))
            else:
                setattr(self, name, self._child(name, leaf, config)(leaf, values[name], config))

    def _child(self, name: str, spec: dict, config: ModelConfig) -> type:
        return self._children.get(name, Group)

    @classmethod
    def of(cls, config: ModelConfig, values: dict):
        """The module over a parameter dict of one layer part (scripts and tests holding such dicts)."""
        return cls(cls.spec_for(config), values, config)

    def tree(self) -> dict:
        """The parameters as a dict of arrays (the same arrays), named as in the checkpoint."""
        out = {}
        for name, v in vars(self).items():
            if isinstance(v, nnx.Param):
                out[name] = value(v)
            elif isinstance(v, Group):
                out[name] = v.tree()
            elif isinstance(v, List):
                out[name] = [x.tree() for x in v]
        return out


def right_operand_mask(module: Group) -> dict:
    """module.tree()'s layout with True at the parameters listed in their Group's right_operands."""
    out = {}
    for name, v in vars(module).items():
        if isinstance(v, nnx.Param):
            out[name] = name in module.right_operands
        elif isinstance(v, Group):
            out[name] = right_operand_mask(v)
        elif isinstance(v, List):
            out[name] = [right_operand_mask(x) for x in v]
    return out


@dataclasses.dataclass(frozen=True, eq=False)
class Graph:
    """What splitting a module leaves besides its arrays: nnx's graphdef and the state's tree structure."""
    graphdef: Any
    treedef: Any

    def merge(self, params):
        """The module over `params` (a tree of arrays in the split layout; inside a trace, tracers)."""
        leaves = jax.tree_util.tree_leaves(params)
        if len(leaves) != self.treedef.num_leaves:
            raise ValueError(f"{len(leaves)} parameter arrays for a model graph of {self.treedef.num_leaves}")
        return nnx.merge(self.graphdef, jax.tree_util.tree_unflatten(self.treedef, leaves))


def split_module(module: Group) -> tuple[Graph, dict]:
    """(graph, module.tree()): the parameter dict is in the order of the nnx state's leaves (checked),
    so `graph.merge(tree)` rebuilds the module, with its variants, over other arrays of that layout."""
    graphdef, state = nnx.split(module)
    leaves, treedef = jax.tree_util.tree_flatten(state)
    params = module.tree()
    if any(a is not b for a, b in zip(jax.tree_util.tree_leaves(params), leaves)) or \
            len(jax.tree_util.tree_leaves(params)) != len(leaves):
        raise AssertionError("the nnx state's leaf order differs from the parameter tree's")
    return Graph(graphdef, treedef), params
