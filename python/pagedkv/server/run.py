"""Run the server with uvicorn (what ``pagedkv serve`` does).

Shutdown: on SIGINT or SIGTERM uvicorn stops accepting connections and lets in-flight
requests finish for up to ``shutdown_timeout`` seconds (then cancels them: their engine
requests are aborted); the app's lifespan end then shuts the engine down (every remaining
request aborted, its blocks freed, the disk tier flushed) and closes the KV event publisher.
"""

from __future__ import annotations

import math

from pagedkv.engine.args import EngineArgs
from pagedkv.server.app import ServerArgs, create_app

__all__ = ["run_server"]


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
    import uvicorn

    app = create_app(engine_args, server_args)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        lifespan="on",
        timeout_graceful_shutdown=max(1, math.ceil(shutdown_timeout)),
    )
    try:
        uvicorn.Server(config).run()
    finally:
        app.state.pagedkv.close()  # a no-op after the lifespan's end did it
