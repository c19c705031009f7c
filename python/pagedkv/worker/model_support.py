"""Can pagedkv serve this model correctly? Checks at load time, never wrong output later.

pagedkv's attention is plain causal softmax attention over a paged KV cache with grouped-query
heads and one scaling factor. A model is served only if every one of its layers is exactly
that. Two complementary checks:

1. :func:`check_config` (before the weights load): features visible in the config that the
   kernels do not implement: encoder-decoder / cross-attention, ALiBi, attention logit
   soft-capping, chunked attention, non-attention or hybrid layers (``layer_types``), and a
   sliding window that is smaller than the context the runner will serve.
2. :func:`check_probe` (after loading, on a forward of a few tokens through a recording
   attention function): every layer must call the registered attention function exactly once,
   with self-attention shapes (keys = queries = the fed tokens), equal query/key/value head
   dims, a KV head count dividing the query head count, no mask of its own, and none of the
   extra arguments that change the attention math (``sliding_window`` within the context,
   ``softcap``, sinks, ``is_causal=False``). Models whose code does not use transformers'
   ``AttentionInterface`` at all are caught here too: the function is never called.
"""

from __future__ import annotations

from typing import Any

from pagedkv.config import KVGeometry, kv_dtype_info
from pagedkv.errors import UnsupportedModelError
from pagedkv.worker.attention_backend import AttentionCall

__all__ = ["check_config", "check_probe", "context_length_of"]


def context_length_of(config: Any) -> int | None:
    """The longest context the config declares (``max_position_embeddings`` or an alias)."""
    for name in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_config(config: Any, max_model_len: int) -> None:
    """Raise ``UnsupportedModelError`` for config-visible features pagedkv cannot serve.

    ``config`` is the text (decoder) config; ``max_model_len`` the longest sequence the
    runner will serve (a sliding window at least that long never slides).
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
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise refuse("attention logit soft-capping is not implemented by the paged-attention kernels")
    if getattr(config, "attention_chunk_size", None) is not None:
        raise refuse("chunked (local) attention is not implemented by the paged-attention kernels")

    layer_types = getattr(config, "layer_types", None)
    sliding_window = getattr(config, "sliding_window", None)
    if getattr(config, "use_sliding_window", True) is False:
        sliding_window = None
    if layer_types is not None:
        others = sorted({t for t in layer_types if t not in ("full_attention", "sliding_attention")})
        if others:
            raise refuse(
                f"it has layers that are not full attention ({', '.join(others)}): hybrid and "
                "non-attention layers need state the paged KV cache does not hold"
            )
        if "sliding_attention" not in layer_types:
            sliding_window = None
    if isinstance(sliding_window, int) and sliding_window < max_model_len:
        raise refuse(
            f"sliding-window attention (window {sliding_window}) is in use for contexts up to "
            f"max_model_len={max_model_len}; pass max_model_len <= {sliding_window} to serve it "
            "with full attention (identical results within the window)"
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
            if key == "sliding_window" and isinstance(value, int) and value >= max_model_len:
                continue  # the window covers the whole context: full attention
            if key == "is_causal" and value is True:
                continue
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


def _get(obj: Any, key: str, default: Any) -> Any:
    if isinstance(obj, dict):
        return obj.get(key, default)
    return getattr(obj, key, default)
