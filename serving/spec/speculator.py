"""The engine's side of speculative decoding: which requests get drafts this step, how many, and the
acceptance bookkeeping (adaptive draft length, pauses, the /metrics counters).

Adaptive policy, per sequence: the draft length follows acceptance (one more after a fully accepted
run, the accepted count + 1 after a rejection); an exponential average of the acceptance rate below
`min_acceptance` pauses speculation for the sequence (8 steps, doubling on every failed probe up to
`max_pause`; a good probe resets it); a drafter with nothing to propose pauses it too (1 step, doubling
up to 32); pauses end at multiples of their length, so paused sequences probe in the same steps (a
speculative step is synchronous). Speculation is off for a step when more than `max_batch` sequences decode: a large batch
is already compute-efficient, and verification would only add work.

Not speculated: requests with structured output or penalties (their sampler state depends on every
previous token: the host must see each token first), a prefix-cache verifier's recompute, and
sequences with fewer than two tokens left to generate.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from serving.request import Request, Status


@dataclasses.dataclass
class SeqSpec:
    k: int                       # draft length for the next proposal
    ema: float = 1.0             # acceptance rate, exponentially averaged
    pause: int = 0               # steps left without speculation
    backoff: int = 8             # the next pause after low acceptance
    miss_backoff: int = 1        # the next pause after a step without a proposal


class Speculator:
    EMA = 0.5                    # weight of the newest verification in the acceptance average

    def __init__(self, drafter, num_speculative_tokens: int, *, adaptive: bool = True, max_batch: int = 32,
                 min_acceptance: float = 0.3, max_pause: int = 256):
        self.drafter = drafter
        self.k = num_speculative_tokens
        self.adaptive = adaptive
        self.max_batch = max_batch
        self.min_acceptance = min_acceptance
        self.max_pause = max_pause
        self.seqs: dict[str, SeqSpec] = {}
        self.step = 0
        self.stats = {"spec_drafted_tokens": 0, "spec_accepted_tokens": 0, "spec_verify_rows": 0,
                      "spec_steps": 0}

    @staticmethod
    def eligible(req: Request) -> bool:
        p = req.params
        return (req.status == Status.RUNNING and req.is_decode and not req.final_sampled and req.matcher is None
                and not p.uses_penalties and req.use_cache and (p.max_tokens or 0) - len(req.output_ids) >= 2)

    def _state(self, req: Request) -> SeqSpec:
        s = self.seqs.get(req.request_id)
        if s is None:
            s = self.seqs[req.request_id] = SeqSpec(self.k)
        return s

    def candidates(self, running) -> list:
        """The running requests that would get drafts now (before their last token is known)."""
        live = [r for r in running if r.status == Status.RUNNING and r.output_ids and not r.final_sampled]
        if len(live) > self.max_batch:
            return []
        return [r for r in live if self.eligible(r) and self._state(r).pause <= 0]

    def tick(self):
        """One engine step passed: paused sequences count it."""
        self.step += 1
        for s in self.seqs.values():
            s.pause -= 1

    def _pause(self, s: SeqSpec, steps: int):
        # paused sequences resume together, at multiples of their (power of two) pause: a step that speculates
        # is synchronous, so few such steps beat many steps with one probing sequence each
        s.pause = steps - self.step % steps

    def wants_step(self, running) -> bool:
        return bool(self.candidates(running))

    def propose(self, running, max_model_len: int) -> int:
        """Set req.spec_drafts on this step's speculating requests (all others: none); returns how many got
        some. Every request's last token must be known (no step in flight)."""
        for r in running:
            r.spec_drafts = []
        reqs = self.candidates(running)
        if not reqs:
            return 0
        ks = [max(0, min(self._state(r).k, r.params.max_tokens - len(r.output_ids) - 1,
                         max_model_len - r.num_tokens)) for r in reqs]
        got = 0
        for r, k, drafts in zip(reqs, ks, self.drafter.propose(reqs, ks)):
            drafts = [int(t) for t in drafts[:k]]
            r.spec_drafts = drafts
            if drafts:
                got += 1
            elif self.adaptive:
                s = self._state(r)
                self._pause(s, s.miss_backoff)
                s.miss_backoff = min(2 * s.miss_backoff, 32)
        return got

    def observe(self, req: Request, proposed: int, accepted: int):
        """Account one verification: `accepted` of `proposed` drafts."""
        self.stats["spec_drafted_tokens"] += proposed
        self.stats["spec_accepted_tokens"] += accepted
        self.stats["spec_verify_rows"] += 1
        if not self.adaptive:
            return
        s = self._state(req)
        s.miss_backoff = 1
        s.ema = (1 - self.EMA) * s.ema + self.EMA * accepted / proposed
        s.k = min(self.k, s.k + 1) if accepted == proposed else max(1, accepted + 1)
        if s.ema < self.min_acceptance:
            self._pause(s, s.backoff)
            s.backoff = min(2 * s.backoff, self.max_pause)
            s.ema = self.min_acceptance          # one probe after the pause decides again
        elif accepted:
            s.backoff = 8

    def forget(self, req: Request):
        self.seqs.pop(req.request_id, None)
        forget = getattr(self.drafter, "forget", None)
        if forget is not None:
            forget(req)

    def metrics(self) -> dict:
        d, a = self.stats["spec_drafted_tokens"], self.stats["spec_accepted_tokens"]
        return dict(self.stats, spec_acceptance_rate=a / d if d else 0.0)


class PromptLookup:
    """Adapts a per-sequence proposer (NgramDrafter: propose(tokens, k)) to the batch interface."""

    def __init__(self, ngram):
        self.ngram = ngram
        self.kind = ngram.kind

    def propose(self, reqs, ks) -> list:
        w = self.ngram.window
        return [self.ngram.propose(r.token_slice(max(0, r.num_tokens - w), r.num_tokens), k) if k > 0 else []
                for r, k in zip(reqs, ks)]


def drafter_for(kind: str, k: int, model=None, draft_model=None, args=None) -> Optional[object]:
    """The drafter of EngineArgs.speculative (None for "off")."""
    if kind == "off":
        return None
    if kind == "ngram":
        from serving.spec.ngram import NgramDrafter
        return PromptLookup(NgramDrafter())
    if kind == "draft":
        from serving.spec.draft import DraftModelDrafter
        return DraftModelDrafter(draft_model, target_config=model.config, args=args)
    raise ValueError(f"speculative: unknown drafter {kind!r} (expected off, ngram or draft)")
