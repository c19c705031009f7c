"""`pagedkv router` in disaggregated mode (a prefill engine, then a decode engine) and the
`pagedkv serve --disagg` launcher.

Three layers, cheapest first:

* pure functions: the prefill's body, which requests skip the prefill, argument checks, the
  engines' kv_transfer_config, the flags `serve --disagg` passes on;
* the router app over stand-in engines (``httpx.MockTransport``): what each engine receives,
  what the client gets back, every prefill outcome (KV, null, 4xx, 5xx, down, timeout, client
  gone), decode load balancing, the metrics;
* end to end (``test_e2e_*``; ``pytest tests/serving/test_router_disagg.py -k e2e``): real engine
  servers with ``--kv-transfer-config`` over NIXL and gloo, on the tiny random model of
  tests/tiny_models.py (the KV's way between the engines is under test, not the weights). Greedy outputs through the router
  equal a plain server's, a prefill 4xx reaches the client, the engines answer only the router
  (driven directly with its key: the pull, bad ``kv_transfer_params`` as 400s), a dead
  prefill engine falls back, a prefill engine SIGKILLed while it holds a lease costs the decode
  engine a recompute, never the request, and leaves the deployment serving (and comes back
  over NIXL), and `pagedkv serve --disagg` stops its three processes on SIGTERM.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from kv_transports import TRANSPORTS  # noqa: E402
from starlette.requests import Request  # noqa: E402

from pagedkv import ConfigError  # noqa: E402
from pagedkv.cli import router as router_cli  # noqa: E402
from pagedkv.cli import serve as serve_cli  # noqa: E402
from pagedkv.engine.args import EngineArgs  # noqa: E402
from pagedkv.router.app import Replica, Router, RouterArgs, _load_tokenizer, build_router_app  # noqa: E402
from pagedkv.router.disagg import direct_reason, prefill_body  # noqa: E402
from pagedkv.router.launcher import DisaggDeployment, kv_transfer_configs, start_disagg  # noqa: E402
from pagedkv.server.launch import ServerProcess, free_port  # noqa: E402
from pagedkv.server.metrics import parse_metrics  # noqa: E402

T = TypeVar("T")
TIMEOUT = 60.0
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


def run(coro: Awaitable[T], timeout: float = TIMEOUT) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(bounded())


# ----------------------------------------------------------------------------- pure functions


def test_prefill_body_of_a_completion() -> None:
    body = {
        "prompt": "Hello",
        "max_tokens": 50,
        "temperature": 0.5,
        "stream": True,
        "stream_options": {"include_usage": True},
        "n": 3,
        "best_of": 3,
        "min_tokens": 5,
        "logprobs": 2,
        "echo": True,
        "stop": ["\n"],
        "cache_salt": "s",
        "seed": 7,
    }
    original = json.loads(json.dumps(body))
    out = prefill_body(COMPLETIONS, body)
    assert body == original, "the client's body is left alone"
    assert out == {
        "prompt": "Hello",
        "max_tokens": 1,
        "temperature": 0.5,
        "stream": False,
        "n": 1,
        "cache_salt": "s",
        "seed": 7,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    # A completion has no max_completion_tokens: the server refuses it at the prefill already.
    assert prefill_body(COMPLETIONS, {"prompt": "x", "max_completion_tokens": 4})["max_completion_tokens"] == 4


def test_prefill_body_of_a_chat() -> None:
    messages = [{"role": "user", "content": "Hi"}]
    out = prefill_body(CHAT, {"messages": messages, "max_completion_tokens": 30, "max_tokens": 30, "logprobs": True})
    assert out["max_completion_tokens"] == 1 and "max_tokens" not in out and "logprobs" not in out
    out = prefill_body(CHAT, {"messages": messages, "max_tokens": 30, "top_logprobs": 2})
    assert out["max_tokens"] == 1 and "max_completion_tokens" not in out and "top_logprobs" not in out
    out = prefill_body(CHAT, {"messages": messages})
    assert out == {
        "messages": messages,
        "max_tokens": 1,
        "stream": False,
        "n": 1,
        "kv_transfer_params": {"do_remote_decode": True},
    }


def test_direct_reason() -> None:
    assert direct_reason(COMPLETIONS, {"prompt": "a"}) is None
    assert direct_reason(COMPLETIONS, {"prompt": ["a"]}) is None
    assert direct_reason(COMPLETIONS, {"prompt": [1, 2, 3]}) is None
    assert direct_reason(COMPLETIONS, {"prompt": [[1, 2], [3]]}) == "multi_prompt"
    assert direct_reason(COMPLETIONS, {"prompt": ["a", "b"]}) == "multi_prompt"
    assert direct_reason(COMPLETIONS, {"prompt": "a", "kv_transfer_params": {"x": 1}}) == "has_kv_params"
    assert direct_reason(COMPLETIONS, {"prompt": "a", "kv_transfer_params": None}) is None
    assert direct_reason(CHAT, {"messages": [], "kv_transfer_params": {}}) == "has_kv_params"
    assert direct_reason(CHAT, {"messages": [], "prompt": ["a", "b"]}) is None


def test_router_args_modes_are_checked() -> None:
    args = RouterArgs(prefill=["http://127.0.0.1:1"], decode=["http://127.0.0.1:2"])
    assert args.disaggregated and not RouterArgs(["http://127.0.0.1:1"]).disaggregated
    with pytest.raises(ConfigError, match="not both"):
        RouterArgs(replicas=["http://127.0.0.1:1"], prefill=["http://127.0.0.1:2"], decode=["http://127.0.0.1:3"])
    with pytest.raises(ConfigError, match="at least one prefill and at least one decode"):
        RouterArgs(prefill=["http://127.0.0.1:1"])
    with pytest.raises(ConfigError, match="at least one prefill and at least one decode"):
        RouterArgs(decode=["http://127.0.0.1:1"])
    with pytest.raises(ConfigError, match="at least one replica"):
        RouterArgs()
    with pytest.raises(ConfigError, match="URL"):
        RouterArgs(prefill=["http://127.0.0.1:1"], decode=["127.0.0.1:2"])
    with pytest.raises(ConfigError, match="prefill_timeout"):
        RouterArgs(prefill=["http://127.0.0.1:1"], decode=["http://127.0.0.1:2"], prefill_timeout=0)


def test_router_cli_disaggregated_arguments() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    router_cli.add_arguments(parser)
    args = parser.parse_args(
        ["--prefill", "http://a:1", "http://a:2", "--decode", "http://b:1", "--prefill", "http://a:3"]
    )
    assert args.prefill == ["http://a:1", "http://a:2", "http://a:3"] and args.decode == ["http://b:1"]
    assert args.replica == []
    # Both modes at once, or half of one: a clear error, exit status 1, before connecting anywhere.
    bad = parser.parse_args(["--replica", "http://a:1", "--prefill", "http://b:1", "--decode", "http://c:1"])
    assert router_cli.run(bad) == 1
    assert router_cli.run(parser.parse_args(["--decode", "http://c:1"])) == 1


def test_kv_transfer_configs() -> None:
    prefill, decode = kv_transfer_configs("gloo", {"lease_seconds": 5.0, "role": "both", "transport": "nixl"})
    assert prefill["role"] == "producer" and decode["role"] == "consumer"
    assert prefill["transport"] == decode["transport"] == "gloo"
    assert (decode["gloo_rank"], prefill["gloo_rank"]) == (0, 1), "decode is rank 0, the store's host"
    assert prefill["gloo_world_size"] == decode["gloo_world_size"] == 2
    assert prefill["gloo_init_method"] == decode["gloo_init_method"]
    assert prefill["gloo_init_method"].startswith("tcp://127.0.0.1:")
    assert prefill["lease_seconds"] == decode["lease_seconds"] == 5.0
    prefill, decode = kv_transfer_configs("nixl", {"gloo_rank": 3})
    assert not any(k.startswith("gloo_") for k in [*prefill, *decode])
    # The decode engine pulls only from its prefill engine's control address (a port of its own).
    assert prefill["control_port"] > 0 and prefill["control_host"] == "127.0.0.1"
    assert decode["allowed_producers"] == [f"tcp://127.0.0.1:{prefill['control_port']}"]
    assert "gloo_init_method" in kv_transfer_configs("auto")[0], "auto may resolve to gloo"
    with pytest.raises(ConfigError, match="kv_transport"):
        kv_transfer_configs("tcp")
    # What the engines will check (when this engine has the KV transfer config).
    if "kv_transfer_config" in {f.name for f in dataclasses.fields(EngineArgs)}:
        from pagedkv.distributed.transfer_config import KVTransferConfig

        for config in kv_transfer_configs("gloo", {"lease_seconds": 5.0}):
            KVTransferConfig.from_any(json.dumps(config))


def test_serve_disagg_passes_the_given_engine_flags_on() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    serve_cli.add_arguments(parser)
    given = [
        "--num-blocks",
        "64",
        "--no-enable-prefix-caching",
        "--dtype",
        "float32",
        "--gpu-memory-utilization",
        "0.5",
    ]
    args = parser.parse_args(["--disagg", "--kv-transport", "gloo", *given])
    assert args.disagg and args.kv_transport == "gloo"
    flags = serve_cli._engine_flags(args)
    assert sorted(flags) == sorted(given)
    # Parsed again (as each engine does), the flags give the same engine arguments.
    again = parser.parse_args(flags)
    assert serve_cli.engine_args_from(again, None) == serve_cli.engine_args_from(args, None)
    assert serve_cli._serve_flags(parser.parse_args(["--served-model-name", "a", "b"]))[-3:] == [
        "--served-model-name",
        "a",
        "b",
    ]
    # (--disagg --api-key K starts a deployment whose router's clients need K: the CLI test below.)
    assert serve_cli.run(parser.parse_args(["--disagg", "--kv-events-endpoint", "tcp://127.0.0.1:1"])) == 2


# ----------------------------------------------------------------------------- stand-in engines


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return _load_tokenizer(RouterArgs(["http://127.0.0.1:1"]))


KV_PARAMS = {"do_remote_prefill": True, "remote_engine_id": "p0", "remote_block_ids": [3, 4]}
SSE = b'data: {"choices": [{"text": "a"}]}\n\ndata: {"choices": [{"text": "b"}]}\n\ndata: [DONE]\n\n'


class Engines:
    """Stand-in engines behind one ``httpx.MockTransport``: hosts ``prefill0``, ``decode0``,
    ``decode1``... Records every request; the prefill answers as ``prefill_mode`` says."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, Any]] = []
        self.raw_bodies: list[bytes] = []  # as each engine received them
        self.prefill_mode = "kv"
        self.healthy = True
        self.prefill_started = asyncio.Event()
        self.prefill_cancelled = False

    def to(self, host_prefix: str) -> list[tuple[str, Any]]:
        return [(path, body) for host, path, body in self.calls if host.startswith(host_prefix)]

    async def handle(self, request: httpx.Request) -> httpx.Response:
        host, path = request.url.host, request.url.path
        body = json.loads(request.content) if request.content else None
        self.calls.append((host, path, body))
        self.raw_bodies.append(request.content)
        if path == "/health":
            return httpx.Response(200 if self.healthy or host != "decode0" else 503)
        if path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": host}]})
        if host.startswith("prefill"):
            return await self.prefill(request)
        if body.get("stream"):

            async def events() -> AsyncIterator[bytes]:  # as an engine sends them, one at a time
                for event in SSE.split(b"\n\n")[:-1]:
                    yield event + b"\n\n"

            return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=events())
        return httpx.Response(200, json={"decoded_by": host, "body": body})

    async def prefill(self, request: httpx.Request) -> httpx.Response:
        mode = self.prefill_mode
        if mode == "kv":
            return httpx.Response(200, json={"choices": [{"text": "x"}], "kv_transfer_params": KV_PARAMS})
        if mode == "null":
            return httpx.Response(200, json={"choices": [{"text": "x"}], "kv_transfer_params": None})
        if mode == "400":
            return httpx.Response(400, json={"error": {"message": "temperature must be >= 0", "code": 400}})
        if mode == "500":
            return httpx.Response(500, json={"error": {"message": "boom"}})
        if mode == "not_json":
            return httpx.Response(200, content=b"<html>")
        if mode == "down":
            raise httpx.ConnectError("connection refused", request=request)
        if mode == "timeout":
            raise httpx.ReadTimeout("timed out", request=request)
        assert mode == "hang"
        self.prefill_started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.prefill_cancelled = True
            raise
        raise AssertionError("unreachable")


def make_router(engines: Engines, tokenizer: Any, num_decode: int = 1, **kw: Any) -> tuple[Any, Router]:
    decode = [f"http://decode{i}:8000" for i in range(num_decode)]
    args = RouterArgs(prefill=["http://prefill0:8000"], decode=decode, **kw)
    router = Router(args, [Replica("http://prefill0:8000", 16)], tokenizer, [Replica(u, 16) for u in decode])
    router.client = httpx.AsyncClient(transport=httpx.MockTransport(engines.handle))
    return build_router_app(router), router


def client_of(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router", timeout=TIMEOUT)


def metrics_of(router: Router) -> dict[str, float]:
    return parse_metrics(router.render_metrics().decode())


def test_prefill_then_decode_with_the_prefills_kv(tokenizer: Any) -> None:
    engines = Engines()
    app, router = make_router(engines, tokenizer)
    body = {"prompt": "Tell me a story " * 8, "max_tokens": 20, "temperature": 0, "n": 2, "logprobs": 1}

    async def go() -> None:
        async with client_of(app) as http:
            r = await http.post(COMPLETIONS, json=body)
            assert r.status_code == 200, r.text
            assert r.headers["x-pagedkv-prefill"] == "http://prefill0:8000"
            assert r.headers["x-pagedkv-replica"] == "http://decode0:8000"
            assert "x-pagedkv-disagg-fallback" not in r.headers
            # The decode engine got the client's body and the prefill's params, verbatim.
            assert r.json()["body"] == {**body, "kv_transfer_params": KV_PARAMS}
            [(path, sent)] = engines.to("prefill")
            assert path == COMPLETIONS and sent == prefill_body(COMPLETIONS, body)
            # A stream: the prefill is not streamed, the decode's stream passes through as is.
            chat = {"messages": [{"role": "user", "content": "Hi"}], "stream": True, "max_completion_tokens": 9}
            async with http.stream("POST", CHAT, json=chat) as r:
                assert r.status_code == 200 and r.headers["x-pagedkv-prefill"] == "http://prefill0:8000"
                assert await r.aread() == SSE
            assert engines.to("prefill")[-1] == (CHAT, prefill_body(CHAT, chat))
            assert engines.to("decode")[-1] == (CHAT, {**chat, "kv_transfer_params": KV_PARAMS})

    run(go())
    m = metrics_of(router)
    assert m["pagedkv_router:disagg_requests_total{}"] == 2
    assert m["pagedkv_router:prefill_seconds_count{}"] == 2
    assert not any(k.startswith("pagedkv_router:disagg_fallbacks_total") for k in m)
    assert m["pagedkv_router:requests_total{replica=http://prefill0:8000}"] == 2
    assert m["pagedkv_router:requests_total{replica=http://decode0:8000}"] == 2
    assert m["pagedkv_router:prompt_tokens_total{}"] > 0, "the prefill engine was chosen on the tokenized prompt"
    assert all(v == 0 for k, v in m.items() if k.startswith("pagedkv_router:in_flight"))


def test_a_prefill_client_error_is_the_clients_answer(tokenizer: Any) -> None:
    engines = Engines()
    engines.prefill_mode = "400"
    app, router = make_router(engines, tokenizer)

    async def go() -> None:
        async with client_of(app) as http:
            r = await http.post(COMPLETIONS, json={"prompt": "x", "temperature": -1, "stream": True})
            assert r.status_code == 400
            assert r.json()["error"]["message"] == "temperature must be >= 0"
            assert r.headers["x-pagedkv-prefill"] == "http://prefill0:8000"

    run(go())
    assert engines.to("decode") == [], "a bad request is not decoded"
    assert not any(k.startswith("pagedkv_router:disagg_fallbacks") for k in metrics_of(router))


@pytest.mark.parametrize(
    ("mode", "reason"),
    [
        ("500", "server_error"),
        ("down", "unreachable"),
        ("timeout", "timeout"),
        ("not_json", "bad_answer"),
        ("null", "no_kv"),
    ],
)
def test_a_failed_prefill_falls_back_to_decoding_everything(tokenizer: Any, mode: str, reason: str) -> None:
    engines = Engines()
    engines.prefill_mode = mode
    app, router = make_router(engines, tokenizer)
    raw = b'{"prompt": "Once upon a time",  "max_tokens": 5}'  # sent as is: odd spacing kept

    async def go() -> None:
        async with client_of(app) as http:
            r = await http.post(COMPLETIONS, content=raw, headers={"content-type": "application/json"})
            assert r.status_code == 200, r.text
            assert r.headers["x-pagedkv-disagg-fallback"] == reason
            assert engines.raw_bodies[-1] == raw, "the original request as sent, without kv_transfer_params"
            assert ("x-pagedkv-prefill" in r.headers) == (mode == "null"), "only an engine that answered is named"

    run(go())
    assert len(engines.to("prefill")) == 1
    m = metrics_of(router)
    assert m[f"pagedkv_router:disagg_fallbacks_total{{reason={reason}}}"] == 1
    assert m["pagedkv_router:disagg_requests_total{}"] == 1
    assert all(v == 0 for k, v in m.items() if k.startswith("pagedkv_router:in_flight"))


def test_a_clients_kv_transfer_params_are_refused_unless_allowed(tokenizer: Any) -> None:
    # They name the address a decode engine connects to and the lease it claims: only the
    # router produces them. Refused before anything is forwarded; an explicit null is no claim.
    engines = Engines()
    app, _ = make_router(engines, tokenizer)

    async def go() -> None:
        async with client_of(app) as http:
            for path, body in (
                (COMPLETIONS, {"prompt": "x", "kv_transfer_params": {"do_remote_prefill": True}}),
                (COMPLETIONS, {"prompt": "x", "kv_transfer_params": {"do_remote_decode": True}}),
                (CHAT, {"messages": [{"role": "user", "content": "x"}], "kv_transfer_params": "yes"}),
            ):
                r = await http.post(path, json=body)
                assert r.status_code == 400, r.text
                assert r.json()["error"]["param"] == "kv_transfer_params"
            assert engines.calls == [], "nothing was forwarded"
            r = await http.post(COMPLETIONS, json={"prompt": "x", "kv_transfer_params": None})
            assert r.status_code == 200 and r.json()["decoded_by"] == "decode0"

    run(go())


def test_the_routers_health_names_a_thread_of_its_own_that_died(tokenizer: Any) -> None:
    from pagedkv.router.health import THREAD_NAME, HealthMonitor

    engines = Engines()
    app, router = make_router(engines, tokenizer)
    monitor = HealthMonitor(router.backends, router.args)
    # /health checks every engine through the monitor's own client, which cannot reach these
    # stand-ins: they are up as built, and stay so.
    monitor.check_all = lambda: None  # type: ignore[method-assign]

    def die() -> None:
        raise SystemExit("killed for the test")  # no guard catches it

    monitor.background.start(THREAD_NAME, die).join(TIMEOUT)
    router.health_monitor = monitor

    async def go() -> None:
        async with client_of(app) as http:
            r = await http.get("/health")
            # Still answering (200: the router routes without its checks), but not ok.
            assert r.status_code == 200 and r.json()["status"] == "degraded", r.text
            assert r.json()["dead"] == [THREAD_NAME]
            assert "SystemExit" in r.json()["threads"][THREAD_NAME]["died_of"]
            r = await http.post(COMPLETIONS, json={"prompt": "x"})
            assert r.status_code == 200, r.text

    try:
        run(go())
    finally:
        monitor.close()


def test_requests_that_skip_the_prefill(tokenizer: Any) -> None:
    engines = Engines()
    app, router = make_router(engines, tokenizer, allow_client_kv_transfer_params=True)
    several = {"prompt": ["first", "second"], "max_tokens": 2}
    prefilled = {"prompt": "x", "kv_transfer_params": {"do_remote_prefill": True}}

    async def go() -> None:
        async with client_of(app) as http:
            for body in (several, prefilled):
                r = await http.post(COMPLETIONS, json=body)
                assert r.status_code == 200 and r.json()["body"] == body
                assert "x-pagedkv-prefill" not in r.headers

    run(go())
    assert engines.to("prefill") == []
    m = metrics_of(router)
    assert m["pagedkv_router:disagg_direct_requests_total{reason=multi_prompt}"] == 1
    assert m["pagedkv_router:disagg_direct_requests_total{reason=has_kv_params}"] == 1
    assert m["pagedkv_router:disagg_requests_total{}"] == 0


def test_decode_engines_by_load_then_in_turn_and_other_routes(tokenizer: Any) -> None:
    engines = Engines()
    app, router = make_router(engines, tokenizer, num_decode=2)
    d0, d1 = router.decoders

    async def go() -> None:
        async with client_of(app) as http:
            seen = [(await http.post(COMPLETIONS, json={"prompt": "x"})).headers["x-pagedkv-replica"] for _ in range(4)]
            assert sorted(seen[:2]) == sorted(seen[2:]) == [d0.url, d1.url], "ties alternate"
            d0.in_flight = 3  # busy with someone else's requests
            for _ in range(3):
                assert (await http.post(COMPLETIONS, json={"prompt": "x"})).headers["x-pagedkv-replica"] == d1.url
            d0.in_flight = 0
            # Other routes: the decode engines answer /v1/models.
            assert (await http.get("/v1/models")).json()["data"][0]["id"] == "decode0"
            r = await http.get("/health")
            assert r.status_code == 200 and r.json()["status"] == "ok"
            assert [(e["role"], e["url"]) for e in r.json()["engines"]] == [
                ("prefill", "http://prefill0:8000"),
                ("decode", d0.url),
                ("decode", d1.url),
            ]
            # A decode engine that is down is routed around; the router is degraded, not down.
            d0.mark_down("stand-in failure")
            for _ in range(3):
                assert (await http.post(COMPLETIONS, json={"prompt": "x"})).headers["x-pagedkv-replica"] == d1.url
            assert (await http.get("/v1/models")).json()["data"][0]["id"] == "decode1"
            r = await http.get("/health")
            assert r.status_code == 200 and r.json()["status"] == "degraded"
            assert r.json()["engines"][1]["error"] == "stand-in failure"
            d1.mark_down("stand-in failure")  # no decode engine: nothing can be answered
            r = await http.get("/health")
            assert r.status_code == 503 and r.json()["status"] == "unavailable"
            assert "decode0" in r.json()["error"]["message"]
            assert (await http.post(COMPLETIONS, content=b"[1]")).status_code == 400

    run(go())


def test_a_client_that_leaves_during_the_prefill_cancels_it(tokenizer: Any) -> None:
    engines = Engines()
    engines.prefill_mode = "hang"
    app, router = make_router(engines, tokenizer)
    endpoint = next(r for r in app.routes if getattr(r, "path", None) == COMPLETIONS).endpoint

    async def go() -> None:
        gone = asyncio.Event()
        messages = [{"type": "http.request", "body": b'{"prompt": "x"}', "more_body": False}]

        async def receive() -> dict[str, Any]:
            if messages:
                return messages.pop(0)
            await gone.wait()
            return {"type": "http.disconnect"}

        scope = {"type": "http", "method": "POST", "path": COMPLETIONS, "headers": [], "query_string": b""}
        task = asyncio.ensure_future(endpoint(Request(scope, receive)))
        await engines.prefill_started.wait()
        assert router.replicas[0].in_flight == 1
        gone.set()
        response = await asyncio.wait_for(task, 10)
        assert response.status_code == 499
        assert engines.prefill_cancelled, "the prefill's connection was closed (the engine aborts it)"
        assert router.replicas[0].in_flight == 0

    run(go())
    assert engines.to("decode") == []


# ----------------------------------------------------------------------------- end to end


ENGINE_FLAGS = [
    "--num-blocks",
    "64",
    "--block-size",
    "16",
    "--max-model-len",
    "512",
    "--dtype",
    "float32",
    "--device",
    "cpu",
]
ENV = {"OMP_NUM_THREADS": "1"}
# About 90 tokens: several full blocks to transfer, and a partial one.
PROMPT = (
    "The history of the lighthouse begins in the ancient world, where fires were lit on hills "
    "to guide ships home. Later, towers of stone carried the flame higher, and lenses made it "
    "visible from far out at sea. Today the keeper's job"
)
MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant who answers in one short paragraph."},
    {"role": "user", "content": "Why do lighthouses use lenses instead of just bigger fires?"},
]


@pytest.fixture(scope="module")
def plain(tiny_model: str) -> Iterator[ServerProcess]:
    with ServerProcess(["--model", tiny_model, *ENGINE_FLAGS], env=ENV, start_timeout=120) as server:
        yield server


@pytest.fixture(scope="module", params=TRANSPORTS)
def deployment(request: pytest.FixtureRequest, tiny_model: str) -> Iterator[DisaggDeployment]:
    # A decode engine that cannot pull the KV computes the prompt itself (and counts a failed
    # load): the tests read the decode engine's load counters to see that the KV came over.
    config = {"kv_load_failure_policy": "recompute", "handshake_timeout": 2.0, "transfer_timeout": 10.0}
    with start_disagg(
        model=tiny_model,
        engine_flags=ENGINE_FLAGS,
        kv_transport=request.param,
        kv_transfer_config=config,
        env=ENV,
        start_timeout=120,
    ) as dep:
        yield dep


def metric(url: str, name: str) -> float:
    """The sum of an engine's metric ``name`` over its labels."""
    m = parse_metrics(httpx.get(url + "/metrics", timeout=TIMEOUT).text)
    return sum(v for k, v in m.items() if k.split("{")[0] == name)


def settle(url: str, name: str, value: float) -> None:
    """Waits until the engine's metric reaches ``value`` (stats are read between steps)."""
    deadline = time.monotonic() + TIMEOUT
    while metric(url, name) != value:
        assert time.monotonic() < deadline, f"{name} != {value}"
        time.sleep(0.05)


def engine_prefill(http: httpx.Client, url: str, prompt: str) -> dict[str, Any]:
    """What the router sends the prefill engine: the KV transfer parameters of its answer."""
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "kv_transfer_params": {"do_remote_decode": True}}
    r = http.post(url + COMPLETIONS, json=body)
    assert r.status_code == 200, r.text
    params = r.json()["kv_transfer_params"]
    assert params["do_remote_prefill"] is True
    return dict(params)


def engine_decode(http: httpx.Client, url: str, prompt: str, params: dict[str, Any] | None) -> str:
    """What the router sends the decode engine (with the prefill's parameters, or none)."""
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": 10, "temperature": 0}
    if params is not None:
        body["kv_transfer_params"] = params
    r = http.post(url + COMPLETIONS, json=body)
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["text"])


def _text(answer: dict[str, Any]) -> str:
    choice = answer["choices"][0]
    return str(choice["message"]["content"] if "message" in choice else choice["text"])


def _streamed_text(http: httpx.Client, url: str, body: dict[str, Any]) -> tuple[str, httpx.Headers]:
    parts = []
    with http.stream("POST", url, json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"]
                if choice:
                    parts.append(choice[0].get("text") or (choice[0].get("delta") or {}).get("content") or "")
        return "".join(parts), r.headers


@pytest.mark.slow
def test_e2e_disaggregated_greedy_outputs_equal_a_plain_server(
    deployment: DisaggDeployment, plain: ServerProcess
) -> None:
    requests = [
        (COMPLETIONS, {"prompt": PROMPT, "max_tokens": 12, "temperature": 0}),
        (CHAT, {"messages": MESSAGES, "max_completion_tokens": 12, "temperature": 0}),
    ]
    loads_before = metric(deployment.decode_url, "pagedkv:kv_loads_ok_total")
    with httpx.Client(timeout=TIMEOUT) as http:
        for path, body in requests:
            expected = http.post(plain.url + path, json=body)
            assert expected.status_code == 200, expected.text
            r = http.post(deployment.url + path, json=body)
            assert r.status_code == 200, r.text
            assert r.headers["x-pagedkv-prefill"] == deployment.prefill_url
            assert r.headers["x-pagedkv-replica"] == deployment.decode_url
            assert "x-pagedkv-disagg-fallback" not in r.headers, "the decode engine got the prefill's KV"
            assert _text(r.json()) == _text(expected.json()), path
            streamed, headers = _streamed_text(http, deployment.url + path, {**body, "stream": True})
            assert headers["x-pagedkv-prefill"] == deployment.prefill_url
            assert streamed == _text(expected.json()), path
        # A bad request is refused by the prefill engine; the client gets its 400.
        r = http.post(deployment.url + COMPLETIONS, json={"prompt": PROMPT, "temperature": -1.0})
        assert r.status_code == 400, r.text
        assert r.headers["x-pagedkv-prefill"] == deployment.prefill_url
        m = parse_metrics(http.get(deployment.url + "/metrics").text)
    assert m["pagedkv_router:disagg_requests_total{}"] == 5
    assert m["pagedkv_router:prefill_seconds_count{}"] == 4
    assert not any(k.startswith("pagedkv_router:disagg_fallbacks_total") for k in m)
    # The decode engine pulled the KV of both prompts (the streamed repeats may hit its own
    # prefix cache instead) and never had to compute a prompt for a failed pull.
    assert metric(deployment.decode_url, "pagedkv:kv_loads_ok_total") >= loads_before + 2
    assert metric(deployment.decode_url, "pagedkv:kv_loads_failed_total") == 0


@pytest.mark.slow
def test_e2e_the_engines_answer_only_the_router_and_pull_over_http(deployment: DisaggDeployment) -> None:
    """The engines driven directly, the way the router drives them."""
    p, d = deployment.prefill_url, deployment.decode_url
    # The engines answer only the deployment's router (and whoever holds its engine key).
    for url in (p, d):
        r = httpx.post(url + COMPLETIONS, json={"prompt": PROMPT, "max_tokens": 1}, timeout=TIMEOUT)
        assert r.status_code == 401, r.text
    with httpx.Client(timeout=TIMEOUT, headers=deployment.engine_headers()) as http:
        info = http.get(d + "/kv_cache_info").json()["kv_transfer"]
        assert info["role"] == "consumer"
        assert http.get(p + "/kv_cache_info").json()["kv_transfer"]["control_address"].startswith("tcp://127.0.0.1:")

        http.post(d + "/reset_prefix_cache")
        loads, blocks = metric(d, "pagedkv:kv_loads_ok_total"), metric(d, "pagedkv:kv_blocks_pulled_total")
        expired = metric(p, "pagedkv:kv_leases_expired_total")
        prompt = PROMPT + " Direct:"
        params = engine_prefill(http, p, prompt)
        pulled = engine_decode(http, d, prompt, params)
        assert metric(d, "pagedkv:kv_loads_ok_total") == loads + 1
        # Every full block but one holding the last prompt token (computed here for its logits).
        assert metric(d, "pagedkv:kv_blocks_pulled_total") == blocks + (params["remote_num_tokens"] - 1) // 16
        settle(p, "pagedkv:kv_leases", 0)  # released by the reader, not expired
        assert metric(p, "pagedkv:kv_leases_expired_total") == expired
        http.post(d + "/reset_prefix_cache")
        assert engine_decode(http, d, prompt, None) == pulled  # computed here: the same text

        # Bad kv_transfer_params are 400s, on both sides; the engines keep serving.
        bad = [
            (p, {"prompt": prompt, "kv_transfer_params": {"do_remote_decode": True}, "stream": True}),
            (p, {"prompt": [prompt, prompt], "kv_transfer_params": {"do_remote_decode": True}}),
            (p, {"prompt": prompt, "kv_transfer_params": {"bogus": 1}}),
            (p, {"prompt": prompt, "kv_transfer_params": "yes"}),
            (d, {"prompt": prompt, "kv_transfer_params": {"do_remote_decode": True}}),  # not a producer
            (d, {"prompt": prompt + " other", "kv_transfer_params": params}),  # another prompt's KV
        ]
        for url, body in bad:
            r = http.post(url + COMPLETIONS, json=body)
            assert r.status_code == 400, (body, r.text)


@pytest.mark.slow
def test_e2e_prefill_engine_down_falls_back(deployment: DisaggDeployment, plain: ServerProcess) -> None:
    from pagedkv.router.app import create_router_app

    body = {"prompt": PROMPT + " Second try:", "max_tokens": 8, "temperature": 0}
    expected = _text(httpx.post(plain.url + COMPLETIONS, json=body, timeout=TIMEOUT).json())
    args = RouterArgs(
        prefill=[deployment.prefill_url], decode=[deployment.decode_url], engine_api_key=deployment.engine_api_key
    )
    app = create_router_app(args)
    router = app.state.router
    # The prefill engine stops answering after the router started: nothing listens there now.
    router.replicas[0].url = f"http://127.0.0.1:{free_port()}"

    async def go() -> None:
        try:
            async with client_of(app) as http:
                r = await http.post(COMPLETIONS, json=body)
                assert r.status_code == 200, r.text
                assert r.headers["x-pagedkv-disagg-fallback"] == "unreachable"
                assert _text(r.json()) == expected
                m = parse_metrics((await http.get("/metrics")).text)
                assert m["pagedkv_router:disagg_fallbacks_total{reason=unreachable}"] == 1
        finally:
            await router.close()

    run(go())


@pytest.mark.slow
def test_e2e_a_killed_prefill_engine_does_not_stop_the_deployment(deployment: DisaggDeployment) -> None:
    # After the other tests on this deployment: it kills the prefill engine while it holds a
    # lease (SIGKILL to its whole process group).
    d = deployment.decode_url
    engine_http = httpx.Client(timeout=TIMEOUT, headers=deployment.engine_headers())
    with engine_http, httpx.Client(timeout=TIMEOUT) as http:
        engine_http.post(d + "/reset_prefix_cache")
        expected = engine_decode(engine_http, d, PROMPT, None)
        failed = metric(d, "pagedkv:kv_loads_failed_total")
        params = engine_prefill(engine_http, deployment.prefill_url, PROMPT)
        killed = deployment.prefill
        killed.signal(signal.SIGKILL)
        killed.wait(TIMEOUT)
        # The router finds the prefill engine gone: requests fall back to the decode engine.
        for i in range(4):
            r = http.post(deployment.url + COMPLETIONS, json={"prompt": f"{PROMPT} ({i})", "max_tokens": 3})
            assert r.status_code == 200, r.text
            assert r.headers["x-pagedkv-disagg-fallback"] == "unreachable"
        assert deployment.exited() is None, "the decode engine and the router keep serving"
        health = http.get(deployment.url + "/health")
        assert health.status_code == 200 and health.json()["status"] == "degraded"
        # The lease the dead engine held: the pull fails and the decode engine computes the
        # prompt; the request gets its answer and no block is left behind.
        engine_http.post(d + "/reset_prefix_cache")
        assert engine_decode(engine_http, d, PROMPT, params) == expected
        assert metric(d, "pagedkv:kv_loads_failed_total") == failed + 1
        settle(d, "vllm:kv_cache_usage_perc", 0)
        settle(d, "pagedkv:kv_requests_waiting_for_remote", 0)
        keeper = deployment.prefill_keeper
        if not keeper.restart:  # gloo: a new producer cannot join the decode engine's group
            assert "gloo" in keeper.why_not and deployment.prefill is killed
            return
        # NIXL: the prefill engine comes back on its port and the router prefills with it again.
        deadline = time.monotonic() + 300
        while keeper.restarts == 0 or http.get(deployment.url + "/health").json()["status"] != "ok":
            assert time.monotonic() < deadline, "the prefill engine did not come back"
            time.sleep(0.5)
        r = http.post(deployment.url + COMPLETIONS, json={"prompt": PROMPT, "max_tokens": 3})
        assert r.status_code == 200 and "x-pagedkv-disagg-fallback" not in r.headers, r.headers
        assert r.headers["x-pagedkv-prefill"] == deployment.prefill_url


@pytest.mark.slow
def test_e2e_serve_disagg_cli_stops_its_processes_on_sigterm(tiny_model: str) -> None:
    port = free_port()
    with tempfile.NamedTemporaryFile(prefix="pagedkv-disagg-cli-", suffix=".log", delete=False) as log:
        log_path = Path(log.name)
    cmd = [sys.executable, "-m", "pagedkv", "serve", "--disagg", "--kv-transport", "gloo", "--port", str(port)]
    cmd += ["--api-key", "client-key"]  # the router's clients' key; the engines get their own
    cmd += ["--model", tiny_model]
    with log_path.open("wb") as out:
        proc = subprocess.Popen(
            [*cmd, *ENGINE_FLAGS],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **ENV},
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300  # three processes start on a loaded machine
        while True:
            assert proc.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, log_path.read_text()
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        body = {"prompt": PROMPT, "max_tokens": 3}
        assert httpx.post(url + COMPLETIONS, json=body, timeout=TIMEOUT).status_code == 401
        key = {"Authorization": "Bearer client-key"}
        r = httpx.post(url + COMPLETIONS, json=body, headers=key, timeout=TIMEOUT)
        assert r.status_code == 200 and "x-pagedkv-prefill" in r.headers, r.text
        engines = [r.headers["x-pagedkv-prefill"], r.headers["x-pagedkv-replica"]]
        for engine_url in engines:  # nobody goes around the router, not even with the client's key
            assert httpx.post(engine_url + COMPLETIONS, json=body, headers=key, timeout=TIMEOUT).status_code == 401
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log_path.read_text()
        for engine_url in [url, *engines]:
            with pytest.raises(httpx.ConnectError):
                httpx.get(engine_url + "/health", timeout=5)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        # The command keeps its processes' logs and prints where: remove them.
        for line in log_path.read_text(errors="replace").splitlines():
            if "logs: " in line:
                for entry in line.split("logs: ", 1)[1].split(", "):
                    Path(entry.split(" ", 1)[-1]).unlink(missing_ok=True)
        log_path.unlink(missing_ok=True)
