"""Penalties, logit bias and allowed tokens, applied to a step's logits in a few batched ops.

vLLM's semantics (``SamplingParams`` has the definitions): for row ``r`` and token ``t``

* ``repetition_penalty`` ``ρ`` on the tokens of the prompt and of the output so far:
  ``l / ρ`` where ``l > 0``, else ``l * ρ``;
* ``frequency_penalty`` ``f`` and ``presence_penalty`` ``p`` on the output so far:
  ``l - f * count(t) - p * [count(t) > 0]``;
* ``logit_bias``: ``l + bias[t]``, applied first (vLLM runs its logits processors before the
  penalties);
* ``allowed_token_ids``: every other token ``-inf``.

``logit_bias`` and ``allowed_token_ids`` come as tensors built once per request
(:class:`~pagedkv.sample.prepared.LogitTensors`, when the request was added): a step adds the
request's bias to its rows in one indexed add (``O(len(bias))`` per row) and its allowed mask
(``[V]``, 0 or ``-inf``) in one pass per row, whatever the length of the list, with no Python
work per id. The rows of one request (its ``n`` samples) share the tensors.

Cost: sparse, never a pass per penalty over ``[S, V]``
-------------------------------------------------------
A row's penalties touch only the tokens it has seen, a few hundred of ~50k. The step's
(row, token) pairs are flat keys ``r * V + t``; a pass over them (``O(pairs)``) counts the
output occurrences into a persistent all-zero ``[S * V]`` float buffer, gathers the touched
logits (every touched key is in the prompt or the output: the repetition penalty's set),
computes their new values and scatters them back, then zeroes the counts it wrote, so the
buffer is all zero again for the next step. Duplicate
keys (a token seen twice) compute the same new value from the same inputs, so writing it twice
is harmless. No sort, no ``unique``. Building the keys is ``numpy.repeat`` / ``concatenate`` over
per-row arrays the engine keeps (no Python loop per token).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pagedkv.sample.prepared import LogitTensors, PreparedSampling, logit_tensors
from pagedkv.sample.sampling_params import SamplingParams

__all__ = ["LogitsAdjustments", "TokenBuffer", "bad_words_bans"]


class TokenBuffer:
    """A sample's output token ids as a growing int64 numpy array (amortized O(1) append), so
    that each step's penalty keys are built from arrays rather than Python lists."""

    def __init__(self, capacity: int = 64) -> None:
        self._data = np.empty(max(1, capacity), dtype=np.int64)
        self._len = 0

    def append(self, token_id: int) -> None:
        if self._len == self._data.shape[0]:
            grown = np.empty(2 * self._len, dtype=np.int64)
            grown[: self._len] = self._data
            self._data = grown
        self._data[self._len] = token_id
        self._len += 1

    def array(self) -> np.ndarray:
        """The tokens so far (a view: valid until the next append)."""
        return self._data[: self._len]

    def __len__(self) -> int:
        return self._len


@dataclass
class LogitsAdjustments:
    """One step's penalties, biases and allowed-token masks as flat tensors (keys are
    ``row * V + token`` into the ``[S, V]`` logits); ``None`` parts are not used this step."""

    vocab_size: int
    # Output tokens of the penalized rows, one key per occurrence: [O] int64.
    output_keys: torch.Tensor | None
    # Prompt tokens of rows with a repetition penalty, one key per occurrence: [P] int64.
    prompt_keys: torch.Tensor | None
    # Per row [S] float32: the penalties (neutral values on rows without them).
    repetition: torch.Tensor | None
    frequency: torch.Tensor | None
    presence: torch.Tensor | None
    # logit_bias per request: ([R] int64 rows, [B] int64 distinct ids, [B] float32 biases).
    biases: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    # allowed_token_ids per request: ([R] int64 rows, [V] float32 mask: 0 allowed, -inf not).
    allowed: list[tuple[torch.Tensor, torch.Tensor]]

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        *,
        vocab_size: int,
        output_token_ids: Sequence[np.ndarray | None],
        prompt_token_ids: Sequence[np.ndarray | None],
        device: torch.device | str = "cpu",
        prepared: Sequence[PreparedSampling | None] | None = None,
    ) -> LogitsAdjustments | None:
        """The adjustments of the rows whose ``params`` ask for any; ``None`` when none does.

        ``output_token_ids[r]`` / ``prompt_token_ids[r]``: row r's generated and prompt token
        ids (int64 arrays; needed only on rows with penalties, ``None`` elsewhere).
        ``prepared[r]``: row r's request's structures, built when it was added (the engine
        passes them); a row without them gets them built here, once per params object."""
        penalized = [r for r, p in enumerate(params) if p.has_penalties]
        biased = [r for r, p in enumerate(params) if p.logit_bias]
        allowed = [r for r, p in enumerate(params) if p.allowed_token_ids is not None]
        if not (penalized or biased or allowed):
            return None
        v = vocab_size

        def keys(rows: list[int], arrays: list[np.ndarray]) -> torch.Tensor | None:
            lengths = np.fromiter((a.shape[0] for a in arrays), dtype=np.int64, count=len(arrays))
            if not lengths.sum():
                return None
            flat = np.concatenate(arrays) + np.repeat(np.asarray(rows, dtype=np.int64) * v, lengths)
            return torch.from_numpy(flat).to(device)

        def per_row(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.float32, device=device)

        output_keys = prompt_keys = repetition = frequency = presence = None
        if penalized:
            outputs = [output_token_ids[r] for r in penalized]
            if any(a is None for a in outputs):
                raise ValueError("rows with penalties need their output token ids")
            output_keys = keys(penalized, outputs)  # type: ignore[arg-type]
            repeating = [r for r in penalized if params[r].repetition_penalty != 1.0]
            prompts = [prompt_token_ids[r] for r in repeating]
            if any(a is None for a in prompts):
                raise ValueError("rows with a repetition penalty need their prompt token ids")
            prompt_keys = keys(repeating, prompts) if repeating else None  # type: ignore[arg-type]
            repetition = per_row([p.repetition_penalty for p in params])
            frequency = per_row([p.frequency_penalty for p in params])
            presence = per_row([p.presence_penalty for p in params])

        # The rows of each request's tensors (one request's n samples share them): per step, work
        # per row and per request, none per id.
        groups: dict[int, tuple[LogitTensors, list[int]]] = {}
        built: dict[int, LogitTensors] = {}  # rows without prepared tensors, per params object
        for r in sorted(set(biased) | set(allowed)):
            found = prepared[r] if prepared is not None else None
            if found is not None:
                tensors = found.logits
            else:
                tensors = built.get(id(params[r])) or logit_tensors(params[r], v, device)
                built[id(params[r])] = tensors
            groups.setdefault(id(tensors), (tensors, []))[1].append(r)
        biases: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        masks: list[tuple[torch.Tensor, torch.Tensor]] = []
        for tensors, rows in groups.values():
            index = torch.tensor(rows, dtype=torch.int64, device=device)
            if tensors.bias_ids is not None and tensors.bias_values is not None:
                biases.append((index, tensors.bias_ids, tensors.bias_values))
            if tensors.allowed_mask is not None:
                masks.append((index, tensors.allowed_mask))
        return cls(
            vocab_size=v,
            output_keys=output_keys,
            prompt_keys=prompt_keys,
            repetition=repetition,
            frequency=frequency,
            presence=presence,
            biases=biases,
            allowed=masks,
        )

    def apply_(self, logits: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Adjust ``logits`` [S, V] float32 (contiguous) in place and return it.

        ``counts``: [S * V] float32 scratch that is all zero on entry and is left all zero (only
        the touched keys are written, then reset)."""
        flat = logits.view(-1)
        for rows, ids, values in self.biases:
            # Broadcast (rows x ids) pairs: one indexed add per request (ids are distinct).
            logits.index_put_((rows.unsqueeze(1), ids.unsqueeze(0)), values, accumulate=True)
        if self.output_keys is not None or self.prompt_keys is not None:
            self._penalize(flat, counts)
        for rows, mask in self.allowed:
            # x + 0 = x (allowed), x + -inf = -inf (the rest): one pass per row.
            logits.index_add_(0, rows, mask.expand(rows.shape[0], -1))
        return logits

    def _penalize(self, flat: torch.Tensor, counts: torch.Tensor) -> None:
        assert self.repetition is not None and self.frequency is not None and self.presence is not None
        parts = [k for k in (self.output_keys, self.prompt_keys) if k is not None]
        touched = parts[0] if len(parts) == 1 else torch.cat(parts)
        if self.output_keys is not None:
            counts.index_put_(
                (self.output_keys,), torch.ones_like(self.output_keys, dtype=counts.dtype), accumulate=True
            )
        rows = torch.div(touched, self.vocab_size, rounding_mode="floor")
        values = flat.index_select(0, touched)
        rho = self.repetition.index_select(0, rows)
        values = torch.where(values > 0, values / rho, values * rho)
        count = counts.index_select(0, touched)
        values -= self.frequency.index_select(0, rows) * count
        values -= self.presence.index_select(0, rows) * (count > 0).to(values.dtype)
        flat.index_copy_(0, touched, values)  # duplicates carry equal values
        counts.index_fill_(0, touched, 0.0)


def bad_words_bans(bad_word_ids: Sequence[Sequence[int]], output_ids: Sequence[int]) -> list[int]:
    """The tokens a row must not sample next: each bad word's last token when the output ends
    with the word's other tokens (a one-token word: always)."""
    bans: list[int] = []
    for word in bad_word_ids:
        head = len(word) - 1
        if head == 0 or (len(output_ids) >= head and list(output_ids[len(output_ids) - head :]) == list(word[:head])):
            bans.append(word[-1])
    return bans
