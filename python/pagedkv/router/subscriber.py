"""A replica's KV-event subscription: a thread with a ZMQ SUB socket on the replica's event
endpoint and a DEALER on its replay socket, applying batches to a :class:`PrefixIndex` in
sequence order.

At start it replays from sequence 0 (everything the replica still buffers), then follows the
live stream. A batch whose sequence number skips ahead (the subscription was not active yet,
or the socket dropped messages) triggers a replay of the missing ones; if the replica no
longer has them, the index restarts empty (``PrefixIndex.reset``). Batches already applied
are skipped, so live and replayed copies never count twice.
"""

from __future__ import annotations

import logging
import threading

import zmq

from pagedkv.router.prefix_index import PrefixIndex
from pagedkv.server.kv_events import REPLAY_END, decode_event_batch

__all__ = ["EventSubscriber"]

logger = logging.getLogger(__name__)

# How long a replay may take to answer before the subscriber gives up on it (ms).
_REPLAY_TIMEOUT_MS = 2000


class EventSubscriber:
    """Follows one replica's KV events into ``index`` until :meth:`close`."""

    def __init__(self, index: PrefixIndex, endpoint: str, replay_endpoint: str | None, topic: str = "") -> None:
        self.index = index
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.last_seq = -1
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._thread = threading.Thread(target=self._run, name=f"kv-events {endpoint}", daemon=True)
        self._thread.start()

    def close(self, timeout: float = 2.0) -> None:
        self._stop.set()
        self._thread.join(timeout)
        self._ctx.term()

    def _run(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        sub.connect(self.endpoint)
        replay = None
        if self.replay_endpoint is not None:
            replay = self._ctx.socket(zmq.DEALER)
            replay.setsockopt(zmq.LINGER, 0)
            replay.connect(self.replay_endpoint)
        try:
            self._replay(replay, 0)
            while not self._stop.is_set():
                if not sub.poll(100):
                    continue
                frames = sub.recv_multipart()
                if len(frames) != 3:
                    logger.warning("ignored a KV event message of %d frames from %s", len(frames), self.endpoint)
                    continue
                seq = int.from_bytes(frames[1], "big")
                if seq <= self.last_seq:
                    continue
                if seq > self.last_seq + 1:
                    self._replay(replay, self.last_seq + 1)
                    if seq <= self.last_seq:
                        continue
                    if seq > self.last_seq + 1:  # the replica no longer buffers what we missed
                        self.index.reset()
                self._apply(seq, frames[2])
        except Exception:  # noqa: BLE001 - a broken replica must not take the router down
            logger.exception("the KV event subscription to %s failed; routing ignores its cache", self.endpoint)
            self.index.reset()
        finally:
            sub.close()
            if replay is not None:
                replay.close()

    def _apply(self, seq: int, payload: bytes) -> None:
        self.index.apply(decode_event_batch(payload))
        self.last_seq = seq

    def _replay(self, replay: zmq.Socket[bytes] | None, start: int) -> None:
        """Apply the batches from ``start`` on that the replica still buffers, in order."""
        if replay is None:
            return
        replay.send_multipart([b"", start.to_bytes(8, "big")])
        while replay.poll(_REPLAY_TIMEOUT_MS):
            frames = replay.recv_multipart()
            if len(frames) != 3 or frames[1] == REPLAY_END:
                return
            seq = int.from_bytes(frames[1], "big")
            if seq <= self.last_seq:
                continue
            if seq > self.last_seq + 1 and self.last_seq >= 0:
                self.index.reset()  # a hole the replica cannot fill
            self._apply(seq, frames[2])
        logger.warning("the replay socket %s did not answer in time", self.replay_endpoint)
