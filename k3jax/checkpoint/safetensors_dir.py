"""Read-only view over a Hugging Face checkpoint directory of safetensors shards.

Tensors are read one at a time (memory-mapped by the safetensors library), so callers can stream.
Corrupt or truncated shards and index entries pointing at missing files raise ValueError.
"""
from __future__ import annotations

import json
import os

import numpy as np
from safetensors import SafetensorError, safe_open


class SafetensorsDir:
    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        self._handles: dict[str, object] = {}
        index = os.path.join(self.path, "model.safetensors.index.json")
        if os.path.exists(index):
            try:
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise ValueError(f"{index}: malformed index ({e})") from e
        else:
            files = sorted(f for f in os.listdir(self.path) if f.endswith(".safetensors"))
            if not files:
                raise ValueError(f"{self.path}: no *.safetensors files and no model.safetensors.index.json")
            weight_map = {}
            for fname in files:
                for k in self._open(fname).keys():
                    weight_map[k] = fname
        self.weight_map: dict[str, str] = dict(weight_map)

    def _open(self, fname: str):
        if fname not in self._handles:
            full = os.path.join(self.path, fname)
            if not os.path.exists(full):
                raise ValueError(f"{full}: shard named in the index does not exist")
            try:
                h = safe_open(full, framework="numpy")
            except (SafetensorError, OSError, Exception) as e:  # noqa: BLE001 - library raises several types
                raise ValueError(f"{full}: corrupt or truncated safetensors file ({e})") from e
            self._handles[fname] = h
        return self._handles[fname]

    def keys(self):
        return self.weight_map.keys()

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def get(self, name: str) -> np.ndarray:
        try:
            return self._open(self.weight_map[name]).get_tensor(name)
        except ValueError:
            raise
        except Exception as e:  # noqa: BLE001
            raise ValueError(f"{name}: cannot read from {self.weight_map[name]} ({e})") from e

    def shape_dtype(self, name: str):
        sl = self._open(self.weight_map[name]).get_slice(name)
        return tuple(sl.get_shape()), sl.get_dtype()
