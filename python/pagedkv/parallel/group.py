"""The tensor-parallel process group: one private torch.distributed group per engine (gloo on
the CPU, NCCL on CUDA), so a user's own default process group is never touched.

Every collective has the group's timeout: a rank that dies closes its sockets and the others'
collective fails at once; a rank that hangs makes theirs fail after ``timeout`` seconds. Either
way the engine gets an exception, never a hang.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from pagedkv.errors import ConfigError

__all__ = ["TPGroup"]


@dataclass
class TPGroup:
    """This process's place in the tensor-parallel group: ``rank`` of ``world_size``; rank 0 is
    the engine (scheduler, sampler, detokenizer), the others are workers."""

    rank: int
    world_size: int
    device: torch.device
    _pg: Any
    _store: Any
    # Time spent in collectives (seconds) and their count, by kind ("all_reduce", "broadcast"):
    # what tensor parallelism costs this rank (benches/bench_tp.py reads them).
    seconds: dict[str, float] = field(default_factory=lambda: {"all_reduce": 0.0, "broadcast": 0.0})
    calls: dict[str, int] = field(default_factory=lambda: {"all_reduce": 0, "broadcast": 0})

    @classmethod
    def create(cls, rank: int, world_size: int, init_method: str, device: torch.device, timeout: float) -> TPGroup:
        """Joins the group at ``init_method`` (``tcp://host:port``; rank 0 hosts the store).
        Blocks until every rank has joined, or raises after ``timeout`` seconds."""
        url = urlparse(init_method)
        if url.scheme != "tcp" or not url.hostname or not url.port:
            raise ConfigError(f"a tensor-parallel init_method is tcp://host:port, got {init_method!r}")
        td = datetime.timedelta(seconds=timeout)
        store = dist.TCPStore(url.hostname, url.port, world_size, rank == 0, timeout=td)
        prefixed = dist.PrefixStore("pagedkv-tp/", store)
        pg: Any
        if device.type == "cuda":
            pg = dist.ProcessGroupNCCL(prefixed, rank, world_size, dist.ProcessGroupNCCL.Options())
        else:
            pg = dist.ProcessGroupGloo(prefixed, rank, world_size, td)
        return cls(rank=rank, world_size=world_size, device=device, _pg=pg, _store=store)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sums ``tensor`` over the ranks, in place (the row-parallel layers' reduction)."""
        t0 = time.perf_counter()
        self._pg.allreduce([tensor]).wait()
        self._count("all_reduce", t0)
        return tensor

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Overwrites ``tensor`` with rank ``src``'s, in place."""
        t0 = time.perf_counter()
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        self._pg.broadcast([tensor], opts).wait()
        self._count("broadcast", t0)
        return tensor

    def _count(self, kind: str, t0: float) -> None:
        self.seconds[kind] += time.perf_counter() - t0
        self.calls[kind] += 1

    def min_int(self, value: int) -> int:
        """The smallest of every rank's ``value`` (the pool is sized by the tightest rank)."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        self._pg.allreduce([t], dist.ReduceOp.MIN).wait()
        return int(t.item())
