"""An engine's event stream relayed to the client so that it always ends well-formed.

The engine's bytes pass through as they arrive, cut only at event boundaries (``\\n\\n``): the
incomplete tail of an event is held until the rest of it arrives. When the stream cannot end
as the engine meant it (the engine dies or stops answering mid-stream, its stream ends without
``data: [DONE]``, or the router shuts down), the held tail is dropped and the client gets an
OpenAI error event then ``data: [DONE]``, so that a client reading events sees an error, not a
cut connection, and the server logs no traceback.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import httpx

from pagedkv.server.errors import error_body

__all__ = ["DONE", "error_event", "relay_events"]

DONE = b"data: [DONE]\n\n"
_EVENT_END = b"\n\n"


def error_event(status: int, message: str) -> bytes:
    """``data: {"error": {...}}`` (OpenAI's error body) as one event."""
    return b"data: " + error_body(status, message).model_dump_json().encode() + _EVENT_END


async def relay_events(
    upstream: httpx.Response, shutting_down: asyncio.Event, engine: str, on_error: Callable[[str], None]
) -> AsyncIterator[bytes]:
    """The events of ``upstream`` (an open streaming response), then an error event and
    ``[DONE]`` if it did not end with ``[DONE]``; ``on_error(reason)`` counts such an end
    (``replica`` or ``shutdown``). Closes ``upstream`` in every case."""
    chunks = upstream.aiter_raw()
    stop = asyncio.ensure_future(shutting_down.wait())
    held = b""  # the start of an event not complete yet
    done = False  # the last complete event was [DONE]
    failure: tuple[str, int, str] | None = None
    read: asyncio.Future[bytes] | None = None
    try:
        while True:
            read = asyncio.ensure_future(anext(chunks))
            await asyncio.wait({read, stop}, return_when=asyncio.FIRST_COMPLETED)
            if not read.done():
                read.cancel()
                failure = ("shutdown", 503, "the router is shutting down; the request was cut short")
                break
            try:
                chunk = read.result()
            except StopAsyncIteration:
                break
            except httpx.HTTPError as exc:
                failure = ("replica", 502, f"the engine {engine} failed mid-stream ({type(exc).__name__}: {exc})")
                break
            held += chunk
            cut = held.rfind(_EVENT_END) + len(_EVENT_END)
            if cut >= len(_EVENT_END):
                complete, held = held[:cut], held[cut:]
                done = complete.endswith(DONE)
                yield complete
    finally:  # also when the client left (the generator is closed or cancelled)
        stop.cancel()
        if read is not None:
            read.cancel()
        await upstream.aclose()
    if failure is None and held:
        yield held  # a last event without its blank line: passed on as the engine sent it
        done = done or held.strip() == DONE.strip()
    if not done:
        reason, status, message = failure or ("replica", 502, f"the engine {engine} ended the stream without [DONE]")
        on_error(reason)
        yield error_event(status, message) + DONE
