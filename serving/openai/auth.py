"""ASGI middleware: every path but the open ones needs the API key, as 'Authorization: Bearer KEY' or
as Anthropic clients send it, 'x-api-key: KEY'.

Plain ASGI, not @app.middleware("http"): Starlette's BaseHTTPMiddleware hands the app a receive that
never reports the client's disconnect to Request.is_disconnected, so a non-streamed request whose
client had left ran to max_tokens.
"""
from __future__ import annotations

import hmac


class APIKeyMiddleware:
    def __init__(self, app, api_key: str, open_paths, refuse):
        self.app, self.open_paths = app, frozenset(open_paths)
        self.bearer, self.key = f"Bearer {api_key}".encode(), api_key.encode()
        self.refuse = refuse              # refuse(scope, receive, send): answers the 401

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in self.open_paths:
            headers = {}
            for k, v in scope.get("headers") or ():
                headers.setdefault(k, v)
            # both compared, whichever is given: the time taken does not say which one matched
            bearer = hmac.compare_digest(headers.get(b"authorization", b""), self.bearer)
            key = hmac.compare_digest(headers.get(b"x-api-key", b""), self.key)
            if not (bearer or key):
                return await self.refuse(scope, receive, send)
        await self.app(scope, receive, send)
