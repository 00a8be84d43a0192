"""OpenAI-style error bodies: {"error": {"message", "type", "param", "code"}}."""
from __future__ import annotations

import json
import logging
import uuid
from typing import Optional

from starlette.requests import ClientDisconnect

_log = logging.getLogger(__name__)


class APIError(Exception):
    def __init__(self, status: int, message: str, *, type_: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: Optional[str] = None, code: Optional[str] = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def from_value_error(e: ValueError, code: Optional[str] = None) -> APIError:
    """ValueErrors raised by validation start with the field name ("max_tokens: ..."): keep it as param."""
    msg = str(e)
    head = msg.split(":", 1)[0].split()[0] if msg else None
    param = head if head and head.replace("_", "").isalnum() and head.islower() else None
    return bad_request(msg, param=param, code=code)


class InternalErrorMiddleware:
    """ASGI: an exception escaping a handler becomes a JSON 500 in the OpenAI error shape naming a request
    id (the log line with its traceback carries the same id), and the connection stays usable. (Starlette's
    own ServerErrorMiddleware answers in plain text and re-raises, so uvicorn closes the connection.)
    A client that went away while its request was read (ClientDisconnect) gets nothing, and no log."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracked_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracked_send)
        except Exception as e:   # noqa: BLE001 - the point: no handler error may escape unanswered
            if isinstance(e, ClientDisconnect):
                return
            if started:          # the response is half sent: only closing the connection can tell the client
                raise
            rid = f"req-{uuid.uuid4().hex[:24]}"
            _log.error("request %s (%s %s) failed", rid, scope.get("method"), scope.get("path"), exc_info=e)
            body = json.dumps(APIError(500, f"internal server error (request id {rid})", type_="server_error",
                                       code="internal_error").body()).encode()
            await send({"type": "http.response.start", "status": 500,
                        "headers": [(b"content-type", b"application/json"), (b"x-request-id", rid.encode()),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
