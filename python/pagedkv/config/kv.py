"""What a model's KV cache costs per token (:class:`KVGeometry`), and the KV-cache dtypes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedkv.config.fields import torch_name
from pagedkv.errors import ConfigError

__all__ = [
    "KV_CACHE_DTYPES",
    "KV_CACHE_SCALES",
    "KV_DTYPE_BYTES",
    "KV_SCALE_BYTES",
    "KVGeometry",
    "canonical_kv_cache_dtype",
    "kv_dtype_info",
]

# Element size of each KV-cache dtype name (torch spellings and the usual short forms).
KV_DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "fp32": 4,
    "float": 4,
    "float16": 2,
    "fp16": 2,
    "half": 2,
    "bfloat16": 2,
    "bf16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "int8": 1,
}
# ``kv_cache_dtype`` values: "auto" = the model's dtype; the others are quantized formats
# (pagedkv.kernels.kv_quant) that store a bfloat16 scale per (token, KV head) next to the data.
KV_CACHE_DTYPES = ("auto", "int8", "fp8", "fp8_e4m3", "fp8_e5m2")
# Where the scales of a quantized cache come from: computed per vector when stored, or the
# checkpoint's static k_scale / v_scale (per tensor or per KV head).
KV_CACHE_SCALES = ("dynamic", "checkpoint")
KV_SCALE_BYTES = 2  # one bfloat16 per (token, KV head) vector of K and of V
# Canonical names of the quantized formats (torch spellings accepted too).
_QUANTIZED_KV = {
    "int8": "int8",
    "fp8": "fp8_e4m3",
    "fp8_e4m3": "fp8_e4m3",
    "float8_e4m3fn": "fp8_e4m3",
    "fp8_e5m2": "fp8_e5m2",
    "float8_e5m2": "fp8_e5m2",
}


def canonical_kv_cache_dtype(value: Any) -> str:
    """``"auto"`` or the canonical name (``"int8"``, ``"fp8_e4m3"``, ``"fp8_e5m2"``) of a
    ``kv_cache_dtype`` value (aliases such as ``"fp8"`` and the torch dtypes accepted);
    ConfigError for anything else."""
    name = torch_name(value)
    if name == "auto":
        return "auto"
    if isinstance(name, str) and name in _QUANTIZED_KV:
        return _QUANTIZED_KV[name]
    raise ConfigError(
        f"kv_cache_dtype must be one of {KV_CACHE_DTYPES} (or torch.int8 / torch.float8_e4m3fn / "
        f"torch.float8_e5m2), got {value!r}"
    )


def kv_dtype_info(name: str) -> tuple[str, int, int]:
    """(canonical name, bytes per element, scale bytes per (token, head) vector) of a KV dtype
    name such as ``"bfloat16"`` or ``"int8"``; ConfigError for an unknown one."""
    if name in _QUANTIZED_KV:
        return _QUANTIZED_KV[name], 1, KV_SCALE_BYTES
    if name not in KV_DTYPE_BYTES:
        raise ConfigError(f"KV dtype {name!r} is not known; use one of {', '.join(sorted(KV_DTYPE_BYTES))}")
    return name, KV_DTYPE_BYTES[name], 0


@dataclass(frozen=True)
class KVGeometry:
    """What a model's KV cache holds per token, and what that costs.

    ``bytes_per_token = 2 (K and V) * num_layers * num_kv_heads * (head_dim * dtype_bytes +
    scale_bytes)``: a quantized cache (int8, fp8) also stores one bfloat16 scale per (token,
    KV head) vector (``scale_bytes`` = 2; 0 for a float cache).
    ``num_heads`` (query heads) is None when it is not known (a config that names only the
    KV heads); the KV cost never depends on it.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # "float32", "bfloat16", ... (torch names without "torch.")
    dtype_bytes: int
    num_heads: int | None = None
    source: str = "config"  # where the numbers came from, for reports
    scale_bytes: int = 0

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * (self.head_dim * self.dtype_bytes + self.scale_bytes)

    def bytes_per_block(self, block_size: int) -> int:
        return self.bytes_per_token * block_size

    def describe(self) -> str:
        per_vector = f"{self.head_dim} head_dim x {self.dtype_bytes} B"
        if self.scale_bytes:
            per_vector = f"({per_vector} + {self.scale_bytes} B scale)"
        return (
            f"{self.bytes_per_token:,} B/token = 2 x {self.num_layers} layers x {self.num_kv_heads} KV heads "
            f"x {per_vector} ({self.dtype})"
        )
