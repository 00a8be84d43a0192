"""An 8k-token prompt run through the engine in small chunks (16-token pages, 512-token steps) gives the
logits of one full forward of the prompt (tiny-random, fp32: KDA states carried chunk to chunk, MLA in the
expanded form over the paged context, a 1024-key window at a time, so late chunks walk ~8 windows), with
and without a prefix-cache hit (the second prompt resumes at a cached KDA checkpoint and reads the cached
MLA pages)."""
import jax
import numpy as np
import pytest

from pallas_kernels.backend import detect
from serving.engine_args import EngineArgs
from serving.sampling_params import SamplingParams


TOP = 8


@pytest.fixture(scope="module")
def model():
    from k3jax.api import load_model
    m = load_model("tiny-random", dtype="float32")
    m.backend = detect("reference", mla_prefill="expanded")    # every chunk expanded (the GPU's form), jnp path
    return m


def _first_token_logprobs(eng, prompt):
    rid = eng.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0, logprobs=TOP))
    while eng.has_unfinished():
        for out in eng.step():
            if out.request_id == rid and out.finished:
                _, top = out.outputs[0].logprobs[0]
                return dict(top), out
    raise AssertionError("no output")


def _full(model, prompt):
    """log-softmax of the last position's logits of one full forward, top TOP."""
    lg = model.logits(np.asarray([prompt]))[0, -1].astype(np.float64)
    lp = lg - lg.max() - np.log(np.exp(lg - lg.max()).sum())
    ids = np.argsort(-lp)[:TOP]
    return {int(i): lp[i] for i in ids}


# with the prefix cache on, the first prompt misses (chunks from nothing) and the second hits: CI runs that one
# (~35 s on 2 cores); the cache-off engine's compiles are the slow tier's
@pytest.mark.parametrize("prefix_caching", [pytest.param(False, marks=pytest.mark.slow), True])
def test_chunked_8k_prompt_equals_full_forward(model, prefix_caching, monkeypatch):
    from k3jax.layers import mla
    from serving.engine import LLMEngine
    monkeypatch.setattr(mla, "EXPANDED_MIN_WINDOW_KEYS", 0)      # 2 keys per step token: several windows
    rng = np.random.RandomState(11)
    a = rng.randint(0, 768, 8100).tolist()
    b = a[:8064] + rng.randint(0, 768, 40).tolist()
    eng = LLMEngine(model, EngineArgs(max_num_seqs=2, max_num_batched_tokens=512, page_size=16, prefix_match_unit=16,
                                      state_block_size=1024, max_model_len=8192, enable_prefix_caching=prefix_caching,
                                      warmup=False, compilation_cache_dir=None, num_pages=1100, num_slots=24))
    for prompt in (a, b):
        got, out = _first_token_logprobs(eng, prompt)
        want = _full(model, prompt)
        assert list(got) == list(want)[:len(got)] or set(got) == set(want), (got, want)
        np.testing.assert_allclose([got[k] for k in want], list(want.values()), rtol=0, atol=2e-4)
    # the second prompt hit the cache (a KDA checkpoint at 7168 and the pages before it) only when enabled
    assert (out.num_cached_tokens > 0) == prefix_caching, out.num_cached_tokens
    assert jax.default_backend() == "cpu"


@pytest.mark.slow     # CI's time budget (its own long step shapes); test_cache_path's chunks run by default
def test_lone_long_prompt_in_big_steps_checkpoints_where_a_later_prompt_resumes(model, monkeypatch):
    """A lone prompt of 600 tokens runs in long_prefill_tokens steps (128, 2x the 64-token budget: the runner's
    long bucket) with the prefix cache on; its chunks end on the 128-token block grid and checkpoint there, and
    the first token's log-probabilities equal a full forward's. A second prompt sharing 540 tokens resumes at 512
    (the last checkpoint at or below the shared part) and equals its full forward too."""
    from k3jax.layers import mla
    from serving.engine import LLMEngine
    monkeypatch.setattr(mla, "EXPANDED_MIN_WINDOW_KEYS", 0)      # 2 keys per step token: several windows a step
    rng = np.random.RandomState(12)
    a = rng.randint(0, 768, 600).tolist()
    b = a[:540] + rng.randint(0, 768, 60).tolist()               # the same length: one full-forward compile
    eng = LLMEngine(model, EngineArgs(max_num_seqs=2, max_num_batched_tokens=64, long_prefill_tokens=128,
                                      page_size=16, prefix_match_unit=16, state_block_size=128, max_model_len=768,
                                      warmup=False, compilation_cache_dir=None, num_pages=100, num_slots=16,
                                      token_buckets=(64,)))     # two step shapes: 64 and the long 128
    assert eng.runner.long_token_buckets == [128]
    steps = []
    launch = eng.runner.launch

    def spy(chunks, *args, **kw):
        steps.append([(c.context_len, c.context_len + len(c.tokens), c.ckpt_dst > 0) for c in chunks])
        return launch(chunks, *args, **kw)
    eng.runner.launch = spy
    for prompt, cached, want_steps in (
            # whole long steps, then to the end checkpoint (592: an identical prompt hits) and the rest
            (a, 0, [[(0, 128, True)], [(128, 256, True)], [(256, 384, True)], [(384, 512, True)], [(512, 592, True)],
                    [(592, 600, False)]]),
            # from the checkpoint at 512: to the junction with the first prompt (528), its end checkpoint, the rest
            (b, 512, [[(512, 528, True)], [(528, 592, True)], [(592, 600, False)]])):
        steps.clear()
        got, out = _first_token_logprobs(eng, prompt)
        want = _full(model, prompt)
        assert list(got) == list(want)[:len(got)] or set(got) == set(want), (got, want)
        np.testing.assert_allclose([got[k] for k in want], list(want.values()), rtol=0, atol=2e-4)
        assert out.num_cached_tokens == cached
        assert steps == want_steps, steps
