"""Hybrid prefix-cache index (host side; owns ids, never device arrays).

Two kinds of entries, keyed by chained unit hashes (serving.hashing):
- page entry: a full MLA page, keyed by the hash of the prefix ending at its last token;
  parent = the page before it.
- checkpoint entry: a KDA state slot holding the state after exactly N tokens, keyed by the
  hash at N; parent = the last full page before N. N is a multiple of match_unit, or (a
  "tail" checkpoint: the state a finished generation ends with) any length past the first
  unit, keyed by serving.hashing.tail_hash(hash of its complete units, remaining tokens).
  When N is not a page multiple it also holds the page with rows [N//ps*ps, N) (the
  "partial page", copied, never shared, by a request that reuses the checkpoint).

A hit needs a visible checkpoint at N and visible page entries for every full page in [0, N).

References: the cache holds one allocator reference on each id it indexes. An entry is
"referenced" while anyone else holds a reference too (the request that wrote it, a request
that acquired it, a pending copy); referenced entries, entries with children (leaf-first, so
no checkpoint ever loses its pages) and entries not yet committed are never evicted. The
allocators report when an id is back to the cache's single reference (set_listener), so
the evictable set is kept exactly, without scans. Eviction order is least recently used.

Deferred visibility: entries registered during step t are pending until commit_pending()
(the engine calls it at the start of step t+1, when their copies/writes have been issued).
"""
from __future__ import annotations

import dataclasses
import heapq
from collections import Counter, deque
from typing import Callable, Dict, List, Optional, Sequence

from serving.allocator import PageAllocator, SlotAllocator
from serving.hashing import ExtraKeys, chain_hashes, tail_hash


@dataclasses.dataclass
class Hit:
    """Result of a lookup. num_tokens: reusable prefix length N (0 = miss); pages: full shared
    pages covering [0, N // page_size * page_size); partial_page: page whose first
    copy_rows = N % page_size rows must be copied into a private page (None if N is a page
    multiple); checkpoint_slot: state after N tokens, to copy into the working slot."""

    num_tokens: int = 0
    pages: List[int] = dataclasses.field(default_factory=list)
    partial_page: Optional[int] = None
    checkpoint_slot: Optional[int] = None
    copy_rows: int = 0
    key: Optional[bytes] = None  # checkpoint hash (internal handle)


@dataclasses.dataclass
class CacheEntry:
    """A self-describing, serializable cache unit: the prefix's hash chain at every page
    boundary plus the checkpoint hash, and the ids holding its data."""

    num_tokens: int
    page_size: int
    match_unit: int
    page_hashes: List[bytes]
    checkpoint_hash: bytes
    page_ids: List[int]
    partial_page: Optional[int]
    slot_id: int

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["page_hashes"] = [h.hex() for h in self.page_hashes]
        d["checkpoint_hash"] = self.checkpoint_hash.hex()
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "CacheEntry":
        d = dict(d)
        d["page_hashes"] = [bytes.fromhex(h) for h in d["page_hashes"]]
        d["checkpoint_hash"] = bytes.fromhex(d["checkpoint_hash"])
        return cls(**d)


@dataclasses.dataclass(eq=False)
class _Entry:
    key: bytes
    kind: str                  # "page" | "ckpt"
    id: int                    # page id or slot id
    parent: Optional[bytes]    # key of the parent page entry
    num_tokens: int
    page_hashes: tuple = ()    # ckpt: keys of its full pages
    partial_page: Optional[int] = None
    children: int = 0
    tail_of: Optional[bytes] = None  # tail checkpoint: the unit hash it hangs off
    visible: bool = False
    stamp: int = 0             # last use (logical clock)
    evictable: bool = False


class PrefixCacheIndex:
    """Index of MLA pages and KDA checkpoints by prefix hash. See module docstring."""

    def __init__(self, pages: PageAllocator, slots: SlotAllocator, page_size: int,
                 match_unit: int, namespace: str | bytes = b""):
        if match_unit < 1 or page_size % match_unit:
            raise ValueError(f"page_size: must be a multiple of match_unit "
                             f"({page_size} vs {match_unit})")
        self.pages, self.slots = pages, slots
        self.page_size, self.unit, self.namespace = page_size, match_unit, namespace
        self.upp = page_size // match_unit  # units per page
        self._page: Dict[bytes, _Entry] = {}
        self._ckpt: Dict[bytes, _Entry] = {}
        self._by_page_id: Dict[int, _Entry] = {}
        self._by_slot: Dict[int, _Entry] = {}
        self._pending: List[_Entry] = []
        # Per kind, (stamp, seq, entry) eviction candidates; stale items skipped lazily.
        self._heaps = {"page": [], "ckpt": []}
        self._clock = 0
        self._tails: Counter = Counter()    # unit hash -> tail checkpoints hanging off it
        self.stats = Counter()
        # Called with an evicted unit-aligned checkpoint (its pages are still indexed then, children go
        # first), before its ids are freed: the host-memory tier copies it out (serving/host_tier.py).
        self.on_evict: Optional[Callable[[CacheEntry], None]] = None
        pages.set_listener(lambda ids: self._on_last_ref(self._by_page_id, ids))
        slots.set_listener(lambda ids: self._on_last_ref(self._by_slot, ids))

    # ------------------------------------------------------------------ hashing / lookup
    def hashes(self, token_ids, extra_keys: ExtraKeys = None) -> List[bytes]:
        """Unit hash chain of token_ids (one per complete unit)."""
        return chain_hashes(token_ids, self.unit, extra_keys, namespace=self.namespace)

    def lookup(self, token_ids, extra_keys: ExtraKeys = None, *, hashes=None,
               record: bool = True) -> Hit:
        """Longest N (0 < N < len(token_ids)) with a visible checkpoint at N and visible pages for
        [0, N): N a multiple of match_unit, or a tail checkpoint's length. hashes: precomputed
        self.hashes(token_ids, ...). record: count this lookup in stats (once per request)."""
        n = len(token_ids)
        max_units = max(0, (n - 1) // self.unit)
        if hashes is None:
            hashes = self.hashes(token_ids[:max_units * self.unit], extra_keys)
        max_units = min(max_units, len(hashes))
        full = 0  # consecutive visible full pages from the start
        while (full + 1) * self.upp <= max_units:
            e = self._page.get(hashes[(full + 1) * self.upp - 1])
            if e is None or not e.visible:
                break
            full += 1
        hit = Hit()
        for m in range(min(max_units, (full + 1) * self.upp - 1), 0, -1):
            # (m + 1) units end within page `full`, so a tail after unit m has all its full pages
            c = self._tail_at(hashes[m - 1], token_ids, m * self.unit, n) if hashes[m - 1] in self._tails else None
            if c is None:
                c = self._ckpt.get(hashes[m - 1])
            if c is not None and c.visible:
                k = c.num_tokens // self.page_size
                hit = Hit(c.num_tokens, [self._page[h].id for h in c.page_hashes[:k]],
                          c.partial_page, c.id, c.num_tokens % self.page_size, c.key)
                break
        if record:
            self.stats.update(lookups=1, queried_tokens=n, hit_tokens=hit.num_tokens)
        return hit

    def _tail_at(self, parent: bytes, token_ids, base: int, n: int) -> Optional[_Entry]:
        """The longest visible tail checkpoint after `base` tokens that leaves a token to compute."""
        for r in range(min(self.unit - 1, n - 1 - base), 0, -1):
            c = self._ckpt.get(tail_hash(parent, token_ids[base:base + r]))
            if c is not None and c.visible:
                return c
        return None

    def acquire(self, hit: Hit) -> None:
        """Pin a hit: one more reference on each shared page (they join the request's block
        table and are released with it through the page allocator), on the partial page and
        on the checkpoint slot (copy sources, see release_copy_sources)."""
        if not hit.num_tokens:
            return
        page_ids = hit.pages + ([hit.partial_page] if hit.partial_page is not None else [])
        self.pages.incref(page_ids)
        self.slots.incref([hit.checkpoint_slot])
        for e in [self._by_slot[hit.checkpoint_slot]] + [self._by_page_id[i] for i in page_ids
                                                          if i in self._by_page_id]:
            e.evictable = False  # referenced now; the allocator listener re-arms it later
            self._touch(e)

    def release_copy_sources(self, hit: Hit) -> None:
        """Drop the references acquire took on the partial page and checkpoint slot, once the
        engine has issued their copies into the request's own page / working slot."""
        if hit.num_tokens:
            if hit.partial_page is not None:
                self.pages.decref([hit.partial_page])
            self.slots.decref([hit.checkpoint_slot])

    def release(self, hit: Hit) -> None:
        """Undo acquire entirely (request dropped before it used the hit)."""
        if hit.num_tokens:
            self.pages.decref(hit.pages)
            self.release_copy_sources(hit)

    # ------------------------------------------------------------------ registration
    def register_pages(self, hashes: Sequence[bytes], block_table: Sequence[int],
                       num_tokens: int, from_page: int = 0) -> int:
        """Register the request's full pages in [from_page, num_tokens // page_size) (their
        rows are written by the end of this step). hashes: the request's unit hash chain.
        The cache takes its own reference on each new page; pages whose hash is already
        indexed are skipped (the request keeps its private copy). Returns the number added."""
        n_full = min(num_tokens // self.page_size, len(block_table), len(hashes) // self.upp)
        added = 0
        for j in range(from_page, n_full):
            key = hashes[(j + 1) * self.upp - 1]
            if key in self._page or int(block_table[j]) in self._by_page_id:
                continue  # already indexed (a shared page, or the same content elsewhere)
            parent = hashes[j * self.upp - 1] if j else None
            if parent is not None and parent not in self._page:
                break  # an orphan page could never be part of a hit
            e = _Entry(key, "page", int(block_table[j]), parent, (j + 1) * self.page_size)
            self.pages.incref([e.id])
            self._add(e, self._by_page_id)
            added += 1
        return added

    def has_checkpoint(self, hashes: Sequence[bytes], num_tokens: int) -> bool:
        """Whether a checkpoint (visible or pending) exists at num_tokens; ask before copying a
        working slot into a fresh checkpoint slot."""
        m = num_tokens // self.unit
        return 0 < m <= len(hashes) and hashes[m - 1] in self._ckpt

    def register_checkpoint(self, hashes: Sequence[bytes], num_tokens: int, slot: int,
                            block_table: Sequence[int], tokens: Optional[Sequence[int]] = None) -> bool:
        """Index `slot` as the KDA state after exactly num_tokens tokens of this prefix. Call
        only where the model stopped at num_tokens (the write into `slot` is issued by now).
        The cache takes over the caller's reference on `slot`. All full pages before
        num_tokens must be registered. num_tokens not a multiple of the unit (a tail
        checkpoint) needs the prefix's `tokens`. Returns False (nothing taken; the caller
        frees the slot) if a checkpoint already exists there or a page entry is missing."""
        u = num_tokens // self.unit
        tail = num_tokens % self.unit
        if u < 1 or u > len(hashes) or (tail and (tokens is None or len(tokens) < num_tokens)):
            raise ValueError(f"num_tokens: must be at least {self.unit} within the hashed prefix (and come with "
                             f"its tokens when not a multiple of {self.unit}), got {num_tokens}")
        if slot in self._by_slot:
            raise ValueError(f"slot: {slot} already holds a checkpoint")
        key = tail_hash(hashes[u - 1], tokens[u * self.unit:num_tokens]) if tail else hashes[u - 1]
        k = num_tokens // self.page_size
        page_keys = tuple(hashes[(j + 1) * self.upp - 1] for j in range(k))
        if key in self._ckpt or any(h not in self._page for h in page_keys):
            return False
        partial = int(block_table[k]) if num_tokens % self.page_size else None
        if partial is not None:
            self.pages.incref([partial])
        e = _Entry(key, "ckpt", int(slot), page_keys[-1] if k else None, num_tokens,
                   page_keys, partial, tail_of=hashes[u - 1] if tail else None)
        if e.tail_of is not None:
            self._tails[e.tail_of] += 1
        self._add(e, self._by_slot)
        return True

    def commit_pending(self) -> None:
        """Make everything registered since the last call visible to lookups."""
        for e in self._pending:
            e.visible = True
            self._maybe_evictable(e)
        self._pending = []

    # ------------------------------------------------------------------ eviction
    def evict(self, num_pages_needed: int = 0, num_slots_needed: int = 0) -> bool:
        """Evict unreferenced leaf entries, least recently used first, until the allocators
        have at least the given numbers of free ids. When pages are short, leaf pages go
        first (a page with no checkpoint below it can never be part of a hit), then
        checkpoints (which exposes their pages); when only slots are short, only
        checkpoints go. Returns whether both targets are met."""
        while True:
            pages_short = self.pages.num_free < num_pages_needed
            slots_short = self.slots.num_free < num_slots_needed
            if not (pages_short or slots_short):
                return True
            e = self._pop("page") if pages_short else None
            e = e or self._pop("ckpt")
            if e is None:
                return False
            self._remove(e)

    def _pop(self, kind: str) -> Optional[_Entry]:
        """Least recently used evictable entry of a kind, or None (stale items dropped)."""
        heap = self._heaps[kind]
        while heap:
            stamp, _, e = heapq.heappop(heap)
            if not e.evictable or e.stamp != stamp:
                continue  # stale
            if self._alloc(e).refcount(e.id) != 1 or e.children:
                e.evictable = False  # referenced behind our back; the listener re-arms it
                continue
            return e
        return None

    def clear(self) -> None:
        """Evict every evictable entry."""
        self.evict(self.pages.capacity, self.slots.capacity)

    def _remove(self, e: _Entry) -> None:
        e.evictable = False
        if e.kind == "page":
            del self._page[e.key], self._by_page_id[e.id]
            self.pages.watch([e.id], False)
            self.pages.decref([e.id])
        else:
            if self.on_evict is not None and e.tail_of is None and e.visible:
                self.on_evict(self.export(e))
            del self._ckpt[e.key], self._by_slot[e.id]
            if e.tail_of is not None:
                self._tails[e.tail_of] -= 1
                if not self._tails[e.tail_of]:
                    del self._tails[e.tail_of]
            self.slots.watch([e.id], False)
            self.slots.decref([e.id])
            if e.partial_page is not None:
                self.pages.decref([e.partial_page])
        self.stats["evicted_" + e.kind] += 1
        if e.parent is not None:
            p = self._page[e.parent]
            p.children -= 1
            self._maybe_evictable(p)

    # ------------------------------------------------------------------ bookkeeping
    def _add(self, e: _Entry, by_id: Dict[int, _Entry]) -> None:
        (self._page if e.kind == "page" else self._ckpt)[e.key] = e
        by_id[e.id] = e
        self._alloc(e).watch([e.id])
        if e.parent is not None:
            self._page[e.parent].children += 1
            self._page[e.parent].evictable = False
        self._pending.append(e)
        self._touch(e)

    def _touch(self, e: _Entry) -> None:
        self._clock += 1
        e.stamp = self._clock
        if e.evictable:
            self._push(e)

    def _push(self, e: _Entry) -> None:
        heap = self._heaps[e.kind]
        heapq.heappush(heap, (e.stamp, id(e), e))
        if len(heap) > 2 * len(self._page if e.kind == "page" else self._ckpt) + 64:
            heap[:] = [it for it in heap if it[2].evictable and it[2].stamp == it[0]]
            heapq.heapify(heap)

    def _alloc(self, e: _Entry):
        return self.pages if e.kind == "page" else self.slots

    def _maybe_evictable(self, e: _Entry) -> None:
        ok = e.visible and e.children == 0 and self._alloc(e).refcount(e.id) == 1
        if ok and not e.evictable:
            e.evictable = True
            self._push(e)
        elif not ok:
            e.evictable = False

    def _on_last_ref(self, by_id: Dict[int, _Entry], ids: List[int]) -> None:
        for i in ids:
            e = by_id.get(i)
            if e is not None:
                self._maybe_evictable(e)

    # ------------------------------------------------------------------ export / policy
    def entries(self) -> List[CacheEntry]:
        """Every visible checkpoint as a self-describing CacheEntry."""
        return [self.export(c) for c in self._ckpt.values() if c.visible]

    def export(self, c: _Entry) -> CacheEntry:
        return CacheEntry(c.num_tokens, self.page_size, self.unit, list(c.page_hashes), c.key,
                          [self._page[h].id for h in c.page_hashes], c.partial_page, c.id)

    def unit_checkpoint(self, hashes: Sequence[bytes], max_units: int) -> Optional[CacheEntry]:
        """The longest visible unit-aligned checkpoint of this chain within max_units, with its pages, as a
        CacheEntry (what prefill/decode disaggregation ships), or None."""
        for m in range(min(max_units, len(hashes)), 0, -1):
            c = self._ckpt.get(hashes[m - 1])
            if c is not None and c.visible and c.tail_of is None:
                return self.export(c)
        return None

    def page_id(self, key: bytes) -> Optional[int]:
        """The page indexed under a page hash, or None."""
        e = self._page.get(key)
        return None if e is None else e.id

    def num_entries(self) -> Dict[str, int]:
        return {"pages": len(self._page), "checkpoints": len(self._ckpt)}

    def suggest_checkpoints(self, prompt_len: int, hashes: Sequence[bytes],
                            num_cached: int = 0, junction_tokens: int = 0) -> List[int]:
        """Where the scheduler should stop a prefill to register checkpoints: the prompt end
        rounded down to the match unit, keeping at least one token after it (so an identical
        prompt hits too), and a shared junction (e.g. JunctionTracker's common prefix),
        rounded down; only positions after num_cached and not already checkpointed."""
        u = self.unit
        cands = {((prompt_len - 1) // u) * u, (min(junction_tokens, prompt_len - 1) // u) * u}
        return sorted(n for n in cands
                      if n > num_cached and n > 0 and not self.has_checkpoint(hashes, n))


class JunctionTracker:
    """Unit hashes of recent prompts; finds how far a new prompt shares a prefix with any of
    them (a likely junction, e.g. the end of a shared system prompt). Chained hashes make the
    "unit m is shared" test monotone in m, so a binary search answers it."""

    def __init__(self, match_unit: int, max_prompts: int = 64):
        self.unit = match_unit
        self._recent: deque = deque()
        self._count: Counter = Counter()
        self.max_prompts = max_prompts

    def common_prefix(self, hashes: Sequence[bytes]) -> int:
        """Tokens (a multiple of match_unit) shared with some remembered prompt."""
        lo, hi = 0, len(hashes)  # invariant: units [0, lo) shared
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if hashes[mid - 1] in self._count:
                lo = mid
            else:
                hi = mid - 1
        return lo * self.unit

    def add(self, hashes: Sequence[bytes]) -> None:
        """Remember a prompt (its unit hash chain); forgets the oldest beyond max_prompts."""
        self._recent.append(tuple(hashes))
        self._count.update(set(hashes))
        if len(self._recent) > self.max_prompts:
            old = self._recent.popleft()
            self._count.subtract(set(old))
            for h in set(old):
                if self._count[h] <= 0:
                    del self._count[h]
