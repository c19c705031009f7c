"""SamplingParams validation and normalization; output dataclasses' reprs."""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagedkv.errors import ConfigError
from pagedkv.sample.limits import MAX_BAD_WORDS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, MAX_TOKEN_ID_ENTRIES
from pagedkv.sample.sampling_params import SamplingParams, SamplingType


def test_defaults_match_vllm() -> None:
    params = SamplingParams()
    assert (params.n, params.max_tokens, params.min_tokens) == (1, 16, 0)
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (1.0, 1.0, 0, 0.0)
    assert params.seed is None and params.stop is None and params.stop_strings == []
    assert params.logprobs is None and params.skip_special_tokens is True
    assert params.sampling_type is SamplingType.RANDOM


def test_sampling_type() -> None:
    assert SamplingParams(temperature=0.0).sampling_type is SamplingType.GREEDY
    assert SamplingParams(temperature=0.7, seed=3).sampling_type is SamplingType.RANDOM_SEED
    # Greedy wins over a seed: the seed is irrelevant to argmax.
    assert SamplingParams(temperature=0.0, seed=3).sampling_type is SamplingType.GREEDY


def test_greedy_normalizes_filters() -> None:
    params = SamplingParams(temperature=0.0, top_k=5, top_p=0.5, min_p=0.2)
    assert (params.top_k, params.top_p, params.min_p) == (0, 1.0, 0.0)
    # Below vLLM's epsilon counts as greedy too.
    assert SamplingParams(temperature=1e-7).sampling_type is SamplingType.GREEDY


@pytest.mark.parametrize("top_k", [0, -1])
def test_top_k_off_accepts_zero_and_minus_one(top_k: int) -> None:
    assert SamplingParams(top_k=top_k).effective_top_k == 0


def test_request_sized_lists_are_bounded_before_their_entries_are_read() -> None:
    # Each bound is checked on the length first: a list of millions costs nothing to refuse
    # (300,000 stop strings were de-duplicated in quadratic time before).
    cases = [
        ({"stop": [f"s{i}" for i in range(300_000)]}, "stop has 300000 strings"),
        ({"stop": ["x" * 100] * 200}, "stop has more than 16384 characters"),
        ({"stop_token_ids": list(range(MAX_STOP_TOKEN_IDS + 1))}, "stop_token_ids has"),
        ({"bad_words": [f"w{i}" for i in range(100_000)]}, "bad_words has 100000 words"),
        ({"bad_words": ["w" * 20_000]}, "bad_words has more than 16384 characters"),
        ({"allowed_token_ids": [1] * (MAX_TOKEN_ID_ENTRIES + 1)}, "allowed_token_ids has"),
        ({"logit_bias": dict.fromkeys(range(MAX_TOKEN_ID_ENTRIES + 1), 1.0)}, "logit_bias has"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ConfigError, match=message):
            SamplingParams(**kwargs)
    # At the bounds: accepted, duplicates dropped in their first order.
    stops = [f"s{i}" for i in range(MAX_STOP_STRINGS - 1)] + ["s0"]
    assert SamplingParams(stop=stops).stop_strings == stops[:-1]
    assert len(SamplingParams(bad_words=[f"w{i}" for i in range(MAX_BAD_WORDS)]).bad_words or []) == MAX_BAD_WORDS
    assert SamplingParams(allowed_token_ids=[5, 3, 5, 9, 3]).allowed_token_ids == [5, 3, 9]
    # Numpy ids take the per-entry path and come back as ints.
    assert SamplingParams(allowed_token_ids=[np.int64(2), 0, np.int64(2)]).allowed_token_ids == [2, 0]


def test_stop_normalized_to_list() -> None:
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=["a", "b", "a"]).stop_strings == ["a", "b"]
    assert SamplingParams(stop_token_ids=[np.int64(7), 9]).stop_token_ids == [7, 9]


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.1}, "min_p"),
        ({"n": 0}, "n"),
        ({"n": True}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"stop": 3}, "stop"),
        ({"stop": ["ok", 3]}, "stop"),
        ({"stop": [""]}, "empty"),
        ({"stop_token_ids": "12"}, "stop_token_ids"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"logprobs": -1}, "logprobs"),
        ({"seed": 2**64}, "seed"),
        ({"seed": "7"}, "seed"),
        ({"ignore_eos": 1}, "ignore_eos"),
    ],
)
def test_invalid_values_raise_config_error(kwargs: dict, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        SamplingParams(**kwargs)


def test_config_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        SamplingParams(top_p=0.0)


def test_max_tokens_none_means_unbounded() -> None:
    assert SamplingParams(max_tokens=None, min_tokens=100).max_tokens is None


def test_output_reprs_are_readable() -> None:
    completion = CompletionOutput(index=0, text="Paris.", token_ids=list(range(40)), finish_reason="stop")
    text = repr(completion)
    assert "text='Paris.'" in text and "(len=40)" in text and "finish_reason=stop" in text
    assert completion.finished()
    output = RequestOutput(
        request_id="r1",
        prompt="The capital of France is",
        prompt_token_ids=[1, 2, 3],
        outputs=[completion],
        finished=True,
        metrics=RequestMetrics(arrival_time=10.0, first_token_time=10.5, finished_time=11.0),
    )
    assert "request_id='r1'" in repr(output) and "prompt_token_ids=[1, 2, 3]" in repr(output)
    assert output.metrics is not None
    assert output.metrics.time_to_first_token == pytest.approx(0.5)
    assert output.metrics.e2e_latency == pytest.approx(1.0)
