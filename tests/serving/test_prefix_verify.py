"""The prefix-cache verifier's distance between two top-K log-probability lists; the
end-to-end check is test_engine.py::test_verify_prefix_cache_passes_true_hits_and_catches_a_corrupted_checkpoint."""
import numpy as np
import pytest

from serving.prefix_verify import PrefixCacheVerifier, logprob_distance


def _top_k(lp, k):
    ids = np.argsort(-lp)[:k]
    return ids, lp[ids]


@pytest.mark.parametrize("seed", range(20))
def test_distance_is_a_lower_bound_of_the_full_linf_distance(seed):
    rng = np.random.RandomState(seed)
    a = rng.randn(50)
    b = a + rng.randn(50) * rng.choice([1e-3, 0.3, 3.0])
    d = logprob_distance(*_top_k(a, 5), *_top_k(b, 5))
    full = np.abs(a - b).max()
    assert d <= full + 1e-12
    # over the ids both lists hold, the distance is exact
    shared = set(_top_k(a, 5)[0]) & set(_top_k(b, 5)[0])
    assert d >= max((abs(a[t] - b[t]) for t in shared), default=0.0)


def test_identical_lists_are_at_distance_zero_and_a_swapped_top_is_not():
    ids, vals = np.array([3, 1, 2]), np.array([-0.1, -2.0, -3.0])
    assert logprob_distance(ids, vals, ids, vals) == 0.0
    assert logprob_distance(ids, vals, np.array([1, 3, 2]), np.array([-0.1, -2.0, -3.0])) == pytest.approx(1.9)
    # an id missing from one side counts as that side's K-th value at most
    assert logprob_distance(np.array([7, 1]), np.array([-0.5, -1.0]), np.array([1, 2]), np.array([-1.0, -4.0])) == 3.5


def test_fraction_is_validated():
    with pytest.raises(ValueError, match="fraction"):
        PrefixCacheVerifier(0.0, 0.1)
    with pytest.raises(ValueError, match="fraction"):
        PrefixCacheVerifier(1.5, 0.1)
