"""``pagedkv.server.metrics``: the Prometheus metrics of ``pagedkv serve``, without a server.

Stats dicts and real ``RequestOutput``s are fed to a ``ServerMetrics``; its exposition is parsed
back with prometheus_client's parser. Last, a real engine's stats and outputs go through it.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

pytest.importorskip("prometheus_client")

from prometheus_client import CollectorRegistry  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from pagedkv.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput  # noqa: E402
from pagedkv.server.metrics import FINISH_REASONS, ServerMetrics, finish_reason_of  # noqa: E402

MODEL = "smol"

# A device-only snapshot shaped like LLMEngine.get_stats() (the keys the metrics read, and a
# few they ignore).
BASE_STATS: dict[str, Any] = {
    "num_blocks": 64,
    "num_free_blocks": 48,
    "num_used_blocks": 16,
    "num_cached_blocks": 20,
    "kv_usage": 0.25,
    "kv_utilization": 0.75,
    "tokens_held": 192,
    "slots_allocated": 256,
    "num_running": 3,
    "num_waiting": 2,
    "num_preemptions": 4,
    "prefix_cache_queries": 1000,
    "prefix_cache_hits": 320,
    "num_evictions": 7,
    "num_host_blocks": 0,
    "num_host_free_blocks": 0,
    "num_host_used_blocks": 0,
    "num_host_cached_blocks": 0,
    "host_kv_usage": 0.0,
    "num_swap_preemptions": 0,
    "prefix_cache_host_hits": 0,
    "blocks_swapped_out": 0,
    "blocks_swapped_in": 0,
    "num_disk_blocks": 0,
    "num_disk_cached_blocks": 0,
    "prefix_cache_disk_hits": 0,
    "blocks_written_to_disk": 0,
    "blocks_read_from_disk": 0,
    "steps": 100,
    "kv_cache_dtype": "float32",
}

HOST_STATS = {
    "num_host_blocks": 32,
    "num_host_free_blocks": 24,
    "num_host_cached_blocks": 10,
    "host_kv_usage": 0.25,
    "num_swap_preemptions": 3,
    "prefix_cache_host_hits": 48,
    "blocks_swapped_out": 11,
    "blocks_swapped_in": 9,
}

DISK_STATS = {
    "num_disk_blocks": 128,
    "num_disk_cached_blocks": 40,
    "prefix_cache_disk_hits": 64,
    "blocks_written_to_disk": 41,
    "blocks_read_from_disk": 4,
}

HOST_NAMES = {
    "pagedkv:host_num_blocks",
    "pagedkv:host_kv_usage_perc",
    "pagedkv:host_num_free_blocks",
    "pagedkv:host_num_cached_blocks",
    "pagedkv:prefix_cache_host_hits_total",
    "pagedkv:blocks_swapped_out_total",
    "pagedkv:blocks_swapped_in_total",
    "pagedkv:num_swap_preemptions_total",
}
DISK_NAMES = {
    "pagedkv:disk_num_blocks",
    "pagedkv:disk_num_cached_blocks",
    "pagedkv:prefix_cache_disk_hits_total",
    "pagedkv:blocks_written_to_disk_total",
    "pagedkv:blocks_read_from_disk_total",
}


def samples(metrics: ServerMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The rendered exposition, parsed: (sample name, sorted labels) -> value."""
    body, content_type = metrics.render()
    assert content_type.startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(metrics: ServerMetrics, name: str, **labels: str) -> float:
    return samples(metrics)[(name, tuple(sorted({"model_name": MODEL, **labels}.items())))]


def names(metrics: ServerMetrics) -> set[str]:
    return {name for name, _ in samples(metrics)}


def hist_count(metrics: ServerMetrics, name: str) -> float:
    return value(metrics, f"{name}_count")


def hist_sum(metrics: ServerMetrics, name: str) -> float:
    return value(metrics, f"{name}_sum")


def output(
    token_ids: list[int] | list[list[int]],
    *,
    prompt_len: int = 5,
    finish_reason: str | None = None,
    arrival: float = 100.0,
    scheduled: float | None = 100.5,
    error: str | None = None,
) -> RequestOutput:
    """A cumulative RequestOutput: one sample (a list of ids) or several (a list of lists)."""
    per_sample = token_ids if token_ids and isinstance(token_ids[0], list) else [token_ids]
    completions = [
        CompletionOutput(index=i, text="", token_ids=list(ids), finish_reason=finish_reason)  # type: ignore[arg-type]
        for i, ids in enumerate(per_sample)
    ]
    return RequestOutput(
        request_id="r",
        prompt=None,
        prompt_token_ids=list(range(prompt_len)),
        outputs=completions,
        finished=finish_reason is not None,
        metrics=RequestMetrics(arrival_time=arrival, first_scheduled_time=scheduled),
        error=error,
    )


# ---------------------------------------------------------------- engine statistics


def test_nothing_engine_derived_before_the_first_snapshot() -> None:
    m = ServerMetrics(MODEL)
    # (pagedkv:http_* count the server's own connection guards, not the engine.)
    assert not any(n.startswith("pagedkv:") and not n.startswith("pagedkv:http_") for n in names(m))
    assert "vllm:kv_cache_usage_perc" not in names(m)
    # The request-level counters exist at 0 from the start, every finish reason included.
    for reason in FINISH_REASONS:
        assert value(m, "vllm:request_success_total", finished_reason=reason) == 0
    assert value(m, "vllm:prompt_tokens_total") == 0


def test_engine_stats_values_and_labels() -> None:
    m = ServerMetrics(MODEL)
    m.update_engine_stats(BASE_STATS)
    assert value(m, "vllm:num_requests_running") == 3
    assert value(m, "vllm:num_requests_waiting") == 2
    assert value(m, "vllm:kv_cache_usage_perc") == 0.25  # a fraction, as in vLLM
    assert value(m, "vllm:prefix_cache_queries_total") == 1000
    assert value(m, "vllm:prefix_cache_hits_total") == 320
    assert value(m, "vllm:num_preemptions_total") == 4
    assert value(m, "pagedkv:kv_utilization") == 0.75
    assert value(m, "pagedkv:num_blocks") == 64
    assert value(m, "pagedkv:num_free_blocks") == 48
    assert value(m, "pagedkv:num_cached_blocks") == 20
    assert value(m, "pagedkv:num_evictions_total") == 7
    # Every sample carries the model_name label (request_success adds finished_reason).
    for (_, labels), _v in samples(m).items():
        assert dict(labels)["model_name"] == MODEL
    # A new snapshot replaces the gauges.
    m.update_engine_stats({**BASE_STATS, "num_running": 0, "kv_usage": 0.0, "prefix_cache_queries": 1200})
    assert value(m, "vllm:num_requests_running") == 0
    assert value(m, "vllm:kv_cache_usage_perc") == 0.0
    assert value(m, "vllm:prefix_cache_queries_total") == 1200


def test_counter_help_says_tokens_and_types() -> None:
    m = ServerMetrics(MODEL)
    m.update_engine_stats(BASE_STATS)
    families = {f.name: f for f in text_string_to_metric_families(m.render()[0].decode())}
    assert families["vllm:prefix_cache_queries"].type == "counter"
    assert "tokens" in families["vllm:prefix_cache_queries"].documentation
    assert "tokens" in families["vllm:prefix_cache_hits"].documentation
    assert families["vllm:kv_cache_usage_perc"].type == "gauge"
    assert families["vllm:time_to_first_token_seconds"].type == "histogram"


def test_counters_never_go_down_when_snapshots_arrive_out_of_order() -> None:
    m = ServerMetrics(MODEL)
    m.update_engine_stats({**BASE_STATS, "prefix_cache_hits": 400, "num_running": 5})
    m.update_engine_stats({**BASE_STATS, "prefix_cache_hits": 320, "num_running": 1})  # older snapshot
    assert value(m, "vllm:prefix_cache_hits_total") == 400
    assert value(m, "vllm:num_requests_running") == 1  # gauges take the latest


def test_missing_keys_are_left_out_not_fatal() -> None:
    m = ServerMetrics(MODEL)
    m.update_engine_stats({"num_running": 1, "kv_usage": 0.5})
    got = names(m)
    assert {"vllm:num_requests_running", "vllm:kv_cache_usage_perc"} <= got
    assert "vllm:prefix_cache_hits_total" not in got and "pagedkv:num_blocks" not in got


def test_tier_metrics_appear_only_with_the_tier() -> None:
    m = ServerMetrics(MODEL)
    m.update_engine_stats(BASE_STATS)
    assert not (names(m) & (HOST_NAMES | DISK_NAMES))

    m.update_engine_stats({**BASE_STATS, **HOST_STATS})
    got = names(m)
    assert HOST_NAMES <= got and not (got & DISK_NAMES)
    assert value(m, "pagedkv:host_kv_usage_perc") == 0.25
    assert value(m, "pagedkv:host_num_free_blocks") == 24
    assert value(m, "pagedkv:prefix_cache_host_hits_total") == 48
    assert value(m, "pagedkv:blocks_swapped_out_total") == 11
    assert value(m, "pagedkv:blocks_swapped_in_total") == 9
    assert value(m, "pagedkv:num_swap_preemptions_total") == 3

    m.update_engine_stats({**BASE_STATS, **HOST_STATS, **DISK_STATS})
    got = names(m)
    assert HOST_NAMES | DISK_NAMES <= got
    assert value(m, "pagedkv:disk_num_cached_blocks") == 40
    assert value(m, "pagedkv:prefix_cache_disk_hits_total") == 64
    assert value(m, "pagedkv:blocks_written_to_disk_total") == 41
    assert value(m, "pagedkv:blocks_read_from_disk_total") == 4

    # A disk tier without a host tier is possible in a snapshot: each tier is judged alone.
    m2 = ServerMetrics(MODEL)
    m2.update_engine_stats({**BASE_STATS, **DISK_STATS})
    got = names(m2)
    assert DISK_NAMES <= got and not (got & HOST_NAMES)


def test_spec_decode_metrics_appear_only_with_speculation() -> None:
    m = ServerMetrics(MODEL)
    m.update_engine_stats({**BASE_STATS, "num_spec_drafts": 0, "spec_accepted_per_position": []})
    assert not any(n.startswith("vllm:spec_decode") for n in names(m))
    spec = {
        "spec_per_token_s": 0.001,
        "num_spec_drafts": 10,
        "num_spec_draft_tokens": 35,
        "num_spec_accepted_tokens": 21,
        "num_spec_blocks_freed": 2,
        "spec_accepted_per_position": [9, 7, 5],
    }
    m.update_engine_stats({**BASE_STATS, **spec})
    assert value(m, "vllm:spec_decode_num_drafts_total") == 10
    assert value(m, "vllm:spec_decode_num_draft_tokens_total") == 35
    assert value(m, "vllm:spec_decode_num_accepted_tokens_total") == 21
    assert value(m, "pagedkv:spec_decode_blocks_freed_total") == 2
    per_pos = [value(m, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(p)) for p in range(3)]
    assert per_pos == [9, 7, 5]


# ---------------------------------------------------------------- per-request tracking


def test_ttft_itl_and_token_counters_from_a_stream() -> None:
    m = ServerMetrics(MODEL)
    t = m.start_request("r", arrival_time=100.0)
    t.on_output(output([], prompt_len=7), now=100.2)  # no token yet: nothing recorded
    assert hist_count(m, "vllm:time_to_first_token_seconds") == 0
    t.on_output(output([1], prompt_len=7), now=101.0)
    assert hist_count(m, "vllm:time_to_first_token_seconds") == 1
    assert hist_sum(m, "vllm:time_to_first_token_seconds") == pytest.approx(1.0)
    assert value(m, "vllm:prompt_tokens_total") == 7  # counted once the prefill is done
    t.on_output(output([1, 2], prompt_len=7), now=101.125)
    t.on_output(output([1, 2], prompt_len=7), now=101.25)  # the same output again: nothing new
    t.on_output(output([1, 2, 3, 4, 5], prompt_len=7), now=101.5)  # 3 tokens after 0.375 s
    # 5 tokens: 4 observations (0.125, then 3 x 0.125).
    assert hist_count(m, "vllm:inter_token_latency_seconds") == 4
    assert hist_sum(m, "vllm:inter_token_latency_seconds") == pytest.approx(0.5)
    assert value(m, "vllm:inter_token_latency_seconds_bucket", le="0.1") == 0
    assert value(m, "vllm:inter_token_latency_seconds_bucket", le="0.15") == 4
    assert value(m, "vllm:generation_tokens_total") == 5
    assert t.num_generation_tokens == 5

    assert t.finish(output([1, 2, 3, 4, 5, 6], prompt_len=7, finish_reason="length"), now=103.0)
    assert hist_count(m, "vllm:inter_token_latency_seconds") == 5  # the final output's token
    assert value(m, "vllm:generation_tokens_total") == 6
    assert value(m, "vllm:prompt_tokens_total") == 7
    assert value(m, "vllm:request_success_total", finished_reason="length") == 1
    assert value(m, "vllm:request_success_total", finished_reason="stop") == 0
    assert hist_sum(m, "vllm:e2e_request_latency_seconds") == pytest.approx(3.0)
    assert hist_sum(m, "vllm:request_queue_time_seconds") == pytest.approx(0.5)  # from out.metrics
    assert hist_sum(m, "vllm:request_prompt_tokens") == 7
    assert hist_sum(m, "vllm:request_generation_tokens") == 6
    assert hist_count(m, "vllm:time_to_first_token_seconds") == 1


def test_first_output_with_several_tokens_keeps_n_minus_one_observations() -> None:
    m = ServerMetrics(MODEL)
    t = m.start_request("r", arrival_time=0.0)
    t.on_output(output([1, 2, 3]), now=1.0)
    t.on_output(output([1, 2, 3, 4]), now=1.5)
    assert hist_count(m, "vllm:inter_token_latency_seconds") == 3
    assert hist_sum(m, "vllm:inter_token_latency_seconds") == pytest.approx(0.5)


def test_parallel_samples_are_timed_per_sample() -> None:
    m = ServerMetrics(MODEL)
    t = m.start_request("r", arrival_time=0.0)
    t.on_output(output([[1], [7]]), now=1.0)
    t.on_output(output([[1, 2], [7]]), now=1.2)
    t.on_output(output([[1, 2, 3], [7, 8]]), now=1.6)
    # Sample 0: 3 tokens -> 2 observations (0.2, 0.4); sample 1: 2 tokens -> 1 (0.6).
    assert hist_count(m, "vllm:inter_token_latency_seconds") == 3
    assert hist_sum(m, "vllm:inter_token_latency_seconds") == pytest.approx(1.2)
    assert hist_count(m, "vllm:time_to_first_token_seconds") == 1
    assert value(m, "vllm:generation_tokens_total") == 5
    t.finish(output([[1, 2, 3], [7, 8]], finish_reason="stop"), now=2.0)
    assert value(m, "vllm:request_success_total", finished_reason="stop") == 1  # once per request
    assert hist_sum(m, "vllm:request_generation_tokens") == 5


def test_finish_is_recorded_once() -> None:
    m = ServerMetrics(MODEL)
    t = m.start_request("r", arrival_time=0.0)
    t.on_output(output([1, 2]), now=1.0)
    final = output([1, 2, 3], finish_reason="stop")
    assert t.finish(final, now=2.0, reason="stop")
    assert t.finished
    # A disconnect racing the end: a second finish, and a late output, record nothing.
    assert not t.finish(None, now=3.0, reason="abort")
    t.on_output(output([1, 2, 3, 4]), now=3.5)
    assert value(m, "vllm:request_success_total", finished_reason="stop") == 1
    assert value(m, "vllm:request_success_total", finished_reason="abort") == 0
    assert hist_count(m, "vllm:e2e_request_latency_seconds") == 1
    assert hist_count(m, "vllm:request_prompt_tokens") == 1
    assert value(m, "vllm:generation_tokens_total") == 3


def test_abort_before_any_token_and_after_disconnect() -> None:
    m = ServerMetrics(MODEL)
    # Aborted while waiting: never scheduled, no token.
    t = m.start_request("a", arrival_time=0.0)
    t.finish(output([], finish_reason="abort", scheduled=None), now=1.0, reason="abort")
    assert value(m, "vllm:request_success_total", finished_reason="abort") == 1
    assert hist_count(m, "vllm:request_queue_time_seconds") == 0  # never scheduled
    assert hist_count(m, "vllm:e2e_request_latency_seconds") == 1
    assert hist_count(m, "vllm:time_to_first_token_seconds") == 0
    assert value(m, "vllm:prompt_tokens_total") == 0  # its prefill never completed
    assert hist_sum(m, "vllm:request_generation_tokens") == 0

    # A client that went away mid-stream: finish(None) uses the last output seen.
    t = m.start_request("b", arrival_time=0.0)
    t.on_output(output([1, 2], prompt_len=9), now=1.0)
    t.finish(None, now=2.0, reason="abort")
    assert value(m, "vllm:request_success_total", finished_reason="abort") == 2
    assert hist_sum(m, "vllm:request_prompt_tokens") == 5 + 9  # "a" counts too, as in vLLM
    assert hist_sum(m, "vllm:request_generation_tokens") == 2
    assert hist_count(m, "vllm:request_queue_time_seconds") == 1

    # A request that never produced an output at all.
    t = m.start_request("c", arrival_time=0.0)
    t.finish(None, now=0.5, reason="error")
    assert value(m, "vllm:request_success_total", finished_reason="error") == 1
    assert hist_count(m, "vllm:request_prompt_tokens") == 2  # nothing to observe for "c"


def test_finish_reason_defaults_to_the_outputs() -> None:
    assert finish_reason_of(None) == "abort"
    assert finish_reason_of(output([1], finish_reason="stop")) == "stop"
    assert finish_reason_of(output([1], finish_reason="length")) == "length"
    assert finish_reason_of(output([1])) == "abort"  # unfinished: the stream was cut
    assert finish_reason_of(output([1], finish_reason="stop", error="RuntimeError: x")) == "error"
    mixed = output([[1], [2]], finish_reason="stop")
    mixed.outputs[1].finish_reason = "length"
    assert finish_reason_of(mixed) == "length"

    m = ServerMetrics(MODEL)
    m.start_request("r", arrival_time=0.0).finish(output([1], finish_reason="error"), now=1.0)
    assert value(m, "vllm:request_success_total", finished_reason="error") == 1
    with pytest.raises(ValueError, match="finish reason"):
        m.start_request("s", arrival_time=0.0).finish(None, now=1.0, reason="repetition")


def test_instances_are_independent() -> None:
    a, b = ServerMetrics(MODEL), ServerMetrics("other")
    assert a.registry is not b.registry
    a.update_engine_stats(BASE_STATS)
    ta = a.start_request("r", arrival_time=0.0)
    ta.finish(output([1, 2], finish_reason="stop"), now=1.0)
    assert value(a, "vllm:request_success_total", finished_reason="stop") == 1
    got_b = samples(b)
    assert ("vllm:request_success_total", (("finished_reason", "stop"), ("model_name", "other"))) in got_b
    assert got_b[("vllm:request_success_total", (("finished_reason", "stop"), ("model_name", "other")))] == 0
    assert not any(name == "vllm:kv_cache_usage_perc" for name, _ in got_b)
    # An explicit registry is used as given.
    registry = CollectorRegistry()
    c = ServerMetrics(MODEL, registry)
    assert c.registry is registry


def test_token_histogram_buckets_follow_max_model_len() -> None:
    m = ServerMetrics(MODEL, max_model_len=256)
    les = {dict(labels)["le"] for name, labels in samples(m) if name == "vllm:request_prompt_tokens_bucket"}
    assert les == {"1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "100.0", "200.0", "+Inf"}


# ---------------------------------------------------------------- a real engine


def test_real_engine_stats_and_streams() -> None:
    from pagedkv import LLMEngine, SamplingParams

    engine = LLMEngine(num_blocks=64, max_model_len=256, dtype="float32", device="cpu")
    m = ServerMetrics(MODEL, max_model_len=256)
    prompt = "The quick brown fox jumps over the lazy dog. " * 4  # several blocks: prefix hits
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    trackers = {}
    finals: dict[str, RequestOutput] = {}

    def run(ids: list[str]) -> None:
        for rid in ids:
            trackers[rid] = m.start_request(rid)
            engine.add_request(rid, prompt, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                now = time.time()
                trackers[out.request_id].on_output(out, now)
                if out.finished:
                    trackers[out.request_id].finish(out, now, out.outputs[0].finish_reason)
                    finals[out.request_id] = out

    run(["a"])  # fills the prefix cache
    run(["b", "c"])  # hit it
    stats = engine.get_stats()
    m.update_engine_stats(stats)

    assert stats["prefix_cache_hits"] > 0
    assert value(m, "vllm:prefix_cache_queries_total") == stats["prefix_cache_queries"]
    assert value(m, "vllm:prefix_cache_hits_total") == stats["prefix_cache_hits"]
    assert value(m, "vllm:num_preemptions_total") == stats["num_preemptions"]
    assert value(m, "vllm:kv_cache_usage_perc") == pytest.approx(stats["kv_usage"])
    assert value(m, "vllm:num_requests_running") == stats["num_running"] == 0
    assert value(m, "pagedkv:num_blocks") == stats["num_blocks"]
    assert not (names(m) & (HOST_NAMES | DISK_NAMES))  # no tiers configured

    # Queries count prompt tokens (vLLM's unit), one lookup per request.
    prompt_len = len(finals["a"].prompt_token_ids)
    assert stats["prefix_cache_queries"] == 3 * prompt_len
    assert value(m, "vllm:prompt_tokens_total") == 3 * prompt_len
    assert value(m, "vllm:generation_tokens_total") == stats["generation_tokens"] == 12
    assert value(m, "vllm:request_success_total", finished_reason="length") == 3
    assert hist_count(m, "vllm:inter_token_latency_seconds") == 3 * (4 - 1)
    assert hist_count(m, "vllm:time_to_first_token_seconds") == 3
    assert hist_count(m, "vllm:request_queue_time_seconds") == 3
    assert sum(f.num_cached_tokens for f in finals.values()) == stats["prefix_cache_hits"]
