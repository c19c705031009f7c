"""Figures for the studies, drawn with matplotlib's object API on the Agg canvas.

No ``pyplot``: figures are plain :class:`matplotlib.figure.Figure` objects saved straight
to PNG, so the studies never touch the global backend (safe in notebooks, servers and CI
without a display). matplotlib is an optional dependency (``pip install pagedkv[sim]``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pagedkv.errors import ConfigError

__all__ = ["new_figure", "save_png", "CATEGORY_COLORS", "CATEGORY_LABELS", "ALLOCATOR_LABELS"]

# Memory-breakdown categories (pagedkv.sim.baselines.BREAKDOWN_CATEGORIES) in plot order.
CATEGORY_LABELS = {
    "token_states": "token states",
    "reserved_unused": "reserved, not yet used",
    "internal_fragmentation": "internal fragmentation",
    "external_fragmentation": "external fragmentation",
    "free": "free",
}
CATEGORY_COLORS = {
    "token_states": "#2e7d32",
    "reserved_unused": "#f9a825",
    "internal_fragmentation": "#c62828",
    "external_fragmentation": "#6a1b9a",
    "free": "#e0e0e0",
}
ALLOCATOR_LABELS = {
    "paged": "pagedkv\n(paged)",
    "max_length": "reserve\nmax_model_len",
    "exact": "reserve exact\nlength (oracle)",
}


def new_figure(width: float, height: float, **kwargs: Any) -> Any:
    """A Figure on the Agg canvas (raises ConfigError when matplotlib is missing)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ConfigError(f"the studies' plots need matplotlib ({error}); pip install 'pagedkv[sim]'") from None
    figure = Figure(figsize=(width, height), **kwargs)
    FigureCanvasAgg(figure)
    return figure


def save_png(figure: Any, path: Path, *, dpi: int = 120) -> Path:
    """Writes ``figure`` as a PNG (tight bounding box) and returns the path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, format="png", dpi=dpi, bbox_inches="tight")
    return path
