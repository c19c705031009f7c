"""Launches the Triton paged-attention kernels for one packed batch.

A batch mixes decodes (``q_len == 1``) and prefill/extend chunks (``q_len > 1``). Nothing here
reads device memory on the host (no sync): the launch is planned from shapes and optional
host-side hints only.

* Decodes go to the split-KV kernel (:mod:`.triton_decode`), grid ``(B, Hkv, num_splits)``.
  ``num_splits`` (:func:`choose_num_splits`) is picked so that ``B * Hkv * num_splits`` is at
  least ``_PROGRAMS_PER_SM`` times the SM count while every split keeps at least
  ``_MIN_TOKENS_PER_SPLIT`` keys of the longest context; one split means no workspace and no
  merge.
* Everything else goes to the prefill kernel (:mod:`.triton_prefill`), grid
  ``(T // BLOCK_M + B, H)``, which skips the decode rows.
* Without a ``max_seqlen_q`` hint, ``T == B`` is taken to mean all decodes and the prefill
  kernel is not launched. That holds whenever every sequence has at least one query row (the
  scheduler never batches a sequence with nothing to compute); a caller that does pass
  ``q_len == 0`` sequences on a GPU must pass ``max_seqlen_q``. (On CPU tensors the dispatcher
  computes ``max_seqlen_q`` itself.)

Workspace policy: the split-KV partial results (``[B, H, num_splits, D]`` output and two
``[B, H, num_splits]`` statistics, fp32) are allocated per call with ``torch.empty`` from the
torch caching allocator (no state kept between calls, CUDA-graph friendly); a caller may pass
a :class:`DecodeWorkspace` instead (the tests pass one filled with NaN to prove that nothing
reads an entry the kernel did not write).

Layer variants (``layer=``, :class:`~.layer_attention.LayerAttention`): window, chunk,
soft-cap and sinks become constexpr flags and runtime arguments of both kernels
(:class:`_LayerArgs`); full attention sets no flag and launches the kernels it always did. A
windowed / chunked decode row reads at most its window or chunk, so the split count is chosen
for that many keys, not for the context.

Longest context: ``max_seqlen_k`` when given, else ``block_tables.shape[1] * block_size``
(the block tables are padded to the longest sequence of the batch).

Quantized caches (int8, float8 e4m3 / e5m2; :mod:`.kv_quant`) come with their
:class:`~.kv_quant.KVScales` (bfloat16 ``[num_blocks, block_size, Hkv]``, one scale per
(token, KV head), any strides): both kernels read the raw tiles and the scales and fold the
scales into the math in registers (``QUANTIZED``; see :mod:`.triton_decode`); nothing
dequantized is ever written. Float8 e4m3 needs compute capability >= 8.9 (the dispatcher
refuses it below); int8 and e5m2 run everywhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton

from pagedkv.errors import InvalidArgumentError
from pagedkv.kernels.kv_quant import KVScales, format_of
from pagedkv.kernels.layer_attention import FULL_ATTENTION, LayerAttention
from pagedkv.kernels.triton_decode import decode_split_kernel, merge_splits_kernel
from pagedkv.kernels.triton_prefill import prefill_kernel

__all__ = [
    "DecodeConfig",
    "DecodeWorkspace",
    "PrefillConfig",
    "choose_num_splits",
    "default_decode_config",
    "default_prefill_config",
    "is_interpreted",
    "paged_attention",
]

_LOG2_E = 1.4426950408889634
# Decode programs wanted per SM. The kernel is bandwidth-bound and its K/V tiles are single-
# buffered (the block-table indirection limits Triton's pipelining), so latency is hidden by
# several resident programs per SM (~4-5 fit at head_dim 128); the merge cost of extra splits is
# small next to the KV read.
_PROGRAMS_PER_SM = 4
_MIN_TOKENS_PER_SPLIT = 256  # keep each split several blocks long
_MAX_SPLITS = 64
_INTERPRETER_SMS = 4  # "SM count" under TRITON_INTERPRET: few programs, fast tests


def is_interpreted() -> bool:
    """True when the kernels were decorated under ``TRITON_INTERPRET=1`` (they run on the CPU)."""
    return type(decode_split_kernel).__name__ == "InterpretedFunction"


@dataclass
class DecodeWorkspace:
    """fp32 partial results of split-KV decode, one entry per (sequence, query head, split)."""

    partial_out: torch.Tensor  # [B, H, num_splits, D] fp32, contiguous
    partial_max: torch.Tensor  # [B, H, num_splits] fp32, contiguous (base-2 running max)
    partial_sum: torch.Tensor  # [B, H, num_splits] fp32, contiguous

    @classmethod
    def allocate(
        cls,
        num_seqs: int,
        num_heads: int,
        num_splits: int,
        head_dim: int,
        device: torch.device,
        fill: float | None = None,
    ) -> DecodeWorkspace:
        def make(*shape: int) -> torch.Tensor:
            if fill is None:
                return torch.empty(shape, dtype=torch.float32, device=device)
            return torch.full(shape, fill, dtype=torch.float32, device=device)

        return cls(
            make(num_seqs, num_heads, num_splits, head_dim),
            make(num_seqs, num_heads, num_splits),
            make(num_seqs, num_heads, num_splits),
        )

    def fits(self, num_seqs: int, num_heads: int, num_splits: int, head_dim: int) -> bool:
        return tuple(self.partial_out.shape) == (num_seqs, num_heads, num_splits, head_dim)


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _INTERPRETER_SMS


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_context: int, num_sms: int) -> int:
    """Splits per (sequence, KV head) for decode: fill the GPU, keep splits long enough.

    >>> choose_num_splits(256, 8, 4096, 132)  # 2048 programs already fill an H200
    1
    >>> choose_num_splits(1, 8, 32768, 132)  # one long sequence: spread it over the SMs
    64
    """
    programs = max(1, num_seqs * num_kv_heads)
    wanted = _PROGRAMS_PER_SM * num_sms
    if programs >= wanted:
        return 1
    longest_useful = max(1, max_context // _MIN_TOKENS_PER_SPLIT)
    return max(1, min(math.ceil(wanted / programs), longest_useful, _MAX_SPLITS))


@dataclass(frozen=True)
class PrefillConfig:
    """Tile sizes and launch options of the prefill kernel."""

    block_m: int  # query rows per program
    block_n: int  # keys per loop iteration
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class DecodeConfig:
    """Tile size and launch options of the split-KV decode kernel."""

    block_n: int  # keys per loop iteration (may span several cache blocks)
    num_warps: int
    num_stages: int


def _target_arch() -> int:
    """Compute capability x 10 of the GPU the kernels compile for (compile_check's stand-in
    driver answers its --arch)."""
    return triton.runtime.driver.active.get_current_target().arch


def default_prefill_config(
    head_dim_padded: int, dtype: torch.dtype, quantized: bool = False, limited: bool = False
) -> PrefillConfig:
    """``quantized``: int8 / float8 K/V tiles, converted in registers (and stored back to shared
    memory for the MMA), need half the key tile to stay within 255 registers without spilling
    (see compile_check's report). ``limited``: a window or chunk (one more masked loop and its
    bounds): with a quantized cache on Ampere that no longer fits 255 registers at 128 rows
    (8 bytes spilled), so 64."""
    if is_interpreted():
        # The interpreter pays per loop iteration, not per element: big tiles, few iterations.
        return PrefillConfig(block_m=64, block_n=64, num_warps=4, num_stages=1)
    if dtype == torch.float32:
        # fp32 runs exact (FMA, "ieee") dots: small tiles and 8 warps keep register spills small.
        return PrefillConfig(block_m=32, block_n=32, num_warps=8, num_stages=2)
    if head_dim_padded >= 256:
        return PrefillConfig(block_m=64, block_n=16 if quantized else 32, num_warps=8, num_stages=2)
    if quantized and limited and _target_arch() < 90:
        return PrefillConfig(block_m=64, block_n=32, num_warps=8, num_stages=3)
    # Hopper: 128 x 64 tiles on warp-group MMA, K/V loads pipelined over 3 stages.
    return PrefillConfig(block_m=128, block_n=32 if quantized else 64, num_warps=8, num_stages=3)


def default_decode_config(head_dim_padded: int, dtype: torch.dtype) -> DecodeConfig:
    if is_interpreted():
        return DecodeConfig(block_n=64, num_warps=4, num_stages=1)
    if head_dim_padded >= 256 or dtype == torch.float32:
        return DecodeConfig(block_n=32, num_warps=4, num_stages=3)
    # 64 keys x 128 dims of K and of V per iteration (32 KB in bf16); with 3 stages the block
    # ids of the next iteration are prefetched along with it (see compile_check's report).
    return DecodeConfig(block_n=64, num_warps=4, num_stages=3)


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs: exact fp32 products (tf32 would miss the fp32 tolerance); halves ignore it.
    return "ieee" if dtype == torch.float32 else "tf32"


def _scale_args(key_cache: torch.Tensor, kv_scales: KVScales | None) -> tuple[list, bool]:
    """(scale pointers and their strides, QUANTIZED) for the kernels."""
    fmt = format_of(key_cache.dtype)
    if (fmt is None) != (kv_scales is None):
        raise InvalidArgumentError(
            f"a {key_cache.dtype} cache {'needs' if fmt is not None else 'takes no'} kv_scales (triton paged_attention)"
        )
    if kv_scales is None or fmt is None:
        # Not read (QUANTIZED is False): any pointer, any strides.
        return [key_cache, key_cache, 0, 0, 0, 0, 0, 0], False
    return [kv_scales.key, kv_scales.value, *kv_scales.key.stride(), *kv_scales.value.stride()], True


@dataclass(frozen=True)
class _LayerArgs:
    """A :class:`LayerAttention` as the kernels take it: a sinks pointer, three runtime scalars
    and four constexpr flags (all False for full attention, which then compiles to the kernels
    it always was)."""

    sinks: torch.Tensor | None  # [H] float on the query's device; None: not read
    sliding_window: int  # 0 when not WINDOW
    chunk_size: int  # 0 when not CHUNK
    soft_cap_log2e: float  # cap * log2(e), the kernels' base-2 domain; 0.0 when not SOFT_CAP

    @classmethod
    def of(cls, layer: LayerAttention, device: torch.device) -> _LayerArgs:
        sinks = layer.sinks
        if sinks is not None and (sinks.device != device or not sinks.is_contiguous()):
            sinks = sinks.to(device).contiguous()
        cap = layer.logits_soft_cap
        return cls(sinks, layer.sliding_window or 0, layer.chunk_size or 0, 0.0 if cap is None else cap * _LOG2_E)

    def sinks_or(self, dummy: torch.Tensor) -> torch.Tensor:
        """The sinks pointer; ``dummy`` stands for it when there are none (never read)."""
        return dummy if self.sinks is None else self.sinks

    def scalars(self) -> tuple[int, int, float]:
        """(sliding_window, chunk_size, soft_cap_log2e), the kernels' runtime arguments."""
        return self.sliding_window, self.chunk_size, self.soft_cap_log2e

    def flags(self) -> dict[str, bool]:
        return {
            "WINDOW": self.sliding_window > 0,
            "CHUNK": self.chunk_size > 0,
            "SOFT_CAP": self.soft_cap_log2e > 0.0,
            "SINKS": self.sinks is not None,
        }

    def visible_context(self, context: int) -> int:
        """At most how many keys a decode row of a ``context``-token sequence sees."""
        for limit in (self.sliding_window, self.chunk_size):
            if limit > 0:
                context = min(context, limit)
        return context


def paged_attention(
    query: torch.Tensor,  # [T, H, D] fp16/bf16/fp32
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], query's dtype, or int8 / float8 with kv_scales
    value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], key_cache's dtype
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32
    cu_seqlens_q: torch.Tensor,  # [B + 1] int32
    *,
    scale: float,
    out: torch.Tensor,  # [T, H, D], query's dtype
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    num_splits: int | None = None,  # decode splits; None = choose_num_splits
    workspace: DecodeWorkspace | None = None,
    use_decode_kernel: bool = True,  # False: the prefill kernel does the q_len == 1 rows too
    decode_config: DecodeConfig | None = None,  # None = default_decode_config
    prefill_config: PrefillConfig | None = None,  # None = default_prefill_config
    kv_scales: KVScales | None = None,  # required for (and only for) an int8 / float8 cache
    layer: LayerAttention = FULL_ATTENTION,  # window, chunk, soft-cap, sinks ([H] sinks)
) -> torch.Tensor:
    """Launch decode and/or prefill kernels (inputs already validated by the dispatcher)."""
    scale_args, quantized = _scale_args(key_cache, kv_scales)
    layer.check_heads(query.shape[1])
    layer_args = _LayerArgs.of(layer, query.device)
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = block_tables.shape[0]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    head_dim_padded = max(16, triton.next_power_of_2(head_dim))
    scale_log2e = scale * _LOG2_E
    dot_precision = _dot_precision(query.dtype)

    if max_seqlen_q is None:
        all_decodes = num_tokens == num_seqs
    else:
        all_decodes = max_seqlen_q <= 1
    has_prefill = not all_decodes or not use_decode_kernel

    if use_decode_kernel:
        if max_seqlen_k is None:
            max_seqlen_k = block_tables.shape[1] * block_size
        if num_splits is None:
            # A windowed / chunked row reads its window, not its context: split that.
            visible = layer_args.visible_context(max_seqlen_k)
            num_splits = choose_num_splits(num_seqs, num_kv_heads, visible, _num_sms(query.device))
        _launch_decode(
            query,
            key_cache,
            value_cache,
            block_tables,
            seq_lens,
            cu_seqlens_q,
            out,
            scale_args,
            layer_args,
            quantized=quantized,
            scale_log2e=scale_log2e,
            num_splits=num_splits,
            workspace=workspace,
            group=group,
            head_dim_padded=head_dim_padded,
            dot_precision=dot_precision,
            config=decode_config or default_decode_config(head_dim_padded, query.dtype),
        )
    if has_prefill:
        limited = layer.limits_context
        config = prefill_config or default_prefill_config(head_dim_padded, query.dtype, quantized, limited)
        grid = (num_tokens // config.block_m + num_seqs, num_heads)
        prefill_kernel[grid](
            query,
            key_cache,
            value_cache,
            *scale_args[:2],
            block_tables,
            seq_lens,
            cu_seqlens_q,
            out,
            layer_args.sinks_or(out),
            scale_log2e,
            *layer_args.scalars(),
            *query.stride(),
            *key_cache.stride(),
            *value_cache.stride(),
            *scale_args[2:],
            *block_tables.stride(),
            *out.stride(),
            num_seqs,
            head_dim,
            GROUP=group,
            BLOCK_SIZE=block_size,
            BLOCK_M=config.block_m,
            BLOCK_N=config.block_n,
            HEAD_DIM_PADDED=head_dim_padded,
            SKIP_DECODES=use_decode_kernel,
            DOT_PRECISION=dot_precision,
            QUANTIZED=quantized,
            RESCALE_V=quantized and query.dtype == torch.float16,
            **layer_args.flags(),
            num_warps=config.num_warps,
            num_stages=config.num_stages,
        )
    return out


def _launch_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    out: torch.Tensor,
    scale_args: list,  # from _scale_args
    layer_args: _LayerArgs,
    *,
    quantized: bool,
    scale_log2e: float,
    num_splits: int,
    workspace: DecodeWorkspace | None,
    group: int,
    head_dim_padded: int,
    dot_precision: str,
    config: DecodeConfig,
) -> None:
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_seqs = block_tables.shape[0]
    num_kv_heads = key_cache.shape[2]
    single_split = num_splits == 1
    if single_split:
        workspace = None
        partials = (out, out, out)  # unused by the kernel; any pointer will do
    else:
        if workspace is None:
            workspace = DecodeWorkspace.allocate(num_seqs, num_heads, num_splits, head_dim, query.device)
        elif not workspace.fits(num_seqs, num_heads, num_splits, head_dim):
            raise InvalidArgumentError(
                f"workspace has shape {tuple(workspace.partial_out.shape)}, "
                f"needs {(num_seqs, num_heads, num_splits, head_dim)}"
            )
        partials = (workspace.partial_out, workspace.partial_max, workspace.partial_sum)

    decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        query,
        key_cache,
        value_cache,
        *scale_args[:2],
        block_tables,
        seq_lens,
        cu_seqlens_q,
        out,
        *partials,
        layer_args.sinks_or(out),
        scale_log2e,
        *layer_args.scalars(),
        *query.stride(),
        *key_cache.stride(),
        *value_cache.stride(),
        *scale_args[2:],
        *block_tables.stride(),
        *out.stride(),
        num_heads,
        num_splits,
        head_dim,
        GROUP=group,
        GROUP_PADDED=max(16, triton.next_power_of_2(group)),
        BLOCK_SIZE=key_cache.shape[1],
        BLOCK_N=config.block_n,
        HEAD_DIM_PADDED=head_dim_padded,
        WRITE_OUTPUT=single_split,
        DOT_PRECISION=dot_precision,
        QUANTIZED=quantized,
        RESCALE_V=quantized and query.dtype == torch.float16,
        **layer_args.flags(),
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if workspace is not None:
        merge_splits_kernel[(num_seqs, num_heads)](
            workspace.partial_out,
            workspace.partial_max,
            workspace.partial_sum,
            cu_seqlens_q,
            out,
            *out.stride(),
            num_heads,
            num_splits,
            head_dim,
            SPLITS_PADDED=triton.next_power_of_2(num_splits),
            HEAD_DIM_PADDED=head_dim_padded,
            num_warps=4,
        )
