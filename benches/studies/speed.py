"""How fast a simulation runs: ``replay_paged`` wall time on many requests, and where it goes.

The scheduler does the work in Rust; the Python loop of :func:`pagedkv.sim.replay.replay_paged`
adds arrivals, draws synthetic sampled tokens and sums the per-step statistics. The study
times one plain replay, then one under ``cProfile`` to split the time between the scheduler's
calls (``schedule``, ``update``, ``stats``, ``add_request``) and the rest of the loop
(profiling slows the run; only the split is read from it). Tokenization of the workload is
timed by the caller, apart.
"""

from __future__ import annotations

import cProfile
import os
import platform
import pstats
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pagedkv.sim.replay import PagedConfig, replay_paged
from pagedkv.sim.workloads.request import TraceRequest
from studies.report import StudyResult, md_table

__all__ = ["speed_study", "profile_split"]

_SCHEDULER_CALLS = ("schedule", "update", "stats", "add_request", "has_unfinished_requests", "memory_map")


def profile_split(requests: Sequence[TraceRequest], config: PagedConfig) -> dict[str, float]:
    """Share of a profiled replay's time per scheduler method, plus ``"python loop"`` for the rest."""
    profiler = cProfile.Profile()
    profiler.enable()
    replay_paged(requests, config)
    profiler.disable()
    stats = pstats.Stats(profiler)
    total = 0.0
    per_call: dict[str, float] = {}
    for (_, _, name), (_, _, tottime, _, _) in stats.stats.items():  # type: ignore[attr-defined]
        total += tottime
        # Methods of the compiled class appear as "<method 'schedule' of 'pagedkv._core.Scheduler' objects>".
        for wanted in _SCHEDULER_CALLS:
            if name == f"<method '{wanted}' of 'pagedkv._core.Scheduler' objects>":
                per_call[wanted] = per_call.get(wanted, 0.0) + tottime
                break
    split = {f"Scheduler.{k}": v / total for k, v in per_call.items()} if total else {}
    split["python loop and the rest"] = 1.0 - sum(split.values())
    return split


def speed_study(
    requests: Sequence[TraceRequest],
    out_dir: Path,
    *,
    num_blocks: int,
    block_size: int = 16,
    max_model_len: int = 2048,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 8192,
    tokenization_s: float | None = None,
    workload_label: str = "workload",
    repeats: int = 3,
) -> StudyResult:
    """Best of ``repeats`` replays of ``requests``, and the profiled split of one more."""
    config = PagedConfig(
        num_blocks=num_blocks,
        block_size=block_size,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
    )
    results = [replay_paged(requests, config) for _ in range(max(repeats, 1))]
    best = min(results, key=lambda r: r.wall_time_s)
    split = profile_split(requests, config)
    data: dict[str, Any] = {
        "workload": workload_label,
        "num_requests": len(requests),
        "prompt_tokens": sum(r.prompt_len for r in requests),
        "output_tokens": sum(r.output_len * r.n for r in requests),
        "num_blocks": num_blocks,
        "block_size": block_size,
        "max_model_len": max_model_len,
        "max_num_seqs": max_num_seqs,
        "replay_wall_s": best.wall_time_s,
        "replay_wall_s_all": [r.wall_time_s for r in results],
        "tokenization_s": tokenization_s,
        "steps": best.total_steps,
        "us_per_step": 1e6 * best.wall_time_s / max(best.total_steps, 1),
        "tokens_computed": best.tokens_computed,
        "num_preemptions": best.num_preemptions,
        "profile_split": split,
        "cpu_count": os.cpu_count(),
        "machine": platform.processor() or platform.machine(),
    }
    table = md_table(
        [
            "requests",
            f"replay wall (best of {len(results)})",
            "steps",
            "us / step",
            "tokens computed",
            "preemptions",
            "tokenization (apart)",
        ],
        [
            [
                len(requests),
                f"{best.wall_time_s:.2f} s",
                best.total_steps,
                f"{data['us_per_step']:.0f}",
                best.tokens_computed,
                best.num_preemptions,
                "-" if tokenization_s is None else f"{tokenization_s:.1f} s",
            ]
        ],
    )
    split_table = md_table(
        ["where the replay's time goes (cProfile)", "share"],
        [[name, f"{100 * share:.0f}%"] for name, share in sorted(split.items(), key=lambda kv: -kv[1])],
    )
    body = "\n".join(
        [
            f"{workload_label}: {len(requests):,} requests through `replay_paged` ({num_blocks:,} blocks x {block_size}, "
            f"max_model_len {max_model_len}, max_num_seqs {max_num_seqs}) on {os.cpu_count()} cores. Target: 10,000 "
            f"ShareGPT requests in under 10 s on a 2-core machine: **{best.wall_time_s:.2f} s**.",
            "",
            table,
            "",
            split_table,
        ]
    )
    return StudyResult("simulation_speed", "Simulation speed", data, body, [])
