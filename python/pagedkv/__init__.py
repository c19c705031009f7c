"""pagedkv: serve large language models on a paged KV cache.

The Rust core (``pagedkv._core``) owns the block pool, the prefix cache, copy-on-write and the
continuous-batching scheduler; the Python side owns tensors and model execution.
"""

from __future__ import annotations

from pagedkv.errors import *  # noqa: F401,F403  (the exception tree is part of the public API)
from pagedkv.errors import __all__ as _errors_all
from pagedkv._core import (
    BlockAllocator,
    KVCacheManager,
    RequestUpdate,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
    SchedulerStats,
)

__version__ = "0.1.0"

__all__ = [
    "BlockAllocator",
    "KVCacheManager",
    "RequestUpdate",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "SchedulerStats",
    *_errors_all,
]
