"""Test helper: drive an LLMEngine with interleaved arrivals, shared prefixes and multi-turn chats."""
from __future__ import annotations

import numpy as np

from serving.sampling_params import SamplingParams


def make_workload(seed: int, n_requests: int, vocab: int, max_prefix: int = 80, max_new=(2, 6)):
    """Requests as (name, prompt or (parent_name, extra tokens), max_tokens). Prefix lengths are random."""
    rng = np.random.RandomState(seed)
    bases = [rng.randint(0, vocab, rng.randint(20, max_prefix)).tolist() for _ in range(6)]
    work = []
    for i in range(n_requests):
        if i >= 10 and rng.rand() < 0.2:                     # a follow-up turn of an earlier request
            parent = f"r{rng.randint(0, i)}"
            while any(w[0] == parent and isinstance(w[1], tuple) for w in work):
                parent = f"r{rng.randint(0, i)}"
            work.append((f"r{i}", (parent, rng.randint(0, vocab, rng.randint(1, 20)).tolist()), int(rng.randint(*max_new))))
            continue
        base = bases[rng.randint(len(bases))]
        cut = rng.randint(1, len(base) + 1)
        prompt = base[:cut] + rng.randint(0, vocab, rng.randint(1, 30)).tolist()
        work.append((f"r{i}", prompt, int(rng.randint(*max_new))))
    return work


def run_workload(engine, work, arrivals_per_step: int = 3):
    """Returns {name: (token ids, num_cached_tokens)}; follow-ups wait for their parent to finish."""
    done, pending, results = {}, list(work), {}
    prompts = {}
    while pending or engine.has_unfinished():
        added = 0
        for item in list(pending):
            if added >= arrivals_per_step:
                break
            name, prompt, max_tokens = item
            if isinstance(prompt, tuple):
                parent, extra = prompt
                if parent not in done:
                    continue
                prompt = prompts[parent] + done[parent][0] + extra
            prompts[name] = prompt
            engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens), request_id=name)
            pending.remove(item)
            added += 1
        for out in engine.step():
            if out.finished:
                done[out.request_id] = (out.outputs[0].token_ids, out.num_cached_tokens)
        if not engine.has_unfinished() and pending and added == 0:
            raise AssertionError("workload stuck: follow-ups whose parents never finished")
    return done


def run_one(engine, prompt, params, request_id):
    """Run one request to the end (and whatever else is queued); returns its final RequestOutput."""
    engine.add_request(prompt, params, request_id=request_id)
    done = None
    while engine.has_unfinished():
        done = next((o for o in engine.step() if o.finished and o.request_id == request_id), done)
    return done
