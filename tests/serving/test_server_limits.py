"""`pagedkv serve` against a hostile client: every request that used to take the server down
(a huge ``n``, huge bodies and prompts, huge ``logprobs``, a request chat template that
builds gigabytes, slowloris connections, a list of thousands of prompts) gets a bounded 4xx/503
with OpenAI's error body, and the server answers a normal request right after. Plus the start-up
log and the end of open streams past the shutdown timeout.

One real server (the embedded SmolLM2 on the CPU) with small limits, so each abuse is cheap to
send; its last test stops it with SIGTERM. Waits are bounded; nothing asserts a duration.
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from pagedkv.errors import ConfigError, InvalidArgumentError  # noqa: E402
from pagedkv.server.chat_template import render_request_template  # noqa: E402
from pagedkv.server.launch import ServerProcess  # noqa: E402
from pagedkv.server.limits import ServerLimits, add_limit_arguments, limit_flags, limits_from  # noqa: E402
from pagedkv.server.metrics import parse_metrics  # noqa: E402

MAX_MODEL_LEN = 256
MAX_NUM_SEQS = 4
MAX_LOGPROBS = 5
MAX_BODY = 64 * 1024
MAX_PROMPT_CHARS = 2000
MAX_PROMPTS = 8
MAX_QUEUED = 6
MAX_CONNECTIONS = 16
HEADER_TIMEOUT = 1.0
TEMPLATE_TIMEOUT = 2.0
FLAGS = [
    "--dtype", "float32", "--device", "cpu", "--block-size", "16", "--num-blocks", "96",
    "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", str(MAX_NUM_SEQS),
    "--max-logprobs", str(MAX_LOGPROBS), "--max-queued-requests", str(MAX_QUEUED),
    "--max-request-body-bytes", str(MAX_BODY), "--max-prompt-chars", str(MAX_PROMPT_CHARS),
    "--max-prompts-per-request", str(MAX_PROMPTS), "--max-connections", str(MAX_CONNECTIONS),
    "--header-timeout", str(HEADER_TIMEOUT), "--trust-request-chat-template",
    "--chat-template-timeout", str(TEMPLATE_TIMEOUT), "--shutdown-timeout", "1", "--log-level", "info",
]  # fmt: skip
TIMEOUT = 60.0
LONE_SURROGATE = json.loads('"\\ud800"')  # valid JSON, not valid Unicode


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with ServerProcess(FLAGS, start_timeout=120) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Any:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=TIMEOUT)


def post(server: ServerProcess, path: str, body: Any) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.url + path, content=content, headers={"Content-Type": "application/json"}, timeout=TIMEOUT)


def error_of(r: httpx.Response, status: int) -> dict[str, Any]:
    """The OpenAI error body of a response that must have ``status``."""
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and error["type"] and isinstance(error["code"], str), error
    return dict(error)


def still_serving(client: Any) -> None:
    out = client.completions.create(model=None, prompt="Still serving?", max_tokens=2, temperature=0)
    assert out.usage.completion_tokens == 2


def chat(content: str = "Hi", **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": content}], "max_tokens": 2, **extra}


# ---------------------------------------------------------------------------- the limits themselves


def test_limits_are_checked_and_round_trip_through_their_flags() -> None:
    for bad in (
        {"max_request_body_bytes": 0},
        {"max_prompt_chars": -1},
        {"max_connections": True},
        {"header_timeout": 0},
        {"body_timeout": -1.0},
        {"chat_template_timeout": float("inf")},
        {"trust_request_chat_template": "yes"},
    ):
        with pytest.raises(ConfigError):
            ServerLimits(**bad)  # type: ignore[arg-type]
    parser = argparse.ArgumentParser()
    add_limit_arguments(parser)
    assert limits_from(parser.parse_args([])) == ServerLimits()
    given = [
        "--max-prompt-chars",
        "99",
        "--header-timeout",
        "2.5",
        "--body-timeout",
        "7",
        "--trust-request-chat-template",
    ]
    limits = limits_from(parser.parse_args(given))
    assert (limits.max_prompt_chars, limits.header_timeout, limits.trust_request_chat_template) == (99, 2.5, True)
    assert limits.body_timeout == 7.0
    # What `serve --disagg` passes on to each engine: the same limits.
    assert limits_from(parser.parse_args(limit_flags(parser.parse_args(given)))) == limits


# ---------------------------------------------------------------------------- 24: start-up log


def test_startup_log_names_model_dtype_kv_pool_tiers_and_limits(server: ServerProcess) -> None:
    log = server.log_tail(200_000)
    assert "serving model SmolLM2-135M-Instruct (embedded)" in log, log
    assert "dtype float32 on cpu, max_model_len 256, max_num_seqs 4, max_logprobs 5; layers: 30 full" in log, log
    block_bytes = 2 * 30 * 3 * 64 * 4 * 16  # K and V x layers x KV heads x head_dim x float32 x block
    assert f"KV cache: dtype float32, block size 16, 96 blocks x {block_bytes} B" in log, log
    assert "(1536 tokens)" in log and "host tier: none; disk tier: none" in log, log
    assert f"body {MAX_BODY} bytes, {MAX_PROMPT_CHARS} prompt characters" in log, log
    assert "request chat templates trusted" in log, log
    assert "CPU kernel paths: linear float32 " in log and "; attention " in log, log


# ---------------------------------------------------------------------------- 4: n


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "n": 1_000_000_000}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "n": MAX_NUM_SEQS + 1}),
        ("/v1/chat/completions", chat(n=1_000_000_000)),
        ("/v1/completions", {"prompt": "hi", "use_beam_search": True, "n": 1_000_000_000}),
    ],
    ids=["completions", "just-over", "chat", "beam"],
)
def test_n_over_max_num_seqs_is_refused_before_any_sample_exists(
    server: ServerProcess, client: Any, path: str, body: dict[str, Any]
) -> None:
    error = error_of(post(server, path, body), 400)
    assert error["param"] == "n" and "max_num_seqs = 4" in error["message"], error
    still_serving(client)


# ---------------------------------------------------------------------------- 5: body and prompt size


def test_body_over_the_limit_gets_413_before_it_is_read(server: ServerProcess, client: Any) -> None:
    # Headers announcing 50 MB and only the first KiB sent: the answer comes before the rest.
    with socket.create_connection((server.host, server.port), timeout=TIMEOUT) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 50000000\r\n\r\n" + b'{"prompt": "' + b"A" * 1024
        )
        response = _read_until_closed(s)
    head, _, body = response.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), head
    assert json.loads(body)["error"]["code"] == "request_entity_too_large"
    # The same through the openai client: a 5 MB prompt is a 413 it reports.
    with pytest.raises(openai.APIStatusError) as caught:
        client.completions.create(model=None, prompt="A" * 5_000_000, max_tokens=1)
    assert caught.value.status_code == 413 and "max_request_body_bytes" in str(caught.value)
    still_serving(client)


def test_chunked_body_is_cut_off_at_the_limit(server: ServerProcess, client: Any) -> None:
    # No Content-Length: the server counts as it reads and answers once past the limit; the
    # client's later pieces are never needed (a generator that would send 50 MB).
    sent = 0

    def body() -> Iterator[bytes]:
        nonlocal sent
        yield b'{"prompt": "'
        for _ in range(50 * 1024):
            sent += 1024
            yield b"A" * 1024

    try:
        r = httpx.post(server.url + "/v1/completions", content=body(), timeout=TIMEOUT)
        error_of(r, 413)
    except (httpx.WriteError, httpx.RemoteProtocolError, httpx.ReadError):
        pass  # the server closed the connection while the client was still sending
    assert sent < 50 * 1024 * 1024
    still_serving(client)


def test_slow_body_gets_408(server: ServerProcess) -> None:
    with socket.create_connection((server.host, server.port), timeout=TIMEOUT) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
        head = _read_until_closed(s).partition(b"\r\n")[0]
    assert head.startswith(b"HTTP/1.1 408"), head


def test_prompt_over_max_prompt_chars_is_refused_before_tokenizing(server: ServerProcess, client: Any) -> None:
    # The surrogate would make tokenizing fail: the character limit answers first.
    long_prompt = "A" * MAX_PROMPT_CHARS + LONE_SURROGATE
    for path, body, param in [
        ("/v1/completions", {"prompt": long_prompt, "max_tokens": 2}, "prompt"),
        ("/v1/completions", {"prompt": ["hi", long_prompt], "max_tokens": 2}, "prompt"),
        ("/v1/chat/completions", chat(long_prompt), "messages"),
        ("/tokenize", {"prompt": long_prompt}, "prompt"),
    ]:
        error = error_of(post(server, path, body), 400)
        assert error["param"] == param and "max_prompt_chars = 2000" in error["message"], error
    still_serving(client)


# ---------------------------------------------------------------------------- 6: logprobs


def test_logprobs_over_max_logprobs_are_refused(server: ServerProcess, client: Any) -> None:
    error = error_of(post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "logprobs": 49152, "n": 4}), 400)
    assert error["param"] == "logprobs" and "max_logprobs = 5" in error["message"], error
    error = error_of(post(server, "/v1/chat/completions", chat(logprobs=True, top_logprobs=49152)), 400)
    assert error["param"] == "top_logprobs", error
    # At the limit it is served, with that many alternatives per token.
    out = client.completions.create(prompt="hi", model=None, max_tokens=2, logprobs=MAX_LOGPROBS, temperature=0)
    assert all(len(top) == MAX_LOGPROBS for top in out.choices[0].logprobs.top_logprobs)


# ---------------------------------------------------------------------------- 7: request chat templates


@pytest.mark.parametrize(
    "template,expected",
    [
        ("{{ 'A' * 100000000 }}", "repeated a value"),
        ("{{ 'A'|center(100000000) }}", "passed the number"),
        ("{% set ns = namespace(s='AB') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", "limit"),
        ("{{ ''.__class__.__mro__ }}", "cannot render"),
        (
            "{% for a in range(1999) %}{% for b in range(1999) %}{% for c in range(1999) %}{% endfor %}{% endfor %}"
            "{% endfor %}",
            "took more than",
        ),
    ],
    ids=["repeat", "center", "doubling", "escape", "endless-loop"],
)
def test_request_chat_template_is_bounded(server: ServerProcess, client: Any, template: str, expected: str) -> None:
    error = error_of(post(server, "/v1/chat/completions", chat(chat_template=template)), 400)
    assert expected in error["message"], error
    still_serving(client)


def test_request_chat_template_renders_like_the_tokenizers(server: ServerProcess) -> None:
    from pathlib import Path

    from pagedkv.worker.model_files import resolve_model

    own = (Path(resolve_model(None)) / "chat_template.jinja").read_text()  # the tokenizer's template
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    default = post(server, "/tokenize", {"messages": messages}).json()
    sent = post(server, "/tokenize", {"messages": messages, "chat_template": own}).json()
    assert sent["tokens"] == default["tokens"] and default["count"] > 5


def test_request_template_stops_when_its_client_leaves() -> None:
    cancel, started = threading.Event(), threading.Event()
    loops = "{% for a in range(999) %}{% for b in range(999) %}{% for c in range(999) %}{% endfor %}{% endfor %}{% endfor %}"
    result: list[BaseException] = []

    def render() -> None:
        try:
            variables = {"messages": [], "started": lambda: started.set() or ""}
            render_request_template("{{ started() }}" + loops, variables, max_size=1000, timeout=3600, cancel=cancel)
        except InvalidArgumentError as exc:
            result.append(exc)

    worker = threading.Thread(target=render)
    worker.start()
    assert started.wait(TIMEOUT)  # the template's loops are running
    cancel.set()  # what the handler does when the client disconnects
    worker.join(TIMEOUT)
    assert not worker.is_alive() and "client left" in str(result[0]), result


# ---------------------------------------------------------------------------- 9: many prompts


def test_many_prompts_are_refused_before_tokenizing(server: ServerProcess, client: Any) -> None:
    # Each prompt would fail to tokenize (a lone surrogate): the count is checked first.
    bad = "x" + LONE_SURROGATE
    error = error_of(post(server, "/v1/completions", {"prompt": [bad] * 5000, "max_tokens": 1}), 400)
    assert error["param"] == "prompt" and "max_prompts_per_request = 8" in error["message"], error
    # Within that limit but over the queue's room: 503 before any is tokenized.
    error = error_of(post(server, "/v1/completions", {"prompt": [bad] * (MAX_QUEUED + 1), "max_tokens": 1}), 503)
    assert error["code"] == "server_overloaded" and "max_queued_requests=6" in error["message"], error
    still_serving(client)


# ---------------------------------------------------------------------------- 15: error bodies


def test_json_error_param_is_not_an_offset_and_codes_are_strings(server: ServerProcess) -> None:
    error = error_of(post(server, "/v1/completions", b'{"prompt": "x", '), 400)
    assert error["param"] is None and "not valid JSON at character" in error["message"], error
    error_of(post(server, "/v1/completions", {"prompt": "x", "model": "nope"}), 404)
    error_of(post(server, "/v1/completions", {"prompt": "x", "max_tokens": "5"}), 400)
    error_of(httpx.get(server.url + "/nowhere", timeout=TIMEOUT), 404)


@pytest.mark.parametrize("stop", [LONE_SURROGATE, ["ok", "a" + LONE_SURROGATE]])
def test_lone_surrogate_in_stop_is_refused_like_in_a_prompt(server: ServerProcess, stop: Any) -> None:
    error = error_of(post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2, "stop": stop}), 400)
    assert error["param"] == "stop" and "not valid Unicode" in error["message"], error
    prompt_error = error_of(post(server, "/v1/completions", {"prompt": LONE_SURROGATE, "max_tokens": 2}), 400)
    assert "not valid Unicode" in prompt_error["message"]


# ---------------------------------------------------------------------------- 8: slowloris


def test_partial_header_connections_are_closed_and_others_served(server: ServerProcess, client: Any) -> None:
    before = closed_connections(server, "header_timeout")
    held = [_partial_headers(server) for _ in range(MAX_CONNECTIONS // 2)]
    try:
        still_serving(client)  # while they hang
        for s in held:
            assert _read_until_closed(s) == b""  # closed by the server (else recv times out)
    finally:
        for s in held:
            s.close()
    assert closed_connections(server, "header_timeout") - before >= len(held)
    still_serving(client)


def test_connections_over_the_cap_are_closed_at_once(server: ServerProcess, client: Any) -> None:
    before = closed_connections(server, "max_connections")
    held = [_partial_headers(server) for _ in range(MAX_CONNECTIONS + 8)]
    try:
        for s in held:
            _read_until_closed(s)
    finally:
        for s in held:
            s.close()
    assert closed_connections(server, "max_connections") - before >= 8
    assert "connections are open (max_connections): closing new ones" in server.log_tail(1_000_000)
    still_serving(client)


def closed_connections(server: ServerProcess, reason: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=TIMEOUT).text
    return parse_metrics(text)[f"pagedkv:http_connections_closed_total{{reason={reason}}}"]


def _partial_headers(server: ServerProcess) -> socket.socket:
    s = socket.create_connection((server.host, server.port), timeout=TIMEOUT)
    try:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
    except OSError:
        pass  # already closed by the cap
    return s


def _read_until_closed(s: socket.socket) -> bytes:
    """Everything the server sends until it closes (a timeout raises: never closed)."""
    data = b""
    while True:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            return data
        if not chunk:
            return data
        data += chunk


# ---------------------------------------------------------------------------- 14: shutdown (last: stops the server)


def test_stream_past_shutdown_timeout_ends_with_error_event_and_done(server: ServerProcess) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=TIMEOUT) as r:
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        server.signal(signal.SIGTERM)
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]", rest[-3:]
    error = json.loads(rest[-2].removeprefix("data: "))["error"]
    assert error["code"] == "server_shutting_down" and "shutdown timeout" in error["message"], error
    assert server.wait(TIMEOUT) in (0, -signal.SIGTERM), server.log_tail()
    log = server.log_tail(1_000_000)
    assert "ended 1 running requests with an error" in log, log
    assert "the engine is shut down: 0 requests unfinished, 0 KV blocks in use" in log, log
