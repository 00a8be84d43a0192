"""Reference-counted id allocators for MLA pages and KDA state slots (host side, numpy).

Id 0 is reserved in both pools (padding writes go to page 0 / slot 0), so it is never
handed out. An id is free exactly when its refcount is 0. Every operation checks its whole
argument before changing anything, so a failed call leaves the allocator unchanged.
"""
from __future__ import annotations

from typing import Callable, Iterable, List, Optional

import numpy as np


class RefCountedAllocator:
    """Ids 1..size-1 with reference counts. Initially hands out the lowest ids first; freed
    ids are reused first (LIFO), which keeps the touched part of the pool small."""

    kind = "id"

    def __init__(self, size: int):
        if size < 2:
            raise ValueError(f"size: need >= 2 (id 0 is reserved), got {size}")
        self.size = int(size)
        self._ref = np.zeros(self.size, np.int32)
        self._free: List[int] = list(range(self.size - 1, 0, -1))  # stack, pops lowest id
        # Owner-of-last-reference notification (used by the prefix cache: an id whose only
        # remaining reference is the cache's becomes evictable).
        self._watched = np.zeros(self.size, bool)
        self._listener: Optional[Callable[[List[int]], None]] = None

    # -- queries
    @property
    def capacity(self) -> int:
        """Number of ids that can be handed out (size - 1)."""
        return self.size - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.capacity - len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of the usable ids in use, in [0, 1]."""
        return self.num_used / self.capacity

    def refcount(self, i: int) -> int:
        return int(self._ref[i])

    # -- changes
    def allocate(self, n: int) -> Optional[List[int]]:
        """n fresh ids with refcount 1, or None if fewer than n are free (nothing taken;
        the caller decides whether to evict or preempt)."""
        if n < 0:
            raise ValueError(f"n: must be >= 0, got {n}")
        if n > len(self._free):
            return None
        ids = self._free[len(self._free) - n:][::-1]
        del self._free[len(self._free) - n:]
        self._ref[ids] = 1
        return ids

    def _count(self, ids: Iterable[int]):
        arr = np.asarray(list(ids), np.int64)
        if arr.size and (arr.min() < 1 or arr.max() >= self.size):
            raise ValueError(f"{self.kind} ids out of range 1..{self.size - 1}: {arr.tolist()}")
        return np.unique(arr, return_counts=True)

    def incref(self, ids: Iterable[int]) -> None:
        """One more reference per occurrence (an id may repeat); ids must be allocated."""
        uniq, cnt = self._count(ids)
        dead = uniq[self._ref[uniq] == 0]
        if dead.size:
            raise ValueError(f"incref of free {self.kind} ids: {dead.tolist()}")
        self._ref[uniq] += cnt.astype(np.int32)

    def decref(self, ids: Iterable[int]) -> List[int]:
        """Drop one reference per occurrence; ids reaching 0 are freed and returned.
        Dropping more references than held raises ValueError (double free)."""
        uniq, cnt = self._count(ids)
        over = uniq[self._ref[uniq] < cnt]
        if over.size:
            raise ValueError(f"double free of {self.kind} ids: {over.tolist()}")
        self._ref[uniq] -= cnt.astype(np.int32)
        freed = uniq[self._ref[uniq] == 0].tolist()
        self._free.extend(freed)
        if self._listener is not None:
            last = uniq[(self._ref[uniq] == 1) & self._watched[uniq]]
            if last.size:
                self._listener(last.tolist())
        return freed

    def set_listener(self, fn: Optional[Callable[[List[int]], None]]) -> None:
        """fn(ids) is called after a decref leaves watched ids with exactly one reference."""
        if fn is not None and self._listener is not None:
            raise ValueError(f"{self.kind} allocator already has a listener")
        self._listener = fn

    def watch(self, ids: Iterable[int], on: bool = True) -> None:
        self._watched[np.asarray(list(ids), np.int64)] = on

    free = decref

    def check_consistent(self) -> None:
        """Assert the free list and refcounts agree (for tests)."""
        free = np.zeros(self.size, bool)
        free[self._free] = True
        assert len(set(self._free)) == len(self._free), "duplicate ids in free list"
        assert not free[0] and self._ref[0] == 0, "id 0 must stay reserved"
        assert np.array_equal(free[1:], self._ref[1:] == 0), "free list != refcount-0 ids"


class PageAllocator(RefCountedAllocator):
    """MLA KV pages; page 0 is the garbage sink for padding writes."""
    kind = "page"


class SlotAllocator(RefCountedAllocator):
    """KDA state slots; slot 0 is the garbage sink for padding rows."""
    kind = "slot"
