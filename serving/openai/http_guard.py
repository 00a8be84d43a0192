"""Slow and surplus clients: request read deadlines and a connection cap for uvicorn's h11 protocol.

uvicorn (its h11 protocol) bounds neither how long a client may take to send a request nor how many
connections it holds: its keep-alive timer runs only between requests, so a connection that sends
its headers or body a byte at a time stays open for ever, and connections are accepted until the
process runs out of file descriptors (then nothing, /health included, can connect). uvicorn's own
`limit_concurrency` is checked only once a request's headers are complete, so it cannot see those
connections. `GuardedH11Protocol` adds, per connection:

- a header deadline: the whole header block must arrive within `header_timeout` of the connection
  opening (or, on a kept-alive connection, of the next request's first byte);
- a body deadline: the whole body within `body_timeout` of the headers.
  Both are deadlines, not idle timers, so trickling bytes does not extend them. Past one the client
  gets a 408 in the OpenAI error shape (when it has sent anything) and the connection is closed.
- a cap: past `max_connections` open connections, a request for anything but the open paths
  (/health, /metrics) gets a 503 and its connection is closed; `reserve` more connections are
  accepted for the open paths only, so a load balancer's probe still gets in when every slot is
  busy. Past max_connections + reserve, an idle kept-alive connection or else the one that has
  waited longest for its request headers is closed to make room (slow-header clients cannot hold
  the server), and only when there is neither is the new connection refused (a 503, then closed).

Every close is counted in `k3jax:http_connections_closed_total{reason=...}` and logged, at most one line
per `log_interval` seconds with the counts of that interval.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import resource
from collections import Counter
from typing import Callable, Optional

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)

# File descriptors the process keeps for itself (checkpoint and cache files, pipes, the compiler,
# image files, the prefill peer's sockets) when --max-connections is sized from the fd limit.
FD_HEADROOM = 512
# Connections past --max-connections accepted for the open paths (/health, /metrics) only.
HEALTH_RESERVE = 16


def default_max_connections() -> int:
    """The cap that fits the process's file-descriptor limit: its soft RLIMIT_NOFILE less FD_HEADROOM
    and HEALTH_RESERVE (at least 64)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    return max(64, soft - FD_HEADROOM - HEALTH_RESERVE)


@dataclasses.dataclass(frozen=True)
class GuardSettings:
    header_timeout: Optional[float] = 20.0      # None: no deadline
    body_timeout: Optional[float] = 60.0
    max_connections: Optional[int] = None       # None: no cap
    reserve: int = HEALTH_RESERVE
    open_paths: frozenset = frozenset({"/health", "/metrics"})
    log_interval: float = 10.0


def _raw_response(status: int, reason: str, message: str, code: str, type_: str) -> bytes:
    """A whole HTTP/1.1 response in the OpenAI error shape that closes the connection: written to the
    transport directly where no request was parsed yet (or the app is still reading its body)."""
    body = json.dumps({"error": {"message": message, "type": type_, "param": None, "code": code}}).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"connection: close\r\n\r\n").encode()
    return head + body


class Guard:
    """The shared side: settings, the metric and the rate-limited log. `protocol_class()` is the
    uvicorn `http=` protocol bound to it."""

    REASONS = {"header_timeout": "request headers not received within {header_timeout:g}s",
               "body_timeout": "request body not received within {body_timeout:g}s",
               "over_limit": "503: over --max-connections ({max_connections})",
               "evicted": "closed to make room past --max-connections + {reserve}",
               "refused": "refused past --max-connections + {reserve}"}

    def __init__(self, settings: GuardSettings, count: Optional[Callable[[str], None]] = None):
        self.settings = settings
        self.count = count or (lambda reason: None)      # the metric: count(reason)
        self._pending: Counter = Counter()
        self._flush_handle = None

    def protocol_class(self) -> type:
        return type("GuardedH11Protocol", (GuardedH11Protocol,), {"guard": self})

    def record(self, reason: str) -> None:
        """Count a close and log it: the first at once, then one line per log_interval with the counts."""
        self.count(reason)
        if self._flush_handle is None:
            log.warning("closed a connection: %s", self._describe(reason))
            self._flush_handle = asyncio.get_running_loop().call_later(self.settings.log_interval, self._flush)
        else:
            self._pending[reason] += 1

    def _describe(self, reason: str) -> str:
        return self.REASONS[reason].format(**dataclasses.asdict(self.settings))

    def _flush(self):
        if not self._pending:
            self._flush_handle = None
            return
        log.warning("closed %d connections in the last %gs: %s", sum(self._pending.values()),
                    self.settings.log_interval,
                    "; ".join(f"{n} x {self._describe(r)}" for r, n in self._pending.most_common()))
        self._pending.clear()
        self._flush_handle = asyncio.get_running_loop().call_later(self.settings.log_interval, self._flush)

    # -- the cap
    def over_cap(self, connections) -> bool:
        cap = self.settings.max_connections
        return cap is not None and len(connections) > cap

    def make_room(self, connections, keep) -> bool:
        """Close one idle kept-alive connection, or else the one waiting longest for its request headers
        (not `keep`); False when there is neither."""
        idle, slowest = None, None
        for c in connections:
            if c is keep or not isinstance(c, GuardedH11Protocol) or c.transport.is_closing():
                continue
            if c.phase is None and (c.cycle is None or c.cycle.response_complete):
                idle = c
                break
            if c.phase == "headers" and (slowest is None or c.phase_since < slowest.phase_since):
                slowest = c
        victim = idle or slowest
        if victim is None:
            return False
        victim.close_guarded("evicted")
        return True

    def gate(self, app, connections, protocol):
        """The ASGI app a connection's requests go to: over the cap, only the open paths are served."""
        settings = self.settings

        async def gated(scope, receive, send):
            if (scope["type"] == "http" and scope["path"] not in settings.open_paths and self.over_cap(connections)
                    and not self.make_room(connections, keep=protocol)):
                self.record("over_limit")
                body = json.dumps({"error": {
                    "message": f"the server is at its connection limit ({settings.max_connections}); retry later",
                    "type": "server_error", "param": None, "code": "too_many_connections"}}).encode()
                await send({"type": "http.response.start", "status": 503,
                            "headers": [(b"content-type", b"application/json"), (b"connection", b"close"),
                                        (b"retry-after", b"1"), (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
            await app(scope, receive, send)
        return gated


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a header deadline, a body deadline and the connection cap (see the
    module docstring). `phase` is what the connection waits for from its client: "headers", "body" or
    None (a request being answered, or an idle kept-alive connection: uvicorn's keep-alive timer)."""
    guard: Guard = None         # set by Guard.protocol_class()

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.phase: Optional[str] = None
        self.phase_since = 0.0
        self._got_bytes = False          # bytes of the request now being read
        self._deadline: Optional[asyncio.TimerHandle] = None
        if self.guard.settings.max_connections is not None:
            self.app = self.guard.gate(self.app, self.connections, self)

    # -- the phases
    def _enter(self, phase: Optional[str]) -> None:
        if phase == self.phase:
            return
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self.phase, self.phase_since = phase, self.loop.time()
        timeout = {"headers": self.guard.settings.header_timeout, "body": self.guard.settings.body_timeout}.get(phase)
        if timeout is not None:
            self._deadline = self.loop.call_later(timeout, self._expired)

    def _follow_h11(self) -> None:
        """Set the phase from h11's view of the client: SEND_BODY, IDLE while a header deadline runs (no
        complete request headers yet), else done with its request (or idle after one whose body came in
        after its answer)."""
        state = self.conn.their_state
        if state is h11.SEND_BODY:
            self._enter("body")
        elif not (state is h11.IDLE and self.phase == "headers"):
            if self.phase == "body" and state is h11.IDLE and self.timeout_keep_alive_task is None:
                # the rest of a body that came after its answer: uvicorn disarmed its keep-alive timer on
                # these bytes and re-arms it only after a response; idle from here, so arm it again
                self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                                    self.timeout_keep_alive_handler)
            self._enter(None)

    def close_guarded(self, reason: str) -> None:
        """Close the connection for `reason`, answering 408 where the client is still sending a request
        and no response has started."""
        phase = self.phase
        self._enter(None)
        if self.transport.is_closing():
            return
        cycle = self.cycle if phase == "body" else None
        if reason.endswith("_timeout") and (phase == "body" or self._got_bytes) and \
                (cycle is None or not cycle.response_started):
            what = "headers" if phase == "headers" else "body"
            timeout = self.guard.settings.header_timeout if phase == "headers" else self.guard.settings.body_timeout
            self.transport.write(_raw_response(408, "Request Timeout", f"the request {what} did not arrive within "
                                               f"{timeout:g}s", "request_timeout", "invalid_request_error"))
        if cycle is not None and not cycle.response_complete:
            cycle.response_started = True        # the app's own answer would follow ours: drop it
            cycle.disconnected = True            # its receive() returns http.disconnect
            cycle.message_event.set()
        self.transport.close()
        self.guard.record(reason)

    def _expired(self) -> None:
        self._deadline = None
        self.close_guarded("header_timeout" if self.phase == "headers" else "body_timeout")

    # -- uvicorn's protocol hooks
    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        guard = self.guard
        if guard.over_cap(self.connections) and len(self.connections) > guard.settings.max_connections + \
                guard.settings.reserve and not guard.make_room(self.connections, keep=self):
            transport.write(_raw_response(503, "Service Unavailable", "the server is at its connection limit; "
                                          "retry later", "too_many_connections", "server_error"))
            transport.close()
            guard.record("refused")
            return
        self._enter("headers")

    def data_received(self, data: bytes) -> None:
        if self.phase is None and self.conn.their_state is h11.IDLE:   # the next request on a kept-alive connection
            self._got_bytes = False
            self._enter("headers")
        self._got_bytes = True
        super().data_received(data)
        self._follow_h11()

    def on_response_complete(self) -> None:
        super().on_response_complete()      # may start the next cycle and parse a pipelined request
        if self.conn.their_state is h11.IDLE:
            self._got_bytes = False
            self._enter(None)               # (a pipelined partial request: its next bytes start the deadline)
        else:
            self._follow_h11()

    def connection_lost(self, exc) -> None:
        self._enter(None)
        super().connection_lost(exc)
