"""Progressive warm-up (EngineArgs.background_compile), CPU fp32: the engine is ready with a covering set of step
programs and serves every step with compiled programs only (the compile guard armed) while the rest are held back;
once they land, steps take their exact buckets, a lone long prompt its long bucket and small decode batches several
steps per launch; outputs are the same either way. The background queue's own contract (gate, failures, stop) is
checked with stand-in programs, and the engine's waiting for long, multi-step and verification programs with
stand-in launches."""
import threading

import numpy as np
import pytest

from k3jax import load_model
from serving.compile_queue import CompileQueue, abstract
from serving.engine import LLMEngine
from serving.engine_args import EngineArgs
from serving.executable_cache import args_signature
from serving.step_shapes import _shape_key, _step_key, warmup_shapes
from serving.sampling_params import SamplingParams

# token buckets 16 and 64, one sequence bucket of 4: the covering set is the decode-only (16, 4) step and the
# general (64, 4) step; held back: the general (16, 4) step, and with ARGS the long (128, 4) step and the two
# multi-step programs (2 decode steps per launch)
BASE = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256, page_size=16, prefix_match_unit=16,
            num_pages=64, num_slots=24, token_buckets=(16, 64), seq_buckets=(4,), enable_prefix_caching=False,
            vision=False, compilation_cache_dir=None, long_prefill_tokens=0, decode_steps_per_launch=1)
ARGS = dict(BASE, long_prefill_tokens=128, decode_steps_per_launch=2, decode_steps_max_seqs=4)
COVERING = {("step", 16, 4, True, False), ("step", 64, 4, False, False)}


@pytest.fixture(scope="module")
def model():
    return load_model("tiny-random", dtype="float32")


def _workload(eng, tag: str) -> dict:
    """A lone long prompt (200 tokens), a lone short one (5), then three prompts together and their decodes."""
    rng = np.random.RandomState(1)
    prompts = [rng.randint(0, 1000, n).tolist() for n in (200, 5, 6, 20, 40)]
    groups = [[("long", prompts[0], 3)], [("short", prompts[1], 4)],
              [(f"batch{i}", p, 9) for i, p in enumerate(prompts[2:])]]
    out = {}
    for group in groups:
        for name, prompt, n in group:
            lp = 0 if name == "short" else None
            eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=n, logprobs=lp), request_id=tag + name)
        while eng.has_unfinished():
            for o in eng.step():
                if o.finished:
                    c = o.outputs[0]
                    out[o.request_id[len(tag):]] = (c.token_ids, c.logprobs)
    return out


def _held_then_landed(model, args: dict, held_back: int):
    """The workload while the background compile is held, then after every program landed: (engine, outputs
    held, outputs landed, programs used held, programs used landed)."""
    gate = threading.Event()
    eng = LLMEngine(model, EngineArgs(background_compile=True, **args), compile_gate=gate)
    runner = eng.runner
    assert eng.compiles_pending() == held_back and eng.stats()["compiles_pending"] == held_back
    runner.guard = True                                         # no compile through the jit path from here on
    used = []
    call = runner._call

    def spy(control, *a):
        if control in ("step", "multi"):
            used.append((control,) + _step_key(a[0]))
        return call(control, *a)
    runner._call = spy

    compiles = runner.num_compiles
    held = _workload(eng, "held-")
    used_held = set(used)
    assert runner.num_compiles == compiles and eng.compiles_pending() == held_back
    gate.set()
    assert eng.wait_for_compiles(timeout=600) and eng.compiles_pending() == 0
    assert eng.wait_for_compiles(timeout=0)
    used.clear()
    full = _workload(eng, "full-")
    assert {k: v[0] for k, v in held.items()} == {k: v[0] for k, v in full.items()}
    np.testing.assert_allclose([lp for lp, _ in full["short"][1]], [lp for lp, _ in held["short"][1]], atol=1e-4)
    return eng, used_held, set(used)


@pytest.mark.slow     # CI's time budget (two engines' warm-ups); the queue and the engine's waiting run by default
def test_serves_with_the_covering_set_then_takes_exact_buckets(model):
    eng, held, landed = _held_then_landed(model, BASE, held_back=1)
    assert held == COVERING, held                               # the lone short prompt padded to (64, 4)
    assert landed == COVERING | {("step", 16, 4, False, False)}, landed


@pytest.mark.slow           # ~40 s on 2 cores: the long and multi-step programs compile too
def test_long_and_multi_step_programs_engage_once_landed(model):
    eng, held, landed = _held_then_landed(model, ARGS, held_back=4)
    assert held == COVERING, held
    assert {("step", 16, 4, False, False), ("step", 128, 4, False, False), ("multi", 16, 4, True, False)} <= landed
    assert eng.counters["multi_step_launches"] > 0 and eng.scheduler.long_prefill_tokens == 128


def test_long_and_multi_step_launches_wait_for_their_programs(model):
    """While their programs compile, a lone long prompt takes regular-sized steps and decodes one step per launch;
    once they have landed, the long prompt takes long steps and decodes several steps a launch. (Runner launches
    are stand-ins: no compile.)"""
    eng = LLMEngine(model, EngineArgs(warmup=False, **ARGS))
    r = eng.runner
    r._jobs(warmup_shapes(r.token_buckets, r.seq_buckets, long_token_buckets=r.long_token_buckets), [])  # multi keys
    held = threading.Event()
    r._queue = CompileQueue([("never", lambda: None)], None, gate=held).start()   # one program pending throughout
    r._compiled = dict.fromkeys([_shape_key(16, 4, True, False), _shape_key(64, 4, False, False)])
    eng._compiling = True
    launches = []
    r.launch = lambda chunks, *a, **kw: launches.append(("step", sum(len(c.tokens) for c in chunks))) or "step"
    r.launch_decode_steps = lambda chunks, *a, **kw: launches.append(("multi", len(chunks))) or "multi"
    one, two = (np.full(4, 7), np.zeros(4), np.zeros((4, 0), int), np.zeros((4, 0))), \
        (np.full((4, 2), 7), np.zeros((4, 2)), np.zeros((4, 2, 0), int), np.zeros((4, 2, 0)))
    r.fetch = lambda res: two if res == "multi" else one
    prompt = list(range(200))

    def run():
        launches.clear()
        eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))
        while eng.has_unfinished():
            eng.step()
        return list(launches)
    try:
        assert run() == [("step", 64)] * 3 + [("step", 8)] + [("step", 1)] * 6
        assert eng.scheduler.long_prefill_tokens == 0
        r._compiled[_shape_key(128, 4, False, False)] = None            # the long program lands
        assert run() == [("step", 128), ("step", 72)] + [("step", 1)] * 6
        r._compiled.update(dict.fromkeys(r._multi_keys.values()))      # and the multi-step ones
        assert run() == [("step", 128), ("step", 72)] + [("multi", 1)] * 3         # 6 tokens, 2 a launch
    finally:
        r._queue.stop()


def test_background_arguments_store_as_the_warm_up_ones(model):
    """The background queue lowers against abstract arguments (the pools it planned with are donated meanwhile);
    their executable-cache signature is the concrete arguments', so a restart loads what the background stored."""
    eng = LLMEngine(model, EngineArgs(warmup=False, **ARGS))
    runner = eng.runner
    jobs = runner._jobs(warmup_shapes(runner.token_buckets, runner.seq_buckets, long_token_buckets=[128]),
                        [(False,) * 4])
    assert {j.kind for j in jobs} == {"step", "sample", "multi"}
    for job in jobs:
        assert args_signature(abstract(job.args)) == args_signature(job.args), job.key
    # without a background compile every program counts as available (compiled at warm-up, or on first use)
    assert runner.long_prefill_limit() == 128 and runner.can_verify(64, 4)
    assert runner.can_launch_decode_steps(3) and not runner.can_launch_decode_steps(5)


class _Program:
    def __init__(self, value, fail=False):
        self.value, self.fail = value, fail

    def compile(self):
        if self.fail:
            raise RuntimeError("compile failed")
        return self.value


def test_compile_queue_holds_lands_and_survives_failures():
    gate, landed = threading.Event(), {}
    done = []

    def lower(value, fail_lower=False, fail_compile=False):
        if fail_lower:
            raise ValueError("lowering failed")
        return _Program(value, fail_compile)

    jobs = [("a", lambda: lower(1)), ("b", lambda: lower(2, fail_lower=True)),
            ("c", lambda: lower(3, fail_compile=True)), ("d", lambda: lower(4))]
    q = CompileQueue(jobs, landed.__setitem__, threads=2, gate=gate, on_done=lambda s, failed: done.append(failed))
    q.start()
    assert not q.wait(timeout=0.2) and q.pending() == 4 and not landed     # held by the gate
    gate.set()
    assert q.wait(timeout=60)
    assert landed == {"a": 1, "d": 4} and sorted(q.failed) == ["b", "c"] and q.pending() == 0
    assert [sorted(f) for f in done] == [["b", "c"]]


def test_compile_queue_stops_while_held():
    gate, landed = threading.Event(), {}
    q = CompileQueue([("a", lambda: _Program(1))], landed.__setitem__, gate=gate).start()
    q.stop()
    assert not q.wait(timeout=5) and q.pending() == 1
    for t in q._threads:
        t.join(5)
    assert not any(t.is_alive() for t in q._threads)
    gate.set()
    assert not landed
    assert CompileQueue([], landed.__setitem__).start().wait(timeout=0)     # nothing to build: done at once


def test_background_compile_setting():
    with pytest.raises(ValueError, match="background_compile"):
        EngineArgs(background_compile="yes")
    assert EngineArgs().background_compile is None


def test_steps_take_the_smallest_compiled_bucket(model):
    """While programs compile in the background, a step's bucket is the smallest compiled one that holds it; a
    decode-only batch may take a bucket's general variant; long, multi-step and verification launches wait for
    their programs."""
    eng = LLMEngine(model, EngineArgs(warmup=False, speculative="ngram", num_speculative_tokens=2, **ARGS))
    r = eng.runner
    r._queue = CompileQueue([], None).start()      # a background compile that has landed nothing yet
    r._compiled = dict.fromkeys([_shape_key(16, 4, True, False), _shape_key(64, 4, False, False)])
    assert r._compiled_bucket(5, 1, False, False) == (64, 4, False, False)
    assert r._compiled_bucket(3, 3, True, False) == (16, 4, True, False)
    del r._compiled[_shape_key(16, 4, True, False)]
    assert r._compiled_bucket(3, 3, True, False) == (64, 4, False, False)
    assert r._compiled_bucket(100, 1, False, False) is None and r.long_prefill_limit() == 0
    r._compiled[_shape_key(128, 4, False, False)] = None
    assert r._compiled_bucket(100, 1, False, False) == (128, 4, False, False) and r.long_prefill_limit() == 128
    assert not r.can_verify(6, 2) and not r.can_verify(6, 2, short=True)
    r._compiled[_shape_key(64, 4, False, False, 3)] = None
    assert r.can_verify(6, 2) and not r.can_verify(100, 1)
    # a verification of short chunks takes its own variant once compiled, the general one until then
    assert r.can_verify(6, 2, short=True)
    assert r._compiled_bucket(6, 2, False, False, 3, True) == (64, 4, False, False)
    r._compiled[_shape_key(16, 4, False, False, 3, True)] = None
    assert r._compiled_bucket(6, 2, False, False, 3, True) == (16, 4, False, True)
    assert r._compiled_bucket(6, 2, False, False, 3) == (64, 4, False, False)
    assert not r.can_launch_decode_steps(2)


def test_metrics_report_programs_pending_while_the_engine_idles():
    """/metrics reads the async engine's snapshot; the programs pending are read live (they land while it idles)."""
    pytest.importorskip("prometheus_client")
    from serving.async_engine import AsyncEngine
    from serving.openai.metrics import Metrics

    class Idle:
        pending = 3

        def has_unfinished(self):
            return False

        def stats(self):
            return {"compiles_pending": self.pending}

        def cache_usage(self):
            return {}

        def compiles_pending(self):
            return self.pending

        def stop_compiles(self):
            self.pending = 0

    eng = AsyncEngine(Idle())
    try:
        assert eng.stats_snapshot["compiles_pending"] == 3
        eng.engine.pending = 1
        text = Metrics("m").render(eng.stats_snapshot).decode()
        assert 'k3jax:compiles_pending{model_name="m"} 1.0' in text
    finally:
        eng.shutdown(timeout=5)
    assert eng.engine.pending == 0                  # shutdown stops the background compile


def test_speculation_waits_for_its_verification_program(model):
    """While a step's verification program compiles, its drafts are dropped and it runs as a plain step; once the
    program has landed the same kind of step verifies its drafts. (Runner launches are stand-ins: no compile.)"""
    eng = LLMEngine(model, EngineArgs(warmup=False, speculative="ngram", num_speculative_tokens=2,
                                      speculative_adaptive=False, **ARGS))
    r = eng.runner
    r._queue = CompileQueue([], None).start()
    r._compiled = dict.fromkeys([_shape_key(16, 4, True, False), _shape_key(64, 4, False, False)])
    calls = []

    class Verified(Exception):
        pass

    def launch(chunks, *args, **kw):
        calls.append(("plain", [len(c.tokens) for c in chunks]))

    def launch_verify(chunks, drafts, *args, **kw):
        calls.append(("verify", [list(d) for d in drafts]))
        raise Verified
    r.launch, r.launch_verify = launch, launch_verify
    asked, can_verify = [], r.can_verify
    r.can_verify = lambda *a: asked.append(a) or can_verify(*a)      # asked only when a step has drafts
    r.fetch = lambda _: (np.full(4, 7), np.zeros(4), np.zeros((4, 0), int), np.zeros((4, 0)))   # always token 7
    eng.add_request([7, 7, 7, 7, 7, 7], SamplingParams(temperature=0, max_tokens=40))
    for _ in range(6):
        eng.step()
    assert calls and all(kind == "plain" for kind, _ in calls) and calls[-1] == ("plain", [1])
    assert asked and len(asked) >= 3                                 # drafts proposed, then dropped
    r._compiled[_shape_key(16, 4, False, False, 3)] = None      # the verification program lands
    with pytest.raises(Verified):
        eng.step()
    assert calls[-1][0] == "verify" and calls[-1][1][0] and set(calls[-1][1][0]) == {7}
