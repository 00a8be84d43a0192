"""ASGI middleware: every path but the open ones needs 'Authorization: Bearer KEY'.

Plain ASGI, not @app.middleware("http"): Starlette's BaseHTTPMiddleware hands the app a receive that
never reports the client's disconnect to Request.is_disconnected, so a non-streamed request whose
client had left ran to max_tokens.
"""
from __future__ import annotations

import hmac


class APIKeyMiddleware:
    def __init__(self, app, api_key: str, open_paths, refuse):
        self.app, self.expected, self.open_paths = app, f"Bearer {api_key}".encode(), frozenset(open_paths)
        self.refuse = refuse              # refuse(scope, receive, send): answers the 401

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in self.open_paths:
            got = next((v for k, v in scope.get("headers") or () if k == b"authorization"), b"")
            if not hmac.compare_digest(got, self.expected):
                return await self.refuse(scope, receive, send)
        await self.app(scope, receive, send)
