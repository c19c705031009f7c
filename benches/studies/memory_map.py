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

With a host tier (``PagedConfig.num_host_blocks`` > 0) the recording also reads
:meth:`pagedkv.Scheduler.tier_map` after every step: free cached device blocks whose content
is also resident on the host are drawn mid grey instead of light grey (the device map keeps
its meaning otherwise), and a second map shows the host pool over the same steps: blocks held
by swapped-out sequences (or pinned by the step's copies) blue, cached free blocks light grey,
free white, and the blocks the step copies into (``swap_out``: swap-outs and write-backs)
orange and out of (``swap_in``: swap-ins and host prefix hits) green; beside it, the blocks
copied per step.
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
CACHED_ON_HOST_RGB = (0.58, 0.60, 0.63)  # free on the device, cached, and also resident on the host
HOST_HELD_RGB = (0.16, 0.40, 0.70)
HOST_WRITTEN_RGB = (0.96, 0.55, 0.10)  # swap_out target this step
HOST_READ_RGB = (0.18, 0.62, 0.25)  # swap_in source this step


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
        # Host tier (empty without one): per step, device blocks also on the host, the host
        # pool's ref counts and cache flags, and the host blocks copied into / out of.
        self.tiered = False
        self._on_host: list[np.ndarray] = []
        self._host_refs: list[np.ndarray] = []
        self._host_cached: list[np.ndarray] = []
        self._host_written: list[np.ndarray] = []
        self._host_read: list[np.ndarray] = []

    def on_step(self, step: int, scheduler: Any, output: Any) -> None:
        """``replay_paged``'s ``on_step`` hook: records steps that computed tokens."""
        if output.num_tokens == 0:
            return
        refs, cached, owners = scheduler.memory_map()
        self._refs.append(np.asarray(refs, dtype=np.int32))
        self._cached.append(np.asarray(cached, dtype=bool))
        self._owners.append(np.asarray(owners, dtype=np.int64))
        on_host, host_refs, host_cached = scheduler.tier_map()
        if len(host_refs):
            self.tiered = True
            self._on_host.append(np.asarray(on_host, dtype=bool))
            self._host_refs.append(np.asarray(host_refs, dtype=np.int32))
            self._host_cached.append(np.asarray(host_cached, dtype=bool))
            self._host_written.append(np.array(output.swap_out[:, 1], dtype=np.int64))
            self._host_read.append(np.array(output.swap_in[:, 0], dtype=np.int64))
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

    @property
    def on_host(self) -> np.ndarray:
        """bool [steps, num_blocks]: the device block's cached content is also on the host."""
        return np.stack(self._on_host)

    @property
    def host_ref_counts(self) -> np.ndarray:
        """int32 [steps, num_host_blocks]."""
        return np.stack(self._host_refs)

    @property
    def host_cached(self) -> np.ndarray:
        """bool [steps, num_host_blocks]."""
        return np.stack(self._host_cached)

    @property
    def host_written(self) -> list[np.ndarray]:
        """Per step, the host blocks the step's ``swap_out`` copies write."""
        return self._host_written

    @property
    def host_read(self) -> list[np.ndarray]:
        """Per step, the host blocks the step's ``swap_in`` copies read."""
        return self._host_read

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
    if recording.tiered:
        rgb[(refs == 0) & cached & recording.on_host] = CACHED_ON_HOST_RGB
    held = owners >= 0
    rgb[held] = palette[owners[held] % len(palette)]
    highlight_arrival = recording.arrival_ids.index(highlight_id)
    rgb[held & (owners == highlight_arrival)] = HIGHLIGHT_RGB
    rgb[refs > 1] = SHARED_RGB
    return rgb.transpose(1, 0, 2)


def render_host(recording: MemoryMapRecording) -> np.ndarray:
    """The host pool as an RGB image: float [num_host_blocks, steps, 3] (empty without a tier)."""
    if not recording.tiered:
        return np.zeros((0, 0, 3))
    refs, cached = recording.host_ref_counts, recording.host_cached
    rgb = np.empty((*refs.shape, 3), dtype=np.float64)
    rgb[:] = FREE_RGB
    rgb[(refs == 0) & cached] = CACHED_FREE_RGB
    rgb[refs > 0] = HOST_HELD_RGB
    for step, (written, read) in enumerate(zip(recording.host_written, recording.host_read)):
        rgb[step, written] = HOST_WRITTEN_RGB
        rgb[step, read] = HOST_READ_RGB
    return rgb.transpose(1, 0, 2)


def _plot(recording: MemoryMapRecording, highlight_id: str, path: Path, subtitle: str) -> Path:
    from matplotlib.patches import Patch

    picture = render(recording, highlight_id)
    num_blocks, steps = picture.shape[:2]
    tiered = recording.tiered
    fig = new_figure(13, 10 if tiered else 5.5)
    grid = fig.add_gridspec(2 if tiered else 1, 2, width_ratios=[4, 1])
    ax_map = fig.add_subplot(grid[0, 0])
    ax_table = fig.add_subplot(grid[0, 1])
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
            *([Patch(facecolor=CACHED_ON_HOST_RGB, label="free, cached, also on the host")] if tiered else []),
            Patch(facecolor=FREE_RGB, edgecolor="0.6", label="free"),
        ],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.12),
        ncol=5 if tiered else 4,
        fontsize=8,
        frameon=False,
    )
    if tiered:
        _plot_host(fig, grid, recording, steps)
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


def _plot_host(fig: Any, grid: Any, recording: MemoryMapRecording, steps: int) -> None:
    """The host pool map (bottom left) and the blocks copied per step (bottom right)."""
    from matplotlib.patches import Patch

    host = render_host(recording)
    num_host = host.shape[0]
    ax_host = fig.add_subplot(grid[1, 0])
    ax_host.imshow(
        host, aspect="auto", interpolation="nearest", origin="lower", extent=(-0.5, steps - 0.5, -0.5, num_host - 0.5)
    )
    ax_host.set_xlabel("step")
    ax_host.set_ylabel("host block id")
    ax_host.set_title("host tier over time", fontsize=10)
    ax_host.legend(
        handles=[
            Patch(facecolor=HOST_HELD_RGB, label="held by a swapped-out sequence"),
            Patch(facecolor=HOST_WRITTEN_RGB, label="copied in this step (swap-out / write-back)"),
            Patch(facecolor=HOST_READ_RGB, label="copied out this step (swap-in / host hit)"),
            Patch(facecolor=CACHED_FREE_RGB, edgecolor="0.6", label="free, cached"),
            Patch(facecolor=FREE_RGB, edgecolor="0.6", label="free"),
        ],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.12),
        ncol=3,
        fontsize=8,
        frameon=False,
    )
    ax_copies = fig.add_subplot(grid[1, 1])
    xs = np.arange(steps)
    ax_copies.plot(xs, [len(w) for w in recording.host_written], color=HOST_WRITTEN_RGB, linewidth=0.8, label="to host")
    ax_copies.plot(xs, [-len(r) for r in recording.host_read], color=HOST_READ_RGB, linewidth=0.8, label="to device")
    ax_copies.axhline(0, color="0.5", linewidth=0.5)
    ax_copies.set_xlabel("step")
    ax_copies.set_ylabel("blocks copied (to host up, to device down)")
    ax_copies.set_title("copies per step", fontsize=10)
    ax_copies.legend(fontsize=8)
    ax_copies.grid(alpha=0.3)


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
    num_host_blocks: int = 0,
    preemption_mode: str = "recompute",
    bytes_per_block: int = 0,
) -> StudyResult:
    """Draw the pool's memory map over a (short) replay of ``requests`` (with the host tier's
    map when ``num_host_blocks`` > 0)."""
    config = PagedConfig(
        num_blocks=num_blocks,
        block_size=block_size,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        num_host_blocks=num_host_blocks,
        preemption_mode=preemption_mode,
        bytes_per_block=bytes_per_block,
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
        + (f", host tier {num_host_blocks} blocks ({preemption_mode} preemption)" if num_host_blocks else "")
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
        "num_host_blocks": num_host_blocks,
        "preemption_mode": preemption_mode,
    }
    if recording.tiered:
        host_refs = recording.host_ref_counts
        data.update(
            num_swap_preemptions=result.num_swap_preemptions,
            blocks_swapped_out=result.blocks_swapped_out,
            blocks_swapped_in=result.blocks_swapped_in,
            num_write_backs=result.num_write_backs,
            prefix_cache_host_hits=result.prefix_cache_host_hits,
            mean_cached_free_on_host_blocks=float(
                ((refs == 0) & recording.cached & recording.on_host).sum(axis=1).mean()
            ),
            mean_host_held_blocks=float((host_refs > 0).sum(axis=1).mean()),
            mean_host_cached_free_blocks=float(((host_refs == 0) & recording.host_cached).sum(axis=1).mean()),
        )
    tier_text = ""
    if recording.tiered:
        tier_text = (
            f" Host tier (bottom): blue = held by a swapped-out sequence, orange = copied in by the step (swap-out or "
            f"write-back), green = copied out (swap-in or host prefix hit), light grey = free but cached; on the device "
            f"map, mid grey = free, cached, and also resident on the host. {result.num_swap_preemptions} of the "
            f"preemptions swapped; {result.blocks_swapped_out:,} blocks copied to the host ({result.num_write_backs:,} "
            f"of them write-backs of evicted cached blocks) and {result.blocks_swapped_in:,} back; on average per step "
            f"{data['mean_host_held_blocks']:.0f} host blocks held, {data['mean_host_cached_free_blocks']:.0f} free but "
            f"cached, and {data['mean_cached_free_on_host_blocks']:.0f} free cached device blocks also on the host."
        )
    body = "\n".join(
        [
            f"{subtitle}; {result.num_preemptions} preemptions. x = step, y = physical block, colour = the request "
            "holding the block; black = shared by several sequences (ref count > 1), light grey = free but still "
            "in the prefix cache, white = free." + tier_text,
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
