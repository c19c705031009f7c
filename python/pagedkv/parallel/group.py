"""The tensor-parallel process group: one private torch.distributed group per engine (gloo on
the CPU, NCCL on CUDA), so a user's own default process group is never touched.

Every collective has the group's timeout: a rank that dies closes its sockets and the others'
collective fails at once; a rank that hangs makes theirs fail after ``timeout`` seconds. Either
way the engine gets an exception, never a hang. The one exception is a worker waiting for the
next step (:meth:`TPGroup.broadcast` with ``wait_forever``): an engine with no requests sends
none for as long as it likes, so that wait has no deadline (rank 0 dying still ends it at once:
its sockets close). With the group's timeout there, an engine idle for ``timeout`` seconds lost
its workers (the Ray test's flake: the first Ray start on a machine kept the test's other engine
idle past 60 s).

Two process groups over one store: ``device`` collectives (the all-reduces: gloo on the CPU,
NCCL on CUDA) and a gloo ``control`` group for CPU tensors (the step broadcast, the pool-size
agreement), which on the CPU is the same group. Steps are numpy arrays on the host, so they
travel without a device copy, and NCCL's watchdog never sees an idle wait.

Rank 0's store is created first (:func:`host_store`, on a port the kernel picks and the store
keeps from then on) and handed to rank 0's :class:`TPGroup`: no port is chosen, released and
bound again later, which another process could take in between. It listens on the group's
host only (torch's own store listens on every interface); with a loopback host (the ``mp``
executor) the gloo pairs listen on loopback too, so nothing of a local group is reachable from
another machine.
"""

from __future__ import annotations

import datetime
import ipaddress
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from pagedkv.errors import ConfigError, EngineDeadError
from pagedkv.listen import listening_socket

__all__ = ["TPGroup", "host_store"]

# A wait for the next step: effectively none (gloo takes a deadline; ten years is none).
_NO_DEADLINE = datetime.timedelta(days=3650)
# Each rank's "ready to join" key, and how often rank 0 checks its workers while waiting.
_READY = "pagedkv-tp-ready/"
_READY_POLL_SECONDS = 0.2


def host_store(host: str, world_size: int, timeout: float) -> tuple[Any, str]:
    """Rank 0's store, listening on ``host`` at a port the kernel picks; and its
    ``tcp://host:port`` init method for the other ranks. It does not wait for them here."""
    td = datetime.timedelta(seconds=timeout)
    with listening_socket(host, 0, "tensor-parallel store") as sock:
        port = int(sock.getsockname()[1])
        # The store takes the socket over (it closes the descriptor when it is destroyed).
        store = dist.TCPStore(  # type: ignore[attr-defined]
            host, port, world_size, True, timeout=td, wait_for_workers=False, master_listen_fd=sock.detach()
        )
    return store, f"tcp://{host}:{port}"


def _wait_for_every_rank(store: Any, rank: int, world_size: int, peer_failures: Callable[[], list[str]] | None) -> None:
    """Says this rank is ready to join, then waits until every rank is. Loading the model
    takes what it takes (a loaded machine, a first Ray start, a large download), so there is no
    deadline while the others live: rank 0 polls ``peer_failures`` (a worker that died ends
    the wait with EngineDeadError) and a worker's wait fails at once if rank 0's store goes
    away. The join itself, with every rank present, then has the group's timeout."""
    store.set(f"{_READY}{rank}", "1")
    keys = [f"{_READY}{r}" for r in range(world_size)]
    while not store.check(keys):  # a lost store raises (DistNetworkError)
        failures = peer_failures() if peer_failures is not None else []
        if failures:
            raise EngineDeadError(f"tensor-parallel workers failed to start: {'; '.join(failures)}")
        time.sleep(_READY_POLL_SECONDS)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _gloo_group(store: Any, rank: int, world_size: int, host: str, td: datetime.timedelta) -> Any:
    """A gloo group over ``store``; its pairs listen on loopback when the group's host is."""
    if not _is_loopback(host):
        return dist.ProcessGroupGloo(store, rank, world_size, td)
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._timeout = td
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return dist.ProcessGroupGloo(store, rank, world_size, options)


@dataclass
class TPGroup:
    """This process's place in the tensor-parallel group: ``rank`` of ``world_size``; rank 0 is
    the engine (scheduler, sampler, detokenizer), the others are workers."""

    rank: int
    world_size: int
    device: torch.device
    _pg: Any
    _store: Any
    _control: Any  # the gloo group for CPU tensors (``_pg`` itself on the CPU)
    # Time spent in collectives (seconds) and their count, by kind ("all_reduce", "broadcast"):
    # what tensor parallelism costs this rank (benches/bench_tp.py reads them).
    seconds: dict[str, float] = field(default_factory=lambda: {"all_reduce": 0.0, "broadcast": 0.0})
    calls: dict[str, int] = field(default_factory=lambda: {"all_reduce": 0, "broadcast": 0})

    @classmethod
    def create(
        cls,
        rank: int,
        world_size: int,
        init_method: str,
        device: torch.device,
        timeout: float,
        store: Any = None,
        peer_failures: Callable[[], list[str]] | None = None,
    ) -> TPGroup:
        """Joins the group at ``init_method`` (``tcp://host:port``; rank 0 hosts the store: pass
        the one :func:`host_store` made as ``store``). Waits until every rank is ready to join
        (:func:`_wait_for_every_rank`; ``peer_failures``: how rank 0 learns that a worker died
        meanwhile), then joins within ``timeout`` seconds."""
        url = urlparse(init_method)
        if url.scheme != "tcp" or not url.hostname or not url.port:
            raise ConfigError(f"a tensor-parallel init_method is tcp://host:port, got {init_method!r}")
        td = datetime.timedelta(seconds=timeout)
        if store is None:
            store = dist.TCPStore(url.hostname, url.port, world_size, rank == 0, timeout=td)  # type: ignore[attr-defined]
        _wait_for_every_rank(store, rank, world_size, peer_failures)
        control = _gloo_group(dist.PrefixStore("pagedkv-tp/", store), rank, world_size, url.hostname, td)  # type: ignore[attr-defined]
        pg: Any = control
        if device.type == "cuda":
            nccl_store = dist.PrefixStore("pagedkv-tp-nccl/", store)  # type: ignore[attr-defined]
            pg = dist.ProcessGroupNCCL(nccl_store, rank, world_size, dist.ProcessGroupNCCL.Options())
        return cls(rank=rank, world_size=world_size, device=device, _pg=pg, _store=store, _control=control)

    def close(self) -> None:
        """Shuts this rank's groups down now (idempotent). A process that leaves without it has
        its gloo group destroyed during the interpreter's teardown, where gloo's threads can
        still be joinable: the process then aborts ("terminate called without an active
        exception", exit -6) after a clean run (seen once in four runs of
        tests/serving/test_operator_experience.py)."""
        for pg in {id(g): g for g in (self._pg, self._control) if g is not None}.values():
            try:
                pg.shutdown()
            except RuntimeError:  # already shut down, or the peer is gone: nothing to wait for
                pass
        self._pg = self._control = None

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sums ``tensor`` over the ranks, in place (the row-parallel layers' reduction)."""
        t0 = time.perf_counter()
        self._pg.allreduce([tensor]).wait()
        self._count("all_reduce", t0)
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int = 0, *, wait_forever: bool = False) -> torch.Tensor:
        """Overwrites ``tensor`` with rank ``src``'s, in place (a CPU tensor over the control
        group). ``wait_forever``: no deadline (a worker waiting for the next step)."""
        t0 = time.perf_counter()
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        if wait_forever:
            opts.timeout = _NO_DEADLINE
        pg = self._control if tensor.device.type == "cpu" else self._pg
        pg.broadcast([tensor], opts).wait()
        self._count("broadcast", t0)
        return tensor

    def _count(self, kind: str, t0: float) -> None:
        self.seconds[kind] += time.perf_counter() - t0
        self.calls[kind] += 1

    def min_int(self, value: int) -> int:
        """The smallest of every rank's ``value`` (the pool is sized by the tightest rank)."""
        t = torch.tensor([value], dtype=torch.int64)
        self._control.allreduce([t], dist.ReduceOp.MIN).wait()
        return int(t.item())
