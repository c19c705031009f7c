"""Moving KV blocks between engine processes (the data plane of disaggregated prefill/decode).

- ``kv_transport`` — the :class:`KVTransport` interface, :class:`KVLayout` (what two engines
  must agree on), block-run coalescing and id checks, read grants.
- ``transports`` — :func:`make_transport`: a transport by name (the only module that imports
  the transports).
- ``nixl_transport`` — :class:`NixlTransport`: one-sided RDMA-style reads through NVIDIA NIXL
  (UCX backend; host DRAM or GPU memory), the holder's CPU is not involved.
- ``gloo_transport`` — :class:`GlooTransport`: the fallback without NIXL, ``torch.distributed``
  gloo send/recv between ranks; the holder answers pull requests from a small serving thread.

Nothing here imports NIXL or starts a process group until a transport is constructed.
"""

from __future__ import annotations

from pagedkv.distributed.kv_transport import KVLayout, KVTransport, TransferHandle, coalesce_runs
from pagedkv.distributed.transports import make_transport

__all__ = ["KVLayout", "KVTransport", "TransferHandle", "coalesce_runs", "make_transport"]
