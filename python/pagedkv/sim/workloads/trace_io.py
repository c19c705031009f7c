"""JSONL workload traces: read (with line-by-line validation) and write.

Format: UTF-8 text, one JSON object per line, one request per object, in arrival order. Blank
lines are skipped (they still count for line numbers). Keys:

==================  ========  ==========================================================
key                 required  meaning
==================  ========  ==========================================================
arrival_time        yes       seconds since the trace starts; number, finite, >= 0, and
                              not smaller than the previous line's (non-decreasing)
output_len          yes       tokens to generate, integer >= 1
prompt_token_ids    one of    the prompt, list of integers in 0 .. 2**31-1, non-empty
prompt_len          these     the prompt's length, integer >= 1; the tokens are synthesized
                              (see below). If both keys are given they must agree.
request_id          no        string or integer (same as its decimal string), unique in
                              the file; default: the request's 0-based position
n                   no        parallel samples, integer >= 1; default 1
shared_prefix_id    no        string or integer naming a prefix shared between requests
shared_prefix_len   no        tokens that prefix covers, 1 .. prompt length; given
                              together with shared_prefix_id, never alone
retention_priority  no        how long the prompt's cached blocks are kept once free,
                              integer 0 .. 100 (higher: longer); default: the scheduler's (35)
retention_duration  no        seconds that priority holds once a block is freed, number
                              >= 0; default: for good
retention_tokens    no        the priority covers only the full blocks within the first
                              this many prompt tokens (e.g. the shared system prompt),
                              integer >= 0; default: the whole prompt
==================  ========  ==========================================================

Any other key is an error (it catches typos such as ``"ouput_len"``).

Synthesized prompts (lines with ``prompt_len`` and no ``prompt_token_ids``): the first
``shared_prefix_len`` tokens come from the stream of ``shared_prefix_id`` and the rest from the
stream of ``request_id`` (:mod:`pagedkv.sim.workloads.synthetic_tokens`), drawn from
``0 .. vocab_size - 1`` with ``seed``. So the same file, vocab size and seed always give the same
tokens, and lines naming the same prefix id start with the same tokens. On lines that carry
``prompt_token_ids``, the shared-prefix keys are kept as metadata and tokens are not changed.

Every rule broken raises :class:`~pagedkv.errors.TraceFormatError` whose message starts with
``<file>:<line>: field '<name>':``.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from pagedkv.errors import TraceFormatError
from pagedkv.sim.workloads.request import (
    FieldError,
    TraceRequest,
    check_arrival_time,
    check_id,
    check_positive_int,
    check_retention_duration,
    check_retention_priority,
    check_retention_tokens,
    check_shared_prefix,
    check_token_ids,
)
from pagedkv.sim.workloads.synthetic_tokens import (
    DEFAULT_SYNTHETIC_VOCAB_SIZE,
    prefix_tokens,
    unique_tokens,
)

__all__ = ["load_trace", "parse_trace_lines", "save_trace", "trace_line"]

_KNOWN_KEYS = frozenset(
    {
        "arrival_time",
        "output_len",
        "prompt_token_ids",
        "prompt_len",
        "request_id",
        "n",
        "shared_prefix_id",
        "shared_prefix_len",
        "retention_priority",
        "retention_duration",
        "retention_tokens",
    }
)


def _parse_object(record: dict[str, Any], position: int, vocab_size: int, seed: int) -> TraceRequest:
    """One decoded line to a request; raises FieldError naming the first bad field."""
    unknown = sorted(set(record) - _KNOWN_KEYS)
    if unknown:
        raise FieldError(unknown[0], "is not a known key (known: " + ", ".join(sorted(_KNOWN_KEYS)) + ")")
    for required in ("arrival_time", "output_len"):
        if required not in record:
            raise FieldError(required, "is missing")
    if "prompt_token_ids" not in record and "prompt_len" not in record:
        raise FieldError("prompt_token_ids", "is missing (give 'prompt_token_ids' or 'prompt_len')")

    arrival_time = check_arrival_time(record["arrival_time"])
    output_len = check_positive_int("output_len", record["output_len"])
    request_id = check_id("request_id", record.get("request_id", position))
    n = check_positive_int("n", record.get("n", 1))
    retention_priority = check_retention_priority(record.get("retention_priority"))
    retention_duration = check_retention_duration(record.get("retention_duration"))
    retention_tokens = check_retention_tokens(record.get("retention_tokens"))
    prefix_id = record.get("shared_prefix_id")
    if prefix_id is not None:
        prefix_id = check_id("shared_prefix_id", prefix_id)

    if "prompt_token_ids" in record:
        token_ids = check_token_ids(record["prompt_token_ids"])
        if "prompt_len" in record:
            declared = check_positive_int("prompt_len", record["prompt_len"])
            if declared != len(token_ids):
                raise FieldError(
                    "prompt_len",
                    f"is {declared} but 'prompt_token_ids' holds {len(token_ids)} tokens",
                )
        prefix_len = check_shared_prefix(prefix_id, record.get("shared_prefix_len", 0), len(token_ids))
    else:
        prompt_len = check_positive_int("prompt_len", record["prompt_len"])
        prefix_len = check_shared_prefix(prefix_id, record.get("shared_prefix_len", 0), prompt_len)
        shared = (
            prefix_tokens(prefix_id, prefix_len, vocab_size=vocab_size, seed=seed)
            if prefix_id is not None
            else np.zeros(0, dtype=np.int32)
        )
        private = unique_tokens(request_id, prompt_len - prefix_len, vocab_size=vocab_size, seed=seed)
        token_ids = np.concatenate([shared, private])

    return TraceRequest(
        request_id=request_id,
        arrival_time=arrival_time,
        prompt_token_ids=token_ids,
        output_len=output_len,
        n=n,
        shared_prefix_id=prefix_id,
        shared_prefix_len=prefix_len,
        retention_priority=retention_priority,
        retention_duration=retention_duration,
        retention_tokens=retention_tokens,
    )


def parse_trace_lines(
    lines: Iterable[str],
    *,
    source: str = "<trace>",
    vocab_size: int = DEFAULT_SYNTHETIC_VOCAB_SIZE,
    seed: int = 0,
) -> list[TraceRequest]:
    """Parse JSONL trace lines (see the module docstring for the format).

    ``source`` names the input in error messages. ``vocab_size`` bounds synthesized token ids;
    explicit ``prompt_token_ids`` are not checked against it (only against int32).
    Raises TraceFormatError at the first bad line.
    """
    requests: list[TraceRequest] = []
    first_line_of_id: dict[str, int] = {}
    previous_arrival = -math.inf
    for line_number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{source}:{line_number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise TraceFormatError(f"{where}: malformed JSON: {error.msg} (column {error.colno})") from None
        if not isinstance(record, dict):
            raise TraceFormatError(f"{where}: expected a JSON object, got {type(record).__name__}")
        try:
            request = _parse_object(record, len(requests), vocab_size, seed)
        except FieldError as error:
            raise TraceFormatError(f"{where}: {error}") from None
        if request.arrival_time < previous_arrival:
            raise TraceFormatError(
                f"{where}: field 'arrival_time': {request.arrival_time} is earlier than the "
                f"previous request's {previous_arrival} (arrival times must be non-decreasing)"
            )
        if request.request_id in first_line_of_id:
            raise TraceFormatError(
                f"{where}: field 'request_id': {request.request_id!r} was already used on line "
                f"{first_line_of_id[request.request_id]}"
            )
        first_line_of_id[request.request_id] = line_number
        previous_arrival = request.arrival_time
        requests.append(request)
    return requests


def load_trace(
    path: str | os.PathLike[str],
    *,
    vocab_size: int = DEFAULT_SYNTHETIC_VOCAB_SIZE,
    seed: int = 0,
) -> list[TraceRequest]:
    """Read a JSONL trace file; every line is validated (TraceFormatError names line and field)."""
    with open(path, encoding="utf-8") as stream:
        return parse_trace_lines(stream, source=os.fspath(path), vocab_size=vocab_size, seed=seed)


def trace_line(request: TraceRequest) -> str:
    """One request as a JSONL line (without the newline); always writes the token ids."""
    record: dict[str, Any] = {
        "request_id": request.request_id,
        "arrival_time": request.arrival_time,
        "prompt_token_ids": request.prompt_token_ids.tolist(),
        "output_len": request.output_len,
    }
    if request.n != 1:
        record["n"] = request.n
    if request.shared_prefix_id is not None:
        record["shared_prefix_id"] = request.shared_prefix_id
        record["shared_prefix_len"] = request.shared_prefix_len
    if request.retention_priority is not None:
        record["retention_priority"] = request.retention_priority
    if request.retention_duration is not None:
        record["retention_duration"] = request.retention_duration
    if request.retention_tokens is not None:
        record["retention_tokens"] = request.retention_tokens
    return json.dumps(record, separators=(",", ":"))


def save_trace(path: str | os.PathLike[str], requests: Sequence[TraceRequest]) -> None:
    """Write ``requests`` as a JSONL trace that :func:`load_trace` reads back equal.

    Requests must be in non-decreasing arrival order with unique ids (what the loader demands);
    a violation raises TraceFormatError before anything is written.
    """
    previous_arrival = -math.inf
    seen: set[str] = set()
    for position, request in enumerate(requests):
        if request.arrival_time < previous_arrival:
            raise TraceFormatError(
                f"request {position} ({request.request_id!r}): field 'arrival_time': "
                f"{request.arrival_time} is earlier than the previous request's {previous_arrival}"
            )
        if request.request_id in seen:
            raise TraceFormatError(f"request {position}: field 'request_id': {request.request_id!r} is used twice")
        seen.add(request.request_id)
        previous_arrival = request.arrival_time
    with open(path, "w", encoding="utf-8") as stream:
        for request in requests:
            stream.write(trace_line(request))
            stream.write("\n")
