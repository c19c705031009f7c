"""Batched token sampling in torch: greedy, temperature, min-p, top-k, top-p, per-request seeds.

One call samples one token for every row of a step's logits ``[S, V]``. All rows go through
the same few batched tensor operations; per-row Python work is limited to building the
:class:`SamplingMetadata` (a handful of list-to-tensor conversions) and to one small RNG call
per *seeded* row.

Order of operations (vLLM's): banned tokens -> temperature -> min-p -> top-k -> top-p -> draw.
Log-probabilities are the model's raw ones (``log_softmax`` of the logits as given, before
temperature or any filter), like vLLM's default ``logprobs_mode="raw_logprobs"``.

How a token is drawn, and why a seeded row's draw does not depend on the batch
-------------------------------------------------------------------------------
Two exact methods, chosen by device (``Sampler(method=...)`` overrides):

* ``"exponential"`` (default on CUDA; vLLM's): draw ``q_i ~ Exp(1)`` for every token ``i`` and
  pick ``argmax_i p_i / q_i``. Since ``q_i / p_i ~ Exp(rate=p_i)`` and the minimum of
  independent exponentials is the one of rate ``p_i`` with probability ``p_i / sum(p)``, the
  winner is distributed exactly as ``p``. One elementwise pass, no scan: ideal on a GPU.
* ``"inverse_cdf"`` (default on the CPU): one uniform ``u`` per row, pick the first token whose
  cumulative probability exceeds ``u * sum(p)``. ``V`` exponentials cost ~1 ms per 50k-token
  row on a CPU core; a cumulative sum and a binary search cost ~0.15 ms.

Either way, a seeded request's random numbers (``V`` exponentials or one uniform per step)
come from the request's own ``torch.Generator``, which nothing else draws from: they depend
only on the seed and on how many tokens the request has sampled before. ``p`` (and its
cumulative sum) depends only on the row's own logits and parameters, because every operation
here is row-wise. So which other rows share the batch, and in which order, changes nothing.
Unseeded rows share the global generator in one batched call.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from pagedkv.errors import InvalidArgumentError
from pagedkv.sample.sampling_params import SamplingParams

__all__ = [
    "LogprobsTensors",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "make_generator",
]


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A request's private generator; keep it with the request for its whole life."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


@dataclass
class SamplingMetadata:
    """The sampling parameters of one step's rows, as batched tensors on the logits' device.

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
    # [F] int64: the rows that use top-k or top-p (only they are sorted); None if all rows do.
    filtered_rows: torch.Tensor | None
    # Row -> the request's own generator, for seeded random rows only.
    generators: dict[int, torch.Generator]
    # Largest number of top logprobs any row asked for; None when no row wants logprobs.
    max_num_logprobs: int | None
    # [N] int64 pairs (row, token id) whose logits are set to -inf (e.g. eos before min_tokens).
    banned_rows: torch.Tensor | None
    banned_token_ids: torch.Tensor | None

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        *,
        vocab_size: int,
        device: torch.device | str = "cpu",
        generators: Sequence[torch.Generator | None] | None = None,
        banned_token_ids: Mapping[int, Sequence[int]] | None = None,
    ) -> SamplingMetadata:
        """Batch ``params`` (one per logits row).

        ``generators[i]`` is row i's private generator (``None`` for unseeded rows; ignored on
        greedy rows). ``banned_token_ids`` maps a row to token ids it must not sample.
        """
        num_rows = len(params)
        if generators is not None and len(generators) != num_rows:
            raise InvalidArgumentError(
                f"generators has {len(generators)} entries for {num_rows} rows"
            )
        temperatures = [p.temperature for p in params]
        greedy = [t == 0.0 for t in temperatures]
        all_greedy = all(greedy)
        all_random = not any(greedy)

        def as_tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        temperature = as_tensor([t if t > 0.0 else 1.0 for t in temperatures], torch.float32)
        greedy_mask = None if all_greedy or all_random else as_tensor(greedy, torch.bool)

        min_p = top_k = top_p = filtered_rows = max_top_k = None
        row_generators: dict[int, torch.Generator] = {}
        if not all_greedy:
            # Greedy rows carry normalized "off" values (SamplingParams does that), so they
            # never switch a filter on.
            min_ps = [p.min_p for p in params]
            top_ks = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
            top_ps = [p.top_p for p in params]
            if any(m > 0.0 for m in min_ps):
                min_p = as_tensor(min_ps, torch.float32)
            uses_top_k = [k < vocab_size for k in top_ks]
            uses_top_p = [p < 1.0 for p in top_ps]
            if any(uses_top_k):
                top_k = as_tensor(top_ks, torch.int64)
                max_top_k = max(k for k in top_ks if k < vocab_size)
            if any(uses_top_p):
                top_p = as_tensor(top_ps, torch.float32)
            filtered = [i for i in range(num_rows) if uses_top_k[i] or uses_top_p[i]]
            if filtered and len(filtered) < num_rows:
                filtered_rows = as_tensor(filtered, torch.int64)
            if generators is not None:
                row_generators = {
                    row: generator
                    for row, generator in enumerate(generators)
                    if generator is not None and not greedy[row]
                }

        wanted = [p.logprobs for p in params if p.logprobs is not None]
        max_num_logprobs = max(wanted) if wanted else None

        banned_rows = banned_ids = None
        if banned_token_ids:
            rows: list[int] = []
            ids: list[int] = []
            for row, token_ids in banned_token_ids.items():
                if not 0 <= row < num_rows:
                    raise InvalidArgumentError(f"banned_token_ids row {row} is not in [0, {num_rows})")
                for token_id in token_ids:
                    if not 0 <= token_id < vocab_size:
                        raise InvalidArgumentError(
                            f"banned token id {token_id} (row {row}) is not in [0, {vocab_size})"
                        )
                    rows.append(row)
                    ids.append(token_id)
            if rows:
                banned_rows = as_tensor(rows, torch.int64)
                banned_ids = as_tensor(ids, torch.int64)

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
        )


@dataclass
class LogprobsTensors:
    """Per-row log-probabilities: column 0 is the sampled token, columns 1.. the top-k tokens."""

    token_ids: torch.Tensor  # [S, 1 + K] int64
    logprobs: torch.Tensor  # [S, 1 + K] float32
    ranks: torch.Tensor  # [S] int64, 1-based rank of the sampled token (1 = most likely)


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [S] int64
    logprobs: LogprobsTensors | None  # None when no row asked for logprobs


class Sampler:
    """Samples one token per logits row; stateless (generators live with the requests).

    ``method``: ``"exponential"``, ``"inverse_cdf"`` or ``None`` (by device: exponential race
    on CUDA, inverse CDF on the CPU); see the module docstring.
    """

    METHODS = ("exponential", "inverse_cdf")

    def __init__(self, method: str | None = None) -> None:
        if method is not None and method not in self.METHODS:
            raise InvalidArgumentError(f"method must be one of {self.METHODS} or None, got {method!r}")
        self.method = method

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        return self.sample(logits, metadata)

    def sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """``logits``: [S, V] (float32 preferred; other float dtypes are upcast). Not modified."""
        if logits.dim() != 2 or logits.shape[0] != metadata.num_rows:
            raise InvalidArgumentError(
                f"logits must be [S={metadata.num_rows}, V], got shape {tuple(logits.shape)}"
            )
        logits = logits.float()
        raw_logprobs = None
        if metadata.max_num_logprobs is not None:
            raw_logprobs = torch.log_softmax(logits, dim=-1)

        if metadata.banned_rows is not None:
            logits = logits.index_put(
                (metadata.banned_rows, metadata.banned_token_ids),
                torch.tensor(float("-inf"), device=logits.device),
            )

        if metadata.all_greedy:
            sampled = logits.argmax(dim=-1)
        else:
            random_ids = self._sample_random(logits, metadata)
            if metadata.all_random:
                sampled = random_ids
            else:
                assert metadata.greedy_mask is not None
                sampled = torch.where(metadata.greedy_mask, logits.argmax(dim=-1), random_ids)

        logprobs = None
        if raw_logprobs is not None:
            logprobs = _gather_logprobs(raw_logprobs, sampled, metadata.max_num_logprobs or 0)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    def _sample_random(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        # New tensor: everything below may work in place.
        scaled = logits / metadata.temperature.unsqueeze(1)
        if metadata.min_p is not None:
            apply_min_p(scaled, metadata.min_p)
        if metadata.top_k is not None or metadata.top_p is not None:
            rows = metadata.filtered_rows
            if rows is None:
                scaled = apply_top_k_top_p(
                    scaled, metadata.top_k, metadata.top_p, max_top_k=metadata.max_top_k
                )
            else:
                subset = apply_top_k_top_p(
                    scaled.index_select(0, rows),
                    None if metadata.top_k is None else metadata.top_k.index_select(0, rows),
                    None if metadata.top_p is None else metadata.top_p.index_select(0, rows),
                    max_top_k=metadata.max_top_k,
                )
                scaled.index_copy_(0, rows, subset)
        probs = torch.softmax(scaled, dim=-1)
        method = self.method or ("exponential" if probs.device.type == "cuda" else "inverse_cdf")
        if method == "exponential":
            return _exponential_race(probs, metadata)
        return _inverse_cdf(probs, metadata)


def _exponential_race(probs: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """``probs`` [S, V] (consumed) -> [S] int64: ``argmax(p / q)``, ``q ~ Exp(1)``."""
    race = torch.empty_like(probs)
    if len(metadata.generators) < metadata.num_rows:
        race.exponential_()  # unseeded rows: the global RNG
    for row, generator in metadata.generators.items():
        race[row].exponential_(generator=generator)
    # Exp(1) can round to 0; 0/0 would be NaN (argmax picks NaN). Keep q > 0.
    race.clamp_min_(torch.finfo(race.dtype).tiny)
    return probs.div_(race).argmax(dim=-1)


def _inverse_cdf(probs: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """``probs`` [S, V] -> [S] int64: first token whose cumulative probability exceeds ``u``."""
    cdf = probs.cumsum(dim=-1)  # [S, V]; flat (exactly) over zero-probability tokens
    total = cdf[:, -1:]  # [S, 1], ~1
    uniform = torch.empty_like(total)
    if len(metadata.generators) < metadata.num_rows:
        uniform.uniform_()
    for row, generator in metadata.generators.items():
        uniform[row].uniform_(generator=generator)
    # target < total strictly, so some cdf entry exceeds it; the token found has p > 0
    # because cdf is constant across zero-probability tokens.
    target = torch.minimum(uniform * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(1)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """In place: mask tokens with prob < min_p * max prob. ``logits`` [S, V], ``min_p`` [S]."""
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    logits.masked_fill_(probs < threshold, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    *,
    max_top_k: int | None = None,
) -> torch.Tensor:
    """Mask all but each row's top-k tokens, then all but its top-p nucleus (of the
    distribution renormalized over the top-k, as vLLM does).

    ``logits`` [S, V] float32 (modified in place and returned); ``top_k`` [S] int64 in [1, V]
    (V = off); ``top_p`` [S] float32 in (0, 1] (1 = off). ``max_top_k``: ``max`` of the rows'
    top-k below V, if the caller knows it (saves a device sync). Ties with the boundary value
    are kept (as in vLLM).
    """
    if top_k is not None:
        _apply_top_k(logits, top_k, max_top_k)
    if top_p is not None:
        if logits.device.type == "cpu" and logits.shape[1] > _TOP_P_CANDIDATES:
            _apply_top_p_from_candidates(logits, top_p)
        else:
            _apply_top_p_by_sort(logits, top_p)
    return logits


# Top-p on the CPU looks at this many most likely tokens first: a full sort of a 50k-token
# row costs ~4 ms on a CPU core, a top-256 selection ~0.2 ms, and the nucleus almost always
# lies within the top 256. Rows whose nucleus does not are sorted in full (exact either way).
_TOP_P_CANDIDATES = 256


def _apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int | None) -> None:
    """In place. The k-th largest value is a threshold: no full sort needed."""
    vocab_size = logits.shape[1]
    max_k = min(int(top_k.max()) if max_top_k is None else max_top_k, vocab_size)
    top_values = logits.topk(max_k, dim=-1).values  # [S, max_k], descending
    kth_value = top_values.gather(1, (top_k - 1).clamp(max=max_k - 1).unsqueeze(1))
    kth_value.masked_fill_((top_k >= vocab_size).unsqueeze(1), float("-inf"))  # k = V: off
    logits.masked_fill_(logits < kth_value, float("-inf"))


def _apply_top_p_by_sort(logits: torch.Tensor, top_p: torch.Tensor) -> None:
    """In place. Sort each row; drop the low tail whose mass is <= 1 - p."""
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
    drop = cumulative <= (1.0 - top_p).unsqueeze(1)
    drop[:, -1] = False  # the most likely token always stays
    sorted_logits.masked_fill_(drop, float("-inf"))
    logits.scatter_(1, order, sorted_logits)


def _apply_top_p_from_candidates(logits: torch.Tensor, top_p: torch.Tensor) -> None:
    """In place; same result as :func:`_apply_top_p_by_sort` (up to ties at the boundary).

    The nucleus is the shortest prefix of the descending order whose mass reaches p: token j
    stays iff the mass of the tokens before it is < p. Computed on the top candidates with the
    row's true normalizer (logsumexp over the whole row); a row whose candidates hold less
    than p of the mass is re-done by a full sort.
    """
    values = logits.topk(_TOP_P_CANDIDATES, dim=-1).values  # [S, C], descending
    probs = (values - logits.logsumexp(dim=-1, keepdim=True)).exp()
    cumulative = probs.cumsum(dim=-1)
    keep = (cumulative - probs) < top_p.unsqueeze(1)
    threshold = values.masked_fill(~keep, float("inf")).amin(dim=-1, keepdim=True)
    threshold.masked_fill_((top_p >= 1.0).unsqueeze(1), float("-inf"))  # p = 1: off
    uncovered = (cumulative[:, -1] < top_p).nonzero().squeeze(1)  # host sync: CPU only
    if uncovered.numel() > 0:
        rows = logits.index_select(0, uncovered)
        _apply_top_p_by_sort(rows, top_p.index_select(0, uncovered))
    logits.masked_fill_(logits < threshold, float("-inf"))
    if uncovered.numel() > 0:
        logits.index_copy_(0, uncovered, rows)


def _gather_logprobs(
    logprobs: torch.Tensor, sampled: torch.Tensor, num_top: int
) -> LogprobsTensors:
    """``logprobs`` [S, V] float32, ``sampled`` [S] int64 -> chosen + top-``num_top`` columns."""
    chosen = logprobs.gather(1, sampled.unsqueeze(1))  # [S, 1]
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    if num_top > 0:
        top_values, top_ids = logprobs.topk(num_top, dim=-1)
        token_ids = torch.cat([sampled.unsqueeze(1), top_ids], dim=1)
        values = torch.cat([chosen, top_values], dim=1)
    else:
        token_ids, values = sampled.unsqueeze(1), chosen
    return LogprobsTensors(token_ids=token_ids, logprobs=values, ranks=ranks)
