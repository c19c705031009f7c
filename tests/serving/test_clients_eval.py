"""`pagedkv serve` driven by the clients people point at an OpenAI-compatible server, as they
use them: lm-eval (``local-completions`` on a multiple-choice and a generation task,
``local-chat-completions`` on the generation task), LangChain (``ChatOpenAI``; the ``OpenAI``
completions LLM with its default parameters) and LiteLLM (``hosted_vllm/...``, sync and async,
streaming and not).

One server for the module: the embedded SmolLM2 in float32 on the CPU, so texts and
loglikelihoods are the real model's (greedy answers such as " Paris" are checked). Each test
fails if its client raises or parses nothing. Requests are few and short (lm-eval's tasks are
tests/lm_eval_tasks/, 12 + 5 documents; at most 6 new tokens elsewhere). Nothing is
downloaded: the tasks' data, the tokenizer and LiteLLM's model table are local.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("fastapi")

from lm_eval_tasks.harness import (  # noqa: E402
    GENERATION,
    MULTIPLE_CHOICE,
    OFFLINE_ENV,
    accuracy,
    all_finite,
    choice_loglikelihoods,
    completions_args,
    evaluate,
    samples,
)

from pagedkv.server.launch import ServerProcess  # noqa: E402
from pagedkv.worker.model_files import default_model_dir  # noqa: E402

MODEL_NAME = "smol"
ENGINE_FLAGS = [
    "--served-model-name", MODEL_NAME, "--dtype", "float32", "--device", "cpu", "--block-size", "16",
    "--num-blocks", "160", "--max-model-len", "512", "--max-num-seqs", "8", "--log-level", "warning",
]  # fmt: skip
TIMEOUT = 60.0
MAX_TOKENS = 6
# Prompts whose greedy continuation by SmolLM2 is known (" Paris.", " Tokyo.", ...).
FRANCE, JAPAN = "The capital of France is", "The capital of Japan is"
CHAT_PROMPT = "Name a fruit."


@pytest.fixture(scope="module", autouse=True)
def offline_env() -> Iterator[None]:
    """No client may reach the network: Hugging Face offline, LiteLLM's model table from its
    package (read when litellm is first imported, so set before any test imports it)."""
    with pytest.MonkeyPatch.context() as mp:
        for name, value in {**OFFLINE_ENV, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}.items():
            mp.setenv(name, value)
        yield


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with ServerProcess(ENGINE_FLAGS) as proc:
        yield proc


@pytest.fixture(scope="module")
def api_base(server: ServerProcess) -> str:
    return server.url + "/v1"


# ---------------------------------------------------------------------------- lm-eval


def test_lm_eval_multiple_choice_through_local_completions(api_base: str) -> None:
    """lm-eval's loglikelihood requests: token-id prompts in batches of 4, ``echo`` with
    ``logprobs: 1`` and ``max_tokens: 1``; it sums the prompt positions' ``token_logprobs``."""
    pytest.importorskip("lm_eval")
    args = completions_args(api_base, MODEL_NAME, str(default_model_dir()), batch_size=4)
    results = evaluate("local-completions", args, MULTIPLE_CHOICE)

    loglikelihoods = choice_loglikelihoods(results)
    assert len(loglikelihoods) == 12 and all(len(row) == 3 for row in loglikelihoods)
    assert all_finite(loglikelihoods)
    assert all(v < 0 for row in loglikelihoods for v in row)
    assert len({round(v, 4) for row in loglikelihoods for v in row}) > 24  # not one value repeated
    # The real model, not noise: clearly better than chance (1/3) on these easy questions.
    assert accuracy(results) >= 0.5, accuracy(results)


def test_lm_eval_generate_until_through_local_completions(api_base: str) -> None:
    pytest.importorskip("lm_eval")
    args = completions_args(api_base, MODEL_NAME, str(default_model_dir()))
    results = evaluate("local-completions", args, GENERATION)

    texts = [sample["filtered_resps"][0] for sample in samples(results, GENERATION)]
    assert len(texts) == 5 and all(isinstance(t, str) and t.strip() for t in texts), texts
    # Greedy SmolLM2 completes "The capital of X is" with the city, cut at the full stop.
    assert results["results"][GENERATION]["exact_match,none"] >= 0.6, texts


def test_lm_eval_generate_until_through_local_chat_completions(api_base: str) -> None:
    pytest.importorskip("lm_eval")
    args = {"model": MODEL_NAME, "base_url": api_base + "/chat/completions", "max_retries": 1}
    # The first 3 documents: a chat answer runs to the token limit (the full stop comes late).
    results = evaluate("local-chat-completions", args, GENERATION, apply_chat_template=True, limit=3)

    texts = [sample["filtered_resps"][0] for sample in samples(results, GENERATION)]
    assert len(texts) == 3 and all(isinstance(t, str) and t.strip() for t in texts), texts


# ---------------------------------------------------------------------------- LangChain


def test_langchain_chat_openai_invoke_stream_batch(api_base: str) -> None:
    lc_openai = pytest.importorskip("langchain_openai")
    messages = pytest.importorskip("langchain_core.messages")
    chat = lc_openai.ChatOpenAI(
        model=MODEL_NAME, base_url=api_base, api_key="none", max_tokens=MAX_TOKENS, temperature=0,
        max_retries=0, timeout=TIMEOUT, stream_usage=True,
    )  # fmt: skip

    whole = chat.invoke(CHAT_PROMPT)
    assert isinstance(whole.content, str) and whole.content.strip()
    assert whole.usage_metadata["input_tokens"] > 0 and 0 < whole.usage_metadata["output_tokens"] <= MAX_TOKENS

    chunks = list(chat.stream(CHAT_PROMPT))
    assert sum(1 for c in chunks if c.content) >= 3
    assert "".join(str(c.content) for c in chunks) == whole.content  # greedy: the same text
    usage = [c.usage_metadata for c in chunks if c.usage_metadata]
    assert usage and usage[-1]["output_tokens"] == whole.usage_metadata["output_tokens"]

    # A batch of two conversations, one with a system message, a named speaker and content parts.
    named = messages.HumanMessage(content=[{"type": "text", "text": CHAT_PROMPT}], name="alice")
    answers = chat.batch(
        [[messages.SystemMessage(content="You answer in one short sentence."), named], "Name a color."]
    )
    assert len(answers) == 2 and all(isinstance(a.content, str) and a.content.strip() for a in answers)


def test_langchain_openai_completions_llm_with_default_parameters(api_base: str) -> None:
    """The ``OpenAI`` LLM sends its defaults with every request (``temperature`` 0.7, ``top_p``
    1, ``frequency_penalty`` and ``presence_penalty`` 0, ``n`` 1, ``logprobs`` and ``seed``
    null) and a batch as one request with a list of prompts."""
    lc_openai = pytest.importorskip("langchain_openai")
    common: dict[str, Any] = {"model": MODEL_NAME, "base_url": api_base, "api_key": "none", "max_retries": 0}
    llm = lc_openai.OpenAI(**common, max_tokens=MAX_TOKENS, timeout=TIMEOUT)

    assert llm.invoke(FRANCE).strip()
    chunks = list(llm.stream(FRANCE))
    assert sum(1 for c in chunks if c) >= 3

    greedy = lc_openai.OpenAI(**common, max_tokens=4, temperature=0, timeout=TIMEOUT)
    france, japan = greedy.batch([FRANCE, JAPAN])  # choices mapped back by their index
    assert "Paris" in france and "Tokyo" in japan, (france, japan)


# ---------------------------------------------------------------------------- LiteLLM


def _litellm_request(api_base: str, **extra: Any) -> dict[str, Any]:
    """LiteLLM's vLLM provider (``hosted_vllm/<served name>``), a system message and the user
    turn as content parts."""
    return {
        "model": f"hosted_vllm/{MODEL_NAME}",
        "api_base": api_base,
        "api_key": "none",
        "messages": [
            {"role": "system", "content": "You answer in one short sentence."},
            {"role": "user", "content": [{"type": "text", "text": CHAT_PROMPT}]},
        ],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "timeout": TIMEOUT,
        "num_retries": 0,
        **extra,
    }


def _streamed_text(chunks: list[Any]) -> str:
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(pieces) >= 3, chunks
    return "".join(pieces)


def test_litellm_completion_sync_and_streaming(api_base: str) -> None:
    litellm = pytest.importorskip("litellm")
    whole = litellm.completion(**_litellm_request(api_base))
    text = whole.choices[0].message.content
    assert text and text.strip()
    assert whole.usage.prompt_tokens > 0 and 0 < whole.usage.completion_tokens <= MAX_TOKENS

    assert _streamed_text(list(litellm.completion(**_litellm_request(api_base, stream=True)))) == text


def test_litellm_acompletion_async_and_streaming(api_base: str) -> None:
    litellm = pytest.importorskip("litellm")

    async def run() -> tuple[str, str]:
        whole = await litellm.acompletion(**_litellm_request(api_base))
        stream = await litellm.acompletion(**_litellm_request(api_base, stream=True))
        return whole.choices[0].message.content, _streamed_text([chunk async for chunk in stream])

    text, streamed = asyncio.run(run())
    assert text and text.strip() and streamed == text
