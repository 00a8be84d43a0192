"""Graceful shutdown for the HTTP server: on SIGTERM stop admitting work, let in-flight requests run
for the grace window, then end the rest through the engine, so every stream closes with an error
event and `[DONE]` (and a non-streaming request gets a 503) instead of a cut connection."""
from __future__ import annotations

import asyncio
import logging

import uvicorn

log = logging.getLogger(__name__)

# Seconds uvicorn waits beyond the grace window for the ended streams to flush before it cancels tasks.
_FLUSH_S = 10.0


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, engine, grace_s: float):
        config.timeout_graceful_shutdown = grace_s + _FLUSH_S
        super().__init__(config)
        self.engine, self.grace_s = engine, grace_s

    async def shutdown(self, sockets=None):
        log.info("shutting down: no new requests, finishing in-flight ones (up to %.0fs)", self.grace_s)
        self.engine.stop_accepting()
        timer = asyncio.get_running_loop().call_later(self.grace_s, self._end_in_flight)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()

    def _end_in_flight(self):
        n = self.engine.end_all("server is shutting down")
        if n:
            log.warning("shutdown: grace window of %.0fs over, ended %d in-flight request(s)", self.grace_s, n)
