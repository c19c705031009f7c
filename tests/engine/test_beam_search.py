"""Beam search on copy-on-write blocks (SmolLM2, float32, CPU).

The sequences `LLM.beam_search` returns equal transformers' `generate(num_beams=W,
do_sample=False)` — the whole beam set, tokens and scores — for W in {2, 4}: with fixed-length
outputs (no eos), under a pool small enough to force preemption (recompute, and swap to a
host tier), with chunked prefill, and with eos allowed (transformers' early-stopping rule).
The cache configurations other than the default one (no prefix cache, preemption, swap,
chunks: block bookkeeping) run on the tiny random model of tests/tiny_models.py, against
transformers on the same weights (its beam scores stand apart by more than 2e-3).
The embedding API streams the best beam; the stats count the blocks beams share; aborts and
bad input leave the engine whole.
"""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pagedkv import LLM, AsyncLLM, BeamSearchParams, LLMEngine, SamplingParams, Scheduler, SchedulerConfig
from pagedkv.errors import ConfigError, InvalidArgumentError, InvalidTypeError
from pagedkv.worker.model_files import default_model_dir

MAX_NEW = 10
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea",
    "In 1492, Columbus",
]
CHATS = ["Say hi.", "Name a color."]  # between them: beams ended by eos and by max_tokens
CHAT_MAX_NEW = 24
ENGINE_ARGS = {"dtype": "float32", "device": "cpu", "max_model_len": 512, "kv_cache_memory": 64 << 20}


def load_hf(folder: str) -> tuple[AutoModelForCausalLM, AutoTokenizer]:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.eval()
    return model, AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def hf() -> tuple[AutoModelForCausalLM, AutoTokenizer]:
    return load_hf(str(default_model_dir()))


def hf_beams(hf: tuple, text: str, width: int, max_new: int, eos: list[int] | None) -> list[tuple[list[int], float]]:
    """transformers' beam set for one prompt: (generated ids, score), best first. Without eos
    ids the outputs have a fixed length (`min_new_tokens` holds eos back)."""
    model, tok = hf
    ids = tok(text, return_tensors="pt").input_ids
    kwargs = {"min_new_tokens": max_new} if eos is None else {"eos_token_id": eos, "pad_token_id": eos[0]}
    with torch.inference_mode():
        g = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            num_beams=width,
            num_return_sequences=width,
            do_sample=False,
            max_new_tokens=max_new,
            output_scores=True,
            return_dict_in_generate=True,
            **kwargs,
        )
    out = []
    for seq, score in zip(g.sequences[:, ids.shape[1] :].tolist(), g.sequences_scores.tolist()):
        if eos is not None and eos[0] in seq:
            seq = seq[: seq.index(eos[0]) + 1]  # padding after the eos
        out.append((seq, score))
    return out


def fixed_length_beams(hf: tuple) -> dict[int, list[list[tuple[list[int], float]]]]:
    """transformers' beam sets of PROMPTS, by width."""
    return {w: [hf_beams(hf, p, w, MAX_NEW, None) for p in PROMPTS] for w in (2, 4)}


@pytest.fixture(scope="module")
def reference(hf: tuple) -> dict[int, list[list[tuple[list[int], float]]]]:
    return fixed_length_beams(hf)


@pytest.fixture(scope="module")
def tiny_reference(tiny_model: str) -> dict[int, list[list[tuple[list[int], float]]]]:
    return fixed_length_beams(load_hf(tiny_model))


def assert_pool_whole(engine: LLMEngine) -> None:
    engine.scheduler.check_invariants()
    st = engine.get_stats()
    assert st["num_free_blocks"] == st["num_blocks"], st
    assert st["num_running"] == 0 and st["num_waiting"] == 0 and not engine.requests
    assert st["beam_blocks_in_use"] == 0 and st["beam_block_refs"] == 0


def assert_same_beams(outs: list, expected: list[list[tuple[list[int], float]]]) -> None:
    for out, beams in zip(outs, expected):
        assert [s.output_token_ids for s in out.sequences] == [ids for ids, _ in beams]
        for s, (_, score) in zip(out.sequences, beams):
            assert s.score == pytest.approx(score, abs=1e-4)
            # Fixed length with length_penalty 1: the score is the mean logprob per token.
            assert s.cum_logprob == pytest.approx(s.score * len(s.output_token_ids), rel=1e-6)


@pytest.mark.parametrize(
    ("model", "engine_args"),
    [
        pytest.param("smollm2", {}, id="prefix-cache"),
        pytest.param("tiny", {"enable_prefix_caching": False}, id="no-prefix-cache"),
        # 12 blocks of 8 slots: W = 4 beams of 4 requests cannot all stay resident; an 8-token
        # budget: prompts and recomputed beams are prefilled in chunks (the all-or-none barrier).
        pytest.param(
            "tiny",
            {"block_size": 8, "num_blocks": 12, "max_model_len": 64, "max_num_batched_tokens": 8},
            id="preemption-recompute-chunked",
        ),
        pytest.param(
            "tiny",
            {"block_size": 8, "num_blocks": 12, "max_model_len": 64, "num_host_blocks": 64, "preemption_mode": "swap"},
            id="preemption-swap",
        ),
    ],
)
def test_beam_sets_equal_transformers(request: pytest.FixtureRequest, model: str, engine_args: dict) -> None:
    kwargs = dict(ENGINE_ARGS)
    kwargs.update(engine_args)
    if "num_blocks" in engine_args:
        kwargs.pop("kv_cache_memory")
    tiny = model == "tiny"
    reference = request.getfixturevalue("tiny_reference" if tiny else "reference")
    llm = LLM(request.getfixturevalue("tiny_model") if tiny else None, **kwargs)
    for width in (2, 4):
        outs = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=width, max_tokens=MAX_NEW, ignore_eos=True))
        assert len(outs) == len(PROMPTS) and all(len(o.sequences) == width for o in outs)
        assert_same_beams(outs, reference[width])
        for out, prompt in zip(outs, PROMPTS):
            best = out.sequences[0]
            assert best.tokens[: best.num_prompt_tokens] == llm.get_tokenizer()(prompt).input_ids
            assert best.text == llm.get_tokenizer().decode(best.output_token_ids)
            assert all(s.finish_reason == "length" for s in out.sequences)
        assert_pool_whole(llm.llm_engine)
    stats = llm.llm_engine.get_stats()
    assert stats["num_beam_forks"] > 0
    if "num_blocks" in engine_args:
        assert stats["num_preemptions"] > 0
    if engine_args.get("preemption_mode") == "swap":
        assert stats["num_swap_preemptions"] > 0


def test_eos_and_early_stopping_match_transformers(hf: tuple) -> None:
    llm = LLM(**ENGINE_ARGS)
    tok = llm.get_tokenizer()
    eos = llm.llm_engine.eos_token_ids
    chats = [
        tok.apply_chat_template([{"role": "user", "content": c}], tokenize=False, add_generation_prompt=True)
        for c in CHATS
    ]
    reasons = set()
    for width in (4,):
        outs = llm.beam_search(chats, BeamSearchParams(beam_width=width, max_tokens=CHAT_MAX_NEW))
        assert_same_beams_any_length(outs, [hf_beams(hf, c, width, CHAT_MAX_NEW, eos) for c in chats])
        for out in outs:
            for s in out.sequences:
                reasons.add(s.finish_reason)
                if s.finish_reason == "stop":
                    assert s.output_token_ids[-1] in eos
                    # The eos token's text is left out of `text`.
                    assert s.text == tok.decode(s.output_token_ids[:-1])
    assert reasons == {"stop", "length"}
    assert_pool_whole(llm.llm_engine)


def assert_same_beams_any_length(outs: list, expected: list[list[tuple[list[int], float]]]) -> None:
    for out, beams in zip(outs, expected):
        assert [s.output_token_ids for s in out.sequences] == [ids for ids, _ in beams]
        for s, (_, score) in zip(out.sequences, beams):
            assert s.score == pytest.approx(score, abs=1e-4)


def test_engine_streams_the_best_beam_next_to_sampled_requests(reference: dict) -> None:
    engine = LLMEngine(**ENGINE_ARGS)
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    alone = LLM(**ENGINE_ARGS).generate(PROMPTS[1], greedy, use_tqdm=False)[0].outputs[0].token_ids
    engine.add_request("beam", PROMPTS[0], BeamSearchParams(beam_width=4, max_tokens=MAX_NEW, ignore_eos=True))
    engine.add_request("greedy", PROMPTS[1], greedy)
    streamed, final, shared_seen = [], {}, False
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == "beam" and not out.finished:
                assert len(out.outputs) == 1  # the current best beam
                streamed.append(out.outputs[0].token_ids)
            if out.finished:
                final[out.request_id] = out
        st = engine.get_stats()
        if st["beam_blocks_shared"] > 0:
            shared_seen = True
            assert st["beam_blocks_in_use"] < st["beam_block_refs"]
        engine.scheduler.check_invariants()
    assert shared_seen
    assert [len(t) for t in streamed] == list(range(1, MAX_NEW))
    beam = final["beam"]
    assert [c.token_ids for c in beam.outputs] == [ids for ids, _ in reference[4][0]]
    assert [c.index for c in beam.outputs] == [0, 1, 2, 3]
    cums = [c.cumulative_logprob for c in beam.outputs]
    assert cums == sorted(cums, reverse=True)
    assert final["greedy"].outputs[0].token_ids == alone
    assert_pool_whole(engine)


def test_async_llm_streams_the_best_beam(reference: dict) -> None:
    async def run() -> list:
        with AsyncLLM(**ENGINE_ARGS) as engine:
            params = BeamSearchParams(beam_width=2, max_tokens=MAX_NEW, ignore_eos=True)
            outs = [o async for o in engine.generate(PROMPTS[3], params, request_id="b")]
            stats = await engine.get_stats()
            assert stats["num_free_blocks"] == stats["num_blocks"]
            return outs

    outs = asyncio.run(run())
    assert [len(o.outputs) for o in outs] == [1] * (MAX_NEW - 1) + [2]
    assert [c.token_ids for c in outs[-1].outputs] == [ids for ids, _ in reference[2][3]]


def test_abort_mid_search_frees_every_beam() -> None:
    engine = LLMEngine(**ENGINE_ARGS)
    engine.add_request("a", PROMPTS[0], BeamSearchParams(beam_width=4, max_tokens=30, ignore_eos=True))
    engine.add_request("b", PROMPTS[1], BeamSearchParams(beam_width=2, max_tokens=MAX_NEW, ignore_eos=True))
    for _ in range(4):
        engine.step()
    assert engine.get_stats()["num_running"] == 6
    (out,) = engine.abort_request("a")
    assert out.finished and len(out.outputs) == 4
    assert all(c.finish_reason == "abort" and len(c.token_ids) == 4 for c in out.outputs)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert len(done["b"].outputs) == 2
    assert_pool_whole(engine)


def test_a_failed_step_is_retried_with_the_same_beams(reference: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = LLMEngine(**ENGINE_ARGS)
    engine.add_request("x", PROMPTS[2], BeamSearchParams(beam_width=4, max_tokens=MAX_NEW, ignore_eos=True))
    real, calls = engine.runner.execute, {"n": 0}

    def flaky(*args: object) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] in (3, 6):
            raise RuntimeError("injected")
        return real(*args)

    monkeypatch.setattr(engine.runner, "execute", flaky)
    final = None
    while engine.has_unfinished_requests():
        try:
            outs = engine.step()
        except RuntimeError:
            engine.scheduler.check_invariants()
            continue
        final = next((o for o in outs if o.finished), final)
    assert final is not None
    assert [c.token_ids for c in final.outputs] == [ids for ids, _ in reference[4][2]]
    assert_pool_whole(engine)


def test_ctrl_c_inside_beam_search_leaves_a_working_engine(reference: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    llm = LLM(**ENGINE_ARGS)
    engine = llm.llm_engine
    real, calls = engine.runner.execute, {"n": 0}

    def interrupted(*args: object) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 4:
            raise KeyboardInterrupt
        return real(*args)

    monkeypatch.setattr(engine.runner, "execute", interrupted)
    params = BeamSearchParams(beam_width=4, max_tokens=MAX_NEW, ignore_eos=True)
    with pytest.raises(KeyboardInterrupt):
        llm.beam_search(PROMPTS, params)
    assert_pool_whole(engine)  # the call's beam requests left the engine, every block is back
    assert_same_beams(llm.beam_search(PROMPTS, params), reference[4])


@pytest.mark.parametrize(
    "kwargs",
    [
        {"beam_width": 0, "max_tokens": 4},
        {"beam_width": 2, "max_tokens": 0},
        {"beam_width": 2, "max_tokens": 4, "temperature": 0.7},
        {"beam_width": 2, "max_tokens": 4, "length_penalty": math.nan},
        {"beam_width": 2, "max_tokens": 4, "length_penalty": math.inf},
        {"beam_width": 2.0, "max_tokens": 4},
        {"beam_width": 2, "max_tokens": 4, "ignore_eos": 1},
    ],
)
def test_bad_beam_params_are_typed_errors(kwargs: dict) -> None:
    with pytest.raises(ConfigError):
        BeamSearchParams(**kwargs)


def test_bad_beam_requests_are_refused_at_add_request() -> None:
    engine = LLMEngine(**ENGINE_ARGS, max_num_seqs=4)
    with pytest.raises(InvalidArgumentError, match="max_num_seqs"):
        engine.add_request("w", "hi", BeamSearchParams(beam_width=5, max_tokens=4))
    with pytest.raises(InvalidArgumentError, match="kv_transfer_params"):
        engine.add_request("k", "hi", BeamSearchParams(beam_width=2, max_tokens=4), kv_transfer_params={"x": 1})
    with pytest.raises(InvalidTypeError):
        LLM.beam_search(LLM.__new__(LLM), "hi", SamplingParams())  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="more than the pool"):
        engine.add_request("big", "hi", BeamSearchParams(beam_width=4, max_tokens=engine.max_model_len))
    assert not engine.requests and not engine.scheduler.has_unfinished_requests()
    # The engine still serves.
    engine.add_request("ok", "hi", BeamSearchParams(beam_width=4, max_tokens=3, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert_pool_whole(engine)


def scheduler(**kw: int) -> Scheduler:
    cfg = {"num_blocks": 64, "block_size": 4, "max_model_len": 64, "max_num_seqs": 8, "max_num_batched_tokens": 64}
    cfg.update(kw)
    return Scheduler(SchedulerConfig(**cfg))


def test_scheduler_refuses_bad_beam_requests_and_candidates() -> None:
    s = scheduler()
    bad = [
        {"beam_width": 0},
        {"beam_width": 9},
        {"beam_width": 2, "n": 2},
        {"beam_width": 2, "length_penalty": math.nan},
        {"length_penalty": 1.0},
        {"beam_width": 2, "hold_kv": True},
    ]
    for kw in bad:
        with pytest.raises(InvalidArgumentError):
            s.add_request("r", [1, 2, 3], max_tokens=4, **kw)
    assert not s.has_unfinished_requests()
    s.add_request("r", [1, 2, 3], max_tokens=4, beam_width=2)
    out = s.schedule()
    assert out.beam_rows.tolist() == [0]
    tokens = np.zeros(1, dtype=np.int64)
    for ids, lps in [
        (None, None),  # candidates missing
        ([[5, 6, 7, 8]], None),
        ([[5, 6, 7, 8]], [[-1.0, -2.0, -3.0]]),  # ragged
        ([[5, 6], [7, 8]], [[-1.0, -2.0], [-1.0, -2.0]]),  # a row too many
        ([[5, 6, 7, 8]], [[-1.0, math.nan, -3.0, -4.0]]),
        ([[5, -6, 7, 8]], [[-1.0, -2.0, -3.0, -4.0]]),
        ("abc", [[-1.0]]),
    ]:
        with pytest.raises((InvalidArgumentError, InvalidTypeError)):
            s.update(out, tokens, ids, lps)
    with pytest.raises(InvalidArgumentError, match="beam search"):
        s.finish_sample("r", 0)
    # Nothing changed: the same step still takes good candidates.
    ups = s.update(out, tokens, [[5, 6, 7, 8]], [[-0.1, -0.2, -3.0, -4.0]])
    assert [(u.index, u.parent, u.new_token_ids) for u in ups] == [(0, 0, [5]), (1, 0, [6])]
    assert [round(u.cumulative_logprob, 5) for u in ups] == [-0.1, -0.2]
    assert s.stats().num_beam_forks == 1
    s.check_invariants()
    s.abort_request("r")
    s.check_invariants()
    assert s.stats().num_used_blocks == 0
