"""Triton split-KV decode attention (flash-decoding) over a paged KV cache.

Decode rows have one query token (``q_len == 1``) that sees every key of its sequence. Their
cost is reading K and V, so the kernel is built to read each byte of KV once, from as many SMs
as possible:

* **GQA packing**: program ``(b, kv_head, split)`` loads the ``GROUP = H / Hkv`` query heads
  that share ``kv_head`` as the rows of one ``[GROUP_PADDED, D]`` tile, so one ``tl.dot``
  serves the whole group and K/V are read once per KV head. ``tl.dot`` needs M >= 16: the
  group is padded to ``GROUP_PADDED = max(16, next_pow2(GROUP))`` rows of zeros (free, the
  kernel is bandwidth-bound).
* **Split-KV**: a sequence's keys are cut into ``num_splits`` ranges of
  ``tokens_per_split = round_up(ceil(seq_len / num_splits), BLOCK_N)`` tokens. Each program
  walks its range ``BLOCK_N`` tokens at a time; token ``j`` lives in physical block
  ``block_tables[b, j // BLOCK_SIZE]`` (widened to int64 before any pointer arithmetic) at row
  ``j % BLOCK_SIZE``, so a tile may span several pages or part of one.
* **Online softmax** in fp32, base 2 (``scale * log2(e)`` is folded into the scores). Every
  loop iteration has at least one valid key, so the running max is finite after the first.
* **Quantized caches** (``QUANTIZED``: int8 / float8 data, one bfloat16 scale per (token, KV
  head) in ``key_scale`` / ``value_scale`` ``[num_blocks, BLOCK_SIZE, Hkv]``, read through the
  same block ids and rows as the data): the raw tile is converted to the query's dtype (exact:
  int8 and both float8 formats are subsets of fp16, bf16 and fp32) and the scales are folded
  into the math, never into a dequantized copy: ``scores = (q . k_raw) * (k_scale * scale *
  log2(e))`` per key, and the PV weights are ``p * v_scale`` per key (``l`` sums the plain
  ``p``). In fp16 (``RESCALE_V``) those weights would underflow (e5m2's scales are ``absmax /
  57344``), so ``acc`` is kept in units of ``s``, the largest V scale seen so far (a running
  max, like ``m``): the weights are ``p * (v_scale / s) <= p``, ``acc`` is rescaled by ``s_old /
  s_new <= 1`` along with ``alpha`` (the dot still accumulates in place) and multiplied by
  ``s`` once at the end. bf16 and fp32 have float32's exponent range and need none of it.
* **Partial results**: with ``num_splits > 1`` each program writes its un-normalised output
  ``sum_j 2^(s_j - m) v_j``, its max ``m`` and its sum ``l = sum_j 2^(s_j - m)`` to an fp32
  workspace; :func:`_merge_splits_kernel` combines the splits of one (sequence, head)::

      M = max_s m_s,   out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s

  A split with no keys (short sequence, or ``seq_len == 0``) writes ``m = -inf, l = 0,
  acc = 0`` and so weighs nothing; a row with no key at all gets zeros. The merge reads only
  the ``num_splits`` entries every program writes, so stale or NaN workspace is harmless.
  With ``num_splits == 1`` the kernel normalises and writes the output itself (no merge).

* **Layer variants** (:class:`~.layer_attention.LayerAttention`; constexpr flags ``WINDOW``,
  ``CHUNK``, ``SOFT_CAP``, ``SINKS``, all False for full attention, which then compiles to the
  plain kernel). With a window or a chunk the row sees keys ``kv_first .. seq_len - 1``
  (``first_visible``); the splits share the range from ``kv_base``, the start of the BLOCK_N
  tile that holds ``kv_first`` (the tile grid of full attention), and every load is masked to
  ``tokens >= kv_first``: the blocks wholly before it, which a sliding-window KV cache group
  gives back (table entries -1, data stale), are never read. Every tile still holds a valid
  key (``kv_first`` is in split 0's first tile). Soft-capping maps the base-2 scores through
  ``soft_cap`` before the mask. A sink is one more logit with a zero value: split 0 starts its
  online softmax from it (``m = sink * log2(e)``, ``l = 1``, ``acc = 0``), the other splits
  start empty, so the merge counts it once and a row with no key gets zeros.

Programs of sequences with ``q_len != 1`` return at once; the prefill kernel handles those.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["decode_split_kernel", "first_visible", "merge_splits_kernel", "soft_cap", "value_weights"]


@triton.jit
def value_weights(p, alpha, v_scale, v_scale_run, RESCALE_V: tl.constexpr):
    """The softmax weights of a tile scaled by its V scales, ``acc``'s rescale factor, and the
    new running V scale: ``(weights [M, N], acc_alpha [M], v_scale_run)``.

    ``p`` [M, N] fp32 softmax numerators, ``alpha`` [M] the online-softmax rescale of ``acc``,
    ``v_scale`` [N] fp32 per-key V scales (0 for masked keys), ``v_scale_run`` scalar. With
    RESCALE_V (fp16 queries) ``acc`` is kept in units of the largest V scale so far, so the
    weights ``p * v_scale / s <= p`` stay clear of fp16 subnormals; bf16 / fp32 weights have
    fp32's exponent range and take ``p * v_scale`` directly.
    """
    if RESCALE_V:
        s_new = tl.maximum(v_scale_run, tl.max(v_scale, axis=0))  # > 0: some key of the tile is valid
        inv_s_new = 1.0 / s_new  # one division per tile
        return p * (v_scale * inv_s_new)[None, :], alpha * (v_scale_run * inv_s_new), s_new
    return p * v_scale[None, :], alpha, v_scale_run


@triton.jit
def first_visible(position, sliding_window, chunk_size, WINDOW: tl.constexpr, CHUNK: tl.constexpr):
    """The first key the query at ``position`` sees (``LayerAttention.first_visible``), >= 0;
    ``position`` is a scalar or a tensor of int32 positions, at least one of WINDOW / CHUNK is set.

    A negative position (a row of a sequence shorter than its query chunk, which sees nothing)
    gives 0 whatever the rounding of ``//``: every term is clamped at 0.
    """
    if WINDOW:
        first = tl.maximum(position - sliding_window + 1, 0)  # keys p - w < k <= p
        if CHUNK:
            first = tl.maximum(first, (position // chunk_size) * chunk_size)  # and k // C == p // C
    else:
        first = tl.maximum((position // chunk_size) * chunk_size, 0)
    return first


@triton.jit
def soft_cap(scores, cap_log2e):
    """``cap * tanh(s / cap)`` for scores in the kernels' base-2 domain (``scores = s * log2(e)``,
    ``cap_log2e = cap * log2(e)``): ``cap_log2e * tanh(scores / cap_log2e)``.

    tanh from exp2 (the interpreter has no libdevice): ``tanh(|x|) = (1 - e) / (1 + e)`` with
    ``e = exp(-2|x|)`` in (0, 1], so nothing overflows; the sign is put back afterwards.
    """
    x = scores / cap_log2e
    e = tl.exp2(-2.8853900817779268 * tl.abs(x))  # exp(-2|x|) = 2^(-2 log2(e) |x|)
    magnitude = (1.0 - e) / (1.0 + e)
    return cap_log2e * tl.where(x < 0.0, -magnitude, magnitude)


@triton.jit
def _decode_split_kernel(
    query_ptr,  # [T, H, D]
    key_cache_ptr,
    value_cache_ptr,  # [num_blocks, BLOCK_SIZE, Hkv, D], query's dtype, or int8 / float8 when QUANTIZED
    key_scale_ptr,
    value_scale_ptr,  # [num_blocks, BLOCK_SIZE, Hkv] bfloat16, read when QUANTIZED
    block_tables_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,  # [B] int32
    cu_seqlens_q_ptr,  # [B + 1] int32
    out_ptr,  # [T, H, D], written when WRITE_OUTPUT
    partial_out_ptr,  # [B, H, num_splits, D] fp32, written unless WRITE_OUTPUT
    partial_max_ptr,
    partial_sum_ptr,  # [B, H, num_splits] fp32
    sinks_ptr,  # [H] float, read when SINKS
    scale_log2e,  # softmax scale * log2(e)
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
    num_heads,
    num_splits,
    head_dim,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PADDED: tl.constexpr,  # >= 16, power of two
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    BLOCK_N: tl.constexpr,  # keys per loop iteration
    HEAD_DIM_PADDED: tl.constexpr,
    WRITE_OUTPUT: tl.constexpr,  # num_splits == 1: normalise and write `out` directly
    DOT_PRECISION: tl.constexpr,
    QUANTIZED: tl.constexpr,  # int8 / float8 caches with per-(token, head) scales
    RESCALE_V: tl.constexpr,  # QUANTIZED with fp16 queries: acc in units of the running max V scale
    WINDOW: tl.constexpr,  # a sliding window (LayerAttention); all four False: full attention
    CHUNK: tl.constexpr,  # chunked local attention
    SOFT_CAP: tl.constexpr,  # logit soft-capping
    SINKS: tl.constexpr,  # one sink logit per query head
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    q_row = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_row
    if q_len != 1:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    if WINDOW or CHUNK:
        # The splits share the keys from the tile that holds the row's first visible key (on
        # full attention's tile grid) to the end; no key below `kv_first` is loaded, so the
        # blocks wholly before it (given back, their table entries maybe -1) are never touched.
        kv_first = first_visible(seq_len - 1, sliding_window, chunk_size, WINDOW, CHUNK)
        kv_base = (kv_first // BLOCK_N) * BLOCK_N
        tokens_per_split = tl.cdiv(tl.cdiv(seq_len - kv_base, num_splits), BLOCK_N) * BLOCK_N
        kv_start = kv_base + split * tokens_per_split
    else:
        tokens_per_split = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
        kv_start = split * tokens_per_split
    kv_end = tl.minimum(kv_start + tokens_per_split, seq_len)

    group_rows = tl.arange(0, GROUP_PADDED)
    heads = kv_head * GROUP + group_rows
    row_mask = group_rows < GROUP
    dims = tl.arange(0, HEAD_DIM_PADDED)
    dim_mask = dims < head_dim

    q_ptrs = query_ptr + q_row.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + dims[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=row_mask[:, None] & dim_mask[None, :], other=0.0)

    m_i = tl.full([GROUP_PADDED], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PADDED], dtype=tl.float32)
    if SINKS:
        # The sink is one more logit in the row's softmax with a zero value vector: split 0 starts
        # from it (m = sink, l = 2^0 = 1, acc = 0), base 2 like the scores; the other splits start
        # empty, so the merge counts it once.
        sink = tl.load(sinks_ptr + heads, mask=row_mask, other=0.0).to(tl.float32) * 1.4426950408889634
        m_i = tl.where(split == 0, sink, m_i)
        l_i = tl.where(split == 0, 1.0, l_i)
    acc = tl.zeros([GROUP_PADDED, HEAD_DIM_PADDED], dtype=tl.float32)
    v_scale_run = 0.0  # RESCALE_V: the largest V scale so far (acc's unit)

    block_table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt_b
    kv_head_offset_k = kv_head.to(tl.int64) * stride_kh
    kv_head_offset_v = kv_head.to(tl.int64) * stride_vh
    kv_head_offset_ks = kv_head.to(tl.int64) * stride_ksh
    kv_head_offset_vs = kv_head.to(tl.int64) * stride_vsh
    for start in range(kv_start, kv_end, BLOCK_N):
        tokens = start + tl.arange(0, BLOCK_N)
        if WINDOW or CHUNK:
            # Every tile holds a visible key: kv_first is in the first tile of split 0.
            token_mask = (tokens >= kv_first) & (tokens < kv_end)
        else:
            token_mask = tokens < kv_end
        physical_block = tl.load(block_table_row + (tokens // BLOCK_SIZE) * stride_bt_n, mask=token_mask, other=0)
        physical_block = physical_block.to(tl.int64)
        row_in_block = tokens % BLOCK_SIZE
        kv_mask = token_mask[:, None] & dim_mask[None, :]

        k_ptrs = (
            key_cache_ptr
            + physical_block[:, None] * stride_kb
            + row_in_block[:, None] * stride_ks
            + kv_head_offset_k
            + dims[None, :] * stride_kd
        )
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0).to(q.dtype)  # [BLOCK_N, D], exact
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [GROUP_PADDED, BLOCK_N]
        if QUANTIZED:
            k_scale = tl.load(
                key_scale_ptr + physical_block * stride_ksb + row_in_block * stride_kss + kv_head_offset_ks,
                mask=token_mask,
                other=0.0,
            ).to(tl.float32)  # [BLOCK_N]
            scores = scores * (k_scale * scale_log2e)[None, :]
        else:
            scores = scores * scale_log2e
        if SOFT_CAP:
            scores = soft_cap(scores, soft_cap_log2e)  # before the mask, as transformers does
        scores = tl.where(token_mask[None, :], scores, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(scores, axis=1))  # finite: some token of the tile is valid
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)

        v_ptrs = (
            value_cache_ptr
            + physical_block[:, None] * stride_vb
            + row_in_block[:, None] * stride_vs
            + kv_head_offset_v
            + dims[None, :] * stride_vd
        )
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0).to(q.dtype)  # [BLOCK_N, D], exact
        if QUANTIZED:
            v_scale = tl.load(
                value_scale_ptr + physical_block * stride_vsb + row_in_block * stride_vss + kv_head_offset_vs,
                mask=token_mask,
                other=0.0,
            ).to(tl.float32)  # [BLOCK_N]
            weights, acc_alpha, v_scale_run = value_weights(p, alpha, v_scale, v_scale_run, RESCALE_V)
        else:
            weights = p
            acc_alpha = alpha
        acc = acc * acc_alpha[:, None] + tl.dot(weights.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    if RESCALE_V:
        acc = acc * v_scale_run  # 0 for a split without keys (acc is 0 too)

    store_mask = row_mask[:, None] & dim_mask[None, :]
    if WRITE_OUTPUT:
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        result = acc / l_safe[:, None]
        o_ptrs = out_ptr + q_row.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + dims[None, :] * stride_od
        tl.store(o_ptrs, result.to(out_ptr.dtype.element_ty), mask=store_mask)
    else:
        # Workspace index of (seq, head, split); int64 so that large batches cannot overflow.
        entry = (seq.to(tl.int64) * num_heads + heads) * num_splits + split  # [GROUP_PADDED]
        tl.store(partial_out_ptr + entry[:, None] * head_dim + dims[None, :], acc, mask=store_mask)
        tl.store(partial_max_ptr + entry, m_i, mask=row_mask)
        tl.store(partial_sum_ptr + entry, l_i, mask=row_mask)


@triton.jit
def _merge_splits_kernel(
    partial_out_ptr,  # [B, H, num_splits, D] fp32
    partial_max_ptr,
    partial_sum_ptr,  # [B, H, num_splits] fp32
    cu_seqlens_q_ptr,  # [B + 1] int32
    out_ptr,  # [T, H, D]
    stride_ot,
    stride_oh,
    stride_od,
    num_heads,
    num_splits,
    head_dim,
    SPLITS_PADDED: tl.constexpr,  # power of two >= num_splits
    HEAD_DIM_PADDED: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_row = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_row
    if q_len != 1:
        return

    splits = tl.arange(0, SPLITS_PADDED)
    split_mask = splits < num_splits
    dims = tl.arange(0, HEAD_DIM_PADDED)
    dim_mask = dims < head_dim
    entry = (seq.to(tl.int64) * num_heads + head) * num_splits + splits  # [SPLITS_PADDED]

    m = tl.load(partial_max_ptr + entry, mask=split_mask, other=float("-inf"))
    split_sum = tl.load(partial_sum_ptr + entry, mask=split_mask, other=0.0)
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # no key anywhere: all weights 0
    weight = tl.exp2(m - m_max)  # 0 for empty and padded splits
    total = tl.sum(weight * split_sum, axis=0)

    acc = tl.load(
        partial_out_ptr + entry[:, None] * head_dim + dims[None, :],
        mask=split_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )
    result = tl.sum(weight[:, None] * acc, axis=0) / tl.where(total > 0.0, total, 1.0)
    o_ptrs = out_ptr + q_row.to(tl.int64) * stride_ot + head * stride_oh + dims * stride_od
    tl.store(o_ptrs, result.to(out_ptr.dtype.element_ty), mask=dim_mask)


decode_split_kernel = _decode_split_kernel
merge_splits_kernel = _merge_splits_kernel
