"""ASGI middleware: refuse request bodies over a byte limit with 413 before they are read whole.

A declared Content-Length over the limit is refused at once; a chunked body is counted as it
arrives and refused as soon as it passes the limit, so an oversized body never sits in memory.
(Starlette's own RequestBodyLimitMiddleware always answers in plain text; ours goes through the
app's HTTPException handler, so the 413 has the OpenAI error shape.)
"""
from __future__ import annotations

from starlette.exceptions import HTTPException


class BodyTooLarge(HTTPException):
    def __init__(self, limit: int):
        super().__init__(413, f"request body is over the server's limit of {limit} bytes")


class BodyLimitMiddleware:
    def __init__(self, app, max_bytes: int, refuse):
        self.app, self.max_bytes, self.refuse = app, max_bytes, refuse   # refuse(scope, receive, send, exc)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or ()).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            return await self.refuse(scope, receive, send, BodyTooLarge(self.max_bytes))
        seen = 0

        async def counted_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)   # reaches the app's HTTPException handler
            return message

        await self.app(scope, counted_receive, send)
