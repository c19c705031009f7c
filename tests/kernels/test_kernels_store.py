"""Triton store_kv (interpreter on CPU) against the torch path: bit-exact, poison preserved."""

from __future__ import annotations

import pytest
import torch

import pagedkv.kernels as kernels
from pagedkv.kernels import reference
from pagedkv.kernels.kv_quant import SCALE_DTYPE, KVScales, format_of

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _poisoned_caches(num_blocks, block_size, num_kv_heads, head_dim, dtype):
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return (
        torch.full(shape, float("nan"), dtype=dtype, device=DEVICE),
        torch.full(shape, float("nan"), dtype=dtype, device=DEVICE),
    )


def _random_slots(generator, num_tokens, num_slots, skip_every):
    """Distinct random slots (a permutation, so tokens cross block boundaries) with -1 holes."""
    slots = torch.randperm(num_slots, generator=generator)[:num_tokens]
    slots[::skip_every] = -1
    return slots.to(DEVICE)


@pytest.mark.parametrize(
    ("dtype", "num_kv_heads", "head_dim", "block_size"),
    [(torch.float32, 2, 64, 16), (torch.float16, 3, 96, 8), (torch.float16, 1, 128, 32), (torch.float32, 8, 80, 16)],
)
def test_store_matches_torch_bit_exact(dtype, num_kv_heads, head_dim, block_size):
    generator = torch.Generator().manual_seed(head_dim)
    num_blocks, num_tokens = 5, 37
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator).to(DEVICE, dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=generator).to(DEVICE, dtype)
    slots = _random_slots(generator, num_tokens, num_blocks * block_size, skip_every=5)

    expected_k, expected_v = _poisoned_caches(num_blocks, block_size, num_kv_heads, head_dim, dtype)
    reference.store_kv(key, value, expected_k, expected_v, slots)
    got_k, got_v = _poisoned_caches(num_blocks, block_size, num_kv_heads, head_dim, dtype)
    kernels.store_kv(key, value, got_k, got_v, slots, backend="triton")

    # equal_nan: the untouched slots must still be NaN in both (bit-exact elsewhere).
    assert torch.equal(got_k.isnan(), expected_k.isnan()) and torch.equal(got_v.isnan(), expected_v.isnan())
    assert torch.equal(got_k.nan_to_num(), expected_k.nan_to_num())
    assert torch.equal(got_v.nan_to_num(), expected_v.nan_to_num())
    written = int((slots >= 0).sum())
    assert int((~got_k.isnan()).all(dim=-1).all(dim=-1).sum()) == written


def test_store_strided_views_of_fused_qkv():
    """key/value as column views of a fused [T, (H + 2 Hkv) * D] projection output."""
    generator = torch.Generator().manual_seed(1)
    num_tokens, num_heads, num_kv_heads, head_dim, block_size = 19, 4, 2, 64, 16
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=generator).to(DEVICE)
    _, key_flat, value_flat = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=1)
    key = key_flat.view(num_tokens, num_kv_heads, head_dim)
    value = value_flat.view(num_tokens, num_kv_heads, head_dim)
    assert not key.is_contiguous() and key.stride(0) == qkv.stride(0)
    slots = _random_slots(generator, num_tokens, 3 * block_size, skip_every=7)

    got_k, got_v = _poisoned_caches(3, block_size, num_kv_heads, head_dim, torch.float32)
    kernels.store_kv(key, value, got_k, got_v, slots, backend="triton")
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        assert torch.equal(got_k[slot // block_size, slot % block_size], key[t])
        assert torch.equal(got_v[slot // block_size, slot % block_size], value[t])


def test_store_into_strided_cache():
    """A cache that is a view (here: one layer of a [layers, ...] pool with K and V interleaved)."""
    generator = torch.Generator().manual_seed(2)
    pool = torch.full((2, 4, 8, 2, 2, 64), float("nan"), device=DEVICE)  # [layer, block, slot, K/V, Hkv, D]
    key_cache, value_cache = pool[1, :, :, 0], pool[1, :, :, 1]
    key = torch.randn(10, 2, 64, generator=generator).to(DEVICE)
    value = torch.randn(10, 2, 64, generator=generator).to(DEVICE)
    slots = torch.tensor([0, 9, -1, 31, 8, 7, 15, 16, -1, 23], device=DEVICE)
    expected = pool.clone()
    reference.store_kv(key, value, expected[1, :, :, 0], expected[1, :, :, 1], slots)
    kernels.store_kv(key, value, key_cache, value_cache, slots, backend="triton")
    assert torch.equal(pool.isnan(), expected.isnan())
    assert torch.equal(pool.nan_to_num(), expected.nan_to_num())


def test_store_nothing_to_do():
    key_cache, value_cache = _poisoned_caches(2, 8, 1, 64, torch.float32)
    key = torch.randn(3, 1, 64, device=DEVICE)
    kernels.store_kv(key, key, key_cache, value_cache, torch.full((3,), -1, device=DEVICE), backend="triton")
    kernels.store_kv(
        key[:0], key[:0], key_cache, value_cache, torch.empty(0, dtype=torch.int64, device=DEVICE), backend="triton"
    )
    assert key_cache.isnan().all() and value_cache.isnan().all()


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", ["bfloat16", "int8", "float8_e4m3fn", "float8_e5m2"])
def test_store_gpu_dtypes(cache_dtype):
    """bf16 copies exactly; quantized caches store the same data and scales as the torch path,
    bit for bit (see tests/kernels/test_kv_quant_triton.py for the edge cases)."""
    dtype = getattr(torch, cache_dtype)
    if dtype == torch.float8_e4m3fn and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8 e4m3 needs compute capability >= 8.9 in Triton")
    source_dtype = torch.bfloat16
    generator = torch.Generator().manual_seed(3)
    key = torch.randn(33, 8, 128, generator=generator).to("cuda", source_dtype)
    value = torch.randn(33, 8, 128, generator=generator).to("cuda", source_dtype)
    slots = _random_slots(generator, 33, 4 * 16, skip_every=4)
    expected_k = torch.zeros(4, 16, 8, 128, dtype=dtype, device="cuda")
    expected_v = torch.zeros_like(expected_k)
    got_k, got_v = torch.zeros_like(expected_k), torch.zeros_like(expected_k)
    expected_scales = got_scales = None
    if format_of(dtype) is not None:
        expected_scales = KVScales(*torch.zeros(2, 4, 16, 8, dtype=SCALE_DTYPE, device="cuda"))
        got_scales = KVScales(*torch.zeros(2, 4, 16, 8, dtype=SCALE_DTYPE, device="cuda"))
    reference.store_kv(key, value, expected_k, expected_v, slots, kv_scales=expected_scales)
    kernels.store_kv(key, value, got_k, got_v, slots, kv_scales=got_scales, backend="triton")
    assert torch.equal(got_k.view(torch.uint8), expected_k.view(torch.uint8))
    assert torch.equal(got_v.view(torch.uint8), expected_v.view(torch.uint8))
    if got_scales is not None and expected_scales is not None:
        assert torch.equal(got_scales.key, expected_scales.key) and torch.equal(got_scales.value, expected_scales.value)
        assert (got_scales.key.flatten(0, 1)[slots[slots >= 0]] > 0).all()


@pytest.mark.gpu
def test_store_cache_larger_than_2_31_elements():
    """int64 addressing: slots in a cache of more than 2^31 elements (4.3 GB in fp16)."""
    num_kv_heads, head_dim, block_size = 8, 128, 16
    elements_per_block = block_size * num_kv_heads * head_dim
    num_blocks = (1 << 31) // elements_per_block + 8
    key_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=torch.float16, device="cuda")
    value_cache = torch.zeros_like(key_cache)
    last = num_blocks * block_size - 1
    slots = torch.tensor([last, 5, last - block_size - 3], device="cuda")
    key = torch.randn(3, num_kv_heads, head_dim, device="cuda", dtype=torch.float16)
    value = torch.randn_like(key)
    kernels.store_kv(key, value, key_cache, value_cache, slots, backend="triton")
    for t, slot in enumerate(slots.tolist()):
        assert torch.equal(key_cache[slot // block_size, slot % block_size], key[t])
        assert torch.equal(value_cache[slot // block_size, slot % block_size], value[t])
