"""``HostKVCache``: the host-memory tier of the KV cache, and the block swaps to and from it.

The host tier is a second pool of blocks, ``[L, 2, num_host_blocks, block_size, Hkv, D]`` in
the device cache's storage dtype (plus ``[L, 2, num_host_blocks, block_size, Hkv]`` bfloat16
scales for a quantized cache), on the CPU, pinned when the device is CUDA. Host block ids are
their own id space (0 .. ``num_host_blocks``), handed out by the Rust scheduler. This class
only owns those tensors and executes a step's swaps; the
:class:`~pagedkv.worker.model_runner.ModelRunner` validates the ids before calling it.

One step's swaps, in this order and before the step's copy-on-write ops and forward:

1. ``swap_out`` rows ``(device_block, host_block)``: host block := device block,
2. ``swap_in`` rows ``(host_block, device_block)``: device block := host block.

A device block may be a swap_out source and a swap_in destination in the same step: the out
copy reads its old content first.
"""

from __future__ import annotations

import torch

from pagedkv.kernels.kv_quant import byte_view

__all__ = ["HostKVCache"]


class HostKVCache:
    """Host copies of KV blocks for one device cache.

    ``HostKVCache(device_kv_cache, device_scale_cache, num_host_blocks)``: the device tensors
    ``[L, 2, num_blocks, ...]`` (scales None for a float cache) whose blocks this tier holds.
    Attributes: ``num_blocks``, ``kv_cache``, ``kv_scale_cache`` (None for a float cache),
    ``pinned``, ``nbytes``.
    """

    def __init__(
        self, device_kv_cache: torch.Tensor, device_scale_cache: torch.Tensor | None, num_host_blocks: int
    ) -> None:
        self.device = device_kv_cache.device
        self.num_blocks = num_host_blocks
        self.pinned = self.device.type == "cuda"
        self._device_tensors = [device_kv_cache] + ([] if device_scale_cache is None else [device_scale_cache])
        # Zeros, as the device cache: a never-written host block swaps in as zeros, not garbage.
        host = [
            torch.zeros(
                (*t.shape[:2], num_host_blocks, *t.shape[3:]), dtype=t.dtype, device="cpu", pin_memory=self.pinned
            )
            for t in self._device_tensors
        ]
        self.kv_cache: torch.Tensor = host[0]
        self.kv_scale_cache: torch.Tensor | None = host[1] if len(host) > 1 else None
        self._host_tensors = host
        self.nbytes = sum(t.numel() * t.element_size() for t in host)
        self._stream = (
            torch.cuda.Stream(device=self.device) if self.device.type == "cuda" else None  # type: ignore[no-untyped-call]
        )

    def swap(self, swap_out: torch.Tensor | None, swap_in: torch.Tensor | None) -> None:
        """Run one step's swaps: ``swap_out`` int64 ``[K, 2]`` (device, host) rows, then
        ``swap_in`` int64 ``[K, 2]`` (host, device) rows (CPU tensors, already validated;
        None = none). On CUDA the compute stream waits for the copies before its next work."""
        if swap_out is None and swap_in is None:
            return
        if self._stream is None:
            self._swap_on_cpu(swap_out, swap_in)
        else:
            self._swap_on_cuda(self._stream, swap_out, swap_in)

    def _pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        # Float8 has no CPU index_copy_: its bytes move as uint8 (byte_view: same memory).
        return [(byte_view(d), byte_view(h)) for d, h in zip(self._device_tensors, self._host_tensors)]

    def _swap_on_cpu(self, swap_out: torch.Tensor | None, swap_in: torch.Tensor | None) -> None:
        # One slice copy per block and tensor: a block is L * 2 contiguous runs of
        # block_size * Hkv * D values, which copy_ moves at memcpy speed, where index_select +
        # index_copy_ over the block axis gathers into a temporary first (3-4x slower on 2
        # cores, benches/RESULTS.md "Swap copy bandwidth"). Destinations within each list are
        # distinct (checked by the runner), and every swap_out finishes before any swap_in.
        pairs = self._pairs()
        if swap_out is not None:
            for device_block, host_block in swap_out.tolist():
                for device_t, host_t in pairs:
                    host_t[:, :, host_block].copy_(device_t[:, :, device_block])
        if swap_in is not None:
            for host_block, device_block in swap_in.tolist():
                for device_t, host_t in pairs:
                    device_t[:, :, device_block].copy_(host_t[:, :, host_block])

    def _swap_on_cuda(
        self, side: torch.cuda.Stream, swap_out: torch.Tensor | None, swap_in: torch.Tensor | None
    ) -> None:
        """The copies run on a side stream.

        Invariants:
        - The side stream first waits for the compute stream: the KV an earlier step wrote
          (forward, copy-on-write) is complete before it is read or overwritten here.
        - Only the CPU reads or writes the host cache; the copy engine only touches pinned
          staging buffers (their reuse is fenced by torch's pinned-memory allocator, which
          records an event for every non_blocking copy). Swap-out: the device rows are
          gathered into one contiguous device buffer, copied into a pinned buffer (one D2H per
          tensor), and the CPU waits for that before scattering them into the host cache, so
          the host blocks hold their new content when this returns (a later swap_in, in this
          step or another, reads them). Swap-in: the CPU gathers the host rows into a pinned
          buffer, one H2D copy per tensor, scattered into the device cache on the side stream.
        - Swap-out's gather is queued on the side stream before swap-in's scatter, so a device
          block that is both reads its old content first.
        - The compute stream waits on an event recorded after the last copy: the forward (and
          copy-on-write) never reads a block before its swap-in lands, and never overwrites a
          swap-out source before it has been read.
        """
        compute = torch.cuda.current_stream(self.device)
        side.wait_stream(compute)
        pairs = self._pairs()
        with torch.cuda.stream(side):
            if swap_out is not None:
                rows = swap_out[:, 0].to(self.device, non_blocking=True)
                staged = []
                for device_t, host_t in pairs:
                    gathered = device_t.index_select(2, rows)
                    pinned = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
                    pinned.copy_(gathered, non_blocking=True)
                    staged.append((host_t, pinned))
                copied = torch.cuda.Event()  # type: ignore[no-untyped-call]
                copied.record(side)
                copied.synchronize()  # the pinned buffers now hold the rows
                for host_t, pinned in staged:
                    host_t.index_copy_(2, swap_out[:, 1], pinned)
            if swap_in is not None:
                rows = swap_in[:, 1].to(self.device, non_blocking=True)
                for device_t, host_t in pairs:
                    shape = (*host_t.shape[:2], swap_in.shape[0], *host_t.shape[3:])
                    pinned = torch.empty(shape, dtype=host_t.dtype, pin_memory=True)
                    torch.index_select(host_t, 2, swap_in[:, 0], out=pinned)
                    device_t.index_copy_(2, rows, pinned.to(self.device, non_blocking=True))
        done = torch.cuda.Event()  # type: ignore[no-untyped-call]
        done.record(side)
        compute.wait_event(done)
