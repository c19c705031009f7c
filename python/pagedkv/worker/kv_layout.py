"""Where each layer's KV lives: KV cache groups (docs/architecture.md, "Attention types").

Layers are grouped by what they attend to: full attention, a sliding window ``w``, chunks of
``C`` (a window or chunk at least ``max_model_len`` long limits nothing: full). The KV cache is
one pool of equal pages; a page holds ``N`` layers of one block (``N`` = the greatest common
divisor of the groups' layer counts, so no page slot is padding), and a group of ``L`` layers
takes ``L / N`` *columns*: one block table per column per sequence, kept by the Rust core
(``SchedulerConfig(attention_spans=...)``), which gives back a sliding or chunked column's
blocks behind every future query.

The runner's cache is ``[N, 2, pages, block_size, Hkv, D]``. The ``i``-th layer of a group (in
layer order) reads page slot ``i % N`` through column ``first_column + i // N`` of its group.
With one group (or groups off) ``N`` is the number of layers and there is one column: the
layout every model had before groups.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from pagedkv.kernels.layer_attention import LayerAttention

__all__ = ["KVLayout", "Span"]

# One column's span as the Rust core takes it: ("full", None), ("sliding_window", w),
# ("chunked_local", C).
Span = tuple[str, int | None]
_SPAN_NAMES = {"full": "full", "sliding_window": "sliding window", "chunked_local": "chunked"}


@dataclass(frozen=True)
class KVLayout:
    """The page geometry and each layer's place in it."""

    page_layers: int  # N: layers one page holds
    columns: tuple[Span, ...]  # one span per column, column 0 first (a full one when any)
    layer_slot: tuple[int, ...]  # per layer: its slot in a page, 0 .. N-1
    layer_column: tuple[int, ...]  # per layer: the column whose table it reads

    @property
    def num_columns(self) -> int:
        return len(self.columns)

    @property
    def grouped(self) -> bool:
        return self.num_columns > 1 or self.columns[0] != ("full", None)

    @classmethod
    def whole(cls, num_layers: int) -> KVLayout:
        """Every layer in one full column: pages of all the layers."""
        return cls(num_layers, (("full", None),), tuple(range(num_layers)), (0,) * num_layers)

    @classmethod
    def of_layers(cls, layers: Sequence[LayerAttention], max_model_len: int) -> KVLayout | str:
        """The groups of ``layers``, or the reason they cannot be columns (a string)."""
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
        # Groups in first-seen order, full attention first (column 0's hashes are the ones KV
        # events report).
        order = sorted(dict.fromkeys(spans), key=lambda s: s != ("full", None))
        members = {span: [i for i, s in enumerate(spans) if s == span] for span in order}
        per_page = math.gcd(*(len(m) for m in members.values()))
        columns: list[Span] = []
        slot = [0] * len(layers)
        column = [0] * len(layers)
        for span in order:
            first = len(columns)
            for k, layer_index in enumerate(members[span]):
                slot[layer_index] = k % per_page
                column[layer_index] = first + k // per_page
            columns.extend([span] * (len(members[span]) // per_page))
        return cls(per_page, tuple(columns), tuple(slot), tuple(column))

    def column_names(self) -> list[str]:
        """Each column's span in words: ``['full', 'sliding window 512', ...]``."""
        return [_SPAN_NAMES[kind] + ("" if size is None else f" {size}") for kind, size in self.columns]

    def describe(self) -> str:
        """``'1 full + 5 sliding window 512 columns, pages of 3 layers'``."""
        counts: dict[Span, int] = {}
        for span in self.columns:
            counts[span] = counts.get(span, 0) + 1
        parts = [f"{n} {_SPAN_NAMES[kind]}{'' if size is None else f' {size}'}" for (kind, size), n in counts.items()]
        return f"{' + '.join(parts)} column{'s' if self.num_columns > 1 else ''}, pages of {self.page_layers} layers"
