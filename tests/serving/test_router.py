"""`pagedkv router` over two real `pagedkv serve` replicas (subprocesses on loopback, KV events
on, an API key the router holds as its engine key): requests sharing a system prompt land on
the replica that cached it (its usage shows the prefix-cache hit), round robin alternates
whatever is cached, streams pass through, the router's clients need its own key, and the
router's metrics count its decisions. Last, a replica is SIGKILLed mid-stream: the stream ends
with an error event, later requests go to the other one, a router started while the replica is
restarted waits for it, and the first router sees the restart (its index starts over). The
router app runs in-process (httpx's ASGI transport); its forwarding, health checks and event
subscriptions are real. The replicas serve the tiny random model (tests/tiny_models.py, the
embedded tokenizer): routing depends on the tokens, not on the weights."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("zmq")
pytest.importorskip("fastapi")

from pagedkv import ConfigError  # noqa: E402
from pagedkv.router import RouterArgs, create_router_app  # noqa: E402
from pagedkv.router.launcher import ProcessKeeper  # noqa: E402
from pagedkv.server.launch import ServerProcess, free_port  # noqa: E402
from pagedkv.server.metrics import parse_metrics  # noqa: E402

ENGINE_FLAGS = ["--dtype", "float32", "--device", "cpu", "--num-blocks", "160", "--max-model-len", "512"]
TIMEOUT = 60.0
ENGINE_KEY = "engine-secret"


@pytest.fixture(scope="module")
def replicas(tiny_model: str) -> Iterator[list[ServerProcess]]:
    procs = []
    try:
        for _ in range(2):
            events = f"tcp://127.0.0.1:{free_port()}"
            replay = f"tcp://127.0.0.1:{free_port()}"
            args = ["--model", tiny_model, *ENGINE_FLAGS]
            args += ["--kv-events-endpoint", events, "--kv-events-replay-endpoint", replay]
            args += ["--api-key", ENGINE_KEY]
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
    app = create_router_app(RouterArgs(replicas=[p.url for p in replicas], engine_api_key=ENGINE_KEY))
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
    app = create_router_app(
        RouterArgs(replicas=[p.url for p in replicas], policy="round_robin", engine_api_key=ENGINE_KEY)
    )
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


async def _client_keys(replicas: list[ServerProcess]) -> None:
    urls = [p.url for p in replicas]
    app = create_router_app(RouterArgs(replicas=urls, api_key="client-key", engine_api_key=ENGINE_KEY))
    body = {"prompt": "Hello", "max_tokens": 1}
    try:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://router", timeout=TIMEOUT) as http:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Bearer {ENGINE_KEY}"}):
                r = await http.post("/v1/completions", json=body, headers=headers)
                assert r.status_code == 401, headers
            r = await http.post("/v1/completions", json=body, headers={"Authorization": "Bearer client-key"})
            assert r.status_code == 200, r.text  # the replica, which needs ENGINE_KEY, accepted the router's
    finally:
        await app.state.router.close()
    # A router without the engine key cannot use the replicas (and says why), whatever the client sends.
    with pytest.raises(ConfigError, match="engine key was refused"):
        create_router_app(RouterArgs(replicas=urls, api_key="client-key", startup_timeout=0.5))


def test_clients_need_the_routers_key_and_replicas_get_the_engine_key(replicas: list[ServerProcess]) -> None:
    asyncio.run(asyncio.wait_for(_client_keys(replicas), 2 * TIMEOUT))


@contextmanager
def served(app: Any) -> Iterator[str]:
    """``app`` under uvicorn in a thread on a free loopback port (real streaming, which httpx's
    ASGI transport does not do); its lifespan closes the router at the end."""
    import uvicorn

    config = uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + TIMEOUT
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the router did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{config.port}"
    finally:
        server.should_exit = True
        thread.join(TIMEOUT)


def test_a_replica_killed_mid_stream_is_routed_around_and_rejoins(
    replicas: list[ServerProcess], caplog: pytest.LogCaptureFixture
) -> None:
    # Last in the module: it kills a replica (and leaves it restarted).
    caplog.set_level(logging.INFO, logger="pagedkv.router")
    urls = [p.url for p in replicas]
    app = create_router_app(RouterArgs(replicas=urls, engine_api_key=ENGINE_KEY, health_interval=0.5))
    keeper = None
    try:
        with served(app) as url, httpx.Client(base_url=url, timeout=TIMEOUT) as http:
            # A long stream; its replica is SIGKILLed after the first event.
            body = {"prompt": "Tell me a long story.", "max_tokens": 300, "ignore_eos": True, "stream": True}
            lines: list[str] = []
            with http.stream("POST", "/v1/completions", json=body) as r:
                victim = next(p for p in replicas if p.url == r.headers["x-pagedkv-replica"])
                survivor = next(p for p in replicas if p is not victim)
                for line in r.iter_lines():
                    if line and not lines:
                        victim.signal(signal.SIGKILL)
                        victim.wait(TIMEOUT)
                    if line:
                        lines.append(line)
            assert lines[-1] == "data: [DONE]" and "failed mid-stream" in lines[-2], lines[-3:]
            assert json.loads(lines[-2][6:])["error"]["type"] == "bad_gateway"
            # Every new request is answered, by the survivor.
            for i in range(8):
                r = http.post("/v1/completions", json={"prompt": f"Question {i}?", "max_tokens": 2})
                assert r.status_code == 200 and r.headers["x-pagedkv-replica"] == survivor.url, r.text
            health = http.get("/health").json()
            assert health["status"] == "degraded"
            assert {e["url"]: e["up"] for e in health["engines"]} == {victim.url: False, survivor.url: True}

            # The victim comes back on the same ports; a router started meanwhile waits for it.
            keeper = ProcessKeeper(victim, "replica", first_pause=0.1).start()
            late = create_router_app(RouterArgs(replicas=[victim.url], engine_api_key=ENGINE_KEY, startup_timeout=300))
            assert "waiting up to 300 s for the engines to come up" in caplog.text
            assert keeper.restarts == 1
            with served(late) as late_url:
                r = httpx.post(late_url + "/v1/completions", json={"prompt": "Hello again", "max_tokens": 2})
                assert r.status_code == 200 and r.headers["x-pagedkv-replica"] == victim.url, r.text

            # The first router sees it back, follows its new event history from 0, routes to it.
            health = http.get("/health").json()
            assert health["status"] == "ok", health
            prompt = system_prompt("sailing") + "After the restart?"
            direct = httpx.post(
                victim.url + "/v1/completions",
                json={"prompt": prompt, "max_tokens": 1},
                headers={"Authorization": f"Bearer {ENGINE_KEY}"},
                timeout=TIMEOUT,
            )
            assert direct.status_code == 200, direct.text
            asyncio.run(asyncio.wait_for(_wait_indexed(app, victim.url, prompt), TIMEOUT))
            r = http.post("/v1/completions", json={"prompt": prompt + " Again.", "max_tokens": 1})
            assert r.headers["x-pagedkv-replica"] == victim.url
            m = parse_metrics(http.get("/metrics").text)
            assert m[f"pagedkv_router:kv_index_resets_total{{reason=restart,replica={victim.url}}}"] >= 1
            assert m[f"pagedkv_router:replica_up{{replica={victim.url}}}"] == 1
            assert m["pagedkv_router:stream_errors_total{reason=replica}"] == 1
    finally:
        if keeper is not None:
            keeper.stop()
            replicas[replicas.index(victim)] = keeper.proc  # stopped by the fixture
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]  # no ASGI traceback, no failed subscription
