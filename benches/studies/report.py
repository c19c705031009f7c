"""What a study produces: numbers (JSON), a Markdown write-up with tables, and PNG figures.

A :class:`StudyResult` is written into one output folder as ``<name>.json`` and
``<name>.md`` next to its PNGs. Its Markdown links the images relative to wherever it is
rendered: :meth:`StudyResult.markdown` takes the folder prefix (``""`` inside the results
folder, ``"results/"`` from ``benches/RESULTS.md``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["StudyResult", "md_table", "fmt", "IMAGE_PREFIX"]

# Stands for the folder of the PNGs in Markdown bodies; replaced when rendered.
IMAGE_PREFIX = "@@results@@/"


def fmt(value: Any, digits: int = 3) -> str:
    """A table cell: ints with thousands separators, floats to ``digits`` significant digits."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return f"{value:,.0f}" if abs(value) >= 10**digits else f"{value:.{digits}g}"
    return str(value)


def pct(value: float | None, decimals: int = 1) -> str:
    return "-" if value is None else f"{100 * value:.{decimals}f}%"


def md_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub Markdown table; cells that are not strings go through :func:`fmt`."""

    def cell(value: Any) -> str:
        return value if isinstance(value, str) else fmt(value)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def image(alt: str, filename: str) -> str:
    """A Markdown image whose folder is filled in when the write-up is rendered."""
    return f"![{alt}]({IMAGE_PREFIX}{filename})"


@dataclass
class StudyResult:
    """One study's outputs. ``data`` is JSON-ready; ``body`` is Markdown using :func:`image`."""

    name: str
    title: str
    data: dict[str, Any]
    body: str
    images: list[Path] = field(default_factory=list)

    def markdown(self, image_folder: str = "") -> str:
        """The write-up with image links under ``image_folder`` (e.g. ``"results/"``)."""
        return self.body.replace(IMAGE_PREFIX, image_folder)

    def write(self, out_dir: Path) -> list[Path]:
        """Writes ``<name>.json`` and ``<name>.md`` into ``out_dir``; returns every output file."""
        out_dir.mkdir(parents=True, exist_ok=True)
        json_path = out_dir / f"{self.name}.json"
        md_path = out_dir / f"{self.name}.md"
        json_path.write_text(json.dumps(self.data, indent=2, sort_keys=False) + "\n")
        md_path.write_text(f"# {self.title}\n\n{self.markdown('')}\n")
        return [*self.images, json_path, md_path]
