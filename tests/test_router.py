"""`pagedkv router` over two real `pagedkv serve` replicas (subprocesses on loopback, KV events
on): requests sharing a system prompt land on the replica that cached it (its usage shows the
prefix-cache hit), round robin alternates whatever is cached, streams pass through, and the
router's metrics count its decisions. The router app runs in-process (httpx's ASGI transport);
its forwarding and its event subscriptions are real."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("zmq")
pytest.importorskip("fastapi")

from pagedkv import ConfigError  # noqa: E402
from pagedkv.router import RouterArgs, create_router_app  # noqa: E402
from pagedkv.server.launch import ServerProcess, free_port  # noqa: E402
from pagedkv.server.metrics import parse_metrics  # noqa: E402

ENGINE_FLAGS = ["--dtype", "float32", "--device", "cpu", "--num-blocks", "160", "--max-model-len", "512"]
TIMEOUT = 60.0


@pytest.fixture(scope="module")
def replicas() -> Iterator[list[ServerProcess]]:
    procs = []
    try:
        for _ in range(2):
            events = f"tcp://127.0.0.1:{free_port()}"
            replay = f"tcp://127.0.0.1:{free_port()}"
            args = [*ENGINE_FLAGS, "--kv-events-endpoint", events, "--kv-events-replay-endpoint", replay]
            procs.append(ServerProcess(args, env={"OMP_NUM_THREADS": "1"}).start())
        yield procs
    finally:
        for p in procs:
            p.stop()


def system_prompt(topic: str) -> str:
    return f"You are an assistant for questions about {topic}. Answer briefly and politely. " * 4


async def _wait_indexed(app: Any, replica_url: str, prompt: str) -> None:
    """Until the router's index shows ``prompt``'s blocks on ``replica_url`` (events are async)."""
    router = app.state.router
    replica = next(r for r in router.replicas if r.url == replica_url)
    ids = router.prompt_token_ids("/v1/completions", {"prompt": prompt})
    deadline = time.monotonic() + TIMEOUT
    while router._held_tokens(replica, ids, None) == 0:
        assert time.monotonic() < deadline, "the router never saw the replica cache the prompt"
        await asyncio.sleep(0.05)


async def _cache_aware(replicas: list[ServerProcess]) -> None:
    app = create_router_app(RouterArgs(replicas=[p.url for p in replicas]))
    try:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://router", timeout=TIMEOUT) as http:
            placed: dict[str, str] = {}
            for topic in ("gardening", "astronomy"):
                prompt = system_prompt(topic) + "First question?"
                r = await http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
                assert r.status_code == 200, r.text
                placed[topic] = r.headers["x-pagedkv-replica"]
                await _wait_indexed(app, placed[topic], prompt)
            assert placed["gardening"] != placed["astronomy"], "ties go to the less loaded / next replica"
            for i in range(3):
                for topic in ("astronomy", "gardening"):
                    body = {"prompt": system_prompt(topic) + f"Question {i}?", "max_tokens": 2}
                    r = await http.post("/v1/completions", json=body)
                    assert r.headers["x-pagedkv-replica"] == placed[topic], (topic, i)
                    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16 * 3
            # A stream passes through byte for byte.
            body = {"prompt": system_prompt("astronomy") + "Stream?", "max_tokens": 3, "stream": True}
            async with http.stream("POST", "/v1/completions", json=body) as r:
                assert r.headers["x-pagedkv-replica"] == placed["astronomy"]
                lines = [line async for line in r.aiter_lines() if line]
            assert lines[-1] == "data: [DONE]"
            # Chat requests are tokenized with the template and routed the same way.
            chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
            assert (await http.post("/v1/chat/completions", json=chat)).status_code == 200
            assert (await http.post("/v1/completions", content=b"{not json")).status_code == 400
            # A bad request reaches the replica, which answers it.
            assert (await http.post("/v1/completions", json={"prompt": "x", "n": 0})).status_code == 400
            m = parse_metrics((await http.get("/metrics")).text)
            assert m["pagedkv_router:routing_decisions_total{reason=prefix}"] >= 7
            assert m["pagedkv_router:predicted_hit_tokens_total{}"] > 0
            assert all(v == 0 for k, v in m.items() if k.startswith("pagedkv_router:in_flight"))
            assert (await http.get("/health")).status_code == 200
    finally:
        await app.state.router.close()


def test_cache_aware_routing_follows_the_cached_prefix(replicas: list[ServerProcess]) -> None:
    asyncio.run(asyncio.wait_for(_cache_aware(replicas), 4 * TIMEOUT))


async def _round_robin(replicas: list[ServerProcess]) -> None:
    app = create_router_app(RouterArgs(replicas=[p.url for p in replicas], policy="round_robin"))
    try:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://router", timeout=TIMEOUT) as http:
            seen = []
            for i in range(4):
                body = {"prompt": system_prompt("cooking") + f"Q{i}?", "max_tokens": 1}
                r = await http.post("/v1/completions", json=body)
                seen.append(r.headers["x-pagedkv-replica"])
            assert seen[0] != seen[1] and seen[0] == seen[2] and seen[1] == seen[3]
    finally:
        await app.state.router.close()


def test_round_robin_alternates(replicas: list[ServerProcess]) -> None:
    asyncio.run(asyncio.wait_for(_round_robin(replicas), 2 * TIMEOUT))


def test_router_args_are_checked() -> None:
    with pytest.raises(ConfigError, match="at least one"):
        RouterArgs(replicas=[])
    with pytest.raises(ConfigError, match="URL"):
        RouterArgs(replicas=["localhost:8000"])
    with pytest.raises(ConfigError, match="policy"):
        RouterArgs(replicas=["http://127.0.0.1:1"], policy="random")
    with pytest.raises(ConfigError, match="no engine came up within 0.2 s: .* did not answer /health"):
        create_router_app(RouterArgs(replicas=[f"http://127.0.0.1:{free_port()}"], startup_timeout=0.2))
