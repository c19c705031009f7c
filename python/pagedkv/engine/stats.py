"""The engine's running statistics, and the cost models it feeds the scheduler from them.

:class:`StepStats` counts steps, tokens, model time and failures, keeps the last preemptions
(the live KV page draws them), and after every step that went through updates the two cost
models the Rust scheduler decides with: the forward's throughput on prefill-sized steps (the
auto preemption rule weighs a recompute against a swap at the measured tier bandwidth) and,
with speculative decoding, the step time as ``overhead + per_token * tokens`` (how many drafts
are worth verifying, ``Scheduler.set_spec_cost``).
"""

from __future__ import annotations

import collections
from collections.abc import Mapping
from typing import Any

from pagedkv._core import Scheduler, SchedulerOutput, SchedulerStats
from pagedkv.engine.request_state import RequestState
from pagedkv.engine.spec_decode import StepTimeFit
from pagedkv.structured.compiler import GrammarCompiler
from pagedkv.structured.step_masks import StepMasks

__all__ = ["StepStats", "invariant_counts", "kv_maps", "structured_stats"]

# Steps of at least this many tokens measure the forward's throughput (a recompute is a prefill).
_MIN_COST_MODEL_TOKENS = 64


class StepStats:
    """Counters and cost models over an engine's steps (module docs)."""

    def __init__(
        self, scheduler: Scheduler, bytes_per_block: int, swap_bandwidth: float | None, speculative: bool
    ) -> None:
        self.scheduler = scheduler
        self.bytes_per_block = bytes_per_block
        self.speculative = speculative
        self.counters: dict[str, float] = {
            "steps": 0,
            "tokens_computed": 0,
            "generation_tokens": 0,
            "model_time_s": 0.0,
            "failed_steps": 0,
            "failed_requests": 0,
        }
        # The last preemptions, (time, request id), for the live KV page.
        self.recent_preemptions: collections.deque[tuple[float, str]] = collections.deque(maxlen=20)
        # The tiers' copy bandwidth, measured once at start-up (None without a host tier), and
        # the forward's throughput, measured on the real steps: the auto preemption cost model.
        self.swap_bandwidth = swap_bandwidth
        self.recompute_tokens_per_s: float | None = None
        self.step_time = StepTimeFit()

    def scheduled(self, out: SchedulerOutput, requests: Mapping[str, RequestState], now: float) -> None:
        """A step was scheduled at ``now``: its preemptions and its requests' first schedule."""
        if out.preempted_req_ids:
            self.recent_preemptions.extend((now, rid) for rid in out.preempted_req_ids)
        for rid in dict.fromkeys(out.req_ids):
            state = requests.get(rid)
            if state is not None and state.metrics.first_scheduled_time is None:
                state.metrics.first_scheduled_time = now

    def stepped(self, out: SchedulerOutput, seconds: float, num_generated: int) -> None:
        """A step went through in ``seconds`` and emitted ``num_generated`` tokens."""
        num_tokens = out.num_tokens
        self._update_cost_model(num_tokens, seconds)
        if self.speculative and num_tokens == len(out.logits_indices):
            # Steps whose every token is sampled (decodes, with or without drafts): what a
            # draft adds is a token *and* a logits row, which prompt chunks do not have.
            self.step_time.observe(num_tokens, seconds)
            self.scheduler.set_spec_cost(*self.step_time.as_args())
        self.counters["model_time_s"] += seconds
        self.counters["steps"] += 1
        self.counters["tokens_computed"] += num_tokens
        self.counters["generation_tokens"] += num_generated

    def _update_cost_model(self, num_tokens: int, seconds: float) -> None:
        """The forward's throughput on prefill-sized steps, an exponential average with the
        first one taken as is, for the scheduler's auto preemption rule."""
        if self.swap_bandwidth is None or num_tokens < _MIN_COST_MODEL_TOKENS or seconds <= 0.0:
            return
        rate = num_tokens / seconds
        prev = self.recompute_tokens_per_s
        self.recompute_tokens_per_s = rate if prev is None else 0.8 * prev + 0.2 * rate
        self.scheduler.set_cost_model(self.swap_bandwidth, self.recompute_tokens_per_s, self.bytes_per_block)

    def as_dict(self) -> dict[str, Any]:
        """The counters, and the cost models' current values."""
        stats: dict[str, Any] = dict(self.counters)
        if self.speculative:
            stats["spec_step_overhead_s"], stats["spec_per_token_s"] = self.step_time.as_args()
        stats["swap_bandwidth_bytes_per_s"] = self.swap_bandwidth
        stats["recompute_tokens_per_s"] = self.recompute_tokens_per_s
        return stats


def structured_stats(grammars: GrammarCompiler, masks: StepMasks) -> dict[str, Any]:
    """Structured outputs' timings and counts: compiles (cache hits; dropped because every
    request that wanted one left before it started; refused because ``max_queued_compiles``
    waited already), mask fills, grammar work on the step's critical path, masked rows."""
    return {
        "structured_compile_seconds": grammars.compile_time.snapshot(),
        "structured_mask_seconds": masks.fill_time.snapshot(),
        "structured_step_seconds": masks.critical_time.snapshot(),
        "structured_grammar_cache_hits": grammars.num_cache_hits,
        "structured_compiles_cancelled": grammars.num_cancelled,
        "structured_compiles_refused": grammars.num_refused,
        "structured_masked_rows": masks.num_masked_rows,
    }


def kv_maps(scheduler: Scheduler, requests: Mapping[str, RequestState]) -> dict[str, Any]:
    """The KV cache as a live view draws it (``LLMEngine.kv_snapshot`` adds the last
    preemptions, the KV cache groups' spans and the stats): ``memory_map`` (device ``ref_counts``
    int32[N], ``cached`` bool[N], ``owner`` int64[N]: the arrival number of the earliest
    running request holding each block, -1 if none), ``tier_map`` (host ``host_ref_counts`` /
    ``host_cached``; empty without a host tier), ``disk_map`` (``disk_ref_counts`` /
    ``disk_cached``), ``kv_groups`` (int16[N], the KV cache group each device block
    serves, -1 free and uncached), the requests' summaries (``Scheduler.request_summaries``),
    prompts, ``constraints`` (request id -> the kind of its structured-output constraint) and
    ``drafts`` (request id -> its drafted and accepted tokens)."""
    refs, cached, owner = scheduler.memory_map()
    _, host_refs, host_cached = scheduler.tier_map()
    disk_refs, disk_cached = scheduler.disk_map()
    live = requests.items()
    return {
        "ref_counts": refs,
        "cached": cached,
        "owner": owner,
        "host_ref_counts": host_refs,
        "host_cached": host_cached,
        "disk_ref_counts": disk_refs,
        "disk_cached": disk_cached,
        "kv_groups": scheduler.block_kv_groups(),
        "requests": scheduler.request_summaries(),
        "prompts": {rid: state.prompt for rid, state in live},
        "constraints": {rid: state.grammar.kind for rid, state in live if state.grammar is not None},
        "drafts": {
            rid: (state.metrics.num_draft_tokens, state.metrics.num_accepted_tokens)
            for rid, state in live
            if state.metrics.num_draft_tokens
        },
    }


def invariant_counts(
    stats: SchedulerStats, num_kv_loads: int, num_held_compiles: int, num_requests: int
) -> dict[str, int]:
    """What ``LLMEngine.check_invariants`` returns: who holds blocks, and who waits."""
    return {
        "num_blocks": stats.num_blocks,
        "num_used_blocks": stats.num_used_blocks,
        "num_free_blocks": stats.num_free_blocks,
        "num_running": stats.num_running,
        "num_waiting": stats.num_waiting,
        "num_waiting_for_grammar": stats.num_waiting_for_grammar,
        "num_waiting_for_remote_kv": stats.num_waiting_for_remote_kv,
        "num_kv_leases": stats.num_kv_leases,
        "num_kv_reservations": stats.num_kv_reservations,
        "num_kv_loads": num_kv_loads,
        "num_held_compiles": num_held_compiles,
        "num_unfinished_requests": num_requests,
    }
