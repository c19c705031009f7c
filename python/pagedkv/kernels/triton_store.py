"""Triton kernel that writes new tokens' K and V into the paged caches.

One program per (token, group of KV heads). Program ``(t, g)`` reads ``slot_mapping[t]``;
a negative slot means "do not store" (padding, or a token whose KV is already cached) and the
program returns. Otherwise it copies the ``[heads, head_dim]`` tile of K and of V to
``cache[slot // block_size, slot % block_size]``.

Invariants:

* every address is computed in int64: the slot is int64 and it multiplies the cache strides
  first, so caches larger than 2^31 elements work; the token index is widened too, because
  ``key``/``value`` may be views of a large fused QKV tensor;
* inputs may have any strides (strides are kernel arguments; Triton specialises unit strides);
* the copy is exact when the dtypes match; a float8 cache gets the round-to-nearest-even
  conversion of ``.to``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["store_kv"]


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,  # [T, Hkv, D]
    key_cache_ptr,
    value_cache_ptr,  # [num_blocks, BLOCK_SIZE, Hkv, D]
    slot_mapping_ptr,  # [T] int64
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_kcd,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_vcd,
    num_kv_heads,
    head_dim,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block (power of two)
    HEADS_PER_PROGRAM: tl.constexpr,  # power of two
    HEAD_DIM_PADDED: tl.constexpr,  # power of two >= head_dim
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset_in_block = slot % BLOCK_SIZE

    heads = tl.program_id(1) * HEADS_PER_PROGRAM + tl.arange(0, HEADS_PER_PROGRAM)
    dims = tl.arange(0, HEAD_DIM_PADDED)
    mask = (heads[:, None] < num_kv_heads) & (dims[None, :] < head_dim)

    k = tl.load(key_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :] * stride_kd, mask=mask)
    v = tl.load(value_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :] * stride_vd, mask=mask)

    k_dst = (
        key_cache_ptr
        + block * stride_kcb
        + offset_in_block * stride_kcs
        + heads[:, None] * stride_kch
        + dims[None, :] * stride_kcd
    )
    v_dst = (
        value_cache_ptr
        + block * stride_vcb
        + offset_in_block * stride_vcs
        + heads[:, None] * stride_vch
        + dims[None, :] * stride_vcd
    )
    tl.store(k_dst, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(value_cache_ptr.dtype.element_ty), mask=mask)


# A program moves at most this many elements of K (and as many of V): enough bytes per program
# to keep the copy bandwidth-bound, few enough registers to keep occupancy high.
_MAX_ELEMENTS_PER_PROGRAM = 4096


def store_kv(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64
) -> None:
    """Launch the store kernel (inputs already validated by the dispatcher)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    head_dim_padded = triton.next_power_of_2(head_dim)
    heads_per_program = min(triton.next_power_of_2(num_kv_heads), max(1, _MAX_ELEMENTS_PER_PROGRAM // head_dim_padded))
    grid = (num_tokens, triton.cdiv(num_kv_heads, heads_per_program))
    _store_kv_kernel[grid](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        *key.stride(),
        *value.stride(),
        *key_cache.stride(),
        *value_cache.stride(),
        num_kv_heads,
        head_dim,
        BLOCK_SIZE=key_cache.shape[1],
        HEADS_PER_PROGRAM=heads_per_program,
        HEAD_DIM_PADDED=head_dim_padded,
        num_warps=4,
    )
