"""Request bookkeeping on the host."""
from serving.request import Request
from serving.sampling_params import SamplingParams


def test_token_slice_equals_slicing_the_whole_sequence():
    r = Request("a", list(range(10)), SamplingParams(), seed=0)
    r.output_ids = [100, 101, 102]
    for s in range(14):
        for e in range(s, 14):
            assert r.token_slice(s, e) == r.tokens[s:e], (s, e)
