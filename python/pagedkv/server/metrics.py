"""Prometheus metrics of ``pagedkv serve``, under vLLM's names so that vLLM's Grafana dashboards work.

Two sources feed them:

* The engine's statistics (``LLMEngine.get_stats()`` / ``await AsyncLLM.get_stats()``): the server
  hands a snapshot to :meth:`ServerMetrics.update_engine_stats` right before it renders
  ``/metrics`` (and may do so after steps). Everything derived from the engine (queue lengths, KV
  usage, the prefix-cache and preemption counters, the tiers) is read from the latest snapshot
  by a custom collector at scrape time: the engine's counters are cumulative already, so they
  are exposed as they are instead of being turned into deltas and incremented.
* The streamed :class:`~pagedkv.engine.outputs.RequestOutput`\\ s each request handler receives:
  :meth:`ServerMetrics.start_request` gives the handler a :class:`RequestTracker`, which records
  time to first token, inter-token latencies and token counts as outputs arrive, and latency,
  queue time and the finish reason once at the end.

Every metric carries a ``model_name`` label (vLLM's also carry ``engine``; pagedkv has one
engine, so that label is left out). prometheus_client appends ``_total`` to counter names in the
exposition (``vllm:prompt_tokens_total``), exactly as vLLM's output shows them.

Each :class:`ServerMetrics` registers into its own :class:`~prometheus_client.CollectorRegistry`
unless one is given, so several servers (or tests) in one process never collide on names.

Times: a tracker's ``arrival_time`` and every ``now`` passed to it must come from one clock;
``time.time()`` (the default) is the clock of :class:`~pagedkv.engine.outputs.RequestMetrics`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from pagedkv.engine.outputs import RequestOutput

__all__ = [
    "CONNECTION_CLOSE_REASONS",
    "FINISH_REASONS",
    "RequestTracker",
    "ServerMetrics",
    "finish_reason_of",
    "parse_metrics",
]

# The values of the ``finished_reason`` label of ``vllm:request_success``: pagedkv's
# ``CompletionOutput.finish_reason`` values. vLLM's are the same strings ("stop", "length",
# "abort", "error"; recent versions add "repetition", which pagedkv never produces). As in vLLM,
# the counter counts every finished request, aborted and failed ones included, despite its name.
FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort", "error")

# Why the server closed a connection itself (pagedkv.server.connections): the ``reason`` label of
# ``pagedkv:http_connections_closed``.
CONNECTION_CLOSE_REASONS: tuple[str, ...] = ("max_connections", "header_timeout")

# Bucket upper bounds (seconds) as vLLM's, so that dashboards' quantiles read alike.
_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
)  # fmt: skip
_REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip

# Token-count histograms without a known max_model_len go up to this many tokens.
_DEFAULT_MAX_TOKENS_BUCKET = 1_000_000


def _buckets_1_2_5(max_value: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` inclusive (vLLM's token-count buckets)."""
    buckets: list[float] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * scale
            if value > max_value:
                return buckets
            buckets.append(float(value))
        scale *= 10


# ---------------------------------------------------------------- engine statistics

# (name, stats key, help) of the engine-derived metrics. A metric whose key is missing from the
# snapshot is left out of the scrape rather than failing it.
_Spec = tuple[str, str, str]

_GAUGES: tuple[_Spec, ...] = (
    (
        "vllm:num_requests_running",
        "num_running",
        "Number of sequences in model execution batches (a request with n samples counts n, as vLLM's "
        "child requests do).",
    ),
    (
        "vllm:num_requests_waiting",
        "num_waiting",
        "Number of sequences waiting to be scheduled (swapped-out ones included).",
    ),
    (
        "pagedkv:requests_waiting_for_grammar",
        "num_waiting_for_grammar",
        "Requests whose structured-output grammar is compiling (blocked in the scheduler, not yet scheduled).",
    ),
    (
        "vllm:kv_cache_usage_perc",
        "kv_usage",
        "KV-cache usage: blocks held by running sequences / blocks in the pool. 1 means 100 percent usage.",
    ),
    (
        "pagedkv:kv_utilization",
        "kv_utilization",
        "Filled token slots / token slots of the KV blocks in use (0..1; 0 when none are in use).",
    ),
    ("pagedkv:num_blocks", "num_blocks", "KV blocks in the device pool."),
    ("pagedkv:num_free_blocks", "num_free_blocks", "Free KV blocks in the device pool (cached or not)."),
    (
        "pagedkv:num_cached_blocks",
        "num_cached_blocks",
        "KV blocks registered in the prefix cache (in use or free).",
    ),
)
_COUNTERS: tuple[_Spec, ...] = (
    (
        "vllm:prefix_cache_queries",
        "prefix_cache_queries",
        "Prefix cache queries, in terms of number of queried tokens (prompt tokens looked up at first "
        "admission; re-admissions after preemption are not counted).",
    ),
    (
        "vllm:prefix_cache_hits",
        "prefix_cache_hits",
        "Prefix cache hits, in terms of number of cached tokens (of vllm:prefix_cache_queries, those "
        "served from the cache, on any tier).",
    ),
    (
        "vllm:num_preemptions",
        "num_preemptions",
        "Cumulative number of preemptions from the engine (recompute and swap).",
    ),
    ("pagedkv:num_evictions", "num_evictions", "Cached device KV blocks evicted by reuse."),
)

# The host tier exists when the snapshot's num_host_blocks > 0; these are emitted only then.
_HOST_GAUGES: tuple[_Spec, ...] = (
    ("pagedkv:host_num_blocks", "num_host_blocks", "KV blocks in the host-memory tier."),
    (
        "pagedkv:host_kv_usage_perc",
        "host_kv_usage",
        "Host-tier KV usage: host blocks held by swapped-out sequences / host blocks. 1 means 100 percent.",
    ),
    ("pagedkv:host_num_free_blocks", "num_host_free_blocks", "Free host-tier KV blocks (cached or not)."),
    (
        "pagedkv:host_num_cached_blocks",
        "num_host_cached_blocks",
        "Host-tier KV blocks registered in the prefix cache (in use or free).",
    ),
)
_HOST_COUNTERS: tuple[_Spec, ...] = (
    (
        "pagedkv:prefix_cache_host_hits",
        "prefix_cache_host_hits",
        "Of vllm:prefix_cache_hits, tokens found only on the host tier (loaded back), in tokens.",
    ),
    (
        "pagedkv:blocks_swapped_out",
        "blocks_swapped_out",
        "KV blocks copied device -> host (swap-outs and write-backs).",
    ),
    (
        "pagedkv:blocks_swapped_in",
        "blocks_swapped_in",
        "KV blocks copied host -> device (swap-ins and host prefix hits).",
    ),
    (
        "pagedkv:num_swap_preemptions",
        "num_swap_preemptions",
        "Of vllm:num_preemptions, those that swapped the sequence out to the host (the rest recomputed).",
    ),
)
# The disk tier exists when the snapshot's num_disk_blocks > 0; these are emitted only then.
_DISK_GAUGES: tuple[_Spec, ...] = (
    ("pagedkv:disk_num_blocks", "num_disk_blocks", "Block slots of the disk tier."),
    ("pagedkv:disk_num_cached_blocks", "num_disk_cached_blocks", "Disk-tier slots holding a cached KV block."),
)
_DISK_COUNTERS: tuple[_Spec, ...] = (
    (
        "pagedkv:prefix_cache_disk_hits",
        "prefix_cache_disk_hits",
        "Of vllm:prefix_cache_hits, tokens found only on the disk tier (read back), in tokens.",
    ),
    (
        "pagedkv:blocks_written_to_disk",
        "blocks_written_to_disk",
        "Cached host KV blocks written to the disk tier when the host pool reused them.",
    ),
    ("pagedkv:blocks_read_from_disk", "blocks_read_from_disk", "Disk-tier slots read back for prefix hits."),
)

# KV transfer (an engine with kv_transfer_config: its stats carry these keys); emitted only then.
_KV_TRANSFER_GAUGES: tuple[_Spec, ...] = (
    ("pagedkv:kv_leases", "num_kv_leases", "Finished requests whose KV blocks are held for a remote reader."),
    (
        "pagedkv:kv_requests_waiting_for_remote",
        "num_waiting_for_remote_kv",
        "Requests waiting for their prompt's KV from a prefill engine (blocked in the scheduler, not yet scheduled).",
    ),
)
_KV_TRANSFER_COUNTERS: tuple[_Spec, ...] = (
    ("pagedkv:kv_leases_granted", "kv_leases_granted", "KV leases taken for remote readers (producer)."),
    ("pagedkv:kv_leases_expired", "kv_leases_expired", "KV leases freed by expiry, not by their reader."),
    ("pagedkv:kv_loads_ok", "kv_loads_ok", "Prompt KV pulls from a prefill engine that completed (consumer)."),
    (
        "pagedkv:kv_loads_failed",
        "kv_loads_failed",
        "Prompt KV pulls that failed (dead peer, lease gone, transfer error); recomputed or failed by policy.",
    ),
    ("pagedkv:kv_blocks_pulled", "kv_blocks_pulled", "KV blocks received from prefill engines."),
    (
        "pagedkv:kv_transfer_seconds",
        "kv_transfer_seconds",
        "Seconds from queuing a pull to its data being in place (handshake included), summed.",
    ),
)

# Structured outputs: (name, stats key, help) of the engine's cumulative duration histograms
# (pagedkv.structured.stats.SecondsHistogram snapshots); counters of structured requests.
_HISTOGRAMS: tuple[_Spec, ...] = (
    (
        "pagedkv:structured_output_compile_seconds",
        "structured_compile_seconds",
        "Seconds to compile a structured-output constraint (JSON schema, regex, choice, grammar); cache "
        "misses only, off the engine thread.",
    ),
    (
        "pagedkv:structured_output_mask_seconds",
        "structured_mask_seconds",
        "Seconds to fill one step's grammar masks (all its structured rows), beside the forward.",
    ),
    (
        "pagedkv:structured_output_step_seconds",
        "structured_step_seconds",
        "Seconds of grammar work on a step's critical path: waiting for its masks after the forward, "
        "applying them, advancing the matchers.",
    ),
)
_STRUCTURED_COUNTERS: tuple[_Spec, ...] = (
    (
        "pagedkv:structured_output_grammar_cache_hits",
        "structured_grammar_cache_hits",
        "Structured-output constraints served from the compiled-grammar cache.",
    ),
    ("pagedkv:structured_output_masked_rows", "structured_masked_rows", "Logits rows masked by a grammar."),
    (
        "pagedkv:structured_output_compiles_cancelled",
        "structured_compiles_cancelled",
        "Grammar compiles dropped before they started: every request that wanted one went away.",
    ),
    (
        "pagedkv:structured_output_compiles_refused",
        "structured_compiles_refused",
        "Structured requests refused (503) because max_queued_compiles compiles were queued.",
    ),
)

# Speculative decoding (an engine with speculative_config: its stats carry spec_per_token_s);
# vLLM's names, emitted only then.
_SPEC_COUNTERS: tuple[_Spec, ...] = (
    ("vllm:spec_decode_num_drafts", "num_spec_drafts", "Number of spec decoding drafts (rows verified with drafts)."),
    ("vllm:spec_decode_num_draft_tokens", "num_spec_draft_tokens", "Number of draft tokens."),
    ("vllm:spec_decode_num_accepted_tokens", "num_spec_accepted_tokens", "Number of accepted tokens."),
    (
        "pagedkv:spec_decode_blocks_freed",
        "num_spec_blocks_freed",
        "KV blocks given back at once because rejected draft tokens alone occupied them.",
    ),
)
_SPEC_PER_POSITION = (
    "vllm:spec_decode_num_accepted_tokens_per_pos",
    "spec_accepted_per_position",
    "Accepted draft tokens by position within a row's drafts (0: the first draft).",
)

# Stats keys exposed as counters: kept monotonic across snapshots (see update_engine_stats).
_COUNTER_KEYS = frozenset(
    key
    for _, key, _ in _COUNTERS
    + _HOST_COUNTERS
    + _DISK_COUNTERS
    + _KV_TRANSFER_COUNTERS
    + _STRUCTURED_COUNTERS
    + _SPEC_COUNTERS
)


class _EngineStatsCollector(Collector):
    """Yields the engine-derived metrics from the latest snapshot, at scrape time.

    Invariant: all of one scrape's engine metrics come from one snapshot (the reference is
    swapped whole under the lock, never mutated), so e.g. num_free_blocks and num_blocks agree.
    Nothing is yielded before the first snapshot.
    """

    def __init__(self, model_name: str) -> None:
        self._model_name = model_name
        self._lock = threading.Lock()
        self._stats: Mapping[str, Any] | None = None

    def update(self, stats: Mapping[str, Any]) -> None:
        with self._lock:
            previous = self._stats
            snapshot = dict(stats)
            if previous is not None:
                # Counters never go down: a snapshot taken earlier but handed over later (two
                # coroutines racing on get_stats) must not make rate() see a counter reset. One
                # ServerMetrics serves one engine, whose counters only grow.
                for key in _COUNTER_KEYS:
                    old, new = previous.get(key), snapshot.get(key)
                    if old is not None and (new is None or new < old):
                        snapshot[key] = old
            self._stats = snapshot

    def snapshot(self) -> Mapping[str, Any] | None:
        with self._lock:
            return self._stats

    def describe(self) -> Iterable[Metric]:
        # Names are fixed and prefixed; no collision check against the registry is needed, and
        # describing by collecting would depend on whether a snapshot exists yet.
        return ()

    def collect(self) -> Iterator[Metric]:
        stats = self.snapshot()
        if stats is None:
            return
        yield from self._families(stats, _GAUGES, _COUNTERS)
        if _number(stats.get("num_host_blocks")) > 0:
            yield from self._families(stats, _HOST_GAUGES, _HOST_COUNTERS)
        if _number(stats.get("num_disk_blocks")) > 0:
            yield from self._families(stats, _DISK_GAUGES, _DISK_COUNTERS)
        if "kv_loads_ok" in stats:
            yield from self._families(stats, _KV_TRANSFER_GAUGES, _KV_TRANSFER_COUNTERS)
        yield from self._families(stats, (), _STRUCTURED_COUNTERS)
        if "spec_per_token_s" in stats:
            yield from self._families(stats, (), _SPEC_COUNTERS)
            name, key, doc = _SPEC_PER_POSITION
            per_position = CounterMetricFamily(name, doc, labels=["model_name", "position"])
            for position, count in enumerate(stats.get(key) or []):
                per_position.add_metric([self._model_name, str(position)], _number(count))
            yield per_position
        for name, key, doc in _HISTOGRAMS:
            snapshot = stats.get(key)
            if snapshot is not None:
                yield _histogram(name, doc, self._model_name, snapshot)
        background = stats.get("background_errors")
        if background:
            # Per thread (pagedkv.background): inputs it failed on and went on from. Only grows.
            family = CounterMetricFamily(
                "pagedkv:background_errors",
                "Errors a background thread survived (a malformed control message, a failed pull, a bad "
                "replay request, ...): counted, logged at a bounded rate, and the thread went on. By thread.",
                labels=["model_name", "thread"],
            )
            for thread, count in sorted(background.items()):
                family.add_metric([self._model_name, str(thread)], _number(count))
            yield family

    def _families(
        self, stats: Mapping[str, Any], gauges: Iterable[_Spec], counters: Iterable[_Spec]
    ) -> Iterator[Metric]:
        labels = [self._model_name]
        for name, key, doc in gauges:
            if stats.get(key) is not None:
                gauge = GaugeMetricFamily(name, doc, labels=["model_name"])
                gauge.add_metric(labels, _number(stats[key]))
                yield gauge
        for name, key, doc in counters:
            if stats.get(key) is not None:
                counter = CounterMetricFamily(name, doc, labels=["model_name"])
                counter.add_metric(labels, _number(stats[key]))
                yield counter


def _histogram(name: str, doc: str, model_name: str, snapshot: Mapping[str, Any]) -> Metric:
    """A histogram family from a SecondsHistogram snapshot (per-bucket counts, +Inf last)."""
    family = HistogramMetricFamily(name, doc, labels=["model_name"])
    running = 0
    buckets = []
    for bound, count in zip([*snapshot["buckets"], float("inf")], snapshot["counts"]):
        running += count
        buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), running))
    family.add_metric([model_name], buckets, sum_value=float(snapshot["sum"]))
    return family


def _number(value: Any) -> float:
    return 0.0 if value is None else float(value)


# ---------------------------------------------------------------- the metrics of one server


class ServerMetrics:
    """The Prometheus metrics of one ``pagedkv serve`` process (one model).

    ``registry``: where the metrics are registered; a fresh :class:`CollectorRegistry` by default
    (two instances never share state). ``max_model_len``: the top bucket of the per-request token
    histograms (vLLM sizes them the same way); a fixed 1e6 when not given.
    """

    def __init__(
        self,
        model_name: str,
        registry: CollectorRegistry | None = None,
        *,
        max_model_len: int | None = None,
    ) -> None:
        self.model_name = model_name
        self.registry = registry if registry is not None else CollectorRegistry()
        reg = self.registry
        labelnames = ["model_name"]

        self._engine = _EngineStatsCollector(model_name)
        reg.register(self._engine)

        # Counters of request-level events. Each metric is bound to this model's label set once,
        # so recording never looks labels up.
        self._prompt_tokens = Counter(
            "vllm:prompt_tokens",
            "Number of prefill tokens processed (each request's whole prompt, prefix-cache hits "
            "included, counted when its first token arrives).",
            labelnames,
            registry=reg,
        ).labels(model_name)
        self._generation_tokens = Counter(
            "vllm:generation_tokens",
            "Number of generation tokens processed (all samples of a request), counted as they stream.",
            labelnames,
            registry=reg,
        ).labels(model_name)
        success = Counter(
            "vllm:request_success",
            "Count of finished requests, by finish reason (aborted and failed ones included, as in vLLM).",
            [*labelnames, "finished_reason"],
            registry=reg,
        )
        # Every reason's series exists from the start (at 0), so rate() sees its first increment.
        self._request_success = {reason: success.labels(model_name, reason) for reason in FINISH_REASONS}

        # Histograms.
        self._ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds (request arrival at the server to the first "
            "output carrying a token).",
            labelnames,
            registry=reg,
            buckets=_TTFT_BUCKETS,
        ).labels(model_name)
        self._itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds, one observation per generated token after a "
            "sample's first (k tokens arriving together after dt: k observations of dt/k).",
            labelnames,
            registry=reg,
            buckets=_ITL_BUCKETS,
        ).labels(model_name)
        self._e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds (arrival at the server to the end of the request).",
            labelnames,
            registry=reg,
            buckets=_REQUEST_LATENCY_BUCKETS,
        ).labels(model_name)
        self._queue_time = Histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request (engine arrival to first scheduling).",
            labelnames,
            registry=reg,
            buckets=_REQUEST_LATENCY_BUCKETS,
        ).labels(model_name)
        closed = Counter(
            "pagedkv:http_connections_closed",
            "Connections the server closed on its own: reason=max_connections (one more than the cap "
            "opened), header_timeout (request headers not complete in time).",
            [*labelnames, "reason"],
            registry=reg,
        )
        self._connections_closed = {reason: closed.labels(model_name, reason) for reason in CONNECTION_CLOSE_REASONS}
        token_buckets = _buckets_1_2_5(max_model_len or _DEFAULT_MAX_TOKENS_BUCKET)
        self._request_prompt_tokens = Histogram(
            "vllm:request_prompt_tokens",
            "Number of prefill tokens processed, per finished request.",
            labelnames,
            registry=reg,
            buckets=token_buckets,
        ).labels(model_name)
        self._request_generation_tokens = Histogram(
            "vllm:request_generation_tokens",
            "Number of generation tokens processed, per finished request (all its samples).",
            labelnames,
            registry=reg,
            buckets=token_buckets,
        ).labels(model_name)

    def update_engine_stats(self, stats: Mapping[str, Any]) -> None:
        """Store the engine's statistics (a ``get_stats()`` dict) for the next scrapes.

        The dict is copied; counters in it (prefix cache, preemptions, evictions, tier traffic)
        never go down from one snapshot to the next, even if snapshots arrive out of order.
        """
        self._engine.update(stats)

    def connection_closed(self, reason: str) -> None:
        """Count a connection the server closed (``reason``: one of CONNECTION_CLOSE_REASONS)."""
        self._connections_closed[reason].inc()

    def start_request(self, request_id: str, arrival_time: float | None = None) -> RequestTracker:
        """A tracker for one request, owned by its handler. ``arrival_time``: when the server
        received the request (``time.time()`` when omitted); the tracker's later ``now`` values
        must come from the same clock."""
        return RequestTracker(self, request_id, time.time() if arrival_time is None else arrival_time)

    def render(self) -> tuple[bytes, str]:
        """The exposition of every metric, and its content type (for the /metrics response)."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class RequestTracker:
    """Records one request's metrics from the outputs its handler streams.

    ``on_output`` once per received output (cumulative, as ``AsyncLLM`` streams them), then
    ``finish`` once at the end. Not thread-safe: one handler (one coroutine) owns it.

    Invariants:
    * a sample that streams n tokens adds n - 1 inter-token-latency observations and n to
      ``vllm:generation_tokens``, however its tokens are grouped into outputs;
    * on_output is idempotent for an output already seen (it only counts tokens past the ones
      seen), so ``finish(out)`` may be given an output that was, or was not, passed to on_output;
    * the finish is recorded at most once (a second ``finish`` — e.g. a disconnect racing the
      last output — is ignored); outputs after the finish record nothing.
    """

    def __init__(self, metrics: ServerMetrics, request_id: str, arrival_time: float) -> None:
        self.request_id = request_id
        self.arrival_time = arrival_time
        self._metrics = metrics
        self._first_token_seen = False
        # Per sample (CompletionOutput.index): tokens seen so far and when the last of them came.
        self._num_tokens: dict[int, int] = {}
        self._last_token_time: dict[int, float] = {}
        self._last_output: RequestOutput | None = None
        self._finished = False

    @property
    def finished(self) -> bool:
        return self._finished

    @property
    def num_generation_tokens(self) -> int:
        """Tokens seen so far, over all samples."""
        return sum(self._num_tokens.values())

    def on_output(self, out: RequestOutput, now: float | None = None) -> None:
        """Record the tokens ``out`` carries beyond those already seen: time to first token at
        the first output with a token, and, per sample, ``k`` inter-token latencies of ``dt / k``
        for ``k`` new tokens arriving ``dt`` after that sample's previous ones. A sample's first
        tokens have no predecessor: if several arrive together, the ones after its first are
        observed with latency 0 (they reached the handler at the same instant)."""
        if self._finished:
            return
        now = time.time() if now is None else now
        m = self._metrics
        self._last_output = out
        new_total = 0
        for sample in out.outputs:
            seen = self._num_tokens.get(sample.index, 0)
            k = len(sample.token_ids) - seen
            if k <= 0:
                continue
            new_total += k
            if seen == 0:
                observations, latency = k - 1, 0.0
            else:
                observations, latency = k, max(now - self._last_token_time[sample.index], 0.0) / k
            for _ in range(observations):
                m._itl.observe(latency)
            self._num_tokens[sample.index] = seen + k
            self._last_token_time[sample.index] = now
        if new_total == 0:
            return
        if not self._first_token_seen:
            # The prefill is done: the prompt counts as processed now, as in vLLM.
            self._first_token_seen = True
            m._ttft.observe(max(now - self.arrival_time, 0.0))
            m._prompt_tokens.inc(len(out.prompt_token_ids))
        m._generation_tokens.inc(new_total)

    def finish(self, out: RequestOutput | None = None, now: float | None = None, reason: str | None = None) -> bool:
        """Record the end of the request, once: e2e latency, queue time (from
        ``out.metrics``), ``vllm:request_success{finished_reason=reason}``, and the per-request
        token histograms. ``out``: the last output (its tokens not seen yet are recorded as by
        :meth:`on_output`); ``None`` uses the last output seen (a client that went away).
        ``reason``: one of :data:`FINISH_REASONS`; ``None`` takes it from the output (see
        :func:`finish_reason_of`). Returns False when the finish was already recorded."""
        if self._finished:
            return False
        now = time.time() if now is None else now
        if out is not None:
            self.on_output(out, now)
        last = self._last_output
        if reason is None:
            reason = finish_reason_of(last)
        elif reason not in FINISH_REASONS:
            raise ValueError(f"finish reason must be one of {FINISH_REASONS}, got {reason!r}")
        self._finished = True
        m = self._metrics
        m._request_success[reason].inc()
        m._e2e.observe(max(now - self.arrival_time, 0.0))
        if last is not None:
            # Never scheduled (aborted while waiting): no queue time to observe, as in vLLM.
            queue_time = last.metrics.queue_time if last.metrics is not None else None
            if queue_time is not None:
                m._queue_time.observe(max(queue_time, 0.0))
            m._request_prompt_tokens.observe(len(last.prompt_token_ids))
            m._request_generation_tokens.observe(self.num_generation_tokens)
        return True


def finish_reason_of(out: RequestOutput | None) -> str:
    """The ``finished_reason`` label of a request from its last output: the most severe of its
    samples' reasons (error > abort > length > stop; "error" whenever ``out.error`` is set);
    "abort" when it has none (it ended
    before finishing: the client went away)."""
    if out is None:
        return "abort"
    if out.error is not None:
        return "error"
    reasons = {sample.finish_reason for sample in out.outputs}
    for reason in ("error", "abort", "length", "stop"):
        if reason in reasons:
            return reason
    return "abort"


def parse_metrics(text: str) -> dict[str, float]:
    """A ``/metrics`` exposition as ``{"name{label=value,...}": value}``: labels sorted,
    ``model_name`` left out (what the tests and the serving benchmark read)."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "model_name")
            out[f"{sample.name}{{{labels}}}"] = sample.value
    return out
