"""The forward of a step as the engine runs it: ``ModelRunner.execute`` with what the disk tier
needs (the identities written into the files of the step's disk stores), the disk slots whose
file failed (never served again: their KV is recomputed), and the copy-only steps that flush
the cached KV down the tiers."""

from __future__ import annotations

import torch

from pagedkv._core import Scheduler, SchedulerOutput
from pagedkv.worker.model_runner import ModelRunner
from pagedkv.worker.step_input import ModelStep

__all__ = ["StepForward", "has_copies"]


def has_copies(out: SchedulerOutput) -> bool:
    """True when the step moves blocks (copy-on-write, swaps, disk reads or writes)."""
    return any(len(a) > 0 for a in (out.copy_ops, out.swap_out, out.swap_in, out.disk_store, out.disk_load))


class StepForward:
    """Runs steps' forwards on one runner for one scheduler (module docs)."""

    def __init__(self, runner: ModelRunner, scheduler: Scheduler) -> None:
        self.runner = runner
        self.scheduler = scheduler

    def run(self, out: SchedulerOutput, step: SchedulerOutput | ModelStep | None = None) -> torch.Tensor:
        """``runner.execute(step or out)`` (``step``: ``out`` with its prompt rows): the logits
        of the rows to sample."""
        step = out if step is None else step
        if len(out.disk_store) == 0:
            return self.runner.execute(step)
        return self.runner.execute(step, self.scheduler.disk_block_info(out.disk_store[:, 1].tolist()))

    def forget_bad_disk_slots(self) -> None:
        """Disk slots whose file failed to write or read are never served (the KV is recomputed)."""
        if self.runner.disk_cache is not None:
            bad = self.runner.disk_cache.take_bad_slots()
            if bad:
                self.scheduler.invalidate_disk_blocks(bad)

    def flush(self, max_rounds: int) -> int:
        """Copy-only steps (``Scheduler.schedule_flush``) until one copies nothing, or
        ``max_rounds``; returns the blocks copied (``LLMEngine.flush_kv_cache``)."""
        copied = 0
        if self.runner.num_host_blocks == 0:
            return 0
        for _ in range(max_rounds):
            out = self.scheduler.schedule_flush()
            if not has_copies(out):
                self.scheduler.update(out, [])
                break
            copied += len(out.swap_out) + len(out.disk_store)
            try:
                self.run(out)
                self.scheduler.update(out, [])
            except BaseException:
                self.scheduler.rollback_step(out)
                raise
            finally:
                self.forget_bad_disk_slots()
        return copied
