"""A tensor-parallel worker rank (ranks 1..N-1): build its shard, then execute every step that
rank 0 broadcasts until told to stop.

:func:`run_worker` is the rank's whole life; the ``mp`` executor runs it in a fresh interpreter
as ``python -m pagedkv.parallel.worker`` (:func:`main`), the Ray executor in an actor method.
A fresh interpreter started this way imports only pagedkv, never the user's ``__main__``: a
script that builds an ``LLM(tensor_parallel_size=N)`` at top level (no ``if __name__ ==
"__main__":`` guard) does not build it again in every worker, which is what ``multiprocessing``'s
``spawn`` did.

The ``mp`` executor writes one pickled ``(TPSpec, engine_config, parent_pid)`` tuple to the
worker's stdin (a pipe only the parent holds) and closes it (a tuple of pagedkv classes: run as
``__main__``, this module's own classes would not be the ones the parent pickled). The worker also watches its parent: if the engine's process
goes away before the group is up (so no collective would fail to tell it), it leaves at once.
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
from typing import Any

import torch

from pagedkv.orphan import leave_when_orphaned
from pagedkv.parallel.group import TPGroup
from pagedkv.parallel.rank import TPRank
from pagedkv.parallel.spec import TPSpec
from pagedkv.parallel.step_broadcast import recv_step
from pagedkv.worker.model_runner import ModelRunner

__all__ = ["main", "run_worker"]

logger = logging.getLogger(__name__)


def run_worker(spec: TPSpec, engine_config: Any) -> None:
    """A worker rank's whole life: join, build its runner, execute broadcast steps, leave."""
    logging.basicConfig(level=logging.WARNING, format=f"%(levelname)s tp-rank{spec.rank} %(name)s: %(message)s")
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    # The ranks share the machine's cores on the CPU: split them.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.world_size))
    torch.manual_seed(engine_config.model.seed)
    rank = TPRank(spec)
    runner = ModelRunner(engine_config.model, engine_config.cache, engine_config.scheduling, tp=rank)
    try:
        _serve_steps(runner, rank.group)
    finally:
        rank.close()


def _serve_steps(runner: ModelRunner, group: TPGroup) -> None:
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


def main() -> int:
    """``python -m pagedkv.parallel.worker``: ``(spec, engine_config, parent_pid)`` from stdin,
    then the rank's life."""
    spec, engine_config, parent_pid = pickle.load(sys.stdin.buffer)
    if not isinstance(spec, TPSpec):
        raise TypeError(f"expected a TPSpec first on stdin, got {type(spec).__name__}")
    leave_when_orphaned(parent_pid, lambda: os._exit(1), f"tensor-parallel rank {spec.rank}")
    run_worker(spec, engine_config)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
