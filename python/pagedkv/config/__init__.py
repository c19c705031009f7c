"""Validated configuration, and the KV geometry of a model. No torch.

:class:`pagedkv.EngineArgs` (the user-facing flat arguments) builds an :class:`EngineConfig` of
small frozen parts, each validating its own fields when constructed (a bad value raises
:class:`~pagedkv.errors.ConfigError` naming the field and the value): :class:`ModelConfig`
(what to load and how to run it), :class:`CacheConfig` (the KV pool and its host and disk
tiers), :class:`SchedulingConfig` (the per-step caps, queue policy, preemption),
:class:`ParallelConfig`, :class:`StructuredOutputsConfig` and :class:`SpeculativeConfig`.

Each field is declared once, with its default and doc (:mod:`pagedkv.config.fields`); the
Rust scheduler's settings take their defaults and ranges from the core's table
(``pagedkv._core.config_fields()``) and are checked by the core, so Python checks only what the
core cannot know (devices, dtypes, kernels, files). ``EngineArgs`` and the CLI flags are
generated from these declarations. :class:`KVGeometry` is what one token's KV costs in a model.
"""

from pagedkv.config.cache import MAX_BLOCK_SIZE, MAX_NUM_BLOCKS, CacheConfig, check_pool_holds_one_request
from pagedkv.config.engine import EngineConfig, check_preemption_mode
from pagedkv.config.fields import CORE_FIELDS, config_from_any
from pagedkv.config.kv import (
    KV_CACHE_DTYPES,
    KV_CACHE_SCALES,
    KV_DTYPE_BYTES,
    KV_SCALE_BYTES,
    KVGeometry,
    canonical_kv_cache_dtype,
    kv_dtype_info,
)
from pagedkv.config.model import (
    ATTENTION_BACKENDS,
    DTYPES,
    ENFORCE_EAGER_ENV_VAR,
    LINEAR_KERNELS,
    QUANTIZATIONS,
    ModelConfig,
    resolve_enforce_eager,
    resolve_linear_kernel,
)
from pagedkv.config.scheduling import (
    EXECUTOR_BACKENDS,
    POLICIES,
    PREEMPTION_MODES,
    ParallelConfig,
    SchedulingConfig,
    StructuredOutputsConfig,
)
from pagedkv.config.speculative import MAX_SPECULATIVE_TOKENS, SPECULATIVE_METHODS, SpeculativeConfig

__all__ = [
    "ATTENTION_BACKENDS",
    "CORE_FIELDS",
    "DTYPES",
    "ENFORCE_EAGER_ENV_VAR",
    "EXECUTOR_BACKENDS",
    "KV_CACHE_DTYPES",
    "KV_CACHE_SCALES",
    "KV_DTYPE_BYTES",
    "KV_SCALE_BYTES",
    "LINEAR_KERNELS",
    "MAX_BLOCK_SIZE",
    "MAX_NUM_BLOCKS",
    "MAX_SPECULATIVE_TOKENS",
    "POLICIES",
    "PREEMPTION_MODES",
    "QUANTIZATIONS",
    "SPECULATIVE_METHODS",
    "CacheConfig",
    "EngineConfig",
    "KVGeometry",
    "ModelConfig",
    "ParallelConfig",
    "SchedulingConfig",
    "SpeculativeConfig",
    "StructuredOutputsConfig",
    "canonical_kv_cache_dtype",
    "check_pool_holds_one_request",
    "check_preemption_mode",
    "config_from_any",
    "kv_dtype_info",
    "resolve_enforce_eager",
    "resolve_linear_kernel",
]
