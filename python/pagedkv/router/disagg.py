"""Disaggregated prefill/decode: each request is prefilled by one engine and decoded by another.

For ``POST /v1/completions`` and ``/v1/chat/completions`` in disaggregated mode
(``RouterArgs(prefill=[...], decode=[...])``):

1. **Prefill.** A copy of the client's body rewritten by :func:`prefill_body` (one token, no
   stream, one choice, nothing that costs more than the prompt's KV, and
   ``kv_transfer_params: {"do_remote_decode": true}``) goes to a prefill engine chosen like a
   replica (cache-aware over the prefill engines). The engine computes the prompt's KV, holds
   its blocks under a lease, and answers with a top-level ``kv_transfer_params`` dict (opaque
   here: which engine, which blocks, where to ask) or null when it could not hold them.
2. **Decode.** The client's original body, with ``kv_transfer_params`` set to that dict
   verbatim, goes to the decode engine with the fewest requests in flight, which pulls the
   blocks and generates; its answer (a stream byte for byte) goes to the client as in replica
   mode (``pagedkv.router.forward.relay``), with ``x-pagedkv-prefill`` (the prefill engine)
   and ``x-pagedkv-replica`` (the decode engine).

Outcomes of the prefill:

* 200 with a dict: decode with it. 200 with null: decode without (the decode engine computes
  the prompt itself; counted as fallback ``no_kv``).
* 4xx: the request is bad (the prefill validates it as the decode would): that answer, status
  and body, is the client's.
* No answer (``unreachable``), ``timeout`` (``RouterArgs.prefill_timeout``), 5xx or another
  status (``server_error``), a body that is not JSON (``bad_answer``): the original request is
  decoded without KV (``x-pagedkv-disagg-fallback`` names the reason). A prefill engine that is
  down slows requests; it does not fail them. A prefill engine that refuses the connection is
  marked down (routed around until it passes a health check) and the next one is tried; a
  decode engine likewise (``pagedkv.router.forward.first_reachable``).

Straight to a decode engine, without a prefill: a completion with several prompts (one
``kv_transfer_params`` per request cannot carry several prompts' blocks), and a body that
already carries ``kv_transfer_params`` that are not null (someone else did the prefill) where
the operator allows clients to (``RouterArgs.allow_client_kv_transfer_params``); by default such
a body gets a 400 at the router (``pagedkv.router.app``): the params name the address a decode
engine connects to and the lease it claims, so only the router may produce them.

A client that disconnects during the prefill cancels it: the prefill engine's connection is
closed, which aborts the request there (its blocks are freed; no lease is left behind). During
the decode, as in replica mode. A prefill whose decode never comes (the client left between the
two) leaves its blocks leased until the lease expires on the prefill engine.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import Request
from starlette.responses import Response

from pagedkv.router.forward import CLIENT_GONE, EnginesUnreachable, first_reachable, relay, upstream_headers
from pagedkv.router.metrics import DisaggMetrics
from pagedkv.router.replica import Replica
from pagedkv.router.state import Prompt, Router
from pagedkv.server.serving import cancel_on_disconnect

__all__ = [
    "KV_TRANSFER_PARAMS",
    "DisaggMetrics",
    "direct_reason",
    "forward_disaggregated",
    "prefill_body",
]

logger = logging.getLogger(__name__)

KV_TRANSFER_PARAMS = "kv_transfer_params"
_CHAT_PATH = "/v1/chat/completions"

# Fields the prefill does without. Each either costs work beyond the prompt's KV (logprobs,
# echo, min_tokens that the one-token limit would contradict) or could make the prefill fail
# where the client's request is fine: best_of must equal n, which becomes 1; stop and
# stream_options only concern generated text and streams.
_PREFILL_DROPPED = ("stream_options", "min_tokens", "logprobs", "top_logprobs", "echo", "stop", "best_of")


def prefill_body(path: str, body: dict[str, Any]) -> dict[str, Any]:
    """The prefill engine's request for a client's ``body``: the same prompt and sampling
    (so the same validation and, with ``cache_salt``, the same block hashes), one token, no
    stream, one choice, and ``kv_transfer_params: {"do_remote_decode": true}``. ``body`` is
    not modified."""
    out = {k: v for k, v in body.items() if k not in _PREFILL_DROPPED}
    if path == _CHAT_PATH and "max_completion_tokens" in body:
        # The client's key, so it is the one the server reads; the other would only conflict.
        out["max_completion_tokens"] = 1
        out.pop("max_tokens", None)
    else:
        # Completions have no max_completion_tokens: a client's is left for the server to refuse.
        out["max_tokens"] = 1
    out["stream"] = False
    out["n"] = 1
    out[KV_TRANSFER_PARAMS] = {"do_remote_decode": True}
    return out


def direct_reason(path: str, body: dict[str, Any]) -> str | None:
    """Why ``body`` goes straight to a decode engine (``None``: it is prefilled first)."""
    # An explicit null asks for nothing: such a body is prefilled like any other.
    if body.get(KV_TRANSFER_PARAMS) is not None:
        return "has_kv_params"
    prompt = body.get("prompt") if path != _CHAT_PATH else None
    # A list of strings or of token-id lists is several prompts (a list of ints is one).
    if isinstance(prompt, list) and len(prompt) > 1 and not isinstance(prompt[0], int):
        return "multi_prompt"
    return None


@dataclass
class _Prefill:
    """What a prefill came to. Exactly one of: ``answer`` set (a client error, the client's
    answer), ``fallback`` set (decode without KV), or neither (decode with ``kv_params``)."""

    kv_params: dict[str, Any] | None = None
    answer: Response | None = None
    fallback: str | None = None
    engine: str | None = None  # the prefill engine's URL when it answered 200


async def _prefill(router: Router, metrics: DisaggMetrics, prompt: Prompt, path: str, body: dict[str, Any]) -> _Prefill:
    args = router.args
    timeout = args.prefill_timeout if args.prefill_timeout is not None else args.timeout
    content = json.dumps(prefill_body(path, body)).encode()
    start = time.perf_counter()

    async def post(engine: Replica) -> httpx.Response:
        router.metrics.requests.labels(engine.url).inc()
        engine.in_flight += 1
        try:
            # Not streamed: the answer is one small JSON object. Cancelling this (client gone)
            # closes the connection, which aborts the request on the engine.
            return await router.client.post(
                engine.url + path,
                content=content,
                headers=upstream_headers(args),
                timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)),
            )
        finally:
            engine.in_flight -= 1

    try:
        # A prefill engine that refuses connections is marked down and the next one tried.
        replica, answer = await first_reachable(router, lambda tried: router.choose_for(prompt, tried), post)
    except EnginesUnreachable as exc:
        logger.warning("%s: decoding without a prefill's KV", exc)
        return _Prefill(fallback="unreachable")
    except httpx.TimeoutException as exc:
        logger.warning("a prefill engine timed out (%s): decoding without its KV", exc)
        return _Prefill(fallback="timeout")
    except httpx.HTTPError as exc:
        logger.warning("a prefill engine failed (%s): decoding without its KV", exc)
        return _Prefill(fallback="unreachable")
    elapsed = time.perf_counter() - start
    if 400 <= answer.status_code < 500:
        media_type = answer.headers.get("content-type", "application/json")
        headers = {"x-pagedkv-prefill": replica.url}
        return _Prefill(answer=Response(answer.content, answer.status_code, media_type=media_type, headers=headers))
    if answer.status_code != 200:
        logger.warning(
            "prefill engine %s answered %d (%s): decoding without its KV",
            replica.url,
            answer.status_code,
            answer.text[:200],
        )
        return _Prefill(fallback="server_error")
    try:
        data = answer.json()
    except ValueError:
        logger.warning("prefill engine %s answered 200 with no JSON: decoding without its KV", replica.url)
        return _Prefill(fallback="bad_answer")
    metrics.prefill_seconds.observe(elapsed)
    params = data.get(KV_TRANSFER_PARAMS) if isinstance(data, dict) else None
    if not isinstance(params, dict):
        return _Prefill(fallback="no_kv", engine=replica.url)
    return _Prefill(kv_params=params, engine=replica.url)


async def forward_disaggregated(
    router: Router, request: Request, path: str, raw: bytes, body: dict[str, Any]
) -> Response:
    """Answer one completion or chat request: a prefill engine, then a decode engine (``raw``:
    the client's body as sent, ``body``: parsed)."""
    metrics = router.disagg_metrics
    assert metrics is not None, "a disaggregated router has its metrics"
    reason = direct_reason(path, body)
    if reason is not None:
        metrics.direct.labels(reason).inc()
        return await relay(router, request, router.least_loaded, path, raw)
    metrics.requests.inc()
    prompt = await router.prompt_of(path, body, len(raw))
    prefill = await cancel_on_disconnect(request, _prefill(router, metrics, prompt, path, body))
    if prefill is None:  # the client left; cancelling closed the prefill's connection
        return Response(status_code=CLIENT_GONE)
    if prefill.answer is not None:
        return prefill.answer
    headers = {}
    if prefill.engine is not None:
        headers["x-pagedkv-prefill"] = prefill.engine
    if prefill.fallback is not None:
        metrics.fallbacks.labels(prefill.fallback).inc()
        headers["x-pagedkv-disagg-fallback"] = prefill.fallback
    if prefill.kv_params is None:
        content = raw  # decode from scratch: the client's request as it came
    else:
        content = json.dumps({**body, KV_TRANSFER_PARAMS: prefill.kv_params}).encode()
    return await relay(router, request, router.least_loaded, path, content, headers)
