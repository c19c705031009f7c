"""Planning the KV cache, the second of a runner's set-up stages: after the probe forward has
given the geometry, before anything is allocated.

The plan fixes the layout (KV cache groups or every layer whole, :mod:`~pagedkv.worker.kv_layout`),
the bytes of one block (a page: ``page_layers`` layers of one block), how many blocks the device
pool and the host tier hold, and refuses a pool the device or the host cannot hold, so that the
failure is a ``ConfigError`` that names the knob rather than an allocator error or, on the CPU,
the OOM killer once zeros are written.

Device pool size: an explicit ``num_blocks``; else on CUDA what ``gpu_memory_utilization`` of
the device leaves after the weights and a profiled activation peak; else ``kv_cache_memory``
bytes (CPU default 1 GiB). Host tier: ``num_host_blocks``, or a byte budget
(``host_kv_cache_memory``, ``swap_space`` GiB). A budget is a ceiling: one worth more than
``MAX_NUM_BLOCKS`` blocks is clamped to it with a ``UserWarning``. Under tensor parallelism the
ranks agree on the smallest counts, so that block ids mean the same on every rank.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from pagedkv.config import MAX_NUM_BLOCKS, CacheConfig, KVGeometry
from pagedkv.errors import ConfigError
from pagedkv.kernels.layer_attention import LayerAttention
from pagedkv.worker.kv_layout import KVLayout
from pagedkv.worker.parallel_rank import ParallelRank

__all__ = ["DEFAULT_CPU_KV_CACHE_MEMORY", "KVCachePlan", "kv_layout_of", "plan_kv_cache"]

DEFAULT_CPU_KV_CACHE_MEMORY = 1 << 30  # 1 GiB
# The warnings' stack level: the code that built the ModelRunner (runner -> plan -> count -> budget).
_CALLER = 5


@dataclass(frozen=True)
class KVCachePlan:
    """What will be allocated: the layout, the block size in bytes and the pools' block counts."""

    layout: KVLayout
    layout_note: str  # which layout and why, for the log and the dashboard
    bytes_per_block: int  # one page: K and V of page_layers layers of one block (and scales)
    num_blocks: int
    num_host_blocks: int  # 0: no host tier

    @property
    def kv_cache_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    @property
    def host_kv_cache_bytes(self) -> int:
        return self.num_host_blocks * self.bytes_per_block


def plan_kv_cache(
    geometry: KVGeometry,
    layers: Sequence[LayerAttention],
    max_model_len: int,
    device: torch.device,
    cache: CacheConfig,
    *,
    cuda_budget: Callable[[], int],
    tp: ParallelRank | None = None,
) -> KVCachePlan:
    """The plan for ``cache`` (see the module docstring). ``cuda_budget()`` profiles the bytes
    left for the KV cache on a CUDA device; it is called only when the pool is sized by
    ``gpu_memory_utilization``."""
    layout, note = kv_layout_of(layers, geometry.num_layers, max_model_len, cache.enable_kv_cache_groups)
    bytes_per_block = geometry.bytes_per_block(cache.block_size) * layout.page_layers // geometry.num_layers
    num_blocks = cache.num_blocks
    if num_blocks is None:
        num_blocks = _blocks_that_fit(cache, device, bytes_per_block, cuda_budget)
    if tp is not None:  # the same block ids on every rank: the tightest one decides
        num_blocks = tp.agree(num_blocks)
    num_host_blocks = _host_blocks(cache, bytes_per_block)
    if tp is not None and num_host_blocks > 0:
        num_host_blocks = tp.agree(num_host_blocks)
    plan = KVCachePlan(layout, note, bytes_per_block, num_blocks, num_host_blocks)
    _check_fits_in_memory(plan, device)
    return plan


def kv_layout_of(
    layers: Sequence[LayerAttention], num_layers: int, max_model_len: int, enable_groups: bool
) -> tuple[KVLayout, str]:
    """The KV layout (worker/kv_layout.py) and a line that says which one and why."""
    whole = KVLayout.whole(num_layers)
    layout = KVLayout.of_layers(layers, max_model_len)
    if isinstance(layout, str):
        return whole, f"every layer whole: {layout}"
    if not layout.grouped:
        return whole, "every layer whole: every layer attends to the whole context"
    if not enable_groups:
        return whole, "every layer whole: KV cache groups are off (disable_hybrid_kv_cache_manager)"
    return layout, f"KV cache groups: {layout.describe()}"


def _blocks_that_fit(
    cache: CacheConfig, device: torch.device, bytes_per_block: int, cuda_budget: Callable[[], int]
) -> int:
    if device.type == "cuda" and cache.kv_cache_memory is None:
        budget = cuda_budget()
        source = f"gpu_memory_utilization={cache.gpu_memory_utilization}"
    else:
        budget = cache.kv_cache_memory if cache.kv_cache_memory is not None else DEFAULT_CPU_KV_CACHE_MEMORY
        source = f"kv_cache_memory={budget}"
    return _blocks_in_budget(
        budget,
        bytes_per_block,
        source,
        "the KV pool",
        f"{source} leaves {max(budget, 0)} bytes for the KV cache, less than one block ({bytes_per_block} bytes)",
    )


def _host_blocks(cache: CacheConfig, bytes_per_block: int) -> int:
    """The host tier's block count: explicit, or a byte budget (``host_kv_cache_memory``,
    or ``swap_space`` GiB) over ``bytes_per_block``; 0 without a host tier."""
    if cache.num_host_blocks is not None:
        return cache.num_host_blocks
    if cache.host_kv_cache_memory is not None:
        budget, source = cache.host_kv_cache_memory, f"host_kv_cache_memory={cache.host_kv_cache_memory}"
    elif cache.swap_space is not None:
        budget, source = int(cache.swap_space * 2**30), f"swap_space={cache.swap_space} GiB"
    else:
        return 0
    return _blocks_in_budget(
        budget,
        bytes_per_block,
        source,
        "the host tier",
        f"{source} = {budget:,} bytes is less than one KV block ({bytes_per_block:,} bytes): "
        f"raise it, or give num_host_blocks",
    )


def _blocks_in_budget(budget: int, bytes_per_block: int, source: str, pool: str, too_small: str) -> int:
    """Blocks of ``bytes_per_block`` in ``budget`` bytes: ``too_small`` is the ConfigError
    when not one fits; a budget is a ceiling, so one worth more than ``MAX_NUM_BLOCKS`` is
    clamped to it (``UserWarning`` naming ``source`` and ``pool``)."""
    num_blocks = budget // bytes_per_block
    if num_blocks < 1:
        raise ConfigError(too_small)
    if num_blocks > MAX_NUM_BLOCKS:
        warnings.warn(
            f"{source} makes room for {num_blocks} blocks of {bytes_per_block} bytes, more than the "
            f"core's limit MAX_NUM_BLOCKS = {MAX_NUM_BLOCKS}: {pool} is clamped to {MAX_NUM_BLOCKS} blocks",
            UserWarning,
            stacklevel=_CALLER,
        )
        num_blocks = MAX_NUM_BLOCKS
    return num_blocks


def _check_fits_in_memory(plan: KVCachePlan, device: torch.device) -> None:
    """Refuse, before allocating, a pool the device cannot hold, and a host tier the host
    cannot hold (on a CPU device, next to the device pool)."""
    available = _available_memory(device)
    if available is not None and plan.kv_cache_bytes > available:
        raise ConfigError(
            f"the KV cache would take {plan.kv_cache_bytes:,} bytes ({plan.num_blocks} blocks x "
            f"{plan.bytes_per_block:,} bytes), more than the {available:,} bytes available on {device}: "
            f"lower num_blocks / kv_cache_memory / gpu_memory_utilization, or block_size"
        )
    if plan.host_kv_cache_bytes == 0:
        return
    on_cpu = device.type == "cpu"
    host_available = available if on_cpu else _available_memory(torch.device("cpu"))
    if host_available is None:
        return
    if on_cpu:
        host_available -= plan.kv_cache_bytes
    if plan.host_kv_cache_bytes > host_available:
        beside = " beside the device KV cache" if on_cpu else ""
        raise ConfigError(
            f"the host KV cache would take {plan.host_kv_cache_bytes:,} bytes ({plan.num_host_blocks} host "
            f"blocks x {plan.bytes_per_block:,} bytes), more than the {max(host_available, 0):,} bytes of host "
            f"memory available{beside}: lower num_host_blocks / host_kv_cache_memory / swap_space"
        )


def _available_memory(device: torch.device) -> int | None:
    """Bytes a new tensor can take on ``device`` now (None: unknown)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:  # Linux: what can be allocated without swapping or the OOM killer
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None
