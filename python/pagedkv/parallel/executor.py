"""Starting and stopping the tensor-parallel ranks other than the engine's own.

``MultiprocExecutor`` (``distributed_executor_backend="mp"``): ranks 1..N-1 are local
processes, each a fresh interpreter running ``python -m pagedkv.parallel.worker`` (see that
module): it builds its shard of the model and its KV cache, then executes every step rank 0
broadcasts until told to stop. A fresh interpreter, not ``multiprocessing``'s ``spawn``: spawn
re-imports the user's ``__main__``, so a script without an ``if __name__ == "__main__":`` guard
would build a second engine in every worker (and never start).

Failure handling: a worker that fails leaves (its sockets close, so rank 0's next collective
fails at once); rank 0 that fails or goes away makes every worker's next receive fail, and
workers leave then (a worker also leaves when its parent process is gone). The executor
reports which worker died and how (:meth:`MultiprocExecutor.failures`), and :meth:`shutdown`
ends them all, killing any that do not stop within the timeout; the same kill runs at
interpreter exit for an engine never shut down: no orphan processes.
"""

from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys
import weakref
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from pagedkv.errors import ConfigError
from pagedkv.parallel.group import TPGroup, host_store
from pagedkv.parallel.preflight import check_model_divides
from pagedkv.parallel.rank import TPRank
from pagedkv.parallel.spec import TPSpec

if TYPE_CHECKING:
    from pagedkv.parallel.ray_executor import RayExecutor

__all__ = ["MultiprocExecutor", "TPSpec", "start_workers", "usable_group"]

logger = logging.getLogger(__name__)

WORKER_MODULE = "pagedkv.parallel.worker"


def _worker_env() -> dict[str, str]:
    """This process's environment, with the folder that holds this pagedkv first on the
    worker's import path (so it runs this same code whatever the current directory)."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return env


def _stop(processes: list[subprocess.Popen[bytes]], timeout: float) -> None:
    """Waits up to ``timeout`` s for each process, then SIGTERM, then SIGKILL for any left."""
    for p in processes:
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
    for p in processes:
        for signal_it in (p.terminate, p.kill):
            if p.poll() is not None:
                break
            signal_it()
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass


class MultiprocExecutor:
    """Ranks 1..N-1 of a tensor-parallel engine as local worker processes."""

    def __init__(self, engine_config: Any, init_method: str, timeout: float) -> None:
        world = engine_config.parallel.tensor_parallel_size
        # Workers build only a runner: no KV connector, no disk tier of their own.
        worker_config = replace(engine_config, kv_transfer=None)
        self.timeout = timeout
        self.processes: list[subprocess.Popen[bytes]] = []
        # At interpreter exit (or if the executor is dropped) any worker still running is stopped.
        self._finalizer = weakref.finalize(self, _stop, self.processes, 0.0)
        env = _worker_env()
        for rank in range(1, world):
            spec = TPSpec(rank, world, init_method, timeout, device_index=rank)
            p = subprocess.Popen([sys.executable, "-m", WORKER_MODULE], stdin=subprocess.PIPE, env=env)
            self.processes.append(p)
            assert p.stdin is not None
            try:
                with p.stdin:
                    pickle.dump((spec, worker_config, os.getpid()), p.stdin)
            except BrokenPipeError:  # it died at once: failures() says how
                pass

    def alive(self) -> list[bool]:
        """Whether each worker (rank 1, 2, ...) is still running."""
        return [p.poll() is None for p in self.processes]

    def failures(self) -> list[str]:
        """How each worker that is no longer running ended."""
        return [
            f"worker rank {rank} (pid {p.pid}) exited with code {p.returncode}"
            for rank, p in enumerate(self.processes, start=1)
            if p.poll() is not None
        ]

    def shutdown(self, group: object = None) -> None:
        """Stops every worker: a shutdown broadcast when ``group`` (rank 0's :class:`TPRank`, or
        its :class:`TPGroup`; None: not usable) is usable, then a join, then SIGTERM and
        SIGKILL for any still running. Idempotent."""
        tp_group = usable_group(group)
        if tp_group is not None and all(self.alive()):
            from pagedkv.parallel.step_broadcast import send_shutdown

            try:
                send_shutdown(tp_group)
            except Exception:  # a worker is already gone: the others leave on their own
                pass
        _stop(self.processes, self.timeout)


def usable_group(group: object) -> TPGroup | None:
    """The group to broadcast the shutdown on: ``group`` itself, or a joined rank's."""
    if isinstance(group, TPRank):
        return group.group
    return group if isinstance(group, TPGroup) else None


def _on_cuda(config: Any) -> bool:
    device = str(config.model.device)
    return device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())


def start_workers(config: Any) -> tuple[TPRank, MultiprocExecutor | RayExecutor]:
    """Starts ranks 1..N-1 with ``distributed_executor_backend`` (``"mp"``: local processes,
    the default; ``"ray"``: Ray actors, joining a running Ray or starting a local one) and
    returns rank 0's :class:`TPRank` (for ``ModelRunner(..., tp=...)``), whose store is already
    listening on this node at the address the workers reach it by. The model and the machine are checked first (``preflight``): nothing starts
    for a size that cannot work."""
    parallel = config.parallel
    n = parallel.tensor_parallel_size
    backend = parallel.distributed_executor_backend or "mp"
    on_cuda = _on_cuda(config)
    check_model_divides(config.model, n)
    if backend == "mp" and on_cuda and n > torch.cuda.device_count():
        raise ConfigError(
            f"tensor_parallel_size={n} needs a CUDA device per rank; {torch.cuda.device_count()} visible "
            "(use distributed_executor_backend='ray' for ranks on other nodes)"
        )
    if backend == "ray":
        from pagedkv.parallel.ray_executor import RayExecutor, join_or_start_ray

        started_ray, host = join_or_start_ray(n, on_cuda)
        store, init_method = host_store(host, n, parallel.timeout)
        executor: MultiprocExecutor | RayExecutor = RayExecutor(
            config, init_method, parallel.timeout, started_ray=started_ray
        )
    else:
        store, init_method = host_store("127.0.0.1", n, parallel.timeout)
        executor = MultiprocExecutor(config, init_method, parallel.timeout)
    spec = TPSpec(0, n, init_method, parallel.timeout, store=store, peer_failures=executor.failures)
    return TPRank(spec), executor
