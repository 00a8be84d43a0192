"""Parameter tree: one spec (shape, dtype, init kind) per leaf, shared by init, loading and planning.

Layout (linear weights are stored [in, out] so `x @ w` needs no transpose):
  embed [V, D], lm_head [D, V], final_norm [D], output_attn_res {proj, norm} [D] (AttnRes models)
  layers[i]: input_norm, post_attn_norm [D]; attn_res {attn_proj, attn_norm, mlp_proj, mlp_norm} [D];
    attn: KDA or MLA dict (see _kda_spec / _mla_spec); mlp: dense {gate, up, down} or MoE dict.
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

    def dtype(self, dtype):
        if self.kind in FP32_KINDS:
            return jnp.float32
        if self.kind in ("mx_packed", "mx_scale"):
            return jnp.uint8
        return dtype


def _kda_spec(c: ModelConfig) -> dict:
    D, H, K = c.hidden_size, c.kda_num_heads, c.kda_head_dim
    HK = H * K
    s = {
        "q_proj": Leaf((D, HK)), "k_proj": Leaf((D, HK)), "v_proj": Leaf((D, HK)),
        "q_conv": Leaf((c.conv_kernel, HK), "conv"), "k_conv": Leaf((c.conv_kernel, HK), "conv"),
        "v_conv": Leaf((c.conv_kernel, HK), "conv"),
        "A_log": Leaf((H,), "A_log"), "dt_bias": Leaf((HK,), "dt_bias"),
        "f_a_proj": Leaf((D, K)), "f_b_proj": Leaf((K, HK)),
        "b_proj": Leaf((D, H)),
        "o_norm": Leaf((K,), "norm"), "o_proj": Leaf((HK, D)),
    }
    if c.kda_full_rank_gate:
        s["g_proj"] = Leaf((D, HK))
    else:
        s["g_a_proj"] = Leaf((D, K))
        s["g_b_proj"] = Leaf((K, HK))
    return s


def _mla_spec(c: ModelConfig) -> dict:
    D, H = c.hidden_size, c.mla_num_heads
    s = {}
    if c.q_lora_rank:
        s["q_a_proj"] = Leaf((D, c.q_lora_rank))
        s["q_a_norm"] = Leaf((c.q_lora_rank,), "norm")
        s["q_b_proj"] = Leaf((c.q_lora_rank, H * c.qk_head_dim))
    else:
        s["q_proj"] = Leaf((D, H * c.qk_head_dim))
    s["kv_a_proj"] = Leaf((D, c.kv_lora_rank + c.qk_rope_head_dim))
    s["kv_a_norm"] = Leaf((c.kv_lora_rank,), "norm")
    s["kv_b_proj"] = Leaf((c.kv_lora_rank, H * (c.qk_nope_head_dim + c.v_head_dim)))
    s["o_proj"] = Leaf((H * c.v_head_dim, D))
    if c.mla_output_gate:
        s["g_proj"] = Leaf((D, H * c.v_head_dim))
    return s


def _mlp_spec(d: int, inter: int) -> dict:
    return {"gate": Leaf((d, inter)), "up": Leaf((d, inter)), "down": Leaf((inter, d))}


def _experts_spec(c: ModelConfig) -> dict:
    E, Dp, I = c.num_experts, c.expert_hidden, c.moe_intermediate_size
    if c.expert_format == "mxfp4":
        return {
            "w1_packed": Leaf((E, I, Dp // 2), "mx_packed"), "w1_scale": Leaf((E, I, Dp // 32), "mx_scale"),
            "w3_packed": Leaf((E, I, Dp // 2), "mx_packed"), "w3_scale": Leaf((E, I, Dp // 32), "mx_scale"),
            "w2_packed": Leaf((E, Dp, I // 2), "mx_packed"), "w2_scale": Leaf((E, Dp, I // 32), "mx_scale"),
        }
    return {"w1": Leaf((E, Dp, I)), "w3": Leaf((E, Dp, I)), "w2": Leaf((E, I, Dp))}


def _moe_spec(c: ModelConfig) -> dict:
    D = c.hidden_size
    s = {
        "router": Leaf((D, c.num_experts), "router"),
        "router_bias": Leaf((c.num_experts,), "zeros32"),
        "experts": _experts_spec(c),
    }
    if c.num_shared_experts:
        s["shared"] = _mlp_spec(D, c.moe_intermediate_size * c.num_shared_experts)
    if c.routed_expert_hidden_size:
        s["latent_down"] = Leaf((D, c.expert_hidden))
        s["latent_up"] = Leaf((c.expert_hidden, D))
        if c.latent_moe_norm:
            s["latent_norm"] = Leaf((c.expert_hidden,), "norm")
    return s


def param_spec(c: ModelConfig) -> dict:
    """Nested dict of Leaf: the single source of truth for the parameter tree."""
    D, V = c.hidden_size, c.vocab_size
    layers = []
    for i in range(c.num_layers):
        layer = {
            "input_norm": Leaf((D,), "norm"), "post_attn_norm": Leaf((D,), "norm"),
            "attn": _kda_spec(c) if c.layer_types[i] == "kda" else _mla_spec(c),
            "mlp": _mlp_spec(D, c.intermediate_size) if c.mlp_types[i] == "dense" else _moe_spec(c),
        }
        if c.attn_res_block_size:
            layer["attn_res"] = {k: Leaf((D,), "norm") for k in ("attn_proj", "attn_norm", "mlp_proj", "mlp_norm")}
        layers.append(layer)
    p: dict[str, Any] = {"embed": Leaf((V, D)), "final_norm": Leaf((D,), "norm"), "layers": layers}
    if not c.tie_word_embeddings:
        p["lm_head"] = Leaf((D, V))
    if c.attn_res_block_size:
        p["output_attn_res"] = {"proj": Leaf((D,), "norm"), "norm": Leaf((D,), "norm")}
    return p


def is_leaf(x) -> bool:
    return isinstance(x, Leaf)


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


def init_params_by_leaf(c: ModelConfig, key, dtype=jnp.bfloat16, std: float = 0.02, stacked: bool = False):
    """The values of `init_params` (same key per leaf), made by one small jitted program per distinct
    leaf (kind, shape): a model with many identical layers compiles a few programs in seconds, where
    jitting init_params whole took ~3.5 minutes for the 27-layer Kimi-Linear on an H200 (2026-12-01).
    stacked: return the scan layout (k3jax.layer_stack), each stacked leaf made at once by a vmapped
    program over its layers' keys: no per-layer copies to stack, so the weights are made without a
    second copy or a fragmented allocator (stacking the 48B model after the fact ran out of memory)."""
    spec = param_spec(c)
    leaves, treedef = jax.tree_util.tree_flatten(spec, is_leaf=is_leaf)
    key_tree = jax.tree_util.tree_unflatten(treedef, list(jax.random.split(key, len(leaves))))
    programs = {}

    def make(leaf, k):                    # k: one key, or [R] keys for a stacked leaf
        sig = (leaf.kind, tuple(leaf.shape), k.ndim)
        if sig not in programs:
            f = lambda k, leaf=leaf: _init_leaf(leaf, _JaxRandom(k), dtype, std)  # noqa: E731
            programs[sig] = jax.jit(jax.vmap(f) if k.ndim else f)
        return programs[sig](k)

    init = lambda s, k: jax.tree_util.tree_map(make, s, k, is_leaf=is_leaf)  # noqa: E731
    from k3jax.layer_stack import layer_stack_plan
    plan = layer_stack_plan(c)
    if not stacked or not plan.repeats:
        return init(spec, key_tree)
    out = {name: init(spec[name], key_tree[name]) for name in spec if name != "layers"}
    ls, lk = spec["layers"], key_tree["layers"]
    units = []
    for j in range(plan.unit):
        keys = jax.tree_util.tree_map(lambda *k: jnp.stack(k), *[lk[plan.layer(r, j)] for r in range(plan.repeats)])
        units.append(init(ls[plan.start + j], keys))
    out["layers"] = {"head": [init(ls[i], lk[i]) for i in plan.head], "units": units,
                     "tail": [init(ls[i], lk[i]) for i in plan.tail]}
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
