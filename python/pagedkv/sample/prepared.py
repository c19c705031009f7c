"""What one request's sampling needs at every step, checked against the model and built once,
when the request is added.

A request chooses the size of its ``allowed_token_ids``, ``logit_bias``, ``bad_words`` and
``stop_token_ids``. Rebuilt from :class:`SamplingParams` at every step, each would cost per
step (and per parallel sample) what its length is: 1.5 M allowed ids with ``n = 16`` turned
into 24 M Python integers per step. So :func:`prepare_sampling` does that work once:

- every token id checked against the vocabulary (a ConfigError naming the field); distinct ids
  in range cannot outnumber the vocabulary, so that bounds the lists too;
- ``allowed_token_ids`` as one additive mask ``[V]`` (0 where allowed, ``-inf`` elsewhere), shared
  by the request's ``n`` samples: a step adds it to the request's rows (one pass over each
  row, whatever the list's length; it was ``O(V + len)`` Python work per row before);
- ``logit_bias`` as two tensors (ids, values) added to the request's rows in one indexed add;
- ``bad_words`` tokenized (each word as written and after a space), with the number of output
  tokens a step must look at to ban their last tokens;
- the ids ``min_tokens`` bans (``stop_token_ids`` and eos) as one array.

:meth:`LLMEngine.prepare_params <pagedkv.engine.llm_engine.LLMEngine.prepare_params>` calls it
with the engine's tokenizer, vocabulary and device; :class:`~pagedkv.engine.async_llm.AsyncLLM`
does so in a worker thread before it hands the request to the engine's loop thread, so neither
the server's event loop nor the engine thread tokenizes a request's bad words.
:meth:`LLMEngine.add_request` builds it itself when it was not given one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import torch

from pagedkv.errors import ConfigError
from pagedkv.sample.sampling_params import SamplingParams

__all__ = [
    "LogitTensors",
    "PreparedSampling",
    "bad_words_token_ids",
    "check_ids_in_vocabulary",
    "logit_tensors",
    "needs_preparation",
    "prepare_sampling",
]

_NEG_INF = float("-inf")
_NO_IDS = np.zeros(0, dtype=np.int64)


@dataclass(frozen=True, eq=False)
class LogitTensors:
    """A request's ``allowed_token_ids`` and ``logit_bias`` as the sampler applies them."""

    # [V] float32 on the logits' device: 0.0 on allowed ids, -inf elsewhere; None: no list.
    allowed_mask: torch.Tensor | None
    # [B] int64 distinct ids and [B] float32 biases; None: no bias.
    bias_ids: torch.Tensor | None
    bias_values: torch.Tensor | None

    @property
    def used(self) -> bool:
        """Whether a step has anything to apply."""
        return self.allowed_mask is not None or self.bias_ids is not None


@dataclass(frozen=True, eq=False)
class PreparedSampling:
    """One request's per-step sampling structures (see the module docs); read-only once built,
    shared by the request's samples."""

    # What it was built from and for: the engine uses it only for these.
    params: SamplingParams
    vocab_size: int
    device: torch.device
    logits: LogitTensors
    # Token sequences of the bad words, and the most output tokens a ban depends on (the
    # longest sequence minus its last token).
    bad_word_ids: tuple[tuple[int, ...], ...] = ()
    bad_word_context: int = 0
    # The ids banned while a sample has fewer than min_tokens tokens (stop_token_ids, then eos).
    min_tokens_ban: np.ndarray = field(default_factory=lambda: _NO_IDS)

    @classmethod
    def empty(cls, params: SamplingParams, device: torch.device | str = "cpu") -> PreparedSampling:
        """Structures for ``params`` that ask for none of them (no vocabulary needed)."""
        return cls(params=params, vocab_size=0, device=torch.device(device), logits=LogitTensors(None, None, None))

    def fits(self, params: SamplingParams, vocab_size: int, device: torch.device) -> bool:
        """Whether this was built from ``params`` for this vocabulary and device."""
        return self.params is params and self.vocab_size == vocab_size and self.device == device


def needs_preparation(params: SamplingParams) -> bool:
    """Whether preparing ``params`` does work worth keeping off a busy thread (lists to check
    against the vocabulary, words to tokenize)."""
    return bool(params.allowed_token_ids is not None or params.logit_bias or params.bad_words)


def prepare_sampling(
    params: SamplingParams,
    *,
    vocab_size: int,
    tokenizer: Any = None,
    eos_token_ids: Sequence[int] = (),
    device: torch.device | str = "cpu",
) -> PreparedSampling:
    """``params``' per-step structures for a model of ``vocab_size`` tokens whose logits live
    on ``device``; ``tokenizer`` tokenizes ``bad_words`` (needed only when there are some).
    A token id outside the vocabulary is a ConfigError naming its field.

    Built once per params object and engine (kept on the params: requests that share one
    SamplingParams, such as the prompts of one API request or of one ``LLM.generate`` call,
    share one mask). Thread-safe: two threads may both build it; either result is kept."""
    device = torch.device(device)
    key = (vocab_size, str(device), id(tokenizer), tuple(eos_token_ids))
    cached = params._prepared.get(key)
    if cached is not None:
        return cast(PreparedSampling, cached)
    prepared = _build(params, vocab_size, tokenizer, eos_token_ids, device)
    if len(params._prepared) >= 4:  # the params travel between a few engines at most
        params._prepared.clear()
    params._prepared[key] = prepared
    return prepared


def _build(
    params: SamplingParams, vocab_size: int, tokenizer: Any, eos_token_ids: Sequence[int], device: torch.device
) -> PreparedSampling:
    check_ids_in_vocabulary("stop_token_ids", params.stop_token_ids or (), vocab_size)
    tensors = logit_tensors(params, vocab_size, device)
    words: tuple[tuple[int, ...], ...] = ()
    if params.bad_words:
        if tokenizer is None:
            raise ConfigError("bad_words need the engine's tokenizer")
        words = tuple(tuple(w) for w in bad_words_token_ids(tokenizer, params.bad_words, vocab_size))
    ban = _NO_IDS
    if params.min_tokens > 0:
        ids = list(dict.fromkeys([*(params.stop_token_ids or ()), *eos_token_ids]))
        ban = np.asarray([t for t in ids if 0 <= t < vocab_size], dtype=np.int64)
    return PreparedSampling(
        params=params,
        vocab_size=vocab_size,
        device=device,
        logits=tensors,
        bad_word_ids=words,
        bad_word_context=max((len(w) - 1 for w in words), default=0),
        min_tokens_ban=ban,
    )


def logit_tensors(params: SamplingParams, vocab_size: int, device: torch.device | str = "cpu") -> LogitTensors:
    """``params``' allowed-token mask and logit-bias tensors (ids checked against
    ``vocab_size``: a ConfigError naming the field)."""
    mask = bias_ids = bias_values = None
    allowed = params.allowed_token_ids
    if allowed is not None:
        check_ids_in_vocabulary("allowed_token_ids", allowed, vocab_size)
        mask = torch.full((vocab_size,), _NEG_INF, dtype=torch.float32)
        mask[torch.tensor(allowed, dtype=torch.int64)] = 0.0
        mask = mask.to(device)
    if params.logit_bias:
        ids = list(params.logit_bias)
        check_ids_in_vocabulary("logit_bias", ids, vocab_size)
        bias_ids = torch.tensor(ids, dtype=torch.int64, device=device)
        bias_values = torch.tensor(list(params.logit_bias.values()), dtype=torch.float32, device=device)
    return LogitTensors(allowed_mask=mask, bias_ids=bias_ids, bias_values=bias_values)


def check_ids_in_vocabulary(name: str, ids: Sequence[int], vocab_size: int) -> None:
    """A ConfigError naming ``name`` when an id of ``ids`` (ints >= 0, as SamplingParams left
    them) is not below ``vocab_size``; one C-speed pass when all are."""
    if ids and max(ids) >= vocab_size:
        bad = next(t for t in ids if t >= vocab_size)
        raise ConfigError(f"{name} holds {bad}, outside the vocabulary [0, {vocab_size})")


def bad_words_token_ids(tokenizer: Any, words: Sequence[str], vocab_size: int) -> list[list[int]]:
    """The token sequences of ``bad_words``: each word as written and with one leading space
    (mid-sentence spelling: BPE vocabularies give " word" its own tokens), without duplicates
    or ids outside the LM head."""
    sequences: dict[tuple[int, ...], None] = {}
    for word in words:
        for spelling in (word, " " + word.lstrip()):
            ids = tuple(int(t) for t in tokenizer.encode(spelling, add_special_tokens=False))
            if ids and all(0 <= t < vocab_size for t in ids):
                sequences[ids] = None
    return [list(ids) for ids in sequences]
