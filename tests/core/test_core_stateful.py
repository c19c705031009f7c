"""Hypothesis state machines over the Python API of the Rust core.

`KVCacheManagerMachine` drives sequences (shared prompt prefixes, salts, chunked slot
allocation, batched decodes, fork, free, cache reset) and keeps a simulated KV cache in which a
slot holds a digest of the whole prefix up to its position, as real KV does. After every step:
the invariants hold, and every live sequence reads back exactly its own prefix digests through
its block table. At teardown every sequence is freed and the pool must be whole.

`BlockAllocatorMachine` checks raw allocate / free / fork / touch against a ref-count model."""

from __future__ import annotations

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import pagedkv
from pagedkv import BlockAllocator, KVCacheManager

NUM_BLOCKS, BLOCK_SIZE = 24, 4
BASES = [list(range(9)), [0, 1, 2, 3, 50, 51, 52, 53, 54], [20, 21, 22, 23, 24, 25]]


def prefix_digests(tokens: list[int]) -> list[int]:
    out, h = [], 1469598103934665603
    for t in tokens:
        h = ((h ^ t) * 1099511628211) % (1 << 64)
        out.append(h)
    return out


class KVCacheManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.m = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, hash_bits=4)
        self.kv: list[int | None] = [None] * (NUM_BLOCKS * BLOCK_SIZE)
        self.seqs: list[int] = []
        self.next_token = 1000

    def _apply_copies(self) -> None:
        for src, dst in self.m.take_copy_ops().tolist():
            for off in range(BLOCK_SIZE):
                self.kv[dst * BLOCK_SIZE + off] = self.kv[src * BLOCK_SIZE + off]

    def _write_window(self, seq: int) -> None:
        digests = prefix_digests(self.m.token_ids(seq).tolist())
        computed = self.m.num_computed_tokens(seq)
        slots = self.m.slot_mapping(seq).tolist()
        for pos, slot in zip(range(computed - len(slots), computed), slots):
            self.kv[slot] = digests[pos]

    @rule(base=st.integers(0, len(BASES) - 1), suffix=st.integers(0, 10), salted=st.booleans())
    def add(self, base: int, suffix: int, salted: bool) -> None:
        tokens = BASES[base] + list(range(self.next_token, self.next_token + suffix))
        self.next_token += suffix
        seq, cached = self.m.add_sequence(np.array(tokens, dtype=np.int32), cache_salt="t" if salted else None)
        assert cached % BLOCK_SIZE == 0 and cached < len(tokens)
        self.seqs.append(seq)

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 100), n=st.integers(1, 12))
    def allocate(self, i: int, n: int) -> None:
        seq = self.seqs[i % len(self.seqs)]
        pending = self.m.num_tokens(seq) - self.m.num_computed_tokens(seq)
        k = min(n, pending)
        free_before = self.m.num_free_blocks
        if self.m.allocate_slots(seq, k):
            self._apply_copies()
            self._write_window(seq)
        else:
            assert self.m.num_free_blocks == free_before

    @precondition(lambda self: self.seqs)
    @rule(picks=st.lists(st.integers(0, 100), min_size=1, max_size=4, unique=True), token=st.integers(0, 5))
    def decode(self, picks: list[int], token: int) -> None:
        ids = sorted({self.seqs[p % len(self.seqs)] for p in picks})
        ids = [s for s in ids if self.m.num_tokens(s) == self.m.num_computed_tokens(s)]
        if not ids:
            return
        ok = self.m.append_decode_tokens(np.array(ids, dtype=np.int64), np.full(len(ids), token, dtype=np.int32))
        self._apply_copies()
        for seq, good in zip(ids, ok.tolist()):
            if good:
                self._write_window(seq)

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 100))
    def fork(self, i: int) -> None:
        self.seqs.append(self.m.fork(self.seqs[i % len(self.seqs)]))

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 100))
    def free(self, i: int) -> None:
        seq = self.seqs.pop(i % len(self.seqs))
        self.m.free(seq)

    @rule()
    def reset_cache(self) -> None:
        self.m.reset_prefix_cache()

    @invariant()
    def consistent_and_reads_back(self) -> None:
        self.m.check_invariants()
        for seq in self.seqs:
            digests = prefix_digests(self.m.token_ids(seq).tolist())
            computed = self.m.num_computed_tokens(seq)
            for pos, slot in enumerate(self.m.slot_mapping(seq, 0, computed).tolist()):
                assert self.kv[slot] == digests[pos], (seq, pos)

    def teardown(self) -> None:
        for seq in self.seqs:
            self.m.free(seq)
        self.m.check_invariants()
        assert self.m.num_free_blocks == NUM_BLOCKS
        assert all(self.m.ref_count(b) == 0 for b in range(NUM_BLOCKS))


class BlockAllocatorMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.a = BlockAllocator(12, 4)
        self.refs = [0] * 12
        self.held: list[int] = []

    @rule(n=st.integers(0, 5))
    def allocate(self, n: int) -> None:
        got = self.a.allocate(n)
        free = self.refs.count(0)
        if got is None:
            assert n > free
            return
        assert n <= free and len(got) == n
        for b in got:
            assert self.refs[b] == 0
            self.refs[b] = 1
            self.held.append(b)

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 100))
    def free(self, i: int) -> None:
        b = self.held.pop(i % len(self.held))
        self.a.free([b])
        self.refs[b] -= 1

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 100))
    def fork(self, i: int) -> None:
        b = self.held[i % len(self.held)]
        self.a.fork([b])
        self.refs[b] += 1
        self.held.append(b)

    @rule(b=st.integers(-3, 15))
    def bogus_free(self, b: int) -> None:
        if 0 <= b < 12 and self.refs[b] > 0:
            return
        before = [self.a.ref_count(x) for x in range(12)]
        try:
            self.a.free([b])
        except pagedkv.InvalidBlockError:
            pass
        else:
            raise AssertionError(f"freeing block {b} should fail")
        assert [self.a.ref_count(x) for x in range(12)] == before

    @invariant()
    def matches_model(self) -> None:
        self.a.check_invariants()
        assert [self.a.ref_count(b) for b in range(12)] == self.refs

    def teardown(self) -> None:
        self.a.free(self.held)
        assert self.a.num_free_blocks == 12


TestKVCacheManagerMachine = KVCacheManagerMachine.TestCase
TestKVCacheManagerMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestBlockAllocatorMachine = BlockAllocatorMachine.TestCase
TestBlockAllocatorMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
