import numpy as np
import pytest

from serving.allocator import PageAllocator, SlotAllocator


def test_allocate_never_hands_out_zero_and_reports_shortage():
    a = PageAllocator(8)
    assert a.capacity == 7 and a.num_free == 7 and a.usage == 0.0
    ids = a.allocate(7)
    assert sorted(ids) == list(range(1, 8))
    assert a.num_free == 0 and a.usage == 1.0
    assert a.allocate(1) is None  # caller decides to evict / preempt
    assert a.allocate(0) == []
    a.check_consistent()


def test_shortage_takes_nothing():
    a = SlotAllocator(5)
    a.allocate(2)
    assert a.allocate(3) is None
    assert a.num_free == 2
    assert len(a.allocate(2)) == 2


def test_refcounts_free_at_zero():
    a = PageAllocator(6)
    x, y, z = a.allocate(3)
    a.incref([x, x, y])
    assert a.refcount(x) == 3 and a.refcount(y) == 2 and a.refcount(z) == 1
    assert a.decref([x, y, z]) == [z]
    assert a.num_free == 3
    assert a.decref([x, x]) == [x]
    assert a.decref([y]) == [y]
    assert a.num_free == 5
    a.check_consistent()


def test_double_free_and_bad_ids_are_errors_and_leave_state_unchanged():
    a = SlotAllocator(6)
    x, y = a.allocate(2)
    a.decref([x])
    with pytest.raises(ValueError, match="double free"):
        a.decref([x])
    with pytest.raises(ValueError, match="double free"):
        a.decref([y, y])  # y has one ref; the whole call fails
    assert a.refcount(y) == 1
    with pytest.raises(ValueError):
        a.incref([x])  # free id
    with pytest.raises(ValueError):
        a.decref([0])  # reserved
    with pytest.raises(ValueError):
        a.incref([6])  # out of range
    a.check_consistent()
    assert a.num_free == 4


def test_usage_and_reuse_after_free():
    a = PageAllocator(11)
    ids = a.allocate(5)
    assert a.usage == pytest.approx(0.5)
    a.decref(ids[:2])
    again = a.allocate(2)
    assert sorted(again) == sorted(ids[:2])  # freed ids are reused first
    assert 0 not in again


def test_listener_reports_last_reference_of_watched_ids():
    a = PageAllocator(8)
    seen = []
    a.set_listener(seen.extend)
    x, y = a.allocate(2)
    a.watch([x])
    a.incref([x, x, y])
    a.decref([x, y])
    assert seen == []           # x still has 2
    a.decref([x, y])
    assert seen == [x]          # y is not watched
    with pytest.raises(ValueError):
        a.set_listener(print)   # one listener only


def test_random_ops_match_a_model():
    rng = np.random.default_rng(0)
    a = PageAllocator(33)
    ref = {}
    for _ in range(2000):
        op = rng.integers(3)
        if op == 0:
            n = int(rng.integers(0, 6))
            ids = a.allocate(n)
            free = 32 - len(ref)
            assert (ids is None) == (n > free)
            for i in ids or []:
                assert i not in ref and i != 0
                ref[i] = 1
        elif ref:
            i = int(rng.choice(list(ref)))
            if op == 1:
                a.incref([i])
                ref[i] += 1
            else:
                a.decref([i])
                ref[i] -= 1
                if not ref[i]:
                    del ref[i]
        assert a.num_free == 32 - len(ref)
    a.check_consistent()
    for i, c in ref.items():
        assert a.refcount(i) == c
