"""Batched sampler: greedy, filters, per-request seeds, distributions and logprobs."""

from __future__ import annotations

import pytest
import torch

from pagedkv.errors import InvalidArgumentError
from pagedkv.sample.sampler import Sampler, SamplingMetadata, apply_top_k_top_p, make_generator
from pagedkv.sample.sampling_params import SamplingParams

VOCAB = 1000
METHODS = pytest.mark.parametrize("method", ["exponential", "inverse_cdf"])


def _logits(rows: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=generator) * 3.0


def _sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None] | None = None,
    banned: dict[int, list[int]] | None = None,
    method: str | None = None,
):
    metadata = SamplingMetadata.build(
        params, vocab_size=logits.shape[1], generators=generators, banned_token_ids=banned
    )
    return Sampler(method)(logits, metadata)


def test_greedy_is_argmax() -> None:
    logits = _logits(8)
    out = _sample(logits, [SamplingParams(temperature=0.0)] * 8)
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))
    assert out.logprobs is None


def test_greedy_rows_in_a_mixed_batch_are_argmax() -> None:
    logits = _logits(6)
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.5) for i in range(6)]
    torch.manual_seed(0)
    out = _sample(logits, params)
    assert torch.equal(out.sampled_token_ids[1::2], logits[1::2].argmax(dim=-1))


def test_logits_are_not_modified() -> None:
    logits = _logits(4)
    before = logits.clone()
    params = [SamplingParams(temperature=0.8, top_k=5, top_p=0.9, min_p=0.1, logprobs=2)] * 4
    _sample(logits, params, banned={0: [1, 2]})
    assert torch.equal(logits, before)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=2.0, top_p=1e-6),
        SamplingParams(temperature=1.0, min_p=1.0),
        SamplingParams(temperature=5.0, top_k=50, top_p=1e-6),
    ],
    ids=["top_k=1", "tiny top_p", "min_p=1", "top_k+tiny top_p"],
)
def test_filters_that_leave_one_token_equal_greedy(params: SamplingParams) -> None:
    logits = _logits(32)
    torch.manual_seed(1)
    for _ in range(3):
        out = _sample(logits, [params] * 32)
        assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))


def test_top_k_keeps_exactly_k_largest() -> None:
    logits = _logits(3)
    top_k = torch.tensor([1, 7, VOCAB])
    masked = apply_top_k_top_p(logits.clone(), top_k, None)
    kept = torch.isfinite(masked)
    assert kept.sum(dim=-1).tolist() == [1, 7, VOCAB]
    for row in range(3):
        expected = logits[row].topk(int(top_k[row])).indices
        assert kept[row, expected].all()


def test_top_p_keeps_smallest_nucleus() -> None:
    # probs 0.5, 0.3, 0.15, 0.05: p=0.75 needs {0, 1}; p=0.8 is reached exactly by {0, 1};
    # p=0.81 needs {0, 1, 2}.
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 3, dtype=torch.float64)
    logits = probs.log().float()
    top_p = torch.tensor([0.75, 0.79, 0.81])
    kept = torch.isfinite(apply_top_k_top_p(logits.clone(), None, top_p))
    assert kept.tolist() == [
        [True, True, False, False],
        [True, True, False, False],
        [True, True, True, False],
    ]


def test_top_k_then_top_p_renormalizes_over_top_k() -> None:
    # Within the top 2 (0.5, 0.3) the renormalized probs are 0.625 / 0.375: p=0.6 keeps 1 token.
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    kept = torch.isfinite(
        apply_top_k_top_p(logits.clone(), torch.tensor([2]), torch.tensor([0.6]))
    )
    assert kept.tolist() == [[True, False, False, False]]


@METHODS
def test_min_p_only_samples_tokens_above_threshold(method: str) -> None:
    # probs 0.4, 0.3, 0.19, 0.11: min_p=0.5 keeps tokens with p >= 0.2 -> {0, 1}.
    logits = torch.tensor([[0.4, 0.3, 0.19, 0.11]]).log().repeat(2000, 1)
    torch.manual_seed(2)
    out = _sample(logits, [SamplingParams(temperature=1.0, min_p=0.5)] * 2000, method=method)
    assert set(out.sampled_token_ids.tolist()) == {0, 1}


def test_banned_tokens_are_never_sampled() -> None:
    logits = _logits(4)
    best = logits.argmax(dim=-1)
    banned = {row: [int(best[row])] for row in range(4)}
    greedy = _sample(logits, [SamplingParams(temperature=0.0)] * 4, banned=banned)
    second = logits.topk(2, dim=-1).indices[:, 1]
    assert torch.equal(greedy.sampled_token_ids, second)
    # A random row whose whole mass is on the banned token still avoids it.
    peaked = torch.full((1, 5), -30.0)
    peaked[0, 3] = 30.0
    torch.manual_seed(3)
    for _ in range(20):
        out = _sample(peaked, [SamplingParams(temperature=1.0)], banned={0: [3]})
        assert int(out.sampled_token_ids[0]) != 3


def _seeded_draws(
    logits: torch.Tensor,
    row: int,
    params: list[SamplingParams],
    seeds: list[int | None],
    steps: int,
    method: str | None = None,
) -> list[int]:
    """Sample `steps` times with per-row generators; return row `row`'s tokens."""
    generators = [None if s is None else make_generator(s) for s in seeds]
    tokens = []
    for _ in range(steps):
        out = _sample(logits, params, generators, method=method)
        tokens.append(int(out.sampled_token_ids[row]))
    return tokens


@METHODS
def test_seeded_row_is_independent_of_batch_composition(method: str) -> None:
    logits = _logits(6, seed=4)
    target_logits = logits[2:3]
    target = SamplingParams(temperature=1.3, top_p=0.95, seed=1234)
    alone = _seeded_draws(target_logits, 0, [target], [1234], steps=5, method=method)

    # Same row among greedy, unseeded, differently-seeded and filtered rows, at another index.
    others = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, top_k=3),
        SamplingParams(temperature=1.0, seed=99),
        SamplingParams(temperature=1.0, min_p=0.2),
        SamplingParams(temperature=2.0),
    ]
    batch_logits = torch.cat([logits[:2], target_logits, logits[3:]])
    params = others[:2] + [target] + others[2:]
    seeds = [None, None, 1234, 99, None, None]
    torch.manual_seed(5)
    in_batch = _seeded_draws(batch_logits, 2, params, seeds, steps=5, method=method)
    assert in_batch == alone

    # And at the end of a different batch, after other rows consumed the global RNG.
    batch_logits = torch.cat([logits[4:], target_logits])
    torch.manual_seed(6)
    at_end = _seeded_draws(
        batch_logits, 2, [others[0], others[4], target], [None, None, 1234], 5, method=method
    )
    assert at_end == alone
    # The draws really are random (not all the same token).
    assert len(set(alone)) > 1


@METHODS
def test_same_seed_same_tokens_different_seed_differs(method: str) -> None:
    logits = _logits(1, seed=7)
    params = [SamplingParams(temperature=1.5, seed=11)]
    first = _seeded_draws(logits, 0, params, [11], steps=8, method=method)
    assert _seeded_draws(logits, 0, params, [11], steps=8, method=method) == first
    assert _seeded_draws(logits, 0, params, [12], steps=8, method=method) != first


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    return float((((counts - expected) ** 2)[keep] / expected[keep]).sum())


@pytest.mark.parametrize(
    ("params", "expected_fn"),
    [
        (SamplingParams(temperature=1.0), lambda p: p),
        (SamplingParams(temperature=0.5), lambda p: p**2 / (p**2).sum()),
        (
            SamplingParams(temperature=1.0, top_k=3),
            lambda p: torch.cat([p[:3], torch.zeros(5)]) / p[:3].sum(),
        ),
    ],
    ids=["t=1", "t=0.5", "top_k=3"],
)
@METHODS
def test_sampled_distribution_matches(params: SamplingParams, expected_fn, method: str) -> None:
    probs = torch.tensor([0.3, 0.2, 0.15, 0.12, 0.1, 0.07, 0.04, 0.02], dtype=torch.float64)
    draws = 20000
    logits = probs.log().float().repeat(draws, 1)
    torch.manual_seed(8)
    out = _sample(logits, [params] * draws, method=method)
    counts = torch.bincount(out.sampled_token_ids, minlength=8).double()
    expected = expected_fn(probs)
    assert counts[expected == 0].sum() == 0
    # 7 degrees of freedom: P(chi2 > 40) < 1e-5; fixed seeds make it deterministic anyway.
    assert _chi_square(counts, expected) < 40.0


@METHODS
def test_seeded_rows_follow_the_distribution(method: str) -> None:
    # Many single-draw seeded rows: the exponential race is a correct sampler per generator too.
    probs = torch.tensor([0.5, 0.25, 0.125, 0.125], dtype=torch.float64)
    rows = 4000
    logits = probs.log().float().repeat(rows, 1)
    params = [SamplingParams(temperature=1.0, seed=i) for i in range(rows)]
    out = _sample(logits, params, [make_generator(i) for i in range(rows)], method=method)
    counts = torch.bincount(out.sampled_token_ids, minlength=4).double()
    assert _chi_square(counts, probs) < 30.0


def test_logprobs_are_raw_log_softmax() -> None:
    logits = _logits(5, seed=9)
    params = [
        SamplingParams(temperature=0.0, logprobs=0),
        SamplingParams(temperature=0.5, logprobs=3),
        SamplingParams(temperature=2.0, top_k=4, logprobs=1),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.0, logprobs=2),
    ]
    torch.manual_seed(10)
    out = _sample(logits, params)
    assert out.logprobs is not None
    reference = torch.log_softmax(logits.double(), dim=-1)
    sampled = out.sampled_token_ids
    # Column 0: the sampled token's raw (temperature-free) logprob.
    assert out.logprobs.token_ids.shape == (5, 4)
    assert torch.equal(out.logprobs.token_ids[:, 0], sampled)
    torch.testing.assert_close(
        out.logprobs.logprobs[:, 0].double(), reference.gather(1, sampled[:, None])[:, 0]
    )
    # Columns 1..3: the top-3 tokens and their logprobs, descending.
    top = reference.topk(3, dim=-1)
    assert torch.equal(out.logprobs.token_ids[:, 1:], top.indices)
    torch.testing.assert_close(out.logprobs.logprobs[:, 1:].double(), top.values)
    # Ranks: greedy rows sampled the most likely token.
    assert out.logprobs.ranks[0] == 1 and out.logprobs.ranks[4] == 1
    expected_ranks = (reference > reference.gather(1, sampled[:, None])).sum(dim=-1) + 1
    assert torch.equal(out.logprobs.ranks, expected_ranks)


def test_metadata_skips_unused_filters() -> None:
    metadata = SamplingMetadata.build(
        [SamplingParams(temperature=0.8), SamplingParams(temperature=0.8, top_k=-1)],
        vocab_size=VOCAB,
    )
    assert metadata.top_k is None and metadata.top_p is None and metadata.min_p is None
    assert metadata.all_random and not metadata.all_greedy and metadata.greedy_mask is None
    metadata = SamplingMetadata.build(
        [SamplingParams(temperature=0.8), SamplingParams(temperature=0.8, top_p=0.5)],
        vocab_size=VOCAB,
    )
    assert metadata.filtered_rows is not None and metadata.filtered_rows.tolist() == [1]


def test_bad_inputs_raise() -> None:
    params = [SamplingParams()] * 2
    with pytest.raises(InvalidArgumentError, match="logits"):
        Sampler()(torch.zeros(3, VOCAB), SamplingMetadata.build(params, vocab_size=VOCAB))
    with pytest.raises(InvalidArgumentError, match="banned token id"):
        SamplingMetadata.build(params, vocab_size=VOCAB, banned_token_ids={0: [VOCAB]})
    with pytest.raises(InvalidArgumentError, match="generators"):
        SamplingMetadata.build(params, vocab_size=VOCAB, generators=[None])


def test_top_p_candidate_path_equals_full_sort() -> None:
    """The CPU shortcut (top-256 candidates) and the full sort keep the same tokens, also for
    rows whose nucleus extends past the candidates (flat rows) and with top-k first."""
    from pagedkv.sample import sampler as sampler_module

    vocab = 5000
    generator = torch.Generator().manual_seed(12)
    peaked = torch.randn(6, vocab, generator=generator) * 4.0
    flat = torch.randn(4, vocab, generator=generator) * 0.1  # top-256 holds ~5%: full sort
    logits = torch.cat([peaked, flat])
    top_p = torch.tensor([0.5, 0.9, 0.95, 0.99, 1.0, 0.3, 0.9, 0.5, 1.0, 0.99])
    top_k = torch.tensor([vocab, 40, vocab, 1000, 3, vocab, vocab, 300, vocab, vocab])
    assert (torch.softmax(flat, -1).topk(256).values.sum(-1) < 0.5).all()
    by_sort = logits.clone()
    sampler_module._apply_top_k(by_sort, top_k, None)
    sampler_module._apply_top_p_by_sort(by_sort, top_p)
    by_candidates = apply_top_k_top_p(logits.clone(), top_k, top_p)  # CPU: candidate path
    assert torch.equal(torch.isfinite(by_candidates), torch.isfinite(by_sort))
    assert torch.equal(by_candidates[torch.isfinite(by_candidates)], logits[torch.isfinite(by_sort)])
    # Sanity: the filters did something on most rows, nothing on the p=1, k=V row.
    kept = torch.isfinite(by_sort).sum(dim=-1)
    assert kept[8] == vocab and kept[4] == 3 and (kept[:4] < vocab).all()


@METHODS
def test_masked_tokens_are_never_drawn(method: str) -> None:
    """Zero-probability tokens at the edges and in the middle of the vocabulary (where the
    inverse CDF is flat and the exponential race divides 0 by q)."""
    logits = torch.full((3000, 9), float("-inf"))
    logits[:, [1, 4, 7]] = torch.tensor([0.0, 1.0, 2.0])
    torch.manual_seed(13)
    out = _sample(logits, [SamplingParams(temperature=1.0)] * 3000, method=method)
    assert set(out.sampled_token_ids.tolist()) == {1, 4, 7}


def test_unknown_method_raises() -> None:
    with pytest.raises(InvalidArgumentError, match="method"):
        Sampler("gumbel-ish")
