"""Engine arguments, with vLLM's names (``LLM(model=..., **engine_args)``): each field is a
config class's field (same default and doc, :func:`pagedkv.config.fields.engine_arg`) or one
only EngineArgs has; the CLI flags are generated from them (:mod:`pagedkv.cli.engine_args`)."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any

from pagedkv.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulingConfig,
    SpeculativeConfig,
    StructuredOutputsConfig,
)
from pagedkv.config.fields import documented, engine_arg, setting
from pagedkv.distributed.transfer_config import KVTransferConfig
from pagedkv.errors import ConfigError
from pagedkv.sizes import as_byte_count

__all__ = ["BYTE_SIZE_FIELDS", "EngineArgs"]

# The fields that are byte counts: an int, or a size string ("8GiB", "512MiB", "1.5GB", "4096").
BYTE_SIZE_FIELDS = ("kv_cache_memory", "host_kv_cache_memory", "kv_cache_dir_max_bytes")


@documented
@dataclass
class EngineArgs:
    """Everything needed to build an engine: the model, its KV cache, and the scheduler.

    Each field is a field of a config class (:mod:`pagedkv.config`), with its default and doc
    (the fields below), or one that only EngineArgs has. Every value is checked when the
    arguments are built (:meth:`create_engine_config`, called by ``__post_init__``): a bad one
    raises :class:`~pagedkv.errors.ConfigError` naming the field and the value, before any
    model loads.
    """

    model: str | None = engine_arg(ModelConfig, "model")
    tokenizer: str | None = engine_arg(ModelConfig, "tokenizer")
    dtype: str = engine_arg(ModelConfig, "dtype")
    device: str = engine_arg(ModelConfig, "device")
    block_size: int = engine_arg(CacheConfig, "block_size")
    num_blocks: int | None = engine_arg(CacheConfig, "num_blocks")
    kv_cache_memory: int | str | None = engine_arg(CacheConfig, "kv_cache_memory")
    gpu_memory_utilization: float = engine_arg(CacheConfig, "gpu_memory_utilization")
    max_model_len: int | None = engine_arg(ModelConfig, "max_model_len")
    max_num_seqs: int = engine_arg(SchedulingConfig, "max_num_seqs")
    max_num_batched_tokens: int = engine_arg(SchedulingConfig, "max_num_batched_tokens")
    enable_prefix_caching: bool = engine_arg(CacheConfig, "enable_prefix_caching")
    kv_cache_dtype: str = engine_arg(CacheConfig, "kv_cache_dtype")
    kv_cache_scales: str = engine_arg(CacheConfig, "kv_cache_scales")
    num_host_blocks: int | None = engine_arg(CacheConfig, "num_host_blocks")
    host_kv_cache_memory: int | str | None = engine_arg(CacheConfig, "host_kv_cache_memory")
    swap_space: float | None = engine_arg(CacheConfig, "swap_space")
    preemption_mode: str = engine_arg(SchedulingConfig, "preemption_mode")
    kv_cache_dir: str | None = engine_arg(CacheConfig, "kv_cache_dir")
    kv_cache_dir_max_bytes: int | str | None = engine_arg(CacheConfig, "kv_cache_dir_max_bytes")
    enable_kv_cache_events: bool = engine_arg(CacheConfig, "enable_kv_cache_events")
    disable_hybrid_kv_cache_manager: bool = setting(
        False,
        "keep every layer's KV whole even when the model has sliding-window or chunked layers (vLLM's name; "
        "the inverse of CacheConfig's ``enable_kv_cache_groups``: otherwise such a model's KV is kept in KV "
        "cache groups, which give back the blocks a window has left behind). KV transfer between engines "
        "(``kv_transfer_config``) carries the groups (both engines must agree).",
        source=("CacheConfig", "enable_kv_cache_groups"),
        inverse=True,
    )
    scheduling_policy: str = engine_arg(SchedulingConfig, "policy")
    attention_backend: str | None = engine_arg(ModelConfig, "attention_backend")
    seed: int = engine_arg(ModelConfig, "seed")
    trust_remote_code: bool = engine_arg(ModelConfig, "trust_remote_code")
    max_logprobs: int = engine_arg(ModelConfig, "max_logprobs")
    linear_kernel: str = engine_arg(ModelConfig, "linear_kernel")
    quantization: str | None = engine_arg(ModelConfig, "quantization")
    enforce_eager: bool | None = engine_arg(ModelConfig, "enforce_eager")
    tensor_parallel_size: int = engine_arg(ParallelConfig, "tensor_parallel_size")
    distributed_executor_backend: str | None = engine_arg(ParallelConfig, "distributed_executor_backend")
    kv_transfer_config: KVTransferConfig | None = setting(
        None,
        "take part in disaggregated prefill / decode (a "
        ":class:`~pagedkv.distributed.transfer_config.KVTransferConfig`, a dict, or its JSON text, e.g. "
        '``{"role": "consumer", "transport": "nixl"}``); requests then accept ``kv_transfer_params``.',
    )
    structured_outputs_config: StructuredOutputsConfig | None = setting(
        None,
        "how requests' JSON schemas and grammars are compiled (``SamplingParams.structured_outputs``): a dict, "
        "its JSON text, or a :class:`~pagedkv.config.StructuredOutputsConfig` of its fields "
        "(``compile_timeout_s``, ``max_cached_grammars``, ``compile_workers``, ``max_queued_compiles``).",
    )
    speculative_config: SpeculativeConfig | None = setting(
        None,
        "speculative decoding: a dict, its JSON text, or a :class:`~pagedkv.config.SpeculativeConfig`, e.g. "
        '``{"method": "ngram", "num_speculative_tokens": 4}`` (None: off).',
    )

    @classmethod
    def from_kwargs(cls, model: str | None = None, **kwargs: Any) -> EngineArgs:
        """`EngineArgs(model=..., **kwargs)` with a clear error for unknown names."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ConfigError(f"unknown engine argument(s) {unknown}; known: {sorted(known)}")
        return cls(model=model, **kwargs)

    def __post_init__(self) -> None:
        for name in ("model", "tokenizer", "kv_cache_dir"):
            if isinstance(getattr(self, name), os.PathLike):
                setattr(self, name, os.fspath(getattr(self, name)))
        if self.kv_transfer_config is not None:
            self.kv_transfer_config = KVTransferConfig.from_any(self.kv_transfer_config)
        self.structured_outputs_config = StructuredOutputsConfig.from_any(self.structured_outputs_config)
        self.speculative_config = SpeculativeConfig.from_any(self.speculative_config)
        for name in BYTE_SIZE_FIELDS:  # "8GiB" -> bytes, once
            setattr(self, name, as_byte_count(getattr(self, name), name))
        self.create_engine_config()

    def create_engine_config(self) -> EngineConfig:
        """The validated configuration (:mod:`pagedkv.config`) these arguments describe."""
        return EngineConfig(
            model=ModelConfig(
                model=self.model,
                tokenizer=self.tokenizer,
                dtype=self.dtype,
                device=self.device,
                max_model_len=self.max_model_len,
                attention_backend=self.attention_backend,
                seed=self.seed,
                trust_remote_code=self.trust_remote_code,
                max_logprobs=self.max_logprobs,
                linear_kernel=self.linear_kernel,
                quantization=self.quantization,
                enforce_eager=self.enforce_eager,
            ),
            cache=CacheConfig(
                block_size=self.block_size,
                num_blocks=self.num_blocks,
                kv_cache_memory=as_byte_count(self.kv_cache_memory, "kv_cache_memory"),
                gpu_memory_utilization=self.gpu_memory_utilization,
                enable_prefix_caching=self.enable_prefix_caching,
                kv_cache_dtype=self.kv_cache_dtype,
                kv_cache_scales=self.kv_cache_scales,
                num_host_blocks=self.num_host_blocks,
                host_kv_cache_memory=as_byte_count(self.host_kv_cache_memory, "host_kv_cache_memory"),
                swap_space=self.swap_space,
                kv_cache_dir=self.kv_cache_dir,
                kv_cache_dir_max_bytes=as_byte_count(self.kv_cache_dir_max_bytes, "kv_cache_dir_max_bytes"),
                enable_kv_cache_events=self.enable_kv_cache_events,
                enable_kv_cache_groups=not self.disable_hybrid_kv_cache_manager,
            ),
            scheduling=SchedulingConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens,
                policy=self.scheduling_policy,
                preemption_mode=self.preemption_mode,
            ),
            kv_transfer=self.kv_transfer_config,
            parallel=ParallelConfig(
                tensor_parallel_size=self.tensor_parallel_size,
                distributed_executor_backend=self.distributed_executor_backend,
            ),
            structured_outputs=StructuredOutputsConfig.from_any(self.structured_outputs_config),
            speculative=SpeculativeConfig.from_any(self.speculative_config),
        )
