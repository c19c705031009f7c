"""Where each layer's KV lives: KV cache groups (docs/kernels.md, "Attention types").

Layers are sorted by what they attend to (their span): full attention, a sliding window ``w``,
chunks of ``C`` (a window or chunk at least ``max_model_len`` long limits nothing: full). The KV
cache is one pool of equal pages; a page holds ``N`` layers of one block (``N`` = the greatest
common divisor of the spans' layer counts, so no page slot is padding), and the ``L`` layers of
one span make ``L / N`` *KV cache groups*: one block table per group per sequence, kept by the
Rust core (``SchedulerConfig(attention_spans=...)``), which gives back a sliding or chunked
group's blocks behind every future query.

The runner's cache is ``[N, 2, pages, block_size, Hkv, D]``. The ``i``-th layer of a span (in
layer order) reads page slot ``i % N`` through KV cache group ``first + i // N``, ``first``
being the span's first group. With one span (or groups off) ``N`` is the number of layers and
there is one group: every layer whole.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from pagedkv.kernels.layer_attention import LayerAttention

__all__ = ["KVLayout", "Span"]

# One KV cache group's span as the Rust core takes it: ("full", None), ("sliding_window", w),
# ("chunked_local", C).
Span = tuple[str, int | None]
_SPAN_NAMES = {"full": "full", "sliding_window": "sliding window", "chunked_local": "chunked"}


@dataclass(frozen=True)
class KVLayout:
    """The page geometry and each layer's place in it."""

    page_layers: int  # N: layers one page holds
    kv_groups: tuple[Span, ...]  # one span per KV cache group, group 0 first (a full one when any)
    layer_slot: tuple[int, ...]  # per layer: its slot in a page, 0 .. N-1
    layer_kv_group: tuple[int, ...]  # per layer: the KV cache group whose table it reads

    @property
    def num_kv_groups(self) -> int:
        return len(self.kv_groups)

    @property
    def grouped(self) -> bool:
        return self.num_kv_groups > 1 or self.kv_groups[0] != ("full", None)

    @classmethod
    def whole(cls, num_layers: int) -> KVLayout:
        """Every layer in one full KV cache group: pages of all the layers."""
        return cls(num_layers, (("full", None),), tuple(range(num_layers)), (0,) * num_layers)

    @classmethod
    def of_layers(cls, layers: Sequence[LayerAttention], max_model_len: int) -> KVLayout | str:
        """The KV cache groups of ``layers``, or the reason they cannot have groups (a string)."""
        spans: list[Span] = []
        for layer in layers:
            window = (
                layer.sliding_window
                if layer.sliding_window is not None and layer.sliding_window < max_model_len
                else None
            )
            chunk = layer.chunk_size if layer.chunk_size is not None and layer.chunk_size < max_model_len else None
            if window is not None and chunk is not None:
                return "a layer with both a sliding window and chunks"
            spans.append(
                ("sliding_window", window)
                if window is not None
                else ("chunked_local", chunk)
                if chunk is not None
                else ("full", None)
            )
        # Spans in first-seen order, full attention first (group 0's hashes are the ones KV
        # events report).
        order = sorted(dict.fromkeys(spans), key=lambda s: s != ("full", None))
        members = {span: [i for i, s in enumerate(spans) if s == span] for span in order}
        per_page = math.gcd(*(len(m) for m in members.values()))
        groups: list[Span] = []
        slot = [0] * len(layers)
        group = [0] * len(layers)
        for span in order:
            first = len(groups)
            for k, layer_index in enumerate(members[span]):
                slot[layer_index] = k % per_page
                group[layer_index] = first + k // per_page
            groups.extend([span] * (len(members[span]) // per_page))
        return cls(per_page, tuple(groups), tuple(slot), tuple(group))

    def kv_group_names(self) -> list[str]:
        """Each KV cache group's span in words: ``['full', 'sliding window 512', ...]``."""
        return [_SPAN_NAMES[kind] + ("" if size is None else f" {size}") for kind, size in self.kv_groups]

    def describe(self) -> str:
        """``'1 full + 5 sliding window 512 KV cache groups, pages of 3 layers'``."""
        counts: dict[Span, int] = {}
        for span in self.kv_groups:
            counts[span] = counts.get(span, 0) + 1
        parts = [f"{n} {_SPAN_NAMES[kind]}{'' if size is None else f' {size}'}" for (kind, size), n in counts.items()]
        return f"{' + '.join(parts)} KV cache group{'s' if self.num_kv_groups > 1 else ''}, pages of {self.page_layers} layers"
