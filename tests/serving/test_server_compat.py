"""`pagedkv serve` as the tools people point at it use the API: penalties,
``logit_bias``, ``allowed_token_ids``, ``bad_words``; ``echo`` + ``logprobs`` (lm-eval's
loglikelihood requests) and vLLM's ``prompt_logprobs``; vLLM's leniency (unknown fields,
``null``, content-part lists); the small endpoints clients probe; and bad values of all these
refused with a 400 naming the field while the server goes on serving.

One real server (the tiny random Qwen2 with the embedded tokenizer, float32 on the CPU, an API
key), driven by the ``openai`` client and raw HTTP. Logprobs are checked against transformers'
forward pass of the same checkpoint, penalties against a greedy loop over it written here.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from pagedkv.server.launch import ServerProcess  # noqa: E402
from pagedkv.server.metrics import parse_metrics  # noqa: E402
from pagedkv.worker.model_files import default_model_dir  # noqa: E402

API_KEY = "compat-key"
MODEL_NAME = "tiny"
MAX_MODEL_LEN = 256
MAX_LOGPROBS = 5
TIMEOUT = 60.0
PROMPT = "The history of the printing press begins in"
CHAT = [{"role": "user", "content": "Say something about printing."}]


@pytest.fixture(scope="module")
def server(tiny_model: str) -> Iterator[ServerProcess]:
    args = [
        "--model", tiny_model, "--tokenizer", str(default_model_dir()), "--served-model-name", MODEL_NAME,
        "--dtype", "float32", "--device", "cpu", "--block-size", "16", "--num-blocks", "64",
        "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "4", "--max-logprobs", str(MAX_LOGPROBS),
        "--api-key", API_KEY, "--log-level", "warning",
    ]  # fmt: skip
    with ServerProcess(args, start_timeout=120) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Any:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return transformers.AutoTokenizer.from_pretrained(default_model_dir())


@pytest.fixture(scope="module")
def hf_model(tiny_model: str) -> Any:
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


def post(server: ServerProcess, path: str, body: Any, *, key: str | None = API_KEY) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    return httpx.post(server.url + path, content=content, headers=headers, timeout=TIMEOUT)


def ok(r: httpx.Response) -> dict[str, Any]:
    assert r.status_code == 200, r.text
    return dict(r.json())


def prompt_logprobs_of(hf_model: Any, ids: list[int]) -> list[float]:
    """transformers' logprob of each prompt token given the ones before it (from the second)."""
    with torch.inference_mode():
        logits = hf_model(torch.tensor([ids])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return [logprobs[i - 1, ids[i]].item() for i in range(1, len(ids))]


def assert_no_block_held(url: str) -> None:
    """Poll ``/metrics`` (bounded) until no request runs and no KV block is in use."""
    deadline = time.monotonic() + TIMEOUT
    while True:
        m = parse_metrics(httpx.get(url + "/metrics", timeout=TIMEOUT).text)
        busy = {k: v for k, v in m.items() if k in ("vllm:num_requests_running{}", "vllm:kv_cache_usage_perc{}") and v}
        if not busy or time.monotonic() > deadline:
            assert not busy, busy
            return
        time.sleep(0.1)


# ---------------------------------------------------------------------------- echo and logprobs


def test_lm_eval_loglikelihood_request_matches_transformers(
    server: ServerProcess, tokenizer: Any, hf_model: Any
) -> None:
    # lm-eval's local-completions body for loglikelihood / multiple-choice tasks.
    prompts = [tokenizer(PROMPT).input_ids, tokenizer("One two three four").input_ids]
    body = {"prompt": prompts, "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0, "seed": 1234}
    answer = ok(post(server, "/v1/completions", body))
    assert answer["object"] == "text_completion"
    assert [c["index"] for c in answer["choices"]] == [0, 1]
    for ids, choice in zip(prompts, answer["choices"]):
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids) + 1
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        want = prompt_logprobs_of(hf_model, ids)
        assert lp["token_logprobs"][1 : len(ids)] == pytest.approx(want, abs=1e-4)
        # Text offsets: characters of the returned text (the echoed prompt first).
        text = choice["text"]
        assert text.startswith(tokenizer.decode(ids))
        assert lp["text_offset"][0] == 0
        for i in range(len(ids)):
            assert text[lp["text_offset"][i] :].startswith(lp["tokens"][i])
        # lm-eval's is_greedy reads the top-1 dict; the generated (greedy) token is its top one.
        for top in lp["top_logprobs"][1:]:
            assert len(top) == 1
        assert max(lp["top_logprobs"][-1].values()) == pytest.approx(lp["token_logprobs"][-1])
    usage = answer["usage"]
    assert usage["prompt_tokens"] == sum(map(len, prompts)) and usage["completion_tokens"] == 2
    assert usage["prompt_tokens_details"] is not None


def test_echo_with_max_tokens_zero_returns_the_prompt_alone(client: Any, tokenizer: Any, hf_model: Any) -> None:
    ids = tokenizer(PROMPT).input_ids
    answer = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=0, echo=True, logprobs=2)
    choice = answer.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert len(choice.logprobs.tokens) == len(ids)
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(prompt_logprobs_of(hf_model, ids), abs=1e-4)
    assert all(len(top) == 2 for top in choice.logprobs.top_logprobs[1:])
    assert answer.usage.completion_tokens == 0 and answer.usage.total_tokens == len(ids)
    # Without echo there is nothing to return: refused, as vLLM does.
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=0)
    assert refused.value.body["param"] == "max_tokens"


def test_streamed_echo_logprobs_equal_the_whole_answer(client: Any) -> None:
    kwargs = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 5, "temperature": 0, "echo": True, "logprobs": 1}
    whole = client.completions.create(**kwargs).choices[0]
    chunks = list(
        client.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}
        )
    )
    pieces = [c for c in chunks if c.choices]
    assert pieces[0].choices[0].text.startswith(PROMPT)  # the prompt comes with the first chunk
    assert "".join(c.choices[0].text for c in pieces) == whole.text
    streamed = {"tokens": [], "token_logprobs": [], "text_offset": [], "top_logprobs": []}
    for c in pieces:
        for name, values in streamed.items():
            values.extend(getattr(c.choices[0].logprobs, name))
    assert streamed == whole.logprobs.model_dump(include=set(streamed))
    # continuous_usage_stats: usage on every chunk, growing; prompt_tokens_details in each.
    assert all(c.usage is not None and c.usage.prompt_tokens_details is not None for c in chunks)
    assert [c.usage.completion_tokens for c in pieces] == sorted(c.usage.completion_tokens for c in pieces)
    assert chunks[-1].usage.completion_tokens == 5


def test_batched_text_prompts_each_get_their_choices(client: Any) -> None:
    prompts = ["First prompt here", "Second one", "And a third"]
    answer = client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=2, n=2, echo=True, seed=3)
    assert sorted(c.index for c in answer.choices) == list(range(6))
    for c in answer.choices:
        assert c.text.startswith(prompts[c.index // 2])


def test_prompt_logprobs_field_on_both_endpoints(server: ServerProcess, tokenizer: Any, hf_model: Any) -> None:
    ids = tokenizer(PROMPT).input_ids
    answer = ok(post(server, "/v1/completions", {"prompt": ids, "max_tokens": 1, "prompt_logprobs": 2}))
    chat = ok(post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1, "prompt_logprobs": 0}))
    chat_ids = ok(post(server, "/tokenize", {"messages": CHAT}))["tokens"]
    for got, prompt_ids, k in (
        (answer["choices"][0]["prompt_logprobs"], ids, 2),
        (chat["prompt_logprobs"], chat_ids, 0),
    ):
        assert len(got) == len(prompt_ids) and got[0] is None
        want = prompt_logprobs_of(hf_model, prompt_ids)
        for position, (token_id, entries) in enumerate(zip(prompt_ids[1:], got[1:])):
            entry = entries[str(token_id)]  # the prompt token itself, whatever its rank
            assert entry["logprob"] == pytest.approx(want[position], abs=1e-4)
            assert {e["rank"] for e in entries.values() if e["rank"] <= k} == set(range(1, k + 1))
    assert chat["object"] == "chat.completion" and chat["usage"]["prompt_tokens_details"] is not None


# ---------------------------------------------------------------------------- sampling parameters


def greedy_with_penalties(
    hf_model: Any,
    ids: list[int],
    num: int,
    presence: float = 0.0,
    frequency: float = 0.0,
    repetition: float = 1.0,
    bias: dict[int, float] | None = None,
) -> list[int]:
    """Greedy decoding with vLLM's logit bias and penalties, written out: the bias added, then
    repetition over the prompt and the output (positive logits divided, negative multiplied),
    presence and frequency over the output only."""
    out: list[int] = []
    with torch.inference_mode():
        for _ in range(num):
            logits = hf_model(torch.tensor([ids + out])).logits[0, -1].float()
            for token, value in (bias or {}).items():
                logits[token] += value
            seen = torch.tensor(sorted(set(ids + out)))
            picked = logits[seen]
            logits[seen] = torch.where(picked > 0, picked / repetition, picked * repetition)
            for token in set(out):
                logits[token] -= presence + frequency * out.count(token)
            out.append(int(torch.argmax(logits)))
    return out


def test_penalties_reach_the_sampler(client: Any, tokenizer: Any, hf_model: Any) -> None:
    # Each penalty changes this prompt's greedy tokens (on the tiny model) in its own way.
    ids = tokenizer("Hello world").input_ids
    outputs = set()
    for presence, frequency, repetition in ((0.0, 0.0, 3.0), (2.0, 0.0, 3.0), (0.0, 2.0, 3.0), (2.0, 2.0, 3.0)):
        answer = client.completions.create(
            model=MODEL_NAME,
            prompt=ids,
            max_tokens=8,
            temperature=0,
            presence_penalty=presence,
            frequency_penalty=frequency,
            extra_body={"repetition_penalty": repetition, "ignore_eos": True},
        )
        want = greedy_with_penalties(hf_model, ids, 8, presence, frequency, repetition)
        assert answer.choices[0].text == tokenizer.decode(want), (presence, frequency, repetition)
        outputs.add(answer.choices[0].text)
    assert len(outputs) == 4  # none of them was dropped on the way
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=CHAT,
        max_tokens=4,
        temperature=0,
        presence_penalty=2.0,
        extra_body={"repetition_penalty": 3.0},
    )
    assert chat.choices[0].message.content is not None


def test_logit_bias_allowed_token_ids_and_bad_words(client: Any, tokenizer: Any, hf_model: Any) -> None:
    ids = tokenizer(PROMPT).input_ids
    greedy = {"model": MODEL_NAME, "prompt": ids, "max_tokens": 4, "temperature": 0, "logprobs": 0}
    plain = client.completions.create(**greedy, extra_body={"ignore_eos": True}).choices[0]
    first = tokenizer(plain.logprobs.tokens[0], add_special_tokens=False).input_ids
    assert len(first) == 1  # the tiny model repeats one word here: that is the one banned below
    # logit_bias pushes the model's favourite down: the next best, as transformers says.
    biased = client.completions.create(**greedy, logit_bias={str(first[0]): -100}, extra_body={"ignore_eos": True})
    assert biased.choices[0].text == tokenizer.decode(greedy_with_penalties(hf_model, ids, 4, bias={first[0]: -100.0}))
    assert plain.logprobs.tokens[0] not in biased.choices[0].logprobs.tokens
    banned = client.completions.create(
        **greedy, extra_body={"bad_words": [plain.logprobs.tokens[0].strip()], "ignore_eos": True}
    )
    assert plain.logprobs.tokens[0] not in banned.choices[0].logprobs.tokens
    chat = {"model": MODEL_NAME, "messages": CHAT, "max_tokens": 1, "temperature": 0, "logprobs": True}
    chat_first = client.chat.completions.create(**chat).choices[0].logprobs.content[0]
    chat_token = tokenizer(chat_first.token, add_special_tokens=False).input_ids[0]
    chat_biased = client.chat.completions.create(**chat, logit_bias={str(chat_token): -100}).choices[0]
    assert chat_biased.logprobs.content[0].token != chat_first.token
    allowed = tokenizer(" yes no", add_special_tokens=False).input_ids
    sampled = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=6,
        seed=1,
        logprobs=0,
        extra_body={"allowed_token_ids": allowed, "ignore_eos": True},
    )
    assert set(sampled.choices[0].logprobs.tokens) <= {tokenizer.decode([t]) for t in allowed}


# ---------------------------------------------------------------------------- leniency, endpoints


def test_unknown_fields_and_nulls_are_accepted(server: ServerProcess, client: Any) -> None:
    odd = {"lm_eval_cache_key": "x", "metadata": {"a": 1}}
    ok(post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "n": None, "seed": None, **odd}))
    ok(post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1, "stream_options": None, **odd}))
    ok(post(server, "/tokenize", {"prompt": PROMPT, **odd}))
    # Logged once per name, however often it comes.
    assert server.log_tail(100_000).count("'lm_eval_cache_key'") == 1
    # Known fields keep their types.
    r = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": "5"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_chat_content_parts_and_names(server: ServerProcess, client: Any) -> None:
    text = CHAT[0]["content"]
    parts = [{"role": "user", "name": "alice", "content": [{"type": "text", "text": text}]}]
    as_parts = ok(post(server, "/tokenize", {"messages": parts}))["tokens"]
    assert as_parts == ok(post(server, "/tokenize", {"messages": CHAT}))["tokens"]
    kwargs = {"model": MODEL_NAME, "max_tokens": 4, "temperature": 0}
    assert (
        client.chat.completions.create(messages=parts, **kwargs).choices[0].message.content
        == client.chat.completions.create(messages=CHAT, **kwargs).choices[0].message.content
    )
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(client.chat.completions.create(messages=parts, stream=True, stream_options=options, **kwargs))
    assert {c.object for c in chunks} == {"chat.completion.chunk"}
    # continuous_usage_stats: usage on every chunk, prompt_tokens_details in each.
    assert all(c.usage is not None and c.usage.prompt_tokens_details is not None for c in chunks)
    assert chunks[-1].usage.completion_tokens == 4


def test_small_endpoints(server: ServerProcess, client: Any) -> None:
    for method in ("GET", "POST"):  # open, like /health
        assert httpx.request(method, server.url + "/ping", timeout=TIMEOUT).status_code == 200
    assert httpx.get(server.url + "/version", timeout=TIMEOUT).json()["version"]
    assert httpx.get(server.url + "/tokenizer_info", timeout=TIMEOUT).status_code == 401  # behind the key
    info = httpx.get(server.url + "/tokenizer_info", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=TIMEOUT)
    info = ok(info)
    reference = transformers.AutoTokenizer.from_pretrained(default_model_dir())
    assert info["tokenizer_class"] == type(reference).__name__
    assert (info["eos_token"], info["bos_token"], info["pad_token"]) == (
        reference.eos_token,
        reference.bos_token,
        reference.pad_token,
    )
    assert info["model_max_length"] == MAX_MODEL_LEN and info["chat_template"] == reference.chat_template
    assert "name_or_path" not in info  # no path on the server's disk
    models = client.models.list()
    assert models.object == "list" and {m.object for m in models.data} == {"model"}


# ---------------------------------------------------------------------------- bad input

MESSAGES = {"messages": CHAT}
BAD = [
    ("presence_penalty above 2", "/v1/completions", {"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
    ("frequency_penalty below -2", "/v1/chat/completions", {**MESSAGES, "frequency_penalty": -3}, "frequency_penalty"),
    ("repetition_penalty 0", "/v1/completions", {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ("penalty of the wrong type", "/v1/completions", {"prompt": "x", "presence_penalty": "1"}, "presence_penalty"),
    ("logit_bias key not an int", "/v1/completions", {"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
    ("logit_bias key a float", "/v1/chat/completions", {**MESSAGES, "logit_bias": {"1.5": 1}}, "logit_bias"),
    ("logit_bias key negative", "/v1/completions", {"prompt": "x", "logit_bias": {"-1": 1}}, "logit_bias"),
    ("logit_bias key outside the vocabulary", "/v1/completions", {"prompt": "x", "logit_bias": {"999999": 1}}, "logit_bias"),
    ("logit_bias value not a number", "/v1/completions", {"prompt": "x", "logit_bias": {"5": "up"}}, "logit_bias.5"),
    ("allowed_token_ids outside the vocabulary", "/v1/completions", {"prompt": "x", "allowed_token_ids": [10**6]}, "allowed_token_ids"),
    ("allowed_token_ids empty", "/v1/completions", {"prompt": "x", "allowed_token_ids": []}, "allowed_token_ids"),
    ("bad_words with an empty word", "/v1/completions", {"prompt": "x", "bad_words": [" "]}, "bad_words"),
    ("prompt_logprobs above max_logprobs", "/v1/completions", {"prompt": "x", "prompt_logprobs": MAX_LOGPROBS + 1}, "prompt_logprobs"),
    ("prompt_logprobs negative", "/v1/chat/completions", {**MESSAGES, "prompt_logprobs": -1}, "prompt_logprobs"),
    ("prompt_logprobs streamed", "/v1/completions", {"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("echo logprobs above max_logprobs", "/v1/completions", {"prompt": "x", "echo": True, "logprobs": MAX_LOGPROBS + 1}, "logprobs"),
    ("max_tokens 0 without echo", "/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("prompt id negative", "/v1/completions", {"prompt": [1, -1]}, "prompt"),
    ("prompt id outside the vocabulary", "/v1/completions", {"prompt": [[1, 2], [10**6]]}, "prompt"),
    ("prompt ids with a float", "/v1/completions", {"prompt": [1, 2.5]}, "prompt"),
    ("prompt ids with a bool", "/v1/completions", {"prompt": [True, 2]}, "prompt"),
    ("prompt ids nested too deep", "/v1/completions", {"prompt": [[1, [2]]]}, "prompt"),
    ("prompt ids mixed with text", "/v1/completions", {"prompt": [[1, 2], "x"]}, "prompt"),
    ("prompt id list empty", "/v1/completions", {"prompt": [[1], []]}, "prompt"),
    ("suffix", "/v1/completions", {"prompt": "x", "suffix": "y"}, "suffix"),
    ("best_of above n", "/v1/completions", {"prompt": "x", "best_of": 3}, "best_of"),
    ("tool with a bad name", "/v1/chat/completions", {**MESSAGES, "tools": [{"type": "function", "function": {"name": "f g"}}]}, "tools"),
    ("tool_choice naming no tool", "/v1/chat/completions", {**MESSAGES, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ("tool_choice without tools", "/v1/chat/completions", {**MESSAGES, "tool_choice": "required"}, "tool_choice"),
    ("image content part", "/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
    ("penalties with beam search", "/v1/completions", {"prompt": "x", "use_beam_search": True, "presence_penalty": 1}, "presence_penalty"),
]  # fmt: skip


@pytest.mark.parametrize("name,path,body,param", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_a_400_naming_the_field(
    server: ServerProcess, name: str, path: str, body: Any, param: str
) -> None:
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    assert error["message"] and error["type"] == "invalid_request_error" and isinstance(error["code"], str)


def test_bad_input_leaves_the_server_serving(server: ServerProcess, client: Any) -> None:
    for _, path, body, _ in BAD:
        post(server, path, body)
    answer = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=3, echo=True, logprobs=1)
    assert answer.choices[0].text.startswith(PROMPT)
    assert_no_block_held(server.url)
