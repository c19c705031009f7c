"""The router's metrics (``GET /metrics``), in one registry per router.

:class:`RouterMetrics` counts what the router decides and sees; the engines' live state (up,
event subscriptions) is read from them at each scrape. :class:`DisaggMetrics` adds the
disaggregated mode's prefills and fallbacks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pagedkv.router.replica import Replica
from pagedkv.router.subscriber import RESET_REASONS

__all__ = ["DisaggMetrics", "RouterMetrics"]

# Prefill durations: a few ms (short prompt, a GPU) to minutes (long prompt, a CPU).
_PREFILL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class RouterMetrics:
    """The router's metrics (one registry: the disaggregated mode adds its own to it)."""

    def __init__(self, engines: Callable[[], Sequence[Replica]]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("pagedkv_router:requests", "Requests forwarded.", ["replica"], registry=r)
        self.decisions = Counter(
            "pagedkv_router:routing_decisions",
            "Why the replica (or prefill engine) was chosen: prefix (it held the longest prefix), load "
            "(a tie broken by requests in flight), round_robin (the policy), unparsed (the prompt could "
            "not be tokenized), too_long (the body was above max_tokenize_bytes).",
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
        self.failovers = Counter(
            "pagedkv_router:failovers",
            "Requests sent to another engine because a connection to this one failed (nothing was sent).",
            ["replica"],
            registry=r,
        )
        self.stream_errors = Counter(
            "pagedkv_router:stream_errors",
            "Streams the router ended with an error event: replica (it failed mid-stream), shutdown.",
            ["reason"],
            registry=r,
        )
        r.register(_EngineStateCollector(engines))


class _EngineStateCollector(Collector):
    """Read at each scrape from the engines' state (the subscriber threads keep plain counts)."""

    def __init__(self, engines: Callable[[], Sequence[Replica]]) -> None:
        self.engines = engines

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily(
            "pagedkv_router:replica_up", "1 while the engine passes health checks.", labels=["replica"]
        )
        last_seq = GaugeMetricFamily(
            "pagedkv_router:kv_events_last_seq", "The last KV event batch applied, per replica.", labels=["replica"]
        )
        bad = CounterMetricFamily(
            "pagedkv_router:kv_events_bad_messages",
            "Malformed KV event messages skipped, per replica.",
            labels=["replica"],
        )
        resets = CounterMetricFamily(
            "pagedkv_router:kv_index_resets",
            "Times a replica's index restarted empty: gap (history lost), restart (the replica "
            "restarted), failure (the subscription failed and started over).",
            labels=["replica", "reason"],
        )
        for engine in self.engines():
            up.add_metric([engine.url], float(engine.up))
            sub = engine.subscriber
            if sub is None:
                continue
            last_seq.add_metric([engine.url], float(sub.last_seq))
            bad.add_metric([engine.url], float(sub.bad_messages))
            for reason in RESET_REASONS:
                resets.add_metric([engine.url, reason], float(sub.resets[reason]))
        yield from (up, last_seq, bad, resets)


class DisaggMetrics:
    """The disaggregated mode's metrics, in the router's registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.requests = Counter(
            "pagedkv_router:disagg_requests",
            "Requests sent to a prefill engine before their decode engine.",
            registry=r,
        )
        self.fallbacks = Counter(
            "pagedkv_router:disagg_fallbacks",
            "Prefilled requests decoded without the prefill's KV, by reason: unreachable, timeout, "
            "server_error, bad_answer (the prefill engine failed), no_kv (it answered but holds no KV).",
            ["reason"],
            registry=r,
        )
        self.direct = Counter(
            "pagedkv_router:disagg_direct_requests",
            "Requests sent straight to a decode engine, by reason: multi_prompt, has_kv_params.",
            ["reason"],
            registry=r,
        )
        self.prefill_seconds = Histogram(
            "pagedkv_router:prefill_seconds",
            "Seconds from sending a prefill to its engine's 200 answer.",
            buckets=_PREFILL_BUCKETS,
            registry=r,
        )
