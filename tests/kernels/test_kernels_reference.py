"""The torch path (oracle and CPU backend) against SDPA on contiguous KV with an explicit mask."""

from __future__ import annotations

import pytest
import torch
from paged_batches import causal_reference, make_paged_batch

from pagedkv.kernels import reference


def _args(batch):
    return batch.attention_args()


@pytest.mark.parametrize(
    ("q_lens", "seq_lens", "num_heads", "num_kv_heads", "block_size"),
    [
        # decodes only, lengths around the block boundary
        ([1, 1, 1, 1, 1], [1, 15, 16, 17, 70], 4, 4, 16),
        # GQA 3, mixed decodes / prefill / extends whose prefix ends mid-block
        ([1, 9, 1, 40, 5], [33, 9, 1, 59, 21], 9, 3, 16),
        # MQA, block size 32, long extend
        ([64, 1, 3], [100, 32, 31], 8, 1, 32),
        # more query rows than keys: the first rows see nothing
        ([6, 1], [4, 8], 4, 2, 8),
    ],
)
def test_reference_matches_sdpa_float64(q_lens, seq_lens, num_heads, num_kv_heads, block_size):
    batch = make_paged_batch(
        q_lens,
        seq_lens,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=32,
        block_size=block_size,
        dtype=torch.float64,
        seed=len(q_lens),
    )
    expected = causal_reference(batch)
    got = reference.paged_attention(*_args(batch))
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_rows_that_see_no_key_are_zero():
    batch = make_paged_batch(
        [5, 1], [3, 0], num_heads=2, num_kv_heads=1, head_dim=16, block_size=8, dtype=torch.float64
    )
    got = reference.paged_attention(*_args(batch))
    # sequence 0: prefix = 3 - 5 = -2, rows 0 and 1 see nothing; sequence 1 has no key at all
    assert (got[[0, 1, 5]] == 0).all()
    assert (got[2:5].abs().sum(dim=-1) > 0).all()


def test_decode_chunking_matches_one_chunk(monkeypatch):
    batch = make_paged_batch(
        [1] * 9,
        [5, 40, 3, 17, 33, 1, 64, 2, 20],
        num_heads=6,
        num_kv_heads=2,
        head_dim=16,
        block_size=8,
        dtype=torch.float64,
        seed=3,
    )
    whole = reference.paged_attention(*_args(batch))
    # A budget of 40 tokens x Hkv x D elements: several chunks of length-sorted sequences.
    monkeypatch.setattr(reference, "_GATHER_BUDGET_ELEMENTS", 40 * 2 * 16)
    assert len(reference._decode_chunks(list(range(9)), batch.seq_lens.tolist(), 8, 2 * 16)) > 2
    chunked = reference.paged_attention(*_args(batch))
    torch.testing.assert_close(chunked, whole, rtol=0, atol=1e-14)
    torch.testing.assert_close(chunked, causal_reference(batch), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_low_precision_is_computed_in_float32(dtype):
    batch = make_paged_batch(
        [1, 7, 1], [30, 20, 9], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=dtype, seed=5
    )
    expected = causal_reference(batch.as_dtype(torch.float64))
    got = reference.paged_attention(*_args(batch))
    assert got.dtype == dtype
    atol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=atol)


def test_out_and_scale_and_trailing_rows():
    batch = make_paged_batch(
        [1, 4], [10, 12], num_heads=2, num_kv_heads=2, head_dim=16, block_size=8, dtype=torch.float64, seed=7
    )
    # Two padding rows after the last sequence must be left alone.
    query = torch.cat([batch.query, torch.randn(2, 2, 16, dtype=torch.float64)])
    out = torch.full_like(query, 7.0)
    args = (query, *_args(batch)[1:])
    result = reference.paged_attention(*args, scale=0.3, out=out)
    assert result is out
    assert (out[-2:] == 7.0).all()
    torch.testing.assert_close(out[:-2], causal_reference(batch, scale=0.3), rtol=1e-12, atol=1e-12)
    fresh = reference.paged_attention(*args, scale=0.3)
    assert (fresh[-2:] == 0).all()


def test_store_kv_writes_only_mapped_slots():
    generator = torch.Generator().manual_seed(0)
    cache_k = torch.full((6, 8, 2, 16), float("nan"))
    cache_v = torch.full_like(cache_k, float("nan"))
    key = torch.randn(5, 2, 16, generator=generator)
    value = torch.randn(5, 2, 16, generator=generator)
    slots = torch.tensor([17, -1, 7, 8, 40], dtype=torch.int64)  # 7 | 8 crosses a block boundary
    reference.store_kv(key, value, cache_k, cache_v, slots)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(cache_k[slot // 8, slot % 8], key[t])
            assert torch.equal(cache_v[slot // 8, slot % 8], value[t])
    written = torch.zeros(6 * 8, dtype=torch.bool)
    written[[17, 7, 8, 40]] = True
    assert cache_k.view(48, -1)[~written].isnan().all()
    assert cache_v.view(48, -1)[~written].isnan().all()
