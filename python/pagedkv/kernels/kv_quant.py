"""Quantized KV caches: int8 and fp8 blocks with one scale per (token, KV head).

A quantized layer cache is the data ``[num_blocks, block_size, Hkv, D]`` in the storage dtype
(``int8``, ``float8_e4m3fn`` or ``float8_e5m2``) plus a scale cache ``[num_blocks,
block_size, Hkv]`` in bfloat16, for K and for V (:class:`KVScales`). The scale of a stored
vector sits at the same (block, offset) slot as its data, so everything that moves blocks
(copy-on-write, prefix caching, preemption) moves the scales with them by moving the same
block ids.

Why one scale per (token, head) and computed at store time:

* no calibration: ``store_kv`` quantizes each new K/V head vector ``x`` (``D`` values) with
  ``scale = absmax(x) / qmax``, so the full range of the format is used by every vector,
  whatever the layer, the head or how far into a long context the token is; nothing is read
  from the checkpoint and no scale can be missing (the trap of a silent scale of 1.0);
* one outlier only costs resolution inside its own vector, never across tokens;
* it costs ``2 / (D * 1)`` bytes more per value: with ``head_dim`` 64, one (token, head) K
  vector is 64 B of int8 + 2 B of scale = 66 B, against 256 B in float32 (3.88x) or 128 B
  in bfloat16 (1.94x).

Scales are bfloat16 (float32's exponent range: no underflow or overflow for any finite
activation) **rounded up** from ``absmax / qmax``: then ``|x| / scale <= qmax`` always, the
format never saturates, and the error of a stored value is at most half a step of the
format's grid at ``|x| / scale``, times the scale (:meth:`KVFormat.error_bound`). A zero
vector gets the smallest normal float32 as its scale (it stores zeros).

A checkpoint may provide static scales instead (``k_scale`` / ``v_scale``, per tensor or
per KV head: :class:`KVScales` ``static_key`` / ``static_value``). Then ``store_kv`` writes
that scale (rounded up to bfloat16) into every slot and quantizes with saturation at
``qmax``; the attention kernels do not care where a scale came from.

Dequantization: ``x ~= float(q) * float(scale)``; kernels fold it into the math where they can
(scores ``q . k`` times the K scale, softmax weights times the V scale).

Key rotation (``KVScales.key_rotation``, set by the engine with dynamic scales): keys are
stored rotated by a fixed orthogonal ``[D, D]`` matrix ``R`` (:func:`key_rotation`: a
randomized Hadamard matrix), and queries are rotated by the same ``R`` before attention, so
``(q R) . (k R) = q . k`` and nothing else changes (values are not rotated). Post-RoPE keys
have a few outlier channels that set every vector's absmax, and so the step of all its other
channels; the rotation spreads their energy over all ``D`` channels, so the absmax, and with it
the quantization error of the scores, shrinks: on SmolLM2 it lowers int8's KL divergence from full precision and raises its top-1
agreement (benches/bench_kv_quality.py, benches/RESULTS.md). Rotating V as well gained
little (and would need the output rotated back), so V is stored as is. Checkpoint (static)
scales were calibrated on unrotated keys, so the engine does not rotate with them.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from pagedkv.config import KV_CACHE_DTYPES, canonical_kv_cache_dtype
from pagedkv.errors import InvalidArgumentError

__all__ = [
    "FORMATS",
    "KV_CACHE_DTYPES",
    "SCALE_BYTES",
    "SCALE_DTYPE",
    "KVFormat",
    "KVScales",
    "byte_view",
    "check_static_scale",
    "compute_scales",
    "dequantize",
    "format_of",
    "key_rotation",
    "kv_format",
    "quantize",
    "quantize_kv",
    "rotate",
    "round_up_to_bf16",
]

SCALE_DTYPE = torch.bfloat16
SCALE_BYTES = 2
# The smallest normal float32: the scale of an all-zero vector (any positive value works).
_MIN_SCALE = 2.0**-126


@dataclass(frozen=True)
class KVFormat:
    """One quantized storage format of the KV cache."""

    name: str  # "int8", "fp8_e4m3", "fp8_e5m2"
    storage_dtype: torch.dtype
    qmax: float  # largest magnitude the format stores
    mantissa_bits: int  # explicit mantissa bits (int8: 0, a uniform grid of step 1)
    min_exponent: int  # exponent of the smallest normal (fp8); int8: 0

    @property
    def is_float(self) -> bool:
        return self.storage_dtype != torch.int8

    def error_bound(self, magnitude: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """Largest ``|x - dequantize(quantize(x))|`` for values of ``magnitude = |x|`` quantized
        with ``scales`` (broadcastable): half a grid step at ``|x| / scale``, times the scale."""
        y = magnitude.double() / scales.double()
        if not self.is_float:
            half_step = torch.full_like(y, 0.5)
        else:
            exponent = torch.floor(torch.log2(y.clamp_min(2.0**self.min_exponent)))
            half_step = torch.exp2(exponent - self.mantissa_bits - 1)
        return half_step * scales.double()


FORMATS: dict[str, KVFormat] = {
    "int8": KVFormat("int8", torch.int8, 127.0, 0, 0),
    "fp8_e4m3": KVFormat("fp8_e4m3", torch.float8_e4m3fn, 448.0, 3, -6),
    "fp8_e5m2": KVFormat("fp8_e5m2", torch.float8_e5m2, 57344.0, 2, -14),
}
_BY_STORAGE = {fmt.storage_dtype: fmt for fmt in FORMATS.values()}
_FLOAT8 = tuple(fmt.storage_dtype for fmt in FORMATS.values() if fmt.is_float)


def kv_format(name: str) -> KVFormat | None:
    """The format a ``kv_cache_dtype`` value names (None for ``"auto"``); ConfigError otherwise."""
    canonical = canonical_kv_cache_dtype(name)
    return None if canonical == "auto" else FORMATS[canonical]


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """A float8 tensor as its bytes (a ``uint8`` view, same memory), any other tensor as is:
    torch has no CPU ``index_copy_`` for float8 and numpy no float8 type, and copying or
    handing over the bytes is exact."""
    return tensor.view(torch.uint8) if tensor.dtype in _FLOAT8 else tensor


def format_of(cache_dtype: torch.dtype) -> KVFormat | None:
    """The quantized format stored in a cache of ``cache_dtype`` (None: a plain float cache)."""
    return _BY_STORAGE.get(cache_dtype)


@dataclass(frozen=True, eq=False)
class KVScales:
    """The scales of one layer's quantized K and V caches.

    ``key`` / ``value``: ``[num_blocks, block_size, Hkv]`` bfloat16, the scale of the vector at
    each slot (written by ``store_kv``, read by the attention kernels). ``static_key`` /
    ``static_value``: ``[Hkv]`` float32 checkpoint scales (bfloat16-representable, positive) that
    ``store_kv`` uses instead of computing one per vector; None = dynamic (the default).
    ``key_rotation``: an orthogonal ``[D, D]`` matrix (:func:`key_rotation`) by which
    ``store_kv`` rotates keys before quantizing and ``paged_attention`` rotates queries; None =
    keys stored as they are.
    """

    key: torch.Tensor
    value: torch.Tensor
    static_key: torch.Tensor | None = None
    static_value: torch.Tensor | None = None
    key_rotation: torch.Tensor | None = None


# Seed of the random signs of key_rotation: fixed, so every process (and every engine a cache
# is transferred between) stores keys in the same basis.
_ROTATION_SEED = 0x6B76


@functools.lru_cache(maxsize=16)
def _rotation_float64(head_dim: int) -> torch.Tensor:  # [D, D] float64, orthogonal
    generator = torch.Generator().manual_seed(_ROTATION_SEED)
    signs = torch.randint(0, 2, (head_dim,), generator=generator, dtype=torch.float64) * 2 - 1
    if head_dim & (head_dim - 1) == 0:
        # Sylvester's Hadamard matrix with random column signs, normalised: every entry is
        # +-1/sqrt(D), so one outlier channel lands on all D channels with equal weight.
        hadamard = torch.ones(1, 1, dtype=torch.float64)
        while hadamard.shape[0] < head_dim:
            hadamard = torch.cat([torch.cat([hadamard, hadamard], 1), torch.cat([hadamard, -hadamard], 1)], 0)
        return hadamard * signs[None, :] / math.sqrt(head_dim)
    # Other sizes (80, 96, ...): a seeded random orthogonal matrix (QR of a Gaussian).
    q, r = torch.linalg.qr(torch.randn(head_dim, head_dim, generator=generator, dtype=torch.float64))
    rotation: torch.Tensor = q * torch.sign(torch.diagonal(r))[None, :] * signs[None, :]
    return rotation


def key_rotation(head_dim: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> torch.Tensor:
    """The fixed orthogonal ``[head_dim, head_dim]`` key rotation of quantized caches (see the
    module docstring), deterministic for a given ``head_dim``."""
    return _rotation_float64(head_dim).to(device=device, dtype=dtype)


def rotate(x: torch.Tensor, rotation: torch.Tensor | None) -> torch.Tensor:  # [..., D] -> [..., D]
    """``x @ rotation`` in ``x``'s dtype (``x`` itself when there is no rotation)."""
    if rotation is None:
        return x
    return torch.matmul(x, rotation if rotation.dtype == x.dtype else rotation.to(x.dtype))


def round_up_to_bf16(x: torch.Tensor) -> torch.Tensor:  # float32, positive finite -> float32
    """The smallest bfloat16 value ``>= x``, as float32 (exact in bfloat16)."""
    bits = x.float().contiguous().view(torch.int32)
    return ((bits + 0xFFFF) & ~0xFFFF).view(torch.float32)


def compute_scales(
    x: torch.Tensor,  # [..., D]
    fmt: KVFormat,
    static: torch.Tensor | None = None,  # broadcastable to x.shape[:-1], float32
) -> torch.Tensor:  # x.shape[:-1] float32, every value exact in bfloat16
    """``absmax / qmax`` of each vector rounded up to bfloat16, or the static scale."""
    if static is not None:
        return round_up_to_bf16(static.float()).expand(x.shape[:-1])
    absmax = x.detach().abs().amax(dim=-1).float()
    return round_up_to_bf16((absmax / fmt.qmax).clamp_min(_MIN_SCALE))


def quantize(
    x: torch.Tensor,  # [..., D] float
    scales: torch.Tensor,  # x.shape[:-1] float32
    fmt: KVFormat,
) -> torch.Tensor:  # [..., D] fmt.storage_dtype
    """``x / scale`` on the format's grid (round to nearest, saturating at ``qmax``)."""
    y = (x.float() / scales[..., None]).clamp(-fmt.qmax, fmt.qmax)
    if not fmt.is_float:
        y = torch.round(y)
    return y.to(fmt.storage_dtype)


def dequantize(
    q: torch.Tensor,  # [..., D] storage dtype
    scales: torch.Tensor,  # q.shape[:-1], any float dtype
    dtype: torch.dtype,
) -> torch.Tensor:  # [..., D] dtype
    """``float(q) * float(scale)`` in ``dtype`` (float64 for the oracle)."""
    return q.to(dtype) * scales.to(dtype)[..., None]


def quantize_kv(
    x: torch.Tensor,  # [N, Hkv, D]
    fmt: KVFormat,
    static: torch.Tensor | None = None,  # [Hkv] float32
) -> tuple[torch.Tensor, torch.Tensor]:  # ([N, Hkv, D] storage dtype, [N, Hkv] bfloat16)
    """Quantize new K or V vectors for ``store_kv``: the data and the scale to store with it."""
    scales = compute_scales(x, fmt, static)
    return quantize(x, scales, fmt), scales.to(SCALE_DTYPE)


def check_static_scale(name: str, scale: object, num_kv_heads: int) -> torch.Tensor:
    """A checkpoint's ``k_scale`` / ``v_scale`` (a number, ``[]``, ``[1]`` or ``[Hkv]``) as a
    ``[Hkv]`` float32 tensor rounded up to bfloat16; InvalidArgumentError if it is not finite
    and positive or has another shape."""
    tensor = torch.as_tensor(scale, dtype=torch.float32) if not isinstance(scale, torch.Tensor) else scale
    if tensor.is_complex() or not tensor.is_floating_point():
        raise InvalidArgumentError(f"{name} must be a floating-point scale, got dtype {tensor.dtype}")
    tensor = tensor.detach().to("cpu", torch.float32)
    if tensor.dim() > 1 or tensor.numel() not in (1, num_kv_heads):
        raise InvalidArgumentError(
            f"{name} must be one scale per tensor or one per KV head ({num_kv_heads}), got shape {tuple(tensor.shape)}"
        )
    if not bool(torch.isfinite(tensor).all()) or not bool((tensor > 0).all()):
        raise InvalidArgumentError(f"{name} must be finite and positive, got {tensor.tolist()}")
    return round_up_to_bf16(tensor.reshape(-1).expand(num_kv_heads).clone())
