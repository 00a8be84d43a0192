"""Where every k3jax parameter comes from in a Hugging Face checkpoint.

Accepts both spellings of the Kimi checkpoints: Moonshot's (what `save_pretrained` and the
release checkpoints write: `q_conv1d`, `A_log` next to the projections, per-expert `w1/w2/w3`,
dense layer 0 under `mlp.` or `block_sparse_moe.`) and transformers' in-memory one (packed
`conv1d`, `forget_gate.*`, stacked `mlp.experts.gate_up_proj`). K3 checkpoints prefix every
name with `language_model.`.

`sources(cfg, names)` returns, per parameter path, a `Source`: the checkpoint names it reads and
a function turning those arrays into the k3jax layout ([in, out] linears, stacked experts).
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, Sequence

import numpy as np

from k3jax.checkpoint.quant_scheme import dequantize, is_quantized
from k3jax.config import ModelConfig
from k3jax.params import is_leaf, param_spec

import jax


@dataclasses.dataclass(frozen=True)
class Source:
    names: tuple[str, ...]
    build: Callable[[Sequence[np.ndarray]], np.ndarray]


def _t(a):
    return np.ascontiguousarray(a.T)


def _flat(a):
    return a.reshape(-1)


def _conv(a):                       # [C, 1, Kc] -> [Kc, C]
    return np.ascontiguousarray(a.reshape(a.shape[0], a.shape[-1]).T)


def _one(name, fn=lambda a: a):
    return [Source((name,), lambda xs: fn(xs[0]))]


def _linear(*names):
    return [Source((n + ".weight",), lambda xs: _t(xs[0])) for n in names]


def _packed(c: ModelConfig, name: str, fn=_t) -> list[Source]:
    """A module the checkpoint's quantization scheme stores MXFP4: read packed, dequantize."""
    if not c.quant_targets or not is_quantized(c.quant_targets, c.quant_ignore, name):
        return []
    return [Source((name + ".weight_packed", name + ".weight_scale"), lambda xs: fn(dequantize(xs[0], xs[1])))]


def _qlinear(c: ModelConfig, *names):
    """_linear, plus the packed spelling of each name the quantization scheme packs."""
    return _linear(*names) + sum((_packed(c, n) for n in names), [])


def _first_available(options: list[Source], names: set[str]) -> Source | list[Source]:
    for s in options:
        if all(n in names for n in s.names):
            return s
    return options


def _kda(c: ModelConfig, a: str) -> dict:
    H, HK = c.kda_num_heads, c.kda_dim
    fg = a + "forget_gate."
    out = {
        "q_proj": _qlinear(c, a + "q_proj"), "k_proj": _qlinear(c, a + "k_proj"),
        "v_proj": _qlinear(c, a + "v_proj"),
        "A_log": _one(a + "A_log", lambda x: _flat(x)[:H]) + _one(fg + "A_log", lambda x: _flat(x)[:H]),
        "dt_bias": _one(a + "dt_bias", _flat) + _one(fg + "dt_bias", _flat),
        "f_a_proj": _qlinear(c, a + "f_a_proj", fg + "f_a_proj"),
        "f_b_proj": _qlinear(c, a + "f_b_proj", fg + "f_b_proj"),
        "b_proj": _qlinear(c, a + "b_proj"), "o_norm": _one(a + "o_norm.weight"), "o_proj": _qlinear(c, a + "o_proj"),
    }
    for i, n in enumerate("qkv"):
        out[f"{n}_conv"] = _one(f"{a}{n}_conv1d.weight", _conv) + _one(
            a + "conv1d.weight", lambda x, i=i: _conv(x[i * HK:(i + 1) * HK]))
    if c.kda_full_rank_gate:
        out["g_proj"] = _qlinear(c, a + "g_proj")
    else:
        out["g_a_proj"], out["g_b_proj"] = _qlinear(c, a + "g_a_proj"), _qlinear(c, a + "g_b_proj")
    return out


def _mla(c: ModelConfig, a: str) -> dict:
    out = {"kv_a_proj": _qlinear(c, a + "kv_a_proj_with_mqa"), "kv_a_norm": _one(a + "kv_a_layernorm.weight"),
           "kv_b_proj": _qlinear(c, a + "kv_b_proj"), "o_proj": _qlinear(c, a + "o_proj")}
    if c.q_lora_rank:
        out.update(q_a_proj=_qlinear(c, a + "q_a_proj"), q_a_norm=_one(a + "q_a_layernorm.weight"),
                   q_b_proj=_qlinear(c, a + "q_b_proj"))
    else:
        out["q_proj"] = _qlinear(c, a + "q_proj")
    if c.mla_output_gate:
        out["g_proj"] = _qlinear(c, a + "g_proj")
    return out


def _mlp(c: ModelConfig, prefixes: Iterable[str]) -> dict:
    return {k: sum((_qlinear(c, p + f"{k}_proj") for p in prefixes), []) for k in ("gate", "up", "down")}


def _stack(fn):
    return lambda xs: np.stack([fn(x) for x in xs])


def _experts(c: ModelConfig, m: str, alt: str) -> dict:
    E, I = c.num_experts, c.moe_intermediate_size
    per = lambda w, suffix: tuple(f"{m}experts.{e}.{w}.{suffix}" for e in range(E))
    if c.expert_format == "mxfp4":
        out = {}
        for w in ("w1", "w2", "w3"):
            out[f"{w}_packed"] = [Source(per(w, "weight_packed"), _stack(lambda x: x))]
            out[f"{w}_scale"] = [Source(per(w, "weight_scale"), _stack(lambda x: x))]
        return out
    gate_up, down = alt + "experts.gate_up_proj", alt + "experts.down_proj"
    return {
        "w1": [Source(per("w1", "weight"), _stack(_t)),
               Source((gate_up,), lambda xs: np.ascontiguousarray(xs[0][:, :I].transpose(0, 2, 1)))],
        "w3": [Source(per("w3", "weight"), _stack(_t)),
               Source((gate_up,), lambda xs: np.ascontiguousarray(xs[0][:, I:].transpose(0, 2, 1)))],
        "w2": [Source(per("w2", "weight"), _stack(_t)),
               Source((down,), lambda xs: np.ascontiguousarray(xs[0].transpose(0, 2, 1)))],
    }


def _moe(c: ModelConfig, m: str, alt: str) -> dict:
    out = {
        "router": _qlinear(c, m + "gate", alt + "gate"),
        "router_bias": _one(m + "gate.e_score_correction_bias") + _one(alt + "gate.e_score_correction_bias"),
        "experts": _experts(c, m, alt),
        "shared": _mlp(c, [m + "shared_experts.", alt + "shared_experts."]),
        "latent_down": _qlinear(c, m + "routed_expert_down_proj"),
        "latent_up": _qlinear(c, m + "routed_expert_up_proj"),
        "latent_norm": _one(m + "routed_expert_norm.weight"),
    }
    return out


def name_prefix(names: Iterable[str]) -> str:
    """'language_model.' for K3 checkpoints, '' for Kimi Linear."""
    return "language_model." if any(n.startswith("language_model.") for n in names) else ""


def _options(c: ModelConfig, pre: str) -> dict:
    mp = pre + "model."
    layers = []
    for i in range(c.num_layers):
        L = f"{mp}layers.{i}."
        layer = {
            "input_norm": _one(L + "input_layernorm.weight"), "post_attn_norm": _one(L + "post_attention_layernorm.weight"),
            "attn_res": {"attn_proj": _one(L + "self_attention_res_proj.weight", _flat)
                         + _packed(c, L + "self_attention_res_proj", _flat),
                         "attn_norm": _one(L + "self_attention_res_norm.weight"),
                         "mlp_proj": _one(L + "mlp_res_proj.weight", _flat) + _packed(c, L + "mlp_res_proj", _flat),
                         "mlp_norm": _one(L + "mlp_res_norm.weight")},
            "attn": _kda(c, L + "self_attn.") if c.layer_types[i] == "kda" else _mla(c, L + "self_attn."),
            "mlp": (_mlp(c, [L + "mlp.", L + "block_sparse_moe."]) if c.mlp_types[i] == "dense"
                    else _moe(c, L + "block_sparse_moe.", L + "mlp.")),
        }
        layers.append(layer)
    return {
        "embed": _one(mp + "embed_tokens.weight"), "final_norm": _one(mp + "norm.weight"),
        "lm_head": _qlinear(c, pre + "lm_head"), "layers": layers,
        "output_attn_res": {"proj": _one(mp + "output_attn_res_proj.weight", _flat)
                            + _packed(c, mp + "output_attn_res_proj", _flat),
                            "norm": _one(mp + "output_attn_res_norm.weight")},
    }


def _select(spec, options):
    """Prune the options tree to the leaves the spec has."""
    if is_leaf(spec):
        return options
    if isinstance(spec, list):
        return [_select(s, o) for s, o in zip(spec, options)]
    return {k: _select(v, options[k]) for k, v in spec.items()}


def sources(c: ModelConfig, names: Iterable[str]):
    """Per parameter path: the chosen Source, or the list of options when none is complete.

    Returns (flat list of (path, Source | list[Source], Leaf), treedef of the param tree).
    """
    names = set(names)
    return choose_sources(param_spec(c), _options(c, name_prefix(names)), names)


def choose_sources(spec, options, names: set[str]):
    """Per leaf of a parameter spec: the first of its options tree's Sources whose names are all present,
    else the list of options. Returns (flat list of (path, Source | list[Source], Leaf), treedef of spec)."""
    opts = _select(spec, options)
    spec_flat, treedef = jax.tree_util.tree_flatten_with_path(spec, is_leaf=is_leaf)
    opt_flat = jax.tree_util.tree_leaves(opts, is_leaf=lambda x: isinstance(x, list) and x and isinstance(x[0], Source))
    return [(path, _first_available(o, names), leaf) for (path, leaf), o in zip(spec_flat, opt_flat)], treedef


def path_str(path) -> str:
    return ".".join(str(getattr(p, "key", getattr(p, "idx", p))) for p in path)
