"""Serving engine on the tiny model (CPU): prefix caching, copy-on-write, pressure, compile guard.

Runs in float64 so that different chunkings (with and without cache hits) cannot flip a greedy
argmax through rounding: any difference is a real bug.
"""
import numpy as np
import pytest

import jax

from tests.support.engine_workloads import make_workload, run_one, run_workload
from k3jax import load_model
from serving.engine import LLMEngine
from serving.engine_args import EngineArgs
from serving.runner import CompileAfterWarmupError
from serving.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def x64():
    with jax.enable_x64(True):
        yield


@pytest.fixture(scope="module")
def model(x64, tmp_path_factory):
    return load_model("tiny-random", dtype="float64")


# The tests that need cache pressure share one pool size: each distinct pool shape is a warm-up of its own
# (every step shape compiled again), the largest cost of this file.
SMALL_POOLS = dict(num_pages=40, num_slots=12, max_num_seqs=8)


def _engine(model, tmp_path_factory, **kw):
    args = dict(max_num_seqs=16, max_num_batched_tokens=256, max_model_len=512, page_size=16, prefix_match_unit=16,
                state_block_size=64, num_pages=400, num_slots=64, token_buckets=(32, 256), seq_buckets=(16,),
                compilation_cache_dir=str(tmp_path_factory.getbasetemp() / "xla"), vision=False)
    args.update(kw)
    return LLMEngine(model, EngineArgs(**args))


def _assert_no_leaks(engine):
    engine.scheduler.cache and engine.scheduler.cache.clear()
    assert engine.scheduler.pages.num_used == 0 and engine.scheduler.slots.num_used == 0


@pytest.mark.slow     # CI's time budget: caching on/off equality by default in the follow-up test
def test_prefix_caching_on_off_identical_outputs(model, tmp_path_factory):
    work = make_workload(0, 200, model.config.vocab_size)
    on = _engine(model, tmp_path_factory)
    off = _engine(model, tmp_path_factory, enable_prefix_caching=False)
    res_on, res_off = run_workload(on, work), run_workload(off, work)
    assert set(res_on) == set(res_off) == {w[0] for w in work}
    for name in res_on:
        assert res_on[name][0] == res_off[name][0], name
    hit = sum(v[1] for v in res_on.values())
    assert hit > 2000 and all(v[1] == 0 for v in res_off.values())
    assert on.stats()["prefix_hit_tokens"] == hit
    _assert_no_leaks(on)
    _assert_no_leaks(off)


@pytest.mark.slow     # CI's time budget (two 700-token float64 prompts through their own step shapes)
def test_checkpoint_granularity_finer_than_state_block(model, tmp_path_factory):
    # (its own pool shapes: no warm-up, only the two step shapes it runs are compiled)
    eng = _engine(model, tmp_path_factory, page_size=64, state_block_size=256, max_model_len=1024, warmup=False)
    rng = np.random.RandomState(1)
    first = rng.randint(0, 1024, 700).tolist()
    second = first + rng.randint(0, 1024, 50).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=2)
    eng.add_request(first, params, request_id="a")
    while eng.has_unfinished():
        eng.step()
    eng.add_request(second, params, request_id="b")
    outs = []
    while eng.has_unfinished():
        outs += [o for o in eng.step() if o.finished]
    assert outs[0].num_cached_tokens >= 688
    # A short prompt (less than one page) hits too.
    short = rng.randint(0, 1024, 40).tolist()
    for rid in ("c", "d"):
        eng.add_request(short, params, request_id=rid)
        while eng.has_unfinished():
            outs += [o for o in eng.step() if o.finished]
    assert outs[-1].num_cached_tokens == 32


def test_follow_up_turn_resumes_at_the_end_of_the_previous_generation(model, tmp_path_factory):
    """A finished request's final KDA state is cached (a tail checkpoint, not unit-aligned): the next
    turn, which repeats prompt + answer, resumes exactly where the generation stopped."""
    rng = np.random.RandomState(7)
    prompt = rng.randint(0, 768, 50).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=21, ignore_eos=True)
    results = {}
    for caching in (True, False):
        # (the reference without caching compiles only the steps it runs: its own programs, shared by no test)
        eng = _engine(model, tmp_path_factory, enable_prefix_caching=caching, warmup=caching)
        first = run_one(eng, prompt, params, "a")
        answer = first.outputs[0].token_ids
        follow = prompt + answer + rng.randint(0, 768, 9).tolist() if caching else results["follow"]
        second = run_one(eng, follow, SamplingParams(temperature=0.0, max_tokens=4), "b")
        branch = prompt + answer[:5] + [answer[5] ^ 1] + answer[6:] if caching else results["branch"]
        third = run_one(eng, branch, SamplingParams(temperature=0.0, max_tokens=4), "c")
        results.update({caching: (answer, second.outputs[0].token_ids, third.outputs[0].token_ids),
                        "follow": follow, "branch": branch, f"cached{caching}": (second.num_cached_tokens,
                                                                                  third.num_cached_tokens)})
        _assert_no_leaks(eng)
    assert results[True] == results[False]
    n = len(prompt) + 21 - 1                          # the last sampled token was never fed back
    assert n % 16 and results["cachedTrue"][0] == n
    assert results["cachedTrue"][1] == 48             # diverges inside the answer: the prompt's checkpoint


def test_same_step_registration_is_not_reused(model, tmp_path_factory):
    eng = _engine(model, tmp_path_factory, prefix_wait_steps=0)     # y would wait for x's checkpoint otherwise
    prompt = np.random.RandomState(2).randint(0, 1024, 100).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=3)
    eng.add_request(prompt, params, request_id="x")
    eng.add_request(prompt, params, request_id="y")
    first = eng.scheduler.schedule()
    assert len(first.chunks) == 2 and all(c.start == 0 for c in first.chunks)
    eng.scheduler.running.clear()       # undo the dry run: put both back
    for c in first.chunks:
        eng.scheduler.free(c.req)
        if c.ckpt_dst:
            eng.scheduler.slots.decref([c.ckpt_dst])
    eng.scheduler.waiting.extend(c.req for c in first.chunks)
    res = {}
    while eng.has_unfinished():
        res.update({o.request_id: o for o in eng.step() if o.finished})
    assert res["x"].num_cached_tokens == 0 and res["y"].num_cached_tokens == 0
    assert res["x"].outputs[0].token_ids == res["y"].outputs[0].token_ids
    eng.add_request(prompt, params, request_id="z")
    while eng.has_unfinished():
        res.update({o.request_id: o for o in eng.step() if o.finished})
    assert res["z"].num_cached_tokens == 96
    assert res["z"].outputs[0].token_ids == res["x"].outputs[0].token_ids


def _shared_prefix_prompts(seed, groups, per_group, prefix, own):
    rng = np.random.RandomState(seed)
    prefixes = [rng.randint(0, 1024, prefix).tolist() for _ in range(groups)]
    return [prefixes[i // per_group] + rng.randint(0, 1024, own).tolist() for i in range(groups * per_group)]


def _run_all(eng, prompts, params):
    for i, p in enumerate(prompts):
        eng.add_request(p, params, request_id=f"r{i}")
    done = {}
    while eng.has_unfinished():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    return [done[f"r{i}"] for i in range(len(prompts))]


def test_prefix_aware_admission_waits_for_a_prefix_being_computed(model, tmp_path_factory):
    """4 groups x 4 requests sharing a 192-token prefix + 16 own tokens, queued at once, 256 tokens a
    step (the issue's 8 x 8 x 3072+64 with 4096 scaled down). Requests of a group admitted while its prefix is still
    being computed wait for the junction checkpoint, so only the first of each group computes it."""
    groups, per, prefix, own = 4, 4, 192, 16
    prompts = _shared_prefix_prompts(5, groups, per, prefix, own)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    possible = groups * (per - 1) * prefix / sum(map(len, prompts))
    res = {}
    for wait in (64, 0):
        eng = _engine(model, tmp_path_factory, prefix_wait_steps=wait)
        outs = _run_all(eng, prompts, params)
        res[wait] = ([o.outputs[0].token_ids for o in outs], sum(o.num_cached_tokens for o in outs) / sum(map(len, prompts)))
        _assert_no_leaks(eng)
    assert res[64][0] == res[0][0]
    assert res[64][1] == pytest.approx(possible) and res[0][1] < 0.75 * possible, (res[64][1], res[0][1], possible)


def test_verify_prefix_cache_passes_true_hits_and_catches_a_corrupted_checkpoint(model, tmp_path_factory, caplog):
    """Every hit (fraction 1) is recomputed from scratch in the background and its first token's
    log-probabilities compared; a checkpoint corrupted through the test hook is reported with its request."""
    from tests.support.serving_hooks import corrupt_checkpoint
    eng = _engine(model, tmp_path_factory, verify_prefix_cache=1.0, verify_prefix_cache_tolerance=1e-6)
    rng = np.random.RandomState(11)
    base = rng.randint(0, 1024, 100).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=2)
    run_one(eng, base, params, "a")
    hit = run_one(eng, base + rng.randint(0, 1024, 20).tolist(), params, "b")
    s = eng.stats()
    assert hit.num_cached_tokens == 96 and s["prefix_verify_checks"] == 1 and s["prefix_verify_mismatches"] == 0
    for e in eng.scheduler.cache.entries():
        corrupt_checkpoint(eng, e.slot_id, 0.5)
    with caplog.at_level("WARNING", logger="serving.prefix_verify"):
        bad = run_one(eng, base + rng.randint(0, 1024, 20).tolist(), params, "c")
    s = eng.stats()
    assert bad.num_cached_tokens >= 96 and s["prefix_verify_checks"] == 2 and s["prefix_verify_mismatches"] == 1
    assert "prefix cache mismatch: request c " in caplog.text
    _assert_no_leaks(eng)


@pytest.mark.slow     # CI's time budget (two engines of their own pool shapes)
def test_host_tier_copies_evicted_checkpoints_back(model, tmp_path_factory):
    """Checkpoints evicted from small device pools go to host memory with their pages; a later
    prompt that extends an evicted prefix gets it copied back and hits it (outputs as without the tier)."""
    rng = np.random.RandomState(13)
    base = rng.randint(0, 1024, 150).tolist()
    others = [rng.randint(0, 1024, 150).tolist() for _ in range(5)]
    follow = base + rng.randint(0, 1024, 20).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=3)
    res = {}
    for host_bytes in (64 << 20, 0):
        eng = _engine(model, tmp_path_factory, **SMALL_POOLS, state_block_size=0, host_cache_bytes=host_bytes)
        for i, p in enumerate([base] + others):
            run_one(eng, p, params, f"p{i}")
        out = run_one(eng, follow, params, "f")
        res[host_bytes] = (out.outputs[0].token_ids, out.num_cached_tokens, eng.stats())
        _assert_no_leaks(eng)
    (on, hit_on, st), (off, hit_off, _) = res[64 << 20], res[0]
    assert on == off and hit_off == 0
    assert hit_on == 144 and st["host_restored"] >= 1 and st["host_saved"] >= 3, st


@pytest.mark.slow     # CI's time budget (an engine of its own pool shapes); preemption by default: test_spec_engine
def test_pressure_evicts_and_preempts_without_changing_outputs(model, tmp_path_factory):
    work = make_workload(3, 24, model.config.vocab_size, max_new=(24, 40))
    roomy = run_workload(_engine(model, tmp_path_factory), work)
    tight = _engine(model, tmp_path_factory, **SMALL_POOLS)
    squeezed = run_workload(tight, work, arrivals_per_step=8)
    assert {k: v[0] for k, v in squeezed.items()} == {k: v[0] for k, v in roomy.items()}
    assert tight.stats()["num_preemptions"] > 0
    _assert_no_leaks(tight)


@pytest.fixture(scope="module")
def guarded(model, tmp_path_factory):
    """An engine that fails any compile after its warm-up (every sampler variant included)."""
    return _engine(model, tmp_path_factory, forbid_compile_after_warmup=True)


def test_no_compiles_after_warmup(model, guarded):
    eng = guarded
    compiled = eng.runner.num_compiles
    run_workload(eng, make_workload(4, 30, model.config.vocab_size), arrivals_per_step=5)
    assert eng.runner.num_compiles == compiled
    with pytest.raises(CompileAfterWarmupError):
        eng.runner._note_shape(("step", 3, 3, None))


def test_penalties_and_allowed_masks_compile_at_warmup(guarded):
    """A request with presence_penalty (or a structured-output mask) after warm-up compiled a
    new variant of the whole step (27.6 s for the first presence_penalty request on the 2-core CPU tiny server;
    30-100 s on an accelerator). The sampler variants are now compiled at warm-up, for any output length."""
    from serving.sampling_params import SamplingParams
    from tests.support.serving_hooks import ScriptedMatcher
    eng = guarded
    compiled = eng.runner.num_compiles
    tok = eng.tokenizer
    eng.add_request([5, 6, 7], SamplingParams(temperature=0, presence_penalty=0.5, max_tokens=40, ignore_eos=True))
    eng.add_request([5, 6, 7], SamplingParams(temperature=0.7, seed=1, repetition_penalty=1.3, frequency_penalty=0.2,
                                              max_tokens=20, ignore_eos=True))
    eng.add_request([8, 9], SamplingParams(temperature=0, max_tokens=3),
                    matcher=ScriptedMatcher([11, 12], tok.vocab_size, tok.stop_ids))
    eng.add_request([8, 9], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    # top-p (the sort) and top logprobs are static sampler variants too, with penalties alongside
    eng.add_request([5, 6], SamplingParams(temperature=0.8, seed=2, top_p=0.9, presence_penalty=0.3, logprobs=2,
                                           max_tokens=4, ignore_eos=True))
    # logit_bias rides on the masked variant
    eng.add_request([5, 6], SamplingParams(temperature=0, logit_bias={17: 100}, max_tokens=3, ignore_eos=True))
    finished = {}
    while eng.has_unfinished():
        finished.update({o.request_id: o for o in eng.step() if o.finished})
    assert [len(finished[r].outputs[0].token_ids) for r in sorted(finished)] == [40, 20, 3, 5, 4, 3]
    assert finished["req-5"].outputs[0].token_ids == [17, 17, 17]
    assert all(len(top) == 2 for _, top in finished["req-4"].outputs[0].logprobs)
    assert finished["req-2"].outputs[0].token_ids[:2] == [11, 12]
    assert eng.runner.num_compiles == compiled


def test_bad_requests_raise_value_error(model, tmp_path_factory):
    eng = _engine(model, tmp_path_factory, warmup=False, max_model_len=64)
    with pytest.raises(ValueError, match="max_tokens"):
        eng.add_request([1, 2, 3], SamplingParams(max_tokens=100))
    with pytest.raises(ValueError, match="no room"):
        eng.add_request(list(range(64)), SamplingParams())
    with pytest.raises(ValueError, match="out of range"):
        eng.add_request([5000], SamplingParams())
    with pytest.raises(ValueError, match="logit_bias"):
        eng.add_request([5], SamplingParams(logit_bias={model.config.vocab_size: 1.0}))
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=-1)
    eng.add_request([1, 2], SamplingParams(max_tokens=2), request_id="dup")
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request([1, 2], SamplingParams(max_tokens=2), request_id="dup")


def _mixed_run(eng, vocab):
    """Greedy and seeded sampling, stop ids that fire mid-generation, logprobs, a penalties request (its
    steps run synchronously), an abort while its token is in flight; returns the finished outputs."""
    rng = np.random.RandomState(11)
    stops = list(range(3, vocab, 9))
    for i in range(14):
        prompt = rng.randint(0, vocab, rng.randint(5, 90)).tolist()
        kw = dict(max_tokens=int(rng.randint(3, 30)), logprobs=2 if i % 3 == 0 else None)
        kw.update(temperature=0.0) if i % 2 else kw.update(temperature=0.9, seed=i)
        if i % 4 == 1:
            kw.update(stop_token_ids=stops)
        if i == 9:
            kw.update(presence_penalty=0.4)
        eng.add_request(prompt, SamplingParams(**kw), request_id=f"m{i}")
    finished, seen = {}, {}
    while eng.has_unfinished():
        for o in eng.step():
            seen[o.request_id] = len(o.outputs[0].token_ids)
            if o.finished:
                finished[o.request_id] = o
        if seen.get("m4", 0) >= 2 and "m4" in eng.requests:
            eng.abort("m4")
    return finished


@pytest.mark.slow     # CI's time budget: every other engine test runs async (the default)
def test_async_scheduling_gives_the_same_outputs(model, tmp_path_factory):
    """The next step scheduled while the last one runs (its decode inputs are device-side placeholders)
    must not change a token, a logprob, a finish reason or a cache hit, under preemption too."""
    vocab = model.config.vocab_size
    runs = {}
    for mode in (False, True):
        eng = _engine(model, tmp_path_factory, async_scheduling=mode, **SMALL_POOLS)
        runs[mode] = _mixed_run(eng, vocab)
        assert eng.stats()["num_preemptions"] > 0
        _assert_no_leaks(eng)
    sync, asy = runs[False], runs[True]
    assert set(sync) == set(asy) == {f"m{i}" for i in range(14)} - {"m4"}
    for rid in sync:
        a, b = sync[rid].outputs[0], asy[rid].outputs[0]
        assert (a.token_ids, a.finish_reason, a.text) == (b.token_ids, b.finish_reason, b.text), rid
        assert all(t >= 0 for t in b.token_ids)
        if a.logprobs is not None:
            np.testing.assert_allclose([x[0] for x in a.logprobs], [x[0] for x in b.logprobs], rtol=1e-9)
        assert sync[rid].num_cached_tokens == asy[rid].num_cached_tokens
    assert sum(o.outputs[0].finish_reason == "stop" for o in sync.values()) >= 2


def test_prefill_only_steps_overlap_with_the_step_in_flight(model, tmp_path_factory):
    """(Also: the warm-up's ahead-of-time executables serve the steps.) max_tokens=1 requests: the next prefill step is launched while the last one is still on the device
    (its requests, whose only token is in flight, do not hold max_num_seqs), with the tokens of
    synchronous steps. Before, every step waited for the last one's tokens: launch, fetch, launch, ..."""
    vocab = model.config.vocab_size
    rng = np.random.RandomState(5)
    prompts = [rng.randint(0, vocab, rng.randint(5, 40)).tolist() for _ in range(12)]
    runs = {}
    for mode in (False, True):
        eng = _engine(model, tmp_path_factory, async_scheduling=mode, max_num_seqs=4, enable_prefix_caching=False,
                      warmup=mode, compile_threads=2)
        events = []
        for name in ("launch", "fetch"):
            real = getattr(eng.runner, name)
            setattr(eng.runner, name, lambda *a, _real=real, _name=name, **k: (events.append(_name), _real(*a, **k))[1])
        for i, p in enumerate(prompts):
            eng.add_request(p, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), request_id=f"p{i}")
        outs = {}
        while eng.has_unfinished():
            outs.update({o.request_id: o.outputs[0].token_ids for o in eng.step() if o.finished})
        runs[mode] = outs
        _assert_no_leaks(eng)
        # every step ran an executable the warm-up compiled ahead of time (on host threads): none jitted
        assert not mode or (eng.runner._compiled and eng.runner._step._cache_size() == 0)
        assert events.count("launch") == 3                       # 12 prompts, 4 sequences per step
        if mode:   # each launch after the first comes before the fetch of the step before it
            assert events == ["launch", "launch", "fetch", "launch", "fetch", "fetch"], events
    assert runs[True] == runs[False] and len(runs[True]) == 12
