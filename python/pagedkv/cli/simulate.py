"""``pagedkv simulate``: replay a workload through the real scheduler, with no model.

Answers capacity questions — how many requests run at once, how full the KV blocks are, how
often the pool preempts, how much the prefix cache saves — for a KV budget given in bytes
(turned into blocks with the model's KV bytes per token, :mod:`pagedkv.sim.kv_budget`) or in
blocks, and compares with contiguous reservation (:mod:`pagedkv.sim.baselines`) in the same memory.

    pagedkv simulate --workload sharegpt --num-requests 2000 --kv-memory 2GiB --kv-dtype bfloat16
    pagedkv simulate --workload trace:requests.jsonl --num-blocks 4096 --breakdown --json
    pagedkv simulate --workload sharegpt-multiturn --rate 2 --num-blocks 8192 --num-host-blocks 32768
    pagedkv simulate --num-blocks 2048 --host-kv-memory 8GiB --preemption-mode swap --swap-bandwidth 25GB/s

A KV offload tier in host memory (``--num-host-blocks`` / ``--host-kv-memory``) holds swapped-out
sequences (``--preemption-mode swap|auto``) and the cached blocks the device pool evicts (loaded
back on a prefix hit); each block copied between the tiers adds ``bytes per block /
--swap-bandwidth`` to its step's simulated time (:mod:`pagedkv.sim.replay`).

The same from Python: build requests (:mod:`pagedkv.sim.workloads`) and call
:func:`pagedkv.sim.replay.compare_allocators` with a :class:`pagedkv.sim.replay.PagedConfig`
(:func:`pagedkv.sim.simulate.simulate` does all of it from keyword arguments).

Bad input (a malformed trace line, a budget below one block, a model config without the
needed fields) prints one line ``pagedkv simulate: error: ...`` and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from pagedkv.config import CORE_FIELDS
from pagedkv.errors import ConfigError, PagedKVError
from pagedkv.sim.kv_budget import DEFAULT_SWAP_BYTES_PER_SECOND
from pagedkv.sim.simulate import DEFAULT_KV_MEMORY, build_workload, simulate

__all__ = ["add_arguments", "run", "format_report"]
# Column titles of the allocators, in report order.
ALLOCATOR_TITLES = {
    "paged": "pagedkv (paged)",
    "max_length": "reserve max_model_len",
    "exact": "reserve exact length (oracle)",
}


def _length_spec(text: str) -> int | tuple[int, int]:
    """``"64"`` -> 64, ``"32:256"`` -> (32, 256) (uniform, inclusive)."""
    try:
        if ":" in text:
            low, high = text.split(":", 1)
            return int(low), int(high)
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or LOW:HIGH, got {text!r}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    workload = parser.add_argument_group("workload")
    workload.add_argument(
        "--workload",
        default="sharegpt",
        metavar="NAME",
        help="sharegpt (first turns), sharegpt-multiturn, shared-prefix, or trace:PATH (JSONL trace) "
        "[default: sharegpt]",
    )
    workload.add_argument(
        "--num-requests", type=int, default=None, help="requests to replay [default: 1000; a trace: all of its lines]"
    )
    workload.add_argument(
        "--rate",
        type=float,
        default=None,
        help="arrival rate in requests/s (multi-turn: conversations/s); default: all at t=0 "
        "(a trace keeps its own times unless --rate is given)",
    )
    workload.add_argument(
        "--cv", type=float, default=1.0, help="coefficient of variation of inter-arrival gaps [default: 1, Poisson]"
    )
    workload.add_argument("--n", type=int, default=None, help="parallel samples per request (overrides the workload's)")
    workload.add_argument(
        "--seed", type=int, default=0, help="seed of arrivals, shuffling and synthetic tokens [default: 0]"
    )
    workload.add_argument(
        "--shuffle", action="store_true", help="sharegpt*: visit conversations in a seeded random order"
    )
    workload.add_argument(
        "--turn-interval",
        type=float,
        default=30.0,
        help="sharegpt-multiturn: seconds between turns of a conversation [default: 30]",
    )
    workload.add_argument(
        "--max-turns", type=int, default=None, help="sharegpt-multiturn: turns per conversation at most"
    )
    workload.add_argument("--num-prefixes", type=int, default=8, help="shared-prefix: system prompts [default: 8]")
    workload.add_argument(
        "--prefix-len", type=int, default=512, help="shared-prefix: tokens per system prompt [default: 512]"
    )
    workload.add_argument(
        "--user-len",
        type=_length_spec,
        default=(16, 256),
        help="shared-prefix: private prompt tokens, N or LOW:HIGH [default: 16:256]",
    )
    workload.add_argument(
        "--output-len",
        type=_length_spec,
        default=(16, 512),
        help="shared-prefix: output tokens, N or LOW:HIGH [default: 16:512]",
    )
    workload.add_argument("--zipf", type=float, default=1.0, help="shared-prefix: popularity exponent [default: 1]")

    memory = parser.add_argument_group("KV memory (one of --kv-memory / --num-blocks)")
    budget = memory.add_mutually_exclusive_group()
    budget.add_argument(
        "--kv-memory",
        "--kv-bytes",
        dest="kv_memory",
        default=None,
        metavar="SIZE",
        help=f"KV-cache budget in bytes, e.g. 8GiB, 512MB, 1e9 [default: {DEFAULT_KV_MEMORY}]",
    )
    budget.add_argument("--num-blocks", type=int, default=None, help="KV-cache budget in blocks")
    memory.add_argument(
        "--model-config",
        default=None,
        metavar="PATH",
        help="config.json (or a folder with one) giving layers / KV heads / head_dim / dtype "
        "[default: the embedded SmolLM2-135M-Instruct]",
    )
    memory.add_argument(
        "--kv-cache-dtype",
        "--kv-dtype",
        dest="kv_dtype",
        default="auto",
        help="KV-cache dtype: auto (the config's), float32, bfloat16, float16, or quantized int8, fp8 "
        "(= fp8_e4m3), fp8_e5m2 (1 byte per value + a 2-byte scale per token and KV head) [default: auto]",
    )

    tiers = parser.add_argument_group(
        "KV offload tier in host memory (one of --num-host-blocks / --host-kv-memory; default: none)"
    )
    host = tiers.add_mutually_exclusive_group()
    host.add_argument(
        "--num-host-blocks",
        type=int,
        default=None,
        metavar="N",
        help="host-tier blocks (same block size and bytes per block as the device pool); it holds swapped-out "
        "sequences and, with prefix caching, the cached blocks the device pool evicts (written back, loaded "
        "back on a prefix hit) [default: 0, no host tier]",
    )
    host.add_argument(
        "--host-kv-memory",
        default=None,
        metavar="SIZE",
        help="host-tier budget in bytes, e.g. 32GiB, turned into blocks with the model's KV bytes per block",
    )
    tiers.add_argument(
        "--preemption-mode",
        default="recompute",
        metavar="MODE",
        help="when a running sequence must give up its blocks: recompute (free them, compute again later), "
        "swap (copy them to the host tier and back; needs a host tier; recompute when it is full), or auto "
        "(per victim, whichever the cost model says is cheaper: 2 x blocks x bytes per block / swap bandwidth "
        "against tokens / recompute throughput) [default: recompute]",
    )
    tiers.add_argument(
        "--swap-bandwidth",
        default=f"{DEFAULT_SWAP_BYTES_PER_SECOND / 1e9:g}GB/s",
        metavar="BYTES/S",
        help="copy bandwidth between device and host tier, e.g. 25GB/s, 50e9; every block copied adds "
        "bytes per block / this to its step's simulated time, and the auto cost model uses it "
        f"[default: {DEFAULT_SWAP_BYTES_PER_SECOND / 1e9:g}GB/s, a PCIe-class GPU <-> pinned host link]",
    )
    tiers.add_argument(
        "--recompute-throughput",
        type=float,
        default=None,
        metavar="TOKENS/S",
        help="forward throughput when recomputing, tokens/s, for the auto cost model "
        "[default: --max-num-batched-tokens / --step-duration, the step model's full-budget rate]",
    )

    sched = parser.add_argument_group("scheduler")
    block_size = CORE_FIELDS["block_size"]["default"]
    sched.add_argument("--block-size", type=int, default=block_size, help=f"tokens per block [default: {block_size}]")
    sched.add_argument(
        "--max-model-len", type=int, default=2048, help="longest sequence, prompt + output [default: 2048]"
    )
    max_num_seqs = CORE_FIELDS["max_num_seqs"]["default"]
    sched.add_argument(
        "--max-num-seqs", type=int, default=max_num_seqs, help=f"running sequences at most [default: {max_num_seqs}]"
    )
    sched.add_argument(
        "--max-num-batched-tokens", type=int, default=8192, help="tokens per step at most [default: 8192]"
    )
    sched.add_argument("--no-prefix-caching", action="store_true", help="turn the prefix cache off")
    watermark = CORE_FIELDS["watermark"]["default"]
    sched.add_argument(
        "--watermark",
        type=float,
        default=watermark,
        help=f"fraction of blocks admission keeps free for running decodes [default: {watermark}, the scheduler's]",
    )
    sched.add_argument(
        "--step-duration",
        type=float,
        default=0.02,
        help="simulated seconds per step; maps arrival times onto steps [default: 0.02]",
    )
    sched.add_argument("--no-baselines", action="store_true", help="replay only the paged scheduler")

    report = parser.add_argument_group("report")
    report.add_argument(
        "--breakdown",
        action="store_true",
        help="add the memory breakdown (token states, reserved, internal / external fragmentation)",
    )
    report.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _fmt(value: Any, kind: str) -> str:
    if value is None:
        return "-"
    if kind == "pct":
        return f"{100 * value:.1f}%"
    if kind == "float":
        return f"{value:,.1f}"
    if kind == "sec":
        return f"{value:,.2f}"
    if kind == "gib":
        return f"{value / 2**30:,.2f}"
    return f"{value:,}"


_ROWS = (
    ("peak concurrent sequences", "peak_concurrent", "int"),
    ("mean concurrent sequences", "mean_concurrent", "float"),
    ("KV utilization (tokens / slots held)", "kv_utilization", "pct"),
    ("KV memory held (time avg)", "kv_usage", "pct"),
    ("preemptions", "preemptions", "int"),
    ("prefix-cache hit rate (tokens)", "prefix_cache_hit_rate", "pct"),
    ("prefill tokens saved by the cache", "prefill_tokens_saved", "int"),
    ("steps", "steps", "int"),
    ("simulated time (s)", "makespan_s", "sec"),
    ("requests finished", "num_finished", "int"),
)
# Rows shown only when the replay had a host tier (None cells print "-").
_TIER_ROWS = (
    ("tokens computed (incl. recompute)", "tokens_computed", "int"),
    ("host KV memory held (time avg)", "host_kv_usage", "pct"),
    ("host blocks cached (time avg)", "host_cached_fraction", "pct"),
    ("prefix-cache hit rate from the host", "prefix_cache_host_hit_rate", "pct"),
    ("prefill tokens loaded from the host", "prefill_tokens_from_host", "int"),
    ("swap preemptions (of preemptions)", "swap_preemptions", "int"),
    ("blocks copied device -> host", "blocks_swapped_out", "int"),
    ("blocks copied host -> device", "blocks_swapped_in", "int"),
    ("GiB copied device -> host", "bytes_swapped_out", "gib"),
    ("GiB copied host -> device", "bytes_swapped_in", "gib"),
    ("write-backs of evicted blocks", "write_backs", "int"),
    ("write-backs skipped (host full)", "write_backs_skipped", "int"),
    ("copy time (s, in simulated time)", "copy_time_s", "sec"),
)
_BREAKDOWN_ROWS = (
    ("  token states", "token_states"),
    ("  reserved, not yet used", "reserved_unused"),
    ("  internal fragmentation", "internal_fragmentation"),
    ("  external fragmentation", "external_fragmentation"),
    ("  free", "free"),
)


def format_report(report: dict[str, Any], *, breakdown: bool = False) -> str:
    """The human-readable table of a :func:`simulate` report."""
    w, kv = report["workload"], report["kv"]
    lines = [
        f"workload: {w['num_requests']:,} requests ({w['num_sequences']:,} sequences), mean prompt "
        f"{w['mean_prompt_len']:.0f} / output {w['mean_output_len']:.0f} tokens, last arrival at {w['last_arrival_s']:.1f} s",
    ]
    pool = f"KV pool: {kv['num_blocks']:,} blocks x {kv['block_size']} tokens = {kv['num_slots']:,} token slots"
    if "kv_bytes" in kv:
        pool += (
            f" = {kv['kv_bytes'] / 2**30:.2f} GiB ({kv['bytes_per_token']:,} B/token: {kv['num_layers']} layers x "
            f"{kv['num_kv_heads']} KV heads x {kv['head_dim']} x {kv['kv_dtype']}"
            + (f" + {kv['kv_scale_bytes']} B scale per head" if kv.get("kv_scale_bytes") else "")
            + ")"
        )
    lines.append(pool)
    tiers = report.get("tiers") or {}
    if tiers.get("num_host_blocks"):
        host = f"host tier: {tiers['num_host_blocks']:,} blocks"
        if tiers.get("host_kv_bytes") is not None:
            host += f" = {tiers['host_kv_bytes'] / 2**30:.2f} GiB"
        host += (
            f", preemption {tiers['preemption_mode']}, copies at {tiers['swap_bytes_per_second'] / 1e9:g} GB/s"
            + (
                f" ({1e6 * tiers['copy_seconds_per_block']:.1f} us per block)"
                if tiers.get("copy_seconds_per_block") is not None
                else ""
            )
            + f", recompute at {tiers['recompute_tokens_per_second']:,.0f} tokens/s (auto cost model)"
        )
        lines.append(host)
    c = report["config"]
    lines.append(
        f"max_model_len {c['max_model_len']}, max_num_seqs {c['max_num_seqs']}, max_num_batched_tokens "
        f"{c['max_num_batched_tokens']}, prefix caching {'on' if c['enable_prefix_caching'] else 'off'}, "
        f"watermark {c['watermark']:g}"
    )
    allocators = report["allocators"]
    names = list(allocators)
    headers = ["", *(ALLOCATOR_TITLES.get(n, n) for n in names)]
    rows = [[label, *(_fmt(allocators[n][key], kind) for n in names)] for label, key, kind in _ROWS]
    if tiers.get("num_host_blocks"):
        rows += [[label, *(_fmt(allocators[n].get(key), kind) for n in names)] for label, key, kind in _TIER_ROWS]
    if breakdown:
        rows.append(["memory breakdown (time avg of pool)", *([""] * len(names))])
        rows += [
            [label, *(_fmt(allocators[n]["breakdown"][key], "pct") for n in names)] for label, key in _BREAKDOWN_ROWS
        ]
    widths = [max(len(str(row[i])) for row in [headers, *rows]) for i in range(len(headers))]
    lines.append("")
    for index, row in enumerate([headers, *rows]):
        lines.append(
            "  ".join(
                str(cell).ljust(widths[0]) if i == 0 else str(cell).rjust(widths[i]) for i, cell in enumerate(row)
            )
        )
        if index == 0:
            lines.append("  ".join("-" * width for width in widths))
    for policy, reason in report["skipped"].items():
        lines.append(f"{ALLOCATOR_TITLES.get(policy, policy)}: not run: {reason}")
    lines.append(f"\nsimulated in {report['wall_time_s']:.2f} s (paged replay {report['paged_replay_wall_s']:.2f} s)")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    try:
        if args.rate is not None and not (args.rate > 0):
            raise ConfigError(f"--rate must be > 0, got {args.rate}")
        num_requests = args.num_requests
        if num_requests is None and not args.workload.startswith("trace:"):
            num_requests = 1000
        requests = build_workload(
            args.workload,
            num_requests=num_requests,
            max_model_len=args.max_model_len,
            rate=None if args.rate is None or math.isinf(args.rate) else args.rate,
            cv=args.cv,
            n=args.n,
            seed=args.seed,
            shuffle=args.shuffle,
            turn_interval_s=args.turn_interval,
            max_turns=args.max_turns,
            num_prefixes=args.num_prefixes,
            prefix_len=args.prefix_len,
            user_len=args.user_len,
            output_len=args.output_len,
            zipf_s=args.zipf,
        )
        report = simulate(
            requests,
            kv_memory=args.kv_memory,
            num_blocks=args.num_blocks,
            model_config=args.model_config,
            kv_dtype=args.kv_dtype,
            block_size=args.block_size,
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            enable_prefix_caching=not args.no_prefix_caching,
            watermark=args.watermark,
            step_duration_s=args.step_duration,
            baselines=not args.no_baselines,
            seed=args.seed,
            num_host_blocks=args.num_host_blocks,
            host_kv_memory=args.host_kv_memory,
            preemption_mode=args.preemption_mode,
            swap_bandwidth=args.swap_bandwidth,
            recompute_throughput=args.recompute_throughput,
        )
    except PagedKVError as error:
        print(f"pagedkv simulate: error: {error}", file=sys.stderr)
        return 2
    report["workload"]["name"] = args.workload
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_report(report, breakdown=args.breakdown))
    return 0
