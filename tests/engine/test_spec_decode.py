"""Speculative decoding (n-gram drafts verified in the step; docs/engine.md,
"Speculative decoding").

- Greedy outputs with speculation equal those without, token for token, on a tiny random model
  (whose greedy output loops, so drafts are found and mostly accepted) and on SmolLM2: alone,
  under preemption by recompute and by swap, chunked prefill, prefix hits, ``n > 1``, int8 KV,
  penalties (each draft position sampled with its own context), stop strings and logprobs,
  a failed step rolled back with drafts in flight. Tensor parallelism: tests/distributed/test_tensor_parallel.py.
- Exactness of sampling: the real Rust scheduler and the real sampler on a toy model with 4
  tokens (a random logits table): the distribution of the first three output tokens matches the
  target's exact distribution (chi-square, fixed seeds; the same test rejects a slightly
  different distribution), and the drafts accepted at each position match the analytic
  ``sum(p(draft))`` (a point-mass draft's ``sum(min(p, q))``).
- Seeded sampling gives the same tokens with speculation as without.
- Bad configurations fail with ConfigError before anything loads.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from scipy.stats import chi2

from pagedkv import LLM, EngineArgs, LLMEngine, SamplingParams
from pagedkv._core import Scheduler, SchedulerConfig
from pagedkv.errors import ConfigError
from pagedkv.sample.sampler import Sampler, SamplingMetadata
from pagedkv.worker.model_files import default_model_dir

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
# Not adaptive: the drafts do not depend on measured step times, so every count is reproducible.
FIXED = {**NGRAM, "adaptive": False}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 6, "suffix_decoding_max_spec_factor": 2.0, "adaptive": False}
PROMPTS = [
    "one two three one two three one two",
    "def f(x):\n    return x + 1\n\ndef g(x):\n    return",
    "The capital of France is Paris. The capital of Italy is Rome. The capital of",
    "a b c d e f g a b c d",
    "Paged attention stores keys and values in blocks, so that",
]


def tiny_args(tiny_model: str, **kw: Any) -> dict[str, Any]:
    args = dict(model=tiny_model, tokenizer=str(default_model_dir()), dtype="float32", device="cpu")
    pool = {} if "num_blocks" in kw else {"kv_cache_memory": 32 << 20}
    return args | {"max_model_len": 512} | pool | kw


def run(engine: LLMEngine, prompts: list[str], params: SamplingParams | list[SamplingParams]) -> list[Any]:
    plist = params if isinstance(params, list) else [params] * len(prompts)
    for i, (p, sp) in enumerate(zip(prompts, plist)):
        engine.add_request(f"r{i}", p, sp)
    done: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
    engine.scheduler.check_invariants()
    st = engine.get_stats()
    assert st["num_free_blocks"] == st["num_blocks"], "every block is back"
    return [done[f"r{i}"] for i in range(len(prompts))]


def tokens(outs: list[Any]) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outs]


GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize(
    "engine_kw, params",
    [
        pytest.param({}, GREEDY, id="plain"),
        pytest.param({"num_blocks": 14, "block_size": 16, "max_model_len": 160}, GREEDY, id="preempt-recompute"),
        pytest.param(
            {
                "num_blocks": 14,
                "block_size": 16,
                "max_model_len": 160,
                "num_host_blocks": 32,
                "preemption_mode": "swap",
            },
            GREEDY,
            id="preempt-swap",
        ),
        pytest.param({"max_num_batched_tokens": 24, "max_num_seqs": 4}, GREEDY, id="chunked-prefill"),
        pytest.param({"kv_cache_dtype": "int8"}, GREEDY, id="int8-kv"),
        pytest.param(
            {},
            SamplingParams(
                max_tokens=30, temperature=0.0, ignore_eos=True, repetition_penalty=1.3, presence_penalty=0.4
            ),
            id="penalties",
        ),
        pytest.param({}, SamplingParams(max_tokens=30, n=3, temperature=0.9, seed=5, ignore_eos=True), id="n3-seeded"),
        pytest.param(
            {},
            SamplingParams(max_tokens=30, temperature=0.8, top_k=20, top_p=0.9, seed=11, ignore_eos=True),
            id="seeded",
        ),
        pytest.param({"speculative_config": SUFFIX}, GREEDY, id="suffix"),
        pytest.param(
            {"speculative_config": SUFFIX, "num_blocks": 14, "block_size": 16, "max_model_len": 160},
            GREEDY,
            id="suffix-preempt",
        ),
        pytest.param(
            {"speculative_config": SUFFIX}, SamplingParams(max_tokens=30, n=2, temperature=1.0, seed=3), id="suffix-n2"
        ),
        pytest.param(
            {
                "speculative_config": SUFFIX,
                "num_blocks": 14,
                "block_size": 16,
                "max_model_len": 160,
                "num_host_blocks": 32,
                "preemption_mode": "swap",
                "kv_cache_dtype": "fp8_e4m3",
            },
            GREEDY,
            id="suffix-swap-fp8",
        ),
        pytest.param(
            {"speculative_config": SUFFIX, "max_num_batched_tokens": 24, "max_num_seqs": 4, "kv_cache_dtype": "int8"},
            GREEDY,
            id="suffix-chunked-int8",
        ),
    ],
)
def test_speculation_changes_no_token(tiny_model: str, engine_kw: dict, params: SamplingParams) -> None:
    engine_kw = dict(engine_kw)
    spec_config = engine_kw.pop("speculative_config", FIXED)
    prompts = PROMPTS + [PROMPTS[2] + " Spain is"]  # a prefix hit on the third prompt's first block
    plain = run(LLMEngine(**tiny_args(tiny_model, **engine_kw)), prompts, params)
    engine = LLMEngine(**tiny_args(tiny_model, **engine_kw, speculative_config=spec_config))
    spec = run(engine, prompts, params)
    assert tokens(spec) == tokens(plain)
    st = engine.get_stats()
    assert st["num_spec_draft_tokens"] > 50, "drafts were verified"
    assert 0 < st["num_spec_accepted_tokens"] <= st["num_spec_draft_tokens"]
    assert sum(o.metrics.num_accepted_tokens for o in spec) == st["num_spec_accepted_tokens"]
    assert sum(o.metrics.num_draft_tokens for o in spec) == st["num_spec_draft_tokens"]
    assert sum(st["spec_accepted_per_position"]) == st["num_spec_accepted_tokens"]
    if "num_blocks" in engine_kw:
        assert st["num_preemptions"] > 0
    if engine_kw == {}:
        assert st["prefix_cache_hits"] > 0
    if spec_config is SUFFIX:  # a second round matches the first round's outputs too
        again = run(engine, prompts, params)
        assert tokens(again) == tokens(plain)


def test_fewer_steps_and_a_failed_step_with_drafts_in_flight(tiny_model: str) -> None:
    plain_engine = LLMEngine(**tiny_args(tiny_model))
    plain = run(plain_engine, PROMPTS, GREEDY)
    engine = LLMEngine(**tiny_args(tiny_model, speculative_config=FIXED))
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", p, GREEDY)
    inner = engine.runner.execute
    calls = {"n": 0}

    def failing(step: Any, *a: Any) -> Any:
        calls["n"] += 1
        result = inner(step, *a)
        if calls["n"] in (3, 6):  # after the KV writes of a step with drafts
            raise RuntimeError("injected")
        return result

    engine.runner.execute = failing  # type: ignore[method-assign]
    done: dict[str, Any] = {}
    failures = 0
    while engine.has_unfinished_requests():
        try:
            outs = engine.step()
        except RuntimeError:
            failures += 1
            engine.scheduler.check_invariants()
            continue
        done.update({o.request_id: o for o in outs if o.finished})
    assert failures == 2
    assert [done[f"r{i}"].outputs[0].token_ids for i in range(len(PROMPTS))] == [o.outputs[0].token_ids for o in plain]
    assert engine.get_stats()["steps"] < plain_engine.get_stats()["steps"], "accepted drafts save steps"


SMOL = dict(dtype="float32", device="cpu", max_model_len=1024, kv_cache_memory=48 << 20)
CODE = (
    "def area(width, height):\n    return width * height\n\n"
    "def perimeter(width, height):\n    return 2 * (width + height)\n"
)


@pytest.fixture(scope="module")
def smol_pair() -> tuple[LLM, LLM]:
    return LLM(**SMOL), LLM(**SMOL, speculative_config=FIXED)


def test_smollm2_copy_with_stop_strings_and_logprobs(smol_pair: tuple[LLM, LLM]) -> None:
    plain, spec = smol_pair
    messages = [[{"role": "user", "content": "Copy this code exactly, then stop:\n\n" + CODE}]]
    params = [
        SamplingParams(max_tokens=60, temperature=0.0, logprobs=2),
        SamplingParams(max_tokens=60, temperature=0.0, stop=["perimeter"], logprobs=1),
    ]
    for p in params:
        a, b = plain.chat(messages, p, use_tqdm=False)[0], spec.chat(messages, p, use_tqdm=False)[0]
        x, y = a.outputs[0], b.outputs[0]
        assert (y.text, y.token_ids, y.finish_reason, y.stop_reason) == (
            x.text,
            x.token_ids,
            x.finish_reason,
            x.stop_reason,
        )
        assert x.logprobs is not None and y.logprobs is not None and len(x.logprobs) == len(y.logprobs)
        for ex, ey in zip(x.logprobs, y.logprobs):
            assert ex.keys() == ey.keys()
            for t in ex:
                assert abs(ex[t].logprob - ey[t].logprob) < 1e-3 and ex[t].rank == ey[t].rank
        assert b.metrics.num_draft_tokens > 0 and b.metrics.num_accepted_tokens > 0
    assert "perimeter" not in y.text and y.finish_reason == "stop"


def test_structured_and_beam_requests_do_not_draft(smol_pair: tuple[LLM, LLM]) -> None:
    from pagedkv import BeamSearchParams, StructuredOutputsParams

    plain, spec = smol_pair
    choice = SamplingParams(
        max_tokens=8, temperature=0.0, structured_outputs=StructuredOutputsParams(choice=["yes", "no"])
    )
    out = spec.generate(["Is the sky blue? Answer:"], choice, use_tqdm=False)[0]
    assert out.outputs[0].text in ("yes", "no") and out.metrics.num_draft_tokens == 0
    beam = BeamSearchParams(beam_width=2, max_tokens=6)
    a = plain.beam_search([{"prompt": "The capital of France is"}], beam)[0]
    b = spec.beam_search([{"prompt": "The capital of France is"}], beam)[0]
    assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]


# ---------------------------------------------------------------- draft model


def test_draft_model_drafts_verified_exactly(tiny_model: str, tmp_path: Any) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    # Another random model (untied, unscaled: its greedy tokens have nothing to do with the
    # target's), with the target's vocabulary.
    torch.manual_seed(1)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    LlamaForCausalLM(config).save_pretrained(tmp_path / "other-draft")
    other = str(tmp_path / "other-draft")
    plain = run(LLMEngine(**tiny_args(tiny_model)), PROMPTS, GREEDY)
    # A small target pool: the target preempts (by recompute, then by swap, with chunked prefill)
    # with drafts handed in for its samples.
    small = {"num_blocks": 12, "block_size": 16, "max_model_len": 128}
    swap = {**small, "num_host_blocks": 32, "preemption_mode": "swap", "max_num_batched_tokens": 24}
    for draft, good, pool in ((tiny_model, True, small), (other, False, small), (tiny_model, True, swap)):
        spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 4, "adaptive": False}
        engine = LLMEngine(**tiny_args(tiny_model, **pool, speculative_config=spec))
        outs = run(engine, PROMPTS, GREEDY)
        assert tokens(outs) == tokens(plain)
        st = engine.get_stats()
        assert st["num_spec_draft_tokens"] > 50 and st["num_preemptions"] > 0
        rate = st["num_spec_accepted_tokens"] / st["num_spec_draft_tokens"]
        # The target as its own draft: its drafts are the target's own greedy tokens.
        assert rate > 0.9 if good else rate < 0.5, (draft, rate)
        drafter = engine._drafter
        assert drafter is not None and drafter.num_steps > 0
        drafter.scheduler.check_invariants()
        assert not drafter.scheduler.has_unfinished_requests()


def test_a_draft_model_with_another_vocabulary_is_refused_before_loading(
    tiny_model: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=1000,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    Qwen2ForCausalLM(config).save_pretrained(tmp_path / "small-vocab")

    def no_loading(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a model was loaded before the vocabulary check")

    monkeypatch.setattr("pagedkv.engine.startup.ModelRunner", no_loading)
    spec = {"method": "draft_model", "model": str(tmp_path / "small-vocab"), "num_speculative_tokens": 3}
    with pytest.raises(ConfigError, match="vocabulary"):
        LLMEngine(**tiny_args(tiny_model, speculative_config=spec))


# ---------------------------------------------------------------- exactness on a toy model

V = 4
TOY_PROMPT = [0, 1, 2, 3, 0, 2, 1, 3, 0, 1]


class ToyModel:
    """Next-token logits from a random table over the last two tokens (V = 4)."""

    def __init__(self, seed: int) -> None:
        self.table = np.random.default_rng(seed).normal(0.0, 1.2, size=(V, V, V))

    def logits(self, ctx: list[int]) -> np.ndarray:
        return self.table[ctx[-2], ctx[-1]]

    def probs(self, ctx: list[int], params: SamplingParams) -> np.ndarray:
        z = self.logits(ctx) / params.temperature
        p = np.exp(z - z.max())
        if 0 < params.top_k < V:
            p[p < np.sort(p)[-params.top_k]] = 0.0
        return p / p.sum()


Drafter = Callable[[list[int]], list[int]]


def sample_toy(
    model: ToyModel, params: SamplingParams, num: int, speculate: bool, seed: int, drafter: Drafter | None = None
) -> tuple[list, Any]:
    """``num`` requests of 4 tokens after TOY_PROMPT through the real scheduler and sampler,
    with n-gram drafts, or with ``drafter(context)``'s drafts handed in (method draft_model).
    Returns each request's first 3 tokens and, per drafted row group, (context, drafts)."""
    spec: dict[str, Any] = dict(num_speculative_tokens=3, speculative_adaptive=False)
    if drafter is None:
        spec |= dict(prompt_lookup_min=1, prompt_lookup_max=2)
    else:
        spec |= dict(speculative_method="draft_model")
    sched = Scheduler(
        SchedulerConfig(
            num_blocks=4096, block_size=4, max_num_seqs=256, max_num_batched_tokens=4096, **(spec if speculate else {})
        )
    )
    for i in range(num):
        sched.add_request(f"q{i}", TOY_PROMPT, max_tokens=4)
    torch.manual_seed(seed)
    sampler = Sampler(method="inverse_cdf")
    outputs: dict[str, list[int]] = {f"q{i}": [] for i in range(num)}
    groups: list[tuple[list[int], list[int]]] = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        rows = []
        for s, rid in enumerate(out.sampled_req_ids):
            j, at = int(out.draft_offsets[s]), int(out.logits_indices[s])
            drafts = out.input_ids[at - j + 1 : at + 1].tolist()
            ctx = TOY_PROMPT + outputs[rid] + drafts
            rows.append(model.logits(ctx))
            nxt = s + 1 < len(out.sampled_req_ids) and int(out.draft_offsets[s + 1]) > 0
            if j == 0 and nxt:
                n = 1
                while s + n < len(out.draft_offsets) and int(out.draft_offsets[s + n]) == n:
                    n += 1
                groups.append((TOY_PROMPT + outputs[rid], out.input_ids[at + 1 : at + n].tolist()))
        logits = torch.tensor(np.array(rows), dtype=torch.float32)
        md = SamplingMetadata.build([params] * len(rows), vocab_size=V)
        sampled = sampler(logits, md).sampled_token_ids
        for u in sched.update(out, sampled.tolist()):
            outputs[u.request_id].append(u.new_token_ids[0])
        if drafter is not None:
            for rid, o in outputs.items():
                if 0 < len(o) < 4:
                    ctx = TOY_PROMPT + o
                    sched.set_drafts(rid, 0, len(ctx), drafter(ctx))
    assert all(len(o) == 4 for o in outputs.values())
    return [tuple(o[:3]) for o in outputs.values()], (groups, sched)


def exact_distribution(model: ToyModel, params: SamplingParams) -> dict[tuple[int, ...], float]:
    dist = {}
    p1 = model.probs(TOY_PROMPT, params)
    for a in range(V):
        p2 = model.probs(TOY_PROMPT + [a], params)
        for b in range(V):
            p3 = model.probs(TOY_PROMPT + [a, b], params)
            for c in range(V):
                dist[(a, b, c)] = p1[a] * p2[b] * p3[c]
    return dist


def assert_acceptance_per_position(
    model: ToyModel, params: SamplingParams, groups: list[tuple[list[int], list[int]]], measured: list[int]
) -> None:
    """The drafts accepted at positions 1 and 2 against the analytic expectation: the sum over
    drafted rows of the probability that drafts 1 .. j are all what the target samples, within
    4 sigma (+1)."""
    for j in range(2):
        probs = []
        for ctx, drafts in groups:
            if len(drafts) > j:
                p = 1.0
                for i in range(j + 1):
                    p *= model.probs(ctx + drafts[:i], params)[drafts[i]]
                probs.append(p)
        expected, sigma = sum(probs), math.sqrt(sum(p * (1 - p) for p in probs))
        assert abs(measured[j] - expected) < 4 * sigma + 1, (j, measured[j], expected, sigma)


def chi_square_p(samples: list[tuple[int, ...]], dist: dict[tuple[int, ...], float]) -> float:
    n = len(samples)
    counts: dict[tuple[int, ...], int] = {}
    for s in samples:
        counts[s] = counts.get(s, 0) + 1
    # Outcomes expected fewer than 5 times are pooled into one bin (the usual validity rule).
    small = [k for k, p in dist.items() if p * n < 5]
    stat, bins = 0.0, 0
    for k, p in dist.items():
        if k in small:
            continue
        stat += (counts.get(k, 0) - n * p) ** 2 / (n * p)
        bins += 1
    if small:
        e = n * sum(dist[k] for k in small)
        if e > 0:
            stat += (sum(counts.get(k, 0) for k in small) - e) ** 2 / e
            bins += 1
    return float(chi2.sf(stat, bins - 1))


@pytest.mark.parametrize(
    "params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=3)], ids=["t1", "t0.7-topk3"]
)
def test_rejection_sampling_is_exact_on_a_toy_model(params: SamplingParams) -> None:
    model = ToyModel(seed=3)
    num = 4000
    samples, (groups, sched) = sample_toy(model, params, num, speculate=True, seed=1)
    dist = exact_distribution(model, params)
    assert chi_square_p(samples, dist) > 1e-4
    # The same test tells a slightly different distribution apart (it has power here).
    other = exact_distribution(model, SamplingParams(temperature=params.temperature * 1.15, top_k=params.top_k))
    assert chi_square_p(samples, other) < 1e-4
    # Accepted drafts per position against the analytic expectation sum(p(d_1..d_j)).
    assert len(groups) > num // 2
    measured = sched.spec_accepted_per_position()
    assert_acceptance_per_position(model, params, groups, measured)
    plain, _ = sample_toy(model, params, num, speculate=False, seed=2)
    assert chi_square_p(plain, dist) > 1e-4


def greedy_drafter(model: ToyModel) -> Drafter:
    """Drafts the greedy continuation of ``model`` (a point mass at its argmax, as a greedy
    draft model drafts)."""

    def draft(ctx: list[int]) -> list[int]:
        out: list[int] = []
        for _ in range(3):
            out.append(int(np.argmax(model.logits(ctx + out))))
        return out

    return draft


@pytest.mark.parametrize("draft_kind", ["random", "target", "perturbed"])
def test_handed_in_drafts_are_verified_exactly(draft_kind: str) -> None:
    """Drafts handed in (method draft_model): random tokens, the target's own greedy tokens, and
    a perturbed target's greedy tokens. The first three tokens keep the target's exact
    distribution, and each position's acceptance is the analytic sum(p(draft))."""
    model, params, num = ToyModel(seed=3), SamplingParams(temperature=1.0), 3000
    rng = np.random.default_rng(7)
    perturbed = ToyModel(seed=3)
    perturbed.table = perturbed.table + np.random.default_rng(11).normal(0.0, 0.8, size=perturbed.table.shape)
    drafter: Drafter = {
        "random": lambda ctx: rng.integers(0, V, size=3).tolist(),
        "target": greedy_drafter(model),
        "perturbed": greedy_drafter(perturbed),
    }[draft_kind]
    samples, (groups, sched) = sample_toy(model, params, num, speculate=True, seed=4, drafter=drafter)
    assert chi_square_p(samples, exact_distribution(model, params)) > 1e-4
    measured = sched.spec_accepted_per_position()
    assert len(groups) > num // 2
    assert_acceptance_per_position(model, params, groups, measured)


# ---------------------------------------------------------------- configuration


@pytest.mark.parametrize(
    "config, match",
    [
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 17}, "num_speculative_tokens"),
        ({"method": "ngram"}, "num_speculative_tokens is required"),
        ({"method": "eagle", "num_speculative_tokens": 2}, "method 'eagle' is not supported"),
        ({"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "must not exceed"),
        ({"num_speculative_tokens": 2, "draft_tensor_parallel_size": 1}, "unknown speculative_config key"),
        ('{"num_speculative_tokens": 2,', "not valid JSON"),
    ],
)
def test_bad_configs_fail_before_anything_loads(config: Any, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        EngineArgs(model="/nonexistent/model", speculative_config=config)


def test_config_from_json_and_defaults() -> None:
    args = EngineArgs(model="/nonexistent/model", speculative_config='{"num_speculative_tokens": 3}')
    spec = args.create_engine_config().speculative
    assert spec is not None and (spec.method, spec.prompt_lookup_min, spec.prompt_lookup_max) == ("ngram", 2, 5)
    assert EngineArgs(model="/nonexistent/model").create_engine_config().speculative is None
