"""Triton paged attention (the interpreter on CPU, compiled on a GPU) against the float64 oracle.

Every batch comes from :func:`paged_batches.make_paged_batch`: shuffled block tables,
-1 past each sequence's blocks, NaN in every cache slot that holds no token. ``out`` and the
split-KV workspace start as NaN too, so an unwritten row or a read of a stale entry shows up.
Shapes are small and tiles large: the interpreter pays per program and per loop iteration.
"""

from __future__ import annotations

import random

import pytest
import torch
from paged_batches import PagedBatch, make_paged_batch

import pagedkv.kernels as kernels
from pagedkv.kernels import reference, triton_attention
from pagedkv.kernels.kv_quant import SCALE_DTYPE, KVScales
from pagedkv.kernels.triton_attention import DecodeWorkspace, choose_num_splits

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ATOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def _batch(q_lens, seq_lens, *, group, num_kv_heads, head_dim, block_size, dtype, seed=0) -> PagedBatch:
    return make_paged_batch(
        q_lens,
        seq_lens,
        num_heads=group * num_kv_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        device=DEVICE,
        seed=seed,
    )


def _oracle(batch: PagedBatch) -> torch.Tensor:
    return reference.paged_attention(*batch.as_dtype(torch.float64).attention_args())


def _run_triton(batch: PagedBatch, *, num_splits: int | None = None, use_decode_kernel: bool = True) -> torch.Tensor:
    query = batch.query
    out = torch.full_like(query, float("nan"))
    workspace = None
    if num_splits is not None and num_splits > 1:
        workspace = DecodeWorkspace.allocate(
            len(batch.q_lens), query.shape[1], num_splits, query.shape[2], query.device, fill=float("nan")
        )
    triton_attention.paged_attention(
        *batch.attention_args(),
        scale=query.shape[2] ** -0.5,
        out=out,
        max_seqlen_q=max(batch.q_lens),
        num_splits=num_splits,
        workspace=workspace,
        use_decode_kernel=use_decode_kernel,
    )
    return out


def _assert_matches(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert torch.isfinite(got).all(), "non-finite output (a NaN-poisoned slot or workspace entry was read)"
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=ATOL[dtype])


def _boundary_contexts(block_size: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [1, block_size - 1, block_size, block_size + 1, rng.randint(2, 150), rng.randint(2, 150)]


@pytest.mark.parametrize(
    ("group", "num_kv_heads", "head_dim", "block_size", "dtype", "num_splits"),
    [
        (1, 2, 64, 16, torch.float32, 1),  # MHA, output written by the split kernel itself
        (3, 2, 96, 16, torch.float16, 3),  # SmolLM2-like GQA, padded head_dim, merge
        (4, 2, 128, 32, torch.float32, 4),
        (8, 1, 64, 32, torch.float16, 1),  # MQA with a full 8-head group
        (3, 1, 128, 16, torch.float32, 2),
        (8, 2, 96, 32, torch.float32, 3),
        (4, 1, 256, 16, torch.float16, 2),
    ],
)
def test_decode_matches_oracle(group, num_kv_heads, head_dim, block_size, dtype, num_splits):
    contexts = _boundary_contexts(block_size, seed=head_dim + group)
    batch = _batch(
        [1] * len(contexts),
        contexts,
        group=group,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        seed=group,
    )
    _assert_matches(_run_triton(batch, num_splits=num_splits), _oracle(batch), dtype)


@pytest.mark.parametrize(
    ("group", "head_dim", "block_size", "dtype"),
    [
        (1, 64, 16, torch.float32),
        (3, 96, 32, torch.float16),
        (4, 128, 16, torch.float16),
        (8, 64, 32, torch.float32),
    ],
)
def test_mixed_batch_matches_oracle(group, head_dim, block_size, dtype):
    # decode | prefill from scratch | decode | extend, prefix ends mid-block | extend, prefix on a block edge
    q_lens = [1, 13, 1, 40, 7]
    seq_lens = [37, 13, block_size, 40 + block_size + 5, 7 + 2 * block_size]
    batch = _batch(
        q_lens,
        seq_lens,
        group=group,
        num_kv_heads=2,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        seed=block_size + group,
    )
    _assert_matches(_run_triton(batch, num_splits=2), _oracle(batch), dtype)


def test_long_extend_crosses_many_tiles():
    """Several query tiles of one sequence, each meeting the causal diagonal at a different key tile."""
    batch = _batch(
        [150, 1], [150 + 37, 70], group=2, num_kv_heads=1, head_dim=64, block_size=16, dtype=torch.float32, seed=11
    )
    _assert_matches(_run_triton(batch), _oracle(batch), torch.float32)


def test_cache_blocks_larger_than_the_key_tile():
    """block_size 128 > BLOCK_N: a key tile covers part of one cache block."""
    batch = _batch(
        [1, 1, 20],
        [129, 60, 20 + 130],
        group=2,
        num_kv_heads=1,
        head_dim=64,
        block_size=128,
        dtype=torch.float32,
        seed=13,
    )
    _assert_matches(_run_triton(batch, num_splits=2), _oracle(batch), torch.float32)


def test_prefix_ending_next_to_a_key_tile_edge():
    """Prefixes 62, 63, 64: the first query row's last visible key sits just before, on and after
    the edge of a 32/64-key tile, where the unmasked loop must stop exactly."""
    batch = _batch(
        [5, 5, 5], [67, 68, 69], group=1, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32, seed=12
    )
    _assert_matches(_run_triton(batch), _oracle(batch), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_q_len_one_through_extend_path_equals_decode_path(dtype):
    contexts = [1, 15, 16, 17, 90]
    batch = _batch([1] * 5, contexts, group=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=dtype, seed=2)
    through_decode = _run_triton(batch, num_splits=3)
    through_extend = _run_triton(batch, use_decode_kernel=False)
    _assert_matches(through_extend, _oracle(batch), dtype)
    tolerance = 1e-6 if dtype == torch.float32 else 1e-3  # same math, different summation order
    torch.testing.assert_close(through_extend, through_decode, rtol=0, atol=tolerance)


def test_rows_that_see_no_key_are_zero_not_nan():
    # sequence 0: 6 query rows over 4 keys, so rows 0 and 1 see nothing;
    # sequence 1: a decode with an empty context; sequence 2: a normal decode.
    batch = _batch(
        [6, 1, 1], [4, 0, 9], group=2, num_kv_heads=2, head_dim=64, block_size=8, dtype=torch.float32, seed=4
    )
    for use_decode_kernel in (True, False):
        got = _run_triton(batch, num_splits=2, use_decode_kernel=use_decode_kernel)
        _assert_matches(got, _oracle(batch), torch.float32)
        assert (got[[0, 1, 6]] == 0).all()


def test_dispatcher_triton_equals_torch_with_padding_rows_and_strided_query():
    batch = _batch(
        [1, 5, 1, 12], [20, 30, 1, 12], group=3, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32, seed=8
    )
    num_tokens, num_heads, head_dim = batch.query.shape
    # query as a view of a fused QKV output with two padding rows at the end (CUDA-graph style)
    fused = torch.randn(num_tokens + 2, (num_heads + 4) * head_dim, device=DEVICE)
    query = fused[:, : num_heads * head_dim].view(num_tokens + 2, num_heads, head_dim)
    query[:num_tokens] = batch.query
    args = (query, *batch.attention_args()[1:])
    out = torch.full_like(query, 5.0)
    got = kernels.paged_attention(*args, out=out, backend="triton")
    assert got is out
    expected = kernels.paged_attention(*args, backend="torch")
    assert (out[num_tokens:] == 5.0).all(), "rows past cu_seqlens_q[-1] must be left alone"
    atol = 1e-5 if DEVICE == "cpu" else 1e-4  # the torch path on a GPU runs SDPA's own fp32 kernels
    torch.testing.assert_close(out[:num_tokens], expected[:num_tokens], rtol=0, atol=atol)
    torch.testing.assert_close(
        kernels.paged_attention(*args, backend="triton", scale=0.05)[:num_tokens],
        kernels.paged_attention(*args, backend="torch", scale=0.05)[:num_tokens],
        rtol=0,
        atol=atol,
    )


def test_decode_only_launch_without_hints():
    """T == B and no hints: the launch takes the batch as all decodes and picks splits itself."""
    batch = _batch(
        [1, 1, 1], [300, 5, 64], group=2, num_kv_heads=2, head_dim=64, block_size=32, dtype=torch.float16, seed=9
    )
    out = torch.full_like(batch.query, float("nan"))
    triton_attention.paged_attention(*batch.attention_args(), scale=0.125, out=out)
    _assert_matches(out, _oracle(batch), torch.float16)


def test_choose_num_splits_fills_the_gpu_with_long_splits():
    assert choose_num_splits(256, 8, 32768, num_sms=132) == 1
    assert choose_num_splits(1, 8, 512, num_sms=132) == 2  # short context: splits stay >= 256 keys
    assert choose_num_splits(1, 1, 100, num_sms=132) == 1
    for batch in (1, 2, 4, 8, 16, 32, 64, 128):
        for context in (512, 4096, 32768):
            splits = choose_num_splits(batch, 8, context, num_sms=132)
            assert 1 <= splits <= 64
            enough_programs = batch * 8 * splits >= 2 * 132  # at least twice the SM count
            assert enough_programs or splits == min(64, context // 256)
            assert splits == 1 or context / splits >= 256  # each split several blocks long


# ---------------------------------------------------------------------------------------------
# GPU only: bf16 (the interpreter computes it wrongly), quantized caches, > 2^31-element caches.


@pytest.mark.gpu
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 80, 128, 256])
def test_gpu_bf16_mixed_batch(group, head_dim):
    q_lens = [1, 1, 300, 1, 37]
    seq_lens = [1000, 17, 300, 4097, 37 + 130]
    batch = _batch(
        q_lens,
        seq_lens,
        group=group,
        num_kv_heads=2,
        head_dim=head_dim,
        block_size=16,
        dtype=torch.bfloat16,
        seed=head_dim,
    )
    expected = _oracle(batch)
    for num_splits in (1, 5):
        _assert_matches(_run_triton(batch, num_splits=num_splits), expected, torch.bfloat16)
    got = kernels.paged_attention(*batch.attention_args())  # auto: triton on CUDA
    _assert_matches(got, expected, torch.bfloat16)


def _quantized_caches(batch: PagedBatch, cache_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, KVScales]:
    """The batch's K/V stored (torch path) in int8 / float8 caches with their scales."""
    num_blocks, block_size, num_kv_heads, head_dim = batch.key_cache.shape
    device = batch.key_cache.device
    key_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=cache_dtype, device=device)
    value_cache = torch.zeros_like(key_cache)
    kv_scales = KVScales(*torch.zeros(2, num_blocks, block_size, num_kv_heads, dtype=SCALE_DTYPE, device=device))
    tables = batch.block_tables.cpu()
    slots = [
        int(tables[b, j // block_size]) * block_size + j % block_size
        for b, seq_len in enumerate(batch.seq_lens.tolist())
        for j in range(seq_len)
    ]
    reference.store_kv(
        torch.cat(batch.keys),
        torch.cat(batch.values),
        key_cache,
        value_cache,
        torch.tensor(slots, device=device),
        kv_scales=kv_scales,
    )
    return key_cache, value_cache, kv_scales


@pytest.mark.gpu
@pytest.mark.parametrize("cache_dtype", ["int8", "float8_e4m3fn", "float8_e5m2"])
def test_gpu_quantized_cache(cache_dtype):
    """bf16 queries over int8 / float8 caches with per-(token, head) scales, against the oracle
    on the same quantized cache (tests/kernels/test_kv_quant_triton.py has the full matrix)."""
    dtype = getattr(torch, cache_dtype)
    if dtype == torch.float8_e4m3fn and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8 e4m3 needs compute capability >= 8.9 in Triton")
    batch = _batch(
        [1, 1, 50],
        [700, 33, 120],
        group=4,
        num_kv_heads=2,
        head_dim=128,
        block_size=16,
        dtype=torch.bfloat16,
        seed=1,
    )
    key_cache, value_cache, kv_scales = _quantized_caches(batch, dtype)
    args = (batch.query, key_cache, value_cache, batch.block_tables, batch.seq_lens, batch.cu_seqlens_q)
    # Oracle on the same quantized cache: the kernel must dequantize exactly what is stored.
    expected = reference.paged_attention(batch.query.double(), *args[1:], kv_scales=kv_scales)
    for num_splits in (1, 5):
        out = torch.full_like(batch.query, float("nan"))
        triton_attention.paged_attention(
            *args, scale=128**-0.5, out=out, max_seqlen_q=50, num_splits=num_splits, kv_scales=kv_scales
        )
        _assert_matches(out, expected, torch.bfloat16)
    _assert_matches(kernels.paged_attention(*args, kv_scales=kv_scales, backend="triton"), expected, torch.bfloat16)
    torch.testing.assert_close(
        kernels.paged_attention(*args, kv_scales=kv_scales, backend="torch").double(),
        expected,
        rtol=0,
        atol=ATOL[torch.bfloat16],
    )


@pytest.mark.gpu
def test_gpu_cache_larger_than_2_31_elements():
    num_kv_heads, head_dim, block_size = 8, 128, 16
    elements_per_block = block_size * num_kv_heads * head_dim
    num_blocks = (1 << 31) // elements_per_block + 64
    key_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=torch.float16, device="cuda")
    value_cache = torch.zeros_like(key_cache)
    # Two sequences living in the last blocks of the pool (addresses past 2^31 elements).
    small = _batch(
        [1, 9],
        [40, 9 + 20],
        group=4,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=torch.float16,
        seed=3,
    )
    used = small.block_tables.clamp(min=0)
    shifted = torch.where(
        small.block_tables >= 0, small.block_tables + (num_blocks - small.key_cache.shape[0]), small.block_tables
    )
    key_cache[shifted.clamp(min=0).flatten().long()] = small.key_cache[used.flatten().long()]
    value_cache[shifted.clamp(min=0).flatten().long()] = small.value_cache[used.flatten().long()]
    big = PagedBatch(
        small.query,
        key_cache,
        value_cache,
        shifted,
        small.seq_lens,
        small.cu_seqlens_q,
        small.keys,
        small.values,
        small.q_lens,
    )
    got = kernels.paged_attention(*big.attention_args(), backend="triton")
    _assert_matches(got, _oracle(small), torch.float16)
