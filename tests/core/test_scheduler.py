"""pagedkv.Scheduler: exact small cases, stops, aborts, preemption, parallel sampling, stats,
and bad input that must change nothing."""

from __future__ import annotations

import numpy as np
import pytest
from sim_model import FakeModel, reference_tokens, run_to_completion

import pagedkv
from pagedkv import Scheduler, SchedulerConfig


def make(num_blocks: int = 16, block_size: int = 4, **kw: object) -> tuple[Scheduler, FakeModel]:
    cfg = SchedulerConfig(num_blocks=num_blocks, block_size=block_size, **kw)  # type: ignore[arg-type]
    return Scheduler(cfg), FakeModel(num_blocks, block_size)


def test_two_request_step_exact_arrays() -> None:
    s, _ = make(num_blocks=8, block_size=4)
    s.add_request("a", [10, 11, 12, 13, 14], max_tokens=4)
    s.add_request("b", [20, 21, 22], max_tokens=4)
    out = s.schedule()
    assert out.req_ids == ["a", "b"]
    assert out.num_scheduled_tokens.dtype == np.int32 and out.num_scheduled_tokens.tolist() == [5, 3]
    assert out.input_ids.dtype == np.int64 and out.input_ids.tolist() == [10, 11, 12, 13, 14, 20, 21, 22]
    assert out.positions.tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    assert out.cu_seqlens_q.tolist() == [0, 5, 8]
    assert out.seq_lens.tolist() == [5, 3]
    # a gets blocks 0 and 1, b gets block 2; rows padded with 0.
    assert out.block_tables.dtype == np.int32 and out.block_tables.tolist() == [[0, 1], [2, 0]]
    assert out.slot_mapping.dtype == np.int64 and out.slot_mapping.tolist() == [0, 1, 2, 3, 4, 8, 9, 10]
    assert out.logits_indices.tolist() == [4, 7]
    assert out.sampled_req_ids == ["a", "b"] and out.sample_indices.tolist() == [0, 0]
    assert out.copy_ops.shape == (0, 2)
    ups = s.update(out, np.array([30, 40], dtype=np.int32))
    assert [(u.request_id, u.new_token_ids, u.finish_reason) for u in ups] == [("a", [30], None), ("b", [40], None)]
    out = s.schedule()
    assert out.input_ids.tolist() == [30, 40]
    assert out.positions.tolist() == [5, 3]
    assert out.slot_mapping.tolist() == [5, 11]
    assert out.seq_lens.tolist() == [6, 4]


def test_chunked_prefill_across_steps() -> None:
    s, model = make(num_blocks=16, block_size=4, max_num_batched_tokens=4)
    prompt = list(range(100, 110))
    s.add_request("long", prompt, max_tokens=2)
    chunks = []
    while True:
        out = s.schedule()
        chunks.append((out.positions.tolist(), out.logits_indices.tolist()))
        ups = s.update(out, model.execute(out))
        if ups:
            break
    assert chunks == [([0, 1, 2, 3], []), ([4, 5, 6, 7], []), ([8, 9], [1])]
    assert ups[0].new_token_ids == reference_tokens(prompt, 1)


def test_prefix_hit_starts_first_chunk_after_cached_blocks() -> None:
    s, model = make(num_blocks=16, block_size=4)
    system = [7, 7, 7, 7, 8, 8, 8, 8]
    s.add_request("first", system + [1, 2], max_tokens=1)
    tokens, _ = run_to_completion(s, model)
    s.add_request("second", system + [3], max_tokens=3)
    out = s.schedule()
    assert out.positions.tolist() == [8]  # the two cached blocks are skipped
    assert out.input_ids.tolist() == [3]
    ups = s.update(out, model.execute(out))
    assert ups[0].num_cached_tokens == 8
    assert ups[0].new_token_ids == reference_tokens(system + [3], 1)
    stats = s.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (19, 8)


def test_preempted_request_resumes_with_the_same_tokens() -> None:
    prompts = {f"r{i}": [i * 10 + k for k in range(6)] for i in range(4)}
    # A pool of 8 blocks x 4 tokens cannot hold four requests growing to 26 tokens each.
    s, model = make(num_blocks=8, block_size=4, max_model_len=32)
    for rid, p in prompts.items():
        s.add_request(rid, p, max_tokens=20)
    tokens, reasons = run_to_completion(s, model)
    stats = s.stats()
    assert stats.num_preemptions > 0
    assert stats.resumed_prefix_queries > 0
    for rid, p in prompts.items():
        assert tokens[(rid, 0)] == reference_tokens(p, 20)
        assert reasons[(rid, 0)] == "length"
    assert stats.num_free_blocks == 8


def test_copy_on_write_for_parallel_samples_sharing_a_partial_block() -> None:
    s, model = make(num_blocks=16, block_size=4)
    prompt = [5, 6, 7, 8, 9, 10]  # the second block is partial
    s.add_request("p", prompt, max_tokens=3, n=3)
    out = s.schedule()
    assert out.sampled_req_ids == ["p", "p", "p"] and out.sample_indices.tolist() == [0, 1, 2]
    assert out.logits_indices.tolist() == [5, 5, 5]
    s.update(out, model.execute(out))
    assert s.num_running == 3
    out = s.schedule()
    # All three write position 6 into the shared partial block: two get private copies.
    assert out.copy_ops.shape == (2, 2)
    src = {int(x) for x in out.copy_ops[:, 0]}
    assert len(src) == 1
    tables = out.block_tables.tolist()
    assert len({t[0] for t in tables}) == 1  # the full first block stays shared
    assert len({t[1] for t in tables}) == 3
    s.update(out, model.execute(out))
    # A fresh run from the start: every sample equals its contiguous reference.
    s2, model2 = make(num_blocks=16, block_size=4)
    s2.add_request("p", prompt, max_tokens=3, n=3)
    tokens, reasons = run_to_completion(s2, model2)
    for i in range(3):
        assert tokens[("p", i)] == reference_tokens(prompt, 3, index=i)
        assert reasons[("p", i)] == "length"
    assert len({tuple(tokens[("p", i)]) for i in range(3)}) == 3
    assert s2.stats().num_free_blocks == 16


def test_parallel_sampling_uses_fewer_blocks_than_separate_requests() -> None:
    prompt = list(range(40))
    s, model = make(num_blocks=64, block_size=4, enable_prefix_caching=False)
    s.add_request("p", prompt, max_tokens=2, n=4)
    out = s.schedule()
    s.update(out, model.execute(out))
    s.schedule()
    shared = s.stats().num_used_blocks
    s2, model2 = make(num_blocks=64, block_size=4, enable_prefix_caching=False)
    for i in range(4):
        s2.add_request(f"p{i}", prompt, max_tokens=2)
    out = s2.schedule()
    s2.update(out, model2.execute(out))
    s2.schedule()
    separate = s2.stats().num_used_blocks
    assert shared == 10 + 4 - 0  # 10 prompt blocks shared; position 40 opens one block each
    assert separate == 4 * 11
    assert shared < separate


@pytest.mark.parametrize(
    ("kwargs", "sampled", "expect_tokens", "reason"),
    [
        ({"max_tokens": 3}, [5, 6, 7], 3, "length"),
        ({"max_tokens": 5, "eos_token_ids": [6]}, [5, 6, 7], 2, "stop"),
        ({"max_tokens": 5, "eos_token_ids": [6], "ignore_eos": True}, [5, 6, 7, 8, 9], 5, "length"),
        ({"max_tokens": 5, "stop_token_ids": [7]}, [5, 6, 7], 3, "stop"),
        ({"max_tokens": 5, "eos_token_ids": [5], "min_tokens": 2}, [5, 5, 5], 2, "stop"),
        ({"max_tokens": 50}, [1] * 10, 6, "length"),  # max_model_len 10 with a 4-token prompt
    ],
)
def test_token_based_stops(kwargs: dict[str, object], sampled: list[int], expect_tokens: int, reason: str) -> None:
    s, _ = make(num_blocks=8, block_size=4, max_model_len=10)
    s.add_request("r", [1, 2, 3, 4], **kwargs)  # type: ignore[arg-type]
    got = []
    for t in sampled:
        out = s.schedule()
        (u,) = s.update(out, [t])
        got.append(u)
        if u.finished:
            break
    assert len(got) == expect_tokens
    assert got[-1].finish_reason == reason
    assert all(u.finish_reason is None for u in got[:-1])
    out = s.schedule()
    assert out.finished_req_ids == ["r"] and out.finish_reasons == [reason]
    assert not s.has_unfinished_requests()
    assert s.stats().num_free_blocks == 8


def test_abort_frees_blocks_at_once_and_is_reported_next_step() -> None:
    s, model = make(num_blocks=8, block_size=4)
    s.add_request("a", list(range(10)), max_tokens=5)
    s.add_request("b", list(range(50, 55)), max_tokens=5)
    s.add_request("c", [1], max_tokens=5)
    out = s.schedule()
    s.update(out, model.execute(out))
    used = s.stats().num_used_blocks
    s.abort_request("a")
    assert s.stats().num_used_blocks == used - 3
    s.abort_request("c")
    out = s.schedule()
    assert sorted(zip(out.finished_req_ids, out.finish_reasons)) == [("a", "abort"), ("c", "abort")]
    assert out.req_ids == ["b"]
    with pytest.raises(pagedkv.UnknownRequestError):
        s.abort_request("a")
    s.update(out, model.execute(out))
    s.check_invariants()
    assert s.stats().num_aborted == 2


def test_blocked_requests_wait_for_unblock_and_abort_says_what_they_waited_for() -> None:
    s, model = make()
    s.add_request("g", [1, 2, 3], max_tokens=2, wait_for=["grammar"])
    s.add_request("gk", [4, 5, 6], max_tokens=2, wait_for=("grammar", "remote_kv"))
    s.add_request("a", [7, 8], max_tokens=2)
    assert (s.waiting_for("g"), s.waiting_for("gk"), s.waiting_for("a"), s.waiting_for("x")) == (
        ["grammar"],
        ["grammar", "remote_kv"],
        [],
        None,
    )
    stats = s.stats()
    assert (stats.num_waiting, stats.num_waiting_for_grammar, stats.num_waiting_for_remote_kv) == (1, 2, 1)
    out = s.schedule()
    assert out.req_ids == ["a"]  # blocked requests are never scheduled
    s.update(out, model.execute(out))
    # Bad reasons change nothing.
    for bad in ("grammar", ["grammar", "gpu"], [1]):
        with pytest.raises((pagedkv.InvalidArgumentError, pagedkv.InvalidTypeError)):
            s.add_request("z", [1], max_tokens=1, wait_for=bad)  # type: ignore[arg-type]
    with pytest.raises(pagedkv.InvalidArgumentError):
        s.unblock("g", "remote_kv")  # it does not wait for that
    with pytest.raises(pagedkv.InvalidArgumentError):
        s.unblock("g", "gpu")
    with pytest.raises(pagedkv.UnknownRequestError):
        s.unblock("x", "grammar")
    assert s.unblock("g", "grammar") is True
    assert s.unblock("gk", "grammar") is False  # still waits for its KV
    out = s.schedule()
    assert set(out.req_ids) == {"a", "g"}
    s.update(out, model.execute(out))
    assert s.abort_request("gk") == ["remote_kv"]
    assert s.abort_request("g") == []
    s.check_invariants()


def test_abort_between_schedule_and_update_drops_the_token() -> None:
    s, model = make()
    s.add_request("a", [1, 2, 3], max_tokens=5)
    s.add_request("b", [4, 5, 6], max_tokens=5)
    out = s.schedule()
    s.abort_request("a")
    ups = s.update(out, model.execute(out))
    assert [u.request_id for u in ups] == ["b"]
    s.check_invariants()


def test_priority_policy_admits_and_preempts_by_priority() -> None:
    s, model = make(num_blocks=4, block_size=4, max_model_len=16, policy="priority", max_num_seqs=1)
    s.add_request("low", [1, 2], max_tokens=3, priority=5)
    s.add_request("high", [3, 4], max_tokens=3, priority=-1)
    out = s.schedule()
    assert out.req_ids == ["high"]
    s.update(out, model.execute(out))
    fcfs, model2 = make(num_blocks=4, block_size=4, max_model_len=16, max_num_seqs=1)
    fcfs.add_request("low", [1, 2], max_tokens=3, priority=5)
    fcfs.add_request("high", [3, 4], max_tokens=3, priority=-1)
    assert fcfs.schedule().req_ids == ["low"]


def test_stats_fields() -> None:
    s, model = make(num_blocks=10, block_size=4)
    s.add_request("a", list(range(6)), max_tokens=4)
    out = s.schedule()
    s.update(out, model.execute(out))
    st = s.stats()
    assert (st.num_blocks, st.num_used_blocks, st.num_free_blocks) == (10, 2, 8)
    assert st.kv_usage == pytest.approx(0.2)
    assert (st.tokens_held, st.slots_allocated) == (6, 8)
    assert st.kv_utilization == pytest.approx(6 / 8)
    assert (st.num_running, st.num_waiting, st.num_steps) == (1, 0, 1)
    d = st.as_dict()
    assert d["kv_utilization"] == st.kv_utilization and "prefix_cache_hit_rate" in d


@pytest.mark.parametrize(
    ("kwargs", "exc"),
    [
        ({"num_blocks": 0}, pagedkv.ConfigError),
        ({"num_blocks": 4, "block_size": 0}, pagedkv.ConfigError),
        ({"num_blocks": 4, "block_size": 4, "max_model_len": 17}, pagedkv.ConfigError),
        ({"num_blocks": 4, "max_num_seqs": 0}, pagedkv.ConfigError),
        ({"num_blocks": 4, "max_num_batched_tokens": -1}, pagedkv.ConfigError),
        ({"num_blocks": 4, "policy": "lifo"}, pagedkv.ConfigError),
        ({"num_blocks": 4, "watermark": 1.5}, pagedkv.ConfigError),
        ({"num_blocks": 4, "watermark": "x"}, pagedkv.InvalidTypeError),
        ({"num_blocks": 4.0}, pagedkv.InvalidTypeError),
    ],
)
def test_config_validation(kwargs: dict[str, object], exc: type[Exception]) -> None:
    with pytest.raises(exc):
        SchedulerConfig(**kwargs)  # type: ignore[arg-type]


def test_bad_input_changes_nothing() -> None:
    s, model = make(num_blocks=8, block_size=4, max_model_len=16)
    s.add_request("ok", [1, 2, 3], max_tokens=4)
    out = s.schedule()
    before = s.stats().as_dict()
    bad_adds = [
        (("ok", [1]), {"max_tokens": 1}, pagedkv.DuplicateRequestError),
        (("e", []), {"max_tokens": 1}, pagedkv.InvalidArgumentError),
        (("long", list(range(17))), {"max_tokens": 1}, pagedkv.PromptTooLongError),
        (("m", [1]), {"max_tokens": 0}, pagedkv.InvalidArgumentError),
        (("m", [1]), {"max_tokens": -3}, pagedkv.InvalidArgumentError),
        (("m", [1]), {"max_tokens": 2, "min_tokens": 3}, pagedkv.InvalidArgumentError),
        (("neg", [1, -1]), {"max_tokens": 1}, pagedkv.InvalidTokenError),
        (("big", [2**31]), {"max_tokens": 1}, pagedkv.InvalidTokenError),
        (("f", np.array([1.0])), {"max_tokens": 1}, pagedkv.InvalidTypeError),
        ((5, [1]), {"max_tokens": 1}, pagedkv.InvalidTypeError),
        (("n", [1]), {"max_tokens": 1, "n": 0}, pagedkv.InvalidArgumentError),
        (("salt", [1]), {"max_tokens": 1, "cache_salt": 3}, pagedkv.InvalidTypeError),
    ]
    for args, kwargs, exc in bad_adds:
        with pytest.raises(exc):
            s.add_request(*args, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(pagedkv.UnknownRequestError):
        s.abort_request("nope")
    with pytest.raises(pagedkv.InvalidArgumentError):
        s.update(out, [1, 2])  # one logits row, two tokens
    with pytest.raises(pagedkv.InvalidTypeError):
        s.update(out, np.array([1.5]))
    with pytest.raises(pagedkv.InvalidTokenError):
        s.update(out, [-4])
    with pytest.raises(pagedkv.InvalidTypeError):
        s.update("not an output", [1])  # type: ignore[arg-type]
    with pytest.raises(pagedkv.StaleOutputError):
        s.schedule()  # the step in flight was not updated
    assert s.stats().as_dict() == before
    s.check_invariants()
    # The step in flight still completes normally.
    ups = s.update(out, model.execute(out))
    assert [u.request_id for u in ups] == ["ok"]
    with pytest.raises(pagedkv.StaleOutputError):
        s.update(out, [1])  # the same output twice
    nxt = s.schedule()
    with pytest.raises(pagedkv.StaleOutputError):
        s.update(out, [1])  # an older step's output
    s.update(nxt, model.execute(nxt))
    s.check_invariants()


def test_many_random_requests_match_reference() -> None:
    rng = np.random.default_rng(0)
    s, model = make(num_blocks=24, block_size=4, max_model_len=64, max_num_batched_tokens=24, max_num_seqs=8)
    prompts = {}
    for i in range(60):
        p = rng.integers(0, 900, size=int(rng.integers(1, 30))).tolist()
        prompts[f"q{i}"] = (p, int(rng.integers(1, 20)))
        s.add_request(f"q{i}", p, max_tokens=prompts[f"q{i}"][1], priority=int(rng.integers(0, 3)))
    tokens, reasons = run_to_completion(s, model)
    for rid, (p, m) in prompts.items():
        want = reference_tokens(p, min(m, 64 - len(p)))
        assert tokens[(rid, 0)] == want
        assert reasons[(rid, 0)] == "length"
    assert s.stats().num_preemptions > 0
    assert s.stats().num_free_blocks == 24


def test_finish_sample_ends_one_sample_then_the_request() -> None:
    s, model = make(num_blocks=16, block_size=4)
    s.add_request("p", [1, 2, 3, 4, 5], max_tokens=8, n=2)
    out = s.schedule()
    s.update(out, model.execute(out))
    assert s.num_running == 2
    used = s.stats().num_used_blocks
    assert s.finish_sample("p", 1) is True
    assert s.finish_sample("p", 1) is False
    assert s.num_running == 1 and s.stats().num_used_blocks == used  # all blocks were shared
    out = s.schedule()
    assert out.sample_indices.tolist() == [0] and out.finished_req_ids == []
    s.update(out, model.execute(out))
    assert s.finish_sample("p", 0) is True
    out = s.schedule()
    assert out.finished_req_ids == ["p"] and out.finish_reasons == ["stop"]
    with pytest.raises(pagedkv.UnknownRequestError):
        s.finish_sample("p", 0)
    s.update(out, model.execute(out))
    s.check_invariants()
    assert s.stats().num_free_blocks == 16


def _scheduler_request(**changes: object) -> object:
    """The engine's typed request (pagedkv.engine.admission), with ``changes``."""
    import dataclasses

    from pagedkv.engine.admission import SchedulerRequest

    fields = dict(
        request_id="r",
        prompt_token_ids=[1, 2, 3, 4, 5],
        max_tokens=3,
        min_tokens=0,
        eos_token_ids=[],
        stop_token_ids=[],
        ignore_eos=False,
        priority=0,
        n=2,
        retention_priority=None,
        retention_duration=None,
        retention_tokens=None,
        cache_salt=None,
        hold_kv=False,
        beam_width=None,
        length_penalty=None,
        skip_prefix_cache=False,
        speculate=True,
        wait_for=[],
    )
    return dataclasses.replace(SchedulerRequest(**fields), **changes)  # type: ignore[arg-type]


def test_add_takes_the_typed_request_as_add_request_takes_keywords() -> None:
    """``Scheduler.add`` (the engine's one call) converts and checks the same fields as
    ``add_request``: the same steps for a good request, the same typed error for a bad field,
    a clear one for an object that is not a request; a refused request changes nothing."""
    typed, _ = make()
    typed.add(_scheduler_request())
    keywords, _ = make()
    keywords.add_request("r", [1, 2, 3, 4, 5], max_tokens=3, n=2)
    a, b = typed.schedule(), keywords.schedule()
    assert a.req_ids == b.req_ids and np.array_equal(a.input_ids, b.input_ids)
    assert np.array_equal(a.sample_indices, b.sample_indices)
    for bad, error in (
        (_scheduler_request(request_id="x", max_tokens=-1), pagedkv.errors.InvalidArgumentError),
        (_scheduler_request(request_id="y", prompt_token_ids=[1, -2]), pagedkv.errors.InvalidArgumentError),
        (_scheduler_request(request_id="z", wait_for=["nothing"]), pagedkv.errors.InvalidArgumentError),
        (_scheduler_request(), pagedkv.errors.DuplicateRequestError),
    ):
        with pytest.raises(error):
            typed.add(bad)
        kw = {f: getattr(bad, f) for f in bad.__dataclass_fields__}  # type: ignore[attr-defined]
        with pytest.raises(error):
            keywords.add_request(kw.pop("request_id"), kw.pop("prompt_token_ids"), **kw)
    with pytest.raises(pagedkv.errors.InvalidArgumentError, match="no attribute .request_id"):
        typed.add(object())
    assert typed.stats().num_waiting + typed.stats().num_running == 1
