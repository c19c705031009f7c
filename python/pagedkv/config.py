"""Validated configuration, and the KV geometry of a model. No torch.

The engine's one configuration path: :class:`pagedkv.EngineArgs` (the user-facing flat
arguments) builds an :class:`EngineConfig` of three small frozen parts, each validating its own
fields when constructed (type, range and combination; a bad value raises
:class:`~pagedkv.errors.ConfigError` naming the field and the value):

- :class:`ModelConfig`: what to load and how to run it (model, tokenizer, dtype, device,
  max_model_len, attention backend, seed, trust_remote_code);
- :class:`CacheConfig`: the KV pool (block size, its size as ``num_blocks`` or a byte budget,
  prefix caching, KV dtype), the host-memory tier (``num_host_blocks`` / ``host_kv_cache_memory``
  / ``swap_space``) and the disk tier's folder;
- :class:`SchedulingConfig`: the per-step caps, the queue policy and the preemption mode.

:class:`pagedkv.worker.model_runner.ModelRunner` takes a ModelConfig, a CacheConfig and
(for the CUDA memory profile) a SchedulingConfig; the engine hands the scheduling part and the
runner's pool size to the Rust ``SchedulerConfig``.

Limits of the Rust core are checked here, before any model loads or tensor is allocated:
``block_size`` <= ``MAX_BLOCK_SIZE`` (4096) and ``num_blocks`` <= ``MAX_NUM_BLOCKS`` (2^24).
A byte budget (``kv_cache_memory``, or on CUDA ``gpu_memory_utilization``) that would give more
blocks is a ceiling, not a request: the runner clamps the pool to ``MAX_NUM_BLOCKS`` with a
``UserWarning``; a pool larger than the device's memory is refused (``ConfigError``) before it
is allocated.

:class:`KVGeometry` is what one token's KV costs in a model: the runner builds it from its
probe forward, ``pagedkv simulate`` (:mod:`pagedkv.sim.kv_budget`) from a ``config.json``.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

from pagedkv._core import MAX_BLOCK_SIZE, MAX_NUM_BLOCKS
from pagedkv.errors import ConfigError

__all__ = [
    "ATTENTION_BACKENDS",
    "DTYPES",
    "KV_CACHE_DTYPES",
    "KV_CACHE_SCALES",
    "KV_DTYPE_BYTES",
    "KV_SCALE_BYTES",
    "MAX_BLOCK_SIZE",
    "MAX_NUM_BLOCKS",
    "PREEMPTION_MODES",
    "CacheConfig",
    "EngineConfig",
    "KVGeometry",
    "ModelConfig",
    "SchedulingConfig",
    "SpeculativeConfig",
    "canonical_kv_cache_dtype",
    "check_pool_holds_one_request",
    "check_preemption_mode",
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
    name = _torch_name(value)
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


# Model dtypes the runner serves ("auto": bf16 on CUDA when supported, float32 on the CPU).
DTYPES = ("auto", "float32", "float", "float16", "half", "bfloat16")
ATTENTION_BACKENDS = (None, "auto", "triton", "cpu", "torch")
LINEAR_KERNELS = ("auto", "torch", "pagedkv", "onednn")
# Earlier names of linear kernels, still accepted: "default" was torch's products' name while
# they were the default.
_LINEAR_KERNEL_ALIASES = {"default": "torch"}
# Weight quantization applied when the model loads (None: the checkpoint's weights as they are;
# "auto": a GGUF model's own blocks on the CPU, else None; "none" is read as None).
QUANTIZATIONS = (None, "int8", "bf16", "gguf", "auto")
POLICIES = ("fcfs", "priority")
# What preemption does with a preempted branch's KV: drop it and recompute it later, copy it to
# the host tier and back ("swap"), or choose per preemption from the measured costs ("auto").
PREEMPTION_MODES = ("recompute", "swap", "auto")
_DEVICE = re.compile(r"^(auto|cpu|cuda)(:\d+)?$")


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


# ---------------------------------------------------------------- field checks


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_int(name: str, value: Any, *, optional: bool = False, maximum: int | None = None) -> None:
    if value is None and optional:
        return
    if not _is_int(value) or value < 1:
        raise ConfigError(f"{name} must be a positive int, got {value!r}")
    if maximum is not None and value > maximum:
        raise ConfigError(f"{name} must be at most {maximum} (the core's limit), got {value!r}")


def _bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be a bool, got {value!r}")


def _torch_name(value: Any) -> Any:
    """``torch.float16`` / ``torch.device("cuda:0")`` as their string names (no torch import)."""
    if isinstance(value, str) or value is None:
        return value
    text = str(value)
    if type(value).__module__ == "torch" or text.startswith("torch."):
        return text.removeprefix("torch.")
    return value


def check_preemption_mode(cache: CacheConfig, scheduling: SchedulingConfig) -> None:
    """``preemption_mode`` ``"swap"`` or ``"auto"`` needs a host tier to swap into."""
    if scheduling.preemption_mode != "recompute" and not cache.has_host_tier:
        raise ConfigError(
            f"preemption_mode={scheduling.preemption_mode!r} swaps KV to host memory, but there is no host tier "
            f"(num_host_blocks={cache.num_host_blocks!r}, host_kv_cache_memory={cache.host_kv_cache_memory!r}, "
            f"swap_space={cache.swap_space!r}): set num_host_blocks / host_kv_cache_memory / swap_space, "
            f"or use preemption_mode='recompute'"
        )


def check_pool_holds_one_request(
    num_blocks: int, block_size: int, max_model_len: int, detail: str = "", blocks_per_request: int | None = None
) -> None:
    """A pool that cannot hold one ``max_model_len`` request is refused: a lone request must
    always be able to run (and preemption must terminate). ``blocks_per_request``: the blocks
    (pages) such a request holds at most, when not one per ``block_size`` tokens (KV cache
    groups: ``SchedulerConfig.blocks_for_sequence``)."""
    capacity = num_blocks * block_size
    if blocks_per_request is not None:
        if num_blocks < blocks_per_request:
            raise ConfigError(
                f"the KV cache holds {num_blocks} pages{detail}, fewer than the {blocks_per_request} one request of "
                f"max_model_len = {max_model_len} tokens holds in its KV cache groups: raise kv_cache_memory / "
                f"num_blocks / gpu_memory_utilization, or lower max_model_len"
            )
        return
    if capacity < max_model_len:
        raise ConfigError(
            f"the KV cache holds {capacity} tokens ({num_blocks} blocks of {block_size}{detail}), fewer than one "
            f"request of max_model_len = {max_model_len} tokens: raise kv_cache_memory / num_blocks / "
            f"gpu_memory_utilization, or lower max_model_len"
        )


# ---------------------------------------------------------------- defaults chosen for the machine

# Pins ``enforce_eager`` where a ModelConfig leaves it None: "1" eager, "0" compiled. For a
# process that starts many short-lived engines (a test suite, a notebook) where compiling each
# would cost more than it saves; an explicit ``enforce_eager`` wins over it.
ENFORCE_EAGER_ENV_VAR = "PAGEDKV_ENFORCE_EAGER"
_TRUE_WORDS = ("1", "true", "yes", "on")
_FALSE_WORDS = ("0", "false", "no", "off")


def resolve_enforce_eager(enforce_eager: bool | None, device_type: str) -> bool:
    """Whether the engine runs eager: ``enforce_eager`` when it is set, else
    ``PAGEDKV_ENFORCE_EAGER`` when that is set, else compiled on the CPU (the compiled forward
    is saved, so only a machine's first start pays the compile) and eager on a GPU."""
    if enforce_eager is not None:
        return enforce_eager
    pinned = os.environ.get(ENFORCE_EAGER_ENV_VAR, "").strip().lower()
    if pinned in _TRUE_WORDS:
        return True
    if pinned in _FALSE_WORDS:
        return False
    if pinned:
        raise ConfigError(f"{ENFORCE_EAGER_ENV_VAR} must be 1 or 0 (or unset), got {pinned!r}")
    return device_type != "cpu"


def resolve_linear_kernel(linear_kernel: str, device_type: str, dtype_name: str, quantization: str | None) -> str:
    """The linear kernel ``linear_kernel`` means for a model of ``dtype_name`` (``"float32"``,
    ...) on ``device_type`` with ``quantization`` resolved: itself, or for ``"auto"`` pagedkv's
    kernel where it applies (float32 on the CPU, weights as loaded or GGUF blocks; it hands products of more than 32 rows to torch, the faster
    one there) and torch's products elsewhere."""
    if linear_kernel != "auto":
        return linear_kernel
    if device_type == "cpu" and dtype_name == "float32" and quantization in (None, "gguf"):
        return "pagedkv"  # with "gguf": the linears whose tensors are not in blocks
    return "torch"


# ---------------------------------------------------------------- the configs


@dataclass(frozen=True)
class ModelConfig:
    """What to load and how to run it.

    - ``model``: Hugging Face model id or folder, or ``"gemma-3-270m"`` (the embedded Gemma 3 270M);
      ``None`` = the embedded SmolLM2-135M-Instruct.
    - ``tokenizer``: tokenizer id or folder (default: the model's).
    - ``dtype``: ``"auto"`` (bf16 on CUDA when supported, float32 on the CPU), ``"float32"``,
      ``"float16"``, ``"bfloat16"`` (or ``"float"`` / ``"half"``, or a ``torch.dtype``).
    - ``device``: ``"auto"`` (CUDA if available), ``"cpu"``, ``"cuda"``, ``"cuda:N"`` (or a
      ``torch.device``).
    - ``max_model_len``: longest sequence (prompt + output); ``None`` = the model's declared
      context length. Above it the runner warns (``UserWarning``) and serves it anyway.
    - ``attention_backend``: ``"triton"``, ``"cpu"``, ``"torch"``, ``"auto"`` or ``None``
      (``PAGEDKV_ATTENTION_BACKEND`` if set, else Triton on CUDA and the Rust decode kernel +
      torch on the CPU); resolved once, when the runner is built.
    - ``seed``: seed of the global generator used by unseeded random sampling.
    - ``linear_kernel``: ``"auto"`` (the default: pagedkv's kernel for a float32 model on the
      CPU without ``quantization``, torch's products otherwise; :func:`resolve_linear_kernel`),
      ``"torch"`` (torch's matrix products: MKL on the CPU), ``"pagedkv"`` (CPU, float32:
      products of up to 32 rows through pagedkv's own kernel, which streams the weights faster
      than MKL at a decode step's few rows; :mod:`pagedkv.worker.cpu_linear`) or ``"onednn"``
      (CPU, float32: the linears through oneDNN with prepacked weights, which take twice the
      memory; :mod:`pagedkv.worker.onednn_linear`). Logits differ from torch's in the last bits
      with any but ``"torch"``.
    - ``quantization``: ``None`` (the weights as loaded), ``"int8"`` (CPU: every linear's
      weight stored as int8 with a float32 scale per output channel, multiplied by pagedkv's
      CPU kernel on float32 inputs; a quarter of the linears' memory and memory traffic;
      :mod:`pagedkv.worker.int8_linear`), ``"bf16"`` (CPU: every linear's weight stored as
      bfloat16, the rest of the model float32; half the linears' memory; with AVX512-BF16 the
      inputs are rounded to bfloat16 too; :mod:`pagedkv.worker.bf16_linear`), ``"gguf"`` (CPU,
      a GGUF model: the linears whose tensors are Q4_0, Q4_1, Q8_0 or Q4_K multiplied straight
      from those blocks, a fifth to a quarter of float32's memory traffic;
      :mod:`pagedkv.worker.gguf_linear`) or ``"auto"`` (``"gguf"`` for a GGUF model, a ``.gguf``
      file or an embedded model, on the CPU without tensor parallelism, else ``None``);
      ``"none"`` is ``None``. Default ``None``: a GGUF model runs dequantized to float32, which
      is still faster than its blocks at a batch of 16 (benches/RESULTS.md).
    - ``enforce_eager``: ``True`` runs the model op by op; ``False`` runs each step's forward
      under ``torch.compile``: one graph for every step size, compiled as the engine starts
      (about a minute for SmolLM2 on 2 cores, said in the log) and saved whole beside inductor's
      cache, so a later process loads it in a second or two, except with ``linear_kernel=
      "torch"``, whose frozen graph compiles at every start; on a GPU (Triton attention, no
      tensor parallelism), decode steps of up to ``min(max_num_seqs, 256)`` sequences replay
      CUDA graphs captured at start (:mod:`pagedkv.worker.decode_graphs`); logits not
      bit-identical to eager; :mod:`pagedkv.worker.compiled_forward`. ``None`` (the default):
      ``PAGEDKV_ENFORCE_EAGER`` if set (``1`` / ``0``), else compiled on the CPU and eager on a
      GPU (:func:`resolve_enforce_eager`).
    - ``max_logprobs``: the most log-probabilities a request may ask for per token
      (``SamplingParams.logprobs``; vLLM's default, 20): more is refused when it is added,
      before any work (the answer's size grows with it).
    """

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None
    attention_backend: str | None = None
    seed: int = 0
    trust_remote_code: bool = False
    max_logprobs: int = 20
    linear_kernel: str = "auto"
    quantization: str | None = None
    enforce_eager: bool | None = None

    def __post_init__(self) -> None:
        for name in ("model", "tokenizer"):
            value = getattr(self, name)
            if isinstance(value, os.PathLike):
                object.__setattr__(self, name, os.fspath(value))
            elif value is not None and not isinstance(value, str):
                raise ConfigError(f"{name} must be a model id or folder (str), got {value!r}")
        dtype = _torch_name(self.dtype)
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {DTYPES} or a torch.dtype of them, got {self.dtype!r}")
        object.__setattr__(self, "dtype", dtype)
        device = _torch_name(self.device)
        if not isinstance(device, str) or not _DEVICE.match(device) or device.startswith("auto:"):
            raise ConfigError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        object.__setattr__(self, "device", device)
        _positive_int("max_model_len", self.max_model_len, optional=True)
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError(
                f"attention_backend must be None, 'auto', 'triton', 'cpu' or 'torch', got {self.attention_backend!r}"
            )
        if self.attention_backend == "cpu" and device.startswith("cuda"):
            raise ConfigError(f"attention_backend 'cpu' runs on the CPU, but device is {device!r}")
        if not _is_int(self.seed):
            raise ConfigError(f"seed must be an int, got {self.seed!r}")
        _bool("trust_remote_code", self.trust_remote_code)
        if not _is_int(self.max_logprobs) or self.max_logprobs < 0:
            raise ConfigError(f"max_logprobs must be an int >= 0, got {self.max_logprobs!r}")
        if self.enforce_eager is not None:
            _bool("enforce_eager", self.enforce_eager)
        object.__setattr__(self, "linear_kernel", _LINEAR_KERNEL_ALIASES.get(self.linear_kernel, self.linear_kernel))
        if self.linear_kernel not in LINEAR_KERNELS:
            raise ConfigError(f"linear_kernel must be one of {LINEAR_KERNELS}, got {self.linear_kernel!r}")
        explicit_kernel = self.linear_kernel not in ("auto", "torch")
        if explicit_kernel and (device.startswith("cuda") or dtype not in ("auto", "float32", "float")):
            raise ConfigError(
                f"linear_kernel {self.linear_kernel!r} runs float32 linears on the CPU, but device is {device!r} "
                f"and dtype {dtype!r}"
            )
        if self.quantization == "none":
            object.__setattr__(self, "quantization", None)
        if self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        if self.quantization == "gguf" and device.startswith("cuda"):
            raise ConfigError(f"quantization 'gguf' runs pagedkv's CPU GGUF kernel, but device is {device!r}")
        if self.quantization in ("int8", "bf16"):
            if device.startswith("cuda"):
                raise ConfigError(
                    f"quantization {self.quantization!r} runs pagedkv's CPU linear kernel, but device is {device!r}"
                )
            if explicit_kernel:
                raise ConfigError(
                    f"quantization {self.quantization!r} has its own linears; it cannot be combined with linear_kernel "
                    f"{self.linear_kernel!r}"
                )


@dataclass(frozen=True)
class CacheConfig:
    """The KV pool: block size and size.

    - ``block_size``: tokens per KV block, a power of two in 8 .. ``MAX_BLOCK_SIZE`` (4096).
    - The pool size, at most one of ``num_blocks`` (explicit, 1 .. ``MAX_NUM_BLOCKS`` = 2^24)
      and ``kv_cache_memory`` (a byte budget); with neither, on CUDA the
      ``gpu_memory_utilization`` fraction of the device left after weights and the activation
      peak of a profiling forward, on the CPU 1 GiB. A budget is a ceiling: when it would
      give more than ``MAX_NUM_BLOCKS`` blocks, the pool is clamped to ``MAX_NUM_BLOCKS``
      (``UserWarning``). A pool larger than the device's memory is refused (``ConfigError``)
      before it is allocated.
    - ``enable_prefix_caching``: reuse the KV of shared prompt prefixes.
    - ``kv_cache_dtype``: ``"auto"`` (the model's dtype), ``"int8"``, ``"fp8"`` (=
      ``"fp8_e4m3"``), ``"fp8_e5m2"`` (or ``torch.int8`` / ``torch.float8_e4m3fn`` /
      ``torch.float8_e5m2``): quantized blocks with a bfloat16 scale per (token, KV head)
      computed when the token is stored (no calibration), ~4x (vs float32) or ~2x (vs 16-bit)
      the tokens in the same memory.
    - ``kv_cache_scales``: ``"dynamic"`` (those per-vector scales) or ``"checkpoint"`` (the
      model's static ``k_scale`` / ``v_scale`` tensors; an error if it has none).
    - The host tier (a second pool of blocks in host memory, for swap preemption and a
      host-memory prefix cache; host block ids 0 .. ``num_host_blocks``, their own id space), at
      most one of ``num_host_blocks`` (explicit, 0 .. ``MAX_NUM_BLOCKS``; 0 = no host tier),
      ``host_kv_cache_memory`` (a byte budget) and ``swap_space`` (a budget in GiB, vLLM's
      name); with none, no host tier. The runner turns a budget into blocks of the device
      pool's size in bytes (a budget below one block is a ``ConfigError``, one past
      ``MAX_NUM_BLOCKS`` blocks is clamped with a ``UserWarning``) and refuses a host pool
      larger than the host's available memory before allocating it.
    - ``kv_cache_dir``: folder of the disk tier (a ``str`` or path; created by the runner if
      missing, a ``ConfigError`` there if it is not a writable folder); ``None`` = no disk
      tier. ``kv_cache_dir_max_bytes``: the most bytes it may hold (a positive int; needs
      ``kv_cache_dir``; ``None`` = no limit).
    - ``enable_kv_cache_events``: the Rust core records which blocks enter and leave the prefix
      cache of every tier (``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``, vLLM's
      KV events), taken per step by ``LLMEngine.take_kv_events`` for KV-aware routers.
    - ``enable_kv_cache_groups``: a model whose layers do not all attend to the whole context
      (sliding windows, chunks) keeps its KV in KV cache groups (worker/kv_layout.py): the
      blocks a window has left behind go back to the pool. False: every layer whole.
    """

    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"
    kv_cache_scales: str = "dynamic"
    num_host_blocks: int | None = None
    host_kv_cache_memory: int | None = None
    swap_space: float | None = None
    kv_cache_dir: str | None = None
    kv_cache_dir_max_bytes: int | None = None
    enable_kv_cache_events: bool = False
    enable_kv_cache_groups: bool = True

    @property
    def has_host_tier(self) -> bool:
        """A host tier was asked for (its block count is resolved by the runner)."""
        return self.num_host_blocks != 0 and any(
            value is not None for value in (self.num_host_blocks, self.host_kv_cache_memory, self.swap_space)
        )

    def __post_init__(self) -> None:
        object.__setattr__(self, "kv_cache_dtype", canonical_kv_cache_dtype(self.kv_cache_dtype))
        if self.kv_cache_scales not in KV_CACHE_SCALES:
            raise ConfigError(f"kv_cache_scales must be one of {KV_CACHE_SCALES}, got {self.kv_cache_scales!r}")
        if self.kv_cache_scales == "checkpoint" and self.kv_cache_dtype == "auto":
            raise ConfigError(
                "kv_cache_scales='checkpoint' needs a quantized kv_cache_dtype ('int8', 'fp8_e4m3', 'fp8_e5m2'); "
                "kv_cache_dtype is 'auto'"
            )
        bs = self.block_size
        if not _is_int(bs) or bs < 8 or bs & (bs - 1) or bs > MAX_BLOCK_SIZE:
            raise ConfigError(f"block_size must be a power of two in 8 .. {MAX_BLOCK_SIZE}, got {bs!r}")
        _positive_int("num_blocks", self.num_blocks, optional=True, maximum=MAX_NUM_BLOCKS)
        if self.kv_cache_memory is not None and (not _is_int(self.kv_cache_memory) or self.kv_cache_memory < 1):
            raise ConfigError(f"kv_cache_memory must be a positive number of bytes, got {self.kv_cache_memory!r}")
        if self.num_blocks is not None and self.kv_cache_memory is not None:
            raise ConfigError(
                f"give the KV pool size as num_blocks or kv_cache_memory, not both "
                f"(got num_blocks={self.num_blocks!r}, kv_cache_memory={self.kv_cache_memory!r})"
            )
        gmu = self.gpu_memory_utilization
        if isinstance(gmu, bool) or not isinstance(gmu, (int, float)) or not 0.0 < gmu <= 1.0:
            raise ConfigError(f"gpu_memory_utilization must be a number in (0, 1], got {gmu!r}")
        _bool("enable_prefix_caching", self.enable_prefix_caching)
        _bool("enable_kv_cache_events", self.enable_kv_cache_events)
        _bool("enable_kv_cache_groups", self.enable_kv_cache_groups)
        self._check_host_tier()
        self._check_disk_tier()

    def _check_host_tier(self) -> None:
        nhb = self.num_host_blocks
        if nhb is not None and (not _is_int(nhb) or not 0 <= nhb <= MAX_NUM_BLOCKS):
            raise ConfigError(f"num_host_blocks must be an int in 0 .. {MAX_NUM_BLOCKS} (0: no host tier), got {nhb!r}")
        memory = self.host_kv_cache_memory
        if memory is not None and (not _is_int(memory) or memory < 1):
            raise ConfigError(f"host_kv_cache_memory must be a positive number of bytes, got {memory!r}")
        space = self.swap_space
        if space is not None and (
            isinstance(space, bool) or not isinstance(space, (int, float)) or not (math.isfinite(space) and space > 0)
        ):
            raise ConfigError(f"swap_space must be a positive number of GiB, got {space!r}")
        given = {
            name: value
            for name, value in (("num_host_blocks", nhb), ("host_kv_cache_memory", memory), ("swap_space", space))
            if value is not None
        }
        if len(given) > 1:
            detail = ", ".join(f"{name}={value!r}" for name, value in given.items())
            raise ConfigError(
                f"give the host tier size as one of num_host_blocks, host_kv_cache_memory or swap_space, "
                f"not several (got {detail})"
            )

    def _check_disk_tier(self) -> None:
        folder = self.kv_cache_dir
        if isinstance(folder, os.PathLike):
            folder = os.fspath(folder)
        if folder is not None and (not isinstance(folder, str) or not folder):
            raise ConfigError(f"kv_cache_dir must be a folder path (str or os.PathLike), got {self.kv_cache_dir!r}")
        object.__setattr__(self, "kv_cache_dir", folder)
        _positive_int("kv_cache_dir_max_bytes", self.kv_cache_dir_max_bytes, optional=True)
        if self.kv_cache_dir_max_bytes is not None and folder is None:
            raise ConfigError(
                f"kv_cache_dir_max_bytes={self.kv_cache_dir_max_bytes!r} limits the disk tier, but kv_cache_dir "
                f"is not set"
            )
        if folder is not None and not self.has_host_tier:
            raise ConfigError(
                f"kv_cache_dir={folder!r} is a disk tier below the host tier, but there is no host tier: "
                f"set num_host_blocks / host_kv_cache_memory / swap_space"
            )
        if folder is not None and not self.enable_prefix_caching:
            raise ConfigError("kv_cache_dir (the disk tier) holds prefix-cache blocks: it needs enable_prefix_caching")


@dataclass(frozen=True)
class SchedulingConfig:
    """Per-step caps, queue policy and preemption.

    - ``max_num_seqs`` sequences and ``max_num_batched_tokens`` tokens per step (the runner's
      CUDA memory profile runs one such step).
    - ``policy``: ``"fcfs"`` or ``"priority"``.
    - ``preemption_mode``: what happens to a preempted branch's KV: ``"recompute"`` (its
      blocks are freed and its tokens recomputed when it runs again), ``"swap"`` (its blocks
      are copied to the host tier and back), ``"auto"`` (per preemption, whichever the cost
      model finds cheaper, from the runner's measured swap bandwidth). ``"swap"`` and
      ``"auto"`` need a host tier (:class:`CacheConfig`; checked by :class:`EngineConfig`
      and the runner).
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    policy: str = "fcfs"
    preemption_mode: str = "recompute"

    def __post_init__(self) -> None:
        _positive_int("max_num_seqs", self.max_num_seqs)
        _positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        if self.policy not in POLICIES:
            raise ConfigError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.policy!r}")
        if not isinstance(self.preemption_mode, str) or self.preemption_mode not in PREEMPTION_MODES:
            raise ConfigError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")


EXECUTOR_BACKENDS = ("mp", "ray")


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism: ``tensor_parallel_size`` ranks each hold ``1 / N`` of every layer's
    attention heads, KV heads and MLP columns (``pagedkv.parallel``);
    ``distributed_executor_backend``: how the ranks other than the engine's own run (``"mp"``:
    local worker processes, the default; ``"ray"``: Ray actors in a placement group, on this
    node or others, the ``ray`` extra). ``timeout``: seconds any collective may take before the
    engine gives up on its workers."""

    tensor_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    timeout: float = 60.0

    def __post_init__(self) -> None:
        _positive_int("tensor_parallel_size", self.tensor_parallel_size)
        backend = self.distributed_executor_backend
        if backend is not None and backend not in EXECUTOR_BACKENDS:
            raise ConfigError(
                f"distributed_executor_backend must be one of {EXECUTOR_BACKENDS} or None, got {backend!r}"
            )
        if backend == "ray" and importlib.util.find_spec("ray") is None:
            raise ConfigError("distributed_executor_backend='ray' needs Ray: pip install 'pagedkv[ray]'")
        if isinstance(self.timeout, bool) or not isinstance(self.timeout, (int, float)) or not self.timeout > 0:
            raise ConfigError(f"the tensor-parallel timeout must be a number > 0, got {self.timeout!r}")


_C = TypeVar("_C")


def config_from_any(cls: type[_C], value: Any, name: str) -> _C:
    """A config dataclass from itself, a mapping of its fields, or that mapping's JSON text (a
    CLI flag); ConfigError naming ``name`` for bad JSON, another type or an unknown key."""
    if isinstance(value, cls):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ConfigError(f"{name} is not valid JSON: {exc}") from None
    if not isinstance(value, Mapping):
        raise ConfigError(f"{name} must be a dict or JSON object, got {type(value).__name__}")
    known = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(value) - known)
    if unknown:
        raise ConfigError(f"unknown {name} key(s) {unknown}; known: {sorted(known)}")
    return cls(**dict(value))


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """Structured outputs (JSON schemas, regexes, choices, grammars; ``pagedkv.structured``).

    - ``compile_timeout_s``: a request whose grammar is not compiled after this many seconds
      fails alone (the compile itself is bounded by llguidance's fuel limits).
    - ``max_cached_grammars``: compiled grammars kept for reuse, most recently used first.
    - ``compile_workers``: threads that compile grammars (off the engine thread).
    - ``max_queued_compiles``: compiles that may wait for a thread; a request that needs one more
      is refused at once (``OverloadedError``, a server's 503). A compile whose every request
      went away before a thread took it is dropped (``pagedkv.structured.compiler``).
    """

    compile_timeout_s: float = 30.0
    max_cached_grammars: int = 256
    compile_workers: int = 2
    max_queued_compiles: int = 32

    def __post_init__(self) -> None:
        timeout = self.compile_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ConfigError(f"structured_outputs_config: compile_timeout_s must be a number > 0, got {timeout!r}")
        _positive_int("structured_outputs_config: max_cached_grammars", self.max_cached_grammars)
        _positive_int("structured_outputs_config: compile_workers", self.compile_workers, maximum=64)
        _positive_int("structured_outputs_config: max_queued_compiles", self.max_queued_compiles)

    @classmethod
    def from_any(cls, value: Any) -> StructuredOutputsConfig:
        """From a StructuredOutputsConfig, a dict of its fields, its JSON text (the CLI flag), or
        None (the defaults)."""
        return cls() if value is None else config_from_any(cls, value, "structured_outputs_config")


# Speculative decoding: the proposers the core runs, and the ones vLLM users may name that are
# not built (refused by name, with what is supported).
SPECULATIVE_METHODS = ("ngram", "suffix", "draft_model")
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's ``speculative_config`` names; docs/architecture.md,
    "Speculative decoding").

    - ``method``: ``"ngram"`` (prompt lookup over the request's prompt and output) or
      ``"suffix"`` (suffix decoding: the longest suffix matched in the request's tokens and in
      recent requests' outputs, a variable number of drafts by continuation frequency), both in
      the Rust core; or ``"draft_model"``: a smaller model (``model``: its id or folder) with
      the target's vocabulary, on its own paged KV (:mod:`pagedkv.engine.draft_model`).
    - ``num_speculative_tokens``: most tokens drafted per sequence and step, 1 .. 16.
    - ``prompt_lookup_min`` / ``prompt_lookup_max``: the shortest and longest suffix of the
      sequence looked up (``ngram``; defaults 2 and 5, or the one given when only one is).
    - ``suffix_decoding_max_tree_depth`` (24), ``suffix_decoding_max_spec_factor`` (1.0: drafts
      at most the match length), ``suffix_decoding_min_token_prob`` (0.1: stop drafting when
      the draft's estimated probability falls below), ``suffix_decoding_max_cached_requests``
      (1000 recent outputs matched; 0: the request's own tokens only): ``suffix`` only.
    - ``adaptive``: let the step-time model draft fewer tokens, down to none, where drafts
      would not pay (large batches); off: always draft what the proposer finds.
    """

    num_speculative_tokens: int | None = None
    method: str = "ngram"
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    adaptive: bool = True
    suffix_decoding_max_tree_depth: int | None = None
    suffix_decoding_max_spec_factor: float | None = None
    suffix_decoding_min_token_prob: float | None = None
    suffix_decoding_max_cached_requests: int | None = None
    model: str | None = None

    def __post_init__(self) -> None:
        name = "speculative_config"
        if self.method not in SPECULATIVE_METHODS:
            raise ConfigError(
                f"{name}: method {self.method!r} is not supported; supported: {list(SPECULATIVE_METHODS)}"
            )
        if self.num_speculative_tokens is None:
            raise ConfigError(f"{name}: num_speculative_tokens is required (1 .. {MAX_SPECULATIVE_TOKENS})")
        k = self.num_speculative_tokens
        if not _is_int(k) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ConfigError(
                f"{name}: num_speculative_tokens must be an int in 1 .. {MAX_SPECULATIVE_TOKENS}, got {k!r}"
            )
        _bool(f"{name}: adaptive", self.adaptive)
        if (self.method == "draft_model") != (self.model is not None):
            raise ConfigError(
                f"{name}: method 'draft_model' needs model (the draft model's id or folder)"
                if self.model is None
                else f"{name}: model applies to method 'draft_model', not {self.method!r}"
            )
        if self.model is not None and (not isinstance(self.model, str) or not self.model):
            raise ConfigError(f"{name}: model must be a model id or folder, got {self.model!r}")
        if self.method == "suffix":
            self._check_suffix(name)
            return
        suffix_set = [
            f.name for f in fields(self) if f.name.startswith("suffix_") and getattr(self, f.name) is not None
        ]
        if suffix_set:
            raise ConfigError(f"{name}: {suffix_set} apply to method 'suffix', not {self.method!r}")
        if self.method == "draft_model":
            if self.prompt_lookup_min is not None or self.prompt_lookup_max is not None:
                raise ConfigError(f"{name}: prompt_lookup_min / prompt_lookup_max apply to method 'ngram'")
            return
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        _positive_int(f"{name}: prompt_lookup_min", lo, optional=True, maximum=64)
        _positive_int(f"{name}: prompt_lookup_max", hi, optional=True, maximum=64)
        if lo is None:
            lo = 2 if hi is None else min(2, hi)
        if hi is None:
            hi = max(5, lo)
        if lo > hi:
            raise ConfigError(f"{name}: prompt_lookup_min ({lo}) must not exceed prompt_lookup_max ({hi})")
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)

    def _check_suffix(self, name: str) -> None:
        if self.prompt_lookup_min is not None or self.prompt_lookup_max is not None:
            raise ConfigError(f"{name}: prompt_lookup_min / prompt_lookup_max apply to method 'ngram', not 'suffix'")
        depth = 24 if self.suffix_decoding_max_tree_depth is None else self.suffix_decoding_max_tree_depth
        _positive_int(f"{name}: suffix_decoding_max_tree_depth", depth, maximum=256)
        if depth < 2:
            raise ConfigError(f"{name}: suffix_decoding_max_tree_depth must be >= 2, got {depth}")
        factor = 1.0 if self.suffix_decoding_max_spec_factor is None else self.suffix_decoding_max_spec_factor
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor < math.inf:
            raise ConfigError(f"{name}: suffix_decoding_max_spec_factor must be a number > 0, got {factor!r}")
        prob = 0.1 if self.suffix_decoding_min_token_prob is None else self.suffix_decoding_min_token_prob
        if isinstance(prob, bool) or not isinstance(prob, (int, float)) or not 0.0 <= prob <= 1.0:
            raise ConfigError(f"{name}: suffix_decoding_min_token_prob must be in [0, 1], got {prob!r}")
        cached = 1000 if self.suffix_decoding_max_cached_requests is None else self.suffix_decoding_max_cached_requests
        if not _is_int(cached) or not 0 <= cached <= 1_000_000:
            raise ConfigError(
                f"{name}: suffix_decoding_max_cached_requests must be an int in 0 .. 1000000, got {cached!r}"
            )
        for field_name, value in (
            ("suffix_decoding_max_tree_depth", depth),
            ("suffix_decoding_max_spec_factor", float(factor)),
            ("suffix_decoding_min_token_prob", float(prob)),
            ("suffix_decoding_max_cached_requests", cached),
        ):
            object.__setattr__(self, field_name, value)

    @classmethod
    def from_any(cls, value: Any) -> SpeculativeConfig | None:
        """From a SpeculativeConfig, a dict of its fields, its JSON text (the CLI flag), or None
        (speculative decoding off)."""
        return None if value is None else config_from_any(cls, value, "speculative_config")


@dataclass(frozen=True)
class EngineConfig:
    """The three parts together, with the checks that span them."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduling: SchedulingConfig = field(default_factory=SchedulingConfig)
    # KV transfer between engines (pagedkv.distributed.transfer_config.KVTransferConfig), or None.
    kv_transfer: Any = None
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    structured_outputs: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    speculative: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        for name, cls in (
            ("model", ModelConfig),
            ("cache", CacheConfig),
            ("scheduling", SchedulingConfig),
            ("parallel", ParallelConfig),
            ("structured_outputs", StructuredOutputsConfig),
        ):
            if not isinstance(getattr(self, name), cls):
                raise ConfigError(f"{name} must be a {cls.__name__}, got {type(getattr(self, name)).__name__}")
        # Known before anything loads when both are explicit; otherwise checked once the
        # runner has sized the pool.
        if self.cache.num_blocks is not None and self.model.max_model_len is not None:
            check_pool_holds_one_request(self.cache.num_blocks, self.cache.block_size, self.model.max_model_len)
        check_preemption_mode(self.cache, self.scheduling)
        if self.speculative is not None and not isinstance(self.speculative, SpeculativeConfig):
            raise ConfigError(f"speculative must be a SpeculativeConfig, got {type(self.speculative).__name__}")
