"""Encoder-output cache: image digest -> the tower's embeddings, least recently used first out.

Bounded by bytes. An image shared by many requests (a system prompt's logo, a follow-up turn)
is encoded once; the prefix cache usually makes even that unnecessary.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Optional

import numpy as np


class EncoderCache:
    def __init__(self, max_bytes: int):
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._items: "OrderedDict[str, np.ndarray]" = OrderedDict()
        self.bytes = 0
        self.hits = self.misses = 0

    def __contains__(self, digest: str) -> bool:
        return digest in self._items

    def __len__(self) -> int:
        return len(self._items)

    def get(self, digest: str) -> Optional[np.ndarray]:
        emb = self._items.get(digest)
        if emb is None:
            self.misses += 1
            return None
        self.hits += 1
        self._items.move_to_end(digest)
        return emb

    def put(self, digest: str, emb: np.ndarray):
        """Insert (or refresh) an entry, evicting the least recently used ones to stay in budget.
        An entry larger than the whole budget is not kept (the caller still has it)."""
        if digest in self._items:
            self.bytes -= self._items.pop(digest).nbytes
        if emb.nbytes > self.max_bytes:
            return
        while self._items and self.bytes + emb.nbytes > self.max_bytes:
            _, old = self._items.popitem(last=False)
            self.bytes -= old.nbytes
        self._items[digest] = emb
        self.bytes += emb.nbytes
