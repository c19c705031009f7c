"""A fake model for scheduler tests: it reads the KV cache the way attention does.

Each KV slot holds a digest of the token at that position chained with the value of the
previous position, read through the row's block table. A sampled token is a function of the
last position's value and the sample index. `reference_tokens` computes the same chain over a
token list directly (a contiguous cache), so a paged run must reproduce it exactly."""

from __future__ import annotations

import numpy as np

import pagedkv

VOCAB = 997
ROOT = 0x9E3779B97F4A7C15
MASK = (1 << 64) - 1


def chain(prev: int, token: int) -> int:
    z = (prev ^ (token * 0xBF58476D1CE4E5B9)) & MASK
    z = ((z ^ (z >> 31)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 29)


def sample(digest: int, index: int) -> int:
    return chain(digest, index + 7) % VOCAB


class FakeModel:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.bs = block_size
        self.kv: list[int | None] = [None] * (num_blocks * block_size)

    def execute(self, out: pagedkv.SchedulerOutput) -> np.ndarray:
        """Runs one step; returns int64[S] sampled token ids."""
        bs = self.bs
        for src, dst in out.copy_ops.tolist():
            self.kv[dst * bs : (dst + 1) * bs] = self.kv[src * bs : (src + 1) * bs]
        tables = out.block_tables.tolist()
        cu = out.cu_seqlens_q.tolist()
        pos, ids, slots = out.positions.tolist(), out.input_ids.tolist(), out.slot_mapping.tolist()
        for row, table in enumerate(tables):
            for t in range(cu[row], cu[row + 1]):
                p = pos[t]
                prev = ROOT
                if p > 0:
                    value = self.kv[table[(p - 1) // bs] * bs + (p - 1) % bs]
                    assert value is not None, "attention read a slot that was never written"
                    prev = value
                self.kv[slots[t]] = chain(prev, ids[t])
        sampled = []
        for t, idx in zip(out.logits_indices.tolist(), out.sample_indices.tolist()):
            value = self.kv[slots[t]]
            assert value is not None
            sampled.append(sample(value, idx))
        return np.array(sampled, dtype=np.int64)


def reference_tokens(prompt: list[int], num_tokens: int, index: int = 0) -> list[int]:
    """The first `num_tokens` tokens a sample must produce (ignoring stops)."""
    d = ROOT
    for t in prompt:
        d = chain(d, t)
    out = []
    for _ in range(num_tokens):
        t = sample(d, index)
        out.append(t)
        d = chain(d, t)
    return out


def run_to_completion(
    sched: pagedkv.Scheduler, model: FakeModel, max_steps: int = 10_000
) -> tuple[dict[tuple[str, int], list[int]], dict[tuple[str, int], str]]:
    """Steps until nothing is left; returns tokens and finish reasons per (request, index)."""
    tokens: dict[tuple[str, int], list[int]] = {}
    reasons: dict[tuple[str, int], str] = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        for u in sched.update(out, model.execute(out)):
            tokens.setdefault((u.request_id, u.index), []).extend(u.new_token_ids)
            if u.finish_reason is not None:
                reasons[(u.request_id, u.index)] = u.finish_reason
        sched.check_invariants()
    else:
        raise AssertionError("did not finish")
    return tokens, reasons
