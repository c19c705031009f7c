"""Triton prefill/extend attention over a paged KV cache (varlen, bottom-right causal).

Grid ``(num_query_tiles, H)``: one program computes a ``BLOCK_M`` x ``D`` tile of outputs for
one query head of one sequence, streaming that sequence's keys ``BLOCK_N`` at a time through
its block table (block ids widened to int64 before pointer arithmetic).

**Tiles of a packed batch without a host sync.** Sequence ``b`` owns query rows
``cu[b] .. cu[b+1]`` of the packed batch. Its tiles get the program ids
``first_tile(b) = cu[b] // BLOCK_M + b`` up to ``first_tile(b + 1) - 1``: that range holds
``cu[b+1] // BLOCK_M - cu[b] // BLOCK_M + 1 >= ceil(q_len / BLOCK_M)`` ids, and the last one
is below ``T // BLOCK_M + B``, so the grid is sized from host-known numbers only. A program
finds its sequence by binary search over ``first_tile`` (``first_tile`` is strictly increasing);
ids past a sequence's last real tile return at once.

**Causality.** ``prefix = seq_len - q_len`` keys precede the new tokens (cached prefix, or
earlier chunks); query row ``i`` sees keys ``0 .. prefix + i``. For a tile of rows
``r0 .. r1`` the keys ``< prefix + r0 + 1`` are visible to every row (no mask needed: the first
loop), the keys ``prefix + r0 + 1 .. prefix + r1`` need the causal mask (the second loop), and
later keys are skipped entirely. A row that sees no key at all (``prefix + i < 0``, only
possible when ``seq_len < q_len``) keeps ``m = -inf``; the update uses ``m = 0`` in its place so
that no ``-inf - -inf`` arises, and the row's output is 0.

**Layer variants** (constexpr ``WINDOW``, ``CHUNK``, ``SOFT_CAP``, ``SINKS``; all False: the
plain kernel). Row ``i`` also has a first visible key ``first_visible(prefix + i)``, which grows
with ``i``. A tile's keys then fall in three ranges, each a loop: from ``kv_base`` (the start of
the BLOCK_N tile holding the first row's first visible key ``kv_first``) the tiles that some row
cannot see yet need the per-row lower bound, and their loads are masked to ``>= kv_first``, so
the blocks wholly before it (a sliding-window group's given-back blocks, table entries -1) are
never read; then the whole tiles every row sees (from the last row's first visible key to the
first row's last), unmasked; then the causal tiles, masked as for full attention (every row's
lower bound is behind them). Soft-capping maps the base-2 scores through ``soft_cap`` before
the mask; a sink starts each row's online softmax (``m = sink * log2(e)``, ``l = 1``,
``acc = 0``), so a row that sees no key gets zeros.

Programs take the tiles in reverse order: within a sequence the last tiles see the most keys,
so the longest programs start first and the grid's tail is short.

fp32 accumulation, online softmax in base 2 (``scale * log2(e)`` folded into the scores).
Quantized caches (``QUANTIZED``: int8 / float8 data and a bfloat16 scale per (token, KV head),
``[num_blocks, BLOCK_SIZE, Hkv]``, at the same block and row as the data) are dequantized in
registers exactly as in the decode kernel (:mod:`.triton_decode`): raw tiles converted to the
query's dtype (exact), ``scores = (q . k_raw) * (k_scale * scale * log2(e))``, PV weights
``p * v_scale``; with fp16 queries (``RESCALE_V``) ``p * (v_scale / s) <= p`` instead, ``acc``
kept in units of ``s``, the running max of the V scales (rescaled with ``alpha``, multiplied
back once at the end), so that the fp16 weights do not underflow.
With ``SKIP_DECODES`` the programs of ``q_len == 1`` sequences return at once (the split-KV
decode kernel does those); without it this kernel handles any batch by itself.
"""

from __future__ import annotations

import triton
import triton.language as tl

from pagedkv.kernels.triton_decode import first_visible, soft_cap, value_weights

__all__ = ["prefill_kernel"]


@triton.jit
def _find_sequence(cu_seqlens_q_ptr, num_seqs, tile_id, BLOCK_M: tl.constexpr):
    """The last sequence b with cu[b] // BLOCK_M + b <= tile_id (binary search)."""
    low = 0
    high = num_seqs
    while low < high:
        mid = (low + high) // 2
        first_tile = tl.load(cu_seqlens_q_ptr + mid) // BLOCK_M + mid
        if first_tile <= tile_id:
            low = mid + 1
        else:
            high = mid
    return low - 1


@triton.jit
def _attend_tile(
    acc,
    m_i,
    l_i,
    v_scale_run,  # running state [BLOCK_M, D], [BLOCK_M], [BLOCK_M], scalar (RESCALE_V: acc's unit)
    q,  # [BLOCK_M, D]
    key_cache_ptr,
    value_cache_ptr,
    key_scale_ptr,
    value_scale_ptr,
    block_table_row,
    kv_head_offset_k,
    kv_head_offset_v,
    kv_head_offset_ks,
    kv_head_offset_vs,
    stride_kb,
    stride_ks,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vd,
    stride_ksb,
    stride_kss,
    stride_vsb,
    stride_vss,
    stride_bt_n,
    start,
    kv_first,  # LIMITED: no key below it is loaded (the tile's earliest row's first visible key)
    kv_end,
    last_visible,  # keys start .. start+BLOCK_N-1; valid below kv_end; row r sees <= last_visible[r]
    dims,
    dim_mask,
    scale_log2e,
    sliding_window,
    chunk_size,
    soft_cap_log2e,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    QUANTIZED: tl.constexpr,
    RESCALE_V: tl.constexpr,
    WINDOW: tl.constexpr,
    CHUNK: tl.constexpr,
    SOFT_CAP: tl.constexpr,
):
    tokens = start + tl.arange(0, BLOCK_N)
    row_in_block = tokens % BLOCK_SIZE
    if MASKED:
        if WINDOW or CHUNK:
            token_mask = (tokens >= kv_first) & (tokens < kv_end)
        else:
            token_mask = tokens < kv_end
        physical_block = tl.load(block_table_row + (tokens // BLOCK_SIZE) * stride_bt_n, mask=token_mask, other=0)
        kv_mask = token_mask[:, None] & dim_mask[None, :]
    else:
        physical_block = tl.load(block_table_row + (tokens // BLOCK_SIZE) * stride_bt_n)
        kv_mask = dim_mask[None, :]
    physical_block = physical_block.to(tl.int64)

    k_ptrs = (
        key_cache_ptr
        + physical_block[:, None] * stride_kb
        + row_in_block[:, None] * stride_ks
        + kv_head_offset_k
        + dims[None, :] * stride_kd
    )
    k = tl.load(k_ptrs, mask=kv_mask, other=0.0).to(q.dtype)  # exact
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
    if QUANTIZED:
        k_scale_ptrs = key_scale_ptr + physical_block * stride_ksb + row_in_block * stride_kss + kv_head_offset_ks
        if MASKED:
            k_scale = tl.load(k_scale_ptrs, mask=token_mask, other=0.0)
        else:
            k_scale = tl.load(k_scale_ptrs)
        scores = scores * (k_scale.to(tl.float32) * scale_log2e)[None, :]
    else:
        scores = scores * scale_log2e
    if SOFT_CAP:
        scores = soft_cap(scores, soft_cap_log2e)  # before the mask, as transformers does
    if MASKED:
        visible = token_mask[None, :] & (tokens[None, :] <= last_visible[:, None])
        if WINDOW or CHUNK:
            # Row r sees keys from its own first visible one (recomputed here from its position,
            # last_visible[r], rather than kept live across the loop: registers are tight).
            first_visible_rows = first_visible(last_visible, sliding_window, chunk_size, WINDOW, CHUNK)
            visible = visible & (tokens[None, :] >= first_visible_rows[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        # A row that has seen no key yet keeps m = -inf; exponents use 0 in its place.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))  # finite: every key of the tile is visible
        m_ref = m_new
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(scores - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)

    v_ptrs = (
        value_cache_ptr
        + physical_block[:, None] * stride_vb
        + row_in_block[:, None] * stride_vs
        + kv_head_offset_v
        + dims[None, :] * stride_vd
    )
    v = tl.load(v_ptrs, mask=kv_mask, other=0.0).to(q.dtype)  # exact
    if QUANTIZED:
        v_scale_ptrs = value_scale_ptr + physical_block * stride_vsb + row_in_block * stride_vss + kv_head_offset_vs
        if MASKED:
            v_scale = tl.load(v_scale_ptrs, mask=token_mask, other=0.0)
        else:
            v_scale = tl.load(v_scale_ptrs)
        v_scale = v_scale.to(tl.float32)
        weights, acc_alpha, v_scale_run = value_weights(p, alpha, v_scale, v_scale_run, RESCALE_V)
    else:
        weights = p
        acc_alpha = alpha
    acc = acc * acc_alpha[:, None] + tl.dot(weights.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i, v_scale_run


@triton.jit
def _prefill_kernel(
    query_ptr,  # [T, H, D]
    key_cache_ptr,
    value_cache_ptr,  # [num_blocks, BLOCK_SIZE, Hkv, D], query's dtype, or int8 / float8 when QUANTIZED
    key_scale_ptr,
    value_scale_ptr,  # [num_blocks, BLOCK_SIZE, Hkv] bfloat16, read when QUANTIZED
    block_tables_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,  # [B] int32
    cu_seqlens_q_ptr,  # [B + 1] int32
    out_ptr,  # [T, H, D]
    sinks_ptr,  # [H] float, read when SINKS
    scale_log2e,
    sliding_window,  # WINDOW: keys p - w < k <= p
    chunk_size,  # CHUNK: keys k // C == p // C
    soft_cap_log2e,  # SOFT_CAP: cap * log2(e)
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_ksb,
    stride_kss,
    stride_ksh,
    stride_vsb,
    stride_vss,
    stride_vsh,
    stride_bt_b,
    stride_bt_n,
    stride_ot,
    stride_oh,
    stride_od,
    num_seqs,
    head_dim,
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,  # query rows per program
    BLOCK_N: tl.constexpr,  # keys per loop iteration
    HEAD_DIM_PADDED: tl.constexpr,
    SKIP_DECODES: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    QUANTIZED: tl.constexpr,  # int8 / float8 caches with per-(token, head) scales
    RESCALE_V: tl.constexpr,  # QUANTIZED with fp16 queries: acc in units of the running max V scale
    WINDOW: tl.constexpr,  # a sliding window (LayerAttention); all four False: full attention
    CHUNK: tl.constexpr,  # chunked local attention
    SOFT_CAP: tl.constexpr,  # logit soft-capping
    SINKS: tl.constexpr,  # one sink logit per query head
):
    # Reversed: the last tiles of a sequence see the most keys; starting them first shortens the tail.
    tile_id = tl.num_programs(0) - 1 - tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP

    seq = _find_sequence(cu_seqlens_q_ptr, num_seqs, tile_id, BLOCK_M)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    tile = tile_id - (q_start // BLOCK_M + seq)
    first_row = tile * BLOCK_M
    if first_row >= q_len:
        return
    if SKIP_DECODES and q_len == 1:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix = seq_len - q_len

    rows = first_row + tl.arange(0, BLOCK_M)
    row_mask = rows < q_len
    dims = tl.arange(0, HEAD_DIM_PADDED)
    dim_mask = dims < head_dim
    q_ptrs = (
        query_ptr + (q_start + rows).to(tl.int64)[:, None] * stride_qt + head * stride_qh + dims[None, :] * stride_qd
    )
    q = tl.load(q_ptrs, mask=row_mask[:, None] & dim_mask[None, :], other=0.0)

    last_visible = prefix + rows  # row r sees keys 0 .. last_visible[r]
    last_row = tl.minimum(first_row + BLOCK_M, q_len) - 1
    kv_end = tl.minimum(seq_len, prefix + last_row + 1)  # no key at or past this is visible to the tile
    # Keys below `shared_end` are visible to every row of the tile; whole tiles of them need no mask.
    shared_end = tl.maximum(tl.minimum(prefix + first_row + 1, kv_end), 0)
    if WINDOW or CHUNK:
        # Row r sees keys first_visible(last_visible[r]) .. last_visible[r]; both bounds grow with
        # r. The loop starts at the tile (full attention's grid) holding the first row's first
        # visible key, `kv_first`, and loads no key below it: the blocks wholly before it are
        # never read. Keys from `shared_start` (the last row's first) to `shared_end` are visible
        # to every row; the whole tiles among them need no mask, the tiles before and after do.
        kv_first = first_visible(prefix + first_row, sliding_window, chunk_size, WINDOW, CHUNK)
        kv_base = (kv_first // BLOCK_N) * BLOCK_N
        shared_start = first_visible(prefix + last_row, sliding_window, chunk_size, WINDOW, CHUNK)
        # (Divisions of non-negative numbers only: `//` truncates on the GPU.)
        unmasked_start = kv_base + tl.cdiv(tl.maximum(shared_start - kv_base, 0), BLOCK_N) * BLOCK_N
        unmasked_end = unmasked_start + (tl.maximum(shared_end - unmasked_start, 0) // BLOCK_N) * BLOCK_N
    else:
        kv_first = 0  # not read
        kv_base = 0
        unmasked_start = 0
        unmasked_end = (shared_end // BLOCK_N) * BLOCK_N

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if SINKS:
        # The sink is one more logit in each row's softmax with a zero value vector: start from
        # it (m = sink, l = 2^0 = 1, acc = 0), base 2 like the scores.
        sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
        m_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32) + sink
        l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PADDED], dtype=tl.float32)
    v_scale_run = 0.0  # RESCALE_V: the largest V scale so far (acc's unit)
    block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt_b
    kv_head_offset_k = kv_head.to(tl.int64) * stride_kh
    kv_head_offset_v = kv_head.to(tl.int64) * stride_vh
    kv_head_offset_ks = kv_head.to(tl.int64) * stride_ksh
    kv_head_offset_vs = kv_head.to(tl.int64) * stride_vsh

    if WINDOW or CHUNK:
        for start in range(kv_base, tl.minimum(unmasked_start, kv_end), BLOCK_N):
            acc, m_i, l_i, v_scale_run = _attend_tile(
                acc,
                m_i,
                l_i,
                v_scale_run,
                q,
                key_cache_ptr,
                value_cache_ptr,
                key_scale_ptr,
                value_scale_ptr,
                block_table_row,
                kv_head_offset_k,
                kv_head_offset_v,
                kv_head_offset_ks,
                kv_head_offset_vs,
                stride_kb,
                stride_ks,
                stride_kd,
                stride_vb,
                stride_vs,
                stride_vd,
                stride_ksb,
                stride_kss,
                stride_vsb,
                stride_vss,
                stride_bt_n,
                start,
                kv_first,
                kv_end,
                last_visible,
                dims,
                dim_mask,
                scale_log2e,
                sliding_window,
                chunk_size,
                soft_cap_log2e,
                BLOCK_SIZE,
                BLOCK_N,
                True,
                DOT_PRECISION,
                QUANTIZED,
                RESCALE_V,
                WINDOW,
                CHUNK,
                SOFT_CAP,
            )
    for start in range(unmasked_start, unmasked_end, BLOCK_N):
        acc, m_i, l_i, v_scale_run = _attend_tile(
            acc,
            m_i,
            l_i,
            v_scale_run,
            q,
            key_cache_ptr,
            value_cache_ptr,
            key_scale_ptr,
            value_scale_ptr,
            block_table_row,
            kv_head_offset_k,
            kv_head_offset_v,
            kv_head_offset_ks,
            kv_head_offset_vs,
            stride_kb,
            stride_ks,
            stride_kd,
            stride_vb,
            stride_vs,
            stride_vd,
            stride_ksb,
            stride_kss,
            stride_vsb,
            stride_vss,
            stride_bt_n,
            start,
            kv_first,
            kv_end,
            last_visible,
            dims,
            dim_mask,
            scale_log2e,
            sliding_window,
            chunk_size,
            soft_cap_log2e,
            BLOCK_SIZE,
            BLOCK_N,
            False,
            DOT_PRECISION,
            QUANTIZED,
            RESCALE_V,
            WINDOW,
            CHUNK,
            SOFT_CAP,
        )
    for start in range(unmasked_end, kv_end, BLOCK_N):
        acc, m_i, l_i, v_scale_run = _attend_tile(
            acc,
            m_i,
            l_i,
            v_scale_run,
            q,
            key_cache_ptr,
            value_cache_ptr,
            key_scale_ptr,
            value_scale_ptr,
            block_table_row,
            kv_head_offset_k,
            kv_head_offset_v,
            kv_head_offset_ks,
            kv_head_offset_vs,
            stride_kb,
            stride_ks,
            stride_kd,
            stride_vb,
            stride_vs,
            stride_vd,
            stride_ksb,
            stride_kss,
            stride_vsb,
            stride_vss,
            stride_bt_n,
            start,
            kv_first,
            kv_end,
            last_visible,
            dims,
            dim_mask,
            scale_log2e,
            sliding_window,
            chunk_size,
            soft_cap_log2e,
            BLOCK_SIZE,
            BLOCK_N,
            True,
            DOT_PRECISION,
            QUANTIZED,
            RESCALE_V,
            False,  # keys >= unmasked_start >= shared_start: every row's lower bound is behind them
            False,
            SOFT_CAP,
        )

    if RESCALE_V:
        acc = acc * v_scale_run  # 0 when the tile saw no key (acc is 0 too)
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    result = acc / l_safe[:, None]
    o_ptrs = out_ptr + (q_start + rows).to(tl.int64)[:, None] * stride_ot + head * stride_oh + dims[None, :] * stride_od
    tl.store(o_ptrs, result.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & dim_mask[None, :])


prefill_kernel = _prefill_kernel
