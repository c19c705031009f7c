"""Reservation-based KV-cache baselines (pre-PagedAttention, Orca style), replayed on a trace.

Before paging, a server gave each admitted sequence one **contiguous** region of a KV arena and
kept it until the sequence ended. Two policies are modelled:

* ``max_length``: every sequence reserves ``max_model_len`` slots (the length is unknown in
  advance, so the worst case is reserved);
* ``exact``: an oracle that knows each request's output length reserves exactly
  ``prompt_len + output_len`` slots: no internal fragmentation, only external.

Regions are placed **first-fit** over the arena (the lowest-addressed hole that is large
enough) and a freed region coalesces with free neighbours, so holes between live regions
(external fragmentation) are real. Units are token slots; one slot holds one token's KV for all
layers.

The replay (:func:`replay_reservation`) steps as the paged scheduler does, and each step's
memory breakdown (:class:`MemoryBreakdown`, vLLM paper's Fig. 2) splits every slot into token
states, reserved-unused, internal and external fragmentation, and free.
"""

from __future__ import annotations

import bisect
import enum
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from pagedkv.errors import (
    ConfigError,
    InvalidArgumentError,
    InvariantViolationError,
    PromptTooLongError,
)
from pagedkv.sim.workloads.request import TraceRequest

__all__ = [
    "BREAKDOWN_CATEGORIES",
    "ContiguousArena",
    "MemoryBreakdown",
    "ReservationConfig",
    "ReservationPolicy",
    "ReservationReplayResult",
    "replay_reservation",
]

BREAKDOWN_CATEGORIES = (
    "token_states",
    "reserved_unused",
    "internal_fragmentation",
    "external_fragmentation",
    "free",
)


class ContiguousArena:
    """First-fit allocator of contiguous slot ranges over ``[0, num_slots)`` with coalescing.

    Invariants (``check_invariants``): holes and regions tile the arena without overlap; no two
    holes are adjacent (a release always merges with free neighbours); both are keyed by start.
    """

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ConfigError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self._hole_starts: list[int] = [0]  # sorted
        self._hole_sizes: dict[int, int] = {0: num_slots}
        self._regions: dict[int, int] = {}  # start -> size of each live reservation
        self.num_free = num_slots

    def reserve(self, size: int) -> int | None:
        """Start of a new ``size``-slot region in the first hole that fits; None if none does."""
        if size < 1:
            raise InvalidArgumentError(f"a reservation needs >= 1 slot, got {size}")
        for index, start in enumerate(self._hole_starts):
            hole = self._hole_sizes[start]
            if hole < size:
                continue
            del self._hole_sizes[start]
            if hole == size:
                del self._hole_starts[index]
            else:  # the region takes the hole's low end; the rest stays a hole
                self._hole_starts[index] = start + size
                self._hole_sizes[start + size] = hole - size
            self._regions[start] = size
            self.num_free -= size
            return start
        return None

    def release(self, start: int) -> None:
        """Free the region starting at ``start``, merging it with adjacent holes."""
        size = self._regions.pop(start, None)
        if size is None:
            raise InvalidArgumentError(f"no live region starts at slot {start}")
        self.num_free += size
        index = bisect.bisect_left(self._hole_starts, start)
        end = start + size
        if index < len(self._hole_starts) and self._hole_starts[index] == end:  # merge right
            size += self._hole_sizes.pop(end)
            del self._hole_starts[index]
        if index > 0:  # merge left
            left = self._hole_starts[index - 1]
            if left + self._hole_sizes[left] == start:
                self._hole_sizes[left] += size
                return
        self._hole_starts.insert(index, start)
        self._hole_sizes[start] = size

    def holes(self) -> list[tuple[int, int]]:
        """Free ranges as (start, size), by start."""
        return [(start, self._hole_sizes[start]) for start in self._hole_starts]

    def regions(self) -> list[tuple[int, int]]:
        """Live reservations as (start, size), by start."""
        return sorted(self._regions.items())

    def free_in_holes_smaller_than(self, size: int) -> int:
        """Total free slots in holes of fewer than ``size`` slots."""
        return sum(hole for hole in self._hole_sizes.values() if hole < size)

    def check_invariants(self) -> None:
        pieces = sorted([(s, n, "hole") for s, n in self.holes()] + [(s, n, "region") for s, n in self.regions()])
        cursor, previous_kind = 0, None
        for start, size, kind in pieces:
            if start != cursor or size < 1:
                raise InvariantViolationError(f"arena pieces do not tile: {pieces}")
            if kind == "hole" and previous_kind == "hole":
                raise InvariantViolationError(f"adjacent holes were not coalesced: {pieces}")
            cursor, previous_kind = start + size, kind
        if cursor != self.num_slots or self.num_free != sum(self._hole_sizes.values()):
            raise InvariantViolationError(f"arena pieces do not cover {self.num_slots} slots: {pieces}")
        if self._hole_starts != sorted(self._hole_sizes):
            raise InvariantViolationError("hole index is out of order")


class ReservationPolicy(str, enum.Enum):
    MAX_LENGTH = "max_length"
    EXACT = "exact"


@dataclass(frozen=True)
class ReservationConfig:
    """Arena and batching limits of a reservation replay (same meaning as ``SchedulerConfig``)."""

    num_slots: int  # arena size in token slots
    max_model_len: int
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    enable_chunked_prefill: bool = True
    step_duration_s: float = 0.02  # simulated time per step; maps arrival times onto steps

    def __post_init__(self) -> None:
        for name in ("num_slots", "max_model_len", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_model_len < 2:
            raise ConfigError(f"max_model_len must be >= 2 (prompt + output token), got {self.max_model_len}")
        if not (math.isfinite(self.step_duration_s) and self.step_duration_s > 0):
            raise ConfigError(f"step_duration_s must be finite and > 0, got {self.step_duration_s}")


@dataclass(frozen=True)
class MemoryBreakdown:
    """Slots per category during one step; they sum to ``num_slots``.

    Memory breakdown of a step (vLLM paper, Fig. 2). For each live sequence with region size ``R``, final length ``F = prompt_len + generated
    tokens it will have at the end`` and current length ``C`` (prompt tokens prefilled so far +
    tokens generated so far), and with ``H`` = the reservation size of the head of the waiting
    queue (the next request in arrival order not yet admitted, arrived or not; each of its ``n``
    sequences needs ``H``):

    * ``token_states``            = sum of ``C``: slots holding KV of tokens already computed;
    * ``reserved_unused``         = sum of ``F - C``: reserved for tokens the sequence will still
      produce (used later, idle now);
    * ``internal_fragmentation``  = sum of ``R - F``: reserved but never used (beyond the final
      length); always 0 under ``exact``;
    * ``external_fragmentation``  = free slots in holes smaller than ``H``: free memory between
      reservations that the next reservation cannot use; 0 when no request is waiting;
    * ``free``                    = every other free slot.

    The five add up to ``num_slots`` exactly, at every step.
    """

    step: int
    token_states: int
    reserved_unused: int
    internal_fragmentation: int
    external_fragmentation: int
    free: int
    num_running: int  # live sequences (a request with n samples counts n)
    num_waiting: int  # requests not yet admitted, arrived or not

    def slots(self) -> dict[str, int]:
        return {category: getattr(self, category) for category in BREAKDOWN_CATEGORIES}


@dataclass(frozen=True)
class ReservationReplayResult:
    """Aggregates of a replay; fractions are of ``num_slots``, averaged over counted steps."""

    policy: str
    num_slots: int
    total_steps: int
    num_finished: int
    num_truncated: int
    generated_tokens: int
    makespan_s: float  # clock at the end of the last step
    peak_running: int
    mean_running: float
    mean_fraction: dict[str, float]  # category -> time-averaged fraction of the arena
    peak_slots: dict[str, int]  # category -> its largest value over the steps
    at_peak_usage: MemoryBreakdown | None  # the first step with the most reserved slots
    # With record_steps: every step's breakdown, and its arena layout as (start, size,
    # request_id) per live region, by start (a request with n samples has n regions).
    steps: tuple[MemoryBreakdown, ...] | None = field(default=None, repr=False)
    layouts: tuple[tuple[tuple[int, int, str], ...], ...] | None = field(default=None, repr=False)

    def to_dict(self, *, include_steps: bool = False) -> dict[str, Any]:
        """Plain JSON-ready values; per-step history only with ``include_steps``."""
        result = asdict(self)
        if not include_steps:
            result.pop("steps")
            result.pop("layouts")
        return result


@dataclass
class _Live:
    """One admitted request: ``n`` sequences that advance together, each in its own region."""

    request: TraceRequest
    region_size: int
    final_len: int  # prompt_len + tokens it will generate (after the max_model_len cut)
    starts: list[int]
    prefilled: int = 0
    generated: int = 0

    @property
    def current_len(self) -> int:
        return self.prefilled + self.generated

    @property
    def done(self) -> bool:
        return self.current_len == self.final_len


def _final_len(request: TraceRequest, max_model_len: int) -> int:
    return min(request.prompt_len + request.output_len, max_model_len)


def _region_size(request: TraceRequest, policy: ReservationPolicy, max_model_len: int) -> int:
    if policy is ReservationPolicy.MAX_LENGTH:
        return max_model_len
    return _final_len(request, max_model_len)


def _validate(requests: Sequence[TraceRequest], config: ReservationConfig, policy: ReservationPolicy) -> None:
    if policy is ReservationPolicy.MAX_LENGTH and config.max_model_len > config.num_slots:
        raise ConfigError(
            f"max_model_len {config.max_model_len} exceeds the arena's {config.num_slots} slots: "
            "no max-length reservation can ever fit"
        )
    for request in requests:
        where = f"request {request.request_id!r}"
        if request.prompt_len >= config.max_model_len:
            raise PromptTooLongError(
                f"{where}: prompt of {request.prompt_len} tokens leaves no room for an output "
                f"token within max_model_len {config.max_model_len}"
            )
        need = request.n * _region_size(request, policy, config.max_model_len)
        if need > config.num_slots:
            raise PromptTooLongError(
                f"{where}: needs {need} slots ({request.n} x {need // request.n}) but the arena has {config.num_slots}"
            )
        if request.n > config.max_num_seqs:
            raise ConfigError(f"{where}: n={request.n} exceeds max_num_seqs {config.max_num_seqs}")
        if request.n > config.max_num_batched_tokens:
            raise ConfigError(
                f"{where}: n={request.n} decode tokens exceed max_num_batched_tokens {config.max_num_batched_tokens}"
            )
        if not config.enable_chunked_prefill and request.prompt_len > config.max_num_batched_tokens:
            raise ConfigError(
                f"{where}: prompt of {request.prompt_len} tokens exceeds max_num_batched_tokens "
                f"{config.max_num_batched_tokens} and chunked prefill is off"
            )


def first_step_at_or_after(time_s: float, step_duration_s: float) -> int:
    """The smallest step k with ``k * step_duration_s >= time_s``, exact despite float division."""
    step = math.ceil(time_s / step_duration_s)
    while step * step_duration_s < time_s:
        step += 1
    while step > 0 and (step - 1) * step_duration_s >= time_s:
        step -= 1
    return step


def replay_reservation(
    requests: Sequence[TraceRequest],
    config: ReservationConfig,
    policy: ReservationPolicy | str = ReservationPolicy.MAX_LENGTH,
    *,
    record_steps: bool = False,
) -> ReservationReplayResult:
    """Replay ``requests`` (taken in arrival order, stable) through a reservation allocator.

    The replay (continuous batching, kept comparable to the paged scheduler). The clock advances ``step_duration_s`` per step; a request can be admitted once its
    ``arrival_time`` is <= the step's start. When nothing runs and the next request has not
    arrived, the clock jumps to the first step at or after its arrival; skipped idle steps are not
    counted. Each step:

    1. running sequences, in admission order, take their work out of the token budget
       ``max_num_batched_tokens``: the next prefill chunk (the rest of the prompt, cut to the budget
       left) or, once prefilled, one decode token per parallel sample;
    2. waiting requests are admitted **FCFS in arrival order with head-of-line blocking**: the head
       is admitted if it has arrived, ``max_num_seqs`` leaves room for its ``n`` sequences, budget
       is left (all of its prompt when chunked prefill is off), and all ``n`` regions can be
       reserved (all or nothing); otherwise admission stops for this step. An admitted request
       starts its prefill in the same step;
    3. the scheduled tokens are computed. Every token (prompt or generated) occupies one slot of its
       region: the step that completes a prefill also samples the first output token, and every
       decode step adds one more. A request is done after ``output_len`` tokens;
    4. the memory breakdown of the step is recorded (requests finishing this step still count);
    5. finished requests release their regions.

    Output is cut at ``max_model_len``: a request generates ``min(output_len, max_model_len -
    prompt_len)`` tokens (as an engine stops with finish reason ``"length"``), counted in
    ``num_truncated``. A request is refused up front (PromptTooLongError) when its prompt leaves no
    room for one output token or its ``n`` regions can never fit in the arena; a configuration no
    request could run under raises ConfigError.

    ``record_steps`` keeps every step's :class:`MemoryBreakdown` and arena layout in the
    result's ``steps`` and ``layouts`` (memory grows with steps x live requests).
    """
    try:
        policy = ReservationPolicy(policy)
    except ValueError:
        raise ConfigError(f"unknown reservation policy {policy!r}; use 'max_length' or 'exact'") from None
    ordered = sorted(requests, key=lambda request: request.arrival_time)
    _validate(ordered, config, policy)

    arena = ContiguousArena(config.num_slots)
    waiting = deque(ordered)
    running: list[_Live] = []
    num_running_seqs = 0
    step_index = 0  # position on the clock grid (idle jumps skip ahead)
    counted_steps = 0
    finished = truncated = generated_tokens = 0
    sum_slots = dict.fromkeys(BREAKDOWN_CATEGORIES, 0)
    peak_slots = dict.fromkeys(BREAKDOWN_CATEGORIES, 0)
    sum_running = peak_running = 0
    at_peak: MemoryBreakdown | None = None
    peak_reserved = -1
    history: list[MemoryBreakdown] = []
    layouts: list[tuple[tuple[int, int, str], ...]] = []

    while waiting or running:
        if not running and waiting[0].arrival_time > step_index * config.step_duration_s:
            step_index = max(
                step_index,
                first_step_at_or_after(waiting[0].arrival_time, config.step_duration_s),
            )
        now = step_index * config.step_duration_s

        # 1. running sequences take their prefill chunk or decode tokens from the budget.
        budget = config.max_num_batched_tokens
        work: list[tuple[_Live, int]] = []  # (request, prompt tokens this step; 0 = decode)
        for live in running:
            remaining_prompt = live.request.prompt_len - live.prefilled
            if remaining_prompt > 0:
                chunk = min(remaining_prompt, budget)
                if chunk > 0:
                    work.append((live, chunk))
                    budget -= chunk
            elif budget >= live.request.n:
                work.append((live, 0))
                budget -= live.request.n

        # 2. FCFS admission with head-of-line blocking.
        while waiting and budget > 0:
            head = waiting[0]
            if head.arrival_time > now or num_running_seqs + head.n > config.max_num_seqs:
                break
            if not config.enable_chunked_prefill and head.prompt_len > budget:
                break
            size = _region_size(head, policy, config.max_model_len)
            starts: list[int] = []
            for _ in range(head.n):
                start = arena.reserve(size)
                if start is None:
                    break
                starts.append(start)
            if len(starts) < head.n:  # all or nothing
                for start in starts:
                    arena.release(start)
                break
            waiting.popleft()
            final_len = _final_len(head, config.max_model_len)
            truncated += final_len < head.prompt_len + head.output_len
            live = _Live(head, size, final_len, starts)
            running.append(live)
            num_running_seqs += head.n
            chunk = min(head.prompt_len, budget)
            work.append((live, chunk))
            budget -= chunk

        # 3. compute: prefill chunks (the last one also samples a token) and decode tokens.
        for live, prompt_tokens in work:
            if prompt_tokens:
                live.prefilled += prompt_tokens
                if live.prefilled == live.request.prompt_len:
                    live.generated = 1
                    generated_tokens += live.request.n
            else:
                live.generated += 1
                generated_tokens += live.request.n

        # 4. the step's memory breakdown.
        token_states = reserved_unused = internal = 0
        for live in running:
            n = live.request.n
            token_states += n * live.current_len
            reserved_unused += n * (live.final_len - live.current_len)
            internal += n * (live.region_size - live.final_len)
        external = (
            arena.free_in_holes_smaller_than(_region_size(waiting[0], policy, config.max_model_len)) if waiting else 0
        )
        breakdown = MemoryBreakdown(
            step=counted_steps,
            token_states=token_states,
            reserved_unused=reserved_unused,
            internal_fragmentation=internal,
            external_fragmentation=external,
            free=arena.num_free - external,
            num_running=num_running_seqs,
            num_waiting=len(waiting),
        )
        if sum(breakdown.slots().values()) != config.num_slots:
            raise InvariantViolationError(f"breakdown does not add up to {config.num_slots}: {breakdown}")
        for category, slots in breakdown.slots().items():
            sum_slots[category] += slots
            peak_slots[category] = max(peak_slots[category], slots)
        reserved = config.num_slots - arena.num_free
        if reserved > peak_reserved:
            peak_reserved, at_peak = reserved, breakdown
        sum_running += num_running_seqs
        peak_running = max(peak_running, num_running_seqs)
        if record_steps:
            history.append(breakdown)
            layouts.append(
                tuple(
                    sorted(
                        (start, live.region_size, live.request.request_id) for live in running for start in live.starts
                    )
                )
            )

        # 5. finished requests release their regions.
        still_running = []
        for live in running:
            if live.done:
                for start in live.starts:
                    arena.release(start)
                num_running_seqs -= live.request.n
                finished += 1
            else:
                still_running.append(live)
        running = still_running
        counted_steps += 1
        step_index += 1

    steps = max(counted_steps, 1)
    return ReservationReplayResult(
        policy=policy.value,
        num_slots=config.num_slots,
        total_steps=counted_steps,
        num_finished=finished,
        num_truncated=truncated,
        generated_tokens=generated_tokens,
        makespan_s=step_index * config.step_duration_s,
        peak_running=peak_running,
        mean_running=sum_running / steps,
        mean_fraction={c: sum_slots[c] / (steps * config.num_slots) for c in BREAKDOWN_CATEGORIES},
        peak_slots=peak_slots,
        at_peak_usage=at_peak,
        steps=tuple(history) if record_steps else None,
        layouts=tuple(layouts) if record_steps else None,
    )
