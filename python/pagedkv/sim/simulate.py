"""The ``simulate`` library function: replay a named workload under one KV budget, paged and
against contiguous reservation, and return the report that ``pagedkv simulate --json`` prints.

    from pagedkv.sim.simulate import build_workload, simulate
    report = simulate(build_workload("sharegpt", num_requests=500, max_model_len=2048), kv_memory="2GiB")

A KV budget in bytes is turned into blocks with the model's KV bytes per token
(:mod:`pagedkv.sim.kv_budget`); the replay itself is :mod:`pagedkv.sim.replay`.

A KV offload tier in host memory is added with ``num_host_blocks`` or ``host_kv_memory``
(bytes, or a size string); ``preemption_mode`` picks recompute / swap / auto, and the copies
between the tiers cost ``bytes_per_block / swap_bandwidth`` simulated seconds each (the step
model of :mod:`pagedkv.sim.replay`). A host tier needs the model's bytes per block, so it
loads the model's geometry (default: the embedded SmolLM2) even with ``num_blocks``.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from typing import Any

from pagedkv.config import KVGeometry
from pagedkv.errors import ConfigError
from pagedkv.sim.kv_budget import (
    DEFAULT_SWAP_BYTES_PER_SECOND,
    load_kv_geometry,
    num_blocks_for_budget,
    parse_bandwidth,
    parse_bytes,
)
from pagedkv.sim.workloads.arrivals import ArrivalProcess, assign_arrivals
from pagedkv.sim.workloads.request import TraceRequest

__all__ = ["DEFAULT_KV_MEMORY", "WORKLOADS", "build_workload", "simulate"]

DEFAULT_KV_MEMORY = "1GiB"
WORKLOADS = ("sharegpt", "sharegpt-multiturn", "shared-prefix", "trace:PATH")


def _check_positive(name: str, value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or value < 1):
        raise ConfigError(f"{name} must be >= 1, got {value}")


def build_workload(
    workload: str,
    *,
    num_requests: int | None,
    max_model_len: int,
    rate: float | None = None,
    cv: float = 1.0,
    n: int | None = None,
    seed: int = 0,
    shuffle: bool = False,
    turn_interval_s: float = 30.0,
    max_turns: int | None = None,
    num_prefixes: int = 8,
    prefix_len: int = 512,
    user_len: int | tuple[int, int] = (16, 256),
    output_len: int | tuple[int, int] = (16, 512),
    zipf_s: float = 1.0,
) -> list[TraceRequest]:
    """The requests of a named workload (see ``pagedkv simulate --help``), in arrival order.

    ``num_requests`` None means all (ShareGPT: every usable conversation; a trace: every line).
    ``rate`` None keeps every request at t = 0, or a trace's own times.
    """
    _check_positive("num_requests", num_requests)
    _check_positive("n", n)
    arrivals = None if rate is None else ArrivalProcess(rate=rate, cv=cv)
    shuffle_seed = seed if shuffle else None
    if workload == "sharegpt":
        from pagedkv.sim.workloads.sharegpt_requests import sharegpt_first_turn_requests

        requests = sharegpt_first_turn_requests(num_requests, max_model_len=max_model_len, shuffle_seed=shuffle_seed)
        if arrivals is not None:
            requests = assign_arrivals(requests, arrivals, seed=seed)
    elif workload == "sharegpt-multiturn":
        from pagedkv.sim.workloads.sharegpt_requests import sharegpt_multi_turn_requests

        # Each conversation has >= 1 turn: this many conversations give >= num_requests turns
        # (when the data has them); the turns arriving last are cut.
        requests = sharegpt_multi_turn_requests(
            num_requests,
            max_model_len=max_model_len,
            max_turns=max_turns,
            arrivals=arrivals,
            turn_interval_s=turn_interval_s,
            arrival_seed=seed,
            shuffle_seed=shuffle_seed,
        )[:num_requests]
    elif workload == "shared-prefix":
        from pagedkv.sim.workloads.shared_prefix import shared_prefix_requests

        requests = shared_prefix_requests(
            1000 if num_requests is None else num_requests,
            num_prefixes=num_prefixes,
            prefix_len=prefix_len,
            user_len=user_len,
            output_len=output_len,
            zipf_s=zipf_s,
            seed=seed,
            arrivals=arrivals,
        )
    elif workload.startswith("trace:"):
        from pagedkv.sim.workloads.trace_io import load_trace

        path = workload[len("trace:") :]
        if not path:
            raise ConfigError("workload 'trace:' needs a path, e.g. trace:requests.jsonl")
        try:
            requests = load_trace(path, seed=seed)
        except FileNotFoundError:
            raise ConfigError(f"trace file {path!r} does not exist") from None
        except (IsADirectoryError, PermissionError, UnicodeDecodeError) as error:
            raise ConfigError(f"trace file {path!r} cannot be read: {error}") from None
        if num_requests is not None:
            requests = requests[:num_requests]
        if arrivals is not None:
            requests = assign_arrivals(requests, arrivals, seed=seed)
    else:
        raise ConfigError(f"unknown workload {workload!r}; use one of {', '.join(WORKLOADS)}")
    if n is not None:
        requests = [dataclasses.replace(r, n=n) for r in requests]
    if not requests:
        raise ConfigError(f"workload {workload!r} has no requests")
    return requests


def _host_budget(host_kv_memory: int | str | None) -> int:
    """Bytes of a host-tier budget; 0 (or "0") means no host tier."""
    if host_kv_memory is None:
        return 0
    if isinstance(host_kv_memory, str):
        if host_kv_memory.strip() in {"0", "0B", "0b"}:
            return 0
        return parse_bytes(host_kv_memory, name="host_kv_memory")
    if isinstance(host_kv_memory, bool) or not isinstance(host_kv_memory, int) or host_kv_memory < 0:
        raise ConfigError(f"host_kv_memory must be a number of bytes >= 0, got {host_kv_memory!r}")
    return host_kv_memory


def simulate(
    requests: Sequence[TraceRequest],
    *,
    kv_memory: int | str | None = None,
    num_blocks: int | None = None,
    model_config: str | None = None,
    kv_dtype: str = "auto",
    block_size: int = 16,
    max_model_len: int = 2048,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 8192,
    enable_prefix_caching: bool = True,
    watermark: float = 0.01,
    step_duration_s: float = 0.02,
    baselines: bool = True,
    seed: int = 0,
    num_host_blocks: int | None = None,
    host_kv_memory: int | str | None = None,
    preemption_mode: str = "recompute",
    swap_bandwidth: float | str = DEFAULT_SWAP_BYTES_PER_SECOND,
    recompute_throughput: float | None = None,
) -> dict[str, Any]:
    """Replay ``requests`` under one KV budget and return the report ``--json`` prints.

    Give the budget as ``kv_memory`` (bytes, or a size string such as ``"8GiB"``; needs the
    model's geometry from ``model_config``, default the embedded SmolLM2) or ``num_blocks``.
    A host tier: ``num_host_blocks`` or ``host_kv_memory`` (bytes or a size string; 0 = none),
    ``preemption_mode`` ("recompute", "swap", "auto"), ``swap_bandwidth`` (bytes/s between
    the tiers, a number or e.g. ``"25GB/s"``), ``recompute_throughput`` (tokens/s of the
    ``auto`` cost model; None: ``max_num_batched_tokens / step_duration_s``). The baselines
    get the device memory only.
    """
    from pagedkv.sim.replay import PagedConfig, compare_allocators

    for name, value in (
        ("block_size", block_size),
        ("max_model_len", max_model_len),
        ("max_num_seqs", max_num_seqs),
        ("max_num_batched_tokens", max_num_batched_tokens),
        ("num_blocks", num_blocks),
    ):
        _check_positive(name, value)
    if kv_memory is not None and num_blocks is not None:
        raise ConfigError("give the KV budget as kv_memory or num_blocks, not both")
    if host_kv_memory is not None and num_host_blocks is not None:
        raise ConfigError("give the host tier as host_kv_memory or num_host_blocks, not both")
    if num_host_blocks is not None and (
        isinstance(num_host_blocks, bool) or not isinstance(num_host_blocks, int) or num_host_blocks < 0
    ):
        raise ConfigError(f"num_host_blocks must be an integer >= 0, got {num_host_blocks!r}")
    host_budget = _host_budget(host_kv_memory)
    swap_bytes_per_second = parse_bandwidth(swap_bandwidth)
    if recompute_throughput is not None and (
        isinstance(recompute_throughput, bool)
        or not isinstance(recompute_throughput, (int, float))
        or not (math.isfinite(recompute_throughput) and recompute_throughput > 0)
    ):
        raise ConfigError(f"recompute_throughput must be a positive number of tokens/s, got {recompute_throughput!r}")
    tiered = bool(num_host_blocks) or bool(host_budget)
    geometry: KVGeometry | None = None
    if num_blocks is None or model_config is not None or tiered:
        geometry = load_kv_geometry(model_config, kv_dtype=kv_dtype)
    if num_blocks is None:
        assert geometry is not None
        memory = kv_memory if kv_memory is not None else DEFAULT_KV_MEMORY
        budget = parse_bytes(memory, name="kv_memory") if isinstance(memory, str) else memory
        num_blocks = num_blocks_for_budget(budget, geometry, block_size, name="kv_memory")
    if host_budget:
        assert geometry is not None
        num_host_blocks = num_blocks_for_budget(host_budget, geometry, block_size, name="host_kv_memory")
    num_host_blocks = num_host_blocks or 0
    bytes_per_block = geometry.bytes_per_block(block_size) if geometry is not None else 0
    config = PagedConfig(
        num_blocks=num_blocks,
        block_size=block_size,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_prefix_caching=enable_prefix_caching,
        watermark=watermark,
        step_duration_s=step_duration_s,
        num_host_blocks=num_host_blocks,
        preemption_mode=preemption_mode,
        bytes_per_block=bytes_per_block,
        swap_bytes_per_second=swap_bytes_per_second,
        recompute_tokens_per_second=recompute_throughput,
    )
    started = time.perf_counter()
    comparison = compare_allocators(
        requests, config, baselines=() if not baselines else ("max_length", "exact"), seed=seed
    )
    wall = time.perf_counter() - started
    prompt_tokens = sum(r.prompt_len for r in requests)
    output_tokens = sum(r.output_len * r.n for r in requests)
    kv: dict[str, Any] = {
        "num_blocks": num_blocks,
        "block_size": block_size,
        "num_slots": config.num_slots,
    }
    if geometry is not None:
        kv.update(
            bytes_per_token=geometry.bytes_per_token,
            kv_bytes=num_blocks * geometry.bytes_per_block(block_size),
            model_config=geometry.source,
            num_layers=geometry.num_layers,
            num_kv_heads=geometry.num_kv_heads,
            head_dim=geometry.head_dim,
            kv_dtype=geometry.dtype,
            kv_scale_bytes=geometry.scale_bytes,
        )
    return {
        "workload": {
            "num_requests": len(requests),
            "num_sequences": sum(r.n for r in requests),
            "prompt_tokens": prompt_tokens,
            "output_tokens": output_tokens,
            "mean_prompt_len": prompt_tokens / len(requests),
            "mean_output_len": output_tokens / sum(r.n for r in requests),
            "last_arrival_s": max(r.arrival_time for r in requests),
        },
        "kv": kv,
        "config": {
            "max_model_len": max_model_len,
            "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": max_num_batched_tokens,
            "enable_prefix_caching": enable_prefix_caching,
            "watermark": watermark,
            "step_duration_s": step_duration_s,
        },
        "tiers": {
            "num_host_blocks": num_host_blocks,
            "host_kv_bytes": num_host_blocks * bytes_per_block if geometry is not None else None,
            "bytes_per_block": bytes_per_block if geometry is not None else None,
            "preemption_mode": preemption_mode,
            "swap_bytes_per_second": swap_bytes_per_second,
            "recompute_tokens_per_second": config.recompute_throughput,
            "copy_seconds_per_block": config.copy_seconds_per_block if geometry is not None else None,
        },
        "allocators": comparison.metrics(),
        "skipped": comparison.skipped,
        "paged_replay_wall_s": comparison.paged.wall_time_s,
        "wall_time_s": wall,
    }
