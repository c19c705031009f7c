"""Reservation baselines: the first-fit arena and the replay's memory breakdown, checked by hand."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.errors import ConfigError, InvalidArgumentError, PromptTooLongError
from pagedkv.sim.baselines import (
    BREAKDOWN_CATEGORIES,
    ContiguousArena,
    ReservationConfig,
    replay_reservation,
)
from pagedkv.sim.workloads import TraceRequest


def request(name: str, prompt_len: int, output_len: int, arrival: float = 0.0, n: int = 1) -> TraceRequest:
    return TraceRequest(name, arrival, np.arange(prompt_len, dtype=np.int32), output_len, n=n)


def breakdown(result, step: int) -> tuple[int, ...]:
    """(token_states, reserved_unused, internal, external, free) of one recorded step."""
    return tuple(result.steps[step].slots()[category] for category in BREAKDOWN_CATEGORIES)


# --------------------------------------------------------------------------- arena


def test_arena_first_fit_takes_the_lowest_hole_that_fits() -> None:
    arena = ContiguousArena(100)
    assert [arena.reserve(10) for _ in range(4)] == [0, 10, 20, 30]
    arena.release(0)
    arena.release(20)
    assert arena.holes() == [(0, 10), (20, 10), (40, 60)]
    assert arena.reserve(5) == 0  # first hole, although others fit too
    assert arena.reserve(8) == 20  # [5, 10) is too small: the next hole
    assert arena.reserve(60) == 40
    assert arena.reserve(6) is None  # 5 + 2 free slots, no hole of 6
    assert arena.num_free == 7 and arena.holes() == [(5, 5), (28, 2)]
    arena.check_invariants()


def test_arena_release_coalesces_with_both_neighbours() -> None:
    arena = ContiguousArena(100)
    a, b, c, d = (arena.reserve(size) for size in (20, 30, 10, 40))
    assert (a, b, c, d) == (0, 20, 50, 60)
    arena.release(a)
    arena.release(c)
    assert arena.holes() == [(0, 20), (50, 10)]
    arena.release(b)  # merges left [0, 20) and right [50, 60) into one hole
    assert arena.holes() == [(0, 60)]
    assert arena.reserve(55) == 0
    arena.release(0)
    arena.release(d)
    assert arena.holes() == [(0, 100)] and arena.regions() == []
    arena.check_invariants()


def test_arena_rejects_bad_calls() -> None:
    arena = ContiguousArena(10)
    start = arena.reserve(4)
    with pytest.raises(InvalidArgumentError, match="slot 1"):
        arena.release(1)
    arena.release(start)
    with pytest.raises(InvalidArgumentError):
        arena.release(start)  # double free
    with pytest.raises(InvalidArgumentError):
        arena.reserve(0)
    with pytest.raises(ConfigError):
        ContiguousArena(0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 40), st.integers(0, 1000)), max_size=60))
def test_arena_matches_a_slot_bitmap_model(operations: list[tuple[bool, int, int]]) -> None:
    """First fit = the lowest start whose whole window is free (that is always a hole's start)."""
    arena, used, live = ContiguousArena(64), np.zeros(64, dtype=bool), {}
    for is_reserve, size, pick in operations:
        if is_reserve or not live:
            fits = [s for s in range(64 - size + 1) if not used[s : s + size].any()]
            start = arena.reserve(size)
            assert start == (fits[0] if fits else None)
            if start is not None:
                used[start : start + size] = True
                live[start] = size
        else:
            start = sorted(live)[pick % len(live)]
            arena.release(start)
            used[start : start + live.pop(start)] = False
        arena.check_invariants()
        assert arena.num_free == int((~used).sum())
        assert arena.regions() == sorted(live.items())


# --------------------------------------------------------------------------- replay by hand


def test_max_length_breakdown_by_hand() -> None:
    # Arena 100, max_model_len 40: A and B take [0, 40) and [40, 80); C waits, and the 20-slot
    # hole [80, 100) is too small for any 40-slot reservation: external fragmentation.
    trace = [request("A", 10, 5), request("B", 20, 10), request("C", 5, 3)]
    result = replay_reservation(
        trace, ReservationConfig(num_slots=100, max_model_len=40), "max_length", record_steps=True
    )
    # step 0: A = 10 prompt + 1 sampled (final 15), B = 20 + 1 (final 30).
    assert result.layouts[0] == ((0, 40, "A"), (40, 40, "B"))
    assert breakdown(result, 0) == (11 + 21, 4 + 9, 25 + 10, 20, 0)
    assert breakdown(result, 4) == (15 + 25, 0 + 5, 35, 20, 0)  # A's last step
    # step 5: A's region is free again; C goes to the first hole [0, 40), not to [80, 100).
    assert result.layouts[5] == ((0, 40, "C"), (40, 40, "B"))
    assert breakdown(result, 5) == (26 + 6, 4 + 2, 10 + 32, 0, 20)
    assert breakdown(result, 7) == (28 + 8, 2 + 0, 42, 0, 20)  # C's last step
    assert result.layouts[8] == ((40, 40, "B"),)
    assert breakdown(result, 8) == (29, 1, 10, 0, 60)
    assert breakdown(result, 9) == (30, 0, 10, 0, 60)
    assert (result.total_steps, result.num_finished, result.generated_tokens) == (10, 3, 18)
    assert (result.peak_running, result.mean_running, result.num_truncated) == (2, 1.8, 0)
    assert result.mean_fraction["token_states"] == 341 / 1000
    assert result.mean_fraction["external_fragmentation"] == 100 / 1000
    assert result.peak_slots == {
        "token_states": 40,
        "reserved_unused": 13,
        "internal_fragmentation": 42,
        "external_fragmentation": 20,
        "free": 60,
    }
    assert result.at_peak_usage == result.steps[0]  # 80 slots reserved, first reached at step 0
    summary = result.to_dict()
    assert "steps" not in summary and summary["policy"] == "max_length"
    assert summary["at_peak_usage"]["token_states"] == 32
    assert len(result.to_dict(include_steps=True)["steps"]) == 10


def test_exact_breakdown_by_hand_with_coalescing() -> None:
    # Exact reservations: A 30, B 30, C 20 slots at [0,30), [30,60), [60,80); D needs 35.
    trace = [
        request("A", 15, 15),
        request("B", 25, 5),
        request("C", 10, 10),
        request("D", 30, 5),
        request("E", 20, 5),
    ]
    result = replay_reservation(trace, ReservationConfig(num_slots=100, max_model_len=40), "exact", record_steps=True)
    assert result.layouts[0] == ((0, 30, "A"), (30, 30, "B"), (60, 20, "C"))
    assert breakdown(result, 0) == (16 + 26 + 11, 14 + 4 + 9, 0, 20, 0)
    assert breakdown(result, 4) == (20 + 30 + 15, 10 + 0 + 5, 0, 20, 0)  # B's last step
    # B's region is a 30-slot hole and [80, 100) a 20-slot one: 50 free, none usable for D.
    assert breakdown(result, 5) == (21 + 16, 9 + 4, 0, 50, 0)
    assert breakdown(result, 9) == (25 + 20, 5 + 0, 0, 50, 0)  # C's last step
    # C's release merges [30,60), [60,80) and [80,100) into one hole: D fits at its start.
    assert result.layouts[10] == ((0, 30, "A"), (30, 35, "D"), (65, 25, "E"))
    assert breakdown(result, 10) == (26 + 31 + 21, 4 + 4 + 4, 0, 0, 10)
    assert breakdown(result, 14) == (30 + 35 + 25, 0, 0, 0, 10)
    assert result.total_steps == 15 and result.num_finished == 5
    assert result.peak_slots["internal_fragmentation"] == 0


def test_head_of_line_blocking() -> None:
    # C (10 slots) would fit next to A, but B (50 slots) is ahead of it and does not.
    trace = [request("A", 30, 30), request("B", 40, 10), request("C", 5, 5)]
    result = replay_reservation(trace, ReservationConfig(num_slots=100, max_model_len=60), "exact", record_steps=True)
    assert result.layouts[0] == ((0, 60, "A"),)
    assert breakdown(result, 0) == (31, 29, 0, 40, 0)
    assert result.steps[0].num_waiting == 2
    assert result.layouts[29] == ((0, 60, "A"),)  # A's last step
    assert result.layouts[30] == ((0, 50, "B"), (50, 10, "C"))


def test_token_budget_with_and_without_chunked_prefill() -> None:
    trace = [request("A", 6, 3), request("B", 6, 3)]
    chunked = ReservationConfig(num_slots=100, max_model_len=20, max_num_batched_tokens=8)
    result = replay_reservation(trace, chunked, "exact", record_steps=True)
    # step 0: A prefills 6 (+1 sampled), B gets the 2 tokens of budget left.
    assert [breakdown(result, s)[0] for s in range(4)] == [7 + 2, 8 + 7, 9 + 8, 9]
    assert result.total_steps == 4
    whole = ReservationConfig(num_slots=100, max_model_len=20, max_num_batched_tokens=8, enable_chunked_prefill=False)
    result = replay_reservation(trace, whole, "exact", record_steps=True)
    # B's whole prompt does not fit the 2 tokens left at step 0: it starts at step 1.
    assert [breakdown(result, s)[0] for s in range(4)] == [7, 8 + 7, 9 + 8, 9]
    assert result.layouts[0] == ((0, 9, "A"),)
    # A single prompt longer than the budget is chunked over several steps.
    long = replay_reservation(
        [request("L", 10, 2)],
        ReservationConfig(num_slots=50, max_model_len=20, max_num_batched_tokens=4),
        "exact",
        record_steps=True,
    )
    assert [breakdown(long, s)[:2] for s in range(4)] == [(4, 8), (8, 4), (11, 1), (12, 0)]


def test_max_num_seqs_limits_admission() -> None:
    trace = [request(name, 2, 3) for name in "ABC"]
    result = replay_reservation(
        trace,
        ReservationConfig(num_slots=100, max_model_len=10, max_num_seqs=2),
        "max_length",
        record_steps=True,
    )
    assert result.peak_running == 2
    assert [tuple(r for _, _, r in layout) for layout in result.layouts] == [("A", "B")] * 3 + [("C",)] * 3


def test_arrivals_map_to_steps_and_idle_time_is_skipped() -> None:
    trace = [request("A", 2, 5, 0.0), request("B", 2, 2, 1.0), request("C", 2, 2, 10.2)]
    config = ReservationConfig(num_slots=100, max_model_len=10, step_duration_s=0.5)
    result = replay_reservation(trace, config, "exact", record_steps=True)
    names = [tuple(r for _, _, r in layout) for layout in result.layouts]
    # B arrives at 1.0 = the start of step 2; C at 10.2, after an idle gap, runs from step 21.
    assert names == [("A",), ("A",), ("A", "B"), ("A", "B"), ("A",), ("C",), ("C",)]
    assert result.total_steps == 7
    assert result.makespan_s == 23 * 0.5


@pytest.mark.parametrize(("arrival", "first_step"), [(0.3, 3), (0.7, 7), (0.70001, 8), (2.0, 20)])
def test_idle_jump_lands_on_the_first_step_at_or_after_arrival(arrival: float, first_step: int) -> None:
    config = ReservationConfig(num_slots=10, max_model_len=5, step_duration_s=0.1)
    result = replay_reservation([request("A", 2, 1, arrival)], config, "exact")
    assert result.total_steps == 1
    assert result.makespan_s == (first_step + 1) * 0.1


def test_output_is_cut_at_max_model_len() -> None:
    result = replay_reservation(
        [request("A", 6, 10)],
        ReservationConfig(num_slots=20, max_model_len=10),
        "exact",
        record_steps=True,
    )
    assert (result.num_truncated, result.generated_tokens, result.total_steps) == (1, 4, 4)
    assert result.layouts[0] == ((0, 10, "A"),)


def test_parallel_samples_reserve_one_region_each_all_or_nothing() -> None:
    config = ReservationConfig(num_slots=50, max_model_len=20)
    result = replay_reservation([request("A", 5, 5), request("B", 5, 3, n=2)], config, "max_length", record_steps=True)
    # B needs two 20-slot regions; only one fits next to A, so it reserves none until A ends.
    assert result.layouts[0] == ((0, 20, "A"),)
    assert result.layouts[5] == ((0, 20, "B"), (20, 20, "B"))
    assert breakdown(result, 5) == (2 * 6, 2 * 2, 2 * 12, 0, 10)
    assert result.generated_tokens == 5 + 2 * 3 and result.peak_running == 2


@pytest.mark.parametrize(
    ("trace", "config", "policy", "error", "match"),
    [
        (
            [request("A", 10, 1)],
            dict(num_slots=100, max_model_len=10),
            "exact",
            PromptTooLongError,
            "'A'",
        ),
        (
            [request("A", 30, 20)],
            dict(num_slots=40, max_model_len=60),
            "exact",
            PromptTooLongError,
            "needs 50 slots",
        ),
        (
            [request("A", 3, 3, n=3)],
            dict(num_slots=40, max_model_len=20),
            "max_length",
            PromptTooLongError,
            "3 x 20",
        ),
        (
            [request("A", 3, 3)],
            dict(num_slots=40, max_model_len=60),
            "max_length",
            ConfigError,
            "max_model_len 60",
        ),
        (
            [request("A", 3, 3, n=4)],
            dict(num_slots=400, max_model_len=20, max_num_seqs=3),
            "exact",
            ConfigError,
            "n=4",
        ),
        (
            [request("A", 9, 3)],
            dict(
                num_slots=40,
                max_model_len=20,
                max_num_batched_tokens=8,
                enable_chunked_prefill=False,
            ),
            "exact",
            ConfigError,
            "chunked prefill is off",
        ),
        (
            [request("A", 3, 3)],
            dict(num_slots=40, max_model_len=20),
            "best_fit",
            ConfigError,
            "best_fit",
        ),
    ],
)
def test_requests_that_can_never_run_are_refused(trace, config, policy, error, match) -> None:
    with pytest.raises(error, match=match):
        replay_reservation(trace, ReservationConfig(**config), policy)


@pytest.mark.parametrize(
    "bad",
    [
        dict(num_slots=0),
        dict(max_model_len=1),
        dict(max_num_seqs=0),
        dict(max_num_batched_tokens=-1),
        dict(step_duration_s=0.0),
        dict(num_slots=True),
    ],
)
def test_config_validation(bad: dict) -> None:
    fields = dict(num_slots=100, max_model_len=10)
    fields.update(bad)
    with pytest.raises(ConfigError):
        ReservationConfig(**fields)


# --------------------------------------------------------------------------- replay, randomized


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 30), st.integers(1, 30), st.integers(1, 2), st.integers(0, 3)),
        min_size=1,
        max_size=25,
    ),
    st.sampled_from(["max_length", "exact"]),
    st.integers(2, 64),  # token budget: >= n, so every request can decode
    st.booleans(),
)
def test_replay_accounting_is_consistent(shapes, policy, budget, chunked) -> None:
    trace, clock = [], 0.0
    for index, (prompt_len, output_len, n, gap) in enumerate(shapes):
        clock += gap * 0.01
        trace.append(request(f"r{index}", prompt_len, output_len, clock, n))
    config = ReservationConfig(
        num_slots=120,
        max_model_len=40,
        max_num_seqs=6,
        max_num_batched_tokens=max(budget, 30 if not chunked else 2),
        enable_chunked_prefill=chunked,
        step_duration_s=0.01,
    )
    result = replay_reservation(trace, config, policy, record_steps=True)
    final = {r.request_id: min(r.prompt_len + r.output_len, 40) for r in trace}
    assert result.num_finished == len(trace)
    assert result.generated_tokens == sum(r.n * (final[r.request_id] - r.prompt_len) for r in trace)
    first_seen: dict[str, int] = {}
    for step, layout in zip(result.steps, result.layouts):
        slots = step.slots()
        assert sum(slots.values()) == 120
        reserved = sum(size for _, size, _ in layout)
        assert slots["token_states"] + slots["reserved_unused"] + slots["internal_fragmentation"] == reserved
        assert step.num_running == len(layout) <= 6
        ends = [start + size for start, size, _ in layout]
        assert all(end <= next_start for end, (next_start, _, _) in zip(ends, layout[1:])) and (
            not ends or ends[-1] <= 120
        )
        for _, size, name in layout:
            assert size == (40 if policy == "max_length" else final[name])
            first_seen.setdefault(name, step.step)
        if policy == "exact":
            assert slots["internal_fragmentation"] == 0
    # FCFS: requests are admitted in arrival order.
    assert sorted(first_seen, key=lambda name: (first_seen[name], int(name[1:]))) == [r.request_id for r in trace]
