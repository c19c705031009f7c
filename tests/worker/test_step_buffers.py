"""Step objects reused from step to step (rust/py/reuse.rs), `RequestUpdates`, and stats.

The scheduler hands out a step's numpy arrays and id lists again once nothing references them
(block tables rewritten only where rows changed). These tests check that this is invisible: a
run that drops every output at once gives the same arrays as a run that keeps every output
(nothing reusable), and an output, an array or a view still held never changes."""

from __future__ import annotations

import gc
from collections.abc import Sequence

import numpy as np
import pytest
from sim_model import FakeModel

import pagedkv
from pagedkv import Scheduler, SchedulerConfig

FIELDS = (
    "num_scheduled_tokens",
    "input_ids",
    "positions",
    "cu_seqlens_q",
    "seq_lens",
    "block_tables",
    "slot_mapping",
    "logits_indices",
    "sample_indices",
    "copy_ops",
)
LISTS = ("req_ids", "sampled_req_ids", "preempted_req_ids", "finished_req_ids", "finish_reasons")


def snapshot(out: pagedkv.SchedulerOutput) -> dict[str, object]:
    snap: dict[str, object] = {f: getattr(out, f).copy() for f in FIELDS}
    snap.update({f: list(getattr(out, f)) for f in LISTS})
    return snap


def assert_same(a: dict[str, object], b: dict[str, object], where: str) -> None:
    for key in FIELDS:
        x, y = a[key], b[key]
        assert isinstance(x, np.ndarray) and isinstance(y, np.ndarray)
        assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y), f"{where}: {key}"
    for key in LISTS:
        assert a[key] == b[key], f"{where}: {key}"


def workload(keep: bool, seed: int, hold_views: bool = False) -> tuple[list[dict[str, object]], list[list[tuple]]]:
    """A run with shared prefixes, n > 1, stops and preemption; per step the output's arrays
    (copied) and the updates. `keep`: every output stays referenced (no reuse possible)."""
    rng = np.random.default_rng(seed)
    bs, num_blocks = 4, 44
    s = Scheduler(
        SchedulerConfig(
            num_blocks=num_blocks, block_size=bs, max_num_seqs=10, max_num_batched_tokens=40, max_model_len=120
        )
    )
    model = FakeModel(num_blocks, bs)
    system = rng.integers(0, 997, size=13).tolist()
    kept: list[object] = []
    steps, updates = [], []
    added = 0
    for _ in range(400):
        while s.num_waiting < 6 and added < 60:
            prompt = (system if rng.random() < 0.5 else []) + rng.integers(
                0, 997, size=int(rng.integers(1, 30))
            ).tolist()
            s.add_request(
                f"q{added}",
                prompt,
                max_tokens=int(rng.integers(1, 40)),
                n=int(rng.choice([1, 1, 2, 3])),
                eos_token_ids=[5],
            )
            added += 1
        out = s.schedule()
        steps.append(snapshot(out))
        ups = s.update(out, model.execute(out))
        updates.append([(u.request_id, u.index, u.new_token_ids[0], u.finish_reason, u.num_cached_tokens) for u in ups])
        if keep:
            kept.append(out)
            kept.append(ups)
        elif hold_views:
            kept.append((out.block_tables[1:], steps[-1]["block_tables"]))
        del out, ups
        if not s.has_unfinished_requests() and added >= 60:
            break
    s.check_invariants()
    assert s.stats().num_preemptions > 0
    if hold_views:
        for view, expected in kept:  # type: ignore[misc]
            assert np.array_equal(view, expected[1:])
    return steps, updates


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reused_outputs_equal_fresh_ones(seed: int) -> None:
    fresh_steps, fresh_updates = workload(keep=True, seed=seed)
    steps, updates = workload(keep=False, seed=seed)
    assert len(steps) == len(fresh_steps) > 50
    for i, (a, b) in enumerate(zip(steps, fresh_steps)):
        assert_same(a, b, f"step {i}")
    assert updates == fresh_updates


def test_held_views_never_change() -> None:
    workload(keep=False, seed=3, hold_views=True)


def decode_scheduler(num_seqs: int = 8) -> tuple[Scheduler, np.ndarray]:
    s = Scheduler(SchedulerConfig(num_blocks=400, block_size=4, max_model_len=160))
    for i in range(num_seqs):
        s.add_request(f"r{i}", list(range(1, 20 + i)), max_tokens=100, ignore_eos=True)
    out = s.schedule()
    s.update(out, np.zeros(len(out.logits_indices), dtype=np.int64))
    return s, np.ones(num_seqs, dtype=np.int64)


def test_decode_steps_reuse_arrays_and_lists() -> None:
    s, tokens = decode_scheduler()
    ids: set[int] = set()
    for _ in range(12):
        out = s.schedule()
        ids.add(id(out.req_ids))
        ids.add(id(out.input_ids))
        s.update(out, tokens)
        del out
    # The same few objects come back (not one new object per step).
    assert len(ids) <= 8


def test_an_output_kept_is_never_rewritten() -> None:
    s, tokens = decode_scheduler()
    first = s.schedule()
    snap = snapshot(first)
    s.update(first, tokens)
    for _ in range(20):
        out = s.schedule()
        s.update(out, tokens)
        del out
    gc.collect()
    assert_same(snapshot(first), snap, "kept output")
    assert first.block_tables.flags.writeable and first.block_tables.flags.c_contiguous


def test_a_lone_array_kept_is_never_rewritten() -> None:
    s, tokens = decode_scheduler()
    out = s.schedule()
    tables, ids = out.block_tables, out.req_ids
    expected_tables, expected_ids = tables.copy(), list(ids)
    s.update(out, tokens)
    del out
    for _ in range(20):
        nxt = s.schedule()
        assert nxt.block_tables is not tables and nxt.req_ids is not ids
        s.update(nxt, tokens)
        del nxt
    assert np.array_equal(tables, expected_tables) and ids == expected_ids


def test_request_updates_is_a_sequence_with_columns() -> None:
    s = Scheduler(SchedulerConfig(num_blocks=32, block_size=4))
    s.add_request("a", [1, 2, 3], max_tokens=1)
    s.add_request("b", [4, 5], max_tokens=5, n=2)
    out = s.schedule()
    ups = s.update(out, [7, 8, 9])
    assert isinstance(ups, pagedkv._core.RequestUpdates) and isinstance(ups, Sequence)
    assert len(ups) == 3 and bool(ups)
    items = list(ups)
    assert [(u.request_id, u.index, u.new_token_ids, u.finish_reason, u.finished) for u in items] == [
        ("a", 0, [7], "length", True),
        ("b", 0, [8], None, False),
        ("b", 1, [9], None, False),
    ]
    assert ups.request_ids == ["a", "b", "b"]
    assert ups.indices == [0, 0, 1]
    assert ups.token_ids == [7, 8, 9]
    assert ups.finish_reasons == ["length", None, None]
    assert ups.num_cached_tokens == [u.num_cached_tokens for u in items] == [0, 0, 0]
    assert ups[-1].index == 1 and ups[0].request_id == "a"
    assert [u.request_id for u in ups[1:]] == ["b", "b"] and ups[::-1][0].index == 1
    with pytest.raises(IndexError):
        ups[3]
    (a, b0, b1) = ups
    assert (a.request_id, b0.index, b1.index) == ("a", 0, 1)
    it = iter(ups)
    assert next(it).request_id == "a" and len(list(it)) == 2
    assert "RequestUpdates" in repr(ups)
    out = s.schedule()
    empty = s.update(out, [1, 2])
    assert len(empty) == 2
    out = s.schedule()
    assert len(s.update(out, [3, 3])) == 2


def test_updates_kept_keep_their_ids() -> None:
    s, tokens = decode_scheduler(4)
    out = s.schedule()
    ups = s.update(out, tokens)
    ids = ups.request_ids
    for _ in range(5):
        out = s.schedule()
        s.update(out, tokens)
    assert ids == ["r0", "r1", "r2", "r3"] and [u.request_id for u in ups] == ids


def test_kv_utilization_is_zero_with_nothing_in_use() -> None:
    s = Scheduler(SchedulerConfig(num_blocks=16, block_size=4))
    st = s.stats()
    assert (st.num_used_blocks, st.slots_allocated, st.kv_utilization) == (0, 0, 0.0)
    assert st.as_dict()["kv_utilization"] == 0.0
    s.add_request("a", [1, 2, 3], max_tokens=1)
    out = s.schedule()
    assert s.stats().kv_utilization == pytest.approx(0.75)
    s.update(out, [9])
    st = s.stats()
    assert (st.num_used_blocks, st.kv_utilization) == (0, 0.0)


def test_stats_as_dict_has_every_attribute() -> None:
    st = Scheduler(SchedulerConfig(num_blocks=16, block_size=4)).stats()
    d = st.as_dict()
    for key, value in d.items():
        assert getattr(st, key) == value
    public = {name for name in dir(st) if not name.startswith("_") and name != "as_dict"}
    assert public == set(d)


def test_lists_mutated_and_dropped_do_not_leak_into_later_steps() -> None:
    s, tokens = decode_scheduler(4)
    for _ in range(6):
        out = s.schedule()
        assert out.req_ids == ["r0", "r1", "r2", "r3"] and out.sampled_req_ids == out.req_ids
        assert out.finished_req_ids == [] and out.preempted_req_ids == [] and out.finish_reasons == []
        out.req_ids.reverse()
        out.sampled_req_ids[0] = "zz"
        out.finished_req_ids.append("x")
        out.finish_reasons.append("stop")
        ups = s.update(out, tokens)
        assert ups.request_ids == ["r0", "r1", "r2", "r3"]
        ids = ups.request_ids
        ids.reverse()  # a copy: the updates are unchanged
        assert [u.request_id for u in ups] == ups.request_ids == ["r0", "r1", "r2", "r3"]
        del out, ups
