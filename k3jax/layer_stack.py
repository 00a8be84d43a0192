"""Which layers run as one scanned block, and the parameter layout that scanning needs.

Kimi Linear and K3 repeat (KDA, KDA, KDA, MLA) with the same MLP kind; only a dense first layer
and a short tail break the pattern. `layer_stack_plan` finds the longest run of a repeating unit
(the model's `DecoderBlock`); `stack_layers` turns the checkpoint layout (params["layers"] a list,
one dict per layer) into the model's layout (params["layers"] = {"head": [...], "units": [U trees
stacked over the run], "tail": [...]}; no "units" when nothing repeats), once at load, so a step
never copies weights. `unstack_layers` goes back (names stay those of the checkpoint): checkpoint
export and per-layer inspection.
"""
from __future__ import annotations

import dataclasses
from functools import lru_cache

import jax
import jax.numpy as jnp

from k3jax.config import ModelConfig

MAX_UNIT = 8


@dataclasses.dataclass(frozen=True)
class LayerStackPlan:
    start: int          # first scanned layer
    unit: int           # layers per scanned unit
    repeats: int        # units in the scan (0: nothing scanned)
    num_layers: int

    @property
    def stop(self) -> int:
        return self.start + self.unit * self.repeats

    @property
    def head(self) -> range:
        return range(0, self.start)

    @property
    def tail(self) -> range:
        return range(self.stop, self.num_layers)

    def layer(self, repeat: int, position: int) -> int:
        return self.start + repeat * self.unit + position


def layer_stack_plan(c: ModelConfig) -> LayerStackPlan:
    """The (start, unit) whose repeats cover most layers (ties: smaller unit, earlier start).
    Layer 0 stays unrolled in AttnRes models: it starts the block history (see model._decoder)."""
    return _plan(tuple(zip(c.layer_types, c.mlp_types)), bool(c.attn_res_block_size))


@lru_cache(maxsize=64)
def _plan(sig: tuple, attn_res: bool) -> LayerStackPlan:
    L = len(sig)
    best = LayerStackPlan(0, 1, 0, L)
    first = 1 if attn_res else 0
    for unit in range(1, MAX_UNIT + 1):
        for start in range(first, min(first + unit, L)):
            n = 0
            while start + (n + 1) * unit <= L and all(
                    sig[start + n * unit + j] == sig[start + j] for j in range(unit)):
                n += 1
            if n >= 2 and n * unit > best.unit * best.repeats:
                best = LayerStackPlan(start, unit, n, L)
    return best


def is_stacked(params) -> bool:
    return isinstance(params["layers"], dict)


def _stack_arrays(xs, donate: bool):
    """Same-shaped arrays stacked on a new leading axis, keeping their sharding. donate: free each
    source once it is stacked, so loading peaks at one stacked leaf over the weights."""
    if isinstance(xs[0], jax.ShapeDtypeStruct):       # abstract parameters stack abstractly
        return jax.ShapeDtypeStruct((len(xs),) + tuple(xs[0].shape), xs[0].dtype)
    try:
        sh = xs[0].sharding                 # tracers (eval_shape, jit) have none to keep
    except Exception:
        sh = None
    if isinstance(sh, jax.sharding.NamedSharding):
        out = jax.sharding.NamedSharding(sh.mesh, jax.sharding.PartitionSpec(None, *sh.spec))
        y = jax.jit(lambda *a: jnp.stack(a), out_shardings=out)(*xs)
    else:
        y = jnp.stack(xs)
    if donate and sh is not None:
        for x in xs:
            x.delete()
    return y


def stack_layers(params, c: ModelConfig, donate: bool = False, stack=None):
    """Checkpoint layout -> scan layout (returned unchanged if already stacked).
    donate: the stacked layers' arrays in `params` are deleted (the caller owns them; load_model).
    stack(list of one leaf per repeat) -> stacked leaf: arrays by default; k3jax.params stacks the
    parameter spec's leaves with it."""
    if is_stacked(params):
        return params
    plan = layer_stack_plan(c)
    one = stack or (lambda xs: _stack_arrays(xs, donate))
    layers = params["layers"]
    out = dict(params)
    out["layers"] = {"head": [layers[i] for i in plan.head], "tail": [layers[i] for i in plan.tail]}
    if plan.repeats:
        out["layers"]["units"] = [
            jax.tree_util.tree_map(lambda *xs: one(list(xs)), *[layers[plan.layer(r, j)] for r in range(plan.repeats)])
            for j in range(plan.unit)]
    return out


def unstack_layers(params, c: ModelConfig, take=None, is_leaf=None):
    """Scan layout -> checkpoint layout (params["layers"] a list of per-layer dicts). take(leaf, r):
    repeat r of a stacked leaf (default: the array's slice; k3jax.params unstacks spec leaves)."""
    if not is_stacked(params):
        return params
    plan = layer_stack_plan(c)
    take = take or (lambda x, r: x[r])
    st = params["layers"]
    layers = list(st["head"])
    for r in range(plan.repeats):
        for j in range(plan.unit):
            layers.append(jax.tree_util.tree_map(lambda x: take(x, r), st["units"][j], is_leaf=is_leaf))
    layers += st["tail"]
    out = dict(params)
    out["layers"] = layers
    return out
