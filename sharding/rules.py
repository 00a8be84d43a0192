"""Partition rules: every parameter and cache-pool leaf gets a PartitionSpec from one table.

A leaf's path is its keys joined by dots ("layers.3.attn.q_proj", "mla_kv"). Each rule is
(regex matched against the whole path, one LOGICAL axis name or None per array dimension).
A leaf matching no rule raises, as does a rule whose dimension count differs from the leaf's.

Logical axes -> mesh axes (docs/sharding.md explains the choices):
  heads       tensor          attention heads (KDA and MLA; head-aligned: the head count must divide)
  mlp         tensor          dense MLP / shared experts / latent MoE widths
  vocab       tensor          embedding rows and LM-head columns
  experts     expert          the E axis of routed experts
  expert_mlp  tensor          routed-expert intermediate width (MXFP4: in units of 32-blocks)
  batch       (data, expert)  MLA pages and KDA slots: attention is data-parallel over both

A dimension the mesh does not divide falls back: first to a smaller set of the logical axis's
mesh axes (batch: data*expert -> data -> expert), then to replication, with one logged warning
per (rule, reason). Sharding never changes results, only placement and communication.
"""
from __future__ import annotations

import itertools
import logging
import math
import re
from typing import Any, Mapping

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from sharding.mesh import axis_sizes

log = logging.getLogger(__name__)

LOGICAL_AXES: dict[str, tuple[str, ...]] = {
    "heads": ("tensor",),
    "mlp": ("tensor",),
    "vocab": ("tensor",),
    "experts": ("expert",),
    "expert_mlp": ("tensor",),
    "batch": ("data", "expert"),
}

_L = r"layers\.\d+\."
PARAM_RULES: tuple[tuple[str, tuple], ...] = (
    # embeddings and head: vocabulary over tensor
    (r"embed", ("vocab", None)),
    (r"lm_head", (None, "vocab")),
    (r"final_norm", (None,)),
    (r"output_attn_res\.(proj|norm)", (None,)),
    (_L + r"(input_norm|post_attn_norm)", (None,)),
    (_L + r"attn_res\.(attn_proj|attn_norm|mlp_proj|mlp_norm)", (None,)),
    # attention (KDA and MLA): per-head columns split over tensor, shared low-rank inputs replicated
    (_L + r"attn\.(q_proj|k_proj|v_proj|g_proj|f_b_proj|g_b_proj|b_proj|q_b_proj|kv_b_proj)", (None, "heads")),
    (_L + r"attn\.(q_conv|k_conv|v_conv)", (None, "heads")),
    (_L + r"attn\.(A_log|dt_bias)", ("heads",)),
    (_L + r"attn\.o_proj", ("heads", None)),
    (_L + r"attn\.(f_a_proj|g_a_proj|q_a_proj|kv_a_proj)", (None, None)),
    (_L + r"attn\.(o_norm|q_a_norm|kv_a_norm)", (None,)),
    # dense MLP (first layer) and shared experts: intermediate over tensor
    (_L + r"mlp\.(shared\.)?(gate|up)", (None, "mlp")),
    (_L + r"mlp\.(shared\.)?down", ("mlp", None)),
    # MoE: router replicated (every device routes its own tokens), latent projections over tensor
    (_L + r"mlp\.router", (None, None)),
    (_L + r"mlp\.router_bias", (None,)),
    (_L + r"mlp\.latent_down", (None, "mlp")),
    (_L + r"mlp\.latent_up", ("mlp", None)),
    (_L + r"mlp\.latent_norm", (None,)),
    # routed experts: E over expert, intermediate I over tensor (bf16 [E, D', I] / [E, I, D'];
    # MXFP4 packed and scales in [E, out, in/2] / [E, out, in/32] orientation)
    (_L + r"mlp\.experts\.(w1|w3)", ("experts", None, "expert_mlp")),
    (_L + r"mlp\.experts\.w2", ("experts", "expert_mlp", None)),
    (_L + r"mlp\.experts\.(w1|w3)_(packed|scale)", ("experts", "expert_mlp", None)),
    (_L + r"mlp\.experts\.w2_(packed|scale)", ("experts", None, "expert_mlp")),
)

POOL_RULES: tuple[tuple[str, tuple], ...] = (
    # [pages, layers, page_size, latent+rope]: the latent is shared by all heads -> replicated over tensor
    (r"mla_kv", ("batch", None, None, None)),
    # [slots, layers, H, K, V] fp32: slots over data*expert, heads over tensor
    (r"kda_state", ("batch", None, "heads", None, None)),
    # [slots, layers, Kc-1, 3*H*K]: packed q|k|v channels are not head-contiguous -> replicated over tensor
    (r"kda_conv", ("batch", None, None, None)),
)

# Vision tower (k3jax/vision; paths inside model.vision.params): replicated. It is small next to
# the LLM (~0.4 B parameters for K3) and each process encodes its own requests' images, so
# sharding it would only add communication. Stacked blocks (one scan over layers) add a leading L.
VISION_RULES: tuple[tuple[str, tuple], ...] = (
    (r"(patch_embed|projector\.(proj0|proj2))\.w|blocks\.\d+\.(wqkv|wo|fc0|fc1)\.w", (None, None)),
    (r"pos_emb", (None, None, None)),
    (r"blocks\.(wqkv|wo|fc0|fc1)\.w", (None, None, None)),
    (r"blocks\.\d+\.\w+\.[wb]|(patch_embed|final_norm|projector\.\w+)\.b"
     r"|(final_norm|projector\.(pre_norm|post_norm))\.w", (None,)),
    (r"blocks\.\w+\.[wb]", (None, None)),
)

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


def match_rule(path: str, rules=PARAM_RULES) -> tuple[str, tuple]:
    """The (regex, logical dims) rule for a path; KeyError when none matches."""
    for pattern, dims in rules:
        if re.fullmatch(pattern, path):
            return pattern, dims
    raise KeyError(f"no partition rule matches {path!r}: add one to sharding/rules.py")


def _units(tree_info: Mapping[str, Any], path: str, name: str, dim: int) -> int:
    """How many indivisible units a dimension holds (heads, MXFP4 blocks) for a logical axis."""
    if name == "heads":
        m = re.match(r"layers\.(\d+)\.", path)
        if m:
            return tree_info["heads"][int(m.group(1))]
        if path.startswith("kda_state"):
            return dim                          # the state's head dimension itself
    if name == "expert_mlp":
        return tree_info["expert_units"]
    return dim


def _fit(name: str, units: int, dim: int, sizes: Mapping[str, int] | None, note: str):
    """Mesh axes for one dimension, falling back to fewer axes (then None) when they do not divide."""
    axes = LOGICAL_AXES[name]
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


def spec_for(path: str, shape, tree_info, sizes, rules) -> P:
    """PartitionSpec of one leaf (sizes None: the logical spec, ignoring divisibility)."""
    pattern, dims = match_rule(path, rules)
    if len(dims) != len(shape):
        raise ValueError(f"rule {pattern!r} has {len(dims)} dims but {path!r} has shape {tuple(shape)}")
    out = []
    for name, d in zip(dims, shape):
        out.append(None if name is None else _fit(name, _units(tree_info, path, name, d), d, sizes, pattern))
    return P(*out)


def _params_info(tree, config=None) -> dict:
    """Head counts per layer and the routed-expert split unit, from the config or the tree itself."""
    flat = {path_str(p): x.shape for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}
    heads: dict[int, int] = {}
    unit = 1
    if config is not None:
        for i, t in enumerate(config.layer_types):
            heads[i] = config.kda_num_heads if t == "kda" else config.mla_num_heads
        unit = config.moe_intermediate_size // (32 if config.expert_format == "mxfp4" else 1)
        return {"heads": heads, "expert_units": unit}
    for path, shape in flat.items():
        m = re.match(r"layers\.(\d+)\.attn\.A_log$", path)
        if m:
            heads[int(m.group(1))] = shape[0]
        m = re.match(r"layers\.(\d+)\.attn\.kv_b_proj$", path)
        if m:
            heads[int(m.group(1))] = _infer_mla_heads(flat, f"layers.{m.group(1)}.attn.")
        if path.endswith("experts.w2_scale") or path.endswith("experts.w2"):
            unit = shape[-1] if path.endswith("scale") else shape[1]
    return {"heads": heads, "expert_units": unit}


def _infer_mla_heads(flat, pre) -> int:
    """H from MLA shapes: o_proj rows H*v, kv_b cols H*(nope+v), q cols H*(nope+rope), rope width R."""
    a = flat[pre + "o_proj"][0]
    b = flat[pre + "kv_b_proj"][1]
    q = flat.get(pre + "q_b_proj", flat.get(pre + "q_proj"))[1]
    r = flat[pre + "kv_a_proj"][1] - flat[pre + "kv_a_norm"][0]
    return (q - b + a) // r if r else math.gcd(a, b)


def tree_specs(tree, mesh=None, *, config=None, rules=PARAM_RULES):
    """PartitionSpec tree for any tree of arrays / ShapeDtypeStructs (params or pools)."""
    sizes = None if mesh is None else axis_sizes(mesh)
    info = _params_info(tree, config) if rules is PARAM_RULES else {"heads": {}, "expert_units": 1}
    return jax.tree_util.tree_map_with_path(
        lambda p, x: spec_for(path_str(p), x.shape, info, sizes, rules), tree)


def param_specs(config, mesh=None):
    """PartitionSpec tree of `init_params(config)`; mesh (Mesh or {axis: size}) applies fallbacks."""
    from k3jax.params import param_shapes
    return tree_specs(param_shapes(config), mesh, config=config)


def _named(mesh, specs):
    return jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), specs,
                                  is_leaf=lambda x: isinstance(x, P))


def param_shardings(config, mesh):
    """NamedSharding tree of the parameters on `mesh`."""
    return _named(mesh, param_specs(config, mesh))


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


def shard_params(params, mesh, config=None):
    """Parameters placed by the rules (config optional: head counts are inferred from shapes)."""
    specs = tree_specs(params, mesh, config=config)
    return place(params, _named(mesh, specs))


def pool_specs(pools, mesh=None):
    """PartitionSpec tree of CachePools (arrays or ShapeDtypeStructs)."""
    return tree_specs(pools, mesh, rules=POOL_RULES)


def pool_shardings(config, mesh, pools):
    """NamedSharding tree of the cache pools (config kept for symmetry; shapes come from pools)."""
    del config
    return _named(mesh, pool_specs(pools, mesh))


def shard_pools(pools, mesh):
    """Cache pools placed by the rules."""
    return place(pools, _named(mesh, pool_specs(pools, mesh)))


def shard_vision(params, mesh):
    """The vision tower's parameters placed by VISION_RULES (replicated)."""
    return place(params, _named(mesh, tree_specs(params, mesh, rules=VISION_RULES)))


def replicated(mesh):
    """Sharding for small per-step inputs (StepBatch) and gathered outputs."""
    return NamedSharding(mesh, P())


def explain(tree, mesh=None, *, config=None, rules=PARAM_RULES) -> list[tuple[str, str, P]]:
    """(path, matching rule, spec) for every leaf: for docs, debugging and the coverage test."""
    specs = tree_specs(tree, mesh, config=config, rules=rules)
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    spec_leaves = jax.tree_util.tree_leaves(specs, is_leaf=lambda x: isinstance(x, P))
    return [(path_str(p), match_rule(path_str(p), rules)[0], s) for (p, _), s in zip(flat, spec_leaves)]


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
