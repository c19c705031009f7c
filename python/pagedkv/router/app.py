"""The router's FastAPI app: OpenAI's endpoints in front of several ``pagedkv serve`` replicas.

    app = create_router_app(RouterArgs(replicas=["http://127.0.0.1:8001", "http://127.0.0.1:8002"]))

At start the app asks each replica for ``/kv_cache_info`` (its block size and KV event
endpoints) and subscribes to its events. For ``POST /v1/completions`` and
``/v1/chat/completions`` it tokenizes the prompt as the replicas do (the chat template for
chat), computes the prompt's block hashes under its ``cache_salt`` (``pagedkv._core.block_hashes``,
the core's own hashing), and picks a replica:

* ``cache_aware`` (default): the replica holding the longest run of the prompt's leading
  blocks; on a tie (no replica holds any, or several hold as many) the one with the fewest
  requests in flight from this router, then the next in turn;
* ``round_robin``: the next replica in turn, whatever it holds (the baseline).

The request body is forwarded unchanged (with the client's ``Authorization`` header); the
answer comes back unchanged (a stream byte for byte, as it arrives), with the replica in the
``x-pagedkv-replica`` header. A client that disconnects closes the upstream connection, so
the replica aborts the request. A body the router cannot tokenize is still forwarded (routed
by load alone): the replica gives the client its own error.

``GET /metrics``: requests and routing decisions per replica, the prompt tokens routed and
the tokens the chosen replica was predicted to hold (their ratio is the cache-aware hit ratio),
requests in flight and index sizes per replica. ``GET /health``: 200 when every replica is.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import httpx
from fastapi import FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest
from starlette.background import BackgroundTask
from starlette.responses import Response, StreamingResponse

from pagedkv._core import block_hashes
from pagedkv.engine.prompts import chat_prompt, tokenize
from pagedkv.errors import ConfigError, PagedKVError
from pagedkv.router.prefix_index import PrefixIndex
from pagedkv.router.subscriber import EventSubscriber
from pagedkv.server.errors import error_response
from pagedkv.server.serving import cancel_on_disconnect

__all__ = ["POLICIES", "Replica", "RouterArgs", "create_router_app"]

logger = logging.getLogger(__name__)

POLICIES = ("cache_aware", "round_robin")
_ROUTED_PATHS = ("/v1/completions", "/v1/chat/completions")


@dataclass
class RouterArgs:
    """- ``replicas``: base URLs of ``pagedkv serve`` replicas (``http://host:port``).
    - ``model``: the replicas' model, for its tokenizer (default: the embedded SmolLM2).
    - ``policy``: ``"cache_aware"`` or ``"round_robin"``.
    - ``api_key``: sent to the replicas when the client sends none.
    - ``timeout``: seconds for a replica to answer (a stream: between chunks)."""

    replicas: list[str]
    model: str | None = None
    policy: str = "cache_aware"
    api_key: str | None = None
    timeout: float = 600.0
    trust_remote_code: bool = False

    def __post_init__(self) -> None:
        if not self.replicas:
            raise ConfigError("the router needs at least one replica URL")
        for url in self.replicas:
            parsed = urlparse(url)
            if parsed.scheme not in ("http", "https") or not parsed.netloc:
                raise ConfigError(f"a replica is an http(s)://host:port URL, got {url!r}")
        if self.policy not in POLICIES:
            raise ConfigError(f"policy must be one of {POLICIES}, got {self.policy!r}")


@dataclass
class Replica:
    """One backend: its URL, what it caches (from its events), and this router's load on it."""

    url: str
    block_size: int
    index: PrefixIndex = field(default_factory=PrefixIndex)
    subscriber: EventSubscriber | None = None
    in_flight: int = 0


class _Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("pagedkv_router:requests", "Requests forwarded.", ["replica"], registry=r)
        self.decisions = Counter(
            "pagedkv_router:routing_decisions",
            "Why the replica was chosen: prefix (it held the longest prefix), load (a tie broken by "
            "requests in flight), round_robin (the policy), unparsed (the prompt could not be tokenized).",
            ["reason"],
            registry=r,
        )
        self.prompt_tokens = Counter("pagedkv_router:prompt_tokens", "Prompt tokens of routed requests.", registry=r)
        self.predicted_hits = Counter(
            "pagedkv_router:predicted_hit_tokens",
            "Prompt tokens in blocks the chosen replica held when the request was routed "
            "(/ prompt_tokens: the cache-aware hit ratio).",
            registry=r,
        )
        self.in_flight = Gauge("pagedkv_router:in_flight", "Requests in flight per replica.", ["replica"], registry=r)
        self.index_blocks = Gauge(
            "pagedkv_router:index_blocks", "Block hashes the router knows each replica holds.", ["replica"], registry=r
        )


class Router:
    """The routing state: replicas, their indexes and subscriptions, the tokenizer."""

    def __init__(self, args: RouterArgs, replicas: list[Replica], tokenizer: Any) -> None:
        self.args = args
        self.replicas = replicas
        self.tokenizer = tokenizer
        self.metrics = _Metrics()
        self._turn = itertools.count()
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(args.timeout, connect=10.0))

    def choose(self, token_ids: list[int] | None, cache_salt: str | None) -> tuple[Replica, int, str]:
        """``(replica, predicted cached tokens, reason)`` for a prompt (``None``: not parsed)."""
        turn = next(self._turn)
        n = len(self.replicas)
        if self.args.policy == "round_robin":
            replica = self.replicas[turn % n]
            return replica, self._held_tokens(replica, token_ids, cache_salt), "round_robin"
        held = [self._held_tokens(r, token_ids, cache_salt) for r in self.replicas]
        # Longest cached prefix; then least in flight; then the next in turn.
        order = sorted(range(n), key=lambda i: (-held[i], self.replicas[i].in_flight, (i - turn) % n))
        best = order[0]
        if token_ids is None:
            reason = "unparsed"
        elif held[best] > 0 and (n == 1 or held[order[1]] < held[best]):
            reason = "prefix"
        else:
            reason = "load"
        return self.replicas[best], held[best], reason

    def _held_tokens(self, replica: Replica, token_ids: list[int] | None, cache_salt: str | None) -> int:
        if token_ids is None:
            return 0
        hashes = block_hashes(token_ids, replica.block_size, cache_salt)
        return replica.index.match(hashes) * replica.block_size

    def prompt_token_ids(self, path: str, body: dict[str, Any]) -> list[int] | None:
        """The prompt's token ids as the replica will see them; None if it cannot tell."""
        try:
            if path == "/v1/chat/completions":
                rendered = chat_prompt(
                    self.tokenizer,
                    body["messages"],
                    chat_template=body.get("chat_template"),
                    add_generation_prompt=body.get("add_generation_prompt", True),
                )
                return list(rendered["prompt_token_ids"])
            prompt = body["prompt"]
            if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
                prompt = prompt[0]  # several prompts: route by the first
            if isinstance(prompt, str):
                return tokenize(self.tokenizer, prompt)
            if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                return list(prompt)
        except (KeyError, TypeError, ValueError, PagedKVError):
            pass
        return None

    def update_gauges(self) -> None:
        for r in self.replicas:
            self.metrics.in_flight.labels(r.url).set(r.in_flight)
            self.metrics.index_blocks.labels(r.url).set(len(r.index))

    async def close(self) -> None:
        await self.client.aclose()
        for r in self.replicas:
            if r.subscriber is not None:
                r.subscriber.close()


def _events_endpoint(endpoint: str | None, replica_url: str) -> str | None:
    """A replica's event endpoint as reachable from here (a wildcard host is the replica's)."""
    if endpoint is None:
        return None
    host = urlparse(replica_url).hostname or "127.0.0.1"
    for wildcard in ("*", "0.0.0.0"):
        endpoint = endpoint.replace(f"://{wildcard}:", f"://{host}:")
    return endpoint


def connect_replicas(args: RouterArgs) -> list[Replica]:
    """Ask each replica for its KV cache info and subscribe to its events (cache_aware)."""
    replicas = []
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    for url in args.replicas:
        url = url.rstrip("/")
        try:
            info = httpx.get(url + "/kv_cache_info", headers=headers, timeout=30).raise_for_status().json()
        except httpx.HTTPError as exc:
            raise ConfigError(f"replica {url} did not answer /kv_cache_info: {exc}") from exc
        replica = Replica(url=url, block_size=int(info["block_size"]))
        endpoint = _events_endpoint(info.get("kv_events_endpoint"), url)
        if args.policy == "cache_aware":
            if endpoint is None:
                logger.warning("replica %s publishes no KV events: cache-aware routing cannot see its cache", url)
            else:
                replica.subscriber = EventSubscriber(
                    replica.index,
                    endpoint,
                    _events_endpoint(info.get("kv_events_replay_endpoint"), url),
                    info.get("kv_events_topic") or "",
                )
        replicas.append(replica)
    return replicas


def _load_tokenizer(args: RouterArgs) -> Any:
    from transformers import AutoTokenizer

    from pagedkv.worker.model_files import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model(args.model), trust_remote_code=args.trust_remote_code)


def create_router_app(args: RouterArgs) -> FastAPI:
    """The router app; connects to the replicas now (they must be up)."""
    router = Router(args, connect_replicas(args), _load_tokenizer(args))

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        await router.close()

    app = FastAPI(title="pagedkv router", lifespan=lifespan)
    app.state.router = router

    @app.get("/health")
    async def health() -> Response:
        async def ok(r: Replica) -> bool:
            try:
                return (await router.client.get(r.url + "/health", timeout=5)).status_code == 200
            except httpx.HTTPError:
                return False

        states = await asyncio.gather(*(ok(r) for r in router.replicas))
        if all(states):
            return Response(status_code=200)
        down = [r.url for r, up in zip(router.replicas, states) if not up]
        return error_response(503, f"replicas down: {down}")

    @app.get("/metrics")
    async def metrics() -> Response:
        router.update_gauges()
        return Response(generate_latest(router.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        upstream = await router.client.get(router.replicas[0].url + "/v1/models", headers=_headers(request, args))
        return Response(upstream.content, upstream.status_code, media_type="application/json")

    for path in _ROUTED_PATHS:
        app.add_api_route(path, _make_forwarder(router, path), methods=["POST"])
    return app


def _headers(request: Request, args: RouterArgs) -> dict[str, str]:
    headers = {"Content-Type": "application/json"}
    auth = request.headers.get("authorization")
    if auth is not None:
        headers["Authorization"] = auth
    elif args.api_key:
        headers["Authorization"] = f"Bearer {args.api_key}"
    return headers


def _make_forwarder(router: Router, path: str) -> Any:
    async def forward(request: Request) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        if not isinstance(body, dict):
            return error_response(400, "the request body must be a JSON object")
        token_ids = router.prompt_token_ids(path, body)
        salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
        replica, held, reason = router.choose(token_ids, salt)
        m = router.metrics
        m.requests.labels(replica.url).inc()
        m.decisions.labels(reason).inc()
        if token_ids is not None:
            m.prompt_tokens.inc(len(token_ids))
            m.predicted_hits.inc(held)
        replica.in_flight += 1
        done = False

        def finish() -> None:
            nonlocal done
            if not done:
                done = True
                replica.in_flight -= 1

        try:
            upstream_request = router.client.build_request(
                "POST", replica.url + path, content=raw, headers=_headers(request, router.args)
            )
            upstream = await router.client.send(upstream_request, stream=True)
        except httpx.HTTPError as exc:
            finish()
            return error_response(503, f"replica {replica.url} is unreachable: {exc}")
        headers = {"x-pagedkv-replica": replica.url}
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
            content = await cancel_on_disconnect(request, upstream.aread())
        finally:
            await upstream.aclose()
            finish()
        if content is None:  # the client is gone; closing upstream aborted the request there
            return Response(status_code=499)
        return Response(content, upstream.status_code, media_type=media_type, headers=headers)

    return forward
