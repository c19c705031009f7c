"""Rows of ``logits_indices`` handed back as the LM head's input instead of its output.

A step whose requests want prompt logprobs puts every prompt row into ``logits_indices``
(:mod:`pagedkv.engine.prompt_logprobs`): ``S`` sampled rows, then ``E`` prompt rows. Their
logits, ``[E, V]`` float32, would be 200 MB for a 1k-token prompt of a 49k vocabulary, only to
be reduced to a logprob, a rank and a top-k per row. With a :class:`HiddenRows` request on the
step, the runner returns the logits of the ``S`` sampled rows only and hands back the ``E``
rows' final hidden states (the head's input: after the model's final norm) with the head as a
function (:class:`Head`), which ``prompt_logprobs.compute`` applies a chunk of rows at a time
(into a buffer the head keeps on the CPU).

How: the model keeps the ``S + E`` rows of ``logits_to_keep`` and calls its output embeddings
(``get_output_embeddings()``) on them; a forward pre-hook on that module keeps the last ``E``
rows' input and passes on the first ``S``. The model then computes and post-processes the
sampled rows exactly as in a step without prompt rows.

When that is valid: the prompt rows' logits become ``head(hidden)``, so the model must return
its head's output as its logits, unchanged: no soft-capping (Gemma 2), scaling (Cohere,
Granite) or masking (Chameleon) after the head. :class:`HeadSplit` checks it once per model,
on the first step with a request, which runs the usual way (every row's logits from the
model) while hooks watch: the head is called once, and the model's logits are the head's
output tensor itself, with the values the head wrote (a copy taken in the hook shows an
in-place change made after it). A model that fails keeps the usual way: the request's reply
stays empty and the step's logits hold all ``S + E`` rows.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

__all__ = ["Head", "HeadSplit", "HiddenRows"]


class Head(Protocol):
    """The LM head as a function of the final hidden states: ``head(hidden)`` with ``hidden``
    [n, H] (the model's dtype, n <= ``rows_per_call``) gives [n, V] float32 logits, the model's
    own for those rows, valid until the next call (it may be a buffer the head reuses)."""

    rows_per_call: int

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor: ...


@dataclass
class HiddenRows:
    """One step's request to the runner and its reply (set by the runner, else left None)."""

    # E: the last E rows of the step's logits_indices.
    count: int
    # Reply: [E, H] the rows' final hidden states, in logits_indices order (the model's dtype);
    # the step's logits then hold the first S rows only.
    hidden: torch.Tensor | None = None
    # Reply: the function that turns ``hidden`` into the model's logits.
    head: Head | None = None


class HeadSplit:
    """Per model: whether its logits are its head's output (unknown until a step with a
    :class:`HiddenRows` request has run), and the hooks that split the head's rows."""

    def __init__(self, model: nn.Module) -> None:
        # A transformers model (get_output_embeddings: its LM head module, or None).
        self._model: Any = model
        # None: not checked yet; then whether the rows may be split (see the module docstring).
        self.plain: bool | None = None
        self.head = _ModelHead(model)

    @contextmanager
    def split(self, request: HiddenRows | None, num_rows: int) -> Iterator[None]:
        """Around the model's forward with ``logits_to_keep`` of ``num_rows`` (S + E) rows:
        answer ``request`` if the model allows it (then its logits have S rows), else leave
        the forward as it is (all S + E rows)."""
        module = self._model.get_output_embeddings()
        if request is None or not 0 < request.count <= num_rows or module is None or self.plain is False:
            yield
        elif self.plain is None:
            with self._watch(module):
                yield
        else:
            kept = num_rows - request.count

            def keep_sampled(_module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
                hidden = args[0] if args else None
                # Only the one call on the kept rows, [1, S + E, H]; anything else runs as is
                # (and the reply stays empty, so the caller reads every row from the logits).
                if request.hidden is not None or not isinstance(hidden, torch.Tensor) or hidden.dim() != 3:
                    return None
                if hidden.shape[0] != 1 or hidden.shape[1] != num_rows:
                    return None
                request.hidden = hidden[0, kept:]
                request.head = self.head
                return (hidden[:, :kept], *args[1:])

            handle = module.register_forward_pre_hook(keep_sampled)
            try:
                yield
            finally:
                handle.remove()

    @contextmanager
    def _watch(self, module: nn.Module) -> Iterator[None]:
        """Decide :attr:`plain` from one forward that computes every row's logits."""
        # (the head's output, a copy of its values) per call of the head.
        outputs: list[tuple[Any, torch.Tensor | None]] = []

        def on_head(_module: nn.Module, _args: tuple[Any, ...], output: Any) -> None:
            copy = output.detach().clone() if isinstance(output, torch.Tensor) else None
            outputs.append((output, copy))

        def on_model(_module: nn.Module, _args: tuple[Any, ...], output: Any) -> None:
            logits = getattr(output, "logits", None)
            if len(outputs) != 1 or not isinstance(logits, torch.Tensor):
                self.plain = False
                return
            head_output, copy = outputs[0]
            self.plain = logits is head_output and copy is not None and torch.equal(logits, copy)

        handles = [module.register_forward_hook(on_head), self._model.register_forward_hook(on_model)]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()


# The most bytes of float32 logits one call of the head writes (prompt_logprobs.compute takes
# ``rows_per_call`` rows at a time). The CPU's GEMM wants many rows per call: small calls
# (tens of rows) over a large vocabulary cost well more in all than one call of every row.
_CALL_BYTES = 256 << 20


class _ModelHead:
    """:class:`Head`: the model's output embeddings on hidden states, as float32 logits.

    A float32 ``nn.Linear`` on the CPU writes into one buffer kept between calls and steps
    (at most ``_CALL_BYTES``: 200 MB for 1023 rows of a 49k vocabulary): a fresh one's pages
    would be faulted in and zeroed on every step, ~10% of the head's time. It computes the
    product ``nn.Linear`` itself computes (``F.linear`` is ``mm`` without a bias, ``addmm``
    with one). Any other head is called as is."""

    def __init__(self, model: Any) -> None:
        self._model = model  # a transformers model (only called once split() answered)
        self._buffer: torch.Tensor | None = None  # [rows, V] float32 on the CPU
        weight = getattr(model.get_output_embeddings(), "weight", None)
        vocab = int(weight.shape[0]) if isinstance(weight, torch.Tensor) and weight.dim() == 2 else 1
        self.rows_per_call = max(1, _CALL_BYTES // (4 * vocab))

    @torch.inference_mode()
    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:  # [n, H] -> [n, V] float32
        module = self._model.get_output_embeddings()
        plain_linear = type(module) is nn.Linear and not module._forward_hooks and not module._forward_pre_hooks
        if not (plain_linear and hidden.device.type == "cpu" and module.weight.dtype == torch.float32 == hidden.dtype):
            logits: torch.Tensor = module(hidden).float()  # (on CUDA the caching allocator reuses the memory)
            return logits
        rows, vocab = hidden.shape[0], module.weight.shape[0]
        if self._buffer is None or self._buffer.shape[0] < rows or self._buffer.shape[1] != vocab:
            self._buffer = torch.empty(rows, vocab, dtype=torch.float32)
        out = self._buffer[:rows]
        if module.bias is None:
            return torch.mm(hidden, module.weight.t(), out=out)
        return torch.addmm(module.bias, hidden, module.weight.t(), out=out)
