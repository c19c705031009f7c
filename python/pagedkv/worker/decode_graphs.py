"""CUDA graphs for decode steps: with ``enforce_eager=False`` on a GPU, a step whose
every sequence decodes one token replays a graph captured at start instead of launching the
forward's kernels one by one from Python.

Why: a decode step of a small model on a GPU is a few hundred kernel launches of microseconds
each; launched from Python (transformers' modules, pagedkv's attention function, the Triton
launchers) the step costs more on the host than on the GPU. A replay launches all of them at
once. vLLM and SGLang do the same ("CUDA graphs for decode batch sizes").

How (the invariants a replay relies on):

- **Buckets.** Graphs are captured for a few batch sizes (:func:`capture_sizes`: 1, 2, 4, then
  every multiple of 8 up to ``min(max_num_seqs, 256)``); a step of ``B`` sequences runs the
  smallest bucket ``>= B`` with ``bucket - B`` padding rows. Larger steps, steps with prompt
  rows, and steps that answer prompt rows as hidden states run the usual way.
- **Static buffers.** A graph reads fixed addresses, so every input lives in one buffer sized for
  the largest bucket (token ids, positions, per-group slots and block tables, sequence
  lengths, the constant ``cu_seqlens_q = 0, 1, .., B`` and logit rows ``0 .. B - 1``); a bucket
  uses their first rows. :meth:`DecodeGraphs.run` copies the step into them and the padding
  after it; the outputs (logits) live in the graph's memory pool and are copied out.
- **Padding rows** store nothing (slot -1) and attend over one key in block 0 (sequence length
  1, block table row 0): they read memory in range, write none, and their logits are dropped.
- **Metadata fixed at capture.** Each bucket's :class:`~pagedkv.kernels.AttentionMetadata` is
  built once over the static buffers, without host facts (nothing is read back from the
  device), with the launch hints a replay must keep: one query row per sequence and
  ``max_model_len`` as the longest context, so the Triton decode kernel's split count and grid
  never change (a split past a sequence's end exits at once).
- **Memory.** Graphs are captured from the largest bucket down into one shared pool, so the
  smaller ones reuse its memory.

The mechanics other than the capture itself (buckets, buffers, padding, metadata without host
facts, the forward run on the buffers) run on the CPU too: ``capture=False`` makes a "replay"
call the forward on the buffers (tests/worker/test_decode_graphs.py checks greedy tokens against eager
with it). The capture and its speed are checked on a GPU by ``benches/gpu_check.py``
(section ``cuda_graphs``).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pagedkv.kernels import AttentionBackend, AttentionMetadata
from pagedkv.worker.attention_backend import PagedAttentionContext

__all__ = ["DecodeGraphs", "capture_sizes"]

# Above this many sequences a decode step runs the usual way (vLLM captures up to 512; each
# graph holds its own launch records, and a step of 256 sequences is GPU-bound anyway).
MAX_CAPTURE_SIZE = 256

# forward(input_ids [T] int64, positions [T] int64, logits_indices [S] int64, context) -> logits [S, V]
Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, PagedAttentionContext], torch.Tensor]


def capture_sizes(max_num_seqs: int, limit: int = MAX_CAPTURE_SIZE) -> list[int]:
    """The batch sizes graphs are captured for: 1, 2, 4, every multiple of 8, up to
    ``min(max_num_seqs, limit)`` (which is included)."""
    cap = max(1, min(max_num_seqs, limit))
    sizes = [s for s in (1, 2, 4) if s <= cap] + list(range(8, cap + 1, 8))
    if sizes[-1] != cap:
        sizes.append(cap)
    return sizes


@dataclass
class _Bucket:
    size: int
    context: PagedAttentionContext
    graph: Any  # torch.cuda.CUDAGraph, or None (capture=False: run the forward)
    logits: torch.Tensor | None  # [size, V] float32: the captured forward's output


class DecodeGraphs:
    """Decode steps of up to ``max(sizes)`` sequences through graphs captured per bucket."""

    def __init__(
        self,
        forward: Forward,
        make_context: Callable[[list[AttentionMetadata]], PagedAttentionContext],  # one metadata per KV cache group
        backend: AttentionBackend,
        caches: tuple[torch.Tensor, torch.Tensor],  # one layer's (key, value), [N, block_size, Hkv, D] each
        *,
        num_kv_groups: int,
        max_model_len: int,
        dtype: torch.dtype,  # the layers' query / key / value dtype
        sizes: Sequence[int],
        capture: bool,
    ) -> None:
        self._forward = forward
        self._make_context = make_context
        self._backend = backend
        self._caches = caches
        self.num_kv_groups = num_kv_groups
        self.max_model_len = max_model_len
        self._dtype = dtype
        self.sizes = sorted(sizes)
        self.capture = capture
        key_cache = caches[0]
        self.device = key_cache.device
        block_size = key_cache.shape[1]
        self.max_blocks = -(-max_model_len // block_size)  # block table width
        largest = self.sizes[-1]
        device = self.device
        # The static buffers (module docstring); padding values where no step has written.
        self.input_ids = torch.zeros(largest, dtype=torch.int64, device=device)
        self.positions = torch.zeros(largest, dtype=torch.int64, device=device)
        self.slots = torch.full((num_kv_groups, largest), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros((num_kv_groups, largest, self.max_blocks), dtype=torch.int32, device=device)
        self.seq_lens = torch.ones(largest, dtype=torch.int32, device=device)
        self.cu_seqlens_q = torch.arange(largest + 1, dtype=torch.int32, device=device)
        self.logits_rows = torch.arange(largest, dtype=torch.int64, device=device)
        self._buckets: dict[int, _Bucket] = {}
        self._pool: Any = None
        self.capture_seconds: float | None = None  # capture_all's time

    # ------------------------------------------------------------------ capture

    def capture_all(self) -> None:
        """Captures every bucket, largest first (the smaller ones reuse its memory pool). With
        ``capture=False`` only builds each bucket's metadata and runs its forward once."""
        started = time.perf_counter()
        if self.capture:
            self._pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for size in reversed(self.sizes):
                self._buckets[size] = self._capture(size)
            if self.capture:
                torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - started

    def _capture(self, size: int) -> _Bucket:
        self._pad(0, size)
        metadata: list[AttentionMetadata] = [
            self._backend.prepare(
                self.slots[c, :size],
                self.block_tables[c, :size],
                self.seq_lens[:size],
                self.cu_seqlens_q[: size + 1],
                num_tokens=size,
                key_cache=self._caches[0],
                value_cache=self._caches[1],
                dtype=self._dtype,
                static_bounds=(1, self.max_model_len),
            )
            for c in range(self.num_kv_groups)
        ]
        bucket = _Bucket(size, self._make_context(metadata), None, None)
        # One run first: launchers' caches, the compiled forward's first call and the Triton
        # kernels' compiles happen outside the capture (none may run inside one).
        self._run_forward(bucket)
        if self.capture:
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                bucket.logits = self._run_forward(bucket)
            bucket.graph = graph
        return bucket

    def _run_forward(self, bucket: _Bucket) -> torch.Tensor:
        size = bucket.size
        return self._forward(self.input_ids[:size], self.positions[:size], self.logits_rows[:size], bucket.context)

    # ------------------------------------------------------------------ replay

    def bucket_for(self, num_seqs: int) -> int | None:
        """The bucket a decode step of ``num_seqs`` sequences runs in; None: too many."""
        i = bisect.bisect_left(self.sizes, num_seqs)
        return self.sizes[i] if i < len(self.sizes) and num_seqs > 0 else None

    def run(
        self,
        input_ids: torch.Tensor,  # [B] int64, on any device
        positions: torch.Tensor,  # [B] int64
        slot_mapping: torch.Tensor,  # [C * B] int64 (group c's slots at [c * B, (c + 1) * B))
        block_tables: torch.Tensor,  # [C * B, W] int32, W <= max_blocks, no -1 (clamped)
        seq_lens: torch.Tensor,  # [B] int32
    ) -> torch.Tensor:  # [B, V] float32 logits, a tensor of its own
        """One validated decode step of ``B <= max(sizes)`` sequences (one token each, every
        one sampled) through its bucket's graph."""
        num_seqs = input_ids.shape[0]
        size = self.bucket_for(num_seqs)
        assert size is not None, f"a decode step of {num_seqs} sequences has no graph"
        bucket = self._buckets[size]
        width = block_tables.shape[1]
        self.input_ids[:num_seqs].copy_(input_ids, non_blocking=True)
        self.positions[:num_seqs].copy_(positions, non_blocking=True)
        self.seq_lens[:num_seqs].copy_(seq_lens, non_blocking=True)
        self.slots[:, :num_seqs].copy_(slot_mapping.view(self.num_kv_groups, num_seqs), non_blocking=True)
        self.block_tables[:, :num_seqs, :width].copy_(
            block_tables.view(self.num_kv_groups, num_seqs, width), non_blocking=True
        )
        self._pad(num_seqs, size)
        if bucket.graph is not None:
            bucket.graph.replay()
            assert bucket.logits is not None
            logits = bucket.logits
        else:
            logits = self._run_forward(bucket)
        return logits[:num_seqs].clone()  # the next replay overwrites the graph's output

    def _pad(self, start: int, stop: int) -> None:
        """Rows ``start .. stop - 1`` as padding: no store, one key in block 0 (module docstring)."""
        if start >= stop:
            return
        self.input_ids[start:stop] = 0
        self.positions[start:stop] = 0
        self.seq_lens[start:stop] = 1
        self.slots[:, start:stop] = -1
        self.block_tables[:, start:stop, 0] = 0
