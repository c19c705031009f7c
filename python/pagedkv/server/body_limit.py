"""An ASGI middleware that reads each request's body with a size limit, an idle timeout and a
total deadline before the app sees it.

A body whose ``Content-Length`` is over the limit is answered 413 before a byte of it is read;
a chunked body is read piece by piece and answered 413 as soon as the limit is passed. Either
way it is never buffered whole nor parsed, and the connection is closed after the answer (the
rest of the body is not read). A body within the limit is handed to the app as one message,
after which the app's ``receive`` is the server's again (disconnects are still seen).
A body that stops arriving for ``idle_timeout`` seconds is answered 408 (a slow-body slowloris
holds no handler), and so is one still arriving ``total_timeout`` seconds after the app was
called (a body that drips a byte at a time, each within the idle timeout, would otherwise hold
its connection for as long as its sender likes). Either way the connection is closed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from pagedkv.server.errors import error_response

__all__ = ["BodySizeLimit"]

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[MutableMapping[str, Any], Receive, Send], Awaitable[None]]


class BodySizeLimit:
    """Wraps ``app``: HTTP request bodies over ``max_bytes`` get 413, bodies idle for
    ``idle_timeout`` seconds or not complete ``total_timeout`` seconds after their headers
    (``None``: no deadline) 408 (OpenAI's error body)."""

    def __init__(self, app: ASGIApp, max_bytes: int, idle_timeout: float, total_timeout: float | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.idle_timeout = idle_timeout
        self.total_timeout = total_timeout

    async def __call__(self, scope: MutableMapping[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if _declared_length(scope) > self.max_bytes:
            await self._refuse(
                scope, receive, send, 413, f"larger than {self.max_bytes} bytes (max_request_body_bytes)"
            )
            return
        chunks: list[bytes] = []
        size = 0
        loop = asyncio.get_running_loop()
        deadline = None if self.total_timeout is None else loop.time() + self.total_timeout
        while True:
            # Each wait ends at the idle timeout or at the deadline, whichever comes first.
            wait = self.idle_timeout if deadline is None else min(self.idle_timeout, deadline - loop.time())
            try:
                if wait <= 0:
                    raise asyncio.TimeoutError
                message = await asyncio.wait_for(receive(), wait)
            except asyncio.TimeoutError:
                if deadline is not None and loop.time() >= deadline:
                    why = f"not complete {self.total_timeout:g} s after its headers (body_timeout)"
                else:
                    why = f"idle for {self.idle_timeout:g} s (header_timeout)"
                await self._refuse(scope, receive, send, 408, why)
                return
            if message["type"] != "http.request":  # the client left: let the app see it
                await self.app(scope, _replay([message], receive), send)
                return
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                await self._refuse(
                    scope, receive, send, 413, f"larger than {self.max_bytes} bytes (max_request_body_bytes)"
                )
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
        whole = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, _replay([whole], receive), send)

    async def _refuse(
        self, scope: MutableMapping[str, Any], receive: Receive, send: Send, status: int, why: str
    ) -> None:
        response = error_response(status, f"the request body is {why}")
        response.headers["Connection"] = "close"  # the unread rest of the body is not waited for
        await response(scope, receive, send)


def _declared_length(scope: MutableMapping[str, Any]) -> int:
    """The body's ``Content-Length`` (0 when absent or unreadable: the server's parser refuses
    a malformed one, and the reading loop bounds a body of unknown length)."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return 0
    return 0


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """A ``receive`` that returns ``messages`` first, then the server's."""
    pending = list(messages)

    async def replayed() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replayed
