"""Partition rules: every parameter and cache-pool leaf gets a PartitionSpec.

Parameters declare their LOGICAL axes where they are created, in their module's __init__
(k3jax/layers/: one name per dimension, e.g. q_proj ("embed", "kda_heads"), routed experts
("experts", "expert_embed", "expert_mlp"), a scanned stack's leading "layers"; read off the
modules as k3jax.params.param_spec); LOGICAL_AXES maps those names to mesh axes.
Cache pools declare theirs on their fields (k3jax/cache.py, CachePools.pool_axes), the vision
tower's modules on their parameters (k3jax/vision/tower.py: replicated).

Logical axes -> mesh axes (docs/sharding.md explains the choices):
  kda_heads, mla_heads  tensor   attention heads (head-aligned: the head count must divide)
  mlp         tensor          dense MLP / shared experts / latent MoE widths
  vocab       tensor          embedding rows and LM-head columns
  experts     expert          the E axis of routed experts
  expert_mlp  tensor          routed-expert intermediate width (MXFP4: in units of 32-blocks)
  batch       (data, expert)  MLA pages and KDA slots: attention is data-parallel over both
  the rest    replicated      embed, layers, head_dim, conv, q_lora, kv_lora, routes, latent, expert_embed

A dimension the mesh does not divide falls back: first to a smaller set of the logical axis's
mesh axes (batch: data*expert -> data -> expert), then to replication, with one logged warning
per (axes, reason). An unknown logical name, or axes whose count differs from the leaf's
dimensions, raise. Sharding never changes results, only placement and communication.
"""
from __future__ import annotations

import itertools
import logging
import math
from typing import Mapping

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from sharding.mesh import axis_sizes

log = logging.getLogger(__name__)

LOGICAL_AXES: dict[str, tuple[str, ...]] = {
    "kda_heads": ("tensor",),
    "mla_heads": ("tensor",),
    "mlp": ("tensor",),
    "vocab": ("tensor",),
    "experts": ("expert",),
    "expert_mlp": ("tensor",),
    "batch": ("data", "expert"),
    # replicated
    "embed": (), "layers": (), "head_dim": (), "conv": (), "q_lora": (), "kv_lora": (), "routes": (),
    "latent": (), "expert_embed": (),
}

_noted: set = set()


def path_str(path) -> str:
    """'layers.3.attn.q_proj' from a jax key path."""
    parts = []
    for k in path:
        for attr in ("key", "idx", "name"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return ".".join(parts)


def axis_units(config) -> dict[str, int]:
    """Indivisible units per logical axis where they are not the dimension itself: heads (a head's
    columns stay on one device) and MXFP4 blocks of 32 along the routed-expert width."""
    if config is None:
        return {}
    return {"kda_heads": config.kda_num_heads, "mla_heads": config.mla_num_heads,
            "expert_mlp": config.moe_intermediate_size // (32 if config.expert_format == "mxfp4" else 1)}


def _fit(name: str, units: int, dim: int, sizes: Mapping[str, int] | None, note: str):
    """Mesh axes for one dimension, falling back to fewer axes (then None) when they do not divide."""
    axes = LOGICAL_AXES[name]
    if not axes:
        return None
    if sizes is None:
        return axes if len(axes) > 1 else axes[0]
    cands = [c for r in range(len(axes), 0, -1) for c in itertools.combinations(axes, r)]
    cands.sort(key=lambda c: -math.prod(sizes[a] for a in c))      # biggest split first
    for c in cands:
        n = math.prod(sizes[a] for a in c)
        if units % n == 0 and dim % n == 0:
            if c != axes and math.prod(sizes[a] for a in axes) > n:
                _note(note, f"{name} ({units} units) not divisible by {_sz(axes, sizes)}: split over {_sz(c, sizes)}")
            return c if len(c) > 1 else c[0]
    _note(note, f"{name} ({units} units) not divisible by {_sz(axes, sizes)}: replicated")
    return None


def _sz(axes, sizes) -> str:
    return "*".join(f"{a}={sizes[a]}" for a in axes)


def _note(key: str, msg: str):
    if (key, msg) not in _noted:
        _noted.add((key, msg))
        log.warning("sharding: %s: %s", key, msg)


def logical_spec(axes, shape, sizes=None, units: Mapping[str, int] | None = None, what: str = "") -> P:
    """PartitionSpec of a leaf with these logical axes (sizes None: the logical spec, ignoring divisibility)."""
    if len(axes) != len(shape):
        raise ValueError(f"{what or 'leaf'} declares logical axes {tuple(axes)} but has shape {tuple(shape)}")
    unknown = [a for a in axes if a is not None and a not in LOGICAL_AXES]
    if unknown:
        raise ValueError(f"{what or 'leaf'}: unknown logical axis {unknown[0]!r} in {tuple(axes)}; "
                         f"known: {', '.join(LOGICAL_AXES)} (add it to sharding.rules.LOGICAL_AXES)")
    units = units or {}
    return P(*(None if a is None else _fit(a, units.get(a, d), d, sizes, str(tuple(axes)))
               for a, d in zip(axes, shape)))


def spec_tree_specs(spec, mesh=None):
    """PartitionSpec tree of a declared-parameter tree (k3jax.params.Leaf leaves: a module's .spec())."""
    from k3jax.params import is_leaf
    sizes = None if mesh is None else axis_sizes(mesh)
    return jax.tree_util.tree_map(lambda leaf: logical_spec(leaf.axes, leaf.shape, sizes), spec, is_leaf=is_leaf)


def _spec_leaves(tree, config):
    """[(path, leaf of `tree`, its k3jax.params.Leaf)] in the tree's order; the layout (checkpoint or
    scan) is the tree's. KeyError for a leaf the parameter spec does not have, ValueError for a shape
    that differs from it."""
    from k3jax.layer_stack import is_stacked
    from k3jax.params import is_leaf, param_spec
    spec = param_spec(config, stacked=is_stacked(tree))
    declared = {path_str(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(spec, is_leaf=is_leaf)[0]}
    out = []
    for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        path = path_str(p)
        if path not in declared:
            raise KeyError(f"{path!r} is no parameter of this config (its modules, k3jax/layers/, declare each one)")
        if tuple(x.shape) != declared[path].shape:
            raise ValueError(f"{path!r} has shape {tuple(x.shape)}, the config declares {declared[path].shape}")
        out.append((path, x, declared[path]))
    return out


def param_tree_specs(tree, mesh, config):
    """PartitionSpec tree of a parameter tree (arrays or ShapeDtypeStructs, checkpoint or scan layout),
    from the logical axes its leaves were declared with."""
    sizes = None if mesh is None else axis_sizes(mesh)
    units = axis_units(config)
    specs = [logical_spec(leaf.axes, x.shape, sizes, units, path) for path, x, leaf in _spec_leaves(tree, config)]
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(tree), specs)


def param_specs(config, mesh=None, *, stacked: bool = False):
    """PartitionSpec tree of the parameters (stacked: the scan layout); mesh (Mesh or {axis: size})
    applies the fallbacks. Never allocates: the spec's shapes suffice."""
    from k3jax.params import is_leaf, param_spec
    sizes = None if mesh is None else axis_sizes(mesh)
    units = axis_units(config)
    return jax.tree_util.tree_map(lambda leaf: logical_spec(leaf.axes, leaf.shape, sizes, units),
                                  param_spec(config, stacked=stacked), is_leaf=is_leaf)


def _named(mesh, specs):
    return jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), specs,
                                  is_leaf=lambda x: isinstance(x, P))


def param_shardings(config, mesh, *, stacked: bool = False):
    """NamedSharding tree of the parameters on `mesh`: the one tree random init, orbax restore and
    Hugging Face loading place the weights on."""
    return _named(mesh, param_specs(config, mesh, stacked=stacked))


def expert_specs(config, mesh=None):
    """PartitionSpecs of one layer's routed experts (k3jax.params.experts_spec)."""
    from k3jax.params import experts_spec, is_leaf
    sizes = None if mesh is None else axis_sizes(mesh)
    units = axis_units(config)
    return jax.tree_util.tree_map(lambda leaf: logical_spec(leaf.axes, leaf.shape, sizes, units),
                                  experts_spec(config), is_leaf=is_leaf)


def place(tree, shardings):
    """Put host or device arrays onto shardings; works across processes (each feeds its shards).
    Arrays already on their sharding (e.g. restored onto it) stay as they are; a global array on
    another sharding is resharded on the devices (no process can read it back whole)."""
    if jax.process_count() == 1:
        return jax.device_put(tree, shardings)

    def one(x, s):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return x if x.sharding == s else jax.device_put(x, s)
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, s, lambda idx: host[idx])
    return jax.tree_util.tree_map(one, tree, shardings)


def shard_params(params, mesh, config):
    """Parameters (checkpoint or scan layout) placed by their logical axes."""
    return place(params, _named(mesh, param_tree_specs(params, mesh, config)))


def pool_specs(pools, mesh=None):
    """PartitionSpec tree of CachePools (arrays or ShapeDtypeStructs), from the axes each pool declares."""
    sizes = None if mesh is None else axis_sizes(mesh)
    return pools.replace(**{name: None if getattr(pools, name) is None else
                            logical_spec(axes, getattr(pools, name).shape, sizes, what=name)
                            for name, axes in pools.pool_axes().items()})


def pool_shardings(config, mesh, pools):
    """NamedSharding tree of the cache pools (config kept for symmetry; shapes come from pools)."""
    del config
    return _named(mesh, pool_specs(pools, mesh))


def shard_pools(pools, mesh):
    """Cache pools placed by the rules."""
    return place(pools, _named(mesh, pool_specs(pools, mesh)))


def shard_vision(tower, mesh):
    """The vision tower (a VisionTower) over its parameters placed by the axes they declare (replicated)."""
    from k3jax.vision.tower import tower_of
    return tower_of(place(tower.tree(), _named(mesh, spec_tree_specs(tower.spec(), mesh))), tower.config)


def replicated(mesh):
    """Sharding for small per-step inputs (StepBatch) and gathered outputs."""
    return NamedSharding(mesh, P())


def explain(tree, mesh=None, *, config=None) -> list[tuple[str, tuple, P]]:
    """(path, logical axes, spec) for every leaf: a parameter tree (config given), CachePools or a
    module (the vision tower), each by its declared axes."""
    if hasattr(tree, "pool_axes"):
        specs = pool_specs(tree, mesh)
        return [(name, axes, getattr(specs, name)) for name, axes in tree.pool_axes().items()
                if getattr(tree, name) is not None]
    if hasattr(tree, "spec"):
        from k3jax.params import is_leaf
        flat = jax.tree_util.tree_flatten_with_path(tree.spec(), is_leaf=is_leaf)[0]
        specs = jax.tree_util.tree_leaves(spec_tree_specs(tree.spec(), mesh), is_leaf=lambda x: isinstance(x, P))
        return [(path_str(p), leaf.axes, s) for (p, leaf), s in zip(flat, specs)]
    specs = jax.tree_util.tree_leaves(param_tree_specs(tree, mesh, config), is_leaf=lambda x: isinstance(x, P))
    return [(path, leaf.axes, s) for (path, _, leaf), s in zip(_spec_leaves(tree, config), specs)]


def shard_shape(shape, spec: P, mesh) -> tuple[int, ...]:
    """Per-device shape of a global shape under spec (mesh: Mesh or {axis: size}); no devices needed."""
    sizes = axis_sizes(mesh)
    out = []
    for i, d in enumerate(shape):
        entry = spec[i] if i < len(spec) else None
        axes = () if entry is None else (entry if isinstance(entry, tuple) else (entry,))
        n = math.prod(sizes[a] for a in axes)
        out.append(-(-d // n))
    return tuple(out)
