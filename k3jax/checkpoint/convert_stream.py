"""Plan and stream a Hugging Face -> k3jax conversion.

`plan_conversion` resolves every parameter to its checkpoint tensors (both spellings, via
`hf_names.sources`) and checks names, shapes and dtypes from the safetensors headers alone,
before anything is written. `iter_leaves` then builds the parameter leaves one at a time:
per-expert tensors are copied into a preallocated [E, ...] array expert by expert, so memory
stays near one stacked tensor; `dequantize` turns MXFP4 experts into [E, in, out] floats.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import re
from functools import lru_cache
from typing import Iterator

import numpy as np

from k3jax.checkpoint.hf_names import Source, path_str, sources
from k3jax.checkpoint.safetensors_dir import SafetensorsDir
from k3jax.config import ModelConfig
from k3jax.params import Leaf, is_leaf, param_spec

import jax

log = logging.getLogger(__name__)

# Vision weights ship in K3 checkpoints; they are converted on their own (checkpoint/vision_ckpt.py).
VISION = re.compile(r"^(language_model\.)?(model\.)?(vision_tower|mm_projector|multi_modal_projector)\.")
FLOAT_DTYPES = {"BF16", "F16", "F32", "F64"}
_VOID = np.dtype([])        # zero-byte elements: run a Source's reshapes/transposes on shapes only


class ConversionError(ValueError):
    """A problem with the input checkpoint; the message is one line and names the tensor."""


@dataclasses.dataclass
class LeafPlan:
    key: str                     # parameter path, e.g. 'layers.1.mlp.experts.w1_packed'
    leaf: Leaf                   # target shape / kind (from param_spec)
    dtype: np.dtype              # dtype written
    source: Source               # tensors read (the packed ones when dequantizing)
    scale: Source | None = None  # MXFP4 scales when dequantizing
    stacked: bool = False        # one checkpoint tensor per leading index (experts)

    @property
    def nbytes(self) -> int:
        return math.prod(self.leaf.shape) * self.dtype.itemsize


def _names(xs, n=10) -> str:
    xs = list(xs)
    return ", ".join(xs[:n]) + (f" (+{len(xs) - n} more)" if len(xs) > n else "")


def _header(ckpt: SafetensorsDir, name: str):
    try:
        return ckpt.shape_dtype(name)
    except ValueError as e:
        raise ConversionError(str(e).replace("\n", " ")) from e
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
        raise ConversionError(f"{name}: listed in the index but not readable from "
                              f"{ckpt.weight_map.get(name)} ({e})") from e


def _dry_shape(src: Source, shapes) -> tuple | None:
    """Output shape of src.build for inputs of these shapes, without touching data (None: unknown)."""
    try:
        return tuple(src.build([np.zeros(s, _VOID) for s in shapes]).shape)
    except TypeError:
        return None              # the build does arithmetic: checked on real data instead


def _check_source(key: str, src: Source, leaf: Leaf, heads: dict, want: tuple) -> bool:
    """Validate dtypes and shapes of src against the target `want`; returns whether it is stacked."""
    ok = {"U8"} if leaf.kind in ("mx_packed", "mx_scale") else FLOAT_DTYPES
    for n in src.names:
        packed_part = n.endswith((".weight_packed", ".weight_scale"))   # a packed linear, dequantized
        if heads[n][1] not in ({"U8"} if packed_part else ok):
            raise ConversionError(f"{n}: dtype {heads[n][1]}, expected {' or '.join(sorted(ok))} (for {key})")
    shapes = [heads[n][0] for n in src.names]
    stacked = len(src.names) > 1 and len(src.names) == want[0]
    if stacked:
        for n, s in zip(src.names, shapes):
            if s != shapes[0]:
                raise ConversionError(f"{n}: shape {s}, but {src.names[0]} has {shapes[0]} (stacked into {key})")
        one = _dry_shape(src, shapes[:1])
        stacked = one == (1,) + tuple(want[1:])
        got = None if one is None else (len(src.names),) + one[1:]
    else:
        try:
            got = _dry_shape(src, shapes)
        except ValueError as e:
            raise ConversionError(f"{src.names[0]}: shape {shapes[0]} cannot form {key} {want} ({e})") from e
    if got is not None and got != tuple(want):
        raise ConversionError(f"{src.names[0]}: shape {shapes[0]} gives {key} shape {got}, expected {tuple(want)}")
    return stacked


def plan_conversion(ckpt: SafetensorsDir, cfg: ModelConfig, dtype, *, dequantize: bool = False,
                    allow_unexpected: bool = False):
    """Resolve and validate the whole conversion from headers. Raises ConversionError.

    Returns (output config, [LeafPlan] in parameter-tree order). With `dequantize` and an MXFP4
    checkpoint the output config has bf16 experts (w1/w3 [E, D', I], w2 [E, I, D']).
    """
    names = set(ckpt.keys())
    in_flat, _ = sources(cfg, names)
    missing, used = [], set()
    for _, src, _ in in_flat:
        if isinstance(src, Source):
            used.update(src.names)
        else:   # no complete spelling: report the first (Moonshot) spelling's absent names;
            missing += [n for n in src[0].names if n not in names]
            used.update(n for s in src for n in s.names if n in names)   # the rest are not "unexpected"
    unused = sorted(names - used)
    vision = [n for n in unused if VISION.match(n)]
    unexpected = [n for n in unused if not VISION.match(n)]
    problems = []
    if missing:
        problems.append(f"missing tensors ({len(missing)}): {_names(missing)}")
    if unexpected and not allow_unexpected:
        problems.append(f"unexpected tensors ({len(unexpected)}; --allow-unexpected ignores them): "
                        f"{_names(unexpected)}")
    if problems:
        raise ConversionError("; ".join(problems))
    if unexpected:
        log.warning("ignoring %d unexpected tensors: %s", len(unexpected), _names(unexpected, 5))
    if vision:
        log.info("%d vision tensors (converted with the tower when the config has a vision_config), e.g. %s",
                 len(vision), vision[0])

    heads = {n: _header(ckpt, n) for n in sorted(used)}
    by_key = {path_str(p): (src, leaf) for p, src, leaf in in_flat}
    out_cfg = cfg.replace(expert_format="bf16") if dequantize and cfg.expert_format == "mxfp4" else cfg
    plans = []
    for p, leaf in jax.tree_util.tree_flatten_with_path(param_spec(out_cfg), is_leaf=is_leaf)[0]:
        key = path_str(p)
        out_dt = np.dtype(leaf.dtype(dtype))
        if key in by_key:
            src, in_leaf = by_key[key]
            stacked = _check_source(key, src, in_leaf, heads, leaf.shape)
            plans.append(LeafPlan(key, leaf, out_dt, src, stacked=stacked))
            continue
        # Dequantized expert: w{1,2,3} [E, in, out] from w*_packed [E, out, in/2] and w*_scale [E, out, in/32].
        (ps, pl), (ss, sl) = by_key[key + "_packed"], by_key[key + "_scale"]
        E, K, N = leaf.shape
        st_p = _check_source(key + "_packed", ps, pl, heads, (E, N, K // 2))
        st_s = _check_source(key + "_scale", ss, sl, heads, (E, N, K // 32))
        plans.append(LeafPlan(key, leaf, out_dt, ps, scale=ss, stacked=st_p and st_s))
    return out_cfg, plans


def _get(ckpt: SafetensorsDir, name: str) -> np.ndarray:
    try:
        return ckpt.get(name)
    except ValueError as e:
        raise ConversionError(str(e).replace("\n", " ")) from e


@lru_cache(maxsize=None)
def _dequantizer(dtype: np.dtype):
    from pallas_kernels.moe.mxfp4 import dequantize_mxfp4
    f = jax.jit(lambda p, s: dequantize_mxfp4(p, s, dtype).T)      # [out, in] -> [in, out]
    return lambda p, s: np.asarray(jax.device_get(f(p, s)))


def build_leaf(ckpt: SafetensorsDir, plan: LeafPlan) -> np.ndarray:
    """The parameter array for one plan entry (numpy, plan.leaf.shape, plan.dtype)."""
    names = plan.source.names
    if plan.stacked:
        out = np.empty(plan.leaf.shape, plan.dtype)
        for e in range(len(names)):
            if plan.scale is None:
                out[e] = plan.source.build([_get(ckpt, names[e])])[0]
            else:
                packed = plan.source.build([_get(ckpt, names[e])])[0]
                scale = plan.scale.build([_get(ckpt, plan.scale.names[e])])[0]
                out[e] = _dequantizer(plan.dtype)(packed, scale)
        return out
    arr = plan.source.build([_get(ckpt, n) for n in names])
    if plan.scale is not None:
        scale = plan.scale.build([_get(ckpt, n) for n in plan.scale.names])
        arr = np.stack([_dequantizer(plan.dtype)(arr[e], scale[e]) for e in range(arr.shape[0])])
    if tuple(arr.shape) != tuple(plan.leaf.shape):
        raise ConversionError(f"{names[0]}: gives {plan.key} shape {tuple(arr.shape)}, expected {plan.leaf.shape}")
    return np.ascontiguousarray(arr.astype(plan.dtype, copy=False))


def iter_leaves(ckpt: SafetensorsDir, plans) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (key, array) per plan entry, building each only when asked for."""
    for plan in plans:
        yield plan.key, build_leaf(ckpt, plan)
