"""KV transport over NVIDIA NIXL (UCX backend).

Each engine is one NIXL agent that registers its whole ``kv_cache`` (and scale) tensor once;
the agent metadata (UCX worker address + registered regions' remote keys) travels in
``local_metadata``. A read is a one-sided NIXL READ: the reader names remote byte regions
(computed from the peer's base address and layout) and local ones, and NIXL/UCX moves them
(shared memory / CMA / TCP on one host, RDMA between hosts); the holder runs no code for it.

UCX needs no environment variables, so the transport sets none: on one host without GPU or
InfiniBand it picks, by itself, CMA (``process_vm_readv``, zero-copy) for the remote reads and
TCP over ``lo`` for its control messages (seen with ``UCX_PROTO_INFO=y``). Set ``UCX_TLS`` /
``UCX_NET_DEVICES`` in the environment to pin transports on other machines.

Security: a read is one-sided, so the holder cannot check it (``allow_reads`` grants are kept
but not enforced). Whoever has an agent's metadata (its UCX worker address and the registered
regions' remote keys) can read the whole registered cache; the connector hands it out only
over the authenticated control plane, and its consumer reads only the blocks a producer
vouched for. UCX listens (TCP, for its wire-up and control messages) on every network device
it may use, by default all of them: ``loopback_only=True`` (the connector's choice for a
producer whose control socket is on loopback) sets ``UCX_NET_DEVICES=lo`` for this process
unless the environment already sets it; otherwise set ``UCX_NET_DEVICES`` / ``UCX_TLS``
yourself and firewall UCX's ports like the engines' other ones.

Install: ``pip install 'pagedkv[nixl]'`` (= ``nixl-cu13==1.5.1``, Linux). That wheel provides the
module ``nixl_cu13``; the ``nixl`` meta package is only an ``import nixl`` shim over it (and pins
the cu12 and cu13 wheels both), so it is not needed; it is used when present.
"""

from __future__ import annotations

import base64
import importlib
import logging
import os
import threading
import time
import uuid
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import numpy as np
import torch

from pagedkv.distributed.kv_transport import (
    KVLayout,
    KVTransport,
    TransferHandle,
    check_block_ids,
    coalesce_runs,
    decode_metadata,
    encode_metadata,
    run_regions,
)
from pagedkv.errors import ConfigError, InvalidArgumentError, KVTransferError

__all__ = ["NixlTransport", "import_nixl_api"]

logger = logging.getLogger(__name__)


def import_nixl_api() -> ModuleType:
    """NIXL's ``_api`` module: through the ``nixl`` shim if installed, else the CUDA wheel."""
    for name in ("nixl._api", "nixl_cu13._api", "nixl_cu12._api"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise ConfigError("NIXL is not installed (pip install 'pagedkv[nixl]', i.e. nixl-cu13==1.5.1)")


# How often the holder-side progress thread drives UCX: often enough that a pull is not held up
# (bench_kv_transport: no slower than a shorter interval), rarely enough to cost little of an
# idle core.
PROGRESS_INTERVAL_S = 0.001


def _mem(t: torch.Tensor) -> tuple[str, int]:
    """NIXL memory type and device id of a tensor (DRAM descriptors use device id 0)."""
    return ("DRAM", 0) if t.device.type == "cpu" else ("VRAM", int(t.device.index or 0))


class NixlTransport(KVTransport):
    kind = "nixl"

    def __init__(self, engine_id: str | None = None, loopback_only: bool = False) -> None:
        self._api = import_nixl_api()
        if loopback_only and "UCX_NET_DEVICES" not in os.environ:
            # Read by UCX when the agent creates its context, just below.
            os.environ["UCX_NET_DEVICES"] = "lo"
            logger.info("NIXL: UCX limited to the loopback device (UCX_NET_DEVICES=lo)")
        self.engine_id = engine_id or f"pagedkv-{uuid.uuid4().hex[:12]}"
        # UCX must make progress on both sides (the holder answers the reader's wire-up and, over
        # TCP, serves its reads). NIXL's own progress thread polls with no pause, a whole core
        # per engine even when nothing moves (measured: 0.97 core idle), so it is off; a
        # thread of ours drives progress with a short sleep instead (_drive_progress).
        # STRICT: NIXL locks the agent itself, since two threads call it (ours and the caller's).
        config = self._api.nixl_agent_config(
            enable_prog_thread=False, backends=["UCX"], sync_mode=self._api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
        )
        self._agent: Any = self._api.nixl_agent(self.engine_id, config)
        self._stop = threading.Event()
        self._progress = threading.Thread(target=self._drive_progress, name="pagedkv-nixl-progress", daemon=True)
        self._progress.start()
        self._tensors: list[torch.Tensor] = []
        self._regs: list[Any] = []
        self._peers: dict[str, dict[str, Any]] = {}
        self._uncancelled: list[Any] = []
        self._closed = False

    def _drive_progress(self) -> None:
        """Progresses UCX every ``PROGRESS_INTERVAL_S`` (asking NIXL for notifications is what
        progresses its backend), so a holder's reads advance while its engine computes."""
        while not self._stop.wait(PROGRESS_INTERVAL_S):
            try:
                self._agent.get_new_notifs()
            except Exception:  # a peer gone mid-call: nothing to progress for it
                pass

    def _register(self, kv_cache: torch.Tensor, kv_scale_cache: torch.Tensor | None) -> None:
        self._tensors = [kv_cache] if kv_scale_cache is None else [kv_cache, kv_scale_cache]
        # One registration per tensor: the memory key covers every block of every layer.
        for t in self._tensors:
            self._regs.append(self._agent.register_memory(t))

    def local_metadata(self) -> bytes:
        layout = self._require_layout()
        mem, dev = _mem(self._tensors[0])
        extra = {
            "agent_metadata": base64.b64encode(self._agent.get_agent_metadata()).decode(),
            "addrs": [t.data_ptr() for t in self._tensors],
            "mem": mem,
            "device": dev,
        }
        return encode_metadata(self.kind, self.engine_id, layout, extra)

    def add_peer(self, metadata: bytes) -> str:
        layout = self._require_layout()
        engine_id, remote, d = decode_metadata(metadata, self.kind)
        layout.check_compatible(remote)  # before NIXL learns about the peer at all
        name = self._agent.add_remote_agent(base64.b64decode(d["agent_metadata"]))
        name = name.decode() if isinstance(name, bytes) else str(name)
        self._peers[name] = {
            "layout": remote,
            "addrs": [int(a) for a in d["addrs"]],
            "mem": d["mem"],
            "dev": d["device"],
        }
        return name

    def _descs(
        self, layout: KVLayout, num_blocks: int, addrs: list[int], dev: int, starts_lens: list[tuple[int, int]]
    ) -> np.ndarray:
        """Nx3 (address, nbytes, device) rows for every run in every (layer, K/V) of each tensor."""
        rows: list[tuple[int, int, int]] = []
        sizes = [layout.block_bytes, layout.scale_block_bytes]
        for addr, block_bytes in zip(addrs, sizes):
            for start, length in starts_lens:
                for a, n in run_regions(addr, layout.num_layers, num_blocks, block_bytes, start, length):
                    rows.append((a, n, dev))
        return np.array(rows, dtype=np.uint64).reshape(-1, 3)

    def read_blocks(self, peer: str, remote_block_ids: Sequence[int], local_block_ids: Sequence[int]) -> TransferHandle:
        layout = self._require_layout()
        if peer not in self._peers:
            raise InvalidArgumentError(f"unknown KV transfer peer {peer!r}")
        p = self._peers[peer]
        remote: KVLayout = p["layout"]
        check_block_ids(remote_block_ids, local_block_ids, remote.num_blocks, layout.num_blocks)
        handle = TransferHandle(
            peer=peer, num_blocks=len(local_block_ids), nbytes=len(local_block_ids) * layout.bytes_per_block
        )
        if not local_block_ids:
            handle.finished = True
            return handle
        runs = coalesce_runs(remote_block_ids, local_block_ids)
        mem, dev = _mem(self._tensors[0])
        local = self._descs(
            layout, layout.num_blocks, [t.data_ptr() for t in self._tensors], dev, [(ls, n) for _, ls, n in runs]
        )
        rem = self._descs(remote, remote.num_blocks, p["addrs"], p["dev"], [(rs, n) for rs, _, n in runs])
        try:
            xfer = self._agent.initialize_xfer(
                "READ", self._agent.get_xfer_descs(local, mem), self._agent.get_xfer_descs(rem, p["mem"]), peer
            )
            handle.state = xfer
            state = self._agent.transfer(xfer)
        except Exception as e:  # nixlRemoteDisconnectError and friends: the peer is gone
            self._release(handle)
            raise KVTransferError(f"NIXL read from {peer!r} could not start: {type(e).__name__}: {e}") from e
        self._settle(handle, state)
        return handle

    def _release(self, handle: TransferHandle) -> bool:
        """Releases (for an in-flight transfer: cancels) the NIXL request; False if NIXL refused."""
        if handle.state is None:
            return True
        try:
            self._agent.release_xfer_handle(handle.state)
        except Exception:  # NIXL could not cancel it; keep it referenced so it is not freed mid-flight
            self._uncancelled.append(handle.state)
            return False
        finally:
            handle.state = None
        return True

    def _settle(self, handle: TransferHandle, state: str) -> None:
        if state == "DONE":
            handle.finished = True
            self._release(handle)
        elif state != "PROC":
            handle.error = f"NIXL reported {state} for the read from {handle.peer!r}"
            self._release(handle)

    def done(self, handle: TransferHandle) -> bool:
        if handle.error is not None:
            raise KVTransferError(handle.error)
        if handle.finished:
            return True
        try:
            state = self._agent.check_xfer_state(handle.state)
        except Exception as e:
            state = f"{type(e).__name__}: {e}"
        self._settle(handle, state)
        if handle.error is not None:
            raise KVTransferError(handle.error)
        return handle.finished

    def wait(self, handle: TransferHandle, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self.done(handle):
            if time.monotonic() > deadline:
                handle.error = f"NIXL read from {handle.peer!r} did not finish within {timeout:.1f}s"
                if not self._release(handle):
                    handle.error += " and could not be cancelled: the target blocks may still be written"
                raise KVTransferError(handle.error)
            time.sleep(0.0001)  # the progress thread moves the data; we only poll its state

    def remove_peer(self, peer: str) -> None:
        if self._peers.pop(peer, None) is not None:
            try:
                self._agent.remove_remote_agent(peer)
            except Exception:  # already disconnected
                pass

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._progress.join(timeout=5)
        for peer in list(self._peers):
            self.remove_peer(peer)
        for reg in self._regs:
            try:
                self._agent.deregister_memory(reg)
            except Exception:
                pass
        self._regs.clear()
        self._tensors.clear()
