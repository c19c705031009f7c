"""Forwarding one request body to one engine and relaying its answer, for both router modes.

:func:`relay` POSTs the body with the router's engine key (never the client's
``Authorization``: clients and engines have separate keys) and gives back the engine's answer:
a stream (``text/event-stream``) event by event as it arrives (``pagedkv.router.stream``: it
always ends with ``data: [DONE]``, after an error event if the engine failed mid-stream or the
router shuts down), anything else once read, with the engine in ``x-pagedkv-replica``.

Failover (:func:`first_reachable`): an engine whose connection fails (nothing was sent) is
marked down and the request goes to the next choice; only when every engine was tried does
the client get a 503. A failure after the request was sent (the engine died while working on
it) is not retried: the client gets a 502 (an error event, mid-stream).

The engine's ``in_flight`` count covers the whole exchange (until the stream's last byte or
the client leaves). A client that disconnects closes the upstream response, so the engine
aborts the request: Starlette cancels a streaming response whose client is gone, and waiting
for a non-streaming answer runs under :func:`cancel_on_disconnect`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import TypeVar

import httpx
from fastapi import Request
from starlette.background import BackgroundTask
from starlette.responses import Response, StreamingResponse

from pagedkv.router.config import RouterArgs
from pagedkv.router.replica import Replica
from pagedkv.router.state import Router
from pagedkv.router.stream import relay_events
from pagedkv.server.errors import error_response
from pagedkv.server.serving import cancel_on_disconnect

__all__ = ["CLIENT_GONE", "EnginesUnreachable", "Pick", "first_reachable", "relay", "upstream_headers"]

T = TypeVar("T")
# Chooses an engine among those not tried yet (their URLs); None: none is left.
Pick = Callable[[set[str]], "Replica | None"]

# Status logged for a request whose client left before its answer (nginx's convention).
CLIENT_GONE = 499
# Errors that mean the request never reached the engine: safe to send elsewhere.
_NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout)


class EnginesUnreachable(Exception):
    """No engine accepted a connection (each one tried is marked down)."""


def upstream_headers(args: RouterArgs) -> dict[str, str]:
    """Headers for an engine: JSON, and the router's engine key (the client's is not passed on)."""
    return {"Content-Type": "application/json", **args.engine_headers()}


async def first_reachable(router: Router, pick: Pick, attempt: Callable[[Replica], Awaitable[T]]) -> tuple[Replica, T]:
    """``attempt`` on the engine ``pick`` gives, then on the next while connections fail;
    EnginesUnreachable when every engine was tried. Other errors propagate."""
    tried: set[str] = set()
    errors = []
    while (engine := pick(tried)) is not None:
        tried.add(engine.url)
        try:
            return engine, await attempt(engine)
        except _NOT_SENT as exc:
            engine.mark_down(f"connection failed ({type(exc).__name__}: {exc})")
            router.metrics.failovers.labels(engine.url).inc()
            errors.append(f"{engine.url}: {exc}")
    raise EnginesUnreachable(f"no engine is reachable ({'; '.join(errors) or 'none configured'})")


async def relay(
    router: Router,
    request: Request,
    pick: Pick,
    path: str,
    content: bytes,
    extra_headers: Mapping[str, str] | None = None,
) -> Response:
    """POST ``content`` to ``path`` on the engine ``pick`` chooses (another one if it cannot
    be reached) and answer the client with what comes back (``extra_headers`` added)."""

    async def send(engine: Replica) -> httpx.Response:
        router.metrics.requests.labels(engine.url).inc()
        upstream_request = router.client.build_request(
            "POST", engine.url + path, content=content, headers=upstream_headers(router.args)
        )
        engine.in_flight += 1
        try:
            return await router.client.send(upstream_request, stream=True)
        except BaseException:
            engine.in_flight -= 1
            raise

    try:
        sent = await cancel_on_disconnect(request, first_reachable(router, pick, send))
    except EnginesUnreachable as exc:
        return error_response(503, str(exc))
    except httpx.HTTPError as exc:
        return error_response(502, f"the engine failed before answering ({type(exc).__name__}: {exc})")
    if sent is None:  # the client left; closing the connection aborted the request there
        return Response(status_code=CLIENT_GONE)
    engine, upstream = sent
    finished = False

    def finish() -> None:
        # Called from several exits (stream end, client gone, background task): count once.
        nonlocal finished
        if not finished:
            finished = True
            engine.in_flight -= 1

    headers = {**(extra_headers or {}), "x-pagedkv-replica": engine.url}
    media_type = upstream.headers.get("content-type", "application/json")
    if media_type.startswith("text/event-stream"):
        on_error = router.metrics.stream_errors.labels

        async def events() -> AsyncIterator[bytes]:
            try:
                async for chunk in relay_events(
                    upstream, router.shutting_down, engine.url, lambda r: on_error(r).inc()
                ):
                    yield chunk
            finally:
                finish()

        async def cleanup() -> None:  # the stream never started (its client left first)
            await upstream.aclose()
            finish()

        return StreamingResponse(
            events(),
            status_code=upstream.status_code,
            media_type=media_type,
            headers=headers,
            background=BackgroundTask(cleanup),
        )
    try:
        body = await cancel_on_disconnect(request, upstream.aread())
    except httpx.HTTPError as exc:
        return error_response(502, f"the engine {engine.url} failed while answering ({type(exc).__name__}: {exc})")
    finally:
        await upstream.aclose()
        finish()
    if body is None:  # the client is gone; closing upstream aborted the request there
        return Response(status_code=CLIENT_GONE)
    return Response(body, upstream.status_code, media_type=media_type, headers=headers)
