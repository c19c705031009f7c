"""The KV offload tier in the simulator: replay_paged with a host tier (swap / auto preemption,
write-backs and host prefix hits, the copy-time step model), retention priorities carried by
requests, and the `pagedkv simulate` flags."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import numpy as np
import pytest

from pagedkv.cli import main
from pagedkv.errors import ConfigError, InvalidArgumentError, TraceFormatError
from pagedkv.sim.kv_budget import DEFAULT_SWAP_BYTES_PER_SECOND, parse_bandwidth
from pagedkv.sim.replay import PagedConfig, allocator_metrics, replay_paged
from pagedkv.sim.simulate import simulate
from pagedkv.sim.workloads import ArrivalProcess, TraceRequest, shared_prefix_requests
from pagedkv.sim.workloads.trace_io import parse_trace_lines, trace_line

BYTES_PER_BLOCK = 1000
BANDWIDTH = 1e6  # 1 ms per block copied: copy time is visible on the simulated clock


def _workload(num_requests: int = 40) -> list[TraceRequest]:
    return shared_prefix_requests(
        num_requests,
        num_prefixes=3,
        prefix_len=48,
        user_len=(4, 40),
        output_len=(4, 60),
        seed=0,
        arrivals=ArrivalProcess(rate=25.0),
    )


def _config(**kwargs: object) -> PagedConfig:
    # 20 blocks of 16 for prompts of 52..88 tokens growing by up to 60: preemptions.
    base: dict[str, object] = {
        "num_blocks": 20,
        "block_size": 16,
        "max_model_len": 256,
        "bytes_per_block": BYTES_PER_BLOCK,
        "swap_bytes_per_second": BANDWIDTH,
    }
    base.update(kwargs)
    return PagedConfig(**base)  # type: ignore[arg-type]


def test_no_tier_has_no_copies_and_the_old_clock() -> None:
    result = replay_paged(_workload(), _config())
    assert result.num_preemptions > 0
    assert result.copy_time_s == 0.0
    assert result.num_host_blocks == 0 and result.blocks_swapped_out == result.blocks_swapped_in == 0
    assert result.num_swap_preemptions == result.prefix_cache_host_hits == result.num_write_backs == 0
    assert result.mean_host_used_blocks == result.mean_host_cached_blocks == 0
    # Without copies the clock is k * step_duration_s exactly (every request arrives before the
    # pool drains, so no step is skipped).
    assert result.makespan_s == pytest.approx(result.total_steps * 0.02)
    metrics = allocator_metrics(result)
    assert metrics["copy_time_s"] is None and metrics["swap_preemptions"] is None
    assert metrics["tokens_computed"] == result.tokens_computed


@pytest.mark.parametrize(("mode", "host"), [("recompute", 64), ("swap", 64), ("auto", 64), ("swap", 4)])
def test_host_tier_finishes_the_same_work(mode: str, host: int) -> None:
    requests = _workload()
    plain = replay_paged(requests, _config())
    tiered = replay_paged(requests, _config(num_host_blocks=host, preemption_mode=mode))
    assert (
        (tiered.num_finished, tiered.generated_tokens)
        == (plain.num_finished, plain.generated_tokens)
        == (
            len(requests),
            sum(r.output_len for r in requests),
        )
    )
    # Blocks come back from the host instead of being recomputed.
    assert tiered.tokens_computed < plain.tokens_computed
    assert tiered.blocks_swapped_out > 0
    assert tiered.bytes_swapped_out == tiered.blocks_swapped_out * BYTES_PER_BLOCK
    assert tiered.bytes_swapped_in == tiered.blocks_swapped_in * BYTES_PER_BLOCK
    # The step model: every block copied adds bytes_per_block / bandwidth to its step.
    copies = tiered.blocks_swapped_out + tiered.blocks_swapped_in
    assert tiered.copy_time_s == pytest.approx(copies * BYTES_PER_BLOCK / BANDWIDTH)
    assert tiered.makespan_s == pytest.approx(tiered.total_steps * 0.02 + tiered.copy_time_s)
    assert 0 <= tiered.num_swap_preemptions <= tiered.num_preemptions
    assert tiered.peak_host_used_blocks <= host
    metrics = allocator_metrics(tiered)
    assert metrics["copy_time_s"] == tiered.copy_time_s
    assert metrics["blocks_swapped_out"] == tiered.blocks_swapped_out


def test_swap_mode_swaps_and_recompute_mode_writes_back() -> None:
    requests = _workload()
    swap = replay_paged(requests, _config(num_host_blocks=64, preemption_mode="swap"))
    assert swap.num_swap_preemptions == swap.num_preemptions > 0
    recompute = replay_paged(requests, _config(num_host_blocks=64))
    assert recompute.num_swap_preemptions == 0
    # Evicted cached blocks go to the host and later prompts find them there.
    assert recompute.num_write_backs > 0 and recompute.prefix_cache_host_hits > 0
    assert recompute.prefix_cache_host_hit_rate <= recompute.prefix_cache_hit_rate
    # A host tier too small for every victim: some swap, the rest recompute.
    small = replay_paged(requests, _config(num_host_blocks=4, preemption_mode="swap"))
    assert 0 < small.num_swap_preemptions < small.num_preemptions


def test_auto_follows_the_cost_model() -> None:
    requests = _workload()
    # Copies nearly free against a slow recompute: auto swaps every victim; the reverse never.
    cheap = replay_paged(requests, _config(num_host_blocks=64, preemption_mode="auto", recompute_tokens_per_second=1.0))
    assert cheap.num_swap_preemptions == cheap.num_preemptions > 0
    dear = replay_paged(requests, _config(num_host_blocks=64, preemption_mode="auto", recompute_tokens_per_second=1e12))
    assert dear.num_swap_preemptions == 0
    # The default recompute throughput is the step model's full-budget rate.
    assert _config().recompute_throughput == pytest.approx(8192 / 0.02)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_host_blocks": -1}, "num_host_blocks must be an integer >= 0"),
        ({"num_host_blocks": 1.5}, "num_host_blocks must be an integer >= 0"),
        ({"num_host_blocks": 8, "preemption_mode": "lru"}, "preemption_mode 'lru' is not known"),
        ({"preemption_mode": "swap"}, "needs a host tier"),
        ({"bytes_per_block": -5}, "bytes_per_block must be an integer >= 0"),
        ({"swap_bytes_per_second": 0.0}, "swap_bytes_per_second must be a positive finite number"),
        ({"recompute_tokens_per_second": float("inf")}, "recompute_tokens_per_second must be"),
    ],
)
def test_paged_config_refuses_bad_tier_settings(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _config(**kwargs)


def test_retention_fields_reach_the_scheduler_and_traces() -> None:
    request = TraceRequest("a", 0.0, np.arange(40), 4, retention_priority=80, retention_duration=2.5)
    assert (request.retention_priority, request.retention_duration) == (80, 2.5)
    assert parse_trace_lines([trace_line(request)]) == [request]
    with pytest.raises(InvalidArgumentError, match="retention_priority"):
        TraceRequest("b", 0.0, np.arange(4), 1, retention_priority=101)
    with pytest.raises(TraceFormatError, match="field 'retention_duration'"):
        parse_trace_lines(['{"arrival_time": 0, "prompt_len": 5, "output_len": 1, "retention_duration": -1}'])
    # Three prompts compete for a cache that holds about one: the prioritized one's requests keep
    # their prefix cached between uses (the others are evicted first).
    prompts = {name: np.arange(64) + 1000 * i for i, name in enumerate("xyz")}
    requests = [
        TraceRequest(f"q{i}", 0.5 * i, np.concatenate([prompts["xyz"[i % 3]], [5000 + i]]), 2) for i in range(30)
    ]
    config = PagedConfig(num_blocks=10, block_size=16, max_model_len=96, max_num_seqs=1)
    plain = replay_paged(requests, config, record_cached_tokens=True)
    x_ids = [r.request_id for i, r in enumerate(requests) if i % 3 == 0]
    boosted = [dataclasses.replace(r, retention_priority=90) if r.request_id in x_ids else r for r in requests]
    favoured = replay_paged(boosted, config, record_cached_tokens=True)
    assert plain.request_cached_tokens is not None and favoured.request_cached_tokens is not None
    assert sum(favoured.request_cached_tokens[i] for i in x_ids) > sum(plain.request_cached_tokens[i] for i in x_ids)


def test_retention_tokens_field_and_trace_round_trip() -> None:
    request = TraceRequest("a", 0.0, np.arange(40), 4, retention_priority=80, retention_tokens=32)
    assert request.retention_tokens == 32 and "retention_tokens=32" in repr(request)
    assert parse_trace_lines([trace_line(request)]) == [request]
    assert request != dataclasses.replace(request, retention_tokens=None)
    assert "retention_tokens" not in trace_line(dataclasses.replace(request, retention_tokens=None))
    # Any count >= 0 (more than the prompt: the whole prompt), from JSON as from Python.
    line = '{"arrival_time": 0, "prompt_len": 5, "output_len": 1, "retention_tokens": 0}'
    assert parse_trace_lines([line])[0].retention_tokens == 0
    assert TraceRequest("b", 0.0, np.arange(4), 1, retention_tokens=np.int64(100)).retention_tokens == 100
    for bad in (-1, 2.5, True, "8"):
        with pytest.raises(InvalidArgumentError, match="field 'retention_tokens'"):
            TraceRequest("b", 0.0, np.arange(4), 1, retention_tokens=bad)
    with pytest.raises(TraceFormatError, match=r"<trace>:1: field 'retention_tokens': must be an integer >= 0"):
        parse_trace_lines(['{"arrival_time": 0, "prompt_len": 5, "output_len": 1, "retention_tokens": -3}'])


SYSTEM = np.arange(64) + 1  # 4 blocks of 16: a "system prompt"


def _retention_scenario(
    scale: float,
    again_at: float,
    *,
    priority: int | None = 90,
    duration: float | None = 1.0,
    retention_tokens: int | None = None,
    sleep_s: float = 0.0,
) -> int:
    """Prompt tokens the request "again" finds cached. "keep" (SYSTEM + one token, at t = 0,
    retention ``priority`` for ``duration`` s) is done by 0.04 s; then unique 80-token prompts
    arrive every 0.1 s until just before ``again_at`` and thrash the 12-block pool (one
    sequence at a time); "again" (SYSTEM + another token) arrives at ``again_at``. Every time,
    the step and the duration are multiplied by ``scale``; ``on_step`` sleeps ``sleep_s`` of
    wall time per step."""
    kept = TraceRequest(
        "keep",
        0.0,
        np.append(SYSTEM, 9000),
        2,
        retention_priority=priority,
        retention_duration=None if duration is None else duration * scale,
        retention_tokens=retention_tokens,
    )
    requests = [kept]
    for i in range(int(round((again_at - 0.05) / 0.1))):
        requests.append(TraceRequest(f"churn-{i}", (0.05 + 0.1 * i) * scale, np.arange(80) + 10_000 * (i + 1), 2))
    requests.append(TraceRequest("again", again_at * scale, np.append(SYSTEM, 9001), 2))
    config = PagedConfig(num_blocks=12, block_size=16, max_model_len=128, max_num_seqs=1, step_duration_s=0.02 * scale)
    result = replay_paged(
        requests,
        config,
        record_cached_tokens=True,
        on_step=(lambda *_: time.sleep(sleep_s)) if sleep_s else None,
    )
    assert result.num_finished == len(requests) and result.num_preemptions == 0
    assert result.request_cached_tokens is not None
    return result.request_cached_tokens["again"]


@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e3])
def test_retention_duration_runs_on_the_simulated_clock(scale: float) -> None:
    # The pool thrashes: without a priority the prompt is gone by the time "again" comes back.
    assert _retention_scenario(scale, 0.95, priority=None, duration=None) == 0
    # Priority 90 for 1 s (simulated, counted from the release at 0.02 s): kept for a hit at
    # 0.95 s, lost at 1.25 s (it fell back to the default and the churn evicted it), whether
    # the simulated clock runs a thousand times faster or slower than the replay itself.
    assert _retention_scenario(scale, 0.95) == 64
    assert _retention_scenario(scale, 1.25) == 0
    # Without a duration the priority holds for good.
    assert _retention_scenario(scale, 2.05, duration=None) == 64
    # Wall time does not count: 2 ms of real time per step (more than the whole duration at
    # scale 1e-3) changes nothing.
    assert _retention_scenario(scale, 0.95, sleep_s=0.002) == 64


def test_retention_tokens_protects_only_the_leading_blocks() -> None:
    # The whole prompt of "keep" is SYSTEM + 1 token: 4 full blocks. With retention_tokens = 40
    # the priority covers the 2 full blocks within the first 40 tokens; the other two keep the
    # default priority and go with the churn.
    assert _retention_scenario(1.0, 0.95, duration=None, retention_tokens=64) == 64
    assert _retention_scenario(1.0, 0.95, duration=None, retention_tokens=40) == 32
    assert _retention_scenario(1.0, 0.95, duration=None, retention_tokens=0) == 0
    assert _retention_scenario(1.0, 0.95, duration=None, retention_tokens=10**6) == 64


def test_simulate_host_budget_in_bytes(tmp_path: Path) -> None:
    config = {"num_hidden_layers": 2, "num_key_value_heads": 2, "head_dim": 8, "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    per_block = 2 * 2 * 2 * 8 * 2 * 16  # 2048 bytes per block of 16 tokens
    report = simulate(
        _workload(),
        num_blocks=20,
        model_config=str(tmp_path),
        max_model_len=256,
        host_kv_memory=64 * per_block + 100,
        preemption_mode="swap",
        swap_bandwidth="2GB/s",
        baselines=False,
    )
    tiers = report["tiers"]
    assert tiers["num_host_blocks"] == 64 and tiers["bytes_per_block"] == per_block
    assert tiers["swap_bytes_per_second"] == 2e9 and tiers["host_kv_bytes"] == 64 * per_block
    paged = report["allocators"]["paged"]
    assert paged["swap_preemptions"] == paged["preemptions"] > 0
    assert paged["bytes_swapped_out"] == paged["blocks_swapped_out"] * per_block
    assert paged["copy_time_s"] == pytest.approx(
        (paged["blocks_swapped_out"] + paged["blocks_swapped_in"]) * per_block / 2e9
    )
    assert parse_bandwidth("25GB/s") == parse_bandwidth(25e9) == DEFAULT_SWAP_BYTES_PER_SECOND
    assert parse_bandwidth("1GiB") == 2**30
    with pytest.raises(ConfigError, match="not both"):
        simulate(_workload(), num_blocks=20, max_model_len=256, num_host_blocks=4, host_kv_memory="1GiB")


# --- the command line ---------------------------------------------------------------------

SHARED = [
    "simulate",
    "--workload",
    "shared-prefix",
    "--num-requests",
    "40",
    "--num-prefixes",
    "3",
    "--prefix-len",
    "48",
    "--user-len",
    "4:40",
    "--output-len",
    "4:60",
    "--rate",
    "25",
    "--block-size",
    "16",
    "--max-model-len",
    "256",
    "--no-baselines",
]


def _model_config(tmp_path: Path) -> str:
    config = {"num_hidden_layers": 2, "num_key_value_heads": 2, "head_dim": 8, "torch_dtype": "float16"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return str(tmp_path)


def test_cli_tier_flags_json_and_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = _model_config(tmp_path)
    args = [*SHARED, "--model-config", model, "--num-blocks", "20", "--num-host-blocks", "64"]
    args += ["--preemption-mode", "swap", "--swap-bandwidth", "1e6", "--recompute-throughput", "5000"]
    assert main([*args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["tiers"]["num_host_blocks"] == 64 and report["tiers"]["preemption_mode"] == "swap"
    assert report["tiers"]["swap_bytes_per_second"] == 1e6
    assert report["tiers"]["recompute_tokens_per_second"] == 5000
    paged = report["allocators"]["paged"]
    assert paged["num_finished"] == 40 and paged["swap_preemptions"] == paged["preemptions"] > 0
    assert paged["copy_time_s"] > 0
    assert main(args) == 0
    table = capsys.readouterr().out
    assert "host tier: 64 blocks" in table and "swap preemptions (of preemptions)" in table
    assert "copy time (s, in simulated time)" in table and "GiB copied device -> host" in table
    # Without a tier the table has no tier rows, and the JSON says so.
    plain = [*SHARED, "--num-blocks", "20"]
    assert main(plain) == 0
    assert "host tier" not in capsys.readouterr().out
    assert main([*plain, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["tiers"]["num_host_blocks"] == 0 and report["allocators"]["paged"]["copy_time_s"] is None


def test_cli_host_kv_memory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = _model_config(tmp_path)
    per_block = 2 * 2 * 2 * 8 * 2 * 16
    code = main(
        [*SHARED, "--model-config", model, "--num-blocks", "20", "--host-kv-memory", str(10 * per_block), "--json"]
    )
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["tiers"]["num_host_blocks"] == 10
    assert report["allocators"]["paged"]["write_backs"] > 0


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--num-host-blocks", "-1"], "num_host_blocks must be an integer >= 0"),
        (["--host-kv-memory=-1GiB"], "host_kv_memory '-1GiB' is not a size"),
        (["--host-kv-memory", "100"], "host_kv_memory = 100 bytes is smaller than one block"),
        (["--num-host-blocks", "8", "--preemption-mode", "lru"], "preemption_mode 'lru' is not known"),
        (["--preemption-mode", "swap"], "needs a host tier"),
        (["--num-host-blocks", "8", "--swap-bandwidth", "0"], "swap_bandwidth '0' must be at least 1 byte"),
        (["--num-host-blocks", "8", "--swap-bandwidth", "fast"], "swap_bandwidth 'fast' is not a size"),
        (["--num-host-blocks", "8", "--recompute-throughput", "-3"], "recompute_throughput must be a positive"),
    ],
)
def test_cli_tier_errors_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    code = main([*SHARED, "--model-config", _model_config(tmp_path), "--num-blocks", "20", *extra])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("pagedkv simulate: error:") and message in err


def test_cli_host_flags_are_exclusive(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([*SHARED, "--num-blocks", "20", "--num-host-blocks", "8", "--host-kv-memory", "1GiB"])
    assert exit_info.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err
