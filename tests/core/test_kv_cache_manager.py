"""pagedkv.KVCacheManager: the sequence-level API (block tables with append, fork, prefix
lookup and free) for servers that bring their own scheduler."""

from __future__ import annotations

import numpy as np
import pytest

import pagedkv
from pagedkv import KVCacheManager


def test_block_table_grows_one_block_at_a_time() -> None:
    m = KVCacheManager(8, 4)
    seq, cached = m.add_sequence(list(range(7)))
    assert cached == 0 and m.num_computed_tokens(seq) == 0
    assert m.allocate_slots(seq, 7)
    table = m.block_table(seq)
    assert table.dtype == np.int32 and len(table) == 2  # 7 tokens, block size 4
    slots = m.slot_mapping(seq)
    expected = [table[p // 4] * 4 + p % 4 for p in range(7)]
    assert slots.dtype == np.int64 and slots.tolist() == expected
    ok = m.append_decode_tokens(np.array([seq], dtype=np.int64), np.array([7], dtype=np.int32))
    assert ok.tolist() == [True] and len(m.block_table(seq)) == 2
    ok = m.append_decode_tokens([seq], [8])
    assert ok.tolist() == [True] and len(m.block_table(seq)) == 3
    assert m.slot_mapping(seq).tolist() == [int(m.block_table(seq)[2]) * 4]
    assert m.token_ids(seq).tolist() == list(range(9))
    m.free(seq)
    assert m.num_free_blocks == 8
    m.check_invariants()


def test_prefix_hit_starts_after_cached_blocks() -> None:
    m = KVCacheManager(16, 4)
    prompt = list(range(10))
    a, cached = m.add_sequence(prompt)
    assert cached == 0
    assert m.allocate_slots(a, 10)
    b, cached = m.add_sequence(prompt + [42, 43])
    assert cached == 8
    assert m.num_computed_tokens(b) == 8
    assert m.block_table(b).tolist() == m.block_table(a)[:2].tolist()
    assert m.ref_count(int(m.block_table(a)[0])) == 2
    assert m.allocate_slots(b, 4)
    assert m.slot_mapping(b).tolist()[0] == int(m.block_table(b)[2]) * 4
    assert (m.prefix_cache_queries, m.prefix_cache_hits) == (22, 8)
    c, cached = m.add_sequence(prompt, cache_salt="other-tenant")
    assert cached == 0
    for s in (a, b, c):
        m.free(s)
    m.check_invariants()
    assert m.num_free_blocks == 16


def test_fork_copy_on_write() -> None:
    m = KVCacheManager(8, 4)
    a, _ = m.add_sequence([1, 2, 3, 4, 5, 6])
    assert m.allocate_slots(a, 6)
    b = m.fork(a)
    shared = m.block_table(a).tolist()
    assert m.block_table(b).tolist() == shared
    assert [m.ref_count(x) for x in shared] == [2, 2]
    ok = m.append_decode_tokens([a, b], [7, 8])
    assert ok.tolist() == [True, True]
    ops = m.take_copy_ops()
    assert ops.dtype == np.int32 and ops.shape == (1, 2)
    src, dst = ops[0].tolist()
    assert src == shared[1] and m.block_table(a).tolist() == [shared[0], dst]
    assert m.block_table(b).tolist() == shared  # the last holder writes in place
    assert m.take_copy_ops().shape == (0, 2)
    m.check_invariants()


def test_out_of_blocks_is_not_an_error() -> None:
    m = KVCacheManager(2, 4)
    a, _ = m.add_sequence(list(range(12)))
    assert not m.allocate_slots(a, 12)
    assert m.num_computed_tokens(a) == 0 and m.num_free_blocks == 2
    assert m.allocate_slots(a, 8)
    b, _ = m.add_sequence([1])
    assert not m.allocate_slots(b, 1)
    m.append_token_ids(a, [5])
    m.free(a)
    assert m.allocate_slots(b, 1)


def test_block_tables_batch_padding() -> None:
    m = KVCacheManager(8, 2)
    a, _ = m.add_sequence([1, 2, 3, 4, 5])
    b, _ = m.add_sequence([9])
    m.allocate_slots(a, 5)
    m.allocate_slots(b, 1)
    bt = m.block_tables([a, b])
    assert bt.shape == (2, 3) and bt.dtype == np.int32
    assert bt[1, 1:].tolist() == [0, 0]
    assert bt[0].tolist() == m.block_table(a).tolist()


def test_bad_input_changes_nothing() -> None:
    m = KVCacheManager(8, 4)
    a, _ = m.add_sequence(list(range(6)))
    m.allocate_slots(a, 6)
    state = (m.num_free_blocks, m.block_table(a).tolist(), m.token_ids(a).tolist(), m.num_computed_tokens(a))
    bad = [
        (m.allocate_slots, (a, 1), pagedkv.InvalidArgumentError),  # no pending tokens
        (m.allocate_slots, (a, -1), pagedkv.InvalidArgumentError),
        (m.allocate_slots, (12345, 1), pagedkv.UnknownSequenceError),
        (m.free, (-5,), pagedkv.UnknownSequenceError),
        (m.fork, (a + 1,), pagedkv.UnknownSequenceError),
        (m.append_decode_tokens, ([a, 999], [1, 2]), pagedkv.UnknownSequenceError),
        (m.append_decode_tokens, ([a], [1, 2]), pagedkv.InvalidArgumentError),
        (m.append_decode_tokens, ([a], [-1]), pagedkv.InvalidTokenError),
        (m.append_token_ids, (a, np.array([1.0])), pagedkv.InvalidTypeError),
        (m.slot_mapping, (a, 0, 7), pagedkv.InvalidArgumentError),
        (m.add_sequence, ([1, 2**31],), pagedkv.InvalidTokenError),
        (m.add_sequence, (np.arange(8)[::2],), pagedkv.InvalidArgumentError),
    ]
    for fn, args, exc in bad:
        with pytest.raises(exc):
            fn(*args)
        now = (m.num_free_blocks, m.block_table(a).tolist(), m.token_ids(a).tolist(), m.num_computed_tokens(a))
        assert now == state, f"{fn.__name__}{args} changed state"
    assert m.num_sequences == 1
    m.free(a)
    with pytest.raises(pagedkv.UnknownSequenceError):
        m.free(a)
    m.check_invariants()
