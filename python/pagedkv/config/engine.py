"""The configuration parts together (:class:`EngineConfig`), with the checks that span them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedkv.config.cache import CacheConfig, check_pool_holds_one_request
from pagedkv.config.model import ModelConfig
from pagedkv.config.scheduling import ParallelConfig, SchedulingConfig, StructuredOutputsConfig
from pagedkv.config.speculative import SpeculativeConfig
from pagedkv.errors import ConfigError

__all__ = ["EngineConfig", "check_preemption_mode"]


def check_preemption_mode(cache: CacheConfig, scheduling: SchedulingConfig) -> None:
    """``preemption_mode`` ``"swap"`` or ``"auto"`` needs a host tier to swap into."""
    if scheduling.preemption_mode != "recompute" and not cache.has_host_tier:
        raise ConfigError(
            f"preemption_mode={scheduling.preemption_mode!r} swaps KV to host memory, but there is no host tier "
            f"(num_host_blocks={cache.num_host_blocks!r}, host_kv_cache_memory={cache.host_kv_cache_memory!r}, "
            f"swap_space={cache.swap_space!r}): set num_host_blocks / host_kv_cache_memory / swap_space, "
            f"or use preemption_mode='recompute'"
        )


@dataclass(frozen=True)
class EngineConfig:
    """The three parts together, with the checks that span them."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduling: SchedulingConfig = field(default_factory=SchedulingConfig)
    # KV transfer between engines (pagedkv.distributed.transfer_config.KVTransferConfig), or None.
    kv_transfer: Any = None
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    structured_outputs: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    speculative: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        for name, cls in (
            ("model", ModelConfig),
            ("cache", CacheConfig),
            ("scheduling", SchedulingConfig),
            ("parallel", ParallelConfig),
            ("structured_outputs", StructuredOutputsConfig),
        ):
            if not isinstance(getattr(self, name), cls):
                raise ConfigError(f"{name} must be a {cls.__name__}, got {type(getattr(self, name)).__name__}")
        # Known before anything loads when both are explicit; otherwise checked once the
        # runner has sized the pool.
        if self.cache.num_blocks is not None and self.model.max_model_len is not None:
            check_pool_holds_one_request(self.cache.num_blocks, self.cache.block_size, self.model.max_model_len)
        check_preemption_mode(self.cache, self.scheduling)
        if self.speculative is not None and not isinstance(self.speculative, SpeculativeConfig):
            raise ConfigError(f"speculative must be a SpeculativeConfig, got {type(self.speculative).__name__}")
