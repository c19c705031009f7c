"""Can pagedkv serve this model correctly? Checks at load time, never wrong output later.

pagedkv's attention is causal softmax attention over a paged KV cache with grouped-query heads
and one scaling factor, where each layer may add what :class:`pagedkv.kernels.LayerAttention`
describes: a sliding window, chunked local attention, logit soft-capping, attention sinks.
A model is served only if every one of its layers is exactly that. Two complementary checks:

1. :func:`check_config` (before the weights load): features visible in the config that the
   kernels do not implement: encoder-decoder / cross-attention, ALiBi, and non-attention or
   hybrid layers (``layer_types`` other than full, sliding and chunked attention: linear
   attention, Mamba, ...).
2. :func:`check_probe` (after loading, on a forward of a few tokens through a recording
   attention function): every layer must call the registered attention function exactly once,
   with self-attention shapes (keys = queries = the fed tokens), equal query/key/value head
   dims, a KV head count dividing the query head count, no mask of its own, and no extra
   argument that changes the attention math other than those a ``LayerAttention`` carries
   (``sliding_window``, ``softcap``, sinks as ``s_aux`` / ``sinks``). Models whose code does
   not use transformers' ``AttentionInterface`` at all are caught here too: the function is
   never called.

:func:`check_probe` also returns each layer's :class:`~pagedkv.kernels.LayerAttention`. The
config is the authority on masks (transformers builds a layer's mask from ``layer_types`` and
``sliding_window`` / ``attention_chunk_size``; pagedkv's mask function builds none, so the
kernels must apply the same rule); the probe's ``sliding_window`` argument, which models pass
for flash attention, must agree with it. A window at least ``max_model_len`` long never slides
and becomes full attention (identical results, the plain kernels).
"""

from __future__ import annotations

from typing import Any

import torch

from pagedkv.config import KVGeometry, kv_dtype_info
from pagedkv.errors import InvalidArgumentError, InvalidTypeError, UnsupportedModelError
from pagedkv.kernels.layer_attention import FULL_ATTENTION, LayerAttention
from pagedkv.worker.attention_backend import AttentionCall

__all__ = ["check_config", "check_probe", "context_length_of", "layer_attentions"]

# The layer types whose attention LayerAttention describes (config ``layer_types`` values).
_ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")
# Probe extras a LayerAttention carries: the window and the soft-cap; sinks under either name.
_LAYER_EXTRAS = ("sliding_window", "softcap", "s_aux", "sinks")


def context_length_of(config: Any) -> int | None:
    """The longest context the config declares (``max_position_embeddings`` or an alias)."""
    for name in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_config(config: Any, max_model_len: int, max_batched_tokens: int = 0) -> None:
    """Raise ``UnsupportedModelError`` for config-visible features pagedkv cannot serve.

    ``config`` is the text (decoder) config; ``max_model_len`` the longest sequence the
    runner will serve and ``max_batched_tokens`` the most tokens one step packs (together they
    bound the positions Llama 4's temperature tuning sees).
    """
    name = getattr(config, "model_type", type(config).__name__)

    def refuse(reason: str) -> UnsupportedModelError:
        return UnsupportedModelError(f"model type {name!r} is not supported: {reason}")

    if getattr(config, "is_encoder_decoder", False) or getattr(config, "add_cross_attention", False):
        raise refuse("encoder-decoder / cross-attention models are not supported (decoder-only only)")
    if getattr(config, "cross_attention_layers", None):
        raise refuse("it has cross-attention layers")
    attn_config = getattr(config, "attn_config", None)
    if (
        name == "bloom"
        or getattr(config, "alibi", False)
        or getattr(config, "position_embedding_type", None) == "alibi"
        or (attn_config is not None and _get(attn_config, "alibi", False))
    ):
        raise refuse("ALiBi position biases are not implemented by the paged-attention kernels")
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        others = sorted({t for t in layer_types if t not in _ATTENTION_LAYER_TYPES})
        if others:
            raise refuse(
                f"it has layers that are not softmax attention ({', '.join(others)}): hybrid and "
                "non-attention layers need state the paged KV cache does not hold"
            )
    if getattr(config, "attn_temperature_tuning", False) and max(max_model_len, max_batched_tokens) >= getattr(
        config, "floor_scale", 0
    ):
        # Llama 4's no-RoPE layers scale their queries by a function of the position that its
        # code derives from the packed batch's token index, not from position_ids: exact only
        # while every position and every step's token count stays below floor_scale - 1.
        raise refuse(
            f"attention temperature tuning (floor_scale {config.floor_scale}) reads positions that a packed "
            f"batch does not give it; pass max_model_len < {config.floor_scale - 1} (and as many batched tokens)"
        )


def check_probe(
    calls: list[AttentionCall], config: Any, num_probe_tokens: int, max_model_len: int, *, dtype: str = "float32"
) -> KVGeometry:
    """Check the recorded attention calls of a probe forward; return the cache geometry
    (``dtype``: the KV cache's dtype name, e.g. ``"bfloat16"`` or ``"int8"``)."""
    name = getattr(config, "model_type", type(config).__name__)

    def refuse(reason: str) -> UnsupportedModelError:
        return UnsupportedModelError(f"model type {name!r} is not supported: {reason}")

    if not calls:
        raise refuse(
            "its attention layers do not call transformers' AttentionInterface, so pagedkv "
            "cannot route them to the paged KV cache"
        )
    layer_ids = [call.layer_idx for call in calls]
    if any(layer_idx is None for layer_idx in layer_ids):
        raise refuse("its attention modules have no layer_idx to select a layer's KV cache")
    expected_layers = getattr(config, "num_hidden_layers", len(calls))
    if sorted(layer_ids) != list(range(expected_layers)):  # type: ignore[type-var]
        raise refuse(
            f"attention ran for layers {sorted(set(layer_ids))} of {expected_layers} "  # type: ignore[type-var]
            "(hybrid, non-attention or KV-sharing layers are not supported)"
        )
    geometries = set()
    for call in calls:
        _, num_heads, q_len, q_dim = call.query_shape
        _, num_kv_heads, k_len, k_dim = call.key_shape
        v_dim = call.value_shape[3]
        if q_len != num_probe_tokens or k_len != num_probe_tokens:
            raise refuse(
                f"layer {call.layer_idx} attends over {k_len} keys for {q_len} queries of a "
                f"{num_probe_tokens}-token input (cross-attention or extra memory tokens)"
            )
        if not q_dim == k_dim == v_dim:
            raise refuse(
                f"layer {call.layer_idx} has query/key/value head dims {q_dim}/{k_dim}/{v_dim}; "
                "the paged cache needs them equal"
            )
        if num_kv_heads == 0 or num_heads % num_kv_heads:
            raise refuse(f"layer {call.layer_idx}: {num_heads} query heads over {num_kv_heads} KV heads")
        if call.has_mask:
            raise refuse(
                f"layer {call.layer_idx} receives an attention mask of the model's own making, "
                "which paged attention would ignore"
            )
        for key, value in call.extras.items():
            if key in _LAYER_EXTRAS or (key == "is_causal" and value is True):
                continue  # a LayerAttention carries it (layer_attentions)
            raise refuse(
                f"layer {call.layer_idx} uses {key}={value!r}, which the paged-attention kernels do not implement"
            )
        geometries.add((num_heads, num_kv_heads, q_dim))
    if len(geometries) != 1:
        raise refuse(f"its layers have different attention shapes {sorted(geometries)}")
    num_heads, num_kv_heads, head_dim = geometries.pop()
    dtype, dtype_bytes, scale_bytes = kv_dtype_info(dtype)
    return KVGeometry(
        num_layers=len(calls),
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        dtype_bytes=dtype_bytes,
        scale_bytes=scale_bytes,
        num_heads=num_heads,
        source="probe forward",
    )


def layer_attentions(calls: list[AttentionCall], config: Any, max_model_len: int) -> list[LayerAttention]:
    """Each layer's :class:`LayerAttention` (index = layer), from the config and a probe's
    calls (already accepted by :func:`check_probe`).

    The window and the chunk come from the config, as transformers' masks do: a layer whose
    ``layer_types`` entry is ``sliding_attention`` sees the last ``sliding_window`` tokens,
    ``chunked_attention`` its ``attention_chunk_size`` chunk; without ``layer_types``, a
    ``sliding_window`` the layer passes to the attention function (Mistral) is its window. A
    window or chunk of at least ``max_model_len`` never limits anything and is dropped. The
    soft-cap and the sinks are what the layer passes (``softcap``; ``s_aux`` or ``sinks``,
    copied as float32 ``[H]``).
    """
    name = getattr(config, "model_type", type(config).__name__)
    layer_types = getattr(config, "layer_types", None)
    config_window = getattr(config, "sliding_window", None)
    chunk = getattr(config, "attention_chunk_size", None)
    layers: list[LayerAttention] = [FULL_ATTENTION] * len(calls)
    for call in calls:
        index: int = call.layer_idx  # type: ignore[assignment]
        layer_type = layer_types[index] if layer_types is not None else None
        passed_window = call.extras.get("sliding_window")
        window = passed_window
        if layer_type == "sliding_attention":
            window = config_window
            if passed_window is not None and passed_window != config_window:
                raise UnsupportedModelError(
                    f"model type {name!r} is not supported: layer {index} passes sliding_window={passed_window} "
                    f"but its config gives it a window of {config_window}"
                )
        elif layer_type is not None and passed_window is not None and passed_window < max_model_len:
            raise UnsupportedModelError(
                f"model type {name!r} is not supported: layer {index} is {layer_type!r} in the config but "
                f"passes sliding_window={passed_window}"
            )
        elif layer_type is not None:
            window = None
        layer_chunk = chunk if layer_type == "chunked_attention" else None
        sinks = call.extras.get("s_aux", call.extras.get("sinks"))
        try:
            layers[index] = LayerAttention(
                sliding_window=window if window is not None and window < max_model_len else None,
                chunk_size=layer_chunk if layer_chunk is not None and layer_chunk < max_model_len else None,
                logits_soft_cap=call.extras.get("softcap"),
                sinks=None if sinks is None else sinks.detach().to(torch.float32).clone(),
            )
            layers[index].check_heads(call.query_shape[1])
        except (InvalidArgumentError, InvalidTypeError) as exc:
            raise UnsupportedModelError(f"model type {name!r} is not supported: layer {index}: {exc}") from exc
        if layers[index].is_full:  # the kernels' plain path: the singleton they test for by identity
            layers[index] = FULL_ATTENTION
    return layers


def _get(obj: Any, key: str, default: Any) -> Any:
    if isinstance(obj, dict):
        return obj.get(key, default)
    return getattr(obj, key, default)
