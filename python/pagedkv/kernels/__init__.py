"""Paged KV cache kernels: write new K/V into the cache, attend over it.

Public API (same signatures for every backend)::

    store_kv(key, value, key_cache, value_cache, slot_mapping, *, kv_scales=None, backend=None) -> None
    paged_attention(query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q,
                    *, scale=None, out=None, kv_scales=None, backend=None,
                    max_seqlen_q=None, max_seqlen_k=None) -> Tensor

Quantized caches (:mod:`.kv_quant`): an ``int8`` / ``float8_e4m3fn`` / ``float8_e5m2`` cache
comes with its :class:`KVScales` (a bfloat16 scale per (token, KV head), same slots as the
data). ``store_kv`` quantizes the new vectors and writes data and scales; every backend's
attention reads the quantized blocks and dequantizes on load. With ``kv_scales.key_rotation``,
keys are stored rotated and queries rotated to match, here, before any backend runs. A
quantized cache without
``kv_scales`` (or scales for a float cache) is an InvalidArgumentError.

Backends:

* ``triton``: the Triton kernels (:mod:`.triton_store`, :mod:`.triton_attention`). Runs on
  CUDA tensors, and on CPU tensors when ``TRITON_INTERPRET=1`` was set before the kernels were
  imported (how the CPU tests run them).
* ``cpu``: :mod:`.cpu`, decode rows in Rust straight from the paged cache (float32 queries;
  float32, int8 or float8 caches), prefill and extend rows through the torch path: the CPU
  production path.
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

A serving loop calls the kernels once per layer with the same step metadata; it uses an
:class:`AttentionBackend` instead (``get_backend``: the backend resolved once)::

    backend = get_backend(device, name, dtype=..., head_dim=...)
    meta = backend.prepare(slot_mapping, block_tables, seq_lens, cu_seqlens_q,
                           num_tokens=T, key_cache=..., value_cache=..., dtype=...)  # once per step
    backend.store_kv(key, value, key_cache, value_cache, meta)                     # per layer
    backend.paged_attention(query, key_cache, value_cache, meta, scale=..., out=None)

``prepare`` validates the step's index tensors once (shapes and dtypes; values too when they
are given on the host, as the runner does before the upload), moves them to the caches' device
(contiguous) and records the host facts every layer would otherwise recompute
(:class:`AttentionMetadata`); the per-layer methods check only shapes and dtypes of the layer's
own tensors.

There is one execution path: the module-level ``store_kv`` / ``paged_attention`` validate their
whole call, then run through the same :class:`AttentionBackend` methods the serving loop uses
(``paged_attention`` on metadata built for the call), so a backend or an argument (such as
``layer``) is dispatched in one place.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
import torch

from pagedkv.errors import ConfigError, InvalidArgumentError
from pagedkv.kernels import reference, validation
from pagedkv.kernels.kv_quant import KVScales, rotate
from pagedkv.kernels.layer_attention import FULL_ATTENTION, LayerAttention
from pagedkv.kernels.validation import TRITON_DTYPES, TRITON_HEAD_DIMS

__all__ = [
    "BACKEND_ENV_VAR",
    "BACKENDS",
    "AttentionBackend",
    "AttentionMetadata",
    "KVScales",
    "LayerAttention",
    "get_backend",
    "resolve_backend",
    "store_kv",
    "paged_attention",
]

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
    kv_scales: KVScales | None = None,  # a quantized cache's scales
    backend: str | None = None,
) -> None:
    """Write token ``t``'s K and V into cache slot ``slot_mapping[t]`` (in place); into a
    quantized cache as data plus scale."""
    chosen = resolve_backend(_device_of("key", key), backend, dtype=key.dtype, head_dim=key.shape[-1])
    validation.check_store_kv_args(key, value, key_cache, value_cache, slot_mapping, chosen, kv_scales)
    AttentionBackend(chosen)._store(key, value, key_cache, value_cache, slot_mapping, kv_scales)


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
    kv_scales: KVScales | None = None,  # a quantized cache's scales
    backend: str | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    layer: LayerAttention = FULL_ATTENTION,  # sliding window, chunk, soft-cap, sinks
) -> torch.Tensor:  # [T, H, D]
    """Causal (bottom-right) varlen attention of packed queries over a paged KV cache, with
    the layer's window, chunk, soft-cap and sinks (:class:`LayerAttention`; default none).

    Rows of ``out`` that belong to no sequence (past ``cu_seqlens_q[-1]``) are not written;
    a freshly allocated ``out`` has zeros there.
    """
    chosen = resolve_backend(_device_of("query", query), backend, dtype=query.dtype, head_dim=query.shape[-1])
    validation.check_paged_attention_args(
        query, key_cache, value_cache, block_tables, seq_lens, cu_seqlens_q, scale, out, chosen, kv_scales, layer
    )
    # The one execution path of the serving loop (AttentionBackend), on metadata for this call.
    attention = AttentionBackend(chosen)
    meta = attention._metadata(
        None,
        block_tables,
        seq_lens,
        cu_seqlens_q,
        num_tokens=query.shape[0],
        key_cache=key_cache,
        dtype=query.dtype,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=max_seqlen_k,
    )
    return attention._attend(query, key_cache, value_cache, meta, scale, out, kv_scales, layer)


@dataclass(frozen=True, eq=False)
class AttentionMetadata:
    """One step's attention metadata, shared by every layer: converted and checked once.

    Built by :meth:`AttentionBackend.prepare`. The tensors are on the caches' device, contiguous,
    in the kernels' dtypes. The host facts are None when the index tensors were handed over
    already on a GPU (reading them there would sync).
    """

    backend: str
    slot_mapping: torch.Tensor | None  # [T] int64, -1 = do not store the token; None: attention only
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32, KV tokens per sequence including the new ones
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    num_tokens: int  # T, query rows of the step
    cache_shape: torch.Size  # [num_blocks, block_size, num_kv_heads, head_dim] of every layer's cache
    cache_dtype: torch.dtype
    dtype: torch.dtype  # the layers' query / key / value dtype
    device: torch.device
    # Host facts: longest query chunk and context (Triton launch hints), sequences with one
    # query row (decodes) and with several (prefill chunks / extends), the index arrays as lists.
    max_seqlen_q: int | None = None
    max_seqlen_k: int | None = None
    num_decodes: int | None = None
    num_extends: int | None = None
    host_cu_seqlens_q: list[int] | None = None
    host_seq_lens: list[int] | None = None
    # torch path of store_kv when some slot is -1: the rows to store and their slots (int64).
    store_rows: torch.Tensor | None = None
    store_slots: torch.Tensor | None = None
    # cpu backend: block_tables, seq_lens, cu_seqlens_q as the Rust decode kernel reads them,
    # numpy arrays: every sequence of up to CPU_KERNEL_MAX_QUERY query rows as that many
    # one-row sequences (row j of a sequence of L tokens with q new ones sees L - q + 1 + j
    # tokens: causal), since its KV is stored before any layer attends; speculative rows and
    # short chunks then skip the torch path's gather. cpu_long_rows: the (original) sequences
    # with more query rows, for the torch path.
    cpu_views: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
    cpu_long_rows: list[int] | None = None
    cpu_num_kernel_rows: int = 0  # one-row sequences in cpu_views


# Sequences with at most this many query rows (a decode with up to 16 drafts) go to the CPU
# decode kernel as one-row sequences (AttentionMetadata.cpu_views).
CPU_KERNEL_MAX_QUERY = 17


def _cpu_kernel_rows(tables: torch.Tensor, cu: list[int], lens: list[int]) -> dict[str, Any]:
    """``cpu_views`` and ``cpu_long_rows`` (see :class:`AttentionMetadata`)."""
    q_lens = [cu[b + 1] - cu[b] for b in range(len(lens))]
    table_array = tables.numpy()
    if all(q == 1 for q in q_lens):
        # Only decodes (the common step): the arrays as they are, no copy.
        views = (table_array, np.asarray(lens, dtype=np.int32), np.asarray(cu, dtype=np.int32))
        return {"cpu_views": views, "cpu_long_rows": [], "cpu_num_kernel_rows": len(lens)}
    rows: list[int] = []
    view_lens: list[int] = []
    spans: list[int] = []
    long_rows: list[int] = []
    for b, q in enumerate(q_lens):
        if q > CPU_KERNEL_MAX_QUERY:
            # Kept whole (the kernel skips a sequence of several query rows): the torch path's.
            long_rows.append(b)
            rows.append(b)
            view_lens.append(lens[b])
            spans.append(q)
            continue
        first = lens[b] - q + 1
        rows.extend([b] * q)
        view_lens.extend(range(first, first + q))
        spans.extend([1] * q)
    views = (
        np.ascontiguousarray(table_array[rows]),
        np.asarray(view_lens, dtype=np.int32),
        np.concatenate([[0], np.cumsum(spans)]).astype(np.int32),
    )
    return {"cpu_views": views, "cpu_long_rows": long_rows, "cpu_num_kernel_rows": len(rows) - len(long_rows)}


class AttentionBackend:
    """``store_kv`` / ``paged_attention`` of one backend, resolved once, for a serving loop.

    :meth:`prepare` builds and validates a step's :class:`AttentionMetadata` once; the
    per-layer :meth:`store_kv` / :meth:`paged_attention` check only the shapes and dtypes of
    the layer's own tensors against it (no value reductions, no environment lookups).
    """

    def __init__(self, name: str) -> None:
        if name not in ("triton", "cpu", "torch"):
            raise InvalidArgumentError(f"backend must be 'triton', 'cpu' or 'torch', got {name!r}")
        self.name = name

    def __repr__(self) -> str:
        return f"AttentionBackend({self.name!r})"

    def prepare(
        self,
        slot_mapping: torch.Tensor,  # [T] int64
        block_tables: torch.Tensor,  # [B, max_blocks] int32
        seq_lens: torch.Tensor,  # [B] int32
        cu_seqlens_q: torch.Tensor,  # [B + 1] int32
        *,
        num_tokens: int,
        key_cache: torch.Tensor,  # one layer's cache; every layer's has this geometry
        value_cache: torch.Tensor,
        dtype: torch.dtype,  # the layers' query / key / value dtype
        static_bounds: tuple[int, int] | None = None,  # (max_seqlen_q, max_seqlen_k) of a captured graph
    ) -> AttentionMetadata:
        """Validate one step's index tensors (values too when on the host: pass them before the
        upload), move them to the caches' device and record the host facts.

        With ``static_bounds``: the metadata of a captured graph (worker/decode_graphs.py), over
        tensors already on the caches' device whose *contents* change between replays, so no
        host fact is taken from them (the kernels read them on the device) and the launch hints
        are the bounds given. The values they hold now are checked too."""
        validation.check_step_metadata(
            slot_mapping, block_tables, seq_lens, cu_seqlens_q, num_tokens, key_cache, value_cache, dtype, self.name
        )
        bounds: dict[str, Any] = {}
        if static_bounds is not None:
            for name, tensor in (("slot_mapping", slot_mapping), ("block_tables", block_tables)):
                if tensor.device != key_cache.device or not tensor.is_contiguous():
                    raise InvalidArgumentError(f"{name} must be contiguous on {key_cache.device} for a captured step")
            bounds = {"max_seqlen_q": static_bounds[0], "max_seqlen_k": static_bounds[1], "host_facts": False}
        return self._metadata(
            slot_mapping,
            block_tables,
            seq_lens,
            cu_seqlens_q,
            num_tokens=num_tokens,
            key_cache=key_cache,
            dtype=dtype,
            **bounds,
        )

    def store_kv(
        self,
        key: torch.Tensor,  # [T, Hkv, D], any strides
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        kv_scales: KVScales | None = None,  # a quantized cache's scales
    ) -> None:
        """:func:`store_kv` for one layer of the step ``meta`` describes."""
        validation.check_layer_store(key, value, key_cache, value_cache, meta, kv_scales)
        assert meta.slot_mapping is not None, "metadata of a paged_attention call has no slots"
        self._store(
            key,
            value,
            key_cache,
            value_cache,
            meta.slot_mapping,
            kv_scales,
            store_rows=meta.store_rows,
            store_slots=meta.store_slots,
            slots_checked=meta.host_seq_lens is not None,
        )

    def paged_attention(
        self,
        query: torch.Tensor,  # [T, H, D]
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        *,
        scale: float | None = None,
        out: torch.Tensor | None = None,
        kv_scales: KVScales | None = None,  # a quantized cache's scales
        layer: LayerAttention = FULL_ATTENTION,  # sliding window, chunk, soft-cap, sinks
    ) -> torch.Tensor:  # [T, H, D]
        """:func:`paged_attention` for one layer of the step ``meta`` describes."""
        validation.check_layer_attention(query, key_cache, value_cache, meta, scale, out, kv_scales)
        if layer is not FULL_ATTENTION:
            validation.check_layer(layer, query.shape[1])
        return self._attend(query, key_cache, value_cache, meta, scale, out, kv_scales, layer)

    # The execution path, shared with the module-level store_kv / paged_attention: arguments
    # already validated (per step and per layer, or per call).

    def _metadata(
        self,
        slot_mapping: torch.Tensor | None,  # [T] int64; None: attention only (a paged_attention call)
        block_tables: torch.Tensor,  # [B, max_blocks] int32
        seq_lens: torch.Tensor,  # [B] int32
        cu_seqlens_q: torch.Tensor,  # [B + 1] int32
        *,
        num_tokens: int,
        key_cache: torch.Tensor,
        dtype: torch.dtype,
        max_seqlen_q: int | None = None,  # the caller's launch hints win over the host facts
        max_seqlen_k: int | None = None,
        host_facts: bool = True,  # False: none even from host tensors (prepare's static_bounds)
    ) -> AttentionMetadata:
        """The metadata of validated index tensors: moved to the caches' device, host facts
        recorded when the tensors are on the host."""
        device = key_cache.device
        facts: dict[str, Any] = {}
        if host_facts and cu_seqlens_q.device.type == "cpu":
            cu_host, lens_host = cu_seqlens_q.tolist(), seq_lens.tolist()
            q_lens = [cu_host[b + 1] - cu_host[b] for b in range(len(lens_host))]
            facts.update(
                max_seqlen_q=max(q_lens, default=0),
                max_seqlen_k=max(lens_host, default=0),
                num_decodes=q_lens.count(1),
                num_extends=sum(q > 1 for q in q_lens),
                host_cu_seqlens_q=cu_host,
                host_seq_lens=lens_host,
            )
            if (
                self.name != "triton"
                and slot_mapping is not None
                and slot_mapping.numel()
                and int(slot_mapping.min()) < 0
            ):
                rows = (slot_mapping >= 0).nonzero().flatten()
                facts.update(store_rows=rows.to(device), store_slots=slot_mapping[rows].to(device))
        if max_seqlen_q is not None:
            facts["max_seqlen_q"] = max_seqlen_q
        if max_seqlen_k is not None:
            facts["max_seqlen_k"] = max_seqlen_k
        tables, lens, cu = (
            t.to(device, non_blocking=True).contiguous() for t in (block_tables, seq_lens, cu_seqlens_q)
        )
        if self.name == "cpu" and device.type == "cpu" and "host_seq_lens" in facts:
            facts.update(_cpu_kernel_rows(tables, facts["host_cu_seqlens_q"], facts["host_seq_lens"]))
        return AttentionMetadata(
            backend=self.name,
            slot_mapping=None if slot_mapping is None else slot_mapping.to(device, non_blocking=True),
            block_tables=tables,
            seq_lens=lens,
            cu_seqlens_q=cu,
            num_tokens=num_tokens,
            cache_shape=key_cache.shape,
            cache_dtype=key_cache.dtype,
            dtype=dtype,
            device=device,
            **facts,
        )

    def _store(
        self,
        key: torch.Tensor,  # [T, Hkv, D], any strides
        value: torch.Tensor,
        key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [T] int64 on the caches' device, -1 = skip the token
        kv_scales: KVScales | None,
        *,
        store_rows: torch.Tensor | None = None,  # torch path: the rows whose slot is not -1 (int64) ...
        store_slots: torch.Tensor | None = None,  # ... and their slots, when some slot is -1
        slots_checked: bool = False,  # the slots were read on the host: none is -1 unless store_rows says so
    ) -> None:
        if kv_scales is not None:
            key = rotate(key, kv_scales.key_rotation)
        if self.name == "triton":
            _triton_module("triton_store").store_kv(
                key, value, key_cache, value_cache, slot_mapping, kv_scales=kv_scales
            )
        elif store_rows is not None:
            assert store_slots is not None
            reference.write_slots(
                key[store_rows], value[store_rows], key_cache, value_cache, store_slots, kv_scales=kv_scales
            )
        elif slots_checked:
            reference.write_slots(key, value, key_cache, value_cache, slot_mapping, kv_scales=kv_scales)
        else:
            reference.store_kv(key, value, key_cache, value_cache, slot_mapping, kv_scales=kv_scales)

    def _attend(
        self,
        query: torch.Tensor,  # [T, H, D]
        key_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float | None,
        out: torch.Tensor | None,  # [T, H, D], query's dtype
        kv_scales: KVScales | None,
        layer: LayerAttention,
    ) -> torch.Tensor:  # [T, H, D]
        if scale is None:
            scale = query.shape[2] ** -0.5
        if kv_scales is not None:
            query = rotate(query, kv_scales.key_rotation)
        if self.name == "cpu" and meta.cpu_views is not None:
            from pagedkv.kernels import cpu

            return cpu.paged_attention_prepared(
                query, key_cache, value_cache, meta, scale=float(scale), out=out, kv_scales=kv_scales, layer=layer
            )
        if self.name in ("cpu", "torch"):
            if meta.host_cu_seqlens_q is None or meta.host_seq_lens is None:
                return reference.paged_attention(
                    query,
                    key_cache,
                    value_cache,
                    meta.block_tables,
                    meta.seq_lens,
                    meta.cu_seqlens_q,
                    scale=scale,
                    out=out,
                    kv_scales=kv_scales,
                    layer=layer,
                )
            if out is None:
                out = torch.zeros_like(query)
            reference.attend_host(
                query,
                key_cache,
                value_cache,
                meta.block_tables,
                meta.seq_lens,
                meta.host_cu_seqlens_q,
                meta.host_seq_lens,
                scale=scale,
                out=out,
                kv_scales=kv_scales,
                layer=layer,
            )
            return out
        if out is None:
            out = torch.zeros_like(query)
        attended: torch.Tensor = _triton_module("triton_attention").paged_attention(
            query,
            key_cache,
            value_cache,
            meta.block_tables,
            meta.seq_lens,
            meta.cu_seqlens_q,
            scale=float(scale),
            out=out,
            max_seqlen_q=meta.max_seqlen_q,
            max_seqlen_k=meta.max_seqlen_k,
            kv_scales=kv_scales,
            layer=layer,
        )
        return attended


def get_backend(
    device: torch.device,
    backend: str | None = None,
    *,
    dtype: torch.dtype | None = None,
    head_dim: int | None = None,
    cache_dtype: torch.dtype | None = None,
) -> AttentionBackend:
    """The :class:`AttentionBackend` for tensors on ``device`` (:func:`resolve_backend`, read
    once: ``PAGEDKV_ATTENTION_BACKEND`` is not looked at again). With ``dtype`` and
    ``head_dim`` given, a backend that cannot run them (over a cache of ``cache_dtype``, default
    ``dtype``) raises InvalidArgumentError now."""
    name = resolve_backend(device, backend, dtype=dtype, head_dim=head_dim)
    if dtype is not None and head_dim is not None:
        validation.check_backend_supports(name, dtype, head_dim, cache_dtype, device)
    return AttentionBackend(name)


def _device_of(name: str, tensor: object) -> torch.device:
    if not isinstance(tensor, torch.Tensor):
        raise InvalidArgumentError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    return tensor.device
