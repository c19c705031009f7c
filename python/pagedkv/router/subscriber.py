"""A replica's KV-event subscription: a thread with a ZMQ SUB socket on the replica's event
endpoint and a DEALER on its replay socket, applying batches to a :class:`PrefixIndex` in
sequence order.

At start it replays from sequence 0 (everything the replica still buffers), then follows the
live stream. Batches already applied are skipped, so live and replayed copies never count
twice. What can go wrong, and what the subscription does (it never ends before :meth:`close`):

* **A skipped sequence number** (the subscription was not active yet, or the socket dropped
  messages): the missing batches are replayed; if the replica no longer has them, the index
  restarts empty (``gap``), which can only cost routing hits.
* **A malformed message** (not three frames, a sequence number that is not 8 bytes, a payload
  that is not a msgpack event batch): counted in :attr:`bad_messages`, logged, skipped. The
  sequence number is not trusted either, so the next good batch is placed as usual.
* **The replica restarted** on the same ports: its sequence numbers start at 0 again. A batch
  at or below the last applied sequence number is a copy of an applied batch only if it is
  not newer (its timestamp) than the newest applied one; a newer one means a new history:
  the index restarts empty (``restart``) and the new history is replayed from 0. The health
  monitor also calls :meth:`resync` when it sees a replica come back after being down.
* **Anything else** (a socket error): logged, the index restarts empty (``failure``), and the
  subscription is set up again after a second.

:meth:`state` reports it all (``/health``, ``/metrics``).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import zmq

from pagedkv.errors import PagedKVError
from pagedkv.router.prefix_index import PrefixIndex
from pagedkv.server.kv_events import REPLAY_END, KVEventBatch, decode_event_batch

__all__ = ["RESET_REASONS", "EventSubscriber"]

logger = logging.getLogger(__name__)

# How long a replay may take to answer before the subscriber gives up on it (ms).
_REPLAY_TIMEOUT_MS = 2000
# Pause before subscribing again after a failure (s).
_RETRY_S = 1.0
# Why an index restarted empty (see the module docstring).
RESET_REASONS = ("gap", "restart", "failure")


class _Resync(Exception):
    """Raised inside the subscription to start it over from sequence 0."""


class EventSubscriber:
    """Follows one replica's KV events into ``index`` until :meth:`close`."""

    def __init__(self, index: PrefixIndex, endpoint: str, replay_endpoint: str | None, topic: str = "") -> None:
        self.index = index
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.last_seq = -1
        self._last_ts = float("-inf")  # the newest applied batch's timestamp
        self.bad_messages = 0
        self.resets = dict.fromkeys(RESET_REASONS, 0)
        self._stop = threading.Event()
        self._resync = threading.Event()
        self._ctx = zmq.Context()
        self._thread = threading.Thread(target=self._run, name=f"kv-events {endpoint}", daemon=True)
        self._thread.start()

    @property
    def closed(self) -> bool:
        """:meth:`close` was called (the thread's end is then not a failure)."""
        return self._stop.is_set()

    def close(self, timeout: float = 2.0) -> None:
        """Stops the subscription's thread (waiting up to ``timeout`` s) and its sockets."""
        self._stop.set()
        self._thread.join(timeout)
        self._ctx.term()

    def resync(self) -> None:
        """Forget the index and replay the replica's history from 0 (it restarted)."""
        self._resync.set()

    def state(self) -> dict[str, Any]:
        return {
            "endpoint": self.endpoint,
            "running": self._thread.is_alive(),
            "last_seq": self.last_seq,
            "batches": self.index.num_batches,
            "bad_messages": self.bad_messages,
            "index_resets": dict(self.resets),
        }

    # ------------------------------------------------------------------ the subscriber thread

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._follow()
            except _Resync:
                self._forget("restart")
            except Exception:  # noqa: BLE001 - a broken replica must not take the router down
                logger.exception("the KV event subscription to %s failed; subscribing again", self.endpoint)
                self._forget("failure")
                self._stop.wait(_RETRY_S)

    def _forget(self, reason: str) -> None:
        """The index restarts empty and the next batch starts a history."""
        self.index.reset()
        self.resets[reason] += 1
        self.last_seq = -1
        self._last_ts = float("-inf")

    def _follow(self) -> None:
        """One subscription: sockets, a replay from where the index stands, the live stream."""
        self._resync.clear()
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
            self._replay(replay, self.last_seq + 1)
            while not self._stop.is_set():
                if self._resync.is_set():
                    raise _Resync
                if sub.poll(100):
                    self._on_live(replay, sub.recv_multipart())
        finally:
            sub.close()
            if replay is not None:
                replay.close()

    def _parse(self, frames: list[bytes], where: str) -> tuple[int, KVEventBatch] | None:
        """``(seq, batch)`` of a ``[topic, seq, payload]`` message; None (counted) if malformed."""
        try:
            if len(frames) != 3 or len(frames[1]) != 8:
                raise PagedKVError(f"{len(frames)} frames")
            return int.from_bytes(frames[1], "big"), decode_event_batch(frames[2])
        except PagedKVError as exc:
            self.bad_messages += 1
            logger.warning("skipped a malformed KV event message from %s (%s): %s", self.endpoint, where, exc)
            return None

    def _on_live(self, replay: zmq.Socket[bytes] | None, frames: list[bytes]) -> None:
        parsed = self._parse(frames, "live")
        if parsed is None:
            return
        seq, batch = parsed
        if seq <= self.last_seq:
            if batch.ts <= self._last_ts:
                return  # a copy of a batch already applied (replayed, then live)
            logger.info("replica %s restarted its event sequence (%d after %d)", self.endpoint, seq, self.last_seq)
            self._forget("restart")
            self._replay(replay, 0)
            if seq <= self.last_seq:
                return
        if seq > self.last_seq + 1:
            self._replay(replay, self.last_seq + 1)
            if seq <= self.last_seq:
                return
            if seq > self.last_seq + 1 and self.last_seq >= 0:  # the replica no longer buffers them
                self._forget("gap")
        self._apply(seq, batch)

    def _apply(self, seq: int, batch: KVEventBatch) -> None:
        self.index.apply(batch)
        self.last_seq = seq
        self._last_ts = max(self._last_ts, batch.ts)

    def _replay(self, replay: zmq.Socket[bytes] | None, start: int) -> None:
        """Apply the batches from ``start`` on that the replica still buffers, in order."""
        if replay is None:
            return
        while replay.poll(0):  # the late answer of a replay that timed out
            replay.recv_multipart()
        replay.send_multipart([b"", start.to_bytes(8, "big")])
        while replay.poll(_REPLAY_TIMEOUT_MS):
            frames = replay.recv_multipart()
            if len(frames) == 3 and frames[1] == REPLAY_END:
                return
            parsed = self._parse(frames, "replay")  # [b"", seq, payload]
            if parsed is None:
                continue
            seq, batch = parsed
            if seq <= self.last_seq:
                continue
            if seq > self.last_seq + 1 and self.last_seq >= 0:
                self._forget("gap")  # a hole the replica cannot fill
            self._apply(seq, batch)
        logger.warning("the replay socket %s did not answer in time", self.replay_endpoint)
