"""KV-cache bytes per token from a model's ``config.json``, and KV budgets in bytes or blocks.

One token's KV state takes ``2 (K and V) x num_layers x num_kv_heads x head_dim x dtype bytes``
in every layer's cache (the layout of :mod:`pagedkv.worker.model_runner`:
``[num_blocks, block_size, num_kv_heads, head_dim]`` per layer, K and V apart). A pool of
``B`` bytes therefore holds ``floor(B / (bytes_per_token x block_size))`` blocks.

Fields are read the way Hugging Face configs spell them, with the common aliases of older
architectures (GPT-2's ``n_layer`` / ``n_head`` / ``n_embd``, Falcon's ``n_head_kv`` /
``multi_query``); a multimodal config's ``text_config`` is used for the language model.
``num_key_value_heads`` defaults to ``num_attention_heads`` (multi-head attention) and
``head_dim`` to ``hidden_size / num_attention_heads``, as transformers does.

The geometry type, :class:`pagedkv.config.KVGeometry`, is the one the model runner builds from
its probe forward. Nothing here imports torch: ``pagedkv simulate`` plans capacity without
loading a model.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pagedkv.config import KV_CACHE_DTYPES, KV_DTYPE_BYTES, KVGeometry, kv_dtype_info
from pagedkv.errors import ConfigError
from pagedkv.sizes import parse_bytes  # re-exported: the one size parser

__all__ = [
    "DEFAULT_SWAP_BYTES_PER_SECOND",
    "KV_DTYPE_BYTES",
    "KVGeometry",
    "kv_geometry",
    "load_kv_geometry",
    "load_model_config",
    "num_blocks_for_budget",
    "parse_bandwidth",
    "parse_bytes",
]

# Copy bandwidth between the device and the host tier, bytes/s: a PCIe-class GPU <-> pinned host link.
DEFAULT_SWAP_BYTES_PER_SECOND = 25e9

_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
_HEAD_KEYS = ("num_attention_heads", "n_head", "n_heads")
_KV_HEAD_KEYS = ("num_key_value_heads", "n_head_kv", "num_kv_heads", "multi_query_group_num")
_HIDDEN_KEYS = ("hidden_size", "n_embd", "d_model")
_DTYPE_KEYS = ("dtype", "torch_dtype")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_int(config: Mapping[str, Any], keys: tuple[str, ...], source: str) -> tuple[str, int] | None:
    """(key, value) of the first of ``keys`` present with a non-null value; None if none is."""
    for key in keys:
        value = config.get(key)
        if value is None:
            continue
        if not _is_int(value) or value < 1:
            raise ConfigError(f"model config {source}: field {key!r} must be an integer >= 1, got {value!r}")
        return key, value
    return None


def _require(config: Mapping[str, Any], keys: tuple[str, ...], source: str) -> int:
    found = _positive_int(config, keys, source)
    if found is None:
        also = f" (or {', '.join(repr(k) for k in keys[1:])})" if len(keys) > 1 else ""
        raise ConfigError(f"model config {source}: field {keys[0]!r}{also} is missing")
    return found[1]


def _text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's part: a multimodal config nests it under ``text_config``."""
    nested = config.get("text_config")
    if isinstance(nested, Mapping) and not any(key in config for key in _LAYER_KEYS):
        return {**{k: v for k, v in config.items() if k in _DTYPE_KEYS}, **nested}
    return config


def resolve_kv_dtype(kv_dtype: str, config: Mapping[str, Any], source: str) -> tuple[str, int, int]:
    """(dtype name, bytes per element, scale bytes per (token, head) vector); ``"auto"`` takes
    the config's ``dtype`` / ``torch_dtype``; the quantized formats (``int8``, ``fp8`` =
    ``fp8_e4m3``, ``fp8_e5m2``) store one byte per value plus a 2-byte scale per vector."""
    if not isinstance(kv_dtype, str):
        raise ConfigError(f"kv_dtype must be a string, got {kv_dtype!r}")
    name = kv_dtype.strip().lower().removeprefix("torch.")
    if name == "auto":
        for key in _DTYPE_KEYS:
            declared = config.get(key)
            if declared is None:
                continue
            declared_name = str(declared).lower().removeprefix("torch.")
            if declared_name not in KV_DTYPE_BYTES:
                raise ConfigError(
                    f"model config {source}: field {key!r} is {declared!r}, not a KV dtype "
                    f"({', '.join(sorted(KV_DTYPE_BYTES))}); pass kv_dtype explicitly"
                )
            return kv_dtype_info(declared_name)
        raise ConfigError(
            f"model config {source}: field 'torch_dtype' (or 'dtype') is missing, so kv_dtype 'auto' "
            "cannot be resolved; pass kv_dtype explicitly (e.g. bfloat16)"
        )
    if name not in KV_DTYPE_BYTES:
        known = sorted({*KV_DTYPE_BYTES, *KV_CACHE_DTYPES[1:]})
        raise ConfigError(f"kv_dtype {kv_dtype!r} is not known; use 'auto' or one of {', '.join(known)}")
    return kv_dtype_info(name)


def kv_geometry(config: Mapping[str, Any], *, kv_dtype: str = "auto", source: str = "<config>") -> KVGeometry:
    """The KV geometry of a parsed ``config.json``; ConfigError names a missing or bad field."""
    if not isinstance(config, Mapping):
        raise ConfigError(f"model config {source}: expected a JSON object, got {type(config).__name__}")
    text = _text_config(config)
    if text.get("kv_lora_rank") is not None:
        raise ConfigError(
            f"model config {source}: field 'kv_lora_rank' is set: multi-head latent attention caches a "
            "compressed latent, which this per-head formula does not model"
        )
    num_layers = _require(text, _LAYER_KEYS, source)
    num_heads = _positive_int(text, _HEAD_KEYS, source)
    kv_heads = _positive_int(text, _KV_HEAD_KEYS, source)
    if kv_heads is not None:
        num_kv_heads = kv_heads[1]
    elif text.get("multi_query") is True:
        num_kv_heads = 1
    elif num_heads is not None:
        num_kv_heads = num_heads[1]
    else:
        raise ConfigError(f"model config {source}: field 'num_key_value_heads' (or 'num_attention_heads') is missing")
    head_dim_entry = _positive_int(text, ("head_dim",), source)
    if head_dim_entry is not None:
        head_dim = head_dim_entry[1]
    else:
        hidden = _positive_int(text, _HIDDEN_KEYS, source)
        if hidden is None or num_heads is None:
            missing = "hidden_size" if hidden is None else "num_attention_heads"
            raise ConfigError(
                f"model config {source}: field 'head_dim' is missing and cannot be derived "
                f"(field {missing!r} is missing too)"
            )
        if hidden[1] % num_heads[1]:
            raise ConfigError(
                f"model config {source}: field 'head_dim' is missing and {hidden[0]} = {hidden[1]} is not "
                f"divisible by {num_heads[0]} = {num_heads[1]}"
            )
        head_dim = hidden[1] // num_heads[1]
    dtype, dtype_bytes, scale_bytes = resolve_kv_dtype(kv_dtype, text, source)
    return KVGeometry(
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        dtype_bytes=dtype_bytes,
        scale_bytes=scale_bytes,
        num_heads=num_heads[1] if num_heads is not None else None,
        source=source,
    )


def load_model_config(path: str | os.PathLike[str] | None = None) -> tuple[dict[str, Any], str]:
    """(parsed config, its path) from a ``config.json`` file or a folder holding one.

    ``None`` means the embedded default model (SmolLM2-135M-Instruct): its converted folder
    from :func:`pagedkv.worker.model_files.default_model_dir` (converted once on first use).
    """
    if path is None:
        from pagedkv.worker.model_files import default_model_dir

        file = default_model_dir() / "config.json"
    else:
        file = Path(path).expanduser()
        if file.is_dir():
            file = file / "config.json"
    if not file.is_file():
        raise ConfigError(f"model config {os.fspath(file)!r} does not exist (give a config.json or a folder with one)")
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"model config {os.fspath(file)!r} cannot be read: {error}") from None
    except json.JSONDecodeError as error:
        raise ConfigError(
            f"model config {os.fspath(file)!r} is not valid JSON: {error.msg} (line {error.lineno})"
        ) from None
    if not isinstance(config, dict):
        raise ConfigError(f"model config {os.fspath(file)!r}: expected a JSON object, got {type(config).__name__}")
    return config, os.fspath(file)


def load_kv_geometry(path: str | os.PathLike[str] | None = None, *, kv_dtype: str = "auto") -> KVGeometry:
    """:func:`kv_geometry` of :func:`load_model_config` (default: the embedded SmolLM2)."""
    config, source = load_model_config(path)
    return kv_geometry(config, kv_dtype=kv_dtype, source=source)


def num_blocks_for_budget(budget_bytes: int, geometry: KVGeometry, block_size: int, *, name: str = "kv_memory") -> int:
    """Whole blocks of ``block_size`` tokens that fit in ``budget_bytes``; ConfigError below one block."""
    if not _is_int(budget_bytes) or budget_bytes < 1:
        raise ConfigError(f"{name} must be a positive number of bytes, got {budget_bytes!r}")
    if not _is_int(block_size) or block_size < 1:
        raise ConfigError(f"block_size must be an integer >= 1, got {block_size!r}")
    per_block = geometry.bytes_per_block(block_size)
    blocks = budget_bytes // per_block
    if blocks < 1:
        raise ConfigError(
            f"{name} = {budget_bytes:,} bytes is smaller than one block ({per_block:,} bytes = "
            f"{block_size} tokens x {geometry.bytes_per_token:,} B/token)"
        )
    return blocks


def parse_bandwidth(value: float | int | str, *, name: str = "swap_bandwidth") -> float:
    """Bytes per second from a number or a size with an optional ``/s`` (``"25GB/s"``,
    ``"32GiB"``, ``"2.5e10"``); ConfigError unless positive and finite."""
    if isinstance(value, str):
        text = value.strip()
        text = text[:-2] if text.lower().endswith("/s") else text
        return float(parse_bytes(text, name=name))
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
        raise ConfigError(f"{name} must be a positive number of bytes per second, got {value!r}")
    return float(value)
