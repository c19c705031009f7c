"""The one request type every workload produces: :class:`TraceRequest`.

A trace is a list of ``TraceRequest`` in arrival order. Each request carries its prompt as token
ids (so a prefix cache can hash them) and the number of tokens to generate (the replay generates
exactly ``output_len`` tokens, as with ``SamplingParams(max_tokens=output_len, ignore_eos=True)``).

Field checks live here as small functions that raise :class:`FieldError` naming the field; the
constructor turns that into :class:`~pagedkv.errors.InvalidArgumentError`, and the JSONL loader
into :class:`~pagedkv.errors.TraceFormatError` with the line number, so both report the same rule
in the same words.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pagedkv.errors import InvalidArgumentError

__all__ = ["TraceRequest", "FieldError", "INT32_MAX", "MAX_RETENTION_PRIORITY"]

INT32_MAX = 2**31 - 1  # token ids cross into Rust and the GPU as int32
MAX_RETENTION_PRIORITY = 100  # the scheduler's range of retention priorities is 0 ..= 100


class FieldError(Exception):
    """Internal: one field of a request is invalid. ``field`` names it, ``reason`` says why."""

    def __init__(self, field_name: str, reason: str) -> None:
        super().__init__(f"field {field_name!r}: {reason}")
        self.field = field_name
        self.reason = reason


def is_json_int(value: Any) -> bool:
    """True for a Python/JSON integer; ``bool`` is excluded although it subclasses ``int``."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def check_positive_int(name: str, value: Any) -> int:
    if not is_json_int(value):
        raise FieldError(name, f"must be an integer, got {value!r}")
    if value < 1:
        raise FieldError(name, f"must be >= 1, got {value}")
    return int(value)


def check_arrival_time(value: Any) -> float:
    if not (is_json_int(value) or isinstance(value, (float, np.floating))):
        raise FieldError("arrival_time", f"must be a number, got {value!r}")
    seconds = float(value)
    if not math.isfinite(seconds) or seconds < 0:
        raise FieldError("arrival_time", f"must be finite and >= 0, got {value!r}")
    return seconds


def check_id(name: str, value: Any) -> str:
    """Ids are strings; an integer id is accepted and means the same as its decimal string."""
    if is_json_int(value):
        return str(int(value))
    if not isinstance(value, str) or not value:
        raise FieldError(name, f"must be a non-empty string or an integer, got {value!r}")
    return value


def check_token_ids(value: Any) -> np.ndarray:
    """The prompt as a read-only int32 array; rejects empty, non-integer or out-of-range ids."""
    if isinstance(value, np.ndarray):
        if value.ndim != 1 or value.dtype.kind not in "iu":
            raise FieldError(
                "prompt_token_ids",
                f"must be a 1-D integer array, got dtype {value.dtype} shape {value.shape}",
            )
        ids = value
    else:
        if isinstance(value, (str, bytes)) or not hasattr(value, "__len__"):
            raise FieldError("prompt_token_ids", f"must be a list of integers, got {value!r:.80}")
        for position, token in enumerate(value):
            if not is_json_int(token):
                raise FieldError(f"prompt_token_ids[{position}]", f"must be an integer, got {token!r}")
        ids = np.asarray(value, dtype=np.int64) if len(value) else np.zeros(0, np.int64)
    if ids.size == 0:
        raise FieldError("prompt_token_ids", "must hold at least one token")
    if ids.dtype != np.int32:
        bad = np.flatnonzero((ids < 0) | (ids > INT32_MAX))
        if bad.size:
            raise FieldError(
                f"prompt_token_ids[{bad[0]}]",
                f"token id {int(ids[bad[0]])} is outside 0..{INT32_MAX}",
            )
        ids = ids.astype(np.int32)
    else:
        bad = np.flatnonzero(ids < 0)
        if bad.size:
            raise FieldError(f"prompt_token_ids[{bad[0]}]", f"token id {int(ids[bad[0]])} is negative")
        ids = ids.copy()
    ids.flags.writeable = False
    return ids


def check_retention_priority(value: Any) -> int | None:
    """None (the scheduler's default, 35) or an integer in 0 .. MAX_RETENTION_PRIORITY."""
    if value is None:
        return None
    if not is_json_int(value) or not 0 <= value <= MAX_RETENTION_PRIORITY:
        raise FieldError("retention_priority", f"must be an integer in 0..{MAX_RETENTION_PRIORITY}, got {value!r}")
    return int(value)


def check_retention_duration(value: Any) -> float | None:
    """None (the priority holds for good) or seconds, finite and >= 0."""
    if value is None:
        return None
    if not (is_json_int(value) or isinstance(value, (float, np.floating))):
        raise FieldError("retention_duration", f"must be a number of seconds, got {value!r}")
    seconds = float(value)
    if not math.isfinite(seconds) or seconds < 0:
        raise FieldError("retention_duration", f"must be finite and >= 0, got {value!r}")
    return seconds


def check_retention_tokens(value: Any) -> int | None:
    """None (the priority covers the whole prompt) or a token count >= 0."""
    if value is None:
        return None
    if not is_json_int(value) or value < 0:
        raise FieldError("retention_tokens", f"must be an integer >= 0, got {value!r}")
    return int(value)


def check_shared_prefix(prefix_id: str | None, prefix_len: Any, prompt_len: int) -> int:
    """``shared_prefix_id`` and ``shared_prefix_len`` go together; the prefix fits the prompt."""
    if not is_json_int(prefix_len) or prefix_len < 0:
        raise FieldError("shared_prefix_len", f"must be an integer >= 0, got {prefix_len!r}")
    if prefix_id is None and prefix_len != 0:
        raise FieldError("shared_prefix_len", "is given without 'shared_prefix_id'")
    if prefix_id is not None and prefix_len == 0:
        raise FieldError("shared_prefix_id", "is given without a 'shared_prefix_len' >= 1")
    if prefix_len > prompt_len:
        raise FieldError("shared_prefix_len", f"{prefix_len} is longer than the prompt ({prompt_len} tokens)")
    return int(prefix_len)


@dataclass(frozen=True, eq=False)
class TraceRequest:
    """One request of a workload.

    Attributes:
        request_id: unique within a trace.
        arrival_time: seconds since the start of the trace, finite and >= 0.
        prompt_token_ids: int32 [prompt_len], read-only, every id in 0..2**31-1.
        output_len: tokens to generate (>= 1); the replay ignores EOS.
        n: parallel samples of this prompt (>= 1), as ``SamplingParams.n``.
        shared_prefix_id: names a prefix shared with other requests (a system prompt, the
            earlier turns of a conversation); ``None`` when the workload declares none.
        shared_prefix_len: how many leading prompt tokens that shared prefix covers
            (0 exactly when ``shared_prefix_id`` is None). Informational: the prefix cache finds
            sharing by hashing token ids, so this is the sharing the workload *intends*, the
            ideal hit for every request after the first that uses the prefix.
        retention_priority: how long the prompt's cached blocks are kept once free, 0..100
            (higher is kept longer), as ``Scheduler.add_request(retention_priority=)``; None is
            the scheduler's default (35).
        retention_duration: seconds (of the replay's simulated clock) the priority holds after
            a block is freed; None: for good.
        retention_tokens: the priority covers only the full blocks within the first this many
            prompt tokens (e.g. ``shared_prefix_len``: the shared system prompt, not the private
            tail), as ``Scheduler.add_request(retention_tokens=)``; the other blocks keep the
            default priority. None: the whole prompt; more than the prompt: the whole prompt.
    """

    request_id: str
    arrival_time: float
    prompt_token_ids: np.ndarray = field(repr=False)
    output_len: int
    n: int = 1
    shared_prefix_id: str | None = None
    shared_prefix_len: int = 0
    retention_priority: int | None = None
    retention_duration: float | None = None
    retention_tokens: int | None = None

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "request_id", check_id("request_id", self.request_id))
            object.__setattr__(self, "arrival_time", check_arrival_time(self.arrival_time))
            object.__setattr__(self, "prompt_token_ids", check_token_ids(self.prompt_token_ids))
            object.__setattr__(self, "output_len", check_positive_int("output_len", self.output_len))
            object.__setattr__(self, "n", check_positive_int("n", self.n))
            prefix_id = None if self.shared_prefix_id is None else check_id("shared_prefix_id", self.shared_prefix_id)
            object.__setattr__(self, "shared_prefix_id", prefix_id)
            prefix_len = check_shared_prefix(prefix_id, self.shared_prefix_len, self.prompt_len)
            object.__setattr__(self, "shared_prefix_len", prefix_len)
            object.__setattr__(self, "retention_priority", check_retention_priority(self.retention_priority))
            object.__setattr__(self, "retention_duration", check_retention_duration(self.retention_duration))
            object.__setattr__(self, "retention_tokens", check_retention_tokens(self.retention_tokens))
        except FieldError as error:
            raise InvalidArgumentError(f"TraceRequest {self.request_id!r}: {error}") from None

    @property
    def prompt_len(self) -> int:
        return int(self.prompt_token_ids.shape[0])

    def __repr__(self) -> str:
        return (
            f"TraceRequest(request_id={self.request_id!r}, arrival_time={self.arrival_time!r}, "
            f"prompt_len={self.prompt_len}, output_len={self.output_len}, n={self.n}, "
            f"shared_prefix_id={self.shared_prefix_id!r}, "
            f"shared_prefix_len={self.shared_prefix_len}"
            + (f", retention_priority={self.retention_priority!r}" if self.retention_priority is not None else "")
            + (f", retention_duration={self.retention_duration!r}" if self.retention_duration is not None else "")
            + (f", retention_tokens={self.retention_tokens!r}" if self.retention_tokens is not None else "")
            + ")"
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TraceRequest):
            return NotImplemented
        return (
            self.request_id == other.request_id
            and self.arrival_time == other.arrival_time
            and self.output_len == other.output_len
            and self.n == other.n
            and self.shared_prefix_id == other.shared_prefix_id
            and self.shared_prefix_len == other.shared_prefix_len
            and self.retention_priority == other.retention_priority
            and self.retention_duration == other.retention_duration
            and self.retention_tokens == other.retention_tokens
            and np.array_equal(self.prompt_token_ids, other.prompt_token_ids)
        )

    def __hash__(self) -> int:
        return hash((self.request_id, self.arrival_time, self.prompt_len, self.output_len, self.n))
