"""Parameter tree: one spec (shape, dtype, init kind) per leaf, shared by init, loading and planning.

Layout (linear weights are stored [in, out] so `x @ w` needs no transpose):
  embed [V, D], lm_head [D, V], final_norm [D], output_attn_res {proj, norm} [D] (AttnRes models)
  layers[i]: input_norm, post_attn_norm [D]; attn_res {attn_proj, attn_norm, mlp_proj, mlp_norm} [D];
    attn: KDA or MLA dict (see kda_spec / mla_spec); mlp: dense {gate, up, down} or MoE dict.
  Routed experts are stacked [E, ...]: bf16 as w1/w3 [E, D', I], w2 [E, I, D'];
  MXFP4 kept packed in the checkpoint's [out, in] orientation: w1_packed [E, I, D'/2] uint8,
  w1_scale [E, I, D'/32] uint8 (likewise w3; w2_packed [E, D', I/2]).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.config import ModelConfig

FP32_KINDS = {"A_log", "dt_bias", "router", "zeros32"}


@dataclasses.dataclass(frozen=True)
class Leaf:
    shape: tuple[int, ...]
    kind: str = "w"          # w | norm | A_log | dt_bias | router | zeros32 | mx_packed | mx_scale | conv
    axes: tuple[str, ...] = ()   # one logical axis name per dimension (sharding/rules.py maps them to a mesh)

    def dtype(self, dtype):
        if self.kind in FP32_KINDS:
            return jnp.float32
        if self.kind in ("mx_packed", "mx_scale"):
            return jnp.uint8
        return dtype


def kda_spec(c: ModelConfig) -> dict:
    D, H, K = c.hidden_size, c.kda_num_heads, c.kda_head_dim
    HK = H * K
    into_heads = ("embed", "kda_heads")
    s = {
        "q_proj": Leaf((D, HK), axes=into_heads), "k_proj": Leaf((D, HK), axes=into_heads),
        "v_proj": Leaf((D, HK), axes=into_heads),
        "q_conv": Leaf((c.conv_kernel, HK), "conv", ("conv", "kda_heads")),
        "k_conv": Leaf((c.conv_kernel, HK), "conv", ("conv", "kda_heads")),
        "v_conv": Leaf((c.conv_kernel, HK), "conv", ("conv", "kda_heads")),
        "A_log": Leaf((H,), "A_log", ("kda_heads",)), "dt_bias": Leaf((HK,), "dt_bias", ("kda_heads",)),
        "f_a_proj": Leaf((D, K), axes=("embed", "head_dim")), "f_b_proj": Leaf((K, HK), axes=("head_dim", "kda_heads")),
        "b_proj": Leaf((D, H), axes=into_heads),
        "o_norm": Leaf((K,), "norm", ("head_dim",)), "o_proj": Leaf((HK, D), axes=("kda_heads", "embed")),
    }
    if c.kda_full_rank_gate:
        s["g_proj"] = Leaf((D, HK), axes=into_heads)
    else:
        s["g_a_proj"] = Leaf((D, K), axes=("embed", "head_dim"))
        s["g_b_proj"] = Leaf((K, HK), axes=("head_dim", "kda_heads"))
    return s


def mla_spec(c: ModelConfig) -> dict:
    D, H = c.hidden_size, c.mla_num_heads
    s = {}
    if c.q_lora_rank:
        s["q_a_proj"] = Leaf((D, c.q_lora_rank), axes=("embed", "q_lora"))
        s["q_a_norm"] = Leaf((c.q_lora_rank,), "norm", ("q_lora",))
        s["q_b_proj"] = Leaf((c.q_lora_rank, H * c.qk_head_dim), axes=("q_lora", "mla_heads"))
    else:
        s["q_proj"] = Leaf((D, H * c.qk_head_dim), axes=("embed", "mla_heads"))
    s["kv_a_proj"] = Leaf((D, c.kv_lora_rank + c.qk_rope_head_dim), axes=("embed", "kv_lora"))
    s["kv_a_norm"] = Leaf((c.kv_lora_rank,), "norm", ("kv_lora",))
    s["kv_b_proj"] = Leaf((c.kv_lora_rank, H * (c.qk_nope_head_dim + c.v_head_dim)), axes=("kv_lora", "mla_heads"))
    s["o_proj"] = Leaf((H * c.v_head_dim, D), axes=("mla_heads", "embed"))
    if c.mla_output_gate:
        s["g_proj"] = Leaf((D, H * c.v_head_dim), axes=("embed", "mla_heads"))
    return s


def mlp_spec(d: int, inter: int) -> dict:
    return {"gate": Leaf((d, inter), axes=("embed", "mlp")), "up": Leaf((d, inter), axes=("embed", "mlp")),
            "down": Leaf((inter, d), axes=("mlp", "embed"))}


def experts_spec(c: ModelConfig, merged: bool = False) -> dict:
    """Routed experts [E, ...]: E over "experts", the intermediate width over "expert_mlp" (MXFP4 in the
    checkpoint's [out, in] orientation, so w1/w3 carry it first and w2 last). merged: the serving
    layout of k3jax.expert_layout, gate and up as one w13 of width 2I (never in a checkpoint)."""
    E, Dp, I = c.num_experts, c.expert_hidden, c.moe_intermediate_size
    into, out_of = ("experts", "expert_mlp", "expert_embed"), ("experts", "expert_embed", "expert_mlp")
    if merged and c.expert_format == "mxfp4":
        return {"w13_packed": Leaf((E, 2 * I, Dp // 2), "mx_packed", into),
                "w13_scale": Leaf((E, 2 * I, Dp // 32), "mx_scale", into),
                "w2_packed": Leaf((E, Dp, I // 2), "mx_packed", out_of),
                "w2_scale": Leaf((E, Dp, I // 32), "mx_scale", out_of)}
    if merged:
        return {"w13": Leaf((E, Dp, 2 * I), axes=out_of), "w2": Leaf((E, I, Dp), axes=into)}
    if c.expert_format == "mxfp4":
        return {
            "w1_packed": Leaf((E, I, Dp // 2), "mx_packed", into), "w1_scale": Leaf((E, I, Dp // 32), "mx_scale", into),
            "w3_packed": Leaf((E, I, Dp // 2), "mx_packed", into), "w3_scale": Leaf((E, I, Dp // 32), "mx_scale", into),
            "w2_packed": Leaf((E, Dp, I // 2), "mx_packed", out_of),
            "w2_scale": Leaf((E, Dp, I // 32), "mx_scale", out_of),
        }
    return {"w1": Leaf((E, Dp, I), axes=out_of), "w3": Leaf((E, Dp, I), axes=out_of), "w2": Leaf((E, I, Dp), axes=into)}


def moe_spec(c: ModelConfig, merged_experts: bool = False) -> dict:
    D = c.hidden_size
    s = {
        "router": Leaf((D, c.num_experts), "router", ("embed", "routes")),
        "router_bias": Leaf((c.num_experts,), "zeros32", ("routes",)),
        "experts": experts_spec(c, merged_experts),
    }
    if c.num_shared_experts:
        s["shared"] = mlp_spec(D, c.moe_intermediate_size * c.num_shared_experts)
    if c.routed_expert_hidden_size:
        s["latent_down"] = Leaf((D, c.expert_hidden), axes=("embed", "mlp"))
        s["latent_up"] = Leaf((c.expert_hidden, D), axes=("mlp", "embed"))
        if c.latent_moe_norm:
            s["latent_norm"] = Leaf((c.expert_hidden,), "norm", ("latent",))
    return s


def param_spec(c: ModelConfig, stacked: bool = False, merged_experts: bool = False) -> dict:
    """Nested dict of Leaf: the single source of truth for the parameter tree (shapes, init kinds,
    logical axes). stacked: the scan layout (k3jax.layer_stack), scanned leaves with a leading
    "layers" axis. merged_experts: routed experts with one gate/up weight (k3jax.expert_layout)."""
    D, V = c.hidden_size, c.vocab_size
    norm = Leaf((D,), "norm", ("embed",))
    layers = []
    for i in range(c.num_layers):
        layer = {
            "input_norm": norm, "post_attn_norm": norm,
            "attn": kda_spec(c) if c.layer_types[i] == "kda" else mla_spec(c),
            "mlp": mlp_spec(D, c.intermediate_size) if c.mlp_types[i] == "dense" else moe_spec(c, merged_experts),
        }
        if c.attn_res_block_size:
            layer["attn_res"] = {k: norm for k in ("attn_proj", "attn_norm", "mlp_proj", "mlp_norm")}
        layers.append(layer)
    p: dict[str, Any] = {"embed": Leaf((V, D), axes=("vocab", "embed")), "final_norm": norm, "layers": layers}
    if not c.tie_word_embeddings:
        p["lm_head"] = Leaf((D, V), axes=("embed", "vocab"))
    if c.attn_res_block_size:
        p["output_attn_res"] = {"proj": norm, "norm": norm}
    if stacked:
        from k3jax.layer_stack import stack_layers
        p = stack_layers(p, c, stack=_stack_leaves)
    return p


def _stack_leaves(leaves):
    """Leaves of the same layer position over the scanned repeats -> one leaf with a "layers" axis."""
    first = leaves[0]
    return Leaf((len(leaves),) + first.shape, first.kind, ("layers",) + first.axes)


def is_leaf(x) -> bool:
    return isinstance(x, Leaf)


def parameter_count(name: str, shape) -> int:
    """Parameters a leaf named `name` holds: an MXFP4 packed byte holds two, scales are metadata."""
    if name.endswith("_scale"):
        return 0
    return int(np.prod(shape)) * (2 if name.endswith("_packed") else 1)


def tree_parameter_count(tree) -> int:
    """parameter_count summed over a parameter tree (arrays or shapes)."""
    return sum(parameter_count(str(getattr(path[-1], "key", "")), x.shape)
               for path, x in jax.tree_util.tree_flatten_with_path(tree)[0])


class _JaxRandom:
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


class _NumpyRandom:
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


def _init_leaf(leaf: Leaf, r, dtype, std: float):
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


def init_params(c: ModelConfig, key, dtype=jnp.bfloat16, std: float = 0.02):
    """Random parameters with the spec's shapes (deterministic for a given key; jit-friendly)."""
    spec = param_spec(c)
    leaves, treedef = jax.tree_util.tree_flatten(spec, is_leaf=is_leaf)
    keys = jax.random.split(key, len(leaves))
    return jax.tree_util.tree_unflatten(
        treedef, [_init_leaf(l, _JaxRandom(k), dtype, std) for l, k in zip(leaves, keys)])


def random_values(spec: dict, key, dtype=jnp.bfloat16, std: float = 0.02, lead: tuple = ()) -> dict:
    """Random values of a spec subtree (one layer's MoE, say) with init_params' distributions, made on
    the default device by one jitted program (no weight a host copy or a program constant). lead:
    dims put before every leaf's shape (a stack over layers)."""
    leaves, treedef = jax.tree_util.tree_flatten(spec, is_leaf=is_leaf)
    leaves = [dataclasses.replace(leaf, shape=tuple(lead) + tuple(leaf.shape)) for leaf in leaves]
    make = jax.jit(lambda keys: [_init_leaf(leaf, _JaxRandom(k), dtype, std) for leaf, k in zip(leaves, keys)])
    return jax.tree_util.tree_unflatten(treedef, make(jax.random.split(key, len(leaves))))


def init_params_by_leaf(c: ModelConfig, key, dtype=jnp.bfloat16, std: float = 0.02, stacked: bool = False,
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
            f = lambda k, leaf=leaf: _init_leaf(leaf, _JaxRandom(k), dtype, std)  # noqa: E731
            programs[sig] = jax.jit(jax.vmap(f) if k.ndim else f, **({"out_shardings": sh} if sh else {}))
        return programs[sig](k)

    from k3jax.layer_stack import layer_stack_plan
    plan = layer_stack_plan(c)
    stacked = stacked and bool(plan.repeats)
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


def init_params_numpy(c: ModelConfig, seed: int, dtype=jnp.bfloat16, std: float = 0.02):
    """Host-side random parameters (numpy Generator per leaf), returned as jax arrays."""
    spec = param_spec(c)
    leaves, treedef = jax.tree_util.tree_flatten(spec, is_leaf=is_leaf)
    rngs = np.random.default_rng(seed).spawn(len(leaves))
    return jax.tree_util.tree_unflatten(
        treedef, [jnp.asarray(_init_leaf(l, _NumpyRandom(g), dtype, std)) for l, g in zip(leaves, rngs)])


def param_shapes(c: ModelConfig, dtype=jnp.bfloat16):
    """ShapeDtypeStruct tree, computed with jax.eval_shape (never allocates)."""
    return jax.eval_shape(lambda k: init_params(c, k, dtype), jax.random.key(0))
