"""Random garbage through every binding: each call either succeeds or raises a
pagedkv.PagedKVError. A PanicException (or any other exception type) reaching Python is a bug."""

from __future__ import annotations

import inspect
import random

import numpy as np
import pytest

import pagedkv
from pagedkv import BlockAllocator, KVCacheManager, Scheduler, SchedulerConfig
from pagedkv._core import block_hashes

GARBAGE: list[object] = [
    None,
    True,
    False,
    0,
    1,
    3,
    -1,
    -(2**31),
    2**31,
    2**63,
    -(2**63) - 1,
    2**70,
    0.5,
    float("nan"),
    float("inf"),
    "",
    "abc",
    b"\x00",
    [],
    [0],
    [1, 2, 3],
    [-1],
    [2**40],
    [0.5],
    ["a"],
    [[1]],
    (1, 2),
    {1: 2},
    {1, 2},
    object(),
    np.int64(2),
    np.int32(-7),
    np.float32(1.0),
    np.bool_(True),
    np.array([], dtype=np.int64),
    np.array([1, 2], dtype=np.int32),
    np.array([1, 2], dtype=np.uint8),
    np.array([0.1]),
    np.array([[1, 2]]),
    np.arange(10)[::3],
    np.array(5),
    np.array(["x"]),
    range(5),
    iter([1, 2]),
    np.array([2**40], dtype=np.int64),
]


def public_methods(obj: object) -> list[tuple[str, int]]:
    out = []
    for name in dir(obj):
        if name.startswith("_"):
            continue
        attr = getattr(obj, name)
        if callable(attr):
            try:
                params = inspect.signature(attr).parameters.values()
                arity = sum(
                    1
                    for p in params
                    if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                )
            except (TypeError, ValueError):
                arity = 1
            out.append((name, arity))
    return out


def call_with_garbage(obj: object, rng: random.Random, rounds: int, skip: tuple[str, ...] = ()) -> None:
    methods = [m for m in public_methods(obj) if m[0] not in skip]
    assert methods
    for _ in range(rounds):
        name, arity = rng.choice(methods)
        args = [rng.choice(GARBAGE) for _ in range(arity + rng.randint(0, 1))]
        try:
            getattr(obj, name)(*args)
        except pagedkv.PagedKVError:
            pass
        except TypeError as e:
            # Only a wrong *number* of arguments may surface as a plain TypeError from Python's
            # call machinery; every value error must be a pagedkv exception.
            msg = str(e)
            assert "argument" in msg and ("positional" in msg or "takes" in msg or "keyword" in msg), (name, args, e)
        # Anything else (PanicException is a BaseException) propagates and fails the test.


@pytest.mark.parametrize("seed", range(4))
def test_garbage_never_panics(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(30):
        try:
            a = BlockAllocator(rng.choice(GARBAGE + [8, 16]), rng.choice(GARBAGE + [4, 16]))
        except pagedkv.PagedKVError:
            continue
        call_with_garbage(a, rng, 40)
        a.check_invariants()
    m = KVCacheManager(32, 4)
    seq, _ = m.add_sequence([1, 2, 3, 4, 5])
    m.allocate_slots(seq, 3)
    for _ in range(20):
        call_with_garbage(m, rng, 60)
        m.check_invariants()


@pytest.mark.parametrize("seed", range(3))
def test_scheduler_garbage_never_panics(seed: int) -> None:
    rng = random.Random(seed)
    keys = [
        "num_blocks",
        "block_size",
        "max_num_seqs",
        "max_num_batched_tokens",
        "max_model_len",
        "enable_prefix_caching",
        "policy",
        "watermark",
        "hash_bits",
        "enable_kv_events",
    ]
    for _ in range(60):
        kwargs = {k: rng.choice(GARBAGE + [4, 16, "fcfs", 0.1]) for k in rng.sample(keys, rng.randint(1, 4))}
        kwargs.setdefault("num_blocks", rng.choice(GARBAGE + [64]))
        try:
            SchedulerConfig(**kwargs)
        except pagedkv.PagedKVError:
            pass
    s = Scheduler(SchedulerConfig(num_blocks=64, block_size=4, max_model_len=64))
    s.add_request("live", [1, 2, 3], max_tokens=5)
    add_keys = [
        "min_tokens",
        "eos_token_ids",
        "stop_token_ids",
        "ignore_eos",
        "priority",
        "cache_salt",
        "n",
        "beam_width",
        "length_penalty",
    ]
    for i in range(300):
        kwargs = {k: rng.choice(GARBAGE) for k in rng.sample(add_keys, rng.randint(0, 3))}
        try:
            s.add_request(
                rng.choice(GARBAGE + [f"g{i}"]), rng.choice(GARBAGE), max_tokens=rng.choice(GARBAGE + [3]), **kwargs
            )
        except pagedkv.PagedKVError:
            pass
        if i % 10 == 0:
            out = s.schedule()
            done = False
            for bad in (rng.choice(GARBAGE), rng.choice(GARBAGE)):
                try:
                    s.update(out, bad)  # may be well-formed by chance (e.g. [] for 0 rows)
                    done = True
                    break
                except pagedkv.PagedKVError:
                    pass
            if not done:
                rows = len(out.beam_rows)
                ids = [[1, 2, 3, 4]] * rows if rows else None
                lps = [[-1.0, -2.0, -3.0, -4.0]] * rows if rows else None
                s.update(out, np.zeros(len(out.logits_indices), dtype=np.int64), ids, lps)
        try:
            s.abort_request(rng.choice(GARBAGE))
        except pagedkv.PagedKVError:
            pass
        s.check_invariants()
    call_with_garbage(s, rng, 100)
    s.check_invariants()


def test_beam_methods_never_panic() -> None:
    # update's beam candidates and take_beam_results with every garbage value, on a step that
    # samples a beam request: typed errors, and the step still takes good candidates after.
    rng = random.Random(7)
    s = Scheduler(SchedulerConfig(num_blocks=64, block_size=4, max_model_len=64))
    s.add_request("beam", [1, 2, 3], max_tokens=3, beam_width=2)
    while s.has_unfinished_requests():
        out = s.schedule()
        zeros = np.zeros(len(out.logits_indices), dtype=np.int64)
        for _ in range(40):
            try:
                s.update(out, zeros, rng.choice(GARBAGE), rng.choice(GARBAGE))  # type: ignore[arg-type]
                break  # well-formed by chance
            except pagedkv.PagedKVError:
                s.check_invariants()
        else:
            rows = len(out.beam_rows)
            s.update(out, zeros, [[5, 6, 7, 8]] * rows, [[-0.5, -1.0, -1.5, -2.0]] * rows)
        # The loop drives the steps: a garbage call that starts one (schedule_flush takes no
        # argument, so any call of it succeeds) would leave it without its update.
        call_with_garbage(s, rng, 10, skip=("schedule", "schedule_flush"))
        s.check_invariants()
    assert isinstance(s.take_beam_results(), list)
    assert s.stats().num_used_blocks == 0


def test_kv_event_methods_never_panic() -> None:
    # take_kv_events / block_hashes / reset_prefix_cache with every garbage value, on a
    # scheduler whose pool has cached blocks and events pending.
    s = Scheduler(SchedulerConfig(num_blocks=16, block_size=4, enable_kv_events=True))
    s.add_request("a", list(range(9)), max_tokens=3)
    out = s.schedule()
    s.update(out, [1])
    for g in GARBAGE:
        calls = (
            lambda: s.take_kv_events(g),  # type: ignore[arg-type]
            lambda: s.block_hashes(g),  # type: ignore[arg-type]
            lambda: s.block_hashes([1, 2, 3, 4], g),  # type: ignore[arg-type]
            lambda: s.block_hashes(g, cache_salt=g),  # type: ignore[arg-type]
            lambda: block_hashes(g, 4),  # type: ignore[arg-type]
            lambda: block_hashes([1, 2, 3, 4], g),  # type: ignore[arg-type]
            lambda: block_hashes([1, 2, 3, 4], 4, g),  # type: ignore[arg-type]
        )
        for call in calls:
            try:
                call()
            except pagedkv.PagedKVError:
                pass
        s.check_invariants()
    assert isinstance(s.reset_prefix_cache(), int)
    assert isinstance(s.take_kv_events(0.0), (bytes, type(None)))
    s.check_invariants()


def test_kv_transfer_methods_never_panic() -> None:
    # Leases and reservations (disaggregated prefill / decode) with every garbage value, on a
    # scheduler holding one of each.
    s = Scheduler(SchedulerConfig(num_blocks=16, block_size=4, max_model_len=64))
    s.add_request("p", list(range(9)), max_tokens=1, hold_kv=True)
    out = s.schedule()
    s.update(out, [1])
    assert s.kv_lease("p") is not None
    assert s.reserve_kv("r", list(range(100, 113)), 3) is not None
    for g in GARBAGE:
        calls = (
            lambda: s.add_request("h", [1, 2], max_tokens=1, hold_kv=g),  # type: ignore[arg-type]
            lambda: s.kv_lease(g),  # type: ignore[arg-type]
            lambda: s.release_kv_lease(g),  # type: ignore[arg-type]
            lambda: s.reserve_kv(g, [1, 2, 3, 4, 5], 1),  # type: ignore[arg-type]
            lambda: s.reserve_kv("x", g, 1),  # type: ignore[arg-type]
            lambda: s.reserve_kv("y", [1, 2, 3, 4, 5], g),  # type: ignore[arg-type]
            lambda: s.reserve_kv("z", [1, 2, 3, 4, 5], 1, g),  # type: ignore[arg-type]
            lambda: s.commit_kv(g),  # type: ignore[arg-type]
            lambda: s.cancel_kv(g),  # type: ignore[arg-type]
        )
        for call in calls:
            try:
                call()
            except pagedkv.PagedKVError:
                pass
        s.check_invariants()
    for name in s.kv_lease_ids():
        assert s.release_kv_lease(name)
    for name in ("r", "x", "y", "z"):
        s.cancel_kv(name)
    if s.has_unfinished_requests():
        s.abort_request("h")
    s.check_invariants()
    assert s.stats().num_used_blocks == 0
