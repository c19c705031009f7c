"""How much KV a model with sliding-window or chunked layers really needs.

A layer with a sliding window ``w`` never again reads a key more than ``w - 1`` positions behind
the newest query; a chunked layer of size ``C`` never reads behind its chunk's start. A cache
that groups layers by what they see (KV cache groups) holds, per sequence, each group's
visible blocks only; a cache that keeps every layer whole holds the whole history in all of
them. This module counts both, and a third layout, vLLM's rule, without any model or torch:

* ``whole``: every layer holds every block of the sequence.
* ``groups``: pagedkv's layout. One pool of equal pages; a page holds ``N`` layers of one
  block, with ``N`` the greatest common divisor of the groups' layer counts, so a group of
  ``L`` layers takes ``L / N`` pages per block it holds and no page slot is padding.
* ``vllm``: vLLM's hybrid allocator rule. A page holds ``N`` layers with ``N`` the smallest
  group's layer count; a group of ``L`` layers is split into ``ceil(L / N)`` groups of ``N``,
  the last padded, each holding its own pages.

Blocks held by a group for a sequence whose next token is at position ``T`` (the block of that
token's slot included): full attention ``T // b + 1``; a window ``w`` the blocks from the one
holding ``max(0, T - w + 1)``; a chunk ``C`` the blocks from the one holding ``T // C * C``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pagedkv.attention_span import first_visible

__all__ = [
    "LAYOUTS",
    "AttentionGroup",
    "ModelKV",
    "blocks_held",
    "bytes_per_page",
    "bytes_per_sequence",
    "groups_of_layer_types",
    "kv_group_spans",
    "model_kv_of_config",
    "page_layers",
]

LAYOUTS = ("whole", "groups", "vllm")


@dataclass(frozen=True)
class AttentionGroup:
    """Layers that see the same keys: full attention, or a sliding window, or a chunk."""

    num_layers: int
    sliding_window: int | None = None
    chunk_size: int | None = None

    @property
    def kind(self) -> str:
        if self.sliding_window is not None:
            return f"sliding {self.sliding_window}"
        if self.chunk_size is not None:
            return f"chunked {self.chunk_size}"
        return "full"

    def first_visible(self, position: int) -> int:
        """The lowest key position the query at ``position`` sees."""
        return first_visible(position, self.sliding_window, self.chunk_size)


@dataclass(frozen=True)
class ModelKV:
    """A model's KV shape: its groups and the bytes one layer stores per token (K and V)."""

    name: str
    groups: tuple[AttentionGroup, ...]
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int = 2  # bfloat16

    @property
    def num_layers(self) -> int:
        return sum(g.num_layers for g in self.groups)

    @property
    def bytes_per_layer_token(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim * self.dtype_bytes


def groups_of_layer_types(
    layer_types: list[str], *, sliding_window: int | None = None, chunk_size: int | None = None
) -> tuple[AttentionGroup, ...]:
    """Groups from a config's ``layer_types`` (``full_attention`` / ``sliding_attention`` /
    ``chunked_attention``), in first-seen order."""
    counts: dict[str, int] = {}
    for layer_type in layer_types:
        if layer_type not in ("full_attention", "sliding_attention", "chunked_attention"):
            raise ValueError(f"unknown layer type {layer_type!r}")
        counts[layer_type] = counts.get(layer_type, 0) + 1
    return tuple(
        AttentionGroup(
            n,
            sliding_window=sliding_window if kind == "sliding_attention" else None,
            chunk_size=chunk_size if kind == "chunked_attention" else None,
        )
        for kind, n in counts.items()
    )


def model_kv_of_config(name: str, config: dict) -> ModelKV:
    """A published config's KV shape (the fields of a transformers text config, as a dict):
    ``layer_types`` decide the groups; without them every layer slides when ``sliding_window``
    is set (and ``use_sliding_window`` is not False), else every layer is full."""
    window = config.get("sliding_window")
    if config.get("use_sliding_window") is False:
        window = None
    layer_types = config.get("layer_types")
    num_layers = config["num_hidden_layers"]
    if layer_types is not None:
        if len(layer_types) != num_layers:
            raise ValueError(f"{name}: {len(layer_types)} layer_types for {num_layers} layers")
        groups = groups_of_layer_types(
            layer_types, sliding_window=window, chunk_size=config.get("attention_chunk_size")
        )
    else:
        groups = (AttentionGroup(num_layers, sliding_window=window),)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return ModelKV(name, groups, num_kv_heads=config["num_key_value_heads"], head_dim=head_dim)


def page_layers(model: ModelKV, layout: str) -> int:
    """Layers one page holds: all of them (``whole``), the gcd of the groups' layer counts
    (``groups``) or the smallest group's count (``vllm``)."""
    counts = [g.num_layers for g in model.groups]
    if layout == "whole":
        return model.num_layers
    if layout == "groups":
        return math.gcd(*counts)
    if layout == "vllm":
        return min(counts)
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def kv_group_spans(model: ModelKV, layout: str = "groups") -> tuple[tuple[str, int | None], ...]:
    """The KV cache groups of ``layout`` (``whole`` or ``groups``) as the Rust core's
    ``SchedulerConfig(attention_spans=...)`` takes them: one ``(kind, size)`` per KV cache
    group (one block table, ``page_layers`` layers per page), an ``AttentionGroup`` of ``L``
    layers taking ``L / page_layers`` of them, full attention first (KV cache group 0's hashes
    are the ones KV events report)."""
    if layout == "whole":
        return (("full", None),)
    if layout != "groups":
        raise ValueError(f"the Rust core takes the 'whole' or 'groups' layout, got {layout!r}")
    per_page = page_layers(model, layout)
    spans: list[tuple[str, int | None]] = []
    for group in sorted(model.groups, key=lambda g: g.sliding_window is not None or g.chunk_size is not None):
        if group.sliding_window is not None and group.chunk_size is not None:
            raise ValueError("a group with both a window and a chunk is not a KV cache group the core knows")
        span: tuple[str, int | None] = (
            ("sliding_window", group.sliding_window)
            if group.sliding_window is not None
            else ("chunked_local", group.chunk_size)
            if group.chunk_size is not None
            else ("full", None)
        )
        spans.extend([span] * (group.num_layers // per_page))
    return tuple(spans)


def bytes_per_page(model: ModelKV, layout: str, block_size: int = 16) -> int:
    """Bytes of one page of ``layout``: ``page_layers`` layers of one block."""
    return page_layers(model, layout) * model.bytes_per_layer_token * block_size


def blocks_held(group: AttentionGroup, next_position: int, block_size: int) -> int:
    """Blocks one sequence holds in ``group`` when its next token is at ``next_position``."""
    return next_position // block_size - group.first_visible(next_position) // block_size + 1


def bytes_per_sequence(model: ModelKV, context: int, layout: str, block_size: int = 16) -> int:
    """KV bytes one sequence of ``context`` tokens holds (its next token's block included)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    layer_block = model.bytes_per_layer_token * block_size
    if layout == "whole":
        return model.num_layers * (context // block_size + 1) * layer_block
    if layout == "groups":
        return sum(g.num_layers * blocks_held(g, context, block_size) for g in model.groups) * layer_block
    per_page = page_layers(model, "vllm")
    return (
        sum(math.ceil(g.num_layers / per_page) * per_page * blocks_held(g, context, block_size) for g in model.groups)
        * layer_block
    )
