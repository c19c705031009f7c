"""The KV offload tiers through the Python API: retention priorities and durations decide what
the prefix cache keeps, swap preemption emits well-formed copy arrays, bad settings are typed
errors, and the engine (real SmolLM2) keeps serving with the right tokens when a step that
carries swaps fails, and serves prefix hits from the host tier."""

from __future__ import annotations

import math

import pytest

from pagedkv import LLM, LLMEngine, SamplingParams
from pagedkv._core import Scheduler, SchedulerConfig
from pagedkv.errors import ConfigError, InvalidArgumentError, InvalidTypeError

BS = 4


def run_to_end(s: Scheduler) -> None:
    """Drive every request to its end, sampling token 1 everywhere (no model)."""
    while s.has_unfinished_requests():
        out = s.schedule()
        s.update(out, [1] * len(out.logits_indices))
        s.check_invariants()


def prompt(seed: int, n_blocks: int) -> list[int]:
    return [seed * 1000 + i for i in range(n_blocks * BS + 1)]


def cached_tokens(s: Scheduler, tokens: list[int], rid: str) -> int:
    """Prompt tokens a new request over ``tokens`` finds in the prefix cache."""
    before = s.stats().prefix_cache_hits
    s.add_request(rid, tokens, max_tokens=1)
    run_to_end(s)
    return s.stats().prefix_cache_hits - before


def test_high_retention_priority_outlives_default_blocks() -> None:
    s = Scheduler(SchedulerConfig(num_blocks=24, block_size=BS, max_model_len=48))
    keep, drop = prompt(1, 4), prompt(2, 4)
    s.add_request("keep", keep, max_tokens=1, retention_priority=90)
    s.add_request("drop", drop, max_tokens=1, retention_priority=10)
    run_to_end(s)
    # Churn: distinct prompts whose blocks must evict some cached ones.
    for i in range(6):
        s.add_request(f"churn-{i}", prompt(10 + i, 4), max_tokens=1)
        run_to_end(s)
    assert cached_tokens(s, keep, "keep-again") == 4 * BS
    assert cached_tokens(s, drop, "drop-again") == 0


def test_retention_tokens_limit_the_priority_to_a_leading_span() -> None:
    s = Scheduler(SchedulerConfig(num_blocks=24, block_size=BS, max_model_len=48))
    shared = prompt(1, 4)
    # Only the first two blocks (a "system prompt") are kept at priority 90.
    s.add_request("first", shared, max_tokens=1, retention_priority=90, retention_tokens=2 * BS)
    run_to_end(s)
    for i in range(6):
        s.add_request(f"churn-{i}", prompt(10 + i, 4), max_tokens=1)
        run_to_end(s)
    assert cached_tokens(s, shared, "again") == 2 * BS


def test_retention_duration_expires_to_the_default_priority() -> None:
    def survivor(advance: float) -> int:
        s = Scheduler(SchedulerConfig(num_blocks=24, block_size=BS, max_model_len=48, manual_clock=True))
        old = prompt(1, 4)
        s.add_request("old", old, max_tokens=1, retention_priority=90, retention_duration=1.0)
        run_to_end(s)
        s.advance_clock(advance)
        for i in range(6):
            s.add_request(f"churn-{i}", prompt(10 + i, 4), max_tokens=1)
            run_to_end(s)
        return cached_tokens(s, old, "old-again")

    assert survivor(0.0) == 4 * BS  # within its duration: kept at priority 90
    assert survivor(5.0) == 0  # expired: least recently used at the default priority, evicted


def test_swap_preemption_emits_copy_arrays_and_loses_nothing() -> None:
    config = SchedulerConfig(num_blocks=16, block_size=BS, max_model_len=64, num_host_blocks=64, preemption_mode="swap")
    assert (config.num_host_blocks, config.preemption_mode) == (64, "swap")
    s = Scheduler(config)
    for i in range(6):
        s.add_request(f"r{i}", prompt(i, 3), max_tokens=20, ignore_eos=True)
    seen_out = seen_in = False
    while s.has_unfinished_requests():
        out = s.schedule()
        for name, array in (("swap_out", out.swap_out), ("swap_in", out.swap_in)):
            assert array.ndim == 2 and array.shape[1] == 2, name
        if len(out.swap_out):
            seen_out = True
            assert out.swap_out[:, 0].max() < 16 and out.swap_out[:, 1].max() < 64
            assert len(set(out.swap_out[:, 1].tolist())) == len(out.swap_out)
        if len(out.swap_in):
            seen_in = True
            assert out.swap_in[:, 0].max() < 64 and out.swap_in[:, 1].max() < 16
        s.update(out, [1] * len(out.logits_indices))
        s.check_invariants()
    stats = s.stats()
    assert seen_out and seen_in and stats.num_swap_preemptions > 0
    assert stats.num_free_blocks == 16 and stats.num_host_used_blocks == 0 and stats.num_swapped == 0
    host_refs = s.tier_map()[1]
    assert len(host_refs) == 64 and not host_refs.any()


def test_bad_tier_and_retention_settings_are_typed_errors() -> None:
    with pytest.raises(ConfigError, match="host tier"):
        SchedulerConfig(num_blocks=16, block_size=BS, preemption_mode="swap")
    with pytest.raises(ConfigError, match="preemption_mode"):
        SchedulerConfig(num_blocks=16, block_size=BS, num_host_blocks=4, preemption_mode="sometimes")
    with pytest.raises(ConfigError, match="disk tier"):
        SchedulerConfig(num_blocks=16, block_size=BS, num_disk_blocks=8)
    with pytest.raises(InvalidArgumentError):
        SchedulerConfig(num_blocks=16, block_size=BS, num_host_blocks=-1)
    s = Scheduler(SchedulerConfig(num_blocks=16, block_size=BS, max_model_len=64))
    for bad in (101, -1, 1000):
        with pytest.raises(InvalidArgumentError, match="retention_priority"):
            s.add_request("x", [1, 2, 3], max_tokens=1, retention_priority=bad)
    with pytest.raises(InvalidTypeError):
        s.add_request("x", [1, 2, 3], max_tokens=1, retention_priority="high")
    for bad_duration in (-1.0, math.nan, math.inf):
        with pytest.raises(InvalidArgumentError, match="retention_duration"):
            s.add_request("x", [1, 2, 3], max_tokens=1, retention_duration=bad_duration)
    assert not s.has_unfinished_requests()  # nothing was queued by the failed calls
    for kwargs in ({"retention_priority": 101}, {"retention_priority": -3}, {"retention_duration": -1.0}):
        with pytest.raises(ConfigError, match="retention"):
            SamplingParams(**kwargs)
    with pytest.raises(ConfigError):
        SamplingParams(retention_priority="80")
    with pytest.raises(ConfigError, match="retention_tokens"):
        SamplingParams(retention_tokens=-1)
    with pytest.raises(InvalidArgumentError):
        s.add_request("x", [1, 2, 3], max_tokens=1, retention_tokens=-4)


TEXTS = [
    "Tell me about the moon and the tides and why the sea rises twice a day, " * 3,
    "Write a short poem about autumn leaves falling in a quiet park at dusk, " * 3,
    "Explain how a paged KV cache works in a language model server, " * 3,
    "What is the capital of France, and why has it been the capital so long? " * 3,
]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0)
TIGHT = {"dtype": "float32", "device": "cpu", "block_size": 16, "num_blocks": 12, "max_model_len": 192}


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    llm = LLM(dtype="float32", device="cpu", block_size=16, max_model_len=192, kv_cache_memory=64 << 20)
    return [list(o.outputs[0].token_ids) for o in llm.generate(TEXTS, GREEDY, use_tqdm=False)]


def test_a_failing_step_with_swaps_loses_nothing(reference: list[list[int]], monkeypatch: pytest.MonkeyPatch) -> None:
    engine = LLMEngine(**TIGHT, num_host_blocks=64, preemption_mode="swap")
    for i, text in enumerate(TEXTS):
        engine.add_request(str(i), text, GREEDY)
    real_execute = engine.runner.execute
    failures = {"left": 2}

    def flaky(step: object, *args: object) -> object:
        # Fail after the swaps may have run part-way: the first steps that swap.
        if failures["left"] and (len(step.swap_out) or len(step.swap_in)):  # type: ignore[attr-defined]
            failures["left"] -= 1
            real_execute(step, *args)
            raise RuntimeError("injected failure after the copies")
        return real_execute(step, *args)

    monkeypatch.setattr(engine.runner, "execute", flaky)
    outputs: dict[str, list[int]] = {}
    raised = 0
    for _ in range(2000):
        if not engine.has_unfinished_requests():
            break
        try:
            for o in engine.step():
                if o.finished:
                    outputs[o.request_id] = list(o.outputs[0].token_ids)
        except RuntimeError:
            raised += 1
        engine.scheduler.check_invariants()
    assert raised >= 1, "the injected failure never fired: nothing was swapped"
    assert [outputs[str(i)] for i in range(len(TEXTS))] == reference
    stats = engine.get_stats()
    assert stats["num_free_blocks"] == stats["num_blocks"] and stats["num_host_used_blocks"] == 0


def test_host_tier_serves_prefix_hits_after_device_eviction(reference: list[list[int]]) -> None:
    llm = LLM(**TIGHT, num_host_blocks=64)
    first = [list(o.outputs[0].token_ids) for o in llm.generate(TEXTS, GREEDY, use_tqdm=False)]
    # The 12-block device pool cannot keep all four prompts cached: the second pass finds the
    # evicted ones on the host tier (written back when the device reused their blocks).
    second = [list(o.outputs[0].token_ids) for o in llm.generate(TEXTS, GREEDY, use_tqdm=False)]
    assert first == second == reference
    stats = llm.llm_engine.get_stats()
    assert stats["num_write_backs"] > 0
    assert stats["prefix_cache_host_hits"] > 0 and stats["blocks_swapped_in"] > 0
    on_host, host_refs, host_cached = llm.llm_engine.scheduler.tier_map()
    assert host_cached.any() and not host_refs.any()
