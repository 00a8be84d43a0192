"""Multi-host fault watch: a process that fails or goes silent ends the whole run within seconds,
with process 0 logging which process, in which stage, and why.

Without it a follower that raised while loading left process 0 blocked in a collective until JAX's
coordination service ended both, minutes later, with a C++ check failure that named no cause.

Every process runs two daemon threads. The beat thread writes this process's state to the JAX
coordination service's key-value store (it lives in process 0; every process has a client) and
reads everyone's; the judge thread decides on the latest snapshot. Keys under `k3jax/pod/`:
  beat/{i}    "stage|seq|count", rewritten every beat_s. `count` changes each beat; readers time
              changes on their own clock (host clocks need not agree). `seq`: the last multi-host
              message a follower finished, or the one process 0 is running.
  failed/{i}  "stage|exception": process i raised there (written once, just before it exits).
  abort       process 0's reason for ending the run; every follower exits 1 when it sees it.
  ack/{i}     follower i saw abort and is exiting.
Stages: start, load (checkpoint read and placement), warmup (a follower from load until process 0
serves), serve, shutdown (a clean exit: nothing is judged any more).

Process 0 ends the run when a follower wrote failed/{i}; when a follower's beat has not changed
for heartbeat_timeout_s (killed, crashed, hung as a whole: slow is not dead, a process loading a
large checkpoint keeps beating); when start-up outlasts startup_timeout_s; or when one multi-host
message stays unfinished for step_timeout_s (naming the processes that have not finished it).
Ending: log the cause, run the on_abort callbacks (the server fails its in-flight requests with a
503 and /health reports the cause), write abort, give responses and followers' acks a moment,
then os._exit(1). A follower exits 1 on abort, on process 0's beat going stale, or when the store
(process 0) stops answering. os._exit because a normal exit would wait in jax.distributed's
shutdown barrier for the lost process and end in a C++ abort.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import sys
import threading
import time
from typing import Callable, Optional

log = logging.getLogger(__name__)

PREFIX = "k3jax/pod/"
STARTUP_STAGES = ("start", "load", "warmup")


@dataclasses.dataclass(frozen=True)
class WatchSettings:
    heartbeat_timeout_s: float = 30.0     # a process silent this long is lost
    startup_timeout_s: float = 7200.0     # load + warm-up of the whole run (large checkpoints take minutes)
    step_timeout_s: float = 900.0         # one multi-host message unfinished this long (covers a compile)
    flush_s: float = 3.0                  # most time responses and acks get once the run is ending
    # fault_hook(stage, process_index), if set, runs at every fault point: entering a stage, and every
    # message a follower receives from process 0 (the fault tests inject failures through it)
    fault_hook: Optional[Callable[[str, int], None]] = None

    @property
    def beat_s(self) -> float:
        return min(1.0, self.heartbeat_timeout_s / 4)


def describe(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return text if len(text) <= 2000 else text[:2000] + " ..."


@dataclasses.dataclass
class _Peer:
    value: str = ""
    changed_at: float = 0.0
    stage: str = "start"
    seq: int = 0


class Watch:
    """One process's side of the watch (see the module doc). `client`: the coordination service's
    client (key_value_set / key_value_dir_get); `exit`: os._exit, replaceable in tests."""

    def __init__(self, client, process_index: int, num_processes: int, settings: WatchSettings,
                 exit: Callable[[int], None] = os._exit, clock: Callable[[], float] = time.monotonic):
        self.client, self.me, self.n, self.settings = client, process_index, num_processes, settings
        self.leader = process_index == 0
        self._exit, self._clock = exit, clock
        now = clock()
        self.started_at = now
        self.stage = "start"
        self.seq = 0                       # followers: last message finished; process 0: message running
        self.pending: Optional[tuple] = None    # process 0: (seq, sent at) of the message in flight
        self.peers = {i: _Peer(changed_at=now) for i in range(num_processes) if i != process_index}
        self.failed: dict = {}             # process -> "stage|exception"
        self.abort_reason: Optional[str] = None
        self.own_error: Optional[str] = None    # process 0's own exception while a follower may be the cause
        self.acks: set = set()
        self.last_ok, self.last_error = now, None
        self._count = 0
        self._on_abort: list = []
        self._ending = threading.Lock()
        self._stopped = threading.Event()

    # ------------------------------------------------------------------ this process's state
    def start(self):
        for target, name in ((self._beat_loop, "k3jax-mh-beat"), (self._judge_loop, "k3jax-mh-judge")):
            threading.Thread(target=target, name=name, daemon=True).start()
        return self

    def set_stage(self, stage: str):
        if stage != self.stage:
            log.info("multi-host: process %d: %s done after %.1fs, now %s", self.me, self.stage,
                     self._clock() - self.started_at, stage)
        self.stage = stage
        self._beat()

    def fault_point(self):
        """Run the settings' fault hook, if any, for this process's current stage."""
        if self.settings.fault_hook is not None:
            self.settings.fault_hook(self.stage, self.me)

    def on_abort(self, callback: Callable[[str], None]):
        """callback(reason) runs on process 0 when the run ends for a fault (from the judge thread)."""
        self._on_abort.append(callback)

    def stop(self):
        """A clean exit is under way: say so, then stop beating and judging (the others exit too)."""
        self.set_stage("shutdown")
        self._stopped.set()

    def fail(self, exc: BaseException, code: int = 1):
        """This process's start-up, or process 0's engine thread, raised: report it and end (never returns)."""
        stage = self.stage
        if not self.leader:
            log.error("multi-host: process %d failed during %s", self.me, stage, exc_info=exc)
            self._set(f"failed/{self.me}", f"{stage}|{describe(exc)}")
            self._flush_and_exit(code)
        if not isinstance(exc, (ValueError, OSError)):
            # A collective that broke (gloo: "connection reset by peer") is the echo of a follower's
            # death: give the judge the time to see the silence and name that follower instead.
            log.warning("multi-host: process 0 raised during %s (%s); checking the other processes",
                        stage, describe(exc))
            self.own_error = f"process 0 then raised during {stage}: {describe(exc)}"
            deadline = self._clock() + self.settings.heartbeat_timeout_s + 2 * self.settings.beat_s
            while self._clock() < deadline and not self._ending.locked():
                time.sleep(self.settings.beat_s)
        if self._ending.locked():
            threading.Event().wait()         # the judge is ending the run for the real cause
        log.error("multi-host: process 0 failed during %s", stage, exc_info=exc)
        self.end(f"process 0 failed during {stage}: {describe(exc)}", code)

    def report_failed(self, exc: BaseException):
        """Follower: record the failure for process 0 (the caller logs and exits)."""
        self._set(f"failed/{self.me}", f"{self.stage}|{describe(exc)}")

    # ------------------------------------------------------------------ process 0: steps
    def message_started(self, seq: int):
        self.seq, self.pending = seq, (seq, self._clock())

    def message_finished(self, seq: int):
        self.seq, self.pending = seq, None

    # ------------------------------------------------------------------ the store
    def _set(self, key: str, value: str):
        try:
            self.client.key_value_set(PREFIX + key, value, allow_overwrite=True)
        except Exception as e:  # noqa: BLE001 - the store may be gone with process 0; the judge handles that
            self.last_error = e

    def _beat(self):
        self._count += 1
        self._set(f"beat/{self.me}", f"{self.stage}|{self.seq}|{self._count}")

    def _read(self):
        entries = self.client.key_value_dir_get(PREFIX)
        now = self._clock()
        for key, value in entries:
            kind, _, who = key[len(PREFIX):].partition("/")
            if kind == "abort":
                self.abort_reason = value
                continue
            if not who.isdigit() or int(who) == self.me:
                continue
            i = int(who)
            if kind == "failed":
                self.failed[i] = value
            elif kind == "ack":
                self.acks.add(i)
            elif kind == "beat" and i in self.peers:
                peer = self.peers[i]
                if value != peer.value:
                    stage, seq, _ = (value.split("|") + ["", "0", ""])[:3]
                    peer.value, peer.changed_at, peer.stage, peer.seq = value, now, stage, int(seq or 0)
        self.last_ok = now

    def _beat_loop(self):
        while not self._stopped.is_set():
            try:
                self._beat()
                self._read()
            except Exception as e:  # noqa: BLE001 - judged as "store not answering" by the judge thread
                self.last_error = e
            time.sleep(self.settings.beat_s)

    # ------------------------------------------------------------------ judging
    def _judge_loop(self):
        while not self._stopped.is_set():
            if not self.leader and self.stage == "warmup" and self.peers[0].stage == "serve":
                self.stage = "serve"        # a follower's warm-up is process 0's
            reason = self.verdict()
            if reason is not None:
                if self.leader:
                    self.end(reason)
                else:
                    self._follower_exit(reason)
            time.sleep(self.settings.beat_s)

    def verdict(self) -> Optional[str]:
        """Why the run must end now, or None (from the latest snapshot of the store)."""
        if self._stopped.is_set():
            return None
        now, s = self._clock(), self.settings
        if not self.leader:
            if self.abort_reason is not None:
                return f"process 0 ended the run: {self.abort_reason}"
            lead = self.peers[0]
            if lead.stage == "shutdown":
                return None
            if now - self.last_ok > s.heartbeat_timeout_s:
                return f"lost process 0: the coordination service stopped answering ({self.last_error})"
            if now - lead.changed_at > s.heartbeat_timeout_s:
                return f"lost process 0 (during {lead.stage}): no heartbeat for {now - lead.changed_at:.0f}s"
            return None
        for i in sorted(self.failed):
            stage, _, what = self.failed[i].partition("|")
            return f"process {i} failed during {stage}: {what}"
        for i, peer in sorted(self.peers.items()):
            if peer.stage != "shutdown" and now - peer.changed_at > s.heartbeat_timeout_s:
                return (f"process {i} lost during {peer.stage}: no heartbeat for {now - peer.changed_at:.0f}s "
                        "(killed, crashed or unreachable)")
        if self.stage in STARTUP_STAGES and now - self.started_at > s.startup_timeout_s:
            where = ", ".join(f"process {i} in {st}" for i, st in self._stages() if st in STARTUP_STAGES)
            return f"start-up did not finish in {s.startup_timeout_s:.0f}s ({where})"
        pending = self.pending
        if pending is not None and now - pending[1] > s.step_timeout_s:
            seq, sent = pending
            behind = [i for i, peer in sorted(self.peers.items()) if peer.seq < seq]
            who = (f"process(es) {', '.join(map(str, behind))} have not finished it" if behind
                   else "every follower finished it: process 0 itself is stuck")
            return f"multi-host message {seq} unfinished after {now - sent:.0f}s (step timeout): {who}"
        return None

    def _stages(self):
        return [(self.me, self.stage)] + [(i, p.stage) for i, p in sorted(self.peers.items())]

    # ------------------------------------------------------------------ ending
    def end(self, reason: str, code: int = 1):
        """Process 0: end every process of the run for `reason` (never returns)."""
        if not self._ending.acquire(blocking=False):
            threading.Event().wait()         # another thread is ending the run and exits the process
        if self.own_error and not reason.startswith("process 0"):
            reason = f"{reason}; {self.own_error}"
        log.error("multi-host: %s; ending all %d processes", reason, self.n)
        for callback in self._on_abort:
            try:
                callback(reason)
            except Exception:  # noqa: BLE001 - ending must not stop at a callback
                log.exception("multi-host: abort callback failed")
        self._set("abort", reason)
        start = self._clock()
        # Responses get at least a second to flush; followers a moment to see abort and ack.
        while self._clock() - start < self.settings.flush_s:
            if self._clock() - start >= 1.0 and self._live_followers() <= self.acks:
                break
            time.sleep(0.1)
        self._flush_and_exit(code)

    def _live_followers(self) -> set:
        now = self._clock()
        return {i for i, p in self.peers.items() if now - p.changed_at <= self.settings.heartbeat_timeout_s
                and i not in self.failed}

    def _follower_exit(self, reason: str):
        if not self._ending.acquire(blocking=False):
            threading.Event().wait()
        log.error("multi-host: process %d: %s; exiting", self.me, reason)
        self._set(f"ack/{self.me}", "1")
        self._flush_and_exit(1)

    def _flush_and_exit(self, code: int):
        for h in logging.getLogger().handlers:
            h.flush()
        sys.stdout.flush()
        sys.stderr.flush()
        self._exit(code)


# ---------------------------------------------------------------------- the process's watch

_watch: Optional[Watch] = None


def start(settings: WatchSettings) -> Optional[Watch]:
    """Start the watch of a multi-process run (call right after jax.distributed is up); None otherwise."""
    global _watch
    import jax
    if jax.process_count() == 1 or _watch is not None:
        return _watch
    from jax._src.distributed import global_state
    _watch = Watch(global_state.client, jax.process_index(), jax.process_count(), settings).start()
    return _watch


def current() -> Optional[Watch]:
    return _watch


def set_stage(stage: str):
    if _watch is not None:
        _watch.set_stage(stage)
        _watch.fault_point()
