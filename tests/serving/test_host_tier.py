"""The host-memory tier's byte-bounded LRU; the copy out and back through an engine is
test_engine.py::test_host_tier_copies_evicted_checkpoints_back."""
import numpy as np

from serving.host_tier import HostEntry, HostTier


def _entry(n_bytes):
    return HostEntry(16, [], [np.zeros(n_bytes, np.uint8)], [], [])


def test_lru_stays_within_its_bytes_and_longest_refreshes():
    tier = HostTier(300)
    for k in (b"a", b"b", b"c"):
        tier.put(k, _entry(100))
    assert tier.longest([b"x", b"a"], 2, 0) == b"a"        # a is now the most recent
    tier.put(b"d", _entry(100))
    assert b"b" not in tier and {b"a", b"c", b"d"} <= set(tier._entries) and tier.bytes == 300
    tier.put(b"big", _entry(301))                              # larger than the whole tier: not kept
    assert b"big" not in tier and tier.stats["host_too_large"] == 1 and tier.stats["host_evicted"] == 1


def test_longest_respects_the_unit_window():
    tier = HostTier(1000)
    hashes = [b"h1", b"h2", b"h3", b"h4"]
    tier.put(b"h2", _entry(10))
    tier.put(b"h4", _entry(10))
    assert tier.longest(hashes, 4, 0) == b"h4"
    assert tier.longest(hashes, 3, 0) == b"h2"             # h4 would leave no token to compute
    assert tier.longest(hashes, 3, 2) is None              # the device already holds 2 units
    assert tier.pop(b"h2").num_tokens == 16 and tier.bytes == 10
