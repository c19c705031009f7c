"""``ModelRunner``: a transformers causal LM running on pagedkv's paged KV cache.

One step = one packed forward. The scheduler's ``SchedulerOutput`` (docs/architecture.md,
Step output) already holds the batch as flat arrays; the runner

0. builds the step's attention metadata once (:meth:`pagedkv.kernels.AttentionBackend.prepare`:
   index tensors converted, validated on the host, moved to the device, host facts such as the
   longest query chunk recorded) — every layer reuses it,
1. runs the step's copies between the tiers — ``disk_store`` (host → disk), ``swap_out``
   (device → host), ``disk_load`` (disk → host), ``swap_in`` (host → device):
   :class:`pagedkv.worker.host_cache.HostKVCache`, :class:`pagedkv.worker.disk_cache.DiskKVStore`
   — then copies whole blocks for
   its copy-on-write ops (all layers, K and V, in one indexed copy: the per-layer caches are
   views of one tensor ``[L, 2, num_blocks, block_size, Hkv, D]``),
2. runs the model once over all ``T`` scheduled tokens as a single sequence (``input_ids`` and
   ``position_ids`` of shape ``[1, T]``, no transformers cache), handing the step metadata to
   pagedkv's attention function as the keyword argument ``pagedkv_context``
   (:mod:`pagedkv.worker.attention_backend`), and
3. computes the LM head only on the rows in ``logits_indices`` (the model's own
   ``logits_to_keep`` argument, given as an index tensor: no ``[T, V]`` logits for a long
   prefill, and the model's own logit post-processing such as soft-capping still applies).

It returns float32 logits ``[S, V]``, one row per sampled sequence, in ``logits_indices`` order.

Configuration: ``ModelRunner(ModelConfig(...), CacheConfig(...), SchedulingConfig(...))``
(:mod:`pagedkv.config`, validated when built; :class:`pagedkv.EngineArgs` makes them).

KV cache dtype (``CacheConfig.kv_cache_dtype``): ``"auto"`` stores K/V in the model's dtype; a
quantized format (``"int8"``, ``"fp8_e4m3"``, ``"fp8_e5m2"``) stores the data in one byte per
value plus a bfloat16 scale per (token, KV head) (:mod:`pagedkv.kernels.kv_quant`), in a second
tensor ``[L, 2, num_blocks, block_size, Hkv]`` addressed by the same block ids, so copy-on-write
copies both. The pool size follows the bytes per block of the chosen dtype.

KV cache size: an explicit ``num_blocks``; else on CUDA what ``gpu_memory_utilization`` of the
device leaves after the weights and the activation peak of a profiling forward over
``max_num_batched_tokens`` tokens; else ``kv_cache_memory`` bytes (CPU default 1 GiB). A budget
worth more than ``MAX_NUM_BLOCKS`` blocks is clamped to it (``UserWarning``); a pool larger
than the device's free memory is refused (``ConfigError``) before it is allocated.

Host tier (``CacheConfig.num_host_blocks`` / ``host_kv_cache_memory`` / ``swap_space``): a
second pool ``[L, 2, num_host_blocks, block_size, Hkv, D]`` (and its scales) in host memory,
pinned on CUDA, with its own block ids; a budget is divided by ``bytes_per_block`` (less than
one block: ``ConfigError``; more than ``MAX_NUM_BLOCKS``: clamped with a ``UserWarning``); a
host pool larger than the host's available memory is refused before it is allocated.

Disk tier (``CacheConfig.kv_cache_dir``, needs the host tier and prefix caching): one file per
cached block in a subfolder named by the model/layout fingerprint, at most
``kv_cache_dir_max_bytes`` (default 4 GiB, capped by the disk's free space; less than one file:
``ConfigError``) (:mod:`pagedkv.worker.disk_cache`).
"""

from __future__ import annotations

import inspect
import logging
import os
import shutil
import sys
import time
import warnings
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

import pagedkv.kernels as kernels
from pagedkv.config import (
    MAX_NUM_BLOCKS,
    CacheConfig,
    KVGeometry,
    ModelConfig,
    SchedulingConfig,
    check_preemption_mode,
    resolve_enforce_eager,
    resolve_linear_kernel,
)
from pagedkv.errors import ConfigError, EngineDeadError, InvalidArgumentError, ModelLoadError, UnsupportedModelError
from pagedkv.kernels.kv_quant import SCALE_DTYPE, KVScales, byte_view, key_rotation, kv_format
from pagedkv.kernels.layer_attention import LayerAttention
from pagedkv.parallel.group import TPGroup
from pagedkv.parallel.sharding import check_tensor_parallel_size, shard_model
from pagedkv.parallel.spec import TPSpec
from pagedkv.parallel.step_broadcast import send_step
from pagedkv.worker.attention_backend import (
    ATTENTION_NAME,
    CONTEXT_KWARG,
    PagedAttentionContext,
    ProbeContext,
    ProfileContext,
    register_pagedkv_attention,
)
from pagedkv.worker.bf16_linear import use_bf16_linears
from pagedkv.worker.checkpoint_scales import load_checkpoint_kv_scales
from pagedkv.worker.compiled_forward import CompiledForward
from pagedkv.worker.cpu_linear import LinearSwitch, use_pagedkv_linears
from pagedkv.worker.decode_graphs import DecodeGraphs, capture_sizes
from pagedkv.worker.disk_cache import DiskKVStore, disk_fingerprint
from pagedkv.worker.gguf_blocks import has_gguf_blocks, load_gguf_blocks
from pagedkv.worker.gguf_linear import use_gguf_linears
from pagedkv.worker.head_rows import HeadSplit, HiddenRows
from pagedkv.worker.host_cache import HostKVCache
from pagedkv.worker.int8_linear import use_int8_linears
from pagedkv.worker.kv_layout import KVLayout
from pagedkv.worker.model_files import resolve_model
from pagedkv.worker.model_support import check_config, check_probe, context_length_of, layer_attentions
from pagedkv.worker.onednn_linear import use_onednn_linears

__all__ = ["ModelRunner", "DEFAULT_CPU_KV_CACHE_MEMORY", "load_model_config"]

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_CACHE_MEMORY = 1 << 30  # 1 GiB
_PROBE_TOKENS = 5
_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}


class ModelRunner:
    """Loads a causal LM, owns its paged KV cache, and runs one packed forward per step.

    ``ModelRunner(model_config, cache_config=None, scheduling_config=None)``: the validated
    configuration of :mod:`pagedkv.config` (defaults: ``CacheConfig()``, ``SchedulingConfig()``;
    the scheduling caps size the CUDA memory profile).

    Public attributes after construction: ``model``, ``model_path`` (what ``from_pretrained``
    got; load the tokenizer from it), ``device``, ``dtype``, ``block_size``, ``num_blocks``,
    ``geometry`` (:class:`pagedkv.config.KVGeometry`), ``layer_attention`` (per layer its
    :class:`~pagedkv.kernels.LayerAttention`: window, chunk, soft-cap, sinks), ``bytes_per_block`` (K and V of all
    layers), ``kv_cache_bytes``, ``num_layers``, ``num_heads``, ``num_kv_heads``, ``head_dim``,
    ``vocab_size``, ``max_model_len``, ``backend`` (the :class:`pagedkv.kernels.AttentionBackend`,
    resolved once) and its name ``attention_backend``, ``kv_caches`` (per layer
    ``(key_cache, value_cache)``, each ``[num_blocks, block_size, num_kv_heads, head_dim]``),
    ``kv_cache_dtype`` (the cache's torch dtype), ``kv_format`` (its quantized format, or None),
    ``kv_scales`` (per layer :class:`~pagedkv.kernels.KVScales` of a quantized cache, else None),
    ``eos_token_ids``; the host tier: ``num_host_blocks`` (0: none), ``host_kv_cache_bytes``,
    ``host_kv_cache`` ``[L, 2, num_host_blocks, block_size, num_kv_heads, head_dim]`` and
    ``host_kv_scale_cache`` ``[L, 2, num_host_blocks, block_size, num_kv_heads]`` (a quantized
    cache's scales, else None) on the CPU (None when there is no tier), ``host_cache`` (the
    :class:`~pagedkv.worker.host_cache.HostKVCache` that owns them and runs the swaps, or
    None); ``kv_cache_dir`` (the disk tier's folder, created and checked writable, or None),
    ``disk_cache`` (its :class:`~pagedkv.worker.disk_cache.DiskKVStore`, or None) and
    ``num_disk_blocks`` (its slots; 0: none).

    Per step: :meth:`execute`; also :meth:`copy_blocks`, :meth:`swap_blocks` and
    :meth:`measure_swap_bandwidth` (for the scheduler's swap-or-recompute cost model).
    """

    def __init__(
        self,
        model_config: ModelConfig | None = None,
        cache_config: CacheConfig | None = None,
        scheduling_config: SchedulingConfig | None = None,
        *,
        tp: TPSpec | None = None,
    ) -> None:
        model_config = ModelConfig() if model_config is None else model_config
        cache_config = CacheConfig() if cache_config is None else cache_config
        scheduling_config = SchedulingConfig() if scheduling_config is None else scheduling_config
        for name, value, cls in (
            ("model_config", model_config, ModelConfig),
            ("cache_config", cache_config, CacheConfig),
            ("scheduling_config", scheduling_config, SchedulingConfig),
        ):
            if not isinstance(value, cls):
                raise ConfigError(f"{name} must be a pagedkv.config.{cls.__name__}, got {type(value).__name__}")
        self.model_config, self.cache_config, self.scheduling_config = model_config, cache_config, scheduling_config
        check_preemption_mode(cache_config, scheduling_config)

        self.device = _resolve_device(model_config.device)
        # Tensor parallelism (pagedkv.parallel): this rank's group, joined below; rank 0 also
        # broadcasts every step it executes. A failure after a broadcast breaks the group.
        self.tp_group: TPGroup | None = None
        self.tp_failed: BaseException | None = None
        self.kv_cache_dir = _prepare_kv_cache_dir(cache_config.kv_cache_dir)
        self.block_size = block_size = cache_config.block_size
        self.model_path = resolve_model(model_config.model)
        register_pagedkv_attention()
        _resolve_backend(self.device, model_config.attention_backend)  # fail fast, before the weights load

        config = _load_config(self.model_path, model_config.trust_remote_code)
        text_config = config.get_text_config()
        max_model_len = model_config.max_model_len
        declared_len = context_length_of(text_config)
        # Unsupported features first: they matter more than a missing context length.
        check_config(
            text_config, max_model_len or declared_len or sys.maxsize, scheduling_config.max_num_batched_tokens
        )
        if max_model_len is None:
            if declared_len is None:
                raise ConfigError(f"the config of {self.model_path!r} declares no context length; pass max_model_len")
            max_model_len = declared_len
        elif declared_len is not None and max_model_len > declared_len:
            warnings.warn(
                f"max_model_len = {max_model_len} is above the context length the model declares "
                f"({declared_len}); positions past {declared_len} are outside what it was trained for",
                UserWarning,
                stacklevel=2,
            )
        self.max_model_len = max_model_len
        if tp is not None:
            self._join_tp_group(tp, text_config, cache_config)

        self.dtype = _resolve_dtype(model_config.dtype, config, self.device)
        self.kv_format = kv_format(cache_config.kv_cache_dtype)
        self.kv_cache_dtype = self.dtype if self.kv_format is None else self.kv_format.storage_dtype
        if self.kv_format is not None:  # fail fast: a backend that cannot read this cache
            _resolve_backend(
                self.device,
                model_config.attention_backend,
                dtype=self.dtype,
                head_dim=_declared_head_dim(text_config),
                cache_dtype=self.kv_cache_dtype,
            )
        self.model = _load_model(self.model_path, self.dtype, self.device, model_config.trust_remote_code)
        if self.tp_group is not None:
            shard_model(self.model, self.tp_group)
        # quantization="gguf" (or "auto" for a GGUF model on the CPU): the linears of the GGUF's
        # Q4_0 / Q4_1 / Q8_0 / Q4_K tensors straight from their blocks (worker/gguf_linear.py);
        # before the linear kernel's switch, which takes the linears left.
        self.quantization = self._resolve_quantization(model_config.quantization)
        if self.quantization == "gguf":
            use_gguf_linears(self.model, load_gguf_blocks(self.model_path))
        # linear_kernel="onednn": the linears through oneDNN (worker/onednn_linear.py); "pagedkv":
        # decode-sized products through the Rust kernel (worker/cpu_linear.py). None: torch's
        # own. "auto" resolves here, where the device and dtype are known. Benchmarks turn the
        # switch off and on.
        self.linear_kernel = resolve_linear_kernel(
            model_config.linear_kernel,
            self.device.type,
            str(self.dtype).removeprefix("torch."),
            self.quantization,
        )
        self.linear_switch = self._switch_linear_kernel(self.linear_kernel)
        # quantization="int8": the linears' weights as int8 (worker/int8_linear.py); after the
        # sharding, so each rank quantizes its own shard.
        # quantization="bf16": bfloat16 weights, float32 activations (worker/bf16_linear.py).
        if self.quantization in ("int8", "bf16"):
            if self.device.type != "cpu":
                raise ConfigError(
                    f"quantization {model_config.quantization!r} runs pagedkv's CPU linear kernel; "
                    f"the model is on {self.device}"
                )
            if self.quantization == "bf16":
                use_bf16_linears(self.model)
            else:
                use_int8_linears(self.model)
        head = self.model.get_output_embeddings()
        self.vocab_size = int(head.weight.shape[0]) if head is not None else int(text_config.vocab_size)
        self._accepts_logits_to_keep = "logits_to_keep" in inspect.signature(self.model.forward).parameters
        # Prompt rows handed back as hidden states instead of logits (worker/head_rows.py).
        self._head_split = HeadSplit(self.model)

        self.compiled_forward: CompiledForward | None = None  # the probe runs eager
        self.decode_graphs: DecodeGraphs | None = None  # enable_decode_graphs
        # Per layer (index = layer): its window, chunk, soft-cap and sinks.
        self.geometry, self.layer_attention = self._probe()
        # enforce_eager=False: the step's forward under torch.compile (worker/compiled_forward.py).
        self.enforce_eager = resolve_enforce_eager(model_config.enforce_eager, self.device.type)
        if not self.enforce_eager:
            # Freezing lets inductor pack torch's linears for oneDNN, but a frozen graph is not
            # cached on disk (AOT autograd refuses it): with pagedkv's kernels for the linears
            # there is nothing to pack, and a restart reuses the cache.
            torch_linears = self.linear_kernel == "torch" and self.quantization is None
            self.compiled_forward = CompiledForward(self.model, freeze=self.device.type == "cpu" and torch_linears)
        geometry = self.geometry
        self.num_layers = geometry.num_layers
        self.num_heads = geometry.num_heads
        self.num_kv_heads = geometry.num_kv_heads
        self.head_dim = geometry.head_dim
        # KV cache groups (worker/kv_layout.py): pages of some layers, one block table per
        # column; or every layer whole, with the reason in kv_layout_note.
        self.kv_layout, self.kv_layout_note = self._kv_layout(cache_config)
        # A "block" of the pool is a page: page_layers layers of one block.
        self.bytes_per_block = geometry.bytes_per_block(block_size) * self.kv_layout.page_layers // self.num_layers
        # Resolved once (PAGEDKV_ATTENTION_BACKEND is read here, not per layer call).
        self.backend = _resolve_backend(
            self.device,
            model_config.attention_backend,
            dtype=self.dtype,
            head_dim=self.head_dim,
            cache_dtype=self.kv_cache_dtype,
        )
        self.attention_backend = self.backend.name
        logger.info(
            "%s on %s (%s, %d threads): linears %s%s, forward %s, attention %s",
            type(self.model).__name__,
            self.device,
            str(self.dtype).removeprefix("torch."),
            torch.get_num_threads(),
            self.linear_kernel,
            "" if self.quantization is None else f" ({self.quantization} weights through pagedkv's kernels)",
            "eager" if self.enforce_eager else "compiled",
            self.attention_backend,
        )
        static_scales = None
        if cache_config.kv_cache_scales == "checkpoint":
            static_scales = load_checkpoint_kv_scales(self.model_path, self.num_layers, self.num_kv_heads)
        # Checkpoint scales (and no key rotation) change what the KV bytes mean.
        self.kv_static_scales = static_scales is not None

        num_blocks = cache_config.num_blocks
        if num_blocks is None:
            num_blocks = self._blocks_that_fit(cache_config, scheduling_config)
        if self.tp_group is not None:  # the same block ids on every rank: the tightest one decides
            num_blocks = self.tp_group.min_int(num_blocks)
        self.num_blocks = num_blocks
        self.kv_cache_bytes = num_blocks * self.bytes_per_block
        self.num_host_blocks = self._host_blocks(cache_config)
        if self.tp_group is not None and self.num_host_blocks > 0:
            self.num_host_blocks = self.tp_group.min_int(self.num_host_blocks)
        self.host_kv_cache_bytes = self.num_host_blocks * self.bytes_per_block
        self._check_fits_in_memory()
        # One tensor for every layer's K and V: copy-on-write is one indexed copy per step.
        # Zeros, not empty: padding keys are masked, but NaN garbage times a zero weight is NaN.
        try:
            with torch.inference_mode():
                self.kv_cache = torch.zeros(
                    self.kv_layout.page_layers,
                    2,
                    num_blocks,
                    block_size,
                    self.num_kv_heads,
                    self.head_dim,
                    dtype=self.kv_cache_dtype,
                    device=self.device,
                )
                # A quantized cache's scales, slot for slot (zeros: a never-written slot reads 0).
                self.kv_scale_cache = (
                    torch.zeros(
                        self.kv_layout.page_layers,
                        2,
                        num_blocks,
                        block_size,
                        self.num_kv_heads,
                        dtype=SCALE_DTYPE,
                        device=self.device,
                    )
                    if self.kv_format is not None
                    else None
                )
        except (RuntimeError, MemoryError) as exc:  # torch.OutOfMemoryError is a RuntimeError
            raise ConfigError(
                f"cannot allocate the KV cache ({self.kv_cache_bytes:,} bytes = {num_blocks} blocks x "
                f"{self.bytes_per_block:,} bytes) on {self.device}: {exc}"
            ) from exc
        # Per layer: its slot of every page (a view).
        slots = self.kv_layout.layer_slot
        self.kv_caches = [
            (self.kv_cache[slots[layer], 0], self.kv_cache[slots[layer], 1]) for layer in range(self.num_layers)
        ]
        self.host_cache: HostKVCache | None = None
        if self.num_host_blocks > 0:
            try:
                with torch.inference_mode():
                    self.host_cache = HostKVCache(self.kv_cache, self.kv_scale_cache, self.num_host_blocks)
            except (RuntimeError, MemoryError) as exc:
                raise ConfigError(
                    f"cannot allocate the host KV cache ({self.host_kv_cache_bytes:,} bytes = {self.num_host_blocks} "
                    f"host blocks x {self.bytes_per_block:,} bytes): {exc}"
                ) from exc
        self.host_kv_cache = None if self.host_cache is None else self.host_cache.kv_cache
        self.host_kv_scale_cache = None if self.host_cache is None else self.host_cache.kv_scale_cache
        self.disk_cache: DiskKVStore | None = None
        self.num_disk_blocks = 0
        if self.kv_cache_dir is not None:
            self.disk_cache = self._open_disk_tier(cache_config)
            self.num_disk_blocks = self.disk_cache.num_slots
        self.kv_scales: list[KVScales] | None = None
        if self.kv_scale_cache is not None:
            k_static, v_static = static_scales if static_scales is not None else (None, None)
            # Dynamic scales: keys stored rotated (kv_quant, "Key rotation"); checkpoint scales
            # were calibrated on unrotated keys.
            rotation = key_rotation(self.head_dim, self.dtype, self.device) if static_scales is None else None
            self.kv_scales = [
                KVScales(
                    key=self.kv_scale_cache[slots[layer], 0],
                    value=self.kv_scale_cache[slots[layer], 1],
                    static_key=None if k_static is None else k_static[layer].to(self.device),
                    static_value=None if v_static is None else v_static[layer].to(self.device),
                    key_rotation=rotation,
                )
                for layer in range(self.num_layers)
            ]

    def _resolve_quantization(self, requested: str | None) -> str | None:
        """``quantization`` made concrete: ``"auto"`` is ``"gguf"`` for a GGUF model (a folder
        with the GGUF's blocks, worker/gguf_blocks.py) on the CPU without tensor parallelism,
        else None; ``"gguf"`` where it cannot be served is a ConfigError."""
        if requested not in ("auto", "gguf"):
            return requested
        blocks = os.path.isdir(self.model_path) and has_gguf_blocks(self.model_path)
        if requested == "auto":
            return "gguf" if blocks and self.device.type == "cpu" and self.tp_group is None else None
        if not blocks:
            raise ConfigError(
                f"quantization 'gguf' serves a GGUF model's own blocks, but {self.model_path!r} is not a GGUF "
                "model (a .gguf file or an embedded model) or has no Q4_0 / Q4_1 / Q8_0 / Q4_K linears"
            )
        if self.device.type != "cpu":
            raise ConfigError(f"quantization 'gguf' runs pagedkv's CPU GGUF kernel; the model is on {self.device}")
        if self.tp_group is not None:
            raise ConfigError("quantization 'gguf' cannot be combined with tensor parallelism")
        return "gguf"

    def _switch_linear_kernel(self, kernel: str) -> LinearSwitch | None:
        if kernel == "torch":
            return None
        if self.device.type != "cpu" or self.dtype != torch.float32:
            raise ConfigError(
                f"linear_kernel={kernel!r} runs float32 linears on the CPU, but the model is {self.dtype} on {self.device}"
            )
        if kernel == "pagedkv":
            return use_pagedkv_linears(self.model)
        return use_onednn_linears(self.model)

    @property
    def eos_token_ids(self) -> list[int]:
        """The model's end-of-sequence ids (generation config, else model config); may be empty."""
        for source in (getattr(self.model, "generation_config", None), self.model.config):
            eos = getattr(source, "eos_token_id", None)
            if eos is not None:
                return [int(eos)] if isinstance(eos, int) else [int(e) for e in eos]
        return []

    # ------------------------------------------------------------------ per step

    @torch.inference_mode()
    def execute(self, step: Any, disk_block_info: Sequence[Any] | None = None) -> torch.Tensor:
        """Run one scheduler step (see :meth:`_execute`). Under tensor parallelism rank 0 first
        broadcasts the step to the other ranks, which run the same step on their shards; an
        exception after that broadcast leaves the ranks possibly out of step, so the group is
        broken for good: EngineDeadError now (an interrupt is re-raised as is) and on every
        later call."""
        group = self.tp_group
        if group is None or group.rank != 0:
            return self._execute(step, disk_block_info)
        if self.tp_failed is not None:
            raise EngineDeadError(f"the tensor-parallel group is broken: {self.tp_failed}") from self.tp_failed
        try:
            send_step(group, step)
            return self._execute(step, disk_block_info)
        except Exception as exc:
            self.tp_failed = exc
            raise EngineDeadError(
                f"a tensor-parallel step failed ({type(exc).__name__}: {exc}); the ranks may disagree, "
                "so the engine stops"
            ) from exc
        except BaseException as exc:  # KeyboardInterrupt: re-raised, the next step reports the break
            self.tp_failed = exc
            raise

    def _execute(self, step: Any, disk_block_info: Sequence[Any] | None = None) -> torch.Tensor:
        """Run one scheduler step; return float32 logits ``[S, V]`` for ``step.logits_indices``.

        ``step`` has the ``SchedulerOutput`` fields (numpy arrays or tensors): ``input_ids``
        int64[T], ``positions`` int64[T], ``cu_seqlens_q`` int32[B+1], ``seq_lens`` int32[B],
        ``block_tables`` int32[B, max_blocks], ``slot_mapping`` int64[T], ``logits_indices``
        int64[S] and optionally the block copies, run in this order before the forward:
        ``disk_store`` int32[K, 2] (host block, disk slot; ``disk_block_info`` gives each row's
        identity, from ``Scheduler.disk_block_info``), ``swap_out`` int32[K, 2] (device block,
        host block), ``disk_load`` int32[K, 2] (disk slot, host block), ``swap_in`` int32[K, 2]
        (host block, device block) and ``copy_ops`` int32[K, 2] (src, dst) (:meth:`swap_blocks`,
        :meth:`copy_blocks`, :class:`~pagedkv.worker.disk_cache.DiskKVStore`). Everything is
        validated before anything is written. A disk file that cannot be read raises
        :class:`~pagedkv.worker.disk_cache.DiskTierError`; failed disk writes and reads are
        reported by ``disk_cache.take_bad_slots()``. A ``step.hidden_rows``
        (:class:`~pagedkv.worker.head_rows.HiddenRows`) asks for its last rows of
        ``logits_indices`` as hidden states instead: when answered, the logits hold the others.
        """
        # Host tensors first (from_numpy: no copy): the step is checked before anything runs.
        input_ids = _index_tensor(step.input_ids, torch.int64, "input_ids")
        positions = _index_tensor(step.positions, torch.int64, "positions")
        slot_mapping = _index_tensor(step.slot_mapping, torch.int64, "slot_mapping")
        cu_seqlens_q = _index_tensor(step.cu_seqlens_q, torch.int32, "cu_seqlens_q")
        seq_lens = _index_tensor(step.seq_lens, torch.int32, "seq_lens")
        block_tables = _index_tensor(step.block_tables, torch.int32, "block_tables")
        logits_indices = _index_tensor(step.logits_indices, torch.int64, "logits_indices")
        num_columns = self.kv_layout.num_columns
        _check_step_shapes(
            input_ids, positions, slot_mapping, cu_seqlens_q, seq_lens, block_tables, logits_indices, num_columns
        )
        num_tokens = input_ids.shape[0]
        metadata: list[kernels.AttentionMetadata] | None = None
        # A decode step through a captured graph (worker/decode_graphs.py): checked as any
        # step, but its metadata lives in the graph's buffers.
        graphed = self.decode_graphs is not None and self._graph_serves(
            cu_seqlens_q, logits_indices, block_tables, num_tokens, getattr(step, "hidden_rows", None)
        )
        if num_tokens > 0:
            _check_token_values(input_ids, logits_indices, self.vocab_size)
            # Once per step and column, for all layers: convert, validate (values too, on the
            # host), move.
            key_cache, value_cache = self.kv_caches[0]
            num_seqs = seq_lens.shape[0]
            metadata = []
            graph_tables = []
            for c in range(num_columns):
                tables = block_tables[c * num_seqs : (c + 1) * num_seqs]
                if self.kv_layout.grouped:
                    # Given-back blocks (-1) lie behind every query's window: no kernel reads
                    # them; block 0 keeps the ids in range for the checks.
                    tables = tables.clamp(min=0)
                column_slots = slot_mapping[c * num_tokens : (c + 1) * num_tokens]
                if graphed:
                    kernels.validation.check_step_metadata(
                        column_slots,
                        tables,
                        seq_lens,
                        cu_seqlens_q,
                        num_tokens,
                        key_cache,
                        value_cache,
                        self.dtype,
                        self.backend.name,
                    )
                    graph_tables.append(tables)
                    continue
                metadata.append(
                    self.backend.prepare(
                        column_slots,
                        tables,
                        seq_lens,
                        cu_seqlens_q,
                        num_tokens=num_tokens,
                        key_cache=key_cache,
                        value_cache=value_cache,
                        dtype=self.dtype,
                    )
                )
        swap_out, swap_in = self._check_swaps(getattr(step, "swap_out", None), getattr(step, "swap_in", None))
        disk_store, disk_load = self._check_disk_ops(
            getattr(step, "disk_store", None), getattr(step, "disk_load", None)
        )
        if disk_store is not None and (disk_block_info is None or len(disk_block_info) != disk_store.shape[0]):
            raise InvalidArgumentError(
                "disk_store needs disk_block_info: one identity per row (Scheduler.disk_block_info)"
            )
        copy_ops = getattr(step, "copy_ops", None)
        copies = self._check_copy_ops(copy_ops) if copy_ops is not None and len(copy_ops) > 0 else None
        # Validated: now the writes, in the tiers' order (worker/disk_cache.py): host blocks to
        # disk before swap_out may overwrite them, swap_out before disk_load and swap_in may
        # overwrite what it reads, then copy-on-write before the forward (this step's K/V
        # writes go into the copies).
        if self.disk_cache is not None and disk_store is not None:
            self.disk_cache.store(disk_store, disk_block_info or [])
        if self.host_cache is not None:
            self.host_cache.swap(swap_out, None)
        if self.disk_cache is not None and disk_load is not None:
            self.disk_cache.load(disk_load)
        if self.host_cache is not None:
            self.host_cache.swap(None, swap_in)
        if copies is not None:
            self._run_copies(copies)
        if metadata is None:  # nothing scheduled (copy ops only)
            return torch.empty(0, self.vocab_size, dtype=torch.float32, device=self.device)
        if graphed:
            assert self.decode_graphs is not None
            return self.decode_graphs.run(input_ids, positions, slot_mapping, torch.cat(graph_tables), seq_lens)
        return self._forward(
            input_ids.to(self.device, non_blocking=True),
            positions.to(self.device, non_blocking=True),
            logits_indices.to(self.device, non_blocking=True),
            self._attention_context(metadata),
            getattr(step, "hidden_rows", None),
        )

    def _attention_context(self, metadata: list[kernels.AttentionMetadata]) -> PagedAttentionContext:
        """The step's attention context over its metadata, one per KV column."""
        columns = len(metadata) > 1
        return PagedAttentionContext(
            backend=self.backend,
            kv_caches=self.kv_caches,
            metadata=metadata[0],
            kv_scales=self.kv_scales,
            layers=self.layer_attention,
            column_metadata=metadata if columns else None,
            layer_columns=self.kv_layout.layer_column if columns else None,
        )

    def _graph_serves(
        self,
        cu_seqlens_q: torch.Tensor,  # [B + 1] int32, host
        logits_indices: torch.Tensor,  # [S] int64, host
        block_tables: torch.Tensor,  # [C * B, W] int32, host
        num_tokens: int,
        hidden_rows: object,
    ) -> bool:
        """Whether this step runs through a captured graph: every sequence decodes one token,
        every row is sampled in order, no prompt row goes back as a hidden state, and a bucket
        holds it."""
        graphs = self.decode_graphs
        num_seqs = cu_seqlens_q.shape[0] - 1
        if (
            graphs is None
            or cu_seqlens_q.device.type != "cpu"  # handed over on the GPU: not read back
            or hidden_rows is not None
            or num_tokens != num_seqs
            or graphs.bucket_for(num_seqs) is None
            or block_tables.shape[1] > graphs.max_blocks
        ):
            return False
        rows = torch.arange(num_seqs + 1)
        return (
            logits_indices.shape[0] == num_seqs
            and torch.equal(cu_seqlens_q, rows.to(cu_seqlens_q.dtype))
            and torch.equal(logits_indices, rows[:num_seqs].to(logits_indices.dtype))
        )

    def enable_decode_graphs(self, *, capture: bool = True) -> None:
        """Decode steps of up to ``min(max_num_seqs, 256)`` sequences through graphs
        (worker/decode_graphs.py), captured now. ``capture=False`` (any device): the same
        buffers, padding and fixed metadata, the forward run on them instead of a replay."""
        graphs = DecodeGraphs(
            self._forward,
            self._attention_context,
            self.backend,
            self.kv_caches[0],
            num_columns=self.kv_layout.num_columns,
            max_model_len=self.max_model_len,
            dtype=self.dtype,
            sizes=capture_sizes(self.scheduling_config.max_num_seqs),
            capture=capture,
        )
        graphs.capture_all()
        self.decode_graphs = graphs

    def warm_up_compiled(self) -> None:
        """With ``enforce_eager=False``: compiles (or loads) the forward now, by one step of one
        token, so that the first request does not wait for it (tens of seconds on a CPU) and a
        server is ready when it says so. The token's K/V goes to slot 0 of block 0 in every
        column: the pool is new, so that block is free and holds nothing anyone reads before
        writing it. Under tensor parallelism the step reaches every rank like any other. On a
        GPU it then captures the decode steps' CUDA graphs (:meth:`enable_decode_graphs`)."""
        if self.compiled_forward is None:
            return
        self._warm_up_step()
        # CUDA graphs for decode steps, after the compile (the graphs capture the compiled
        # forward). The Triton backend only: the others read the step's metadata on the host.
        # Not under tensor parallelism yet (the graphs would hold the group's collectives).
        if self.device.type == "cuda" and self.backend.name == "triton" and self.tp_group is None:
            self.enable_decode_graphs()

    def _warm_up_step(self) -> None:
        num_columns = self.kv_layout.num_columns
        step = SimpleNamespace(
            input_ids=np.zeros(1, dtype=np.int64),
            positions=np.zeros(1, dtype=np.int64),
            slot_mapping=np.zeros(num_columns, dtype=np.int64),
            cu_seqlens_q=np.array([0, 1], dtype=np.int32),
            seq_lens=np.ones(1, dtype=np.int32),
            block_tables=np.zeros((num_columns, 1), dtype=np.int32),
            logits_indices=np.zeros(1, dtype=np.int64),
        )
        self.execute(step)

    @torch.inference_mode()
    def copy_blocks(self, copy_ops: Any) -> None:
        """Copy whole blocks ``src -> dst`` in every layer's K and V (and their scales, for a
        quantized cache). ``copy_ops``: int[K, 2]."""
        ops = self._check_copy_ops(copy_ops)
        if ops is not None:
            self._run_copies(ops)

    @torch.inference_mode()
    def swap_blocks(self, swap_out: Any = None, swap_in: Any = None) -> None:
        """Copy whole blocks between the device pool and the host tier (every layer's K and V,
        and the scales of a quantized cache): first ``swap_out`` int[K, 2] rows (device block,
        host block), host := device; then ``swap_in`` int[K, 2] rows (host block, device
        block), device := host. None or empty: nothing. Both are validated before anything is
        copied (``InvalidArgumentError``: not [K, 2] integers, an id outside its pool, a
        destination written twice, or any swap without a host tier). On CUDA the copies run on
        a side stream that the compute stream waits for (:class:`HostKVCache`)."""
        out_ops, in_ops = self._check_swaps(swap_out, swap_in)
        if self.host_cache is not None:
            self.host_cache.swap(out_ops, in_ops)

    @torch.inference_mode()
    def measure_swap_bandwidth(self, num_blocks: int | None = None, repeats: int = 3) -> float:
        """Bytes per second of a device -> host -> device round trip of ``num_blocks`` blocks
        through the swap path (:class:`HostKVCache`), the median of ``repeats`` timed round
        trips after one warm-up: ``2 * num_blocks * bytes_per_block`` (each block copied out
        and back in) over the round trip's time, so a round trip of n blocks costs
        ``2 * n * bytes_per_block / bandwidth`` seconds. Scratch blocks of the pool's shape
        are used: the real KV (device and host) is not touched, and no host tier is needed.
        Default ``num_blocks``: about 64 MiB worth (1 .. 256 blocks), more than the CPU caches
        hold, so the figure is a memory bandwidth (8 blocks of SmolLM2 read 1.8x too fast)."""
        if num_blocks is None:
            num_blocks = max(1, min(256, (64 << 20) // self.bytes_per_block))
        for name, value in (("num_blocks", num_blocks), ("repeats", repeats)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidArgumentError(f"{name} must be a positive int, got {value!r}")
        scratch = torch.zeros(
            (*self.kv_cache.shape[:2], num_blocks, *self.kv_cache.shape[3:]),
            dtype=self.kv_cache.dtype,
            device=self.device,
        )
        scales = None
        if self.kv_scale_cache is not None:
            scales = torch.zeros(
                (*self.kv_scale_cache.shape[:2], num_blocks, *self.kv_scale_cache.shape[3:]),
                dtype=self.kv_scale_cache.dtype,
                device=self.device,
            )
        host = HostKVCache(scratch, scales, num_blocks)
        ids = torch.arange(num_blocks, dtype=torch.int64)
        ops = torch.stack([ids, ids], dim=1)
        times = []
        for attempt in range(repeats + 1):  # the first: warm-up (pinned buffers, kernels)
            self._synchronize()
            start = time.perf_counter()
            host.swap(ops, ops)
            self._synchronize()
            if attempt:
                times.append(time.perf_counter() - start)
        seconds = max(float(np.median(times)), 1e-9)
        return 2 * num_blocks * self.bytes_per_block / seconds

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _check_swaps(self, swap_out: Any, swap_in: Any) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Both swap arrays as validated CPU int64 ``[K, 2]`` tensors (None: no swaps)."""
        pools = {"device": self.num_blocks, "host": self.num_host_blocks}
        return (
            self._check_swap_ops(swap_out, "swap_out", ("device", "host"), pools),
            self._check_swap_ops(swap_in, "swap_in", ("host", "device"), pools),
        )

    def _check_disk_ops(self, disk_store: Any, disk_load: Any) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Both disk arrays as validated CPU int64 ``[K, 2]`` tensors (None: no disk ops)."""
        pools = {"host": self.num_host_blocks, "disk": self.num_disk_blocks}
        checked = (
            self._check_swap_ops(disk_store, "disk_store", ("host", "disk"), pools),
            self._check_swap_ops(disk_load, "disk_load", ("disk", "host"), pools),
        )
        if any(c is not None for c in checked) and self.disk_cache is None:
            raise InvalidArgumentError("the step has disk ops, but this runner has no disk tier (kv_cache_dir)")
        return checked

    def _check_swap_ops(
        self, ops_in: Any, name: str, columns: tuple[str, str], pools: dict[str, int]
    ) -> torch.Tensor | None:
        if ops_in is None:
            return None
        ops = _as_tensor(ops_in, name)
        if ops.numel() == 0:
            return None
        if self.host_cache is None:
            raise InvalidArgumentError(
                f"{name} holds {ops.shape[0] if ops.dim() else 1} swap(s), but this runner has no host KV tier "
                f"(num_host_blocks = 0): set num_host_blocks / host_kv_cache_memory / swap_space"
            )
        ops = _index_tensor(ops, torch.int64, name).cpu()
        if ops.dim() != 2 or ops.shape[1] != 2:
            raise InvalidArgumentError(
                f"{name} must be [K, 2] ({columns[0]} block, {columns[1]} block), got shape {tuple(ops.shape)}"
            )
        for column, pool in enumerate(columns):
            ids = ops[:, column]
            low, high = int(ids.min()), int(ids.max())
            if low < 0 or high >= pools[pool]:
                raise InvalidArgumentError(
                    f"{name} holds {pool} block id {low if low < 0 else high}, not in [0, {pools[pool]})"
                )
        if len(set(ops[:, 1].tolist())) != ops.shape[0]:
            raise InvalidArgumentError(f"{name} writes the same {columns[1]} block twice")
        return ops

    def _check_copy_ops(self, copy_ops: Any) -> torch.Tensor | None:
        """``copy_ops`` as int64 ``[K, 2]`` on the device, values checked when they are on
        the host; None when empty."""
        ops = _as_tensor(copy_ops, "copy_ops")
        if ops.dim() != 2 or ops.shape[1] != 2:
            raise InvalidArgumentError(f"copy_ops must be [K, 2] (src, dst), got shape {tuple(ops.shape)}")
        if ops.numel() == 0:
            return None
        if ops.device.type == "cpu":  # value checks are free on the host
            low, high = int(ops.min()), int(ops.max())
            if low < 0 or high >= self.num_blocks:
                bad = low if low < 0 else high
                raise InvalidArgumentError(f"copy_ops holds block id {bad}, not in [0, {self.num_blocks})")
            if len(set(ops[:, 1].tolist())) != ops.shape[0]:
                raise InvalidArgumentError("copy_ops writes the same destination block twice")
        return ops.to(self.device, torch.int64, non_blocking=True)

    def _run_copies(self, ops: torch.Tensor) -> None:
        src, dst = ops[:, 0], ops[:, 1]
        _copy_blocks(self.kv_cache, src, dst)
        if self.kv_scale_cache is not None:
            _copy_blocks(self.kv_scale_cache, src, dst)

    # ------------------------------------------------------------------ internals

    def _forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        logits_indices: torch.Tensor,  # [S] int64
        context: object,
        hidden_rows: HiddenRows | None = None,
    ) -> torch.Tensor:  # [S, V] float32 ([S - hidden_rows.count, V] when it answers hidden_rows)
        kwargs = {
            "input_ids": input_ids.unsqueeze(0),
            "position_ids": positions.unsqueeze(0),
            "use_cache": False,
            CONTEXT_KWARG: context,
        }
        model: Any = self.model
        if self.compiled_forward is not None and self.compiled_forward.applies(context, hidden_rows):
            model = self.compiled_forward
        if self._accepts_logits_to_keep:
            with self._head_split.split(hidden_rows, logits_indices.shape[0]):
                logits = model(**kwargs, logits_to_keep=logits_indices).logits[0]
        else:
            logits = model(**kwargs).logits[0].index_select(0, logits_indices)
        return logits.float()

    def _kv_layout(self, cache: CacheConfig) -> tuple[KVLayout, str]:
        """The KV layout (worker/kv_layout.py) and a line that says which one and why."""
        whole = KVLayout.whole(self.num_layers)
        layout = KVLayout.of_layers(self.layer_attention, self.max_model_len)
        if isinstance(layout, str):
            return whole, f"every layer whole: {layout}"
        if not layout.grouped:
            return whole, "every layer whole: every layer attends to the whole context"
        if not cache.enable_kv_cache_groups:
            return whole, "every layer whole: KV cache groups are off (disable_hybrid_kv_cache_manager)"
        return layout, f"KV cache groups: {layout.describe()}"

    @torch.inference_mode()
    def _probe(self) -> tuple[KVGeometry, list[LayerAttention]]:
        """Forward a few tokens through the recording attention; check the calls and return
        the cache geometry and each layer's attention variant."""
        probe = ProbeContext()
        num_tokens = min(_PROBE_TOKENS, self.max_model_len)
        input_ids = torch.arange(1, num_tokens + 1, device=self.device) % self.vocab_size
        positions = torch.arange(num_tokens, device=self.device)
        last = torch.tensor([num_tokens - 1], device=self.device)
        try:
            self._forward(input_ids, positions, last, probe)
        except UnsupportedModelError:
            raise
        except Exception as exc:  # the model's own code failed on a packed forward
            raise UnsupportedModelError(
                f"a probe forward of {type(self.model).__name__} through pagedkv's attention "
                f"failed: {type(exc).__name__}: {exc}"
            ) from exc
        text_config = self.model.config.get_text_config()
        geometry = check_probe(
            probe.calls,
            text_config,
            num_tokens,
            self.max_model_len,
            dtype=self.kv_format.name if self.kv_format is not None else str(self.dtype).removeprefix("torch."),
        )
        return geometry, layer_attentions(probe.calls, text_config, self.max_model_len)

    def _blocks_that_fit(self, cache: CacheConfig, scheduling: SchedulingConfig) -> int:
        if self.device.type == "cuda" and cache.kv_cache_memory is None:
            budget = self._profile_cuda_budget(
                cache.gpu_memory_utilization, scheduling.max_num_batched_tokens, scheduling.max_num_seqs
            )
            source = f"gpu_memory_utilization={cache.gpu_memory_utilization}"
        else:
            budget = cache.kv_cache_memory if cache.kv_cache_memory is not None else DEFAULT_CPU_KV_CACHE_MEMORY
            source = f"kv_cache_memory={budget}"
        return self._blocks_in_budget(
            budget,
            source,
            "the KV pool",
            f"{source} leaves {max(budget, 0)} bytes for the KV cache, less than one block "
            f"({self.bytes_per_block} bytes)",
        )

    def _blocks_in_budget(self, budget: int, source: str, pool: str, too_small: str) -> int:
        """Blocks of ``bytes_per_block`` in ``budget`` bytes: ``too_small`` is the ConfigError
        when not one fits; a budget is a ceiling, so one worth more than ``MAX_NUM_BLOCKS`` is
        clamped to it (``UserWarning`` naming ``source`` and ``pool``)."""
        num_blocks = budget // self.bytes_per_block
        if num_blocks < 1:
            raise ConfigError(too_small)
        if num_blocks > MAX_NUM_BLOCKS:
            warnings.warn(
                f"{source} makes room for {num_blocks} blocks of {self.bytes_per_block} bytes, more than the "
                f"core's limit MAX_NUM_BLOCKS = {MAX_NUM_BLOCKS}: {pool} is clamped to {MAX_NUM_BLOCKS} blocks",
                UserWarning,
                stacklevel=4,
            )
            num_blocks = MAX_NUM_BLOCKS
        return num_blocks

    def _join_tp_group(self, tp: TPSpec, text_config: Any, cache: CacheConfig) -> None:
        """Checks that the model and this machine allow ``tp.world_size`` ranks (before joining,
        so a refused engine joins nothing), then joins the group; on CUDA rank r uses device r."""
        check_tensor_parallel_size(text_config, tp.world_size)
        if self.device.type == "cuda":
            available = torch.cuda.device_count()
            if tp.device_index >= available:
                raise ConfigError(
                    f"tensor_parallel_size={tp.world_size} needs a CUDA device per rank; rank {tp.rank} "
                    f"would use device {tp.device_index} of the {available} visible"
                )
            self.device = torch.device("cuda", tp.device_index)
        # On the CPU a rank is a process: any N runs (sharing the cores), which is what tests use.
        if cache.kv_cache_dir is not None:
            raise ConfigError("the disk KV tier (kv_cache_dir) is not supported with tensor_parallel_size > 1")
        self.tp_group = TPGroup.create(
            tp.rank, tp.world_size, tp.init_method, self.device, tp.timeout, tp.store, tp.peer_failures
        )

    def kv_fingerprint(self) -> dict[str, Any]:
        """What must match for KV written by another engine (a disk file, a transferred block)
        to be valid here: the model (path, a digest of its config and weight files) and the KV
        format (layers, heads, head_dim, dtypes, scale mode, block size) and, with KV cache
        groups, the page layout (a page and a column mean other layers under another layout;
        with every layer whole the key is absent, so those fingerprints are what they were), and
        a weight quantization (int8 weights compute other K/V than the checkpoint's; absent
        without one)."""
        geometry: dict[str, Any] = {
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "dtype": str(self.dtype),
            "kv_cache_dtype": str(self.kv_cache_dtype),
            "kv_cache_scales": "checkpoint" if self.kv_static_scales else "dynamic",
            "block_size": self.block_size,
        }
        if self.quantization is not None:
            geometry["quantization"] = self.quantization
        layout = self.kv_layout
        if layout.grouped:
            # Lists, not tuples: the fingerprint is compared with its JSON round trip.
            geometry["kv_layout"] = {
                "page_layers": layout.page_layers,
                "columns": [[kind, size] for kind, size in layout.columns],
                "layer_column": list(layout.layer_column),
                "layer_slot": list(layout.layer_slot),
            }
        return disk_fingerprint(self.model_path, geometry=geometry)

    def _open_disk_tier(self, cache: CacheConfig) -> DiskKVStore:
        """The disk tier below the host tier (``kv_cache_dir``): its files' fingerprint and its
        slot count (``kv_cache_dir_max_bytes``, default 4 GiB, at most the disk's free space)."""
        if self.host_cache is None or self.kv_cache_dir is None:
            raise ConfigError(
                f"kv_cache_dir={cache.kv_cache_dir!r} is a disk tier below the host tier, but there is no host tier: "
                f"set num_host_blocks / host_kv_cache_memory / swap_space"
            )
        if not cache.enable_prefix_caching:
            raise ConfigError("kv_cache_dir (the disk tier) holds prefix-cache blocks: it needs enable_prefix_caching")
        fingerprint = self.kv_fingerprint()
        tensors = [self.host_cache.kv_cache] + (
            [] if self.host_cache.kv_scale_cache is None else [self.host_cache.kv_scale_cache]
        )
        budget = cache.kv_cache_dir_max_bytes if cache.kv_cache_dir_max_bytes is not None else 4 << 30
        free = shutil.disk_usage(self.kv_cache_dir).free
        if budget > free:
            warnings.warn(
                f"the disk tier's budget ({budget:,} bytes) is more than the free space of {self.kv_cache_dir!r} "
                f"({free:,} bytes): it is limited to the free space",
                UserWarning,
                stacklevel=3,
            )
            budget = free
        store = DiskKVStore(self.kv_cache_dir, tensors, budget, fingerprint)
        if store.num_slots < 1:
            raise ConfigError(
                f"kv_cache_dir_max_bytes = {budget:,} bytes is less than one block file "
                f"({store.file_bytes:,} bytes): raise it"
            )
        return store

    def _host_blocks(self, cache: CacheConfig) -> int:
        """The host tier's block count: explicit, or a byte budget (``host_kv_cache_memory``,
        or ``swap_space`` GiB) over ``bytes_per_block``; 0 without a host tier."""
        if cache.num_host_blocks is not None:
            return cache.num_host_blocks
        if cache.host_kv_cache_memory is not None:
            budget, source = cache.host_kv_cache_memory, f"host_kv_cache_memory={cache.host_kv_cache_memory}"
        elif cache.swap_space is not None:
            budget, source = int(cache.swap_space * 2**30), f"swap_space={cache.swap_space} GiB"
        else:
            return 0
        return self._blocks_in_budget(
            budget,
            source,
            "the host tier",
            f"{source} = {budget:,} bytes is less than one KV block ({self.bytes_per_block:,} bytes): "
            f"raise it, or give num_host_blocks",
        )

    def _check_fits_in_memory(self) -> None:
        """Refuse, before allocating, a pool the device cannot hold (instead of an allocator
        error, or on the CPU the OOM killer once zeros are written), and a host tier the host
        cannot hold (on a CPU device, next to the device pool)."""
        available = _available_memory(self.device)
        if available is not None and self.kv_cache_bytes > available:
            raise ConfigError(
                f"the KV cache would take {self.kv_cache_bytes:,} bytes ({self.num_blocks} blocks x "
                f"{self.bytes_per_block:,} bytes), more than the {available:,} bytes available on {self.device}: "
                f"lower num_blocks / kv_cache_memory / gpu_memory_utilization, or block_size"
            )
        if self.host_kv_cache_bytes == 0:
            return
        on_cpu = self.device.type == "cpu"
        host_available = available if on_cpu else _available_memory(torch.device("cpu"))
        if host_available is None:
            return
        if on_cpu:
            host_available -= self.kv_cache_bytes
        if self.host_kv_cache_bytes > host_available:
            beside = " beside the device KV cache" if on_cpu else ""
            raise ConfigError(
                f"the host KV cache would take {self.host_kv_cache_bytes:,} bytes ({self.num_host_blocks} host "
                f"blocks x {self.bytes_per_block:,} bytes), more than the {max(host_available, 0):,} bytes of host "
                f"memory available{beside}: lower num_host_blocks / host_kv_cache_memory / swap_space"
            )

    @torch.inference_mode()
    def _profile_cuda_budget(
        self, gpu_memory_utilization: float, max_num_batched_tokens: int, max_num_seqs: int
    ) -> int:
        """Bytes left for the KV cache after weights, other users and the activation peak."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        allocated_before = torch.cuda.memory_allocated(self.device)
        num_tokens = min(max_num_batched_tokens, self.max_model_len)
        input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        positions = torch.arange(num_tokens, device=self.device)
        rows = torch.arange(num_tokens - min(max_num_seqs, num_tokens), num_tokens, device=self.device)
        logits = self._forward(input_ids, positions, rows, ProfileContext())
        # The sampler works on a few [S, V] float32 copies of the logits.
        activation_peak = torch.cuda.max_memory_allocated(self.device) - allocated_before
        activation_peak += 3 * logits.numel() * 4
        del logits
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        in_use = total - free  # weights, CUDA context, other processes
        return int(total * gpu_memory_utilization) - in_use - activation_peak


def _index_tensor(array: Any, dtype: torch.dtype, name: str) -> torch.Tensor:
    """``array`` as a tensor of integer ``dtype`` (converted from another integer dtype)."""
    tensor = _as_tensor(array, name)
    if tensor.dtype != dtype:
        if tensor.dtype.is_floating_point or tensor.dtype.is_complex or tensor.dtype == torch.bool:
            raise InvalidArgumentError(f"{name} must hold integers, got {tensor.dtype}")
        tensor = tensor.to(dtype)
    return tensor


def _as_tensor(array: Any, name: str) -> torch.Tensor:
    if isinstance(array, torch.Tensor):
        return array
    if isinstance(array, np.ndarray):
        if not array.flags.writeable or not array.flags.c_contiguous:
            array = np.array(array)  # torch.from_numpy wants a writable array
        return torch.from_numpy(array)
    try:
        return torch.as_tensor(array)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise InvalidArgumentError(f"{name} must be an array, got {type(array).__name__}") from exc


def _check_step_shapes(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    logits_indices: torch.Tensor,
    num_columns: int = 1,
) -> None:
    """Shape consistency of one step (metadata only: no device sync). With ``num_columns``
    KV-cache columns, ``slot_mapping`` is ``[C * T]`` and ``block_tables`` ``[C * B, W]``."""
    for name, tensor in (
        ("input_ids", input_ids),
        ("positions", positions),
        ("slot_mapping", slot_mapping),
        ("cu_seqlens_q", cu_seqlens_q),
        ("seq_lens", seq_lens),
        ("logits_indices", logits_indices),
    ):
        if tensor.dim() != 1:
            raise InvalidArgumentError(f"{name} must be 1-D, got shape {tuple(tensor.shape)}")
    num_tokens = input_ids.shape[0]
    if positions.shape[0] != num_tokens or slot_mapping.shape[0] != num_columns * num_tokens:
        raise InvalidArgumentError(
            f"input_ids and positions must have one entry per token and slot_mapping one per token and "
            f"KV-cache column ({num_columns}), got {num_tokens}, {positions.shape[0]}, {slot_mapping.shape[0]}"
        )
    num_seqs = seq_lens.shape[0]
    if cu_seqlens_q.shape[0] != num_seqs + 1:
        raise InvalidArgumentError(
            f"cu_seqlens_q must have B + 1 = {num_seqs + 1} entries, got {cu_seqlens_q.shape[0]}"
        )
    if block_tables.dim() != 2 or block_tables.shape[0] != num_columns * num_seqs:
        raise InvalidArgumentError(
            f"block_tables must be [C * B = {num_columns} x {num_seqs}, max_blocks], got shape "
            f"{tuple(block_tables.shape)}"
        )


def _check_token_values(input_ids: torch.Tensor, logits_indices: torch.Tensor, vocab_size: int) -> None:
    """Token ids inside the vocabulary and logits rows inside the step (host tensors only: on
    a GPU an out-of-range index is a device-side assert that kills the process)."""
    if input_ids.device.type != "cpu":
        return
    low, high = int(input_ids.min()), int(input_ids.max())
    if low < 0 or high >= vocab_size:
        raise InvalidArgumentError(f"input_ids holds token id {low if low < 0 else high}, not in [0, {vocab_size})")
    if logits_indices.device.type == "cpu" and logits_indices.numel():
        num_tokens = input_ids.shape[0]
        low, high = int(logits_indices.min()), int(logits_indices.max())
        if low < 0 or high >= num_tokens:
            raise InvalidArgumentError(
                f"logits_indices holds row {low if low < 0 else high}, not in [0, {num_tokens}) (the step's tokens)"
            )


def _resolve_backend(
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


def _copy_blocks(cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """``cache[:, :, dst] = cache[:, :, src]`` (dim 2 = block id) for ``[L, 2, num_blocks, ...]``.

    index_select copies first, so a block that is both a source and a destination in the same
    step still reads its old content. Float8 has no CPU index_copy_: its bytes move as uint8.
    """
    cache = byte_view(cache)
    cache.index_copy_(2, dst, cache.index_select(2, src))


def _prepare_kv_cache_dir(folder: str | None) -> str | None:
    """The disk tier's folder, created if missing; ConfigError unless it is a writable folder."""
    if folder is None:
        return None
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"kv_cache_dir={folder!r} cannot be created: {exc}") from exc
    if not os.path.isdir(folder):
        raise ConfigError(f"kv_cache_dir={folder!r} is not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(f"kv_cache_dir={folder!r} is not writable")
    return folder


def _available_memory(device: torch.device) -> int | None:
    """Bytes a new tensor can take on ``device`` now (None: unknown)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:  # Linux: what can be allocated without swapping or the OOM killer
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def _resolve_device(device: str | torch.device) -> torch.device:
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
    model.eval()
    # transformers decorates `to`; mypy mis-reads its signature.
    return model.to(device)  # type: ignore[arg-type]
