"""The CPU attention backend: decodes in Rust, straight from the paged cache; prefill/extend
chunks through the torch path.

Decode attention on a CPU is bound by memory bandwidth. The torch path gathers each decode
sequence's K/V into a padded copy before SDPA, so the KV bytes cross memory three times; the
Rust kernel (``pagedkv._core.paged_decode_attention_cpu``, rust/cpu_attention.rs) reads each
K and V row once through the block table, on ``torch.get_num_threads()`` threads with the GIL
released, so it is faster per layer than SDPA over the copy (benches/RESULTS.md).
Sequences with several query rows are few per step and are large matrix products, which
SDPA already does well: they stay on :func:`reference.attend_extend_rows`.

The Rust kernel takes a float32 query and C-contiguous caches, as numpy views of the tensors
(no copy of the caches): float32 caches, or quantized ones (:mod:`.kv_quant`: int8, fp8 e4m3,
fp8 e5m2) with their C-contiguous bfloat16 scales, which it dequantizes on the fly (the fp8
caches cross as their bytes, ``view(torch.uint8)``, the scales as their bits,
``view(torch.int16)``). Anything else (other dtypes, strided caches or scales) goes entirely
through the torch path, which dequantizes gathered blocks.

Layers with a window, a chunk, soft-capping or sinks (:class:`~.layer_attention.LayerAttention`)
take the same Rust kernel, which starts each row at its first visible position (the blocks
before it are never read) and applies the soft-cap and the sinks in its softmax.

Two entry points: :func:`paged_attention` (one call, converts the index tensors itself) and
:func:`paged_attention_prepared` (a serving step: the index tensors' numpy views and host
copies come from the step's :class:`pagedkv.kernels.AttentionMetadata`, made once for all
layers).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pagedkv._core import paged_decode_attention_cpu
from pagedkv.kernels import reference
from pagedkv.kernels.kv_quant import SCALE_DTYPE, KVScales, byte_view, format_of
from pagedkv.kernels.layer_attention import FULL_ATTENTION, LayerAttention

if TYPE_CHECKING:
    from pagedkv.kernels import AttentionMetadata

__all__ = ["paged_attention", "paged_attention_prepared", "supports"]


def supports(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    kv_scales: KVScales | None = None,
) -> bool:
    """Whether the Rust decode kernel can read these tensors as they are: a float32 CPU query;
    C-contiguous caches, float32 (and no scales) or quantized (int8 / fp8) with C-contiguous
    bfloat16 scales of shape ``[num_blocks, block_size, Hkv]``."""
    if not (
        query.device.type == "cpu"
        and query.dtype == torch.float32
        and key_cache.dtype == value_cache.dtype
        and key_cache.device.type == value_cache.device.type == "cpu"
        and key_cache.is_contiguous()
        and value_cache.is_contiguous()
    ):
        return False
    if key_cache.dtype == torch.float32:
        return kv_scales is None
    if format_of(key_cache.dtype) is None or kv_scales is None:
        return False
    shape = key_cache.shape[:3]
    return all(
        s.dtype == SCALE_DTYPE and s.device.type == "cpu" and s.shape == shape and s.is_contiguous()
        for s in (kv_scales.key, kv_scales.value)
    )


def _kernel_caches(
    key_cache: torch.Tensor, value_cache: torch.Tensor, kv_scales: KVScales | None
) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    """The caches as the Rust kernel reads them (numpy views sharing memory) and its format
    keyword arguments; the tensors passed :func:`supports`."""
    fmt = format_of(key_cache.dtype)
    if fmt is None:
        return key_cache.numpy(), value_cache.numpy(), {}
    assert kv_scales is not None  # supports() checked it
    return (
        byte_view(key_cache).numpy(),  # numpy has no float8: the bytes
        byte_view(value_cache).numpy(),
        {
            "kv_format": fmt.name,
            "key_scales": kv_scales.key.view(torch.int16).numpy(),
            "value_scales": kv_scales.value.view(torch.int16).numpy(),
        },
    )


def _variant(layer: LayerAttention) -> dict[str, Any]:
    """The Rust kernel's keyword arguments for ``layer`` (none for full attention)."""
    if layer.is_full:
        return {}
    sinks = (
        None if layer.sinks is None else layer.sinks.detach().to(device="cpu", dtype=torch.float32).contiguous().numpy()
    )
    return {
        "sliding_window": layer.sliding_window,
        "chunk_size": layer.chunk_size,
        "logits_soft_cap": layer.logits_soft_cap,
        "sinks": sinks,
    }


def paged_attention(
    query: torch.Tensor,  # [T, H, D] float32
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D] float32, int8 or float8
    value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], key_cache's dtype
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32
    cu_seqlens_q: torch.Tensor,  # [B + 1] int32
    *,
    scale: float,
    out: torch.Tensor | None = None,  # [T, H, D]
    kv_scales: KVScales | None = None,  # a quantized cache's scales
    layer: LayerAttention = FULL_ATTENTION,
) -> torch.Tensor:  # [T, H, D]
    """Same contract as :func:`reference.paged_attention` (validated by the dispatcher)."""
    if not supports(query, key_cache, value_cache, kv_scales):
        return reference.paged_attention(
            query,
            key_cache,
            value_cache,
            block_tables,
            seq_lens,
            cu_seqlens_q,
            scale=scale,
            out=out,
            kv_scales=kv_scales,
            layer=layer,
        )
    result = out if out is not None and out.is_contiguous() and out.dtype == torch.float32 else _contiguous_zeros(query)
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    cu = cu_seqlens_q.to(torch.int32).contiguous()
    keys, values, quant = _kernel_caches(key_cache, value_cache, kv_scales)
    decoded = paged_decode_attention_cpu(
        query.contiguous().numpy(),
        keys,
        values,
        tables.numpy(),
        lens.numpy(),
        cu.numpy(),
        result.numpy(),
        float(scale),
        torch.get_num_threads(),
        **quant,
        **_variant(layer),
    )
    if decoded < lens.shape[0]:
        reference.attend_extend_rows(
            query, key_cache, value_cache, tables, lens, cu, scale=scale, out=result, kv_scales=kv_scales, layer=layer
        )
    if out is not None and result is not out:
        out.copy_(result)
        return out
    return result


def paged_attention_prepared(
    query: torch.Tensor,  # [T, H, D]
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,  # built by the cpu backend: cpu_views and host lists set
    *,
    scale: float,
    out: torch.Tensor | None = None,
    kv_scales: KVScales | None = None,  # a quantized cache's scales
    layer: LayerAttention = FULL_ATTENTION,
) -> torch.Tensor:  # [T, H, D]
    """:func:`paged_attention` for one layer of a step whose metadata was prepared once."""
    assert meta.cpu_views is not None and meta.host_cu_seqlens_q is not None and meta.host_seq_lens is not None
    result = out if out is not None and out.is_contiguous() and out.dtype == torch.float32 else _contiguous_zeros(query)
    fast = supports(query, key_cache, value_cache, kv_scales)
    if fast and meta.cpu_num_kernel_rows:
        # Decodes and short sequences (speculative rows), as one-row sequences (cpu_views).
        tables, lens, cu = meta.cpu_views
        keys, values, quant = _kernel_caches(key_cache, value_cache, kv_scales)
        paged_decode_attention_cpu(
            query.contiguous().numpy(),
            keys,
            values,
            tables,
            lens,
            cu,
            result.numpy(),
            float(scale),
            torch.get_num_threads(),
            **quant,
            **_variant(layer),
        )
    if not fast or meta.cpu_long_rows:
        reference.attend_host(
            query,
            key_cache,
            value_cache,
            meta.block_tables,
            meta.seq_lens,
            meta.host_cu_seqlens_q,
            meta.host_seq_lens,
            scale=scale,
            out=result,
            decodes=not fast,
            kv_scales=kv_scales,
            layer=layer,
            extend_rows=None if not fast else meta.cpu_long_rows,
        )
    if out is not None and result is not out:
        out.copy_(result)
        return out
    return result


def _contiguous_zeros(query: torch.Tensor) -> torch.Tensor:
    """Zeros shaped like ``query``, C-contiguous (the Rust kernel writes rows densely) even when
    ``query`` is a transposed view, as some models' rotary embeddings leave it."""
    return torch.zeros_like(query, memory_format=torch.contiguous_format)
