"""Where every vision parameter comes from in a Hugging Face checkpoint (both spellings).

Moonshot's (the K2.5 / K3 release checkpoints; tried first):
  vision_tower.patch_embed.proj.{weight,bias}   [D, 3, p, p]
  vision_tower.patch_embed.pos_emb.weight       [H, W, D]
  vision_tower.encoder.blocks.{i}.{norm0,norm1,wqkv,wo,mlp.fc0,mlp.fc1}.{weight,bias}
  vision_tower.encoder.final_layernorm.{weight,bias}
  mm_projector.{pre_norm, proj.0, proj.2, post_norm}.{weight,bias}
transformers' `kimi_k25` (in memory / save_pretrained of Kimi_K25ForConditionalGeneration):
  model.vision_tower.patch_embed.proj.*, model.vision_tower.patch_embed.pos_emb.position_embeddings,
  model.vision_tower.layers.{i}.{norm1,norm2,attn.q_proj,attn.k_proj,attn.v_proj,attn.proj,mlp.fc1,mlp.fc2}.*,
  model.vision_tower.final_layernorm.*, model.mm_projector.{pre_norm,in_proj,out_proj}.*
Kimi-VL's `multi_modal_projector.{pre_norm,linear_1,linear_2}` is accepted for the projector too.
transformers splits the fused `wqkv` and permutes q/k rows per head from interleaved rope pairs
to rotate-half order (its PermuteForRope); we keep Moonshot's fused, interleaved layout, so the
transformers spelling is fused back and un-permuted here. The prefixes before `patch_embed.` and
through `mm_projector.` are taken from the names present (bare towers, `model.`, `language_model.`).
"""
from __future__ import annotations

import re
from typing import Iterable, Mapping

import numpy as np

import jax

from k3jax.checkpoint.hf_names import Source, choose_sources, path_str
from k3jax.vision.config import VisionConfig
from k3jax.vision.tower import vision_param_spec

_TOWER = re.compile(r"^(.*?)patch_embed\.proj\.weight$")
_PROJ = re.compile(r"^(.*?(?:mm_projector|multi_modal_projector)\.)")


def _t(a):
    return np.ascontiguousarray(a.T)


def _patch(a):                       # conv [D, 3, p, p] -> [3*p*p, D], (c, y, x) flattened
    return np.ascontiguousarray(a.reshape(a.shape[0], -1).T)


def _one(name, fn=lambda a: a):
    return Source((name,), lambda xs: fn(xs[0]))


def _unrope(a, heads: int):
    """transformers' rotate-half rows (2, hd/2) per head -> Moonshot's interleaved (hd/2, 2)."""
    tail = a.shape[1:]
    hd = a.shape[0] // heads
    return a.reshape(heads, 2, hd // 2, *tail).swapaxes(1, 2).reshape(a.shape)


def _fused_qkv(c: VisionConfig, L: str, suffix: str) -> Source:
    names = tuple(f"{L}attn.{n}_proj.{suffix}" for n in "qkv")

    def build(xs):
        q, k, v = xs
        out = np.concatenate([_unrope(q, c.num_heads), _unrope(k, c.num_heads), v], axis=0)
        return _t(out) if suffix == "weight" else np.ascontiguousarray(out)
    return Source(names, build)


def _lin(spellings, suffix: str):
    fn = _t if suffix == "weight" else (lambda a: a)
    return [_one(f"{n}.{suffix}", fn) for n in spellings]


def _pair(*spellings: str) -> dict:
    """{w, b} options for a linear named differently by each spelling (first found wins)."""
    return {"w": _lin(spellings, "weight"), "b": _lin(spellings, "bias")}


def _norm_pair(moon: str | None, hf: str | None) -> dict:
    ns = [n for n in (moon, hf) if n is not None]
    return {"w": [_one(n + ".weight") for n in ns], "b": [_one(n + ".bias") for n in ns]}


def prefixes(names: Iterable[str]) -> tuple[str, str]:
    """(tower prefix, projector prefix) as spelled in this checkpoint (Moonshot's by default)."""
    tower, proj = "vision_tower.", "mm_projector."
    for n in names:
        m = _TOWER.match(n)
        if m:
            tower = m.group(1)
        m = _PROJ.match(n)
        if m:
            proj = m.group(1)
    return tower, proj


def _options(c: VisionConfig, tower: str, proj: str) -> dict:
    blocks = []
    for i in range(c.num_layers):
        B, L = f"{tower}encoder.blocks.{i}.", f"{tower}layers.{i}."
        blocks.append({
            "norm0": _norm_pair(B + "norm0", L + "norm1"),
            "norm1": _norm_pair(B + "norm1", L + "norm2"),
            "wqkv": {"w": [_one(B + "wqkv.weight", _t), _fused_qkv(c, L, "weight")],
                     "b": [_one(B + "wqkv.bias"), _fused_qkv(c, L, "bias")]},
            "wo": _pair(B + "wo", L + "attn.proj"),
            "fc0": _pair(B + "mlp.fc0", L + "mlp.fc1"),
            "fc1": _pair(B + "mlp.fc1", L + "mlp.fc2"),
        })
    return {
        "patch_embed": {"w": [_one(tower + "patch_embed.proj.weight", _patch)],
                        "b": [_one(tower + "patch_embed.proj.bias")]},
        "pos_emb": [_one(tower + "patch_embed.pos_emb.weight"),
                    _one(tower + "patch_embed.pos_emb.position_embeddings")],
        "blocks": blocks,
        "final_norm": _norm_pair(tower + "encoder.final_layernorm", tower + "final_layernorm"),
        "projector": {
            "pre_norm": _norm_pair(proj + "pre_norm", None),
            # Moonshot, transformers, Kimi-VL (multi_modal_projector.linear_1/2, same math)
            "proj0": _pair(proj + "proj.0", proj + "in_proj", proj + "linear_1"),
            "proj2": _pair(proj + "proj.2", proj + "out_proj", proj + "linear_2"),
            "post_norm": {"w": [_one(proj + "post_norm.weight")]},
        },
    }


def vision_sources(c: VisionConfig, names: Iterable[str], text_hidden_size: int | None = None):
    """Per vision parameter path: the chosen Source, or the list of options when none is complete.

    Same contract as `k3jax.checkpoint.hf_names.sources` (paths relative to the vision tree):
    returns (flat list of (path, Source | list[Source], Leaf), treedef of vision_param_spec).
    """
    names = set(names)
    return choose_sources(vision_param_spec(c, text_hidden_size), _options(c, *prefixes(names)), names)


def load_vision_params(tensors: Mapping[str, np.ndarray], c: VisionConfig, text_hidden_size: int | None = None,
                       dtype=np.float32):
    """Vision param tree from an in-memory {name: array} (numpy, or anything np.asarray takes).

    Raises ValueError naming missing tensors or a shape that does not fit the config.
    """
    import jax.numpy as jnp

    flat, treedef = vision_sources(c, tensors.keys(), text_hidden_size)
    missing = [n for _, s, _ in flat if not isinstance(s, Source) for n in s[0].names if n not in tensors]
    if missing:
        raise ValueError(f"missing vision tensors ({len(missing)}): {', '.join(missing[:10])}")
    leaves = []
    for path, src, leaf in flat:
        arr = src.build([np.asarray(tensors[n], dtype=np.float32) for n in src.names])
        if tuple(arr.shape) != tuple(leaf.shape):
            raise ValueError(f"{src.names[0]}: gives vision.{path_str(path)} shape {tuple(arr.shape)}, "
                             f"expected {leaf.shape}")
        leaves.append(jnp.asarray(arr, dtype=leaf.dtype(dtype)))
    return jax.tree_util.tree_unflatten(treedef, leaves)
