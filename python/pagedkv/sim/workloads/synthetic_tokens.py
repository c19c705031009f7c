"""Deterministic synthetic token ids for workloads that give lengths instead of text.

Two kinds of token streams, both pure functions of their arguments (no global random state):

* a **shared prefix** stream per prefix id: every request naming the same prefix id gets the
  same leading tokens, so a prefix cache hits on them. The stream is cut into fixed chunks, each
  drawn from its own seeded generator, so a shorter prefix of the same id is exactly the start
  of a longer one (the first ``k`` tokens never depend on how many are asked for);
* a **unique** stream per request id, for the part of the prompt no other request shares.

Ids are drawn uniformly from ``0 .. vocab_size - 1``. Streams of different ids (and the two
kinds) come from different seeds, so two requests share a full KV block only with vanishing
probability unless they name the same prefix.
"""

from __future__ import annotations

import hashlib
from functools import lru_cache

import numpy as np

from pagedkv.errors import InvalidArgumentError

__all__ = ["DEFAULT_SYNTHETIC_VOCAB_SIZE", "prefix_tokens", "unique_tokens", "stable_hash64"]

# SmolLM2-135M-Instruct's vocabulary, the default model's: synthesized ids are valid inputs to it.
DEFAULT_SYNTHETIC_VOCAB_SIZE = 49152

_PREFIX_CHUNK = 1024  # tokens per independently seeded chunk of a prefix stream
_PREFIX_DOMAIN = 1  # keeps prefix and unique streams of the same id apart
_UNIQUE_DOMAIN = 2


def stable_hash64(text: str) -> int:
    """A 64-bit hash of ``text`` that is the same in every process (unlike ``hash``)."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little")


def _check(length: int, vocab_size: int, seed: int) -> None:
    if length < 0:
        raise InvalidArgumentError(f"token count must be >= 0, got {length}")
    if not 1 <= vocab_size <= 2**31:
        raise InvalidArgumentError(f"vocab_size must be in 1..2**31, got {vocab_size}")
    if seed < 0:
        raise InvalidArgumentError(f"seed must be >= 0, got {seed}")


@lru_cache(maxsize=4096)
def _prefix_chunk(prefix_hash: int, chunk_index: int, vocab_size: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng([seed, _PREFIX_DOMAIN, prefix_hash, chunk_index])
    chunk = rng.integers(0, vocab_size, size=_PREFIX_CHUNK, dtype=np.int64).astype(np.int32)
    chunk.flags.writeable = False  # cached and shared between callers
    return chunk


def prefix_tokens(
    prefix_id: str, length: int, *, vocab_size: int = DEFAULT_SYNTHETIC_VOCAB_SIZE, seed: int = 0
) -> np.ndarray:
    """The first ``length`` tokens of the shared stream named ``prefix_id``: int32 [length]."""
    _check(length, vocab_size, seed)
    prefix_hash = stable_hash64(prefix_id)
    num_chunks = -(-length // _PREFIX_CHUNK)
    chunks = [_prefix_chunk(prefix_hash, index, vocab_size, seed) for index in range(num_chunks)]
    if not chunks:
        return np.zeros(0, dtype=np.int32)
    return np.concatenate(chunks)[:length]


def unique_tokens(
    request_id: str, length: int, *, vocab_size: int = DEFAULT_SYNTHETIC_VOCAB_SIZE, seed: int = 0
) -> np.ndarray:
    """``length`` tokens private to ``request_id``: int32 [length]."""
    _check(length, vocab_size, seed)
    rng = np.random.default_rng([seed, _UNIQUE_DOMAIN, stable_hash64(request_id)])
    return rng.integers(0, vocab_size, size=length, dtype=np.int64).astype(np.int32)
