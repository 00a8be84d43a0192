"""Programs compiled after the engine is ready: lowered one after another on a background thread, each
compiled on a few worker threads as soon as it is lowered (XLA compiles outside the GIL).

The queue only builds programs; it never runs one (the runner's pools are donated and replaced by every
step of the main loop). `land(key, compiled)` hands each finished program to its owner, on a worker thread;
a program that fails to lower or compile is logged and left out (its owner keeps treating it as
unavailable). `gate` (a threading.Event) holds the work until it is set: a test's way to look at an
engine whose programs have not landed yet. Every thread is a daemon: a process that ends does not wait
for programs it will never run.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable, Optional, Sequence

log = logging.getLogger(__name__)


class CompileQueue:
    def __init__(self, jobs: Sequence[tuple], land: Callable, *, threads: int = 1,
                 gate: Optional[threading.Event] = None, on_done: Optional[Callable[[float, list], None]] = None):
        """jobs: (key, lower) in the order to build them; lower() returns a jax Lowered (its .compile() runs on a
        worker). land(key, compiled): a program is ready. on_done(seconds, failed keys): every job ended."""
        self._jobs = list(jobs)
        self._land = land
        self._gate = gate
        self._on_done = on_done
        self._left = len(self._jobs)          # jobs not yet ended (landed or failed)
        self._lock = threading.Lock()
        self._finished = threading.Event()
        self._stop = threading.Event()
        self._lowered: queue.Queue = queue.Queue()
        self.failed: list = []
        self._t0 = 0.0
        self._threads = [threading.Thread(target=self._lower_all, name="k3jax-background-lower", daemon=True)]
        self._threads += [threading.Thread(target=self._compile_all, name=f"k3jax-background-compile-{i}", daemon=True)
                          for i in range(max(1, threads))]

    def start(self) -> "CompileQueue":
        self._t0 = time.perf_counter()
        if not self._jobs:
            self._finished.set()
            return self
        for t in self._threads:
            t.start()
        return self

    def pending(self) -> int:
        """Programs not built yet (neither landed nor failed)."""
        return self._left

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Block until every job has ended (True) or `timeout` seconds passed or the queue was stopped (False)."""
        self._finished.wait(timeout)
        return self._left == 0

    def stop(self):
        """Start no further program (one being compiled finishes on its thread; nothing waits for it)."""
        self._stop.set()
        self._finished.set()

    # ------------------------------------------------------------------ background threads
    def _held(self) -> bool:
        """Wait for the gate; True when the queue was stopped meanwhile."""
        while self._gate is not None and not self._gate.wait(0.05):
            if self._stop.is_set():
                return True
        return self._stop.is_set()

    def _lower_all(self):
        try:
            for key, lower in self._jobs:
                if self._held():
                    return
                try:
                    self._lowered.put((key, lower()))
                except Exception as e:  # noqa: BLE001 - one program's failure leaves only that shape unavailable
                    self._end(key, e)
        finally:
            for _ in self._threads[1:]:
                self._lowered.put(None)          # the compile threads end after the last program

    def _compile_all(self):
        while True:
            item = self._lowered.get()
            if item is None or self._stop.is_set():
                return
            key, lowered = item
            try:
                self._land(key, lowered.compile())
            except Exception as e:  # noqa: BLE001
                self._end(key, e)
                continue
            self._end(key)

    def _end(self, key, error: Optional[BaseException] = None):
        if error is not None and not self._stop.is_set():
            log.warning("background compile: program %s failed (%s: %s); steps keep padding to another bucket",
                        key, type(error).__name__, str(error).splitlines()[0][:300] if str(error) else "")
        with self._lock:
            if error is not None:
                self.failed.append(key)
            self._left -= 1
            done = self._left == 0
        if done:
            self._finished.set()
            if self._on_done is not None:
                self._on_done(time.perf_counter() - self._t0, list(self.failed))
