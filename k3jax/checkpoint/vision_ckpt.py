"""Vision tower weights in checkpoints: convert them, load them, build the model's VisionModel.

A Hugging Face checkpoint keeps the tower beside the language model (`vision_tower.*` and
`mm_projector.*`, in Moonshot's or transformers' spelling, see k3jax/vision/names.py). A
converted k3jax checkpoint keeps it in one safetensors file in our layout, `k3jax_vision.safetensors`
(the tower is small next to the experts: ~0.4 B parameters for K3, so one file is fine).
A config with a `vision_config` but no tower weights serves text only, with a warning.
"""
from __future__ import annotations

import json
import logging
import os

import jax
import numpy as np

from k3jax.checkpoint.hf_names import Source, path_str
from k3jax.config import ModelConfig
from k3jax.params import is_leaf
from k3jax.vision.model import VisionModel, media_pad_id

log = logging.getLogger(__name__)

VISION_FILE = "k3jax_vision.safetensors"


def vision_config(config: ModelConfig, raw: dict | None = None):
    """The tower's VisionConfig, or None for text-only configs."""
    if not config.vision:
        return None
    from k3jax.vision.config import VisionConfig
    return VisionConfig.from_dict(config.vision, raw, text_hidden_size=config.hidden_size)


def _plan(vcfg, config: ModelConfig, names):
    """[(key, Source, Leaf)] for every tower parameter, or None when the checkpoint has no tower.
    Raises ValueError when some tower tensors are present but others are missing."""
    from k3jax.vision.names import vision_sources
    flat, _ = vision_sources(vcfg, names, config.hidden_size)
    missing = [s[0].names[0] for _, s, _ in flat if not isinstance(s, Source)]
    if len(missing) == len(flat):
        return None
    if missing:
        raise ValueError(f"checkpoint has part of the vision tower; missing ({len(missing)}): "
                         f"{', '.join(missing[:8])}")
    return [(path_str(p), s, leaf) for p, s, leaf in flat]


def _build(src: Source, leaf, get, key: str, dtype) -> np.ndarray:
    arr = src.build([np.asarray(get(n), np.float32) for n in src.names])
    if tuple(arr.shape) != tuple(leaf.shape):
        raise ValueError(f"{src.names[0]}: gives vision.{key} shape {tuple(arr.shape)}, expected {tuple(leaf.shape)}")
    return np.ascontiguousarray(arr.astype(leaf.dtype(dtype)))


def convert_vision(ckpt, config: ModelConfig, raw: dict, dst_dir: str, dtype) -> int:
    """Write the tower of HF checkpoint `ckpt` (a SafetensorsDir) to dst_dir/VISION_FILE.
    Returns the bytes written (0: no tower in the config or the checkpoint)."""
    vcfg = vision_config(config, raw)
    if vcfg is None:
        return 0
    plan = _plan(vcfg, config, ckpt.keys())
    if plan is None:
        log.warning("config has a vision_config but the checkpoint has no vision tower: converted text only")
        return 0
    from safetensors.numpy import save_file
    tensors = {key: _build(src, leaf, ckpt.get, key, dtype) for key, src, leaf in plan}
    save_file(tensors, os.path.join(dst_dir, VISION_FILE))
    return sum(a.nbytes for a in tensors.values())


def _tower(vcfg, config: ModelConfig, flat: dict, dtype):
    """The VisionTower: an abstract one (its declared parameters) filled from {key: numpy array},
    each cast to its parameter's dtype."""
    import jax.numpy as jnp
    from k3jax.layers.module import fill
    from k3jax.vision.tower import VisionTower
    tower = VisionTower(vcfg, config.hidden_size)
    paths, treedef = jax.tree_util.tree_flatten_with_path(tower.spec(), is_leaf=is_leaf)
    keys = [path_str(p) for p, _ in paths]
    missing = [k for k in keys if k not in flat]
    if missing:
        raise ValueError(f"{VISION_FILE}: missing {', '.join(missing[:8])}")
    for (p, leaf), k in zip(paths, keys):
        if tuple(flat[k].shape) != tuple(leaf.shape):
            raise ValueError(f"{VISION_FILE}: {k} has shape {tuple(flat[k].shape)}, expected {tuple(leaf.shape)}")
    return fill(tower, jax.tree_util.tree_unflatten(treedef, [jnp.asarray(flat[k], leaf.dtype(dtype))
                                                              for (_, leaf), k in zip(paths, keys)]))


def load_vision(path: str, config: ModelConfig, tokenizer, dtype):
    """The VisionModel of checkpoint dir `path` (converted or HF), or None (text-only)."""
    raw = None
    cfg_file = os.path.join(path, "config.json")
    if os.path.exists(cfg_file):
        with open(cfg_file) as f:
            raw = json.load(f)
    vcfg = vision_config(config, raw)
    if vcfg is None:
        return None
    converted = os.path.join(path, VISION_FILE)
    if os.path.exists(converted):
        from safetensors.numpy import load_file
        tower = _tower(vcfg, config, load_file(converted), dtype)
    else:
        from k3jax.checkpoint.safetensors_dir import SafetensorsDir
        try:
            ckpt = SafetensorsDir(path)
        except ValueError:
            ckpt = None
        plan = None if ckpt is None else _plan(vcfg, config, ckpt.keys())
        if plan is None:
            log.warning("%s: config has a vision_config but no vision tower weights: images are disabled", path)
            return None
        tower = _tower(vcfg, config, {key: _build(src, leaf, ckpt.get, key, dtype) for key, src, leaf in plan}, dtype)
    from k3jax.vision.preprocess import ImageProcessorConfig
    return VisionModel(vcfg, tower, ImageProcessorConfig.from_checkpoint_dir(path), media_pad_id(config, tokenizer))
