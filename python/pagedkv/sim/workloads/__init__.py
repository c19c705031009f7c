"""Workloads for simulations and benchmarks: traces of :class:`TraceRequest`.

Modules, one job each:

* ``request``           the request type and its field checks
* ``trace_io``          JSONL trace format: ``load_trace`` / ``save_trace``
* ``synthetic_tokens``  deterministic token ids for length-only workloads
* ``arrivals``          Poisson / gamma / simultaneous arrival times
* ``sharegpt``          streaming reader of the (truncated) ShareGPT V3 file
* ``tokenization``      the default tokenizer and fast batch encoding
* ``sharegpt_requests`` ShareGPT first turns and multi-turn conversations as requests
* ``shared_prefix``     synthetic shared system prompts with Zipf popularity

Nothing here needs the compiled ``pagedkv._core``; transformers is imported only when a
tokenizer is needed.
"""

from __future__ import annotations

from pagedkv.sim.workloads.arrivals import ArrivalProcess, assign_arrivals
from pagedkv.sim.workloads.request import TraceRequest
from pagedkv.sim.workloads.shared_prefix import shared_prefix_requests, zipf_weights
from pagedkv.sim.workloads.sharegpt import (
    Conversation,
    Turn,
    iter_json_array,
    load_sharegpt_conversations,
    parse_sharegpt_records,
)
from pagedkv.sim.workloads.sharegpt_requests import (
    sharegpt_first_turn_requests,
    sharegpt_multi_turn_requests,
)
from pagedkv.sim.workloads.synthetic_tokens import (
    DEFAULT_SYNTHETIC_VOCAB_SIZE,
    prefix_tokens,
    unique_tokens,
)
from pagedkv.sim.workloads.tokenization import default_tokenizer, encode_batch
from pagedkv.sim.workloads.trace_io import load_trace, parse_trace_lines, save_trace

__all__ = [
    "ArrivalProcess",
    "Conversation",
    "DEFAULT_SYNTHETIC_VOCAB_SIZE",
    "TraceRequest",
    "Turn",
    "assign_arrivals",
    "default_tokenizer",
    "encode_batch",
    "iter_json_array",
    "load_sharegpt_conversations",
    "load_trace",
    "parse_sharegpt_records",
    "parse_trace_lines",
    "prefix_tokens",
    "save_trace",
    "shared_prefix_requests",
    "sharegpt_first_turn_requests",
    "sharegpt_multi_turn_requests",
    "unique_tokens",
    "zipf_weights",
]
