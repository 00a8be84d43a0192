"""Safetensors shards read with plain file reads instead of mmap, for streaming conversion.

The safetensors library memory-maps each shard: every page a conversion touches stays in the
process's resident set until the mapping closes, so RSS grows to the size of the checkpoint.
Reading each tensor with `readinto` into a fresh array keeps RSS to the arrays alive.
The header is parsed and checked here (JSON, dtypes, byte ranges inside the file), so a
truncated or corrupt shard fails when it is opened, naming the file and tensor.
"""
from __future__ import annotations

import json
import math
import os
import struct

import ml_dtypes
import numpy as np

from k3jax.checkpoint.safetensors_dir import SafetensorsDir

DTYPES = {
    "BOOL": np.bool_, "U8": np.uint8, "I8": np.int8, "U16": np.uint16, "I16": np.int16,
    "U32": np.uint32, "I32": np.int32, "U64": np.uint64, "I64": np.int64,
    "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F32": np.float32, "F64": np.float64,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
}
_MAX_HEADER = 100 << 20


class Shard:
    """One safetensors file: parsed header, tensors read on demand with positioned reads."""

    def __init__(self, path: str):
        self.path = path
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise ValueError(f"{path}: corrupt or truncated safetensors file ({size} bytes)")
            (n,) = struct.unpack("<Q", raw)
            if n > min(size - 8, _MAX_HEADER):
                raise ValueError(f"{path}: corrupt or truncated safetensors file (header of {n} bytes, file {size})")
            try:
                header = json.loads(f.read(n))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ValueError(f"{path}: corrupt safetensors header ({e})") from e
        if not isinstance(header, dict):
            raise ValueError(f"{path}: corrupt safetensors header (not a JSON object)")
        header.pop("__metadata__", None)
        self.base = 8 + n
        self.tensors = {}
        for name, h in header.items():
            try:
                dt, shape, (b, e) = h["dtype"], tuple(int(d) for d in h["shape"]), h["data_offsets"]
            except (KeyError, TypeError, ValueError) as err:
                raise ValueError(f"{path}: corrupt header entry for {name} ({err!r})") from err
            if self.base + e > size or b > e:
                raise ValueError(f"{path}: corrupt or truncated safetensors file ({name} needs bytes "
                                 f"{self.base + b}..{self.base + e}, the file has {size})")
            if dt in DTYPES and e - b != math.prod(shape) * np.dtype(DTYPES[dt]).itemsize:
                raise ValueError(f"{path}: corrupt header entry for {name} ({e - b} bytes for {dt} {list(shape)})")
            self.tensors[name] = (dt, shape, b, e)

    def keys(self):
        return self.tensors.keys()

    def shape_dtype(self, name: str):
        dt, shape, _, _ = self.tensors[name]
        return shape, dt

    def get(self, name: str) -> np.ndarray:
        if name not in self.tensors:
            raise ValueError(f"{name}: not in {self.path}")
        dt, shape, b, e = self.tensors[name]
        if dt not in DTYPES:
            raise ValueError(f"{name}: unsupported safetensors dtype {dt}")
        out = np.empty(shape, DTYPES[dt])
        buf = out.reshape(-1).view(np.uint8)
        with open(self.path, "rb") as f:
            f.seek(self.base + b)
            got = f.readinto(buf)
        if got != e - b:
            raise ValueError(f"{self.path}: truncated while reading {name} ({got} of {e - b} bytes)")
        return out


class StreamingSafetensorsDir(SafetensorsDir):
    """SafetensorsDir (same index handling and interface) whose tensors are read without mmap."""

    def _open(self, fname: str):
        if fname not in self._handles:
            full = os.path.join(self.path, fname)
            if not os.path.exists(full):
                raise ValueError(f"{full}: shard named in the index does not exist")
            self._handles[fname] = Shard(full)
        return self._handles[fname]

    def get(self, name: str) -> np.ndarray:
        return self._open(self.weight_map[name]).get(name)

    def shape_dtype(self, name: str):
        shard = self._open(self.weight_map[name])
        if name not in shard.tensors:
            raise ValueError(f"{name}: listed in the index under {self.weight_map[name]} but not in that file")
        return shard.shape_dtype(name)
