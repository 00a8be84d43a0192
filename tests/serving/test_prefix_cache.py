import json
import os
import subprocess
import sys

import numpy as np
import pytest

from serving.allocator import PageAllocator, SlotAllocator
from serving.hashing import chain_hashes
from serving.prefix_cache import CacheEntry, JunctionTracker, PrefixCacheIndex

PS, U = 64, 16  # page size, match unit (state block 256 plays no role in the index)


class Sim:
    """A minimal engine: requests own block tables and a working slot; checkpoints are
    registered where the (simulated) scheduler stopped."""

    def __init__(self, num_pages=64, num_slots=8):
        self.pages, self.slots = PageAllocator(num_pages), SlotAllocator(num_slots)
        self.idx = PrefixCacheIndex(self.pages, self.slots, PS, U)

    def prefill(self, tokens, stops=(), extra=None, hit=None):
        h = self.idx.hashes(tokens, extra)
        shared = hit.pages if hit else []
        own = self.pages.allocate(-(-len(tokens) // PS) - len(shared))
        assert own is not None
        bt = shared + own
        ws = self.slots.allocate(1)[0]
        if hit:
            self.idx.release_copy_sources(hit)  # copies "issued"
        for n in stops:
            self.idx.register_pages(h, bt, n)
            s = self.slots.allocate(1)[0]
            assert self.idx.register_checkpoint(h, n, s, bt)
        self.idx.register_pages(h, bt, len(tokens))
        return dict(bt=bt, ws=ws, h=h)

    def finish(self, req):
        self.pages.decref(req["bt"])
        self.slots.decref([req["ws"]])

    def assert_empty_after_clear(self):
        self.idx.clear()
        assert self.idx.num_entries() == {"pages": 0, "checkpoints": 0}
        assert self.pages.num_free == self.pages.capacity
        assert self.slots.num_free == self.slots.capacity
        self.pages.check_consistent()
        self.slots.check_consistent()


def toks(n, seed):
    return np.random.default_rng(seed).integers(0, 150000, n).tolist()


def test_chained_hash_names_the_whole_prefix():
    a = toks(64, 1)
    b = list(a)
    b[3] += 1  # different head, same tail
    ha, hb = chain_hashes(a, U), chain_hashes(b, U)
    assert len(ha) == 4
    assert all(x != y for x, y in zip(ha, hb))
    assert chain_hashes(a, U) == ha
    assert chain_hashes(a[:50], U) == ha[:3]  # partial unit not hashed
    # extending a chain equals hashing the whole
    assert chain_hashes(a[32:], U, parent=ha[1], start_unit=2) == ha[2:]
    assert chain_hashes(a, U, namespace="other") != ha


def test_hash_is_stable_across_processes():
    code = ("from serving.hashing import chain_hashes;"
            "print(chain_hashes(list(range(32)), 16, {1: ['img', 7]})[-1].hex())")
    outs = set()
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        outs.add(subprocess.check_output([sys.executable, "-c", code], env=env,
                                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))).strip())
    assert len(outs) == 1
    assert outs.pop().decode() == chain_hashes(list(range(32)), 16, {1: ["img", 7]})[-1].hex()


def test_granularity_700_token_prefix_hits_688_with_partial_page():
    sim = Sim()
    prefix = toks(700, 2)
    a = sim.prefill(prefix, stops=[688])
    sim.idx.commit_pending()
    query = prefix + toks(100, 3)
    hit = sim.idx.lookup(query)
    assert hit.num_tokens == 688
    assert hit.pages == a["bt"][:10]           # 10 full pages shared
    assert hit.partial_page == a["bt"][10]     # rows [640, 688) to copy
    assert hit.copy_rows == 48
    assert hit.checkpoint_slot is not None
    # the same prompt again hits too (N < len keeps one token to compute)
    assert sim.idx.lookup(prefix).num_tokens == 688
    # diverging inside unit 43 (tokens 688..703) still hits 688; diverging at 687 does not
    q2 = list(query)
    q2[690] += 1
    assert sim.idx.lookup(q2).num_tokens == 688
    q3 = list(query)
    q3[687] += 1
    assert sim.idx.lookup(q3).num_tokens == 0


def test_short_prompt_hits_below_one_page():
    sim = Sim()
    p = toks(40, 4)
    a = sim.prefill(p, stops=[32])
    sim.idx.commit_pending()
    hit = sim.idx.lookup(p + [1, 2, 3])
    assert (hit.num_tokens, hit.pages, hit.partial_page, hit.copy_rows) == (32, [], a["bt"][0], 32)


def test_hit_needs_both_pages_and_checkpoint():
    sim = Sim()
    p = toks(700, 5)
    sim.prefill(p, stops=[320])                 # pages up to 640, checkpoint only at 320
    sim.idx.commit_pending()
    hit = sim.idx.lookup(p + [7])
    assert hit.num_tokens == 320 and len(hit.pages) == 5 and hit.partial_page is None
    # pages alone never give a hit
    sim2 = Sim()
    sim2.prefill(p)
    sim2.idx.commit_pending()
    assert sim2.idx.lookup(p + [7]).num_tokens == 0
    # a checkpoint whose pages are not indexed is refused
    pages, slots = PageAllocator(32), SlotAllocator(4)
    idx = PrefixCacheIndex(pages, slots, PS, U)
    h = idx.hashes(p)
    bt = pages.allocate(11)
    s = slots.allocate(1)[0]
    assert not idx.register_checkpoint(h, 688, s, bt)
    assert slots.refcount(s) == 1  # not taken over


def test_deferred_visibility():
    sim = Sim()
    p = toks(300, 6)
    sim.prefill(p, stops=[288])
    assert sim.idx.lookup(p).num_tokens == 0      # same step: invisible
    assert sim.idx.has_checkpoint(sim.idx.hashes(p), 288)  # but known, so not duplicated
    sim.idx.commit_pending()
    assert sim.idx.lookup(p).num_tokens == 288


def test_duplicate_registration_keeps_first_and_does_not_leak():
    sim = Sim()
    p = toks(200, 7)
    a = sim.prefill(p, stops=[192])
    h = a["h"]
    bt2 = sim.pages.allocate(4)
    assert sim.idx.register_pages(h, bt2, 200) == 0
    s = sim.slots.allocate(1)[0]
    assert not sim.idx.register_checkpoint(h, 192, s, bt2)
    sim.slots.decref([s])
    sim.pages.decref(bt2)
    sim.finish(a)
    sim.idx.commit_pending()
    sim.assert_empty_after_clear()


def test_extra_keys_separate_images():
    sim = Sim()
    p = toks(200, 8)
    sim.prefill(p, stops=[192], extra={2: ["img-A"]})
    sim.idx.commit_pending()
    assert sim.idx.lookup(p, {2: ["img-B"]}).num_tokens == 0
    assert sim.idx.lookup(p).num_tokens == 0
    assert sim.idx.lookup(p, {2: ["img-A"]}).num_tokens == 192
    assert sim.idx.lookup(p, [None, (), ("img-A",)]).num_tokens == 192  # sequence form


def test_copy_on_write_refcounts():
    sim = Sim()
    p = toks(700, 9)
    a = sim.prefill(p, stops=[688])
    sim.idx.commit_pending()
    hit = sim.idx.lookup(p + [1])
    before = [sim.pages.refcount(i) for i in hit.pages]
    sim.idx.acquire(hit)
    assert [sim.pages.refcount(i) for i in hit.pages] == [r + 1 for r in before]
    assert sim.slots.refcount(hit.checkpoint_slot) == 2
    b = sim.prefill(p + [1], hit=hit)             # copies issued -> sources released
    assert sim.slots.refcount(hit.checkpoint_slot) == 1
    assert b["bt"][:10] == a["bt"][:10] and b["bt"][10] != a["bt"][10]  # private partial
    sim.finish(a)
    sim.finish(b)
    sim.idx.commit_pending()
    sim.assert_empty_after_clear()


def test_lru_order_and_referenced_entries_survive():
    sim = Sim(num_pages=64, num_slots=5)          # 4 usable slots
    prompts = [toks(150, 10 + i) for i in range(3)]
    for p in prompts:
        sim.finish(sim.prefill(p, stops=[144]))
    sim.idx.commit_pending()
    assert sim.slots.num_free == 1
    h0 = sim.idx.lookup(prompts[0])
    sim.idx.acquire(h0)                           # prompt 0 most recent
    sim.idx.release(h0)
    # need 2 free slots: evicts exactly the least recently used checkpoint (prompt 1)
    assert sim.idx.evict(num_slots_needed=2)
    assert [sim.idx.lookup(p, record=False).num_tokens for p in prompts] == [144, 0, 144]
    assert sim.idx.num_entries()["pages"] == 6     # only slots were needed: pages stay
    h2 = sim.idx.lookup(prompts[2])
    sim.idx.acquire(h2)                           # referenced: never evicted
    assert not sim.idx.evict(num_pages_needed=sim.pages.capacity)
    assert sim.idx.lookup(prompts[2], record=False).num_tokens == 144
    assert sim.idx.lookup(prompts[0], record=False).num_tokens == 0
    sim.idx.release(h2)
    sim.assert_empty_after_clear()


def test_pending_entries_and_running_requests_are_not_evicted():
    sim = Sim()
    p = toks(300, 20)
    a = sim.prefill(p, stops=[288])
    assert not sim.idx.evict(num_slots_needed=sim.slots.capacity)  # pending
    sim.idx.commit_pending()
    assert not sim.idx.evict(num_pages_needed=sim.pages.capacity)
    # the checkpoint (slot ref only the cache's) went; pages used by `a` stayed
    assert sim.idx.num_entries() == {"pages": 4, "checkpoints": 0}
    sim.finish(a)
    sim.assert_empty_after_clear()


def test_random_workload_invariants_and_no_leaks():
    rng = np.random.default_rng(0)
    sim = Sim(num_pages=96, num_slots=16)
    systems = [toks(int(rng.integers(20, 400)), 100 + i) for i in range(4)]
    live, hits_seen = [], 0
    jt = JunctionTracker(U)
    for step in range(300):
        sim.idx.commit_pending()
        if live and (rng.random() < 0.4 or len(live) > 4):
            sim.finish(live.pop(int(rng.integers(len(live)))))
        p = systems[int(rng.integers(4))] + toks(int(rng.integers(1, 200)), 1000 + step)
        hit = sim.idx.lookup(p)
        need_pages = -(-len(p) // PS) - len(hit.pages)
        sim.idx.acquire(hit)
        h = sim.idx.hashes(p)
        stops = sim.idx.suggest_checkpoints(len(p), h, hit.num_tokens, jt.common_prefix(h))
        jt.add(h)
        if not sim.idx.evict(need_pages, 1 + len(stops)):
            sim.idx.release(hit)
            continue
        hits_seen += hit.num_tokens > 0
        live.append(sim.prefill(p, stops, hit=hit))
        # invariant: every checkpoint's pages are indexed
        for e in sim.idx.entries():
            assert all(h in sim.idx._page for h in e.page_hashes)
    assert hits_seen > 200, hits_seen
    assert sim.idx.stats["hit_tokens"] > 0
    for r in live:
        sim.finish(r)
    sim.idx.commit_pending()
    sim.assert_empty_after_clear()


def test_entries_serialize():
    sim = Sim()
    p = toks(700, 30)
    a = sim.prefill(p, stops=[688])
    sim.idx.commit_pending()
    (e,) = sim.idx.entries()
    d = json.loads(json.dumps(e.to_dict()))
    back = CacheEntry.from_dict(d)
    assert back == e
    assert (e.num_tokens, e.page_ids, e.partial_page) == (688, a["bt"][:10], a["bt"][10])
    assert e.checkpoint_hash == a["h"][42] and e.page_hashes == [a["h"][4 * j + 3] for j in range(10)]


def test_suggest_checkpoints_and_junctions():
    sim = Sim()
    system = toks(300, 40)
    p1, p2 = system + toks(50, 41), system + toks(90, 42)
    jt = JunctionTracker(U)
    h1, h2 = sim.idx.hashes(p1), sim.idx.hashes(p2)
    assert jt.common_prefix(h1) == 0
    jt.add(h1)
    j = jt.common_prefix(h2)
    assert j == 288                                # 300 rounded down to the unit
    assert sim.idx.suggest_checkpoints(len(p2), h2, 0, j) == [288, 384]
    assert sim.idx.suggest_checkpoints(len(p2), h2, 288, j) == [384]    # already cached
    assert sim.idx.suggest_checkpoints(64, h2, 0, 0) == [48]           # keeps one token
    sim.prefill(p2, stops=[288])
    assert sim.idx.suggest_checkpoints(len(p2), h2, 0, j) == [384]      # deduplicated


def test_stats_and_validation():
    sim = Sim()
    p = toks(100, 50)
    sim.prefill(p, stops=[96])
    sim.idx.commit_pending()
    sim.idx.lookup(p)
    sim.idx.lookup(toks(100, 51))
    assert sim.idx.stats["queried_tokens"] == 200 and sim.idx.stats["hit_tokens"] == 96
    with pytest.raises(ValueError, match="page_size"):
        PrefixCacheIndex(PageAllocator(4), SlotAllocator(4), 64, 24)
    with pytest.raises(ValueError, match="num_tokens"):
        sim.idx.register_checkpoint(sim.idx.hashes(p), 40, 1, [1, 2])


def test_page_shortage_evicts_pages_past_the_last_checkpoint_first():
    sim = Sim()
    p = toks(700, 60)
    sim.finish(sim.prefill(p, stops=[320]))       # pages 0..9 indexed, checkpoint at 320
    sim.idx.commit_pending()
    assert sim.pages.num_free == 53
    assert sim.idx.evict(num_pages_needed=56)
    assert sim.idx.num_entries() == {"pages": 7, "checkpoints": 1}  # pages 9, 8, 7 went
    assert sim.idx.lookup(p).num_tokens == 320
    assert sim.idx.evict(num_pages_needed=59)      # pages 6, 5 are leaves; then the checkpoint
    assert sim.idx.num_entries() == {"pages": 4, "checkpoints": 0}
    sim.assert_empty_after_clear()


def test_tail_checkpoint_hits_only_the_same_tail_and_is_evicted_cleanly():
    """A checkpoint at a length inside a unit (a finished generation's final state)."""
    sim = Sim()
    t = toks(150, 40)
    req = sim.prefill(t)                                  # pages for [0, 128)
    n = 141                                               # 8 units + 13 tokens, page 2 partial
    slot = sim.slots.allocate(1)[0]
    with pytest.raises(ValueError, match="tokens"):
        sim.idx.register_checkpoint(req["h"], n, slot, req["bt"])
    assert sim.idx.register_checkpoint(req["h"], n, slot, req["bt"], tokens=t)
    sim.idx.commit_pending()
    sim.finish(req)
    hit = sim.idx.lookup(t[:n] + toks(5, 41))
    assert (hit.num_tokens, hit.copy_rows, hit.checkpoint_slot) == (n, n - 2 * PS, slot)
    assert hit.pages == req["bt"][:2] and hit.partial_page == req["bt"][2]
    other = t[:n - 1] + [t[n - 1] + 1] + toks(5, 41)      # last tail token differs
    assert sim.idx.lookup(other).num_tokens == 0
    assert sim.idx.lookup(t[:n]).num_tokens == 0          # no token left to compute after it
    sim.assert_empty_after_clear()
    assert not sim.idx._tails
