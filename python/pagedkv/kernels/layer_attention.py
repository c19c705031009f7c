"""What one layer's attention does besides bottom-right causal masking.

Most models attend every query to the whole context before it. Many popular ones do not, in
some or all layers:

* **sliding window** ``w`` (Mistral, Gemma 2/3, gpt-oss, Cohere 2, ...): the query at
  position ``p`` sees the keys ``k`` with ``p - w < k <= p``, its last ``w`` tokens, itself
  included (transformers' ``sliding_window_overlay``);
* **chunked local** ``C`` (Llama 4): the query sees the keys of its own chunk of ``C``
  positions, ``k // C == p // C`` and ``k <= p`` (transformers' ``chunked_overlay``);
* **logit soft-capping** ``cap`` (Gemma 2, Cohere 2): each scaled score ``s`` becomes
  ``cap * tanh(s / cap)`` before the mask and the softmax;
* **attention sinks** (gpt-oss): one learned logit per query head joins every row's softmax
  and attends to nothing, so a row's weights sum to less than one.

Window and chunk may both be given (the query sees the keys both allow). The keys a query
cannot see begin at :meth:`LayerAttention.first_visible`: the kernels read from the block that
holds it, never the blocks before (a sliding-window KV cache group gives those back).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pagedkv.attention_span import first_visible
from pagedkv.errors import InvalidArgumentError, InvalidTypeError

__all__ = ["FULL_ATTENTION", "LayerAttention", "describe_layers"]


@dataclass(frozen=True, eq=False)
class LayerAttention:
    """One layer's attention variant; the default is plain causal attention over the whole
    context. Checked when built: a bad value raises :class:`InvalidArgumentError`."""

    # Keys p - w < k <= p: the last `sliding_window` tokens (w >= 1).
    sliding_window: int | None = None
    # Keys k // C == p // C (C >= 1).
    chunk_size: int | None = None
    # Scaled scores s -> cap * tanh(s / cap), before masking (cap > 0).
    logits_soft_cap: float | None = None
    # [H] float: one extra logit per query head in each row's softmax (gpt-oss).
    sinks: torch.Tensor | None = None

    def __post_init__(self) -> None:
        for name in ("sliding_window", "chunk_size"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise InvalidTypeError(f"{name} must be an int or None, got {type(value).__name__}")
            if value < 1:
                raise InvalidArgumentError(f"{name} must be >= 1, got {value}")
        cap = self.logits_soft_cap
        if cap is not None:
            if isinstance(cap, bool) or not isinstance(cap, (int, float)):
                raise InvalidTypeError(f"logits_soft_cap must be a float or None, got {type(cap).__name__}")
            if not (math.isfinite(cap) and cap > 0):
                raise InvalidArgumentError(f"logits_soft_cap must be a finite number > 0, got {cap}")
        sinks = self.sinks
        if sinks is not None:
            if not isinstance(sinks, torch.Tensor):
                raise InvalidTypeError(f"sinks must be a torch.Tensor or None, got {type(sinks).__name__}")
            if sinks.dim() != 1 or not sinks.is_floating_point():
                raise InvalidArgumentError(
                    f"sinks must be a 1-D floating tensor of one logit per query head, got {sinks.dtype} "
                    f"of shape {list(sinks.shape)}"
                )

    @property
    def is_full(self) -> bool:
        """Plain causal attention over the whole context (nothing set)."""
        return self.sliding_window is None and self.chunk_size is None and self.is_plain_softmax

    @property
    def is_plain_softmax(self) -> bool:
        """The softmax is the usual one: no soft-capping, no sinks (only the mask may differ)."""
        return self.logits_soft_cap is None and self.sinks is None

    @property
    def limits_context(self) -> bool:
        """A query sees only part of the context before it (a window or a chunk)."""
        return self.sliding_window is not None or self.chunk_size is not None

    def first_visible(self, position: int) -> int:
        """The lowest key position the query at ``position`` sees (0 under full attention)."""
        return first_visible(position, self.sliding_window, self.chunk_size)

    def first_visible_tensor(self, positions: torch.Tensor) -> torch.Tensor:
        """:meth:`first_visible` of every element of ``positions`` (int64, any shape); the same
        rule as :func:`pagedkv.attention_span.first_visible`, elementwise (a test checks)."""
        first = torch.zeros_like(positions)
        if self.sliding_window is not None:
            first = torch.clamp(positions - self.sliding_window + 1, min=0)
        if self.chunk_size is not None:
            chunk_start = torch.div(positions, self.chunk_size, rounding_mode="floor") * self.chunk_size
            first = torch.maximum(first, chunk_start)
        return first

    def check_heads(self, num_heads: int) -> None:
        """``sinks`` has one logit per query head."""
        if self.sinks is not None and self.sinks.shape[0] != num_heads:
            raise InvalidArgumentError(
                f"sinks has {self.sinks.shape[0]} logits but the query has {num_heads} heads: one per query head"
            )


# Plain causal attention over the whole context (no window, chunk, sinks or soft-cap).
FULL_ATTENTION = LayerAttention()


def describe_layers(layers: list[LayerAttention]) -> str:
    """What a model's layers attend to, counted by kind, in first-seen order: for Gemma 3 270M
    ``"15 sliding window 512 + 3 full"``; for a plain model ``"30 full"``."""
    counts: dict[str, int] = {}
    for layer in layers:
        parts = []
        if layer.sliding_window is not None:
            parts.append(f"sliding window {layer.sliding_window}")
        if layer.chunk_size is not None:
            parts.append(f"chunk {layer.chunk_size}")
        if not parts:
            parts.append("full")
        if layer.logits_soft_cap is not None:
            parts.append(f"soft-cap {layer.logits_soft_cap:g}")
        if layer.sinks is not None:
            parts.append("sinks")
        kind = ", ".join(parts)
        counts[kind] = counts.get(kind, 0) + 1
    return " + ".join(f"{n} {kind}" for kind, n in counts.items())
