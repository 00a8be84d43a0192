"""Prefix-aware admission, on the host-side scheduler alone (no model, no device).

The engine-level check (outputs unchanged, hit fraction at its maximum on a shared-prefix
workload) is test_engine.py::test_prefix_aware_admission_waits_for_a_prefix_being_computed.
"""
import numpy as np
import pytest

from serving.request import Request, Status
from serving.sampling_params import SamplingParams
from serving.scheduler import Scheduler, SchedulerConfig


def _scheduler(wait_steps, budget=150, state_block=128):
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget, page_size=16, max_model_len=2048,
                          prefix_match_unit=16, state_block_size=state_block, prefix_wait_steps=wait_steps)
    return Scheduler(cfg, num_pages=256, num_slots=16)


def _drive(sched, reqs, steps):
    """Schedule `steps` times (after_step stands in for the model); per step, {request id: (start, end)}."""
    for r in reqs:
        sched.add(r)
    log = []
    for _ in range(steps):
        out = sched.schedule()
        sched.after_step(out)
        log.append({c.req.request_id: (c.start, c.end) for c in out.chunks})
        for c in out.chunks:         # a sampled token makes the request a decode; stop it there
            if c.sample:
                sched.finish(c.req, keep_state=True)
    return log


def _pair(prefix_len=992):
    rng = np.random.RandomState(0)
    prefix = rng.randint(0, 1000, prefix_len).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=1)
    return [Request(f"r{i}", prefix + rng.randint(0, 1000, 40).tolist(), params, seed=0) for i in range(2)]


def test_waits_for_the_junction_checkpoint_then_hits_it():
    sched = _scheduler(wait_steps=64)
    r0, r1 = _pair()
    log = _drive(sched, [r0, r1], steps=10)
    # r0 computes the 992-token prefix 128 tokens a step (its chunks stop at state blocks), leaving budget for r1;
    # r1 shares exactly the prefix, so a checkpoint is planned into r0 at 992 (r0's own plan: multiples of 128
    # and its prompt end, 1024) and r1 waits for it instead of computing the prefix again.
    assert 992 in r0.checkpoints
    first = next(i for i, s in enumerate(log) if "r1" in s)
    assert log[first]["r1"] == (992, 1024) and r1.num_cached_tokens == 992       # (1024: its own planned stop)
    assert max(e for s in log[:first] for rid, (_, e) in s.items() if rid == "r0") == 992
    assert r1.waited_steps == first
    assert sched.stats()["prefix_hit_tokens"] == 992


def test_the_wait_is_bounded():
    sched = _scheduler(wait_steps=3)
    r0, r1 = _pair()
    log = _drive(sched, [r0, r1], steps=4)
    # r1 waits 3 schedules, then proceeds from what the cache holds by then (r0's checkpoint at 3 x 128).
    assert [("r1" in s) for s in log] == [False, False, False, True]
    assert log[3]["r1"] == (384, 406) and r1.waited_steps == 3 and r1.num_cached_tokens == 384


def test_off_admits_at_once_and_recomputes():
    sched = _scheduler(wait_steps=0)
    r0, r1 = _pair()
    log = _drive(sched, [r0, r1], steps=1)
    assert log[0] == {"r0": (0, 128), "r1": (0, 22)}


def test_the_owner_leaving_ends_the_wait():
    sched = _scheduler(wait_steps=64)
    r0, r1 = _pair()
    _drive(sched, [r0, r1], steps=2)
    assert r1.status == Status.WAITING and r1.wait_for[0] is r0
    sched.abort(r0)
    out = sched.schedule()        # r1 goes at once, from what r0 registered before it left (2 x 128 tokens)
    assert [(c.req.request_id, c.start) for c in out.chunks] == [("r1", 256)] and r1.num_cached_tokens == 256


@pytest.mark.parametrize("wait_steps", [0, 64])
def test_requests_behind_a_waiting_one_go_first(wait_steps):
    sched = _scheduler(wait_steps=wait_steps, budget=300, state_block=0)
    r0, r1 = _pair(prefix_len=240)
    other = Request("other", list(range(40)), SamplingParams(max_tokens=1), seed=0)
    log = _drive(sched, [r0, r1, other], steps=1)
    # r0 stops at its prompt end rounded down (272), leaving 28 tokens of budget; r1 shares 240 tokens with it:
    # waiting, it cuts r0's chunk at 240 (a checkpoint there) and "other" gets the rest (up to its own stop, 32)
    expect = {"r0": (0, 272), "r1": (0, 28)} if not wait_steps else {"r0": (0, 240), "other": (0, 32)}
    assert log[0] == expect


@pytest.mark.parametrize("grouped", [True, False])
def test_the_issue_workload_reaches_the_possible_hit_fraction(grouped):
    """The issue's H200 run, scheduled on the host alone: 64 requests = 8 groups x 8 sharing a 3072-token prefix +
    64 own tokens, 4096 tokens a step, state blocks of 1024, 16 output tokens. Admitted at once, requests of a group
    arriving together find only part of the prefix cached (45.9% of their prompt tokens there, with chunks cut at
    every block; 66.8% with chunks ending at the last block boundary inside them); waiting for the group's prefix,
    every request after the first of its group hits the whole prefix: 7/8 x 3072/3136 = 85.7%."""
    rng = np.random.RandomState(0)
    prefixes = [rng.randint(0, 160000, 3072).tolist() for _ in range(8)]
    prompts = [prefixes[i // 8 if grouped else i % 8] + rng.randint(0, 160000, 64).tolist() for i in range(64)]
    hit = {}
    for wait in (0, 64):
        cfg = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=4096, page_size=16, max_model_len=3200,
                              prefix_match_unit=16, state_block_size=1024, prefix_wait_steps=wait)
        sched = Scheduler(cfg, num_pages=20000, num_slots=512)
        reqs = [Request(f"r{i}", p, SamplingParams(max_tokens=16), seed=0) for i, p in enumerate(prompts)]
        for r in reqs:
            sched.add(r)
        while sched.has_work():
            out = sched.schedule()
            sched.after_step(out)
            for c in out.chunks:
                if c.sample:
                    c.req.output_ids.append(1)
                    if len(c.req.output_ids) == 16:
                        sched.finish(c.req, keep_state=True)
        hit[wait] = sum(r.num_cached_tokens for r in reqs) / sum(map(len, prompts))
    assert hit[64] == pytest.approx(7 / 8 * 3072 / 3136)
    assert hit[0] == pytest.approx(0.668, abs=5e-4) if grouped else hit[0] < hit[64]
