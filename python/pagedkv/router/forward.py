"""Forwarding one request body to one backend and relaying its answer, for both router modes.

:func:`relay` POSTs the body with the client's ``Authorization`` (or the router's key) and
gives back the backend's answer unchanged: a stream (``text/event-stream``) byte for byte as it
arrives, anything else once read, with the backend in ``x-pagedkv-replica``. The backend's
``in_flight`` count covers the whole exchange (until the stream's last byte or the client
leaves). A client that disconnects closes the upstream response, so the backend aborts the
request: Starlette cancels a streaming response whose client is gone, and a non-streaming
read runs under :func:`cancel_on_disconnect`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING

import httpx
from fastapi import Request
from starlette.background import BackgroundTask
from starlette.responses import Response, StreamingResponse

from pagedkv.server.errors import error_response
from pagedkv.server.serving import cancel_on_disconnect

if TYPE_CHECKING:
    from pagedkv.router.app import Replica, Router, RouterArgs

__all__ = ["CLIENT_GONE", "relay", "upstream_headers"]

# Status logged for a request whose client left before its answer (nginx's convention).
CLIENT_GONE = 499


def upstream_headers(request: Request, args: RouterArgs) -> dict[str, str]:
    """Headers for a backend: JSON, and the client's Authorization (else the router's key)."""
    headers = {"Content-Type": "application/json"}
    auth = request.headers.get("authorization")
    if auth is not None:
        headers["Authorization"] = auth
    elif args.api_key:
        headers["Authorization"] = f"Bearer {args.api_key}"
    return headers


async def relay(
    router: Router,
    request: Request,
    replica: Replica,
    path: str,
    content: bytes,
    extra_headers: Mapping[str, str] | None = None,
) -> Response:
    """POST ``content`` to ``replica.url + path`` and answer the client with what comes back
    (``extra_headers`` added to the answer's headers)."""
    router.metrics.requests.labels(replica.url).inc()
    replica.in_flight += 1
    done = False

    def finish() -> None:
        # Called from several exits (stream end, client gone, background task): count once.
        nonlocal done
        if not done:
            done = True
            replica.in_flight -= 1

    try:
        upstream_request = router.client.build_request(
            "POST", replica.url + path, content=content, headers=upstream_headers(request, router.args)
        )
        upstream = await router.client.send(upstream_request, stream=True)
    except httpx.HTTPError as exc:
        finish()
        return error_response(503, f"replica {replica.url} is unreachable: {exc}")
    headers = {**(extra_headers or {}), "x-pagedkv-replica": replica.url}
    media_type = upstream.headers.get("content-type", "application/json")
    if media_type.startswith("text/event-stream"):

        async def passthrough() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            finally:
                await upstream.aclose()  # the client left or the stream ended
                finish()

        async def cleanup() -> None:
            await upstream.aclose()
            finish()

        return StreamingResponse(
            passthrough(),
            status_code=upstream.status_code,
            media_type=media_type,
            headers=headers,
            background=BackgroundTask(cleanup),
        )
    try:
        body = await cancel_on_disconnect(request, upstream.aread())
    finally:
        await upstream.aclose()
        finish()
    if body is None:  # the client is gone; closing upstream aborted the request there
        return Response(status_code=CLIENT_GONE)
    return Response(body, upstream.status_code, media_type=media_type, headers=headers)
