"""Test hooks, installed through the product's injection points (never shipped in it).

scripted_matcher: a `request_matcher` hook (serving.openai.generation.ServerState) forcing a scripted token
sequence through the real sampling path: a request carrying `"k3jax_test_script": [ids]` gets a matcher
whose allowed-token mask holds exactly the next scripted id (then only the stop ids), so tool-call and
reasoning parsing can be driven end to end through HTTP with a random-weight model.

fault_hook(spec): a multi-host `fault_hook` (serving.multihost_watch.WatchSettings) injecting a failure
into one process: spec "PROCESS:STAGE:ACTION[:SKIP]" makes process PROCESS, at the first fault point of
STAGE (load, warmup, serve) after SKIP others, raise RuntimeError ("raise"), SIGKILL itself ("kill") or
stop itself whole ("hang", SIGSTOP). Fault points: entering a stage, and every message a follower
receives from process 0.

tests/support/serve_with_hooks.py starts `k3jax.serve` with both installed.
"""
from __future__ import annotations

import os
import signal

import numpy as np


class ScriptedMatcher:
    def __init__(self, script, vocab_size: int, stop_ids):
        self.script = [int(t) for t in script]
        self.words = (vocab_size + 31) // 32
        self.stop_ids = list(stop_ids)
        self.pos = 0

    def allowed_mask(self) -> np.ndarray:
        ids = [self.script[self.pos]] if self.pos < len(self.script) else self.stop_ids
        m = np.zeros(self.words, np.uint32)
        for t in ids:
            m[t >> 5] |= np.uint32(1 << (t & 31))
        return m

    def accept(self, token_id: int) -> bool:
        ok = self.pos < len(self.script) and token_id == self.script[self.pos]
        self.pos += 1
        return ok


def scripted_matcher(req, state):
    """request_matcher hook: a factory forcing the request's scripted ids, when it asks for some."""
    script = (req.model_extra or {}).get("k3jax_test_script")
    if script is None:
        return None
    tok = state.tokenizer
    ids = script if isinstance(script, list) else [None]
    if not all(isinstance(t, int) and 0 <= t < tok.vocab_size for t in ids):
        raise ValueError("k3jax_test_script: expected a list of token ids")
    return lambda: ScriptedMatcher(ids, tok.vocab_size, tok.stop_ids)


def fault_hook(spec: str):
    """The fault_hook(stage, process_index) that spec "PROCESS:STAGE:ACTION[:SKIP]" describes."""
    proc, want, action, *skip = spec.split(":")
    if action not in ("raise", "kill", "hang"):
        raise ValueError(f"fault {spec!r}: ACTION must be raise, kill or hang")
    seen: dict = {}

    def hook(stage: str, process_index: int):
        if int(proc) != process_index or want != stage:
            return
        seen[stage] = seen.get(stage, -1) + 1
        if seen[stage] != (int(skip[0]) if skip else 0):
            return
        if action == "raise":
            raise RuntimeError(f"injected fault ({spec})")
        os.kill(os.getpid(), {"kill": signal.SIGKILL, "hang": signal.SIGSTOP}[action])
    return hook


def corrupt_checkpoint(engine, slot: int, scale: float = 1.0) -> None:
    """Add `scale` to every entry of a KDA state slot in every KDA layer (a deliberately corrupted prefix-cache
    checkpoint, for the prefix-cache verifier's tests). Single-process engines only."""
    pools = engine.runner.pools
    engine.runner.pools = pools.replace(kda_state=pools.kda_state.at[slot].add(scale))   # every KDA layer
