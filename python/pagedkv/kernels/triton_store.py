"""Triton kernel that writes new tokens' K and V into the paged caches.

One program per (token, group of KV heads). Program ``(t, g)`` reads ``slot_mapping[t]``;
a negative slot means "do not store" (padding, or a token whose KV is already cached) and the
program returns. Otherwise it writes the ``[heads, head_dim]`` tile of K and of V to
``cache[slot // block_size, slot % block_size]``:

* a float cache: a copy (``.to`` the cache's dtype; exact when the dtypes match);
* a quantized cache (``int8``, ``float8_e4m3fn``, ``float8_e5m2``; :mod:`.kv_quant`): each
  (token, head) vector ``x`` is quantized with its own scale, written to the bfloat16 scale
  caches of :class:`~.kv_quant.KVScales` at the same slot (``[num_blocks, block_size, Hkv]``,
  addressed with their own strides). The kernel computes exactly what
  :func:`.kv_quant.quantize_kv` computes, bit for bit:

  - ``scale = round_up_to_bf16(max(absmax(x) / qmax, 2^-126))`` (IEEE round-to-nearest
    division, ``tl.math.div_rn``; the round-up is the float32 bit trick
    ``(bits + 0xFFFF) & ~0xFFFF``), or the static scale of the head rounded up the same way
    (``static_key`` / ``static_value``);
  - ``y = clamp(x / scale, -qmax, qmax)`` (``div_rn`` again; the clamp only bites with a
    static scale, a dynamic one gives ``|y| <= qmax`` by construction);
  - int8: ``y`` rounded to nearest, ties to even (``(y + 1.5 * 2^23) - 1.5 * 2^23``, exact for
    ``|y| < 2^22``), then converted; float8: ``y`` rounded to the format's grid the same way
    (:func:`_round_to_float8_grid`: ties to even, subnormals included, the sign of zero
    kept), then converted, exactly (torch's round-to-nearest-even conversion, bit for bit).

  The float32 ``(a + c) - c`` rounding relies on the compiler keeping IEEE semantics (Triton
  sets no fast-math reassociation flags on these adds).

Invariants:

* every address is computed in int64: the slot is int64 and it multiplies the cache strides
  first, so caches larger than 2^31 elements work; the token index is widened too, because
  ``key``/``value`` may be views of a large fused QKV tensor;
* inputs and caches may have any strides (strides are kernel arguments; Triton specialises unit
  strides);
* the scale is exact in bfloat16 before it is stored, so its ``.to(bfloat16)`` is exact.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedkv.errors import InvalidArgumentError
from pagedkv.kernels.kv_quant import KVScales, format_of

__all__ = ["store_kv"]

_QUANT_NONE = 0  # plain copy
_QUANT_INT8 = 1
_QUANT_FP8 = 2


@triton.jit
def _round_up_to_bf16(x):
    """The smallest bfloat16 value >= x (positive finite float32), as float32."""
    bits = x.to(tl.int32, bitcast=True)
    return ((bits + 0xFFFF) & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _round_to_float8_grid(y, MANTISSA_BITS: tl.constexpr, MIN_EXPONENT: tl.constexpr):
    """``y`` (float32, ``|y| <= qmax``) rounded to the nearest float8 value, ties to even, as a
    float32 that the float8 conversion then stores exactly (sign of zero kept).

    The grid step at ``|y|`` is ``2^(e - MANTISSA_BITS)`` with ``e = max(exponent(y),
    MIN_EXPONENT)`` (the subnormals share the smallest normal's step); adding and subtracting
    ``1.5 * 2^(e - MANTISSA_BITS + 23)`` rounds to a multiple of it in float32's own
    round-to-nearest-even. Done here rather than by the conversion because Triton's interpreter
    rounds float32 -> float8 wrongly (a carry into the exponent, subnormals), and so that every
    target rounds the same way (hardware conversion or Triton's software one).
    """
    bits = y.to(tl.int32, bitcast=True)
    exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, MIN_EXPONENT)
    magic = (((exponent - MANTISSA_BITS + 150) << 23) | 0x400000).to(tl.float32, bitcast=True)
    rounded = (tl.abs(y) + magic) - magic
    return (rounded.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)


@triton.jit
def _quantize_tile(
    x,  # [HEADS, D] the new vectors (padding columns are 0)
    static_scale,  # [HEADS] float32, read when STATIC
    out_dtype: tl.constexpr,
    QUANT: tl.constexpr,
    QMAX: tl.constexpr,
    MANTISSA_BITS: tl.constexpr,
    MIN_EXPONENT: tl.constexpr,
    STATIC: tl.constexpr,
):
    """(data [HEADS, D] in ``out_dtype``, scale [HEADS] float32 exact in bfloat16)."""
    x = x.to(tl.float32)
    if STATIC:
        scale = _round_up_to_bf16(static_scale)
    else:
        absmax = tl.max(tl.abs(x), axis=1)
        scale = _round_up_to_bf16(tl.maximum(tl.math.div_rn(absmax, QMAX), 1.1754943508222875e-38))  # 2^-126
    y = tl.math.div_rn(x, scale[:, None])
    y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
    if QUANT == 1:
        y = (y + 12582912.0) - 12582912.0  # round half to even (|y| <= 127 < 2^22)
    else:
        y = _round_to_float8_grid(y, MANTISSA_BITS, MIN_EXPONENT)
    return y.to(out_dtype), scale


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,  # [T, Hkv, D]
    key_cache_ptr,
    value_cache_ptr,  # [num_blocks, BLOCK_SIZE, Hkv, D]
    key_scale_ptr,
    value_scale_ptr,  # [num_blocks, BLOCK_SIZE, Hkv] bfloat16 (written when QUANT != 0)
    static_key_ptr,
    static_value_ptr,  # [Hkv] float32 (read when STATIC_K / STATIC_V)
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
    stride_ksb,
    stride_kss,
    stride_ksh,
    stride_vsb,
    stride_vss,
    stride_vsh,
    num_kv_heads,
    head_dim,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block (power of two)
    HEADS_PER_PROGRAM: tl.constexpr,  # power of two
    HEAD_DIM_PADDED: tl.constexpr,  # power of two >= head_dim
    QUANT: tl.constexpr,  # 0: copy, 1: int8, 2: float8
    QMAX: tl.constexpr,  # the format's largest magnitude (QUANT != 0)
    MANTISSA_BITS: tl.constexpr,  # float8: explicit mantissa bits
    MIN_EXPONENT: tl.constexpr,  # float8: exponent of the smallest normal
    STATIC_K: tl.constexpr,  # K uses static_key instead of per-vector scales
    STATIC_V: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset_in_block = slot % BLOCK_SIZE

    heads = tl.program_id(1) * HEADS_PER_PROGRAM + tl.arange(0, HEADS_PER_PROGRAM)
    head_mask = heads < num_kv_heads
    dims = tl.arange(0, HEAD_DIM_PADDED)
    mask = head_mask[:, None] & (dims[None, :] < head_dim)

    k = tl.load(
        key_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :] * stride_kd, mask=mask, other=0.0
    )
    v = tl.load(
        value_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :] * stride_vd, mask=mask, other=0.0
    )

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
    if QUANT == 0:
        tl.store(k_dst, k.to(key_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_dst, v.to(value_cache_ptr.dtype.element_ty), mask=mask)
    else:
        static_k = 1.0
        static_v = 1.0
        if STATIC_K:
            static_k = tl.load(static_key_ptr + heads, mask=head_mask, other=1.0)
        if STATIC_V:
            static_v = tl.load(static_value_ptr + heads, mask=head_mask, other=1.0)
        k_data, k_scale = _quantize_tile(
            k, static_k, key_cache_ptr.dtype.element_ty, QUANT, QMAX, MANTISSA_BITS, MIN_EXPONENT, STATIC_K
        )
        v_data, v_scale = _quantize_tile(
            v, static_v, value_cache_ptr.dtype.element_ty, QUANT, QMAX, MANTISSA_BITS, MIN_EXPONENT, STATIC_V
        )
        tl.store(k_dst, k_data, mask=mask)
        tl.store(v_dst, v_data, mask=mask)
        k_scale_dst = key_scale_ptr + block * stride_ksb + offset_in_block * stride_kss + heads * stride_ksh
        v_scale_dst = value_scale_ptr + block * stride_vsb + offset_in_block * stride_vss + heads * stride_vsh
        tl.store(k_scale_dst, k_scale.to(key_scale_ptr.dtype.element_ty), mask=head_mask)
        tl.store(v_scale_dst, v_scale.to(value_scale_ptr.dtype.element_ty), mask=head_mask)


# A program moves at most this many elements of K (and as many of V): enough bytes per program
# to keep the copy bandwidth-bound, few enough registers to keep occupancy high.
_MAX_ELEMENTS_PER_PROGRAM = 4096


def store_kv(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], float, int8 or float8
    value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], key_cache's dtype
    slot_mapping: torch.Tensor,  # [T] int64
    kv_scales: KVScales | None = None,  # required for (and only for) an int8 / float8 cache
) -> None:
    """Launch the store kernel (inputs already validated by the dispatcher)."""
    fmt = format_of(key_cache.dtype)
    if (fmt is None) != (kv_scales is None):
        raise InvalidArgumentError(
            f"a {key_cache.dtype} cache {'needs' if fmt is not None else 'takes no'} kv_scales (triton store_kv)"
        )
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    head_dim_padded = triton.next_power_of_2(head_dim)
    heads_per_program = min(triton.next_power_of_2(num_kv_heads), max(1, _MAX_ELEMENTS_PER_PROGRAM // head_dim_padded))
    grid = (num_tokens, triton.cdiv(num_kv_heads, heads_per_program))
    if kv_scales is None:
        # Not read (QUANT == 0): any pointer, any strides.
        scales: tuple[torch.Tensor, ...] = (key_cache,) * 4
        scale_strides: tuple[int, ...] = (0,) * 6
        quant, qmax, static_k, static_v = _QUANT_NONE, 1.0, False, False
        mantissa_bits, min_exponent = 0, 0
    else:
        assert fmt is not None
        static_k, static_v = kv_scales.static_key is not None, kv_scales.static_value is not None
        scales = (
            kv_scales.key,
            kv_scales.value,
            kv_scales.static_key if kv_scales.static_key is not None else kv_scales.key,
            kv_scales.static_value if kv_scales.static_value is not None else kv_scales.value,
        )
        scale_strides = (*kv_scales.key.stride(), *kv_scales.value.stride())
        quant, qmax = (_QUANT_FP8 if fmt.is_float else _QUANT_INT8), fmt.qmax
        mantissa_bits, min_exponent = fmt.mantissa_bits, fmt.min_exponent
    _store_kv_kernel[grid](
        key,
        value,
        key_cache,
        value_cache,
        *scales,
        slot_mapping,
        *key.stride(),
        *value.stride(),
        *key_cache.stride(),
        *value_cache.stride(),
        *scale_strides,
        num_kv_heads,
        head_dim,
        BLOCK_SIZE=key_cache.shape[1],
        HEADS_PER_PROGRAM=heads_per_program,
        HEAD_DIM_PADDED=head_dim_padded,
        QUANT=quant,
        QMAX=qmax,
        MANTISSA_BITS=mantissa_bits,
        MIN_EXPONENT=min_exponent,
        STATIC_K=static_k,
        STATIC_V=static_v,
        num_warps=4,
    )
