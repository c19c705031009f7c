"""Allocating a planned KV cache (:class:`~pagedkv.worker.kv_cache_plan.KVCachePlan`), the last
of a runner's set-up stages: the device pool, a quantized cache's scales, the per-layer views, the
host tier and the disk tier.

One tensor holds every layer's K and V, ``[page_layers, 2, num_blocks, block_size, Hkv, D]``, so
copy-on-write is one indexed copy per step; each layer's cache is a view of its page slot. The
pool is zeros, not empty: padding keys are masked, but NaN garbage times a zero weight is NaN.
A quantized cache's scales, ``[page_layers, 2, num_blocks, block_size, Hkv]``, follow it slot for
slot (a never-written slot reads 0).
"""

from __future__ import annotations

import os
import shutil
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from pagedkv.config import CacheConfig, KVGeometry
from pagedkv.errors import ConfigError
from pagedkv.kernels.kv_quant import SCALE_DTYPE, KVScales, key_rotation
from pagedkv.worker.disk_cache import DiskKVStore
from pagedkv.worker.host_cache import HostKVCache
from pagedkv.worker.kv_cache_plan import KVCachePlan

__all__ = ["KVCache", "allocate_kv_cache", "open_disk_tier", "prepare_kv_cache_dir"]

# Checkpoint K and V scales, per layer [Hkv] float32 (worker/checkpoint_scales.py).
StaticScales = tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]]


@dataclass
class KVCache:
    """The allocated device pool, its per-layer views and scales, and the host tier."""

    kv_cache: torch.Tensor
    kv_scale_cache: torch.Tensor | None  # a quantized cache's scales, else None
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (key_cache, value_cache), views
    kv_scales: list[KVScales] | None  # per layer, a quantized cache's scales, else None
    host_cache: HostKVCache | None  # the host tier, or None


def allocate_kv_cache(
    plan: KVCachePlan,
    geometry: KVGeometry,
    block_size: int,
    device: torch.device,
    *,
    model_dtype: torch.dtype,
    cache_dtype: torch.dtype,
    quantized: bool,
    static_scales: StaticScales | None,
) -> KVCache:
    """Allocate what ``plan`` says; a failed allocation is a ConfigError with the sizes."""
    page_layers, num_kv_heads, head_dim = plan.layout.page_layers, geometry.num_kv_heads, geometry.head_dim
    try:
        with torch.inference_mode():
            shape = (page_layers, 2, plan.num_blocks, block_size, num_kv_heads)
            kv_cache = torch.zeros(*shape, head_dim, dtype=cache_dtype, device=device)
            kv_scale_cache = torch.zeros(*shape, dtype=SCALE_DTYPE, device=device) if quantized else None
    except (RuntimeError, MemoryError) as exc:  # torch.OutOfMemoryError is a RuntimeError
        raise ConfigError(
            f"cannot allocate the KV cache ({plan.kv_cache_bytes:,} bytes = {plan.num_blocks} blocks x "
            f"{plan.bytes_per_block:,} bytes) on {device}: {exc}"
        ) from exc
    # Per layer: its slot of every page (a view).
    slots = plan.layout.layer_slot
    layers = range(geometry.num_layers)
    kv_caches = [(kv_cache[slots[layer], 0], kv_cache[slots[layer], 1]) for layer in layers]
    host_cache = None
    if plan.num_host_blocks > 0:
        try:
            with torch.inference_mode():
                host_cache = HostKVCache(kv_cache, kv_scale_cache, plan.num_host_blocks)
        except (RuntimeError, MemoryError) as exc:
            raise ConfigError(
                f"cannot allocate the host KV cache ({plan.host_kv_cache_bytes:,} bytes = {plan.num_host_blocks} "
                f"host blocks x {plan.bytes_per_block:,} bytes): {exc}"
            ) from exc
    kv_scales = None
    if kv_scale_cache is not None:
        k_static, v_static = static_scales if static_scales is not None else (None, None)
        # Dynamic scales: keys stored rotated (kv_quant, "Key rotation"); checkpoint scales
        # were calibrated on unrotated keys.
        rotation = key_rotation(head_dim, model_dtype, device) if static_scales is None else None
        kv_scales = [
            KVScales(
                key=kv_scale_cache[slots[layer], 0],
                value=kv_scale_cache[slots[layer], 1],
                static_key=None if k_static is None else k_static[layer].to(device),
                static_value=None if v_static is None else v_static[layer].to(device),
                key_rotation=rotation,
            )
            for layer in layers
        ]
    return KVCache(kv_cache, kv_scale_cache, kv_caches, kv_scales, host_cache)


def prepare_kv_cache_dir(folder: str | None) -> str | None:
    """The disk tier's folder, created if missing; ConfigError unless it is a writable folder."""
    if folder is None:
        return None
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"kv_cache_dir={folder!r} cannot be created: {exc}") from exc
    if not os.path.isdir(folder):
        raise ConfigError(f"kv_cache_dir={folder!r} is not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(f"kv_cache_dir={folder!r} is not writable")
    return folder


def open_disk_tier(
    cache: CacheConfig, folder: str, host_cache: HostKVCache | None, fingerprint: Callable[[], dict[str, object]]
) -> DiskKVStore:
    """The disk tier below the host tier (``kv_cache_dir``): its files' ``fingerprint()`` and
    its slot count (``kv_cache_dir_max_bytes``, default 4 GiB, at most the disk's free space)."""
    if host_cache is None:
        raise ConfigError(
            f"kv_cache_dir={cache.kv_cache_dir!r} is a disk tier below the host tier, but there is no host tier: "
            f"set num_host_blocks / host_kv_cache_memory / swap_space"
        )
    if not cache.enable_prefix_caching:
        raise ConfigError("kv_cache_dir (the disk tier) holds prefix-cache blocks: it needs enable_prefix_caching")
    tensors = [host_cache.kv_cache] + ([] if host_cache.kv_scale_cache is None else [host_cache.kv_scale_cache])
    budget = cache.kv_cache_dir_max_bytes if cache.kv_cache_dir_max_bytes is not None else 4 << 30
    free = shutil.disk_usage(folder).free
    if budget > free:
        warnings.warn(
            f"the disk tier's budget ({budget:,} bytes) is more than the free space of {folder!r} "
            f"({free:,} bytes): it is limited to the free space",
            UserWarning,
            stacklevel=3,  # ModelRunner's caller
        )
        budget = free
    store = DiskKVStore(folder, tensors, budget, fingerprint())
    if store.num_slots < 1:
        raise ConfigError(
            f"kv_cache_dir_max_bytes = {budget:,} bytes is less than one block file "
            f"({store.file_bytes:,} bytes): raise it"
        )
    return store
