"""Built-in check that a prefix-cache hit equals a recompute (`--verify-prefix-cache FRACTION`).

A sampled fraction of the requests whose prompt was served partly from the prefix cache get a
shadow request: the same prompt computed from scratch (it neither reads nor writes the cache), one
token, at the lowest priority, so it runs in the budget that real requests leave over. When it
samples, the raw log-probabilities of its first token are compared with those the original request
got from the hit. Silent corruption from hybrid prefix caches (a KDA state registered at the wrong
boundary, a stale page) shows up as a mismatch: counted, and logged as a warning naming the request.

Only each side's top-K log-probabilities come back from the step (K = max_logprobs), so the
distance is the largest |difference| over the ids in either top-K, where an id missing from one
side counts as that side's K-th value (a lower bound of the true L-inf distance: never an
over-report).
"""
from __future__ import annotations

import logging
import random
import sys
from typing import Optional

import numpy as np

from serving.request import Request
from serving.sampling_params import SamplingParams

log = logging.getLogger(__name__)

SHADOW_PRIORITY = sys.maxsize       # after every real request, first to be preempted


def logprob_distance(ids_a, vals_a, ids_b, vals_b) -> float:
    """Lower bound of max_t |a_t - b_t| from two top-K lists of (id, log-probability), sorted by value."""
    a = dict(zip(map(int, ids_a), map(float, vals_a)))
    b = dict(zip(map(int, ids_b), map(float, vals_b)))
    floor_a, floor_b = min(a.values()), min(b.values())
    d = 0.0
    for t in a.keys() | b.keys():
        if t in a and t in b:
            d = max(d, abs(a[t] - b[t]))
        elif t in a:                    # b_t <= floor_b
            d = max(d, a[t] - floor_b)
        else:
            d = max(d, b[t] - floor_a)
    return d


class PrefixCacheVerifier:
    def __init__(self, fraction: float, tolerance: float, max_pending: int = 2, seed: int = 0):
        if not 0 < fraction <= 1:
            raise ValueError(f"verify_prefix_cache: a fraction in (0, 1], got {fraction!r}")
        self.fraction, self.tolerance, self.max_pending = fraction, tolerance, max_pending
        self._rng = random.Random(seed)
        self._pending: dict = {}        # shadow request id -> (original id, cached tokens, top ids, top values)
        self.stats = {"prefix_verify_checks": 0, "prefix_verify_mismatches": 0, "prefix_verify_skipped": 0,
                      "prefix_verify_max_distance": 0.0}

    def owns(self, req: Request) -> bool:
        return req.request_id in self._pending

    def shadow_for(self, req: Request, top_ids, top_vals) -> Optional[Request]:
        """Called with a request's first sampled token. Returns the recompute to schedule, or None (no
        hit, not sampled, or too many checks in flight)."""
        if not req.num_cached_tokens or self._rng.random() >= self.fraction:
            return None
        if len(self._pending) >= self.max_pending:
            self.stats["prefix_verify_skipped"] += 1
            return None
        shadow = Request(f"verify:{req.request_id}", req.prompt_ids, SamplingParams(temperature=0.0, max_tokens=1),
                         seed=0, priority=SHADOW_PRIORITY, extra_keys=req.extra_keys, images=req.images,
                         use_cache=False)
        self._pending[shadow.request_id] = (req.request_id, req.num_cached_tokens, np.array(top_ids),
                                            np.array(top_vals))
        return shadow

    def recomputed(self, shadow: Request, top_ids, top_vals) -> bool:
        """The shadow's first token: compare it with the hit's. Returns whether they match."""
        rid, cached, hit_ids, hit_vals = self._pending.pop(shadow.request_id)
        d = logprob_distance(hit_ids, hit_vals, top_ids, top_vals)
        self.stats["prefix_verify_checks"] += 1
        self.stats["prefix_verify_max_distance"] = max(self.stats["prefix_verify_max_distance"], d)
        if d <= self.tolerance:
            return True
        self.stats["prefix_verify_mismatches"] += 1
        log.warning("prefix cache mismatch: request %s (%d of %d prompt tokens from the cache): the first token's "
                    "log-probabilities differ from a recompute by %.4g (tolerance %.4g); hit top ids %s, recompute %s",
                    rid, cached, len(shadow.prompt_ids), d, self.tolerance, list(map(int, hit_ids[:5])),
                    list(map(int, np.asarray(top_ids)[:5])))
        return False

    def dropped(self, shadow: Request) -> None:
        """A shadow that will never sample (aborted)."""
        self._pending.pop(shadow.request_id, None)
