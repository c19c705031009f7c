"""Admission: a request that waits before it can run — for its grammar to compile, for its
prompt's KV to arrive from another engine, or both — is a request of the scheduler from
``add_request`` on, blocked on what it waits for (``Scheduler.waiting_for``) and never
scheduled until unblocked. Aborted in each state, or failed by a grammar that does not compile
or a pull that fails, nothing of it may be left anywhere: not in the engine, the scheduler, the
grammar compiler (its compile handle: a compile nobody else waits for that has not started is
cancelled), the connector (its pull, its reservation), nor a block
(``LLMEngine.check_invariants`` cross-checks all of them).

One consumer engine, with a single compile thread that the tests keep busy (so a grammar waits
in the queue for as long as a test wants) and a pull thread they hold at its claim (so a pull
stays in flight), pulling from a producer over gloo.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from kv_transports import TIMEOUT, assert_idle, make_pair, prefill, wait_for_no_leases

from pagedkv import LLMEngine, SamplingParams
from pagedkv.distributed.connector import KVConnector
from pagedkv.engine.outputs import RequestOutput
from pagedkv.errors import DuplicateRequestError, KVTransferError
from pagedkv.structured import StructuredOutputsParams
from pagedkv.worker.model_files import default_model_dir

ENGINE_ARGS = dict(device="cpu", dtype="float32", num_blocks=64, block_size=16, max_model_len=256)
GREEDY = SamplingParams(max_tokens=6, temperature=0.0)
_n = itertools.count()


@pytest.fixture(scope="module")
def pair(tiny_model: str) -> Iterator[tuple[LLMEngine, LLMEngine]]:
    engine = {
        **ENGINE_ARGS,
        "model": tiny_model,
        "tokenizer": str(default_model_dir()),
        "structured_outputs_config": {"compile_workers": 1},
    }
    producer, consumer = make_pair("gloo", engine)
    yield producer, consumer
    consumer.shutdown()
    producer.shutdown()


def fresh_regex() -> str:
    """A regex no earlier request used (so its compile is never a cache hit)."""
    return f"q{next(_n)}[a-z]+"


def constrained(regex: str) -> SamplingParams:
    return SamplingParams(max_tokens=4, temperature=0.0, structured_outputs={"regex": regex})


def prompt(engine: LLMEngine, n: int, offset: int) -> dict[str, list[int]]:
    """``n`` token ids of a fixed text from ``offset`` (distinct offsets: distinct prompts)."""
    ids = engine.tokenizer("Paged attention keeps the KV cache in blocks of fixed size. " * 20)["input_ids"]
    return {"prompt_token_ids": list(ids[offset : offset + n])}


@contextlib.contextmanager
def busy_compile_thread(engine: LLMEngine) -> Iterator[threading.Event]:
    """The engine's only compile thread compiles a grammar that waits for the event: every
    other grammar waits in the queue (not started) until it is set."""
    release = threading.Event()
    busy_regex = fresh_regex()
    compile_one = engine.grammars._compile

    def held(params: StructuredOutputsParams, key: Any) -> Any:
        if params.regex == busy_regex:
            release.wait(TIMEOUT)
        return compile_one(params, key)

    engine.grammars._compile = held  # type: ignore[method-assign]
    busy = engine.grammars.compile(StructuredOutputsParams(regex=busy_regex))
    try:
        yield release
    finally:
        release.set()
        busy.result(TIMEOUT)
        del engine.grammars._compile  # type: ignore[method-assign]


@contextlib.contextmanager
def held_pulls(connector: KVConnector, fail: bool = False) -> Iterator[threading.Event]:
    """The pull thread stops at its next claim until the event is set (every pull stays in
    flight); with ``fail`` the claims then fail (the producer went away)."""
    release = threading.Event()
    claim = connector._claim

    def held(load: Any) -> None:
        release.wait(TIMEOUT)
        if fail:
            raise KVTransferError("injected: the producer went away")
        claim(load)

    connector._claim = held  # type: ignore[method-assign]
    try:
        yield release
    finally:
        release.set()
        del connector._claim  # type: ignore[method-assign]


def step_until_done(engine: LLMEngine, ids: set[str]) -> dict[str, RequestOutput]:
    """Steps until every request of ``ids`` ended; their final outputs."""
    finished: dict[str, RequestOutput] = {}
    deadline = time.monotonic() + TIMEOUT
    while not ids <= finished.keys():
        assert time.monotonic() < deadline, f"{ids - finished.keys()} did not finish"
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    return finished


def assert_nothing_left(producer: LLMEngine, consumer: LLMEngine) -> None:
    """Once every pull ended: no request, compile, pull, reservation, lease or block is held."""
    assert_idle(consumer)
    wait_for_no_leases(producer)
    state = consumer.check_invariants()
    for key in (
        "num_unfinished_requests",
        "num_used_blocks",
        "num_waiting_for_grammar",
        "num_waiting_for_remote_kv",
        "num_held_compiles",
        "num_kv_loads",
        "num_kv_reservations",
    ):
        assert state[key] == 0, (key, state)
    assert consumer.grammars.num_queued == 0


def test_requests_aborted_in_every_waiting_state_leave_nothing(pair: tuple[LLMEngine, LLMEngine]) -> None:
    producer, consumer = pair
    connector = consumer.kv_connector
    assert connector is not None
    k_prompt, gk_prompt = prompt(consumer, 40, 0), prompt(consumer, 50, 3)
    k_params, gk_params = (prefill(producer, f"p{next(_n)}", p) for p in (k_prompt, gk_prompt))
    cancelled = consumer.grammars.num_cancelled
    with busy_compile_thread(consumer), held_pulls(connector):
        consumer.add_request("g", "x", constrained(fresh_regex()))
        consumer.add_request("k", k_prompt, GREEDY, kv_transfer_params=k_params)
        consumer.add_request("gk", gk_prompt, constrained(fresh_regex()), kv_transfer_params=gk_params)
        consumer.add_request("run", "Hello there", SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
        waits = {r: consumer.scheduler.waiting_for(r) for r in ("g", "k", "gk", "run")}
        assert waits == {"g": ["grammar"], "k": ["remote_kv"], "gk": ["grammar", "remote_kv"], "run": []}
        state = consumer.check_invariants()
        assert (state["num_waiting_for_grammar"], state["num_waiting_for_remote_kv"]) == (2, 2)
        assert (state["num_held_compiles"], state["num_kv_loads"], state["num_kv_reservations"]) == (2, 2, 2)
        states = {s[0]: s[2] for s in consumer.scheduler.request_summaries()}
        assert states["g"] == "waiting_for_grammar" and states["k"] == "waiting_for_remote_kv"
        for _ in range(3):  # blocked requests are never scheduled; the plain one runs
            assert {out.request_id for out in consumer.step()} == {"run"}
        assert consumer.scheduler.request_summaries()[-1][2] == "running"
        for r in ("g", "k", "gk", "run"):
            (out,) = consumer.abort_request(r)
            assert out.finished and out.outputs[0].finish_reason == "abort"
            consumer.check_invariants()
        state = consumer.check_invariants()
        assert state["num_unfinished_requests"] == 0 and state["num_held_compiles"] == 0
        assert (state["num_waiting_for_grammar"], state["num_waiting_for_remote_kv"]) == (0, 0)
        # Both grammars were queued, not started, and nobody else waited for them: cancelled.
        assert consumer.grammars.num_cancelled == cancelled + 2
        # The pulls go on until their reads end (they may still write the reserved blocks):
        # meanwhile the id cannot wait for remote KV again.
        assert (state["num_kv_loads"], state["num_kv_reservations"]) == (2, 2)
        with pytest.raises(DuplicateRequestError):
            consumer.add_request("k", k_prompt, GREEDY, kv_transfer_params=k_params)
    assert_nothing_left(producer, consumer)
    assert not connector.loads


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_failing_grammar_or_pull_ends_only_its_request(pair: tuple[LLMEngine, LLMEngine], policy: str) -> None:
    producer, consumer = pair
    connector = consumer.kv_connector
    assert connector is not None
    config = connector.config
    connector.config = dataclasses.replace(config, kv_load_failure_policy=policy)
    try:
        consumer.reset_prefix_cache()
        kv_prompt, both_prompt = prompt(consumer, 40, 10), prompt(consumer, 50, 20)
        kv_params, both_params = (prefill(producer, f"p{next(_n)}", p) for p in (kv_prompt, both_prompt))
        failed = consumer.get_stats()["failed_requests"]
        with busy_compile_thread(consumer) as compiles, held_pulls(connector, fail=True) as pulls:
            consumer.add_request("bad-grammar", "x", constrained(f"(q{next(_n)}[a-z"))  # does not compile
            consumer.add_request("bad-kv", kv_prompt, GREEDY, kv_transfer_params=kv_params)
            consumer.add_request("bad-both", both_prompt, constrained(fresh_regex()), kv_transfer_params=both_params)
            consumer.add_request("ok", "Hello there", GREEDY)
            assert consumer.scheduler.waiting_for("bad-both") == ["grammar", "remote_kv"]
            consumer.check_invariants()
            compiles.set()
            pulls.set()
            outs = step_until_done(consumer, {"bad-grammar", "bad-kv", "bad-both", "ok"})
        bad = outs["bad-grammar"]
        assert bad.outputs[0].finish_reason == "error" and "StructuredOutputError" in (bad.error or "")
        assert outs["ok"].outputs[0].finish_reason == "length"
        if policy == "fail":
            for r in ("bad-kv", "bad-both"):
                assert outs[r].outputs[0].finish_reason == "error" and "injected" in (outs[r].error or "")
            assert consumer.get_stats()["failed_requests"] == failed + 3
        else:  # the prompts are computed here instead
            assert outs["bad-kv"].outputs[0].finish_reason == "length" and outs["bad-kv"].num_cached_tokens == 0
            assert outs["bad-both"].outputs[0].finish_reason in ("stop", "length")
            assert consumer.get_stats()["failed_requests"] == failed + 1
        assert_nothing_left(producer, consumer)
    finally:
        connector.config = config
