"""The FP8 MLA cache on the trained `tiny` (tools/kv_cache_quality.py): held-out perplexity within 1% of the
16-bit cache's and greedy agreement >= 97%, every token's attention reading its context from the cache."""
import pytest

from tools.kv_cache_quality import compare


@pytest.fixture(scope="module")
def tiny():
    from k3jax import load_model
    return load_model("tiny", dtype="bfloat16")


def _check(res):
    assert abs(res["ppl_ratio"] - 1) <= 0.01, res
    assert res["greedy_agreement"] >= 0.97, res
    assert res["ppl_ratio"] != 1.0, res               # the caches differ: the FP8 path really ran


@pytest.mark.slow          # ~25 s on 2 cores; the kernel-level FP8 tests run by default
def test_fp8_cache_quality_small(tiny):
    _check(compare(tiny, 4, 24))


@pytest.mark.slow
def test_fp8_cache_quality_16x256(tiny):
    _check(compare(tiny, 16, 256))
