"""The speculator's adaptive policy (serving/spec/speculator.py), driven step by step without a model: which
sequences get drafts, how many, when a sequence pauses and when it probes again."""
from serving.request import Request, Status
from serving.sampling_params import SamplingParams
from serving.spec.speculator import Speculator

K = 4


class Proposer:
    """Proposes k tokens for every request (or nothing, with `empty`)."""

    def __init__(self):
        self.empty = False

    def propose(self, reqs, ks):
        return [[] if self.empty else [7] * k for k in ks]


def _request(rid="r", max_tokens=10_000):
    r = Request(rid, [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=max_tokens), seed=0)
    r.status, r.num_computed, r.output_ids = Status.RUNNING, 3, [5]
    return r


def _emit(r):
    """One decode step of r: a token out, the one before it fed."""
    r.output_ids.append(5)
    r.num_computed += 1


def _run(spec, reqs, steps, accept):
    """`steps` engine steps; each proposal is verified with accept(proposed) drafts accepted. Returns the steps
    (0-based) that verified, and the draft lengths proposed in them."""
    verified, lengths = [], []
    for step in range(steps):
        spec.tick()
        spec.propose(reqs, max_model_len=1 << 20)
        for r in reqs:
            if r.spec_drafts:
                n = len(r.spec_drafts)
                spec.observe(r, n, accept(n))
                verified.append(step)
                lengths.append(n)
            _emit(r)
    return verified, lengths


def test_accepted_drafts_keep_speculating_at_full_length():
    spec = Speculator(Proposer(), K)
    verified, lengths = _run(spec, [_request()], 50, accept=lambda n: n)
    assert verified == list(range(50)) and set(lengths) == {K}
    assert spec.metrics()["spec_acceptance_rate"] == 1.0


def test_draft_length_follows_acceptance():
    spec = Speculator(Proposer(), K)
    accepted = iter([1, 4, 4, 4, 0])
    _, lengths = _run(spec, [_request()], 5, accept=lambda n: min(n, next(accepted)))
    # 1 of 4 accepted -> accepted + 1 = 2; fully accepted runs grow one a step up to K; none accepted -> 1
    assert lengths == [4, 2, 3, 4, 4]


def test_rejections_pause_with_doubling_backoff_and_a_good_probe_resets_it():
    spec = Speculator(Proposer(), K)
    r = _request()
    verified, _ = _run(spec, [r], 200, accept=lambda n: 0)
    ticks = [v + 1 for v in verified]                     # the speculator's step count at each verification
    # two rejected verifications in a row bring the average under min_acceptance; then one probe after each pause
    # of 8, 16, ..., 128 steps, each ending at a multiple of its length (paused sequences probe together)
    assert ticks[1] - ticks[0] == 1 and len(ticks) == 7, ticks
    for probe, pause, before in zip(ticks[2:], (8, 16, 32, 64, 128), ticks[1:]):
        assert probe % pause == 0 and 0 < probe - before <= pause, ticks
    assert ticks[-1] + 256 > 200                          # the next pause (256 steps) outlasts the run
    # a probe that accepts ends the backoff: the next low average pauses 8 steps again
    spec.seqs["r"].pause = 0
    spec.observe(r, 1, 1)
    assert spec.seqs["r"].backoff == 8


def test_paused_sequences_probe_in_the_same_steps():
    spec = Speculator(Proposer(), K)
    reqs = [_request("a"), _request("b")]
    spec.tick()
    spec.step += 3                                       # b starts speculating 3 steps after a
    verified = {"a": [], "b": []}
    for step in range(120):
        spec.tick()
        spec.propose(reqs, max_model_len=1 << 20)
        for r in reqs:
            if r.spec_drafts and (r.request_id == "a" or step >= 3):
                spec.observe(r, len(r.spec_drafts), 0)
                verified[r.request_id].append(step)
            _emit(r)
    late = [s for s in verified["a"] if s > 30]
    assert late and late == [s for s in verified["b"] if s > 30]


def test_nothing_to_propose_pauses_one_step_doubling_to_32():
    drafter = Proposer()
    drafter.empty = True
    spec = Speculator(drafter, K)
    r = _request()
    asked = []
    for step in range(130):
        spec.tick()
        if spec.candidates([r]):
            asked.append(step)
        spec.propose([r], max_model_len=1 << 20)
        _emit(r)
    gaps = [b - a for a, b in zip(asked, asked[1:])]
    assert gaps[:6] == [1, 2, 4, 8, 16, 32] and set(gaps[6:]) == {32}, gaps


def test_no_speculation_beyond_max_batch_or_near_max_tokens():
    spec = Speculator(Proposer(), K, max_batch=2)
    reqs = [_request(str(i)) for i in range(3)]
    assert spec.candidates(reqs) == []
    assert spec.candidates(reqs[:2]) == reqs[:2]
    last = _request("last", max_tokens=2)               # one token left to generate: nothing to verify
    assert spec.candidates([last]) == []
    near = _request("near", max_tokens=4)                # two left: one draft at most
    spec.propose([near], max_model_len=1 << 20)
    assert near.spec_drafts == [7, 7]


def test_adaptive_off_never_pauses():
    spec = Speculator(Proposer(), K, adaptive=False)
    verified, lengths = _run(spec, [_request()], 30, accept=lambda n: 0)
    assert verified == list(range(30)) and set(lengths) == {K}
