"""Request bookkeeping on the host."""
from serving.request import Request
from serving.sampling_params import SamplingParams


def test_token_slice_equals_slicing_the_whole_sequence():
    r = Request("a", list(range(10)), SamplingParams(), seed=0)
    r.output_ids = [100, 101, 102]
    for s in range(14):
        for e in range(s, 14):
            assert r.token_slice(s, e) == r.tokens[s:e], (s, e)


def test_page_array_follows_the_block_table():
    r = Request("a", [1, 2, 3], SamplingParams(), seed=0)
    assert r.page_array().tolist() == []
    r.pages += [5, 6]
    a = r.page_array()
    assert a.tolist() == [5, 6] and a.dtype.name == "int32"
    r.pages += [9]
    assert r.page_array().tolist() == [5, 6, 9]
    r.pages = []                            # preemption, then a new admission
    r.pages = [7, 6, 1]
    assert r.page_array().tolist() == [7, 6, 1]
    r.pages += [2]
    assert r.page_array().tolist() == [7, 6, 1, 2]
