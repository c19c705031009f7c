"""KV-cache events: produced by the Rust scheduler in vLLM's wire format, decoded with the msgspec
structs of pagedkv.server.kv_events, and published over ZMQ with vLLM's replay protocol."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator

import pytest
from sim_model import FakeModel

import pagedkv
from pagedkv import Scheduler, SchedulerConfig
from pagedkv._core import MAX_BLOCK_SIZE, block_hashes
from pagedkv.errors import ConfigError, InvalidArgumentError, InvalidTypeError

zmq = pytest.importorskip("zmq")
pytest.importorskip("msgspec")

from pagedkv.server.kv_events import (  # noqa: E402
    REPLAY_END,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventPublisher,
    decode_event_batch,
    encode_event_batch,
)

BS = 4


def make(num_blocks: int = 16, **kw: object) -> tuple[Scheduler, FakeModel]:
    cfg = SchedulerConfig(num_blocks=num_blocks, block_size=BS, enable_kv_events=True, **kw)  # type: ignore[arg-type]
    return Scheduler(cfg), FakeModel(num_blocks, BS)


def run(s: Scheduler, model: FakeModel, *prompts: list[int], salt: str | None = None, max_tokens: int = 1) -> None:
    for i, p in enumerate(prompts):
        s.add_request(f"r{time.perf_counter_ns()}-{i}", p, max_tokens=max_tokens, cache_salt=salt)
    while s.has_unfinished_requests():
        out = s.schedule()
        s.update(out, model.execute(out))


def take(s: Scheduler, ts: float = 123.5) -> list[BlockStored | BlockRemoved | AllBlocksCleared]:
    payload = s.take_kv_events(ts)
    assert payload is not None, "expected events"
    batch = decode_event_batch(payload)
    assert batch.ts == ts
    # msgspec writes exactly the bytes the Rust core wrote.
    assert encode_event_batch(batch) == payload
    return batch.events


def stored(events: list[BlockStored | BlockRemoved | AllBlocksCleared], medium: str) -> list[int]:
    return [h for e in events if isinstance(e, BlockStored) and e.medium == medium for h in e.block_hashes]


def removed(events: list[BlockStored | BlockRemoved | AllBlocksCleared], medium: str) -> list[int]:
    return [h for e in events if isinstance(e, BlockRemoved) and e.medium == medium for h in e.block_hashes]


def test_prompt_blocks_are_stored_under_the_router_hashes() -> None:
    s, model = make()
    assert s.config.enable_kv_events
    assert s.take_kv_events(1.0) is None, "nothing happened yet"
    prompt = list(range(100, 113))  # three full blocks and one token
    hashes = s.block_hashes(prompt)
    assert len(hashes) == 3 and all(0 <= h < 2**64 for h in hashes) and len(set(hashes)) == 3
    run(s, model, prompt)
    assert take(s) == [
        BlockStored(
            block_hashes=hashes,
            parent_block_hash=None,
            token_ids=prompt[:12],
            block_size=BS,
            lora_id=None,
            medium="GPU",
        )
    ]
    assert s.take_kv_events(2.0) is None, "taken once"
    # A longer prompt with the same prefix: only its new blocks, chained to the cached ones.
    longer = prompt[:12] + list(range(200, 209))
    run(s, model, longer)
    longer_hashes = s.block_hashes(longer)
    assert longer_hashes[:3] == hashes
    assert take(s) == [
        BlockStored(
            block_hashes=longer_hashes[3:5],
            parent_block_hash=hashes[2],
            token_ids=longer[12:20],
            block_size=BS,
            lora_id=None,
            medium="GPU",
        )
    ]


def test_a_cache_salt_changes_the_hashes() -> None:
    s, model = make()
    prompt = list(range(9))
    plain = s.block_hashes(prompt)
    salted = s.block_hashes(prompt, cache_salt="tenant-a")
    assert len(salted) == 2 and set(salted).isdisjoint(plain)
    assert s.block_hashes(prompt, "tenant-b") != salted
    assert s.block_hashes(prompt, None) == plain
    run(s, model, prompt, salt="tenant-a")
    assert stored(take(s), "GPU") == salted
    assert s.block_hashes(prompt[:3]) == []


def test_block_hashes_without_a_scheduler() -> None:
    # What a router calls: the same hashes for the same block size, no engine needed.
    s, _ = make()
    block_size = s.config.block_size
    prompt = list(range(50, 90))
    assert block_hashes(prompt, block_size) == s.block_hashes(prompt)
    assert block_hashes(prompt, block_size, "t") == s.block_hashes(prompt, "t")
    assert block_hashes(prompt, 2 * block_size) != s.block_hashes(prompt)[: len(prompt) // (2 * block_size)]
    with pytest.raises(ConfigError, match="block_size"):
        block_hashes(prompt, 0)
    with pytest.raises(ConfigError, match="block_size"):
        block_hashes(prompt, MAX_BLOCK_SIZE + 1)


def test_evicted_blocks_are_removed() -> None:
    s, model = make(num_blocks=8)
    prompt = list(range(1000, 1009))
    run(s, model, prompt)
    first = stored(take(s), "GPU")
    # Another prompt needs every block of the pool: the cached ones are reused.
    run(s, model, list(range(2000, 2029)))
    events = take(s)
    assert set(first) <= set(removed(events, "GPU"))
    # Removed before the new content that reused them is stored (one pool, in order).
    assert isinstance(events[0], BlockRemoved)


def test_reset_with_nothing_in_use_clears_all() -> None:
    s, model = make()
    run(s, model, list(range(9)), list(range(50, 70)))
    take(s)
    assert s.reset_prefix_cache() == 2 + 5
    assert take(s) == [AllBlocksCleared()]
    assert s.stats().num_cached_blocks == 0
    # Still announced when there was nothing left to drop: consumers may resynchronize.
    assert s.reset_prefix_cache() == 0
    assert take(s) == [AllBlocksCleared()]


def test_reset_with_blocks_in_use_removes_only_the_free_ones() -> None:
    s, model = make()
    run(s, model, list(range(9)))
    done = stored(take(s), "GPU")
    s.add_request("live", list(range(40, 49)), max_tokens=4)
    out = s.schedule()
    live = stored(take(s), "GPU")
    assert s.reset_prefix_cache() == 2
    assert take(s) == [BlockRemoved(block_hashes=done[::-1], medium="GPU")]
    s.update(out, model.execute(out))
    assert s.stats().num_cached_blocks == len(live)


def test_host_tier_write_backs_are_stored_on_cpu() -> None:
    s, model = make(num_blocks=8, num_host_blocks=16)
    prompt = list(range(500, 517))
    run(s, model, prompt)
    hashes = stored(take(s), "GPU")
    assert hashes == s.block_hashes(prompt)
    run(s, model, list(range(600, 632)))
    events = take(s)
    assert set(hashes) <= set(removed(events, "GPU"))
    # Evicted leaves first, announced parents first as one chain.
    cpu = [e for e in events if isinstance(e, BlockStored) and e.medium == "CPU"]
    assert cpu == [
        BlockStored(
            block_hashes=hashes,
            parent_block_hash=None,
            token_ids=prompt[:16],
            block_size=BS,
            lora_id=None,
            medium="CPU",
        )
    ]


def test_a_rolled_back_step_stores_then_removes() -> None:
    s, model = make()
    prompt = list(range(9))
    s.add_request("a", prompt, max_tokens=1)
    out = s.schedule()
    s.rollback_step(out)
    hashes = s.block_hashes(prompt)
    events = take(s)
    assert stored(events, "GPU") == hashes and removed(events, "GPU") == hashes
    assert isinstance(events[0], BlockStored) and isinstance(events[1], BlockRemoved)


def test_events_off_give_none() -> None:
    s = Scheduler(SchedulerConfig(num_blocks=16, block_size=BS))
    assert not s.config.enable_kv_events
    run(s, FakeModel(16, BS), list(range(9)))
    assert s.reset_prefix_cache() == 2
    assert s.take_kv_events(1.0) is None
    # Without prefix caching nothing is ever cached: no events even when asked for.
    s, model = make(enable_prefix_caching=False)
    run(s, model, list(range(9)))
    assert s.take_kv_events(1.0) is None


def test_bad_arguments_are_typed_errors() -> None:
    s, _ = make()
    with pytest.raises(InvalidTypeError):
        s.take_kv_events("now")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        s.take_kv_events(math.nan)
    with pytest.raises(InvalidTypeError):
        s.block_hashes("abc")  # type: ignore[arg-type]
    with pytest.raises(pagedkv.errors.InvalidTokenError):
        s.block_hashes([-1, 2, 3, 4])
    with pytest.raises(InvalidTypeError):
        s.block_hashes([1, 2, 3, 4], cache_salt=5)  # type: ignore[arg-type]
    with pytest.raises(InvalidTypeError):
        SchedulerConfig(num_blocks=4, enable_kv_events=1)  # type: ignore[arg-type]
    for garbage in (b"", b"\x00", b"\x92\xcb", b"\x92\x00\x90\x00"):
        with pytest.raises(InvalidArgumentError):
            decode_event_batch(garbage)


# The publisher over loopback -----------------------------------------------------------------

TIMEOUT_MS = 3000


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def recv(sock: zmq.Socket, what: str) -> list[bytes]:
    assert sock.poll(TIMEOUT_MS), f"no {what} within {TIMEOUT_MS} ms"
    return sock.recv_multipart()


def replay(ctx: zmq.Context, endpoint: str, start: int) -> list[tuple[int, bytes]]:
    dealer = ctx.socket(zmq.DEALER)
    try:
        dealer.connect(endpoint)
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        got = []
        while True:
            empty, seq, payload = recv(dealer, "replay frame")
            assert empty == b""
            if seq == REPLAY_END:
                assert payload == b""
                return got
            got.append((int.from_bytes(seq, "big"), payload))
    finally:
        dealer.close(linger=0)


def test_subscriber_receives_batches_in_order(ctx: zmq.Context) -> None:
    with KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", topic="kv@worker0") as pub:
        assert pub.endpoint.startswith("tcp://127.0.0.1:") and not pub.endpoint.endswith("*")
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(pub.endpoint)
        # A subscription reaches the publisher asynchronously: probe until one arrives.
        deadline = time.monotonic() + TIMEOUT_MS / 1000
        first = None
        probes = 0
        while first is None:
            assert time.monotonic() < deadline, "the subscriber never connected"
            pub.publish(b"probe")
            probes += 1
            if sub.poll(20):
                first = sub.recv_multipart()
        topic, seq, payload = first
        assert topic == b"kv@worker0" and payload == b"probe" and len(seq) == 8
        start = int.from_bytes(seq, "big")
        # Real batches from a scheduler, then: consecutive sequence numbers, bytes unchanged.
        s, model = make()
        sent = []
        for i in range(3):
            run(s, model, list(range(100 * i, 100 * i + 9)))
            payload = s.take_kv_events(float(i))
            assert payload is not None
            pub.publish(payload)
            sent.append(payload)
        seen: list[bytes] = []
        while len(seen) < 3:
            topic, seq, payload = recv(sub, "batch")
            if payload == b"probe":
                continue  # a probe published before the first one arrived
            assert int.from_bytes(seq, "big") == probes + len(seen)
            seen.append(payload)
        assert seen == sent
        assert [decode_event_batch(p).ts for p in seen] == [0.0, 1.0, 2.0]
        # Every batch ever published is numbered 0, 1, 2, ... (the replay has them all).
        everything = replay(ctx, pub.replay_endpoint or "", 0)
        assert [q for q, _ in everything] == list(range(probes + 3))
        assert start < probes and everything[-3:] == [(probes + i, p) for i, p in enumerate(sent)]
        sub.close(linger=0)


def test_late_subscriber_replays_missed_batches(ctx: zmq.Context) -> None:
    with KVEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", buffer_steps=4) as pub:
        for i in range(6):
            pub.publish(b"batch-%d" % i)
        assert pub.replay_endpoint is not None
        # The last four are buffered; a request from seq 3 gets 3, 4, 5 and the end marker.
        got = replay(ctx, pub.replay_endpoint, 3)
        assert got == [(3, b"batch-3"), (4, b"batch-4"), (5, b"batch-5")]
        assert replay(ctx, pub.replay_endpoint, 0) == [(i, b"batch-%d" % i) for i in range(2, 6)]
        assert replay(ctx, pub.replay_endpoint, 99) == []
        # A malformed request is answered with the end marker alone.
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(pub.replay_endpoint)
        dealer.send_multipart([b"", b"short"])
        assert recv(dealer, "end marker") == [b"", REPLAY_END, b""]
        dealer.close(linger=0)


def test_bad_endpoints_and_arguments_raise_config_errors() -> None:
    with pytest.raises(ConfigError, match="not-an-endpoint"):
        KVEventPublisher("not-an-endpoint")
    with KVEventPublisher("tcp://127.0.0.1:*") as taken:
        with pytest.raises(ConfigError, match=taken.endpoint):
            KVEventPublisher(taken.endpoint)
        with pytest.raises(ConfigError, match="replay endpoint"):
            KVEventPublisher("tcp://127.0.0.1:*", taken.endpoint)
    for kwargs in ({"buffer_steps": -1}, {"hwm": "10"}, {"max_queue_size": 0}, {"topic": 5}):
        with pytest.raises(ConfigError):
            KVEventPublisher("tcp://127.0.0.1:*", **kwargs)  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        KVEventPublisher("")


def test_publish_is_typed_and_a_no_op_once_closed() -> None:
    pub = KVEventPublisher("tcp://127.0.0.1:*")
    with pytest.raises(InvalidTypeError):
        pub.publish("text")  # type: ignore[arg-type]
    pub.publish(bytearray(b"ok"))
    pub.close()
    pub.close()
    pub.publish(b"after close")
    assert pub.num_dropped == 0


def test_batch_struct_round_trip() -> None:
    batch = KVEventBatch(
        ts=1.25,
        events=[
            BlockStored(
                block_hashes=[2**64 - 1, 3],
                parent_block_hash=7,
                token_ids=[1, 2],
                block_size=1,
                lora_id=None,
                medium="DISK",
            ),
            BlockRemoved(block_hashes=[5], medium="CPU"),
            AllBlocksCleared(),
        ],
    )
    payload = encode_event_batch(batch)
    assert decode_event_batch(payload) == batch
    # vLLM's layout: tags first, array-like, no trailing data_parallel_rank.
    import msgspec

    assert msgspec.msgpack.decode(payload) == [
        1.25,
        [
            ["BlockStored", [2**64 - 1, 3], 7, [1, 2], 1, None, "DISK"],
            ["BlockRemoved", [5], "CPU"],
            ["AllBlocksCleared"],
        ],
    ]
    # A vLLM batch with its data_parallel_rank decodes too.
    assert decode_event_batch(msgspec.msgpack.encode([2.0, [["AllBlocksCleared"]], 3])) == KVEventBatch(
        ts=2.0, events=[AllBlocksCleared()]
    )
