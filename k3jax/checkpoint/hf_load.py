"""Load a Hugging Face Kimi checkpoint directory straight into a k3jax parameter tree (in memory).

For models small enough to hold on one host; large checkpoints go through `k3jax.convert`.
"""
from __future__ import annotations

import logging
import os

import jax
import jax.numpy as jnp
import numpy as np

from k3jax.checkpoint.hf_names import Source, path_str, sources
from k3jax.checkpoint.safetensors_dir import SafetensorsDir
from k3jax.config import ModelConfig

log = logging.getLogger(__name__)


def resolve(cfg: ModelConfig, names):
    """Check that every parameter has a complete source. Returns (plan, treedef, unused names)."""
    plan, treedef = sources(cfg, names)
    missing = [f"{path_str(p)} (needs one of: {' | '.join(','.join(s.names[:2]) + ('...' if len(s.names) > 2 else '') for s in src)})"
               for p, src, _ in plan if not isinstance(src, Source)]
    if missing:
        raise ValueError("checkpoint is missing tensors:\n  " + "\n  ".join(missing))
    used = {n for _, src, _ in plan for n in src.names}
    return plan, treedef, sorted(set(names) - used)


def build_leaf(src: Source, leaf, get, path, dtype):
    arr = src.build([get(n) for n in src.names])
    if tuple(arr.shape) != tuple(leaf.shape):
        raise ValueError(f"{path_str(path)} from {src.names[0]}: shape {tuple(arr.shape)}, expected {tuple(leaf.shape)}")
    want = leaf.dtype(dtype)
    if leaf.kind in ("mx_packed", "mx_scale") and arr.dtype != np.uint8:
        raise ValueError(f"{src.names[0]}: MXFP4 tensor must be uint8, got {arr.dtype}")
    return np.asarray(arr).astype(want)


def _put(host: np.ndarray, sharding):
    """One host array onto its sharding (each process feeds only its own shards), or the default device."""
    if sharding is None:
        return jnp.asarray(host)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def load_hf_params(path: str | os.PathLike, cfg: ModelConfig, dtype=jnp.bfloat16, shardings=None):
    """The parameter tree of `cfg` from the checkpoint's tensors. shardings: a tree like the params
    (sharding.rules.param_shardings): each leaf goes straight from the host to its devices."""
    ckpt = SafetensorsDir(path)
    plan, treedef, unused = resolve(cfg, ckpt.keys())
    if unused:
        log.warning("%d checkpoint tensors are not used by the text model (e.g. %s)", len(unused), ", ".join(unused[:3]))
    flat_sh = [None] * len(plan) if shardings is None else treedef.flatten_up_to(shardings)
    leaves = [_put(build_leaf(src, leaf, ckpt.get, p, dtype), sh) for (p, src, leaf), sh in zip(plan, flat_sh)]
    return jax.tree_util.tree_unflatten(treedef, leaves)
