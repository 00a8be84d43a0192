"""Several decode steps per launch (EngineArgs.decode_steps_per_launch), CPU fp32: outputs identical to one
step per launch, greedy and seeded sampling, async and synchronous scheduling, through stop tokens and strings
inside a launch, max_tokens not a multiple of the launch, waiting requests, logprobs and penalties (which fall
back to single steps); the final state a launch leaves is cached only when it matches the kept tokens.

One engine per model: "one step per launch" is the same engine with engine.decode_steps = 1, so both runs
share every compiled step.
"""
import numpy as np
import pytest

from k3jax import load_model
from serving.engine import LLMEngine
from serving.engine_args import EngineArgs
from serving.sampling_params import SamplingParams

K = 4


def _engine(model, tmp, **kw):
    args = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=192, page_size=16, prefix_match_unit=16,
                num_pages=48, num_slots=24, token_buckets=(64,), seq_buckets=(4,), warmup=False, vision=False,
                compilation_cache_dir=str(tmp), decode_steps_per_launch=K, decode_steps_max_seqs=4)
    args.update(kw)
    return LLMEngine(model, EngineArgs(**args))


def _run(engine, work, steps, async_scheduling=True, clear=True):
    engine.decode_steps = steps
    engine.args.async_scheduling = async_scheduling
    if clear:
        engine.scheduler.cache.clear()
    for rid, prompt, params in work:
        engine.add_request(prompt, params, request_id=rid)
    res, pieces = {}, {}
    while engine.has_unfinished():
        for o in engine.step():
            pieces.setdefault(o.request_id, []).extend(o.metrics["new_token_ids"])
            if o.finished:
                c = o.outputs[0]
                res[o.request_id] = (c.token_ids, c.text, c.finish_reason, c.logprobs, o.num_cached_tokens)
    for rid, r in res.items():          # streamed pieces add up to the final output
        assert pieces[rid] == r[0], rid
    return res


@pytest.fixture(scope="module")
def rnd(tmp_path_factory):
    return _engine(load_model("tiny-random", dtype="float32"), tmp_path_factory.mktemp("xla"))


def _workload(stop_ref=None):
    rng = np.random.RandomState(0)
    g = lambda n, **kw: SamplingParams(temperature=0.0, max_tokens=n, **kw)   # noqa: E731
    p = [rng.randint(0, 1000, n).tolist() for n in (40, 23, 31, 17, 50)]
    work = [("a", p[0], g(30)), ("b", p[1], g(21)),
            ("sampled", p[2], SamplingParams(temperature=0.9, seed=7, max_tokens=26)),
            # logprobs, penalties and logit bias take single steps while they run
            ("lp", p[3], g(5, logprobs=2)), ("pen", p[1], g(6, presence_penalty=1.5)),
            ("bias", p[0], g(7, logit_bias={5: 3.0})), ("c", p[3], g(9))]
    if stop_ref is None:
        return [("stop", p[4], g(30))]
    # a stop token and a stop string inside a launch, from the output without them
    text = stop_ref[1]
    return work + [("stop", p[4], g(30, stop_token_ids=[stop_ref[0][13]])),
                   ("stopstr", p[4], g(30, stop=[text[len(text) // 2:len(text) // 2 + 2]]))]


def test_outputs_identical_to_single_steps(rnd):
    work = _workload(_run(rnd, _workload(), 1)["stop"])
    one = _run(rnd, work, 1)
    assert one["stop"][2] == "stop" and len(one["stop"][0]) == 14 and one["stopstr"][2] == "stop"
    for async_scheduling in (True, False):
        before = rnd.counters["multi_step_launches"]
        multi = _run(rnd, work, K, async_scheduling)
        assert rnd.counters["multi_step_launches"] - before >= 4
        for rid in one:
            assert multi[rid][:3] == one[rid][:3], (rid, async_scheduling)
        np.testing.assert_allclose([lp for lp, _ in multi["lp"][3]], [lp for lp, _ in one["lp"][3]], atol=1e-5)


def test_final_state_cached_only_when_it_matches(rnd):
    """A follow-up turn over a request finished by max_tokens at the end of a launch resumes from its cached
    final state; one whose stop came early in a launch (its state ran past it) is recomputed. Both give the
    tokens of a run without the prefix cache."""
    work = _workload(_run(rnd, _workload(), 1)["stop"])
    first = {r: w for r, w in ((w[0], w) for w in work) if r in ("a", "stop")}
    multi = _run(rnd, list(first.values()), K)
    assert multi["a"][2] == "length" and multi["stop"][2] == "stop"
    follow = [("a2", first["a"][1] + multi["a"][0] + [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=10)),
              ("stop2", first["stop"][1] + multi["stop"][0] + [5, 6], SamplingParams(temperature=0.0, max_tokens=10))]
    hit = _run(rnd, follow, K, clear=False)
    assert hit["a2"][4] >= len(follow[0][1]) - 16       # resumed from "a"'s cached final state
    fresh = _run(rnd, follow, 1)
    assert fresh["a2"][4] == 0 and fresh["stop2"][4] == 0
    for rid in ("a2", "stop2"):
        assert hit[rid][0] == fresh[rid][0], rid


@pytest.mark.slow          # ~45 s on 2 cores: the trained tiny's compiles
def test_trained_tiny_text(tmp_path):
    eng = _engine(load_model("tiny", dtype="float32"), tmp_path)
    work = [(f"t{i}", p, SamplingParams(temperature=0.0, max_tokens=n)) for i, (p, n) in enumerate(
        [("The engine schedules", 19), ("Speculative decoding", 22)])]
    one, multi = _run(eng, work, 1), _run(eng, work, K)
    assert eng.counters["multi_step_launches"] > 0
    for rid in one:
        assert multi[rid][:3] == one[rid][:3], rid
        assert len(one[rid][1]) > 10


def test_bad_values():
    for kw in ({"decode_steps_per_launch": 0}, {"decode_steps_max_seqs": 0}, {"decode_steps_per_launch": 2.0}):
        with pytest.raises(ValueError, match=next(iter(kw))):
            EngineArgs(**kw)


def test_scheduler_waits_for_tokens_in_flight_and_reserves_pages():
    """A request preempted while a launch of several steps has its tokens on the device is re-admitted only
    after they are fetched (its intermediate tokens have no device placeholder); reserve_pages extends a
    block table to a position and refuses when the pool is short."""
    from serving.request import Request
    from serving.scheduler import Scheduler, SchedulerConfig
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, page_size=16, max_model_len=256,
                                      prefix_match_unit=16, enable_prefix_caching=False), num_pages=6, num_slots=8)
    req = Request("r", list(range(20)), SamplingParams(temperature=0.0, max_tokens=50), seed=0)
    req.output_ids, req.tokens_in_flight = [-1] * 4, True
    sched.add(req)
    assert sched.schedule().chunks == []
    req.output_ids, req.tokens_in_flight = [3, 4, 5, 6], False
    out = sched.schedule()
    assert [(c.req.request_id, c.start, c.end) for c in out.chunks] == [("r", 0, 24)] and len(req.pages) == 2
    assert sched.reserve_pages(req, 24 + 16) and len(req.pages) == 3
    assert not sched.reserve_pages(req, 16 * 7) and len(req.pages) == 3      # 5 usable pages in all
