"""A long prompt does not freeze other streams (host-side scheduler alone, no model): every step schedules
every running decode row, and while they run the long prompt's chunks stay within the attention cap; alone,
it takes the whole token budget."""
import numpy as np

from serving.request import Request
from serving.sampling_params import SamplingParams
from serving.scheduler import Scheduler, SchedulerConfig

PAIRS = 1 << 16


def _scheduler(**kw):
    cfg = SchedulerConfig(**{**dict(max_num_seqs=16, max_num_batched_tokens=1024, page_size=16, max_model_len=1 << 16,
                                    prefix_match_unit=16, state_block_size=0, interactive_prefill_pairs=PAIRS), **kw})
    return Scheduler(cfg, num_pages=8192, num_slots=64)


def _request(rid, n, max_tokens, seed):
    ids = np.random.RandomState(seed).randint(0, 1000, n).tolist()
    return Request(rid, ids, SamplingParams(temperature=0.0, max_tokens=max_tokens), seed=0)


def _step(sched):
    """One schedule; after_step stands in for the model, and each sampled chunk appends a token."""
    out = sched.schedule()
    sched.after_step(out)
    for c in out.chunks:
        if c.sample:
            c.req.output_ids.append(7)
            if len(c.req.output_ids) >= c.req.params.max_tokens:
                c.req.final_sampled = True
                sched.finish(c.req)
    return out


def test_every_decode_row_runs_every_step_while_a_long_prompt_prefills():
    sched = _scheduler()
    streams = [_request(f"s{i}", 40, 10_000, i) for i in range(8)]
    for r in streams:
        sched.add(r)
    while not all(r.is_decode for r in streams):
        _step(sched)
    long = _request("long", 20_000, 1, 99)
    sched.add(long)
    chunks, steps = [], 0
    while not chunks or chunks[-1][0] + chunks[-1][1] < 20_000:
        out = _step(sched)
        steps += 1
        got = {c.req.request_id: c for c in out.chunks}
        assert set(got) >= {r.request_id for r in streams}, f"step {steps}: a decode row was left out"
        assert all(got[r.request_id].end - got[r.request_id].start == 1 for r in streams)
        if "long" in got:
            c = got["long"]
            n = c.end - c.start
            chunks.append((c.start, n))
            # a page always advances; chunks may stop earlier, at planned prefix-cache checkpoints
            assert n <= 16 or n * c.start + n * (n + 1) // 2 <= PAIRS, (c.start, n)
            assert out.num_tokens <= 1024
        assert steps < 5000
    starts = [s for s, _ in chunks]
    assert starts == sorted(starts) and chunks[0][0] == 0
    # the cap bites as the context grows: the first chunk is large, the late ones a page
    assert chunks[0][1] > 256 and max(n for s, n in chunks if s > 10_000) == 16


def test_alone_a_long_prompt_takes_the_whole_budget():
    sched = _scheduler()
    long = _request("long", 5_000, 1, 3)
    sched.add(long)
    sizes = []
    while sum(sizes) < 5_000:
        out = _step(sched)
        sizes += [c.end - c.start for c in out.chunks]
    assert sizes[:4] == [1024] * 4 and sum(sizes) == 5_000   # (the tail may stop at a prefix-cache checkpoint)


def test_cap_off_gives_prefills_the_budget_beside_decodes():
    sched = _scheduler()
    sched.cfg = SchedulerConfig(**{**sched.cfg.__dict__, "interactive_prefill_pairs": 0})
    streams = [_request(f"s{i}", 40, 10_000, i) for i in range(4)]
    for r in streams:
        sched.add(r)
    while not all(r.is_decode for r in streams):
        _step(sched)
    long = _request("long", 3_000, 1, 5)
    sched.add(long)
    out = _step(sched)
    assert {c.req.request_id: c.end - c.start for c in out.chunks}["long"] == 1024 - 4


def test_a_lone_long_prompt_advances_in_big_steps_and_still_checkpoints():
    """Alone, a long prompt takes long_prefill_tokens a step (4x the budget here); periodic checkpoints do not
    cut its chunks: each chunk ends on the block grid and checkpoints there, and a later prompt sharing a prefix
    resumes from the last of them at or below the shared part. A second request ends the lone steps."""
    sched = _scheduler(long_prefill_tokens=4096, state_block_size=256)
    n = 20_000
    long = _request("long", n, 1, 5)
    sched.add(long)
    chunks = []
    while not chunks or chunks[-1][1] < n:
        out = _step(sched)
        assert [c.req.request_id for c in out.chunks] == ["long"]
        c = out.chunks[0]
        chunks.append((c.start, c.end, bool(c.ckpt_dst)))
    # 4 whole steps, then the last block boundary before the prompt's end (19968), its end rounded down to the
    # match unit (19984, so an identical prompt hits) and the rest
    assert chunks == [(0, 4096, True), (4096, 8192, True), (8192, 12288, True), (12288, 16384, True),
                      (16384, 19968, True), (19968, 19984, True), (19984, n, False)]
    sched.cache.commit_pending()
    for shared, want in ((10_000, 8192), (19_970, 19968), (n, 19984), (4095, 0)):
        other = long.prompt_ids[:shared] + [1001] * 40
        assert sched.cache.lookup(other).num_tokens == want, shared

    # with a second request waiting, both take the regular budget (nobody waits behind a 4x step)
    sched = _scheduler(long_prefill_tokens=4096, state_block_size=256)
    a, b = _request("a", n, 1, 6), _request("b", 300, 1, 7)
    sched.add(a)
    assert _step(sched).chunks[0].end == 4096
    sched.add(b)
    out = _step(sched)
    assert [(c.req.request_id, c.end - c.start) for c in out.chunks] == [("a", 1024)]


def test_a_million_token_prompt_compiles_few_step_shapes():
    """A 1M-token prompt alone with the accelerator defaults (4096-token budget, 16,384-token lone steps, blocks of
    1024): 64 long steps to the last block boundary before its end, a regular one to its end checkpoint, the tail,
    then decode steps: four step shapes (the per-context shape, the block tables, is fixed by max_model_len)."""
    from serving.engine_args import ACCELERATOR_BATCH_DEFAULTS, ACCELERATOR_LONG_PREFILL_TOKENS
    from serving.step_shapes import long_buckets, step_buckets, step_shape
    seqs, budget = ACCELERATOR_BATCH_DEFAULTS
    n = (1 << 20) - 256
    sched = _scheduler(max_num_seqs=seqs, max_num_batched_tokens=budget, max_model_len=1 << 20, state_block_size=1024,
                       long_prefill_tokens=ACCELERATOR_LONG_PREFILL_TOKENS)
    sched = Scheduler(sched.cfg, num_pages=(1 << 16) + 8, num_slots=128)
    tb, sb = step_buckets(seqs, budget, on_cpu=False)
    long = long_buckets(tb[-1], ACCELERATOR_LONG_PREFILL_TOKENS)
    req = _request("1m", n, 4, 3)
    sched.add(req)
    shapes, steps, ckpts = set(), 0, 0
    while sched.has_work():
        out = _step(sched)
        steps += 1
        decode = all(c.start >= len(c.req.prompt_ids) for c in out.chunks)
        shapes.add(step_shape(out.num_tokens, len(out.chunks), tb, sb, long) + (decode,))
        ckpts += sum(bool(c.ckpt_dst) for c in out.chunks)
    assert steps == 64 + 2 + 3 and ckpts == 65             # a checkpoint at each long step's end and the prompt's
    assert shapes == {(16384, 4, False), (1024, 4, False), (16, 4, False), (16, 4, True)}, shapes
