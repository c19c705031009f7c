"""`pagedkv serve` end to end: the real server in a subprocess on a loopback port, driven by the
official ``openai`` client and by raw HTTP, as a server operator would break it.

One server (the embedded SmolLM2, float32 on the CPU, an API key, KV events on) serves most
tests; a second, tiny one (one sequence at a time, a queue limit) serves the overload and
graceful-shutdown tests. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
zmq = pytest.importorskip("zmq")
pytest.importorskip("fastapi")

from pagedkv._core import block_hashes  # noqa: E402
from pagedkv.server.kv_events import BlockRemoved, BlockStored, decode_event_batch  # noqa: E402
from pagedkv.server.launch import ServerProcess, free_port  # noqa: E402
from pagedkv.server.metrics import parse_metrics  # noqa: E402

API_KEY = "test-key"
MODEL_NAME = "smol"
BLOCK_SIZE = 16
MAX_MODEL_LEN = 512
NUM_BLOCKS = 160
MAX_NUM_SEQS = 6
ENGINE_FLAGS = [
    "--dtype", "float32", "--device", "cpu", "--block-size", str(BLOCK_SIZE), "--num-blocks", str(NUM_BLOCKS),
    "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", str(MAX_NUM_SEQS), "--log-level", "warning",
]  # fmt: skip
TIMEOUT = 60.0
# A prompt of several full blocks (prefix-cache and event tests).
LONG_PROMPT = "The history of the printing press begins in the fifteenth century, when " * 6


@pytest.fixture(scope="module")
def events_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def replay_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def server(events_port: int, replay_port: int) -> Iterator[ServerProcess]:
    args = [
        *ENGINE_FLAGS,
        "--served-model-name", MODEL_NAME,
        "--api-key", API_KEY,
        "--kv-events-endpoint", f"tcp://127.0.0.1:{events_port}",
        "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{replay_port}",
    ]  # fmt: skip
    with ServerProcess(args) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Any:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=TIMEOUT)


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}


def metrics(url: str) -> dict[str, float]:
    """``/metrics`` as {"name{label=value,...}": value}."""
    return parse_metrics(httpx.get(url + "/metrics", timeout=TIMEOUT).text)


def wait_idle(url: str, timeout: float = TIMEOUT) -> dict[str, float]:
    """Poll ``/metrics`` until no request runs or waits and no KV block is in use."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        idle = (
            m["vllm:num_requests_running{}"] == 0
            and m["vllm:num_requests_waiting{}"] == 0
            and m["vllm:kv_cache_usage_perc{}"] == 0
        )
        if idle or time.monotonic() > deadline:
            assert idle, {k: v for k, v in m.items() if "num_requests" in k or "usage" in k}
            return m
        time.sleep(0.1)


# ---------------------------------------------------------------------------- basics


def test_health_models_version(server: ServerProcess, client: Any) -> None:
    assert httpx.get(server.url + "/health", timeout=TIMEOUT).status_code == 200
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert models.data[0].max_model_len == MAX_MODEL_LEN
    assert httpx.get(server.url + "/version", timeout=TIMEOUT).json()["version"]


def test_completion_greedy_stream_equals_whole(client: Any) -> None:
    whole = client.completions.create(model=MODEL_NAME, prompt="The capital of France is", max_tokens=12, temperature=0)
    choice = whole.choices[0]
    assert choice.finish_reason in ("stop", "length") and choice.text
    assert whole.usage.completion_tokens <= 12 and whole.usage.prompt_tokens > 0
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    chunks = list(
        client.completions.create(
            model=MODEL_NAME, prompt="The capital of France is", max_tokens=12, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason


def test_chat_stream_and_whole(client: Any) -> None:
    messages = [{"role": "user", "content": "Name three colors."}]
    whole = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=16, temperature=0)
    text = whole.choices[0].message.content
    assert whole.choices[0].message.role == "assistant" and text
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,
        max_completion_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_n_and_seeds(client: Any) -> None:
    kwargs = dict(model=MODEL_NAME, prompt="Once upon a time", max_tokens=10, temperature=1.0, n=3)
    a = client.completions.create(seed=1234, **kwargs)
    b = client.completions.create(seed=1234, **kwargs)
    c = client.completions.create(seed=99, **kwargs)
    assert sorted(ch.index for ch in a.choices) == [0, 1, 2]
    texts = lambda r: [ch.text for ch in sorted(r.choices, key=lambda ch: ch.index)]
    assert texts(a) == texts(b), "the same seed must give the same completions"
    assert texts(a) != texts(c)
    assert len(set(texts(a))) > 1, "the n samples of one seeded request use different generators"
    assert 3 <= a.usage.completion_tokens <= 3 * 10, "usage counts the tokens of every choice"
    # Two prompts x n = 2: indices count across prompts.
    two = client.completions.create(model=MODEL_NAME, prompt=["Hello", "Goodbye"], max_tokens=4, n=2, seed=5)
    assert sorted(ch.index for ch in two.choices) == [0, 1, 2, 3]


def test_stop_string(client: Any) -> None:
    base = client.completions.create(
        model=MODEL_NAME,
        prompt="Count: one, two, three,",
        max_tokens=24,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    words = base.choices[0].text.split()
    assert len(words) >= 3, base.choices[0].text
    stop = words[2]
    cut = client.completions.create(
        model=MODEL_NAME, prompt="Count: one, two, three,", max_tokens=24, temperature=0, stop=[stop]
    )
    choice = cut.choices[0]
    assert choice.finish_reason == "stop" and stop not in choice.text
    assert base.choices[0].text.startswith(choice.text)
    assert choice.model_extra.get("stop_reason") == stop


def test_logprobs(client: Any) -> None:
    out = client.completions.create(model=MODEL_NAME, prompt="Paris is", max_tokens=5, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == out.usage.completion_tokens
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 3 and chosen <= 0.0
        assert max(top.values()) == pytest.approx(chosen, abs=1e-4), "greedy picks the top token"
    assert "".join(lp.tokens) == out.choices[0].text
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob for t in content)


def test_streamed_logprobs_equal_the_whole_response(client: Any) -> None:
    kwargs = dict(model=MODEL_NAME, prompt="The moon is", max_tokens=6, temperature=0, logprobs=2)
    whole = client.completions.create(**kwargs).choices[0].logprobs
    chunks = [c.choices[0].logprobs for c in client.completions.create(stream=True, **kwargs) if c.choices]
    assert [t for lp in chunks for t in lp.tokens] == whole.tokens
    assert [o for lp in chunks for o in lp.text_offset] == whole.text_offset
    assert [t for lp in chunks for t in lp.top_logprobs] == whole.top_logprobs


def test_cached_tokens_on_repeated_prompt(client: Any) -> None:
    first = client.completions.create(model=MODEL_NAME, prompt=LONG_PROMPT + " first", max_tokens=2)
    second = client.completions.create(model=MODEL_NAME, prompt=LONG_PROMPT + " second", max_tokens=2)
    shared_blocks = (first.usage.prompt_tokens - 4) // BLOCK_SIZE
    assert shared_blocks >= 3
    assert second.usage.prompt_tokens_details.cached_tokens >= (shared_blocks - 1) * BLOCK_SIZE


def test_cache_salt_separates_prefix_caches(client: Any) -> None:
    prompt = "Tenants must not share KV blocks across salts, said the operator. " * 5
    first = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1, extra_body={"cache_salt": "a"})
    other = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1, extra_body={"cache_salt": "b"})
    same = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1, extra_body={"cache_salt": "a"})
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert other.usage.prompt_tokens_details.cached_tokens == 0, "another salt must not hit tenant a's blocks"
    assert same.usage.prompt_tokens_details.cached_tokens >= BLOCK_SIZE * 3


def test_min_tokens_and_priority(client: Any) -> None:
    out = client.completions.create(
        model=MODEL_NAME, prompt="Hi", max_tokens=6, temperature=0, extra_body={"min_tokens": 6, "priority": 3}
    )
    assert out.usage.completion_tokens == 6 and out.choices[0].finish_reason == "length"


def test_raw_http_sse(server: ServerProcess) -> None:
    body = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 4, "stream": True, "temperature": 0}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=auth(), timeout=TIMEOUT) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert all(c["object"] == "text_completion" and c["model"] == MODEL_NAME for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_tokenize_detokenize(server: ServerProcess) -> None:
    r = httpx.post(server.url + "/tokenize", json={"prompt": "Hello world"}, headers=auth(), timeout=TIMEOUT).json()
    assert r["count"] == len(r["tokens"]) > 0 and r["max_model_len"] == MAX_MODEL_LEN
    back = httpx.post(server.url + "/detokenize", json={"tokens": r["tokens"]}, headers=auth(), timeout=TIMEOUT)
    assert "Hello world" in back.json()["prompt"]
    chat = httpx.post(
        server.url + "/tokenize",
        json={"messages": [{"role": "user", "content": "Hi"}]},
        headers=auth(),
        timeout=TIMEOUT,
    ).json()
    assert chat["count"] > 3


# ---------------------------------------------------------------------------- bad input


def _post(server: ServerProcess, path: str, body: Any, headers: dict[str, str] | None = None) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(
        server.url + path,
        content=content,
        headers={"Content-Type": "application/json", **(auth() if headers is None else headers)},
        timeout=TIMEOUT,
    )


BAD_REQUESTS = [
    ("malformed json", "/v1/completions", b'{"prompt": "x", ', 400),
    ("wrong type", "/v1/completions", {"prompt": "x", "max_tokens": "5"}, 400),
    ("n = 0", "/v1/completions", {"prompt": "x", "n": 0}, 400),
    ("negative temperature", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "temperature": -1}, 400),
    ("prompt too long", "/v1/completions", {"prompt": list(range(100, 100 + MAX_MODEL_LEN + 1))}, 400),
    ("prompt + max_tokens too long", "/v1/completions", {"prompt": "x", "max_tokens": MAX_MODEL_LEN}, 400),
    ("bad token id", "/v1/completions", {"prompt": [1, 2, 10**9]}, 400),
    ("bad stop token id", "/v1/completions", {"prompt": "x", "stop_token_ids": [10**9]}, 400),
    ("empty messages", "/v1/chat/completions", {"messages": []}, 400),
    ("penalty out of range", "/v1/completions", {"prompt": "x", "presence_penalty": 2.5}, 400),
    ("stream_options without stream", "/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400),
    ("bad detokenize id", "/detokenize", {"tokens": [-1]}, 400),
    ("beam search streamed", "/v1/completions", {"prompt": "x", "use_beam_search": True, "n": 2, "stream": True}, 400),
    ("beam search with temperature", "/v1/completions", {"prompt": "x", "use_beam_search": True, "temperature": 0.7}, 400),
    ("beam search with logprobs", "/v1/completions", {"prompt": "x", "use_beam_search": True, "logprobs": 2}, 400),
    ("beam search with stop strings", "/v1/completions", {"prompt": "x", "use_beam_search": True, "stop": ["."]}, 400),
    ("beam width above max_num_seqs", "/v1/completions", {"prompt": "x", "use_beam_search": True, "n": MAX_NUM_SEQS + 1}, 400),
    ("nan length_penalty", "/v1/completions", b'{"prompt": "x", "use_beam_search": true, "length_penalty": NaN}', 400),
    ("lone surrogate in stop", "/v1/completions", b'{"prompt": "x", "stop": ["a\\ud800"]}', 400),
    ("request chat_template not trusted", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ 'x' }}"}, 400),
    ("unknown model", "/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404),
    ("unknown model chat", "/v1/chat/completions", {"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404),
    ("unknown path", "/v1/embeddings", {"input": "x"}, 404),
]  # fmt: skip


@pytest.mark.parametrize("name,path,body,status", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_request_gets_openai_error(server: ServerProcess, name: str, path: str, body: Any, status: int) -> None:
    r = _post(server, path, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and error["type"], error
    assert isinstance(error["code"], str), error  # always a string, whatever the path
    if name == "malformed json":
        assert error["param"] is None, error  # not a character offset


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}])
def test_api_key_required(server: ServerProcess, headers: dict[str, str]) -> None:
    r = _post(server, "/v1/completions", {"prompt": "x", "max_tokens": 1}, headers=headers)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(server.url + "/health", timeout=TIMEOUT).status_code == 200  # open paths stay open
    unauthorized = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0, timeout=TIMEOUT)
    with pytest.raises(openai.AuthenticationError):
        unauthorized.models.list()


def test_bad_requests_leave_server_serving(server: ServerProcess, client: Any) -> None:
    for _, path, body, _ in BAD_REQUESTS:
        _post(server, path, body)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL_NAME, prompt="x", n=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="missing", prompt="x")
    ok = client.completions.create(model=MODEL_NAME, prompt="Still there?", max_tokens=3)
    assert ok.choices[0].text is not None
    wait_idle(server.url)


def test_beam_search_choices_are_the_engines_beams(server: ServerProcess, client: Any) -> None:
    # vLLM's extra fields: n is the beam width; the choices are the beams, best first.
    from pagedkv import LLM, BeamSearchParams

    prompt, width, max_tokens = "The three largest cities of Japan are", 3, 8
    r = client.completions.create(
        model=MODEL_NAME,
        prompt=prompt,
        n=width,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"use_beam_search": True, "ignore_eos": True},
    )
    local = LLM(
        dtype="float32", device="cpu", block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, max_model_len=MAX_MODEL_LEN
    )
    expected = local.beam_search(prompt, BeamSearchParams(beam_width=width, max_tokens=max_tokens, ignore_eos=True))
    assert [c.index for c in r.choices] == list(range(width))
    assert [c.text for c in r.choices] == [s.text for s in expected[0].sequences]
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.completion_tokens == width * max_tokens
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Name a fruit."}],
        n=2,
        max_tokens=6,
        extra_body={"use_beam_search": True},
    )
    assert len(chat.choices) == 2 and all(c.message.content for c in chat.choices)
    wait_idle(server.url)


# ---------------------------------------------------------------------------- cancellation


def test_disconnect_mid_stream_frees_blocks(server: ServerProcess) -> None:
    body = {"prompt": LONG_PROMPT, "max_tokens": 400, "stream": True, "extra": None}
    body.pop("extra")
    body["ignore_eos"] = True
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=auth(), timeout=TIMEOUT) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        received = 0
        for line in lines:
            if line.startswith("data: "):
                received += 1
            if received >= 3:
                break
        m = metrics(server.url)
        assert m["vllm:num_requests_running{}"] == 1 and m["vllm:kv_cache_usage_perc{}"] > 0
    # The connection is closed: the request is aborted and its blocks are back.
    m = wait_idle(server.url)
    assert m["vllm:request_success_total{finished_reason=abort}"] >= 1


async def _disconnect_while_queued(url: str) -> None:
    headers = auth()
    long_body = {"prompt": "Tell me a long story.", "max_tokens": 300, "ignore_eos": True, "stream": True}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=TIMEOUT) as http:
        # Fill every running slot with streams that have produced a token.
        streams = []
        for _ in range(MAX_NUM_SEQS):
            cm = http.stream("POST", "/v1/completions", json=long_body)
            response = await cm.__aenter__()
            lines = response.aiter_lines()
            while not (await lines.__anext__()).startswith("data: "):
                pass
            # Keep the line iterator alive: collecting it would close the response (a disconnect).
            streams.append((cm, lines))
        # One more, not streamed: it waits in the queue.
        queued = asyncio.ensure_future(http.post("/v1/completions", json={"prompt": "Queued", "max_tokens": 5}))
        deadline = time.monotonic() + TIMEOUT
        while metrics(url)["vllm:num_requests_waiting{}"] < 1:
            assert time.monotonic() < deadline, "the extra request never queued"
            await asyncio.sleep(0.05)
        queued.cancel()  # the client gives up while queued: the connection closes
        with pytest.raises(asyncio.CancelledError):
            await queued
        deadline = time.monotonic() + TIMEOUT
        while metrics(url)["vllm:num_requests_waiting{}"] != 0:
            assert time.monotonic() < deadline, "the queued request was not aborted"
            await asyncio.sleep(0.05)
        assert metrics(url)["vllm:num_requests_running{}"] == MAX_NUM_SEQS
        for cm, _ in streams:
            await cm.__aexit__(None, None, None)


def test_disconnect_while_queued(server: ServerProcess) -> None:
    asyncio.run(asyncio.wait_for(_disconnect_while_queued(server.url), 3 * TIMEOUT))
    wait_idle(server.url)


# ---------------------------------------------------------------------------- KV events


def _router_hashes(token_ids: list[int]) -> list[int]:
    """What a KV-aware router computes for a prompt: the wire hashes of its full blocks."""
    return block_hashes(token_ids, BLOCK_SIZE)


def _await_subscription(sub: Any, client: Any) -> None:
    """PUB/SUB drops what is published before a subscription reaches the publisher: send small
    requests of their own until one batch arrives, then drain what is queued."""
    deadline = time.monotonic() + TIMEOUT
    i = 0
    while not sub.poll(500):
        assert time.monotonic() < deadline, "no KV event batch reached the subscriber"
        client.completions.create(model=MODEL_NAME, prompt=f"Subscription probe {i}: " * 8, max_tokens=1)
        i += 1
    while sub.poll(200):
        sub.recv_multipart()


def test_kv_events_stored_removed_and_replay(
    server: ServerProcess, client: Any, events_port: int, replay_port: int
) -> None:
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(f"tcp://127.0.0.1:{events_port}")
    try:
        _await_subscription(sub, client)
        prompt = "A unique prompt about kv events and routers, " * 5
        ids = httpx.post(server.url + "/tokenize", json={"prompt": prompt}, headers=auth(), timeout=TIMEOUT).json()[
            "tokens"
        ]
        expected = _router_hashes(ids)
        assert len(expected) >= 3
        client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2)
        stored: list[int] = []
        seqs = []
        deadline = time.monotonic() + TIMEOUT
        while not set(expected) <= set(stored):
            assert time.monotonic() < deadline, f"stored {stored}, expected {expected}"
            if sub.poll(1000):
                _, seq, payload = sub.recv_multipart()
                seqs.append(int.from_bytes(seq, "big"))
                for event in decode_event_batch(payload).events:
                    if isinstance(event, BlockStored) and event.medium == "GPU":
                        assert event.block_size == BLOCK_SIZE
                        assert len(event.token_ids) == BLOCK_SIZE * len(event.block_hashes)
                        stored.extend(event.block_hashes)
        assert seqs == sorted(seqs)
        # Evict them: fill the pool with other prompts.
        removed: list[int] = []
        filler = [f"Filler number {i} " * 60 for i in range(12)]
        for i in range(0, len(filler), 3):
            client.completions.create(model=MODEL_NAME, prompt=filler[i : i + 3], max_tokens=1)
        deadline = time.monotonic() + TIMEOUT
        while not set(expected) & set(removed):
            assert time.monotonic() < deadline, "no BlockRemoved for the evicted prompt"
            if sub.poll(1000):
                _, seq, payload = sub.recv_multipart()
                seqs.append(int.from_bytes(seq, "big"))
                for event in decode_event_batch(payload).events:
                    if isinstance(event, BlockRemoved):
                        removed.extend(event.block_hashes)
    finally:
        sub.close()
    # A late subscriber replays everything still buffered from sequence 0.
    replay = ctx.socket(zmq.DEALER)
    replay.setsockopt(zmq.LINGER, 0)
    replay.connect(f"tcp://127.0.0.1:{replay_port}")
    try:
        replay.send_multipart([b"", (0).to_bytes(8, "big")])
        replayed = []
        while True:
            assert replay.poll(int(TIMEOUT * 1000)), "replay did not answer"
            _, seq, payload = replay.recv_multipart()
            if not payload:
                assert int.from_bytes(seq, "big", signed=True) == -1
                break
            replayed.append(int.from_bytes(seq, "big"))
        assert replayed[: len(seqs)] == list(range(len(replayed)))[: len(seqs)]
        assert set(seqs) <= set(replayed)
    finally:
        replay.close()
        ctx.term()


# ---------------------------------------------------------------------------- overload and shutdown


def test_queue_limit_and_graceful_shutdown() -> None:
    args = [*ENGINE_FLAGS, "--max-num-seqs", "1", "--max-queued-requests", "2", "--log-level", "info"]
    with ServerProcess(args) as proc:
        asyncio.run(asyncio.wait_for(_overload(proc.url), 3 * TIMEOUT))
        wait_idle(proc.url)
        # SIGTERM with a stream in flight: the server finishes it, then exits cleanly.
        body = {"prompt": "Bye", "max_tokens": 20, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", proc.url + "/v1/completions", json=body, timeout=TIMEOUT) as r:
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            proc.signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        # uvicorn re-raises the signal once it has shut down, so the exit status says SIGTERM.
        assert proc.wait(TIMEOUT) in (0, -signal.SIGTERM), proc.log_tail()
        log = proc.log_tail(20_000)
        assert "the engine is shut down: 0 requests unfinished, 0 KV blocks in use" in log, log
        assert "Finished server process" in log, log


async def _overload(url: str) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as http:
        body = {"prompt": "Running", "max_tokens": 200, "ignore_eos": True, "stream": True}
        cm = http.stream("POST", "/v1/completions", json=body)
        response = await cm.__aenter__()
        lines = response.aiter_lines()
        while not (await lines.__anext__()).startswith("data: "):
            pass
        waiting = [
            asyncio.ensure_future(http.post("/v1/completions", json={"prompt": f"Wait {i}", "max_tokens": 2}))
            for i in range(2)
        ]
        deadline = time.monotonic() + TIMEOUT
        while metrics(url)["vllm:num_requests_waiting{}"] < 2:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        over = await http.post("/v1/completions", json={"prompt": "One too many", "max_tokens": 2})
        assert over.status_code == 503, over.text
        assert over.json()["error"]["code"] == "server_overloaded"
        await cm.__aexit__(None, None, None)  # the running stream goes away; the waiting ones run
        for task in waiting:
            assert (await task).status_code == 200
