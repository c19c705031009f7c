"""pagedkv: serve large language models on a paged KV cache.

The Rust core (``pagedkv._core``) owns the block pool, the prefix cache, copy-on-write and the
continuous-batching scheduler; the Python side owns tensors and model execution.

The engine classes (``LLM``, ``LLMEngine``, ``AsyncLLM``, ``SamplingParams``, ...) need torch
and transformers; they are imported on first use, so ``import pagedkv`` for the core alone stays
light and works without them (``pagedkv.LLM`` then raises ``MissingDependencyError``, an
``ImportError`` that says ``pip install 'pagedkv[engine]'``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from pagedkv._core import (
    BlockAllocator,
    KVCacheManager,
    RequestUpdate,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
    SchedulerStats,
)
from pagedkv.errors import *  # noqa: F401,F403  (the exception tree is part of the public API)
from pagedkv.errors import __all__ as _errors_all
from pagedkv.extras import needs_extra

if TYPE_CHECKING:
    from pagedkv.engine.args import EngineArgs
    from pagedkv.engine.async_llm import AsyncLLM
    from pagedkv.engine.llm import LLM
    from pagedkv.engine.llm_engine import LLMEngine
    from pagedkv.engine.outputs import BeamSearchOutput, BeamSearchSequence, CompletionOutput, RequestOutput
    from pagedkv.sample.beam_search_params import BeamSearchParams
    from pagedkv.sample.sampling_params import SamplingParams
    from pagedkv.structured.params import StructuredOutputsParams

__version__ = "0.1.0"

# Public name -> module that defines it, imported on first access (PEP 562).
_LAZY = {
    "LLM": "pagedkv.engine.llm",
    "LLMEngine": "pagedkv.engine.llm_engine",
    "AsyncLLM": "pagedkv.engine.async_llm",
    "EngineArgs": "pagedkv.engine.args",
    "SamplingParams": "pagedkv.sample.sampling_params",
    "BeamSearchParams": "pagedkv.sample.beam_search_params",
    "StructuredOutputsParams": "pagedkv.structured.params",
    "BeamSearchOutput": "pagedkv.engine.outputs",
    "BeamSearchSequence": "pagedkv.engine.outputs",
    "RequestOutput": "pagedkv.engine.outputs",
    "CompletionOutput": "pagedkv.engine.outputs",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'pagedkv' has no attribute {name!r}")
    with needs_extra(f"pagedkv.{name}"):  # a core-only install: say which extra to install
        value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "AsyncLLM",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "BlockAllocator",
    "CompletionOutput",
    "EngineArgs",
    "KVCacheManager",
    "LLM",
    "LLMEngine",
    "RequestOutput",
    "RequestUpdate",
    "SamplingParams",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "SchedulerStats",
    "StructuredOutputsParams",
    *_errors_all,
]
