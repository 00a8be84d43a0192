"""Speculative decoding in the engine (CPU, fp32): greedy output identical to speculation off through
chunked prefill, prefix-cache hits (also on a finished speculated request's state), preemption, stop
tokens and strings, max_tokens inside an accepted run, logprobs, n > 1 and async scheduling; the
verification step keeps each position's KDA state; n-gram lookup is accepted on the trained tiny.

One engine per model: speculation "off" is the same engine with a drafter that proposes nothing, so
the two runs share every compiled step.
"""
import numpy as np
import pytest

from k3jax import load_model
from k3jax.cache import SeqChunk
from serving.engine import LLMEngine
from serving.engine_args import EngineArgs
from serving.sampling_params import SamplingParams
from serving.spec import make_speculator
from serving.spec.ngram import NgramDrafter
from serving.spec.speculator import PromptLookup

K = 3


class Nothing:
    def propose(self, reqs, ks):
        return [[] for _ in reqs]


class Scripted:
    """Proposes a reference continuation, one draft in two runs corrupted at a random position, so every
    acceptance length (0..K) occurs."""

    def __init__(self, ref, seed=0):
        self.ref, self.rng = ref, np.random.RandomState(seed)

    def propose(self, reqs, ks):
        out = []
        for r, k in zip(reqs, ks):
            n = len(r.output_ids)
            d = list(self.ref.get(r.request_id, [])[n:n + k])
            if d and self.rng.rand() < 0.5:
                j = self.rng.randint(len(d))
                d[j] = (d[j] + 1) % 1000
            out.append(d)
        return out


def _engine(model, tmp, **kw):
    args = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=160, page_size=16, prefix_match_unit=16,
                state_block_size=32, num_pages=16, num_slots=40, token_buckets=(64,), seq_buckets=(4,),
                warmup=False, vision=False, compilation_cache_dir=str(tmp), speculative="ngram",
                num_speculative_tokens=K, speculative_adaptive=False)
    args.update(kw)
    return LLMEngine(model, EngineArgs(**args))


def _run(engine, work, drafter, async_scheduling=True):
    engine.spec.drafter = drafter
    engine.args.async_scheduling = async_scheduling
    if engine.scheduler.cache is not None:
        engine.scheduler.cache.clear()
    for rid, prompt, params in work:
        engine.add_request(prompt, params, request_id=rid)
    res = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                c = o.outputs[0]
                res[o.request_id] = (c.token_ids, c.text, c.finish_reason, c.logprobs, o.num_cached_tokens)
    return res


@pytest.fixture(scope="module")
def rnd(tmp_path_factory):
    model = load_model("tiny-random", dtype="float32")
    return _engine(model, tmp_path_factory.mktemp("xla"))


def _workload(rng, ref=None):
    g = lambda n, **kw: SamplingParams(temperature=0.0, max_tokens=n, **kw)   # noqa: E731
    long = rng.randint(0, 1000, 100).tolist()
    short = rng.randint(0, 1000, 20).tolist()
    pair = rng.randint(0, 1000, 30).tolist()
    other = rng.randint(0, 1000, 40).tolist()
    work = [("long", long, g(24)), ("shared", long[:80] + short[:10], g(20)), ("lp", short, g(24, logprobs=2)),
            ("n0", pair, g(17)), ("n1", pair, g(17))]
    if ref is None:
        work.append(("stop", other, g(24)))
    else:                      # a stop token and a stop string that the reference output reaches
        work.append(("stop", other, g(24, stop_token_ids=[ref["stop"][0][11]])))
        text = ref["stop"][1]
        work.append(("stopstr", other, g(24, stop=[text[len(text) // 2:len(text) // 2 + 2]])))
    return work


def test_greedy_identical_with_speculation(rnd):
    ref = _run(rnd, _workload(np.random.RandomState(0)), Nothing())
    work = _workload(np.random.RandomState(0), ref)
    off = _run(rnd, work, Nothing(), async_scheduling=True)
    pre_off = rnd.scheduler.num_preemptions
    on = _run(rnd, work, Scripted({k: v[0] for k, v in off.items()}))
    assert rnd.scheduler.num_preemptions > pre_off            # the pools are small enough to preempt
    s = rnd.spec.metrics()
    assert s["spec_accepted_tokens"] > 20 and s["spec_drafted_tokens"] > s["spec_accepted_tokens"]
    for rid in off:
        assert on[rid][:3] == off[rid][:3], rid
    assert off["stop"][2] == "stop" and len(off["stop"][0]) < 24 and off["stopstr"][2] == "stop"
    assert off["long"][2] == "length" and len(off["long"][0]) == 24
    assert off["n0"][0] == off["n1"][0]
    # fp32 logprobs of one token through differently shaped steps (1.1e-4 apart on an AVX2 CPU)
    np.testing.assert_allclose([lp for lp, _ in on["lp"][3]], [lp for lp, _ in off["lp"][3]], atol=3e-4)
    assert [sorted(t) for _, t in on["lp"][3]] == [sorted(t) for _, t in off["lp"][3]]
    # synchronous steps, and a follow-up turn resuming from a speculated request's cached final state
    follow = [("turn2", work[0][1] + on["long"][0] + [7, 8, 9], SamplingParams(temperature=0.0, max_tokens=12))]
    rnd.scheduler.cache.clear()
    on2 = _run_keep_cache(rnd, work[:1], follow, Scripted({k: v[0] for k, v in off.items()}), async_scheduling=False)
    off2 = _run_keep_cache(rnd, work[:1], follow, Nothing())
    assert on2["long"][0] == off["long"][0]
    assert on2["turn2"][4] >= 112 and off2["turn2"][4] >= 112         # the prompt and output of "long" hit
    assert on2["turn2"][0] == off2["turn2"][0]
    rnd.scheduler.cache.clear()
    assert rnd.scheduler.pages.num_used == 0 and rnd.scheduler.slots.num_used == 0


def _run_keep_cache(engine, first, then, drafter, async_scheduling=True):
    res = _run(engine, first, drafter, async_scheduling)
    engine.spec.drafter = drafter
    for rid, prompt, params in then:
        engine.add_request(prompt, params, request_id=rid)
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                c = o.outputs[0]
                res[o.request_id] = (c.token_ids, c.text, c.finish_reason, c.logprobs, o.num_cached_tokens)
    return res


def test_sampled_requests_complete(rnd):
    work = [("s0", list(range(5, 40)), SamplingParams(temperature=1.0, top_p=0.9, seed=3, max_tokens=20)),
            ("s1", list(range(5, 40)), SamplingParams(temperature=0.7, seed=4, max_tokens=20, logprobs=1))]
    ref = _run(rnd, work, Nothing())
    out = _run(rnd, work, Scripted({k: v[0] for k, v in ref.items()}))
    for rid in ref:
        assert len(out[rid][0]) == 20 and out[rid][2] == "length"
    assert len(out["s1"][3]) == 20


def test_verify_step_keeps_each_positions_state(rnd):
    """The runner's verification writes the state after fed token j to spec_slots[j]; each equals the state
    one-token decode steps reach (a wrong position kept fails here, and the greedy test above)."""
    r = rnd.runner
    rnd.scheduler.cache.clear()
    prompt = [5, 17, 99, 3, 250, 41, 7, 600, 12]
    pages = [20, 21]
    fetch = lambda res: r.fetch(res)                                       # noqa: E731
    g = [SamplingParams(temperature=0.0)]
    tok = int(fetch(r.launch([SeqChunk(prompt, 0, pages, -1, 30)], g, [0], [0]))[0][0])
    fed = [tok, 321, 44, 908]
    saved = [np.asarray(x[30]).copy() for x in (r.pools.kda_state, r.pools.kda_conv)]
    slots = [31, 32, 33, 30]
    toks, acc, *_ = fetch(r.launch_verify([SeqChunk(fed, len(prompt), pages, 30, 30, spec_slots=slots)],
                                          [fed[1:]], g, [0], [1]))
    got = [(np.asarray(r.pools.kda_state[s]), np.asarray(r.pools.kda_conv[s])) for s in slots]
    # reference: restore slot 30 and decode the fed tokens one by one
    r.pools = r.pools.replace(kda_state=r.pools.kda_state.at[30].set(saved[0]),
                              kda_conv=r.pools.kda_conv.at[30].set(saved[1]))
    greedy = []
    for j, t in enumerate(fed):
        greedy.append(int(fetch(r.launch([SeqChunk([t], len(prompt) + j, pages, 30, 30)], g, [0], [1 + j]))[0][0]))
        st, cv = np.asarray(r.pools.kda_state[30]), np.asarray(r.pools.kda_conv[30])
        np.testing.assert_allclose(got[j][0], st, rtol=1e-4, atol=1e-5, err_msg=f"state after position {j}")
        np.testing.assert_allclose(got[j][1], cv, rtol=1e-4, atol=1e-5, err_msg=f"conv after position {j}")
        if j:
            assert np.abs(got[j][0] - got[j - 1][0]).max() > 1e-3          # neighbouring positions differ
    # the verify step's own judgement agrees with plain decoding
    m = int(acc[0])
    assert toks[0, :m].tolist() == fed[1:1 + m] and greedy[:m] == fed[1:1 + m] and toks[0, m] == greedy[m]


@pytest.mark.slow      # ~60 s on 2 cores: every kernel in the Pallas interpreter
def test_gpu_kernels_interpret(tmp_path):
    """The GPU kernel paths of a verify step (Triton MLA over a multi-token chunk, the KDA decode kernel per
    position, the stacked and MoE kernels) in interpret mode: oracle drafts all accepted, greedy output equal
    to off (tests/serving/test_spec_gpu.py runs the same compiled on a GPU)."""
    from pallas_kernels.backend import Backend
    model = load_model("tiny-random", dtype="float32")
    model.backend = Backend(kernels=True, interpret=True, platform="gpu", pool_bits=True)
    eng = _engine(model, tmp_path, max_num_seqs=2, seq_buckets=(2,), max_model_len=112, speculative_adaptive=True,
                  num_speculative_tokens=4)
    prompt = np.random.RandomState(1).randint(0, 1000, 40).tolist()
    work = [("r0", prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))]
    ref = {k: v[0] for k, v in _run(eng, work, Nothing()).items()}

    class Oracle:
        def propose(self, reqs, ks):
            return [ref[r.request_id][len(r.output_ids):len(r.output_ids) + k] for r, k in zip(reqs, ks)]
    eng.spec = make_speculator(eng.args, model, eng.max_model_len)
    got = {k: v[0] for k, v in _run(eng, work, Oracle()).items()}
    m = eng.spec.metrics()
    assert got == ref and m["spec_drafted_tokens"] >= 8 and m["spec_acceptance_rate"] == 1.0, m


def test_verify_step_rounds_as_decode_steps_on_the_gpu_kernels():
    """A verification step on the GPU kernels (interpreted; Kimi-Linear's layer kinds, bf16) gives each position
    the bits of K + 1 decode steps: logits and every KDA layer's state. Verification rows run as decode rows
    (MLA token_rows, KDA's decode step on the token rows, the LM head a position at a time), which is what lets
    greedy speculation keep speculation off's tokens on random bf16 weights, where near-ties are everywhere."""
    import jax.numpy as jnp
    from tests.support.spec_steps import spec_model, verify_vs_decode
    m = spec_model("tiny-linear", "reference", "bfloat16")
    m.backend = m.backend.replace(kernels=True, interpret=True)
    dec, ver, ds, vs = verify_vs_decode(m.config, m.params, m.backend, jnp.bfloat16)
    assert np.abs(dec).max() > 0 and np.abs(ds[1] - ds[0]).max() > 0
    assert np.array_equal(vs, ds), np.abs(vs - ds).reshape(len(ds), -1).max(-1)
    assert np.array_equal(ver, dec), np.abs(ver - dec).max(-1)


@pytest.mark.slow      # ~25 s on 2 cores: the draft runner's own compiles
def test_draft_model_greedy_identical(rnd):
    """The draft-model drafter (here the target's own weights: every draft must be accepted), its catch-up
    chunks and decode steps in its own pools."""
    from serving.spec.draft import DraftModelDrafter
    rng = np.random.RandomState(5)
    work = [(f"d{i}", rng.randint(0, 1000, n).tolist(), SamplingParams(temperature=0.0, max_tokens=14))
            for i, n in enumerate((20, 70))]
    off = _run(rnd, work, Nothing())
    before = dict(rnd.spec.stats)
    drafter = DraftModelDrafter(load_model("tiny-random", dtype="float32"), target_config=rnd.model.config,
                                args=rnd.args)
    on = _run(rnd, work, drafter)
    assert {k: v[0] for k, v in on.items()} == {k: v[0] for k, v in off.items()}
    drafted = rnd.spec.stats["spec_drafted_tokens"] - before["spec_drafted_tokens"]
    accepted = rnd.spec.stats["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    assert drafted > 10 and accepted == drafted
    assert not drafter.seqs and drafter.slots.num_used == 0 and drafter.pages.num_used == 0   # forgotten at finish


@pytest.mark.slow      # ~60 s on 2 cores: the trained tiny's own step compiles
def test_ngram_accepted_on_trained_tiny(tmp_path_factory):
    model = load_model("tiny", dtype="float32")
    eng = _engine(model, tmp_path_factory.mktemp("xla"), num_speculative_tokens=4, speculative_adaptive=True,
                  num_pages=64)
    passage = "Each application defines its models in a module, and the database stores their fields. "
    prompt = model.tokenizer.encode(passage * 2 + "Each application defines")   # its output repeats itself too
    work = [("rep", prompt, SamplingParams(temperature=0.0, max_tokens=24))]
    off = _run(eng, work, Nothing())
    on = _run(eng, work, PromptLookup(NgramDrafter()))
    assert on["rep"][0] == off["rep"][0]
    s = eng.spec.metrics()
    assert s["spec_accepted_tokens"] > 0, s


def test_bad_speculative_settings():
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineArgs(speculative="ngram", num_speculative_tokens=0)
    with pytest.raises(ValueError, match="speculative must be one of"):
        EngineArgs(speculative="medusa")
    with pytest.raises(ValueError, match="needs draft_model"):
        EngineArgs(speculative="draft")
    from k3jax.api import load_model
    from serving.spec.draft import check_draft_configs
    with pytest.raises(ValueError, match="vocabulary of 1024 tokens, the target's has 4096"):
        check_draft_configs("tiny", "tiny-random")

    class Target:                       # the engine's check, before any draft weights are built
        config = __import__("k3jax.presets", fromlist=["x"]).preset_config("tiny")
        params = {"embed": np.zeros(1, np.float32)}
    with pytest.raises(ValueError, match="vocabulary"):
        make_speculator(EngineArgs(speculative="draft", draft_model="tiny-random"), Target(), 256,
                        load_model=load_model)


@pytest.mark.parametrize("argv", [["--num-speculative-tokens", "0"], ["--speculative", "medusa"]])
def test_serve_refuses_bad_speculative_flags_in_one_line(argv, capsys):
    from k3jax import serve
    with pytest.raises(SystemExit) as e:
        serve.parse_args(argv)
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 2 and argv[0] in err and "Traceback" not in err


def test_serve_refuses_a_draft_of_another_vocabulary_before_loading(monkeypatch):
    from k3jax import api, serve
    monkeypatch.setattr(api, "load_model", lambda *a, **k: pytest.fail("the model loaded before the check"))
    with pytest.raises(ValueError, match="draft model 'tiny-random': vocabulary of 1024 tokens"):
        serve.build_state(serve.parse_args(["--model", "tiny", "--speculative", "draft", "--draft-model", "tiny-random"]))
    with pytest.raises(ValueError, match="needs draft_model"):
        serve.build_state(serve.parse_args(["--speculative", "draft"]))


def test_speculation_refused_on_gpu_kernels_unless_asked():
    """On compiled GPU kernels speculation is refused (its tokens differ from off on the H200) unless
    speculative_on_gpu; interpreted kernels and the CPU reference path run it."""
    from types import SimpleNamespace

    from k3jax.presets import preset_config
    from pallas_kernels.backend import Backend
    cfg = preset_config("tiny-random")

    def target(**kw):
        return SimpleNamespace(config=cfg, params={"embed": np.zeros(1, np.float32)}, backend=Backend(**kw))
    with pytest.raises(ValueError, match="refused on GPU kernels.*speculative_on_gpu"):
        make_speculator(EngineArgs(speculative="ngram"), target(kernels=True, platform="gpu"), 256)
    assert make_speculator(EngineArgs(speculative="ngram", speculative_on_gpu=True),
                           target(kernels=True, platform="gpu"), 256) is not None
    assert make_speculator(EngineArgs(speculative="ngram"), target(kernels=True, interpret=True, platform="gpu"),
                           256) is not None
    assert make_speculator(EngineArgs(speculative="off"), target(kernels=True, platform="gpu"), 256) is None
