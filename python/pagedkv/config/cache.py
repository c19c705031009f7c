"""The KV pool and its tiers (:class:`CacheConfig`): block size, pool size, prefix caching,
KV dtype, the host and disk tiers."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from pagedkv.config.fields import (
    CORE_FIELDS,
    check_bool,
    check_core,
    core_setting,
    documented,
    is_int,
    positive_int,
    setting,
)
from pagedkv.config.kv import KV_CACHE_SCALES, canonical_kv_cache_dtype
from pagedkv.errors import ConfigError

__all__ = ["MAX_BLOCK_SIZE", "MAX_NUM_BLOCKS", "CacheConfig", "check_pool_holds_one_request"]

# The Rust core's limits (its table's ranges of block_size and num_blocks).
MAX_BLOCK_SIZE: int = CORE_FIELDS["block_size"]["max"]
MAX_NUM_BLOCKS: int = CORE_FIELDS["num_blocks"]["max"]
# The kernels' smallest block (a power of two from here up to MAX_BLOCK_SIZE).
MIN_KERNEL_BLOCK_SIZE = 8


def check_pool_holds_one_request(
    num_blocks: int, block_size: int, max_model_len: int, detail: str = "", blocks_per_request: int | None = None
) -> None:
    """A pool that cannot hold one ``max_model_len`` request is refused: a lone request must
    always be able to run (and preemption must terminate). ``blocks_per_request``: the blocks
    (pages) such a request holds at most, when not one per ``block_size`` tokens (KV cache
    groups: ``SchedulerConfig.blocks_for_sequence``)."""
    capacity = num_blocks * block_size
    if blocks_per_request is not None:
        if num_blocks < blocks_per_request:
            raise ConfigError(
                f"the KV cache holds {num_blocks} pages{detail}, fewer than the {blocks_per_request} one request of "
                f"max_model_len = {max_model_len} tokens holds in its KV cache groups: raise kv_cache_memory / "
                f"num_blocks / gpu_memory_utilization, or lower max_model_len"
            )
        return
    if capacity < max_model_len:
        raise ConfigError(
            f"the KV cache holds {capacity} tokens ({num_blocks} blocks of {block_size}{detail}), fewer than one "
            f"request of max_model_len = {max_model_len} tokens: raise kv_cache_memory / num_blocks / "
            f"gpu_memory_utilization, or lower max_model_len"
        )


@documented
@dataclass(frozen=True)
class CacheConfig:
    """The KV pool (block size and size), prefix caching, the KV dtype, and the host and disk
    tiers. A byte budget is a ceiling: when it would give more than ``MAX_NUM_BLOCKS`` blocks,
    the pool is clamped to ``MAX_NUM_BLOCKS`` (``UserWarning``); a pool larger than the device's
    (or, for the host tier, the host's available) memory is refused (``ConfigError``) before it
    is allocated."""

    block_size: int = core_setting(
        "block_size", f"tokens per KV block, a power of two in {MIN_KERNEL_BLOCK_SIZE} .. {MAX_BLOCK_SIZE}."
    )
    num_blocks: int | None = core_setting(
        "num_blocks",
        f"the KV pool size in blocks (1 .. {MAX_NUM_BLOCKS}); at most one of ``num_blocks`` and "
        "``kv_cache_memory``; with neither, ``gpu_memory_utilization`` sizes it on CUDA, and it is 1 GiB on "
        "the CPU.",
        default=None,
    )
    kv_cache_memory: int | None = setting(
        None, "the KV pool as a byte budget (EngineArgs and the CLI also take a size such as ``512MiB``)."
    )
    gpu_memory_utilization: float = setting(
        0.9,
        "CUDA, with neither ``num_blocks`` nor ``kv_cache_memory``: the fraction of the device (0 < x <= 1) "
        "that sizes the pool, after the weights and a profiling forward's activation peak.",
    )
    enable_prefix_caching: bool = core_setting("enable_prefix_caching", "reuse the KV of shared prompt prefixes.")
    kv_cache_dtype: str = setting(
        "auto",
        '``"auto"`` (the model\'s dtype), ``"int8"``, ``"fp8"`` (= ``"fp8_e4m3"``), ``"fp8_e5m2"`` (or '
        "``torch.int8`` / ``torch.float8_e4m3fn`` / ``torch.float8_e5m2``): quantized blocks with a bfloat16 "
        "scale per (token, KV head) computed as each token is stored (no calibration), ~4x (vs float32) or "
        "~2x (vs 16-bit) the tokens in the same memory.",
    )
    kv_cache_scales: str = setting(
        "dynamic",
        '``"dynamic"`` (the per-vector scales of a quantized ``kv_cache_dtype``) or ``"checkpoint"`` (the '
        "model's static ``k_scale`` / ``v_scale`` tensors; an error if it has none).",
    )
    num_host_blocks: int | None = core_setting(
        "num_host_blocks",
        f"the host-memory KV tier (swap preemption and a host-memory prefix cache) in blocks (0 .. "
        f"{MAX_NUM_BLOCKS}; 0: no host tier); at most one of ``num_host_blocks``, ``host_kv_cache_memory`` and "
        "``swap_space``, none of them: no host tier.",
        default=None,
    )
    host_kv_cache_memory: int | None = setting(
        None,
        "the host tier as a byte budget (or a size), turned into blocks of the device pool's size "
        "(less than one block is an error).",
    )
    swap_space: float | None = setting(None, "the host tier as a budget in GiB (vLLM's name).")
    kv_cache_dir: str | None = setting(
        None,
        "folder of the disk KV tier below the host tier (created if missing; must be writable; needs a host "
        "tier and prefix caching); ``None``: no disk tier.",
    )
    kv_cache_dir_max_bytes: int | None = setting(
        None, "the most bytes the disk tier may hold (or a size; needs ``kv_cache_dir``); ``None``: no limit."
    )
    enable_kv_cache_events: bool = setting(
        False,
        "record which blocks enter and leave the prefix cache of every tier (vLLM's KV events), taken per step "
        "by ``LLMEngine.take_kv_events`` for KV-aware routers (``pagedkv serve --kv-events-endpoint`` "
        "publishes them).",
        core="enable_kv_events",
    )
    enable_kv_cache_groups: bool = setting(
        True,
        "a model whose layers do not all attend to the whole context (sliding windows, chunks) keeps its KV "
        "in KV cache groups (worker/kv_layout.py): the blocks a window has left behind go back to the pool. "
        "False: every layer whole.",
    )

    @property
    def has_host_tier(self) -> bool:
        """A host tier was asked for (its block count is resolved by the runner)."""
        return self.num_host_blocks != 0 and any(
            value is not None for value in (self.num_host_blocks, self.host_kv_cache_memory, self.swap_space)
        )

    def __post_init__(self) -> None:
        object.__setattr__(self, "kv_cache_dtype", canonical_kv_cache_dtype(self.kv_cache_dtype))
        if self.kv_cache_scales not in KV_CACHE_SCALES:
            raise ConfigError(f"kv_cache_scales must be one of {KV_CACHE_SCALES}, got {self.kv_cache_scales!r}")
        if self.kv_cache_scales == "checkpoint" and self.kv_cache_dtype == "auto":
            raise ConfigError(
                "kv_cache_scales='checkpoint' needs a quantized kv_cache_dtype ('int8', 'fp8_e4m3', 'fp8_e5m2'); "
                "kv_cache_dtype is 'auto'"
            )
        bs = self.block_size
        if not is_int(bs) or bs < MIN_KERNEL_BLOCK_SIZE or bs & (bs - 1) or bs > MAX_BLOCK_SIZE:
            # The kernels' rule (a power of two from 8), within the core's range.
            raise ConfigError(
                f"block_size must be a power of two in {MIN_KERNEL_BLOCK_SIZE} .. {MAX_BLOCK_SIZE}, got {bs!r}"
            )
        if self.num_blocks is not None:
            check_core(num_blocks=self.num_blocks)
        if self.kv_cache_memory is not None and (not is_int(self.kv_cache_memory) or self.kv_cache_memory < 1):
            raise ConfigError(f"kv_cache_memory must be a positive number of bytes, got {self.kv_cache_memory!r}")
        if self.num_blocks is not None and self.kv_cache_memory is not None:
            raise ConfigError(
                f"give the KV pool size as num_blocks or kv_cache_memory, not both "
                f"(got num_blocks={self.num_blocks!r}, kv_cache_memory={self.kv_cache_memory!r})"
            )
        gmu = self.gpu_memory_utilization
        if isinstance(gmu, bool) or not isinstance(gmu, (int, float)) or not 0.0 < gmu <= 1.0:
            raise ConfigError(f"gpu_memory_utilization must be a number in (0, 1], got {gmu!r}")
        check_core(enable_prefix_caching=self.enable_prefix_caching)
        check_bool("enable_kv_cache_events", self.enable_kv_cache_events)
        check_bool("enable_kv_cache_groups", self.enable_kv_cache_groups)
        self._check_host_tier()
        self._check_disk_tier()

    def _check_host_tier(self) -> None:
        nhb = self.num_host_blocks
        if nhb is not None:
            check_core(num_host_blocks=nhb)
        memory = self.host_kv_cache_memory
        if memory is not None and (not is_int(memory) or memory < 1):
            raise ConfigError(f"host_kv_cache_memory must be a positive number of bytes, got {memory!r}")
        space = self.swap_space
        if space is not None and (
            isinstance(space, bool) or not isinstance(space, (int, float)) or not (math.isfinite(space) and space > 0)
        ):
            raise ConfigError(f"swap_space must be a positive number of GiB, got {space!r}")
        given = {
            name: value
            for name, value in (("num_host_blocks", nhb), ("host_kv_cache_memory", memory), ("swap_space", space))
            if value is not None
        }
        if len(given) > 1:
            detail = ", ".join(f"{name}={value!r}" for name, value in given.items())
            raise ConfigError(
                f"give the host tier size as one of num_host_blocks, host_kv_cache_memory or swap_space, "
                f"not several (got {detail})"
            )

    def _check_disk_tier(self) -> None:
        folder = self.kv_cache_dir
        if isinstance(folder, os.PathLike):
            folder = os.fspath(folder)
        if folder is not None and (not isinstance(folder, str) or not folder):
            raise ConfigError(f"kv_cache_dir must be a folder path (str or os.PathLike), got {self.kv_cache_dir!r}")
        object.__setattr__(self, "kv_cache_dir", folder)
        positive_int("kv_cache_dir_max_bytes", self.kv_cache_dir_max_bytes, optional=True)
        if self.kv_cache_dir_max_bytes is not None and folder is None:
            raise ConfigError(
                f"kv_cache_dir_max_bytes={self.kv_cache_dir_max_bytes!r} limits the disk tier, but kv_cache_dir "
                f"is not set"
            )
        if folder is not None and not self.has_host_tier:
            raise ConfigError(
                f"kv_cache_dir={folder!r} is a disk tier below the host tier, but there is no host tier: "
                f"set num_host_blocks / host_kv_cache_memory / swap_space"
            )
        if folder is not None and not self.enable_prefix_caching:
            raise ConfigError("kv_cache_dir (the disk tier) holds prefix-cache blocks: it needs enable_prefix_caching")
