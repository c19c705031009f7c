"""The KV offload flags of `pagedkv generate` and `pagedkv demo`: parsing, the errors the CLI
prints for a bad combination, and small runs on a tiny KV pool with a host tier that swap
(on the tiny random model of tests/tiny_models.py: the tiers' bookkeeping is under test)."""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

import pytest

from pagedkv.cli import demo as demo_cli
from pagedkv.cli import generate as generate_cli
from pagedkv.cli import main

# The tiny random model's KV block in float32, block size 16: K and V x 2 layers x 16 tokens x
# 1 KV head x 64 dims x 4 bytes.
TINY_BLOCK_BYTES = 2 * 2 * 16 * 64 * 4
# 17 blocks, as 12 MiB holds of SmolLM2's (whose block is 45 times larger).
DEMO_KV = ["--max-prompt-tokens", "160", "--max-model-len", "256", "--kv-cache-memory", str(17 * TINY_BLOCK_BYTES)]


def parse(module: Any, argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"pagedkv {module.__name__.rsplit('.', 1)[1]}")
    module.add_arguments(p)
    return p.parse_args(argv)


# ---------------------------------------------------------------- parsing


def test_offload_flags_parse_into_engine_args() -> None:
    args = parse(
        generate_cli,
        [
            "--prompt",
            "x",
            "--host-kv-cache-memory",
            "1000000",
            "--preemption-mode",
            "auto",
            "--kv-cache-dir",
            "/tmp/kv",
            "--kv-cache-dir-max-bytes",
            "4096",
        ],
    )
    assert generate_cli.offload_engine_args(args) == {
        "preemption_mode": "auto",
        "host_kv_cache_memory": 1_000_000,
        "kv_cache_dir": "/tmp/kv",
        "kv_cache_dir_max_bytes": 4096,
    }
    # demo: the same unit (bytes) and suffixes as generate
    args = parse(demo_cli, ["--host-kv-cache-memory", "64MiB", "--preemption-mode", "swap"])
    assert generate_cli.offload_engine_args(args) == {
        "preemption_mode": "swap",
        "host_kv_cache_memory": 64 << 20,
    }
    args = parse(demo_cli, ["--num-host-blocks", "12"])
    assert generate_cli.offload_engine_args(args) == {"preemption_mode": "recompute", "num_host_blocks": 12}
    args = parse(generate_cli, ["--prompt", "x", "--swap-space", "0.5"])
    assert generate_cli.offload_engine_args(args) == {"preemption_mode": "recompute", "swap_space": 0.5}
    # no flags: only the default mode, which is EngineArgs' default
    assert generate_cli.offload_engine_args(parse(demo_cli, [])) == {"preemption_mode": "recompute"}


@pytest.mark.parametrize("command", ["generate", "demo"])
def test_bad_preemption_mode_is_rejected_by_argparse(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [command, "--preemption-mode", "never"] + (["--prompt", "x"] if command == "generate" else [])
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --preemption-mode: invalid choice: 'never'" in err


@pytest.mark.parametrize("command", ["generate", "demo"])
def test_swap_without_host_tier_prints_config_error(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [command, "--preemption-mode", "swap", "--device", "cpu"] + (
        ["--prompt", "x"] if command == "generate" else []
    )
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"pagedkv {command}: ConfigError: preemption_mode='swap' swaps KV to host memory")
    assert "there is no host tier" in err


def test_two_host_sizes_print_config_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--device", "cpu", "--num-host-blocks", "8", "--swap-space", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pagedkv demo: ConfigError: give the host tier size as one of")


# ---------------------------------------------------------------- runs


def _generate(
    model: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], extra: list[str]
) -> tuple:
    """`pagedkv generate --json` on 6 prompts in an 8-block pool; (outputs, engine stats)."""
    from pagedkv.engine import llm as llm_module

    engines: list[Any] = []
    original = llm_module.LLM.__init__

    def spy(self: Any, *a: Any, **kw: Any) -> None:
        original(self, *a, **kw)
        engines.append(self.llm_engine)

    monkeypatch.setattr(llm_module.LLM, "__init__", spy)
    prompts = [f"Write a story about the number {i}. Once upon a time" for i in range(6)]
    argv = ["generate", "--model", model, "--json", "--device", "cpu", "--dtype", "float32", "--temperature", "0"]
    argv += ["--ignore-eos", "--max-tokens", "24", "--max-model-len", "128"]
    argv += ["--kv-cache-memory", str(8 * TINY_BLOCK_BYTES)]
    for p in prompts:
        argv += ["--prompt", p]
    assert main(argv + extra) == 0, capsys.readouterr().err
    out = json.loads(capsys.readouterr().out)
    return [c["token_ids"] for o in out for c in o["completions"]], engines[-1].get_stats()


def test_generate_swaps_on_a_tiny_pool(
    tiny_model: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    swapped, st = _generate(tiny_model, monkeypatch, capsys, ["--num-host-blocks", "32", "--preemption-mode", "swap"])
    assert st["num_blocks"] == 8 and st["num_host_blocks"] == 32
    assert st["num_swap_preemptions"] > 0 and st["num_swap_preemptions"] == st["num_preemptions"]
    assert st["blocks_swapped_out"] > 0 and st["blocks_swapped_in"] > 0
    assert all(len(ids) == 24 for ids in swapped)
    recomputed, st = _generate(tiny_model, monkeypatch, capsys, [])
    assert st["num_preemptions"] > 0 and st["num_swap_preemptions"] == 0
    assert swapped == recomputed  # greedy: swapping back the KV changes no token


def test_demo_prints_the_tiers(tiny_model: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["demo", "--model", tiny_model, "--device", "cpu", "--num-prompts", "10", "--max-tokens", "16"]
    argv += [*DEMO_KV, "--show", "0"]
    assert main(argv + ["--num-host-blocks", "48", "--preemption-mode", "swap"]) == 0
    out = capsys.readouterr().out
    mib = f"{48 * TINY_BLOCK_BYTES / 2**20:.0f} MiB"
    assert re.search(rf"^host KV tier: 48 blocks = 768 token slots, {mib}; preemption mode swap", out, re.M), out
    m = re.search(r"^preemptions\s+(\d+): (\d+) swap, 0 recompute \(mode swap;", out, re.M)
    assert m and int(m.group(1)) == int(m.group(2)) > 0, out
    assert re.search(rf"^host tier\s+48 blocks in {mib}; usage peak \d+%", out, re.M)
    m = re.search(r"^swapped\s+out (\d+) blocks \([\d.]+ MiB\), in (\d+) blocks", out, re.M)
    assert m and int(m.group(1)) > 0 and int(m.group(2)) > 0, out
    for label in ("write-backs", "host prefix hits", "swap bandwidth"):
        assert re.search(rf"^{label}\s+\S", out, re.M), label
    assert re.search(r"^swap bandwidth\s+[\d.]+ GB/s", out, re.M)


def test_demo_without_a_tier_prints_no_tier_lines(tiny_model: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["demo", "--model", tiny_model, "--device", "cpu", "--num-prompts", "2", "--max-tokens", "4"]
    assert main(argv + [*DEMO_KV, "--show", "0"]) == 0
    out = capsys.readouterr().out
    summary = out.split("=== pagedkv demo ===", 1)[1].strip().splitlines()
    assert [line.split()[0] for line in summary] == [
        "requests",
        "throughput",
        "KV",
        "KV",
        "KV",
        "prefix",
        "preemptions",
    ]
    assert re.search(r"^preemptions\s+\d+ \(recompute; \d+ tokens re-read", out, re.M)
    assert "host" not in out and "swap" not in out


def test_demo_with_a_disk_tier_flushes_to_it(
    tiny_model: str, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "kv"
    argv = ["demo", "--model", tiny_model, "--device", "cpu", "--num-prompts", "4", "--max-tokens", "8"]
    argv += [*DEMO_KV, "--show", "0", "--num-host-blocks", "16"]
    argv += ["--kv-cache-dir", str(folder), "--kv-cache-dir-max-bytes", str(64 << 20)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert re.search(
        rf"^disk tier\s+{re.escape(str(folder))} \(at most 67,108,864 bytes\); \d+ blocks flushed", out, re.M
    )
    assert any(p.is_file() for p in folder.rglob("*"))  # the flush at exit wrote blocks
    # A second run on the same folder starts with them (prefix hits served from the disk tier).
    assert main(argv) == 0
    m = re.search(r"num_restored_disk_blocks (\d+)", capsys.readouterr().out)
    assert m and int(m.group(1)) > 0
