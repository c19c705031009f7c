"""``DiskKVStore``: the disk tier of the KV cache — one file per cached block, below the host tier.

The Rust core decides what goes to disk and where (``Scheduler`` disk slots: cached host blocks
the host pool evicts are written down, a prefix hit found only on disk is read back into a
host block); this class owns the files and moves the bytes. One step's disk ops, in the
runner's order (docs/core.md, "KV offload tiers"):

1. ``disk_store`` rows ``(host_block, slot)``: the host block's KV is written to the slot's
   file, *before* the step's swap-outs may overwrite that host block;
2. (``swap_out``: device → host)
3. ``disk_load`` rows ``(slot, host_block)``: the slot's file is read into the host block;
4. (``swap_in``: host → device, then copy-on-write and the forward).

File format (one block group: every layer's K and V of one block, and their scales for a
quantized cache), ``<kv_cache_dir>/pagedkv-<fingerprint>/slot-<slot>.kvb``:

- 8 bytes magic ``PAGEDKV1``, 4 bytes little-endian header length ``n``;
- ``n`` bytes of UTF-8 JSON: ``fingerprint`` (model, its config and weight files, geometry,
  dtypes, block size, scale mode, and the page layout with KV cache groups), the block's
  ``hash`` and ``parent_hash`` (hex), ``tokens``, ``salt``, ``column`` (the file format's name for the KV cache group
  whose layers the page holds; 0 without groups, and absent in files written before them),
  ``payload_bytes`` and the payload's ``crc32``; padded so the payload starts at a 4096-byte
  boundary;
- the payload: each host tensor's ``[N, 2, block_size, ...]`` slice of the block (``N`` the
  layers of a page: every layer without groups), raw, C order.

A file is written to a temporary name and renamed, so a crash leaves either the old file or
the new one. A restarted engine on the same model and settings (same fingerprint folder)
reads every header (:meth:`DiskKVStore.scan`), checks the fingerprint, the size and the
checksum, and hands the entries to :meth:`Scheduler.restore_disk_blocks`, which verifies each
block's hash from its parent's and its tokens. Anything that does not check out is skipped
with a warning, never served. A store that fails (full disk, I/O error) is reported back to
the scheduler as a bad slot (:meth:`DiskKVStore.take_bad_slots`) so nothing is served from it:
the KV is recomputed instead.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import warnings
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pagedkv.config import MAX_NUM_BLOCKS
from pagedkv.errors import PagedKVError
from pagedkv.kernels.kv_quant import byte_view

__all__ = ["DiskEntry", "DiskKVStore", "DiskTierError", "disk_fingerprint"]

_MAGIC = b"PAGEDKV1"
_ALIGN = 4096
_FORMAT_VERSION = 1


class DiskTierError(PagedKVError, OSError):
    """A disk-tier file could not be read while a step needed it (the step is rolled back and
    the slot forgotten, so the retry recomputes that KV)."""


@dataclass(frozen=True)
class DiskEntry:
    """A valid file found by :meth:`DiskKVStore.scan`."""

    path: str
    hash: bytes
    parent_hash: bytes | None
    tokens: list[int]
    salt: str | None
    kv_group: int = 0


def disk_fingerprint(model_path: str, *, geometry: dict[str, Any]) -> dict[str, Any]:
    """What must match for a file's KV to be valid in this engine: the model (its path, a digest
    of its config and of its weight files' names and sizes) and ``geometry`` (layers, KV heads,
    head_dim, dtypes, block size, scale mode...)."""
    digest = hashlib.sha256()
    if os.path.isdir(model_path):
        for name in sorted(os.listdir(model_path)):
            full = os.path.join(model_path, name)
            if name == "config.json":
                with open(full, "rb") as f:
                    digest.update(f.read())
            elif name.endswith((".safetensors", ".bin", ".gguf")):
                digest.update(f"{name}:{os.path.getsize(full)}".encode())
    return {"version": _FORMAT_VERSION, "model": model_path, "model_digest": digest.hexdigest(), **geometry}


class DiskKVStore:
    """The disk tier's files for one host cache (see the module docs).

    ``DiskKVStore(folder, host_tensors, max_bytes, fingerprint)``: ``host_tensors`` are the host
    tier's ``[L, 2, num_host_blocks, ...]`` tensors (KV, then scales for a quantized cache);
    ``max_bytes`` bounds the files (a payload and a header page each, at most
    ``MAX_NUM_BLOCKS`` of them). Attributes: ``folder`` (the fingerprint's subfolder),
    ``num_slots`` (0 when ``max_bytes`` holds no file), ``payload_bytes``, ``file_bytes``.
    """

    def __init__(
        self, folder: str, host_tensors: Sequence[torch.Tensor], max_bytes: int, fingerprint: dict[str, Any]
    ) -> None:
        self.fingerprint = fingerprint
        key = hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:16]
        self.folder = os.path.join(folder, f"pagedkv-{key}")
        os.makedirs(self.folder, exist_ok=True)
        self._host = [byte_view(t) for t in host_tensors]  # fp8 as bytes: same memory
        self._block_shapes = [(*t.shape[:2], *t.shape[3:]) for t in self._host]
        self.payload_bytes = sum(_numel(s) * t.element_size() for s, t in zip(self._block_shapes, self._host))
        self.file_bytes = self.payload_bytes + _ALIGN  # a typical header fits in one page
        self.num_slots = min(max_bytes // self.file_bytes, MAX_NUM_BLOCKS)
        self._bad: list[int] = []
        self._failed_slots: set[int] = set()

    def path(self, slot: int) -> str:
        """The file of ``slot``."""
        return os.path.join(self.folder, f"slot-{slot:08d}.kvb")

    # ------------------------------------------------------------------ per step

    def store(
        self, ops: torch.Tensor, infos: Sequence[tuple[bytes, bytes | None, list[int], str | None, int] | None]
    ) -> None:
        """Write ``ops`` ``[K, 2]`` (host block, slot) rows, ``infos[i]`` the identity of row i's
        slot (``Scheduler.disk_block_info``). A failed write is warned about and its slot
        reported by :meth:`take_bad_slots`; the step goes on."""
        for (host_block, slot), info in zip(ops.tolist(), infos):
            try:
                if info is None:
                    raise OSError("the scheduler has no identity for this slot")
                self._write(int(slot), int(host_block), info)
            except OSError as exc:
                warnings.warn(
                    f"KV disk tier: cannot write slot {slot} ({exc}); its KV will be recomputed", stacklevel=2
                )
                self._bad.append(int(slot))
                self._failed_slots.add(int(slot))

    def load(self, ops: torch.Tensor) -> None:
        """Read ``ops`` ``[K, 2]`` (slot, host block) rows into the host cache. Raises
        :class:`DiskTierError` (after reporting the slot) if a file is missing, truncated or
        corrupt: the step must not run on it."""
        for slot, host_block in ops.tolist():
            try:
                if int(slot) in self._failed_slots:
                    raise OSError("its write failed")
                self._read(int(slot), int(host_block))
            except (OSError, ValueError) as exc:
                self._bad.append(int(slot))
                raise DiskTierError(f"KV disk tier: cannot read slot {slot}: {exc}") from exc

    def take_bad_slots(self) -> list[int]:
        """Slots whose file failed since the last call (to ``Scheduler.invalidate_disk_blocks``)."""
        bad, self._bad = self._bad, []
        return bad

    def _write(self, slot: int, host_block: int, info: tuple[bytes, bytes | None, list[int], str | None, int]) -> None:
        hash_, parent, tokens, salt, kv_group = info
        parts = [t[:, :, host_block].contiguous() for t in self._host]
        payload = b"".join(p.numpy().tobytes() for p in parts)
        header = json.dumps(
            {
                "fingerprint": self.fingerprint,
                "hash": hash_.hex(),
                "parent_hash": None if parent is None else parent.hex(),
                "tokens": list(tokens),
                "salt": salt,
                "column": kv_group,
                "payload_bytes": len(payload),
                "crc32": zlib.crc32(payload),
            }
        ).encode()
        start = _payload_offset(len(header))
        blob = _MAGIC + len(header).to_bytes(4, "little") + header
        tmp = self.path(slot) + ".tmp"
        with open(tmp, "wb") as f:
            f.write(blob)
            f.write(b"\0" * (start - len(blob)))
            f.write(payload)
        os.replace(tmp, self.path(slot))
        self._failed_slots.discard(slot)

    def _verified(self, path: str) -> tuple[dict[str, Any], bytes]:
        """A file's header and payload, after the checks every read makes: magic, header, this
        engine's fingerprint, the payload's size and checksum (ValueError otherwise)."""
        header, start = _read_header(path)
        if header.get("fingerprint") != self.fingerprint:
            raise ValueError("written for another model or KV layout (fingerprint mismatch)")
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            if len(mm) != start + self.payload_bytes or header.get("payload_bytes") != self.payload_bytes:
                raise ValueError("truncated or of the wrong size")
            payload = mm[start:]
        if zlib.crc32(payload) != header.get("crc32"):
            raise ValueError("checksum mismatch (corrupt payload)")
        return header, payload

    def _read(self, slot: int, host_block: int) -> None:
        _, payload = self._verified(self.path(slot))
        offset = 0
        for t, shape in zip(self._host, self._block_shapes):
            n = _numel(shape) * t.element_size()
            src = torch.frombuffer(bytearray(payload[offset : offset + n]), dtype=t.dtype).reshape(shape)
            t[:, :, host_block] = src
            offset += n

    # ------------------------------------------------------------------ restart

    def scan(self) -> list[DiskEntry]:
        """The files of earlier runs that check out (magic, header, fingerprint, size, checksum);
        each one that does not is skipped with a warning. Leftover temporary files are removed."""
        entries: list[DiskEntry] = []
        for name in sorted(os.listdir(self.folder)):
            path = os.path.join(self.folder, name)
            if name.endswith(".tmp"):
                os.remove(path)  # a write interrupted by a crash
                continue
            if not name.endswith(".kvb"):
                continue
            try:
                entries.append(self._check_file(path))
            except (OSError, ValueError, KeyError, TypeError) as exc:
                warnings.warn(f"KV disk tier: skipping {path}: {exc}", stacklevel=2)
        return entries

    def _check_file(self, path: str) -> DiskEntry:
        header, _ = self._verified(path)
        parent = header["parent_hash"]
        hash_ = bytes.fromhex(header["hash"])
        tokens = header["tokens"]
        kv_group = header.get("column", 0)  # files from before KV cache groups: group 0
        if len(hash_) != 16 or not isinstance(tokens, list) or not isinstance(kv_group, int) or kv_group < 0:
            raise ValueError("malformed header")
        return DiskEntry(
            path, hash_, None if parent is None else bytes.fromhex(parent), tokens, header["salt"], kv_group
        )

    def restore(self, scheduler: Any) -> int:
        """Scan the folder and register the valid entries with ``scheduler`` (its disk tier
        must be empty); each restored file is renamed to its new slot, the others are removed
        (they could never be served). Returns how many were restored."""
        entries = self.scan()
        if not entries:
            return 0
        slots = scheduler.restore_disk_blocks([(e.hash, e.parent_hash, e.tokens, e.salt, e.kv_group) for e in entries])
        # Two renames (through temporary names), since new slots may name existing files.
        moves = []
        for entry, slot in zip(entries, slots):
            tmp = entry.path + ".restore"
            os.replace(entry.path, tmp)
            moves.append((tmp, slot))
        restored = 0
        for tmp, slot in moves:
            if slot is None:
                os.remove(tmp)
            else:
                os.replace(tmp, self.path(slot))
                restored += 1
        if restored < len(entries):
            warnings.warn(
                f"KV disk tier: restored {restored} of {len(entries)} blocks from {self.folder} "
                f"(the others had no restored parent, a hash that did not check out, or no free slot)",
                stacklevel=2,
            )
        return restored


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _payload_offset(header_len: int) -> int:
    used = len(_MAGIC) + 4 + header_len
    return (used + _ALIGN - 1) // _ALIGN * _ALIGN


def _read_header(path: str) -> tuple[dict[str, Any], int]:
    with open(path, "rb") as f:
        prefix = f.read(len(_MAGIC) + 4)
        if len(prefix) < len(_MAGIC) + 4 or prefix[: len(_MAGIC)] != _MAGIC:
            raise ValueError("not a pagedkv KV block file (bad magic)")
        n = int.from_bytes(prefix[len(_MAGIC) :], "little")
        raw = f.read(n)
    if len(raw) != n:
        raise ValueError("truncated header")
    header = json.loads(raw.decode())
    if not isinstance(header, dict):
        raise ValueError("malformed header")
    return header, _payload_offset(n)
