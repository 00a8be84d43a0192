"""AsyncEngine: runs LLMEngine steps on a background thread and streams outputs to asyncio callers.

Submissions and aborts cross into the engine thread through a lock-protected list; outputs come
back per request through an asyncio.Queue (bounded by the request's max_tokens). The engine is
only ever touched from its own thread, so it needs no locking itself.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import AsyncIterator, Callable, Optional

from serving.engine import LLMEngine
from serving.request import RequestOutput
from serving.sampling_params import SamplingParams
from serving.scheduler import QueueFullError

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    pass


class AsyncEngine:
    def __init__(self, engine: LLMEngine, on_error: Optional[Callable[[BaseException], None]] = None):
        """on_error(exc): runs on the engine thread when a step raises, before the waiting requests are
        failed (multi-host: find the lost process and end the run, so requests learn the real cause)."""
        self.engine = engine
        self.on_error = on_error
        self._lock = threading.Condition()
        self._submit: list = []                  # (rid, prompt_ids, params, extras, future, queue, loop)
        self._aborts: list = []
        self._calls: list = []                   # (fn, future, loop): fn(engine) run between steps
        self._streams: dict[str, tuple] = {}     # rid -> (queue, loop)
        self._stopping = False
        self._dead: Optional[BaseException] = None
        self._end_reason: Optional[str] = None      # set by end_all: the engine thread ends every stream
        self._cache_usage, self._cache_usage_t = {}, 0.0
        self._snapshot: dict = self._stats(engine)
        self._thread = threading.Thread(target=self._loop, name="k3jax-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ asyncio side
    def submit(self, prompt_ids, params: SamplingParams, request_id: str, **extras) -> "RequestStream":
        """Hand a request to the engine thread. `await stream.admitted()` raises the engine's
        ValueError / QueueFullError, so callers can answer 4xx before they start streaming."""
        if self._dead is not None:
            raise EngineDeadError(f"engine stopped: {self._dead}")
        loop = asyncio.get_running_loop()
        stream = RequestStream(self, request_id, loop.create_future())
        with self._lock:
            if self._stopping:
                raise EngineDeadError("server is shutting down")
            self._submit.append((request_id, prompt_ids, params, extras, stream.accepted, stream.queue, loop))
            self._lock.notify()
        return stream

    async def generate(self, prompt_ids, params: SamplingParams, request_id: str, **extras) -> AsyncIterator[RequestOutput]:
        """Yield a RequestOutput per new token until the request finishes. Cancelling the consumer
        (client disconnect) aborts the request and frees its cache."""
        stream = self.submit(prompt_ids, params, request_id, **extras)
        try:
            await stream.admitted()
        except BaseException:
            stream.close()
            raise
        async for out in stream:
            yield out

    def call(self, fn) -> asyncio.Future:
        """Run fn(engine) on the engine thread between two steps (the cache pools change every step, so
        reading or writing them from elsewhere races); await the returned future for its result."""
        if self._dead is not None:
            raise EngineDeadError(f"engine stopped: {self._dead}")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._lock:
            self._calls.append((fn, fut, loop))
            self._lock.notify()
        return fut

    def abort(self, request_id: str):
        with self._lock:
            self._aborts.append(request_id)
            self._lock.notify()

    def stop_accepting(self):
        """New submissions get EngineDeadError ("shutting down", a 503); running requests go on."""
        with self._lock:
            self._stopping = self._stopping or True
            self._lock.notify()

    def end_all(self, reason: str) -> int:
        """Abort every running request, each stream ending with EngineDeadError(reason). Returns how many."""
        with self._lock:
            n = len(self._streams)
            self._end_reason = reason
            self._lock.notify()
        return n

    def shutdown(self, timeout: float = 30.0):
        """Stop accepting work, let running requests finish (up to timeout), then abort the rest."""
        self.engine.stop_compiles()             # no new background compile competes with the last steps
        with self._lock:
            self._stopping = True
            self._lock.notify()
        self._thread.join(timeout)
        if self._thread.is_alive():
            with self._lock:
                self._aborts.extend(list(self._streams))
                self._stopping = "now"
                self._lock.notify()
            self._thread.join(5.0)

    def fail(self, reason: str) -> int:
        """From any thread, when the engine thread may be stuck for good (a multi-host process was
        lost in the middle of a step): refuse new work, and end every admitted or waiting request
        now with EngineDeadError(reason) (a 503). Returns how many requests were ended."""
        err = EngineDeadError(reason)
        with self._lock:
            self._dead, self._stopping = err, "now"
            subs, self._submit = self._submit, []
            streams, self._streams = self._streams, {}
            self._lock.notify()
        for *_, fut, _queue, loop in subs:
            loop.call_soon_threadsafe(_resolve, fut, err)
        for queue, loop in streams.values():
            try:
                loop.call_soon_threadsafe(queue.put_nowait, err)
            except RuntimeError:                  # the caller's loop is gone
                pass
        return len(subs) + len(streams)

    @property
    def stats_snapshot(self) -> dict:
        """The engine's stats as of its last step; the background compile's progress as of now (programs also
        land while the engine idles)."""
        snap, pending = self._snapshot, self.engine.compiles_pending()
        return snap if snap.get("compiles_pending") == pending else {**snap, "compiles_pending": pending}

    @property
    def alive(self) -> bool:
        return self._dead is None and self._thread.is_alive()

    @property
    def dead_reason(self) -> Optional[str]:
        return None if self._dead is None else str(self._dead)

    # ------------------------------------------------------------------ engine thread
    def _stats(self, eng) -> dict:
        # The cache breakdown walks the cache index: at most twice a second, and whenever the engine goes idle.
        now = time.monotonic()
        if now - self._cache_usage_t >= 0.5 or not eng.has_unfinished():
            self._cache_usage, self._cache_usage_t = eng.cache_usage(), now
        return {**eng.stats(), **self._cache_usage}

    def _deliver(self, rid: str, item):
        entry = self._streams.get(rid)
        if entry is None:
            return
        queue, loop = entry
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:                      # the caller's loop is gone
            pass
        if isinstance(item, BaseException) or getattr(item, "finished", False):
            self._streams.pop(rid, None)

    def _take_work(self):
        with self._lock:
            while not (self._submit or self._aborts or self._calls or self._stopping or self.engine.has_unfinished()):
                self._lock.wait()
            subs, self._submit = self._submit, []
            aborts, self._aborts = self._aborts, []
            calls, self._calls = self._calls, []
            end, self._end_reason = self._end_reason, None
            return subs, aborts, calls, end

    def _loop(self):
        eng = self.engine
        try:
            while True:
                subs, aborts, calls, end = self._take_work()
                if end is not None:
                    for rid in list(self._streams):
                        eng.abort(rid)
                        self._deliver(rid, EngineDeadError(end))
                for rid, ids, params, extras, fut, queue, loop in subs:
                    try:
                        eng.add_request(ids, params, request_id=rid, **extras)
                        self._streams[rid] = (queue, loop)
                        loop.call_soon_threadsafe(_resolve, fut, None)
                    except (ValueError, QueueFullError) as e:
                        loop.call_soon_threadsafe(_resolve, fut, e)
                for fn, fut, loop in calls:
                    try:
                        result, exc = fn(eng), None
                    except Exception as e:  # noqa: BLE001 - the caller gets it
                        result, exc = None, e
                    loop.call_soon_threadsafe(_settle, fut, result, exc)
                for rid in aborts:
                    if eng.abort(rid):
                        log.info("aborted %s", rid)
                    self._streams.pop(rid, None)
                if self._stopping == "now" or (self._stopping and not eng.has_unfinished()):
                    return
                if eng.has_unfinished():
                    for out in eng.step():
                        self._deliver(out.request_id, out)
                self._snapshot = self._stats(eng)
        except BaseException as e:  # noqa: BLE001 - fail every waiting request loudly, never hang them
            log.exception("engine loop died")
            self._dead = self._dead or e      # refuse new work now; fail() may name the cause later
            if self.on_error is not None:
                self.on_error(e)
            for rid in list(self._streams):
                self._deliver(rid, EngineDeadError(f"engine failed: {e!r}"))


class RequestStream:
    """One submitted request: `await admitted()`, then iterate its RequestOutputs. Leaving early
    (or close() before iterating) aborts the request and frees its cache."""

    def __init__(self, engine: AsyncEngine, request_id: str, accepted):
        self.engine, self.request_id, self.accepted = engine, request_id, accepted
        self.queue: asyncio.Queue = asyncio.Queue()
        self.finished = False

    async def admitted(self):
        await self.accepted

    def close(self):
        if not self.finished:
            self.finished = True
            self.engine.abort(self.request_id)

    async def __aiter__(self):
        try:
            await self.accepted
            while True:
                item = await self.queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    self.finished = True
                yield item
                if item.finished:
                    return
        finally:
            self.close()


def _settle(fut, result, exc):
    if fut.done():
        return
    if exc is None:
        fut.set_result(result)
    else:
        fut.set_exception(exc)


def _resolve(fut, exc):
    _settle(fut, None, exc)
