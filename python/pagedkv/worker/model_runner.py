"""``ModelRunner``: a transformers causal LM running on pagedkv's paged KV cache.

One step = one packed forward. The scheduler's ``SchedulerOutput`` already holds the batch as
flat arrays (the step contract: :mod:`pagedkv.worker.step_input`); the runner

0. builds the step's attention metadata once (:meth:`pagedkv.kernels.AttentionBackend.prepare`:
   index tensors converted, validated on the host, moved to the device) — every layer reuses it,
1. runs the step's copies between the tiers — ``disk_store`` (host → disk), ``swap_out``
   (device → host), ``disk_load`` (disk → host), ``swap_in`` (host → device) — then the
   copy-on-write block copies (all layers, K and V, in one indexed copy),
2. runs the model once over all ``T`` scheduled tokens as a single sequence (``[1, T]`` ids and
   positions, no transformers cache), handing the step metadata to pagedkv's attention function
   (:mod:`pagedkv.worker.attention_backend`), and
3. computes the LM head only on the rows in ``logits_indices`` (the model's own
   ``logits_to_keep``: no ``[T, V]`` logits for a long prefill, the model's logit
   post-processing such as soft-capping still applies).

It returns float32 logits ``[S, V]``, one row per sampled sequence, in ``logits_indices`` order.

Set-up runs in three stages: :mod:`~pagedkv.worker.model_loader` loads the model,
:mod:`~pagedkv.worker.kv_cache_plan` plans the KV cache (layout, block size, how many blocks
fit) after a probe forward has given its geometry, :mod:`~pagedkv.worker.kv_cache_alloc`
allocates it (device pool, host tier, disk tier). Under tensor parallelism the runner takes its
rank (:class:`~pagedkv.worker.parallel_rank.ParallelRank`, built by :mod:`pagedkv.parallel`).
"""

from __future__ import annotations

import inspect
import logging
import time
from typing import Any

import numpy as np
import torch

import pagedkv.kernels as kernels
from pagedkv.config import (
    CacheConfig,
    KVGeometry,
    ModelConfig,
    SchedulingConfig,
    check_preemption_mode,
    resolve_enforce_eager,
)
from pagedkv.errors import ConfigError, InvalidArgumentError, UnsupportedModelError
from pagedkv.kernels.layer_attention import LayerAttention
from pagedkv.worker.attention_backend import CONTEXT_KWARG, PagedAttentionContext, ProbeContext, ProfileContext
from pagedkv.worker.checkpoint_scales import load_checkpoint_kv_scales
from pagedkv.worker.compiled_forward import CompiledForward
from pagedkv.worker.decode_graphs import DecodeGraphs, capture_sizes
from pagedkv.worker.disk_cache import DiskKVStore, disk_fingerprint
from pagedkv.worker.head_rows import HeadSplit, HiddenRows
from pagedkv.worker.host_cache import HostKVCache
from pagedkv.worker.kv_cache_alloc import allocate_kv_cache, open_disk_tier, prepare_kv_cache_dir
from pagedkv.worker.kv_cache_plan import DEFAULT_CPU_KV_CACHE_MEMORY, plan_kv_cache
from pagedkv.worker.model_loader import load_model, load_model_config, resolve_backend
from pagedkv.worker.model_support import check_probe, layer_attentions
from pagedkv.worker.parallel_rank import ParallelRank
from pagedkv.worker.step_checks import (
    OpsLike,
    check_block_ops,
    check_copy_ops,
    check_step_shapes,
    check_token_values,
    copy_blocks,
    index_tensor,
)
from pagedkv.worker.step_input import DiskBlockInfos, Step, StepInput, hidden_rows_of

__all__ = ["ModelRunner", "DEFAULT_CPU_KV_CACHE_MEMORY", "load_model_config"]

logger = logging.getLogger(__name__)

_PROBE_TOKENS = 5


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
    ``num_disk_blocks`` (its slots; 0: none); ``tp_group`` (the tensor-parallel rank, or None).

    Per step: :meth:`execute`; also :meth:`copy_blocks`, :meth:`swap_blocks` and
    :meth:`measure_swap_bandwidth` (for the scheduler's swap-or-recompute cost model).
    """

    def __init__(
        self,
        model_config: ModelConfig | None = None,
        cache_config: CacheConfig | None = None,
        scheduling_config: SchedulingConfig | None = None,
        *,
        tp: ParallelRank | None = None,
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
        # Tensor parallelism: this rank joins its group while the model loads, shards it, agrees
        # on the pool sizes, and runs every step (rank 0 first hands it to the other ranks).
        self.tp = tp
        self.kv_cache_dir = prepare_kv_cache_dir(cache_config.kv_cache_dir)
        self.block_size = cache_config.block_size

        # 1. The model.
        loaded = load_model(model_config, cache_config, scheduling_config, tp)
        self.model, self.model_path = loaded.model, loaded.model_path
        self.device, self.dtype, self.max_model_len = loaded.device, loaded.dtype, loaded.max_model_len
        self.kv_format, self.kv_cache_dtype = loaded.kv_format, loaded.kv_cache_dtype
        self.quantization, self.linear_kernel, self.linear_switch = (
            loaded.quantization,
            loaded.linear_kernel,
            loaded.linear_switch,
        )
        self.vocab_size = loaded.vocab_size
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
        # Resolved once (PAGEDKV_ATTENTION_BACKEND is read here, not per layer call).
        self.backend = resolve_backend(
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

        # 2. The KV cache's plan: KV cache groups (worker/kv_layout.py: pages of some layers, one
        # block table per KV cache group; or every layer whole, the reason in kv_layout_note), a block's
        # bytes (a page: page_layers layers of one block), the pools' block counts.
        plan = plan_kv_cache(
            geometry,
            self.layer_attention,
            self.max_model_len,
            self.device,
            cache_config,
            cuda_budget=lambda: self._profile_cuda_budget(
                cache_config.gpu_memory_utilization,
                scheduling_config.max_num_batched_tokens,
                scheduling_config.max_num_seqs,
            ),
            tp=tp,
        )
        self.kv_layout, self.kv_layout_note = plan.layout, plan.layout_note
        self.bytes_per_block = plan.bytes_per_block
        self.num_blocks, self.kv_cache_bytes = plan.num_blocks, plan.kv_cache_bytes
        self.num_host_blocks, self.host_kv_cache_bytes = plan.num_host_blocks, plan.host_kv_cache_bytes

        # 3. The KV cache: the device pool, its per-layer views, the host and disk tiers.
        kv = allocate_kv_cache(
            plan,
            geometry,
            self.block_size,
            self.device,
            model_dtype=self.dtype,
            cache_dtype=self.kv_cache_dtype,
            quantized=self.kv_format is not None,
            static_scales=static_scales,
        )
        self.kv_cache, self.kv_scale_cache, self.kv_caches = kv.kv_cache, kv.kv_scale_cache, kv.kv_caches
        self.kv_scales, self.host_cache = kv.kv_scales, kv.host_cache
        self.host_kv_cache = None if self.host_cache is None else self.host_cache.kv_cache
        self.host_kv_scale_cache = None if self.host_cache is None else self.host_cache.kv_scale_cache
        self.disk_cache: DiskKVStore | None = None
        self.num_disk_blocks = 0
        if self.kv_cache_dir is not None:
            self.disk_cache = open_disk_tier(cache_config, self.kv_cache_dir, self.host_cache, self.kv_fingerprint)
            self.num_disk_blocks = self.disk_cache.num_slots

    @property
    def tp_group(self) -> ParallelRank | None:
        """The tensor-parallel rank this runner is (``tp``), or None; the engine hands it to its
        executor to stop the other ranks."""
        return self.tp

    @property
    def eos_token_ids(self) -> list[int]:
        """The model's end-of-sequence ids (generation config, else model config); may be empty."""
        for source in (getattr(self.model, "generation_config", None), self.model.config):
            eos = getattr(source, "eos_token_id", None)
            if eos is not None:
                return [int(eos)] if isinstance(eos, int) else [int(e) for e in eos]
        return []

    # ------------------------------------------------------------------ per step

    # ------------------------------------------------------------------ per step

    @torch.inference_mode()
    def execute(self, step: Step, disk_block_info: DiskBlockInfos | None = None) -> torch.Tensor:
        """Run one scheduler step (see :meth:`_execute`). Under tensor parallelism the step goes
        through the rank (``tp.execute``): rank 0 first hands it to the other ranks, which run
        the same step on their shards."""
        if self.tp is None:
            return self._execute(step, disk_block_info)
        return self.tp.execute(step, disk_block_info, self._execute)

    def _execute(self, step: Step, disk_block_info: DiskBlockInfos | None = None) -> torch.Tensor:
        """Run one scheduler step; return float32 logits ``[S, V]`` for ``step.logits_indices``.

        ``step``: the arrays of :class:`~pagedkv.worker.step_input.StepArrays` (numpy arrays or
        tensors). The block copies run in this order before the forward: ``disk_store``
        (``disk_block_info`` gives each row's identity, from ``Scheduler.disk_block_info``),
        ``swap_out``, ``disk_load``, ``swap_in`` (:meth:`swap_blocks`,
        :class:`~pagedkv.worker.disk_cache.DiskKVStore`), then ``copy_ops``
        (:meth:`copy_blocks`). Everything is validated before anything is written. A disk file
        that cannot be read raises :class:`~pagedkv.worker.disk_cache.DiskTierError`; failed
        disk writes and reads are reported by ``disk_cache.take_bad_slots()``. A step's
        ``hidden_rows`` (:class:`~pagedkv.worker.head_rows.HiddenRows`) asks for its last rows
        of ``logits_indices`` as hidden states instead: when answered, the logits hold the others.
        """
        hidden_rows = hidden_rows_of(step)
        # Host tensors first (from_numpy: no copy): the step is checked before anything runs.
        input_ids = index_tensor(step.input_ids, torch.int64, "input_ids")
        positions = index_tensor(step.positions, torch.int64, "positions")
        slot_mapping = index_tensor(step.slot_mapping, torch.int64, "slot_mapping")
        cu_seqlens_q = index_tensor(step.cu_seqlens_q, torch.int32, "cu_seqlens_q")
        seq_lens = index_tensor(step.seq_lens, torch.int32, "seq_lens")
        block_tables = index_tensor(step.block_tables, torch.int32, "block_tables")
        logits_indices = index_tensor(step.logits_indices, torch.int64, "logits_indices")
        num_kv_groups = self.kv_layout.num_kv_groups
        check_step_shapes(
            input_ids, positions, slot_mapping, cu_seqlens_q, seq_lens, block_tables, logits_indices, num_kv_groups
        )
        num_tokens = input_ids.shape[0]
        metadata: list[kernels.AttentionMetadata] | None = None
        # A decode step through a captured graph (worker/decode_graphs.py): checked as any
        # step, but its metadata lives in the graph's buffers.
        graphed = self.decode_graphs is not None and self._graph_serves(
            cu_seqlens_q, logits_indices, block_tables, num_tokens, hidden_rows
        )
        if num_tokens > 0:
            check_token_values(input_ids, logits_indices, self.vocab_size)
            # Once per step and KV cache group, for all layers: convert, validate (values too, on the
            # host), move.
            key_cache, value_cache = self.kv_caches[0]
            num_seqs = seq_lens.shape[0]
            metadata = []
            graph_tables = []
            for c in range(num_kv_groups):
                tables = block_tables[c * num_seqs : (c + 1) * num_seqs]
                if self.kv_layout.grouped:
                    # Given-back blocks (-1) lie behind every query's window: no kernel reads
                    # them; block 0 keeps the ids in range for the checks.
                    tables = tables.clamp(min=0)
                group_slots = slot_mapping[c * num_tokens : (c + 1) * num_tokens]
                if graphed:
                    kernels.validation.check_step_metadata(
                        group_slots,
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
                        group_slots,
                        tables,
                        seq_lens,
                        cu_seqlens_q,
                        num_tokens=num_tokens,
                        key_cache=key_cache,
                        value_cache=value_cache,
                        dtype=self.dtype,
                    )
                )
        swap_out, swap_in = self._check_swaps(step.swap_out, step.swap_in)
        disk_store, disk_load = self._check_disk_ops(step.disk_store, step.disk_load)
        if disk_store is not None and (disk_block_info is None or len(disk_block_info) != disk_store.shape[0]):
            raise InvalidArgumentError(
                "disk_store needs disk_block_info: one identity per row (Scheduler.disk_block_info)"
            )
        copy_ops = step.copy_ops
        copies = self._check_copy_ops(copy_ops) if len(copy_ops) > 0 else None
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
            hidden_rows,
        )

    def _attention_context(self, metadata: list[kernels.AttentionMetadata]) -> PagedAttentionContext:
        """The step's attention context over its metadata, one per KV cache group."""
        grouped = len(metadata) > 1
        return PagedAttentionContext(
            backend=self.backend,
            kv_caches=self.kv_caches,
            metadata=metadata[0],
            kv_scales=self.kv_scales,
            layers=self.layer_attention,
            group_metadata=metadata if grouped else None,
            layer_kv_groups=self.kv_layout.layer_kv_group if grouped else None,
        )

    def _graph_serves(
        self,
        cu_seqlens_q: torch.Tensor,  # [B + 1] int32, host
        logits_indices: torch.Tensor,  # [S] int64, host
        block_tables: torch.Tensor,  # [C * B, W] int32, host
        num_tokens: int,
        hidden_rows: HiddenRows | None,
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
            num_kv_groups=self.kv_layout.num_kv_groups,
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
        if self.device.type == "cuda" and self.backend.name == "triton" and self.tp is None:
            self.enable_decode_graphs()

    def _warm_up_step(self) -> None:
        num_kv_groups = self.kv_layout.num_kv_groups
        step = StepInput(
            input_ids=np.zeros(1, dtype=np.int64),
            positions=np.zeros(1, dtype=np.int64),
            slot_mapping=np.zeros(num_kv_groups, dtype=np.int64),
            cu_seqlens_q=np.array([0, 1], dtype=np.int32),
            seq_lens=np.ones(1, dtype=np.int32),
            block_tables=np.zeros((num_kv_groups, 1), dtype=np.int32),
            logits_indices=np.zeros(1, dtype=np.int64),
        )
        self.execute(step)

    @torch.inference_mode()
    def copy_blocks(self, copy_ops: OpsLike) -> None:
        """Copy whole blocks ``src -> dst`` in every layer's K and V (and their scales, for a
        quantized cache). ``copy_ops``: int[K, 2]."""
        ops = self._check_copy_ops(copy_ops)
        if ops is not None:
            self._run_copies(ops)

    @torch.inference_mode()
    def swap_blocks(self, swap_out: OpsLike | None = None, swap_in: OpsLike | None = None) -> None:
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
        hold, so the figure is a memory bandwidth (a few blocks are read from the caches, too fast)."""
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

    def _check_swaps(
        self, swap_out: OpsLike | None, swap_in: OpsLike | None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Both swap arrays as validated CPU int64 ``[K, 2]`` tensors (None: no swaps)."""
        pools = {"device": self.num_blocks, "host": self.num_host_blocks}
        tier = self.host_cache is not None
        return (
            check_block_ops(swap_out, "swap_out", ("device", "host"), pools, tier),
            check_block_ops(swap_in, "swap_in", ("host", "device"), pools, tier),
        )

    def _check_disk_ops(
        self, disk_store: OpsLike, disk_load: OpsLike
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Both disk arrays as validated CPU int64 ``[K, 2]`` tensors (None: no disk ops)."""
        pools = {"host": self.num_host_blocks, "disk": self.num_disk_blocks}
        tier = self.host_cache is not None
        checked = (
            check_block_ops(disk_store, "disk_store", ("host", "disk"), pools, tier),
            check_block_ops(disk_load, "disk_load", ("disk", "host"), pools, tier),
        )
        if any(c is not None for c in checked) and self.disk_cache is None:
            raise InvalidArgumentError("the step has disk ops, but this runner has no disk tier (kv_cache_dir)")
        return checked

    def _check_copy_ops(self, copy_ops: OpsLike) -> torch.Tensor | None:
        return check_copy_ops(copy_ops, self.num_blocks, self.device)

    def _run_copies(self, ops: torch.Tensor) -> None:
        src, dst = ops[:, 0], ops[:, 1]
        copy_blocks(self.kv_cache, src, dst)
        if self.kv_scale_cache is not None:
            copy_blocks(self.kv_scale_cache, src, dst)

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
        out: torch.Tensor = logits.float()
        return out

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

    def kv_fingerprint(self) -> dict[str, Any]:
        """What must match for KV written by another engine (a disk file, a transferred block)
        to be valid here: the model (path, a digest of its config and weight files) and the KV
        format (layers, heads, head_dim, dtypes, scale mode, block size) and, with KV cache
        groups, the page layout (a page and a KV cache group mean other layers under another layout;
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
            # Lists, not tuples: the fingerprint is compared with its JSON round trip. The keys
            # ("columns", "layer_column": the KV cache groups' old name) are in the fingerprints
            # of existing disk tiers and of peers' layouts: renaming them would orphan those.
            geometry["kv_layout"] = {
                "page_layers": layout.page_layers,
                "columns": [[kind, size] for kind, size in layout.kv_groups],
                "layer_column": list(layout.layer_kv_group),
                "layer_slot": list(layout.layer_slot),
            }
        return disk_fingerprint(self.model_path, geometry=geometry)

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
