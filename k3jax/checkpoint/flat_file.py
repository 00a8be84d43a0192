"""One-file k3jax weights: every parameter leaf in a single safetensors file under its flat path
('layers.3.mlp.experts.w1_packed'), for small models shipped inside the package (the trained tiny).

The config is not stored: the loader checks every leaf against the config's parameter spec.
"""
from __future__ import annotations

import os

import jax
import jax.numpy as jnp

from k3jax.checkpoint.hf_names import path_str
from k3jax.config import ModelConfig
from k3jax.params import FP32_KINDS, is_leaf, param_spec

FORMAT = "k3jax-flat-v1"


def save_flat(path: str | os.PathLike, params, metadata: dict[str, str] | None = None) -> None:
    """Write `params` (any pytree of arrays) to one safetensors file, atomically."""
    from safetensors.flax import save_file
    flat = {path_str(p): jnp.asarray(v) for p, v in jax.tree_util.tree_flatten_with_path(params)[0]}
    tmp = f"{os.fspath(path)}.tmp"
    save_file(flat, tmp, metadata={"format": FORMAT, **(metadata or {})})
    os.replace(tmp, path)


def load_flat(path: str | os.PathLike, config: ModelConfig, dtype=jnp.bfloat16):
    """Read a flat file into the config's parameter tree. Float leaves become `dtype` (the spec's
    fp32 kinds stay fp32); a missing, extra or misshapen leaf is a ValueError naming it."""
    from safetensors import safe_open
    spec_flat, treedef = jax.tree_util.tree_flatten_with_path(param_spec(config), is_leaf=is_leaf)
    out = []
    with safe_open(os.fspath(path), "flax") as f:
        meta = f.metadata() or {}
        if meta.get("format") != FORMAT:
            raise ValueError(f"{path}: not a {FORMAT} file (format {meta.get('format')!r})")
        names = set(f.keys())
        want = [path_str(p) for p, _ in spec_flat]
        missing, extra = sorted(set(want) - names), sorted(names - set(want))
        if missing or extra:
            raise ValueError(f"{path} does not match the config: missing {missing[:5]}, unexpected {extra[:5]}")
        for key, (_, leaf) in zip(want, spec_flat):
            arr = f.get_tensor(key)
            if tuple(arr.shape) != tuple(leaf.shape):
                raise ValueError(f"{path}: {key} has shape {tuple(arr.shape)}, the config wants {leaf.shape}")
            target = jnp.float32 if leaf.kind in FP32_KINDS else leaf.dtype(dtype)
            out.append(arr.astype(target))
    return jax.tree_util.tree_unflatten(treedef, out)


def quantize_experts(params):
    """bf16/fp32 routed experts (w1, w3, w2 [E, in, out]) -> MXFP4 (packed [E, out, in/2] + scales),
    the layout a model with `expert_format == "mxfp4"` keeps."""
    from pallas_kernels.moe.mxfp4 import quantize_mxfp4

    def layer(lp):
        ex = lp["mlp"].get("experts")
        if ex is None or "w1" not in ex:
            return lp
        packed = {}
        for n in ("w1", "w3", "w2"):
            packed[f"{n}_packed"], packed[f"{n}_scale"] = quantize_mxfp4(jnp.swapaxes(ex[n], -1, -2))
        return {**lp, "mlp": {**lp["mlp"], "experts": packed}}

    return {**params, "layers": [layer(lp) for lp in params["layers"]]}
