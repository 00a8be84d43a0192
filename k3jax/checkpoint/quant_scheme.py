"""Which checkpoint modules are MXFP4, as a compressed-tensors `quantization_config` says.

compressed-tensors quantizes a module when one of its `config_groups[*].targets` matches it
and no `ignore` entry does. An entry `re:PATTERN` matches module names by `re.match`; any
other entry matches a module name exactly or names a module class ("Linear"). The K3 release
targets "Linear" and ignores attention, shared experts, dense MLPs, lm_head and the vision
side, so the routed experts and the latent projections around them end up packed
(`NAME.weight_packed` uint8 + `NAME.weight_scale` uint8 E8M0, spec section 6).
"""
from __future__ import annotations

import numpy as np

from k3jax.quantization import is_quantized, scheme_of  # noqa: F401 (the scheme, read with the config)

E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                np.float32)


def dequantize(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """MXFP4 -> float32: packed uint8 [N, K/2] (low nibble = even element), scale uint8 [N, K/32]."""
    packed, scale = np.asarray(packed, np.uint8), np.asarray(scale, np.uint8)
    codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)
    values = E2M1[codes]
    factor = np.exp2(scale.astype(np.float32) - 127.0)
    return (values.reshape(*values.shape[:-1], -1, 32) * factor[..., None]).reshape(values.shape)
