"""uvicorn's HTTP/1.1 protocol with two guards against clients that hold connections open
(slowloris): a header timeout and a cap on open connections.

- Header timeout: a connection must send a request's complete headers within
  ``header_timeout`` seconds of opening, and again within that time of the end of each
  response; otherwise it is closed. (A request whose headers arrived is not timed: a long
  generation or stream is the normal case.)
- Connection cap: a connection that opens while ``max_connections`` are open is closed at once.
- Header size: a request line and headers over uvicorn's ``h11_max_incomplete_event_size``
  (16 KiB by default) get a 400 and the connection is closed; h11 enforces it itself, httptools' parser does not
  (it would buffer whatever arrives before the header timeout), so it is counted here.

uvicorn alone has neither: its keep-alive timer stops as soon as the first byte of a request
arrives, so a client that sends a header line now and then holds a socket forever.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

__all__ = ["guarded_protocol"]

logger = logging.getLogger(__name__)

# h11's default limit on a request's line and headers (uvicorn's when not configured).
_DEFAULT_MAX_HEADER_BYTES = 16 * 1024
# At most one warning per this many seconds about refused connections (a flood must not
# become a flood of log lines); the counts are in /metrics.
_WARNING_INTERVAL = 10.0


def _base_protocol() -> type[Any]:
    """httptools' protocol where it is installed (the faster parser), else h11's."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

        return HttpToolsProtocol
    except ImportError:  # httptools is optional
        from uvicorn.protocols.http.h11_impl import H11Protocol

        return H11Protocol


def guarded_protocol(
    header_timeout: float, max_connections: int, on_close: Callable[[str], None] | None = None
) -> type[asyncio.Protocol]:
    """A uvicorn HTTP protocol class (``uvicorn.Config(http=...)``) with both guards.
    ``on_close(reason)`` is told of every connection a guard closes (``"max_connections"``,
    ``"header_timeout"``: the server's metrics count them)."""
    base = _base_protocol()
    last_warning = [-_WARNING_INTERVAL]

    def closed(reason: str, open_connections: int) -> None:
        if on_close is not None:
            on_close(reason)
        now = time.monotonic()
        if reason == "max_connections" and now - last_warning[0] >= _WARNING_INTERVAL:
            last_warning[0] = now
            logger.warning(
                "%d connections are open (max_connections): closing new ones (counted in /metrics)",
                open_connections,
            )

    class GuardedHTTPProtocol(base):  # type: ignore[misc, valid-type]
        _header_timer: asyncio.TimerHandle | None = None
        _header_bytes = 0

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                transport.close()
                closed("max_connections", len(self.connections) - 1)
                return
            self._arm_header_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm_header_timer()  # the next request's headers are timed afresh

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_header_timer()
            super().connection_lost(exc)

        def _arm_header_timer(self) -> None:
            self._cancel_header_timer()
            # `cycle` is replaced when a request's headers are complete: if it is still this
            # one when the timer fires, no request started in time.
            self._header_timer = self.loop.call_later(header_timeout, self._header_timeout, self.cycle)

        def _cancel_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        # httptools' callbacks (h11 never calls them): count what the headers hold so far.
        def on_url(self, url: bytes) -> None:
            self._count_header_bytes(len(url))
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._count_header_bytes(len(name) + len(value))
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._header_bytes = 0
            super().on_headers_complete()

        def _count_header_bytes(self, n: int) -> None:
            self._header_bytes += n
            limit = self.config.h11_max_incomplete_event_size or _DEFAULT_MAX_HEADER_BYTES
            if self._header_bytes > limit:
                # httptools turns a callback's exception into a parser error: uvicorn answers 400
                # and closes the connection.
                raise ValueError("request headers too large")

        def _header_timeout(self, cycle_when_armed: object) -> None:
            self._header_timer = None
            if self.cycle is cycle_when_armed and not self.transport.is_closing():
                self.transport.close()
                closed("header_timeout", len(self.connections))

    return GuardedHTTPProtocol
