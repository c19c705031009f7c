"""The engine as a server operator breaks it: requests that used to wedge the engine, an
exception or Ctrl-C inside a step, aborts and adds from other threads, one bad client among
many under AsyncLLM, and the vLLM semantics a client relies on (growing stream text, min_tokens
holding eos back even with ignore_eos). After each, every other request finishes with the
tokens of an undisturbed run and no block is lost."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time

import pytest
import torch

import pagedkv
from pagedkv import LLM, AsyncLLM, SamplingParams

# max_logprobs past the vocabulary: these tests ask for every token's logprob (vLLM's default, 20,
# is tested with the server's limits).
ENGINE_ARGS = {
    "dtype": "float32",
    "device": "cpu",
    "max_model_len": 512,
    "kv_cache_memory": 64 << 20,
    "max_logprobs": 1 << 20,
}
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Three facts about the moon:",
    "My favourite recipe for pancakes is",
    "The quick brown fox",
    "In the year 1969,",
]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(**ENGINE_ARGS)


def greedy(max_tokens: int, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)  # type: ignore[arg-type]


def assert_pool_whole(llm: LLM) -> None:
    engine = llm.llm_engine
    engine.scheduler.check_invariants()
    st = engine.get_stats()
    assert st["num_free_blocks"] == st["num_blocks"], st
    assert st["num_running"] == 0 and st["num_waiting"] == 0 and not engine.requests


def run_all(engine: pagedkv.LLMEngine) -> dict[str, pagedkv.RequestOutput]:
    done: dict[str, pagedkv.RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


@pytest.fixture(scope="module")
def reference(llm: LLM) -> list[list[int]]:
    """Greedy tokens of PROMPTS on an undisturbed engine."""
    outs = llm.generate(PROMPTS, [greedy(8 + i, ignore_eos=True) for i in range(len(PROMPTS))], use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


class FaultyForward:
    """Wraps ``runner.execute``: raises ``error`` on the calls whose number is in ``fail_on``."""

    def __init__(self, llm: LLM, fail_on: set[int], error: BaseException) -> None:
        self.runner = llm.llm_engine.runner
        self.inner = self.runner.execute
        self.fail_on, self.error, self.calls = fail_on, error, 0

    def __call__(self, step):  # noqa: ANN001
        self.calls += 1
        if self.calls in self.fail_on:
            self.inner(step)  # a failure after the KV writes: the rollback must not trust them
            raise self.error
        return self.inner(step)

    def __enter__(self) -> FaultyForward:
        self.runner.execute = self
        return self

    def __exit__(self, *exc: object) -> None:
        del self.runner.execute  # back to the class's method


# ---------------------------------------------------------------- requests that used to wedge the engine


@pytest.mark.parametrize(
    "params",
    [
        dict(max_tokens=2, logprobs=60000),
        dict(max_tokens=4, min_tokens=2, stop_token_ids=[50000]),
        dict(n=2, seed=2**64 - 1, temperature=0.8),
    ],
)
def test_requests_that_wedged_the_engine_are_refused_at_add(llm: LLM, params: dict) -> None:
    engine = llm.llm_engine
    with pytest.raises(pagedkv.ConfigError):
        engine.add_request("wedge", "Hi", SamplingParams(**params))
    assert "wedge" not in engine.requests
    with pytest.raises(pagedkv.UnknownRequestError):
        engine.abort_request("wedge")
    out = llm.generate("Hi", greedy(2), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 2
    engine.add_request("wedge", "Hi", greedy(1))  # the id was never taken
    assert run_all(engine)["wedge"].finished
    assert_pool_whole(llm)


def test_huge_n_and_logprobs_over_max_logprobs_are_refused_before_any_state(llm: LLM) -> None:
    # n = 10**9 used to build a billion samples' state before the scheduler refused it.
    engine = llm.llm_engine
    with pytest.raises(pagedkv.InvalidArgumentError, match="max_num_seqs"):
        engine.add_request("huge-n", "Hi", SamplingParams(n=10**9, max_tokens=2))
    with pytest.raises(pagedkv.InvalidArgumentError, match="max_num_seqs"):
        engine.add_request("huge-beam", "Hi", pagedkv.BeamSearchParams(beam_width=10**9, max_tokens=2))
    with pytest.raises(pagedkv.ConfigError, match="max_logprobs"):
        engine.add_request("many-logprobs", "Hi", SamplingParams(logprobs=ENGINE_ARGS["max_logprobs"] + 1))
    assert not {"huge-n", "huge-beam", "many-logprobs"} & set(engine.requests)
    assert_pool_whole(llm)


def test_logprobs_up_to_the_vocabulary_and_stop_ids_inside_it_are_served(llm: LLM) -> None:
    vocab = llm.llm_engine.runner.vocab_size
    out = llm.generate("Hi", greedy(1, logprobs=vocab, stop_token_ids=[vocab - 1]), use_tqdm=False)[0].outputs[0]
    assert out.logprobs is not None and len(out.logprobs[0]) == vocab


# ---------------------------------------------------------------- exceptions inside a step


def test_ctrl_c_inside_generate_leaves_a_working_engine(llm: LLM, reference: list[list[int]]) -> None:
    params = [greedy(8 + i, ignore_eos=True) for i in range(len(PROMPTS))]
    with FaultyForward(llm, {3}, KeyboardInterrupt()):
        with pytest.raises(KeyboardInterrupt):
            llm.generate(PROMPTS, params, use_tqdm=False)
    assert_pool_whole(llm)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference


def test_out_of_memory_in_one_forward_is_retried(llm: LLM, reference: list[list[int]]) -> None:
    params = [greedy(8 + i, ignore_eos=True) for i in range(len(PROMPTS))]
    with FaultyForward(llm, {2, 5}, torch.OutOfMemoryError("CUDA out of memory (injected)")) as fault:
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert fault.calls > 5
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert all(o.error is None for o in outs)
    assert llm.llm_engine.get_stats()["failed_steps"] >= 2
    assert_pool_whole(llm)


def test_step_raises_then_retries_through_the_embedding_api(llm: LLM, reference: list[list[int]]) -> None:
    engine = llm.llm_engine
    for i, prompt in enumerate(PROMPTS[:3]):
        engine.add_request(f"e{i}", prompt, greedy(8 + i, ignore_eos=True))
    with FaultyForward(llm, {1}, RuntimeError("boom")):
        with pytest.raises(RuntimeError, match="boom"):
            engine.step()
        engine.scheduler.check_invariants()
        done = run_all(engine)
    assert [done[f"e{i}"].outputs[0].token_ids for i in range(3)] == reference[:3]
    assert_pool_whole(llm)


def test_a_request_in_too_many_failed_steps_fails_alone(llm: LLM, reference: list[list[int]]) -> None:
    """A request whose presence makes every forward fail is failed after max_step_failures; the
    requests that were never batched with it are untouched."""
    engine = llm.llm_engine
    runner = engine.runner
    inner = runner.execute

    def poisoned(step):  # noqa: ANN001
        if "poison" in step.req_ids:
            raise ValueError("this request breaks the model")
        return inner(step)

    runner.execute = poisoned
    try:
        engine.add_request("poison", "Break the model", greedy(4))
        failures = 0
        while "poison" in engine.requests:
            with pytest.raises(ValueError):
                engine.step()
            failures += 1
        assert failures == engine.max_step_failures
        out = engine.step()  # the failed request's last output comes out of the next step
        assert [o.request_id for o in out] == ["poison"]
        assert out[0].finished and out[0].outputs[0].finish_reason == "error"
        assert out[0].error is not None and "this request breaks the model" in out[0].error
        outs = llm.generate(PROMPTS[:2], [greedy(8 + i, ignore_eos=True) for i in range(2)], use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == reference[:2]
    finally:
        del runner.execute
    assert engine.get_stats()["failed_requests"] >= 1
    assert_pool_whole(llm)


def test_a_failure_in_one_requests_output_processing_fails_only_it(llm: LLM, reference: list[list[int]]) -> None:
    engine = llm.llm_engine
    for i, prompt in enumerate(PROMPTS[:3]):
        engine.add_request(f"o{i}", prompt, greedy(8 + i, ignore_eos=True))
    detokenizer = engine.requests["o1"].samples[0].detokenizer

    def broken(*args, **kwargs):  # noqa: ANN002, ANN003
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")

    detokenizer.update = broken  # type: ignore[method-assign]
    done = run_all(engine)
    assert done["o1"].outputs[0].finish_reason == "error" and "UnicodeDecodeError" in done["o1"].error
    assert done["o0"].outputs[0].token_ids == reference[0] and done["o2"].outputs[0].token_ids == reference[2]
    assert_pool_whole(llm)


def test_fault_injection_under_a_workload_with_aborts(llm: LLM) -> None:
    """Random forwards raise (and once the sampler); random requests are aborted. Every request
    that was not aborted ends with the tokens of an undisturbed run; no block leaks."""
    engine = llm.llm_engine
    rng = random.Random(5)
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} (variant {i})" for i in range(12)]
    params = [greedy(rng.randint(3, 14), ignore_eos=True) for _ in prompts]
    undisturbed = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    fail_on = {2, 5, 6, 11, 17, 23, 24, 30}  # never three in a row: no request is failed
    sampler, sampler_calls = engine.sampler, [0]

    def flaky_sampler(logits, metadata):  # noqa: ANN001
        sampler_calls[0] += 1
        if sampler_calls[0] == 8:  # the 12th forward: never a third failure in a row
            raise RuntimeError("sampler failure (injected)")
        return sampler(logits, metadata)

    engine.sampler = flaky_sampler  # type: ignore[assignment]
    aborted: set[str] = set()
    done: dict[str, pagedkv.RequestOutput] = {}
    try:
        with FaultyForward(llm, fail_on, RuntimeError("forward failure (injected)")):
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                engine.add_request(f"w{i}", prompt, p)
            steps = 0
            while engine.has_unfinished_requests():
                steps += 1
                if steps % 5 == 0:
                    live = sorted(set(engine.requests) - aborted)
                    if live:
                        victim = rng.choice(live)
                        engine.abort_request(victim)
                        aborted.add(victim)
                try:
                    outputs = engine.step()
                except RuntimeError:
                    engine.scheduler.check_invariants()
                    continue
                for out in outputs:
                    if out.finished:
                        done[out.request_id] = out
    finally:
        engine.sampler = sampler
    assert engine.get_stats()["failed_steps"] >= 3
    assert aborted and len(done) + len(aborted) == len(prompts)
    for i in range(len(prompts)):
        if f"w{i}" not in aborted:
            assert done[f"w{i}"].outputs[0].token_ids == undisturbed[i], i
    assert_pool_whole(llm)


# ---------------------------------------------------------------- threads


def test_abort_from_another_thread_while_a_step_runs(llm: LLM) -> None:
    engine = llm.llm_engine
    for i in range(3):
        engine.add_request(f"t{i}", PROMPTS[i], greedy(30, ignore_eos=True))
    runner = engine.runner
    inner = runner.execute
    in_forward = threading.Event()

    def slow(step):  # noqa: ANN001
        in_forward.set()
        time.sleep(0.2)  # the abort below arrives while this forward runs
        return inner(step)

    runner.execute = slow
    results: list[object] = []
    thread = threading.Thread(target=lambda: results.append(engine.abort_request(["t1", "t1"])))
    try:
        engine.step()  # prefill
        in_forward.clear()
        stepper = threading.Thread(target=engine.step)
        stepper.start()
        in_forward.wait(10)
        thread.start()
        stepper.join(30)
        thread.join(30)
    finally:
        del runner.execute
    (outputs,) = results
    assert isinstance(outputs, list) and len(outputs) == 1  # ["t1", "t1"] aborts once
    assert outputs[0].outputs[0].finish_reason == "abort"
    done = run_all(engine)
    assert sorted(done) == ["t0", "t2"] and all(len(o.outputs[0].token_ids) == 30 for o in done.values())
    assert_pool_whole(llm)


def test_threads_add_and_abort_while_the_engine_steps(llm: LLM) -> None:
    engine = llm.llm_engine
    errors: list[BaseException] = []
    added: list[str] = []
    aborted: list[str] = []
    stop = threading.Event()

    def client(k: int) -> None:
        rng = random.Random(k)
        try:
            for j in range(6):
                rid = f"c{k}-{j}"
                engine.add_request(
                    rid, PROMPTS[rng.randrange(len(PROMPTS))], greedy(rng.randint(2, 10), ignore_eos=True)
                )
                added.append(rid)
                time.sleep(rng.random() * 0.05)
                if rng.random() < 0.4:
                    try:
                        engine.abort_request(rid)
                        aborted.append(rid)
                    except pagedkv.UnknownRequestError:
                        pass  # it finished first
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    clients = [threading.Thread(target=client, args=(k,)) for k in range(4)]
    done: dict[str, pagedkv.RequestOutput] = {}

    def stepper() -> None:
        while not stop.is_set() or engine.has_unfinished_requests():
            for out in engine.step() if engine.has_unfinished_requests() else []:
                if out.finished:
                    done[out.request_id] = out
            time.sleep(0.001)

    step_thread = threading.Thread(target=stepper)
    step_thread.start()
    for c in clients:
        c.start()
    for c in clients:
        c.join(120)
    stop.set()
    step_thread.join(120)
    assert not errors, errors
    assert len(added) == 24 and set(done) | set(aborted) == set(added) and not set(done) & set(aborted)
    assert_pool_whole(llm)


# ---------------------------------------------------------------- AsyncLLM: one bad client among many


def test_async_llm_one_bad_client_among_many() -> None:
    with AsyncLLM(**ENGINE_ARGS) as engine:
        vocab = engine.engine.runner.vocab_size
        broken_once = FaultyForward.__new__(FaultyForward)
        runner = engine.engine.runner
        broken_once.runner, broken_once.inner = runner, runner.execute
        broken_once.fail_on, broken_once.error, broken_once.calls = {3}, RuntimeError("transient (injected)"), 0
        runner.execute = broken_once

        async def good(i: int) -> list[int]:
            tokens: list[int] = []
            async for out in engine.generate(PROMPTS[i], greedy(6 + i, ignore_eos=True), f"good{i}"):
                tokens = out.outputs[0].token_ids
            return tokens

        async def bad(kind: str) -> str:
            cases = {
                "logprobs": ("Hi", SamplingParams(logprobs=vocab + 1)),
                "stop_ids": ("Hi", SamplingParams(stop_token_ids=[vocab + 5])),
                "surrogate": (json.loads('"bad \\ud800 text"'), greedy(2)),
                "type": (None, greedy(2)),
            }
            prompt, params = cases[kind]
            try:
                async for _ in engine.generate(prompt, params, f"bad-{kind}"):  # type: ignore[arg-type]
                    pass
            except pagedkv.PagedKVError as exc:
                return type(exc).__name__
            return "accepted"

        async def failing() -> str:
            async def run() -> None:
                async for _ in engine.generate(PROMPTS[5], greedy(20, ignore_eos=True), "fails"):
                    state = engine.engine.requests.get("fails")
                    if state is not None:
                        state.samples[0].detokenizer.update = _raise  # type: ignore[method-assign]

            try:
                await run()
            except pagedkv.RequestFailedError as exc:
                return str(exc)
            return "not failed"

        async def main() -> tuple[list[list[int]], list[str], str]:
            results = await asyncio.gather(
                *(good(i) for i in range(4)),
                *(bad(k) for k in ("logprobs", "stop_ids", "surrogate", "type")),
                failing(),
            )
            # Failed requests free their blocks on the loop thread: wait for it (bounded).
            deadline = time.monotonic() + 60
            while True:
                stats = await engine.get_stats()
                if stats["num_free_blocks"] == stats["num_blocks"] and stats["num_unfinished_requests"] == 0:
                    break
                assert time.monotonic() < deadline, stats
                await asyncio.sleep(0.05)
            return results[:4], results[4:8], results[8]

        streamed, bad_errors, failure = asyncio.run(main())
        assert engine.is_running
        del runner.execute
    assert bad_errors == ["ConfigError", "ConfigError", "InvalidArgumentError", "InvalidTypeError"]
    assert "fails" in failure and "RuntimeError" in failure
    offline = LLM(**ENGINE_ARGS).generate(
        PROMPTS[:4], [greedy(6 + i, ignore_eos=True) for i in range(4)], use_tqdm=False
    )
    assert streamed == [o.outputs[0].token_ids for o in offline]


def _raise(*args: object, **kwargs: object) -> None:
    raise RuntimeError("detokenizer failure (injected)")


# ---------------------------------------------------------------- vLLM semantics


def test_streamed_text_only_grows_with_stop_strings(llm: LLM) -> None:
    engine = llm.llm_engine
    prompt = "Three facts about the moon:"
    full = llm.generate(prompt, greedy(30, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    ids = full.token_ids
    tokenizer = llm.get_tokenizer()
    # A stop string across a token boundary, so its first part arrives one step before the rest.
    for k in range(2, len(ids) - 2):
        head, tail = tokenizer.decode(ids[:k]), tokenizer.decode(ids[: k + 1])
        piece = tail[len(head) :]
        if len(piece.strip()) >= 2 and head.strip():
            stop = head[-1:] + piece[:2]
            if full.text.count(stop) == 1:
                break
    else:
        pytest.fail(f"no usable stop string in {full.text!r}")
    engine.add_request("grow", prompt, greedy(30, ignore_eos=True, stop=[stop]))
    texts = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            texts.append(out.outputs[0].text)
    assert texts[-1] == full.text[: full.text.index(stop)]
    for before, after in zip(texts, texts[1:]):
        assert after.startswith(before), (before, after)


def test_min_tokens_holds_eos_back_even_with_ignore_eos(llm: LLM) -> None:
    eos = set(llm.llm_engine.eos_token_ids)
    chat = [{"role": "user", "content": "What is 2+2? Answer with one number."}]
    short = llm.chat(chat, greedy(40), use_tqdm=False)[0].outputs[0]
    assert short.finish_reason == "stop" and short.token_ids[-1] in eos and len(short.token_ids) < 20
    held = llm.chat(chat, greedy(24, min_tokens=24, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert len(held.token_ids) == 24 and not eos & set(held.token_ids)


def test_kv_utilization_is_zero_when_nothing_is_in_use(llm: LLM) -> None:
    assert_pool_whole(llm)
    assert llm.llm_engine.get_stats()["kv_utilization"] == 0.0


# ---------------------------------------------------------------- typed errors at every boundary


def test_typed_errors_at_the_boundaries(llm: LLM) -> None:
    engine = llm.llm_engine
    surrogate = json.loads('"caf\\udce9"')
    cases = [
        (lambda: llm.generate(None, use_tqdm=False), pagedkv.InvalidTypeError),  # type: ignore[arg-type]
        (lambda: llm.generate(5, use_tqdm=False), pagedkv.InvalidTypeError),  # type: ignore[arg-type]
        (lambda: llm.generate(["ok", None], use_tqdm=False), pagedkv.InvalidTypeError),  # type: ignore[list-item]
        (lambda: llm.generate("x", "params", use_tqdm=False), pagedkv.InvalidTypeError),  # type: ignore[arg-type]
        (lambda: llm.generate(surrogate, use_tqdm=False), pagedkv.InvalidArgumentError),
        (lambda: llm.generate({"prompt": surrogate}, use_tqdm=False), pagedkv.InvalidArgumentError),
        (lambda: llm.chat([{"role": "user", "content": None}], use_tqdm=False), pagedkv.InvalidTypeError),
        (lambda: llm.chat([{"role": "user", "content": surrogate}], use_tqdm=False), pagedkv.InvalidArgumentError),
        (
            lambda: llm.chat([{"role": "user", "content": [{"type": "image_url"}]}], use_tqdm=False),
            pagedkv.InvalidArgumentError,
        ),
        (lambda: llm.chat([{"role": 1, "content": "x"}], use_tqdm=False), pagedkv.InvalidTypeError),
        (lambda: llm.chat("hello", use_tqdm=False), pagedkv.InvalidTypeError),  # type: ignore[arg-type]
        (lambda: engine.abort_request(123), pagedkv.InvalidTypeError),  # type: ignore[arg-type]
        (lambda: engine.abort_request(["ok", 5]), pagedkv.InvalidTypeError),  # type: ignore[list-item]
        (lambda: engine.add_request("r", "x", greedy(2), arrival_time="now"), pagedkv.InvalidTypeError),  # type: ignore[arg-type]
        (lambda: SamplingParams(temperature="0.5"), pagedkv.ConfigError),  # type: ignore[arg-type]
        (lambda: SamplingParams(top_p=b"1"), pagedkv.ConfigError),  # type: ignore[arg-type]
        (lambda: SamplingParams(min_p=True), pagedkv.ConfigError),  # type: ignore[arg-type]
    ]
    for fn, exc in cases:
        with pytest.raises(exc):
            fn()
    parts = llm.chat([{"role": "user", "content": [{"type": "text", "text": "Say hi."}]}], greedy(2), use_tqdm=False)
    assert len(parts[0].outputs[0].token_ids) == 2
    assert_pool_whole(llm)
