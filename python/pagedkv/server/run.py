"""Run the server with uvicorn (what ``pagedkv serve`` does).

Connections: uvicorn's HTTP/1.1 protocol with a header timeout, a cap on open connections and
a header size limit (pagedkv.server.connections, from ``ServerArgs.limits``).

Shutdown: on SIGINT or SIGTERM uvicorn stops accepting connections and lets in-flight
requests finish for up to ``shutdown_timeout`` seconds. Then every request still running is
failed with a 503 (:meth:`OpenAIServing.end_all`): a stream ends with an in-band
``data: {"error": ...}`` event and ``data: [DONE]``, not cut mid-body, and its engine requests
are aborted. uvicorn cancels what is left a little later (``_STREAM_END_GRACE``); the app's
lifespan end then shuts the engine down (every remaining request aborted, its blocks freed,
the disk tier flushed) and closes the KV event publisher.
"""

from __future__ import annotations

import asyncio
import logging
import math
import socket

import uvicorn

from pagedkv.engine.args import EngineArgs
from pagedkv.server.app import ServerArgs, create_app
from pagedkv.server.connections import guarded_protocol
from pagedkv.server.serving import OpenAIServing

__all__ = ["run_server"]

logger = logging.getLogger(__name__)

# Seconds between ending the running requests with an error and uvicorn cancelling what is
# left: time for the streams to write their last two events.
_STREAM_END_GRACE = 2.0


def run_server(
    engine_args: EngineArgs,
    server_args: ServerArgs,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "info",
    shutdown_timeout: float = 10.0,
) -> None:
    """Build the engine and serve until a signal; returns once everything is freed."""
    app = create_app(engine_args, server_args)
    limits = server_args.limits
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        lifespan="on",
        http=guarded_protocol(
            limits.header_timeout, limits.max_connections, app.state.pagedkv.metrics.connection_closed
        ),
        timeout_graceful_shutdown=max(1, math.ceil(shutdown_timeout + _STREAM_END_GRACE)),
    )
    try:
        _Server(config, app.state.pagedkv.serving, shutdown_timeout).run()
    finally:
        app.state.pagedkv.close()  # a no-op after the lifespan's end did it


class _Server(uvicorn.Server):
    """uvicorn's server, ending the requests still running ``shutdown_timeout`` seconds into a
    shutdown with an error (see the module docs)."""

    def __init__(self, config: uvicorn.Config, serving: OpenAIServing, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.serving = serving
        self.shutdown_timeout = shutdown_timeout

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        timer = asyncio.get_running_loop().call_later(self.shutdown_timeout, self._end_requests)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()

    def _end_requests(self) -> None:
        ended = self.serving.end_all(
            f"the server is shutting down: its shutdown timeout ({self.shutdown_timeout:g} s) has passed"
        )
        if ended:
            logger.warning("shutdown timeout passed: ended %d running requests with an error", ended)
