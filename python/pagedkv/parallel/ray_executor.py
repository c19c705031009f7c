"""Tensor-parallel workers as Ray actors (``distributed_executor_backend="ray"``): the path to
ranks on other nodes, as in vLLM's multi-node setup.

The engine's process stays rank 0 (the scheduler, the sampler, the detokenizer). Ranks
1..N-1 are actors placed by one placement group — one bundle per rank (``{"GPU": 1}`` on CUDA,
``{"CPU": 1}`` otherwise), packed onto as few nodes as fit — and each runs
:func:`pagedkv.parallel.worker.run_worker` in an actor method until rank 0 broadcasts the
shutdown. The group's store is on rank 0's node at its Ray node address, so the actors reach
it from any node; the collectives are torch.distributed's (Ray only places and supervises).

Ray is joined if it is running (``RAY_ADDRESS``, or a driver that already called
``ray.init``); otherwise a local instance is started and stopped with the executor. Before any
actor is placed, the cluster must hold a bundle per worker rank (``preflight``): a size it cannot
place fails at once, not after the placement timeout.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from pagedkv.errors import ConfigError
from pagedkv.parallel.preflight import check_ray_resources, worker_bundle
from pagedkv.parallel.spec import TPSpec

__all__ = ["RayExecutor", "join_or_start_ray", "ray_node_address"]

logger = logging.getLogger(__name__)


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:  # also checked by ParallelConfig
        raise ConfigError("distributed_executor_backend='ray' needs Ray: pip install 'pagedkv[ray]'") from exc
    return ray


def ray_node_address(start_local: bool) -> str:
    """This node's address as Ray's other nodes reach it (127.0.0.1 for a local instance)."""
    ray = _import_ray()
    return "127.0.0.1" if start_local else str(ray.util.get_node_ip_address())


def join_or_start_ray(n: int, on_cuda: bool) -> tuple[bool, str]:
    """Joins the running Ray (``RAY_ADDRESS``, e.g. ``"auto"``, or a driver's ``ray.init``) or
    starts a local one; checks it can place ``n - 1`` workers. Returns (whether this call
    started Ray, the address the workers reach this node by)."""
    ray = _import_ray()
    started_ray = False
    if not ray.is_initialized():
        started_ray = "RAY_ADDRESS" not in os.environ
        ray.init(include_dashboard=False, log_to_driver=False)
    try:
        check_ray_resources(ray.cluster_resources(), n, on_cuda)
    except ConfigError:
        if started_ray:
            ray.shutdown()
        raise
    return started_ray, ray_node_address(start_local=started_ray)


class _Worker:
    """The actor body: one rank for its whole life (``run`` returns at shutdown)."""

    def run(self, spec: TPSpec, engine_config: Any) -> None:
        from pagedkv.parallel.worker import run_worker

        run_worker(spec, engine_config)


class RayExecutor:
    """Ranks 1..N-1 as Ray actors; the same interface as ``MultiprocExecutor``."""

    def __init__(self, engine_config: Any, init_method: str, timeout: float, *, started_ray: bool) -> None:
        ray = _import_ray()
        from dataclasses import replace

        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._ray = ray
        self._remove_pg = remove_placement_group
        self.started_ray = started_ray
        self.timeout = timeout
        world = engine_config.parallel.tensor_parallel_size
        on_cuda = str(engine_config.model.device).startswith("cuda")
        bundle = worker_bundle(on_cuda)
        self.placement = placement_group([bundle] * (world - 1), strategy="PACK")
        try:
            ray.get(self.placement.ready(), timeout=timeout)
        except Exception as exc:  # GetTimeoutError: the cluster lacks the resources
            self._remove_pg(self.placement)
            raise ConfigError(
                f"Ray could not place {world - 1} tensor-parallel workers ({bundle} each) in {timeout:.0f}s: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        worker_config = replace(engine_config, kv_transfer=None)
        actor_class = ray.remote(_Worker)
        self.actors = []
        self.runs = []
        for rank in range(1, world):
            actor = actor_class.options(
                num_cpus=0 if on_cuda else 1,
                num_gpus=1 if on_cuda else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.placement, placement_group_bundle_index=rank - 1
                ),
                name=None,
            ).remote()
            self.actors.append(actor)
            spec = TPSpec(rank, world, init_method, timeout, device_index=0)
            self.runs.append(actor.run.remote(spec, worker_config))

    def failures(self) -> list[str]:
        """How each worker that is no longer running ended (its ``run`` returned or raised)."""
        ray = self._ray
        done, _ = ray.wait(self.runs, num_returns=len(self.runs), timeout=0)
        out = []
        for rank, ref in enumerate(self.runs, start=1):
            if ref not in done:
                continue
            try:
                ray.get(ref, timeout=0)
                out.append(f"worker rank {rank} (Ray actor) returned")
            except Exception as exc:
                out.append(f"worker rank {rank} (Ray actor) died: {type(exc).__name__}: {str(exc)[:300]}")
        return out

    def alive(self) -> list[bool]:
        ray = self._ray
        done, _ = ray.wait(self.runs, num_returns=len(self.runs), timeout=0)
        return [ref not in done for ref in self.runs]

    def shutdown(self, group: object = None) -> None:
        """A shutdown broadcast when ``group`` (as ``MultiprocExecutor.shutdown``) is usable, then waits for the actors' ``run``
        and kills them; removes the placement group, and stops Ray if this executor started
        it. Idempotent."""
        ray = self._ray
        if not ray.is_initialized():
            return
        from pagedkv.parallel.executor import usable_group

        tp_group = usable_group(group)
        if tp_group is not None and all(self.alive()):
            from pagedkv.parallel.step_broadcast import send_shutdown

            try:
                send_shutdown(tp_group)
                ray.wait(self.runs, num_returns=len(self.runs), timeout=self.timeout)
            except Exception:
                pass
        for actor in self.actors:
            try:
                ray.kill(actor)
            except Exception:
                pass
        try:
            self._remove_pg(self.placement)
        except Exception:
            pass
        if self.started_ray:
            ray.shutdown()
