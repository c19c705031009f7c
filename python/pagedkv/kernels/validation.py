"""Argument checks shared by every backend of ``store_kv`` and ``paged_attention``.

Every check raises :class:`pagedkv.errors.InvalidArgumentError` with a message naming the bad
argument and value. Shape, dtype and device checks are free (metadata only) and always run.
Checks that read tensor *values* (``cu_seqlens_q`` monotone, block ids in range, slots in
range, ...) run only for CPU tensors: on a GPU they would force a device-to-host sync on every
call, which a serving loop cannot afford.

Two ways in:

* per call, for direct users of :func:`pagedkv.kernels.store_kv` / ``paged_attention``:
  :func:`check_store_kv_args`, :func:`check_paged_attention_args` (everything, every call);
* per step, for a serving loop (:class:`pagedkv.kernels.AttentionBackend`):
  :func:`check_step_metadata` checks the step's index tensors and the cache geometry once
  (values included, on the host), and :func:`check_layer_store` /
  :func:`check_layer_attention` check only the shapes and dtypes of each layer's own tensors
  against those facts (no reductions).
"""

from __future__ import annotations

import math
import numbers
from typing import TYPE_CHECKING

import torch

from pagedkv.errors import InvalidArgumentError, InvalidTypeError
from pagedkv.kernels.kv_quant import SCALE_DTYPE, KVScales, format_of
from pagedkv.kernels.layer_attention import LayerAttention

if TYPE_CHECKING:
    from pagedkv.kernels import AttentionMetadata

__all__ = [
    "TRITON_HEAD_DIMS",
    "TRITON_DTYPES",
    "FP8_CACHE_DTYPES",
    "QUANTIZED_CACHE_DTYPES",
    "check_kv_scales",
    "check_store_kv_args",
    "check_paged_attention_args",
    "check_step_metadata",
    "check_layer_store",
    "check_layer_attention",
    "check_layer",
    "check_backend_supports",
]

# head_dim values the Triton kernels are built and tested for (non powers of two are padded).
TRITON_HEAD_DIMS = (64, 80, 96, 128, 256)
# Query / K / V dtypes of the Triton kernels; the torch path also takes float64.
TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# A cache may also be quantized (kernels/kv_quant.py): int8 or float8 data with a bfloat16 scale per
# (token, KV head), passed as ``kv_scales``; it is dequantized on load, in the query's precision.
FP8_CACHE_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
QUANTIZED_CACHE_DTYPES = (torch.int8, *FP8_CACHE_DTYPES)
_TORCH_DTYPES = (*TRITON_DTYPES, torch.float64)


def _require_tensor(name: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise InvalidArgumentError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def _require_dim(name: str, tensor: torch.Tensor, ndim: int, layout: str) -> None:
    if tensor.dim() != ndim:
        raise InvalidArgumentError(f"{name} must be {ndim}-D {layout}, got shape {tuple(tensor.shape)}")


def _require_dtype(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> None:
    if tensor.dtype != dtype:
        raise InvalidArgumentError(f"{name} must be {dtype}, got {tensor.dtype}")


def _require_same_device(tensors: dict[str, torch.Tensor]) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        listing = ", ".join(f"{name} on {device}" for name, device in devices.items())
        raise InvalidArgumentError(f"all tensors must be on one device, got {listing}")


def _check_cache_pair(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    _require_dim("key_cache", key_cache, 4, "[num_blocks, block_size, num_kv_heads, head_dim]")
    if value_cache.shape != key_cache.shape:
        raise InvalidArgumentError(
            f"value_cache shape {tuple(value_cache.shape)} differs from key_cache shape {tuple(key_cache.shape)}"
        )
    if value_cache.dtype != key_cache.dtype:
        raise InvalidArgumentError(
            f"value_cache dtype {value_cache.dtype} differs from key_cache dtype {key_cache.dtype}"
        )
    block_size = key_cache.shape[1]
    if block_size < 8 or block_size & (block_size - 1):
        raise InvalidArgumentError(f"block_size (key_cache.shape[1]) must be a power of two >= 8, got {block_size}")


def _check_compute_dtypes(name: str, dtype: torch.dtype, cache_dtype: torch.dtype, backend: str) -> None:
    allowed = TRITON_DTYPES if backend == "triton" else _TORCH_DTYPES
    if dtype not in allowed:
        raise InvalidArgumentError(
            f"{name} dtype {dtype} is not supported by the {backend} backend (supported: {', '.join(map(str, allowed))})"
        )
    if cache_dtype != dtype and cache_dtype not in QUANTIZED_CACHE_DTYPES:
        raise InvalidArgumentError(
            f"cache dtype {cache_dtype} must equal {name} dtype {dtype} (or be int8 / float8 with kv_scales)"
        )


def check_kv_scales(kv_scales: object, key_cache: torch.Tensor) -> None:
    """``kv_scales`` is given exactly for a quantized cache, and fits it (metadata only)."""
    if format_of(key_cache.dtype) is None:
        if kv_scales is not None:
            raise InvalidArgumentError(f"kv_scales were given for a {key_cache.dtype} cache, which is not quantized")
        return
    if not isinstance(kv_scales, KVScales):
        raise InvalidArgumentError(
            f"a {key_cache.dtype} cache needs its scales: pass kv_scales=KVScales(key=..., value=...) "
            f"(pagedkv.kernels.KVScales), got {type(kv_scales).__name__}"
        )
    expected = tuple(key_cache.shape[:3])
    for name, tensor in (("kv_scales.key", kv_scales.key), ("kv_scales.value", kv_scales.value)):
        if (
            not isinstance(tensor, torch.Tensor)
            or tuple(tensor.shape) != expected
            or tensor.dtype != SCALE_DTYPE
            or tensor.device != key_cache.device
        ):
            raise InvalidArgumentError(
                f"{name} must be a {SCALE_DTYPE} {expected} tensor ([num_blocks, block_size, num_kv_heads] of the "
                f"cache) on {key_cache.device}, got {_describe(tensor)}"
            )
    rotation, head_dim = kv_scales.key_rotation, key_cache.shape[3]
    if rotation is not None and (
        not isinstance(rotation, torch.Tensor)
        or tuple(rotation.shape) != (head_dim, head_dim)
        or not rotation.is_floating_point()
        or rotation.device != key_cache.device
    ):
        raise InvalidArgumentError(
            f"kv_scales.key_rotation must be a floating-point ({head_dim}, {head_dim}) tensor on {key_cache.device} "
            f"(kv_quant.key_rotation makes one), got {_describe(rotation)}"
        )
    num_kv_heads = key_cache.shape[2]
    for name, static in (
        ("kv_scales.static_key", kv_scales.static_key),
        ("kv_scales.static_value", kv_scales.static_value),
    ):
        if static is None:
            continue
        if (
            not isinstance(static, torch.Tensor)
            or tuple(static.shape) != (num_kv_heads,)
            or static.dtype != torch.float32
            or static.device != key_cache.device
        ):
            raise InvalidArgumentError(
                f"{name} must be a float32 ({num_kv_heads},) tensor on {key_cache.device} (one scale per KV head; "
                f"kv_quant.check_static_scale makes one), got {_describe(static)}"
            )


def _check_fp8_support(cache_dtype: torch.dtype, device: torch.device, backend: str) -> None:
    """Triton has float8 e4m3 from compute capability 8.9 (Ada, Hopper) on; e5m2 everywhere."""
    if backend != "triton" or device.type != "cuda" or cache_dtype != getattr(torch, "float8_e4m3fn", None):
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9):
        raise InvalidArgumentError(
            f"a float8_e4m3fn cache needs compute capability >= 8.9 for the triton backend; "
            f"{device} has {capability[0]}.{capability[1]} (use float8_e5m2 or a 16-bit cache)"
        )


def _check_head_dim(head_dim: int, backend: str) -> None:
    if backend == "triton" and head_dim not in TRITON_HEAD_DIMS:
        raise InvalidArgumentError(
            f"head_dim {head_dim} is not supported by the triton backend (supported: {TRITON_HEAD_DIMS})"
        )


def check_store_kv_args(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    backend: str,
    kv_scales: KVScales | None = None,
) -> None:
    for name, arg in (
        ("key", key),
        ("value", value),
        ("key_cache", key_cache),
        ("value_cache", value_cache),
        ("slot_mapping", slot_mapping),
    ):
        _require_tensor(name, arg)
    _require_dim("key", key, 3, "[num_tokens, num_kv_heads, head_dim]")
    if value.shape != key.shape:
        raise InvalidArgumentError(f"value shape {tuple(value.shape)} differs from key shape {tuple(key.shape)}")
    if value.dtype != key.dtype:
        raise InvalidArgumentError(f"value dtype {value.dtype} differs from key dtype {key.dtype}")
    _check_cache_pair(key_cache, value_cache)
    if key.shape[1:] != key_cache.shape[2:]:
        raise InvalidArgumentError(
            f"key has (num_kv_heads, head_dim) = {tuple(key.shape[1:])} but the cache has {tuple(key_cache.shape[2:])}"
        )
    _check_slot_mapping(slot_mapping, key.shape[0], "key has")
    _check_compute_dtypes("key", key.dtype, key_cache.dtype, backend)
    _check_head_dim(key.shape[2], backend)
    _require_same_device(
        {"key": key, "value": value, "key_cache": key_cache, "value_cache": value_cache, "slot_mapping": slot_mapping}
    )
    _check_fp8_support(key_cache.dtype, key_cache.device, backend)
    check_kv_scales(kv_scales, key_cache)
    if slot_mapping.device.type == "cpu":
        _check_slot_values(slot_mapping, key_cache.shape[0] * key_cache.shape[1])


def _check_slot_mapping(slot_mapping: torch.Tensor, num_tokens: int, owner: str) -> None:
    _require_dim("slot_mapping", slot_mapping, 1, "[num_tokens]")
    _require_dtype("slot_mapping", slot_mapping, torch.int64)
    if slot_mapping.shape[0] != num_tokens:
        raise InvalidArgumentError(f"slot_mapping has {slot_mapping.shape[0]} entries but {owner} {num_tokens} tokens")


def _check_slot_values(slot_mapping: torch.Tensor, num_slots: int) -> None:
    """Slots in range (CPU tensors only; -1 = do not store)."""
    if slot_mapping.numel() > 0:
        largest = int(slot_mapping.max())
        if largest >= num_slots:
            raise InvalidArgumentError(f"slot_mapping holds slot {largest}, but the cache has only {num_slots} slots")


def check_paged_attention_args(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    scale: float | None,
    out: torch.Tensor | None,
    backend: str,
    kv_scales: KVScales | None = None,
    layer: object = None,  # a LayerAttention (checked here); a window / chunk allows -1 columns before it
) -> None:
    for name, arg in (
        ("query", query),
        ("key_cache", key_cache),
        ("value_cache", value_cache),
        ("block_tables", block_tables),
        ("seq_lens", seq_lens),
        ("cu_seqlens_q", cu_seqlens_q),
    ):
        _require_tensor(name, arg)
    _require_dim("query", query, 3, "[num_tokens, num_heads, head_dim]")
    _check_cache_pair(key_cache, value_cache)
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    if key_cache.shape[3] != head_dim:
        raise InvalidArgumentError(f"query head_dim {head_dim} differs from the cache's head_dim {key_cache.shape[3]}")
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise InvalidArgumentError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    _check_compute_dtypes("query", query.dtype, key_cache.dtype, backend)
    _check_head_dim(head_dim, backend)
    checked_layer = None if layer is None else check_layer(layer, num_heads)

    _check_batch_shapes(block_tables, seq_lens, cu_seqlens_q)
    _check_scale(scale)
    tensors = {
        "query": query,
        "key_cache": key_cache,
        "value_cache": value_cache,
        "block_tables": block_tables,
        "seq_lens": seq_lens,
        "cu_seqlens_q": cu_seqlens_q,
    }
    if out is not None:
        _require_tensor("out", out)
        if out.shape != query.shape or out.dtype != query.dtype:
            raise InvalidArgumentError(
                f"out must match query ({tuple(query.shape)}, {query.dtype}), got ({tuple(out.shape)}, {out.dtype})"
            )
        tensors["out"] = out
    _require_same_device(tensors)
    _check_fp8_support(key_cache.dtype, key_cache.device, backend)
    check_kv_scales(kv_scales, key_cache)
    if query.device.type == "cpu":
        _check_batch_values(
            block_tables, seq_lens, cu_seqlens_q, num_tokens, key_cache.shape[0], key_cache.shape[1], checked_layer
        )


def _check_batch_shapes(block_tables: torch.Tensor, seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor) -> None:
    _require_dim("block_tables", block_tables, 2, "[num_seqs, max_blocks]")
    _require_dtype("block_tables", block_tables, torch.int32)
    _require_dim("seq_lens", seq_lens, 1, "[num_seqs]")
    _require_dtype("seq_lens", seq_lens, torch.int32)
    _require_dim("cu_seqlens_q", cu_seqlens_q, 1, "[num_seqs + 1]")
    _require_dtype("cu_seqlens_q", cu_seqlens_q, torch.int32)
    num_seqs = block_tables.shape[0]
    if seq_lens.shape[0] != num_seqs or cu_seqlens_q.shape[0] != num_seqs + 1:
        raise InvalidArgumentError(
            f"block_tables has {num_seqs} rows, so seq_lens needs {num_seqs} entries (has {seq_lens.shape[0]}) "
            f"and cu_seqlens_q {num_seqs + 1} (has {cu_seqlens_q.shape[0]})"
        )


def _check_scale(scale: float | None) -> None:
    if scale is not None and not (isinstance(scale, numbers.Real) and math.isfinite(scale)):
        raise InvalidArgumentError(f"scale must be a finite number or None, got {scale!r}")


def _check_batch_values(
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32
    cu_seqlens_q: torch.Tensor,  # [B + 1] int32
    num_tokens: int,
    num_blocks: int,
    block_size: int,
    layer: LayerAttention | None = None,
) -> None:
    """Value checks of the batch metadata (CPU tensors only: no device sync). A block is used
    from the one holding the first key a sequence's earliest query sees (``layer``: a window or
    a chunk; no kernel reads the blocks before it, which may be -1) to its last."""
    if cu_seqlens_q.numel() and int(cu_seqlens_q[0]) != 0:
        raise InvalidArgumentError(f"cu_seqlens_q must start at 0, got {int(cu_seqlens_q[0])}")
    q_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    if q_lens.numel() == 0:
        return
    if int(q_lens.min()) < 0:
        b = int(torch.argmin(q_lens))
        raise InvalidArgumentError(
            f"cu_seqlens_q must be non-decreasing; it falls from {int(cu_seqlens_q[b])} to {int(cu_seqlens_q[b + 1])} "
            f"at sequence {b}"
        )
    if int(cu_seqlens_q[-1]) > num_tokens:
        raise InvalidArgumentError(f"cu_seqlens_q ends at {int(cu_seqlens_q[-1])}, past the {num_tokens} query rows")
    capacity = block_tables.shape[1] * block_size
    if int(seq_lens.min()) < 0 or int(seq_lens.max()) > capacity:
        b = int(torch.argmin(seq_lens)) if int(seq_lens.min()) < 0 else int(torch.argmax(seq_lens))
        raise InvalidArgumentError(
            f"seq_lens[{b}] = {int(seq_lens[b])} is outside 0 .. {capacity} (block_tables width x block_size)"
        )
    blocks_used = (seq_lens.long() + block_size - 1) // block_size
    columns = torch.arange(block_tables.shape[1])
    in_use = columns < blocks_used[:, None]
    if layer is not None and layer.limits_context:
        earliest_query = torch.clamp(seq_lens.long() - q_lens.long(), min=0)
        in_use &= columns >= (layer.first_visible_tensor(earliest_query) // block_size)[:, None]
    used_ids = block_tables[in_use]
    if used_ids.numel() and (int(used_ids.min()) < 0 or int(used_ids.max()) >= num_blocks):
        bad = int(used_ids.min()) if int(used_ids.min()) < 0 else int(used_ids.max())
        raise InvalidArgumentError(
            f"block_tables holds block id {bad} for a used block; the cache has {num_blocks} blocks"
        )


# ---------------------------------------------------------------- per step / per layer


def check_backend_supports(
    backend: str,
    dtype: torch.dtype,
    head_dim: int,
    cache_dtype: torch.dtype | None = None,  # None = the compute dtype
    device: torch.device | None = None,
) -> None:
    """Can ``backend`` run a model of this compute dtype and head_dim over a cache of
    ``cache_dtype`` on ``device``?"""
    _check_compute_dtypes("query", dtype, dtype if cache_dtype is None else cache_dtype, backend)
    _check_head_dim(head_dim, backend)
    if cache_dtype is not None and device is not None:
        _check_fp8_support(cache_dtype, device, backend)


def check_step_metadata(
    slot_mapping: torch.Tensor,  # [T] int64
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32
    cu_seqlens_q: torch.Tensor,  # [B + 1] int32
    num_tokens: int,  # T
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], one layer's (all layers alike)
    value_cache: torch.Tensor,
    dtype: torch.dtype,  # the query / key / value dtype of the layers
    backend: str,
) -> None:
    """Everything about one step that every layer shares, checked once: the cache geometry and
    dtypes for ``backend``, and the index tensors' shapes, dtypes and (on the host) values."""
    for name, arg in (
        ("slot_mapping", slot_mapping),
        ("block_tables", block_tables),
        ("seq_lens", seq_lens),
        ("cu_seqlens_q", cu_seqlens_q),
        ("key_cache", key_cache),
        ("value_cache", value_cache),
    ):
        _require_tensor(name, arg)
    _check_cache_pair(key_cache, value_cache)
    _check_compute_dtypes("query", dtype, key_cache.dtype, backend)
    _check_head_dim(key_cache.shape[3], backend)
    _require_same_device({"key_cache": key_cache, "value_cache": value_cache})
    _check_fp8_support(key_cache.dtype, key_cache.device, backend)
    _check_slot_mapping(slot_mapping, num_tokens, "the step has")
    _check_batch_shapes(block_tables, seq_lens, cu_seqlens_q)
    _require_same_device(
        {"slot_mapping": slot_mapping, "block_tables": block_tables, "seq_lens": seq_lens, "cu_seqlens_q": cu_seqlens_q}
    )
    if slot_mapping.device.type == "cpu":
        num_blocks, block_size = key_cache.shape[0], key_cache.shape[1]
        _check_slot_values(slot_mapping, num_blocks * block_size)
        _check_batch_values(block_tables, seq_lens, cu_seqlens_q, num_tokens, num_blocks, block_size)


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"{value.dtype} {tuple(value.shape)} on {value.device}"
    return type(value).__name__


def _check_layer_caches(key_cache: torch.Tensor, value_cache: torch.Tensor, meta: AttentionMetadata) -> None:
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        if (
            not isinstance(cache, torch.Tensor)
            or cache.shape != meta.cache_shape
            or cache.dtype != meta.cache_dtype
            or cache.device != meta.device
        ):
            raise InvalidArgumentError(
                f"{name} must be a {meta.cache_dtype} {tuple(meta.cache_shape)} tensor on {meta.device} (the cache "
                f"geometry the step metadata was built for), got {_describe(cache)}"
            )


def check_layer_store(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    kv_scales: KVScales | None = None,
) -> None:
    """One layer's ``store_kv`` arguments against the step metadata: shapes and dtypes only."""
    _check_layer_caches(key_cache, value_cache, meta)
    check_kv_scales(kv_scales, key_cache)
    expected = (meta.num_tokens, *meta.cache_shape[2:])
    for name, tensor in (("key", key), ("value", value)):
        if (
            not isinstance(tensor, torch.Tensor)
            or tensor.shape != expected
            or tensor.dtype != meta.dtype
            or tensor.device != meta.device
        ):
            raise InvalidArgumentError(
                f"{name} must be a {meta.dtype} {expected} tensor on {meta.device} ([num_tokens, num_kv_heads, "
                f"head_dim] of the step), got {_describe(tensor)}"
            )


def check_layer_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float | None,
    out: torch.Tensor | None,
    kv_scales: KVScales | None = None,
) -> None:
    """One layer's ``paged_attention`` arguments against the step metadata: shapes and dtypes only."""
    _check_layer_caches(key_cache, value_cache, meta)
    check_kv_scales(kv_scales, key_cache)
    num_kv_heads, head_dim = meta.cache_shape[2], meta.cache_shape[3]
    if (
        not isinstance(query, torch.Tensor)
        or query.dim() != 3
        or query.shape[0] != meta.num_tokens
        or query.shape[2] != head_dim
        or query.shape[1] % num_kv_heads
        or query.dtype != meta.dtype
        or query.device != meta.device
    ):
        raise InvalidArgumentError(
            f"query must be a {meta.dtype} [{meta.num_tokens}, k * {num_kv_heads}, {head_dim}] tensor on "
            f"{meta.device} ([num_tokens, num_heads, head_dim] of the step), got {_describe(query)}"
        )
    _check_scale(scale)
    if out is not None and (
        not isinstance(out, torch.Tensor)
        or out.shape != query.shape
        or out.dtype != query.dtype
        or out.device != query.device
    ):
        raise InvalidArgumentError(f"out must match query ({tuple(query.shape)}, {query.dtype}), got {_describe(out)}")


def check_layer(layer: object, num_heads: int) -> LayerAttention:
    """``layer`` is a :class:`LayerAttention` whose sinks fit the query's heads (every backend
    runs every variant); returns it."""
    if not isinstance(layer, LayerAttention):
        raise InvalidTypeError(f"layer must be a pagedkv.kernels.LayerAttention, got {type(layer).__name__}")
    layer.check_heads(num_heads)
    return layer
