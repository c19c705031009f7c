"""The router's own client authentication (``RouterArgs.api_key``).

With a key, every route but ``/health`` and ``/metrics`` (open, as on the engines) needs
``Authorization: Bearer <key>``; anything else is a 401 with OpenAI's error body, before the
body is read or an engine is asked. The client's credentials stop here: engines get the
router's own engine key (``RouterArgs.engine_api_key``, ``pagedkv.router.forward``).

A plain ASGI middleware (not Starlette's ``BaseHTTPMiddleware``), so streams and client
disconnects pass through it untouched.
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from pagedkv.server.errors import error_response

__all__ = ["OPEN_PATHS", "ClientAuth"]

OPEN_PATHS = frozenset({"/health", "/metrics"})


class ClientAuth:
    """Answers 401 to an HTTP request without ``Authorization: Bearer <api_key>``."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        given = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
        # Constant time: the comparison must not tell how much of a guess was right.
        if hmac.compare_digest(given, self._expected):
            await self.app(scope, receive, send)
            return
        denied = error_response(401, "missing or wrong API key (Authorization: Bearer <key>)", code="invalid_api_key")
        await denied(scope, receive, send)
