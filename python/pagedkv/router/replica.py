"""One engine behind the router: its URL, whether it is up, what it caches, its load.

A replica is *connected* once its ``/kv_cache_info`` was read (its block size, its KV event
endpoints); only then can its cache be matched, and (``follow_events``) its events followed by
an :class:`EventSubscriber`. It is *up* while it passes health checks and accepts connections
(``pagedkv.router.health`` and the forwarding mark it); routing prefers engines that are up.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

from pagedkv.router.prefix_index import PrefixIndex
from pagedkv.router.subscriber import EventSubscriber

__all__ = ["Replica", "events_endpoint"]

logger = logging.getLogger(__name__)


@dataclass
class Replica:
    """One backend: its URL, what it caches (from its events), and this router's load on it.

    ``block_size`` is None until the engine's ``/kv_cache_info`` was read. ``follow_events``:
    the router routes to it by cache (a replica, a prefill engine under ``cache_aware``)."""

    url: str
    block_size: int | None = None
    index: PrefixIndex = field(default_factory=PrefixIndex)
    subscriber: EventSubscriber | None = None
    in_flight: int = 0
    up: bool = True
    follow_events: bool = False
    last_error: str | None = None

    @property
    def connected(self) -> bool:
        return self.block_size is not None

    def mark_down(self, why: str) -> None:
        """Routed around from now on, until it passes a health check again."""
        if self.up:
            logger.warning("engine %s is down: %s", self.url, why)
        self.up = False
        self.last_error = why

    def mark_up(self) -> None:
        if not self.up:
            logger.info("engine %s is up", self.url)
        self.up = True
        self.last_error = None

    def connect(self, info: dict[str, Any], *, warn_without_events: bool) -> None:
        """Take the engine's ``/kv_cache_info`` (at its first health check, and again each time
        it comes back): its block size, and a subscription to its events (a fresh history: a
        replica that comes back may have restarted, so its index restarts empty)."""
        self.block_size = int(info["block_size"])
        if not self.follow_events:
            return
        endpoint = events_endpoint(info.get("kv_events_endpoint"), self.url)
        replay = events_endpoint(info.get("kv_events_replay_endpoint"), self.url)
        old = self.subscriber
        if old is not None and (old.endpoint, old.replay_endpoint) == (endpoint, replay):
            old.resync()
            return
        if old is not None:
            old.close()
            self.subscriber = None
            self.index.reset()
        if endpoint is not None:
            self.subscriber = EventSubscriber(self.index, endpoint, replay, info.get("kv_events_topic") or "")
        elif warn_without_events:  # with one engine there is no choice to make
            logger.warning("engine %s publishes no KV events: cache-aware routing cannot see its cache", self.url)

    def close(self) -> None:
        if self.subscriber is not None:
            self.subscriber.close()

    def state(self) -> dict[str, Any]:
        """For ``/health``: up or down (and why), load, and the event subscription."""
        return {
            "url": self.url,
            "up": self.up,
            "error": self.last_error,
            "in_flight": self.in_flight,
            "index_blocks": len(self.index),
            "kv_events": None if self.subscriber is None else self.subscriber.state(),
        }


def events_endpoint(endpoint: str | None, replica_url: str) -> str | None:
    """A replica's event endpoint as reachable from here (a wildcard host is the replica's)."""
    if endpoint is None:
        return None
    host = urlparse(replica_url).hostname or "127.0.0.1"
    for wildcard in ("*", "0.0.0.0"):
        endpoint = endpoint.replace(f"://{wildcard}:", f"://{host}:")
    return endpoint
