"""Paged KV cache kernels: write new K/V into the cache, attend over it.

Public API (same signatures for every backend)::

    store_kv(key, value, key_cache, value_cache, slot_mapping, *, backend=None) -> None
    paged_attention(query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q,
                    *, scale=None, out=None, backend=None,
                    max_seqlen_q=None, max_seqlen_k=None) -> Tensor

Backends:

* ``triton``: the Triton kernels (:mod:`.triton_store`, :mod:`.triton_attention`). Runs on
  CUDA tensors, and on CPU tensors when ``TRITON_INTERPRET=1`` was set before the kernels were
  imported (how the CPU tests run them).
* ``cpu``: :mod:`.cpu`, decode rows in Rust straight from the paged cache (float32), prefill
  and extend rows through the torch path: the CPU production path.
* ``torch``: :mod:`.reference`, plain torch (the float64 oracle; any device and dtype).

The backend is the ``backend=`` argument if given, else the environment variable
``PAGEDKV_ATTENTION_BACKEND`` (read at every call), else ``auto``: ``triton`` for CUDA tensors
when Triton is installed and supports the dtype and head_dim, ``cpu`` for float32 CPU tensors,
``torch`` otherwise. Triton is imported lazily, only when the
``triton`` backend is used, so the torch path works where Triton is not installed.

Every call validates its arguments (:mod:`.validation`) and raises
:class:`pagedkv.errors.InvalidArgumentError` on bad ones; an unknown backend name raises
:class:`pagedkv.errors.ConfigError`.

``max_seqlen_q`` / ``max_seqlen_k`` are optional host-side hints for the Triton launch (the
longest query chunk and the longest context of the batch); without them the launch assumes
that ``T == B`` means all decodes and bounds the context by the block-table width. They never
change results, only which kernels run and how the work is split.
"""

from __future__ import annotations

import importlib.util
import os
from types import ModuleType

import torch

from pagedkv.errors import ConfigError, InvalidArgumentError
from pagedkv.kernels import reference
from pagedkv.kernels.validation import (
    TRITON_DTYPES,
    TRITON_HEAD_DIMS,
    check_paged_attention_args,
    check_store_kv_args,
)

__all__ = ["BACKEND_ENV_VAR", "BACKENDS", "resolve_backend", "store_kv", "paged_attention"]

BACKEND_ENV_VAR = "PAGEDKV_ATTENTION_BACKEND"
BACKENDS = ("auto", "triton", "cpu", "torch")


def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def _triton_module(name: str) -> ModuleType:
    """Import ``pagedkv.kernels.<name>`` (which imports Triton) on first use."""
    try:
        return importlib.import_module(f"pagedkv.kernels.{name}")
    except ImportError as exc:
        raise ConfigError(f"the triton backend needs the `triton` package, which failed to import: {exc}") from exc


def resolve_backend(
    device: torch.device,
    backend: str | None = None,
    *,
    dtype: torch.dtype | None = None,
    head_dim: int | None = None,
) -> str:
    """The backend (``"triton"``, ``"cpu"`` or ``"torch"``) a call on tensors of ``device`` uses.

    ``auto`` takes Triton for CUDA tensors whose dtype and head_dim (when given) the kernels
    support, the cpu backend for float32 CPU tensors, and the torch path for everything else.
    """
    if backend is not None:
        if backend not in BACKENDS:
            raise InvalidArgumentError(f"backend must be one of {BACKENDS}, got {backend!r}")
        choice = backend
    else:
        choice = os.environ.get(BACKEND_ENV_VAR, "auto").strip().lower() or "auto"
        if choice not in BACKENDS:
            raise ConfigError(f"{BACKEND_ENV_VAR} must be one of {BACKENDS}, got {choice!r}")
    if choice == "auto":
        if device.type == "cpu":
            return "cpu" if dtype in (None, torch.float32) else "torch"
        supported = (dtype is None or dtype in TRITON_DTYPES) and (head_dim is None or head_dim in TRITON_HEAD_DIMS)
        return "triton" if device.type == "cuda" and supported and _triton_installed() else "torch"
    if choice == "cpu" and device.type != "cpu":
        raise InvalidArgumentError(f"the cpu backend got tensors on {device}; use triton or torch there")
    if choice == "triton" and device.type != "cuda":
        if not _triton_module("triton_attention").is_interpreted():
            raise InvalidArgumentError(
                f"the triton backend got tensors on {device}; it runs on CUDA tensors, or on the CPU only "
                "when TRITON_INTERPRET=1 is set before pagedkv.kernels imports its Triton modules"
            )
    return choice


def store_kv(
    key: torch.Tensor,  # [T, Hkv, D], any strides
    value: torch.Tensor,  # [T, Hkv, D], any strides
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64; -1 = skip the token
    *,
    backend: str | None = None,
) -> None:
    """Write token ``t``'s K and V into cache slot ``slot_mapping[t]`` (in place)."""
    chosen = resolve_backend(_device_of("key", key), backend, dtype=key.dtype, head_dim=key.shape[-1])
    check_store_kv_args(key, value, key_cache, value_cache, slot_mapping, chosen)
    if chosen == "triton":
        _triton_module("triton_store").store_kv(key, value, key_cache, value_cache, slot_mapping)
    else:
        reference.store_kv(key, value, key_cache, value_cache, slot_mapping)


def paged_attention(
    query: torch.Tensor,  # [T, H, D]
    key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    value_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32, KV tokens per sequence including the new ones
    cu_seqlens_q: torch.Tensor,  # [B + 1] int32
    *,
    scale: float | None = None,  # default 1 / sqrt(D)
    out: torch.Tensor | None = None,  # [T, H, D], query's dtype
    backend: str | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
) -> torch.Tensor:  # [T, H, D]
    """Causal (bottom-right) varlen attention of packed queries over a paged KV cache.

    Rows of ``out`` that belong to no sequence (past ``cu_seqlens_q[-1]``) are not written;
    a freshly allocated ``out`` has zeros there.
    """
    chosen = resolve_backend(_device_of("query", query), backend, dtype=query.dtype, head_dim=query.shape[-1])
    check_paged_attention_args(
        query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q, scale, out, chosen
    )
    if scale is None:
        scale = query.shape[2] ** -0.5
    if chosen == "torch":
        return reference.paged_attention(
            query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q, scale=scale, out=out
        )
    if chosen == "cpu":
        from pagedkv.kernels import cpu

        return cpu.paged_attention(
            query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q, scale=float(scale), out=out
        )
    if out is None:
        out = torch.zeros_like(query)
    if max_seqlen_q is None and query.device.type == "cpu" and cu_seqlens_q.numel() > 1:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())  # free on the CPU
    return _triton_module("triton_attention").paged_attention(
        query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q,
        scale=float(scale), out=out, max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
    )


def _device_of(name: str, tensor: object) -> torch.device:
    if not isinstance(tensor, torch.Tensor):
        raise InvalidArgumentError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    return tensor.device
