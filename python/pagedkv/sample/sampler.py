"""Batched token sampling in torch: greedy, temperature, min-p, top-k, top-p, per-request seeds.

One call samples one token for every row of a step's logits ``[S, V]``. All rows go through
the same few batched tensor operations; per-row Python work is limited to building the
:class:`SamplingMetadata` (list comprehensions and a handful of list-to-tensor conversions) and
to one small RNG call per *seeded* row.

Order of operations (vLLM's): logit bias -> penalties -> allowed tokens
(:mod:`pagedkv.sample.penalties`, on a copy) -> banned tokens -> temperature -> min-p -> top-k ->
top-p -> draw.
Top-p applies to the distribution renormalized over what min-p and top-k kept. Log-probabilities
are the model's raw ones (``log_softmax`` of the logits as given, before bans, temperature or any
filter), like vLLM's default ``logprobs_mode="raw_logprobs"``.

Which tokens a filter keeps (the exact definition every path implements)
--------------------------------------------------------------------------
With ``e_i = exp(logit_i / T - max)`` the row's float32 weights after the bans and the filters
before it: min-p keeps ``e_i >= min_p * max(e)``; top-k keeps token ``i`` iff fewer than ``k``
tokens have ``e_j > e_i``; top-p keeps ``i`` iff the tokens with ``e_j > e_i`` hold less than
``p`` of the mass. So the kept set is always "every token at or above a boundary value": ties
with the boundary are kept (vLLM keeps them too), and the top-p set is the smallest
most-likely prefix reaching ``p`` of a full descending sort, plus its ties. Decisions are made
on the float32 weights (top-k on the candidate path below: on the scaled logits), so two tokens
whose weights round to the same float32 tie.

How a token is drawn, and why a seeded row's draw does not depend on the batch
-------------------------------------------------------------------------------
Two exact methods, chosen by device (``Sampler(method=...)`` overrides):

* ``"exponential"`` (default on CUDA; vLLM's): every filter becomes a per-row threshold (top-k by
  ``torch.topk`` values or radix select, top-p by radix select), then ``q_i ~ Exp(1)`` for every
  token ``i`` and the pick is ``argmax_i e_i / q_i``. Since ``q_i / e_i ~ Exp(rate=e_i)`` and the
  minimum of independent exponentials is the one of rate ``e_i`` with probability
  ``e_i / sum(e)``, the winner is distributed exactly as ``e``. Elementwise passes and a few
  histograms: no scan, no sort. ``V`` exponentials per row per step.
* ``"inverse_cdf"`` (default on the CPU, where ``V`` exponentials per row are expensive): as
  above. Every random row takes ``_ROUNDS + 1`` uniforms per step, used or not: draw
  ``r`` uses column ``r``, the radix fallback the last one.

Either way a seeded request's random numbers come from the request's own ``torch.Generator``,
which nothing else draws from, in a fixed amount per step: they depend only on the seed and on
how many tokens the request has sampled before. The weights, thresholds, rejection tests and
draws are all row-wise (a row's result never reads another row), so which other rows share the
batch, and in which order, changes nothing. That holds bitwise on the CPU: elementwise passes
round alike wherever a row sits, and the row sums behind decisions are taken per 256-token
chunk (:func:`~pagedkv.sample.ops.row_sums`; a lone row's plain ``sum`` is split across threads
and rounds differently). On CUDA the radix histograms add with atomics, so a top-p boundary
within float64 rounding of ``p`` could fall either way from run to run. Unseeded rows share the
global generator in one batched call.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedkv.errors import InvalidArgumentError
from pagedkv.sample.metadata import SamplingMetadata
from pagedkv.sample.ops import (
    Workspace,
    blocked_draw,
    chunk_sums,
    mask_below_,
    mass_and_count_above,
    radix_threshold,
    topk,
)
from pagedkv.sample.penalties import LogitsAdjustments

__all__ = [
    "LogprobsTensors",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "apply_min_p",
    "apply_top_k_top_p",
    "make_generator",
]

# Top-k up to this many tokens is sampled from top-(k + 1) candidates (cost grows with k).
_CANDIDATES = 256
# Rejection rounds (inverse CDF) before a still-rejected row gets the exact radix boundary.
# A round costs about one pass over the rejected rows only; the radix select about ten.
_ROUNDS = 8
# Relative margin of the rejection shortcuts (float32 sums are good to ~1e-7).
_MARGIN = 1e-5

_INF = float("inf")


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A request's private generator; keep it with the request for its whole life."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


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
    """Samples one token per logits row. Generators live with the requests; the sampler only
    keeps scratch buffers between calls (CPU; a concurrent call from another thread uses its
    own), so it holds up to two ``[S, V]`` float32 buffers plus radix blocks.

    ``method``: ``"exponential"``, ``"inverse_cdf"`` or ``None`` (by device: exponential race
    on CUDA, inverse CDF on the CPU); see the module docstring and ``_Step``.
    """

    METHODS = ("exponential", "inverse_cdf")

    def __init__(self, method: str | None = None) -> None:
        if method is not None and method not in self.METHODS:
            raise InvalidArgumentError(f"method must be one of {self.METHODS} or None, got {method!r}")
        self.method = method
        self._workspace = Workspace()

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        return self.sample(logits, metadata)

    def replay_draws(
        self, generator: torch.Generator, num_rows: int, vocab_size: int, device: torch.device | str
    ) -> None:
        """Draws from ``generator`` exactly what sampling ``num_rows`` random (temperature > 0)
        rows of a seeded sample draws from it: ``_ROUNDS + 1`` uniforms each (inverse CDF) or
        ``vocab_size`` exponentials (exponential race). Speculative decoding uses it to advance
        a seeded stream by the tokens a step emitted (``pagedkv.engine.spec_decode``)."""
        method = self.method or ("exponential" if torch.device(device).type == "cuda" else "inverse_cdf")
        for _ in range(num_rows):
            if method == "inverse_cdf":
                torch.empty(_ROUNDS + 1, device=device).uniform_(generator=generator)
            else:
                torch.empty(vocab_size, device=device).exponential_(generator=generator)

    def sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """``logits``: [S, V] (float32 preferred; other float dtypes are upcast). Not modified."""
        if logits.dim() != 2 or logits.shape[0] != metadata.num_rows:
            raise InvalidArgumentError(f"logits must be [S={metadata.num_rows}, V], got shape {tuple(logits.shape)}")
        logits = logits.float()
        method = self.method or ("exponential" if logits.device.type == "cuda" else "inverse_cdf")
        workspace = self._workspace.acquire()
        try:
            stats = None
            if metadata.max_num_logprobs is not None:
                stats = _logprob_stats(logits, metadata.max_num_logprobs, workspace)  # raw logprobs
            raw = logits
            if metadata.adjustments is not None:
                logits = _adjusted(logits, metadata.adjustments, workspace)
            if metadata.all_greedy:
                sampled = _greedy(logits, metadata, workspace)
            else:
                sampled = _Step(logits, metadata, method, workspace).run()
            logprobs = None
            if stats is not None:
                logprobs = _gather_logprobs(raw, stats, sampled, workspace)
        finally:
            workspace.release()
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)


def _adjusted(logits: torch.Tensor, adjustments: LogitsAdjustments, workspace: Workspace) -> torch.Tensor:
    """A copy of ``logits`` [S, V] with the penalties, biases and allowed-token masks applied
    (in a workspace buffer: the caller's logits are never modified)."""
    adjusted = workspace.buffer("adjusted", tuple(logits.shape), torch.float32, logits.device).copy_(logits)
    counts = workspace.zeros("penalty_counts", logits.numel(), torch.float32, logits.device)
    return adjustments.apply_(adjusted, counts)


def _greedy(logits: torch.Tensor, metadata: SamplingMetadata, workspace: Workspace) -> torch.Tensor:
    if metadata.banned_rows is None:
        return logits.argmax(dim=-1)
    masked = workspace.buffer("scaled", tuple(logits.shape), torch.float32, logits.device).copy_(logits)
    masked.index_put_((metadata.banned_rows, metadata.banned_token_ids), torch.tensor(-_INF, device=logits.device))
    return masked.argmax(dim=-1)


class _Step:
    """One call's random sampling.

    Cost: a few passes over the logits, never a sort
    ------------------------------------------------
    A pass over the logits is cheap only when it writes into memory that is already mapped; a fresh
    ``[S, V]`` result pays page faults, and a sort costs far more than either. So the sampler writes
    only into :class:`~pagedkv.sample.ops.Workspace` buffers kept between steps and uses elementwise
    arithmetic (``relu``, ``sign``, a compare into a float buffer) where a bool ``masked_fill_`` /
    ``where`` / bool sum is slower. Per random row (CPU, ``inverse_cdf``):

    * temperature: divide (into the workspace), ``max``, subtract + ``exp`` in place, one read for
      the per-chunk sums, then the draw (:func:`~pagedkv.sample.ops.blocked_draw`: the chunk by a
      search over the chunk sums, the token by a cumulative sum of that 256-token chunk only);
    * min-p: one more in-place pass (a scalar ``threshold_`` when the rows share one ``min_p``);
    * top-k, ``k <= 256``: the top ``k + 1`` scaled logits (:func:`~pagedkv.sample.ops.topk`),
      then min-p, top-p and the draw on those candidates alone (sorted, so top-p is a cumulative
      sum). A row whose k-th value repeats just past the candidates goes the general way below.
      The candidate set's cost grows with k, hence the limit;
    * top-p (and top-k > 256): *rejection*. Draw ``t`` from the min-p/top-k-filtered weights, then
      test whether ``t`` is in the nucleus: the mass of tokens strictly more likely than ``t`` is
      ``< p`` (and fewer than ``k`` of them are, for top-k by rejection) — one pass over the row
      (:func:`~pagedkv.sample.ops.mass_and_count_above`), skipped when the answer is known without
      it. An accepted draw is a draw from the filtered distribution conditioned on the nucleus,
      i.e. exactly from the renormalized nucleus, whatever the shape of the row. A row is accepted
      with probability = nucleus mass >= p, so rejected rows are redrawn (only they) for up to
      ``_ROUNDS`` rounds; rows still rejected get the exact boundary by a radix select on the float
      bits (:func:`~pagedkv.sample.ops.radix_threshold`: three histogram passes, no sort) and one
      draw from the masked row. Rows with both top-k > 256 and top-p get the top-k boundary by
      radix select first (the nucleus is relative to the top-k mass, unknown otherwise).
    """

    def __init__(self, logits: torch.Tensor, metadata: SamplingMetadata, method: str, workspace: Workspace) -> None:
        self.logits = logits
        self.md = metadata
        self.method = method
        self.ws = workspace
        self.device = logits.device
        self.num_rows, self.vocab = logits.shape
        # [S, _ROUNDS + 1] uniforms of the inverse-CDF draws (set by run()).
        self.uniform = torch.empty(0, device=logits.device)

    def _rows_tensor(self, rows: list[int]) -> torch.Tensor:
        return torch.tensor(rows, dtype=torch.int64, device=self.device)

    def run(self) -> torch.Tensor:
        md, num_rows, vocab = self.md, self.num_rows, self.vocab
        shape = (num_rows, vocab)
        # The scaled, banned logits: the only [S, V] tensor computed for every row.
        scaled = self.ws.buffer("scaled", shape, torch.float32, self.device)
        torch.div(self.logits, md.temperature.unsqueeze(1), out=scaled)
        if md.banned_rows is not None:
            scaled.index_put_((md.banned_rows, md.banned_token_ids), torch.tensor(-_INF, device=self.device))
        spare = self.ws.buffer("spare", shape, torch.float32, self.device)
        sampled = torch.empty(num_rows, dtype=torch.int64, device=self.device)

        if md.greedy_rows:  # temperature 1 there: `scaled` is the banned logits
            rows = self._rows_tensor(md.greedy_rows)
            picked = torch.index_select(scaled, 0, rows, out=spare[: len(md.greedy_rows)])
            sampled[rows] = picked.argmax(dim=-1)

        if self.method == "inverse_cdf":
            self.uniform = self._uniforms()
        full = md.random_rows
        if self.method == "inverse_cdf" and md.top_k is not None:
            candidates = [r for r in md.random_rows if md.top_k_list[r] < min(vocab, _CANDIDATES + 1)]
            if candidates:
                rows = self._rows_tensor(candidates)
                tokens, tied = self._sample_candidates(scaled, spare, candidates, rows)
                sampled[rows] = tokens
                redo = set(rows[tied].tolist())  # host sync (CPU: free)
                done = set(candidates) - redo
                full = [r for r in md.random_rows if r not in done]

        if full:
            if len(full) == num_rows:
                weights, scratch = scaled, spare
            else:  # `scaled` is free once the greedy and candidate rows are done
                rows = self._rows_tensor(full)
                weights = torch.index_select(scaled, 0, rows, out=spare[: len(full)])
                scratch = scaled[: len(full)]
            sampled[self._rows_tensor(full)] = self._sample_full(weights, scratch, full)
        return sampled

    def _uniforms(self) -> torch.Tensor:
        """[S, _ROUNDS + 1]: a fixed number per row and step (seeded rows: their generator)."""
        md = self.md
        uniform = torch.empty(self.num_rows, _ROUNDS + 1, device=self.device)
        if len(md.generators) < self.num_rows:
            uniform.uniform_()
        for row, generator in md.generators.items():
            uniform[row].uniform_(generator=generator)
        return uniform

    # ---------------------------------------------------------------- top-k <= 256: candidates

    def _sample_candidates(
        self, scaled: torch.Tensor, spare: torch.Tensor, row_list: list[int], rows: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows with top-k <= _CANDIDATES: everything on the sorted top-(k+1) values. Returns the
        tokens and a mask of the rows whose k-th value repeats at position k+1 (their top-k set
        may extend past the candidates: the caller re-samples them on the full row)."""
        md = self.md
        assert md.top_k is not None
        if len(row_list) == self.num_rows:
            source = scaled
        else:
            source = torch.index_select(scaled, 0, rows, out=spare[: len(row_list)])
        k = md.top_k.index_select(0, rows)
        width = max(md.top_k_list[r] for r in row_list) + 1  # <= V since k < V
        values, indices = topk(source, width)  # sorted, descending
        tied = (values.gather(1, k.unsqueeze(1)) == values.gather(1, (k - 1).unsqueeze(1))).squeeze(1)
        weights = (values - values[:, :1]).exp_()
        position = torch.arange(width, device=self.device)
        weights.masked_fill_(position >= k.unsqueeze(1), 0.0)
        if md.min_p is not None:
            weights.masked_fill_(weights < md.min_p.index_select(0, rows).unsqueeze(1), 0.0)
        if md.top_p is not None:
            top_p = md.top_p.index_select(0, rows).unsqueeze(1)
            cumulative = weights.cumsum(dim=-1)
            keep = (cumulative - weights) < top_p * cumulative[:, -1:]
            keep |= top_p >= 1.0
            boundary = values.masked_fill(~keep, _INF).amin(dim=-1, keepdim=True)
            weights.masked_fill_(values < boundary, 0.0)  # ties with the boundary stay
        cumulative = weights.cumsum(dim=-1)
        total = cumulative[:, -1:]
        target = self.uniform.index_select(0, rows)[:, :1] * total
        target = torch.minimum(target, torch.nextafter(total, torch.zeros_like(total)))
        position = torch.searchsorted(cumulative, target, right=True).clamp_(max=width - 1)
        return indices.gather(1, position).squeeze(1), tied

    # ---------------------------------------------------------------- general rows

    def _sample_full(self, weights: torch.Tensor, scratch: torch.Tensor, row_list: list[int]) -> torch.Tensor:
        """``weights`` [F, V]: the rows' scaled logits (consumed: turned into weights in place).
        ``scratch`` [F, V] float32, free to overwrite."""
        md, vocab, device = self.md, self.vocab, self.device
        num = len(row_list)
        rows = self._rows_tensor(row_list)
        weights.sub_(weights.amax(dim=-1, keepdim=True)).exp_()  # the row's max weighs 1

        min_ps = [md.min_p_list[r] for r in row_list] if md.min_p is not None else []
        if any(m > 0.0 for m in min_ps):
            if len(set(min_ps)) == 1:  # one scalar threshold: keep e >= min_p
                below = float(np.nextafter(np.float32(min_ps[0]), np.float32(-_INF)))
                torch.nn.functional.threshold(weights, below, 0.0, inplace=True)  # keeps e > below
            else:
                assert md.min_p is not None
                mask_below_(weights, md.min_p.index_select(0, rows).unsqueeze(1), scratch)

        top_ks = [md.top_k_list[r] for r in row_list] if md.top_k is not None else [vocab] * num
        top_ps = [md.top_p_list[r] for r in row_list] if md.top_p is not None else [1.0] * num
        uses_p = [p < 1.0 for p in top_ps]
        inverse = self.method == "inverse_cdf"
        # Top-k as a threshold now, or (inverse CDF, k > _CANDIDATES, no top-p) by rejection.
        k_by_threshold: list[int] = []
        k_by_rejection: list[int] = []
        for j in range(num):
            if top_ks[j] < vocab:
                rejection = inverse and top_ks[j] > _CANDIDATES and not uses_p[j]
                (k_by_rejection if rejection else k_by_threshold).append(j)
        if k_by_threshold:
            threshold = torch.zeros(num, dtype=torch.float32, device=device)
            small = [j for j in k_by_threshold if top_ks[j] <= _CANDIDATES]
            large = [j for j in k_by_threshold if top_ks[j] > _CANDIDATES]
            if small:
                index = self._rows_tensor(small)
                source = weights if len(small) == num else weights.index_select(0, index)
                k = torch.tensor([top_ks[j] for j in small], dtype=torch.int64, device=device)
                kth = topk(source, int(k.max()))[0].gather(1, (k - 1).unsqueeze(1))
                threshold[index] = kth.squeeze(1)
            if large:
                index = self._rows_tensor(large)
                k = torch.tensor([float(top_ks[j]) for j in large], dtype=torch.float32, device=device)
                threshold[index] = radix_threshold(weights, index, k, by_mass=False, workspace=self.ws)
            mask_below_(weights, threshold.unsqueeze(1), scratch)

        p_rows = [j for j in range(num) if uses_p[j]]
        if not inverse:
            if p_rows:
                index = self._rows_tensor(p_rows)
                threshold = torch.zeros(num, dtype=torch.float32, device=device)
                p = torch.tensor([top_ps[j] for j in p_rows], dtype=torch.float32, device=device)
                threshold[index] = radix_threshold(weights, index, p, by_mass=True, workspace=self.ws)
                mask_below_(weights, threshold.unsqueeze(1), scratch)
            return self._exponential_race(weights, scratch, row_list)

        sums = chunk_sums(weights)
        tokens = blocked_draw(weights, self.uniform.index_select(0, rows)[:, 0], sums)
        checked = sorted(set(p_rows) | set(k_by_rejection))
        if not checked:
            return tokens
        total = sums.sum(dim=-1)
        mass_limit = torch.tensor(top_ps, dtype=torch.float32, device=device) * total
        mass_limit.masked_fill_(torch.tensor([not u for u in uses_p], device=device), _INF)
        by_count = set(k_by_rejection)
        count_limit = torch.tensor([float(top_ks[j]) if j in by_count else _INF for j in range(num)], device=device)
        # Decisions that need no pass (exact, with a margin so that near-boundary cases do get
        # the pass): the most likely token (weight 1) is always kept; a token holding more
        # than 1 - p of the mass is in the nucleus (mass above it <= total - its own weight);
        # when the most likely token alone holds p of the mass, every other token is out.
        no_count = torch.isinf(count_limit)
        sure_out_row = (mass_limit < 1.0 - _MARGIN) & no_count
        pending = self._rows_tensor(checked)  # ascending
        for round_ in range(_ROUNDS):
            if round_ > 0:  # redraw the rejected rows (only them) with their next uniform
                uniform = self.uniform.index_select(0, rows[pending])[:, round_]
                tokens[pending] = blocked_draw(weights, uniform, sums.index_select(0, pending), rows=pending)
            token_weight = weights[pending, tokens[pending]]
            sure_in = (token_weight >= 1.0) | (
                ((total[pending] - token_weight) * (1.0 + _MARGIN) < mass_limit[pending]) & no_count[pending]
            )
            sure_out = ~sure_in & sure_out_row[pending]
            rejected = pending[sure_out]
            unsure = ~(sure_in | sure_out)
            pending, token_weight = pending[unsure], token_weight[unsure]
            n = pending.numel()
            if n:
                if 3 * n >= num:  # one pass over every row beats copying most of them
                    everyone = weights.gather(1, tokens.unsqueeze(1))
                    mass, count = mass_and_count_above(weights, everyone, scratch)
                    mass, count = mass[pending], count[pending]
                else:
                    selected = torch.index_select(weights, 0, pending, out=scratch[:n])
                    mass, count = mass_and_count_above(selected, token_weight.unsqueeze(1), selected)
                pending = pending[(mass >= mass_limit[pending]) | (count >= count_limit[pending])]
            if rejected.numel():
                pending = torch.cat([pending, rejected]).sort().values
            if pending.numel() == 0:
                return tokens
        self._draw_exact(weights, scratch, pending, rows, top_ks, top_ps, tokens)
        return tokens

    def _draw_exact(
        self,
        weights: torch.Tensor,
        scratch: torch.Tensor,
        pending: torch.Tensor,
        rows: torch.Tensor,
        top_ks: list[int],
        top_ps: list[float],
        tokens: torch.Tensor,
    ) -> None:
        """Rows still rejected after _ROUNDS draws: the exact boundary by radix select (top-p
        by mass, top-k by count), then one draw from the masked row with the last uniform."""
        device = self.device
        n = pending.numel()
        selected = torch.index_select(weights, 0, pending, out=scratch[:n])
        pending_list = pending.tolist()
        threshold = torch.zeros(n, dtype=torch.float32, device=device)
        by_mass = [i for i, j in enumerate(pending_list) if top_ps[j] < 1.0]
        by_count = [i for i, j in enumerate(pending_list) if top_ps[j] >= 1.0]
        for group, is_mass in ((by_mass, True), (by_count, False)):
            if group:
                index = self._rows_tensor(group)
                value = [top_ps[pending_list[i]] if is_mass else float(top_ks[pending_list[i]]) for i in group]
                threshold[index] = radix_threshold(
                    selected, index, torch.tensor(value, device=device), by_mass=is_mass, workspace=self.ws
                )
        keep = self.ws.buffer("keep", (n, self.vocab), torch.float32, device)
        mask_below_(selected, threshold.unsqueeze(1), keep)
        uniform = self.uniform.index_select(0, rows[pending])[:, _ROUNDS]
        tokens[pending] = blocked_draw(selected, uniform)

    def _exponential_race(self, weights: torch.Tensor, scratch: torch.Tensor, row_list: list[int]) -> torch.Tensor:
        """``argmax(e / q)``, ``q ~ Exp(1)``: V exponentials per row (seeded rows: their own)."""
        md = self.md
        race = scratch
        seeded = [(j, md.generators[r]) for j, r in enumerate(row_list) if r in md.generators]
        if len(seeded) < len(row_list):
            race.exponential_()  # unseeded rows: the global RNG
        for j, generator in seeded:
            race[j].exponential_(generator=generator)
        # Exp(1) can round to 0; 0/0 would be NaN (argmax picks NaN). Keep q > 0.
        race.clamp_min_(torch.finfo(race.dtype).tiny)
        return weights.div_(race).argmax(dim=-1)


# -------------------------------------------------------------------- logprobs


@dataclass
class _LogprobStats:
    logsumexp: torch.Tensor  # [S, 1] float64
    top_values: torch.Tensor | None  # [S, K] raw logits, descending
    top_ids: torch.Tensor | None


def _logprob_stats(logits: torch.Tensor, num_top: int, workspace: Workspace) -> _LogprobStats:
    """The raw log-softmax's normalizer (one exp pass into scratch) and the top logits."""
    peak = logits.amax(dim=-1, keepdim=True)
    scratch = workspace.buffer("spare", tuple(logits.shape), torch.float32, logits.device)
    # The log and the subtractions in float64: the log-probabilities are then rounded once.
    total = torch.sub(logits, peak, out=scratch).exp_().sum(dim=-1, keepdim=True).double()
    top_values = top_ids = None
    if num_top > 0:
        top_values, top_ids = topk(logits, num_top)
    return _LogprobStats(peak.double() + total.log(), top_values, top_ids)


def _gather_logprobs(
    logits: torch.Tensor, stats: _LogprobStats, sampled: torch.Tensor, workspace: Workspace
) -> LogprobsTensors:
    """Chosen + top-k columns of ``log_softmax(logits)``; the rank counts strictly larger logits."""
    chosen = logits.gather(1, sampled.unsqueeze(1))  # [S, 1]
    scratch = workspace.buffer("spare", tuple(logits.shape), torch.float32, logits.device)
    larger = torch.gt(logits, chosen, out=scratch).sum(dim=-1)  # 1.0 / 0.0: exact counts
    ranks = larger.to(torch.int64) + 1
    chosen = (chosen - stats.logsumexp).float()
    if stats.top_values is not None and stats.top_ids is not None:
        token_ids = torch.cat([sampled.unsqueeze(1), stats.top_ids], dim=1)
        values = torch.cat([chosen, (stats.top_values - stats.logsumexp).float()], dim=1)
    else:
        token_ids, values = sampled.unsqueeze(1), chosen
    return LogprobsTensors(token_ids=token_ids, logprobs=values, ranks=ranks)


# -------------------------------------------------------------------- filters as masks


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """In place: mask tokens with prob < min_p * max prob. ``logits`` [S, V], ``min_p`` [S]."""
    weights = (logits - logits.amax(dim=-1, keepdim=True)).exp_()
    logits.masked_fill_(weights < min_p.unsqueeze(1), float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    *,
    max_top_k: int | None = None,
) -> torch.Tensor:
    """Mask (to -inf) all but each row's top-k tokens, then all but its top-p nucleus of the
    distribution renormalized over the top-k (vLLM's order). The masks of the exponential-race
    path: thresholds by ``torch.topk`` / radix select, no sort. Ties with a boundary are kept.

    ``logits`` [S, V] float32 (modified in place and returned); ``top_k`` [S] int64 in [1, V]
    (V = off); ``top_p`` [S] float32 in (0, 1] (1 = off). ``max_top_k`` is accepted for
    compatibility (the host values decide the path).
    """
    del max_top_k
    num_rows, vocab = logits.shape
    device = logits.device
    workspace = Workspace(cache=False)
    weights = (logits - logits.amax(dim=-1, keepdim=True)).exp_()
    keep = torch.ones_like(weights, dtype=torch.bool)
    if top_k is not None:
        ks = top_k.tolist()
        threshold = torch.zeros(num_rows, dtype=torch.float32, device=device)
        small = [i for i, k in enumerate(ks) if k < vocab and k <= _CANDIDATES]
        large = [i for i, k in enumerate(ks) if _CANDIDATES < k < vocab]
        if small:
            index = torch.tensor(small, device=device)
            k = top_k.index_select(0, index)
            kth = weights.index_select(0, index).topk(int(k.max()), dim=-1).values.gather(1, (k - 1).unsqueeze(1))
            threshold[index] = kth.squeeze(1)
        if large:
            index = torch.tensor(large, device=device)
            k = top_k.index_select(0, index).float()
            threshold[index] = radix_threshold(weights, index, k, by_mass=False, workspace=workspace)
        keep &= weights >= threshold.unsqueeze(1)
        weights = weights * keep
    if top_p is not None:
        p_rows = [i for i, p in enumerate(top_p.tolist()) if p < 1.0]
        if p_rows:
            index = torch.tensor(p_rows, device=device)
            threshold = torch.zeros(num_rows, dtype=torch.float32, device=device)
            threshold[index] = radix_threshold(
                weights, index, top_p.index_select(0, index), by_mass=True, workspace=workspace
            )
            keep &= weights >= threshold.unsqueeze(1)
    return logits.masked_fill_(~keep, float("-inf"))
