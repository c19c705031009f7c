"""Incremental detokenization and stop strings with the real SmolLM2 tokenizer."""

from __future__ import annotations

import random

import pytest

from pagedkv.engine.detokenizer import IncrementalDetokenizer
from pagedkv.sample.sampling_params import SamplingParams
from pagedkv.worker.model_files import default_model_dir

TEXTS = [
    "The quick brown fox jumps over the lazy dog. It's 42 degrees!",
    "Héllo wörld: naïve café, Straße, Ελληνικά, русский текст.",
    "Emoji time 👋🏽👩‍👩‍👧 and 🇫🇷 flags — with dashes… and “quotes”.",
    "日本語のテキスト、中文文本和한국어 텍스트。",
    "def f(x):\n    return x ** 2  # code\n\n\ttabs and   spaces",
]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(default_model_dir())


def _run(detok: IncrementalDetokenizer, ids: list[int], chunk_sizes: list[int]) -> tuple[str, str | None]:
    """Feed ids in chunks; return the streamed text (deltas joined) and the stop string."""
    streamed = []
    position = 0
    stop = None
    for size in chunk_sizes:
        stop = detok.update(ids[position : position + size])
        position += size
        streamed.append(detok.get_delta(finished=stop is not None))
        if stop is not None:
            break
    else:
        streamed.append(detok.get_delta(finished=True))
    return "".join(streamed), stop


@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time_equals_full_decode(tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer)
    streamed, stop = _run(detok, ids, [1] * len(ids))
    assert stop is None
    assert detok.output_text == tokenizer.decode(ids) == text
    assert streamed == text


def test_deltas_never_show_partial_characters(tokenizer) -> None:
    ids = tokenizer.encode(TEXTS[2] + TEXTS[3])
    detok = IncrementalDetokenizer(tokenizer)
    for token_id in ids:
        detok.update([token_id])
        assert "\ufffd" not in detok.get_delta()


def test_random_chunks_and_prompt_context(tokenizer) -> None:
    rng = random.Random(0)
    for text in TEXTS:
        prompt_ids = tokenizer.encode("Some prompt 👋 before")
        ids = tokenizer.encode(text)
        chunks = []
        while sum(chunks) < len(ids):
            chunks.append(rng.randint(1, 4))
        detok = IncrementalDetokenizer(tokenizer, prompt_token_ids=prompt_ids)
        streamed, _ = _run(detok, ids, chunks)
        full = tokenizer.decode(prompt_ids + ids)
        expected = full[len(tokenizer.decode(prompt_ids)) :]
        assert detok.output_text == expected == streamed
        assert detok.token_ids == ids


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_special_tokens(tokenizer, skip_special_tokens: bool) -> None:
    ids = tokenizer.encode("Hi there") + [tokenizer.eos_token_id] + tokenizer.encode(" more text")
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
    _run(detok, ids, [1] * len(ids))
    assert detok.output_text == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert ("<|im_end|>" in detok.output_text) is not skip_special_tokens


def _stop_case(tokenizer) -> tuple[list[int], str]:
    text = "Answer: the sky is blue. ### Next question: why?"
    ids = tokenizer.encode(text)
    pieces = [tokenizer.decode([i]) for i in ids]
    # The stop string "is blue. ##" spans several tokens and starts mid-stream.
    assert sum("blue" in p or "#" in p for p in pieces) >= 2
    return ids, "is blue. ##"


def test_stop_string_spanning_tokens_cuts_before_it(tokenizer) -> None:
    ids, stop = _stop_case(tokenizer)
    detok = IncrementalDetokenizer(tokenizer, stop=["never", stop])
    streamed, matched = _run(detok, ids, [1] * len(ids))
    assert matched == stop and detok.stop_reason == stop
    assert detok.output_text == "Answer: the sky "
    # The stream never showed any part of the stop string.
    assert streamed == detok.output_text
    # It stopped on the token that completed the match, not later.
    completed_at = len(detok.token_ids)
    assert stop in tokenizer.decode(ids[:completed_at])
    assert stop not in tokenizer.decode(ids[: completed_at - 1])


def test_include_stop_str_in_output(tokenizer) -> None:
    ids, stop = _stop_case(tokenizer)
    params = SamplingParams(stop=[stop], include_stop_str_in_output=True)
    detok = IncrementalDetokenizer.from_params(tokenizer, params)
    streamed, matched = _run(detok, ids, [2] * len(ids))
    assert matched == stop
    assert detok.output_text == "Answer: the sky is blue. ##"
    assert streamed == detok.output_text


def test_stop_string_in_a_multi_token_update(tokenizer) -> None:
    ids, stop = _stop_case(tokenizer)
    detok = IncrementalDetokenizer(tokenizer, stop=[stop, "sky"])
    # Both match in one update: the earliest one in the text wins.
    assert detok.update(ids) == "sky"
    assert detok.output_text == "Answer: the "
    with pytest.raises(RuntimeError):
        detok.update(ids[:1])


def test_min_tokens_defers_stop_strings(tokenizer) -> None:
    ids = tokenizer.encode("stop here and stop there")
    detok = IncrementalDetokenizer(tokenizer, stop=["stop"], min_tokens=3)
    _, matched = _run(detok, ids, [1] * len(ids))
    assert matched == "stop"
    assert detok.output_text == "stop here and "


def test_stop_terminated_token_text_is_left_out(tokenizer) -> None:
    ids = tokenizer.encode("Hello world")
    stop_token = tokenizer.encode(" END")[0]
    detok = IncrementalDetokenizer(tokenizer)
    detok.update(ids)
    detok.update([stop_token], stop_terminated=True)
    assert detok.output_text == "Hello world"
    assert detok.token_ids == ids + [stop_token]
    kept = IncrementalDetokenizer(tokenizer, include_stop_str_in_output=True)
    kept.update(ids + [stop_token], stop_terminated=True)
    assert kept.output_text == tokenizer.decode(ids + [stop_token])
