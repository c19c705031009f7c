"""Block size: what a larger or smaller block buys, in the same memory.

For each block size the pool keeps the same number of token slots (``num_blocks = num_slots //
block_size``) and the real scheduler replays each workload. Reported per block size:

* KV utilization (tokens held / slots of blocks in use): larger blocks leave a longer unfilled
  tail in each sequence's last block;
* prefix-cache hit rate (tokens): only full blocks are cached, so a shared prefix is reused up
  to its last full block (a larger block loses more of it);
* block-table bytes per token: one int32 entry per block, ``4 / block_size`` bytes (what the
  scheduler ships to the GPU each step and the kernel reads);
* steps to finish the workload (a throughput proxy: fewer steps, more work per step) and
  preemptions (a fuller pool preempts more often).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pagedkv.sim.replay import PagedConfig, replay_paged
from pagedkv.sim.workloads.request import TraceRequest
from studies.plotting import new_figure, save_png
from studies.report import StudyResult, image, md_table, pct

__all__ = ["block_size_study", "DEFAULT_BLOCK_SIZES", "TABLE_ENTRY_BYTES"]

DEFAULT_BLOCK_SIZES = (8, 16, 32, 64, 128, 256)
TABLE_ENTRY_BYTES = 4  # block tables are int32


def _plot(data: dict[str, list[dict[str, Any]]], path: Path, subtitle: str) -> Path:
    fig = new_figure(11, 7.5)
    axes = fig.subplots(2, 2)
    panels = (
        (axes[0][0], "kv_utilization", "KV utilization (tokens held / slots in use)", True),
        (axes[0][1], "prefix_cache_hit_rate", "prefix-cache hit rate (tokens)", True),
        (axes[1][0], "steps", "steps to finish (fewer = more throughput)", False),
        (axes[1][1], "num_preemptions", "preemptions", False),
    )
    for ax, key, title, percent in panels:
        for label, rows in data.items():
            xs = [r["block_size"] for r in rows]
            ys = [100 * r[key] if percent else r[key] for r in rows]
            ax.plot(xs, ys, marker="o", label=label)
        ax.set_xscale("log", base=2)
        xs = [r["block_size"] for r in next(iter(data.values()))]
        ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_xlabel("block size (tokens)")
        ax.set_title(title, fontsize=10)
        if percent:
            ax.set_ylabel("%")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=9)
    fig.suptitle(f"Block size in a fixed KV budget\n{subtitle}", fontsize=11)
    fig.tight_layout()
    return save_png(fig, path)


def block_size_study(
    workloads: Mapping[str, Sequence[TraceRequest]],
    out_dir: Path,
    *,
    num_slots: int | Mapping[str, int],
    block_sizes: Sequence[int] = DEFAULT_BLOCK_SIZES,
    max_model_len: int = 2048,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 8192,
) -> StudyResult:
    """Replay each workload (label -> requests) at every block size with ``num_slots`` slots
    (one number for all, or one per workload label)."""
    slots = {label: num_slots if isinstance(num_slots, int) else num_slots[label] for label in workloads}
    data: dict[str, list[dict[str, Any]]] = {}
    for label, requests in workloads.items():
        rows = []
        for block_size in block_sizes:
            config = PagedConfig(
                num_blocks=slots[label] // block_size,
                block_size=block_size,
                max_model_len=max_model_len,
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
            )
            result = replay_paged(requests, config)
            rows.append(
                {
                    "block_size": block_size,
                    "num_blocks": config.num_blocks,
                    "kv_utilization": result.kv_utilization,
                    "prefix_cache_hit_rate": result.prefix_cache_hit_rate,
                    "table_bytes_per_token": TABLE_ENTRY_BYTES / block_size,
                    "steps": result.total_steps,
                    "num_preemptions": result.num_preemptions,
                    "mean_concurrent": result.mean_running,
                    "tokens_computed": result.tokens_computed,
                    "wall_time_s": result.wall_time_s,
                }
            )
        data[label] = rows
    memory = ", ".join(f"{n:,}" for n in dict.fromkeys(slots.values()))
    subtitle = f"{memory} token slots, max_model_len {max_model_len}, max_num_seqs {max_num_seqs}"
    png = _plot(data, out_dir / "block_size.png", subtitle)

    sections = [
        f"Same memory at every block size (token slots per workload below); {max_num_batched_tokens} tokens "
        f"per step, at most {max_num_seqs} sequences. Block-table bytes per token = 4 / block size (int32 "
        "entries).",
        "",
    ]
    for label, rows in data.items():
        sections += [
            f"**{label}** ({len(workloads[label]):,} requests, {slots[label]:,} token slots)",
            "",
            md_table(
                [
                    "block size",
                    "blocks",
                    "KV utilization",
                    "prefix hit rate",
                    "table bytes / token",
                    "steps",
                    "preemptions",
                    "mean concurrent",
                    "tokens computed",
                ],
                [
                    [
                        r["block_size"],
                        r["num_blocks"],
                        pct(r["kv_utilization"]),
                        pct(r["prefix_cache_hit_rate"]),
                        f"{r['table_bytes_per_token']:.3g}",
                        r["steps"],
                        r["num_preemptions"],
                        f"{r['mean_concurrent']:.1f}",
                        r["tokens_computed"],
                    ]
                    for r in rows
                ],
            ),
            "",
        ]
    sections.append(image("block size study", "block_size.png"))
    result_data = {
        "num_slots": slots,
        "max_model_len": max_model_len,
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": max_num_batched_tokens,
        "workloads": {label: {"num_requests": len(workloads[label]), "rows": rows} for label, rows in data.items()},
    }
    return StudyResult("block_size", "Block size in a fixed KV budget", result_data, "\n".join(sections), [png])
