"""Ahead-of-time compiles of the runner's programs: now (warm-up, compile_now) or after the engine is ready
(CompileQueue, on background threads).

Programs are lowered one after another (tracing is Python, under the GIL) and each is compiled on a few
threads as soon as it is lowered (XLA compiles outside the GIL), so lowering and compiling overlap.

The background queue only builds programs; it never runs one (the runner's pools are donated and replaced
by every step of the main loop). `land(key, compiled)` hands each finished program to its owner, on a
worker thread; a program that fails to lower or compile is logged and left out (its owner keeps treating
it as unavailable). `gate` (a threading.Event) holds the work until it is set: a test's way to look at an
engine whose programs have not landed yet. Every thread is a daemon: a process that ends does not wait
for programs it will never run.
"""
from __future__ import annotations

import concurrent.futures
import logging
import os
import queue
import threading
import time
from typing import Callable, NamedTuple, Optional, Sequence

import jax

log = logging.getLogger(__name__)


class Job(NamedTuple):
    """A program warm-up builds: the shape key it is kept under, the jitted function, the executable-cache kind,
    example arguments, the guard's shape keys it stands for, whether it belongs to the covering set compiled
    before the engine is ready (background compile) and its place in the background order (rank)."""
    key: tuple
    fn: object
    kind: str
    args: tuple
    notes: tuple
    cover: bool
    rank: tuple


def abstract(tree):
    """Device arrays as their shapes, dtypes and shardings (what lowering reads); host values as they are."""
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding,
                                                                 weak_type=x.weak_type)
                                  if isinstance(x, jax.Array) else x, tree)


def compile_threads(threads: Optional[int], jobs: int) -> int:
    """Host threads compiling `jobs` programs: `threads`, by default half the cores (up to 8; XLA's own compile
    passes use threads too)."""
    return max(1, min(jobs, threads or min(8, (os.cpu_count() or 2) // 2)))


def _compile(lowered):
    return lowered.compile()


def compile_now(jobs: Sequence[Job], land: Callable, *, threads: Optional[int] = None,
                progress: bool = False, compile: Callable = _compile) -> tuple[float, float]:
    """Lower and compile `jobs`, handing each program to land(job, compiled) as it is done. With one compile
    thread (a small host) every program is lowered first: lowering while compiling would only contend.
    compile(lowered): how a program is compiled (ExecutableCache.compile for programs it stores).
    Returns (seconds lowering, seconds compiling after the last program was lowered)."""
    t0 = time.perf_counter()
    threads = compile_threads(threads, len(jobs))
    bar = None
    if progress and jobs:
        from tqdm import tqdm
        bar = tqdm(total=len(jobs), desc=f"warm-up (compiling step shapes and samplers, {threads} threads)",
                   unit="program")
    futures, deferred = {}, []
    with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="k3jax-compile") as pool:
        def submit(job, low):
            fut = pool.submit(compile, low)
            if bar is not None:
                fut.add_done_callback(lambda _: bar.update())
            futures[fut] = job
        for job in jobs:
            deferred.append((job, job.fn.lower(*job.args)))
            if threads > 1:
                submit(*deferred.pop())
        t1 = time.perf_counter()
        for job in deferred:
            submit(*job)
        for done in concurrent.futures.as_completed(futures):
            land(futures[done], done.result())
    if bar is not None:
        bar.close()
    return t1 - t0, time.perf_counter() - t1


class CompileQueue:
    def __init__(self, jobs: Sequence[tuple], land: Callable, *, threads: int = 1,
                 gate: Optional[threading.Event] = None, on_done: Optional[Callable[[float, list], None]] = None,
                 compile: Callable = _compile):
        """jobs: (key, lower) in the order to build them; lower() returns a jax Lowered (compile(lowered) runs on
        a worker). land(key, compiled): a program is ready. on_done(seconds, failed keys): every job ended."""
        self._jobs = list(jobs)
        self._land = land
        self._compile = compile
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
                self._land(key, self._compile(lowered))
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
