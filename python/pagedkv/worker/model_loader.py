"""Loading the model a runner serves, the first of its three set-up stages (then
:mod:`~pagedkv.worker.kv_cache_plan` sizes the KV cache and :mod:`~pagedkv.worker.kv_cache_alloc`
allocates it).

:func:`load_model` resolves the device and dtype, reads the config and refuses what pagedkv
cannot serve before any weight is read, fixes ``max_model_len``, joins the tensor-parallel group
(``tp``: before the weights, so a refused engine joins nothing), loads the weights with pagedkv's
attention registered, shards them, and swaps the linears for the chosen kernel or quantization.
"""

from __future__ import annotations

import os
import sys
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import pagedkv.kernels as kernels
from pagedkv.config import CacheConfig, ModelConfig, SchedulingConfig, resolve_linear_kernel
from pagedkv.errors import ConfigError, InvalidArgumentError, ModelLoadError, UnsupportedModelError
from pagedkv.kernels.kv_quant import KVFormat, kv_format
from pagedkv.worker.attention_backend import ATTENTION_NAME, register_pagedkv_attention
from pagedkv.worker.bf16_linear import use_bf16_linears
from pagedkv.worker.cpu_linear import LinearSwitch, use_pagedkv_linears
from pagedkv.worker.gguf_blocks import has_gguf_blocks, load_gguf_blocks
from pagedkv.worker.gguf_linear import use_gguf_linears
from pagedkv.worker.int8_linear import use_int8_linears
from pagedkv.worker.model_files import resolve_model
from pagedkv.worker.model_support import check_config, context_length_of
from pagedkv.worker.onednn_linear import use_onednn_linears
from pagedkv.worker.parallel_rank import ParallelRank

__all__ = ["LoadedModel", "load_model", "load_model_config", "resolve_backend", "resolve_device"]

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}


@dataclass
class LoadedModel:
    """A loaded (and, under tensor parallelism, sharded) model and the facts resolved on the way."""

    model: Any  # a transformers PreTrainedModel
    model_path: str  # what from_pretrained got (the tokenizer loads from it)
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    kv_format: KVFormat | None  # a quantized KV cache's format, else None
    kv_cache_dtype: torch.dtype
    quantization: str | None
    linear_kernel: str
    linear_switch: LinearSwitch | None
    vocab_size: int


def load_model(
    model_config: ModelConfig, cache: CacheConfig, scheduling: SchedulingConfig, tp: ParallelRank | None
) -> LoadedModel:
    """The model of ``model_config``, ready for the probe forward (see the module docstring)."""
    device = resolve_device(model_config.device)
    model_path = resolve_model(model_config.model)
    register_pagedkv_attention()
    resolve_backend(device, model_config.attention_backend)  # fail fast, before the weights load

    config = _load_config(model_path, model_config.trust_remote_code)
    text_config = config.get_text_config()
    max_model_len = model_config.max_model_len
    declared_len = context_length_of(text_config)
    # Unsupported features first: they matter more than a missing context length.
    check_config(text_config, max_model_len or declared_len or sys.maxsize, scheduling.max_num_batched_tokens)
    if max_model_len is None:
        if declared_len is None:
            raise ConfigError(f"the config of {model_path!r} declares no context length; pass max_model_len")
        max_model_len = declared_len
    elif declared_len is not None and max_model_len > declared_len:
        warnings.warn(
            f"max_model_len = {max_model_len} is above the context length the model declares "
            f"({declared_len}); positions past {declared_len} are outside what it was trained for",
            UserWarning,
            stacklevel=3,  # ModelRunner's caller
        )
    if tp is not None:
        device = tp.join(text_config, device, cache)

    dtype = _resolve_dtype(model_config.dtype, config, device)
    fmt = kv_format(cache.kv_cache_dtype)
    cache_dtype = dtype if fmt is None else fmt.storage_dtype
    if fmt is not None:  # fail fast: a backend that cannot read this cache
        resolve_backend(
            device,
            model_config.attention_backend,
            dtype=dtype,
            head_dim=_declared_head_dim(text_config),
            cache_dtype=cache_dtype,
        )
    model = _load_model(model_path, dtype, device, model_config.trust_remote_code)
    if tp is not None:
        tp.shard(model)
    # quantization="gguf" (or "auto" for a GGUF model on the CPU): the linears of the GGUF's
    # Q4_0 / Q4_1 / Q8_0 / Q4_K tensors straight from their blocks (worker/gguf_linear.py);
    # before the linear kernel's switch, which takes the linears left.
    quantization = _resolve_quantization(model_config.quantization, model_path, device, tp is not None)
    if quantization == "gguf":
        use_gguf_linears(model, load_gguf_blocks(model_path))
    # linear_kernel="onednn": the linears through oneDNN (worker/onednn_linear.py); "pagedkv":
    # decode-sized products through the Rust kernel (worker/cpu_linear.py). None: torch's
    # own. "auto" resolves here, where the device and dtype are known. Benchmarks turn the
    # switch off and on.
    linear_kernel = resolve_linear_kernel(
        model_config.linear_kernel, device.type, str(dtype).removeprefix("torch."), quantization
    )
    linear_switch = _switch_linear_kernel(linear_kernel, model, device, dtype)
    # quantization="int8": the linears' weights as int8 (worker/int8_linear.py); after the
    # sharding, so each rank quantizes its own shard.
    # quantization="bf16": bfloat16 weights, float32 activations (worker/bf16_linear.py).
    if quantization in ("int8", "bf16"):
        if device.type != "cpu":
            raise ConfigError(
                f"quantization {model_config.quantization!r} runs pagedkv's CPU linear kernel; the model is on {device}"
            )
        if quantization == "bf16":
            use_bf16_linears(model)
        else:
            use_int8_linears(model)
    head = model.get_output_embeddings()
    vocab_size = int(head.weight.shape[0]) if head is not None else int(text_config.vocab_size)
    return LoadedModel(
        model=model,
        model_path=model_path,
        device=device,
        dtype=dtype,
        max_model_len=max_model_len,
        kv_format=fmt,
        kv_cache_dtype=cache_dtype,
        quantization=quantization,
        linear_kernel=linear_kernel,
        linear_switch=linear_switch,
        vocab_size=vocab_size,
    )


def _resolve_quantization(requested: str | None, model_path: str, device: torch.device, parallel: bool) -> str | None:
    """``quantization`` made concrete: ``"auto"`` is ``"gguf"`` for a GGUF model (a folder
    with the GGUF's blocks, worker/gguf_blocks.py) on the CPU without tensor parallelism,
    else None; ``"gguf"`` where it cannot be served is a ConfigError."""
    if requested not in ("auto", "gguf"):
        return requested
    blocks = os.path.isdir(model_path) and has_gguf_blocks(model_path)
    if requested == "auto":
        return "gguf" if blocks and device.type == "cpu" and not parallel else None
    if not blocks:
        raise ConfigError(
            f"quantization 'gguf' serves a GGUF model's own blocks, but {model_path!r} is not a GGUF "
            "model (a .gguf file or an embedded model) or has no Q4_0 / Q4_1 / Q8_0 / Q4_K linears"
        )
    if device.type != "cpu":
        raise ConfigError(f"quantization 'gguf' runs pagedkv's CPU GGUF kernel; the model is on {device}")
    if parallel:
        raise ConfigError("quantization 'gguf' cannot be combined with tensor parallelism")
    return "gguf"


def _switch_linear_kernel(
    kernel: str, model: nn.Module, device: torch.device, dtype: torch.dtype
) -> LinearSwitch | None:
    if kernel == "torch":
        return None
    if device.type != "cpu" or dtype != torch.float32:
        raise ConfigError(
            f"linear_kernel={kernel!r} runs float32 linears on the CPU, but the model is {dtype} on {device}"
        )
    if kernel == "pagedkv":
        return use_pagedkv_linears(model)
    return use_onednn_linears(model)


def resolve_backend(
    device: torch.device,
    name: str | None,
    *,
    dtype: torch.dtype | None = None,
    head_dim: int | None = None,
    cache_dtype: torch.dtype | None = None,
) -> kernels.AttentionBackend:
    """The attention backend, once; a backend that cannot serve this model (or read its KV
    cache dtype) is a ConfigError."""
    try:
        return kernels.get_backend(device, name, dtype=dtype, head_dim=head_dim, cache_dtype=cache_dtype)
    except InvalidArgumentError as exc:
        detail = f"attention_backend={name!r}"
        if cache_dtype is not None and cache_dtype != dtype:
            detail += f", KV cache {str(cache_dtype).removeprefix('torch.')}"
        raise ConfigError(f"{detail}: {exc}") from exc


def _declared_head_dim(text_config: Any) -> int | None:
    """head_dim as the config declares it (or hidden_size / heads); None if it says neither."""
    head_dim = getattr(text_config, "head_dim", None)
    if isinstance(head_dim, int) and head_dim > 0:
        return head_dim
    hidden, heads = getattr(text_config, "hidden_size", None), getattr(text_config, "num_attention_heads", None)
    if isinstance(hidden, int) and isinstance(heads, int) and heads > 0 and hidden % heads == 0:
        return hidden // heads
    return None


def resolve_device(device: str | torch.device) -> torch.device:
    if isinstance(device, str) and device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}") from exc
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r} requested but CUDA is not available")
    if resolved.type not in ("cpu", "cuda"):
        raise ConfigError(f"device must be a CPU or CUDA device, got {device!r}")
    return resolved


def _resolve_dtype(dtype: str | torch.dtype, config: Any, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        resolved = dtype
    elif dtype == "auto":
        if device.type != "cuda":
            return torch.float32
        if torch.cuda.is_bf16_supported():
            return torch.bfloat16
        declared = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if isinstance(declared, str):
            declared = _DTYPES.get(declared)
        return declared if declared in (torch.float16, torch.float32) else torch.float16
    elif isinstance(dtype, str) and dtype in _DTYPES:
        resolved = _DTYPES[dtype]
    else:
        raise ConfigError(f"dtype must be 'auto', 'float32', 'float16', 'bfloat16' or a torch.dtype, got {dtype!r}")
    if resolved not in (torch.float32, torch.float16, torch.bfloat16):
        raise ConfigError(f"dtype must be float32, float16 or bfloat16, got {resolved}")
    return resolved


def load_model_config(model: str | None, trust_remote_code: bool = False) -> Any:
    """The transformers config of ``model`` (a folder, an embedded model's name, a hub id, or
    None for the default), without loading its weights."""
    return _load_config(resolve_model(model), trust_remote_code)


def _load_config(model_path: str, trust_remote_code: bool) -> Any:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"cannot load the config of model {model_path!r}: {exc}") from exc


def _load_model(model_path: str, dtype: torch.dtype, device: torch.device, trust_remote_code: bool) -> Any:
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(
            model_path,
            dtype=dtype,
            attn_implementation=ATTENTION_NAME,
            trust_remote_code=trust_remote_code,
        )
    except ValueError as exc:
        # "Unrecognized configuration class ... for AutoModelForCausalLM", or an attention
        # implementation the model class refuses.
        raise UnsupportedModelError(f"cannot load {model_path!r} as a pagedkv causal LM: {exc}") from exc
    except OSError as exc:
        raise ModelLoadError(f"cannot load the weights of model {model_path!r}: {exc}") from exc
    model.eval()  # type: ignore[no-untyped-call]
    # transformers decorates `to`; mypy mis-reads its signature.
    return model.to(device)  # type: ignore[arg-type]
