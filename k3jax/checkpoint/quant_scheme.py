"""Which checkpoint modules are MXFP4, as a compressed-tensors `quantization_config` says.

compressed-tensors quantizes a module when one of its `config_groups[*].targets` matches it
and no `ignore` entry does. An entry `re:PATTERN` matches module names by `re.match`; any
other entry matches a module name exactly or names a module class ("Linear"). The K3 release
targets "Linear" and ignores attention, shared experts, dense MLPs, lm_head and the vision
side, so the routed experts and the latent projections around them end up packed
(`NAME.weight_packed` uint8 + `NAME.weight_scale` uint8 E8M0, spec section 6).
"""
from __future__ import annotations

import re
from typing import Any, Mapping, Optional

import numpy as np

E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                np.float32)


def _matches(entry: str, name: str, is_linear: bool) -> bool:
    if entry.startswith("re:"):
        return re.match(entry[3:], name) is not None
    return entry == name or (entry == "Linear" and is_linear)


def scheme_of(quantization_config: Optional[Mapping[str, Any]]) -> tuple[tuple, tuple]:
    """(targets, ignore) of a quantization_config (targets default to "Linear", as K3's is)."""
    if not quantization_config:
        return (), ()
    targets = []
    for group in (quantization_config.get("config_groups") or {}).values():
        if isinstance(group, Mapping):
            targets += [str(t) for t in group.get("targets") or []]
    targets += [str(t) for t in quantization_config.get("targets") or []]
    return tuple(dict.fromkeys(targets or ["Linear"])), tuple(str(i) for i in quantization_config.get("ignore") or [])


def is_quantized(targets: tuple, ignore: tuple, module: str, *, is_linear: bool = True) -> bool:
    """Whether `module` (a checkpoint module name, without `.weight`) is stored MXFP4."""
    return (any(_matches(t, module, is_linear) for t in targets)
            and not any(_matches(i, module, is_linear) for i in ignore))


def dequantize(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """MXFP4 -> float32: packed uint8 [N, K/2] (low nibble = even element), scale uint8 [N, K/32]."""
    packed, scale = np.asarray(packed, np.uint8), np.asarray(scale, np.uint8)
    codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)
    values = E2M1[codes]
    factor = np.exp2(scale.astype(np.float32) - 127.0)
    return (values.reshape(*values.shape[:-1], -1, 32) * factor[..., None]).reshape(values.shape)
