"""Disaggregated prefill / decode between two real engines (a tiny random model: the transfer
does not depend on the weights), per transport.

Both engines live in this process (the engine API is the same as behind a server; the
server-level flow with separate processes and the router is in test_router_disagg.py). The producer prefills with ``max_tokens=1`` and
``{"do_remote_decode": true}``; its output's ``kv_transfer_params`` go to the consumer, which
pulls the prompt's KV over NIXL (host memory) or gloo and decodes. Every greedy output is
compared with a plain engine's, and both engines must end with no block used, no lease and no
reservation. A tiny Gemma 3 (sliding-window layers, a 12-token window on 8-token blocks) moves
its KV cache groups: every group's blocks, greedy tokens equal to transformers'.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from typing import Any

import pytest
from kv_transports import TRANSPORTS, assert_idle, make_pair, prefill, run, wait_for_no_leases
from worker.test_attention_types import BLOCK, MAX_NEW, PROMPTS, _build, _greedy_reference, _reference

from pagedkv import LLMEngine, SamplingParams
from pagedkv.errors import ConfigError, InvalidArgumentError, KVTransferError
from pagedkv.server.launch import free_port
from pagedkv.worker.model_files import default_model_dir

ENGINE_ARGS = dict(device="cpu", dtype="float32", num_blocks=64, block_size=16, max_model_len=256)
TEXT = (
    "Paged attention stores the key and value cache in fixed-size blocks, so that a sequence is "
    "logically contiguous but physically scattered across the pool, and blocks return to a free "
    "list when a request finishes. Blocks can be shared between requests by reference count."
)
GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


@pytest.fixture(scope="module")
def engine_kw(tiny_model: str) -> dict[str, Any]:
    """The engines' keywords: the transfer does not depend on the weights, so a tiny model."""
    return {**ENGINE_ARGS, "model": tiny_model, "tokenizer": str(default_model_dir())}


@pytest.fixture(scope="module")
def reference(engine_kw: dict[str, Any]) -> Iterator[LLMEngine]:
    engine = LLMEngine(**engine_kw)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module", params=TRANSPORTS)
def pair(request: pytest.FixtureRequest, engine_kw: dict[str, Any]) -> Iterator[tuple[LLMEngine, LLMEngine]]:
    producer, consumer = make_pair(request.param, engine_kw)
    yield producer, consumer
    consumer.shutdown()
    producer.shutdown()


@pytest.fixture
def clean(pair: tuple[LLMEngine, LLMEngine], reference: LLMEngine) -> Iterator[tuple[LLMEngine, LLMEngine]]:
    for e in (*pair, reference):
        e.reset_prefix_cache()
    yield pair
    assert_idle(*pair)


def prompt_ids(reference: LLMEngine, n: int) -> list[int]:
    ids = reference.tokenizer(TEXT * 3)["input_ids"]
    assert len(ids) >= n
    return list(ids[:n])


_ids = iter(range(10**6))


def rid(tag: str) -> str:
    return f"{tag}-{next(_ids)}"


@pytest.mark.parametrize("length", [5, 32, 45])
def test_disaggregated_greedy_equals_one_engine(clean: Any, reference: LLMEngine, length: int) -> None:
    # 5 tokens: less than a block (nothing to pull, the lease is released at once); 32: block
    # aligned (the last block is recomputed, so 1 block moves); 45: two full blocks move.
    producer, consumer = clean
    prompt = {"prompt_token_ids": prompt_ids(reference, length)}
    params = prefill(producer, rid("p"), prompt)
    assert params["remote_num_tokens"] == length and len(params["remote_block_ids"]) == -(-length // 16)
    pulled = consumer.get_stats()["kv_blocks_pulled"]
    out = run(consumer, rid("d"), prompt, GREEDY, params)
    expected = run(reference, rid("r"), prompt, GREEDY)
    assert out.outputs[0].token_ids == expected.outputs[0].token_ids
    assert consumer.get_stats()["kv_blocks_pulled"] - pulled == (length - 1) // 16
    assert out.num_cached_tokens == (length - 1) // 16 * 16


def test_decode_side_prefix_hits_are_not_pulled(clean: Any, reference: LLMEngine) -> None:
    producer, consumer = clean
    ids = prompt_ids(reference, 70)  # 4 full blocks move at most
    run(consumer, rid("warm"), {"prompt_token_ids": ids[:40]}, SamplingParams(max_tokens=1))  # caches 2 blocks
    params = prefill(producer, rid("p"), {"prompt_token_ids": ids})
    pulled = consumer.get_stats()["kv_blocks_pulled"]
    out = run(consumer, rid("d"), {"prompt_token_ids": ids}, GREEDY, params)
    assert consumer.get_stats()["kv_blocks_pulled"] - pulled == 2  # blocks 2 and 3 only
    assert out.num_cached_tokens == 64
    assert out.outputs[0].token_ids == run(reference, rid("r"), {"prompt_token_ids": ids}, GREEDY).outputs[0].token_ids
    # The whole prompt cached on the decode side: nothing moves, the lease still ends now.
    params = prefill(producer, rid("p"), {"prompt_token_ids": ids})
    out = run(consumer, rid("d"), {"prompt_token_ids": ids}, GREEDY, params)
    assert consumer.get_stats()["kv_blocks_pulled"] - pulled == 2
    wait_for_no_leases(producer)


def test_parallel_samples_fork_after_the_pull(clean: Any, reference: LLMEngine) -> None:
    producer, consumer = clean
    prompt = {"prompt_token_ids": prompt_ids(reference, 50)}
    sampled = SamplingParams(n=3, max_tokens=8, temperature=0.8, seed=7)
    params = prefill(producer, rid("p"), prompt)
    out = run(consumer, rid("d"), prompt, sampled, params)
    expected = run(reference, rid("r"), prompt, sampled)
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in expected.outputs]


def test_abort_while_the_kv_is_arriving_frees_everything(clean: Any, reference: LLMEngine) -> None:
    producer, consumer = clean
    prompt = {"prompt_token_ids": prompt_ids(reference, 60)}
    params = prefill(producer, rid("p"), prompt)
    r = rid("d")
    consumer.add_request(r, prompt, GREEDY, kv_transfer_params=params)
    assert consumer.kv_connector is not None and consumer.kv_connector.is_loading(r)
    (aborted,) = consumer.abort_request(r)
    assert aborted.outputs[0].finish_reason == "abort"
    # Its blocks stay reserved until the read ends, then are freed; the lease is released.
    assert_idle(consumer)
    wait_for_no_leases(producer)


def test_expired_lease_recomputes_or_fails(clean: Any, reference: LLMEngine) -> None:
    producer, consumer = clean
    assert producer.kv_connector is not None and consumer.kv_connector is not None
    prompt = {"prompt_token_ids": prompt_ids(reference, 60)}
    expected = run(reference, rid("r"), prompt, GREEDY).outputs[0].token_ids
    p_cfg, c_cfg = producer.kv_connector.config, consumer.kv_connector.config
    try:
        producer.kv_connector.config = dataclasses.replace(p_cfg, lease_seconds=0.05)
        for policy in ("recompute", "fail"):
            consumer.kv_connector.config = dataclasses.replace(c_cfg, kv_load_failure_policy=policy)
            consumer.reset_prefix_cache()  # the recomputed prompt would be a local hit
            params = prefill(producer, rid("p"), prompt)
            time.sleep(0.1)
            producer.poll_kv_transfer()
            assert producer.get_stats()["num_kv_leases"] == 0 and producer.get_stats()["num_used_blocks"] == 0
            failed = consumer.get_stats()["kv_loads_failed"]
            out = run(consumer, rid("d"), prompt, GREEDY, params)
            assert consumer.get_stats()["kv_loads_failed"] == failed + 1
            if policy == "recompute":
                assert out.outputs[0].token_ids == expected
            else:
                assert out.error is not None and "KVTransferError" in out.error and "lease" in out.error
                assert out.outputs[0].finish_reason == "error"
    finally:
        producer.kv_connector.config, consumer.kv_connector.config = p_cfg, c_cfg


def test_bad_kv_transfer_params_are_refused(clean: Any, reference: LLMEngine, engine_kw: dict[str, Any]) -> None:
    producer, consumer = clean
    prompt = {"prompt_token_ids": prompt_ids(reference, 40)}
    params = prefill(producer, rid("p"), prompt)
    bad = [
        {"do_remote_prefil": True},
        {"do_remote_decode": "yes"},
        {"do_remote_decode": True, "do_remote_prefill": True},
        {**params, "remote_block_ids": [-1]},
        {**params, "remote_block_ids": [0]},  # too few for the tokens
        {**params, "remote_address": "http://x"},
        {k: v for k, v in params.items() if k != "remote_engine_id"},
        {**params, "prompt_digest": "0" * 32},  # another prompt's KV
        {"do_remote_decode": True},  # a consumer does not produce
    ]
    for p in bad:
        with pytest.raises(InvalidArgumentError):
            consumer.add_request(rid("bad"), prompt, GREEDY, kv_transfer_params=p)
    with pytest.raises(InvalidArgumentError):
        reference.add_request(rid("bad"), prompt, GREEDY, kv_transfer_params={"do_remote_decode": True})
    with pytest.raises(ConfigError):
        LLMEngine(**engine_kw, kv_transfer_config={"role": "producer", "lease_seconds": 0})
    with pytest.raises(ConfigError):
        LLMEngine(**engine_kw, kv_transfer_config={"role": "producer", "leases": 3})
    # Blocks the lease does not hold: refused at the claim (nothing read), the prompt is
    # recomputed, and the lease, its token evidently in bad hands, ends.
    forged = {**params, "remote_block_ids": [10_000, 10_001, 10_002]}
    out = run(consumer, rid("d"), prompt, GREEDY, forged)
    assert out.outputs[0].token_ids == run(reference, rid("r"), prompt, GREEDY).outputs[0].token_ids
    wait_for_no_leases(producer)
    params = prefill(producer, rid("p"), prompt)
    # Another block size is refused before anything is held.
    consumer.kv_connector.config = dataclasses.replace(  # type: ignore[union-attr]
        consumer.kv_connector.config,  # type: ignore[union-attr]
        kv_load_failure_policy="fail",
    )
    try:
        with pytest.raises(KVTransferError):
            consumer.add_request(rid("bs"), prompt, GREEDY, kv_transfer_params={**params, "remote_block_size": 32})
    finally:
        consumer.kv_connector.config = dataclasses.replace(  # type: ignore[union-attr]
            consumer.kv_connector.config,  # type: ignore[union-attr]
            kv_load_failure_policy="recompute",
        )
    # The lease is still there and is released by a well-formed pull.
    pulled = consumer.get_stats()["kv_blocks_pulled"]
    consumer.reset_prefix_cache()
    out = run(consumer, rid("d"), prompt, GREEDY, params)
    assert out.error is None and consumer.get_stats()["kv_blocks_pulled"] == pulled + 2


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_quantized_kv_and_a_dead_producer(transport: str, reference: LLMEngine, engine_kw: dict[str, Any]) -> None:
    producer, consumer = make_pair(transport, {**engine_kw, "kv_cache_dtype": "int8"})
    quantized = LLMEngine(**engine_kw, kv_cache_dtype="int8")
    try:
        prompt = {"prompt_token_ids": prompt_ids(reference, 60)}
        expected = run(quantized, rid("r"), prompt, GREEDY).outputs[0].token_ids
        params = prefill(producer, rid("p"), prompt)
        assert params["remote_kv_dtype"] == "int8"
        out = run(consumer, rid("d"), prompt, GREEDY, params)
        assert out.outputs[0].token_ids == expected
        assert consumer.get_stats()["kv_blocks_pulled"] == 3
        # The producer dies holding a lease: the pull fails, then per policy.
        params = prefill(producer, rid("p"), prompt)
        producer.shutdown()
        assert consumer.kv_connector is not None
        cfg = consumer.kv_connector.config
        consumer.kv_connector.config = dataclasses.replace(cfg, handshake_timeout=1.0, transfer_timeout=5.0)
        consumer.reset_prefix_cache()
        out = run(consumer, rid("d"), prompt, GREEDY, params)
        assert out.outputs[0].token_ids == expected  # recomputed
        consumer.kv_connector.config = dataclasses.replace(consumer.kv_connector.config, kv_load_failure_policy="fail")
        consumer.reset_prefix_cache()
        out = run(consumer, rid("d"), prompt, GREEDY, params)
        assert out.error is not None and "KVTransferError" in out.error
        assert consumer.get_stats()["kv_loads_failed"] == 2
        assert_idle(consumer)
    finally:
        consumer.shutdown()
        producer.shutdown()
        quantized.shutdown()


def test_a_silent_peer_and_another_model_cost_a_recompute(clean: Any, reference: LLMEngine) -> None:
    producer, consumer = clean
    connector = consumer.kv_connector
    assert connector is not None
    prompt = {"prompt_token_ids": prompt_ids(reference, 60)}
    expected = run(reference, rid("r"), prompt, GREEDY).outputs[0].token_ids
    config, fingerprint = connector.config, connector.fingerprint
    try:
        connector.config = dataclasses.replace(config, handshake_timeout=0.5)
        # A control address where nobody answers: the handshake times out.
        params = prefill(producer, rid("p"), prompt)
        silent = {**params, "remote_address": f"tcp://127.0.0.1:{free_port()}"}
        failed = consumer.get_stats()["kv_loads_failed"]
        out = run(consumer, rid("d"), prompt, GREEDY, silent)
        assert out.outputs[0].token_ids == expected
        assert consumer.get_stats()["kv_loads_failed"] == failed + 1
        producer.kv_connector.drop_lease(params["remote_request_id"])  # type: ignore[union-attr]
        # A producer whose model or KV format differs is refused at the handshake.
        connector.fingerprint = {**fingerprint, "model_digest": "another model"}
        connector._peers.clear()  # the transfer thread is idle: no pull in flight
        consumer.reset_prefix_cache()
        params = prefill(producer, rid("p"), prompt)
        out = run(consumer, rid("d"), prompt, GREEDY, params)
        assert out.outputs[0].token_ids == expected
        assert consumer.get_stats()["kv_loads_failed"] == failed + 2
    finally:
        connector.config, connector.fingerprint = config, fingerprint
        connector._peers.clear()


@pytest.fixture(scope="module", params=TRANSPORTS)
def windowed(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, LLMEngine, LLMEngine]]:
    """A producer / consumer pair serving a tiny Gemma 3 (three sliding-window layers to one
    full: four KV cache groups) with KV cache groups on."""
    folder = _build(tmp_path_factory.mktemp("windowed") / "gemma3_text", "gemma3_text")
    engine = dict(
        model=folder,
        tokenizer=str(default_model_dir()),
        device="cpu",
        dtype="float32",
        block_size=BLOCK,
        num_blocks=96,
        max_model_len=128,
        max_num_batched_tokens=32,
    )
    producer, consumer = make_pair(request.param, engine)
    yield folder, producer, consumer
    consumer.shutdown()
    producer.shutdown()


def test_kv_cache_groups_travel_every_group(windowed: tuple[str, LLMEngine, LLMEngine]) -> None:
    folder, producer, consumer = windowed
    groups = consumer.runner.kv_layout.num_kv_groups
    assert groups == producer.runner.kv_layout.num_kv_groups == 4  # groups on, with kv_transfer_config
    assert consumer.kv_connector is not None and "kv_layout" in consumer.kv_connector.fingerprint
    model = _reference(folder)
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    long, shorter = PROMPTS[1], PROMPTS[0]  # 57 and 40 tokens: several windows long
    # Decode-side hits: the consumer caches the first two blocks of every group (the sliding
    # groups' given back behind the window, still cached), so only the rest moves.
    run(consumer, rid("warm"), {"prompt_token_ids": long[:20]}, SamplingParams(max_tokens=1))
    for prompt, hits in ((long, 2), (shorter, 0)):
        expected, _ = _greedy_reference(model, prompt)
        params = prefill(producer, rid("p"), {"prompt_token_ids": prompt})
        # The lease holds the whole prompt in every group, group-major.
        per_group = -(-len(prompt) // BLOCK)
        assert len(params["remote_block_ids"]) == groups * per_group
        assert len(set(params["remote_block_ids"])) == groups * per_group
        pulled = consumer.get_stats()["kv_blocks_pulled"]
        out = run(consumer, rid("d"), {"prompt_token_ids": prompt}, greedy, params)
        assert out.error is None
        assert out.outputs[0].token_ids == expected
        full = (len(prompt) - 1) // BLOCK
        assert consumer.get_stats()["kv_blocks_pulled"] - pulled == groups * (full - hits)
        assert out.num_cached_tokens == full * BLOCK
    # Block ids that are not whole groups: a typed refusal before anything is held.
    params = prefill(producer, rid("p"), {"prompt_token_ids": long})
    torn = {**params, "remote_block_ids": params["remote_block_ids"][:-1]}
    with pytest.raises(InvalidArgumentError, match="KV cache group"):
        consumer.add_request(rid("bad"), {"prompt_token_ids": long}, greedy, kv_transfer_params=torn)
    producer.kv_connector.drop_lease(params["remote_request_id"])  # type: ignore[union-attr]
    # A producer whose KV is laid out otherwise (here: every layer whole, as with
    # disable_hybrid_kv_cache_manager) is refused at the handshake: its fingerprint lacks this
    # layout. The prompt is recomputed.
    connector = consumer.kv_connector
    fingerprint = connector.fingerprint
    try:
        connector.fingerprint = {k: v for k, v in fingerprint.items() if k != "kv_layout"}
        connector._peers.clear()  # the transfer thread is idle: no pull in flight
        consumer.reset_prefix_cache()
        failed = consumer.get_stats()["kv_loads_failed"]
        params = prefill(producer, rid("p"), {"prompt_token_ids": long})
        out = run(consumer, rid("d"), {"prompt_token_ids": long}, greedy, params)
        assert consumer.get_stats()["kv_loads_failed"] == failed + 1
        assert out.outputs[0].token_ids == _greedy_reference(model, long)[0]
        producer.kv_connector.drop_lease(params["remote_request_id"])  # type: ignore[union-attr]
    finally:
        connector.fingerprint = fingerprint
        connector._peers.clear()
    wait_for_no_leases(producer)
    assert_idle(producer, consumer)
    for e in (producer, consumer):
        stats = e.get_stats()
        assert stats["num_free_blocks"] == stats["num_blocks"], stats
