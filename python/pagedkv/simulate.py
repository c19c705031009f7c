"""Replay a workload through the real Rust scheduler, with no model.

The scheduler, block pool and prefix cache are the production ones; only the model is
replaced by synthetic sampled tokens (every request runs ``ignore_eos`` until its recorded
``output_len``, cut at ``max_model_len``). This answers capacity questions on real traffic:
how many requests run at once, how full the KV blocks are, how often the pool preempts, how
much the prefix cache saves.

The step model is the one of :mod:`pagedkv.baselines`, so the two are compared like for
like: the clock advances ``step_duration_s`` per step; a request enters the scheduler once its
``arrival_time`` has passed; when nothing is running the clock jumps to the next arrival
(idle steps are not counted); each step one token budget is shared by decodes and prefill
chunks, running requests first, then FCFS admission with head-of-line blocking; the step that
completes a prefill samples the first token.

Memory breakdown of a paged step (same categories as the baselines): ``token_states`` = slots
of blocks in use that hold a computed token (a shared block counts once);
``internal_fragmentation`` = the rest of the slots of the blocks in use (the unfilled tail of
each sequence's last block); ``free`` = slots of free blocks (cached ones included: they are
reusable at once). Paging reserves nothing ahead and any free block fits any request, so
``reserved_unused`` and ``external_fragmentation`` are 0 by construction.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from pagedkv._core import Scheduler, SchedulerConfig, SchedulerOutput, SchedulerStats
from pagedkv.baselines import BREAKDOWN_CATEGORIES, MemoryBreakdown, first_step_at_or_after
from pagedkv.errors import ConfigError, PromptTooLongError
from pagedkv.workloads.request import TraceRequest

__all__ = ["PagedConfig", "PagedReplayResult", "replay_paged"]


@dataclass(frozen=True)
class PagedConfig:
    """Pool and budgets of a paged replay."""

    num_blocks: int
    block_size: int = 16
    max_model_len: int = 2048
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    enable_prefix_caching: bool = True
    watermark: float = 0.0
    step_duration_s: float = 0.02  # simulated time per step; maps arrival times onto steps

    def __post_init__(self) -> None:
        if not self.step_duration_s > 0:
            raise ConfigError(f"step_duration_s must be > 0, got {self.step_duration_s}")

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            enable_prefix_caching=self.enable_prefix_caching,
            watermark=self.watermark,
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
    wall_time_s: float
    steps: tuple[MemoryBreakdown, ...] | None = field(default=None, repr=False)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    def to_dict(self, *, include_steps: bool = False) -> dict[str, Any]:
        d = asdict(self)
        d["prefix_cache_hit_rate"] = self.prefix_cache_hit_rate
        if not include_steps:
            d.pop("steps")
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
    on_step: Callable[[int, Scheduler, SchedulerOutput], None] | None = None,
) -> PagedReplayResult:
    """Replay ``requests`` (taken in arrival order, stable) through the real scheduler.

    ``on_step(step, scheduler, output)`` is called after each step is scheduled, before its
    update (e.g. to draw the pool's memory map). Requests whose prompt leaves no room for one
    output token under ``max_model_len`` are refused up front with PromptTooLongError.
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
    step_index = counted = 0
    sum_slots = dict.fromkeys(BREAKDOWN_CATEGORIES, 0)
    peak_slots = dict.fromkeys(BREAKDOWN_CATEGORIES, 0)
    sum_running = peak_running = 0
    sum_held = sum_allocated = 0
    finished = generated = tokens_computed = 0
    history: list[MemoryBreakdown] = []
    while waiting or sched.has_unfinished_requests():
        if not sched.has_unfinished_requests() and waiting[0].arrival_time > step_index * config.step_duration_s:
            step_index = max(step_index, first_step_at_or_after(waiting[0].arrival_time, config.step_duration_s))
        now = step_index * config.step_duration_s
        while waiting and waiting[0].arrival_time <= now:
            r = waiting.popleft()
            sched.add_request(
                r.request_id, r.prompt_token_ids, max_tokens=r.output_len, ignore_eos=True, n=r.n
            )
        out = sched.schedule()
        stats = sched.stats()
        if on_step is not None:
            on_step(counted, sched, out)
        if out.num_tokens:
            b = _breakdown(counted, stats, num_slots, sched.num_waiting + len(waiting))
            for c in BREAKDOWN_CATEGORIES:
                v = getattr(b, c)
                sum_slots[c] += v
                peak_slots[c] = max(peak_slots[c], v)
            sum_held += stats.tokens_held
            sum_allocated += stats.slots_allocated
            sum_running += stats.num_running
            peak_running = max(peak_running, stats.num_running)
            tokens_computed += out.num_tokens
            if record_steps:
                history.append(b)
            counted += 1
        sampled = rng.integers(0, 32_000, size=len(out.logits_indices), dtype=np.int64)
        generated += len(sched.update(out, sampled))
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
        makespan_s=step_index * config.step_duration_s,
        peak_running=peak_running,
        mean_running=sum_running / steps,
        mean_fraction={c: sum_slots[c] / (steps * num_slots) for c in BREAKDOWN_CATEGORIES},
        peak_slots=peak_slots,
        block_size=config.block_size,
        kv_utilization=sum_held / sum_allocated if sum_allocated else 1.0,
        num_preemptions=final.num_preemptions,
        prefix_cache_queries=final.prefix_cache_queries,
        prefix_cache_hits=final.prefix_cache_hits,
        resumed_prefix_hits=final.resumed_prefix_hits,
        tokens_computed=tokens_computed,
        wall_time_s=time.perf_counter() - started,
        steps=tuple(history) if record_steps else None,
    )
