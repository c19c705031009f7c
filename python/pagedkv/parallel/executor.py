"""Running the tensor-parallel ranks other than the engine's own.

``MultiprocExecutor`` (``distributed_executor_backend="mp"``): ranks 1..N-1 are local
processes (``spawn``: no forked torch or CUDA state), each running :func:`run_worker`: build
its shard of the model and its KV cache (a :class:`~pagedkv.worker.model_runner.ModelRunner`
joined to the group), then execute every step rank 0 broadcasts until told to stop.

Failure handling: a worker that fails leaves (its sockets close, so rank 0's next collective
fails at once); rank 0 that fails or goes away makes every worker's next receive fail, and
workers leave then (they are daemon processes of the engine's process besides). The executor
reports which worker died and how (:meth:`MultiprocExecutor.failures`), and :meth:`shutdown`
ends them all, killing any that do not stop within the timeout: no orphan processes.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import socket
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from pagedkv.errors import ConfigError

if TYPE_CHECKING:
    from pagedkv.parallel.ray_executor import RayExecutor

__all__ = ["MultiprocExecutor", "TPSpec", "run_worker", "start_workers"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TPSpec:
    """Where a rank joins the tensor-parallel group (``ModelRunner(..., tp=TPSpec(...))``)."""

    rank: int
    world_size: int
    init_method: str  # tcp://host:port of rank 0's store
    timeout: float
    # The CUDA device this rank uses among those visible to its process: the rank for local
    # processes, 0 for a Ray actor (Ray gives each actor its own CUDA_VISIBLE_DEVICES).
    device_index: int = 0


def run_worker(spec: TPSpec, engine_config: Any) -> None:
    """A worker rank's whole life: join, build its runner, execute broadcast steps, leave."""
    from pagedkv.parallel.step_broadcast import recv_step
    from pagedkv.worker.model_runner import ModelRunner

    logging.basicConfig(level=logging.WARNING, format=f"%(levelname)s tp-rank{spec.rank} %(name)s: %(message)s")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    # The ranks share the machine's cores on the CPU: split them.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.world_size))
    torch.manual_seed(engine_config.model.seed)
    runner = ModelRunner(engine_config.model, engine_config.cache, engine_config.scheduling, tp=spec)
    group = runner.tp_group
    assert group is not None
    while True:
        try:
            step = recv_step(group)
        except Exception as exc:  # rank 0 failed or is gone: nothing more will come
            logger.warning("leaving: the engine (rank 0) stopped answering: %s", exc)
            return
        if step is None:
            return
        try:
            runner.execute(step)
        except Exception:  # rank 0 fails the same step and stops the engine
            logger.exception("a step failed on this rank; leaving")
            raise


class MultiprocExecutor:
    """Ranks 1..N-1 of a tensor-parallel engine as local worker processes."""

    def __init__(self, engine_config: Any, init_method: str, timeout: float) -> None:
        world = engine_config.parallel.tensor_parallel_size
        # Workers build only a runner: no KV connector, no disk tier of their own.
        worker_config = replace(engine_config, kv_transfer=None)
        ctx = mp.get_context("spawn")
        self.timeout = timeout
        self.processes = [
            ctx.Process(
                target=run_worker,
                args=(TPSpec(rank, world, init_method, timeout, device_index=rank), worker_config),
                name=f"pagedkv-tp-rank{rank}",
                daemon=True,
            )
            for rank in range(1, world)
        ]
        for p in self.processes:
            p.start()

    def failures(self) -> list[str]:
        """How each worker that is no longer running ended."""
        return [
            f"worker rank {rank} (pid {p.pid}) exited with code {p.exitcode}"
            for rank, p in enumerate(self.processes, start=1)
            if not p.is_alive()
        ]

    def shutdown(self, group: Any = None) -> None:
        """Stops every worker: a shutdown broadcast when ``group`` is usable, then a join, then
        SIGTERM and SIGKILL for any still running. Idempotent."""
        if group is not None and all(p.is_alive() for p in self.processes):
            from pagedkv.parallel.step_broadcast import send_shutdown

            try:
                send_shutdown(group)
            except Exception:  # a worker is already gone: the others leave on their own
                pass
        for p in self.processes:
            p.join(timeout=self.timeout)
        for p in self.processes:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


def start_workers(config: Any) -> tuple[TPSpec, MultiprocExecutor | RayExecutor]:
    """Starts ranks 1..N-1 with ``distributed_executor_backend`` (``"mp"``: local processes,
    the default; ``"ray"``: Ray actors, joining a running Ray or starting a local one) and
    returns rank 0's place in the group: a free port on this node, at the address the workers
    reach it by."""
    parallel = config.parallel
    n = parallel.tensor_parallel_size
    backend = parallel.distributed_executor_backend or "mp"
    device = str(config.model.device)
    on_cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    if backend == "mp" and on_cuda and n > torch.cuda.device_count():
        raise ConfigError(
            f"tensor_parallel_size={n} needs a CUDA device per rank; {torch.cuda.device_count()} visible "
            "(use distributed_executor_backend='ray' for ranks on other nodes)"
        )
    host = "127.0.0.1"
    started_ray = False
    if backend == "ray":
        import ray

        from pagedkv.parallel.ray_executor import ray_node_address

        if not ray.is_initialized():
            # RAY_ADDRESS (e.g. "auto") joins a cluster; without it a local instance starts.
            started_ray = "RAY_ADDRESS" not in os.environ
            ray.init(include_dashboard=False, log_to_driver=False)
        host = ray_node_address(start_local=started_ray)
    with socket.socket() as s:
        s.bind((host, 0))
        port = s.getsockname()[1]
    init_method = f"tcp://{host}:{port}"
    executor: MultiprocExecutor | RayExecutor
    if backend == "ray":
        from pagedkv.parallel.ray_executor import RayExecutor

        executor = RayExecutor(config, init_method, parallel.timeout, started_ray=started_ray)
    else:
        executor = MultiprocExecutor(config, init_method, parallel.timeout)
    return TPSpec(0, n, init_method, parallel.timeout), executor
