"""The cpu attention backend (Rust decode kernel + torch extends) against the independent
contiguous ground truth, and its fallbacks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from paged_batches import causal_reference, make_paged_batch

import pagedkv.kernels as kernels
from pagedkv._core import paged_decode_attention_cpu
from pagedkv.errors import InvalidArgumentError


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size"),
    [(4, 4, 64, 16), (9, 3, 64, 16), (8, 2, 96, 32), (8, 1, 128, 16), (6, 2, 80, 8)],
)
@pytest.mark.parametrize("threads", [1, 2])
def test_mixed_batch_matches_ground_truth(
    num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, threads: int
) -> None:
    # Decodes of lengths 1, bs-1, bs, bs+1 and random, plus extends with prefixes ending mid-block.
    q_lens = [1, 1, 1, 1, 5, 1, 3, 1]
    seq_lens = [1, block_size - 1, block_size, block_size + 1, 2 * block_size + 3, 77, 9, 130]
    batch = make_paged_batch(
        q_lens,
        seq_lens,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        seed=threads,
    )
    want = causal_reference(batch)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = kernels.paged_attention(
            batch.query,
            batch.key_cache,
            batch.value_cache,
            batch.block_tables,
            batch.seq_lens,
            batch.cu_seqlens_q,
            backend="cpu",
        )
    finally:
        torch.set_num_threads(before)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_out_argument_and_untouched_rows() -> None:
    batch = make_paged_batch([1, 2], [20, 20], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16)
    extra = torch.full((3, 4, 64), 7.0)
    query = torch.cat([batch.query, extra[:1]])  # a row that belongs to no sequence
    out = torch.full_like(query, 7.0)
    kernels.paged_attention(
        query,
        batch.key_cache,
        batch.value_cache,
        batch.block_tables,
        batch.seq_lens,
        batch.cu_seqlens_q,
        backend="cpu",
        out=out,
    )
    torch.testing.assert_close(out[:3], causal_reference(batch), atol=1e-5, rtol=1e-5)
    assert (out[3] == 7.0).all()


def test_other_dtypes_fall_back_to_torch() -> None:
    batch = make_paged_batch(
        [1, 3], [10, 20], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float64
    )
    got = kernels.paged_attention(
        batch.query,
        batch.key_cache,
        batch.value_cache,
        batch.block_tables,
        batch.seq_lens,
        batch.cu_seqlens_q,
        backend="cpu",
    )
    torch.testing.assert_close(got, causal_reference(batch))


def test_rust_kernel_rejects_bad_tables() -> None:
    q = np.zeros((1, 2, 64), np.float32)
    cache = np.zeros((2, 16, 1, 64), np.float32)
    out = np.zeros_like(q)
    args = (np.array([[5]], np.int32), np.array([3], np.int32), np.array([0, 1], np.int32))
    with pytest.raises(InvalidArgumentError, match="block id 5"):
        paged_decode_attention_cpu(q, cache, cache, *args, out, 1.0, 1)
    with pytest.raises(InvalidArgumentError, match="needs 2 blocks"):
        paged_decode_attention_cpu(
            q,
            cache,
            cache,
            np.array([[0]], np.int32),
            np.array([20], np.int32),
            np.array([0, 1], np.int32),
            out,
            1.0,
            1,
        )
    with pytest.raises(InvalidArgumentError, match="C-contiguous"):
        paged_decode_attention_cpu(
            q,
            cache,
            cache,
            np.array([[0, 1], [1, 0]], np.int32)[:, ::2],
            np.array([3, 3], np.int32),
            np.array([0, 1, 1], np.int32),
            out,
            1.0,
            1,
        )
    with pytest.raises(InvalidArgumentError):
        kernels.resolve_backend(torch.device("cuda"), "cpu")


def test_torch_path_works_inside_and_then_outside_inference_mode() -> None:
    """The torch path reuses scratch buffers; one first made under inference mode (the engine's
    forward) must still be writable by a later call outside it."""
    from pagedkv.kernels import reference

    batch = make_paged_batch([1, 3], [20, 20], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, poison=False)
    args = (batch.query, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens, batch.cu_seqlens_q)
    with torch.inference_mode():
        inside = reference.paged_attention(*args)
    outside = reference.paged_attention(*args)
    torch.testing.assert_close(inside, outside)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_prepared_step_matches_ground_truth(dtype) -> None:
    """The serving path (metadata prepared once, numpy views reused by every layer): Rust decodes
    + torch extends for float32, the torch path for anything else."""
    batch = make_paged_batch(
        [1, 5, 1, 3, 0], [77, 40, 1, 9, 4], num_heads=9, num_kv_heads=3, head_dim=64, block_size=16, dtype=dtype
    )
    backend = kernels.get_backend(torch.device("cpu"), "cpu", dtype=dtype, head_dim=64)
    slots = torch.full((batch.query.shape[0],), -1, dtype=torch.int64)  # nothing to store
    meta = backend.prepare(
        slots,
        batch.block_tables,
        batch.seq_lens,
        batch.cu_seqlens_q,
        num_tokens=batch.query.shape[0],
        key_cache=batch.key_cache,
        value_cache=batch.value_cache,
        dtype=dtype,
    )
    assert meta.cpu_views is not None and (meta.num_decodes, meta.num_extends) == (2, 2)
    for _layer in range(2):  # the same metadata serves every layer
        got = backend.paged_attention(batch.query, batch.key_cache, batch.value_cache, meta)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, causal_reference(batch), atol=1e-5, rtol=1e-5)
