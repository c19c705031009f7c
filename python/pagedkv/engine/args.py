"""Engine arguments, with vLLM's names (``LLM(model=..., **engine_args)``)."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any

from pagedkv.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulingConfig,
    SpeculativeConfig,
    StructuredOutputsConfig,
)
from pagedkv.distributed.transfer_config import KVTransferConfig
from pagedkv.errors import ConfigError
from pagedkv.sizes import as_byte_count

__all__ = ["BYTE_SIZE_FIELDS", "EngineArgs"]

# The fields that are byte counts: an int, or a size string ("8GiB", "512MiB", "1.5GB", "4096").
BYTE_SIZE_FIELDS = ("kv_cache_memory", "host_kv_cache_memory", "kv_cache_dir_max_bytes")


@dataclass
class EngineArgs:
    """Everything needed to build an engine: the model, its KV cache, and the scheduler.

    - ``model``: Hugging Face model id or folder, or ``"gemma-3-270m"`` (the embedded Gemma 3 270M);
      ``None`` = the embedded SmolLM2-135M-Instruct.
    - ``tokenizer``: tokenizer id or folder (default: the model's).
    - ``dtype``: ``"auto"`` (bf16 on CUDA when supported, float32 on the CPU), ``"float32"``,
      ``"float16"``, ``"bfloat16"``.
    - ``device``: ``"auto"`` (CUDA if available), ``"cuda"``, ``"cuda:N"``, ``"cpu"``.
    - ``block_size``: tokens per KV block (power of two, 8 .. 4096).
    - ``num_blocks`` / ``kv_cache_memory`` (bytes, or a size such as ``"512MiB"``) /
      ``gpu_memory_utilization``: KV pool size
      (explicit blocks up to 2^24, a byte budget, or on CUDA a fraction of the device after
      profiling; not both ``num_blocks`` and ``kv_cache_memory``). A budget is a ceiling: past
      2^24 blocks the pool is clamped with a warning; a pool larger than the device's memory
      is refused before it is allocated.
    - ``max_model_len``: longest sequence (prompt + output); default: the model's context length
      (a larger value warns).
    - ``max_num_seqs``, ``max_num_batched_tokens``: per-step caps of the scheduler.
    - ``enable_prefix_caching``: reuse the KV of shared prompt prefixes.
    - ``kv_cache_dtype``: ``"auto"`` (the model's dtype), ``"int8"``, ``"fp8"`` / ``"fp8_e4m3"``,
      ``"fp8_e5m2"``: quantized KV blocks, a bfloat16 scale per (token, KV head) computed as
      each token is stored (no calibration); the same memory holds ~3.9x the tokens of a
      float32 cache (head_dim 64). ``kv_cache_scales="checkpoint"`` uses the checkpoint's
      static ``k_scale`` / ``v_scale`` instead.
    - ``num_host_blocks`` / ``host_kv_cache_memory`` (bytes or a size) / ``swap_space`` (GiB): size of
      the host-memory KV tier (at most one; ``num_host_blocks=0`` or none of them: no host
      tier). A budget is turned into blocks of the device pool's size in bytes by the runner
      (less than one block is an error); a host pool larger than the host's available memory
      is refused before it is allocated.
    - ``preemption_mode``: ``"recompute"`` (drop a preempted request's KV, recompute it
      later), ``"swap"`` (copy it to the host tier and back) or ``"auto"`` (the cheaper of the
      two per preemption, from the measured swap bandwidth); ``"swap"`` and ``"auto"`` need a
      host tier.
    - ``kv_cache_dir``: folder of the disk KV tier (created if missing; must be writable);
      ``kv_cache_dir_max_bytes``: the most bytes it may hold (default: no limit).
    - ``enable_kv_cache_events``: record the prefix cache's block events for KV-aware routers
      (``LLMEngine.take_kv_events``; ``pagedkv serve --kv-events-endpoint`` publishes them).
    - ``disable_hybrid_kv_cache_manager``: keep every layer's KV whole even when the model has
      sliding-window or chunked layers (vLLM's name; by default such a model's KV is kept in
      KV cache groups, which give back the blocks a window has left behind). KV transfer
      between engines (``kv_transfer_config``) carries the groups (both engines must agree).
    - ``scheduling_policy``: ``"fcfs"`` or ``"priority"``.
    - ``attention_backend``: ``"triton"``, ``"cpu"``, ``"torch"`` or ``None`` (Triton on CUDA,
      the Rust decode kernel + torch on the CPU).
    - ``seed``: seed of the global generator used by unseeded random sampling.
    - ``trust_remote_code``: run the Python code a model repository ships (transformers'
      option of the same name); only for repositories you trust.
    - ``linear_kernel``: ``"auto"`` (pagedkv's kernel for a float32 model on the CPU without
      ``quantization``, torch's products otherwise), ``"torch"`` (torch's matrix products),
      ``"pagedkv"`` (CPU, float32: products of up to 32 rows, i.e. decode steps, through
      pagedkv's own kernel, which streams the weights faster) or ``"onednn"`` (CPU, float32:
      oneDNN with prepacked weights, which take twice the memory). Logits differ from torch's
      in the last bits with any but ``"torch"``. Default: auto.
    - ``quantization``: ``None`` (the weights as loaded), ``"int8"`` (CPU: the linears' weights
      as int8 with a scale per output channel, a quarter of their memory, multiplied by
      pagedkv's kernel on float32 inputs; quality in benches/RESULTS.md), ``"bf16"`` (CPU: the
      linears' weights as bfloat16, half their memory, the rest float32; with AVX512-BF16 the
      kernel rounds the inputs to bfloat16 too), ``"gguf"`` (CPU, a GGUF model: its Q4_0 / Q4_1
      / Q8_0 / Q4_K linears multiplied straight from the file's blocks) or ``"auto"``
      (``"gguf"`` for a GGUF model, a ``.gguf`` file or an embedded model, on the CPU, else the
      weights as loaded); ``"none"`` is ``None``, the default (a GGUF model dequantized to float32).
    - ``enforce_eager``: run the model op by op (``--enforce-eager``), or not
      (``--no-enforce-eager``: each step's forward under ``torch.compile``, compiled as the
      engine starts, about a minute on a 2-core CPU the first time, and saved on disk, so the
      next start loads it in a second or two; on a GPU, decode steps of up to 256 sequences
      replay CUDA graphs captured at start; logits not bit-identical to eager). Default:
      compiled on the CPU, eager on a GPU; the environment variable ``PAGEDKV_ENFORCE_EAGER``
      (1 or 0) sets it for every engine that does not say.
    - ``max_logprobs``: the most log-probabilities a request may ask for per token (vLLM's
      default, 20); a request asking for more is refused when it is added.
    - ``tensor_parallel_size``, ``distributed_executor_backend``: split every layer's attention
      heads, KV heads and MLP over N ranks (N processes on the CPU, N devices on CUDA; the
      heads and KV heads must divide by N), run as ``"mp"`` (local worker processes, the
      default) or ``"ray"`` (Ray actors placed by a placement group, for several nodes; the
      ``ray`` extra).
    - ``kv_transfer_config``: take part in disaggregated prefill / decode (a
      :class:`~pagedkv.distributed.transfer_config.KVTransferConfig`, a dict, or its JSON text,
      e.g. ``{"role": "consumer", "transport": "nixl"}``); requests then accept
      ``kv_transfer_params``.
    - ``structured_outputs_config``: a dict, its JSON text, or a
      :class:`~pagedkv.config.StructuredOutputsConfig`, of ``compile_timeout_s`` (30), ``max_cached_grammars`` (256), ``compile_workers`` (2): how
      requests' JSON schemas and grammars are compiled (``SamplingParams.structured_outputs``).
    - ``speculative_config``: a dict, its JSON text, or a
      :class:`~pagedkv.config.SpeculativeConfig`: speculative decoding, e.g. ``{"method":
      "ngram", "num_speculative_tokens": 4}`` (None: off).

    Every value is checked when the arguments are built (:meth:`create_engine_config`, called
    by ``__post_init__``): a bad one raises :class:`~pagedkv.errors.ConfigError` naming the
    field and the value, before any model loads.
    """

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory: int | str | None = None
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"
    kv_cache_scales: str = "dynamic"
    num_host_blocks: int | None = None
    host_kv_cache_memory: int | str | None = None
    swap_space: float | None = None
    preemption_mode: str = "recompute"
    kv_cache_dir: str | None = None
    kv_cache_dir_max_bytes: int | str | None = None
    enable_kv_cache_events: bool = False
    disable_hybrid_kv_cache_manager: bool = False
    scheduling_policy: str = "fcfs"
    attention_backend: str | None = None
    seed: int = 0
    trust_remote_code: bool = False
    max_logprobs: int = 20
    linear_kernel: str = "auto"
    quantization: str | None = None
    enforce_eager: bool | None = None
    tensor_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    kv_transfer_config: KVTransferConfig | None = None
    structured_outputs_config: StructuredOutputsConfig | None = None
    speculative_config: SpeculativeConfig | None = None

    @classmethod
    def from_kwargs(cls, model: str | None = None, **kwargs: Any) -> EngineArgs:
        """`EngineArgs(model=..., **kwargs)` with a clear error for unknown names."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ConfigError(f"unknown engine argument(s) {unknown}; known: {sorted(known)}")
        return cls(model=model, **kwargs)

    def __post_init__(self) -> None:
        for name in ("model", "tokenizer", "kv_cache_dir"):
            if isinstance(getattr(self, name), os.PathLike):
                setattr(self, name, os.fspath(getattr(self, name)))
        if self.kv_transfer_config is not None:
            self.kv_transfer_config = KVTransferConfig.from_any(self.kv_transfer_config)
        self.structured_outputs_config = StructuredOutputsConfig.from_any(self.structured_outputs_config)
        self.speculative_config = SpeculativeConfig.from_any(self.speculative_config)
        for name in BYTE_SIZE_FIELDS:  # "8GiB" -> bytes, once
            setattr(self, name, as_byte_count(getattr(self, name), name))
        self.create_engine_config()

    def create_engine_config(self) -> EngineConfig:
        """The validated configuration (:mod:`pagedkv.config`) these arguments describe."""
        return EngineConfig(
            model=ModelConfig(
                model=self.model,
                tokenizer=self.tokenizer,
                dtype=self.dtype,
                device=self.device,
                max_model_len=self.max_model_len,
                attention_backend=self.attention_backend,
                seed=self.seed,
                trust_remote_code=self.trust_remote_code,
                max_logprobs=self.max_logprobs,
                linear_kernel=self.linear_kernel,
                quantization=self.quantization,
                enforce_eager=self.enforce_eager,
            ),
            cache=CacheConfig(
                block_size=self.block_size,
                num_blocks=self.num_blocks,
                kv_cache_memory=as_byte_count(self.kv_cache_memory, "kv_cache_memory"),
                gpu_memory_utilization=self.gpu_memory_utilization,
                enable_prefix_caching=self.enable_prefix_caching,
                kv_cache_dtype=self.kv_cache_dtype,
                kv_cache_scales=self.kv_cache_scales,
                num_host_blocks=self.num_host_blocks,
                host_kv_cache_memory=as_byte_count(self.host_kv_cache_memory, "host_kv_cache_memory"),
                swap_space=self.swap_space,
                kv_cache_dir=self.kv_cache_dir,
                kv_cache_dir_max_bytes=as_byte_count(self.kv_cache_dir_max_bytes, "kv_cache_dir_max_bytes"),
                enable_kv_cache_events=self.enable_kv_cache_events,
                enable_kv_cache_groups=not self.disable_hybrid_kv_cache_manager,
            ),
            scheduling=SchedulingConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens,
                policy=self.scheduling_policy,
                preemption_mode=self.preemption_mode,
            ),
            kv_transfer=self.kv_transfer_config,
            parallel=ParallelConfig(
                tensor_parallel_size=self.tensor_parallel_size,
                distributed_executor_backend=self.distributed_executor_backend,
            ),
            structured_outputs=StructuredOutputsConfig.from_any(self.structured_outputs_config),
            speculative=SpeculativeConfig.from_any(self.speculative_config),
        )
