"""pagedkv.BlockAllocator through the bindings: allocation, sharing, the prefix cache, LRU
eviction order, forced hash collisions, and bad input that must leave the pool unchanged."""

from __future__ import annotations

import numpy as np
import pytest

import pagedkv
from pagedkv import BlockAllocator


def snapshot(a: BlockAllocator) -> tuple[list[int], list[int], int]:
    """Everything observable about the pool's state."""
    return [a.ref_count(b) for b in range(a.num_blocks)], a.free_block_ids(), a.num_cached_blocks


def test_allocate_free_fork_and_usage() -> None:
    a = BlockAllocator(8, 16)
    assert (a.num_blocks, a.block_size, a.num_free_blocks, a.usage) == (8, 16, 8, 0.0)
    blocks = a.allocate(3)
    assert blocks == [0, 1, 2]
    assert a.num_free_blocks == 5 and a.num_used_blocks == 3 and a.usage == 3 / 8
    a.fork(blocks)
    assert [a.ref_count(b) for b in blocks] == [2, 2, 2]
    a.free(blocks)
    assert a.num_free_blocks == 5
    a.free(np.array(blocks, dtype=np.int64))
    assert a.num_free_blocks == 8
    a.check_invariants()


def test_allocate_is_all_or_nothing() -> None:
    a = BlockAllocator(4, 4)
    assert a.allocate(3) is not None
    before = snapshot(a)
    assert a.allocate(2) is None
    assert snapshot(a) == before
    assert a.allocate(0) == []


def test_lru_eviction_order() -> None:
    """Uncached blocks are reused first; then cached ones, least recently freed first; a freed
    cached block stays findable until the pool reuses it."""
    a = BlockAllocator(6, 2)
    blocks = a.allocate(6)
    assert blocks is not None
    prompts = {b: [100 + 2 * b, 101 + 2 * b] for b in blocks[:4]}
    for b, toks in prompts.items():
        assert a.cache_blocks([b], toks) == 1
    # Free cached blocks in the order 2, 0, 3, 1 and the uncached 4, 5.
    for b in (2, 0, 3, 1):
        a.free([b])
    a.free([4, 5])
    assert a.free_block_ids() == [5, 4, 2, 0, 3, 1]
    for b, toks in prompts.items():
        assert a.find_cached_prefix(toks + [0]) == [b]
    got = a.allocate(4)
    assert got == [5, 4, 2, 0]
    assert a.num_evictions == 2
    assert a.find_cached_prefix(prompts[2] + [0]) == []
    assert a.find_cached_prefix(prompts[0] + [0]) == []
    assert a.find_cached_prefix(prompts[3] + [0]) == [3]
    a.check_invariants()


def test_prefix_chain_lookup_touch_and_salt() -> None:
    a = BlockAllocator(8, 4)
    blocks = a.allocate(3)
    assert blocks is not None
    tokens = list(range(12))
    assert a.cache_blocks(blocks, tokens) == 3
    # Lookup leaves at least one token to compute: 12 tokens -> at most 2 blocks.
    assert a.find_cached_prefix(tokens) == blocks[:2]
    assert a.find_cached_prefix(tokens + [99]) == blocks
    assert a.find_cached_prefix(tokens[:4] + [7, 7, 7, 7, 1]) == blocks[:1]
    assert a.find_cached_prefix(tokens + [99], cache_salt="tenant") == []
    a.free(blocks)
    assert a.num_free_blocks == 8
    # Reviving cached free blocks takes them out of the free queue.
    a.touch(blocks[:2])
    assert a.num_free_blocks == 6 and a.ref_count(blocks[0]) == 1
    with pytest.raises(pagedkv.InvalidBlockError):
        a.touch([7])  # free and uncached: garbage content
    a.check_invariants()


def test_forced_hash_collision_never_hits() -> None:
    """With 0 hash bits every block hashes alike; verification must reject other tokens."""
    a = BlockAllocator(4, 4, hash_bits=0)
    blocks = a.allocate(1)
    assert blocks is not None
    assert a.cache_blocks(blocks, [1, 2, 3, 4]) == 1
    assert a.find_cached_prefix([5, 6, 7, 8, 9]) == []
    assert a.find_cached_prefix([1, 2, 3, 4, 9]) == blocks
    # A second block with other tokens and the same hash is simply not registered.
    other = a.allocate(1)
    assert other is not None
    assert a.cache_blocks(other, [5, 6, 7, 8]) == 0
    assert a.find_cached_prefix([5, 6, 7, 8, 9]) == []


def test_prefix_caching_off() -> None:
    a = BlockAllocator(4, 2, enable_prefix_caching=False)
    blocks = a.allocate(2)
    assert blocks is not None
    assert a.cache_blocks(blocks, [1, 2, 3, 4]) == 0
    assert a.find_cached_prefix([1, 2, 3, 4, 5]) == []


@pytest.mark.parametrize(
    ("args", "exc"),
    [
        ((0, 16), pagedkv.ConfigError),
        ((16, 0), pagedkv.ConfigError),
        ((-3, 16), pagedkv.ConfigError),
        ((16, -1), pagedkv.ConfigError),
        ((pagedkv._core.MAX_NUM_BLOCKS + 1, 16), pagedkv.ConfigError),
        ((16, pagedkv._core.MAX_BLOCK_SIZE + 1), pagedkv.ConfigError),
        ((2**70, 16), pagedkv.InvalidArgumentError),
        ((1.5, 16), pagedkv.InvalidTypeError),
        (("8", 16), pagedkv.InvalidTypeError),
        ((True, 16), pagedkv.InvalidTypeError),
    ],
)
def test_bad_construction(args: tuple[object, object], exc: type[Exception]) -> None:
    with pytest.raises(exc):
        BlockAllocator(*args)  # type: ignore[arg-type]


def test_bad_input_leaves_pool_unchanged() -> None:
    a = BlockAllocator(8, 4)
    held = a.allocate(3)
    assert held is not None
    a.fork(held[:1])
    before = snapshot(a)
    bad_calls = [
        (a.free, ([7],), pagedkv.InvalidBlockError),  # never allocated
        (a.free, ([held[1], held[1]],), pagedkv.InvalidBlockError),  # double free in one call
        (a.free, ([held[2], 8],), pagedkv.InvalidBlockError),  # out of range after a valid id
        (a.free, ([-1],), pagedkv.InvalidBlockError),
        (a.fork, ([held[0], 5],), pagedkv.InvalidBlockError),
        (a.fork, ([2**40],), pagedkv.InvalidBlockError),
        (a.allocate, (-1,), pagedkv.InvalidArgumentError),
        (a.allocate, (2.0,), pagedkv.InvalidTypeError),
        (a.free, (np.array(held, dtype=np.float32),), pagedkv.InvalidTypeError),
        (a.free, (np.array(held, dtype=np.int64)[::2],), pagedkv.InvalidArgumentError),
        (a.free, (np.array([held], dtype=np.int64),), pagedkv.InvalidArgumentError),
        (a.free, ("abc",), pagedkv.InvalidTypeError),
        (a.free, ([0, "x"],), pagedkv.InvalidTypeError),
        (a.free, (None,), pagedkv.InvalidTypeError),
        (a.ref_count, (99,), pagedkv.InvalidBlockError),
        (a.cache_blocks, ([3], [1, 2, 3, 4]), pagedkv.InvalidBlockError),  # not allocated
        (a.cache_blocks, (held, [1, -2, 3, 4]), pagedkv.InvalidTokenError),
        (a.cache_blocks, (held, [2**31]), pagedkv.InvalidTokenError),
        (a.find_cached_prefix, ([1, 2], 5), pagedkv.InvalidTypeError),
    ]
    for fn, args, exc in bad_calls:
        with pytest.raises(exc):
            fn(*args)
        assert snapshot(a) == before, f"{fn.__name__}{args} changed the pool"
    a.check_invariants()


def test_errors_are_also_builtin_classes() -> None:
    a = BlockAllocator(2, 2)
    with pytest.raises(ValueError):
        a.free([1])
    with pytest.raises(TypeError):
        a.allocate("1")  # type: ignore[arg-type]
    with pytest.raises(pagedkv.PagedKVError, match="double free"):
        a.free([0])
