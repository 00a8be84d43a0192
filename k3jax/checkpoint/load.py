"""Load any supported checkpoint directory: a Hugging Face one (config.json + safetensors)
or a converted k3jax one (written by `k3jax.convert`)."""
from __future__ import annotations

import os

from k3jax.config import ModelConfig


def load_checkpoint_dir(path: str, dtype, mesh=None):
    """Returns (config, params)."""
    cfg_file = os.path.join(path, "config.json")
    if not os.path.exists(cfg_file):
        raise ValueError(f"{path}: no config.json")
    config = ModelConfig.from_json_file(cfg_file)
    from k3jax.checkpoint.hf_load import load_hf_params
    return config, load_hf_params(path, config, dtype)
