"""``SamplingParams``: how one request's tokens are chosen and when it stops (vLLM's names).

Validated on construction: every bad value raises :class:`pagedkv.errors.ConfigError` naming
the field and the value, so a server can turn it into a 400 without inspecting it further.
"""

from __future__ import annotations

import copy
import enum
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pagedkv.errors import ConfigError
from pagedkv.sample.limits import (
    MAX_BAD_WORDS,
    MAX_BAD_WORDS_CHARS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOKEN_ID_ENTRIES,
    check_count,
)
from pagedkv.structured.params import StructuredOutputsParams

__all__ = ["SAMPLING_EPS", "SamplingParams", "SamplingType"]

# Temperatures below this are greedy (vLLM's threshold): dividing logits by ~0 would overflow.
SAMPLING_EPS = 1e-5

# Retention priorities of cached KV blocks (the Rust core's range).
MAX_RETENTION_PRIORITY = 100
# presence_penalty and frequency_penalty range (OpenAI's), and logit_bias values' clamp.
MAX_PENALTY = 2.0
MAX_LOGIT_BIAS = 100.0
# torch.Generator.manual_seed accepts this range.
_SEED_MIN = -(2**63)
_SEED_MAX = 2**64 - 1


class SamplingType(enum.IntEnum):
    """How the sampler treats a request: argmax, a draw from the shared RNG, or from its own."""

    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


@dataclass
class SamplingParams:
    """Sampling parameters of one request, with vLLM's names, defaults and meanings.

    - ``n``: number of completions to return for the prompt (forked sequences share its KV).
    - ``max_tokens``: most tokens to generate per completion; ``None`` = until the model's
      context length (``max_model_len``) is reached.
    - ``min_tokens``: eos and ``stop_token_ids`` are suppressed (and stop strings ignored) until
      this many tokens have been generated.
    - ``temperature``: 0 means greedy; otherwise logits are divided by it before sampling.
    - ``top_p``: keep the smallest set of most likely tokens whose probability sums to >= top_p.
    - ``top_k``: keep the k most likely tokens; 0 or -1 means all (vLLM accepts both).
    - ``min_p``: drop tokens whose probability is below ``min_p`` times the top token's.
    - ``seed``: per-request random seed; the draw is then reproducible whatever else is batched.
      Sample ``i`` of ``n`` uses ``seed + i``.
    - ``stop``: strings that end the completion; the text is cut before the stop string unless
      ``include_stop_str_in_output``. At most ``MAX_STOP_STRINGS`` (256) strings of
      ``MAX_STOP_CHARS`` (16384) characters together (pagedkv.sample.limits); duplicates are
      dropped.
    - ``stop_token_ids``: token ids that end the completion (besides eos); at most
      ``MAX_STOP_TOKEN_IDS`` (1024).
    - ``ignore_eos``: keep generating after eos.
    - ``logprobs``: ``None``, or how many top log-probabilities to return per generated token
      besides the chosen token's own (which is always returned when this is not ``None``).
    - ``skip_special_tokens``: leave special tokens out of the detokenized text.
    - ``presence_penalty``: subtracted from the logit of every token the sample has already
      generated (once), in [-2, 2]; positive values push towards new tokens.
    - ``frequency_penalty``: subtracted from a token's logit once per time the sample has
      generated it, in [-2, 2].
    - ``repetition_penalty``: > 0; tokens in the prompt or the output so far have positive
      logits divided by it and negative ones multiplied by it (1 = off).
    - ``logit_bias``: ``{token_id: bias}`` added to the logits before sampling; biases are
      clamped to [-100, 100] (OpenAI's range); ids are checked against the vocabulary.
    - ``allowed_token_ids``: only these tokens may be sampled (duplicates dropped; the engine
      refuses more ids than its vocabulary has).
    - ``bad_words``: words never generated: a word's last token is banned whenever the output
      ends with the tokens before it (each word is tried with and without a leading space). At
      most ``MAX_BAD_WORDS`` (256) words of ``MAX_BAD_WORDS_CHARS`` (16384) characters together.
    - ``prompt_logprobs``: ``None``, or how many top log-probabilities to return per prompt
      token besides the prompt token's own; such a request computes its whole prompt (no
      prefix-cache hits: cached blocks have no logits).
    - ``retention_priority``: how long the prompt's KV blocks stay in the prefix cache once
      the request is done, 0 .. 100 (TensorRT-LLM's retention priorities): among free cached
      blocks the lowest priority is evicted first, least recently used first within a
      priority. ``None`` = the default, 35 (also the priority of blocks filled by decoding).
    - ``retention_duration``: seconds after which the prompt's blocks fall back to the default
      priority (``None``: they keep ``retention_priority``).
    - ``retention_tokens``: the priority covers only the full blocks within the first this many
      prompt tokens, e.g. a shared system prompt (``None``: the whole prompt). Giving a high
      priority to every request's private tail fills the cache with blocks nobody reuses.
    - ``structured_outputs``: a :class:`~pagedkv.structured.StructuredOutputsParams` (or a dict
      of its fields): every sample's output must match its JSON schema, regex, choice or grammar
      (tokens the constraint forbids are masked before sampling; a sample ends when the
      constraint is complete).
    """

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    retention_priority: int | None = None
    retention_duration: float | None = None
    retention_tokens: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # Normalized copy of `stop` (always a list) for the detokenizer; not a constructor argument.
    _stop_strings: list[str] = field(default_factory=list, init=False, repr=False, compare=False)
    # What an engine built from these params for its steps (pagedkv.sample.prepared), per
    # engine (vocabulary, device, tokenizer): one build however many requests share the params.
    # Like `_stop_strings`, it reflects the values the params held when it was built.
    _prepared: dict[Any, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.n = _check_int("n", self.n, minimum=1)
        if self.max_tokens is not None:
            self.max_tokens = _check_int("max_tokens", self.max_tokens, minimum=1)
        self.min_tokens = _check_int("min_tokens", self.min_tokens, minimum=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ConfigError(
                f"min_tokens must be <= max_tokens, got min_tokens={self.min_tokens} > max_tokens={self.max_tokens}"
            )
        self.temperature = _check_float("temperature", self.temperature)
        if self.temperature < 0.0:
            raise ConfigError(f"temperature must be >= 0, got {self.temperature}")
        self.top_p = _check_float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        self.top_k = _check_int("top_k", self.top_k, minimum=-1)
        self.min_p = _check_float("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ConfigError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            self.seed = _check_int("seed", self.seed, minimum=_SEED_MIN)
            # Sample i of the request draws from its own generator seeded with seed + i.
            if self.seed + self.n - 1 > _SEED_MAX:
                raise ConfigError(
                    f"seed + n - 1 must fit in 64 bits (sample i uses seed + i), got seed={self.seed}, n={self.n}"
                )
        self._stop_strings = _normalize_stop(self.stop)
        if self.stop is not None:
            self.stop = list(self._stop_strings)
        if self.stop_token_ids is not None:
            self.stop_token_ids = _check_token_ids("stop_token_ids", self.stop_token_ids, MAX_STOP_TOKEN_IDS)
        self.ignore_eos = _check_bool("ignore_eos", self.ignore_eos)
        if self.logprobs is not None:
            self.logprobs = _check_int("logprobs", self.logprobs, minimum=0)
        for name in ("presence_penalty", "frequency_penalty"):
            value = _check_float(name, getattr(self, name))
            if not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise ConfigError(f"{name} must be in [-{MAX_PENALTY}, {MAX_PENALTY}], got {value}")
            setattr(self, name, value)
        self.repetition_penalty = _check_float("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0.0:
            raise ConfigError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.logit_bias is not None:
            self.logit_bias = _check_logit_bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            # Distinct ids, in their first order: a repeated id changes nothing but the cost.
            ids = _check_token_ids("allowed_token_ids", self.allowed_token_ids, MAX_TOKEN_ID_ENTRIES)
            self.allowed_token_ids = list(dict.fromkeys(ids))
            if not self.allowed_token_ids:
                raise ConfigError("allowed_token_ids must not be empty (nothing could be sampled)")
        if self.bad_words is not None:
            self.bad_words = _check_bad_words(self.bad_words)
        if self.prompt_logprobs is not None:
            self.prompt_logprobs = _check_int("prompt_logprobs", self.prompt_logprobs, minimum=0)
        self.include_stop_str_in_output = _check_bool("include_stop_str_in_output", self.include_stop_str_in_output)
        self.skip_special_tokens = _check_bool("skip_special_tokens", self.skip_special_tokens)
        if self.retention_priority is not None:
            self.retention_priority = _check_int("retention_priority", self.retention_priority, minimum=0)
            if self.retention_priority > MAX_RETENTION_PRIORITY:
                raise ConfigError(
                    f"retention_priority must be in 0 .. {MAX_RETENTION_PRIORITY}, got {self.retention_priority}"
                )
        if self.retention_duration is not None:
            self.retention_duration = _check_float("retention_duration", self.retention_duration)
            if self.retention_duration < 0.0:
                raise ConfigError(f"retention_duration must be >= 0 seconds, got {self.retention_duration}")
        if self.retention_tokens is not None:
            self.retention_tokens = _check_int("retention_tokens", self.retention_tokens, minimum=0)
        self.structured_outputs = check_structured_outputs(self.structured_outputs)
        if self.temperature < SAMPLING_EPS:
            # Greedy ignores the filters; normalizing them lets the sampler skip their work.
            self.temperature = 0.0
            self.top_p = 1.0
            self.top_k = 0
            self.min_p = 0.0

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature == 0.0:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    @property
    def has_penalties(self) -> bool:
        """Whether any of the presence, frequency or repetition penalties is on."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def stop_strings(self) -> list[str]:
        """``stop`` as a list (empty when there are none)."""
        return self._stop_strings

    @property
    def effective_top_k(self) -> int:
        """``top_k`` with "off" as 0 (whether given as 0 or -1)."""
        return max(self.top_k, 0)

    def clone(self) -> SamplingParams:
        return copy.deepcopy(self)


def check_structured_outputs(value: Any) -> StructuredOutputsParams | None:
    """``structured_outputs`` as a StructuredOutputsParams (a dict of its fields is converted)."""
    if value is None or isinstance(value, StructuredOutputsParams):
        return value
    if isinstance(value, dict):
        known = {"json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(f"structured_outputs: unknown field(s) {unknown}; known: {sorted(known)}")
        return StructuredOutputsParams(**value)
    raise ConfigError(f"structured_outputs must be a StructuredOutputsParams or a dict, got {type(value).__name__}")


def _check_int(name: str, value: Any, *, minimum: int) -> int:
    # bool is an int subclass; True as "n" is almost certainly a mistake. operator.index accepts
    # Python, numpy and 0-d torch integers but no floats (1.5 tokens is not a count).
    if isinstance(value, bool):
        raise ConfigError(f"{name} must be an int, got {value!r}")
    try:
        number = operator.index(value)
    except TypeError:
        raise ConfigError(f"{name} must be an int, got {value!r}") from None
    if number < minimum:
        raise ConfigError(f"{name} must be >= {minimum}, got {number}")
    return number


def _check_float(name: str, value: Any) -> float:
    # Strings are refused rather than parsed: "0.5" from a form field or a JSON body with the
    # wrong type is a client bug that a server should report, not guess around.
    if isinstance(value, (str, bytes, bool)):
        raise ConfigError(f"{name} must be a number, got {value!r}")
    if not isinstance(value, (int, float)):
        try:
            value = float(value)  # numpy scalars, 0-d tensors
        except (TypeError, ValueError):
            raise ConfigError(f"{name} must be a number, got {value!r}") from None
    number = float(value)
    if math.isnan(number) or math.isinf(number):
        raise ConfigError(f"{name} must be finite, got {number}")
    return number


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be a bool, got {value!r}")
    return value


def _normalize_stop(stop: Any) -> list[str]:
    """``stop`` as a list of distinct strings (first occurrence kept). Linear: the count is
    checked before any string is read, duplicates are found with a set."""
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    elif not isinstance(stop, Sequence):
        raise ConfigError(f"stop must be a str or a list of str, got {stop!r}")
    problem = check_count("stop", len(stop), MAX_STOP_STRINGS, "strings")
    if problem is not None:
        raise ConfigError(problem)
    strings: list[str] = []
    seen: set[str] = set()
    num_chars = 0
    for item in stop:
        if not isinstance(item, str):
            raise ConfigError(f"stop must be a str or a list of str, got item {item!r}")
        if not item:
            raise ConfigError("stop strings must not be empty")
        num_chars += len(item)
        if num_chars > MAX_STOP_CHARS:
            raise ConfigError(f"stop has more than {MAX_STOP_CHARS} characters in its strings together (the limit)")
        try:  # a lone surrogate ("\ud800", valid JSON) can never match decoded text
            item.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ConfigError(f"stop string {item!r} is not valid Unicode: {exc.reason}") from None
        if item not in seen:
            seen.add(item)
            strings.append(item)
    return strings


def _check_token_ids(name: str, ids: Any, limit: int) -> list[int]:
    """``ids`` as a list of ints in [0, 2**31), at most ``limit`` of them (checked first)."""
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        raise ConfigError(f"{name} must be a list of token ids, got {ids!r}")
    problem = check_count(name, len(ids), limit, "ids")
    if problem is not None:
        raise ConfigError(problem)
    # The common case (a JSON list of ints) in a few C-speed passes; anything else, or a value
    # out of range, goes through the per-entry checks below for their messages.
    if all(type(t) is int for t in ids) and (not ids or (min(ids) >= 0 and max(ids) < 2**31)):
        return list(ids)
    checked: list[int] = []
    for token_id in ids:
        checked.append(_check_int(name, token_id, minimum=0))
        if checked[-1] >= 2**31:
            raise ConfigError(f"{name} entries must fit in int32, got {token_id}")
    return checked


def _check_logit_bias(bias: Any) -> dict[int, float]:
    """``{token_id: bias}`` with int keys (JSON's string keys are the server's to convert) and
    finite biases clamped to [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS], as OpenAI does."""
    if not isinstance(bias, dict):
        raise ConfigError(f"logit_bias must be a dict of token id -> bias, got {bias!r}")
    problem = check_count("logit_bias", len(bias), MAX_TOKEN_ID_ENTRIES)
    if problem is not None:
        raise ConfigError(problem)
    checked: dict[int, float] = {}
    for token_id, value in bias.items():
        token = _check_int("logit_bias", token_id, minimum=0)
        if token >= 2**31:
            raise ConfigError(f"logit_bias token ids must fit in int32, got {token}")
        value = _check_float(f"logit_bias[{token}]", value)
        checked[token] = min(max(value, -MAX_LOGIT_BIAS), MAX_LOGIT_BIAS)
    return checked


def _check_bad_words(words: Any) -> list[str]:
    if isinstance(words, str) or not isinstance(words, Sequence):
        raise ConfigError(f"bad_words must be a list of str, got {words!r}")
    problem = check_count("bad_words", len(words), MAX_BAD_WORDS, "words")
    if problem is not None:
        raise ConfigError(problem)
    num_chars = 0
    for word in words:
        if not isinstance(word, str) or not word.strip():
            raise ConfigError(f"bad_words entries must be non-empty strings, got {word!r}")
        num_chars += len(word)
        if num_chars > MAX_BAD_WORDS_CHARS:
            raise ConfigError(
                f"bad_words has more than {MAX_BAD_WORDS_CHARS} characters in its words together (the limit)"
            )
    return list(words)
