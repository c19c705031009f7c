"""Prefix caching vs cache size: how much prefill a pool of a given size saves on real traffic.

The prefix cache lives in the KV pool itself: a finished request's full blocks stay findable
until the pool reuses them (LRU), so the pool size is the cache size. For each pool size the
real scheduler replays the workload with prefix caching on, and the study reports the hit
rate (prompt tokens served from the cache at first admission / prompt tokens looked up) and
the prefill tokens saved (those hits: tokens the model does not compute).

Two references are drawn next to the curve:

* **unbounded pool**: the same replay with a pool that holds every token of every request at
  once (nothing is ever evicted or preempted): the most this workload can hit, whatever
  shares its prefix (declared or not: e.g. a chat template's default system prompt);
* **declared sharing**: what the workload's ``shared_prefix_id`` / ``shared_prefix_len``
  promise, at block granularity (only full blocks are cached) and leaving one prompt token to
  compute (its logits are needed): every request after the first naming a prefix reuses it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pagedkv.sim.replay import PagedConfig, replay_paged
from pagedkv.sim.workloads.request import TraceRequest
from studies.plotting import new_figure, save_png
from studies.report import StudyResult, image, md_table, pct

__all__ = ["prefix_cache_study", "declared_prefix_hits", "default_pool_sizes", "unbounded_pool_blocks"]


def declared_prefix_hits(requests: Sequence[TraceRequest], block_size: int) -> int:
    """Prompt tokens an unbounded cache would serve (see the module docstring)."""
    seen: set[str] = set()
    hits = 0
    for request in sorted(requests, key=lambda r: r.arrival_time):
        prefix_id = request.shared_prefix_id
        if prefix_id is None:
            continue
        if prefix_id in seen:
            reusable = min(request.shared_prefix_len, request.prompt_len - 1)
            hits += (reusable // block_size) * block_size
        seen.add(prefix_id)
    return hits


def unbounded_pool_blocks(requests: Sequence[TraceRequest], block_size: int, max_model_len: int) -> int:
    """Blocks for every token of every request (all samples) at once: nothing is ever evicted."""
    total = 0
    for r in requests:
        length = min(r.prompt_len + r.output_len, max_model_len)
        total += r.n * -(-length // block_size)
    return max(total, -(-max_model_len // block_size))


def default_pool_sizes(max_model_len: int, block_size: int, largest: int) -> list[int]:
    """Powers of two times the smallest legal pool (one max_model_len sequence) up to ``largest``."""
    size = -(-max_model_len // block_size)
    sizes = []
    while size <= largest:
        sizes.append(size)
        size *= 2
    return sizes


def _plot(data: dict[str, dict[str, Any]], path: Path, subtitle: str, block_size: int) -> Path:
    fig = new_figure(11, 5.4)
    ax_rate, ax_saved = fig.subplots(1, 2)
    colors = ["#1565c0", "#ef6c00", "#2e7d32", "#6a1b9a"]
    for index, (label, d) in enumerate(data.items()):
        color = colors[index % len(colors)]
        xs = [r["num_blocks"] for r in d["rows"]]
        ax_rate.plot(xs, [100 * r["hit_rate"] for r in d["rows"]], marker="o", color=color, label=label)
        ax_rate.axhline(
            100 * d["unbounded"]["hit_rate"], color=color, linestyle="--", linewidth=1, label=f"{label}: unbounded pool"
        )
        ax_rate.axhline(
            100 * d["declared_hit_rate"], color=color, linestyle=":", linewidth=1, label=f"{label}: declared sharing"
        )
        ax_saved.plot(xs, [r["prefill_tokens_saved"] for r in d["rows"]], marker="o", color=color, label=label)
    sizes = sorted({r["num_blocks"] for d in data.values() for r in d["rows"]})
    for ax in (ax_rate, ax_saved):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [f"{s:,}" for s in sizes], rotation=45 if len(sizes) > 5 else 0)
        ax.minorticks_off()
        ax.set_ylim(bottom=0)
        ax.set_xlabel(f"KV pool = cache size (blocks of {block_size} tokens)")
        ax.grid(alpha=0.3)
    ax_rate.set_ylabel("prefix-cache hit rate (% of prompt tokens)")
    ax_saved.set_ylabel("prefill tokens saved")
    ax_saved.ticklabel_format(axis="y", style="sci", scilimits=(0, 3))
    ax_rate.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.28), ncol=2, frameon=False)
    ax_saved.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.28), ncol=2, frameon=False)
    fig.suptitle(f"Prefix caching vs cache size\n{subtitle}", fontsize=11)
    fig.tight_layout()
    return save_png(fig, path)


def prefix_cache_study(
    workloads: Mapping[str, Sequence[TraceRequest]],
    out_dir: Path,
    *,
    pool_sizes: Sequence[int],
    block_size: int = 16,
    max_model_len: int = 2048,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 8192,
    descriptions: Mapping[str, str] | None = None,
) -> StudyResult:
    """Replay each workload (label -> requests) at every pool size in blocks, prefix caching on."""
    data: dict[str, dict[str, Any]] = {}
    for label, requests in workloads.items():
        prompt_tokens = sum(r.prompt_len for r in requests)
        declared = declared_prefix_hits(requests, block_size)
        rows = []
        unbounded_blocks = unbounded_pool_blocks(requests, block_size, max_model_len)
        for num_blocks in [*pool_sizes, unbounded_blocks]:
            config = PagedConfig(
                num_blocks=num_blocks,
                block_size=block_size,
                max_model_len=max_model_len,
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
            )
            result = replay_paged(requests, config)
            rows.append(
                {
                    "num_blocks": num_blocks,
                    "num_slots": config.num_slots,
                    "hit_rate": result.prefix_cache_hit_rate,
                    "prefill_tokens_saved": result.prefix_cache_hits,
                    "prefix_cache_queries": result.prefix_cache_queries,
                    "tokens_computed": result.tokens_computed,
                    "num_preemptions": result.num_preemptions,
                    "resumed_prefix_hits": result.resumed_prefix_hits,
                    "steps": result.total_steps,
                    "mean_concurrent": result.mean_running,
                }
            )
        unbounded = rows.pop()
        data[label] = {
            "num_requests": len(requests),
            "prompt_tokens": prompt_tokens,
            "declared_hits": declared,
            "declared_hit_rate": declared / prompt_tokens if prompt_tokens else 0.0,
            "unbounded": unbounded,
            "description": (descriptions or {}).get(label, ""),
            "rows": rows,
        }
    subtitle = f"block size {block_size}, max_model_len {max_model_len}, max_num_seqs {max_num_seqs}"
    png = _plot(data, out_dir / "prefix_cache.png", subtitle, block_size)

    lines = [
        f"Pool sizes from the smallest legal pool (one max_model_len sequence) upward; {subtitle}. Hit rate = "
        "prompt tokens served from the cache at first admission / prompt tokens looked up (re-admissions after "
        "preemption are counted apart). Tokens computed include recomputation after preemption.",
        "",
    ]
    for label, d in data.items():
        best = d["unbounded"]["hit_rate"]
        half = next((r["num_blocks"] for r in d["rows"] if r["hit_rate"] >= 0.5 * best), None)
        near = next((r["num_blocks"] for r in d["rows"] if r["hit_rate"] >= 0.9 * best), None)
        lines += [
            f"**{label}** ({d['num_requests']:,} requests, {d['prompt_tokens']:,} prompt tokens"
            + (f"; {d['description']}" if d["description"] else "")
            + f"): an unbounded pool ({d['unbounded']['num_blocks']:,} blocks) hits {pct(best)} "
            + f"(declared sharing alone: {pct(d['declared_hit_rate'])}); half of that needs "
            + (f"{half:,} blocks" if half else "more than the largest pool")
            + ", 90% of it "
            + (f"{near:,} blocks." if near else "more than the largest pool."),
            "",
            md_table(
                [
                    "pool (blocks)",
                    "hit rate",
                    "prefill tokens saved",
                    "tokens computed",
                    "preemptions",
                    "mean concurrent",
                    "steps",
                ],
                [
                    [
                        r["num_blocks"],
                        pct(r["hit_rate"]),
                        r["prefill_tokens_saved"],
                        r["tokens_computed"],
                        r["num_preemptions"],
                        f"{r['mean_concurrent']:.1f}",
                        r["steps"],
                    ]
                    for r in [
                        *d["rows"],
                        {**d["unbounded"], "num_blocks": f"{d['unbounded']['num_blocks']:,} (unbounded)"},
                    ]
                ],
            ),
            "",
        ]
    lines.append(image("prefix cache hit rate vs cache size", "prefix_cache.png"))
    result_data = {
        "block_size": block_size,
        "max_model_len": max_model_len,
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": max_num_batched_tokens,
        "workloads": data,
    }
    return StudyResult("prefix_cache", "Prefix caching vs cache size", result_data, "\n".join(lines), [png])
