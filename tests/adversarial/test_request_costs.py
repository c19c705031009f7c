"""Attacks 3, 7 and 8, and two lower ones: requests whose cost the client chooses.

Each was a request that stopped a server for everyone: 300,000 stop strings de-duplicated in
quadratic time on the event loop; 1.5 M ``allowed_token_ids`` with ``n = 16`` rebuilt at every
step; 100,000 ``bad_words`` tokenized on the engine thread; a huge ``logit_bias``;
``/detokenize`` of 2 M ids on the event loop; a 12 MB history in ``tool_calls[].arguments``
that ``max_prompt_chars`` did not count; a body dripping one byte at a time. Now each is
refused with a 400 naming its field (or a 408) before any work, bounded lists within the
limits (pagedkv.sample.limits) are built once per request and cost the honest client nothing,
and ``parallel_tool_calls: false`` gives the same calls streamed or not.

One real server (the embedded SmolLM2 on the CPU, a small pool, dev mode); every attack runs
through the harness beside an honest greedy client (its text unchanged, ``/health`` ok, no block
lost). The payloads are as large as the issue's; nothing asserts a duration.
"""

from __future__ import annotations

import json
import random
import select
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

pytest.importorskip("fastapi")

from harness import Attacks, error_of, post_json  # noqa: E402

from pagedkv.sample.limits import MAX_BAD_WORDS, MAX_STOP_CHARS, MAX_STOP_STRINGS  # noqa: E402
from pagedkv.server.launch import ServerProcess  # noqa: E402

VOCAB = 49152  # SmolLM2's LM head
MAX_MODEL_LEN = 512
BODY_TIMEOUT = 3.0
FLAGS = [
    "--dtype", "float32", "--device", "cpu", "--block-size", "16", "--num-blocks", "128",
    "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "16", "--body-timeout", str(BODY_TIMEOUT),
]  # fmt: skip
PROMPT = "Write a short poem about the sea:"


def completion(server: ServerProcess, **fields: Any) -> httpx.Response:
    return post_json(server.url + "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, **fields})


def refused(r: httpx.Response, param: str, *words: str) -> None:
    """``r`` is OpenAI's 400 naming ``param``, its message saying ``words``."""
    error = error_of(r, 400)
    assert error["param"] == param, error
    for word in words:
        assert word in error["message"], error


def test_300k_stop_strings_are_refused_and_the_bounded_ones_served(server: ServerProcess, attacks: Attacks) -> None:
    def attack() -> list[httpx.Response]:
        return [
            completion(server, stop=[f"stop-{i}" for i in range(300_000)]),  # the 300,000
            completion(server, stop=["x" * 100] * 200),  # few, but 20,000 characters
            # Within the bounds: served (every string searched for at every step, duplicates once).
            completion(server, stop=[f"never-{i}" for i in range(MAX_STOP_STRINGS - 1)] + ["never-0"]),
        ]

    many, long, bounded = attacks.run("stop-strings", attack).result
    refused(many, "stop", "300000 strings", str(MAX_STOP_STRINGS))
    refused(long, "stop", "20000 characters", str(MAX_STOP_CHARS))
    assert bounded.status_code == 200, bounded.text


def test_allowed_token_ids_are_bounded_and_built_once(server: ServerProcess, attacks: Attacks) -> None:
    rng = random.Random(0)
    everything = list(range(VOCAB))
    rng.shuffle(everything)

    def attack() -> list[httpx.Response]:
        huge = [rng.randrange(VOCAB) for _ in range(1_500_000)]  # the 1.5 M ids, n = 16
        return [
            completion(server, n=16, allowed_token_ids=huge),
            completion(server, allowed_token_ids=[5, VOCAB + 7]),  # an id outside the vocabulary
        ]

    report = attacks.run("allowed-token-ids-1.5M", attack)
    huge, outside = report.result
    refused(huge, "allowed_token_ids", "1500000 ids", str(VOCAB))
    refused(outside, "allowed_token_ids", str(VOCAB + 7))

    # A legitimate list as long as the vocabulary, n = 16 samples, beside the honest client: its
    # mask is built once (in a worker thread) and shared by the 16 rows at every step.
    def legit() -> httpx.Response:
        return completion(server, n=16, max_tokens=8, temperature=1.0, seed=3, allowed_token_ids=everything)

    r = attacks.run("allowed-token-ids-whole-vocabulary", legit).result
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 16
    # A short list is obeyed: greedy over two tokens, whatever the model prefers.
    only = tokens(server, " yes no")
    text = completion(server, max_tokens=6, temperature=0.0, allowed_token_ids=only).json()["choices"][0]["text"]
    assert set(text.split()) <= {"yes", "no"}, text


def tokens(server: ServerProcess, text: str) -> list[int]:
    r = post_json(server.url + "/tokenize", {"prompt": text, "add_special_tokens": False})
    assert r.status_code == 200, r.text
    return list(r.json()["tokens"])


def test_100k_bad_words_are_refused_and_the_bounded_ones_served(server: ServerProcess, attacks: Attacks) -> None:
    def attack() -> list[httpx.Response]:
        return [
            completion(server, bad_words=[f"word{i}" for i in range(100_000)]),
            completion(server, bad_words=["w" * 20_000]),
            # Within the bounds: tokenized once, in a worker thread, when the request is added.
            completion(server, max_tokens=8, bad_words=[f"bad{i}" for i in range(MAX_BAD_WORDS)]),
        ]

    many, long, bounded = attacks.run("bad-words-100k", attack).result
    refused(many, "bad_words", "100000 words", str(MAX_BAD_WORDS))
    refused(long, "bad_words", "20000 characters")
    assert bounded.status_code == 200, bounded.text


def test_huge_logit_bias_is_refused(server: ServerProcess, attacks: Attacks) -> None:
    def attack() -> list[httpx.Response]:
        return [
            completion(server, logit_bias={str(i): 1.0 for i in range(200_000)}),
            completion(server, logit_bias={str(VOCAB + 1): 5.0}),
            # As many entries as the vocabulary: one indexed add per step, values clamped to 100.
            completion(server, max_tokens=8, logit_bias={str(i): (500.0 if i == 11 else 0.5) for i in range(VOCAB)}),
        ]

    many, outside, whole = attacks.run("logit-bias-200k", attack).result
    refused(many, "logit_bias", "200000 entries", str(VOCAB))
    refused(outside, "logit_bias", str(VOCAB + 1))
    assert whole.status_code == 200, whole.text


def test_detokenize_of_2m_ids_is_refused(server: ServerProcess, attacks: Attacks) -> None:
    def attack() -> list[httpx.Response]:
        return [
            post_json(server.url + "/detokenize", {"tokens": [1000] * 2_000_000}),
            post_json(server.url + "/detokenize", {"tokens": [1000] * MAX_MODEL_LEN}),
        ]

    huge, bounded = attacks.run("detokenize-2M", attack).result
    refused(huge, "tokens", "2000000 ids", f"max_model_len = {MAX_MODEL_LEN}")
    assert bounded.status_code == 200 and bounded.json()["prompt"], bounded.text


def call(name: str, arguments: str) -> dict[str, Any]:
    return {"id": "call_1", "type": "function", "function": {"name": name, "arguments": arguments}}


def test_tool_call_history_and_tools_count_against_max_prompt_chars(server: ServerProcess, attacks: Attacks) -> None:
    history = json.dumps({"notes": "x" * 12_000_000})  # the 12 MB of arguments
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}

    def attack() -> list[httpx.Response]:
        url = server.url + "/v1/chat/completions"
        return [
            post_json(
                url,
                {
                    "messages": [
                        {"role": "user", "content": "hi"},
                        {"role": "assistant", "content": None, "tool_calls": [call("get_weather", history)]},
                        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
                    ],
                    "max_tokens": 2,
                },
            ),
            # A tool's description and schema are rendered into the prompt too.
            post_json(
                url,
                {
                    "messages": [{"role": "user", "content": "hi"}],
                    "tools": [{**weather, "function": {**weather["function"], "description": "d" * 3_000_000}}],
                    "max_tokens": 2,
                },
            ),
            # So is a tool's result, and any other field a message carries.
            post_json(
                url,
                {
                    "messages": [
                        {"role": "user", "content": "hi"},
                        {"role": "tool", "tool_call_id": "c" * 3_000_000, "content": "sunny"},
                    ],
                    "max_tokens": 2,
                },
            ),
            # 20,000 small messages: the count stops at the limit.
            post_json(url, {"messages": [{"role": "user", "content": "hello there"}] * 20_000, "max_tokens": 2}),
        ]

    arguments, tools, other_field, many = attacks.run("tool-call-arguments-12MB", attack).result
    for r, param in ((arguments, "messages"), (tools, "tools"), (other_field, "messages"), (many, "messages")):
        refused(r, param, "max_prompt_chars")
        assert r.json()["error"]["code"] == "context_length_exceeded"


def drip(server: ServerProcess, interval: float = 0.4) -> tuple[bytes, bool, int]:
    """Headers, then a body of 1,000 bytes sent one byte per ``interval`` seconds (each within
    the idle timeout) until the server answers: (its status line, whether it then closed the
    connection, bytes sent)."""
    sock = socket.create_connection((server.host, server.port), timeout=30)
    sent = 0
    received = b""
    try:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")
        sock.sendall(b"Content-Length: 1000\r\n\r\n")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            readable, _, _ = select.select([sock], [], [], interval)
            if readable:
                break
            try:
                sock.sendall(b" ")
                sent += 1
            except OSError:
                break
        closed = False
        while time.monotonic() < deadline:
            chunk = sock.recv(65536)
            if not chunk:
                closed = True
                break
            received += chunk
    except OSError:
        closed = True  # reset after the answer
    finally:
        sock.close()
    return received.partition(b"\r\n")[0], closed, sent


def test_a_dripping_body_gets_408_at_the_body_deadline(server: ServerProcess, attacks: Attacks) -> None:
    status, closed, sent = attacks.run("dripping-body", lambda: drip(server)).result
    assert status.startswith(b"HTTP/1.1 408"), status
    assert closed
    assert sent < 1000  # cut off long before the body was complete


# The model's whole answer, forced by a choice constraint: two hermes calls after some text.
TWO_CALLS = (
    'Sure.<tool_call>{"name":"add","arguments":{"a":1,"b":2}}</tool_call>'
    '<tool_call>{"name":"get_weather","arguments":{"city":"Oslo"}}</tool_call>'
)
TOOLS = [
    {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
]


def chat_calls(server: ServerProcess, parallel: bool, stream: bool) -> tuple[list[tuple[str, Any]], str]:
    """The calls ((name, arguments as JSON)) and the content of a chat answer whose text is
    TWO_CALLS, streamed or not."""
    body = {
        "messages": [{"role": "user", "content": "Add 1 and 2, and the weather in Oslo."}],
        "tools": TOOLS,
        "parallel_tool_calls": parallel,
        "structured_outputs": {"choice": [TWO_CALLS]},
        "temperature": 0.0,
        "max_tokens": 160,
        "stream": stream,
    }
    r = post_json(server.url + "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    if not stream:
        message = r.json()["choices"][0]["message"]
        calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]]
        return calls, (message["content"] or "").strip()
    names: dict[int, str] = {}
    arguments: dict[int, str] = {}
    content = ""
    for line in r.text.splitlines():
        if not line.startswith("data: {"):
            continue
        for choice in json.loads(line[6:])["choices"]:
            content += choice["delta"].get("content") or ""
            for delta in choice["delta"].get("tool_calls") or []:
                if "id" in delta:
                    names[delta["index"]] = delta["function"]["name"]
                arguments[delta["index"]] = arguments.get(delta["index"], "") + delta["function"]["arguments"]
    return [(names[i], json.loads(arguments[i])) for i in sorted(names)], content.strip()


def test_parallel_tool_calls_false_gives_the_same_call_streamed_or_not(server: ServerProcess) -> None:
    # The three answers are generated together (one batch), each the same text.
    with ThreadPoolExecutor(3) as pool:
        whole, streamed, parallel = pool.map(
            lambda args: chat_calls(server, *args), [(False, False), (False, True), (True, False)]
        )
    first = [("add", {"a": 1, "b": 2})]
    assert whole == streamed == (first, "Sure.")
    assert parallel == ([*first, ("get_weather", {"city": "Oslo"})], "Sure.")
