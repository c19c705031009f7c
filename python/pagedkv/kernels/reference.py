"""Paged KV cache write and paged attention in plain torch.

Two jobs, one implementation:

* the **oracle** of the Triton kernels: it runs in float64 and is written so that its
  correctness can be read off the code (gather the KV of a sequence through its block table,
  build the bottom-right causal mask explicitly, call ``scaled_dot_product_attention``);
* the **production attention backend on the CPU**: the engine calls it for every layer of
  every step, so the common case (a batch of decodes) is vectorised, never a Python loop per
  sequence.

Layout (docs/kernels.md, Kernels)::

    key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    slot s of the pool  ==  key_cache[s // block_size, s % block_size]

Semantics of ``paged_attention`` (identical in every backend):

* sequence ``b`` owns the query rows ``cu_seqlens_q[b] : cu_seqlens_q[b + 1]`` (``q_len`` of
  them) and ``seq_lens[b]`` KV tokens, the new ones included (already stored);
* causal masking is bottom-right: query ``i`` of the sequence sees keys
  ``0 .. seq_len - q_len + i`` (inclusive);
* a query row that sees no key (``seq_len - q_len + i < 0``) gets an all-zero output, never
  NaN; rows of ``query`` that belong to no sequence (after ``cu_seqlens_q[-1]``) are left
  untouched in ``out`` (zeros when ``out`` is allocated here);
* grouped-query attention: query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``.

Layers that see less than the whole context or change the softmax (``layer``, a
:class:`~.layer_attention.LayerAttention`: sliding window, chunked local, soft-capping, sinks)
mask by the layer's rule on top of the causal one and gather a sequence's KV from the block of
its first visible key: the blocks before it are never read. Soft-capping and sinks change the
scores themselves, so those layers compute the softmax explicitly instead of calling SDPA.

Precision: float64 inputs are computed in float64 (the oracle); on the CPU, float16/bfloat16
inputs are computed in float32 (the CPU has no fast half-precision matmul and the GPU kernels
accumulate in float32 too); on a GPU the input dtype is kept (SDPA accumulates in float32).
Quantized caches (int8, float8; :mod:`.kv_quant`) come with their :class:`~.kv_quant.KVScales`:
``store_kv`` quantizes each new (token, head) vector with its own scale and stores both; the
attention gathers a sequence's blocks and their scales and dequantizes the gather
(``float(q) * scale``) in the compute dtype, float64 for the oracle.

How the decode batch is vectorised: the sequences with ``q_len == 1`` are sorted by length and
cut into chunks whose padded KV fits a gather budget (``_GATHER_BUDGET_ELEMENTS``); each chunk
is one block gather per cache (``index_select`` of the block-table rows into a reused
per-thread buffer), one length mask and one SDPA call with ``enable_gqa=True`` (on the CPU
faster than a hand-written matmul/softmax, and much faster than an explicit
``repeat_interleave`` of the KV heads). Sequences with ``q_len > 1`` (prefill chunks, extends)
are handled one by one: they are few per step and each is already a large matrix product.
"""

from __future__ import annotations

import math
import threading

import torch
import torch.nn.functional as F

from pagedkv.kernels.kv_quant import KVScales, byte_view, format_of, quantize_kv
from pagedkv.kernels.layer_attention import FULL_ATTENTION, LayerAttention

__all__ = ["attend_decode_rows", "attend_extend_rows", "attend_host", "paged_attention", "store_kv", "write_slots"]

# Upper bound on the elements of one gathered K (and one V) chunk of decode sequences:
# 2^23 float32 elements = 32 MiB. Keeps the CPU path's peak memory bounded for big batches
# of long sequences while leaving typical decode batches (e.g. 64 x 512 tokens x 3 x 64) in one chunk.
_GATHER_BUDGET_ELEMENTS = 1 << 23

_SDPA_HAS_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)


def store_kv(
    key: torch.Tensor,  # [T, Hkv, D], any strides
    value: torch.Tensor,  # [T, Hkv, D], any strides
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64, -1 = do not store this token
    *,
    kv_scales: KVScales | None = None,  # required for a quantized cache
) -> None:
    """Write token ``t``'s K and V into slot ``slot_mapping[t]`` of the caches (in place)."""
    keep = slot_mapping >= 0
    slots = slot_mapping.long()
    if not bool(keep.all()):
        slots, key, value = slots[keep], key[keep], value[keep]
    write_slots(key, value, key_cache, value_cache, slots, kv_scales=kv_scales)


def write_slots(
    key: torch.Tensor,  # [N, Hkv, D], any strides
    value: torch.Tensor,  # [N, Hkv, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,
    slots: torch.Tensor,  # [N] int64, every one >= 0
    *,
    kv_scales: KVScales | None = None,  # required for a quantized cache
) -> None:
    """:func:`store_kv` once the skipped tokens (slot -1) are gone."""
    fmt = format_of(key_cache.dtype)
    if fmt is not None:
        assert kv_scales is not None, "a quantized cache needs its scales (checked by the dispatcher)"
        k_data, k_scale = quantize_kv(key, fmt, kv_scales.static_key)
        v_data, v_scale = quantize_kv(value, fmt, kv_scales.static_value)
        _write_rows(key_cache, slots, k_data)
        _write_rows(value_cache, slots, v_data)
        _write_rows(kv_scales.key, slots, k_scale)
        _write_rows(kv_scales.value, slots, v_scale)
        return
    _write_rows(key_cache, slots, key.to(key_cache.dtype))
    _write_rows(value_cache, slots, value.to(value_cache.dtype))


def _write_rows(
    cache: torch.Tensor,  # [num_blocks, block_size, *row]
    slots: torch.Tensor,  # [N] int64, every one >= 0
    rows: torch.Tensor,  # [N, *row], the cache's dtype
) -> None:
    """``cache[slot // block_size, slot % block_size] = row`` for every slot."""
    if cache.is_contiguous():
        # Slot s is row s of the cache seen as [num_blocks * block_size, *row]; float8 moves as bytes.
        cache, rows = byte_view(cache), byte_view(rows)
        cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, rows)
        return
    block_size = cache.shape[1]
    cache[torch.div(slots, block_size, rounding_mode="floor"), slots % block_size] = rows


def paged_attention(
    query: torch.Tensor,  # [T, H, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32, KV tokens per sequence (new ones included)
    cu_seqlens_q: torch.Tensor,  # [B + 1] int32, query rows of sequence b: cu[b]:cu[b+1]
    *,
    scale: float | None = None,
    out: torch.Tensor | None = None,  # [T, H, D], query's dtype
    kv_scales: KVScales | None = None,  # required for a quantized cache
    layer: LayerAttention = FULL_ATTENTION,
) -> torch.Tensor:  # [T, H, D]
    """Varlen causal attention of packed queries over a paged KV cache (see module docstring)."""
    if scale is None:
        scale = query.shape[2] ** -0.5
    if out is None:
        out = torch.zeros_like(query)
    # Host copies of the small index arrays, read once for both parts (a sync on a GPU).
    attend_host(
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        cu_seqlens_q.tolist(),
        seq_lens.tolist(),
        scale=scale,
        out=out,
        kv_scales=kv_scales,
        layer=layer,
    )
    return out


def attend_host(
    query: torch.Tensor,  # [T, H, D]
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32
    cu: list[int],  # cu_seqlens_q on the host
    lens: list[int],  # seq_lens on the host
    *,
    scale: float,
    out: torch.Tensor,  # [T, H, D], written for the rows of every sequence
    decodes: bool = True,
    extends: bool = True,
    kv_scales: KVScales | None = None,
    layer: LayerAttention = FULL_ATTENTION,
    extend_rows: list[int] | None = None,  # the sequences of several query rows to attend (None: all)
) -> None:
    """:func:`paged_attention` with the index arrays already on the host (read once per step
    by the caller, not once per layer); ``decodes`` / ``extends`` select the parts."""
    if decodes:
        _decode_rows(query, key_cache, value_cache, block_tables, seq_lens, cu, lens, scale, out, kv_scales, layer)
    if extends:
        _extend_rows(query, key_cache, value_cache, block_tables, cu, lens, scale, out, kv_scales, layer, extend_rows)


def attend_decode_rows(
    query: torch.Tensor,  # [T, H, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32
    cu_seqlens_q: torch.Tensor,  # [B + 1] int32
    *,
    scale: float,
    out: torch.Tensor,  # [T, H, D], written in place for the decode sequences only
    kv_scales: KVScales | None = None,
    layer: LayerAttention = FULL_ATTENTION,
) -> None:
    """The part of :func:`paged_attention` for sequences with one query row (decodes)."""
    cu, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    _decode_rows(query, key_cache, value_cache, block_tables, seq_lens, cu, lens, scale, out, kv_scales, layer)


def _decode_rows(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu: list[int],  # cu_seqlens_q on the host
    lens: list[int],  # seq_lens on the host
    scale: float,
    out: torch.Tensor,
    kv_scales: KVScales | None,
    layer: LayerAttention,
) -> None:
    compute_dtype = _compute_dtype(query)
    decodes = [b for b in range(len(lens)) if cu[b + 1] - cu[b] == 1]
    if not decodes:
        return
    head_dim = query.shape[2]
    block_size = key_cache.shape[1]
    # Tokens gathered per sequence: from the block of its first visible key to its end.
    spans = lens
    if layer.limits_context:
        spans = [n - layer.first_visible(n - 1) // block_size * block_size for n in lens]
    for chunk in _decode_chunks(decodes, spans, block_size, key_cache.shape[2] * head_dim):
        rows = torch.tensor([cu[b] for b in chunk], device=query.device)
        out[rows] = _attend_decodes(
            query[rows],
            key_cache,
            value_cache,
            block_tables[chunk],
            seq_lens[chunk],
            scale,
            compute_dtype,
            kv_scales,
            layer,
        ).to(out.dtype)


def attend_extend_rows(
    query: torch.Tensor,  # [T, H, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32
    cu_seqlens_q: torch.Tensor,  # [B + 1] int32
    *,
    scale: float,
    out: torch.Tensor,  # [T, H, D], written in place for the extend sequences only
    kv_scales: KVScales | None = None,
    layer: LayerAttention = FULL_ATTENTION,
) -> None:
    """The part of :func:`paged_attention` for sequences with several query rows (prefill
    chunks, extends), one sequence at a time."""
    cu, lens = cu_seqlens_q.tolist(), seq_lens.tolist()
    _extend_rows(query, key_cache, value_cache, block_tables, cu, lens, scale, out, kv_scales, layer)


def _extend_rows(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu: list[int],  # cu_seqlens_q on the host
    lens: list[int],  # seq_lens on the host
    scale: float,
    out: torch.Tensor,
    kv_scales: KVScales | None,
    layer: LayerAttention,
    rows: list[int] | None = None,  # the sequences to attend (None: every one with several query rows)
) -> None:
    compute_dtype = _compute_dtype(query)
    for b in range(len(lens)) if rows is None else rows:
        q_len = cu[b + 1] - cu[b]
        if q_len > 1:
            out[cu[b] : cu[b + 1]] = _attend_one_sequence(
                query[cu[b] : cu[b + 1]],
                key_cache,
                value_cache,
                block_tables[b],
                lens[b],
                scale,
                compute_dtype,
                kv_scales,
                layer,
            ).to(out.dtype)


def _compute_dtype(query: torch.Tensor) -> torch.dtype:
    if query.dtype == torch.float64:
        return torch.float64
    if query.device.type == "cpu":
        return torch.float32
    return query.dtype


def _decode_chunks(decodes: list[int], lens: list[int], block_size: int, elements_per_token: int) -> list[list[int]]:
    """Cut the decode sequences, sorted by ``lens`` (the tokens each one gathers), into chunks
    within the gather budget.

    Sorting keeps the padding of each chunk small (a chunk pads to its longest sequence,
    rounded up to whole blocks).
    """
    order = sorted(decodes, key=lambda b: lens[b])
    budget_tokens = max(1, _GATHER_BUDGET_ELEMENTS // elements_per_token)
    chunks: list[list[int]] = []
    current: list[int] = []
    for b in order:
        # Ascending order: b is the longest of the chunk if it joins.
        padded = max(1, -(-lens[b] // block_size)) * block_size
        if current and (len(current) + 1) * padded > budget_tokens:
            chunks.append(current)
            current = []
        current.append(b)
    if current:
        chunks.append(current)
    return chunks


class _Scratch(threading.local):
    """Per-thread reusable buffers for the decode gathers.

    On the CPU a fresh multi-megabyte tensor per layer and step costs page faults on every
    call (the allocator hands large blocks back to the OS); reusing one buffer halves the gather
    time. Buffers are per thread (concurrent callers never share one) and never larger than
    ``_GATHER_BUDGET_ELEMENTS``: bigger gathers (long prefill chunks) allocate normally, and so
    does every gather on a GPU (the caching allocator already reuses memory there).
    """

    def __init__(self) -> None:
        self.buffers: dict[tuple[str, torch.device, torch.dtype], torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        numel = math.prod(shape)
        if numel > _GATHER_BUDGET_ELEMENTS or device.type != "cpu":
            return torch.empty(shape, dtype=dtype, device=device)
        key = (name, device, dtype)
        buffer = self.buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            # A normal tensor even when first asked for under inference mode (the engine's
            # forward): an inference tensor could not be written by a later call outside it.
            with torch.inference_mode(False):
                buffer = torch.empty(numel, dtype=dtype, device=device)
            self.buffers[key] = buffer
        return buffer[:numel].view(shape)


_scratch = _Scratch()


def _gather_kv(
    name: str,  # scratch slot: "k" or "v"
    cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [N, max_blocks] int32
    num_blocks: int,  # leading block-table columns to read
    seq_lens: torch.Tensor,  # [N]
    compute_dtype: torch.dtype,
    scales: torch.Tensor | None = None,  # [num_blocks, block_size, Hkv] bfloat16 of a quantized cache
    start_blocks: torch.Tensor | None = None,  # [N] int64: first block-table column read (default 0)
) -> torch.Tensor:  # [N, Hkv, num_blocks * block_size, D]
    """The KV of N sequences, contiguous per sequence, padded to ``num_blocks`` blocks: the
    block-table columns ``start_blocks[i] .. start_blocks[i] + num_blocks - 1`` of sequence i.

    Block-table entries past a sequence's last block may be padding (-1, stale ids): they are
    replaced by block 0 so that the gather stays in bounds. Every position at or past
    ``seq_len`` is then zeroed: the cache may hold anything there (stale KV, or NaN bit
    patterns of never-written memory), and a NaN would survive the mask (0 * NaN = NaN).
    The columns before ``start_blocks`` are never read (a sliding-window group frees them).
    """
    n, block_size, num_kv_heads, head_dim = (block_tables.shape[0], *cache.shape[1:])
    blocks_used = torch.div(seq_lens.long() + block_size - 1, block_size, rounding_mode="floor")
    columns = torch.arange(num_blocks, device=block_tables.device)
    if start_blocks is None:
        table = block_tables[:, :num_blocks].long()
        in_use = columns < blocks_used[:, None]
    else:
        columns = start_blocks[:, None] + columns[None, :]  # [N, num_blocks]
        in_use = columns < blocks_used[:, None]
        columns = torch.where(in_use, columns, torch.zeros_like(columns))
        table = torch.gather(block_tables.long(), 1, columns)
    table = torch.where(in_use, table, torch.zeros_like(table))
    shape = (n * num_blocks, block_size, num_kv_heads, head_dim)
    gathered = torch.index_select(cache, 0, table.reshape(-1), out=_scratch.get(name, shape, cache.dtype, cache.device))
    if cache.dtype != compute_dtype:
        gathered = _scratch.get(name + "_upcast", shape, compute_dtype, cache.device).copy_(gathered)
    if scales is not None:  # dequantize: one scale per (token, head) vector
        gathered.mul_(torch.index_select(scales, 0, table.reshape(-1)).to(compute_dtype)[..., None])
    gathered = gathered.view(n, num_blocks * block_size, num_kv_heads, head_dim)
    positions = torch.arange(num_blocks * block_size, device=table.device)[None, :]  # [1, L]
    if start_blocks is not None:  # gathered row -> position in the sequence, [N, L]
        positions = positions + start_blocks[:, None] * block_size
    past_end = positions >= seq_lens.long()[:, None]  # [N, L]
    # Integer indices: only the rows past the end are written (a boolean mask would become a
    # masked_fill over the whole tensor).
    seqs, rows = past_end.nonzero(as_tuple=True)
    gathered[seqs, rows] = 0.0
    return gathered.transpose(1, 2)


def _attend(
    q: torch.Tensor,  # [N, H, Lq, D]
    k: torch.Tensor,  # [N, Hkv, Lk, D]
    v: torch.Tensor,  # [N, Hkv, Lk, D]
    visible: torch.Tensor,  # bool, broadcastable to [N, H, Lq, Lk]; True = may attend
    scale: float,
    layer: LayerAttention,
) -> torch.Tensor:  # [N, H, Lq, D]
    """Attention with GQA and an explicit mask; rows that see no key come out as zeros."""
    if not layer.is_plain_softmax:
        return _attend_explicit(q, k, v, visible, scale, layer)
    groups = q.shape[1] // k.shape[1]
    if not _SDPA_HAS_GQA:
        k, v = _repeat_kv_heads(k, v, groups)
    kwargs = {"enable_gqa": True} if groups > 1 and _SDPA_HAS_GQA else {}
    result = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale, **kwargs)
    # Older torch returns NaN for fully masked rows; the contract is zeros.
    sees_nothing = ~visible.any(dim=-1, keepdim=True)
    return result.masked_fill(sees_nothing, 0.0)


def _attend_explicit(
    q: torch.Tensor,  # [N, H, Lq, D]
    k: torch.Tensor,  # [N, Hkv, Lk, D]
    v: torch.Tensor,  # [N, Hkv, Lk, D]
    visible: torch.Tensor,  # bool, broadcastable to [N, H, Lq, Lk]
    scale: float,
    layer: LayerAttention,
) -> torch.Tensor:  # [N, H, Lq, D]
    """Scores, soft-cap, mask, softmax (with the sinks as one more column), weighted sum:
    what SDPA cannot do. A row that sees no key gets zeros (with sinks too: the sink takes
    the whole weight and attends to nothing)."""
    k, v = _repeat_kv_heads(k, v, q.shape[1] // k.shape[1])
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [N, H, Lq, Lk]
    if layer.logits_soft_cap is not None:
        scores = torch.tanh(scores / layer.logits_soft_cap) * layer.logits_soft_cap
    scores = scores.masked_fill(~visible, float("-inf"))
    if layer.sinks is not None:
        n, heads, q_len, _ = scores.shape
        sinks = layer.sinks.to(device=scores.device, dtype=scores.dtype).view(1, heads, 1, 1)
        scores = torch.cat([scores, sinks.expand(n, heads, q_len, 1)], dim=-1)
        weights = torch.softmax(scores, dim=-1)[..., :-1]
    else:
        weights = torch.softmax(scores, dim=-1)
        weights = weights.masked_fill(~visible.any(dim=-1, keepdim=True), 0.0)  # all -inf: NaN rows
    return torch.matmul(weights, v)


def _repeat_kv_heads(
    k: torch.Tensor,  # [N, Hkv, Lk, D]
    v: torch.Tensor,  # [N, Hkv, Lk, D]
    groups: int,  # query heads per KV head
) -> tuple[torch.Tensor, torch.Tensor]:  # each [N, Hkv * groups, Lk, D]
    """GQA done by hand: each KV head repeated for the ``groups`` query heads that read it."""
    if groups == 1:
        return k, v
    return k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)


def _attend_decodes(
    query: torch.Tensor,  # [N, H, D], one query row per sequence
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [N, max_blocks] int32
    seq_lens: torch.Tensor,  # [N]
    scale: float,
    compute_dtype: torch.dtype,
    kv_scales: KVScales | None,
    layer: LayerAttention,
) -> torch.Tensor:  # [N, H, D]
    block_size = key_cache.shape[1]
    lens = seq_lens.to(query.device).long()
    k_scales, v_scales = (kv_scales.key, kv_scales.value) if kv_scales is not None else (None, None)
    if layer.limits_context:
        # The single query of a decode is the last token (position seq_len - 1); it sees the
        # keys from first_visible on: read from that key's block.
        first = layer.first_visible_tensor(lens - 1)  # [N]
        start_blocks = torch.div(first, block_size, rounding_mode="floor")
        last_blocks = torch.div(lens - 1, block_size, rounding_mode="floor")
        num_blocks = max(1, int((last_blocks - start_blocks).max()) + 1)
        positions = (
            torch.arange(num_blocks * block_size, device=query.device)[None, :] + start_blocks[:, None] * block_size
        )
        visible = (positions < lens[:, None]) & (positions >= first[:, None])  # [N, Lk]
    else:
        # The single query of a decode is the last token: it sees every key of its sequence.
        start_blocks = None
        num_blocks = max(1, -(-int(lens.max()) // block_size))
        positions = torch.arange(num_blocks * block_size, device=query.device)
        visible = positions[None, :] < lens[:, None]  # [N, Lk]
    k = _gather_kv("k", key_cache, block_tables, num_blocks, seq_lens, compute_dtype, k_scales, start_blocks)
    v = _gather_kv("v", value_cache, block_tables, num_blocks, seq_lens, compute_dtype, v_scales, start_blocks)
    q = query.to(compute_dtype)[:, :, None, :]  # [N, H, 1, D]
    return _attend(q, k, v, visible[:, None, None, :], scale, layer)[:, :, 0, :]


def _attend_one_sequence(
    query: torch.Tensor,  # [q_len, H, D]
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,  # [max_blocks] int32
    seq_len: int,
    scale: float,
    compute_dtype: torch.dtype,
    kv_scales: KVScales | None,
    layer: LayerAttention,
) -> torch.Tensor:  # [q_len, H, D]
    q_len = query.shape[0]
    block_size = key_cache.shape[1]
    # The first query (position seq_len - q_len) sees the lowest key: read from its block.
    start_block = layer.first_visible(max(0, seq_len - q_len)) // block_size
    num_blocks = max(1, -(-seq_len // block_size) - start_block)
    lens = torch.tensor([seq_len], device=block_table.device)
    starts = None if start_block == 0 else torch.tensor([start_block], device=block_table.device)
    k_scales, v_scales = (kv_scales.key, kv_scales.value) if kv_scales is not None else (None, None)
    k = _gather_kv("k", key_cache, block_table[None], num_blocks, lens, compute_dtype, k_scales, starts)
    v = _gather_kv("v", value_cache, block_table[None], num_blocks, lens, compute_dtype, v_scales, starts)
    # Bottom-right causal mask: query i (position seq_len - q_len + i) sees keys up to its own
    # position, and from the layer's first visible key on.
    key_pos = start_block * block_size + torch.arange(num_blocks * block_size, device=query.device)
    query_pos = seq_len - q_len + torch.arange(q_len, device=query.device)
    visible = (key_pos[None, :] <= query_pos[:, None]) & (key_pos[None, :] < seq_len)
    if layer.limits_context:
        visible &= key_pos[None, :] >= layer.first_visible_tensor(query_pos)[:, None]
    q = query.to(compute_dtype).transpose(0, 1)[None]  # [1, H, q_len, D]
    return _attend(q, k, v, visible, scale, layer)[0].transpose(0, 1)
