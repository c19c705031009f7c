"""The server app in-process (``create_app(engine=...)`` behind httpx's ASGI transport): its
``/metrics`` agree with the engine's ``SchedulerStats`` after a known workload, the app
factory's and the CLI's argument handling, and a request whose steps keep failing (a 500 or an
in-band stream error for it, service for everyone else)."""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from pagedkv import AsyncLLM, ConfigError  # noqa: E402
from pagedkv.cli.engine_args import add_engine_arguments, engine_args_from  # noqa: E402
from pagedkv.server import ServerArgs, create_app  # noqa: E402
from pagedkv.server.metrics import parse_metrics  # noqa: E402

ENGINE_ARGS: dict[str, Any] = dict(
    dtype="float32", device="cpu", block_size=16, num_blocks=96, max_model_len=384, max_num_seqs=4
)
PROMPT = "A shared preamble about the weather in spring and autumn, repeated for caching. " * 4


async def _workload(engine: AsyncLLM) -> tuple[dict[str, float], dict[str, Any], list[dict[str, Any]]]:
    app = create_app(engine=engine, server_args=ServerArgs(served_model_names=["m"]))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as http:
        bodies = [
            {"prompt": PROMPT + "first", "max_tokens": 5, "temperature": 0, "ignore_eos": True},
            {"prompt": PROMPT + "second", "max_tokens": 3, "temperature": 0, "ignore_eos": True},
            {"prompt": PROMPT + "third", "max_tokens": 4, "n": 2, "seed": 1, "ignore_eos": True},
        ]
        usages = []
        for body in bodies:  # one at a time: the second and third hit the first's blocks
            r = await http.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            usages.append(r.json()["usage"])
        text = (await http.get("/metrics")).text
        # Development endpoints exist only with PAGEDKV_SERVER_DEV_MODE=1 (the attack suite's).
        assert (await http.post("/dev/check_invariants")).status_code == 404
        health = await http.get("/health")
        assert health.status_code == 200 and health.json()["status"] == "ok", health.text
    return parse_metrics(text), await engine.get_stats(), usages


def test_metrics_agree_with_scheduler_stats() -> None:
    with AsyncLLM(**ENGINE_ARGS) as engine:
        m, stats, usages = asyncio.run(_workload(engine))
    assert m["vllm:prefix_cache_queries_total{}"] == stats["prefix_cache_queries"]
    assert m["vllm:prefix_cache_hits_total{}"] == stats["prefix_cache_hits"] > 0
    assert m["vllm:num_preemptions_total{}"] == stats["num_preemptions"]
    assert m["vllm:kv_cache_usage_perc{}"] == stats["kv_usage"] == 0.0
    assert m["vllm:num_requests_running{}"] == stats["num_running"] == 0
    assert m["pagedkv:num_free_blocks{}"] == stats["num_free_blocks"] == ENGINE_ARGS["num_blocks"]
    assert m["vllm:prompt_tokens_total{}"] == sum(u["prompt_tokens"] for u in usages)
    assert m["vllm:generation_tokens_total{}"] == sum(u["completion_tokens"] for u in usages) == 5 + 3 + 8
    assert m["vllm:generation_tokens_total{}"] == stats["generation_tokens"]
    assert m["vllm:request_success_total{finished_reason=length}"] == 3
    assert sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages) == stats["prefix_cache_hits"]
    assert m["vllm:time_to_first_token_seconds_count{}"] == 3
    # Inter-token latencies: one per token after a sample's first.
    assert m["vllm:inter_token_latency_seconds_count{}"] == (5 - 1) + (3 - 1) + 2 * (4 - 1)
    assert not any(k.startswith("pagedkv:host") for k in m), "no host tier, no host metrics"


def test_server_args_are_checked() -> None:
    with pytest.raises(ConfigError, match="max_queued_requests"):
        ServerArgs(max_queued_requests=0)
    with pytest.raises(ConfigError, match="api_key"):
        ServerArgs(api_key="")
    with pytest.raises(ConfigError, match="replay"):
        ServerArgs(kv_events_replay_endpoint="tcp://127.0.0.1:1")
    with pytest.raises(ConfigError, match="not both"):
        create_app(engine_args=object(), engine=object())  # type: ignore[arg-type]


def test_engine_flags_cover_engine_args() -> None:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    ns = parser.parse_args(
        ["--num-blocks", "64", "--no-enable-prefix-caching", "--swap-space", "0.5", "--kv-cache-dtype", "int8"]
    )
    args = engine_args_from(ns, "some/model")
    assert (args.model, args.num_blocks, args.enable_prefix_caching) == ("some/model", 64, False)
    assert (args.swap_space, args.kv_cache_dtype) == (0.5, "int8")
    with pytest.raises(ConfigError, match="block_size"):
        engine_args_from(parser.parse_args(["--block-size", "7"]), None)


POISON = 777  # a prompt token the test's runner refuses to run


async def _poisoned_requests(engine: AsyncLLM) -> None:
    app = create_app(engine=engine)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=60) as http:
        bad = {"prompt": [1, POISON, 2], "max_tokens": 3}
        r = await http.post("/v1/completions", json=bad)
        assert r.status_code == 500 and "injected failure" in r.json()["error"]["message"], r.text
        r = await http.post("/v1/completions", json={**bad, "stream": True})
        lines = [line for line in r.text.splitlines() if line]
        assert lines[-1] == "data: [DONE]"
        assert "injected failure" in json.loads(lines[-2][len("data: ") :])["error"]["message"]
        good = await http.post("/v1/completions", json={"prompt": "Still serving", "max_tokens": 3})
        assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 3


def test_a_request_whose_steps_fail_gets_an_error_and_others_are_served() -> None:
    with AsyncLLM(**ENGINE_ARGS) as engine:
        runner = engine.engine.runner
        real_execute = runner.execute

        def execute(step: Any, *args: Any) -> Any:
            if POISON in step.input_ids.tolist():
                raise RuntimeError("injected failure")
            return real_execute(step, *args)

        runner.execute = execute
        asyncio.run(_poisoned_requests(engine))
        stats = engine.engine.get_stats()
    assert stats["failed_requests"] == 2 and stats["num_used_blocks"] == 0 and stats["num_unfinished_requests"] == 0
