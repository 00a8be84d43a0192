"""Anthropic's error body on the Messages API's routes: {"type": "error", "error": {"type", "message"}},
the type following the HTTP status."""
from __future__ import annotations

import json

PREFIX = "/v1/messages"
# HTTP status -> Anthropic's error type
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}


def error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(status, "api_error"), "message": message}}


class AnthropicErrorShape:
    """ASGI middleware: an error answered on the Messages API's routes, in whatever shape the server made it
    (OpenAI's), is sent in Anthropic's. Outermost, so the key check's 401 and the body limit's 413 pass
    through it too."""

    def __init__(self, app, prefix: str = PREFIX):
        self.app, self.prefix = app, prefix

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith(self.prefix):
            return await self.app(scope, receive, send)
        start, body = None, []

        async def reshape(message):
            nonlocal start
            if message["type"] == "http.response.start" and message["status"] >= 400:
                start = message                     # held until the body is complete
                return
            if message["type"] == "http.response.body" and start is not None:
                body.append(message.get("body", b""))
                if message.get("more_body"):
                    return
                new = _reshape(b"".join(body), start["status"])
                headers = [(k, v) for k, v in start.get("headers", ()) if k.lower() not in
                           (b"content-length", b"content-type")]
                headers += [(b"content-length", str(len(new)).encode()), (b"content-type", b"application/json")]
                await send({**start, "headers": headers})
                await send({"type": "http.response.body", "body": new})
                return
            await send(message)
        await self.app(scope, receive, reshape)


def _reshape(raw: bytes, status: int) -> bytes:
    try:
        err = json.loads(raw)
        message = err["error"]["message"] if isinstance(err.get("error"), dict) else str(err.get("detail"))
    except (ValueError, KeyError, TypeError, AttributeError):
        message = raw.decode("utf-8", "replace") or f"HTTP {status}"
    return json.dumps(error_body(status, message), ensure_ascii=False).encode()
