"""Byte sizes as people write them: ``"8GiB"``, ``"512MiB"``, ``"1.5GB"``, ``"4096"`` (bytes).

The one parser for every memory budget: ``pagedkv simulate --kv-memory``, the engine's
``kv_cache_memory`` / ``host_kv_cache_memory`` / ``kv_cache_dir_max_bytes`` (``EngineArgs``
takes a str for them too) and the matching command-line flags of ``generate``, ``demo`` and
``serve``. A plain number is bytes everywhere. KB/MB/GB/TB (and K/M/G/T) are powers of 10,
KiB/MiB/GiB/TiB powers of 2, case-insensitive. Nothing here imports torch or pagedkv's core.
"""

from __future__ import annotations

import argparse
import math
import re

from pagedkv.errors import ConfigError

__all__ = ["as_byte_count", "byte_size_arg", "parse_bytes"]

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str, *, name: str = "kv_memory") -> int:
    """Bytes in ``"8GiB"``, ``"512 MB"``, ``"1.5e9"`` or ``"4096"`` (KB/MB/GB are powers of 10,
    KiB/MiB/GiB of 2); ConfigError naming ``name`` unless it is a size of at least 1 byte."""
    match = _SIZE.match(str(text))
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ConfigError(f"{name} {text!r} is not a size (examples: 8GiB, 512MiB, 1.5GB, 4096 bytes)")
    value = float(match.group(1)) * _UNITS[unit]
    if not math.isfinite(value) or value < 1:
        raise ConfigError(f"{name} {text!r} must be at least 1 byte")
    return int(value)


def as_byte_count(value: int | str | None, name: str) -> int | None:
    """``value`` as bytes: a str is parsed (:func:`parse_bytes`), anything else is returned as
    is (None, or a number the config's own checks judge)."""
    return parse_bytes(value, name=name) if isinstance(value, str) else value


def byte_size_arg(text: str) -> int:
    """argparse ``type=`` for a size flag: bytes, or argparse's usage error saying why not."""
    try:
        return parse_bytes(text)
    except ConfigError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size of at least 1 byte (examples: 8GiB, 512MiB, 1.5GB, 4096 bytes)"
        ) from None
