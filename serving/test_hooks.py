"""Test hooks.

ScriptedMatcher forces a scripted token sequence through the real sampling path. Enabled only
by `python -m k3jax.serve --enable-test-hooks`: a request carrying `"k3jax_test_script": [ids]`
gets a matcher whose allowed-token mask holds exactly the next scripted id (then only the stop
ids), so tool-call and reasoning parsing can be driven end to end through HTTP with a
random-weight model.

fault_point injects a failure into one process of a multi-host run, for the fault tests only:
K3JAX_TEST_FAULT="PROCESS:STAGE:ACTION[:SKIP]" makes process PROCESS, at the first fault point of
STAGE (load, warmup, serve) after SKIP others, raise RuntimeError ("raise"), SIGKILL itself
("kill") or stop itself whole ("hang", SIGSTOP). Fault points: entering a stage, and every
message a follower receives from process 0.
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


_fault_seen: dict = {}


def fault_point(stage: str, process_index: int):
    spec = os.environ.get("K3JAX_TEST_FAULT")
    if not spec:
        return
    proc, want, action, *skip = spec.split(":")
    if int(proc) != process_index or want != stage:
        return
    seen = _fault_seen[stage] = _fault_seen.get(stage, -1) + 1
    if seen != (int(skip[0]) if skip else 0):
        return
    if action == "raise":
        raise RuntimeError(f"injected fault (K3JAX_TEST_FAULT={spec})")
    os.kill(os.getpid(), {"kill": signal.SIGKILL, "hang": signal.SIGSTOP}[action])


def corrupt_checkpoint(engine, slot: int, scale: float = 1.0) -> None:
    """Add `scale` to every entry of a KDA state slot in every KDA layer (a deliberately corrupted prefix-cache
    checkpoint, for the prefix-cache verifier's tests). Single-process engines only."""
    pools = engine.runner.pools
    engine.runner.pools = pools.replace(kda_state=pools.kda_state.at[slot].add(scale))   # every KDA layer
