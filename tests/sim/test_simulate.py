"""replay_paged accounting on hand-made cases, sharing savings by block arithmetic, and the
`pagedkv simulate` command line end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from studies.parallel_sampling import independent_copies, predicted_block_steps, with_samples

from pagedkv.cli import main
from pagedkv.errors import ConfigError
from pagedkv.sim.replay import PagedConfig, allocator_metrics, compare_allocators, replay_paged
from pagedkv.sim.workloads import TraceRequest

REPO = Path(__file__).resolve().parents[2]


def _three_requests() -> list[TraceRequest]:
    # Prompts of 10 distinct tokens (no prefix sharing), outputs of 5, 6 and 7 tokens.
    return [TraceRequest(f"r{i}", 0.0, np.arange(10) + 100 * i, output_len=5 + i) for i in range(3)]


def test_replay_paged_accounting_by_hand() -> None:
    # Block size 4, 32 blocks = 128 slots. Step 0 prefills all three prompts (10 tokens each,
    # 3 blocks each) and samples their first tokens; decode step k then holds 10 + k computed
    # tokens per live request (a sampled token gets its slot in the next step). Request i
    # lives for steps 0 .. 4 + i.
    config = PagedConfig(num_blocks=32, block_size=4, max_model_len=32, enable_prefix_caching=False)
    result = replay_paged(_three_requests(), config, record_steps=True)
    live = [3, 3, 3, 3, 3, 2, 1]
    held = [30, 33, 36, 39, 42, 30, 16]  # sum of 10 + k over live requests
    slots = [36, 36, 36, 48, 48, 32, 16]  # 4 x sum of ceil((10 + k) / 4)
    assert result.total_steps == 7
    assert [s.token_states for s in result.steps] == held
    assert [s.internal_fragmentation for s in result.steps] == [a - h for a, h in zip(slots, held)]
    assert [s.free for s in result.steps] == [128 - a for a in slots]
    assert all(s.reserved_unused == 0 and s.external_fragmentation == 0 for s in result.steps)
    assert [s.num_running for s in result.steps] == live
    # At the end: request r2 alone, 16 tokens in 4 full blocks, no internal fragmentation.
    assert (result.steps[-1].token_states, result.steps[-1].internal_fragmentation) == (16, 0)
    assert result.kv_utilization == pytest.approx(226 / 252)
    assert result.mean_running == pytest.approx(18 / 7)
    assert result.peak_running == 3
    assert result.peak_blocks_in_use == 12
    assert result.block_steps == 252 // 4
    assert result.mean_blocks_in_use == pytest.approx(63 / 7)
    assert result.mean_fraction["token_states"] == pytest.approx(226 / (7 * 128))
    assert result.mean_fraction["internal_fragmentation"] == pytest.approx(26 / (7 * 128))
    assert (result.num_finished, result.generated_tokens, result.num_preemptions) == (3, 18, 0)
    assert result.tokens_computed == 30 + 3 + 3 + 3 + 3 + 2 + 1


def test_compare_allocators_same_memory_and_metrics() -> None:
    config = PagedConfig(num_blocks=32, block_size=4, max_model_len=32)
    comparison = compare_allocators(_three_requests(), config)
    assert set(comparison.baselines) == {"max_length", "exact"} and comparison.skipped == {}
    assert all(r.num_slots == 128 for r in comparison.baselines.values())
    metrics = comparison.metrics()
    assert list(metrics) == ["paged", "max_length", "exact"]
    paged, max_length = metrics["paged"], metrics["max_length"]
    assert paged["kv_utilization"] == pytest.approx(226 / 252)
    # Reservation holds 32 slots per sequence; the baselines count the sampled token as held.
    result = comparison.baselines["max_length"]
    f = result.mean_fraction
    assert max_length["kv_utilization"] == pytest.approx(
        f["token_states"] / (f["token_states"] + f["reserved_unused"] + f["internal_fragmentation"])
    )
    assert max_length["preemptions"] is None and max_length["prefix_cache_hit_rate"] is None
    assert allocator_metrics(comparison.paged)["steps"] == 7
    for m in metrics.values():
        assert sum(m["breakdown"].values()) == pytest.approx(1.0)


def test_compare_allocators_skips_a_baseline_that_cannot_hold_a_request() -> None:
    # 4 samples of a max-length (32-slot) region need 128 slots; the arena has 64.
    requests = [TraceRequest("a", 0.0, np.arange(6), output_len=8, n=4)]
    comparison = compare_allocators(requests, PagedConfig(num_blocks=16, block_size=4, max_model_len=32))
    assert "max_length" in comparison.skipped and "exact" in comparison.baselines
    assert comparison.paged.num_finished == 1 and comparison.paged.generated_tokens == 32
    with pytest.raises(ConfigError, match="unknown baseline"):
        compare_allocators(requests, PagedConfig(num_blocks=16, block_size=4, max_model_len=32), baselines=["pow2"])


@pytest.mark.parametrize(
    ("prompt_len", "output_len", "forked", "independent"),
    [
        # P = 10, B = 4: 2 shared full prompt blocks; the partial third is copied on write.
        # Prefill 3 blocks; decodes hold 11..15 tokens -> 3,3,4,4,4 blocks per sample.
        (10, 6, 3 + (2 + 2 * 1) * 2 + (2 + 2 * 2) * 3, 2 * (3 + 3 + 3 + 4 + 4 + 4)),
        # P = 8: both prompt blocks full and shared, nothing to copy. Decodes hold 9..12 tokens.
        (8, 5, 2 + (2 + 2 * 1) * 4, 2 * (2 + 3 * 4)),
    ],
)
def test_parallel_sampling_n2_saving_matches_block_arithmetic(
    prompt_len: int, output_len: int, forked: int, independent: int
) -> None:
    requests = [TraceRequest("a", 0.0, np.arange(prompt_len), output_len=output_len)]
    config = PagedConfig(num_blocks=64, block_size=4, max_model_len=64, enable_prefix_caching=False)
    shared = replay_paged(with_samples(requests, 2), config)
    separate = replay_paged(independent_copies(requests, 2), config)
    assert (shared.block_steps, separate.block_steps) == (forked, independent)
    assert predicted_block_steps(requests, 2, 4, 64, shared=True) == forked
    assert predicted_block_steps(requests, 2, 4, 64, shared=False) == independent
    assert shared.total_steps == separate.total_steps == output_len
    assert shared.generated_tokens == separate.generated_tokens == 2 * output_len


def test_parallel_sampling_many_requests_match_block_arithmetic() -> None:
    # With every prompt prefilled in its first step and no preemption, the real scheduler's
    # block-steps equal the arithmetic for any lengths and n.
    rng = np.random.default_rng(3)
    requests = [
        TraceRequest(
            f"q{i}",
            float(i) * 0.1,
            rng.integers(0, 5000, size=int(rng.integers(1, 60))),
            output_len=int(rng.integers(1, 80)),
        )
        for i in range(25)
    ]
    config = PagedConfig(
        num_blocks=25 * 6 * 9,
        block_size=16,
        max_model_len=140,
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        enable_prefix_caching=False,
    )
    for n in (2, 3):
        shared = replay_paged(with_samples(requests, n), config)
        separate = replay_paged(independent_copies(requests, n), config)
        assert shared.num_preemptions == separate.num_preemptions == 0
        assert shared.block_steps == predicted_block_steps(requests, n, 16, 140, shared=True)
        assert separate.block_steps == predicted_block_steps(requests, n, 16, 140, shared=False)
        assert shared.block_steps < separate.block_steps


# --- the command line ---------------------------------------------------------------------

TRACE_LINES = [
    {"arrival_time": 0.0, "prompt_len": 12, "output_len": 6},
    {"arrival_time": 0.0, "prompt_len": 9, "output_len": 4, "shared_prefix_id": "sys", "shared_prefix_len": 8},
    {"arrival_time": 0.1, "prompt_len": 20, "output_len": 5, "shared_prefix_id": "sys", "shared_prefix_len": 8},
    {"arrival_time": 0.5, "prompt_len": 7, "output_len": 9, "n": 2},
]


def _write_trace(path: Path, lines: list[dict]) -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "python"), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-m", "pagedkv", "simulate", *args], capture_output=True, text=True, env=env, timeout=120
    )


def test_cli_end_to_end_json(tmp_path: Path) -> None:
    trace = _write_trace(tmp_path / "trace.jsonl", TRACE_LINES)
    proc = _run_cli(
        f"--workload=trace:{trace}",
        "--num-blocks",
        "40",
        "--block-size",
        "4",
        "--max-model-len",
        "64",
        "--breakdown",
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["workload"]["num_requests"] == 4 and report["workload"]["num_sequences"] == 5
    assert report["kv"] == {"num_blocks": 40, "block_size": 4, "num_slots": 160}
    assert list(report["allocators"]) == ["paged", "max_length", "exact"]
    paged = report["allocators"]["paged"]
    for key in (
        "peak_concurrent",
        "mean_concurrent",
        "kv_utilization",
        "preemptions",
        "prefix_cache_hit_rate",
        "steps",
        "breakdown",
    ):
        assert key in paged
    assert paged["num_finished"] == 4
    assert paged["generated_tokens"] == 6 + 4 + 5 + 2 * 9
    assert 0 < paged["kv_utilization"] <= 1
    # Request 2 reuses the 8-token shared prefix of request 1: two full blocks of 4.
    assert paged["prefill_tokens_saved"] == 8
    assert paged["prefix_cache_hit_rate"] == pytest.approx(8 / (12 + 9 + 20 + 7))
    assert report["allocators"]["max_length"]["preemptions"] is None
    assert sum(paged["breakdown"].values()) == pytest.approx(1.0)


def test_cli_kv_memory_with_model_config_and_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = _write_trace(tmp_path / "trace.jsonl", TRACE_LINES)
    config = {
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "torch_dtype": "bfloat16",
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    per_token = 2 * 2 * 2 * 8 * 2  # 128 bytes
    budget = 37 * 4 * per_token + 100  # 37 blocks of 4 tokens and change
    args = [
        "simulate",
        f"--workload=trace:{trace}",
        "--kv-memory",
        str(budget),
        "--model-config",
        str(tmp_path),
        "--block-size",
        "4",
        "--max-model-len",
        "64",
        "--no-prefix-caching",
    ]
    assert main([*args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["kv"]["bytes_per_token"] == per_token
    assert report["kv"]["num_blocks"] == 37
    assert report["kv"]["kv_bytes"] == 37 * 4 * per_token
    assert report["allocators"]["paged"]["prefill_tokens_saved"] == 0
    assert main([*args, "--breakdown"]) == 0
    table = capsys.readouterr().out
    assert "pagedkv (paged)" in table and "reserve max_model_len" in table and "external fragmentation" in table
    assert "128 B/token" in table


def test_cli_bad_trace_line_exits_2_naming_the_line(tmp_path: Path) -> None:
    lines = [json.dumps(TRACE_LINES[0]), '{"arrival_time": 0.1, "prompt_len": 5, "output_len": 0}']
    trace = tmp_path / "bad.jsonl"
    trace.write_text("\n".join(lines) + "\n")
    proc = _run_cli(f"--workload=trace:{trace}", "--num-blocks", "40", "--block-size", "4", "--max-model-len", "64")
    assert proc.returncode == 2
    assert f"{trace}:2: field 'output_len'" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--kv-memory", "100"], "kv_memory = 100 bytes is smaller than one block"),
        (["--kv-memory", "lots"], "kv_memory 'lots' is not a size"),
        (["--num-blocks", "0"], "num_blocks must be >= 1"),
        (["--num-blocks", "8"], "fewer than max_model_len"),
        (["--num-blocks", "40", "--max-num-seqs", "-1"], "max_num_seqs must be >= 1"),
        (["--num-blocks", "40", "--kv-dtype", "int3"], "kv_dtype 'int3'"),
        (["--num-blocks", "40", "--n", "0"], "n must be >= 1"),
        (["--num-blocks", "40", "--rate", "-2"], "--rate must be > 0"),
        (["--num-blocks", "40", "--watermark", "1.5"], "watermark must be in"),
    ],
)
def test_cli_config_errors_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    trace = _write_trace(tmp_path / "trace.jsonl", TRACE_LINES)
    config = {"num_hidden_layers": 2, "num_key_value_heads": 2, "head_dim": 8, "torch_dtype": "float16"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    code = main(
        [
            "simulate",
            f"--workload=trace:{trace}",
            "--model-config",
            str(tmp_path),
            "--block-size",
            "4",
            "--max-model-len",
            "64",
            *extra,
        ]
    )
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith("pagedkv simulate: error:") and message in err


def test_cli_model_config_missing_field_and_unknown_workload(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = _write_trace(tmp_path / "trace.jsonl", TRACE_LINES)
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 4, "head_dim": 8}))
    assert main(["simulate", f"--workload=trace:{trace}", "--model-config", str(tmp_path)]) == 2
    assert "field 'num_hidden_layers'" in capsys.readouterr().err
    assert main(["simulate", "--workload", "alpaca", "--num-blocks", "200"]) == 2
    assert "unknown workload 'alpaca'" in capsys.readouterr().err
    assert main(["simulate", f"--workload=trace:{tmp_path / 'nope.jsonl'}", "--num-blocks", "200"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_cli_shared_prefix_workload_with_arrivals(capsys: pytest.CaptureFixture[str]) -> None:
    # Synthetic tokens: no tokenizer needed. --n forks every request.
    code = main(
        [
            "simulate",
            "--workload",
            "shared-prefix",
            "--num-requests",
            "30",
            "--num-prefixes",
            "2",
            "--prefix-len",
            "32",
            "--user-len",
            "4:16",
            "--output-len",
            "8",
            "--rate",
            "50",
            "--n",
            "2",
            "--num-blocks",
            "64",
            "--block-size",
            "8",
            "--max-model-len",
            "128",
            "--json",
        ]
    )
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["workload"]["num_sequences"] == 60 and report["workload"]["last_arrival_s"] > 0
    paged = report["allocators"]["paged"]
    assert paged["num_finished"] == 30 and paged["generated_tokens"] == 60 * 8
    assert paged["prefix_cache_hit_rate"] > 0.3  # 28 of 30 requests reuse a 32-token system prompt
