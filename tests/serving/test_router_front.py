"""`pagedkv router` in replica mode over stand-in engines (``httpx.MockTransport``: they record
what they receive and fail on demand), the app driven through httpx's ASGI transport: client
keys (401s) and the separate engine key, failover from an engine that refuses connections,
tokenizing off the event loop and the size bound, and streams that end with an error event and
``[DONE]`` when the engine dies mid-stream or the router shuts down (also for real: SIGTERM to
a router process). (Real replicas: test_router.py.)"""

from __future__ import annotations

import asyncio
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import Any, TypeVar

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from pagedkv.router.app import Replica, Router, RouterArgs, _load_tokenizer, build_router_app  # noqa: E402
from pagedkv.server.launch import free_port  # noqa: E402
from pagedkv.server.metrics import parse_metrics  # noqa: E402

T = TypeVar("T")
TIMEOUT = 30.0
COMPLETIONS = "/v1/completions"
EVENT = b'data: {"choices": [{"text": "a"}]}\n\n'


def run(coro: Awaitable[T]) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(coro, 4 * TIMEOUT)

    return asyncio.run(bounded())


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return _load_tokenizer(RouterArgs(["http://127.0.0.1:1"]))


class Engines:
    """Stand-in replicas ``replica0``, ``replica1``...: record (host, path, Authorization);
    a host in ``refusing`` refuses connections; ``stream_mode`` says how a stream goes."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, str | None]] = []
        self.refusing: set[str] = set()
        self.stream_mode = "whole"
        self.stream_started = asyncio.Event()

    async def handle(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if host in self.refusing:
            raise httpx.ConnectError("connection refused", request=request)
        self.calls.append((host, request.url.path, request.headers.get("authorization")))
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": host}]})
        body = json.loads(request.content)
        if not body.get("stream"):
            return httpx.Response(200, json={"answered_by": host})
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=self.events())

    async def events(self) -> AsyncIterator[bytes]:
        yield EVENT
        # Half an event: held back by the router, never shown to the client when the rest is lost.
        yield b'data: {"choices": [{"te'
        self.stream_started.set()
        if self.stream_mode == "die":
            raise httpx.RemoteProtocolError("peer closed connection without sending complete message body")
        if self.stream_mode == "hang":
            await asyncio.Event().wait()
        yield b'xt": "b"}]}\n\ndata: [DONE]\n\n'

    def hosts(self, path: str = COMPLETIONS) -> list[str]:
        return [h for h, p, _ in self.calls if p == path]


def make_router(engines: Engines, tokenizer: Any, n: int = 2, **kwargs: Any) -> tuple[Any, Router]:
    urls = [f"http://replica{i}:8000" for i in range(n)]
    router = Router(RouterArgs(replicas=urls, **kwargs), [Replica(u, 16) for u in urls], tokenizer)
    router.client = httpx.AsyncClient(transport=httpx.MockTransport(engines.handle))
    return build_router_app(router), router


def client_of(app: Any, key: str | None = None) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    transport = httpx.ASGITransport(app=app)
    return httpx.AsyncClient(transport=transport, base_url="http://router", timeout=TIMEOUT, headers=headers)


def metrics_of(router: Router) -> dict[str, float]:
    return parse_metrics(router.render_metrics().decode())


def test_client_keys_are_checked_and_engines_get_the_engine_key(tokenizer: Any) -> None:
    engines = Engines()
    app, _ = make_router(engines, tokenizer, api_key="client-key", engine_api_key="engine-key")
    body = {"prompt": "Hello", "max_tokens": 1}

    async def go() -> None:
        for key in (None, "wrong", "engine-key", "client-key "):
            async with client_of(app, key) as http:
                r = await http.post(COMPLETIONS, json=body)
                assert r.status_code == 401, key
                assert r.json()["error"]["code"] == "invalid_api_key"
                assert (await http.get("/v1/models")).status_code == 401
        assert engines.calls == [], "a refused client reaches no engine"
        async with client_of(app, "client-key") as http:
            assert (await http.post(COMPLETIONS, json=body)).status_code == 200
            assert (await http.post(COMPLETIONS, json={**body, "stream": True})).status_code == 200
            assert (await http.get("/v1/models")).status_code == 200
        async with client_of(app) as http:  # open, as on the engines
            assert (await http.get("/health")).status_code == 200
            assert (await http.get("/metrics")).status_code == 200

    run(go())
    assert [auth for _, _, auth in engines.calls] == ["Bearer engine-key"] * 3

    # Without an engine key the engines get no Authorization at all: never the client's.
    engines = Engines()
    app, _ = make_router(engines, tokenizer, api_key="client-key")

    async def again() -> None:
        async with client_of(app, "client-key") as http:
            assert (await http.post(COMPLETIONS, json=body)).status_code == 200

    run(again())
    assert [auth for _, _, auth in engines.calls] == [None]


def test_a_body_over_the_limit_gets_413_before_any_engine_sees_it(tokenizer: Any) -> None:
    engines = Engines()
    app, _ = make_router(engines, tokenizer, max_request_body_bytes=1024)

    async def go() -> None:
        async with client_of(app) as http:
            r = await http.post(COMPLETIONS, json={"prompt": "x" * 2000, "max_tokens": 1})
            assert r.status_code == 413, r.text
            assert "max_request_body_bytes" in r.json()["error"]["message"]
            assert engines.calls == []
            assert (await http.post(COMPLETIONS, json={"prompt": "Hello", "max_tokens": 1})).status_code == 200

    run(go())


def test_an_engine_that_refuses_connections_is_routed_around(tokenizer: Any) -> None:
    engines = Engines()
    engines.refusing.add("replica0")
    app, router = make_router(engines, tokenizer)
    r0, r1 = router.replicas

    async def go() -> None:
        async with client_of(app) as http:
            for i in range(6):
                r = await http.post(COMPLETIONS, json={"prompt": f"Question {i}", "max_tokens": 1})
                assert r.status_code == 200 and r.headers["x-pagedkv-replica"] == r1.url
            assert not r0.up and "refused" in str(r0.last_error)
            health = (await http.get("/health")).json()
            assert health["status"] == "degraded" and [e["up"] for e in health["engines"]] == [False, True]
            # Every engine refuses: each is tried once, then a 503 (OpenAI's clients retry it).
            engines.refusing.add("replica1")
            r = await http.post(COMPLETIONS, json={"prompt": "x", "max_tokens": 1})
            assert r.status_code == 503 and "no engine is reachable" in r.json()["error"]["message"]
            assert (await http.get("/health")).status_code == 503

    run(go())
    assert engines.hosts() == ["replica1"] * 6, "the refused attempts sent nothing"
    m = metrics_of(router)
    # replica0: the first request, then the last one (with every engine down, each is tried).
    assert m["pagedkv_router:failovers_total{replica=http://replica0:8000}"] == 2
    assert m["pagedkv_router:failovers_total{replica=http://replica1:8000}"] == 1
    assert m["pagedkv_router:replica_up{replica=http://replica0:8000}"] == 0
    assert all(v == 0 for k, v in m.items() if k.startswith("pagedkv_router:in_flight"))


class GatedTokenizer:
    """The real tokenizer, but each call waits until the test releases it (a long prompt's
    tokenization, made as long as the test needs)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.entered = threading.Event()
        self.release = threading.Event()
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        self.entered.set()
        assert self.release.wait(TIMEOUT), "never released: the event loop was blocked"
        return self.inner(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_tokenizing_runs_off_the_event_loop_and_is_bounded(tokenizer: Any) -> None:
    engines = Engines()
    gated = GatedTokenizer(tokenizer)
    app, router = make_router(engines, gated, max_tokenize_bytes=600_000)
    big = "lorem ipsum dolor sit amet " * 20_000  # 540 kB: tokenized

    async def go() -> None:
        async with client_of(app) as http:
            pending = asyncio.ensure_future(http.post(COMPLETIONS, json={"prompt": big, "max_tokens": 1}))
            await asyncio.to_thread(gated.entered.wait, TIMEOUT)
            # The big request is being tokenized (and waits): the router still answers.
            assert (await http.get("/metrics")).status_code == 200
            assert (await http.get("/health")).status_code == 200
            assert not pending.done(), "/metrics answered while the big prompt was still being tokenized"
            gated.release.set()
            assert (await pending).status_code == 200
            assert gated.calls == 1
            # Above the bound: routed by load, never tokenized.
            r = await http.post(COMPLETIONS, json={"prompt": big * 2, "max_tokens": 1})
            assert r.status_code == 200 and gated.calls == 1
            # A client's own chat template is not run by the router (the engine decides).
            chat = {"messages": [{"role": "user", "content": "Hi"}], "chat_template": "{{ 'A' * 100000000 }}"}
            assert (await http.post("/v1/chat/completions", json=chat)).status_code == 200
            assert gated.calls == 1

    run(go())
    m = metrics_of(router)
    assert m["pagedkv_router:routing_decisions_total{reason=too_long}"] == 1
    assert m["pagedkv_router:routing_decisions_total{reason=unparsed}"] == 1
    assert m["pagedkv_router:prompt_tokens_total{}"] > 20_000


async def _stream(http: httpx.AsyncClient) -> list[bytes]:
    body = {"prompt": "Hello", "max_tokens": 5, "stream": True}
    async with http.stream("POST", COMPLETIONS, json=body) as r:
        assert r.status_code == 200
        return [line async for line in r.aiter_lines() if line]


def _error_of(line: bytes | str) -> dict[str, Any]:
    text = line.decode() if isinstance(line, bytes) else line
    assert text.startswith("data: ")
    return dict(json.loads(text[6:])["error"])


def test_a_stream_ends_with_an_error_event_when_the_engine_dies_or_the_router_stops(tokenizer: Any) -> None:
    engines = Engines()
    app, router = make_router(engines, tokenizer, n=1, shutdown_timeout=0.05)

    async def go() -> None:
        async with client_of(app) as http:
            whole = await _stream(http)
            assert whole == [EVENT.decode().strip(), 'data: {"choices": [{"text": "b"}]}', "data: [DONE]"]
            engines.stream_mode = "die"
            lines = await _stream(http)
            assert lines[0] == EVENT.decode().strip() and lines[-1] == "data: [DONE]" and len(lines) == 3
            error = _error_of(lines[1])
            assert error["type"] == "bad_gateway" and "failed mid-stream" in error["message"]
            # The router shuts down while a stream waits on its engine.
            engines.stream_mode = "hang"
            engines.stream_started.clear()
            pending = asyncio.ensure_future(_stream(http))
            await engines.stream_started.wait()
            router.begin_shutdown(asyncio.get_running_loop())  # what SIGTERM calls (serve_router)
            lines = await pending
            assert lines[-1] == "data: [DONE]" and "shutting down" in _error_of(lines[1])["message"]

    run(go())
    m = metrics_of(router)
    assert m["pagedkv_router:stream_errors_total{reason=replica}"] == 1
    assert m["pagedkv_router:stream_errors_total{reason=shutdown}"] == 1
    assert m["pagedkv_router:in_flight{replica=http://replica0:8000}"] == 0


# A router process over a stand-in engine whose stream never ends: SIGTERM must still end the
# client's stream well-formed (serve_router's signal hook), and the process must exit.
_SIGTERM_SCRIPT = """
import asyncio, sys, threading
import uvicorn
from fastapi import FastAPI
from starlette.responses import StreamingResponse
from pagedkv.router.app import Replica, Router, RouterArgs, build_router_app, serve_router

engine = FastAPI()

@engine.post("/v1/completions")
async def completions() -> StreamingResponse:
    async def events():
        yield b'data: {"choices": [{"text": "a"}]}\\n\\n'
        await asyncio.Event().wait()
    return StreamingResponse(events(), media_type="text/event-stream")

engine_port, router_port = int(sys.argv[1]), int(sys.argv[2])
config = uvicorn.Config(engine, host="127.0.0.1", port=engine_port, log_level="warning")
threading.Thread(target=uvicorn.Server(config).run, daemon=True).start()
url = f"http://127.0.0.1:{engine_port}"
args = RouterArgs(replicas=[url], shutdown_timeout=0.5, header_timeout=1.0, body_timeout=2.0, max_connections=8)
router = Router(args, [Replica(url, 16)], None)
serve_router(build_router_app(router), "127.0.0.1", router_port, "info")
"""


def _closed_by_peer(sock: socket.socket) -> bool:
    """Whether the peer closes ``sock`` (reads until EOF; False if it stays open TIMEOUT s)."""
    sock.settimeout(TIMEOUT)
    try:
        while sock.recv(4096):
            pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        pass
    return True


def _dripped_status(port: int) -> bytes:
    """The status line the router answers a body sent one byte per 0.5 s (each within the idle
    timeout, the whole never within the body deadline), or b"" if none came in TIMEOUT s."""
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n")
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            if select.select([sock], [], [], 0.5)[0]:
                return sock.recv(4096).split(b"\r\n", 1)[0]
            sock.sendall(b" ")
    return b""


def _check_connection_guards(port: int) -> None:
    """The router process's own connection guards (header_timeout=1, body_timeout=2,
    max_connections=8): a slowloris client that never finishes its headers is closed, so is a
    connection past the cap, a dripping body gets 408, and a normal request is still served."""
    assert _dripped_status(port).startswith(b"HTTP/1.1 408")
    slow = [socket.create_connection(("127.0.0.1", port)) for _ in range(8)]
    try:
        for sock in slow:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # and never the rest
        with socket.create_connection(("127.0.0.1", port)) as extra:  # the 9th: over the cap
            assert _closed_by_peer(extra)
        assert all(_closed_by_peer(sock) for sock in slow), "a partial-header connection stayed open"
    finally:
        for sock in slow:
            sock.close()
    assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=TIMEOUT).status_code == 200


def test_sigterm_ends_a_running_stream_with_an_error_event(tmp_path: Path) -> None:
    engine_port, router_port = free_port(), free_port()
    log = tmp_path / "router.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", _SIGTERM_SCRIPT, str(engine_port), str(router_port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{router_port}"
    try:
        deadline = time.monotonic() + 4 * TIMEOUT
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            try:
                httpx.get(url + "/health", timeout=2).raise_for_status()
                break
            except httpx.HTTPError:
                time.sleep(0.2)
        _check_connection_guards(router_port)
        lines = []
        body = {"prompt": "Hello", "stream": True}
        with httpx.stream("POST", url + COMPLETIONS, json=body, timeout=TIMEOUT) as r:
            for line in r.iter_lines():
                if line and not lines:
                    proc.send_signal(signal.SIGTERM)
                if line:
                    lines.append(line)
        assert lines[0] == EVENT.decode().strip() and lines[-1] == "data: [DONE]", lines
        assert "shutting down" in _error_of(lines[1])["message"]
        proc.wait(TIMEOUT)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    assert "Traceback" not in log.read_text(), log.read_text()
