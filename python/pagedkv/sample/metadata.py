"""What the sampler reads of one step: :class:`SamplingMetadata` (the rows' parameters as
batched tensors) and its construction from a ``SchedulerOutput`` and the live requests.

The engine keeps its requests; this module reads them through small protocols
(:class:`SampledRequest`, :class:`SampledSequence`), so the sampling layer does not import the
engine. Per step it builds, for the step's sampled rows (``logits_indices`` order):

- :func:`step_metadata`: each row's parameters, generator, bans (``min_tokens``, bad words)
  and penalty inputs, seen after the drafts before the row (speculative decoding);
- :func:`grammar_rows`: the rows with a structured-output matcher, whose masks are filled
  while the forward runs;
- :func:`beam_width`: how many candidates the step's beam rows need.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import torch

from pagedkv._core import SchedulerOutput
from pagedkv.errors import InvalidArgumentError
from pagedkv.sample.beam_search_params import BeamSearchParams
from pagedkv.sample.penalties import LogitsAdjustments, bad_words_bans
from pagedkv.sample.prepared import PreparedSampling
from pagedkv.sample.sampling_params import SamplingParams

__all__ = [
    "DraftRows",
    "SampledRequest",
    "SampledSequence",
    "SamplingMetadata",
    "SeededGroup",
    "beam_width",
    "grammar_rows",
    "step_metadata",
]

TokenArray = npt.NDArray[np.int64]


@dataclass
class SamplingMetadata:
    """The sampling parameters of one step's rows, as batched tensors on the logits' device
    (and as host lists, which decide which rows take which path without a device sync).

    Filters a step does not use are ``None`` so the sampler skips them. Build it with
    :meth:`build` (once per step); rows are in ``logits_indices`` order.
    """

    num_rows: int
    # [S] float32; 1.0 on greedy rows so that dividing by it is always safe.
    temperature: torch.Tensor
    # [S] bool, True on greedy rows; None when all rows are greedy or none is.
    greedy_mask: torch.Tensor | None
    all_greedy: bool
    all_random: bool
    # [S] float32 min-p per row (0 = off); None when no row uses min-p.
    min_p: torch.Tensor | None
    # [S] int64 top-k per row, with "off" stored as V (a no-op); None when no row uses top-k.
    top_k: torch.Tensor | None
    # Largest top-k among the rows that use it (known on the host: no device sync per step).
    max_top_k: int | None
    # [S] float32 top-p per row (1 = off); None when no row uses top-p.
    top_p: torch.Tensor | None
    # [F] int64: the rows that use top-k or top-p; None if all rows do (or none).
    filtered_rows: torch.Tensor | None
    # Row -> the request's own generator, for seeded random rows only.
    generators: dict[int, torch.Generator]
    # Largest number of top logprobs any row asked for; None when no row wants logprobs.
    max_num_logprobs: int | None
    # [N] int64 pairs (row, token id) whose logits are set to -inf (e.g. eos before min_tokens).
    banned_rows: torch.Tensor | None
    banned_token_ids: torch.Tensor | None
    # Penalties, logit_bias and allowed_token_ids (applied before the bans); None when unused.
    adjustments: LogitsAdjustments | None = None
    # Host copies: row indices by kind, and the per-row filter values (random rows; greedy rows
    # hold the "off" values). top_k_list stores "off" as V.
    greedy_rows: list[int] = field(default_factory=list)
    random_rows: list[int] = field(default_factory=list)
    top_k_list: list[int] = field(default_factory=list)
    top_p_list: list[float] = field(default_factory=list)
    min_p_list: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        # Metadata made without build(): derive the host lists from the tensors (one sync).
        if not self.greedy_rows and not self.random_rows and self.num_rows:
            if self.all_greedy:
                self.greedy_rows = list(range(self.num_rows))
            elif self.greedy_mask is None:
                self.random_rows = list(range(self.num_rows))
            else:
                greedy: list[bool] = self.greedy_mask.tolist()
                self.greedy_rows = [i for i, g in enumerate(greedy) if g]
                self.random_rows = [i for i, g in enumerate(greedy) if not g]
        if self.top_k is not None and not self.top_k_list:
            self.top_k_list = self.top_k.tolist()
        if self.top_p is not None and not self.top_p_list:
            self.top_p_list = self.top_p.tolist()
        if self.min_p is not None and not self.min_p_list:
            self.min_p_list = self.min_p.tolist()

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        *,
        vocab_size: int,
        device: torch.device | str = "cpu",
        generators: Sequence[torch.Generator | None] | None = None,
        banned_token_ids: Mapping[int, Sequence[int] | np.ndarray] | None = None,
        output_token_ids: Sequence[np.ndarray | None] | None = None,
        prompt_token_ids: Sequence[np.ndarray | None] | None = None,
        prepared: Sequence[PreparedSampling | None] | None = None,
    ) -> SamplingMetadata:
        """Batch ``params`` (one per logits row).

        ``generators[i]`` is row i's private generator (``None`` for unseeded rows; ignored on
        greedy rows). ``banned_token_ids`` maps a row to token ids it must not sample (a list
        or an int64 array). ``output_token_ids[i]`` / ``prompt_token_ids[i]``: row i's
        generated and prompt token ids as int64 arrays, needed on rows with penalties (see
        pagedkv.sample.penalties). ``prepared[i]``: row i's request's structures built when it
        was added (pagedkv.sample.prepared: its allowed-token mask and logit-bias tensors);
        without them they are built here from ``params``.
        """
        num_rows = len(params)
        if generators is not None and len(generators) != num_rows:
            raise InvalidArgumentError(f"generators has {len(generators)} entries for {num_rows} rows")
        temperatures = [p.temperature for p in params]
        greedy_rows = [i for i, t in enumerate(temperatures) if t == 0.0]
        all_greedy = len(greedy_rows) == num_rows
        all_random = not greedy_rows

        def as_tensor(values: Sequence[float], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        temperature = as_tensor([t if t > 0.0 else 1.0 for t in temperatures], torch.float32)
        greedy_mask = None
        if not (all_greedy or all_random):
            greedy_mask = as_tensor([t == 0.0 for t in temperatures], torch.bool)

        min_p = top_k = top_p = filtered_rows = None
        max_top_k: int | None = None
        row_generators: dict[int, torch.Generator] = {}
        random_rows: list[int] = []
        top_ks: list[int] = []
        top_ps: list[float] = []
        min_ps: list[float] = []
        if not all_greedy:
            random_rows = [i for i, t in enumerate(temperatures) if t != 0.0]
            # Greedy rows carry normalized "off" values (SamplingParams does that), so they
            # never switch a filter on.
            min_ps = [p.min_p for p in params]
            top_ks = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
            top_ps = [p.top_p for p in params]
            if any(m > 0.0 for m in min_ps):
                min_p = as_tensor(min_ps, torch.float32)
            k_used = [k for k in top_ks if k < vocab_size]
            if k_used:
                top_k = as_tensor(top_ks, torch.int64)
                max_top_k = max(k_used)
            p_used = any(p < 1.0 for p in top_ps)
            if p_used:
                top_p = as_tensor(top_ps, torch.float32)
            if k_used or p_used:
                filtered = [i for i in range(num_rows) if top_ks[i] < vocab_size or top_ps[i] < 1.0]
                if len(filtered) < num_rows:
                    filtered_rows = as_tensor(filtered, torch.int64)
            if generators is not None:
                row_generators = {
                    row: generator
                    for row, generator in enumerate(generators)
                    if generator is not None and temperatures[row] != 0.0
                }

        wanted = [p.logprobs for p in params if p.logprobs is not None]
        max_num_logprobs = max(wanted) if wanted else None

        no_arrays: list[np.ndarray | None] = [None] * num_rows
        adjustments = LogitsAdjustments.build(
            params,
            vocab_size=vocab_size,
            output_token_ids=no_arrays if output_token_ids is None else output_token_ids,
            prompt_token_ids=no_arrays if prompt_token_ids is None else prompt_token_ids,
            device=device,
            prepared=prepared,
        )
        banned_rows, banned_ids = _banned_pairs(banned_token_ids, num_rows, vocab_size, device)
        return cls(
            num_rows=num_rows,
            temperature=temperature,
            greedy_mask=greedy_mask,
            all_greedy=all_greedy,
            all_random=all_random,
            min_p=min_p,
            top_k=top_k,
            max_top_k=max_top_k,
            top_p=top_p,
            filtered_rows=filtered_rows,
            generators=row_generators,
            max_num_logprobs=max_num_logprobs,
            banned_rows=banned_rows,
            banned_token_ids=banned_ids,
            adjustments=adjustments,
            greedy_rows=greedy_rows,
            random_rows=random_rows,
            top_k_list=top_ks,
            top_p_list=top_ps,
            min_p_list=min_ps,
        )


def _banned_pairs(
    banned_token_ids: Mapping[int, Sequence[int] | np.ndarray] | None,
    num_rows: int,
    vocab_size: int,
    device: torch.device | str,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The (row, token id) pairs of ``banned_token_ids`` as two int64 tensors, checked: per row
    one array and a range check over it (C-speed), no Python work per id."""
    if not banned_token_ids:
        return None, None
    row_parts: list[np.ndarray] = []
    id_parts: list[np.ndarray] = []
    for row, token_ids in banned_token_ids.items():
        if not 0 <= row < num_rows:
            raise InvalidArgumentError(f"banned_token_ids row {row} is not in [0, {num_rows})")
        try:
            ids = np.asarray(token_ids, dtype=np.int64)
        except (OverflowError, TypeError, ValueError):
            raise InvalidArgumentError(f"banned token ids (row {row}) must be ints in [0, {vocab_size})") from None
        if not ids.size:
            continue
        outside = (ids < 0) | (ids >= vocab_size)
        if outside.any():
            bad = int(ids[np.argmax(outside)])
            raise InvalidArgumentError(f"banned token id {bad} (row {row}) is not in [0, {vocab_size})")
        row_parts.append(np.full(ids.size, row, dtype=np.int64))
        id_parts.append(ids)
    if not id_parts:
        return None, None
    rows = torch.from_numpy(np.concatenate(row_parts)).to(device)
    ids_tensor = torch.from_numpy(np.concatenate(id_parts)).to(device)
    return rows, ids_tensor


# ---------------------------------------------------------------- from a step


class SampledSequence(Protocol):
    """One sample (parallel completion) of a request, as the sampling reads it."""

    @property
    def generator(self) -> torch.Generator | None: ...

    @property
    def token_ids(self) -> list[int]: ...


class _Beam(Protocol):
    @property
    def params(self) -> BeamSearchParams: ...


class SampledRequest(Protocol):
    """A live request, as the sampling reads it (the engine's ``RequestState``)."""

    @property
    def params(self) -> SamplingParams: ...

    @property
    def prepared(self) -> PreparedSampling: ...

    @property
    def beam(self) -> _Beam | None: ...

    @property
    def samples(self) -> Sequence[SampledSequence]: ...

    def prompt_array(self) -> TokenArray: ...

    def output_array(self, index: int) -> TokenArray: ...

    def matcher(self, index: int) -> Any:
        """The structured-output matcher of sample ``index`` (llguidance's), or None."""


class DraftRows(Protocol):
    """The drafted tokens before each logits row (speculative decoding; falsy without any)."""

    def __bool__(self) -> bool: ...

    def drafts(self, row: int) -> list[int]: ...


# A seeded, random sample whose rows in this step follow drafts: (its generator, request id,
# sample index). Its generator's state is saved before sampling (engine/spec_decode.py).
SeededGroup = tuple[torch.Generator, str, int]

# Parameters for a logits row whose request is gone (its token is discarded) or of a beam
# search (its logits give candidates, not a sampled token).
_GREEDY = SamplingParams(temperature=0.0, max_tokens=1)


def step_metadata(
    out: SchedulerOutput,
    requests: Mapping[str, SampledRequest],
    drafts: DraftRows,
    *,
    vocab_size: int,
    device: torch.device,
) -> tuple[SamplingMetadata, list[SeededGroup]]:
    """The metadata of the step's sampled rows, and the seeded sample groups with drafts.

    A row after drafts (speculative decoding) is sampled as an ordinary step would sample it
    after the sample's tokens and those drafts: bans, penalties and ``min_tokens`` see that
    context."""
    params: list[SamplingParams] = []
    prepared: list[PreparedSampling | None] = []  # per row, None on greedy stand-ins
    generators: list[torch.Generator | None] = []
    banned: dict[int, np.ndarray | list[int]] = {}
    seeded: list[SeededGroup] = []
    # Token arrays of the rows with penalties (pagedkv.sample.penalties), None elsewhere.
    num_rows = len(out.sampled_req_ids)
    token_arrays: dict[str, list[np.ndarray | None]] = {}
    sample_indices: list[int] = out.sample_indices.tolist()
    for row, (rid, index) in enumerate(zip(out.sampled_req_ids, sample_indices)):
        state = requests.get(rid)
        if state is None or state.beam is not None:
            # A beam row's logits give candidates (beam_width), not a sampled token; a row of
            # a request that is gone (cannot happen under the engine's lock: aborts wait for
            # the step) is dropped by Scheduler.update. Both are sampled greedily.
            params.append(_GREEDY)
            prepared.append(None)
            generators.append(None)
            continue
        p = state.params
        prep = state.prepared
        params.append(p)
        prepared.append(prep)
        sample = state.samples[index]
        generators.append(sample.generator)
        before = drafts.drafts(row) if drafts else []
        if sample.generator is not None and p.temperature > 0.0 and drafts.drafts(row + 1) and not before:
            seeded.append((sample.generator, rid, index))  # the group's first row
        ban: np.ndarray | list[int] = []
        if len(sample.token_ids) + len(before) < p.min_tokens:
            # As in vLLM, min_tokens also holds back the model's eos when ignore_eos is set
            # (stop_token_ids and eos, one array made when the request was added).
            ban = prep.min_tokens_ban
        if prep.bad_word_ids:
            # A ban reads at most the last bad_word_context tokens: no copy of the output.
            context = prep.bad_word_context
            tail = (sample.token_ids[-context:] + before) if context else []
            words = bad_words_bans(prep.bad_word_ids, tail)
            if words:
                ban = np.concatenate([np.asarray(ban, dtype=np.int64), np.asarray(words, dtype=np.int64)])
        if len(ban):
            banned[row] = ban
        if p.has_penalties:
            output_ids = state.output_array(index)
            if before:
                output_ids = np.concatenate([output_ids, np.asarray(before, dtype=np.int64)])
            token_arrays.setdefault("output_token_ids", [None] * num_rows)[row] = output_ids
            token_arrays.setdefault("prompt_token_ids", [None] * num_rows)[row] = state.prompt_array()
    # Keyword arguments only in steps that need them (a benchmark swaps in an older build()):
    # the token arrays with penalties, the requests' bias and mask tensors (made when they
    # were added) with logit_bias or allowed_token_ids.
    extra: dict[str, Any] = dict(token_arrays)
    if any(prep is not None and prep.logits.used for prep in prepared):
        extra["prepared"] = prepared
    metadata = SamplingMetadata.build(
        params,
        vocab_size=vocab_size,
        device=device,
        generators=generators,
        banned_token_ids=banned or None,
        **extra,
    )
    return metadata, seeded


def grammar_rows(out: SchedulerOutput, requests: Mapping[str, SampledRequest]) -> tuple[list[int], list[Any]]:
    """The step's sampled rows whose sample has a structured-output matcher, and the matchers."""
    rows: list[int] = []
    matchers: list[Any] = []
    sample_indices: list[int] = out.sample_indices.tolist()
    for row, (rid, index) in enumerate(zip(out.sampled_req_ids, sample_indices)):
        state = requests.get(rid)
        matcher = None if state is None else state.matcher(index)
        if matcher is not None:
            rows.append(row)
            matchers.append(matcher)
    return rows, matchers


def beam_width(rows: Sequence[int], out: SchedulerOutput, requests: Mapping[str, SampledRequest]) -> int:
    """The widest beam among the requests of the step's beam ``rows`` (1 if none is live)."""
    width = 1
    for r in rows:
        state = requests.get(out.sampled_req_ids[r])
        if state is not None and state.beam is not None:
            width = max(width, state.beam.params.beam_width)
    return width
