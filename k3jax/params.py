"""The parameter tree as plain dicts of arrays: what the loaders, the sharding rules and the planner
read, made from the modules' own declarations (k3jax/layers/: each module declares its parameters'
shapes, dtypes, logical axes and initializers in its __init__).

Layout (linear weights are stored [in, out] so `x @ w` needs no transpose):
  embed [V, D], lm_head [D, V], final_norm [D], output_attn_res {proj, norm} [D] (AttnRes models)
  layers[i]: input_norm, post_attn_norm [D]; attn_res {attn_proj, attn_norm, mlp_proj, mlp_norm} [D];
    attn: KDA or MLA (k3jax/layers/kda.py, mla.py); mlp: dense {gate, up, down} or MoE (moe.py).
  Routed experts are stacked [E, ...]: bf16 as w1/w3 [E, D', I], w2 [E, I, D'];
  MXFP4 kept packed in the checkpoint's [out, in] orientation: w1_packed [E, I, D'/2] uint8,
  w1_scale [E, I, D'/32] uint8 (likewise w3; w2_packed [E, D', I/2]).
`param_spec` reads the declarations off an abstract model (nothing allocated) as a dict of `Leaf`;
the init functions fill it with random values (one key or numpy stream per parameter, in the
tree's order, so a seed gives the same weights in either layout).
"""
from __future__ import annotations

import copy
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.config import ModelConfig
from k3jax.layers.module import FP32_KINDS, INIT_STD, JaxRandom, Leaf, NumpyRandom, init_value, is_leaf

__all__ = ["FP32_KINDS", "Leaf", "is_leaf", "param_spec", "kda_spec", "mla_spec", "mlp_spec", "experts_spec",
           "moe_spec", "parameter_count", "tree_parameter_count", "init_params", "init_params_numpy",
           "init_params_by_leaf", "random_values", "param_shapes"]


def _init_leaf(leaf: Leaf, r, dtype, std: float = INIT_STD):
    """The init functions' one call into the distributions (a test replaces it to follow the keys)."""
    return init_value(leaf, r, dtype, std)


_specs: dict = {}


def _memo(key, make):
    """Specs are read off abstract modules once per (config, part, layout); callers get a copy."""
    if key not in _specs:
        _specs[key] = make()
    return copy.deepcopy(_specs[key])


def param_spec(c: ModelConfig, stacked: bool = False, merged_experts: bool = False) -> dict:
    """Nested dict of Leaf: the parameter tree (shapes, init kinds, logical axes) as the modules
    declare it. stacked: the model's layout (k3jax.layer_stack), scanned leaves with a leading
    "layers" axis; otherwise the checkpoint's (params["layers"] a list, one dict per layer).
    merged_experts: routed experts with one gate/up weight (k3jax.expert_layout)."""
    from k3jax.layer_stack import unstack_layers
    from k3jax.model import K3Model

    def make():
        spec = K3Model(c, merged_experts=merged_experts).spec()
        return spec if stacked else unstack_layers(spec, c, take=_unstacked_leaf, is_leaf=is_leaf)
    return _memo((repr(c), "model", stacked, merged_experts), make)


def _unstacked_leaf(leaf: Leaf, r: int) -> Leaf:
    """One repeat's Leaf of a stacked Leaf (the leading "layers" axis dropped)."""
    return dataclasses.replace(leaf, shape=leaf.shape[1:], axes=leaf.axes[1:])


def kda_spec(c: ModelConfig) -> dict:
    from k3jax.layers.kda import KDA
    return _memo((repr(c), "kda"), lambda: KDA(c).spec())


def mla_spec(c: ModelConfig) -> dict:
    from k3jax.layers.mla import MLA
    return _memo((repr(c), "mla"), lambda: MLA(c).spec())


def mlp_spec(c: ModelConfig, inter: int | None = None) -> dict:
    from k3jax.layers.common import DenseMLP
    return _memo((repr(c), "mlp", inter), lambda: DenseMLP(c, inter).spec())


def experts_spec(c: ModelConfig, merged: bool = False) -> dict:
    from k3jax.layers.moe import RoutedExperts
    return _memo((repr(c), "experts", merged), lambda: RoutedExperts(c, merged=merged).spec())


def moe_spec(c: ModelConfig, merged_experts: bool = False) -> dict:
    from k3jax.layers.moe import MoE
    return _memo((repr(c), "moe", merged_experts), lambda: MoE(c, merged_experts=merged_experts).spec())


def parameter_count(name: str, shape) -> int:
    """Parameters a leaf named `name` holds: an MXFP4 packed byte holds two, scales are metadata."""
    if name.endswith("_scale"):
        return 0
    return int(np.prod(shape)) * (2 if name.endswith("_packed") else 1)


def tree_parameter_count(tree) -> int:
    """parameter_count summed over a parameter tree (arrays or shapes)."""
    return sum(parameter_count(str(getattr(path[-1], "key", "")), x.shape)
               for path, x in jax.tree_util.tree_flatten_with_path(tree)[0])


def init_params(c: ModelConfig, key, dtype=jnp.bfloat16, std: float = INIT_STD):
    """Random parameters with the spec's shapes (deterministic for a given key; jit-friendly)."""
    spec = param_spec(c)
    leaves, treedef = jax.tree_util.tree_flatten(spec, is_leaf=is_leaf)
    keys = jax.random.split(key, len(leaves))
    return jax.tree_util.tree_unflatten(
        treedef, [_init_leaf(l, JaxRandom(k), dtype, std) for l, k in zip(leaves, keys)])


def random_values(spec: dict, key, dtype=jnp.bfloat16, std: float = INIT_STD, lead: tuple = ()) -> dict:
    """Random values of a spec subtree (one layer's MoE, say) with init_params' distributions, made on
    the default device by one jitted program (no weight a host copy or a program constant). lead:
    dims put before every leaf's shape (a stack over layers)."""
    leaves, treedef = jax.tree_util.tree_flatten(spec, is_leaf=is_leaf)
    leaves = [dataclasses.replace(leaf, shape=tuple(lead) + tuple(leaf.shape)) for leaf in leaves]
    make = jax.jit(lambda keys: [_init_leaf(leaf, JaxRandom(k), dtype, std) for leaf, k in zip(leaves, keys)])
    return jax.tree_util.tree_unflatten(treedef, make(jax.random.split(key, len(leaves))))


def init_params_by_leaf(c: ModelConfig, key, dtype=jnp.bfloat16, std: float = INIT_STD, stacked: bool = False,
                        shardings=None):
    """The values of `init_params` (same key per leaf), made by one small jitted program per distinct
    leaf (kind, shape): a model with many identical layers compiles a few programs in seconds, where
    jitting init_params whole took minutes for the 27-layer Kimi-Linear.
    stacked: return the scan layout (k3jax.layer_stack), each stacked leaf made at once by a vmapped
    program over its layers' keys: no per-layer copies to stack, so the weights are made without a
    second copy or a fragmented allocator (stacking the 48B model after the fact ran out of memory).
    shardings: a tree like the result (sharding.rules.param_shardings(c, mesh, stacked=...)): each
    leaf is made on its devices, never placed twice."""
    spec = param_spec(c)
    leaves, treedef = jax.tree_util.tree_flatten(spec, is_leaf=is_leaf)
    key_tree = jax.tree_util.tree_unflatten(treedef, list(jax.random.split(key, len(leaves))))
    programs = {}

    def make(leaf, k, sh):                # k: one key, or [R] keys for a stacked leaf; sh: False = default device
        sig = (leaf.kind, tuple(leaf.shape), k.ndim, sh)
        if sig not in programs:
            f = lambda k, leaf=leaf: _init_leaf(leaf, JaxRandom(k), dtype, std)  # noqa: E731
            programs[sig] = jax.jit(jax.vmap(f) if k.ndim else f, **({"out_shardings": sh} if sh else {}))
        return programs[sig](k)

    from k3jax.layer_stack import layer_stack_plan, stack_layers
    plan = layer_stack_plan(c)
    if stacked and not plan.repeats:
        return stack_layers(init_params_by_leaf(c, key, dtype, std, shardings=shardings), c)
    sh_tree = shardings if shardings is not None else \
        jax.tree_util.tree_map(lambda _: False, param_spec(c, stacked=stacked), is_leaf=is_leaf)
    init = lambda s, k, sh: jax.tree_util.tree_map(make, s, k, sh, is_leaf=is_leaf)  # noqa: E731
    if not stacked:
        return init(spec, key_tree, sh_tree)
    out = {name: init(spec[name], key_tree[name], sh_tree[name]) for name in spec if name != "layers"}
    ls, lk, lsh = spec["layers"], key_tree["layers"], sh_tree["layers"]
    units = []
    for j in range(plan.unit):
        keys = jax.tree_util.tree_map(lambda *k: jnp.stack(k), *[lk[plan.layer(r, j)] for r in range(plan.repeats)])
        units.append(init(ls[plan.start + j], keys, lsh["units"][j]))
    out["layers"] = {"head": [init(ls[i], lk[i], sh) for i, sh in zip(plan.head, lsh["head"])], "units": units,
                     "tail": [init(ls[i], lk[i], sh) for i, sh in zip(plan.tail, lsh["tail"])]}
    return out


def init_params_numpy(c: ModelConfig, seed: int, dtype=jnp.bfloat16, std: float = INIT_STD):
    """Host-side random parameters (numpy Generator per leaf), returned as jax arrays."""
    spec = param_spec(c)
    leaves, treedef = jax.tree_util.tree_flatten(spec, is_leaf=is_leaf)
    rngs = np.random.default_rng(seed).spawn(len(leaves))
    return jax.tree_util.tree_unflatten(
        treedef, [jnp.asarray(_init_leaf(l, NumpyRandom(g), dtype, std)) for l, g in zip(leaves, rngs)])


def param_shapes(c: ModelConfig, dtype=jnp.bfloat16):
    """ShapeDtypeStruct tree, computed with jax.eval_shape (never allocates)."""
    return jax.eval_shape(lambda k: init_params(c, k, dtype), jax.random.key(0))
