"""Penalties, logit_bias, allowed_token_ids, bad_words and prompt logprobs in the engine, against
transformers' own forward on the same weights (a tiny random model: the property is the
arithmetic, not the text), with chunked prefill, a warm prefix cache, ``n > 1`` forks and
preemption in the way."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedkv import LLM, SamplingParams
from pagedkv.errors import ConfigError, InvalidArgumentError
from pagedkv.worker.model_files import default_model_dir

PROMPTS = [
    "The capital of France is Paris. The capital of Germany is Berlin. Rome is the capital of",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
]


@pytest.fixture(scope="module")
def soft_model(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny model with logits 20 times smaller (top logits ~5 instead of ~100): penalties of
    OpenAI's range (|f| <= 2) then change which token wins."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    with torch.no_grad():
        model.get_input_embeddings().weight.div_(20.0)
    folder = tmp_path_factory.mktemp("soft-qwen2")
    model.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def llm(soft_model: str) -> LLM:
    # An 8-token budget: every prompt is prefilled in several chunks.
    return engine_on(soft_model, max_model_len=256, num_blocks=64, max_num_batched_tokens=8, max_num_seqs=8)


def engine_on(model: str, **engine_args: object) -> LLM:
    """An LLM on ``model`` (float32, 8-token blocks) with the embedded tokenizer."""
    return LLM(model=model, tokenizer=str(default_model_dir()), dtype="float32", block_size=8, **engine_args)


@pytest.fixture(scope="module")
def hf(soft_model: str) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(soft_model, dtype=torch.float32).eval()


def hf_logits(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()  # [L, V]


def penalized(logits: torch.Tensor, prompt: list[int], output: list[int], p: SamplingParams) -> torch.Tensor:
    """vLLM's definitions, written densely (the engine's sparse version must agree)."""
    x = logits.clone()
    for token, bias in (p.logit_bias or {}).items():
        x[token] += bias
    counts = torch.zeros_like(x)
    for token in output:
        counts[token] += 1
    seen = counts > 0
    seen[prompt] = True
    x = torch.where(seen & (x > 0), x / p.repetition_penalty, torch.where(seen, x * p.repetition_penalty, x))
    x -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
    if p.allowed_token_ids is not None:
        mask = torch.full_like(x, float("-inf"))
        mask[p.allowed_token_ids] = 0
        x += mask
    return x


def reference_greedy(hf: torch.nn.Module, prompt: list[int], p: SamplingParams, max_tokens: int) -> list[int]:
    output: list[int] = []
    for _ in range(max_tokens):
        logits = hf_logits(hf, prompt + output)[-1]
        output.append(int(penalized(logits, prompt, output, p).argmax()))
    return output


def pool_is_whole(llm: LLM) -> bool:
    st = llm.llm_engine.get_stats()
    return st["num_free_blocks"] == st["num_blocks"] and st["num_running"] == 0


PENALTIES = [
    {"repetition_penalty": 3.0},
    {"frequency_penalty": 2.0, "presence_penalty": -0.5},
    {"presence_penalty": 2.0, "repetition_penalty": 0.8, "logit_bias": {13: 5.0, 30: -100.0}},
]


@pytest.mark.parametrize("kw", PENALTIES, ids=["repetition", "frequency+presence", "all+bias"])
def test_greedy_with_penalties_equals_the_dense_reference(llm: LLM, hf: torch.nn.Module, kw: dict) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, n=2, **kw)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for out in outs:
        expected = reference_greedy(hf, out.prompt_token_ids, params, 12)
        # Both greedy samples of the fork keep their own counts (and agree here).
        assert [c.token_ids for c in out.outputs] == [expected, expected]
    plain = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert plain[0].outputs[0].token_ids != outs[0].outputs[0].token_ids, "the penalties changed nothing"
    assert pool_is_whole(llm)


def test_penalties_logprobs_stay_the_models_raw_ones(llm: LLM, hf: torch.nn.Module) -> None:
    out = llm.generate(
        PROMPTS[:1],
        SamplingParams(max_tokens=3, temperature=0.0, logprobs=0, frequency_penalty=2.0, logit_bias={13: 100.0}),
        use_tqdm=False,
    )[0]
    sample = out.outputs[0]
    assert sample.token_ids[0] == 13  # the bias decides
    raw = torch.log_softmax(hf_logits(hf, out.prompt_token_ids)[-1], dim=-1)
    assert sample.logprobs is not None
    assert sample.logprobs[0][13].logprob == pytest.approx(float(raw[13]), abs=1e-4)


def test_allowed_token_ids_and_bad_words(llm: LLM) -> None:
    tokenizer = llm.get_tokenizer()
    allowed = [11, 198, 500, 2000]
    out = llm.generate(PROMPTS, SamplingParams(max_tokens=10, temperature=1.0, seed=3, allowed_token_ids=allowed))
    assert all(t in allowed for o in out for t in o.outputs[0].token_ids)
    # The word greedy decoding produces first is never produced once it is a bad word.
    plain = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True), use_tqdm=False)
    first = plain[0].outputs[0].token_ids[0]
    word = tokenizer.decode([first])
    banned = llm.generate(
        PROMPTS[:1], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, bad_words=[word]), use_tqdm=False
    )
    assert first not in banned[0].outputs[0].token_ids
    assert pool_is_whole(llm)


def test_prompt_logprobs_match_transformers_through_chunks_and_a_warm_cache(llm: LLM, hf: torch.nn.Module) -> None:
    # The first run caches the prompts' blocks; prompt logprobs must not start on those hits.
    llm.generate(PROMPTS, SamplingParams(max_tokens=1), use_tqdm=False)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3, n=2), use_tqdm=False)
    for out in outs:
        ids = out.prompt_token_ids
        assert out.num_cached_tokens == 0
        entries = out.prompt_logprobs
        assert entries is not None and len(entries) == len(ids) and entries[0] is None
        reference = torch.log_softmax(hf_logits(hf, ids), dim=-1)
        for j in range(1, len(ids)):
            entry = entries[j]
            assert entry is not None
            expected = reference[j - 1]
            assert entry[ids[j]].logprob == pytest.approx(float(expected[ids[j]]), abs=1e-4)
            # The rank counts the tokens more likely than the prompt's (ties within float noise
            # of the two forwards may fall either way).
            target = float(expected[ids[j]])
            rank = entry[ids[j]].rank
            assert rank is not None
            assert int((expected > target + 1e-4).sum()) + 1 <= rank <= int((expected > target - 1e-4).sum()) + 1
            top = expected.topk(3).indices.tolist()
            assert set(top) <= set(entry) and len(entry) <= 4
            assert [entry[t].rank for t in top] == [1, 2, 3]
            assert entry[ids[j]].decoded_token == llm.get_tokenizer().decode([ids[j]])
    assert pool_is_whole(llm)


def test_prompt_logprobs_survive_recompute_preemption(soft_model: str, hf: torch.nn.Module) -> None:
    # A pool of 12 blocks of 8 for four 40-token prompts: requests are preempted (recomputed)
    # while prompts are prefilled; their entries are recorded once, in order.
    small = engine_on(
        soft_model, max_model_len=64, num_blocks=12, max_num_batched_tokens=16, preemption_mode="recompute"
    )
    prompts = [[100 + 7 * i + j for j in range(40)] for i in range(4)]
    outs = small.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, prompt_logprobs=0),
        use_tqdm=False,
    )
    assert small.llm_engine.get_stats()["num_preemptions"] > 0
    for out, ids in zip(outs, prompts):
        reference = torch.log_softmax(hf_logits(hf, ids), dim=-1)
        entries = out.prompt_logprobs
        assert entries is not None and len(entries) == len(ids)
        got = [entries[j][ids[j]].logprob for j in range(1, len(ids))]  # type: ignore[index]
        want = [float(reference[j - 1, ids[j]]) for j in range(1, len(ids))]
        assert got == pytest.approx(want, abs=1e-4)


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"logit_bias": {"a": 1.0}}, "logit_bias"),
        ({"logit_bias": {5: float("nan")}}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"bad_words": [""]}, "bad_words"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ],
)
def test_bad_values_are_refused_naming_the_field(kw: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        SamplingParams(**kw)


def test_logit_bias_is_clamped_to_openais_range() -> None:
    assert SamplingParams(logit_bias={1: 500, 2: -1e9}).logit_bias == {1: 100.0, 2: -100.0}


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"logit_bias": {49152: 1.0}}, "logit_bias"),
        ({"allowed_token_ids": [3, 10**6]}, "allowed_token_ids"),
        ({"prompt_logprobs": 10**6}, "prompt_logprobs"),
    ],
)
def test_the_engine_checks_ids_and_limits_before_anything_runs(llm: LLM, kw: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        llm.llm_engine.add_request("bad", "hello", SamplingParams(**kw))
    assert not llm.llm_engine.has_unfinished_requests()


def test_prompt_logprobs_refuse_a_remote_prefill_without_a_connector(llm: LLM) -> None:
    with pytest.raises((InvalidArgumentError, ConfigError)):
        llm.llm_engine.add_request(
            "remote",
            "hello",
            SamplingParams(prompt_logprobs=1),
            kv_transfer_params={"do_remote_prefill": True, "remote_engine_id": "x"},
        )


def test_per_step_structures_are_built_once_per_params(llm: LLM) -> None:
    # prepare_params: the ids checked against the vocabulary, the allowed mask and the bad
    # words' tokens built once; every request sharing the params shares them.
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=2, allowed_token_ids=[11, 198, 500], bad_words=["hello"], logit_bias={11: 1.0})
    prepared = engine.prepare_params(params)
    assert prepared.bad_word_ids and prepared.logits.allowed_mask is not None
    engine.add_request("shared-0", PROMPTS[0], params, prepared=prepared)
    engine.add_request("shared-1", PROMPTS[1], params)  # found on the params, not built again
    assert engine.requests["shared-0"].prepared is engine.requests["shared-1"].prepared is prepared
    engine.abort_request(["shared-0", "shared-1"])
    assert pool_is_whole(llm)


def test_async_llm_prepares_off_the_engine_thread(soft_model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Bad words are tokenized (and masks built) in a worker thread: neither the caller's
    # event loop nor the engine's loop thread does it.
    import asyncio
    import threading

    import pagedkv.sample.prepared as prepared_module
    from pagedkv.engine.args import EngineArgs
    from pagedkv.engine.async_llm import AsyncLLM

    threads: list[str] = []
    tokenize = prepared_module.bad_words_token_ids

    def recording(*args: object, **kwargs: object) -> list[list[int]]:
        threads.append(threading.current_thread().name)
        return tokenize(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(prepared_module, "bad_words_token_ids", recording)
    engine = AsyncLLM.from_engine_args(
        EngineArgs(
            model=soft_model,
            tokenizer=str(default_model_dir()),
            dtype="float32",
            block_size=8,
            num_blocks=32,
            max_model_len=256,
        )
    )

    async def run() -> list[int]:
        params = SamplingParams(max_tokens=3, temperature=0.0, bad_words=["hello", "world"])
        outputs = [out async for out in engine.generate(PROMPTS[0], params)]
        return outputs[-1].outputs[0].token_ids

    try:
        assert len(asyncio.run(run())) == 3
    finally:
        engine.shutdown()
    assert len(threads) == 1 and threads[0] not in ("pagedkv-step-loop", threading.main_thread().name), threads
