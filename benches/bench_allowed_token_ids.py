"""Per-step cost of a request's ``allowed_token_ids``: ``SamplingMetadata.build`` + ``Sampler``
on ``[16, V]`` logits, the 16 rows of one request (``n = 16``) with a list of ``K`` ids, against
the same step without the list (median of 5 steps each).

    python benches/bench_allowed_token_ids.py 100 49152 1500000

The engine passes each request's tensors built when it was added (pagedkv.sample.prepared);
this does the same. On a build from before them (no ``pagedkv.sample.prepared``) it times the
old per-step rebuild, so the two can be compared on one machine.
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from typing import Any

import torch

from pagedkv.sample.sampler import Sampler, SamplingMetadata
from pagedkv.sample.sampling_params import SamplingParams

VOCAB, ROWS, STEPS = 49152, 16, 5


def median_step_ms(sampler: Sampler, logits: torch.Tensor, params: SamplingParams, extra: dict[str, Any]) -> float:
    times = []
    for _ in range(STEPS):
        start = time.perf_counter()
        sampler(logits, SamplingMetadata.build([params] * ROWS, vocab_size=VOCAB, **extra))
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main(sizes: list[int]) -> None:
    torch.set_num_threads(2)
    sampler = Sampler()
    logits = torch.randn(ROWS, VOCAB)
    plain = median_step_ms(sampler, logits, SamplingParams(n=ROWS, temperature=1.0, seed=1), {})
    for k in sizes:
        ids = [random.randrange(VOCAB) for _ in range(k)] if k > VOCAB else random.sample(range(VOCAB), k)
        try:
            params = SamplingParams(n=ROWS, temperature=1.0, seed=1, allowed_token_ids=ids)
        except Exception as exc:  # noqa: BLE001 - a bound refuses it: say so
            print(f"K={k}: refused ({type(exc).__name__}: {exc})")
            continue
        extra: dict[str, Any] = {}
        try:
            from pagedkv.sample.prepared import prepare_sampling
        except ImportError:  # a build from before per-request tensors
            pass
        else:
            extra["prepared"] = [prepare_sampling(params, vocab_size=VOCAB)] * ROWS
        step = median_step_ms(sampler, logits, params, extra)
        print(f"K={k}: {step:.1f} ms per step (without allowed_token_ids: {plain:.1f} ms)")


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [100, VOCAB, 1_500_000])
