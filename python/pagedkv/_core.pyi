# Type stubs for the Rust extension module pagedkv._core (rust/py/). Checked against the
# compiled module with `python -m mypy.stubtest pagedkv._core` (make lint, and a test).
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Literal, SupportsIndex, final, overload

import numpy as np
import numpy.typing as npt

_Ints = Sequence[SupportsIndex] | Iterable[SupportsIndex] | npt.NDArray[np.int32] | npt.NDArray[np.int64]

__all__ = [
    "BlockAllocator",
    "ERROR_CLASS_NAMES",
    "KVCacheManager",
    "MAX_BLOCK_SIZE",
    "MAX_NUM_BLOCKS",
    "RequestUpdate",
    "RequestUpdates",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "SchedulerStats",
    "block_hashes",
    "check_config_fields",
    "config_fields",
    "cpu_isa",
    "cpu_linear",
    "cpu_linear_gguf",
    "gguf_linear_isas",
    "paged_decode_attention_cpu",
    "resolve_speculative",
]

MAX_NUM_BLOCKS: int
MAX_BLOCK_SIZE: int
# The pagedkv.errors classes the bindings can raise (tests/core/test_errors_mapping.py).
ERROR_CLASS_NAMES: tuple[str, ...]

@final
class BlockAllocator:
    """A fixed pool of KV blocks with ref counts, copy-on-write sharing and a prefix cache."""

    def __new__(
        cls,
        num_blocks: SupportsIndex,
        block_size: SupportsIndex,
        enable_prefix_caching: bool | None = None,
        *,
        hash_bits: SupportsIndex | None = None,
    ) -> BlockAllocator: ...
    def allocate(self, n: SupportsIndex) -> list[int] | None: ...
    def free(self, block_ids: _Ints) -> None: ...
    def fork(self, block_ids: _Ints) -> None: ...
    def touch(self, block_ids: _Ints) -> None: ...
    def ref_count(self, block_id: SupportsIndex) -> int: ...
    def cache_blocks(self, block_ids: _Ints, token_ids: _Ints, cache_salt: str | None = None) -> int: ...
    def find_cached_prefix(self, token_ids: _Ints, cache_salt: str | None = None) -> list[int]: ...
    def is_cached(self, block_id: SupportsIndex) -> bool: ...
    def free_block_ids(self) -> list[int]: ...
    def reset_prefix_cache(self) -> int: ...
    def check_invariants(self) -> None: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def enable_prefix_caching(self) -> bool: ...
    @property
    def num_free_blocks(self) -> int: ...
    @property
    def num_used_blocks(self) -> int: ...
    @property
    def usage(self) -> float: ...
    @property
    def num_cached_blocks(self) -> int: ...
    @property
    def num_evictions(self) -> int: ...

@final
class KVCacheManager:
    """Block tables of many sequences over one block pool, with prefix caching and copy-on-write."""

    def __new__(
        cls,
        num_blocks: SupportsIndex,
        block_size: SupportsIndex,
        enable_prefix_caching: bool | None = None,
        *,
        hash_bits: SupportsIndex | None = None,
    ) -> KVCacheManager: ...
    def add_sequence(self, token_ids: _Ints, *, cache_salt: str | None = None) -> tuple[int, int]: ...
    def allocate_slots(self, seq_id: SupportsIndex, num_tokens: SupportsIndex) -> bool: ...
    def append_token_ids(self, seq_id: SupportsIndex, token_ids: _Ints) -> None: ...
    def append_decode_tokens(self, seq_ids: _Ints, token_ids: _Ints) -> npt.NDArray[np.bool_]: ...
    def fork(self, seq_id: SupportsIndex) -> int: ...
    def free(self, seq_id: SupportsIndex) -> None: ...
    def block_table(self, seq_id: SupportsIndex) -> npt.NDArray[np.int32]: ...
    def block_tables(self, seq_ids: _Ints) -> npt.NDArray[np.int32]: ...
    def slot_mapping(
        self, seq_id: SupportsIndex, start: SupportsIndex | None = None, end: SupportsIndex | None = None
    ) -> npt.NDArray[np.int64]: ...
    def token_ids(self, seq_id: SupportsIndex) -> npt.NDArray[np.int32]: ...
    def num_tokens(self, seq_id: SupportsIndex) -> int: ...
    def num_computed_tokens(self, seq_id: SupportsIndex) -> int: ...
    def take_copy_ops(self) -> npt.NDArray[np.int32]: ...
    def ref_count(self, block_id: SupportsIndex) -> int: ...
    def reset_prefix_cache(self) -> int: ...
    def check_invariants(self) -> None: ...
    def sequence_ids(self) -> list[int]: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def num_free_blocks(self) -> int: ...
    @property
    def usage(self) -> float: ...
    @property
    def num_sequences(self) -> int: ...
    @property
    def prefix_cache_queries(self) -> int: ...
    @property
    def prefix_cache_hits(self) -> int: ...

@final
class SchedulerConfig:
    """Scheduler configuration, validated on construction."""

    def __new__(
        cls,
        *,
        num_blocks: SupportsIndex,
        block_size: SupportsIndex | None = None,
        max_num_seqs: SupportsIndex | None = None,
        max_num_batched_tokens: SupportsIndex | None = None,
        max_model_len: SupportsIndex | None = None,
        enable_prefix_caching: bool | None = None,
        policy: str | None = None,
        watermark: float | None = None,
        hash_bits: SupportsIndex | None = None,
        num_host_blocks: SupportsIndex | None = None,
        num_disk_blocks: SupportsIndex | None = None,
        preemption_mode: str | None = None,
        bytes_per_block: SupportsIndex | None = None,
        swap_bytes_per_second: float | None = None,
        recompute_tokens_per_second: float | None = None,
        manual_clock: bool | None = None,
        enable_kv_events: bool | None = None,
        attention_spans: Sequence[tuple[str, SupportsIndex | None]] | None = None,
        num_speculative_tokens: SupportsIndex | None = None,
        speculative_method: str | None = None,
        prompt_lookup_min: SupportsIndex | None = None,
        prompt_lookup_max: SupportsIndex | None = None,
        speculative_adaptive: bool | None = None,
        suffix_decoding_max_tree_depth: SupportsIndex | None = None,
        suffix_decoding_max_spec_factor: float | None = None,
        suffix_decoding_min_token_prob: float | None = None,
        suffix_decoding_max_cached_requests: SupportsIndex | None = None,
    ) -> SchedulerConfig: ...
    @property
    def attention_spans(self) -> list[tuple[str, int | None]]: ...
    @property
    def num_speculative_tokens(self) -> int:
        """Most tokens drafted per row and step (0: speculative decoding off)."""
    @property
    def speculative_method(self) -> str | None: ...
    def blocks_for_sequence(self, len: SupportsIndex) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def max_num_seqs(self) -> int: ...
    @property
    def max_num_batched_tokens(self) -> int: ...
    @property
    def max_model_len(self) -> int: ...
    @property
    def enable_prefix_caching(self) -> bool: ...
    @property
    def policy(self) -> str: ...
    @property
    def watermark(self) -> float: ...
    @property
    def num_host_blocks(self) -> int: ...
    @property
    def num_disk_blocks(self) -> int: ...
    @property
    def preemption_mode(self) -> str: ...
    @property
    def bytes_per_block(self) -> int: ...
    @property
    def enable_kv_events(self) -> bool: ...

@final
class SchedulerOutput:
    """One step: flat arrays in batch order (T tokens, B rows, S sampled rows, K copy ops)."""

    @property
    def step_id(self) -> int: ...
    @property
    def num_reqs(self) -> int: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def is_empty(self) -> bool: ...
    @property
    def req_ids(self) -> list[str]: ...
    @property
    def num_scheduled_tokens(self) -> npt.NDArray[np.int32]: ...
    @property
    def input_ids(self) -> npt.NDArray[np.int64]: ...
    @property
    def positions(self) -> npt.NDArray[np.int64]: ...
    @property
    def cu_seqlens_q(self) -> npt.NDArray[np.int32]: ...
    @property
    def seq_lens(self) -> npt.NDArray[np.int32]: ...
    @property
    def block_tables(self) -> npt.NDArray[np.int32]: ...  # [C * B, W]
    @property
    def slot_mapping(self) -> npt.NDArray[np.int64]: ...  # [C * T]
    @property
    def num_kv_groups(self) -> int: ...
    @property
    def logits_indices(self) -> npt.NDArray[np.int64]: ...
    @property
    def sampled_req_ids(self) -> list[str]: ...
    @property
    def sample_indices(self) -> npt.NDArray[np.int32]: ...
    @property
    def draft_offsets(self) -> npt.NDArray[np.int32]:
        """Per sampled row: the drafts of its row before the position it samples after (0
        where there are none). A row with ``d`` drafts has ``d + 1`` consecutive sampled rows,
        offsets ``0 .. d``."""
    @property
    def beam_rows(self) -> npt.NDArray[np.int64]:
        """Sampled rows (indices into ``logits_indices``) of beam requests: their logits give
        the beam candidates ``update`` needs, not a sampled token."""
    @property
    def copy_ops(self) -> npt.NDArray[np.int32]: ...
    @property
    def swap_out(self) -> npt.NDArray[np.int32]: ...
    @property
    def swap_in(self) -> npt.NDArray[np.int32]: ...
    @property
    def disk_store(self) -> npt.NDArray[np.int32]: ...
    @property
    def disk_load(self) -> npt.NDArray[np.int32]: ...
    @property
    def preempted_req_ids(self) -> list[str]: ...
    @property
    def finished_req_ids(self) -> list[str]: ...
    @property
    def finish_reasons(self) -> list[str]: ...

@final
class RequestUpdate:
    """The effect of one sampled token on one sample of a request."""

    @property
    def request_id(self) -> str: ...
    @property
    def index(self) -> int: ...
    @property
    def new_token_ids(self) -> list[int]: ...
    @property
    def finish_reason(self) -> str | None: ...
    @property
    def finished(self) -> bool: ...
    @property
    def num_cached_tokens(self) -> int: ...
    @property
    def parent(self) -> int | None:
        """Beam search: the rank, before this step, of the beam this one continues."""
    @property
    def cumulative_logprob(self) -> float | None:
        """Beam search: the beam's cumulative log-probability (the best sequence's at the end)."""
    @property
    def logits_row(self) -> int | None:
        """The logits row the token was sampled from (None for beam search)."""

@final
class RequestUpdates(Sequence[RequestUpdate]):
    """What ``Scheduler.update`` returns: one update per sampled row of a live request, in
    logits-row order (a beam request: one per live beam after the step, or one when its search
    ended). A read-only sequence of RequestUpdate (items are built when accessed), with
    the same data as columns for bulk reads."""

    def __len__(self) -> int: ...
    @overload
    def __getitem__(self, key: SupportsIndex, /) -> RequestUpdate: ...
    @overload
    def __getitem__(self, key: slice, /) -> list[RequestUpdate]: ...
    def __iter__(self) -> Iterator[RequestUpdate]: ...
    @property
    def request_ids(self) -> list[str]: ...
    @property
    def indices(self) -> list[int]: ...
    @property
    def token_ids(self) -> list[int]: ...
    @property
    def finish_reasons(self) -> list[str | None]: ...
    @property
    def num_cached_tokens(self) -> list[int]: ...

@final
class SchedulerStats:
    """A snapshot of the scheduler's state and counters."""

    @property
    def num_blocks(self) -> int: ...
    @property
    def num_free_blocks(self) -> int: ...
    @property
    def num_used_blocks(self) -> int: ...
    @property
    def num_cached_blocks(self) -> int: ...
    @property
    def kv_usage(self) -> float: ...
    @property
    def kv_utilization(self) -> float: ...
    @property
    def tokens_held(self) -> int: ...
    @property
    def slots_allocated(self) -> int: ...
    @property
    def num_running(self) -> int: ...
    @property
    def num_waiting(self) -> int: ...
    @property
    def num_waiting_for_grammar(self) -> int: ...
    @property
    def num_waiting_for_remote_kv(self) -> int: ...
    @property
    def num_preemptions(self) -> int: ...
    @property
    def prefix_cache_queries(self) -> int: ...
    @property
    def prefix_cache_hits(self) -> int: ...
    @property
    def prefix_cache_hit_rate(self) -> float: ...
    @property
    def resumed_prefix_queries(self) -> int: ...
    @property
    def resumed_prefix_hits(self) -> int: ...
    @property
    def num_steps(self) -> int: ...
    @property
    def num_finished_stop(self) -> int: ...
    @property
    def num_finished_length(self) -> int: ...
    @property
    def num_aborted(self) -> int: ...
    @property
    def num_evictions(self) -> int: ...
    @property
    def num_host_blocks(self) -> int: ...
    @property
    def num_host_free_blocks(self) -> int: ...
    @property
    def num_host_used_blocks(self) -> int: ...
    @property
    def num_host_cached_blocks(self) -> int: ...
    @property
    def host_kv_usage(self) -> float: ...
    @property
    def num_host_evictions(self) -> int: ...
    @property
    def num_swapped(self) -> int: ...
    @property
    def num_swap_preemptions(self) -> int: ...
    @property
    def prefix_cache_host_hits(self) -> int: ...
    @property
    def blocks_swapped_out(self) -> int: ...
    @property
    def blocks_swapped_in(self) -> int: ...
    @property
    def bytes_swapped_out(self) -> int: ...
    @property
    def bytes_swapped_in(self) -> int: ...
    @property
    def num_write_backs(self) -> int: ...
    @property
    def num_write_backs_skipped(self) -> int: ...
    @property
    def num_disk_blocks(self) -> int: ...
    @property
    def num_disk_cached_blocks(self) -> int: ...
    @property
    def prefix_cache_disk_hits(self) -> int: ...
    @property
    def blocks_written_to_disk(self) -> int: ...
    @property
    def blocks_read_from_disk(self) -> int: ...
    @property
    def num_disk_writes_skipped(self) -> int: ...
    @property
    def num_kv_leases(self) -> int: ...
    @property
    def num_kv_reservations(self) -> int: ...
    @property
    def beam_blocks_in_use(self) -> int:
        """Distinct device blocks held by running beams."""
    @property
    def beam_block_refs(self) -> int:
        """Sum of the running beams' block-table lengths (blocks with a private copy each)."""
    @property
    def beam_blocks_shared(self) -> int:
        """Device blocks held by two or more running beams."""
    @property
    def num_beam_forks(self) -> int:
        """Beams forked from a parent beam so far."""
    @property
    def num_spec_drafts(self) -> int:
        """Speculative decoding: rows verified with drafts."""
    @property
    def num_spec_draft_tokens(self) -> int:
        """Draft tokens verified."""
    @property
    def num_spec_accepted_tokens(self) -> int:
        """Of those, drafts accepted."""
    @property
    def num_spec_blocks_freed(self) -> int:
        """Blocks given back at once because rejected drafts alone occupied them."""
    def as_dict(self) -> dict[str, int | float]: ...

@final
class Scheduler:
    """Continuous-batching scheduler over a paged KV cache."""

    def __new__(cls, config: SchedulerConfig) -> Scheduler: ...
    @property
    def config(self) -> SchedulerConfig: ...
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: _Ints,
        *,
        max_tokens: SupportsIndex,
        min_tokens: SupportsIndex | None = None,
        eos_token_ids: _Ints | None = None,
        stop_token_ids: _Ints | None = None,
        ignore_eos: bool | None = None,
        priority: SupportsIndex | None = None,
        cache_salt: str | None = None,
        n: SupportsIndex | None = None,
        retention_priority: SupportsIndex | None = None,
        retention_duration: float | None = None,
        retention_tokens: SupportsIndex | None = None,
        hold_kv: bool | None = None,
        beam_width: SupportsIndex | None = None,
        length_penalty: float | None = None,
        skip_prefix_cache: bool | None = None,
        speculate: bool | None = None,
        wait_for: Iterable[str] | None = None,
    ) -> None:
        """Adds a request; with ``wait_for`` (among ``"grammar"``, ``"remote_kv"``) it is
        blocked, never scheduled and holding no block, until ``unblock`` lifts each reason."""
    def add(self, request: object) -> None:
        """Adds ``request``, an object with ``add_request``'s argument names as attributes
        (``pagedkv.engine.admission.SchedulerRequest``): the same checks and errors."""
    def schedule(self) -> SchedulerOutput: ...
    def update(
        self,
        output: SchedulerOutput,
        sampled_token_ids: _Ints,
        beam_token_ids: Iterable[_Ints] | None = None,
        beam_logprobs: Iterable[Sequence[float]] | None = None,
    ) -> RequestUpdates:
        """Applies one sampled token per logits row; with beam rows (``output.beam_rows``), also
        every beam decision of the step from the candidates ``[R, k]``."""
    def take_beam_results(self) -> list[tuple[str, list[tuple[list[int], float, float, str]]]]:
        """Results of the beam searches that ended: ``(request_id, [(token_ids,
        cumulative_logprob, score, finish_reason), ...])``, best first."""
    def abort_request(self, request_id: str) -> list[str]:
        """Ends the request in any state; returns what it was still waiting for."""
    def unblock(self, request_id: str, what: str) -> bool:
        """Lifts one wait reason; True when the request is now queued for scheduling."""
    def waiting_for(self, request_id: str) -> list[str] | None: ...
    def finish_sample(self, request_id: str, index: SupportsIndex | None = None) -> bool: ...
    def rollback_step(self, output: SchedulerOutput) -> list[str]: ...
    def has_unfinished_requests(self) -> bool: ...
    @property
    def num_waiting(self) -> int: ...
    @property
    def num_running(self) -> int: ...
    def stats(self) -> SchedulerStats: ...
    def check_invariants(self) -> None: ...
    def memory_map(self) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.bool_], npt.NDArray[np.int64]]: ...
    def block_kv_groups(self) -> npt.NDArray[np.int16]: ...
    def set_cost_model(
        self, swap_bytes_per_second: float, recompute_tokens_per_second: float, bytes_per_block: SupportsIndex
    ) -> None: ...
    def set_spec_cost(self, overhead_s: float, per_token_s: float) -> None: ...
    def spec_accepted_per_position(self) -> list[int]: ...
    def spec_drafts_worth(self) -> int: ...
    def set_drafts(self, request_id: str, index: SupportsIndex, num_tokens: SupportsIndex, token_ids: _Ints) -> bool:
        """Drafts for sample ``index`` of ``request_id`` following its ``num_tokens`` tokens
        (method "draft_model"); verified by the next step that schedules it."""
    def advance_clock(self, seconds: float) -> None: ...
    def schedule_flush(self) -> SchedulerOutput: ...
    def disk_block_info(self, slots: _Ints) -> list[tuple[bytes, bytes | None, list[int], str | None, int] | None]: ...
    def restore_disk_blocks(
        self, entries: Iterable[tuple[bytes, bytes | None, _Ints, str | None, int]]
    ) -> list[int | None]: ...
    def invalidate_disk_blocks(self, slots: _Ints) -> None: ...
    def tier_map(self) -> tuple[npt.NDArray[np.bool_], npt.NDArray[np.int32], npt.NDArray[np.bool_]]: ...
    def take_kv_events(self, timestamp: float) -> bytes | None:
        """The KV-cache events since the last call as one msgpack batch in vLLM's wire format
        (decode with ``pagedkv.server.kv_events.decode_event_batch``), or None when events are
        off or nothing happened."""
    def reset_prefix_cache(self) -> int: ...
    def block_hashes(self, token_ids: _Ints, cache_salt: str | None = None) -> list[int]:
        """The wire hashes (uint64) KV events give the full blocks of ``token_ids``."""
    def disk_map(self) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.bool_]]: ...
    def request_summaries(self) -> list[tuple[str, int, str, int, int, int, int, int]]:
        """Per live request: (id, arrival, state, prompt_tokens, output_tokens, num_blocks,
        cached_tokens, num_samples), in arrival order."""
    def kv_lease(self, request_id: str) -> tuple[list[int], int] | None:
        """``(block_ids, num_tokens)`` held for ended ``hold_kv`` request ``request_id``; with KV
        cache groups every group's blocks, group-major (group 0's ``n``, then group 1's ...)."""
    def release_kv_lease(self, request_id: str) -> bool: ...
    def kv_lease_ids(self) -> list[str]: ...
    def reserve_kv(
        self, reservation_id: str, prompt_token_ids: _Ints, max_blocks: SupportsIndex, cache_salt: str | None = None
    ) -> tuple[int, list[int]] | None:
        """``(num_hit_blocks, fresh_block_ids)`` reserved for remote KV, or None (no room); with KV
        cache groups the hits are every group's and the fresh ids every group's, group-major."""
    def commit_kv(self, reservation_id: str) -> bool: ...
    def cancel_kv(self, reservation_id: str) -> bool: ...

# A paged cache as paged_decode_attention_cpu reads it: float32, int8, or the bytes of fp8.
_KVCacheArray = npt.NDArray[np.float32] | npt.NDArray[np.int8] | npt.NDArray[np.uint8]

def block_hashes(token_ids: _Ints, block_size: SupportsIndex, cache_salt: str | None = None) -> list[int]: ...

# The scheduler's settings table (rust/scheduler/config.rs): defaults, ranges, checks.
def config_fields() -> dict[str, dict[str, Any]]: ...
def check_config_fields(**fields: Any) -> None: ...
def resolve_speculative(**args: Any) -> dict[str, Any]: ...
def paged_decode_attention_cpu(
    query: npt.NDArray[np.float32],  # [T, H, D]
    key_cache: _KVCacheArray,  # [num_blocks, block_size, Hkv, D]
    value_cache: _KVCacheArray,  # key_cache's shape and dtype
    block_tables: npt.NDArray[np.int32],  # [B, W]
    seq_lens: npt.NDArray[np.int32],  # [B]
    cu_seqlens_q: npt.NDArray[np.int32],  # [B + 1]
    out: npt.NDArray[np.float32],  # [T, H, D], written for the decode rows
    scale: float,
    num_threads: int,
    kv_format: Literal["float32", "int8", "fp8_e4m3", "fp8_e5m2"] = "float32",
    key_scales: npt.NDArray[np.int16] | None = None,  # [num_blocks, block_size, Hkv] bfloat16 bits
    value_scales: npt.NDArray[np.int16] | None = None,  # [num_blocks, block_size, Hkv] bfloat16 bits
    sliding_window: SupportsIndex | None = None,
    chunk_size: SupportsIndex | None = None,
    logits_soft_cap: float | None = None,
    sinks: npt.NDArray[np.float32] | None = None,  # [H]
) -> int:
    """Decode attention straight from the paged caches (pagedkv.kernels.cpu uses it).

    Caches: float32 for ``kv_format="float32"``, int8 for ``"int8"``, uint8 (the fp8 bytes,
    ``tensor.view(torch.uint8).numpy()``) for ``"fp8_e4m3"`` / ``"fp8_e5m2"``; the quantized
    formats need ``key_scales`` / ``value_scales`` (``scales.view(torch.int16).numpy()``).
    A layer variant (pagedkv.kernels.LayerAttention): ``sliding_window`` / ``chunk_size`` (a row
    reads only the blocks from its first visible position on), ``logits_soft_cap``, ``sinks``.
    Returns the number of decode rows written."""

def cpu_linear(
    x: npt.NDArray[np.float32],  # [M, K]
    weight: npt.NDArray[np.float32] | npt.NDArray[np.int8] | npt.NDArray[np.uint16],  # [N, K]
    out: npt.NDArray[np.float32],  # [M, N], written
    num_threads: int,
    scales: npt.NDArray[np.float32] | None = None,  # [N], with int8 weights
    bias: npt.NDArray[np.float32] | None = None,  # [N]
    prefetch: bool = True,
    isa: str = "auto",
) -> None:
    """``out = x @ (weight * scales[:, None]).T + bias`` (pagedkv.worker.cpu_linear uses it).

    Float32 weights take no ``scales``; int8 codes need them; uint16 weights are bfloat16 bit
    patterns (no scales). Every array C-contiguous. Row ``m`` of ``out`` is bit for bit what
    ``x[m:m+1]`` alone gives, on any thread count (on one path).
    ``prefetch=False`` turns off the prefetch of weight rows ahead (to measure it; same bits).
    ``isa``: ``"auto"`` (the fastest path this CPU has, :func:`cpu_isa`), ``"portable"``,
    ``"avx2"``, ``"avx512"`` or ``"avx512_bf16"`` (bfloat16 weights: the inputs rounded to
    bfloat16; other weights run ``"avx512"``); a path the CPU lacks is an InvalidArgumentError."""

def cpu_isa() -> dict[str, Any]:
    """The CPU's instruction-set extensions (``features``), the paths of :func:`cpu_linear` it
    can run (``linear_paths``), the one ``isa="auto"`` takes per weight format (``linear``:
    ``float32``, ``int8``, ``bfloat16``) and the decode attention kernel's path (``attention``)."""

def cpu_linear_gguf(
    x: npt.NDArray[np.float32],  # [M, K]
    blocks: npt.NDArray[np.uint8],  # [N, K / block_values * block_bytes]
    kind: str,  # "Q4_0" | "Q4_1" | "Q8_0" | "Q4_K"
    out: npt.NDArray[np.float32],  # [M, N], written
    num_threads: int,
    bias: npt.NDArray[np.float32] | None = None,  # [N]
    isa: str = "auto",  # "auto" | "portable" | "avx2" | "avx512"
) -> None:
    """``out = x @ W.T + bias`` with ``W`` read straight from GGUF blocks (pagedkv.worker.gguf_linear).

    Each row of ``blocks`` is one weight row's blocks as a GGUF file stores them. ``isa`` forces
    an instruction set (one the CPU lacks is an error; :func:`gguf_linear_isas` lists them).
    Every array C-contiguous. Row ``m`` of ``out`` is bit for bit what ``x[m:m+1]`` alone gives,
    on any thread count (on one instruction set)."""

def gguf_linear_isas() -> list[str]:
    """The instruction sets this CPU runs :func:`cpu_linear_gguf` on (``"avx512"``, ``"avx2"``, then
    ``"portable"``, always last); ``"auto"`` picks ``"avx2"`` where the CPU has it."""
