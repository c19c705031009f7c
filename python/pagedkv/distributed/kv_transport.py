"""The KV transport interface and the helpers both transports share.

An engine's paged KV cache is one tensor ``kv_cache[num_layers, 2, num_blocks, block_size,
num_kv_heads, head_dim]`` (plus, for a quantized cache, ``kv_scale_cache[num_layers, 2,
num_blocks, block_size, num_kv_heads]``). Block ``b`` is the ``2 * num_layers`` contiguous
regions ``kv_cache[l, kv, b]``; a run of consecutive blocks ``[b, b + k)`` is ``2 * num_layers``
contiguous regions too, so a transfer is described per *run*, not per block.

With KV cache groups (worker/kv_layout.py) the cache is ``[N, 2, pages, block_size, ...]``: dim
0 holds the ``N`` layers of a page (``page_layers``), a "block" here is a page, and ``num_layers``
is ``N``. Nothing else changes: a page is ``2 * N`` regions, and a request's pages (every
KV cache group's) are just more block ids. Which layer a page slot holds, and which group a page
serves, is not part of this layout: two engines with the same ``N`` but other groups would
exchange bytes in the wrong places, so the connector's handshake first compares the engines'
KV fingerprints, which name the grouped layout (``ModelRunner.kv_fingerprint``, "kv_layout").

Invariants the caller (the scheduler side of disaggregation) guarantees:

- the remote blocks named in ``read_blocks`` stay allocated and unmodified on the holder
  until ``wait()`` returns (or ``done()`` returns True) on the reader;
- the local target blocks are neither read nor written by anyone else until then;
- after a :class:`~pagedkv.errors.KVTransferError` the local target blocks hold undefined data.

Read grants (holder side): :meth:`KVTransport.allow_reads` names the blocks a reader may read
(the connector grants a lease's blocks to the consumer that claimed it, and revokes them when
the lease ends). A transport whose holder takes part in each read (gloo) serves nothing else;
a one-sided one (NIXL) cannot check a read, so there the protection is who gets the metadata.

The transports themselves are built by :func:`pagedkv.distributed.transports.make_transport`
(they import this module; this module imports neither).
"""

from __future__ import annotations

import importlib.util
import json
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from pagedkv.errors import ConfigError, InvalidArgumentError, InvalidBlockError

__all__ = [
    "KVLayout",
    "KVTransport",
    "TransferHandle",
    "coalesce_runs",
    "check_block_ids",
    "run_regions",
    "encode_metadata",
    "decode_metadata",
    "nixl_available",
]

METADATA_VERSION = 1


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class KVLayout:
    """The shape of one engine's KV cache. Two engines can exchange blocks when everything but
    ``num_blocks`` matches (byte-for-byte copies need the same per-block layout).
    ``num_layers`` is the cache's dim 0: every layer, or with KV cache groups the layers of one
    page (see the module docs)."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    scale_dtype: str | None

    @classmethod
    def from_tensors(cls, kv_cache: torch.Tensor, kv_scale_cache: torch.Tensor | None) -> KVLayout:
        if kv_cache.dim() != 6 or kv_cache.shape[1] != 2:
            raise InvalidArgumentError(
                "kv_cache must be [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim], "
                f"got shape {tuple(kv_cache.shape)}"
            )
        # The transports address regions by byte offset from the base pointer.
        if not kv_cache.is_contiguous():
            raise InvalidArgumentError("kv_cache must be contiguous")
        if kv_scale_cache is not None:
            if tuple(kv_scale_cache.shape) != tuple(kv_cache.shape[:5]):
                raise InvalidArgumentError(
                    f"kv_scale_cache shape {tuple(kv_scale_cache.shape)} != {tuple(kv_cache.shape[:5])}"
                )
            if not kv_scale_cache.is_contiguous() or kv_scale_cache.device != kv_cache.device:
                raise InvalidArgumentError("kv_scale_cache must be contiguous and on kv_cache's device")
        layers, _, blocks, block_size, heads, head_dim = (int(x) for x in kv_cache.shape)
        return cls(
            num_layers=layers,
            num_blocks=blocks,
            block_size=block_size,
            num_kv_heads=heads,
            head_dim=head_dim,
            dtype=_dtype_name(kv_cache.dtype),
            scale_dtype=None if kv_scale_cache is None else _dtype_name(kv_scale_cache.dtype),
        )

    @property
    def block_bytes(self) -> int:
        """Bytes of one block in one (layer, K/V) region."""
        itemsize = getattr(torch, self.dtype).itemsize
        return int(self.block_size * self.num_kv_heads * self.head_dim * itemsize)

    @property
    def scale_block_bytes(self) -> int:
        if self.scale_dtype is None:
            return 0
        return int(self.block_size * self.num_kv_heads * getattr(torch, self.scale_dtype).itemsize)

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block occupies over all layers, K and V, scales included."""
        return 2 * self.num_layers * (self.block_bytes + self.scale_block_bytes)

    def check_compatible(self, remote: KVLayout) -> None:
        """Raises ConfigError naming every field that differs (``num_blocks`` may differ)."""
        mismatches = [
            f"{name}: local {getattr(self, name)!r} != remote {getattr(remote, name)!r}"
            for name in ("num_layers", "block_size", "num_kv_heads", "head_dim", "dtype", "scale_dtype")
            if getattr(self, name) != getattr(remote, name)
        ]
        if mismatches:
            raise ConfigError("KV cache layouts are incompatible for transfer: " + "; ".join(mismatches))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KVLayout:
        try:
            return cls(**d)
        except TypeError as e:
            raise ConfigError(f"malformed KV layout in peer metadata: {e}") from e


def encode_metadata(transport: str, engine_id: str, layout: KVLayout, extra: dict[str, Any]) -> bytes:
    # JSON, not pickle: metadata comes from another process and must not be able to run code.
    return json.dumps(
        {
            "version": METADATA_VERSION,
            "transport": transport,
            "engine_id": engine_id,
            "layout": layout.to_dict(),
            **extra,
        }
    ).encode()


def decode_metadata(metadata: bytes, transport: str) -> tuple[str, KVLayout, dict[str, Any]]:
    """Parses a peer's metadata; refuses another transport kind or version with ConfigError."""
    try:
        d = json.loads(metadata)
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"peer KV metadata is not valid JSON: {e}") from e
    if not isinstance(d, dict) or d.get("version") != METADATA_VERSION:
        raise ConfigError(f"peer KV metadata has version {d.get('version') if isinstance(d, dict) else None!r}")
    if d.get("transport") != transport:
        raise ConfigError(f"peer uses KV transport {d.get('transport')!r}, this engine uses {transport!r}")
    return str(d["engine_id"]), KVLayout.from_dict(d["layout"]), d


def check_block_ids(
    remote_block_ids: Sequence[int], local_block_ids: Sequence[int], remote_blocks: int, local_blocks: int
) -> None:
    """Refuses (before anything moves) ids out of range, length mismatches and duplicate targets."""
    if len(remote_block_ids) != len(local_block_ids):
        raise InvalidArgumentError(
            f"{len(remote_block_ids)} remote block ids but {len(local_block_ids)} local block ids"
        )
    for ids, limit, side in ((remote_block_ids, remote_blocks, "remote"), (local_block_ids, local_blocks, "local")):
        for b in ids:
            if isinstance(b, bool) or not isinstance(b, int):
                raise InvalidBlockError(f"{side} block id {b!r} is not an int")
            if not 0 <= b < limit:
                raise InvalidBlockError(f"{side} block id {b} out of range [0, {limit})")
    # Two reads into one local block would race; reading one remote block twice is fine.
    if len(set(local_block_ids)) != len(local_block_ids):
        raise InvalidBlockError("local block ids contain duplicates")


def coalesce_runs(remote_block_ids: Sequence[int], local_block_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """Pairs of ids -> ``(remote_start, local_start, length)`` runs, merging neighbours where both
    sides are consecutive (in the given order): fewer, larger descriptors / copies."""
    runs: list[tuple[int, int, int]] = []
    for r, loc in zip(remote_block_ids, local_block_ids):
        if runs:
            rs, ls, n = runs[-1]
            if r == rs + n and loc == ls + n:
                runs[-1] = (rs, ls, n + 1)
                continue
        runs.append((r, loc, 1))
    return runs


def run_regions(
    base: int, num_layers: int, num_blocks: int, block_bytes: int, start: int, length: int
) -> Iterator[tuple[int, int]]:
    """The ``2 * num_layers`` contiguous byte regions ``(address, nbytes)`` of blocks
    ``[start, start + length)`` in a ``[num_layers, 2, num_blocks, ...]`` tensor at ``base``."""
    for lk in range(2 * num_layers):
        yield base + (lk * num_blocks + start) * block_bytes, length * block_bytes


@dataclass
class TransferHandle:
    """One started ``read_blocks``; pass it to ``wait`` / ``done`` of the transport that made it."""

    peer: str
    num_blocks: int
    nbytes: int
    finished: bool = False
    error: str | None = None
    state: Any = field(default=None, repr=False)  # the transport's own bookkeeping


class KVTransport(ABC):
    """Moves KV blocks between engine processes; one instance per engine process.

    The reader pulls: ``read_blocks`` copies the peer's ``remote_block_ids`` into this engine's
    ``local_block_ids`` (same order, pairwise). It only starts the transfer; ``wait`` or ``done``
    completes it. See the module docstring for what the caller must guarantee meanwhile.
    """

    kind: str = ""
    # This engine's name in its metadata: what a holder calls it in ``allow_reads``.
    engine_id: str = ""
    # Whether the holder checks each read against the grants (False: one-sided reads).
    enforces_read_grants: bool = False
    # This engine's cache layout, set once by register_kv_cache.
    _layout: KVLayout | None = None
    # Holder side: grant name -> (reader engine id, block ids it may read).
    _grants: dict[str, tuple[str, frozenset[int]]]
    _grants_lock: threading.Lock

    def allow_reads(self, reader: str, grant: str, block_ids: Sequence[int]) -> None:
        """Lets peer ``reader`` (its ``engine_id``) read ``block_ids`` of this engine's cache
        until ``revoke_reads(grant)``. Reads of anything not granted to the reader are refused
        where the transport can check them (``enforces_read_grants``)."""
        self._require_layout()
        with self._grants_lock:
            self._grants[grant] = (reader, frozenset(int(b) for b in block_ids))

    def revoke_reads(self, grant: str) -> None:
        """Ends a grant of :meth:`allow_reads` (unknown names are ignored)."""
        self._require_layout()
        with self._grants_lock:
            self._grants.pop(grant, None)

    def reads_allowed(self, reader: str, block_ids: Sequence[int]) -> bool:
        """Whether every one of ``block_ids`` is granted to ``reader`` by some grant."""
        self._require_layout()
        with self._grants_lock:
            granted: set[int] = set()
            for who, blocks in self._grants.values():
                if who == reader:
                    granted |= blocks
        return all(b in granted for b in block_ids)

    def register_kv_cache(self, kv_cache: torch.Tensor, kv_scale_cache: torch.Tensor | None) -> None:
        """Makes this engine's cache readable by peers and writable by reads. Call once."""
        if self._layout is not None:
            raise InvalidArgumentError("a KV cache is already registered with this transport")
        # Set before the transport's registration, which may start a thread that reads them.
        self._grants, self._grants_lock = {}, threading.Lock()
        self._layout = KVLayout.from_tensors(kv_cache, kv_scale_cache)
        try:
            self._register(kv_cache, kv_scale_cache)
        except BaseException:
            self._layout = None
            raise

    @abstractmethod
    def _register(self, kv_cache: torch.Tensor, kv_scale_cache: torch.Tensor | None) -> None:
        """The transport's own registration of a checked cache (``register_kv_cache``)."""

    def _require_layout(self) -> KVLayout:
        if self._layout is None:
            raise InvalidArgumentError("register_kv_cache() must be called first")
        return self._layout

    @abstractmethod
    def local_metadata(self) -> bytes:
        """What a peer passes to ``add_peer``: layout, engine id, transport address."""

    @abstractmethod
    def add_peer(self, metadata: bytes) -> str:
        """Handshake with a peer's ``local_metadata``; ConfigError on an incompatible layout.
        Returns the peer id for ``read_blocks``."""

    @abstractmethod
    def read_blocks(self, peer: str, remote_block_ids: Sequence[int], local_block_ids: Sequence[int]) -> TransferHandle:
        """Starts copying the peer's blocks into local blocks (non-blocking). Bad ids raise
        InvalidBlockError before anything moves; a dead peer raises KVTransferError."""

    @abstractmethod
    def done(self, handle: TransferHandle) -> bool:
        """True once the data is in the local blocks; raises KVTransferError if it failed."""

    @abstractmethod
    def wait(self, handle: TransferHandle, timeout: float) -> None:
        """Blocks until done; KVTransferError on failure or after ``timeout`` seconds."""

    @abstractmethod
    def remove_peer(self, peer: str) -> None:
        """Forgets a peer (its outstanding transfers must be finished or abandoned)."""

    @abstractmethod
    def close(self) -> None:
        """Releases registrations, threads and connections. Idempotent."""


def nixl_available() -> bool:
    """Whether a NIXL wheel is importable (``nixl`` meta package or ``nixl_cu13``/``nixl_cu12``)."""
    return any(importlib.util.find_spec(m) is not None for m in ("nixl", "nixl_cu13", "nixl_cu12"))
