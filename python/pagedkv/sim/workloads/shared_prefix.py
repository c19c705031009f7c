"""Synthetic workload: a few shared system prompts with Zipf popularity, then a private part.

Each request picks one of ``num_prefixes`` system prompts; prompt ``i`` (0 = most popular) is
picked with probability proportional to ``1 / (i + 1) ** zipf_s`` (``zipf_s = 0`` is uniform,
larger is more skewed). Its prompt is that system prompt's tokens followed by ``user_len``
private tokens; every draw comes from generators seeded by ``seed``, so the same arguments give
the same workload in every process.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pagedkv.errors import ConfigError
from pagedkv.sim.workloads.arrivals import ArrivalProcess
from pagedkv.sim.workloads.request import TraceRequest
from pagedkv.sim.workloads.synthetic_tokens import (
    DEFAULT_SYNTHETIC_VOCAB_SIZE,
    prefix_tokens,
    unique_tokens,
)

__all__ = ["zipf_weights", "shared_prefix_requests", "LengthSpec"]

# A length is either fixed or drawn uniformly from an inclusive (low, high) range.
LengthSpec = int | tuple[int, int]

# Independent generator streams derived from the one seed.
_CHOICE_STREAM, _LENGTH_STREAM, _ARRIVAL_STREAM = 0, 1, 2


def zipf_weights(num_items: int, s: float) -> np.ndarray:
    """Popularity of ranks 0..num_items-1: float64 [num_items], ~ 1/(rank+1)**s, summing to 1."""
    if num_items < 1:
        raise ConfigError(f"num_items must be >= 1, got {num_items}")
    if not (np.isfinite(s) and s >= 0):
        raise ConfigError(f"zipf exponent s must be finite and >= 0, got {s}")
    weights = 1.0 / np.arange(1, num_items + 1, dtype=np.float64) ** s
    return weights / weights.sum()


def _draw_lengths(name: str, spec: LengthSpec, size: int, rng: np.random.Generator) -> np.ndarray:
    """int64 [size] lengths: all ``spec`` or uniform over the inclusive range ``spec``."""
    if isinstance(spec, tuple):
        if len(spec) != 2:
            raise ConfigError(f"{name} range must be (low, high), got {spec!r}")
        low, high = spec
    else:
        low = high = spec
    if not (isinstance(low, (int, np.integer)) and isinstance(high, (int, np.integer))):
        raise ConfigError(f"{name} must be an int or a (low, high) pair of ints, got {spec!r}")
    if not 1 <= low <= high:
        raise ConfigError(f"{name} must satisfy 1 <= low <= high, got {spec!r}")
    return rng.integers(low, high + 1, size=size, dtype=np.int64)


def shared_prefix_requests(
    num_requests: int,
    *,
    num_prefixes: int,
    prefix_len: int | Sequence[int],
    user_len: LengthSpec,
    output_len: LengthSpec,
    zipf_s: float = 1.0,
    vocab_size: int = DEFAULT_SYNTHETIC_VOCAB_SIZE,
    seed: int = 0,
    arrivals: ArrivalProcess | None = None,
) -> list[TraceRequest]:
    """``num_requests`` requests sharing ``num_prefixes`` system prompts with Zipf popularity.

    Args:
        prefix_len: one length for every system prompt, or one per prompt (>= 1 each).
        user_len: tokens after the system prompt, fixed or an inclusive (low, high) range.
        output_len: tokens to generate, fixed or an inclusive (low, high) range.
        zipf_s: popularity exponent (0: uniform).
        arrivals: arrival process (default: all at t = 0).

    Request ``j`` has id ``"shared-<j>"`` and declares ``shared_prefix_id = "system-<i>"`` with
    ``shared_prefix_len`` = that prompt's length. Prefix tokens are
    :func:`~pagedkv.sim.workloads.synthetic_tokens.prefix_tokens` of that id, so a JSONL trace with
    ``prompt_len`` and the same prefix ids, vocab size and seed describes the same prompts.
    """
    if num_requests < 0:
        raise ConfigError(f"num_requests must be >= 0, got {num_requests}")
    weights = zipf_weights(num_prefixes, zipf_s)
    lengths = [prefix_len] * num_prefixes if isinstance(prefix_len, (int, np.integer)) else list(prefix_len)
    if len(lengths) != num_prefixes or any(
        not isinstance(length, (int, np.integer)) or length < 1 for length in lengths
    ):
        raise ConfigError(f"prefix_len must be an int >= 1 or {num_prefixes} such ints, got {prefix_len!r}")
    choices = np.random.default_rng([seed, _CHOICE_STREAM]).choice(num_prefixes, size=num_requests, p=weights)
    length_rng = np.random.default_rng([seed, _LENGTH_STREAM])
    user_lens = _draw_lengths("user_len", user_len, num_requests, length_rng)
    output_lens = _draw_lengths("output_len", output_len, num_requests, length_rng)
    times = (arrivals or ArrivalProcess()).sample(num_requests, np.random.default_rng([seed, _ARRIVAL_STREAM]))

    prefixes = [
        prefix_tokens(f"system-{rank}", int(length), vocab_size=vocab_size, seed=seed)
        for rank, length in enumerate(lengths)
    ]
    requests = []
    for j in range(num_requests):
        rank = int(choices[j])
        request_id = f"shared-{j}"
        private = unique_tokens(request_id, int(user_lens[j]), vocab_size=vocab_size, seed=seed)
        requests.append(
            TraceRequest(
                request_id=request_id,
                arrival_time=float(times[j]),
                prompt_token_ids=np.concatenate([prefixes[rank], private]),
                output_len=int(output_lens[j]),
                shared_prefix_id=f"system-{rank}",
                shared_prefix_len=int(lengths[rank]),
            )
        )
    return requests
