"""Scheduler step cost from Python and memory utilization on ShareGPT.

1. `schedule()` + `update()` per step, numpy outputs included, for 256 running decode requests
   with 2k-token contexts (target <= 25 us per step), and for mixed
   steps (prefill chunks of arriving requests + decodes under a 2048-token budget). `update`
   returns a `RequestUpdates` sequence whose items are built when read, so the decode step is
   also timed with the updates read the two ways a caller can: item by item (one
   `RequestUpdate` object each, as the engine's loop does) or as columns.
2. Memory utilization on ShareGPT first turns (SmolLM2 tokenizer, recorded output lengths) at
   block size 16: tokens held / slots allocated (target >= 0.96), next to the "reserve the
   maximum" contiguous allocator (pagedkv.sim.baselines) in the same memory, with the number of
   concurrent requests each admits.

    python benches/bench_scheduler.py [--quick]
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _results import add_write_flag, md_table, write_section  # noqa: E402

import pagedkv  # noqa: E402


def _read_items(ups: Any) -> None:
    for u in ups:
        u.request_id, u.index, u.new_token_ids, u.finish_reason  # noqa: B018


def _read_columns(ups: Any) -> None:
    ups.request_ids, ups.indices, ups.token_ids, ups.finish_reasons  # noqa: B018


def decode_steps(num_seqs: int, ctx: int, steps: int, read: Callable[[Any], None] | None = None) -> dict[str, float]:
    bs = 16
    # Requests admitted early decode while later ones prefill: leave room for those tokens.
    max_new = steps + (num_seqs * ctx) // 8192 + 16
    max_len = ctx + max_new
    cfg = pagedkv.SchedulerConfig(
        num_blocks=num_seqs * (max_len // bs + 1),
        block_size=bs,
        max_model_len=max_len,
        max_num_seqs=num_seqs,
        max_num_batched_tokens=8192,
    )
    s = pagedkv.Scheduler(cfg)
    rng = np.random.default_rng(0)
    for i in range(num_seqs):
        s.add_request(f"r{i}", rng.integers(0, 50_000, size=ctx), max_tokens=max_new, ignore_eos=True)
    # Prefill everything first.
    while True:
        out = s.schedule()
        s.update(out, np.zeros(len(out.logits_indices), dtype=np.int64))
        if out.num_tokens == num_seqs and out.num_reqs == num_seqs:
            break
    sampled = np.zeros(num_seqs, dtype=np.int64)
    times = []
    for _ in range(steps):
        t = time.perf_counter_ns()
        out = s.schedule()
        ups = s.update(out, sampled)
        if read is not None:
            read(ups)
        times.append((time.perf_counter_ns() - t) / 1000)
    assert out.num_reqs == num_seqs and out.block_tables.shape[0] == num_seqs
    times.sort()
    return {
        "median_us": times[len(times) // 2],
        "mean_us": float(np.mean(times)),
        "p90_us": times[len(times) * 9 // 10],
    }


def mixed_steps(steps: int) -> dict[str, float]:
    """~200 running decodes plus prefill chunks of a stream of 1024-token prompts, budget 2048."""
    bs = 16
    cfg = pagedkv.SchedulerConfig(
        num_blocks=40_000, block_size=bs, max_model_len=4096, max_num_seqs=256, max_num_batched_tokens=2048
    )
    s = pagedkv.Scheduler(cfg)
    rng = np.random.default_rng(1)
    next_id = 0
    times, tokens, rows = [], [], []
    for step in range(steps + 200):
        while s.num_waiting < 4:
            s.add_request(
                f"m{next_id}",
                rng.integers(0, 50_000, size=1024),
                max_tokens=int(rng.integers(100, 400)),
                ignore_eos=True,
            )
            next_id += 1
        t = time.perf_counter_ns()
        out = s.schedule()
        s.update(out, np.zeros(len(out.logits_indices), dtype=np.int64))
        if step >= 200:  # after warm-up, the batch is decodes + prefill chunks
            times.append((time.perf_counter_ns() - t) / 1000)
            tokens.append(out.num_tokens)
            rows.append(out.num_reqs)
    times.sort()
    return {
        "median_us": times[len(times) // 2],
        "mean_us": float(np.mean(times)),
        "p90_us": times[len(times) * 9 // 10],
        "tokens": float(np.mean(tokens)),
        "rows": float(np.mean(rows)),
    }


def utilization(num_requests: int) -> tuple[str, list[list[object]]]:
    from pagedkv.sim.baselines import ReservationConfig, replay_reservation
    from pagedkv.sim.replay import PagedConfig, replay_paged
    from pagedkv.sim.workloads import sharegpt_first_turn_requests

    reqs = sharegpt_first_turn_requests(num_requests)
    num_blocks, bs, max_len = 2048, 16, 2048
    paged = replay_paged(
        reqs, PagedConfig(num_blocks=num_blocks, block_size=bs, max_model_len=max_len, max_num_seqs=1024)
    )
    rcfg = ReservationConfig(num_slots=num_blocks * bs, max_model_len=max_len, max_num_seqs=1024)
    maxres = replay_reservation(reqs, rcfg, "max_length")
    exact = replay_reservation(reqs, rcfg, "exact")
    rows: list[list[object]] = []
    for name, r in (
        ("pagedkv (block 16)", paged),
        ("contiguous, reserve max_model_len", maxres),
        ("contiguous, reserve exact length (oracle)", exact),
    ):
        util = (
            paged.kv_utilization
            if r is paged
            else r.mean_fraction["token_states"]
            / max(1e-9, 1 - r.mean_fraction["free"] - r.mean_fraction["external_fragmentation"])
        )
        rows.append([name, r.mean_fraction["token_states"], util, r.mean_running, r.peak_running, r.total_steps])
    desc = (
        f"{len(reqs)} ShareGPT first turns (SmolLM2 tokenizer, recorded output lengths, all arriving at t=0), "
        f"{num_blocks * bs} KV slots ({num_blocks} blocks x {bs}), max_model_len {max_len}, budget 8192 tokens/step. "
        f"pagedkv: {paged.num_preemptions} preemptions, simulated in {paged.wall_time_s:.2f} s."
    )
    return desc, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="small sizes (smoke run)")
    add_write_flag(ap)
    args = ap.parse_args()
    decode_args = (256, 2048, 1000) if not args.quick else (32, 256, 50)
    d = decode_steps(*decode_args)
    d_items = decode_steps(*decode_args, read=_read_items)
    d_cols = decode_steps(*decode_args, read=_read_columns)
    m = mixed_steps(1000 if not args.quick else 20)
    step_table = md_table(
        ["step (schedule + update, from Python)", "median us", "mean us", "p90 us"],
        [
            ["256 decodes, 2k-token contexts", d["median_us"], d["mean_us"], d["p90_us"]],
            [
                "256 decodes, updates read item by item (request_id, index, new_token_ids, finish_reason of each RequestUpdate)",
                d_items["median_us"],
                d_items["mean_us"],
                d_items["p90_us"],
            ],
            [
                "256 decodes, updates read as columns (request_ids, indices, token_ids, finish_reasons)",
                d_cols["median_us"],
                d_cols["mean_us"],
                d_cols["p90_us"],
            ],
            [
                f"mixed: {m['rows']:.0f} rows, {m['tokens']:.0f} tokens (decodes + 1024-token prompt chunks)",
                m["median_us"],
                m["mean_us"],
                m["p90_us"],
            ],
        ],
    )
    print(step_table)
    verdict = f"\n256-decode step: {d['median_us']:.1f} us median (target <= 25 us: {'met' if d['median_us'] <= 25 else 'NOT met'})."
    print(verdict)
    desc, rows = utilization(2000 if not args.quick else 200)
    util_table = md_table(
        [
            "allocator",
            "token states (time-avg fraction of KV)",
            "tokens held / slots allocated",
            "mean concurrent",
            "peak concurrent",
            "steps",
        ],
        rows,
    )
    print(desc)
    print(util_table)
    util = rows[0][2]
    verdict2 = f"\npagedkv memory utilization {util:.3f} (target >= 0.96: {'met' if util >= 0.96 else 'NOT met'}); admits {rows[0][3] / rows[1][3]:.1f}x the concurrent requests of max-length reservation."
    print(verdict2)
    if not args.no_write and not args.quick:
        write_section(
            "Scheduler: step cost and memory utilization (issue 3)",
            "python benches/bench_scheduler.py",
            step_table + "\n" + verdict + "\n\n" + desc + "\n\n" + util_table + "\n" + verdict2,
        )


if __name__ == "__main__":
    main()
