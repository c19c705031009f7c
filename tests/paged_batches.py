"""Random paged batches for the kernel tests and the GPU check.

:func:`make_paged_batch` builds a batch the way the engine would see it, with the traps a
kernel can fall into made explicit:

* each sequence's K/V is kept contiguous (``keys[b]``: ``[seq_len, Hkv, D]``) as ground
  truth, and scattered into the paged caches through a **shuffled, non-monotonic** block table;
* every cache slot that holds no token of the batch (unused blocks, the tail of each
  sequence's last block) is **NaN** when ``poison`` is set, so that reading one shows up as a
  non-finite output;
* block-table entries past a sequence's last block are ``-1``, and the table has a spare
  column, so that reading past the end shows up as a bad address or a NaN.

Query rows are packed in batch order; ``cu_seqlens_q`` and ``seq_lens`` follow the kernel contract
(docs/kernels.md, Kernels: ``seq_lens`` counts every KV token, the new ones included).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from pagedkv.kernels import reference
from pagedkv.kernels.layer_attention import LayerAttention

__all__ = ["PagedBatch", "causal_reference", "layer_reference", "make_paged_batch", "poison_blocks_before"]


@dataclass
class PagedBatch:
    query: torch.Tensor  # [T, H, D]
    key_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor  # [B, max_blocks] int32, -1 past each sequence's blocks
    seq_lens: torch.Tensor  # [B] int32
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    keys: list[torch.Tensor]  # per sequence [seq_len, Hkv, D], the ground truth of key_cache
    values: list[torch.Tensor]  # per sequence [seq_len, Hkv, D]
    q_lens: list[int]

    def attention_args(self) -> tuple[torch.Tensor, ...]:
        return (self.query, self.key_cache, self.value_cache, self.block_tables, self.seq_lens, self.cu_seqlens_q)

    def as_dtype(self, dtype: torch.dtype) -> PagedBatch:
        """The same batch in another dtype (e.g. float64 for the oracle); metadata shared."""
        return PagedBatch(
            self.query.to(dtype),
            self.key_cache.to(dtype),
            self.value_cache.to(dtype),
            self.block_tables,
            self.seq_lens,
            self.cu_seqlens_q,
            [k.to(dtype) for k in self.keys],
            [v.to(dtype) for v in self.values],
            self.q_lens,
        )


def make_paged_batch(
    q_lens: list[int],
    seq_lens: list[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
    spare_blocks: int = 3,
    poison: bool = True,
) -> PagedBatch:
    """A packed batch: sequence b has ``q_lens[b]`` query rows and ``seq_lens[b]`` KV tokens."""
    if len(q_lens) != len(seq_lens):
        raise ValueError(f"q_lens ({len(q_lens)}) and seq_lens ({len(seq_lens)}) differ in length")
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(dtype=dtype, device=device)

    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    physical = torch.randperm(num_blocks, generator=generator).tolist()
    max_blocks = max(blocks_per_seq, default=0) + 1
    block_tables = torch.full((len(q_lens), max_blocks), -1, dtype=torch.int32)
    slots: list[int] = []
    next_block = 0
    for b, (n, seq_len) in enumerate(zip(blocks_per_seq, seq_lens)):
        owned = physical[next_block : next_block + n]
        next_block += n
        block_tables[b, :n] = torch.tensor(owned, dtype=torch.int32)
        slots.extend(owned[j // block_size] * block_size + j % block_size for j in range(seq_len))

    fill = float("nan") if poison else 0.0
    key_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), fill, dtype=dtype, device=device)
    value_cache = torch.full_like(key_cache, fill)
    keys = [randn(s, num_kv_heads, head_dim) for s in seq_lens]
    values = [randn(s, num_kv_heads, head_dim) for s in seq_lens]
    if slots:
        reference.store_kv(
            torch.cat(keys),
            torch.cat(values),
            key_cache,
            value_cache,
            torch.tensor(slots, dtype=torch.int64, device=device),
        )
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(q_lens, dtype=torch.int32).cumsum(0)
    return PagedBatch(
        query=randn(sum(q_lens), num_heads, head_dim),
        key_cache=key_cache,
        value_cache=value_cache,
        block_tables=block_tables.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        cu_seqlens_q=cu.to(device),
        keys=keys,
        values=values,
        q_lens=list(q_lens),
    )


def _per_sequence(batch: PagedBatch) -> Iterator[tuple[slice, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per sequence of the batch: its query rows, their positions ([q_len, 1], bottom-right:
    the last row is the last key), and its query, K and V per query head ([H, q_len, D],
    [H, seq_len, D] x 2: the KV heads repeated for GQA), from the contiguous ground truth."""
    num_heads = batch.query.shape[1]
    row = 0
    for q_len, k, v in zip(batch.q_lens, batch.keys, batch.values):
        seq_len, group = k.shape[0], num_heads // k.shape[1]
        q = batch.query[row : row + q_len].transpose(0, 1)
        k_heads = k.transpose(0, 1).repeat_interleave(group, dim=0)
        v_heads = v.transpose(0, 1).repeat_interleave(group, dim=0)
        yield slice(row, row + q_len), torch.arange(q_len)[:, None] + (seq_len - q_len), q, k_heads, v_heads
        row += q_len


def causal_reference(batch: PagedBatch, scale: float | None = None) -> torch.Tensor:  # [T, H, D]
    """Attention computed from the contiguous ground truth with SDPA and an explicit mask.

    Independent of the block tables and of :mod:`.reference`: a per-sequence loop over
    ``torch.nn.functional.scaled_dot_product_attention`` with a hand-built bottom-right mask
    (never ``is_causal``, which is top-left when ``q_len != kv_len``) and an explicit repeat of
    the KV heads. Rows that see no key are set to zero.
    """
    out = torch.zeros_like(batch.query)
    for rows, query_pos, q, k_heads, v_heads in _per_sequence(batch):
        seq_len = k_heads.shape[1]
        key_pos = torch.arange(seq_len)[None, :]
        mask = (key_pos <= query_pos).to(q.device)  # [q_len, seq_len]
        if seq_len > 0:
            o = torch.nn.functional.scaled_dot_product_attention(q, k_heads, v_heads, attn_mask=mask, scale=scale)
            o = o.masked_fill(~mask.any(dim=-1)[None, :, None], 0.0)
            out[rows] = o.transpose(0, 1)
    return out


def layer_reference(batch: PagedBatch, layer: LayerAttention, scale: float | None = None) -> torch.Tensor:  # [T, H, D]
    """Attention of one layer variant (window, chunk, soft-cap, sinks) from the contiguous
    ground truth, written the way transformers' eager attention computes it, independent of
    :mod:`pagedkv.kernels`: transformers' own mask functions (``sliding_window_causal_mask_function``,
    ``chunked_causal_mask_function``) evaluated over every (query, key) position, scores scaled then
    soft-capped (Gemma 2), masked, and a softmax over the scores and the head's sink (gpt-oss).
    Rows that see no key are zero."""
    from transformers.masking_utils import (
        and_masks,
        causal_mask_function,
        chunked_causal_mask_function,
        sliding_window_causal_mask_function,
    )

    rules = [causal_mask_function]
    if layer.sliding_window is not None:
        rules.append(sliding_window_causal_mask_function(layer.sliding_window))
    if layer.chunk_size is not None:
        rules.append(chunked_causal_mask_function(layer.chunk_size, torch.zeros(1, dtype=torch.long)))
    allowed = and_masks(*rules)
    num_heads, head_dim = batch.query.shape[1:]
    scale = head_dim**-0.5 if scale is None else scale
    out = torch.zeros_like(batch.query)
    for rows, query_pos, q, k_heads, v_heads in _per_sequence(batch):
        q_len, seq_len = q.shape[1], k_heads.shape[1]
        # The mask functions broadcast over index tensors (as transformers' vmap-free path calls them).
        mask = allowed(0, 0, query_pos, torch.arange(seq_len)[None, :]).expand(q_len, seq_len)
        scores = q @ k_heads.transpose(-1, -2) * scale  # [H, q_len, seq_len]
        if layer.logits_soft_cap is not None:
            scores = torch.tanh(scores / layer.logits_soft_cap) * layer.logits_soft_cap
        scores = scores.masked_fill(~mask, float("-inf"))
        if layer.sinks is not None:
            sinks = layer.sinks.to(scores.dtype).reshape(num_heads, 1, 1).expand(num_heads, q_len, 1)
            combined = torch.cat([scores, sinks], dim=-1)
            combined = combined - combined.max(dim=-1, keepdim=True).values
            weights = torch.softmax(combined, dim=-1)[..., :-1]
        else:
            weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # all-masked rows: zeros
        out[rows] = (weights @ v_heads).transpose(0, 1)
    return out


def poison_blocks_before(batch: PagedBatch, layer: LayerAttention) -> int:
    """NaN into every block that holds no key any query of its sequence sees (the blocks a
    sliding-window or chunked group gives back): a kernel that reads one returns NaN. Returns
    how many blocks were poisoned."""
    block_size = batch.key_cache.shape[1]
    poisoned = 0
    for b, (q_len, seq_len) in enumerate(zip(batch.q_lens, batch.seq_lens.tolist())):
        first_block = layer.first_visible(max(0, seq_len - q_len)) // block_size
        for column in range(first_block):
            block = int(batch.block_tables[b, column])
            batch.key_cache[block] = float("nan")
            batch.value_cache[block] = float("nan")
            poisoned += 1
    return poisoned
