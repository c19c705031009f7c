"""The engine end to end on the CPU: parallel sampling by fork, stops, logprobs, chat, streaming
with AsyncLLM, abort, bad input, a second architecture, the Triton kernels (interpreter) against
the torch path, and the command line."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import pagedkv
from pagedkv import LLM, AsyncLLM, SamplingParams
from pagedkv.worker.model_files import default_model_dir

ENGINE_ARGS = {"dtype": "float32", "device": "cpu", "max_model_len": 512, "kv_cache_memory": 64 << 20}


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(**ENGINE_ARGS)


def greedy(max_tokens: int, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)  # type: ignore[arg-type]


def pool_is_whole(llm: LLM) -> bool:
    st = llm.llm_engine.get_stats()
    return st["num_free_blocks"] == st["num_blocks"] and st["num_running"] == 0


# ---------------------------------------------------------------- parallel sampling


def test_parallel_sampling_forks_share_blocks_and_are_reproducible() -> None:
    llm = LLM(**ENGINE_ARGS, enable_prefix_caching=False)
    engine = llm.llm_engine
    prompt = "Write a short poem about the sea. " * 6

    def run(params: SamplingParams, copies: int) -> tuple[list[list[int]], int]:
        for i in range(copies):
            engine.add_request(f"p{i}-{params.n}-{params.seed}", prompt, params)
        peak, outs = 0, {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    outs[o.request_id] = o
            peak = max(peak, engine.scheduler.stats().num_used_blocks)
        return [c.token_ids for o in outs.values() for c in o.outputs], peak

    sampled = SamplingParams(n=4, max_tokens=12, temperature=1.0, seed=7)
    first, forked_peak = run(sampled, 1)
    again, _ = run(sampled, 1)
    assert len(first) == 4 and first == again  # same seed, same completions
    assert len({tuple(t) for t in first}) == 4  # four different completions
    single = SamplingParams(n=1, max_tokens=12, temperature=1.0, seed=7)
    _, separate_peak = run(single, 4)
    assert forked_peak < separate_peak
    assert pool_is_whole(llm)


# ---------------------------------------------------------------- stops, lengths, logprobs


def test_max_tokens_and_ignore_eos(llm: LLM) -> None:
    out = llm.generate("Hello", greedy(7, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 7 and out.finish_reason == "length"


def test_eos_stops_and_is_left_out_of_the_text(llm: LLM) -> None:
    out = llm.chat([{"role": "user", "content": "What is 2+2?"}], greedy(60), use_tqdm=False)[0].outputs[0]
    eos = llm.llm_engine.eos_token_ids
    assert out.finish_reason == "stop" and out.stop_reason is None
    assert out.token_ids[-1] in eos
    assert "<|im_end|>" not in out.text and "4" in out.text


def test_stop_strings_cut_the_text(llm: LLM) -> None:
    prompt = "The first five letters of the alphabet are"
    full = llm.generate(prompt, greedy(24, ignore_eos=True), use_tqdm=False)[0].outputs[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop.strip(), full
    cut = llm.generate(prompt, greedy(24, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == full[: full.index(stop)]
    kept = llm.generate(prompt, greedy(24, stop=stop, include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == full[: full.index(stop) + len(stop)]
    assert pool_is_whole(llm)


def test_stop_token_ids_and_min_tokens(llm: LLM) -> None:
    base = llm.generate("Count: one, two,", greedy(10, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
    stop_id = base[3]
    out = llm.generate("Count: one, two,", greedy(10, stop_token_ids=[stop_id]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == base[: base.index(stop_id) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    late = llm.generate(
        "Count: one, two,", greedy(10, stop_token_ids=[stop_id], min_tokens=base.index(stop_id) + 1), use_tqdm=False
    )
    assert len(late[0].outputs[0].token_ids) > base.index(stop_id) + 1


def test_logprobs_of_chosen_and_top_tokens(llm: LLM) -> None:
    out = llm.generate("The sky is", greedy(4, logprobs=2), use_tqdm=False)[0].outputs[0]
    assert out.logprobs is not None and len(out.logprobs) == 4
    total = 0.0
    for token, entry in zip(out.token_ids, out.logprobs):
        assert token in entry and entry[token].rank == 1  # greedy: the chosen token is the top one
        assert len(entry) == 2  # the chosen token is also the top-1 entry, plus the second
        total += entry[token].logprob
    assert out.cumulative_logprob == pytest.approx(total)


def test_outputs_in_input_order_with_per_prompt_params(llm: LLM) -> None:
    prompts = ["A", "B is for", "C is a letter and"]
    outs = llm.generate(prompts, [greedy(3), greedy(5), greedy(4)], use_tqdm=False)
    assert [o.prompt for o in outs] == prompts
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 5, 4]
    assert all(o.metrics is not None and o.metrics.first_token_time is not None for o in outs)


# ---------------------------------------------------------------- bad input


def test_bad_input_is_typed_and_the_engine_keeps_serving(llm: LLM) -> None:
    engine = llm.llm_engine
    engine.add_request("good", "The weather today is", greedy(6, ignore_eos=True))
    engine.step()
    bad = [
        (lambda: engine.add_request("good", "dup", greedy(2)), pagedkv.DuplicateRequestError),
        (lambda: engine.add_request("e", "", greedy(2)), pagedkv.InvalidArgumentError),
        (lambda: engine.add_request("e", [], greedy(2)), pagedkv.InvalidArgumentError),
        (lambda: engine.add_request("long", list(range(600)), greedy(2)), pagedkv.PromptTooLongError),
        (lambda: engine.add_request("v", [1, 10**7], greedy(2)), pagedkv.InvalidTokenError),
        (lambda: engine.add_request("t", 3.5, greedy(2)), pagedkv.InvalidTypeError),  # type: ignore[arg-type]
        (lambda: engine.add_request("p", "x", {"max_tokens": 2}), pagedkv.InvalidTypeError),  # type: ignore[arg-type]
        (lambda: engine.abort_request("nope"), pagedkv.UnknownRequestError),
        (lambda: SamplingParams(temperature=-1), pagedkv.ConfigError),
        (lambda: SamplingParams(top_p=0.0), pagedkv.ConfigError),
        (lambda: SamplingParams(top_p=1.5), pagedkv.ConfigError),
        (lambda: SamplingParams(n=0), pagedkv.ConfigError),
        (lambda: SamplingParams(max_tokens=0), pagedkv.ConfigError),
        (lambda: SamplingParams(top_k=-2), pagedkv.ConfigError),
    ]
    for fn, exc in bad:
        with pytest.raises(exc):
            fn()
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = o
    assert list(outs) == ["good"] and len(outs["good"].outputs[0].token_ids) == 6
    assert pool_is_whole(llm)


def test_bad_models_and_budgets(tmp_path: Path) -> None:
    with pytest.raises(pagedkv.ModelLoadError):
        LLM(str(tmp_path / "does-not-exist"), **ENGINE_ARGS)
    with pytest.raises(pagedkv.ConfigError, match="fewer than one request"):
        LLM(dtype="float32", device="cpu", max_model_len=512, num_blocks=8)
    with pytest.raises(pagedkv.ConfigError):
        LLM(**ENGINE_ARGS, not_an_engine_arg=1)


# ---------------------------------------------------------------- another architecture, Triton


@pytest.fixture(scope="module")
def tiny_qwen2(tiny_model: str) -> Path:
    return Path(tiny_model)


def test_second_architecture_matches_transformers(tiny_qwen2: Path) -> None:
    tok = AutoTokenizer.from_pretrained(default_model_dir())
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32)
    prompts = ["Hello world", "The capital of France is Paris and the capital of Italy is", "1 2 3"]
    want = []
    with torch.inference_mode():
        for p in prompts:
            ids = tok(p, return_tensors="pt").input_ids
            g = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False, eos_token_id=None
            )
            want.append(g[0, ids.shape[1] :].tolist())
    llm = LLM(
        str(tiny_qwen2),
        tokenizer=str(default_model_dir()),
        dtype="float32",
        device="cpu",
        max_model_len=256,
        kv_cache_memory=4 << 20,
        block_size=16,
    )
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(8, ignore_eos=True), use_tqdm=False)]
    assert got == want


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
    reason="the Triton kernels need a GPU or TRITON_INTERPRET=1",
)
def test_triton_kernels_end_to_end_equal_torch_path(tiny_qwen2: Path) -> None:
    prompts = ["Hello world, this is a test of", "A B C"]
    runs = {}
    for backend in ("torch", "triton"):
        llm = LLM(
            str(tiny_qwen2),
            tokenizer=str(default_model_dir()),
            dtype="float32",
            device="cpu",
            max_model_len=64,
            num_blocks=16,
            block_size=16,
            attention_backend=backend,
        )
        assert llm.llm_engine.runner.attention_backend == backend
        runs[backend] = [
            o.outputs[0].token_ids for o in llm.generate(prompts, greedy(4, ignore_eos=True), use_tqdm=False)
        ]
    assert runs["triton"] == runs["torch"]


# ---------------------------------------------------------------- AsyncLLM


def test_async_llm_streams_concurrently_and_abort_frees_blocks() -> None:
    prompts = [f"Tell me fact number {i} about whales:" for i in range(4)]
    with AsyncLLM(**ENGINE_ARGS) as engine:

        async def collect(i: int) -> tuple[list[str], list[int]]:
            texts, tokens = [], []
            async for out in engine.generate(prompts[i], greedy(6 + i, ignore_eos=True), f"s{i}"):
                texts.append(out.outputs[0].text)
                tokens = out.outputs[0].token_ids
            assert out.finished
            return texts, tokens

        async def abandon() -> None:
            async for out in engine.generate("Count to one hundred: 1, 2, 3,", greedy(200), "quitter"):
                if len(out.outputs[0].token_ids) >= 3:
                    break  # the consumer leaves: the request is aborted

        async def cancel_task() -> None:
            streaming = asyncio.Event()

            async def run() -> None:
                async for _ in engine.generate("Once upon a time", greedy(200), "cancelled"):
                    streaming.set()

            task = asyncio.ensure_future(run())
            # Cancel once the request streams: a task cancelled while its add still waits for
            # the loop thread (a busy machine) leaves no request behind, so nothing to abort.
            await streaming.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        async def bad() -> None:
            with pytest.raises(pagedkv.InvalidArgumentError):
                async for _ in engine.generate("", greedy(2), "empty"):
                    pass

        async def main() -> list[tuple[list[str], list[int]]]:
            results = await asyncio.gather(*(collect(i) for i in range(4)), abandon(), cancel_task(), bad())
            # The abandoned stream is closed by a task the event loop schedules when its
            # generator is collected, so the abort reaches the loop thread a little later:
            # poll (a busy machine may take long) instead of sleeping a fixed time.
            deadline = time.monotonic() + 60
            while True:
                stats = await engine.get_stats()
                if stats["num_aborted"] == 2 and stats["num_unfinished_requests"] == 0:
                    break
                assert time.monotonic() < deadline, {k: stats[k] for k in ("num_aborted", "num_unfinished_requests")}
                await asyncio.sleep(0.05)
            assert stats["num_free_blocks"] == stats["num_blocks"]
            return results[:4]

        streamed = asyncio.run(main())
    for i, (texts, tokens) in enumerate(streamed):
        assert len(tokens) == 6 + i
        assert len(texts) >= 2 and all(texts[k + 1].startswith(texts[k]) for k in range(len(texts) - 1))
    llm = LLM(**ENGINE_ARGS)
    offline = [
        o.outputs[0].token_ids
        for o in llm.generate(prompts, [greedy(6 + i, ignore_eos=True) for i in range(4)], use_tqdm=False)
    ]
    assert [t for _, t in streamed] == offline


# ---------------------------------------------------------------- command line


def test_cli_generate_json() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pagedkv",
            "generate",
            "--prompt",
            "The capital of France is",
            "--max-tokens",
            "5",
            "--temperature",
            "0",
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--max-model-len",
            "256",
            "--kv-cache-memory",
            str(16 << 20),
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert len(data[0]["completions"][0]["token_ids"]) == 5
    bad = subprocess.run(
        [sys.executable, "-m", "pagedkv", "generate", "--prompt", "x", "--temperature", "-1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert bad.returncode == 2 and "ConfigError" in bad.stderr
