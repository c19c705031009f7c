"""The KV offload tier: a host pool behind the device pool, on real traffic (issue "KV offload tier").

Three studies, each replaying a workload through the real scheduler
(:func:`pagedkv.sim.replay.replay_paged`) with the step model of :mod:`pagedkv.sim.replay`: a
step lasts ``step_duration_s`` plus ``bytes_per_block / swap_bytes_per_second`` per block it
copies between the tiers (``swap_out`` + ``swap_in``), copies not overlapped with compute.

* :func:`swap_study` — preemption by recompute vs swap vs auto on one device pool, with a host
  tier large enough for every swap: tokens computed (recompute's cost), block copies and their
  modelled time (swap's cost), steps, simulated time.
* :func:`host_tier_prefix_study` — prefix caching with the host tier as a second-level cache:
  the device pool's evicted cached blocks are written back to the host and loaded back on a
  later hit. Hit rate (total, and the part served from the host) per device pool and host
  size, against the device pool alone, a device pool of the same total size, and an
  unbounded pool.
* :func:`retention_study` — retention priorities: the requests of the k most popular system
  prompts (k up to all of them) get a higher ``retention_priority``, over their system prompt
  only (``retention_tokens`` = ``shared_prefix_len``) or over the whole prompt, for good or for
  a retention duration of simulated time; their blocks are evicted after the default-priority
  ones. Hit rate with vs without.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pagedkv.sim.kv_budget import DEFAULT_SWAP_BYTES_PER_SECOND
from pagedkv.sim.replay import PagedConfig, PagedReplayResult, replay_paged
from pagedkv.sim.workloads.request import TraceRequest
from studies.plotting import new_figure, save_png
from studies.prefix_cache import declared_prefix_hits, unbounded_pool_blocks
from studies.report import StudyResult, image, md_table, pct

__all__ = ["host_tier_prefix_study", "retention_study", "swap_study", "tokens_needed"]

GIB = 2**30


def tokens_needed(requests: Sequence[TraceRequest], max_model_len: int) -> int:
    """Tokens a replay computes with no recompute and no cache hit: each prompt once, then each
    sample's generated tokens but the last (it is sampled, never fed back)."""
    return sum(r.prompt_len + r.n * (min(r.output_len, max_model_len - r.prompt_len) - 1) for r in requests)


def _tier_row(result: PagedReplayResult) -> dict[str, Any]:
    """The figures every offload table draws from."""
    return {
        "num_host_blocks": result.num_host_blocks,
        "preemption_mode": result.preemption_mode,
        "hit_rate": result.prefix_cache_hit_rate,
        "host_hit_rate": result.prefix_cache_host_hit_rate,
        "prefix_cache_hits": result.prefix_cache_hits,
        "prefix_cache_host_hits": result.prefix_cache_host_hits,
        "prefix_cache_queries": result.prefix_cache_queries,
        "tokens_computed": result.tokens_computed,
        "steps": result.total_steps,
        "num_preemptions": result.num_preemptions,
        "num_swap_preemptions": result.num_swap_preemptions,
        "blocks_swapped_out": result.blocks_swapped_out,
        "blocks_swapped_in": result.blocks_swapped_in,
        "bytes_swapped_out": result.bytes_swapped_out,
        "bytes_swapped_in": result.bytes_swapped_in,
        "num_write_backs": result.num_write_backs,
        "num_write_backs_skipped": result.num_write_backs_skipped,
        "num_host_evictions": result.num_host_evictions,
        "mean_host_used_blocks": result.mean_host_used_blocks,
        "peak_host_used_blocks": result.peak_host_used_blocks,
        "mean_host_cached_blocks": result.mean_host_cached_blocks,
        "copy_time_s": result.copy_time_s,
        "makespan_s": result.makespan_s,
        "num_finished": result.num_finished,
        "generated_tokens": result.generated_tokens,
        "mean_concurrent": result.mean_running,
        "wall_time_s": result.wall_time_s,
    }


def _config(num_blocks: int, **kwargs: Any) -> PagedConfig:
    return PagedConfig(num_blocks=num_blocks, **kwargs)


# --------------------------------------------------------------------------- (a) swap vs recompute


def swap_study(
    requests: Sequence[TraceRequest],
    out_dir: Path,
    *,
    num_blocks: int,
    bytes_per_block: int,
    host_multiple: int = 4,
    block_size: int = 16,
    max_model_len: int = 2048,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 8192,
    step_duration_s: float = 0.02,
    swap_bytes_per_second: float = DEFAULT_SWAP_BYTES_PER_SECOND,
    auto_throughputs: Sequence[float] = (100_000.0,),
    workload_label: str = "workload",
    geometry_label: str = "",
) -> StudyResult:
    """Recompute (without and with a host tier) vs swap vs auto on one device pool.

    The host tier holds ``host_multiple`` x ``num_blocks`` blocks. ``auto`` runs with the
    default cost model (recompute throughput = the step model's full-budget rate) and once per
    entry of ``auto_throughputs`` (tokens/s), since its choice hinges on that ratio.
    """
    common = _pool_settings(
        block_size,
        max_model_len,
        max_num_seqs,
        max_num_batched_tokens,
        step_duration_s,
        bytes_per_block=bytes_per_block,
        swap_bytes_per_second=swap_bytes_per_second,
    )
    host = host_multiple * num_blocks
    default_rate = max_num_batched_tokens / step_duration_s
    runs: list[tuple[str, PagedConfig]] = [
        ("recompute, no host tier", _config(num_blocks, **common)),
        ("recompute + host tier", _config(num_blocks, num_host_blocks=host, **common)),
        ("swap", _config(num_blocks, num_host_blocks=host, preemption_mode="swap", **common)),
        (
            f"auto (recompute at {default_rate:,.0f} tokens/s)",
            _config(num_blocks, num_host_blocks=host, preemption_mode="auto", **common),
        ),
    ]
    for rate in auto_throughputs:
        runs.append(
            (
                f"auto (recompute at {rate:,.0f} tokens/s)",
                _config(
                    num_blocks, num_host_blocks=host, preemption_mode="auto", recompute_tokens_per_second=rate, **common
                ),
            )
        )
    needed = tokens_needed(requests, max_model_len)
    rows = []
    for label, config in runs:
        result = replay_paged(requests, config)
        row = {"label": label, **_tier_row(result), "recompute_tokens_per_second": config.recompute_throughput}
        # What recomputing the extra tokens would cost at the cost model's throughput, next to
        # what the copies cost: the two sides of the auto rule, summed over the run.
        row["extra_tokens"] = result.tokens_computed - needed
        row["extra_tokens_time_s"] = max(row["extra_tokens"], 0) / config.recompute_throughput
        row.update(block_size=block_size, bytes_per_block=bytes_per_block, swap_bytes_per_second=swap_bytes_per_second)
        rows.append(row)
    same = {(r["num_finished"], r["generated_tokens"]) for r in rows}
    copy_us = 1e6 * bytes_per_block / swap_bytes_per_second
    lines = [
        f"{workload_label}: {len(requests):,} requests, device pool {num_blocks:,} blocks x {block_size} tokens "
        f"(the pool of the memory-breakdown study), host tier {host:,} blocks ({host_multiple}x), "
        f"{bytes_per_block:,} B per block{geometry_label}; max_model_len {max_model_len}, {max_num_batched_tokens} "
        f"tokens per step, at most {max_num_seqs} sequences, {step_duration_s * 1000:g} ms per step plus "
        f"{copy_us:.1f} us per block copied ({swap_bytes_per_second / 1e9:g} GB/s). Tokens needed without any "
        f"recompute or cache hit: {needed:,}. Every run finished the same requests with the same output tokens: "
        f"{'yes' if len(same) == 1 else 'NO: ' + str(sorted(same))}.",
        "",
        md_table(
            [
                "preemption",
                "tokens computed",
                "extra vs needed",
                "steps",
                "preemptions (swaps)",
                "blocks out / in",
                "GiB out / in",
                "write-backs",
                "host prefix hits (tokens)",
                "copy time (s)",
                "extra tokens' time (s)",
                "simulated time (s)",
            ],
            [
                [
                    r["label"],
                    r["tokens_computed"],
                    f"{100 * r['extra_tokens'] / needed:+.1f}%",
                    r["steps"],
                    f"{r['num_preemptions']:,} ({r['num_swap_preemptions']:,})",
                    f"{r['blocks_swapped_out']:,} / {r['blocks_swapped_in']:,}",
                    f"{r['bytes_swapped_out'] / GIB:.1f} / {r['bytes_swapped_in'] / GIB:.1f}",
                    r["num_write_backs"],
                    r["prefix_cache_host_hits"],
                    f"{r['copy_time_s']:.2f}",
                    f"{r['extra_tokens_time_s']:.2f}",
                    f"{r['makespan_s']:.2f}",
                ]
                for r in rows
            ],
        ),
        "",
        "Blocks out = device -> host copies (swap-outs and write-backs of evicted cached blocks); blocks in = "
        "host -> device (swap-ins and prefix hits found on the host). Copy time = blocks moved x bytes per block / "
        "bandwidth, added to the simulated time; extra tokens' time = (tokens computed - tokens needed) / the "
        "recompute throughput of the row's cost model, which the step model does *not* charge (a recompute step "
        "costs one step like any other, so recomputation shows only in tokens computed).",
    ]
    lines += _swap_findings(rows, needed)
    data = {
        "workload": workload_label,
        "num_requests": len(requests),
        "num_blocks": num_blocks,
        "num_host_blocks": host,
        "block_size": block_size,
        "bytes_per_block": bytes_per_block,
        "swap_bytes_per_second": swap_bytes_per_second,
        "step_duration_s": step_duration_s,
        "tokens_needed": needed,
        "same_output": len(same) == 1,
        "rows": rows,
    }
    return StudyResult("offload_swap", "Preemption: recompute vs swap vs auto", data, "\n".join(lines))


def _swap_findings(rows: list[dict[str, Any]], needed: int) -> list[str]:
    base, tiered, swap = rows[0], rows[1], rows[2]
    saved = base["tokens_computed"] - swap["tokens_computed"]
    out = [
        "",
        f"- **Swap** computes {swap['tokens_computed']:,} tokens against {base['tokens_computed']:,} for recompute "
        f"without a host tier ({saved:,} fewer, {100 * saved / base['tokens_computed']:.1f}%), for "
        f"{(swap['bytes_swapped_out'] + swap['bytes_swapped_in']) / GIB:.1f} GiB of copies = "
        f"{swap['copy_time_s']:.2f} s of modelled copy time; recomputing those {saved:,} tokens would take "
        f"{saved / swap['recompute_tokens_per_second']:.2f} s at {swap['recompute_tokens_per_second']:,.0f} tokens/s.",
    ]
    if base["tokens_computed"] > needed:
        avoided = (base["tokens_computed"] - tiered["tokens_computed"]) / (base["tokens_computed"] - needed)
        out.append(
            f"- **Recompute with a host tier** computes {tiered['tokens_computed']:,} tokens: it avoids "
            f"{avoided:.0%} of the recomputation, because a preempted sequence's full blocks stay cached on the "
            "device, the device pool writes them back to the host when it reuses them, and re-admission finds them "
            f"there ({tiered['prefix_cache_host_hits']:,} host-hit tokens at first admissions, the rest as resumed "
            "hits) — a swap by another route, minus the partial last block."
        )
    # Split swap's copies: its own swap-outs / swap-ins against the write-backs of evicted cached
    # blocks (which recompute + host tier pays too).
    per_block = swap["copy_time_s"] / max(swap["blocks_swapped_out"] + swap["blocks_swapped_in"], 1)
    own_out = swap["blocks_swapped_out"] - swap["num_write_backs"]
    host_hit_blocks = swap["prefix_cache_host_hits"] // swap["block_size"]
    own_in = max(swap["blocks_swapped_in"] - host_hit_blocks, 0)
    base_extra = base["extra_tokens_time_s"]
    swap_per_token = 2 * swap["bytes_per_block"] / (swap["block_size"] * swap["swap_bytes_per_second"])
    out.append(
        f"- Of swap's {swap['blocks_swapped_out'] + swap['blocks_swapped_in']:,} block copies, "
        f"{swap['num_write_backs']:,} are write-backs of evicted cached blocks (prefix caching's second level, "
        f"which brought back only {swap['prefix_cache_host_hits']:,} prompt tokens here) and about "
        f"{own_out + own_in:,} are the victims' own swap-outs and swap-ins: {(own_out + own_in) * per_block:.2f} s of "
        f"copies against {base_extra:.2f} s to recompute the extra tokens of the tier-less run at the default "
        f"throughput. Per token, a copy out and back costs {1e6 * swap_per_token:.2f} us and a recompute "
        f"{1e6 / swap['recompute_tokens_per_second']:.2f} us here, so "
        + (
            "recompute is the cheaper side by the cost model (auto swaps only victims with fewer blocks to copy "
            "than tokens to recompute: those whose blocks are still on the host from an earlier swap or "
            "write-back)"
            if swap_per_token > 1 / swap["recompute_tokens_per_second"]
            else "swap is the cheaper side by the cost model"
        )
        + f"; the write-backs are overhead wherever prefixes are not reused ({swap['num_write_backs'] * per_block:.2f} s "
        "here)."
    )
    steps = sorted({r["steps"] for r in rows})
    if len(steps) == 1:
        out.append(
            f"- Every mode takes {steps[0]:,} steps: the token budget never binds on this workload (decode-bound "
            "steps), so the step model sees recomputation only in tokens computed, and the tiers add only their copy "
            "time to the simulated time."
        )
    else:
        out.append(
            f"- Steps range over {steps[0]:,} .. {steps[-1]:,}: recomputation costs steps where the token budget binds."
        )
    autos = rows[3:]
    out.append(
        "- **Auto** swaps a victim when copying its blocks out and back is cheaper than recomputing its tokens: "
        + "; ".join(
            f"at {r['recompute_tokens_per_second']:,.0f} tokens/s it swapped {r['num_swap_preemptions']:,} of "
            f"{r['num_preemptions']:,} victims"
            for r in autos
        )
        + ". Per token, a copy out and back costs 2 x bytes per token / bandwidth, so the rule flips where the "
        "recompute throughput equals bandwidth / (2 x bytes per token); blocks already on the host (written back "
        "earlier) and a victim's shared cached prefix (not recomputed) move it per victim."
    )
    return out


# --------------------------------------------------------------------------- (b) host tier as a cache


def _plot_host_tier(data: dict[str, Any], path: Path, subtitle: str) -> Path:
    fig = new_figure(8.5, 5.2)
    ax = fig.subplots(1, 1)
    colors = ["#1565c0", "#ef6c00", "#2e7d32", "#6a1b9a"]
    unbounded = 100 * data["unbounded"]["hit_rate"]
    for index, (device, rows) in enumerate(data["pools"].items()):
        color = colors[index % len(colors)]
        xs = [r["host_multiple"] for r in rows]
        ax.plot(
            xs,
            [100 * r["hit_rate"] for r in rows],
            marker="o",
            color=color,
            label=f"{int(device):,} device blocks + host tier",
        )
        ax.plot(
            xs,
            [100 * (r["hit_rate"] - r["host_hit_rate"]) for r in rows],
            marker=".",
            linestyle=":",
            color=color,
            label=f"{int(device):,} device blocks: part hit on the device",
        )
        same = [r for r in rows if r.get("same_total_device") is not None]
        ax.plot(
            [r["host_multiple"] for r in same],
            [100 * r["same_total_device"]["hit_rate"] for r in same],
            marker="s",
            linestyle="--",
            color=color,
            alpha=0.6,
            label=f"device only, {int(device):,} x (1 + multiple) blocks",
        )
    ax.axhline(unbounded, color="0.3", linewidth=1, label=f"unbounded pool ({unbounded:.1f}%)")
    ax.axhline(
        data["target_fraction"] * unbounded,
        color="0.3",
        linewidth=1,
        linestyle="--",
        label=f"{100 * data['target_fraction']:.0f}% of unbounded",
    )
    multiples = sorted({r["host_multiple"] for rows in data["pools"].values() for r in rows})
    ax.set_xticks(multiples, [f"{m}x" for m in multiples])
    ax.set_xlabel("host tier size (multiple of the device pool)")
    ax.set_ylabel("prefix-cache hit rate (% of prompt tokens)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, frameon=False)
    fig.suptitle(f"Prefix caching with a host tier\n{subtitle}", fontsize=11)
    fig.tight_layout()
    return save_png(fig, path)


def host_tier_prefix_study(
    requests: Sequence[TraceRequest],
    out_dir: Path,
    *,
    device_pools: Sequence[int],
    bytes_per_block: int,
    host_multiples: Sequence[int] = (0, 1, 2, 4),
    block_size: int = 16,
    max_model_len: int = 2048,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 8192,
    step_duration_s: float = 0.02,
    swap_bytes_per_second: float = DEFAULT_SWAP_BYTES_PER_SECOND,
    target_fraction: float = 0.95,
    workload_label: str = "workload",
    description: str = "",
    geometry_label: str = "",
) -> StudyResult:
    """Hit rate per device pool (blocks) and host tier (``host_multiples`` x the device pool)."""
    common = _pool_settings(
        block_size,
        max_model_len,
        max_num_seqs,
        max_num_batched_tokens,
        step_duration_s,
        bytes_per_block=bytes_per_block,
        swap_bytes_per_second=swap_bytes_per_second,
    )
    unbounded_blocks = unbounded_pool_blocks(requests, block_size, max_model_len)
    unbounded = {
        "num_blocks": unbounded_blocks,
        **_tier_row(replay_paged(requests, _config(unbounded_blocks, **common))),
    }
    best = unbounded["hit_rate"]
    pools: dict[str, list[dict[str, Any]]] = {}
    for device in device_pools:
        rows = []
        for multiple in host_multiples:
            config = _config(device, num_host_blocks=multiple * device, **common)
            row = {"num_blocks": device, "host_multiple": multiple, **_tier_row(replay_paged(requests, config))}
            row["fraction_of_unbounded"] = row["hit_rate"] / best if best else 0.0
            if multiple:
                # The same memory all on the device: what the host tier is worth against more HBM.
                total = (1 + multiple) * device
                alone = _tier_row(replay_paged(requests, _config(min(total, unbounded_blocks), **common)))
                row["same_total_device"] = {"num_blocks": total, **alone}
            else:
                row["same_total_device"] = None
            rows.append(row)
        pools[str(device)] = rows
    prompt_tokens = sum(r.prompt_len for r in requests)
    data = {
        "workload": workload_label,
        "description": description,
        "num_requests": len(requests),
        "prompt_tokens": prompt_tokens,
        "block_size": block_size,
        "bytes_per_block": bytes_per_block,
        "swap_bytes_per_second": swap_bytes_per_second,
        "target_fraction": target_fraction,
        "unbounded": unbounded,
        "pools": pools,
    }
    subtitle = f"{workload_label}, block size {block_size}, copies at {swap_bytes_per_second / 1e9:g} GB/s"
    png = _plot_host_tier(data, out_dir / "offload_prefix_cache.png", subtitle)
    table_rows = []
    for device, rows in pools.items():
        for r in rows:
            same = r["same_total_device"]
            table_rows.append(
                [
                    f"{int(device):,}",
                    f"{r['num_host_blocks']:,} ({r['host_multiple']}x)" if r["host_multiple"] else "none",
                    pct(r["hit_rate"]),
                    pct(r["host_hit_rate"]),
                    pct(r["fraction_of_unbounded"]),
                    pct(same["hit_rate"]) if same else "-",
                    r["tokens_computed"],
                    f"{r['blocks_swapped_in']:,} / {r['num_write_backs']:,}",
                    r["num_write_backs_skipped"],
                    r["num_host_evictions"],
                    f"{r['copy_time_s']:.2f}",
                    r["steps"],
                ]
            )
    table_rows.append(
        [
            f"{unbounded_blocks:,} (unbounded)",
            "none",
            pct(best),
            pct(0.0),
            pct(1.0),
            "-",
            unbounded["tokens_computed"],
            "0 / 0",
            0,
            0,
            "0.00",
            unbounded["steps"],
        ]
    )
    lines = [
        f"{workload_label} ({len(requests):,} requests, {prompt_tokens:,} prompt tokens"
        + (f"; {description}" if description else "")
        + f"). Block size {block_size}, {bytes_per_block:,} B per block{geometry_label}, copies at "
        f"{swap_bytes_per_second / 1e9:g} GB/s, recompute preemption. The device pool writes its evicted cached "
        "blocks back to the host tier (when the host has room: a free block, or a cached one of no higher retention "
        "priority); a prompt whose prefix misses on the device but hits on the host has those blocks loaded back "
        "before its prefill. Hit rate = prompt tokens served from either tier at first admission / prompt tokens "
        "looked up; host part = those loaded from the host.",
        "",
        md_table(
            [
                "device pool (blocks)",
                "host tier (blocks)",
                "hit rate",
                "from the host",
                "of unbounded",
                "same memory all on device",
                "tokens computed",
                "blocks loaded / written back",
                "write-backs skipped",
                "host evictions",
                "copy time (s)",
                "steps",
            ],
            table_rows,
        ),
        "",
        image("prefix caching with a host tier", "offload_prefix_cache.png"),
        "",
    ]
    lines += _host_findings(data)
    return StudyResult("offload_prefix_cache", "Prefix caching with a host tier", data, "\n".join(lines), [png])


def _host_findings(data: dict[str, Any]) -> list[str]:
    best = data["unbounded"]["hit_rate"]
    target = data["target_fraction"]
    out = []
    for device, rows in data["pools"].items():
        alone = rows[0]
        biggest = rows[-1]
        reached = biggest["fraction_of_unbounded"] >= target
        verdict = (
            f"**reaches the target** ({pct(biggest['fraction_of_unbounded'])} of the unbounded hit rate, "
            f">= {target:.0%})"
            if reached
            else f"**misses the target** by {100 * (target * best - biggest['hit_rate']):.1f} points of hit rate "
            f"({pct(biggest['fraction_of_unbounded'])} of unbounded)"
        )
        out.append(
            f"- {int(device):,} device blocks: alone {pct(alone['hit_rate'])} ({pct(alone['fraction_of_unbounded'])} of "
            f"the unbounded {pct(best)}); with a {biggest['host_multiple']}x host tier {pct(biggest['hit_rate'])}, of which "
            f"{pct(biggest['host_hit_rate'])} loaded from the host: {verdict}. Cost: "
            f"{biggest['blocks_swapped_in']:,} blocks loaded and {biggest['num_write_backs']:,} written back "
            f"({(biggest['bytes_swapped_in'] + biggest['bytes_swapped_out']) / GIB:,.1f} GiB), "
            f"{biggest['copy_time_s']:.2f} s of copies in {biggest['makespan_s']:,.0f} s of simulated time."
        )
    out.append(
        "- Write-backs outnumber loads: every cached block the device evicts is copied out once (unless the host "
        "still holds it), needed later or not; only the ones a later prompt hits come back."
    )
    pairs = [
        (int(device), r) for device, rows in data["pools"].items() for r in rows if r["same_total_device"] is not None
    ]
    if pairs:
        gaps = [r["same_total_device"]["hit_rate"] - r["hit_rate"] for _, r in pairs]
        worst_device, worst = max(pairs, key=lambda p: p[1]["same_total_device"]["hit_rate"] - p[1]["hit_rate"])
        out.append(
            "- Against the same memory all on the device, the two-tier pool's hit rate differs by "
            f"{100 * min(gaps):+.1f} .. {100 * max(gaps):+.1f} points (device-only minus tiered; largest at "
            f"{worst_device:,} device blocks + {worst['host_multiple']}x host: {pct(worst['same_total_device']['hit_rate'])} "
            f"against {pct(worst['hit_rate'])}). The host tier is filled only by device evictions in LRU order and a "
            "write-back is skipped when the host has no room, so it is a somewhat worse cache than one pool of the same "
            "size; what it costs beyond that is the copy traffic."
        )
    return out


# --------------------------------------------------------------------------- (c) retention priorities

# What a prioritized request's retention_priority covers: its system prompt only
# (retention_tokens = shared_prefix_len) or its whole prompt (retention_tokens = None).
RETENTION_SCOPES = ("system prompt", "whole prompt")


def _popularity(requests: Sequence[TraceRequest]) -> list[str]:
    """Shared prefix ids, most requested first (ties: first seen)."""
    counts = Counter(r.shared_prefix_id for r in requests if r.shared_prefix_id is not None)
    order = {pid: i for i, pid in enumerate(dict.fromkeys(r.shared_prefix_id for r in requests))}
    return sorted(counts, key=lambda pid: (-counts[pid], order[pid]))


def _group_rate(requests: Sequence[TraceRequest], cached: dict[str, int], ids: set[str]) -> float:
    queried = sum(r.prompt_len for r in requests if r.shared_prefix_id in ids)
    hit = sum(cached.get(r.request_id, 0) for r in requests if r.shared_prefix_id in ids)
    return hit / queried if queried else 0.0


def _prioritized(
    requests: Sequence[TraceRequest], boosted: set[str], priority: int, duration: float | None, scope: str
) -> list[TraceRequest]:
    """The trace with the requests of the ``boosted`` prefixes at ``priority`` over ``scope``."""
    return [
        dataclasses.replace(
            r,
            retention_priority=priority,
            retention_duration=duration,
            retention_tokens=r.shared_prefix_len if scope == "system prompt" else None,
        )
        if r.shared_prefix_id in boosted
        else r
        for r in requests
    ]


def retention_study(
    requests: Sequence[TraceRequest],
    out_dir: Path,
    *,
    pool_sizes: Sequence[int],
    top_counts: Sequence[int] = (1, 2, 4),
    priority: int = 80,
    variants: Sequence[tuple[str, float | None]] = (("system prompt", None), ("whole prompt", None)),
    watched_prompts: int | None = None,
    block_size: int = 16,
    max_model_len: int = 2048,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 8192,
    step_duration_s: float = 0.02,
    workload_label: str = "workload",
    description: str = "",
) -> StudyResult:
    """Hit rate with the requests of the ``k`` most popular shared prefixes at ``priority``,
    for each ``k`` of ``top_counts`` and each ``(scope, retention duration)`` of ``variants``,
    against no priorities.

    ``scope`` (one of :data:`RETENTION_SCOPES`) is what the priority covers: ``"system prompt"``
    sets ``retention_tokens`` = the request's ``shared_prefix_len`` (the full blocks of its
    system prompt; the private tail keeps the default priority), ``"whole prompt"`` every full
    prompt block. Durations are simulated seconds (``None``: for good). Each row also reports
    the hit rate of the requests of the ``watched_prompts`` most popular prefixes and of the
    others (default: the largest ``k`` below the number of prefixes).
    """
    for scope, _ in variants:
        if scope not in RETENTION_SCOPES:
            raise ValueError(f"unknown retention scope {scope!r}; use one of {', '.join(RETENTION_SCOPES)}")
    popular = _popularity(requests)
    if watched_prompts is None:
        below = [k for k in top_counts if k < len(popular)]
        watched_prompts = max(below) if below else 1
    watched = set(popular[:watched_prompts])  # the group whose hit rate every row reports
    others = set(popular) - watched
    common = _pool_settings(block_size, max_model_len, max_num_seqs, max_num_batched_tokens, step_duration_s)
    # What an unbounded cache would serve each group: its declared sharing.
    ceiling = {}
    for name, ids in (("all", set(popular)), ("top", watched), ("rest", others)):
        group = [r for r in requests if r.shared_prefix_id in ids]
        queried = sum(r.prompt_len for r in group)
        ceiling[name] = declared_prefix_hits(group, block_size) / queried if queried else 0.0
    runs: list[tuple[int, str | None, float | None]] = [(0, None, None)]
    runs += [(k, scope, duration) for scope, duration in variants for k in top_counts]
    rows = []
    for num_blocks in pool_sizes:
        baseline = None
        for k, scope, duration in runs:
            trace = _prioritized(requests, set(popular[:k]), priority, duration, scope) if k else list(requests)
            result = replay_paged(trace, _config(num_blocks, **common), record_cached_tokens=True)
            cached = result.request_cached_tokens or {}
            row = {
                "num_blocks": num_blocks,
                "prioritized_prompts": min(k, len(popular)),
                "priority": priority if k else None,
                "scope": scope,
                "retention_duration": duration,
                "hit_rate": result.prefix_cache_hit_rate,
                "top_hit_rate": _group_rate(requests, cached, watched),
                "rest_hit_rate": _group_rate(requests, cached, others),
                "tokens_computed": result.tokens_computed,
                "num_preemptions": result.num_preemptions,
                "steps": result.total_steps,
            }
            if baseline is None:
                baseline = row
            row["delta_hit_rate"] = row["hit_rate"] - baseline["hit_rate"]
            rows.append(row)
    share = sum(1 for r in requests if r.shared_prefix_id in watched) / len(requests) if requests else 0.0

    def k_label(k: int) -> str:
        return f"all {len(popular)}" if k >= len(popular) else f"top {k}"

    def duration_label(duration: float | None) -> str:
        return "for good" if duration is None else f"{duration:g} s"

    def cells(select: Any) -> list[list[Any]]:
        out = []
        for num_blocks in pool_sizes:
            mine = [r for r in rows if r["num_blocks"] == num_blocks]
            base = mine[0]
            for scope, duration in variants:
                line = [f"{num_blocks:,}", scope, duration_label(duration), select(base, True)]
                for k in top_counts:
                    row = next(
                        r
                        for r in mine
                        if r["scope"] == scope
                        and r["retention_duration"] == duration
                        and r["prioritized_prompts"] == min(k, len(popular))
                    )
                    line.append(select(row, False))
                out.append(line)
        return out

    headers = ["pool (blocks)", "priority covers", "retention duration", "no priorities"]
    headers += [f"{k_label(k)} at {priority}" for k in top_counts]
    lines = [
        f"{workload_label} ({len(requests):,} requests"
        + (f"; {description}" if description else "")
        + f"). The requests of the k most popular system prompts get `retention_priority={priority}` (the "
        "default is 35); cached blocks are evicted lowest priority first, LRU within a priority, and a retention "
        "duration (simulated seconds from the block's release, on the replay's manual clock) lets a block fall back "
        "to the default. *Priority covers*: `system prompt` = `retention_tokens` set to the request's system-prompt "
        "length (`shared_prefix_len`), so only the full blocks of the shared system prompt are prioritized and the "
        "private tail keeps the default; `whole prompt` = every full prompt block, private tail included (the "
        f"earlier form, for comparison). No host tier, block size {block_size}. The top {len(watched)} prompts draw "
        f"{share:.0%} of the requests; an unbounded cache would serve {pct(ceiling['all'])} of all prompt tokens, "
        f"{pct(ceiling['top'])} of the top {len(watched)} prompts' requests' and {pct(ceiling['rest'])} of the "
        "others' (declared sharing; the first request of each prompt must miss).",
        "",
        "Prefix-cache hit rate (change against no priorities, in points):",
        "",
        md_table(
            headers,
            cells(
                lambda r, base: (
                    pct(r["hit_rate"]) if base else f"{pct(r['hit_rate'])} ({100 * r['delta_hit_rate']:+.2f})"
                )
            ),
        ),
        "",
        f"Hit rate of the top {len(watched)} prompts' requests / of the other requests:",
        "",
        md_table(headers, cells(lambda r, base: f"{pct(r['top_hit_rate'])} / {pct(r['rest_hit_rate'])}")),
        "",
        "Preemptions (no priorities; range over the rows with priorities): "
        + ", ".join(_preemptions(rows, n) for n in pool_sizes)
        + ".",
        "",
    ]
    lines += _retention_findings(rows, ceiling, len(popular))
    data = {
        "workload": workload_label,
        "description": description,
        "num_requests": len(requests),
        "priority": priority,
        "num_prefixes": len(popular),
        "watched_prompts": len(watched),
        "popular_prefixes": popular[: len(watched)],
        "variants": [{"scope": scope, "retention_duration": duration} for scope, duration in variants],
        "ceiling": ceiling,
        "rows": rows,
    }
    return StudyResult("offload_retention", "Retention priorities", data, "\n".join(lines))


def _preemptions(rows: list[dict[str, Any]], num_blocks: int) -> str:
    mine = [r for r in rows if r["num_blocks"] == num_blocks]
    counts = sorted({r["num_preemptions"] for r in mine[1:]})
    spread = "" if not counts else f" ({counts[0]:,})" if len(counts) == 1 else f" ({counts[0]:,} .. {counts[-1]:,})"
    return f"{num_blocks:,} blocks {mine[0]['num_preemptions']:,}{spread}"


def _retention_findings(rows: list[dict[str, Any]], ceiling: dict[str, float], num_prefixes: int) -> list[str]:
    """Findings read off the rows (a change under 0.25 points counts as none)."""
    negligible = 0.25
    out: list[str] = []
    pools = list(dict.fromkeys(r["num_blocks"] for r in rows))
    base = {r["num_blocks"]: r for r in rows if not r["prioritized_prompts"]}

    def pick(scope: str, duration: float | None, *, every: bool) -> list[dict[str, Any]]:
        return [
            r
            for r in rows
            if r["prioritized_prompts"]
            and r["scope"] == scope
            and r["retention_duration"] == duration
            and (r["prioritized_prompts"] >= num_prefixes) == every
        ]

    def deltas(selected: list[dict[str, Any]]) -> list[float]:
        return [100 * r["delta_hit_rate"] for r in selected]

    def span(selected: list[dict[str, Any]]) -> str:
        d = deltas(selected)
        return f"{min(d):+.2f} .. {max(d):+.2f} points"

    some_sys, some_whole = pick("system prompt", None, every=False), pick("whole prompt", None, every=False)
    if some_sys and some_whole:
        worst = min(some_whole, key=lambda r: r["delta_hit_rate"])
        ks = [str(k) for k in dict.fromkeys(r["prioritized_prompts"] for r in some_sys)]
        text = (
            f"- **Popular prompts only** (top {', '.join(ks)} of {num_prefixes}), for good: over the system prompt "
            "the priority "
            f"changes the hit rate by {span(some_sys)}; over the whole prompt by {span(some_whole)}"
        )
        if worst["delta_hit_rate"] < 0:
            text += (
                f" (worst {100 * worst['delta_hit_rate']:+.2f} at {worst['num_blocks']:,} blocks, top "
                f"{worst['prioritized_prompts']}: the other requests' hit rate falls from "
                f"{pct(base[worst['num_blocks']]['rest_hit_rate'])} to {pct(worst['rest_hit_rate'])}, because every "
                "prioritized request's private tail, never reused, outlives all default-priority blocks and pushes "
                "out the less popular system prompts)"
            )
        text += ". "
        if min(deltas(some_sys)) > -negligible and min(deltas(some_whole)) < -negligible:
            text += "Limiting the priority to the system prompt (`retention_tokens`) removes that loss"
        else:
            text += "Limiting the priority to the system prompt (`retention_tokens`) changes it as above"
        text += f", for a gain of at most {max(deltas(some_sys)):+.2f} points"
        if max(deltas(some_sys)) < 1:
            text += (
                ": plain LRU already keeps the popular prompts, re-requested every few seconds (without "
                "priorities their requests hit "
                + ", ".join(f"{pct(base[n]['top_hit_rate'])} at {n:,} blocks" for n in pools)
                + f", against {pct(ceiling['top'])} for an unbounded cache)."
            )
        else:
            text += "."
        out.append(text)
    every_sys, every_whole = pick("system prompt", None, every=True), pick("whole prompt", None, every=True)
    if every_sys:
        best = max(every_sys, key=lambda r: r["delta_hit_rate"])
        text = (
            f"- **Every system prompt prioritized** (all {num_prefixes}), over the system prompt, for good: "
            + "; ".join(
                f"{r['num_blocks']:,} blocks {pct(base[r['num_blocks']]['hit_rate'])} -> {pct(r['hit_rate'])} "
                f"({100 * r['delta_hit_rate']:+.2f})"
                for r in every_sys
            )
            + f" (unbounded cache: {pct(ceiling['all'])})."
        )
        if best["delta_hit_rate"] * 100 >= negligible:
            text += (
                " The priority then separates what is shared (the system prompts) from what is not (private tails "
                "and generated tokens, at the default), so the pool evicts the unshareable blocks first instead of "
                f"the least recently used system prompts; the largest gain is at {best['num_blocks']:,} blocks "
                f"({100 * best['delta_hit_rate']:+.2f} points, the other requests' hit rate "
                f"{pct(base[best['num_blocks']]['rest_hit_rate'])} -> {pct(best['rest_hit_rate'])})."
            )
        if every_whole:
            text += f" Over the whole prompt the same priority gives {span(every_whole)}."
        out.append(text)
    durations = sorted({r["retention_duration"] for r in rows if r["retention_duration"] is not None})
    if durations and every_sys and max(deltas(every_sys)) >= negligible:
        pairs = []
        for duration in durations:
            for r in pick("system prompt", duration, every=True):
                good = next(g for g in every_sys if g["num_blocks"] == r["num_blocks"])
                pairs.append(
                    f"{r['num_blocks']:,} blocks {100 * good['delta_hit_rate']:+.2f} -> "
                    f"{100 * r['delta_hit_rate']:+.2f} with {duration:g} s"
                )
        timed = [r for d in durations for r in pick("system prompt", d, every=True)]
        shrinks = all(
            r["delta_hit_rate"] <= next(g for g in every_sys if g["num_blocks"] == r["num_blocks"])["delta_hit_rate"]
            for r in timed
        )
        out.append(
            "- A retention duration (simulated seconds from each release) "
            + ("shrinks that gain" if shrinks else "changes that gain")
            + f" (all {num_prefixes} over the system prompt, for good -> timed: "
            + "; ".join(pairs)
            + ")"
            + (
                ": the prompts that need protecting are the less popular ones, and they come back after their "
                "priority has expired."
                if shrinks
                else "."
            )
        )
    # Pools where the running sequences overfill the pool and no variant moves the hit rate by 1 point.
    thrash = [
        n
        for n in pools
        if base[n]["num_preemptions"]
        and all(abs(r["delta_hit_rate"]) < 0.01 for r in rows if r["num_blocks"] == n and r["prioritized_prompts"])
    ]
    if thrash:
        changes = [r for r in rows if r["prioritized_prompts"] and r["num_blocks"] in thrash]
        out.append(
            "- Where the running sequences overfill the pool ("
            + ", ".join(f"{n:,} blocks: {base[n]['num_preemptions']:,} preemptions" for n in thrash)
            + f") every variant stays within {span(changes)}: a priority orders only the *free* cached blocks, "
            "and there are few of them."
        )
    return out


def _pool_settings(
    block_size: int,
    max_model_len: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    step_duration_s: float,
    **tier: float,
) -> dict[str, Any]:
    """The PagedConfig settings every run of a study shares (plus its tier settings)."""
    return {
        "block_size": block_size,
        "max_model_len": max_model_len,
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": max_num_batched_tokens,
        "step_duration_s": step_duration_s,
        **tier,
    }
