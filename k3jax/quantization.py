"""Which checkpoint modules are MXFP4, as a compressed-tensors `quantization_config` says (read with the
model's config, k3jax/config.py; the checkpoint loaders' dequantization is k3jax/checkpoint/quant_scheme.py).

compressed-tensors quantizes a module when one of its `config_groups[*].targets` matches it
and no `ignore` entry does. An entry `re:PATTERN` matches module names by `re.match`; any
other entry matches a module name exactly or names a module class ("Linear").
"""
from __future__ import annotations

import re
from typing import Any, Mapping, Optional


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
