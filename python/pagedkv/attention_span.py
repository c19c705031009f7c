"""Which keys a query sees under a sliding window or chunked local attention: the one rule.

Transformers' conventions: with a window ``w`` the query at position ``p`` sees the keys
``p - w < k <= p``; with chunks of ``C`` the keys ``k // C == p // C`` (and ``k <= p``); with
both, the keys both allow. Kept free of torch so the capacity arithmetic (``pagedkv.sim``)
and the kernels (``pagedkv.kernels.LayerAttention``, whose tensor form must agree with this)
share it.
"""

from __future__ import annotations

__all__ = ["first_visible"]


def first_visible(position: int, sliding_window: int | None = None, chunk_size: int | None = None) -> int:
    """The lowest key position the query at ``position`` sees (0 under full attention)."""
    first = 0
    if sliding_window is not None:
        first = max(first, position - sliding_window + 1)
    if chunk_size is not None:
        first = max(first, position // chunk_size * chunk_size)
    return first
