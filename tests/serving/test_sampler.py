import dataclasses

import numpy as np
import pytest
import jax
import jax.numpy as jnp

from serving.sampler import (SamplingArrays, apply_penalties, build_sampling_arrays,
                             make_key_data, sample, sample_jit, token_bitmask, truncation_mask)
from serving.sampling_params import SamplingParams
from serving.stop import StopChecker, StopStringStream, held_tail

KEY = make_key_data(0)
trunc = jax.jit(truncation_mask)


def mask_of(logits, top_k=0, top_p=1.0, min_p=0.0):
    x = jnp.asarray(np.atleast_2d(logits), jnp.float32)
    s = x.shape[0]
    full = lambda v, dt: jnp.full((s,), v, dt)
    m = trunc(x, full(top_k, jnp.int32), full(top_p, jnp.float32), full(min_p, jnp.float32))
    return set(np.flatnonzero(np.asarray(m)[0]).tolist())


def ref_mask(x, top_k, top_p, min_p):
    """Independent float64 statement of the documented rules (min-p, top-k, top-p)."""
    x = np.asarray(x, np.float64)
    q = np.exp(x - x.max())
    q /= q.sum()
    keep = q >= min_p * q.max() if min_p > 0 else np.ones_like(q, bool)
    if top_k > 0:
        keep &= np.array([(x > xt).sum() < top_k for xt in x])
    if top_p < 1:
        r = np.where(keep, q, 0.0)
        r /= r.sum()
        keep &= np.array([r[r > rt].sum() < top_p for rt in r])
    return keep


P5 = np.log([0.5, 0.25, 0.125, 0.0625, 0.0625])


def test_top_k_keeps_ties():
    logits = [5.0, 4.0, 4.0, 3.0, 2.0]
    assert mask_of(logits, top_k=1) == {0}
    assert mask_of(logits, top_k=2) == {0, 1, 2}   # tie at the k-th value: all kept
    assert mask_of(logits, top_k=4) == {0, 1, 2, 3}
    assert mask_of(logits, top_k=0) == {0, 1, 2, 3, 4}
    assert mask_of(logits, top_k=99) == {0, 1, 2, 3, 4}


def test_top_p_exact_sets():
    assert mask_of(P5, top_p=0.3) == {0}
    assert mask_of(P5, top_p=0.7) == {0, 1}
    assert mask_of(P5, top_p=0.8) == {0, 1, 2}
    assert mask_of(P5, top_p=0.9) == {0, 1, 2, 3, 4}  # boundary token tied with token 4
    assert mask_of(P5, top_p=1.0) == {0, 1, 2, 3, 4}


def test_min_p_and_order_of_truncations():
    assert mask_of(P5, min_p=0.3) == {0, 1}      # keep p >= 0.15
    assert mask_of(P5, min_p=0.2) == {0, 1, 2}   # keep p >= 0.1
    # top-p is measured after top-k renormalises: [2/3, 1/3] -> 0.6 keeps only token 0
    assert mask_of(P5, top_p=0.6) == {0, 1}
    assert mask_of(P5, top_k=2, top_p=0.6) == {0}


def test_truncation_matches_reference_on_random_rows():
    rng = np.random.default_rng(0)
    s, v = 64, 50
    x = np.round(rng.normal(0, 2, (s, v)) * 2) / 2  # rounded: many ties
    k = rng.choice([0, 1, 3, 10, 60], s)
    p = rng.choice([1.0, 0.95, 0.5, 0.2], s)
    mp = rng.choice([0.0, 0.05, 0.3], s)
    got = np.asarray(trunc(jnp.asarray(x, jnp.float32), jnp.asarray(k, jnp.int32),
                                     jnp.asarray(p, jnp.float32), jnp.asarray(mp, jnp.float32)))
    for i in range(s):
        np.testing.assert_array_equal(got[i], ref_mask(x[i], k[i], p[i], mp[i]), err_msg=f"row {i}")


def test_penalties_match_numpy_formula():
    rng = np.random.default_rng(1)
    s, v = 3, 70
    logits = rng.normal(0, 3, (s, v)).astype(np.float32)
    prompts = [rng.integers(0, v, 20) for _ in range(s)]
    outs = [rng.integers(0, v, n) for n in (0, 5, 30)]
    rep, pres, freq = np.array([1.3, 0.8, 1.0]), np.array([0.5, -0.2, 1.0]), np.array([0.25, 0.0, 0.7])
    ot = np.full((s, 32), -1, np.int32)
    for i, o in enumerate(outs):
        ot[i, :len(o)] = o
    pm = np.stack([token_bitmask(p, v) for p in prompts])
    got = np.asarray(apply_penalties(jnp.asarray(logits), jnp.asarray(pm), jnp.asarray(ot),
                                     jnp.asarray(rep, jnp.float32), jnp.asarray(pres, jnp.float32),
                                     jnp.asarray(freq, jnp.float32)))
    want = logits.astype(np.float64).copy()
    for i in range(s):
        cnt = np.bincount(outs[i], minlength=v)
        for t in range(v):
            if cnt[t] or t in set(prompts[i].tolist()):
                want[i, t] = want[i, t] / rep[i] if want[i, t] > 0 else want[i, t] * rep[i]
            want[i, t] -= freq[i] * cnt[t] + pres[i] * (cnt[t] > 0)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)


def run(logits, params, counters=None, **kw):
    arrays = build_sampling_arrays(params, **kw)
    s = len(params) if kw.get("num_rows") is None else kw["num_rows"]
    c = np.zeros(s, np.int32) if counters is None else np.asarray(counters, np.int32)
    return sample_jit(jnp.asarray(logits, jnp.float32), arrays, KEY, c)


def test_greedy_is_argmax_and_penalties_change_it():
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(6, 300)).astype(np.float32)
    params = [SamplingParams(temperature=t) for t in (0, 0, 1e-6, 0, 0, 0)]
    tok, lp, _ = run(logits, params)
    np.testing.assert_array_equal(np.asarray(tok), logits.argmax(-1))
    raw = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    np.testing.assert_allclose(np.asarray(lp), raw[np.arange(6), logits.argmax(-1)], rtol=1e-5)
    # penalties on the argmax token move greedy to the runner-up
    x = np.array([[3.0, 2.5, -1.0, 0.0]], np.float32)
    pres = [SamplingParams(temperature=0, presence_penalty=1.0)]
    assert int(run(x, pres, vocab_size=4, output_token_ids=[[0]])[0][0]) == 1
    rep = [SamplingParams(temperature=0, repetition_penalty=1.5)]
    assert int(run(x, rep, vocab_size=4, prompt_token_ids=[[0]], output_token_ids=[[]])[0][0]) == 1
    assert int(run(x, rep, vocab_size=4, prompt_token_ids=[[2]], output_token_ids=[[]])[0][0]) == 0


def test_same_seed_same_token_regardless_of_batch():
    rng = np.random.default_rng(3)
    v = 1000
    a = rng.normal(0, 1, v).astype(np.float32)
    others = rng.normal(0, 1, (6, v)).astype(np.float32)
    pa = SamplingParams(temperature=0.9, seed=1234)
    for step in (0, 5, 17):
        b1 = np.stack([a, others[0], others[1]])
        p1 = [pa, SamplingParams(seed=1), SamplingParams(temperature=0)]
        t1, lp1, _ = run(b1, p1, counters=[step, 3, 9])
        b2 = np.stack([others[2], others[3], others[4], others[5], a, a, a, a])  # 3 padding rows
        p2 = [SamplingParams(top_p=0.5), SamplingParams(top_k=3), SamplingParams(),
              SamplingParams(min_p=0.1), pa]
        t2, lp2, _ = run(b2, p2, counters=[1, 2, 3, 4, step, 0, 0, 0], num_rows=8)
        assert int(t1[0]) == int(t2[4])
        assert float(lp1[0]) == pytest.approx(float(lp2[4]), rel=1e-6)
    # different steps / seeds draw differently
    draws = {int(run(a[None], [SamplingParams(seed=1234)], counters=[c])[0][0]) for c in range(20)}
    assert len(draws) > 5


def test_sampling_follows_the_truncated_distribution():
    n = 20000
    logits = np.tile(np.log([0.4, 0.3, 0.2, 0.1, 1e-9, 1e-9, 1e-9, 1e-9]).astype(np.float32), (n, 1))
    params = [SamplingParams(top_k=3, seed=i) for i in range(n)]
    tok, _, _ = run(logits, params)
    freq = np.bincount(np.asarray(tok), minlength=8) / n
    np.testing.assert_allclose(freq[:3], np.array([4, 3, 2]) / 9, atol=0.015)
    assert freq[3:].sum() == 0


def test_bitmask_forbids_tokens():
    rng = np.random.default_rng(4)
    v, s = 1000, 64                                  # V not a multiple of 32
    logits = rng.normal(0, 1, (s, v)).astype(np.float32)
    allowed = rng.choice(v, 40, replace=False)
    mask = token_bitmask(allowed, v)
    params = [SamplingParams(temperature=1.5, seed=i) for i in range(s - 1)] + [SamplingParams(temperature=0)]
    masks = [mask] * (s - 1) + [mask]
    tok = np.asarray(run(logits, params, allowed_masks=masks)[0])
    assert set(tok.tolist()) <= set(allowed.tolist())
    assert len(set(tok.tolist())) > 5
    assert tok[-1] == allowed[np.argmax(logits[-1, allowed])]
    # rows without a mask are unconstrained
    tok2 = np.asarray(run(logits[:2], [SamplingParams(temperature=0)] * 2, allowed_masks=[mask, None])[0])
    assert tok2[1] == logits[1].argmax()


def test_logit_bias_moves_the_choice_and_keeps_raw_logprobs():
    rng = np.random.default_rng(6)
    v = 64
    logits = rng.normal(0, 2, (4, v)).astype(np.float32)
    low, top = int(logits[0].argmin()), np.argsort(-logits[1])
    keep = rng.choice(v, 4, replace=False)
    params = [SamplingParams(temperature=0, logit_bias={low: 100}),               # a +100 bias wins
              SamplingParams(temperature=0, logit_bias={int(top[0]): -100.0}),     # -100 on the argmax
              SamplingParams(temperature=1.0, seed=3, logit_bias={t: -100 for t in range(v) if t not in keep}),
              SamplingParams(temperature=0)]
    arrays = build_sampling_arrays(params, vocab_size=v)
    assert arrays.bias_ids.shape == (4, 300) and arrays.allowed_mask.shape == (4, 2)   # the masked variant
    tok, lp, _ = sample_jit(jnp.asarray(logits), arrays, KEY, np.zeros(4, np.int32))
    tok = np.asarray(tok)
    assert tok[0] == low and tok[1] == top[1] and tok[2] in keep and tok[3] == logits[3].argmax()
    raw = logits - np.log(np.exp(logits.astype(np.float64)).sum(-1, keepdims=True))
    np.testing.assert_allclose(np.asarray(lp), raw[np.arange(4), tok], rtol=1e-5)
    draws = [int(run(logits[2:3], [dataclasses.replace(params[2], seed=s)], vocab_size=v)[0][0]) for s in range(40)]
    assert set(draws) <= set(keep.tolist()) and len(set(draws)) > 1


def test_logprobs_raw_and_processed():
    rng = np.random.default_rng(5)
    logits = rng.normal(0, 2, (4, 64)).astype(np.float32)
    arrays = build_sampling_arrays([SamplingParams(temperature=0.5, top_k=2, seed=i, logprobs=3) for i in range(4)])
    raw = logits - np.log(np.exp(logits.astype(np.float64)).sum(-1, keepdims=True))
    tok, lp, (ids, vals) = sample_jit(jnp.asarray(logits), arrays, KEY, np.zeros(4, np.int32),
                                      num_top_logprobs=3)
    tok = np.asarray(tok)
    np.testing.assert_allclose(np.asarray(lp), raw[np.arange(4), tok], rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(ids), np.argsort(-logits, -1)[:, :3])
    np.testing.assert_allclose(np.asarray(vals), np.sort(raw, -1)[:, ::-1][:, :3], rtol=1e-5)
    _, lp2, _ = sample_jit(jnp.asarray(logits), arrays, KEY, np.zeros(4, np.int32),
                           logprobs_mode="processed")
    top2 = np.sort(logits, -1)[:, ::-1][:, :2] / 0.5
    proc = logits[np.arange(4), tok] / 0.5 - np.log(np.exp(top2).sum(-1))
    np.testing.assert_allclose(np.asarray(lp2), proc, rtol=1e-5, atol=1e-6)


def test_build_sampling_arrays_padding_and_seeds():
    ps = [SamplingParams(seed=2**32 + 5, top_k=-1), SamplingParams(repetition_penalty=1.2)]
    a = build_sampling_arrays(ps, seeds=[None, 77], num_rows=4, vocab_size=100,
                              prompt_token_ids=[[1], [3, 99]], output_token_ids=[[2], [4] * 20])
    assert isinstance(a, SamplingArrays)
    assert a.seed.tolist()[:2] == [5, 77]
    assert a.temperature.tolist() == [1.0, 1.0, 0.0, 0.0] and a.top_k.tolist() == [0] * 4
    assert a.output_tokens.shape == (4, 32)              # 20 -> bucket 32
    assert a.output_tokens[0].tolist() == [-1] * 32      # row 0 has no penalties
    assert a.prompt_mask.shape == (4, 4) and a.prompt_mask[1, 0] == 1 << 3 and a.prompt_mask[1, 3] == 1 << 3
    assert a.allowed_mask is None
    with pytest.raises(ValueError, match="output_token_ids"):
        build_sampling_arrays(ps)


@pytest.mark.parametrize("field,value", [
    ("n", 0), ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2),
    ("min_p", 1.1), ("repetition_penalty", 0.0), ("presence_penalty", 2.5),
    ("frequency_penalty", -3.0), ("seed", 1.5), ("max_tokens", 0), ("max_tokens", -1),
    ("stop", [""]), ("stop_token_ids", [-1]), ("logprobs", -1), ("temperature", float("nan")),
    ("logit_bias", {-1: 1.0}), ("logit_bias", {3: 100.5}), ("logit_bias", {i: 1.0 for i in range(301)}),
])
def test_sampling_params_validation(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_sampling_params_normalisation_and_children():
    p = SamplingParams(n=3, stop="###", top_k=-1, seed=10)
    assert p.stop == ["###"] and p.top_k == 0 and p.stop_token_ids == []
    assert [p.for_child(i).seed for i in range(3)] == [10, 11, 12]
    assert p.for_child(1).n == 1 and SamplingParams().for_child(2).seed is None


def feed(checker, pieces, ids=None):
    for i, piece in enumerate(pieces):
        r = checker.append(ids[i] if ids else 100 + i, piece)
        if r:
            return r
    return None


def test_stop_string_split_across_tokens():
    c = StopChecker(SamplingParams(stop=["STOP"]))
    assert feed(c, ["Hel", "lo S"]) is None
    assert c.stream_text() == "Hello "                      # "S" held back
    r = feed(c, ["T", "OP and more"])
    assert (r.finish_reason, r.stop_reason, c.text) == ("stop", "STOP", "Hello ")
    c = StopChecker(SamplingParams(stop=["STOP"], include_stop_str_in_output=True))
    feed(c, ["Hel", "lo S", "T", "OP and more"])
    assert c.text == "Hello STOP"


def test_stop_tokens_eos_and_length():
    c = StopChecker(SamplingParams(stop_token_ids=[7]), eos_token_ids=[2])
    r = feed(c, ["a", "b", "<x>"], ids=[5, 6, 7])
    assert (r.finish_reason, r.stop_reason, c.text) == ("stop", 7, "ab")
    c = StopChecker(SamplingParams(), eos_token_ids=[2])
    assert feed(c, ["a", "</s>"], ids=[5, 2]).stop_reason is None and c.text == "a"
    c = StopChecker(SamplingParams(ignore_eos=True, max_tokens=3), eos_token_ids=[2])
    r = feed(c, ["a", "</s>", "b", "c"], ids=[5, 2, 6, 7])
    assert (r.finish_reason, c.text, c.num_tokens) == ("length", "a</s>b", 3)


def test_stop_strings_against_brute_force():
    rng = np.random.default_rng(6)
    for trial in range(300):
        stops = ["".join(rng.choice(list("abc"), rng.integers(1, 4))) for _ in range(2)]
        pieces = ["".join(rng.choice(list("abcd"), rng.integers(0, 4))) for _ in range(8)]
        include = bool(trial % 2)
        c = StopChecker(SamplingParams(stop=stops, include_stop_str_in_output=include))
        r = feed(c, pieces)
        text, want = "", None
        for piece in pieces:  # reference: first token after which some stop occurs
            text += piece
            found = [(text.find(s), -len(s), s) for s in stops if s in text]
            if found:
                i, _, s = min(found)
                want = (s, text[:i + (len(s) if include else 0)])
                break
        assert (None if r is None else (r.stop_reason, c.text)) == want, (stops, pieces)


def test_stop_string_stream_of_parsed_text_against_brute_force():
    """A chat answer parsed from ids is streamed through StopStringStream: what it has sent never contains
    a stop string or text after one, and everything it sends adds up to the text cut before the first stop."""
    rng = np.random.default_rng(7)
    for _ in range(300):
        stops = ["".join(rng.choice(list("abc"), rng.integers(1, 4))) for _ in range(2)]
        pieces = ["".join(rng.choice(list("abcd"), rng.integers(0, 4))) for _ in range(8)]
        text, cut, stop = "", None, None
        for n, piece in enumerate(pieces):   # the engine ends at the first piece after which a stop occurs
            text += piece
            found = [(text.find(s), -len(s), s) for s in stops if s in text]
            if found:
                i, _, stop = min(found)
                cut, pieces = text[:i], pieces[:n + 1]
                break
        want = cut if cut is not None else text
        stream, sent, fed = StopStringStream(stops, include=False), "", ""
        for n, piece in enumerate(pieces):
            last = n == len(pieces) - 1
            fed += piece
            sent += stream.feed(piece, finished=last, stop_reason=stop if last else None)
            assert want.startswith(sent), (stops, pieces, sent)             # nothing sent is taken back
            assert last or len(sent) > len(fed) - max(map(len, stops)), (stops, pieces, sent)   # holds back < a stop
        assert sent == want, (stops, pieces, sent)


def test_holding_back_for_many_long_stop_strings_is_cheap():
    """The engine thread asks every token what to hold back: 3000 stop strings of 1000 chars made that
    0.24 s a token (a scan of every stop for every tail), stalling every running request."""
    calls = []

    class Stop(str):
        def startswith(self, prefix, *args):
            calls.append(1)
            return super().startswith(prefix, *args)
    stops = sorted(Stop("ab" * 500 + str(i)) for i in range(3000))
    assert held_tail("xyz q" * 200, stops) == 0 and held_tail("xyz q" * 200 + "abab", stops) == 4
    assert len(calls) <= 2 * 1000         # at most one look per tail, not one per tail per stop
    assert held_tail("hello ST", sorted(["STOP", "SX"])) == 2 and held_tail("ab", sorted(["b", "abc"])) == 2


def test_static_variants_leave_no_device_conditional():
    """No lax.cond on device values (XLA:GPU reads the predicate back to the host, stalling dispatch):
    whether to sort (top-k / top-p) and whether to compute top logprobs are static, set from the rows."""
    import jax
    greedy = build_sampling_arrays([SamplingParams(temperature=0), SamplingParams(temperature=0.7, min_p=0.1)])
    assert not greedy.truncate and not greedy.top_logprobs
    topp = build_sampling_arrays([SamplingParams(temperature=0.7, top_p=0.9), SamplingParams(logprobs=2)])
    assert topp.truncate and topp.top_logprobs
    logits = jnp.asarray(np.random.default_rng(0).normal(0, 1, (2, 50)), jnp.float32)
    for arrays in (greedy, topp):
        jaxpr = jax.make_jaxpr(lambda x, a: sample(x, a, KEY, jnp.zeros(2, jnp.int32), num_top_logprobs=3))(
            logits, arrays)
        assert "cond" not in str(jaxpr)
    _, _, (ids, _) = sample_jit(logits, greedy, KEY, np.zeros(2, np.int32), num_top_logprobs=3)
    assert ids.shape == (2, 0)                           # nobody asked: no top-k over the vocabulary
    tok = np.asarray(sample_jit(logits, greedy, KEY, np.zeros(2, np.int32))[0])
    assert tok[0] == int(np.argmax(np.asarray(logits[0])))
