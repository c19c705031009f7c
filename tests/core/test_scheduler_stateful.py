"""Hypothesis state machine over schedule / update / abort sequences (and bad calls in
between), with the fake model of sim_model.py checking every token against the contiguous
reference."""

from __future__ import annotations

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from sim_model import FakeModel, reference_tokens

import pagedkv
from pagedkv import Scheduler, SchedulerConfig

NUM_BLOCKS, BLOCK_SIZE, MAX_LEN = 12, 4, 32
BASES = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9], [40, 41]]


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.s = Scheduler(
            SchedulerConfig(
                num_blocks=NUM_BLOCKS,
                block_size=BLOCK_SIZE,
                max_model_len=MAX_LEN,
                max_num_batched_tokens=10,
                max_num_seqs=6,
            )
        )
        self.model = FakeModel(NUM_BLOCKS, BLOCK_SIZE)
        self.prompts: dict[str, list[int]] = {}
        self.outputs: dict[tuple[str, int], list[int]] = {}
        self.finished: set[str] = set()
        self.aborted: set[str] = set()
        self.stopped: set[str] = set()
        self.next_id = 0

    @rule(
        base=st.integers(0, len(BASES) - 1),
        extra=st.lists(st.integers(0, 50), max_size=8),
        max_tokens=st.integers(1, 12),
        n=st.integers(1, 3),
        salted=st.booleans(),
    )
    def add(self, base: int, extra: list[int], max_tokens: int, n: int, salted: bool) -> None:
        rid = f"r{self.next_id}"
        self.next_id += 1
        prompt = BASES[base] + extra
        self.s.add_request(
            rid, np.array(prompt, dtype=np.int64), max_tokens=max_tokens, n=n, cache_salt="s" if salted else None
        )
        self.prompts[rid] = prompt

    @rule()
    def step(self) -> None:
        out = self.s.schedule()
        for u in self.s.update(out, self.model.execute(out)):
            key = (u.request_id, u.index)
            self.outputs.setdefault(key, []).extend(u.new_token_ids)
            got = self.outputs[key]
            assert got == reference_tokens(self.prompts[u.request_id], len(got), u.index)
        self.finished.update(out.finished_req_ids)

    @precondition(lambda self: self.prompts)
    @rule(i=st.integers(0, 1000))
    def abort(self, i: int) -> None:
        rid = sorted(self.prompts)[i % len(self.prompts)]
        try:
            self.s.abort_request(rid)
            self.aborted.add(rid)
        except pagedkv.UnknownRequestError:
            # Only requests that ended (aborted, or finished: reported, or ended in the last
            # update and reported with the next step) may be unknown.
            assert (
                rid in self.aborted
                or rid in self.finished
                or rid in self.stopped
                or any((rid, k) in self.outputs for k in range(3))
            ), "a live request was reported unknown"

    @precondition(lambda self: self.prompts)
    @rule(i=st.integers(0, 1000), index=st.integers(0, 2))
    def finish_sample(self, i: int, index: int) -> None:
        rid = sorted(self.prompts)[i % len(self.prompts)]
        try:
            if self.s.finish_sample(rid, index):
                self.stopped.add(rid)  # its last sample may have ended: the request may be gone
        except pagedkv.UnknownRequestError:
            pass

    @rule(data=st.data())
    def bad_update(self, data: st.DataObject) -> None:
        out = self.s.schedule()
        before = self.s.stats().as_dict()
        bogus = data.draw(st.sampled_from(["long", "neg", "float"]))
        tokens = {
            "long": [0] * (len(out.logits_indices) + 1),
            "neg": [-1] * max(1, len(out.logits_indices)),
            "float": np.zeros(len(out.logits_indices), dtype=np.float64),
        }[bogus]
        try:
            self.s.update(out, tokens)
        except pagedkv.PagedKVError:
            pass
        else:
            raise AssertionError("a malformed update must raise")
        assert self.s.stats().as_dict() == before
        # Complete the step properly.
        for u in self.s.update(out, self.model.execute(out)):
            key = (u.request_id, u.index)
            self.outputs.setdefault(key, []).extend(u.new_token_ids)
        self.finished.update(out.finished_req_ids)

    @invariant()
    def consistent(self) -> None:
        self.s.check_invariants()

    def teardown(self) -> None:
        for _ in range(2000):
            if not self.s.has_unfinished_requests():
                break
            self.step()
        assert not self.s.has_unfinished_requests()
        st_ = self.s.stats()
        assert st_.num_free_blocks == NUM_BLOCKS and st_.num_running == 0 and st_.num_waiting == 0


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
