"""Continuous-batching scheduler (host side): decides each step's token chunks.

Per step: a token budget (max_num_batched_tokens) and a sequence cap (max_num_seqs); decodes go
first, then running prefills, then new requests (priority, then FCFS); pages and slots come from
ref-counted allocators, evicting unreferenced cache entries and then preempting (by recompute) the
lowest-priority running request when they run out.

KDA checkpoints: a state is registered only where the model really stopped (a chunk's end). Planned
checkpoints (the prompt's end, a junction with another prompt, a prefix a waiting request needs) cut
chunks there. Periodic ones (`state_block_size`) are not planned one per block: a prompt chunk that
reaches past a multiple of state_block_size ends at the last such multiple inside it and checkpoints
there. A chunk smaller than a block so stops at each multiple; a chunk of whole blocks (the budget a
multiple of the block) keeps its size, so a long prompt advances a whole budget a step, with one
checkpoint a step, on the block grid; the last one before the prompt's end is the one a later prompt
repeating the document with another question resumes from.

A lone long prompt (nothing else running or waiting) takes `long_prefill_tokens` a step instead of
max_num_batched_tokens: each step reads every weight once and decompresses the prompt's whole cached
prefix for the expanded MLA form, so fewer, larger steps are what a long prompt costs least in.

Streams keep moving during long prompts: every running decode row is scheduled before any prefill, and
while a step carries decode rows, a prefill chunk is cut to `interactive_prefill_pairs` (query, key) pairs
(attention work, which grows with the context: a 4096-token chunk at 128k context is ~30x the one at 4k), so
such steps stay short at any context; steps without decode rows take the full token budget (a lone long
prompt's, long_prefill_tokens).

Prefix-aware admission: a waiting request whose prompt shares a longer prefix with a running
prefill than the cache holds now is passed over (the requests behind it go first) until that
prefill registers a checkpoint at the shared junction, at most `prefix_wait_steps` schedules;
otherwise requests admitted while their group's prefix is still being computed compute it again.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from collections import deque
from typing import Optional

from serving.allocator import PageAllocator, SlotAllocator
from serving.hashing import chain_hashes
from serving.multimodal import images_in
from serving.prefix_cache import JunctionTracker, PrefixCacheIndex
from serving.request import Request, Status

log = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """The waiting queue is at its bound; the caller should retry later (HTTP 429/503)."""


@dataclasses.dataclass
class ScheduledChunk:
    req: Request
    start: int           # first token position of the chunk
    end: int             # one past the last
    state_src: int       # KDA slot to resume from (-1 = fresh)
    ckpt_dst: int        # checkpoint slot written after the chunk (0 = none)
    drafts: list = dataclasses.field(default_factory=list)   # speculative drafts fed after the chunk's tokens

    @property
    def sample(self) -> bool:
        return self.end == self.req.num_tokens

    @property
    def num_tokens(self) -> int:
        return self.end - self.start + len(self.drafts)


@dataclasses.dataclass
class SchedulerOutput:
    chunks: list
    page_copies: list            # (src_page, dst_page) copy-on-write copies to issue before the step
    preempted: list
    encode: list = dataclasses.field(default_factory=list)   # images to run through the vision tower first
    restores: list = dataclasses.field(default_factory=list)  # (HostEntry, [(row, page)], slot) to copy back first

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    page_size: int
    max_model_len: int
    prefix_match_unit: int
    enable_prefix_caching: bool = True
    max_waiting: int = 4096
    state_block_size: int = 0        # periodic checkpoints inside long prompts (0 = only ends/junctions)
    encoder_budget: int = 0          # image tokens the vision tower may produce per step (0 = no limit)
    cache_finished_state: bool = True  # keep a finished request's final state (see finish)
    prefix_wait_steps: int = 64      # prefix-aware admission: most schedules a request waits (0 = off)
    interactive_prefill_pairs: int = 1 << 26  # while decode rows run: a prefill chunk's (query, key) pairs at most
                                               # (see _chunk_tokens; 0 = no cap)
    long_prefill_tokens: int = 0     # a lone long prompt's step tokens (see _lone_budget; <= max_num_batched_tokens: off)


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, num_pages: int, num_slots: int, cache_namespace: str = ""):
        self.cfg = cfg
        self.pages = PageAllocator(num_pages)
        self.slots = SlotAllocator(num_slots)
        self.cache = (PrefixCacheIndex(self.pages, self.slots, cfg.page_size, cfg.prefix_match_unit, cache_namespace)
                      if cfg.enable_prefix_caching else None)
        self.junctions = JunctionTracker(cfg.prefix_match_unit)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.is_encoded = lambda digest: False   # the engine's encoder-output cache answers this
        self.host = None                          # serving.host_tier.HostTier (attach_host_tier)
        # a lone long prompt's step tokens now: cfg.long_prefill_tokens, lowered by the engine while the runner's
        # long-step programs still compile in the background (0 = off until one lands)
        self.long_prefill_tokens = cfg.long_prefill_tokens
        self._encode: dict = {}

    def attach_host_tier(self, tier, save) -> None:
        """Evicted checkpoints go to `tier` through save(CacheEntry); waiting requests get them back."""
        if self.cache is not None:
            self.host = tier
            self.cache.on_evict = save

    # ------------------------------------------------------------------ queue
    def add(self, req: Request):
        if len(self.waiting) >= self.cfg.max_waiting:
            raise QueueFullError(f"{len(self.waiting)} requests already waiting")
        # Priority first (lower value first), then arrival order.
        i = len(self.waiting)
        while i > 0 and self.waiting[i - 1].priority > req.priority:
            i -= 1
        self.waiting.insert(i, req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ resources
    def _alloc_pages(self, n: int) -> Optional[list]:
        if n <= 0:
            return []
        ids = self.pages.allocate(n)
        if ids is None and self.cache is not None and self.cache.evict(num_pages_needed=n):
            ids = self.pages.allocate(n)
        return ids

    def _alloc_slot(self) -> int:
        ids = self.slots.allocate(1)
        if ids is None and self.cache is not None and self.cache.evict(num_slots_needed=1):
            ids = self.slots.allocate(1)
        return ids[0] if ids else 0

    def _pages_needed(self, req: Request, end: int) -> int:
        return -(-end // self.cfg.page_size) - len(req.pages)

    def free(self, req: Request):
        """Give back everything a request holds (finish, abort or preemption)."""
        if req.hit is not None and self.cache is not None:
            self.cache.release_copy_sources(req.hit)
        req.hit = None
        if req.pages:
            self.pages.decref(req.pages)
        if req.slot:
            self.slots.decref([req.slot])
        if req.spec_slots:
            self.slots.decref(req.spec_slots)
        req.pages, req.slot, req.num_computed = [], 0, 0
        req.spec_slots, req.spec_drafts = [], []

    def finish(self, req: Request, keep_state: bool = False):
        """Retire a request. keep_state (a normal finish): its final KDA state and pages join the
        prefix cache first, so a follow-up turn that repeats this conversation resumes at its end."""
        if keep_state and self.cache is not None and self.cfg.cache_finished_state and req.use_cache:
            self._cache_final_state(req)
        self.free(req)
        if req in self.running:
            self.running.remove(req)
        elif req.status == Status.WAITING and req in self.waiting:   # preempted while its token was in flight
            self.waiting.remove(req)
        req.status = Status.FINISHED

    def _cache_final_state(self, req: Request):
        n, unit = req.num_computed, self.cfg.prefix_match_unit
        if n < unit or not req.slot or req.hit is not None or req.status != Status.RUNNING:
            return
        tokens = req.tokens[:n]
        hashes = req.hashes
        if len(hashes) < n // unit:     # extend the prompt's chain over the generated tokens
            hashes = hashes + chain_hashes(tokens[len(hashes) * unit:n // unit * unit], unit, req.extra_keys,
                                           parent=hashes[-1] if hashes else None, start_unit=len(hashes),
                                           namespace=self.cache.namespace)
        self.cache.register_pages(hashes, req.pages, n)
        if self.cache.register_checkpoint(hashes[:n // unit], n, req.slot, req.pages, tokens=tokens):
            req.slot = 0                 # the cache holds it now
        # Every write behind these entries was issued by the steps already run, and the next
        # schedule() would commit them anyway: commit now, so they are evictable even if none comes.
        self.cache.commit_pending()

    def abort(self, req: Request):
        if req in self.waiting:
            self.waiting.remove(req)
        self.finish(req)

    def _preempt(self, req: Request, out: SchedulerOutput):
        log.info("preempting %s (recompute %d tokens)", req.request_id, req.num_tokens)
        self.free(req)
        self.running.remove(req)
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted.append(req)

    # ------------------------------------------------------------------ chunking
    def _chunk_tokens(self, start: int, budget: int, decoding: bool) -> int:
        """Tokens a prefill chunk starting at position `start` may take: the budget, or while decode rows share
        the step, the most whose causal (query, key) pairs n * start + n * (n + 1) / 2 fit
        interactive_prefill_pairs (at least a page, so the prompt always advances)."""
        cap = self.cfg.interactive_prefill_pairs
        if not decoding or not cap:
            return budget
        n = int(math.isqrt(start * start + 2 * cap)) - start       # n^2 / 2 + n * start <= cap, to a token
        while n > 0 and n * start + n * (n + 1) // 2 > cap:
            n -= 1
        return min(budget, max(n, self.cfg.page_size))

    def _chunk(self, req: Request, budget: int, decoding: bool = False) -> Optional[ScheduledChunk]:
        """The request's next chunk within `budget` tokens (a prefill's cut by _chunk_tokens when decoding:
        decode rows share the step); None when it must wait for the encoder."""
        start = req.num_computed
        if not req.is_decode:
            budget = self._chunk_tokens(start, budget, decoding)
        end = min(req.num_tokens, start + budget)
        for p in req.checkpoints:            # stop exactly at the next planned checkpoint
            if start < p < end:
                end = p
                break
        grid = self._last_block_end(req, start, end)
        if grid:                             # a periodic checkpoint: the chunk ends there
            end = grid
        if req.images:
            end = self._fit_encoder(req, start, end)
            if end <= start:
                return None
        ckpt = 0
        if (self.cache is not None and (end in req.checkpoints or end == grid)
                and not self.cache.has_checkpoint(req.hashes, end)):
            ckpt = self._alloc_slot()
        if req.hit is not None:
            src = req.hit.checkpoint_slot
        else:
            src = req.slot if start else -1
        return ScheduledChunk(req, start, end, src, ckpt, self._drafts(req, start, end, budget))

    def _last_block_end(self, req: Request, start: int, end: int) -> int:
        """The periodic checkpoint of a prompt chunk [start, end): the last multiple of state_block_size in
        (start, end] before the prompt's end (0: none). The chunk ends there, so a chunk of a whole number of
        blocks from a block boundary keeps its size, and checkpoints stay on the block grid (where another
        prompt sharing a prefix finds one: the last block boundary before the shared part ends)."""
        b = self.cfg.state_block_size
        if not b or self.cache is None or not req.use_cache or req.is_decode:
            return 0
        last = min(end, len(req.prompt_ids) - 1) // b * b
        return last if last > start and last % self.cfg.prefix_match_unit == 0 else 0

    def _lone_budget(self, order: list, decoding: bool) -> int:
        """This step's token budget: long_prefill_tokens when the step can hold only one request, a text prompt
        with more than max_num_batched_tokens left to compute (nothing else running or waiting, so no one
        waits behind its larger step), else max_num_batched_tokens."""
        cfg = self.cfg
        if decoding or self.long_prefill_tokens <= cfg.max_num_batched_tokens or len(order) + len(self.waiting) != 1:
            return cfg.max_num_batched_tokens
        req = order[0] if order else self.waiting[0]
        if req.is_decode or req.images or req.num_tokens - req.num_computed <= cfg.max_num_batched_tokens:
            return cfg.max_num_batched_tokens
        return self.long_prefill_tokens

    def _drafts(self, req: Request, start: int, end: int, budget: int) -> list:
        """The speculative drafts a decode chunk feeds after its token (serving/spec): within the budget
        and the context, each with a KDA slot for its position state (held while the request runs;
        never taken from the prefix cache: without free slots the request does not speculate)."""
        drafts, req.spec_drafts = req.spec_drafts, []       # proposed for this step only
        if not drafts or end != req.num_tokens or end - start != 1:
            return []
        drafts = drafts[:max(0, min(budget - 1, self.cfg.max_model_len - end))]
        missing = len(drafts) - len(req.spec_slots)
        if missing > 0:
            got = self.slots.allocate(missing)
            if got is None:
                return []
            req.spec_slots += got
        return list(drafts)

    @staticmethod
    def select_position(req: Request, start: int, position_slots: list, spare_slots: list, j: int):
        """After a verification: the request continues from the state after fed token j of the chunk that
        started at `start` (position_slots[p] holds the state after token p; spare_slots: its other
        speculation slots). The slots are exchanged, not copied; may be called again with another j (stop
        conditions decide how much of an accepted run is kept)."""
        req.slot = position_slots[j]
        req.spec_slots = [s for p, s in enumerate(position_slots) if p != j] + list(spare_slots)
        req.num_computed = start + j + 1

    def reserve_pages(self, req: Request, end: int) -> bool:
        """Give a running request the pages up to position `end` (several decode steps in one launch);
        False when the pool cannot (nothing is preempted for it)."""
        new = self._alloc_pages(self._pages_needed(req, end))
        if new is None:
            return False
        req.pages += new
        return True

    def trim_pages(self, req: Request):
        """Give back pages past the request's tokens (they held only rejected drafts)."""
        keep = -(-req.num_tokens // self.cfg.page_size)
        if len(req.pages) > keep:
            extra, req.pages = req.pages[keep:], req.pages[:keep]
            self.pages.decref(extra)

    def _fit_encoder(self, req: Request, start: int, end: int) -> int:
        """Shorten [start, end) to the images the encoder budget allows this step (the first image of a
        step always fits, so a large image still makes progress)."""
        cap = self.cfg.encoder_budget
        for img in images_in(req.images, start, end):
            if img.digest in self._encode or self.is_encoded(img.digest):
                continue
            used = sum(i.num_tokens for i in self._encode.values())
            if cap and used and used + img.num_tokens > cap:
                return max(img.offset, start)
            self._encode[img.digest] = img
        return end

    def _admit(self, req: Request, out: SchedulerOutput) -> bool:
        """Give a waiting request a slot, its prefix hit and its checkpoint plan."""
        slot = self._alloc_slot()
        if not slot:
            return False
        req.slot = slot
        if self.cache is not None and req.use_cache:
            if not req.hashes:
                req.hashes = self.cache.hashes(req.prompt_ids, req.extra_keys)
            hit = self.cache.lookup(req.tokens, req.extra_keys, hashes=req.hashes)
            if hit.num_tokens:
                self.cache.acquire(hit)
                req.pages = list(hit.pages)
                req.hit = hit
                if hit.partial_page is not None:
                    private = self._alloc_pages(1)
                    if private is None:
                        self.free(req)
                        return False
                    out.page_copies.append((hit.partial_page, private[0]))
                    req.pages += private
            req.num_computed = hit.num_tokens
            if not req.output_ids:
                req.num_cached_tokens = hit.num_tokens
            junction = self.junctions.common_prefix(req.hashes)
            self.junctions.add(req.hashes)
            # periodic checkpoints are not planned: chunks end on the block grid (_last_block_end)
            req.checkpoints = self.cache.suggest_checkpoints(len(req.prompt_ids), req.hashes, hit.num_tokens, junction)
        return True

    def _should_wait(self, req: Request, scheduled: dict) -> tuple:
        """Prefix-aware admission: (whether `req` should stay waiting for a running prefill that is computing a
        longer prefix of its prompt than the cache holds now, budget tokens freed by cutting that prefill's chunk
        at the junction). See the module docstring. scheduled: request id -> this step's chunk."""
        limit = self.cfg.prefix_wait_steps
        if self.cache is None or not req.use_cache or not limit or req.waited_steps >= limit:
            return False, 0
        if req.wait_for is not None:
            owner, pos = req.wait_for
            if owner.status == Status.RUNNING and owner.num_computed < pos and pos in owner.checkpoints:
                req.waited_steps += 1
                return True, 0
            req.wait_for = None          # registered (or the owner left): look again
        if not req.hashes:
            req.hashes = self.cache.hashes(req.prompt_ids, req.extra_keys)
        unit = self.cfg.prefix_match_unit
        max_units = min(len(req.hashes), (len(req.prompt_ids) - 1) // unit)   # a hit leaves a token to compute
        owner, pos = None, 0
        for r in self.running:
            if r.use_cache and r.num_computed < len(r.prompt_ids):
                shared = self._shared_units(req.hashes, r.hashes, max_units) * unit
                if shared > max(pos, r.num_computed):
                    owner, pos = r, shared
        if owner is None or pos <= self.cache.lookup(req.prompt_ids, req.extra_keys, hashes=req.hashes,
                                                     record=False).num_tokens:
            return False, 0
        freed = self._plan_checkpoint(owner, pos, scheduled.get(owner.request_id))
        if freed is None:
            return False, 0
        req.wait_for = (owner, pos)
        req.waited_steps += 1
        return True, freed

    def _restore_from_host(self, req: Request, out: SchedulerOutput) -> bool:
        """Copy back the longest prefix of req's prompt the host tier holds beyond the device cache's hit:
        pages and a slot allocated, registered as pending entries, their data written by the engine before
        this step (out.restores). Returns whether it did (the request then waits a step)."""
        if not req.use_cache or not len(self.host):
            return False
        if not req.hashes:
            req.hashes = self.cache.hashes(req.prompt_ids, req.extra_keys)
        unit, ps = self.cfg.prefix_match_unit, self.cfg.page_size
        device = self.cache.lookup(req.prompt_ids, req.extra_keys, hashes=req.hashes, record=False).num_tokens
        key = self.host.longest(req.hashes, (len(req.prompt_ids) - 1) // unit, device // unit)
        if key is None:
            return False
        entry = self.host.pop(key)
        n = entry.num_tokens
        have = [self.cache.page_id(h) for h in entry.page_hashes[:n // ps]] + ([None] if n % ps else [])
        reuse = [p for p in have if p is not None]
        self.pages.incref(reuse)             # pinned: the allocations below may evict
        new = self._alloc_pages(have.count(None))
        slot = self._alloc_slot() if new is not None else 0
        if not slot:
            self.pages.decref(reuse + (new or []))
            self.host.put(key, entry)
            return False
        fresh = iter(new)
        bt = [p if p is not None else next(fresh) for p in have]
        self.cache.register_pages(req.hashes, bt, n)
        registered = self.cache.register_checkpoint(req.hashes, n, slot, bt)
        if not registered:
            self.slots.decref([slot])
        # every page the index took must get its data (visible next step), the partial one with the checkpoint
        rows = [(j, p) for j, (p, h) in enumerate(zip(bt, entry.page_hashes)) if have[j] is None
                and self.cache.page_id(h) == p] + ([(len(bt) - 1, bt[-1])] if n % ps and registered else [])
        self.pages.decref(reuse + new)
        out.restores.append((entry, rows, slot if registered else 0))
        return True

    @staticmethod
    def _shared_units(a, b, limit: int) -> int:
        """Units two chained hash lists share from the start (a binary search: sharing unit m implies
        sharing every unit before it)."""
        lo, hi = 0, min(limit, len(a), len(b))
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if a[mid - 1] == b[mid - 1]:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _plan_checkpoint(self, r: Request, pos: int, chunk: Optional[ScheduledChunk]) -> Optional[int]:
        """Make running prefill `r` register a checkpoint at pos (> r.num_computed): plan it into r's chunking,
        or, when this step's chunk of r reaches pos already, checkpoint the chunk there (cutting it short if
        it goes further). Returns the budget tokens the cut freed, or None when no checkpoint can be had."""
        if self.cache.has_checkpoint(r.hashes, pos):
            return None                  # one exists, yet no hit reaches it (its pages are gone): do not wait
        freed = 0
        if chunk is not None and pos <= chunk.end:
            if not chunk.ckpt_dst:
                chunk.ckpt_dst = self._alloc_slot()
                if not chunk.ckpt_dst:
                    return None
            freed, chunk.end = chunk.end - pos, pos
        if pos not in r.checkpoints:
            r.checkpoints = sorted(r.checkpoints + [pos])
        return freed

    def schedule(self) -> SchedulerOutput:
        if self.cache is not None:
            self.cache.commit_pending()      # last step's registrations are now complete
        cfg = self.cfg
        out = SchedulerOutput([], [], [])
        self._encode = {}
        # (a request whose last token is sampled by the step in flight has nothing left to run)
        order = sorted((r for r in self.running if not r.final_sampled),
                       key=lambda r: (not r.is_decode, r.priority, r.arrival))
        scheduled = {}                       # request id -> its chunk of this step
        decoding = any(r.is_decode for r in order)
        budget = self._lone_budget(order, decoding)
        while order and budget > 0 and len(out.chunks) < cfg.max_num_seqs:
            req = order.pop(0)
            ch = self._chunk(req, budget, decoding)
            if ch is None:
                continue
            need = self._pages_needed(req, ch.end + len(ch.drafts))
            new = self._alloc_pages(need)
            while new is None and order:     # preempt the lowest-priority request not yet scheduled
                self._preempt(order.pop(), out)
                new = self._alloc_pages(need)
            if new is None:
                if ch.ckpt_dst:
                    self.slots.decref([ch.ckpt_dst])
                self._preempt(req, out)
                continue
            req.pages += new
            out.chunks.append(ch)
            scheduled[req.request_id] = ch
            budget -= ch.num_tokens
        # A request whose last token the step in flight samples is done computing: it does not count against
        # max_num_seqs, so a prefill-only workload (max_tokens=1) schedules its next step while the device
        # runs the last one instead of waiting for the last one's tokens (its pages and slot stay held).
        live = sum(not r.final_sampled for r in self.running)
        for req in list(self.waiting):
            if budget <= 0 or len(out.chunks) >= cfg.max_num_seqs or live >= cfg.max_num_seqs:
                break
            if req.tokens_in_flight:     # preempted while a launch of several steps runs: its tokens come first
                continue
            if self.host is not None and req.wait_for is None and self._restore_from_host(req, out):
                continue                 # its prefix is being copied back: it hits next step
            wait, freed = self._should_wait(req, scheduled)
            budget += freed
            if wait:
                continue
            if not self._admit(req, out):
                break
            ch = self._chunk(req, budget, decoding)
            new = None if ch is None else self._alloc_pages(self._pages_needed(req, ch.end))
            if new is None:
                if ch is not None and ch.ckpt_dst:
                    self.slots.decref([ch.ckpt_dst])
                out.page_copies = [c for c in out.page_copies if c[1] not in req.pages]
                self.free(req)
                break
            req.pages += new
            self.waiting.remove(req)
            req.status = Status.RUNNING
            req.wait_for = None
            self.running.append(req)
            live += 1
            out.chunks.append(ch)
            scheduled[req.request_id] = ch
            budget -= ch.end - ch.start
        out.encode = list(self._encode.values())
        return out

    def after_step(self, out: SchedulerOutput):
        """Advance every scheduled request and register what the step computed in the prefix cache."""
        for ch in out.chunks:
            req = ch.req
            req.num_computed = ch.end
            if self.cache is None or not req.use_cache:
                continue
            if req.hit is not None:
                self.cache.release_copy_sources(req.hit)
                req.hit = None
            prompt_len = len(req.prompt_ids)
            if ch.start < prompt_len:      # the pages before the chunk's first were registered by earlier steps
                self.cache.register_pages(req.hashes, req.pages, min(ch.end, prompt_len),
                                          from_page=ch.start // self.cfg.page_size)
            if ch.ckpt_dst:
                if not self.cache.register_checkpoint(req.hashes, ch.end, ch.ckpt_dst, req.pages):
                    self.slots.decref([ch.ckpt_dst])

    def stats(self) -> dict:
        s = {
            "num_running": len(self.running), "num_waiting": len(self.waiting),
            "page_usage": self.pages.usage, "slot_usage": self.slots.usage,
            "num_preemptions": self.num_preemptions,
        }
        if self.host is not None:
            s.update(self.host.stats, host_entries=len(self.host), host_bytes=self.host.bytes)
        if self.cache is not None:
            s["prefix_queried_tokens"] = self.cache.stats["queried_tokens"]
            s["prefix_hit_tokens"] = self.cache.stats["hit_tokens"]
        return s

    def cache_usage(self) -> dict:
        """Pages and KDA slots by state: in use (held by an unfinished request), cached (held by the
        prefix cache alone: evictable on demand) and free."""
        live = self.running + list(self.waiting)
        in_use = {"pages": len({p for r in live for p in r.pages if p}),
                  "slots": len({r.slot for r in live if r.slot})}
        out = {}
        for kind, alloc in (("pages", self.pages), ("slots", self.slots)):
            out[f"{kind}_in_use"] = in_use[kind]
            out[f"{kind}_cached"] = alloc.num_used - in_use[kind]
            out[f"{kind}_free"] = alloc.num_free
        return out
