"""guidellm and aiperf, the load generators vLLM users benchmark with, against a live
`pagedkv serve`: each runs a short bounded benchmark as its own CLI, in a subprocess in its own
process group, and its report must show every request succeeded with the token counts we asked.

The server runs the tiny random model (only token counts matter here) with the embedded
tokenizer, which both tools load offline (``HF_HUB_OFFLINE=1``) to build their synthetic prompts
of exactly ``PROMPT_TOKENS`` tokens. Each tool sends ``NUM_REQUESTS`` streaming completions at a
constant ``RATE`` with ``max_tokens = OUTPUT_TOKENS``; ``ignore_eos`` (guidellm adds it itself
to a request with an output length; aiperf through ``--extra-inputs``, with ``min_tokens``) makes
every reply exactly that long. The token counts checked are the server's usage as each tool
parsed it, per request; ``/metrics`` must agree that the server served them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from bench_load_clients import (  # noqa: E402  (benches/ is on pytest's path: pyproject.toml)
    GUIDELLM_ENV,
    CliRun,
    LoadReport,
    aiperf_argv,
    aiperf_tmpdir,
    aiperf_tokenizer_cache,
    cli_path,
    guidellm_argv,
    guidellm_scenario,
    read_aiperf_report,
    read_guidellm_report,
    run_cli,
)

from pagedkv.server.launch import ServerProcess  # noqa: E402
from pagedkv.server.metrics import parse_metrics  # noqa: E402
from pagedkv.worker.model_files import default_model_dir  # noqa: E402

MODEL_NAME = "tiny"
NUM_REQUESTS = 16
PROMPT_TOKENS = 32
OUTPUT_TOKENS = 16
RATE = 8.0  # requests/s, constant arrivals: every request is sent within ~2 s
TOOL_TIMEOUT = 300.0  # seconds; a tool past it is killed with its process group
SERVER_FLAGS = [
    "--served-model-name", MODEL_NAME, "--dtype", "float32", "--device", "cpu", "--max-model-len", "256",
    "--num-blocks", "160", "--max-num-seqs", str(NUM_REQUESTS), "--log-level", "warning",
]  # fmt: skip


def require_cli(name: str) -> None:
    if not cli_path(name).exists():
        pytest.skip(f"{name} is not installed (the `test` extra installs it)")


@pytest.fixture(scope="module")
def tokenizer_dir() -> Path:
    return default_model_dir()


@pytest.fixture(scope="module")
def server(tiny_model: str, tokenizer_dir: Path) -> Iterator[ServerProcess]:
    with ServerProcess([tiny_model, "--tokenizer", str(tokenizer_dir), *SERVER_FLAGS]) as proc:
        yield proc


def served_counts(url: str) -> tuple[float, float]:
    """The server's cumulative (successful requests, generated tokens) from ``/metrics``."""
    totals = {"vllm:request_success_total": 0.0, "vllm:generation_tokens_total": 0.0}
    for key, value in parse_metrics(httpx.get(url + "/metrics", timeout=30).text).items():
        name = key.split("{", 1)[0]
        if name in totals:
            totals[name] += value
    return totals["vllm:request_success_total"], totals["vllm:generation_tokens_total"]


def run_tool(server: ServerProcess, name: str, argv: list[str], cwd: Path, env: dict[str, str]) -> CliRun:
    """Runs one tool against ``server``; fails with its output unless it exited 0, and unless
    the server's ``/metrics`` counted exactly the requests and tokens the tool was to send."""
    before = served_counts(server.url)
    run = run_cli(argv, cwd=cwd, env=env, timeout=TOOL_TIMEOUT)
    print(f"{name}: {run.wall_s:.1f} s wall, {run.cpu_s:.1f} s CPU (its processes)")
    assert not run.timed_out, f"{name} ran past {TOOL_TIMEOUT} s:\n{run.tail()}"
    assert run.returncode == 0, f"{name} exited with {run.returncode}:\n{run.tail()}\nserver:\n{server.log_tail()}"
    requests, tokens = (after - b for after, b in zip(served_counts(server.url), before))
    assert (requests, tokens) == (NUM_REQUESTS, NUM_REQUESTS * OUTPUT_TOKENS), (requests, tokens, run.tail())
    return run


def check_report(report: LoadReport) -> None:
    # Every request is in the report, but those the tool had not recorded when it stopped
    # (guidellm, on a busy machine: its scheduler's "processing" count); run_tool checked on the
    # server that all of them were answered with every token.
    assert report.errors == [] and report.failed == 0 and report.incomplete == 0, report
    assert report.succeeded + report.unrecorded == NUM_REQUESTS and report.succeeded >= NUM_REQUESTS // 2, report
    assert report.prompt_tokens == [PROMPT_TOKENS] * report.succeeded, report.prompt_tokens
    assert report.output_tokens == [OUTPUT_TOKENS] * report.succeeded, report.output_tokens
    assert report.output_tok_s > 0 and report.req_s > 0, report


def test_guidellm_constant_rate(server: ServerProcess, tokenizer_dir: Path, tmp_path: Path) -> None:
    require_cli("guidellm")
    report = tmp_path / "report.json"
    scenario = guidellm_scenario(
        url=server.url,
        model=MODEL_NAME,
        tokenizer=str(tokenizer_dir),
        profile={"kind": "constant", "rate": [RATE]},
        data={"kind": "synthetic_text", "prompt_tokens": PROMPT_TOKENS, "output_tokens": OUTPUT_TOKENS},
        max_requests=NUM_REQUESTS,
        report=report,
    )
    (tmp_path / "scenario.json").write_text(json.dumps(scenario))
    env = {"HF_HUB_OFFLINE": "1", **GUIDELLM_ENV}
    run_tool(server, "guidellm", guidellm_argv(tmp_path / "scenario.json"), tmp_path, env)
    check_report(read_guidellm_report(report))


def test_aiperf_constant_rate(server: ServerProcess, tokenizer_dir: Path, tmp_path: Path) -> None:
    require_cli("aiperf")
    hub_env = aiperf_tokenizer_cache(tmp_path / "hub", tokenizer_dir)
    synthetic = [
        "--prompt-input-tokens-mean", str(PROMPT_TOKENS), "--prompt-input-tokens-stddev", "0",
        "--prompt-output-tokens-mean", str(OUTPUT_TOKENS), "--prompt-output-tokens-stddev", "0",
        "--num-dataset-entries", str(NUM_REQUESTS),
    ]  # fmt: skip
    argv = aiperf_argv(
        url=server.url,
        model=MODEL_NAME,
        artifact_dir=tmp_path / "artifacts",
        request_count=NUM_REQUESTS,
        load=["--request-rate", str(RATE), "--arrival-pattern", "constant"],
        data=synthetic,
        extra_inputs={"ignore_eos": "true", "min_tokens": str(OUTPUT_TOKENS)},
    )
    with aiperf_tmpdir() as tmp_env:
        run_tool(server, "aiperf", argv, tmp_path, {**hub_env, **tmp_env})
    check_report(read_aiperf_report(tmp_path / "artifacts"))
