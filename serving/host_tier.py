"""Host-memory tier of the prefix cache: evicted checkpoints (KDA state + the MLA pages before it) in RAM.

When the device index evicts a unit-aligned checkpoint (PrefixCacheIndex.on_evict), its KDA
recurrent and conv state and the MLA pages of its prefix (full pages and the partial one) are
copied to host memory, keyed by the checkpoint's chained hash; least recently used entries go when
the tier is over its byte bound. A waiting request whose prompt has a longer prefix in the tier
than on the device gets it copied back (the scheduler allocates pages and a slot, registers them
as pending entries, and the engine writes the data before the step): one step later the request
hits it like any device entry. Single-process engines only (a multi-host runner's pools are not
all addressable from process 0).
"""
from __future__ import annotations

import collections
import dataclasses
from typing import List, Optional

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass
class HostEntry:
    num_tokens: int
    page_hashes: list          # keys of its full pages, in order
    mla: list                  # per MLA layer [pages (full, then the partial one if any), page_size, D]
    kda_state: list            # per KDA layer [H, K, V]
    kda_conv: list             # per KDA layer [conv_kernel - 1, 3 * H * K]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.mla + self.kda_state + self.kda_conv)


class HostTier:
    """Byte-bounded LRU of HostEntry by checkpoint hash (host side only)."""

    def __init__(self, capacity_bytes: int):
        self.capacity = int(capacity_bytes)
        self._entries: collections.OrderedDict = collections.OrderedDict()
        self.bytes = 0
        self.stats = collections.Counter()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def put(self, key: bytes, entry: HostEntry) -> None:
        if entry.nbytes > self.capacity:
            self.stats["host_too_large"] += 1
            return
        self.pop(key)
        self._entries[key] = entry
        self.bytes += entry.nbytes
        self.stats["host_saved"] += 1
        while self.bytes > self.capacity:
            _, old = self._entries.popitem(last=False)
            self.bytes -= old.nbytes
            self.stats["host_evicted"] += 1

    def pop(self, key: bytes) -> Optional[HostEntry]:
        e = self._entries.pop(key, None)
        if e is not None:
            self.bytes -= e.nbytes
        return e

    def longest(self, hashes, max_units: int, min_units: int) -> Optional[bytes]:
        """Key of the longest prefix in the tier with min_units < units <= max_units (refreshed as used)."""
        for m in range(min(max_units, len(hashes)), min_units, -1):
            if hashes[m - 1] in self._entries:
                self._entries.move_to_end(hashes[m - 1])
                return hashes[m - 1]
        return None


def _bucket(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@jax.jit
def _read(pools, pages, slot):
    # per layer, as HostEntry and kv_transfer keep them (the pools stack a kind's layers on axis 1)
    kv, st, cv = pools.mla_kv[pages], pools.kda_state[slot], pools.kda_conv[slot]
    return ([kv[:, j] for j in range(kv.shape[1])], [st[j] for j in range(st.shape[0])],
            [cv[j] for j in range(cv.shape[0])])


def read_entry(pools, ce) -> tuple:
    """Device copies of a CacheEntry's data: (MLA pages per layer [rows padded to a power of two, ...], KDA state
    per layer, conv state per layer, number of real rows: its full pages, then the partial one if any)."""
    ids = list(ce.page_ids) + ([ce.partial_page] if ce.partial_page is not None else [])
    pages = np.zeros(_bucket(max(len(ids), 1)), np.int32)
    pages[:len(ids)] = ids
    mla, state, conv = _read(pools, pages, np.int32(ce.slot_id))
    return mla, state, conv, len(ids)


def _write(pools, pages, slot, mla, state, conv):
    def put(pool, idx, layers, axis):
        return pool.at[idx].set(jnp.stack(layers, axis=axis).astype(pool.dtype)) if layers else pool
    return pools.replace(mla_kv=put(pools.mla_kv, pages, mla, 1), kda_state=put(pools.kda_state, slot, state, 0),
                         kda_conv=put(pools.kda_conv, slot, conv, 0))


_write_jit = jax.jit(_write, donate_argnums=(0,))


class HostCacheIO:
    """Copies between the runner's pools and the host tier (page counts padded to powers of two, so the
    number of compiled shapes stays small; padding reads page 0 and writes the garbage page 0)."""

    def __init__(self, runner, tier: HostTier):
        self.runner, self.tier = runner, tier

    def save(self, ce) -> None:
        """PrefixCacheIndex.on_evict: copy an evicted checkpoint (a serving.prefix_cache.CacheEntry) out."""
        mla, state, conv, n = jax.device_get(read_entry(self.runner.pools, ce))
        self.tier.put(ce.checkpoint_hash, HostEntry(ce.num_tokens, list(ce.page_hashes), [np.array(m[:n]) for m in mla],
                                                    list(state), list(conv)))

    def restore(self, restores: List[tuple]) -> None:
        """Write (HostEntry, [(row in entry.mla, destination page)], slot) items into the pools."""
        for entry, rows, slot in restores:
            size = _bucket(max(len(rows), 1))
            pages = np.zeros(size, np.int32)
            src = np.zeros(size, np.int32)
            if rows:
                src[:len(rows)], pages[:len(rows)] = zip(*rows)
            mla = [m[src] for m in entry.mla]          # padding rows go to the garbage page 0
            self.runner.pools = _write_jit(self.runner.pools, pages, np.int32(slot), mla, entry.kda_state,
                                           entry.kda_conv)
            self.tier.stats["host_restored"] += 1
