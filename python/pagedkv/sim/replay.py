"""Replay a workload through the real Rust scheduler, with no model.

The scheduler, block pool and prefix cache are the production ones; only the model is
replaced by synthetic sampled tokens (every request runs ``ignore_eos`` until its recorded
``output_len``, cut at ``max_model_len``). This answers capacity questions on real traffic:
how many requests run at once, how full the KV blocks are, how often the pool preempts, how
much the prefix cache saves.

The step model is the one of :func:`pagedkv.sim.baselines.replay_reservation`, so the two
are compared like for like: the clock advances ``step_duration_s`` per step; a request enters
the scheduler once its ``arrival_time`` has passed; when nothing is running the clock jumps to
the next arrival (idle steps are not counted); each step one token budget is shared by decodes
and prefill chunks, running requests first, then FCFS admission with head-of-line blocking;
the step that completes a prefill samples the first token.

Memory breakdown of a paged step (same categories as the baselines): ``token_states`` = slots
of blocks in use that hold a computed token (a shared block counts once);
``internal_fragmentation`` = the rest of the slots of the blocks in use (the unfilled tail of
each sequence's last block); ``free`` = slots of free blocks (cached ones included: they are
reusable at once). Paging reserves nothing ahead and any free block fits any request, so
``reserved_unused`` and ``external_fragmentation`` are 0 by construction.

With a host tier the replay charges each step's swap copies on the simulated clock, and it
drives the scheduler's retention clock by that clock (:func:`replay_paged`).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from pagedkv._core import Scheduler, SchedulerConfig, SchedulerOutput, SchedulerStats
from pagedkv.errors import ConfigError, PromptTooLongError
from pagedkv.sim.baselines import (
    BREAKDOWN_CATEGORIES,
    MemoryBreakdown,
    ReservationConfig,
    ReservationReplayResult,
    first_step_at_or_after,
    replay_reservation,
)
from pagedkv.sim.kv_budget import DEFAULT_SWAP_BYTES_PER_SECOND
from pagedkv.sim.workloads.request import TraceRequest

__all__ = [
    "DEFAULT_SWAP_BYTES_PER_SECOND",
    "PREEMPTION_MODES",
    "AllocatorComparison",
    "PagedConfig",
    "PagedReplayResult",
    "allocator_metrics",
    "compare_allocators",
    "replay_paged",
]


PREEMPTION_MODES = ("recompute", "swap", "auto")


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


@dataclass(frozen=True)
class PagedConfig:
    """Pool and budgets of a paged replay."""

    num_blocks: int
    block_size: int = 16
    max_model_len: int = 2048
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    enable_prefix_caching: bool = True
    watermark: float = 0.01
    step_duration_s: float = 0.02  # simulated time per step; maps arrival times onto steps
    # KV offload tier (replay_paged): host blocks (0: none), what preemption does, the
    # bytes of one block (all layers, K and V, scales; 0: unknown, copies cost no time), the
    # copy bandwidth between the tiers and the recompute throughput of the cost model.
    num_host_blocks: int = 0
    preemption_mode: str = "recompute"
    bytes_per_block: int = 0
    swap_bytes_per_second: float = DEFAULT_SWAP_BYTES_PER_SECOND
    recompute_tokens_per_second: float | None = None  # None: max_num_batched_tokens / step_duration_s
    # KV cache groups: one (kind, size) per KV cache group (pagedkv.sim.kv_groups.kv_group_spans);
    # None: one full-attention group. With groups, a "block" of this config is a page of some layers.
    attention_spans: tuple[tuple[str, int | None], ...] | None = None

    def __post_init__(self) -> None:
        if not self.step_duration_s > 0:
            raise ConfigError(f"step_duration_s must be > 0, got {self.step_duration_s}")
        if not _is_int(self.num_host_blocks) or self.num_host_blocks < 0:
            raise ConfigError(f"num_host_blocks must be an integer >= 0, got {self.num_host_blocks!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ConfigError(
                f"preemption_mode {self.preemption_mode!r} is not known; use one of {', '.join(PREEMPTION_MODES)}"
            )
        if self.preemption_mode != "recompute" and self.num_host_blocks == 0:
            raise ConfigError(
                f"preemption_mode {self.preemption_mode!r} needs a host tier: set num_host_blocks "
                "(pagedkv simulate: --num-host-blocks or --host-kv-memory)"
            )
        if not _is_int(self.bytes_per_block) or self.bytes_per_block < 0:
            raise ConfigError(f"bytes_per_block must be an integer >= 0, got {self.bytes_per_block!r}")
        for name, value in (
            ("swap_bytes_per_second", self.swap_bytes_per_second),
            ("recompute_tokens_per_second", self.recompute_tokens_per_second),
        ):
            if value is None and name == "recompute_tokens_per_second":
                continue
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not (math.isfinite(value) and value > 0)
            ):
                raise ConfigError(f"{name} must be a positive finite number, got {value!r}")

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def recompute_throughput(self) -> float:
        """Tokens per second of the cost model: the given one, else a full-budget step per step time."""
        if self.recompute_tokens_per_second is not None:
            return float(self.recompute_tokens_per_second)
        return self.max_num_batched_tokens / self.step_duration_s

    @property
    def copy_seconds_per_block(self) -> float:
        """Simulated seconds one block copy between the tiers adds to its step."""
        return self.bytes_per_block / self.swap_bytes_per_second

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            enable_prefix_caching=self.enable_prefix_caching,
            watermark=self.watermark,
            num_host_blocks=self.num_host_blocks,
            preemption_mode=self.preemption_mode,
            bytes_per_block=self.bytes_per_block,
            swap_bytes_per_second=float(self.swap_bytes_per_second),
            recompute_tokens_per_second=self.recompute_throughput,
            # The retention clock is the simulated one (replay_paged), never wall time.
            manual_clock=True,
            attention_spans=self.attention_spans,
        )


@dataclass(frozen=True)
class PagedReplayResult:
    """Aggregates of a paged replay (fields shared with ``ReservationReplayResult`` first)."""

    policy: str
    num_slots: int
    total_steps: int
    num_finished: int
    num_truncated: int
    generated_tokens: int
    makespan_s: float
    peak_running: int
    mean_running: float
    mean_fraction: dict[str, float]  # category -> time-averaged fraction of the pool
    peak_slots: dict[str, int]
    # Paging only:
    block_size: int
    kv_utilization: float  # sum over steps of token states / sum of slots of blocks in use
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    resumed_prefix_hits: int
    tokens_computed: int  # all tokens run through the "model" (prompts, recomputes, decodes)
    peak_blocks_in_use: int  # most blocks held by running sequences in one step (shared once)
    block_steps: int  # sum over counted steps of blocks in use: the time integral of KV held
    wall_time_s: float
    steps: tuple[MemoryBreakdown, ...] | None = field(default=None, repr=False)
    # KV offload tier (all 0 without one; see replay_paged):
    num_host_blocks: int = 0
    preemption_mode: str = "recompute"
    bytes_per_block: int = 0
    mean_host_used_blocks: float = 0.0  # held by swapped-out sequences, time average over counted steps
    peak_host_used_blocks: int = 0
    mean_host_cached_blocks: float = 0.0  # host blocks in the prefix cache, time average
    num_swap_preemptions: int = 0  # of num_preemptions, those that swapped (the rest recomputed)
    prefix_cache_host_hits: int = 0  # of prefix_cache_hits, tokens found only on the host (loaded back)
    blocks_swapped_out: int = 0  # device -> host copies: swap-outs and write-backs
    blocks_swapped_in: int = 0  # host -> device copies: swap-ins and host prefix hits
    bytes_swapped_out: int = 0
    bytes_swapped_in: int = 0
    num_write_backs: int = 0  # evicted cached device blocks copied to the host
    num_write_backs_skipped: int = 0  # evicted cached device blocks the host had no room for
    num_host_evictions: int = 0
    copy_time_s: float = 0.0  # simulated time of all block copies (part of makespan_s)
    # request id -> prompt tokens served from the cache at its first admission (record_cached_tokens=True)
    request_cached_tokens: dict[str, int] | None = field(default=None, repr=False)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @property
    def prefix_cache_host_hit_rate(self) -> float:
        """The part of :attr:`prefix_cache_hit_rate` served from the host tier."""
        return self.prefix_cache_host_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @property
    def mean_blocks_in_use(self) -> float:
        return self.block_steps / self.total_steps if self.total_steps else 0.0

    def to_dict(self, *, include_steps: bool = False) -> dict[str, Any]:
        d = asdict(self)
        d["prefix_cache_hit_rate"] = self.prefix_cache_hit_rate
        d["prefix_cache_host_hit_rate"] = self.prefix_cache_host_hit_rate
        d["mean_blocks_in_use"] = self.mean_blocks_in_use
        if not include_steps:
            d.pop("steps")
            d.pop("request_cached_tokens")
        return d


def _breakdown(step: int, stats: SchedulerStats, num_slots: int, num_waiting: int) -> MemoryBreakdown:
    held = stats.tokens_held
    allocated = stats.slots_allocated
    return MemoryBreakdown(
        step=step,
        token_states=held,
        reserved_unused=0,
        internal_fragmentation=allocated - held,
        external_fragmentation=0,
        free=num_slots - allocated,
        num_running=stats.num_running,
        num_waiting=num_waiting,
    )


def replay_paged(
    requests: Sequence[TraceRequest],
    config: PagedConfig,
    *,
    seed: int = 0,
    record_steps: bool = False,
    record_cached_tokens: bool = False,
    on_step: Callable[[int, Scheduler, SchedulerOutput], None] | None = None,
) -> PagedReplayResult:
    """Replay ``requests`` (taken in arrival order, stable) through the real scheduler.

    ``on_step(step, scheduler, output)`` is called after each step is scheduled, before its
    update (e.g. to draw the pool's memory map). Requests whose prompt leaves no room for one
    output token under ``max_model_len`` are refused up front with PromptTooLongError. A
    request's ``retention_priority`` / ``retention_duration`` / ``retention_tokens`` go to
    ``Scheduler.add_request``, on the simulated retention clock (below).
    ``record_cached_tokens`` fills ``request_cached_tokens`` (prompt tokens each request found
    in the cache at its first admission).

    KV offload tier (``PagedConfig.num_host_blocks`` > 0). The scheduler then also owns a host
    pool of that many blocks, which holds swapped-out sequences (``preemption_mode`` ``"swap"``,
    or ``"auto"`` per victim by the scheduler's cost model) and, with prefix caching, the cached
    blocks the device pool evicts (written back; a later prompt whose prefix misses on the device
    but hits on the host has those blocks loaded back before its prefill). Each step's
    ``swap_out`` (device -> host) and ``swap_in`` (host -> device) block copies are charged on
    the simulated clock, before the step's forward and without overlap with it:

        step time = step_duration_s + (len(swap_out) + len(swap_in)) * bytes_per_block / swap_bytes_per_second

    so a step with K block copies lasts ``K * bytes_per_block / swap_bytes_per_second`` longer
    (the copies' total is ``PagedReplayResult.copy_time_s``; 0 without a tier, or with
    ``bytes_per_block`` 0 = unknown). The clock is ``k * step_duration_s + copy time so far``;
    arrival times follow it. Default bandwidth: 25 GB/s, a PCIe 4.0/5.0 x16-class
    GPU <-> pinned host link in practice. The ``auto`` rule compares ``2 * blocks * bytes_per_block /
    swap_bytes_per_second`` (out and back) with ``tokens / recompute_tokens_per_second``; the
    default recompute throughput is the step model's own, ``max_num_batched_tokens /
    step_duration_s`` (a full-budget step), so that rule and the simulated clock agree. The
    recompute side is not charged beyond the step model: its cost shows as ``tokens_computed``
    (and as extra steps once the token budget binds).

    Retention clock. A request's ``retention_priority`` / ``retention_duration`` /
    ``retention_tokens`` go to ``Scheduler.add_request``; a retention duration counts from the
    moment a block is freed, on the scheduler's retention clock. The replay builds its scheduler
    with ``manual_clock=True``, so that clock never moves with wall time: before each ``schedule``
    it is moved (``Scheduler.advance_clock``) to the simulated time of that step (the clock above,
    idle jumps included), in whole microseconds. A replay is therefore deterministic, and a
    duration of D seconds expires D simulated seconds after the step that freed the block
    (blocks freed by a step's ``update`` are stamped with that step's start time).
    """
    started = time.perf_counter()
    ordered = sorted(requests, key=lambda r: r.arrival_time)
    for r in ordered:
        if r.prompt_len >= config.max_model_len:
            raise PromptTooLongError(
                f"request {r.request_id!r}: prompt of {r.prompt_len} tokens leaves no room for an output "
                f"token under max_model_len = {config.max_model_len}"
            )
    sched = Scheduler(config.scheduler_config())
    rng = np.random.default_rng(seed)
    waiting = deque(ordered)
    num_slots = config.num_slots
    duration = config.step_duration_s
    tiered = config.num_host_blocks > 0
    copy_seconds = config.copy_seconds_per_block
    step_index = counted = 0
    copy_time = 0.0  # the clock is step_index * duration + copy_time
    clock_us = 0  # the scheduler's (manual) retention clock, microseconds: moved this far
    sum_slots = dict.fromkeys(BREAKDOWN_CATEGORIES, 0)
    peak_slots = dict.fromkeys(BREAKDOWN_CATEGORIES, 0)
    sum_running = peak_running = 0
    sum_held = sum_allocated = peak_allocated = 0
    sum_host_used = peak_host_used = sum_host_cached = 0
    finished = generated = tokens_computed = 0
    history: list[MemoryBreakdown] = []
    cached_tokens: dict[str, int] = {}
    while waiting or sched.has_unfinished_requests():
        if not sched.has_unfinished_requests() and waiting[0].arrival_time > step_index * duration + copy_time:
            # Idle: jump to the first step boundary at or after the next arrival.
            step_index = max(step_index, first_step_at_or_after(waiting[0].arrival_time - copy_time, duration))
        now = step_index * duration + copy_time
        now_us = round(now * 1e6)
        if now_us > clock_us:
            # advance_clock truncates seconds to microseconds: + 0.5 us lands on now_us exactly.
            sched.advance_clock((now_us - clock_us + 0.5) / 1e6)
            clock_us = now_us
        while waiting and waiting[0].arrival_time <= now:
            r = waiting.popleft()
            sched.add_request(
                r.request_id,
                r.prompt_token_ids,
                max_tokens=r.output_len,
                ignore_eos=True,
                n=r.n,
                retention_priority=r.retention_priority,
                retention_duration=r.retention_duration,
                retention_tokens=None if r.retention_tokens is None else min(r.retention_tokens, r.prompt_len),
            )
        out = sched.schedule()
        stats = sched.stats()
        if on_step is not None:
            on_step(counted, sched, out)
        if tiered:
            copies = len(out.swap_out) + len(out.swap_in)
            if copies:
                copy_time += copies * copy_seconds
        if out.num_tokens:
            b = _breakdown(counted, stats, num_slots, sched.num_waiting + len(waiting))
            for c in BREAKDOWN_CATEGORIES:
                v = getattr(b, c)
                sum_slots[c] += v
                peak_slots[c] = max(peak_slots[c], v)
            sum_held += stats.tokens_held
            sum_allocated += stats.slots_allocated
            peak_allocated = max(peak_allocated, stats.slots_allocated)
            sum_running += stats.num_running
            peak_running = max(peak_running, stats.num_running)
            if tiered:
                host_used = stats.num_host_used_blocks
                sum_host_used += host_used
                peak_host_used = max(peak_host_used, host_used)
                sum_host_cached += stats.num_host_cached_blocks
            tokens_computed += out.num_tokens
            if record_steps:
                history.append(b)
            counted += 1
        sampled = rng.integers(0, 32_000, size=len(out.logits_indices), dtype=np.int64)
        updates = sched.update(out, sampled)
        generated += len(updates)
        if record_cached_tokens:
            for request_id, hit in zip(updates.request_ids, updates.num_cached_tokens):
                cached_tokens.setdefault(request_id, hit)
        finished += len(out.finished_req_ids)
        step_index += 1
    # The last update's finishes are reported by one more (empty) step.
    out = sched.schedule()
    finished += len(out.finished_req_ids)
    sched.update(out, np.zeros(0, dtype=np.int64))
    # Output is cut at max_model_len (finish reason "length"), as in the baselines.
    truncated = sum(r.prompt_len + r.output_len > config.max_model_len for r in ordered)
    final = sched.stats()
    steps = max(counted, 1)
    return PagedReplayResult(
        policy="paged",
        num_slots=num_slots,
        total_steps=counted,
        num_finished=finished,
        num_truncated=truncated,
        generated_tokens=generated,
        makespan_s=step_index * duration + copy_time,
        peak_running=peak_running,
        mean_running=sum_running / steps,
        mean_fraction={c: sum_slots[c] / (steps * num_slots) for c in BREAKDOWN_CATEGORIES},
        peak_slots=peak_slots,
        block_size=config.block_size,
        kv_utilization=sum_held / sum_allocated if sum_allocated else 0.0,
        num_preemptions=final.num_preemptions,
        prefix_cache_queries=final.prefix_cache_queries,
        prefix_cache_hits=final.prefix_cache_hits,
        resumed_prefix_hits=final.resumed_prefix_hits,
        tokens_computed=tokens_computed,
        peak_blocks_in_use=peak_allocated // config.block_size,
        block_steps=sum_allocated // config.block_size,
        wall_time_s=time.perf_counter() - started,
        steps=tuple(history) if record_steps else None,
        num_host_blocks=config.num_host_blocks,
        preemption_mode=config.preemption_mode,
        bytes_per_block=config.bytes_per_block,
        mean_host_used_blocks=sum_host_used / steps,
        peak_host_used_blocks=peak_host_used,
        mean_host_cached_blocks=sum_host_cached / steps,
        num_swap_preemptions=final.num_swap_preemptions,
        prefix_cache_host_hits=final.prefix_cache_host_hits,
        blocks_swapped_out=final.blocks_swapped_out,
        blocks_swapped_in=final.blocks_swapped_in,
        bytes_swapped_out=final.bytes_swapped_out,
        bytes_swapped_in=final.bytes_swapped_in,
        num_write_backs=final.num_write_backs,
        num_write_backs_skipped=final.num_write_backs_skipped,
        num_host_evictions=final.num_host_evictions,
        copy_time_s=copy_time,
        request_cached_tokens=cached_tokens if record_cached_tokens else None,
    )


BASELINE_POLICIES = ("max_length", "exact")


@dataclass(frozen=True)
class AllocatorComparison:
    """One workload replayed through the paged scheduler and the reservation baselines.

    All allocators get the same memory (``num_slots`` token slots) and the same batching
    limits. ``skipped`` maps a baseline that cannot run at all (e.g. ``n`` max-length regions
    larger than the arena) to the reason.
    """

    paged: PagedReplayResult
    baselines: dict[str, ReservationReplayResult]
    skipped: dict[str, str]

    def metrics(self) -> dict[str, dict[str, Any]]:
        """:func:`allocator_metrics` of each allocator that ran: ``"paged"`` first, then baselines."""
        rows = {"paged": allocator_metrics(self.paged)}
        rows.update({policy: allocator_metrics(result) for policy, result in self.baselines.items()})
        return rows


def allocator_metrics(result: PagedReplayResult | ReservationReplayResult) -> dict[str, Any]:
    """The capacity figures ``pagedkv simulate`` reports, alike for paged and reservation replays.

    ``kv_utilization`` is token states / slots held (allocated blocks, or reserved regions) over
    the whole replay; ``kv_usage`` the time-averaged fraction of the pool held; concurrency
    counts sequences (a request with ``n`` samples counts ``n`` once forked). Paging-only
    figures (preemptions, prefix cache) are None for the baselines, which never preempt and
    have no cache; the offload-tier figures (host usage and hits, swaps, copies, copy time) are
    None too unless the paged replay had a host tier.
    """
    f = result.mean_fraction
    held = f["token_states"] + f["reserved_unused"] + f["internal_fragmentation"]
    paged = result if isinstance(result, PagedReplayResult) else None
    tiers = paged if paged is not None and paged.num_host_blocks else None
    return {
        "policy": result.policy,
        "peak_concurrent": result.peak_running,
        "mean_concurrent": result.mean_running,
        "kv_utilization": paged.kv_utilization if paged else (f["token_states"] / held if held else 0.0),
        "kv_usage": held,
        "preemptions": paged.num_preemptions if paged else None,
        "prefix_cache_hit_rate": paged.prefix_cache_hit_rate if paged else None,
        "prefill_tokens_saved": paged.prefix_cache_hits if paged else None,
        "steps": result.total_steps,
        "makespan_s": result.makespan_s,
        "num_finished": result.num_finished,
        "generated_tokens": result.generated_tokens,
        "breakdown": dict(f),
        # The KV offload tier (None for the baselines and without a host tier):
        "tokens_computed": paged.tokens_computed if paged else None,
        "host_kv_usage": tiers.mean_host_used_blocks / tiers.num_host_blocks if tiers else None,
        "host_cached_fraction": tiers.mean_host_cached_blocks / tiers.num_host_blocks if tiers else None,
        "prefix_cache_host_hit_rate": tiers.prefix_cache_host_hit_rate if tiers else None,
        "prefill_tokens_from_host": tiers.prefix_cache_host_hits if tiers else None,
        "swap_preemptions": tiers.num_swap_preemptions if tiers else None,
        "blocks_swapped_out": tiers.blocks_swapped_out if tiers else None,
        "blocks_swapped_in": tiers.blocks_swapped_in if tiers else None,
        "bytes_swapped_out": tiers.bytes_swapped_out if tiers else None,
        "bytes_swapped_in": tiers.bytes_swapped_in if tiers else None,
        "write_backs": tiers.num_write_backs if tiers else None,
        "write_backs_skipped": tiers.num_write_backs_skipped if tiers else None,
        "host_evictions": tiers.num_host_evictions if tiers else None,
        "copy_time_s": tiers.copy_time_s if tiers else None,
    }


def compare_allocators(
    requests: Sequence[TraceRequest],
    config: PagedConfig,
    *,
    baselines: Sequence[str] = BASELINE_POLICIES,
    seed: int = 0,
    record_steps: bool = False,
) -> AllocatorComparison:
    """Replay ``requests`` through the paged scheduler and each reservation baseline.

    The baselines get ``config.num_slots`` slots (the paged pool's), ``max_model_len``,
    ``max_num_seqs``, ``max_num_batched_tokens`` and ``step_duration_s`` of ``config``.
    Errors of the workload itself (a prompt too long for ``max_model_len``) propagate from the
    paged replay; a baseline that cannot hold some request is listed in ``skipped``.
    """
    for policy in baselines:
        if policy not in BASELINE_POLICIES:
            raise ConfigError(f"unknown baseline {policy!r}; use one of {', '.join(BASELINE_POLICIES)}")
    paged = replay_paged(requests, config, seed=seed, record_steps=record_steps)
    reservation = ReservationConfig(
        num_slots=config.num_slots,
        max_model_len=config.max_model_len,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        step_duration_s=config.step_duration_s,
    )
    results: dict[str, ReservationReplayResult] = {}
    skipped: dict[str, str] = {}
    for policy in baselines:
        try:
            results[policy] = replay_reservation(requests, reservation, policy, record_steps=record_steps)
        except (ConfigError, PromptTooLongError) as error:
            skipped[policy] = str(error)
    return AllocatorComparison(paged=paged, baselines=results, skipped=skipped)
