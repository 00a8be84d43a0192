"""The base of the layer modules: parameters declared by the module that uses them.

Each layer's `__init__` declares its parameters with `param(...)`: shape, dtype (the model's, or
fp32 / uint8 for the kinds that need it), logical axes (one name per dimension; sharding/rules.py
maps them to a mesh) and initializer kind (the distributions in `init_value`). What a declared
parameter holds depends on `rngs`:
  rngs an nnx.Rngs   random values (the initializer, one key per parameter from rngs.params());
  rngs None          the abstract value, a jax.ShapeDtypeStruct (nothing allocated); so does
                     nnx.eval_shape(lambda: Module(config, rngs=nnx.Rngs(0))).
An abstract module is filled with arrays by `fill` (the checkpoint loaders' dicts, named as in the
checkpoint): `Module.of(config, values)`. Variants (MXFP4 experts, low-rank queries, ...) are read
from the config when a module is built and kept as plain attributes, so the layer maths branch on
those, never on which keys a parameter dict holds. The layer maths read their parameters with
`read(p)` and `x @ w` as `matmul(x, p)`: the same arrays in an unscanned layer; in a block stacked
over a scan's repeats, the current repeat's, sliced or read in place in the stack (see below).
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pallas_kernels import ops

# flax >= 0.12 wants lists of modules wrapped (older flax took plain lists as pytree attributes)
List = getattr(nnx, "List", list)

FP32_KINDS = {"A_log", "dt_bias", "router", "zeros32"}
INIT_STD = 0.02       # the router's init std (every other weight: fan_in ** -0.5)


@dataclasses.dataclass(frozen=True)
class Leaf:
    """A declared parameter's record: shape, initializer kind, logical axes (read off a module's
    Params by `Module.spec`)."""
    shape: tuple[int, ...]
    kind: str = "w"          # w | norm | A_log | dt_bias | router | zeros32 | mx_packed | mx_scale | conv
    axes: tuple[str, ...] = ()   # one logical axis name per dimension (sharding/rules.py maps them to a mesh)

    def dtype(self, dtype):
        if self.kind in FP32_KINDS:
            return jnp.float32
        if self.kind in ("mx_packed", "mx_scale"):
            return jnp.uint8
        return dtype


def is_leaf(x) -> bool:
    return isinstance(x, Leaf)


class JaxRandom:
    """Random source over one jax key (init under jit, on any device)."""
    xp = jnp

    def __init__(self, key):
        self.key = key

    def normal(self, shape):
        return jax.random.normal(self.key, shape, jnp.float32)

    def uniform(self, shape, lo, hi):
        return jax.random.uniform(self.key, shape, jnp.float32, lo, hi)

    def randint(self, shape, lo, hi):
        return jax.random.randint(self.key, shape, lo, hi, jnp.int32)


class NumpyRandom:
    """Random source over a numpy Generator: instant on a CPU host (XLA compiles of many
    threefry calls take tens of seconds there), and identical on every platform."""
    xp = np

    def __init__(self, rng):
        self.rng = rng

    def normal(self, shape):
        return self.rng.standard_normal(shape, np.float32)

    def uniform(self, shape, lo, hi):
        return self.rng.uniform(lo, hi, shape).astype(np.float32)

    def randint(self, shape, lo, hi):
        return self.rng.integers(lo, hi, shape, np.int32)


def init_value(leaf: Leaf, r, dtype, std: float = INIT_STD):
    """A random value of a declared parameter from random source `r` (JaxRandom or NumpyRandom)."""
    shape, dt, xp = leaf.shape, leaf.dtype(dtype), r.xp
    k = leaf.kind
    if k == "norm":
        # Near one, not exactly one, so that a wrong norm weight shows up in parity tests.
        return (1.0 + 0.1 * r.normal(shape)).astype(dt)
    if k == "zeros32":
        return 0.01 * r.normal(shape)
    if k == "A_log":
        return xp.log(r.uniform(shape, 1.0, 16.0))
    if k == "dt_bias":
        dt_ = xp.exp(r.uniform(shape, np.log(1e-3), np.log(1e-1)))
        return (dt_ + xp.log(-xp.expm1(-dt_))).astype(np.float32)  # inverse softplus
    if k == "conv":
        return (r.normal(shape) * 0.5).astype(dt)
    if k == "mx_packed":
        return r.randint(shape, 0, 256).astype(np.uint8)
    if k == "mx_scale":
        # 2^-6 .. 2^-4: MXFP4 values of magnitude <= 6 * 2^-4, like a trained expert's weights.
        return r.randint(shape, 121, 124).astype(np.uint8)
    fan_in = shape[-2] if len(shape) >= 2 else shape[-1]
    scale = std if k == "router" else fan_in ** -0.5
    return (r.normal(shape) * scale).astype(dt)


def param(shape, axes, kind: str = "w", *, dtype, rngs: nnx.Rngs | None) -> nnx.Param:
    """A declared parameter: random (rngs) or abstract (rngs None), with its logical axes and
    initializer kind as metadata (`logical_axes`, `init_kind`)."""
    leaf = Leaf(tuple(int(d) for d in shape), kind, tuple(axes))
    if len(leaf.axes) != len(leaf.shape):
        raise ValueError(f"logical axes {leaf.axes} for a parameter of shape {leaf.shape}")
    if rngs is None:
        v = jax.ShapeDtypeStruct(leaf.shape, leaf.dtype(dtype))
    else:
        v = init_value(leaf, JaxRandom(rngs.params()), dtype)
    return nnx.Param(v, logical_axes=leaf.axes, init_kind=kind)


def value(p: nnx.Param):
    """A Param's array (get_value where flax has it; .value is deprecated there)."""
    get = getattr(p, "get_value", None)
    return get() if get is not None else p.value


def _set(p: nnx.Param, x):
    setter = getattr(p, "set_value", None)
    if setter is not None:
        setter(x)
    else:
        p.value = x


# ---- reading parameters at the point of use ------------------------------------------------------
# A block stacked over a scan's repeats (stack_modules: a leading "layers" axis) keeps its parameters
# whole; the scan passes only the repeat index, which the block makes current for its layers
# (`repeat`). The layer maths read every parameter through `read` (the current repeat's slice of a
# stacked one) or, for a weight used as `x @ w`, `matmul`, which reads it in place in its stack
# (ops.stacked_matmul) where the backend says so. Kernels that index a stack themselves (the routed
# experts) take the whole stack and the index (`stacked`).

@dataclasses.dataclass(frozen=True)
class Repeat:
    """The scanned repeat being traced: its index (traced int32) and the backend of the step."""
    index: Any
    backend: Any


_REPEAT: contextvars.ContextVar[Repeat | None] = contextvars.ContextVar("k3jax_repeat", default=None)


@contextlib.contextmanager
def repeat(index, backend):
    """Within: parameters stacked over the repeats read repeat `index` (per thread: contextvars)."""
    token = _REPEAT.set(Repeat(index, backend))
    try:
        yield
    finally:
        _REPEAT.reset(token)


def _is_stacked(p: nnx.Param) -> bool:
    """Whether a parameter is stacked over a scan's repeats (its leading logical axis "layers")."""
    axes = tuple(getattr(p, "logical_axes", ()) or ())
    return bool(axes) and axes[0] == "layers"


def stacked(p: nnx.Param):
    """(array, index): a stacked parameter's whole stack and the current repeat's index, for kernels
    that read one repeat in place; (array, None) for a parameter of an unscanned layer."""
    if not _is_stacked(p):
        return value(p), None
    current = _REPEAT.get()
    if current is None:
        raise ValueError("a parameter stacked over the scanned repeats was read outside a repeat "
                         "(the block's call makes its repeat current)")
    return value(p), current.index


def read(p: nnx.Param):
    """A parameter's array for the running layer: a stacked one's slice of the current repeat."""
    w, r = stacked(p)
    return w if r is None else _slice(w, r)


def matmul(x, p: nnx.Param):
    """x @ read(p); a stacked weight is read in place in its stack (no slice copied) where the
    step's backend sets dense_in_place (ops.stacked_matmul: few-row steps on the GPU kernels)."""
    w, r = stacked(p)
    backend = _in_place([(w, r)])
    if backend is not None:
        return ops.stacked_matmul(x, w, r, backend=backend)
    return x @ (w if r is None else _slice(w, r))


def _in_place(stacks):
    """The step's backend where every (array, index) of `stacks` is a stacked weight to read in place
    (dense_in_place), else None."""
    current = _REPEAT.get()
    if current is None or current.backend is None or not current.backend.dense_in_place:
        return None
    return current.backend if all(r is not None for _, r in stacks) else None


def matmuls(*pairs):
    """[x @ read(p) for (x, p) in pairs]: where the step reads stacked weights in place, one kernel launch
    for all of them (ops.stacked_matmuls: a decode step's small projections of one input cost a launch
    each otherwise); elsewhere `matmul` each."""
    stacks = [stacked(p) for _, p in pairs]
    backend = _in_place(stacks)
    if backend is None:
        return [matmul(x, p) for x, p in pairs]
    return ops.stacked_matmuls([(x, w) for (x, _), (w, _) in zip(pairs, stacks)], stacks[0][1], backend=backend)


def glu(x, gate: nnx.Param, up: nnx.Param, act):
    """act(x @ read(gate), x @ read(up)) (act on x.dtype values): where the step reads stacked weights in
    place, one kernel launch with act in its epilogue (ops.stacked_glu)."""
    stacks = [stacked(gate), stacked(up)]
    backend = _in_place(stacks)
    if backend is None:
        return act(matmul(x, gate), matmul(x, up))
    return ops.stacked_glu(x, stacks[0][0], stacks[1][0], stacks[0][1], act, backend=backend)


def _slice(w, r):
    # as lax.scan slices its inputs: r is a repeat's index, never negative (no wrap-around select)
    return jax.lax.dynamic_index_in_dim(w, r, keepdims=False, allow_negative_indices=False)


def _children(module):
    """(name, Param | Module | List) of a module's parameters and sub-modules, in declaration order
    (a List's: its items, named by position)."""
    if isinstance(module, List):
        yield from ((str(i), v) for i, v in enumerate(module))
        return
    for name, v in vars(module).items():
        if isinstance(v, (nnx.Param, Module, List)):
            yield name, v


class Module(nnx.Module, pytree=False):
    """A part of the model with the parameters it declares (nnx.Param with logical axes)."""

    @classmethod
    def of(cls, config, values: dict, **kwargs):
        """The module (abstract, then filled) over a parameter dict of this part, named as in the
        checkpoint (scripts and tests holding such dicts). kwargs: the constructor's layout options."""
        return fill(cls(config, **kwargs), values)

    def tree(self) -> dict:
        """The parameters as a dict of arrays (the same arrays), named as in the checkpoint."""
        return tree_of(self)

    def spec(self) -> dict:
        """The declared parameters as a dict of Leaf (shape, initializer kind, logical axes)."""
        return _walk(self, lambda p: Leaf(tuple(value(p).shape), p.init_kind, tuple(p.logical_axes)))


Group = Module      # the former name


def _walk(module, leaf_fn):
    if isinstance(module, List):
        return [_walk(x, leaf_fn) for x in module]
    out = {}
    for name, v in _children(module):
        if isinstance(v, nnx.Param):
            out[name] = leaf_fn(v)
        elif isinstance(v, List):
            out[name] = [_walk(x, leaf_fn) for x in v]
        else:
            out[name] = _walk(v, leaf_fn)
    return out


def fill(module, values):
    """Sets every declared parameter of `module` to the array of the same name in `values` (a dict
    of its layout; arrays or tracers, used as they are, no copies); returns the module. ValueError
    naming the module and the parameters when `values` lacks some (parameters made or converted
    for another config's variant)."""
    if isinstance(module, List):
        for m, v in zip(module, values):
            fill(m, v)
        return module
    children = list(_children(module))
    missing = [name for name, _ in children if name not in values]
    if missing:
        raise ValueError(f"{type(module).__name__}: no parameter(s) {missing} in {sorted(values)}; the config's "
                         "variant needs them (parameters made or converted for another config?)")
    for name, v in children:
        if isinstance(v, nnx.Param):
            _set(v, values[name])
        else:
            fill(v, values[name])
    return module


def stack_modules(modules: list, repeats: int | None = None):
    """One module whose parameters are those of `modules` (same class and layout) stacked on a new
    leading axis, the logical axis "layers" (the scan layout). Abstract modules stack abstractly:
    one stands for `repeats` (default: as many as given)."""
    first = modules[0]
    repeats = len(modules) if repeats is None else repeats
    params = [dict(_named(m)) for m in modules]
    for path, p in _named(first):
        xs = [ps[path] for ps in params]
        x0 = value(xs[0])
        if isinstance(x0, jax.ShapeDtypeStruct):
            stacked = jax.ShapeDtypeStruct((repeats,) + tuple(x0.shape), x0.dtype)
        else:
            if len(xs) != repeats:
                raise ValueError(f"{len(xs)} modules of values to stack as {repeats}")
            stacked = jnp.stack([value(x) for x in xs])
        _set(p, stacked)
        axes = ("layers",) + tuple(p.logical_axes)
        if hasattr(p, "set_metadata"):
            p.set_metadata(logical_axes=axes)
        else:
            p.logical_axes = axes
    return first


def _named(module, prefix=""):
    for name, v in _children(module):
        if isinstance(v, nnx.Param):
            yield prefix + name, v
        elif isinstance(v, List):
            for i, x in enumerate(v):
                yield from _named(x, f"{prefix}{name}.{i}.")
        else:
            yield from _named(v, f"{prefix}{name}.")


def tree_of(module) -> dict | list:
    """A Module's or List's parameters as a dict (a list for a List) of arrays, named as in the checkpoint."""
    return _walk(module, value)


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


def split_module(module: Module) -> tuple[Graph, dict]:
    """(graph, tree_of(module)): the parameter dict is in the order of the nnx state's leaves (checked),
    so `graph.merge(tree)` rebuilds the module, with its variants, over other arrays of that layout."""
    graphdef, state = nnx.split(module)
    leaves, treedef = jax.tree_util.tree_flatten(state)
    params = tree_of(module)
    if any(a is not b for a, b in zip(jax.tree_util.tree_leaves(params), leaves)) or \
            len(jax.tree_util.tree_leaves(params)) != len(leaves):
        raise AssertionError("the nnx state's leaf order differs from the parameter tree's")
    return Graph(graphdef, treedef), params
