"""Batched sampler: greedy, filters, per-request seeds, distributions and logprobs."""

from __future__ import annotations

import pytest
import torch

from pagedkv.errors import InvalidArgumentError
from pagedkv.sample.sampler import (
    Sampler,
    SamplingMetadata,
    apply_min_p,
    apply_top_k_top_p,
    make_generator,
)
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
    kept = torch.isfinite(apply_top_k_top_p(logits.clone(), torch.tensor([2]), torch.tensor([0.6])))
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
    at_end = _seeded_draws(batch_logits, 2, [others[0], others[4], target], [None, None, 1234], 5, method=method)
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
    torch.testing.assert_close(out.logprobs.logprobs[:, 0].double(), reference.gather(1, sampled[:, None])[:, 0])
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


def test_allowed_ids_and_bias_are_built_once_per_request_and_match_a_dense_reference() -> None:
    import random

    from pagedkv.errors import ConfigError
    from pagedkv.sample.prepared import prepare_sampling

    rng = random.Random(0)
    allowed = rng.sample(range(VOCAB), 600) * 2  # duplicates too
    a = SamplingParams(n=3, temperature=1.0, allowed_token_ids=allowed, logit_bias={3: 50.0, 700: -7.5})
    b = SamplingParams(temperature=1.0, logit_bias={9: 100.0})
    c = SamplingParams(temperature=1.0)
    rows = [a, b, a, c, a]  # request a's three samples, between others
    prepared = [prepare_sampling(p, vocab_size=VOCAB) for p in rows]
    # Built once per params object (the prompts of one API request share it), then reused.
    assert prepared[0] is prepared[2] is prepared[4] is prepare_sampling(a, vocab_size=VOCAB)
    logits = _logits(len(rows))
    dense = logits.clone()
    for r, p in enumerate(rows):
        for token, bias in (p.logit_bias or {}).items():
            dense[r, token] += bias
        if p.allowed_token_ids is not None:
            outside = torch.ones(VOCAB, dtype=torch.bool)
            outside[p.allowed_token_ids] = False
            dense[r, outside] = float("-inf")
    for given in (prepared, None):  # the engine's tensors, or built by build() itself
        md = SamplingMetadata.build(rows, vocab_size=VOCAB, prepared=given)
        assert md.adjustments is not None
        # One mask for request a, applied to its three rows: per step, nothing per id.
        ((mask_rows, mask),) = md.adjustments.allowed
        assert mask_rows.tolist() == [0, 2, 4] and mask.shape == (VOCAB,)
        if given is not None:
            assert mask is prepared[0].logits.allowed_mask
        adjusted = md.adjustments.apply_(logits.clone(), torch.zeros(logits.numel()))
        assert torch.equal(adjusted, dense)
    with pytest.raises(ConfigError, match="allowed_token_ids holds 1000"):
        prepare_sampling(SamplingParams(allowed_token_ids=[1, VOCAB]), vocab_size=VOCAB)


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


# ---------------------------------------------------------------------------------------------
# Exactness against a plain float64 full-sort reference
# ---------------------------------------------------------------------------------------------


def _reference(
    logits: torch.Tensor,
    *,
    temperature: float = 1.0,
    min_p: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kept-token mask and the final probabilities, by the definitions in the sampler's
    docstring, in float64 with a full sort: vLLM's order, ties with a boundary kept, top-p of
    the distribution renormalized over what min-p and top-k kept."""
    scaled = logits.double() / temperature
    keep = torch.isfinite(scaled)
    probs = torch.softmax(scaled, dim=-1)
    if min_p > 0.0:
        keep &= probs >= min_p * probs.amax(dim=-1, keepdim=True)
    if 0 < top_k < logits.shape[1]:
        masked = scaled.masked_fill(~keep, float("-inf"))
        kth = masked.sort(dim=-1, descending=True).values[:, top_k - 1 : top_k]
        keep &= scaled >= kth
    if top_p < 1.0:
        kept_probs = torch.softmax(scaled.masked_fill(~keep, float("-inf")), dim=-1)
        ordered = kept_probs.sort(dim=-1, descending=True).values
        before = ordered.cumsum(dim=-1) - ordered  # mass of the earlier tokens in the sort
        # The smallest prefix reaching p ends at the last position whose predecessors hold < p.
        boundary = ordered.masked_fill(before >= top_p, float("inf")).amin(dim=-1, keepdim=True)
        keep &= kept_probs >= boundary
    final = torch.softmax(scaled.masked_fill(~keep, float("-inf")), dim=-1)
    return keep, final


def _grid_logits(rows: int, vocab: int, seed: int, *, scale: float = 1.0) -> torch.Tensor:
    """Logits on a 1/4 grid (many exact ties, exact division by powers-of-two temperatures)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(-12, 13, (rows, vocab), generator=generator).float() * (0.25 * scale)


FILTERS = [
    {"temperature": 1.0},
    {"temperature": 0.5},
    {"temperature": 2.0},
    {"temperature": 1.0, "min_p": 0.1},
    {"temperature": 1.0, "top_k": 1},
    {"temperature": 1.0, "top_k": 3},
    {"temperature": 2.0, "top_k": 7},
    {"temperature": 1.0, "top_p": 0.05},
    {"temperature": 1.0, "top_p": 0.5},
    {"temperature": 0.5, "top_p": 0.9},
    {"temperature": 2.0, "top_p": 0.95},
    {"temperature": 1.0, "min_p": 0.05, "top_k": 6, "top_p": 0.7},
    {"temperature": 2.0, "top_k": 5, "top_p": 0.5},
    {"temperature": 1.0, "min_p": 0.2, "top_p": 0.8},
]
FILTER_IDS = ["-".join(f"{k}={v}" for k, v in f.items()) for f in FILTERS]


@pytest.mark.parametrize("settings", FILTERS, ids=FILTER_IDS)
def test_masks_match_float64_sort_reference(settings: dict) -> None:
    """Peaked, flat and tied rows (the 1/4 grid makes ties at every boundary likely): the
    kept-token mask of the threshold path equals the full-sort reference exactly."""
    logits = torch.cat([_grid_logits(40, 24, seed=20), _grid_logits(40, 24, seed=21, scale=0.1)])
    temperature = settings.get("temperature", 1.0)
    scaled = logits / temperature
    if settings.get("min_p", 0.0) > 0.0:
        apply_min_p(scaled, torch.full((80,), settings["min_p"]))
    top_k = settings.get("top_k", 0)
    top_p = settings.get("top_p", 1.0)
    masked = apply_top_k_top_p(
        scaled,
        torch.full((80,), top_k if top_k else 24, dtype=torch.int64),
        torch.full((80,), top_p),
    )
    expected, _ = _reference(logits, **settings)
    assert torch.equal(torch.isfinite(masked), expected)


def test_top_p_keeps_ties_with_the_boundary() -> None:
    """probs .4 .2 .2 .1 .1, top_p=0.5: the nucleus {.4, .2} reaches 0.6; the other .2 ties with
    the boundary and stays (a sort-and-cut keeps one of the two .2 tokens, at random)."""
    logits = torch.tensor([[0.4, 0.2, 0.2, 0.1, 0.1]]).log()
    kept = torch.isfinite(apply_top_k_top_p(logits.clone(), None, torch.tensor([0.5])))
    assert kept.tolist() == [[True, True, True, False, False]]
    for method in ("exponential", "inverse_cdf"):
        torch.manual_seed(30)
        out = _sample(logits.repeat(4000, 1), [SamplingParams(temperature=1.0, top_p=0.5)] * 4000, method=method)
        counts = torch.bincount(out.sampled_token_ids, minlength=5).double()
        assert counts[3:].sum() == 0
        assert _chi_square(counts[:3], torch.tensor([0.5, 0.25, 0.25], dtype=torch.float64)) < _chi2_bound(2)


def _chi2_bound(dof: int) -> float:
    """Upper 1e-6 tail of chi-square(dof) (Wilson-Hilferty); the draws use fixed seeds anyway."""
    z = 4.75
    return dof * (1 - 2 / (9 * dof) + z * (2 / (9 * dof)) ** 0.5) ** 3


def _check_draws(tokens: torch.Tensor, keep: torch.Tensor, probs: torch.Tensor) -> None:
    """``tokens`` drawn from one row's filtered distribution ``probs`` (mask ``keep``): never
    outside the mask, and frequencies within the chi-square bound (sparse bins pooled)."""
    vocab = probs.numel()
    counts = torch.bincount(tokens, minlength=vocab).double()
    assert counts[~keep].sum() == 0, f"drew masked tokens {torch.nonzero(counts * ~keep).flatten().tolist()}"
    expected = probs * tokens.numel()
    big = expected >= 5
    observed = torch.cat([counts[big], counts[~big].sum().unsqueeze(0)])
    wanted = torch.cat([expected[big], expected[~big].sum().unsqueeze(0)])
    if wanted[-1] < 5:  # fold a small pooled bin into the largest one
        observed, wanted = observed[:-1].clone(), wanted[:-1].clone()
        observed[wanted.argmax()] += counts[~big].sum()
        wanted[wanted.argmax()] += expected[~big].sum()
    keep_bins = wanted > 0
    statistic = float((((observed - wanted) ** 2)[keep_bins] / wanted[keep_bins]).sum())
    dof = max(1, int(keep_bins.sum()) - 1)
    assert statistic < _chi2_bound(dof), (statistic, dof)


ROW_SHAPES = {
    "peaked": lambda: torch.tensor([[3.0, 2.5, 2.5, 1.0, 0.5, 0.0, -1.0, -1.0, -2.0, -3.0, -4.0, -6.0]]),
    "flat": lambda: _grid_logits(1, 12, seed=31, scale=0.2),
    "ties": lambda: torch.tensor([[1.0, 1.0, 0.5, 0.5, 0.5, 0.0, 0.0, 0.0, 0.0, -0.5, -0.5, -1.0]]),
}


@pytest.mark.parametrize("shape", list(ROW_SHAPES))
@pytest.mark.parametrize("settings", FILTERS, ids=FILTER_IDS)
@METHODS
def test_draws_follow_the_exact_filtered_distribution(settings: dict, shape: str, method: str) -> None:
    row = ROW_SHAPES[shape]()
    keep, probs = _reference(row, **settings)
    draws = 6000
    torch.manual_seed(32)
    out = _sample(row.repeat(draws, 1), [SamplingParams(**settings)] * draws, method=method)
    _check_draws(out.sampled_token_ids, keep[0], probs[0])


@pytest.mark.parametrize(
    "settings",
    [
        {"temperature": 1.0, "top_p": 0.3},
        {"temperature": 1.0, "top_p": 0.1},
        {"temperature": 2.0, "min_p": 0.3, "top_p": 0.2},
    ],
    ids=["p=0.3", "p=0.1", "min_p+p=0.2"],
)
def test_rejection_fallback_is_exact(settings: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """With a single rejection round most flat rows fall through to the radix boundary and the
    last uniform: the draws still follow the nucleus exactly."""
    from pagedkv.sample import sampler as sampler_module

    monkeypatch.setattr(sampler_module, "_ROUNDS", 1)
    row = _grid_logits(1, 40, seed=33, scale=0.3)
    keep, probs = _reference(row, **settings)
    draws = 8000
    torch.manual_seed(34)
    out = _sample(row.repeat(draws, 1), [SamplingParams(**settings)] * draws, method="inverse_cdf")
    _check_draws(out.sampled_token_ids, keep[0], probs[0])


@pytest.mark.parametrize(
    "settings",
    [
        {"temperature": 1.0, "top_k": 300},
        {"temperature": 1.0, "top_k": 290, "top_p": 0.8},
        {"temperature": 0.5, "top_k": 257, "min_p": 0.01},
    ],
    ids=["k=300", "k=290+p", "k=257+min_p"],
)
@METHODS
def test_large_top_k_is_exact(settings: dict, method: str) -> None:
    """top_k above the topk-candidate limit (256): rejection / radix select on counts. A vocab of
    320 with many ties at the k-th value."""
    row = _grid_logits(1, 320, seed=35, scale=0.5)
    keep, probs = _reference(row, **settings)
    assert 256 < int(keep.sum()) < 320 or "top_p" in settings or "min_p" in settings
    draws = 20000
    torch.manual_seed(36)
    out = _sample(row.repeat(draws, 1), [SamplingParams(**settings)] * draws, method=method)
    _check_draws(out.sampled_token_ids, keep[0], probs[0])
    masked = apply_top_k_top_p(row / settings["temperature"], torch.tensor([settings["top_k"]]), None)
    k_only, _ = _reference(row, temperature=settings["temperature"], top_k=settings["top_k"])
    assert torch.equal(torch.isfinite(masked), k_only)


def test_flat_rows_at_full_vocab_keep_the_exact_nucleus() -> None:
    """The case that used to fall into a full sort: rows so flat that the top-p mass is spread
    over tens of thousands of tokens (SmolLM2's vocab, top_p=0.95), next to peaked rows."""
    vocab = 49152
    generator = torch.Generator().manual_seed(37)
    flat = torch.randn(6, vocab, generator=generator) * 0.05
    peaked = torch.randn(2, vocab, generator=generator) * 4.0
    logits = torch.cat([flat, peaked])
    top_p = torch.tensor([0.95, 0.95, 0.5, 0.99, 0.2, 0.95, 0.95, 0.9])
    masked = apply_top_k_top_p(logits.clone(), None, top_p)
    for row in range(8):
        expected, _ = _reference(logits[row : row + 1], top_p=float(top_p[row]))
        assert torch.equal(torch.isfinite(masked[row : row + 1]), expected), row
    kept = torch.isfinite(masked).sum(dim=-1)
    assert (kept[:2] > 40000).all() and (kept[6:] < 2000).all()
    # The sampler's draws (rejection + fallback) stay inside the nucleus.
    params = [SamplingParams(temperature=1.0, top_p=float(p)) for p in top_p]
    for method in ("inverse_cdf", "exponential"):
        torch.manual_seed(38)
        for _ in range(3):
            out = _sample(logits, params, method=method)
            assert torch.isfinite(masked.gather(1, out.sampled_token_ids[:, None])).all()


@pytest.mark.parametrize(
    "target",
    [
        SamplingParams(temperature=1.3, seed=1),
        SamplingParams(temperature=0.9, top_k=5, seed=2),
        SamplingParams(temperature=1.0, top_p=0.05, seed=3),
        SamplingParams(temperature=2.0, min_p=0.2, top_p=0.5, seed=4),
        SamplingParams(temperature=1.0, top_k=300, seed=5),
        SamplingParams(temperature=1.0, top_k=2, seed=6),
    ],
    ids=["temperature", "top_k", "tiny top_p", "min_p+top_p", "large top_k", "top_k with ties"],
)
@METHODS
def test_seeded_row_ignores_the_batch_for_every_path(target: SamplingParams, method: str) -> None:
    """Seeded rows through every path (candidates, tie fallback, rejection rounds, radix
    fallback, large-k rejection) draw the same tokens alone and inside mixed batches whose other
    rows (flat, peaked, greedy, seeded) are rejected a different number of times."""
    vocab = 400
    target_row = _grid_logits(1, vocab, seed=40, scale=0.3)
    target_row[0, :3] = 3.0  # ties at the top (top_k=2 has a tie past the candidates)
    others = _grid_logits(5, vocab, seed=41)
    others[1] *= 0.01  # flat: rejected often under small top_p
    other_params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_p=0.02),
        SamplingParams(temperature=0.7, top_k=3, seed=99),
        SamplingParams(temperature=1.0, min_p=0.3),
        SamplingParams(temperature=1.0, top_k=350, top_p=0.4),
    ]

    def draws(logits: torch.Tensor, params: list[SamplingParams], row: int, global_seed: int) -> list[int]:
        generators = [None if p.seed is None else make_generator(p.seed) for p in params]
        torch.manual_seed(global_seed)
        return [int(_sample(logits, params, generators, method=method).sampled_token_ids[row]) for _ in range(6)]

    alone = draws(target_row, [target], 0, 50)
    batch = torch.cat([others[:2], target_row, others[2:]])
    assert draws(batch, other_params[:2] + [target] + other_params[2:], 2, 51) == alone
    reordered = torch.cat([others.flip(0), target_row])
    assert draws(reordered, other_params[::-1] + [target], 5, 52) == alone


@METHODS
def test_seeded_draw_depends_only_on_how_many_tokens_were_sampled(method: str) -> None:
    """A request's generator advances by the same amount whatever its previous rows looked like
    (rejected many times or not): after one step on different logits, two rows with the same
    seed draw the same second token."""
    flat = torch.zeros(1, 300)
    peaked = torch.arange(300, dtype=torch.float32).unsqueeze(0)
    second = _grid_logits(1, 300, seed=42)
    first_params = SamplingParams(temperature=1.0, top_p=0.01, seed=7)
    second_params = SamplingParams(temperature=1.0, seed=7)
    tokens = []
    for first in (flat, peaked):
        generators = [make_generator(7)]
        _sample(first, [first_params], generators, method=method)
        tokens.append(int(_sample(second, [second_params], generators, method=method).sampled_token_ids[0]))
    assert tokens[0] == tokens[1]


@METHODS
def test_banned_max_token_on_a_sharp_row(method: str) -> None:
    """The max used to normalize the weights excludes banned tokens: a banned token far above
    the rest must not underflow every other weight to zero."""
    logits = torch.full((2, 50), -40.0)
    logits[:, 7] = 200.0
    logits[:, 3] = -4.0  # all the unbanned mass, up to e^-72
    torch.manual_seed(43)
    params = [SamplingParams(temperature=0.5), SamplingParams(temperature=0.5, top_p=0.5)]
    for _ in range(5):
        out = _sample(logits, params, banned={0: [7], 1: [7]}, method=method)
        assert out.sampled_token_ids.tolist() == [3, 3]


def test_workspace_is_not_shared_between_threads() -> None:
    """Concurrent calls on one Sampler (AsyncLLM runs steps on a thread) give each call its own
    scratch buffers."""
    import threading

    sampler = Sampler("inverse_cdf")
    logits = _logits(16, vocab=3000, seed=44)
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=i) for i in range(16)]
    expected = sampler(
        logits, SamplingMetadata.build(params, vocab_size=3000, generators=[make_generator(i) for i in range(16)])
    )
    results: list[torch.Tensor] = []

    def work() -> None:
        for _ in range(5):
            md = SamplingMetadata.build(params, vocab_size=3000, generators=[make_generator(i) for i in range(16)])
            results.append(sampler(logits, md).sampled_token_ids)

    threads = [threading.Thread(target=work) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 15
    assert all(torch.equal(r, expected.sampled_token_ids) for r in results)


@pytest.mark.parametrize("by_mass", [True, False], ids=["mass (top-p)", "count (top-k)"])
def test_radix_threshold_equals_sorted_boundary(by_mass: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The radix select finds the same boundary value as a sort, over several row blocks, with
    ties, zero (masked) weights, tiny and denormal weights and the weight 1 of the row max."""
    from pagedkv.sample import ops

    monkeypatch.setattr(ops, "_RADIX_BLOCK_ELEMS", 3 * 500)  # blocks of 3 rows
    generator = torch.Generator().manual_seed(45)
    rows, vocab = 10, 500
    logits = torch.randint(-40, 1, (rows, vocab), generator=generator).float() * 0.5  # ties
    logits[0] = torch.randn(vocab, generator=generator) * 0.01  # flat
    logits[1, ::3] = float("-inf")  # zeros
    logits[2, :5] = -103.0  # denormal weights
    weights = (logits - logits.amax(dim=-1, keepdim=True)).exp()
    values = (
        torch.rand(rows, generator=generator) * 0.98 + 0.01
        if by_mass
        else torch.randint(1, vocab, (rows,), generator=generator).float()
    )
    values[3] = 1.0 if by_mass else float(vocab)
    workspace = ops.Workspace()
    index = torch.tensor([9, 0, 1, 2, 3, 4, 5, 6, 7, 8])
    threshold = ops.radix_threshold(weights, index, values[index], by_mass=by_mass, workspace=workspace)
    for j, row in enumerate(index.tolist()):
        ordered = weights[row].double().sort(descending=True).values
        if by_mass:
            before = ordered.cumsum(0) - ordered
            expected = ordered[before < float(values[row]) * ordered.sum()].min()
        else:
            expected = ordered[int(values[row]) - 1]
        assert float(threshold[j]) == float(expected), (row, float(threshold[j]), float(expected))


@pytest.mark.parametrize("vocab", [1000, 4096, 5003])
@pytest.mark.parametrize("k", [1, 5, 17, 51, 120])
def test_chunked_topk_equals_torch_topk(vocab: int, k: int) -> None:
    """Same values as torch.topk (ties included: a 1/4 grid), distinct valid indices, also with a
    short last chunk and rows where the top values crowd into one chunk."""
    from pagedkv.sample import ops

    logits = torch.cat(
        [_grid_logits(6, vocab, seed=46), torch.randn(2, vocab, generator=torch.Generator().manual_seed(47))]
    )
    logits[6, 64:200] = 100.0 + torch.arange(136, dtype=torch.float32)  # the top values in few chunks
    logits[7, -3:] = 50.0  # ... and in the tail
    values, indices = ops.topk(logits, k)
    assert torch.equal(values, logits.topk(k, dim=-1).values)
    assert torch.equal(logits.gather(1, indices), values)
    assert all(len(set(row)) == k for row in indices.tolist())


def test_row_decisions_round_the_same_alone_and_in_a_batch() -> None:
    """The sums behind the rejection test (and the draw's chunk sums) of one row are bitwise the
    same alone and inside batches of any size: a lone row's plain ``sum(-1)`` is split across
    threads and rounds differently, which could flip a near-boundary accept for a seeded row."""
    from pagedkv.sample import ops

    vocab = 49152
    generator = torch.Generator().manual_seed(48)
    for _ in range(6):  # a plain sum(-1) differs for about half of such rows
        row = (torch.randn(1, vocab, generator=generator) * 0.3).exp()
        token_weight = row[:, 11:12].clone()
        alone = ops.mass_and_count_above(row, token_weight, torch.empty_like(row))
        alone_sums = ops.chunk_sums(row)
        for batch, position in ((2, 1), (7, 3), (16, 15)):
            rows = (torch.randn(batch, vocab, generator=generator) * 0.3).exp()
            rows[position] = row[0]
            weights = torch.rand(batch, 1, generator=generator)
            weights[position] = token_weight[0]
            mass, count = ops.mass_and_count_above(rows, weights, torch.empty_like(rows))
            assert mass[position] == alone[0][0] and count[position] == alone[1][0]
            assert torch.equal(ops.chunk_sums(rows)[position], alone_sums[0])
