"""The router's state: its engines, how one is chosen, the tokenizer, the metrics.

``Router.replicas`` are the engines chosen by :meth:`Router.choose` (the replicas, or in
disaggregated mode the prefill engines); ``Router.decoders`` the decode engines (empty in
replica mode), chosen by :meth:`Router.least_loaded`. Both choose among the engines that are up
(``Replica.up``) and not yet tried for this request; when none of those is up they try the
others anyway (a health state may be stale; a refused connection costs a millisecond).

Tokenizing a prompt (and rendering a chat template) runs in a worker thread
(:meth:`Router.prompt_of`), never on the event loop; a body above ``max_tokenize_bytes``, or
one that brings its own ``chat_template`` (the router runs no client's template), is routed by
load alone.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from collections.abc import Container, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from prometheus_client import generate_latest

from pagedkv._core import block_hashes
from pagedkv.engine.prompts import chat_prompt, tokenize
from pagedkv.errors import PagedKVError
from pagedkv.router.config import RouterArgs
from pagedkv.router.health import HealthMonitor
from pagedkv.router.metrics import DisaggMetrics, RouterMetrics
from pagedkv.router.replica import Replica

__all__ = ["Prompt", "Router", "parse_body"]

logger = logging.getLogger(__name__)

CHAT_PATH = "/v1/chat/completions"
# Bodies up to this size are parsed on the event loop (a few ms at most); larger ones in a thread.
_PARSE_INLINE_BYTES = 64 << 10


@dataclass(frozen=True, slots=True)
class Prompt:
    """A request's prompt as the router sees it: ``token_ids`` (None: not tokenized, for
    ``reason``: ``unparsed`` or ``too_long``) and its ``cache_salt``."""

    token_ids: list[int] | None
    cache_salt: str | None
    reason: str | None = None


class Router:
    """The routing state: the engines, their indexes and subscriptions, the tokenizer."""

    def __init__(
        self, args: RouterArgs, replicas: list[Replica], tokenizer: Any, decoders: list[Replica] | None = None
    ) -> None:
        self.args = args
        self.replicas = replicas
        self.decoders = decoders or []
        self.tokenizer = tokenizer
        self.metrics = RouterMetrics(lambda: self.backends)
        self.disagg_metrics = DisaggMetrics(self.metrics.registry) if self.decoders else None
        self._turn = itertools.count()
        # A counter of its own: sharing `_turn` with `choose` (one call per request each) would
        # hand every decode tie to the same engine when there are two.
        self._decode_turn = itertools.count()
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(args.timeout, connect=10.0))
        # Set when the router shuts down: streams still running end with an error event.
        self.shutting_down = asyncio.Event()
        self.health_monitor: HealthMonitor | None = None  # set by create_router_app

    @property
    def disaggregated(self) -> bool:
        return bool(self.decoders)

    @property
    def backends(self) -> list[Replica]:
        """Every engine this router talks to."""
        return [*self.replicas, *self.decoders]

    @property
    def answering(self) -> list[Replica]:
        """The engines that answer the routes the router does not split (``/v1/models``)."""
        return self.decoders or self.replicas

    @staticmethod
    def _candidates(engines: Sequence[Replica], tried: Container[str]) -> list[int]:
        """Indexes of the engines to choose among: untried ones that are up, else untried ones."""
        untried = [i for i, e in enumerate(engines) if e.url not in tried]
        return [i for i in untried if engines[i].up] or untried

    def choose(
        self, token_ids: list[int] | None, cache_salt: str | None, tried: Container[str] = ()
    ) -> tuple[Replica, int, str] | None:
        """``(replica, predicted cached tokens, reason)`` for a prompt (``None``: not parsed);
        None when every replica was tried."""
        turn = next(self._turn)
        n = len(self.replicas)
        candidates = self._candidates(self.replicas, tried)
        if not candidates:
            return None
        if self.args.policy == "round_robin":
            replica = self.replicas[min(candidates, key=lambda i: (i - turn) % n)]
            return replica, self._held_tokens(replica, token_ids, cache_salt), "round_robin"
        held = {i: self._held_tokens(self.replicas[i], token_ids, cache_salt) for i in candidates}
        # Longest cached prefix; then least in flight; then the next in turn.
        order = sorted(candidates, key=lambda i: (-held[i], self.replicas[i].in_flight, (i - turn) % n))
        best = order[0]
        if token_ids is None:
            reason = "unparsed"
        elif held[best] > 0 and (len(order) == 1 or held[order[1]] < held[best]):
            reason = "prefix"
        else:
            reason = "load"
        return self.replicas[best], held[best], reason

    def least_loaded(self, tried: Container[str] = ()) -> Replica | None:
        """The decode engine with the fewest requests in flight from here; then the next in
        turn (among those up and not tried); None when every one was tried."""
        turn = next(self._decode_turn)
        n = len(self.decoders)
        candidates = self._candidates(self.decoders, tried)
        if not candidates:
            return None
        return self.decoders[min(candidates, key=lambda i: (self.decoders[i].in_flight, (i - turn) % n))]

    def first_answering(self, tried: Container[str] = ()) -> Replica | None:
        """The first engine that answers the routes the router does not split (up, untried)."""
        candidates = self._candidates(self.answering, tried)
        return self.answering[candidates[0]] if candidates else None

    def _held_tokens(self, replica: Replica, token_ids: list[int] | None, cache_salt: str | None) -> int:
        if token_ids is None or replica.block_size is None:
            return 0
        hashes = block_hashes(token_ids, replica.block_size, cache_salt)
        return replica.index.match(hashes) * replica.block_size

    def prompt_token_ids(self, path: str, body: dict[str, Any]) -> list[int] | None:
        """The prompt's token ids as the engine will see them; None if it cannot tell. CPU
        work (tokenizing, the chat template): called in a worker thread by :meth:`prompt_of`."""
        try:
            if path == CHAT_PATH:
                if body.get("chat_template") is not None:
                    return None  # the router runs no client's template (the engine decides)
                rendered = chat_prompt(
                    self.tokenizer, body["messages"], add_generation_prompt=body.get("add_generation_prompt", True)
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

    async def prompt_of(self, path: str, body: dict[str, Any], body_size: int) -> Prompt:
        """The prompt of a request whose body was ``body_size`` bytes, tokenized off the loop."""
        salt = body.get("cache_salt") if isinstance(body.get("cache_salt"), str) else None
        if body_size > self.args.max_tokenize_bytes:
            return Prompt(None, salt, "too_long")
        token_ids = await asyncio.to_thread(self.prompt_token_ids, path, body)
        return Prompt(token_ids, salt, None if token_ids is not None else "unparsed")

    def choose_for(self, prompt: Prompt, tried: Container[str] = ()) -> Replica | None:
        """:meth:`choose` for a prompt, counted in the metrics (None: every replica was tried)."""
        chosen = self.choose(prompt.token_ids, prompt.cache_salt, tried)
        if chosen is None:
            return None
        replica, held, reason = chosen
        m = self.metrics
        m.decisions.labels(prompt.reason or reason).inc()
        if prompt.token_ids is not None:
            m.prompt_tokens.inc(len(prompt.token_ids))
            m.predicted_hits.inc(held)
        return replica

    def render_metrics(self) -> bytes:
        """This router's metrics in Prometheus' text format (``GET /metrics``)."""
        for r in self.backends:
            self.metrics.in_flight.labels(r.url).set(r.in_flight)
        for r in self.replicas:
            self.metrics.index_blocks.labels(r.url).set(len(r.index))
        return bytes(generate_latest(self.metrics.registry))

    def begin_shutdown(self, loop: asyncio.AbstractEventLoop) -> None:
        """Called on SIGTERM (from the signal handler): streams still running after
        ``shutdown_timeout`` end with an error event and ``data: [DONE]``."""

        def later() -> None:
            loop.call_later(self.args.shutdown_timeout, self.shutting_down.set)

        loop.call_soon_threadsafe(later)

    async def close(self) -> None:
        if self.health_monitor is not None:
            await asyncio.to_thread(self.health_monitor.close)
        await self.client.aclose()
        for r in self.backends:
            r.close()


async def parse_body(raw: bytes) -> dict[str, Any] | None:
    """The request body as a JSON object (None if it is not one); a large one parsed off the loop."""
    try:
        body = json.loads(raw) if len(raw) <= _PARSE_INLINE_BYTES else await asyncio.to_thread(json.loads, raw)
    except (ValueError, RecursionError):  # RecursionError: nested past the parser's depth
        return None
    return body if isinstance(body, dict) else None
