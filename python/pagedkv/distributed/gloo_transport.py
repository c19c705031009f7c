"""KV transport over ``torch.distributed`` gloo: the fallback when NIXL is not installed.

Gloo has no one-sided reads, so a pull needs the holder's cooperation. The protocol:

1. Every engine is one rank of a private gloo process group (``ProcessGroupGloo`` on a
   ``TCPStore`` at ``init_method``; rank 0 hosts the store, so rank 0 should be the engine
   that lives longest, e.g. the decode engine). The default process group is not touched.
   Rank 0's store listens on the ``init_method`` host only (torch's own would listen on every
   interface), and each rank's gloo pairs listen on its address towards that host (loopback
   for a loopback ``init_method``), not on whatever the machine's hostname resolves to.
2. Reader: ``read_blocks`` posts ``irecv(buffer, src=holder, tag=seq)`` first, then writes the
   request ``{"runs": "[[remote_start, length], ...]", "mac": ...}`` to the store key
   ``req/<holder>/<reader>/<seq>`` (``seq`` counts this reader's requests to this holder; the
   tag makes each reply match exactly its request, whatever the order). With an ``auth_key``
   the request is signed (HMAC over holder, reader, seq and runs): the store has no
   authentication, and whoever reaches it could otherwise slip in requests under a reader's
   name (and so steer which blocks land in that reader's cache).
3. Holder: a daemon serving thread polls the store for each peer's next ``seq`` key, checks
   the signature and that every block is granted to that reader (``allow_reads``: the blocks
   of a lease it claimed), gathers the runs (``kv_cache[:, :, ids]``, then the scales) into
   one contiguous byte buffer and ``send``s it with ``tag=seq``. A request it refuses gets an
   ``err/<reader>/<seq>`` key, and nothing is sent.
4. Reader: a per-transfer thread waits for the receive and scatters the bytes into the local
   blocks (``index_copy_``); ``done``/``wait`` look at its outcome. (A failed gloo receive never
   reports ``is_completed()``, only ``wait()`` raises, hence a thread.) A peer that dies closes
   its sockets, and the pending receive fails at once with "connection closed/reset"; a hung
   peer hits the caller's ``wait`` timeout.

Everything travels as bytes (``uint8`` views), so int8 / fp8 caches need no gloo dtype support.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import json
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from pagedkv.distributed.kv_transport import (
    KVLayout,
    KVTransport,
    TransferHandle,
    check_block_ids,
    coalesce_runs,
    decode_metadata,
    encode_metadata,
)
from pagedkv.errors import ConfigError, InvalidArgumentError, KVTransferError
from pagedkv.listen import listening_socket

__all__ = ["GlooTransport"]

_POLL_S = 0.001  # the serving thread's idle poll of the store


def _run_ids(runs: Sequence[Sequence[int]]) -> torch.Tensor:
    return torch.cat([torch.arange(s, s + n, dtype=torch.long) for s, n in runs])


def _rank_name(rank: int) -> str:
    """A rank's ``engine_id`` (its name in metadata and in read grants)."""
    return f"gloo-rank{rank}"


def _request_mac(key: bytes, holder: int, reader: int, seq: int, runs: str) -> str:
    return hmac.new(key, f"{holder}/{reader}/{seq}/{runs}".encode(), hashlib.sha256).hexdigest()


def _local_address_towards(host: str, port: int) -> str:
    """This machine's address on the route to ``host`` (no packet is sent): where this rank's
    gloo pairs listen, reachable by the other ranks without listening everywhere."""
    try:
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(address)
            return str(probe.getsockname()[0])
    except OSError as e:
        raise ConfigError(f"gloo KV transport: no route to {host}:{port}: {e}") from e


class GlooTransport(KVTransport):
    kind = "gloo"
    enforces_read_grants = True

    def __init__(
        self, rank: int, world_size: int, init_method: str, timeout: float = 30.0, auth_key: bytes | None = None
    ) -> None:
        url = urlparse(init_method)
        if url.scheme != "tcp" or not url.hostname or not url.port:
            raise ConfigError(f"gloo KV transport init_method must be tcp://host:port, got {init_method!r}")
        if not 0 <= rank < world_size:
            raise ConfigError(f"rank {rank} out of range for world_size {world_size}")
        self.rank, self.world_size = rank, world_size
        self.engine_id = _rank_name(rank)
        self._auth_key = auth_key
        td = datetime.timedelta(seconds=timeout)
        host, port = url.hostname, url.port
        # Rank 0 listens on the configured host only: its own socket, handed to the store.
        listen_fd = listening_socket(host, port, "gloo KV transport").detach() if rank == 0 else None
        # Blocks until all ranks have connected (or raises after `timeout`).
        self._store: Any = dist.TCPStore(host, port, world_size, rank == 0, td, master_listen_fd=listen_fd)  # type: ignore[attr-defined]
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        options._timeout = td
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=_local_address_towards(host, port))]
        self._pg: Any = dist.ProcessGroupGloo(
            dist.PrefixStore("pagedkv-kv-pg/", self._store),  # type: ignore[attr-defined]
            rank,
            world_size,
            options,
        )
        self._kv: torch.Tensor | None = None
        self._scale: torch.Tensor | None = None
        self._peers: dict[str, tuple[int, KVLayout]] = {}
        self._next_seq: dict[int, int] = {}  # reader side: next request seq per holder rank
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._server: threading.Thread | None = None

    # -- registration and handshake ------------------------------------------------------------

    def _register(self, kv_cache: torch.Tensor, kv_scale_cache: torch.Tensor | None) -> None:
        self._kv, self._scale = kv_cache, kv_scale_cache
        self._server = threading.Thread(target=self._serve, name=f"pagedkv-gloo-kv-{self.rank}", daemon=True)
        self._server.start()

    def local_metadata(self) -> bytes:
        return encode_metadata(self.kind, self.engine_id, self._require_layout(), {"rank": self.rank})

    def add_peer(self, metadata: bytes) -> str:
        layout = self._require_layout()
        engine_id, remote, d = decode_metadata(metadata, self.kind)
        layout.check_compatible(remote)
        rank = int(d["rank"])
        if rank == self.rank or not 0 <= rank < self.world_size:
            raise ConfigError(f"peer rank {rank} is not another rank of this {self.world_size}-rank group")
        self._peers[engine_id] = (rank, remote)
        return engine_id

    def remove_peer(self, peer: str) -> None:
        self._peers.pop(peer, None)

    # -- holder side -------------------------------------------------------------------------------

    def _serve(self) -> None:
        served = dict.fromkeys((r for r in range(self.world_size) if r != self.rank), 0)
        while not self._stop.is_set():
            busy = False
            for reader, seq in served.items():
                key = f"req/{self.rank}/{reader}/{seq}"
                try:
                    if not self._store.check([key]):
                        continue
                    raw = self._store.get(key)
                    self._store.delete_key(key)
                except Exception:  # the store (rank 0) is gone: nobody can ask us anything
                    return
                served[reader] = seq + 1
                busy = True
                self._answer(reader, seq, raw)
            if not busy:
                time.sleep(_POLL_S)

    def _checked_runs(self, reader: int, seq: int, request: Any) -> list[tuple[int, int]]:
        """The runs of a pull request, after its signature, range and grant checks."""
        layout = self._require_layout()
        text = request.get("runs") if isinstance(request, dict) else None
        if not isinstance(text, str):
            raise ValueError("malformed request")
        if self._auth_key is not None:
            mac = request.get("mac")
            expected = _request_mac(self._auth_key, self.rank, reader, seq, text)
            if not isinstance(mac, str) or not hmac.compare_digest(mac, expected):
                raise ValueError("the request is not signed with this deployment's key")
        runs = [(int(s), int(n)) for s, n in json.loads(text)]
        if any(s < 0 or n <= 0 or s + n > layout.num_blocks for s, n in runs):
            raise ValueError(f"block run out of range [0, {layout.num_blocks})")
        if not self.reads_allowed(_rank_name(reader), [b for s, n in runs for b in range(s, s + n)]):
            raise ValueError("blocks outside what this reader was granted (a lease it claimed)")
        return runs

    def _answer(self, reader: int, seq: int, raw: bytes) -> None:
        layout, kv = self._layout, self._kv
        assert layout is not None and kv is not None
        try:
            runs = self._checked_runs(reader, seq, json.loads(raw))
            ids = _run_ids(runs).to(kv.device)
            parts = [kv.index_select(2, ids).reshape(-1).view(torch.uint8)]
            if self._scale is not None:
                parts.append(self._scale.index_select(2, ids).reshape(-1).view(torch.uint8))
            payload = torch.cat(parts).cpu()
        except Exception as e:
            self._store.set(f"err/{reader}/{seq}", f"holder rank {self.rank} refused request {seq}: {e}")
            return
        try:
            self._pg.send([payload], reader, seq).wait()
        except Exception:  # the reader died or gave up; its side reports the error
            pass

    # -- reader side -------------------------------------------------------------------------------

    def read_blocks(self, peer: str, remote_block_ids: Sequence[int], local_block_ids: Sequence[int]) -> TransferHandle:
        layout = self._require_layout()
        if peer not in self._peers:
            raise InvalidArgumentError(f"unknown KV transfer peer {peer!r}")
        holder, remote = self._peers[peer]
        check_block_ids(remote_block_ids, local_block_ids, remote.num_blocks, layout.num_blocks)
        n = len(local_block_ids)
        handle = TransferHandle(peer=peer, num_blocks=n, nbytes=n * layout.bytes_per_block)
        if n == 0:
            handle.finished = True
            return handle
        runs = coalesce_runs(remote_block_ids, local_block_ids)
        buf = torch.empty(handle.nbytes, dtype=torch.uint8)
        with self._lock:
            seq = self._next_seq.get(holder, 0)
            self._next_seq[holder] = seq + 1
        try:
            work = self._pg.recv([buf], holder, seq)  # posted before the request: no lost reply
            text = json.dumps([[r, k] for r, _, k in runs])
            request = {"runs": text}
            if self._auth_key is not None:
                request["mac"] = _request_mac(self._auth_key, holder, self.rank, seq, text)
            self._store.set(f"req/{holder}/{self.rank}/{seq}", json.dumps(request))
        except Exception as e:
            raise KVTransferError(f"gloo read from {peer!r} could not start: {e}") from e
        local_ids = torch.tensor(list(local_block_ids), dtype=torch.long)
        # The lock orders "scatter into the local blocks" against "wait() gave up": a reply
        # that arrives after a timeout is dropped, never written into blocks the caller reused.
        state = {"event": threading.Event(), "lock": threading.Lock(), "err_key": f"err/{self.rank}/{seq}"}
        thread = threading.Thread(
            target=self._receive,
            args=(handle, work, buf, local_ids, state),
            name=f"pagedkv-gloo-recv-{seq}",
            daemon=True,
        )
        handle.state = state
        thread.start()
        return handle

    def _receive(
        self, handle: TransferHandle, work: Any, buf: torch.Tensor, local_ids: torch.Tensor, state: dict[str, Any]
    ) -> None:
        layout, kv = self._layout, self._kv
        assert layout is not None and kv is not None
        try:
            work.wait()
            n = local_ids.numel()
            kv_bytes = 2 * layout.num_layers * n * layout.block_bytes
            shape = (layout.num_layers, 2, n, *kv.shape[3:])
            ids = local_ids.to(kv.device)
            # An engine's cache is an inference tensor: it may only be written in inference mode.
            with state["lock"], torch.inference_mode():
                if handle.error is None:
                    kv.index_copy_(2, ids, buf[:kv_bytes].view(kv.dtype).view(shape).to(kv.device))
                    if self._scale is not None:
                        scales = buf[kv_bytes:].view(self._scale.dtype).view(shape[:5])
                        self._scale.index_copy_(2, ids, scales.to(kv.device))
                    handle.finished = True
        except Exception as e:
            with state["lock"]:
                if handle.error is None:
                    handle.error = f"gloo read from {handle.peer!r} failed: {e}"
        state["event"].set()

    def done(self, handle: TransferHandle) -> bool:
        state = handle.state
        if state is not None and not state["event"].is_set():
            # A refusal by the holder arrives through the store, not as a failed receive.
            try:
                refused = self._store.check([state["err_key"]])
                reason = self._store.get(state["err_key"]).decode() if refused else None
            except Exception as e:
                refused, reason = True, f"gloo read from {handle.peer!r}: rendezvous store unreachable: {e}"
            if refused:
                self._give_up(handle, str(reason))
        if handle.error is not None:
            raise KVTransferError(handle.error)
        return handle.finished

    def _give_up(self, handle: TransferHandle, reason: str) -> None:
        with handle.state["lock"]:
            if not handle.finished and handle.error is None:
                handle.error = reason

    def wait(self, handle: TransferHandle, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self.done(handle):
            left = deadline - time.monotonic()
            if left <= 0:
                # The receive stays posted (gloo cannot cancel it) but its data will be dropped.
                self._give_up(handle, f"gloo read from {handle.peer!r} did not finish within {timeout:.1f}s")
                continue  # done() now raises, unless the data landed just before the lock
            handle.state["event"].wait(min(left, 0.05))

    def close(self) -> None:
        self._stop.set()
        if self._server is not None:
            self._server.join(timeout=5)
            self._server = None
        self._peers.clear()
