"""A draft model as drafter: a smaller K3 / Kimi Linear model with the target's vocabulary proposes
its greedy continuation (a deterministic proposal: rejection.py treats it as one-hot q).

The drafter keeps its own cache pools (a ModelRunner of its own) and, per sequence, a committed
KDA slot at the position up to which it has read the sequence, and a scratch slot. A proposal first
feeds the tokens the target accepted since the last one into the committed slot (writing a copy to
the scratch slot: ModelRunner's checkpoint write), which yields the first draft, then runs k - 1
decode steps in the scratch slot. Its KDA state therefore never needs rolling back: the drafts only
ever touch the scratch slot, and MLA rows they wrote are overwritten by the next proposal.
"""
from __future__ import annotations

import dataclasses
import logging

from k3jax.cache import SeqChunk
from serving.allocator import PageAllocator, SlotAllocator
from serving.sampling_params import SamplingParams

log = logging.getLogger(__name__)

GREEDY = SamplingParams(temperature=0.0)


def check_compatible(draft_config, target_config, name: str = "draft model"):
    """A draft model must share the target's token ids: one vocabulary size (the tokenizer is the target's)."""
    if draft_config.vocab_size != target_config.vocab_size:
        raise ValueError(f"{name}: vocabulary of {draft_config.vocab_size} tokens, the target's has "
                         f"{target_config.vocab_size}: a draft model must share the target's tokenizer")


def check_draft_configs(target: str, draft: str):
    """The vocabulary check of two model names (presets or checkpoint directories) from their configs alone."""
    from k3jax.presets import resolve_config
    try:
        dc = resolve_config(draft)
    except (OSError, ValueError) as e:
        raise ValueError(f"draft model {draft!r}: {e}") from None
    check_compatible(dc, resolve_config(target), f"draft model {draft!r}")


def load_draft_model(path_or_preset: str, target, load_model):
    """The draft model of --draft-model, in the target's parameter dtype, checked against the target. A preset
    without weights gets random ones (seed 0: benchmarks). `load_model`: the entry point's model loader
    (k3jax.api.load_model, passed in: serving does not import the entry points)."""
    import os

    from k3jax.presets import preset_config, preset_names
    name = os.fspath(path_or_preset)
    seed = None
    if not os.path.isdir(name) and name in preset_names():
        check_compatible(preset_config(name), target.config, f"draft model {name!r}")   # before building weights
        seed = None if name in ("tiny", "tiny-random") else 0
    draft = load_model(name, dtype=target.params["embed"].dtype, seed=seed)
    check_compatible(draft.config, target.config, f"draft model {name!r}")
    return draft


@dataclasses.dataclass
class _Seq:
    slot: int                 # committed state: the sequence's first `pos` tokens
    scratch: int              # the state the drafts run in
    pages: list = dataclasses.field(default_factory=list)
    pos: int = 0


class DraftModelDrafter:
    kind = "draft"

    def __init__(self, draft, *, target_config, args):
        from serving.runner import ModelRunner
        check_compatible(draft.config, target_config)
        self.config = draft.config
        seqs = min(args.max_num_seqs, args.speculative_max_batch)
        self.page_size = args.page_size
        max_len = min(args.max_model_len or 8192, draft.config.max_position_embeddings)
        self.max_len = max_len
        num_pages = seqs * -(-max_len // args.page_size) + 1
        num_slots = 2 * seqs + 1
        self.budget = args.max_num_batched_tokens
        self.runner = ModelRunner(
            draft.config, draft.params, num_pages=num_pages, num_slots=num_slots, page_size=args.page_size,
            max_model_len=max_len, max_num_seqs=seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            max_logprobs=0, seed=args.seed, cache_dtype=draft.params["embed"].dtype,
            token_buckets=args.token_buckets, seq_buckets=None if args.seq_buckets is None else
            tuple(b for b in args.seq_buckets if b <= seqs) or (seqs,),
            backend=getattr(draft, "backend", None))
        self.max_seqs = seqs
        self.pages = PageAllocator(num_pages)
        self.slots = SlotAllocator(num_slots)
        self.seqs: dict[str, _Seq] = {}
        if args.warmup:
            self.runner.warmup(progress=False)

    # ------------------------------------------------------------------ per-sequence resources
    def _seq(self, req):
        s = self.seqs.get(req.request_id)
        if s is None:
            ids = self.slots.allocate(2)
            if ids is None:
                return None
            s = self.seqs[req.request_id] = _Seq(ids[0], ids[1])
        return s

    def _room(self, s: _Seq, end: int) -> bool:
        need = -(-end // self.page_size) - len(s.pages)
        if need <= 0:
            return True
        got = self.pages.allocate(need)
        if got is None:
            return False
        s.pages += got
        return True

    def forget(self, req):
        s = self.seqs.pop(req.request_id, None)
        if s is not None:
            self.slots.decref([s.slot, s.scratch])
            if s.pages:
                self.pages.decref(s.pages)

    # ------------------------------------------------------------------ proposing
    def propose(self, reqs, ks) -> list:
        out = [[] for _ in reqs]
        live = []
        for i, (r, k) in enumerate(zip(reqs, ks)):
            if k <= 0 or r.num_tokens + k - 1 > self.max_len:
                continue
            s = self._seq(r)
            if s is None or s.pos >= r.num_tokens or not self._room(s, r.num_tokens + k - 1):
                continue
            live.append((i, r, k, s))
        for group in (live[j:j + self.max_seqs] for j in range(0, len(live), self.max_seqs)):
            self._propose(group, out)
        return out

    def _run(self, chunks):
        n = len(chunks)
        toks, *_ = self.runner.execute(chunks, [GREEDY] * n, [0] * n, [0] * n)
        return [int(t) for t in toks]

    def _propose(self, group, out):
        # catch up: the tokens accepted since the last proposal, into the committed slot (a copy into scratch
        # with the last of them), the first draft from its logits
        todo = list(group)
        while todo:
            cap = max(1, self.budget // len(todo))
            chunks, ends = [], []
            for i, r, k, s in todo:
                end = min(r.num_tokens, s.pos + cap)
                chunks.append(SeqChunk(r.token_slice(s.pos, end), s.pos, s.pages, s.slot if s.pos else -1, s.slot,
                                       s.scratch if end == r.num_tokens else 0))
                ends.append(end)
            toks = self._run(chunks)
            nxt = []
            for (i, r, k, s), end, t in zip(todo, ends, toks):
                s.pos = end
                if end == r.num_tokens:
                    out[i].append(t)
                else:
                    nxt.append((i, r, k, s))
            todo = nxt
        # the other drafts: decode steps in the scratch slot
        for step in range(1, max(k for _, _, k, _ in group)):
            rows = [(i, r, s) for i, r, k, s in group if k > step]
            chunks = [SeqChunk([out[i][-1]], r.num_tokens + step - 1, s.pages, s.scratch, s.scratch) for i, r, s in rows]
            for (i, _, _), t in zip(rows, self._run(chunks)):
                out[i].append(t)
