"""A step's grammar masks: computed on a worker thread while the forward runs, applied to the
logits before anything reads them (sampler, logprobs, beam candidates).

Timeline of a step with structured rows (``LLMEngine.step``)::

    schedule ─┬─ forward (torch, GIL mostly released) ──────────────┬─ apply masks ─ sample
              └─ fill bitmasks (llguidance, GIL released) ─ done ───┘

Only the rows that sample this step and whose sample has a matcher get a mask. The matchers are
read, never advanced, here: they advance only when a step's tokens are committed
(``OutputProcessor._apply_update``), so a step that fails and is rolled back leaves them as they were;
the engine always waits for the fill to end before it returns from a step, so no matcher is
ever used by two threads at once.

The bitmask is llguidance's layout: int32 ``[G, ceil(V / 32)]``, token ``t`` allowed iff bit
``t % 32`` of word ``t // 32`` is set.

A matcher in llguidance's error state (a grammar that passed its compile but ran past a limit
mid-generation, or a compiled lexer another copy exhausted) gets a mask of eos alone: the
sample would end with ``""``, which need not match. The fill lets every token through on such a
row instead (no row is ever all ``-inf``), and the engine fails that request alone when it
commits the row's token (``OutputProcessor._apply_update``: the matcher is in error).

The fill calls llguidance's executor directly: ``llguidance.torch`` is not imported (its
``torch.compile`` decorator imports dynamo: seconds holding the GIL, every stream stalled).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from pagedkv.structured.compiler import load_llguidance
from pagedkv.structured.stats import SecondsHistogram

__all__ = ["PendingMasks", "StepMasks", "apply_token_bitmask_"]


class PendingMasks:
    """The masks of one step's structured rows, being filled."""

    def __init__(self, rows: list[int], bitmask: torch.Tensor, future: Future[None]) -> None:
        self.rows = rows  # indices into the step's logits rows, ascending
        self.bitmask = bitmask  # int32 [G, W]
        self._future = future

    def wait(self) -> torch.Tensor:
        """The filled bitmask (re-raises what the fill raised)."""
        self._future.result()
        return self.bitmask

    def join(self) -> None:
        """Wait for the fill to end, whatever it did (a failed step's cleanup)."""
        try:
            self._future.result()
        except BaseException:  # noqa: BLE001 - the step is failing already; its own error wins
            pass


class StepMasks:
    """Fills the grammar masks of a step on one worker thread (llguidance parallelises the rows
    over its own threads). ``vocab_size``: the LM head's rows."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.num_words = (vocab_size + 31) // 32
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedkv-masks")
        self._executor: Any = None
        # Seconds to fill one step's masks (all its structured rows), and rows filled.
        self.fill_time = SecondsHistogram()
        # Seconds of grammar work on a step's critical path (the engine observes it): waiting
        # for the fill after the forward, applying the masks, advancing the matchers.
        self.critical_time = SecondsHistogram()
        self.num_masked_rows = 0

    def start(self, rows: list[int], matchers: Sequence[Any]) -> PendingMasks:
        """Start filling the masks of ``matchers`` (one per entry of ``rows``)."""
        llguidance = load_llguidance()
        if self._executor is None:
            # Half the cores: the forward runs beside it (llguidance's default takes 80%).
            self._executor = llguidance.LLExecutor(num_threads=max(1, (os.cpu_count() or 2) // 2))
        bitmask = torch.empty((len(rows), self.num_words), dtype=torch.int32)
        future = self._thread.submit(self._fill, list(matchers), bitmask)
        return PendingMasks(rows, bitmask, future)

    def _fill(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        start = time.perf_counter()
        assert bitmask.is_contiguous() and bitmask.dtype == torch.int32
        # llguidance.torch.fill_next_token_bitmask_par, without importing that module.
        self._executor.unsafe_compute_mask_ptr(
            [(m, i) for i, m in enumerate(matchers)], bitmask.data_ptr(), self.num_words * 4, len(matchers)
        )
        for i, matcher in enumerate(matchers):
            if matcher.is_error():
                bitmask[i] = -1  # all allowed: the engine fails the request at this row's token
        self.fill_time.observe(time.perf_counter() - start)
        self.num_masked_rows += len(matchers)

    def shutdown(self) -> None:
        self._thread.shutdown(wait=True)


def apply_token_bitmask_(logits: torch.Tensor, rows: Sequence[int], bitmask: torch.Tensor) -> None:
    """Set the logits of the tokens each row's mask disallows to -inf, in place.

    ``logits``: float [S, V] (any device); ``rows``: G distinct indices into its first dimension,
    ascending; ``bitmask``: int32 [G, ceil(V / 32)] on the CPU (bit set = allowed). Bits past V
    are ignored.
    """
    with torch.inference_mode():  # the runner's logits are inference tensors
        _apply(logits, rows, bitmask)


def _apply(logits: torch.Tensor, rows: Sequence[int], bitmask: torch.Tensor) -> None:
    vocab = logits.shape[1]
    # One unpack of the complemented words: uint8 [G, 32 W], 1 where a token is disallowed
    # (little bit order: bit t % 32 of word t // 32 is byte-bit t % 8 of byte t // 8).
    packed = np.invert(bitmask.numpy()).view(np.uint8)
    disallowed = torch.from_numpy(np.unpackbits(packed, axis=1, bitorder="little")[:, :vocab]).view(torch.bool)
    if logits.device.type != "cpu":
        disallowed = disallowed.to(logits.device, non_blocking=True)
    if len(rows) == logits.shape[0]:  # every row (ascending, distinct): in place
        logits.masked_fill_(disallowed, float("-inf"))
        return
    index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    selected = logits.index_select(0, index)
    selected.masked_fill_(disallowed, float("-inf"))
    logits.index_copy_(0, index, selected)
