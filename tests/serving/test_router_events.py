"""The router's KV-event subscription (``pagedkv.router.subscriber``) against a ZMQ PUB socket
this test controls, standing in for a replica's event endpoint (bound on a free loopback
port, as a replica binds it): malformed messages are skipped and counted while the
subscription goes on, a sequence that restarts at 0 with newer batches is a restarted replica
(its index restarts empty, then follows the new history), and ``resync`` starts over.
(Real replicas, one of them restarted: test_router.py.)"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest

zmq = pytest.importorskip("zmq")

from pagedkv.router.prefix_index import PrefixIndex  # noqa: E402
from pagedkv.router.subscriber import EventSubscriber  # noqa: E402
from pagedkv.server.kv_events import BlockStored, KVEventBatch, encode_event_batch  # noqa: E402

TIMEOUT = 30.0


def stored(ts: float, *hashes: int) -> bytes:
    event = BlockStored(
        block_hashes=list(hashes),
        parent_block_hash=None,
        token_ids=list(range(16 * len(hashes))),
        block_size=16,
        lora_id=None,
        medium=None,
    )
    return encode_event_batch(KVEventBatch(ts=ts, events=[event]))


class Publisher:
    """A PUB socket on a free port; :meth:`until` publishes a message until a condition holds
    (a SUB socket misses what is published before its connection is up)."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"

    def until(self, frames: list[bytes], condition: Callable[[], bool]) -> None:
        deadline = time.monotonic() + TIMEOUT
        while not condition():
            assert time.monotonic() < deadline, "the subscriber never got the message"
            self.sock.send_multipart(frames)
            time.sleep(0.02)

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


@pytest.fixture
def publisher() -> Iterator[Publisher]:
    pub = Publisher()
    yield pub
    pub.close()


def seq(n: int) -> bytes:
    return n.to_bytes(8, "big")


def test_bad_messages_are_skipped_and_a_restarted_sequence_starts_a_new_history(publisher: Publisher) -> None:
    index = PrefixIndex()
    sub = EventSubscriber(index, publisher.endpoint, None)
    try:
        # Not msgpack, then a wrong frame count, then a short sequence number: counted, skipped.
        publisher.until([b"", seq(0), b"\xc1 not msgpack"], lambda: sub.bad_messages >= 1)
        publisher.until([b"", seq(0)], lambda: sub.bad_messages >= 2)
        publisher.until([b"", b"\x01", stored(1.0, 7)], lambda: sub.bad_messages >= 3)
        assert sub.state()["running"]
        # The subscription goes on: good batches are applied in order.
        publisher.until([b"", seq(0), stored(100.0, 11)], lambda: index.match([11]) == 1)
        publisher.until([b"", seq(1), stored(101.0, 12)], lambda: index.match([12]) == 1)
        assert sub.last_seq == 1 and index.num_batches == 2
        # A copy of an applied batch (its timestamp is not newer) changes nothing (the
        # connection is up, and one PUB's messages arrive in order: before the next ones).
        for _ in range(3):
            publisher.sock.send_multipart([b"", seq(0), stored(100.0, 11)])
        # The replica restarted: its sequence starts at 0 again, with newer batches.
        publisher.until([b"", seq(0), stored(200.0, 21)], lambda: index.match([21]) == 1)
        assert index.match([11]) == 0 and index.match([12]) == 0, "the old history is gone"
        assert sub.last_seq == 0 and sub.resets["restart"] == 1
        # An explicit resync (the health checks saw the replica come back) starts over too.
        sub.resync()
        deadline = time.monotonic() + TIMEOUT
        while sub.resets["restart"] < 2:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert len(index) == 0 and sub.last_seq == -1
        publisher.until([b"", seq(1), stored(300.0, 31)], lambda: index.match([31]) == 1)
        state = sub.state()
        assert state["running"] and state["bad_messages"] == 3 and state["last_seq"] == 1
        assert state["index_resets"] == {"gap": 0, "restart": 2, "failure": 0}
    finally:
        sub.close()
    assert not sub.state()["running"]
