"""Server-sent events for OpenAI streams: the framing, and the response that carries one request's events."""
from __future__ import annotations

import asyncio
import json
import logging
from typing import AsyncIterator, Iterable, Optional

from starlette.responses import StreamingResponse

log = logging.getLogger(__name__)


def event(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


DONE = "data: [DONE]\n\n"


def error_event(err) -> str:
    return event(err.body())


class SendStalled(Exception):
    pass


class EventStreamResponse(StreamingResponse):
    """The text/event-stream of one request. However it ends, its engine requests (`streams`, closed
    here) end with it: its events are all sent, the client disconnects, the client left before the
    first byte (the events were never pulled, so their own cleanup never ran), or one send waits
    longer than `send_timeout` seconds (a client that keeps the connection open and stops reading:
    its events would otherwise pile up until max_tokens, holding a batch slot). The timeout is
    between two writes that the connection accepted, like nginx's send_timeout."""

    def __init__(self, events: AsyncIterator[str], streams: Iterable, send_timeout: Optional[float] = None):
        super().__init__(events, media_type="text/event-stream")
        self.streams, self.send_timeout = list(streams), send_timeout

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, self._within_timeout(send) if self.send_timeout else send)
        except SendStalled as e:
            # returning leaves the response incomplete: the server closes the connection
            log.warning("%s: ended the stream and its request", e)
        finally:
            await self.body_iterator.aclose()
            for s in self.streams:
                s.close()

    def _within_timeout(self, send):
        async def send_within(message):
            try:
                async with asyncio.timeout(self.send_timeout):
                    await send(message)
            except TimeoutError:
                raise SendStalled(f"client read nothing for {self.send_timeout:g} s") from None
        return send_within
