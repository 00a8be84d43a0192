"""Load any supported checkpoint directory: a Hugging Face one (config.json + safetensors)
or a converted k3jax one (written by `k3jax.convert`)."""
from __future__ import annotations

import os

from k3jax.config import ModelConfig


def load_checkpoint_dir(path: str, dtype, mesh=None, shardings_of=None):
    """Returns (config, params).

    A directory with `k3jax_params/` (converted) is restored with orbax straight into the target
    shardings (see checkpoint/orbax_io.restore_params); otherwise the safetensors are read in memory
    and each leaf is put on the same shardings: shardings_of(config) (k3jax.load_model passes the
    partition rules', sharding.rules.param_shardings), else replicated over `mesh`.
    """
    cfg_file = os.path.join(path, "config.json")
    if not os.path.exists(cfg_file):
        raise ValueError(f"{path}: no config.json")
    config = ModelConfig.from_json_file(cfg_file)
    from k3jax.checkpoint import orbax_io
    shardings = (shardings_of(config) if shardings_of is not None else
                 None if mesh is None else orbax_io.default_shardings(config, mesh))
    if os.path.isdir(os.path.join(path, orbax_io.PARAMS_DIR)):
        return config, orbax_io.restore_params(path, config, dtype, mesh=mesh, shardings=shardings)
    from k3jax.checkpoint.hf_load import load_hf_params
    return config, load_hf_params(path, config, dtype, shardings=shardings)
