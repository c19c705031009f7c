"""Which KV blocks a replica holds, rebuilt from its KV-cache event batches.

A block is named by its wire hash (``pagedkv.server.kv_events``); it may sit on several media
of one replica at once (the device pool and the host tier), so the index keeps, per hash, the
set of media holding it: ``BlockStored`` adds a (hash, medium), ``BlockRemoved`` takes it
away, ``AllBlocksCleared`` empties the replica. A prompt's match is the number of its leading
block hashes the replica holds on any medium (a chain of hashes names a whole prefix, so the
first missing block ends the match).

Thread safety: the replica's subscriber thread applies batches while request handlers read
matches; one lock per index.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from pagedkv.server.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

__all__ = ["PrefixIndex"]


class PrefixIndex:
    """The cached block hashes of one replica."""

    def __init__(self) -> None:
        self._media: dict[int, set[str]] = {}
        self._lock = threading.Lock()
        # Batches applied, and times the history was lost (a gap the replay could not fill):
        # the index then restarts empty, which can only cost routing hits, never correctness.
        self.num_batches = 0
        self.num_resets = 0

    def apply(self, batch: KVEventBatch) -> None:
        with self._lock:
            self.num_batches += 1
            for event in batch.events:
                medium = getattr(event, "medium", None) or "GPU"
                if isinstance(event, BlockStored):
                    for h in event.block_hashes:
                        self._media.setdefault(h, set()).add(medium)
                elif isinstance(event, BlockRemoved):
                    for h in event.block_hashes:
                        media = self._media.get(h)
                        if media is not None:
                            media.discard(medium)
                            if not media:
                                del self._media[h]
                elif isinstance(event, AllBlocksCleared):
                    self._media.clear()

    def reset(self) -> None:
        """Forget everything (the event history has a hole)."""
        with self._lock:
            self._media.clear()
            self.num_resets += 1

    def match(self, hashes: Sequence[int]) -> int:
        """How many of ``hashes`` (a prompt's block hashes, in order) are held, from the start."""
        with self._lock:
            n = 0
            for h in hashes:
                if h not in self._media:
                    break
                n += 1
            return n

    def __len__(self) -> int:
        with self._lock:
            return len(self._media)
