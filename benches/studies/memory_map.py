"""The KV pool over time: which request holds each physical block at each step.

A picture of paging at work ("rooms on different floors"): a sequence's logical blocks are
contiguous in its block table but land wherever the free queue hands out blocks, so one
request's blocks are scattered over the pool and interleaved with everyone else's.

Drawn from :meth:`pagedkv.Scheduler.memory_map` after every scheduled step of a
:func:`pagedkv.sim.replay.replay_paged` run: x = step, y = physical block id, colour = the
request holding the block (the earliest-arrived one when shared). Blocks shared by several
sequences (ref count > 1: parallel samples before copy-on-write, prefix-cache hits) are drawn
black; free blocks that still hold a cached prefix light grey; plain free blocks white. One
request (the one that grew to the most blocks) is drawn red, and its block table at its
largest is shown beside the map: logical block i -> physical block.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pagedkv.sim.replay import PagedConfig, replay_paged
from pagedkv.sim.workloads.request import TraceRequest
from studies.plotting import new_figure, save_png
from studies.report import StudyResult, image

__all__ = ["memory_map_study", "record_memory_maps", "MemoryMapRecording"]

FREE_RGB = (1.0, 1.0, 1.0)
CACHED_FREE_RGB = (0.80, 0.82, 0.85)
SHARED_RGB = (0.0, 0.0, 0.0)
HIGHLIGHT_RGB = (0.86, 0.08, 0.08)


class MemoryMapRecording:
    """Per-step memory maps of a replay, plus each request's largest block table.

    ``ref_counts`` int32 [steps, num_blocks], ``cached`` bool [steps, num_blocks],
    ``owners`` int64 [steps, num_blocks] (arrival number, -1 free); ``tables`` maps a request
    id to its largest block table seen (int32 [num_blocks_of_it]); ``arrival_ids`` lists the
    request ids by arrival number.
    """

    def __init__(self, requests: Sequence[TraceRequest], block_size: int) -> None:
        self.block_size = block_size
        self.arrival_ids = [r.request_id for r in sorted(requests, key=lambda r: r.arrival_time)]
        self.samples = {r.request_id: r.n for r in requests}
        self._refs: list[np.ndarray] = []
        self._cached: list[np.ndarray] = []
        self._owners: list[np.ndarray] = []
        self.tables: dict[str, np.ndarray] = {}

    def on_step(self, step: int, scheduler: Any, output: Any) -> None:
        """``replay_paged``'s ``on_step`` hook: records steps that computed tokens."""
        if output.num_tokens == 0:
            return
        refs, cached, owners = scheduler.memory_map()
        self._refs.append(np.asarray(refs, dtype=np.int32))
        self._cached.append(np.asarray(cached, dtype=bool))
        self._owners.append(np.asarray(owners, dtype=np.int64))
        bs = self.block_size
        for row, (request_id, seq_len) in enumerate(zip(output.req_ids, output.seq_lens)):
            count = -(-int(seq_len) // bs)
            if count > len(self.tables.get(request_id, ())):
                self.tables[request_id] = np.array(output.block_tables[row, :count], dtype=np.int32)

    @property
    def ref_counts(self) -> np.ndarray:
        return np.stack(self._refs)

    @property
    def cached(self) -> np.ndarray:
        return np.stack(self._cached)

    @property
    def owners(self) -> np.ndarray:
        return np.stack(self._owners)

    def highlight(self) -> str:
        """The one-sample request whose block table grew largest (ties: earliest arrival)."""
        candidates = [rid for rid in self.arrival_ids if rid in self.tables and self.samples.get(rid, 1) == 1]
        if not candidates:
            candidates = [rid for rid in self.arrival_ids if rid in self.tables]
        return max(candidates, key=lambda rid: len(self.tables[rid]))


def record_memory_maps(requests: Sequence[TraceRequest], config: PagedConfig) -> tuple[MemoryMapRecording, Any]:
    """Replay ``requests`` and record the pool after every step: (recording, PagedReplayResult)."""
    recording = MemoryMapRecording(requests, config.block_size)
    result = replay_paged(requests, config, on_step=recording.on_step)
    return recording, result


def _palette(count: int) -> np.ndarray:
    """``count`` distinct muted colours (float [count, 3]), none close to red, black or grey."""
    from matplotlib import colormaps
    from matplotlib.colors import rgb_to_hsv

    base = np.array([colormaps[name](i)[:3] for name in ("tab20", "tab20b") for i in range(20)])
    hsv = rgb_to_hsv(base)
    # Keep clearly coloured entries away from red hues, so the highlight, shared (black) and
    # cached-free (grey) colours stay unambiguous.
    reddish = (hsv[:, 0] < 0.05) | (hsv[:, 0] > 0.93)
    keep = base[(hsv[:, 1] > 0.2) & ~reddish]
    return keep[np.arange(count) % len(keep)]


def render(recording: MemoryMapRecording, highlight_id: str) -> np.ndarray:
    """The map as an RGB image: float [num_blocks, steps, 3] (row = block id, column = step)."""
    refs, cached, owners = recording.ref_counts, recording.cached, recording.owners
    steps, num_blocks = refs.shape
    palette = _palette(max(len(recording.arrival_ids), 1))
    rgb = np.empty((steps, num_blocks, 3), dtype=np.float64)
    rgb[:] = FREE_RGB
    rgb[(refs == 0) & cached] = CACHED_FREE_RGB
    held = owners >= 0
    rgb[held] = palette[owners[held] % len(palette)]
    highlight_arrival = recording.arrival_ids.index(highlight_id)
    rgb[held & (owners == highlight_arrival)] = HIGHLIGHT_RGB
    rgb[refs > 1] = SHARED_RGB
    return rgb.transpose(1, 0, 2)


def _plot(recording: MemoryMapRecording, highlight_id: str, path: Path, subtitle: str) -> Path:
    from matplotlib.patches import Patch

    picture = render(recording, highlight_id)
    num_blocks, steps = picture.shape[:2]
    fig = new_figure(13, 5.5)
    grid = fig.add_gridspec(1, 2, width_ratios=[4, 1])
    ax_map = fig.add_subplot(grid[0])
    ax_table = fig.add_subplot(grid[1])
    ax_map.imshow(
        picture,
        aspect="auto",
        interpolation="nearest",
        origin="lower",
        extent=(-0.5, steps - 0.5, -0.5, num_blocks - 0.5),
    )
    ax_map.set_xlabel("step")
    ax_map.set_ylabel("physical block id")
    ax_map.set_title("KV pool over time (colour = request holding the block)", fontsize=10)
    ax_map.legend(
        handles=[
            Patch(facecolor=HIGHLIGHT_RGB, label=f"request {highlight_id}"),
            Patch(facecolor=SHARED_RGB, label="shared (ref count > 1)"),
            Patch(facecolor=CACHED_FREE_RGB, edgecolor="0.6", label="free, prefix still cached"),
            Patch(facecolor=FREE_RGB, edgecolor="0.6", label="free"),
        ],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.12),
        ncol=4,
        fontsize=8,
        frameon=False,
    )
    table = recording.tables[highlight_id]
    ax_table.step(np.arange(len(table)), table, where="mid", color="0.75", linewidth=0.8)
    ax_table.scatter(np.arange(len(table)), table, color=HIGHLIGHT_RGB, s=14, zorder=3)
    ax_table.set_ylim(-0.5, num_blocks - 0.5)
    ax_table.set_xlabel("logical block (position / block size)")
    ax_table.set_ylabel("physical block id")
    ax_table.set_title(f"block table of {highlight_id}\n({len(table)} blocks at its longest)", fontsize=10)
    ax_table.grid(alpha=0.3)
    fig.suptitle(f"Paged KV memory map\n{subtitle}", fontsize=11)
    fig.tight_layout()
    return save_png(fig, path)


def memory_map_study(
    requests: Sequence[TraceRequest],
    out_dir: Path,
    *,
    num_blocks: int,
    block_size: int = 16,
    max_model_len: int = 2048,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 8192,
    workload_label: str = "workload",
) -> StudyResult:
    """Draw the pool's memory map over a (short) replay of ``requests``."""
    config = PagedConfig(
        num_blocks=num_blocks,
        block_size=block_size,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
    )
    recording, result = record_memory_maps(requests, config)
    highlight_id = recording.highlight()
    table = recording.tables[highlight_id]
    # How scattered: physical neighbours among consecutive logical blocks, and the spread of ids.
    contiguous_pairs = int(np.sum(np.diff(table) == 1)) if len(table) > 1 else 0
    refs = recording.ref_counts
    subtitle = (
        f"{workload_label}: {len(requests)} requests ({sum(r.n > 1 for r in requests)} with parallel samples), "
        f"{num_blocks} blocks x {block_size} tokens, {result.total_steps} steps"
    )
    png = _plot(recording, highlight_id, out_dir / "memory_map.png", subtitle)
    data = {
        "workload": workload_label,
        "num_requests": len(requests),
        "num_blocks": num_blocks,
        "block_size": block_size,
        "steps": result.total_steps,
        "num_preemptions": result.num_preemptions,
        "highlighted_request": highlight_id,
        "highlighted_block_table": table.tolist(),
        "highlighted_contiguous_pairs": contiguous_pairs,
        "mean_blocks_in_use": float((refs > 0).sum(axis=1).mean()),
        "mean_shared_blocks": float((refs > 1).sum(axis=1).mean()),
        "mean_cached_free_blocks": float(((refs == 0) & recording.cached).sum(axis=1).mean()),
    }
    body = "\n".join(
        [
            f"{subtitle}; {result.num_preemptions} preemptions. x = step, y = physical block, colour = the request "
            "holding the block; black = shared by several sequences (ref count > 1), light grey = free but still "
            "in the prefix cache, white = free.",
            "",
            image("paged KV memory map", "memory_map.png"),
            "",
            f"Request `{highlight_id}` (red) grew to {len(table)} blocks; of its {max(len(table) - 1, 0)} pairs of "
            f"consecutive logical blocks, {contiguous_pairs or 'none'} are physical neighbours, and its blocks span ids "
            f"{int(table.min())}..{int(table.max())} of {num_blocks}. Its block table (right) is all the kernel needs "
            "to find them. On average per step: "
            f"{data['mean_blocks_in_use']:.0f} blocks in use, {data['mean_shared_blocks']:.1f} shared, "
            f"{data['mean_cached_free_blocks']:.0f} free but cached.",
        ]
    )
    return StudyResult("memory_map", "Paged KV memory map", data, body, [png])
