"""The engine's side of speculative decoding (docs/engine.md, "Speculative decoding").

The Rust scheduler drafts, schedules and verifies; the engine only has to sample each logits
row of a row with drafts as an ordinary step would have sampled it, and to feed the
scheduler's cost model. Three small jobs, one class each:

- :class:`DraftContexts`: the drafted tokens before each logits row of the step (row ``j`` of a
  row with drafts samples after drafts ``1 .. j``), so that everything the sampler reads from
  a sample's past (``min_tokens``, ``bad_words``, penalties) sees that row's own context.
- :class:`SeededDraws`: a seeded sample draws its random numbers from its own generator, a fixed
  amount per sampled row. A row with ``d`` drafts samples ``d + 1`` rows but emits only the
  accepted ones plus one; its generator is set back and advanced by exactly the emitted
  tokens, so a seeded request's randomness depends on its output position only, never on how
  many drafts a step verified: the same seed gives the same tokens with speculation as without.
- :class:`StepTimeFit`: the forward's time as ``overhead + per_token * tokens``, fitted on the
  steps as they run (exponentially weighted least squares), for ``Scheduler.set_spec_cost``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import numpy as np
import torch

from pagedkv._core import RequestUpdate, SchedulerOutput
from pagedkv.sample.sampler import Sampler

__all__ = ["DraftContexts", "SeededDraws", "StepTimeFit"]


class DraftContexts:
    """The drafts before each logits row of one step (empty for rows without)."""

    def __init__(self, out: SchedulerOutput) -> None:
        offsets = out.draft_offsets
        # Rows with drafts before them; none in a step without speculation (one pass of numpy).
        rows = np.flatnonzero(offsets)
        self._drafts: dict[int, list[int]] = {}
        if rows.size:
            input_ids, logits_indices = out.input_ids, out.logits_indices
            for row in rows.tolist():
                j, at = int(offsets[row]), int(logits_indices[row])
                self._drafts[row] = input_ids[at - j + 1 : at + 1].tolist()

    def __bool__(self) -> bool:
        return bool(self._drafts)

    def drafts(self, row: int) -> list[int]:
        """The tokens drafted before logits row ``row``'s position (``[]`` if none)."""
        return self._drafts.get(row, [])

    def num_drafted(self) -> dict[int, int]:
        """Drafts per row group, keyed by the group's first logits row."""
        groups: dict[int, int] = {}
        for row, drafts in self._drafts.items():
            first = row - len(drafts)
            groups[first] = max(groups.get(first, 0), len(drafts))
        return groups


class SeededDraws:
    """Keeps seeded samples' random streams independent of the drafts (module docs)."""

    def __init__(self) -> None:
        # (generator, its state before the step, request id, sample index)
        self._saved: list[tuple[torch.Generator, torch.Tensor, str, int]] = []

    def save(self, generator: torch.Generator, request_id: str, index: int) -> None:
        """Before sampling a row group with drafts of a seeded, random (temperature > 0) sample."""
        self._saved.append((generator, generator.get_state(), request_id, index))

    def settle(self, updates: Iterable[RequestUpdate], sampler: Sampler, vocab_size: int, device: torch.device) -> None:
        """After the step: each saved generator goes back to its state before the step and
        draws what the sampled rows of its emitted tokens drew."""
        if not self._saved:
            return
        emitted = Counter((u.request_id, u.index) for u in updates)
        for generator, state, request_id, index in self._saved:
            generator.set_state(state)
            sampler.replay_draws(generator, emitted[(request_id, index)], vocab_size, device)
        self._saved.clear()

    def forget(self) -> None:
        """A failed step: the states stay as the sampling left them (the step is redone from
        the waiting queue, drafting anew; reproducibility across failed steps is not promised)."""
        self._saved.clear()


class StepTimeFit:
    """``seconds ~ overhead + per_token * tokens`` over recent steps (exponentially weighted
    least squares). Until the steps vary enough in size to separate the two, ``per_token``
    stays at its prior (the last good fit, or the one given)."""

    def __init__(self, decay: float = 0.97, overhead_s: float = 0.05, per_token_s: float = 0.0005) -> None:
        self.decay = decay
        self.overhead_s = overhead_s
        self.per_token_s = per_token_s
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        d = self.decay
        x, y = float(tokens), float(seconds)
        self._w = d * self._w + 1.0
        self._x = d * self._x + x
        self._y = d * self._y + y
        self._xx = d * self._xx + x * x
        self._xy = d * self._xy + x * y
        mean_x, mean_y = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mean_x * mean_x
        if var > 1.0:  # token counts that differ by more than about one: the slope is known
            slope = (self._xy / self._w - mean_x * mean_y) / var
            self.per_token_s = max(slope, 0.0)
        self.overhead_s = max(mean_y - self.per_token_s * mean_x, 1e-6)

    def as_args(self) -> tuple[float, float]:
        return self.overhead_s, self.per_token_s
