"""The KV connector: one engine's side of disaggregated prefill / decode.

It joins the Rust scheduler's leases and reservations (``Scheduler.kv_lease`` / ``reserve_kv``,
rust/scheduler/kv_transfer.rs), a :class:`~pagedkv.distributed.kv_transport.KVTransport` that
moves the bytes (NIXL or gloo), and the control plane (:mod:`pagedkv.distributed.control`:
handshake, lease claim and release, every message authenticated with the shared secret).

**Producer.** A request added with ``{"do_remote_decode": true}`` holds its KV when it ends:
:meth:`lease_params` turns the scheduler's lease into the ``kv_transfer_params`` of its output
(engine id, control address, block ids, tokens, block size, KV dtype, prompt digest and a fresh
unguessable ``remote_lease_token``). The lease ends when the reader releases it, or after
``lease_seconds`` (:meth:`poll`). Leases are *claimed*, not named: the params travel through a
client, so the producer binds a lease to the first consumer that claims it with the token,
grants that consumer's transport its blocks, and answers with the lease's own block ids, token
count and token digest; the consumer reads only if those equal the params' and its own prompt
(forged ids or foreign KV are refused, a failed pull handled by the policy).

**Consumer.** A request added with ``{"do_remote_prefill": true, ...}`` enters the scheduler at
once, blocked on ``"remote_kv"`` (live, never scheduled, holding no block). :meth:`check_load`
checks the params before that add; :meth:`start_load` reserves blocks for the prompt's full
blocks (sharing what is cached here; only the rest is pulled) and hands the pull to the
connector's thread: handshake (the KV fingerprints must match), read, release (a release that
finds the lease gone fails the pull: the blocks may have been reused mid-read). Nothing to pull:
the request is unblocked at once. :meth:`take_finished_loads`, before every step, commits the
blocks that arrived (they enter the prefix cache and the request hits them) or cancels the
reservation; the engine unblocks the request or fails it (``fail`` policy). The connector holds
only the pull (:attr:`KVConnector.loads`); an aborted request's pull is :meth:`abandon`-ed.

**KV cache groups** (worker/kv_layout.py): a lease's block ids are every group's table,
group-major (group 0's ``n`` ids, then group 1's, ...), a producer's sliding groups holding the
whole prompt (nothing is given back for a ``hold_kv`` request). Both engines have the same
groups (the handshake's fingerprint names the layout), so the consumer reserves the same blocks
in every group and reads remote blocks ``g * n + hits ..`` into group ``g``'s fresh ones.

**Threads.** ``start_load``, ``abandon``, ``take_finished_loads``, ``lease_params`` and ``poll``
run on the engine's thread under its lock; the transport only on the connector's thread. That
thread never dies of a pull: its input comes from clients and peers, so each pull runs under its
own ``except Exception`` (the pull's error; recorded in
:class:`~pagedkv.background.BackgroundThreads` unless an ordinary ``PagedKVError``). Should it
die anyway, ``/health`` says degraded and :meth:`start_load` stops handing it pulls. Its input is
bounded first (``parse_kv_transfer_params``, ``allowed_producers``, the control plane's parsers).
"""

from __future__ import annotations

import ipaddress
import logging
import queue
import secrets
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagedkv.background import BackgroundThreads
from pagedkv.distributed.control import ControlServer, control_call
from pagedkv.distributed.kv_transport import KVTransport, TransferHandle
from pagedkv.distributed.transfer_config import (
    KVTransferConfig,
    RemotePrefill,
    derive_key,
    prompt_digest,
    tokens_digest,
)
from pagedkv.distributed.transports import make_transport
from pagedkv.errors import ConfigError, InvalidArgumentError, KVTransferError, PagedKVError

if TYPE_CHECKING:
    from pagedkv._core import Scheduler
    from pagedkv.worker.model_runner import ModelRunner

__all__ = ["PULL_THREAD", "FinishedLoad", "KVConnector"]

logger = logging.getLogger(__name__)

PULL_THREAD = "pagedkv-kv-pull"  # the consumer's transfer thread, as /health names it

_POLL_S = 0.0005  # the transfer thread's poll of reads in flight


@dataclass
class _Lease:
    """A producer's lease as the control plane sees it: what it vouches for, and who claimed it."""

    request_id: str
    token: str
    deadline: float  # monotonic
    block_ids: list[int]
    num_tokens: int
    tokens_digest: str  # of the prompt's first num_tokens tokens
    consumer: str | None = None  # the consumer engine that claimed it first
    reader: str | None = None  # that consumer's transport name (granted the blocks)


@dataclass
class _Load:
    """One pull: the producer's ``remote_block_ids`` into ``local_block_ids``, pairwise (every
    KV cache group's blocks after the hits, group-major)."""

    request_id: str
    remote: RemotePrefill
    prompt_token_ids: list[int]
    remote_block_ids: list[int]
    local_block_ids: list[int]
    started: float = field(default_factory=time.monotonic)
    ended: float | None = None  # when the read ended (before the lease release), transfer thread
    handle: TransferHandle | None = None
    error: str | None = None
    abandoned: bool = False  # aborted while the read was in flight (engine thread only)
    release_only: bool = False  # nothing to read (all cached here, or no room): end the lease


@dataclass(frozen=True)
class FinishedLoad:
    """A pull that ended: ``error`` is None when the KV arrived (and was committed)."""

    request_id: str
    error: str | None
    num_blocks: int
    seconds: float


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _fingerprint_for_peers(runner: ModelRunner) -> dict[str, Any]:
    # The model's path may differ between machines; its digest and the KV format may not.
    fp = dict(runner.kv_fingerprint())
    fp.pop("model", None)
    return fp


class KVConnector:
    """See the module docs. ``lock`` is the engine's lock; ``wake`` is called (from the
    connector's thread) when a pull ends, so an idle step loop can pick it up. ``background``:
    the engine's registry of background threads, where the pull thread and the control server
    run and report what they survived (a private one by default)."""

    def __init__(
        self,
        config: KVTransferConfig,
        scheduler: Scheduler,
        runner: ModelRunner,
        lock: threading.RLock,
        wake: Callable[[], None] | None = None,
        *,
        background: BackgroundThreads | None = None,
    ) -> None:
        self.config = config
        self.background = background if background is not None else BackgroundThreads()
        self.engine_id = config.engine_id or f"pagedkv-{uuid.uuid4().hex[:12]}"
        self.scheduler = scheduler
        self.block_size = runner.block_size
        # KV cache groups: one block table per group, carried group-major (module docs).
        self.num_kv_groups = runner.kv_layout.num_kv_groups
        self.kv_dtype = str(runner.kv_cache.dtype).removeprefix("torch.")
        self.fingerprint = _fingerprint_for_peers(runner)
        self._lock = lock
        self.wake = wake
        secret = config.secret()  # ConfigError without one: before anything listens
        self._control_key = derive_key(secret, "control")
        self.transport: KVTransport = make_transport(
            config.transport,  # type: ignore[arg-type]
            engine_id=self.engine_id,
            rank=config.gloo_rank,
            world_size=config.gloo_world_size,
            init_method=config.gloo_init_method,
            timeout=config.connect_timeout,
            auth_key=derive_key(secret, "gloo pull requests"),
            # A producer reachable on loopback only keeps NIXL's UCX sockets there too.
            loopback_only=config.is_producer and _is_loopback(config.control_host),
        )
        self.transport.register_kv_cache(runner.kv_cache, runner.kv_scale_cache)
        self._metadata = self.transport.local_metadata().decode()
        self.counters = {
            "kv_leases_granted": 0,
            "kv_leases_released": 0,
            "kv_leases_expired": 0,
            "kv_loads_ok": 0,
            "kv_loads_failed": 0,
            "kv_blocks_pulled": 0,
            "kv_transfer_seconds": 0.0,
        }
        # Producer: request id -> its lease; lease token -> request id.
        self.leases: dict[str, _Lease] = {}
        self._lease_tokens: dict[str, str] = {}
        self.control: ControlServer | None = None
        if config.is_producer:
            try:
                self.control = ControlServer(
                    config.control_host,
                    config.control_port,
                    {"metadata": self._on_metadata, "claim": self._on_claim, "release": self._on_release},
                    self._control_key,
                    background=self.background,
                )
            except BaseException:
                self.transport.close()  # e.g. the control port is taken: leave nothing running
                raise
        # Consumer: pulls by request id (engine thread), the transfer thread's queues.
        self.loads: dict[str, _Load] = {}
        self._jobs: queue.Queue[_Load | None] = queue.Queue()
        self._done: queue.Queue[_Load] = queue.Queue()
        self._peers: dict[str, str] = {}  # control address -> transport peer id (transfer thread)
        self._thread: threading.Thread | None = None
        if config.is_consumer:
            self._thread = self.background.start(PULL_THREAD, self._run_transfers)
            for address in config.peers:
                try:
                    self._ensure_peer(address)
                except KVTransferError as e:  # not up yet: handshaken on first use instead
                    logger.info("KV producer %s: no handshake at start (%s)", address, e)

    @property
    def address(self) -> str | None:
        """This producer's control address (``tcp://host:port``), None for a consumer."""
        return None if self.control is None else self.control.address

    # ------------------------------------------------------------------ producer side

    def lease_params(self, request_id: str, prompt_token_ids: list[int]) -> dict[str, Any] | None:
        """The ``kv_transfer_params`` of an ended ``do_remote_decode`` request, starting its
        lease clock; None if the scheduler took no lease (aborted, failed)."""
        lease = self.scheduler.kv_lease(request_id)
        if lease is None or self.control is None:
            return None
        block_ids, num_tokens = lease
        num_tokens = min(num_tokens, len(prompt_token_ids))
        token = secrets.token_urlsafe(32)  # 256 random bits: the lease's capability
        self.leases[request_id] = _Lease(
            request_id=request_id,
            token=token,
            deadline=time.monotonic() + self.config.lease_seconds,
            block_ids=list(block_ids),
            num_tokens=num_tokens,
            tokens_digest=tokens_digest(prompt_token_ids[:num_tokens]),
        )
        self._lease_tokens[token] = request_id
        self.counters["kv_leases_granted"] += 1
        remote = RemotePrefill(
            remote_engine_id=self.engine_id,
            remote_address=self.control.address,
            remote_request_id=request_id,
            remote_block_ids=tuple(block_ids),
            remote_num_tokens=num_tokens,
            remote_block_size=self.block_size,
            remote_kv_dtype=self.kv_dtype,
            prompt_digest=prompt_digest(prompt_token_ids),
            remote_lease_token=token,
        )
        return remote.to_params()

    def _end_lease(self, request_id: str) -> bool:
        """Forgets the lease, revokes its read grant and frees its blocks; False if the
        scheduler held no lease of that name."""
        lease = self.leases.pop(request_id, None)
        if lease is not None:
            self._lease_tokens.pop(lease.token, None)
        self.transport.revoke_reads(request_id)
        return bool(self.scheduler.release_kv_lease(request_id))

    def drop_lease(self, request_id: str) -> None:
        """Ends ``request_id``'s lease now, if any (its request failed before reporting it)."""
        self._end_lease(request_id)

    def _on_metadata(self, request: dict[str, Any]) -> dict[str, Any]:
        return {"ok": True, "metadata": self._metadata, "fingerprint": self.fingerprint, "engine_id": self.engine_id}

    def _claimed_lease(self, request: dict[str, Any]) -> _Lease | str:
        """The lease ``request`` (a claim or release) names by token, claimed for the consumer
        it names unless another one claimed it first; else why not. Under the engine lock."""
        token, consumer, reader = (request.get(k) for k in ("token", "consumer", "reader"))
        if not all(isinstance(v, str) and v for v in (token, consumer, reader)):
            return "needs token, consumer and reader (non-empty str)"
        request_id = self._lease_tokens.get(token)  # type: ignore[arg-type]
        lease = None if request_id is None else self.leases.get(request_id)
        if lease is None:
            return "no lease has this token (forged, or the lease was released or expired)"
        if lease.consumer is None:
            lease.consumer, lease.reader = consumer, reader
            self.transport.allow_reads(lease.reader, lease.request_id, lease.block_ids)  # type: ignore[arg-type]
        elif (lease.consumer, lease.reader) != (consumer, reader):
            logger.warning("KV lease of %r: claim by %r refused (claimed by %r)", request_id, consumer, lease.consumer)
            return "the lease is claimed by another consumer"
        return lease

    def _on_claim(self, request: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            lease = self._claimed_lease(request)
            if isinstance(lease, str):
                return {"ok": False, "error": f"claim refused: {lease}"}
            return {
                "ok": True,
                "request_id": lease.request_id,
                "block_ids": lease.block_ids,
                "num_tokens": lease.num_tokens,
                "tokens_digest": lease.tokens_digest,
            }

    def _on_release(self, request: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            lease = self._claimed_lease(request)
            if isinstance(lease, str):
                if lease.startswith("no lease"):  # ended already: the reader must not trust its read
                    return {"ok": True, "held": False}
                return {"ok": False, "error": f"release refused: {lease}"}
            held = self._end_lease(lease.request_id)
            if held:
                self.counters["kv_leases_released"] += 1
        return {"ok": True, "held": held}

    def next_lease_expiry(self) -> float | None:
        """Seconds until the next lease expires (0 if one has), None when none is held."""
        if not self.leases:
            return None
        return max(0.0, min(lease.deadline for lease in self.leases.values()) - time.monotonic())

    def poll(self) -> None:
        """Frees the blocks of expired leases (engine thread, under the engine lock)."""
        if not self.leases:
            return
        now = time.monotonic()
        for request_id in [r for r, lease in self.leases.items() if lease.deadline <= now]:
            if self._end_lease(request_id):
                self.counters["kv_leases_expired"] += 1
                logger.info("KV lease of %r expired after %.1fs", request_id, self.config.lease_seconds)

    # ------------------------------------------------------------------ consumer side

    def check_load(self, prompt_token_ids: list[int], remote: RemotePrefill) -> None:
        """Checks a pull of ``remote``'s KV for ``prompt_token_ids`` before its request is added
        (nothing is held, nothing connects): InvalidArgumentError for params that do not belong
        to this prompt or name a producer this engine does not pull from, KVTransferError for a
        producer whose format cannot match or a pull thread that is not running."""
        if not self.config.is_consumer:
            raise InvalidArgumentError(f"engine {self.engine_id!r} is not a KV consumer (kv_transfer_config.role)")
        allowed = self.config.allowed_producers
        if allowed and remote.remote_address not in allowed:
            # Checked before anything connects anywhere: the address came with the request.
            raise InvalidArgumentError(
                f"kv_transfer_params.remote_address {remote.remote_address!r} is not a producer this engine "
                "pulls from (kv_transfer_config.allowed_producers)"
            )
        if remote.prompt_digest != prompt_digest(prompt_token_ids):
            raise InvalidArgumentError("kv_transfer_params belong to another prompt (prompt_digest differs)")
        if remote.remote_block_size != self.block_size or remote.remote_kv_dtype != self.kv_dtype:
            raise KVTransferError(
                f"producer {remote.remote_engine_id!r} has {remote.remote_block_size}-token blocks of "
                f"{remote.remote_kv_dtype}, this engine {self.block_size}-token blocks of {self.kv_dtype}"
            )
        groups = self.num_kv_groups
        per_group, rest = divmod(len(remote.remote_block_ids), groups)
        if rest or per_group < -(-remote.remote_num_tokens // self.block_size):
            raise InvalidArgumentError(
                f"kv_transfer_params: {len(remote.remote_block_ids)} block ids are not {groups} KV cache group(s) "
                f"holding {remote.remote_num_tokens} tokens of {self.block_size}-token blocks"
            )
        if self._thread is None or not self._thread.is_alive():
            # Never reached while the thread does its job; should it have died, a pull handed to
            # it would wait forever: the prompt is computed here (or failed, by the policy).
            raise KVTransferError(f"the KV pull thread is not running ({self.background.health()['dead']})")

    def start_load(
        self, request_id: str, prompt_token_ids: list[int], remote: RemotePrefill, cache_salt: str | None
    ) -> bool:
        """Reserves blocks (a reservation named ``request_id``) for ``remote``'s KV and starts
        pulling the ones not cached here; the params passed :meth:`check_load`, and the request
        is in the scheduler, blocked on ``"remote_kv"``. Returns False when there is nothing to
        wait for (nothing to pull, or no room now: the caller unblocks the request at once and
        it computes what it lacks); else the request waits for :meth:`take_finished_loads`."""
        groups = self.num_kv_groups
        per_group = len(remote.remote_block_ids) // groups
        full_blocks = min(remote.remote_num_tokens, len(prompt_token_ids)) // self.block_size
        reserved = self.scheduler.reserve_kv(request_id, prompt_token_ids, full_blocks, cache_salt)
        if reserved is None or not reserved[1]:
            if reserved is None:
                logger.info("no room for %d blocks for %r: its prompt is computed here", full_blocks, request_id)
            else:
                self.scheduler.commit_kv(request_id)  # all cached here already (or nothing full)
            # Nothing to read: the producer's lease can end now rather than at its expiry.
            self._jobs.put(_Load(request_id, remote, [], [], [], release_only=True))
            return False
        num_hits, fresh = reserved
        # Group g's blocks after the hits, on both sides: the remote ones from g * per_group.
        fresh_per_group = len(fresh) // groups
        remote_ids = [
            remote.remote_block_ids[g * per_group + num_hits + k] for g in range(groups) for k in range(fresh_per_group)
        ]
        load = _Load(
            request_id=request_id,
            remote=remote,
            prompt_token_ids=list(prompt_token_ids),
            remote_block_ids=remote_ids,
            local_block_ids=list(fresh),
        )
        self.loads[request_id] = load
        self._jobs.put(load)
        return True

    def is_loading(self, request_id: str) -> bool:
        return request_id in self.loads

    def abandon(self, request_id: str) -> None:
        """The request was aborted while its KV is arriving: its blocks are released when the
        read ends (they cannot be reused while it may still write them)."""
        load = self.loads.get(request_id)
        if load is not None:
            load.abandoned = True

    def wait_for_loads(self, timeout: float) -> None:
        """Blocks up to ``timeout`` seconds for a pull to end (an idle engine with pulls only)."""
        if self.loads and self._done.empty():
            try:
                load = self._done.get(timeout=timeout)
            except queue.Empty:
                return
            self._done.put(load)

    def take_finished_loads(self) -> list[FinishedLoad]:
        """Pulls that ended since the last call, reservations committed (KV arrived) or
        cancelled; abandoned ones are left out (their request is gone)."""
        finished: list[FinishedLoad] = []
        while True:
            try:
                load = self._done.get_nowait()
            except queue.Empty:
                return finished
            self.loads.pop(load.request_id, None)
            # Queued to read done (handshake included); not the wait for this engine's step.
            seconds = (load.ended or time.monotonic()) - load.started
            if load.error is None:
                self.scheduler.commit_kv(load.request_id)
                self.counters["kv_loads_ok"] += 1
                self.counters["kv_blocks_pulled"] += len(load.local_block_ids)
                self.counters["kv_transfer_seconds"] += seconds
            else:
                self.scheduler.cancel_kv(load.request_id)
                self.counters["kv_loads_failed"] += 1
                logger.warning("KV pull for %r failed: %s", load.request_id, load.error)
            if not load.abandoned:
                finished.append(FinishedLoad(load.request_id, load.error, len(load.local_block_ids), seconds))

    # ------------------------------------------------------------------ the transfer thread

    def _ensure_peer(self, address: str) -> str:
        """The transport's peer id for the producer at ``address``, handshaking the first time."""
        peer = self._peers.get(address)
        if peer is not None:
            return peer
        reply = self._call(address, {"op": "metadata"})
        if reply.get("fingerprint") != self.fingerprint:
            raise KVTransferError(
                f"producer at {address} serves another model or KV format: {reply.get('fingerprint')} "
                f"!= {self.fingerprint}"
            )
        metadata = reply.get("metadata")
        if not isinstance(metadata, str):
            raise KVTransferError(f"producer at {address} sent no transport metadata")
        try:
            peer = self.transport.add_peer(metadata.encode())
        except (ConfigError, ValueError) as e:  # another layout or transport: refused at handshake
            raise KVTransferError(f"handshake with the producer at {address} refused: {e}") from e
        self._peers[address] = peer
        return peer

    def _call(self, address: str, request: dict[str, Any]) -> dict[str, Any]:
        return control_call(address, request, self.config.handshake_timeout, self._control_key)

    def _lease_request(self, op: str, load: _Load) -> dict[str, Any]:
        return {
            "op": op,
            "token": load.remote.remote_lease_token,
            "consumer": self.engine_id,
            "reader": self.transport.engine_id,
        }

    def _claim(self, load: _Load) -> None:
        """Claims the lease and checks what the producer vouches for against the params and
        this prompt; KVTransferError (nothing read yet) when they differ."""
        reply = self._call(load.remote.remote_address, self._lease_request("claim", load))
        remote, prompt = load.remote, load.prompt_token_ids
        if (
            reply.get("block_ids") != list(remote.remote_block_ids)
            or reply.get("num_tokens") != remote.remote_num_tokens
        ):
            raise KVTransferError(
                "kv_transfer_params name blocks or a length that the producer's lease does not hold (forged params?)"
            )
        num_tokens = remote.remote_num_tokens
        if num_tokens > len(prompt) or reply.get("tokens_digest") != tokens_digest(prompt[:num_tokens]):
            raise KVTransferError("the producer's lease holds the KV of other tokens than this prompt's")

    def _failed(self, load: _Load, exc: Exception, what: str) -> None:
        """``load`` failed with ``exc`` (the first error is kept). An ordinary transfer failure
        (a ``PagedKVError``: a dead peer, a refused claim) is the pull's own; anything else (a
        peer's reply no check foresaw, a bug) is also recorded as an error the thread survived.
        The peer is handshaken again next time."""
        self._peers.pop(load.remote.remote_address, None)
        if load.error is None:
            load.error = f"{type(exc).__name__}: {exc}"[:1000]
        if not isinstance(exc, PagedKVError):
            self.background.record_error(PULL_THREAD, exc, what)

    def _start_read(self, load: _Load) -> None:
        try:
            peer = self._ensure_peer(load.remote.remote_address)
            self._claim(load)
            load.handle = self.transport.read_blocks(peer, load.remote_block_ids, load.local_block_ids)
        except Exception as e:  # KVTransferError, InvalidBlockError (blocks it never had), anything
            self._failed(load, e, f"the pull for {load.request_id!r}")

    def _release_lease(self, load: _Load) -> None:
        """Ends the producer's lease; a lease that had already ended fails the load (its blocks
        may have been reused while they were read)."""
        try:
            reply = self._call(load.remote.remote_address, self._lease_request("release", load))
            if load.error is None and not reply.get("held"):
                load.error = "the producer's lease had ended before the read completed (blocks may have been reused)"
        except Exception as e:  # noqa: BLE001 - a release is best effort; its failure fails the read
            if load.error is None:
                load.error = f"lease release failed: {e}"[:1000]
            if not isinstance(e, PagedKVError):
                self.background.record_error(PULL_THREAD, e, f"the lease release for {load.request_id!r}")

    def _finish(self, load: _Load) -> None:
        """The read is over: release the lease (confirming it held throughout), then report.
        Never raises: the engine waits for every load it handed over to come back here."""
        load.ended = time.monotonic()
        self._release_lease(load)
        self._done.put(load)
        if self.wake is not None:
            try:
                self.wake()
            except Exception as e:  # noqa: BLE001 - the engine still finds the load at its next step
                self.background.record_error(PULL_THREAD, e, "waking the engine")

    def _poll_read(self, load: _Load) -> bool:
        """Whether ``load``'s read is still in flight (False: it ended, well or not)."""
        if load.error is not None or load.handle is None:
            return False
        try:
            if self.transport.done(load.handle):
                return False
            if time.monotonic() - load.started <= self.config.transfer_timeout:
                return True
            self.transport.wait(load.handle, 0.0)  # raises: cancels and reports the timeout
        except Exception as e:  # KVTransferError, or anything the transport raised
            self._failed(load, e, f"the read for {load.request_id!r}")
        return False

    def _run_transfers(self) -> None:
        """The pull thread's body: :meth:`_transfer_loop` until :meth:`close`. Should something
        end it that no guard catches (``SystemExit``, ``KeyboardInterrupt`` raised in it, an
        ``Exception`` in a guard itself), the pulls it holds are reported failed first, so that
        their requests are computed here (or failed) instead of waiting for ever."""
        in_flight: list[_Load] = []
        try:
            self._transfer_loop(in_flight)
        except BaseException as e:
            self._fail_all(in_flight, e)
            raise

    def _fail_all(self, in_flight: list[_Load], exc: BaseException) -> None:
        """Reports every pull the dying thread holds (in flight or queued) as failed, without
        calling out (no lease release: the producer's leases expire)."""
        pending = list(in_flight)
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None and not job.release_only:
                pending.append(job)
        for load in pending:
            if load.error is None:
                load.error = f"the KV pull thread died: {type(exc).__name__}: {exc}"[:1000]
            load.ended = time.monotonic()
            self._done.put(load)
        if pending and self.wake is not None:
            try:
                self.wake()
            except Exception:  # noqa: BLE001 - the engine finds them at its next step anyway
                pass

    def _transfer_loop(self, in_flight: list[_Load]) -> None:
        """Takes pulls from the queue and drives their reads until the ``None`` that
        :meth:`close` queues (module docs: no pull's failure ends it)."""
        while True:
            try:
                job: _Load | None = self._jobs.get(timeout=_POLL_S) if in_flight else self._jobs.get()
            except queue.Empty:
                job = None
            else:
                if job is None:
                    return  # close()
            try:
                if job is not None:
                    if job.release_only:
                        self._release_lease(job)
                    else:
                        in_flight.append(job)
                        self._start_read(job)
                # in_flight is changed in place: it is what _fail_all reports should the thread die.
                for load in list(in_flight):
                    if not self._poll_read(load):
                        in_flight.remove(load)
                        self._finish(load)
            except Exception as e:  # noqa: BLE001 - outside any one pull: fail those in flight, go on
                self.background.record_error(PULL_THREAD, e, "the pulls in flight")
                for load in in_flight:
                    if load.error is None:
                        load.error = f"the pull thread failed: {type(e).__name__}: {e}"[:1000]
                    self._finish(load)
                in_flight.clear()

    def stats(self) -> dict[str, Any]:
        return {
            **self.counters,
            # Pulls in flight, those of aborted requests included (their reads still end here);
            # the requests waiting for them are the scheduler's num_waiting_for_remote_kv.
            "num_kv_pulls_in_flight": len(self.loads),
            "kv_transfer_engine_id": self.engine_id,
            "kv_transfer_address": self.address,
        }

    def close(self) -> None:
        """Stops the pull thread and the control server (their end is not a failure), closes
        the transport."""
        if self._thread is not None and self._thread.is_alive():
            self.background.stopping(PULL_THREAD)
            self._jobs.put(None)
            self._thread.join(timeout=10)
        if self.control is not None:
            self.control.close()
        self.transport.close()
