"""Speculative verification at the sampler level (serving/spec/rejection.py): the emitted tokens are
distributed as the target's processed distribution, whatever the drafts; greedy rows match argmax."""
import numpy as np

from serving.sampler import build_sampling_arrays, make_key_data
from serving.sampling_params import SamplingParams
from serving.spec.rejection import verify_jit

V, ROWS = 6, 20000
LOGITS = np.array([[1.0, 0.2, 2.0, -0.5, 0.7, 1.5],
                   [0.3, 1.1, -1.0, 0.0, 2.2, 0.9],
                   [0.0, 0.5, 1.0, 1.5, 0.0, -2.0]], np.float32)          # positions 0..2 (K = 2)


def _target(logits, temperature, top_k):
    x = logits / temperature
    kth = np.sort(x)[::-1][top_k - 1] if top_k else -np.inf
    p = np.where(x >= kth, np.exp(x - x.max()), 0.0)
    return p / p.sum()


def _chi2(tokens, p):
    obs = np.bincount(tokens, minlength=len(p)).astype(float)
    assert obs[p == 0].sum() == 0, "a token outside the target's support was emitted"
    exp = p * len(tokens)
    m = exp > 0
    return float(((obs[m] - exp[m]) ** 2 / exp[m]).sum())


def _run(params, drafts, draft_probs=None):
    sarr = build_sampling_arrays([params] * ROWS, seeds=list(range(ROWS)), vocab_size=V, top_logprobs=False)
    logits = np.broadcast_to(LOGITS, (ROWS,) + LOGITS.shape)
    nd = np.full(ROWS, drafts.shape[1], np.int32)
    toks, acc, lp, _ = verify_jit(logits, sarr, make_key_data(0), np.zeros(ROWS, np.int32), drafts, nd, draft_probs)
    return np.asarray(toks), np.asarray(acc)


# chi-square with V - 1 = 5 degrees of freedom: P(stat > 25) ~ 1.4e-4 (fixed seeds: deterministic anyway)
BOUND = 25.0


def test_deterministic_drafts_keep_the_target_distribution():
    params = SamplingParams(temperature=0.8, top_k=5)
    p = [_target(LOGITS[j], 0.8, 5) for j in range(3)]
    drafts = np.tile(np.array([[2, 4]], np.int32), (ROWS, 1))           # n-gram style: q one-hot
    toks, acc = _run(params, drafts)
    assert _chi2(toks[:, 0], p[0]) < BOUND
    # draft 0 is accepted with probability p_0(2), and the first token is 2 exactly then (the residual excludes 2)
    assert np.array_equal(acc >= 1, toks[:, 0] == 2)
    assert abs((acc >= 1).mean() - p[0][2]) < 4 * np.sqrt(p[0][2] * (1 - p[0][2]) / ROWS)
    second = toks[acc >= 1, 1]                                           # given the first draft was accepted
    assert _chi2(second, p[1]) < BOUND
    third = toks[acc == 2, 2]                                            # the bonus token after both
    assert _chi2(third, p[2]) < BOUND
    # a draft outside the target's support (top-k drops token 3 at position 0) is never accepted
    bad = np.tile(np.array([[3, 4]], np.int32), (ROWS, 1))
    toks, acc = _run(params, bad)
    assert (acc == 0).all() and _chi2(toks[:, 0], p[0]) < BOUND


def test_sampled_drafts_keep_the_target_distribution():
    params = SamplingParams(temperature=1.0)
    p0 = _target(LOGITS[0], 1.0, 0)
    q = np.array([0.05, 0.05, 0.1, 0.4, 0.3, 0.1], np.float32)          # a poor draft distribution
    rng = np.random.default_rng(0)
    drafts = rng.choice(V, size=(ROWS, 2), p=q).astype(np.int32)
    qs = np.broadcast_to(q, (ROWS, 2, V)).copy()
    toks, acc = _run(params, drafts, qs)
    assert _chi2(toks[:, 0], p0) < BOUND
    # the wrong-q baseline must fail the same test (the bound has power)
    assert _chi2(drafts[:, 0], p0) > 10 * BOUND


def test_greedy_rows_accept_exactly_the_argmax_prefix():
    params = SamplingParams(temperature=0.0)
    sarr = build_sampling_arrays([params] * 4, seeds=[0] * 4, vocab_size=V, top_logprobs=False)
    logits = np.broadcast_to(LOGITS, (4,) + LOGITS.shape)
    am = LOGITS.argmax(-1)                                               # 2, 4, 3
    drafts = np.array([[2, 4], [2, 0], [1, 4], [2, 4]], np.int32)
    nd = np.array([2, 2, 2, 1], np.int32)
    toks, acc, lp, _ = verify_jit(logits, sarr, make_key_data(0), np.zeros(4, np.int32), drafts, nd)
    toks, acc = np.asarray(toks), np.asarray(acc)
    assert acc.tolist() == [2, 1, 0, 1]
    assert toks[0].tolist() == [2, 4, 3] and toks[1, :2].tolist() == [2, 4] and toks[2, 0] == am[0]
    assert toks[3, :2].tolist() == [2, 4]                                # one draft: its bonus is argmax p_1
    raw = LOGITS - np.log(np.exp(LOGITS).sum(-1, keepdims=True))
    np.testing.assert_allclose(np.asarray(lp)[0], raw[[0, 1, 2], toks[0]], rtol=1e-5)
