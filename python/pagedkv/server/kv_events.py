"""KV-cache events over ZMQ, in vLLM's format, for KV-aware routers (Dynamo, llm-d, custom ones).

A router that sends each request to the engine already caching most of its prompt needs to know
what every engine caches. ``pagedkv serve --kv-events-endpoint tcp://...`` publishes it the way
vLLM does, so existing consumers of vLLM's events read pagedkv's unchanged.

Events (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``; media ``"GPU"``, ``"CPU"``,
``"DISK"``) are produced by the Rust core as its pools change
(``SchedulerConfig(enable_kv_events=True)``) and taken once per step as one encoded batch
(``Scheduler.take_kv_events(time.time())``); rust/kv_events.rs defines them, their block hashes
(64-bit, unique among the blocks one pool caches; ``pagedkv._core.block_hashes`` gives a
prompt's) and the msgpack wire format. :func:`decode_event_batch` reads a batch.

Publishing protocol (vLLM's)
    A PUB socket bound at the endpoint sends one multipart message per batch: ``[topic, seq,
    payload]`` with ``seq`` 8 bytes big-endian, from 0, one more per batch. A batch dropped
    because the publisher's queue was full leaves a gap in ``seq``. A subscriber that missed
    batches asks the ROUTER socket bound at the replay endpoint: a DEALER sends ``[b"",
    start_seq (8 bytes big-endian)]`` and receives ``[b"", seq, payload]`` for every buffered
    batch (the last ``buffer_steps``) with ``seq >= start_seq``, then the end marker ``[b"",
    (-1).to_bytes(8, "big", signed=True), b""]``. Subscribe first, then replay from the first
    sequence number missed, and drop live batches already replayed.

The publisher's thread answers whoever reaches the replay socket, so it takes every input
within bounds (a request frame over ``MAX_REPLAY_REQUEST_BYTES`` disconnects its sender: ZMQ
``MAXMSGSIZE``; a request of more than 3 frames is read, dropped and answered with the end
marker) and handles each under its own ``except Exception``: a replay or a send that fails is
counted and logged (:meth:`KVEventPublisher.report_to` an engine's
:class:`~pagedkv.background.BackgroundThreads`: ``/health``, ``pagedkv:background_errors``),
and the thread goes on; should it die anyway, ``/health`` is degraded, naming it.
"""

from __future__ import annotations

import collections
import logging
import socket
import threading
from types import TracebackType

import msgspec
import zmq

from pagedkv.background import BackgroundThreads
from pagedkv.errors import ConfigError, InvalidArgumentError, InvalidTypeError

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVCacheEvent",
    "KVEventBatch",
    "KVEventPublisher",
    "MAX_REPLAY_REQUEST_BYTES",
    "PUBLISHER_THREAD",
    "REPLAY_END",
    "decode_event_batch",
    "encode_event_batch",
]

logger = logging.getLogger(__name__)

# The sequence-number frame that ends a replay.
REPLAY_END = (-1).to_bytes(8, "big", signed=True)
# The publisher's thread, as BackgroundThreads and /health name it.
PUBLISHER_THREAD = "pagedkv-kv-events"
# A replay request's frames are an empty one and 8 bytes; anything much larger is not one.
MAX_REPLAY_REQUEST_BYTES = 1024
_REPLAY_FRAMES = 3  # [identity, b"", start_seq] as the ROUTER socket reads them


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base class of the KV-cache events (tagged with their class name on the wire)."""


class BlockStored(KVCacheEvent):
    """Blocks of one chain entered a pool's prefix cache."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    """Blocks left a pool's prefix cache."""

    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    """Nothing is cached any more."""


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One step's events with their timestamp (seconds). vLLM's batches may carry a third
    field, ``data_parallel_rank``; pagedkv writes none, and decoding ignores it."""

    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


_decoder = msgspec.msgpack.Decoder(KVEventBatch)
_encoder = msgspec.msgpack.Encoder()


def decode_event_batch(payload: bytes) -> KVEventBatch:
    """The batch encoded in ``payload`` (what ``Scheduler.take_kv_events`` returns, the third
    frame of a published message). Raises InvalidArgumentError on anything else."""
    try:
        return _decoder.decode(payload)
    except (msgspec.DecodeError, TypeError) as e:
        raise InvalidArgumentError(f"not a KV event batch: {e}") from e


def encode_event_batch(batch: KVEventBatch) -> bytes:
    """``batch`` in the wire format (the same bytes the Rust core writes for the same events)."""
    return _encoder.encode(batch)


def _count(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an integer, got {type(value).__name__}")
    if value < 0:
        raise ConfigError(f"{name} must be >= 0, got {value}")
    return value


class KVEventPublisher:
    """Publishes encoded event batches on a ZMQ PUB socket, with a replay socket (module docs).

    ``publish`` is thread-safe and never blocks: batches go to a bounded queue
    (``max_queue_size``; when full the oldest is dropped, with one warning) that a background
    thread, which owns the sockets, sends. The sockets are bound before the constructor returns:
    an endpoint that cannot be bound raises ConfigError naming it. ``hwm`` is the PUB socket's
    send high-water mark (messages ZMQ queues per slow subscriber before dropping);
    ``buffer_steps`` the number of batches kept for replay. Endpoints are ZMQ endpoints such as
    ``tcp://127.0.0.1:5557`` (``tcp://127.0.0.1:*`` picks a free port: see :attr:`endpoint`).
    Close it (``close()`` or a ``with`` block) to send what is queued and release the sockets.
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        *,
        max_queue_size: int = 100_000,
    ) -> None:
        if not isinstance(endpoint, str) or not endpoint:
            raise ConfigError(f"the KV event endpoint must be a non-empty str, got {endpoint!r}")
        if replay_endpoint is not None and (not isinstance(replay_endpoint, str) or not replay_endpoint):
            raise ConfigError(f"the KV event replay endpoint must be a non-empty str or None, got {replay_endpoint!r}")
        if not isinstance(topic, str):
            raise ConfigError(f"topic must be a str, got {type(topic).__name__}")
        self._buffer_steps = _count(buffer_steps, "buffer_steps")
        self._hwm = _count(hwm, "hwm")
        self._max_queue = _count(max_queue_size, "max_queue_size")
        if self._max_queue == 0:
            raise ConfigError("max_queue_size must be >= 1")
        self._requested = (endpoint, replay_endpoint)
        self._topic = topic.encode()
        self._lock = threading.Lock()
        self._queue: collections.deque[tuple[int, bytes]] = collections.deque()
        self._next_seq = 0
        self._dropped = 0
        self._closing = False
        self._closed = False
        self._close_timeout = 2.0
        # Wakes the thread from its poll: one byte per wake-up, never blocking the writer.
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._ready = threading.Event()
        # Where the thread reports (a private registry until report_to hands it an engine's).
        self._background = BackgroundThreads()
        self._error: ConfigError | None = None
        self._bound: tuple[str, str | None] = (endpoint, replay_endpoint)
        self._thread = threading.Thread(target=self._run, name=PUBLISHER_THREAD, daemon=True)
        self._thread.start()
        self._background.adopt(PUBLISHER_THREAD, self._thread)
        if not self._ready.wait(30.0):
            self._error = ConfigError(f"the KV event publisher for {endpoint!r} did not start")
        if self._error is not None:
            self._thread.join(5.0)
            self._close_wake()
            self._closed = True
            raise self._error

    @property
    def endpoint(self) -> str:
        """The PUB socket's endpoint as bound (a ``*`` port resolved)."""
        return self._bound[0]

    @property
    def replay_endpoint(self) -> str | None:
        """The replay socket's endpoint as bound, or None without one."""
        return self._bound[1]

    def report_to(self, background: BackgroundThreads) -> None:
        """From now on the publisher's thread answers for itself in ``background`` (an
        engine's: the server's ``/health`` and ``/metrics``): the inputs it survived are
        recorded there, and its death makes ``/health`` degraded."""
        self._background = background
        background.adopt(PUBLISHER_THREAD, self._thread)

    def _record(self, exc: BaseException, what: str) -> None:
        """An input the thread survived: counted and logged (at a bounded rate)."""
        self._background.record_error(PUBLISHER_THREAD, exc, what)

    @property
    def num_dropped(self) -> int:
        """Batches dropped because the queue was full."""
        return self._dropped

    def publish(self, payload: bytes) -> None:
        """Queues one encoded batch (``Scheduler.take_kv_events``) under the next sequence
        number. Never blocks; a no-op once the publisher is closed."""
        if not isinstance(payload, (bytes, bytearray, memoryview)):
            raise InvalidTypeError(f"publish() takes the bytes of a batch, got {type(payload).__name__}")
        data = bytes(payload)
        with self._lock:
            if self._closing:
                return
            if len(self._queue) >= self._max_queue:
                self._queue.popleft()
                self._dropped += 1
                if self._dropped == 1:
                    logger.warning(
                        "KV event queue full (%d batches): dropping the oldest; subscribers see a gap in the "
                        "sequence numbers",
                        self._max_queue,
                    )
            self._queue.append((self._next_seq, data))
            self._next_seq += 1
        self._wake()

    def close(self, timeout: float = 2.0) -> None:
        """Sends what is queued, closes the sockets and joins the thread (waiting at most
        ``timeout`` seconds). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closing = True
            self._closed = True
            self._close_timeout = max(0.0, float(timeout))
        self._background.stopping(PUBLISHER_THREAD)
        self._wake()
        self._thread.join(self._close_timeout + 1.0)
        if self._thread.is_alive():
            logger.warning("the KV event publisher thread did not stop within %.1f s", self._close_timeout)
        else:
            self._close_wake()

    def __enter__(self) -> KVEventPublisher:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # The background thread ----------------------------------------------------------------

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\0")
        except (BlockingIOError, OSError):
            pass  # already signalled (the pipe is full) or closed

    def _close_wake(self) -> None:
        self._wake_r.close()
        self._wake_w.close()

    def _run(self) -> None:
        ctx = zmq.Context()
        pub = ctx.socket(zmq.PUB)
        replay: zmq.Socket[bytes] | None = None
        sockets: list[zmq.Socket[bytes]] = [pub]
        try:
            pub.setsockopt(zmq.SNDHWM, self._hwm)
            pub.setsockopt(zmq.LINGER, 0)
            endpoint, replay_endpoint = self._requested
            bound_pub = self._bind(pub, endpoint, "KV event endpoint")
            bound_replay = None
            if replay_endpoint is not None:
                replay = ctx.socket(zmq.ROUTER)
                sockets.append(replay)
                replay.setsockopt(zmq.LINGER, 0)
                replay.setsockopt(zmq.MAXMSGSIZE, MAX_REPLAY_REQUEST_BYTES)
                bound_replay = self._bind(replay, replay_endpoint, "KV event replay endpoint")
            self._bound = (bound_pub, bound_replay)
        except Exception as e:  # noqa: BLE001 - reported to the constructor
            self._error = e if isinstance(e, ConfigError) else ConfigError(f"cannot start the KV event publisher: {e}")
            for s in sockets:
                s.close(linger=0)
            ctx.term()
            self._ready.set()
            return
        self._ready.set()
        try:
            self._serve(pub, replay)
        except Exception as e:  # noqa: BLE001 - the thread must not die silently
            logger.error("the KV event publisher thread failed; events are no longer published")
            self._background.died(PUBLISHER_THREAD, e)
        finally:
            linger = int(self._close_timeout * 1000)
            for s in sockets:
                s.close(linger=linger)
            ctx.term()

    @staticmethod
    def _bind(sock: zmq.Socket[bytes], endpoint: str, what: str) -> str:
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as e:
            raise ConfigError(f"cannot bind the {what} {endpoint!r}: {e}") from None
        last = sock.getsockopt(zmq.LAST_ENDPOINT)
        return last.decode() if isinstance(last, bytes) else endpoint

    def _serve(self, pub: zmq.Socket[bytes], replay: zmq.Socket[bytes] | None) -> None:
        buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=self._buffer_steps or 1)
        keep = self._buffer_steps > 0
        poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        if replay is not None:
            poller.register(replay, zmq.POLLIN)
        # Each input (a wake-up, a batch, a replay request) is handled under its own guard: its
        # failure is counted (self._record) and the loop goes on (module docs).
        while True:
            try:
                ready = dict(poller.poll())
            except zmq.ZMQError as e:  # EINTR and the like: nothing was read
                self._record(e, "a poll")
                ready = {}
            if self._wake_r.fileno() in ready or self._wake_r in ready:
                self._drain_wake()
            with self._lock:
                batches = list(self._queue)
                self._queue.clear()
                closing = self._closing
            for seq, payload in batches:
                try:
                    pub.send_multipart([self._topic, seq.to_bytes(8, "big"), payload], copy=False)
                except zmq.ZMQError as e:  # the batch is lost: subscribers see a gap and replay it
                    self._record(e, f"publishing batch {seq}")
                if keep:
                    buffer.append((seq, payload))
            if replay is not None and replay in ready:
                try:
                    self._answer_replays(replay, buffer if keep else ())
                except Exception as e:  # noqa: BLE001 - one replay request's failure is its own
                    self._record(e, "a replay request")
            if closing:
                return

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def _answer_replays(
        self, replay: zmq.Socket[bytes], buffer: collections.deque[tuple[int, bytes]] | tuple[()]
    ) -> None:
        while True:
            try:
                frames = [replay.recv(zmq.NOBLOCK)]
            except zmq.Again:
                return
            extra = 0  # frames past the bound: read (ZMQ delivers a message whole) and dropped
            while replay.getsockopt(zmq.RCVMORE):
                part = replay.recv(zmq.NOBLOCK)
                if len(frames) < _REPLAY_FRAMES:
                    frames.append(part)
                else:
                    extra += 1
            client = frames[0]
            if extra or len(frames) != _REPLAY_FRAMES or frames[1] != b"" or len(frames[2]) != 8:
                malformed = InvalidArgumentError(
                    f"a replay request of {len(frames) + extra} frame(s) is not [b'', seq]"
                )
                self._record(malformed, "a malformed replay request (answered with the end marker)")
                start = None
            else:
                start = int.from_bytes(frames[2], "big")
            if start is not None:
                for seq, payload in buffer:
                    if seq >= start:
                        replay.send_multipart([client, b"", seq.to_bytes(8, "big"), payload], copy=False)
            replay.send_multipart([client, b"", REPLAY_END, b""])
