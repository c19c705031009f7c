"""Engine arguments, with vLLM's names (``LLM(model=..., **engine_args)``)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from pagedkv.errors import ConfigError

__all__ = ["EngineArgs"]


@dataclass
class EngineArgs:
    """Everything needed to build an engine: the model, its KV cache, and the scheduler.

    - ``model``: Hugging Face model id or folder; ``None`` = the embedded SmolLM2-135M-Instruct.
    - ``tokenizer``: tokenizer id or folder (default: the model's).
    - ``dtype``: ``"auto"`` (bf16 on CUDA when supported, float32 on the CPU), ``"float32"``,
      ``"float16"``, ``"bfloat16"``.
    - ``device``: ``"auto"`` (CUDA if available), ``"cuda"``, ``"cpu"``.
    - ``block_size``: tokens per KV block (power of two >= 8).
    - ``num_blocks`` / ``kv_cache_memory`` (bytes) / ``gpu_memory_utilization``: KV pool size
      (explicit blocks, a byte budget, or on CUDA a fraction of the device after profiling).
    - ``max_model_len``: longest sequence (prompt + output); default: the model's context length.
    - ``max_num_seqs``, ``max_num_batched_tokens``: per-step caps of the scheduler.
    - ``enable_prefix_caching``: reuse the KV of shared prompt prefixes.
    - ``scheduling_policy``: ``"fcfs"`` or ``"priority"``.
    - ``attention_backend``: ``"triton"``, ``"cpu"``, ``"torch"`` or ``None`` (Triton on CUDA,
      the Rust decode kernel + torch on the CPU).
    - ``seed``: seed of the global generator used by unseeded random sampling.
    """

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"
    attention_backend: str | None = None
    seed: int = 0
    trust_remote_code: bool = False

    @classmethod
    def from_kwargs(cls, model: str | None = None, **kwargs: Any) -> EngineArgs:
        """`EngineArgs(model=..., **kwargs)` with a clear error for unknown names."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ConfigError(f"unknown engine argument(s) {unknown}; known: {sorted(known)}")
        return cls(model=model, **kwargs)

    def __post_init__(self) -> None:
        if self.model is not None and not isinstance(self.model, str):
            self.model = str(self.model)  # os.PathLike
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ConfigError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        if self.max_num_batched_tokens is not None and (
            not isinstance(self.max_num_batched_tokens, int) or self.max_num_batched_tokens < 1
        ):
            raise ConfigError(f"max_num_batched_tokens must be a positive int, got {self.max_num_batched_tokens!r}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ConfigError(f"enable_prefix_caching must be a bool, got {self.enable_prefix_caching!r}")
        if not isinstance(self.seed, int):
            raise ConfigError(f"seed must be an int, got {self.seed!r}")
