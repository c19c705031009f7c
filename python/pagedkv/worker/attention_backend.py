"""pagedkv's attention inside transformers models: registration, step context, probing.

transformers (>= 4.56, checked on 5.x) looks the attention function up by name in
``AttentionInterface`` on every layer call, passing the layer module (with ``layer_idx``),
query/key/value as ``[batch, heads, tokens, head_dim]`` after RoPE, the attention mask, the
``scaling`` factor, and every extra keyword argument given to the model's ``forward``.
pagedkv registers one function under the name ``"pagedkv"`` and passes the whole step's
metadata as one keyword argument, ``pagedkv_context`` (a :class:`PagedAttentionContext`): the
model code forwards it untouched to every layer, so nothing is stored in globals and several
runners can coexist in one process.

The context holds the runner's :class:`pagedkv.kernels.AttentionBackend` (resolved once, when
the runner is built) and the step's :class:`pagedkv.kernels.AttentionMetadata` (index tensors
converted, validated and summarised once per step, by the runner). The batch is packed into one
sequence (``batch = 1``, ``T`` tokens, ``position_ids`` carrying each token's real position for
RoPE); per layer the attention function

1. writes the new K/V into layer ``module.layer_idx``'s paged cache (``backend.store_kv``), then
2. attends over the cache (``backend.paged_attention``: varlen, bottom-right causal per
   sequence, with the layer's window, chunk, soft-cap and sinks from ``context.layers``;
   docs/kernels.md, Kernels),

and returns ``[1, T, H, D]`` (the layout transformers reshapes into the output projection).

The mask function registered under the same name returns ``None``: masking is done by
``paged_attention`` from ``cu_seqlens_q`` / ``seq_lens``, so transformers must not build a
``[T, T]`` mask (it would also be wrong: it cannot see the cached prefix).

A *probe* context instead runs plain causal attention over the given tokens and records every
call (layer index, shapes, extra arguments such as ``sliding_window``); the runner uses it at
load time to check that a model really routes all its attention through this function.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from pagedkv.kernels import AttentionBackend, AttentionMetadata, KVScales
from pagedkv.kernels.layer_attention import FULL_ATTENTION, LayerAttention

__all__ = [
    "ATTENTION_NAME",
    "CONTEXT_KWARG",
    "AttentionCall",
    "PagedAttentionContext",
    "ProbeContext",
    "ProfileContext",
    "pagedkv_attention_forward",
    "register_pagedkv_attention",
]

ATTENTION_NAME = "pagedkv"
CONTEXT_KWARG = "pagedkv_context"


@dataclass
class PagedAttentionContext:
    """One step's attention state, shared by all layers."""

    backend: AttentionBackend
    # Per layer (index = module.layer_idx): (key_cache, value_cache), each
    # [num_blocks, block_size, num_kv_heads, head_dim].
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    metadata: AttentionMetadata
    # Per layer: the scales of a quantized cache (int8 / float8 data); None for a float cache.
    kv_scales: list[KVScales] | None = None
    # Per layer: its window, chunk, soft-cap and sinks; None: every layer plain causal.
    layers: list[LayerAttention] | None = None
    # KV cache groups (worker/kv_layout.py): one metadata per group (its block tables and
    # slots) and, per layer, the group it reads; None: one group, ``metadata``.
    group_metadata: list[AttentionMetadata] | None = None
    layer_kv_groups: Sequence[int] | None = None


@dataclass
class AttentionCall:
    """What one attention call of a probe forward looked like."""

    layer_idx: int | None
    query_shape: tuple[int, ...]
    key_shape: tuple[int, ...]
    value_shape: tuple[int, ...]
    scaling: float | None
    has_mask: bool
    # Extra keyword arguments that change the attention math (sliding_window, softcap, ...).
    extras: dict[str, Any]


@dataclass
class ProbeContext:
    """Runs plain causal attention over one unpadded sequence and records every call."""

    calls: list[AttentionCall] = field(default_factory=list)


@dataclass
class ProfileContext:
    """Skips attention entirely (returns uninitialized output): for memory profiling only."""


# Keyword arguments some models pass to the attention function that pagedkv's kernels do not
# implement; a probe records them, and the runner refuses the model if one is active.
_MATH_CHANGING_KWARGS = ("sliding_window", "softcap", "s_aux", "sinks", "is_causal", "attention_chunk_size")


def pagedkv_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, H, T, D]
    key: torch.Tensor,  # [1, Hkv, T, D]
    value: torch.Tensor,  # [1, Hkv, T, D]
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:  # ([1, T, H, D], no weights)
    """The function registered as ``"pagedkv"`` in transformers' ``AttentionInterface``."""
    context = kwargs.get(CONTEXT_KWARG)
    if isinstance(context, PagedAttentionContext):
        q = query[0].transpose(0, 1)  # [T, H, D] (a view; the kernels take strides)
        k = key[0].transpose(0, 1)  # [T, Hkv, D]
        v = value[0].transpose(0, 1)
        layer: int = module.layer_idx  # type: ignore[assignment]
        key_cache, value_cache = context.kv_caches[layer]
        scales = context.kv_scales[layer] if context.kv_scales is not None else None
        variant = context.layers[layer] if context.layers is not None else FULL_ATTENTION
        metadata = context.metadata
        if context.group_metadata is not None and context.layer_kv_groups is not None:
            metadata = context.group_metadata[context.layer_kv_groups[layer]]
        context.backend.store_kv(k, v, key_cache, value_cache, metadata, scales)
        out = context.backend.paged_attention(
            q, key_cache, value_cache, metadata, scale=scaling, kv_scales=scales, layer=variant
        )
        return out.unsqueeze(0), None
    if isinstance(context, ProbeContext):
        return _probe_attention(context, module, query, key, value, attention_mask, scaling, kwargs)
    if isinstance(context, ProfileContext):
        return query.new_empty(query.shape[0], query.shape[2], query.shape[1], value.shape[3]), None
    raise RuntimeError(
        f"the '{ATTENTION_NAME}' attention implementation needs the step metadata: run the model "
        f"through pagedkv.worker.model_runner.ModelRunner (keyword argument {CONTEXT_KWARG!r} missing)"
    )


def _probe_attention(
    context: ProbeContext,
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, H, T, D]
    key: torch.Tensor,  # [1, Hkv, Tk, D]
    value: torch.Tensor,  # [1, Hkv, Tk, Dv]
    attention_mask: torch.Tensor | None,
    scaling: float | None,
    kwargs: dict[str, Any],
) -> tuple[torch.Tensor, None]:
    extras = {name: kwargs[name] for name in _MATH_CHANGING_KWARGS if kwargs.get(name) is not None}
    for attribute in ("sinks", "sliding_window"):
        if getattr(module, attribute, None) is not None and attribute not in extras:
            extras[attribute] = getattr(module, attribute)
    if getattr(module, "is_causal", True) is False and "is_causal" not in extras:
        extras["is_causal"] = False
    context.calls.append(
        AttentionCall(
            layer_idx=getattr(module, "layer_idx", None),
            query_shape=tuple(query.shape),
            key_shape=tuple(key.shape),
            value_shape=tuple(value.shape),
            scaling=scaling,
            has_mask=attention_mask is not None,
            extras=extras,
        )
    )
    # Any well-shaped output lets the forward go on; plain causal attention keeps the
    # activations realistic for the layers after this one.
    groups = query.shape[1] // max(key.shape[1], 1)
    if groups * key.shape[1] == query.shape[1] and key.shape[2] == query.shape[2] and key.shape[3] == query.shape[3]:
        k = key.repeat_interleave(groups, dim=1)
        v = value.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(query, k, v, is_causal=True, scale=scaling)
    else:
        out = query.new_zeros(query.shape[0], query.shape[1], query.shape[2], value.shape[3])
    return out.transpose(1, 2), None


@functools.cache
def register_pagedkv_attention() -> str:
    """Register the attention function with transformers (idempotent); return the name.

    No mask function is registered, on purpose: ``paged_attention`` masks from the step
    metadata, and transformers skips building masks (its packed-sequence detection over
    ``position_ids`` included, a few torch ops per step, and guards on the token count in a
    compiled forward) for an attention name its mask interface does not know."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, pagedkv_attention_forward)
    return ATTENTION_NAME
