"""Tensor parallelism on the CPU (gloo): the same tokens as one rank, KV split by heads,
clean failures.

Models: a random-weight Llama (4 heads, 2 KV heads, 2 layers) at TP = 2 (engines, a server),
and one shaped like the embedded SmolLM2-135M (9 heads, 3 KV heads, tied embeddings, 2 layers)
at TP = 3; the README's tensor-parallel example runs SmolLM2 itself at TP = 3
(tests/test_readme.py). Every engine with workers is shut down in a finally / fixture teardown;
the worker-death tests check that no worker process is left.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from pagedkv import LLMEngine, SamplingParams
from pagedkv.errors import ConfigError, EngineDeadError
from pagedkv.worker.model_files import resolve_model

TIMEOUT = 120.0
ENGINE = dict(device="cpu", dtype="float32", num_blocks=48, block_size=16, max_model_len=256)
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Paged attention stores keys and values in blocks, so that",
    "A" * 3,
]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, logprobs=3)


def run(engine: LLMEngine, prompts: list[Any], params: SamplingParams = GREEDY) -> dict[str, Any]:
    """Final outputs by request id."""
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    outs: dict[str, Any] = {}
    deadline = time.monotonic() + TIMEOUT
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
    return outs


def assert_same(a: dict[str, Any], b: dict[str, Any], tol: float = 1e-3) -> None:
    """Same tokens; logprobs within ``tol`` (the all-reduce sums the partial products in another
    order than one matmul does)."""
    assert a.keys() == b.keys()
    for rid in a:
        for x, y in zip(a[rid].outputs, b[rid].outputs):
            assert x.token_ids == y.token_ids, rid
            if x.logprobs is not None:
                for px, py in zip(x.logprobs, y.logprobs):
                    for tok, lp in px.items():
                        assert tok in py and abs(lp.logprob - py[tok].logprob) < tol, rid


def save_random_llama(path: Path, *, heads: int, kv_heads: int, tied: bool) -> str:
    """A 2-layer Llama with head_dim 16 and the embedded tokenizer's vocabulary (seeded). Tied
    embeddings are scaled up, as in tests/tiny_models.py: no near-ties in greedy argmax."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152,  # the embedded tokenizer's
        hidden_size=16 * heads,
        intermediate_size=32 * heads,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=512,
        tie_word_embeddings=tied,
    )
    model = LlamaForCausalLM(config)
    if tied:
        with torch.no_grad():
            model.get_input_embeddings().weight.mul_(40.0)
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def random_llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_random_llama(tmp_path_factory.mktemp("random-llama"), heads=4, kv_heads=2, tied=False)


@pytest.fixture(scope="module")
def llama_engines(random_llama: str) -> Iterator[tuple[LLMEngine, LLMEngine]]:
    kw = {**ENGINE, "model": random_llama, "tokenizer": resolve_model(None)}
    one = LLMEngine(**kw)
    two = LLMEngine(**kw, tensor_parallel_size=2)
    try:
        yield one, two
    finally:
        two.shutdown()
        one.shutdown()


def test_two_ranks_give_one_ranks_tokens_and_split_the_kv(llama_engines: tuple[LLMEngine, LLMEngine]) -> None:
    one, two = llama_engines
    assert two.runner.num_kv_heads == one.runner.num_kv_heads // 2
    assert two.runner.num_blocks == one.runner.num_blocks
    assert two.runner.kv_cache_bytes * 2 == one.runner.kv_cache_bytes
    assert_same(run(one, PROMPTS), run(two, PROMPTS))


def test_prompt_logprobs_under_tp_match_one_rank(llama_engines: tuple[LLMEngine, LLMEngine]) -> None:
    # Rank 0 splits the LM head's rows (worker/head_rows.py: the prompt rows' hidden states, its
    # replicated head applied in compute()); the workers, given the broadcast step, compute every
    # row's logits and drop them. The second run takes the split (the first one checks the model).
    one, two = llama_engines
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=2)
    for _ in range(2):
        a, b = run(one, PROMPTS, params), run(two, PROMPTS, params)
        assert_same(a, b)
        for rid in a:
            x, y = a[rid].prompt_logprobs, b[rid].prompt_logprobs
            assert x is not None and y is not None and len(x) == len(y) and x[0] is None and y[0] is None
            for ex, ey in zip(x[1:], y[1:]):
                assert ex is not None and ey is not None
                for tok, lp in ex.items():
                    assert tok in ey and abs(lp.logprob - ey[tok].logprob) < 1e-3, rid
    assert two.runner._head_split.plain is True


def test_preemption_prefix_hits_and_parallel_samples_under_tp(llama_engines: tuple[LLMEngine, LLMEngine]) -> None:
    one, two = llama_engines
    shared = "In a paged KV cache, the block table of every sequence maps its logical blocks to " * 2
    prompts = [shared + f"request number {i}" for i in range(8)]
    long = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    a, b = run(one, prompts, long), run(two, prompts, long)
    assert_same(a, b)
    # 48 blocks cannot hold 8 x (~40 + 100) tokens: both engines preempt, and hit the prefix.
    for engine in (one, two):
        stats = engine.get_stats()
        assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert one.get_stats()["num_preemptions"] == two.get_stats()["num_preemptions"]
    sampled = SamplingParams(n=3, max_tokens=8, temperature=0.9, seed=11)
    assert_same(run(one, PROMPTS[:2], sampled), run(two, PROMPTS[:2], sampled))
    for engine in (one, two):
        assert engine.get_stats()["num_used_blocks"] == 0
        engine.scheduler.check_invariants()


def test_speculative_decoding_under_tp(random_llama: str, llama_engines: tuple[LLMEngine, LLMEngine]) -> None:
    """n-gram drafts verified across two ranks: the tokens of one rank without speculation."""
    one, _ = llama_engines
    spec_config = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "adaptive": False}
    spec = LLMEngine(
        **ENGINE,
        model=random_llama,
        tokenizer=resolve_model(None),
        tensor_parallel_size=2,
        speculative_config=spec_config,
    )
    try:
        params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=2)
        assert_same(run(one, PROMPTS, params), run(spec, PROMPTS, params))
        stats = spec.get_stats()
        assert stats["num_spec_accepted_tokens"] > 0 and stats["num_used_blocks"] == 0
    finally:
        spec.shutdown()


def test_three_ranks_of_a_smollm2_shaped_model(tmp_path: Path) -> None:
    # 9 heads, 3 KV heads, tied embeddings (SmolLM2-135M's shape): one KV head per rank.
    model = save_random_llama(tmp_path / "llama-9-3", heads=9, kv_heads=3, tied=True)
    kw = {**ENGINE, "model": model, "tokenizer": resolve_model(None)}
    one = LLMEngine(**kw)
    three = LLMEngine(**kw, tensor_parallel_size=3)
    try:
        assert three.runner.num_kv_heads == 1 and three.runner.kv_cache_bytes * 3 == one.runner.kv_cache_bytes
        assert_same(run(one, PROMPTS), run(three, PROMPTS))
    finally:
        three.shutdown()
        one.shutdown()


def test_int8_kv_and_a_host_tier_under_tp(random_llama: str) -> None:
    kw = {**ENGINE, "model": random_llama, "tokenizer": resolve_model(None)}
    kw |= {"kv_cache_dtype": "int8", "num_host_blocks": 16, "preemption_mode": "swap", "num_blocks": 24}
    one = LLMEngine(**kw)
    two = LLMEngine(**kw, tensor_parallel_size=2)
    try:
        prompts = [f"Swap test {i}: " + PROMPTS[i % len(PROMPTS)] for i in range(8)]
        params = SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True, logprobs=3)
        # int8 KV: a last-bit difference before quantization can move a value one grid step.
        assert_same(run(one, prompts, params), run(two, prompts, params), tol=0.1)
        assert two.get_stats()["num_swap_preemptions"] > 0
    finally:
        two.shutdown()
        one.shutdown()


def test_bad_sizes_are_refused(random_llama: str) -> None:
    kw = {**ENGINE, "model": random_llama, "tokenizer": resolve_model(None)}
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        LLMEngine(**kw, tensor_parallel_size=0)
    with pytest.raises(ConfigError, match=r"sizes that work for this model: \[1, 2\]"):
        LLMEngine(**kw, tensor_parallel_size=3)
    with pytest.raises(ConfigError, match="distributed_executor_backend"):
        LLMEngine(**kw, tensor_parallel_size=2, distributed_executor_backend="threads")
    with pytest.raises(ConfigError, match="kv_transfer_config"):
        LLMEngine(**kw, tensor_parallel_size=2, kv_transfer_config={"role": "producer"})


def test_ray_requested_but_not_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from pagedkv.config import ParallelConfig

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    with pytest.raises(ConfigError, match=r"pagedkv\[ray\]"):
        ParallelConfig(tensor_parallel_size=2, distributed_executor_backend="ray")


def test_async_streams_end_with_engine_dead_when_a_worker_dies(random_llama: str) -> None:
    import asyncio

    from pagedkv import AsyncLLM
    from pagedkv.engine.args import EngineArgs

    engine = AsyncLLM.from_engine_args(
        EngineArgs(**ENGINE, model=random_llama, tokenizer=resolve_model(None), tensor_parallel_size=2)
    )
    executor = engine.engine.executor
    assert executor is not None

    async def go() -> None:
        stream = await engine.add_request("Hello", SamplingParams(max_tokens=200, ignore_eos=True))
        got = 0
        with pytest.raises(EngineDeadError, match="worker rank 1"):
            async for _ in stream:
                got += 1
                if got == 3:
                    executor.processes[0].kill()
        assert got >= 3

    try:
        asyncio.run(asyncio.wait_for(go(), TIMEOUT))
        assert not engine.is_running
    finally:
        engine.shutdown()
    assert not any(executor.alive())


def test_ray_executor_gives_the_same_tokens_as_mp(
    random_llama: str, llama_engines: tuple[LLMEngine, LLMEngine]
) -> None:
    import ray

    from pagedkv.parallel.ray_executor import RayExecutor

    # One CPU: room for one worker rank (TP = 2), not two. The mp engine of llama_engines sits idle
    # meanwhile (a first Ray start on a machine is slow): its workers keep waiting for steps.
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        # SmolLM2 divides by 3, but its two worker ranks do not fit: refused before any placement.
        with pytest.raises(ConfigError, match=r"needs 2 CPU for its 2 worker ranks .* the Ray cluster has 1"):
            LLMEngine(**ENGINE, tensor_parallel_size=3, distributed_executor_backend="ray")
        kw = {**ENGINE, "model": random_llama, "tokenizer": resolve_model(None)}
        engine = LLMEngine(**kw, tensor_parallel_size=2, distributed_executor_backend="ray")
        executor = engine.executor
        assert isinstance(executor, RayExecutor)
        try:
            assert_same(run(engine, PROMPTS), run(llama_engines[1], PROMPTS))
            assert executor.failures() == []
        finally:
            engine.shutdown()
        # The engine joined this Ray instance, so it leaves it running, with its actors gone.
        assert ray.is_initialized()
        assert not any(executor.alive())
    finally:
        ray.shutdown()


def test_a_worker_killed_mid_generation_stops_the_engine_cleanly(
    llama_engines: tuple[LLMEngine, LLMEngine],
) -> None:
    # The last user of llama_engines (after the Ray test): it kills the TP = 2 engine's worker.
    engine = llama_engines[1]
    executor = engine.executor
    assert executor is not None
    try:
        for i, p in enumerate(PROMPTS):
            engine.add_request(f"k{i}", p, SamplingParams(max_tokens=100, ignore_eos=True))
        engine.step()
        engine.step()
        executor.processes[0].kill()
        executor.processes[0].wait(10)
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError, match="worker rank 1"):
            for _ in range(5):
                engine.step()
        assert time.monotonic() - t0 < 60
        with pytest.raises(EngineDeadError):  # every later step too
            engine.step()
        assert not any(executor.alive())
    finally:
        engine.shutdown()
    assert not any(executor.alive())


def test_serve_with_two_ranks_answers_and_leaves_no_process(random_llama: str) -> None:
    import os

    httpx = pytest.importorskip("httpx")
    from pagedkv.server.launch import ServerProcess

    flags = [random_llama, "--tokenizer", resolve_model(None), "--tensor-parallel-size", "2"]
    flags += ["--device", "cpu", "--dtype", "float32", "--num-blocks", "64", "--max-model-len", "256"]
    server = ServerProcess(flags, env={"OMP_NUM_THREADS": "1"}, start_timeout=3 * TIMEOUT)  # ranks load on a busy CPU
    with server:
        r = httpx.post(
            server.url + "/v1/completions",
            json={"prompt": "The capital of France is", "max_tokens": 5, "temperature": 0, "ignore_eos": True},
            timeout=TIMEOUT,
        )
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 5
        pgid = server.process.pid  # type: ignore[union-attr]
    # The server's process group (its workers included) is gone after a graceful stop.
    deadline = time.monotonic() + 30
    while True:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            break
        assert time.monotonic() < deadline, "a process of the server's group is still running"
        time.sleep(0.2)


class _Recorder:
    """Records what a broadcast root sends, or plays it back to a receiver (packing test)."""

    device = torch.device("cpu")

    def __init__(self, sent: list[torch.Tensor] | None = None) -> None:
        self.sent: list[torch.Tensor] = [] if sent is None else sent
        self.replay = sent is not None

    def broadcast(self, tensor: torch.Tensor, src: int = 0, *, wait_forever: bool = False) -> torch.Tensor:
        if self.replay:
            return tensor.copy_(self.sent.pop(0))
        self.sent.append(tensor.clone())
        return tensor


@pytest.mark.parametrize("rows", [3, 2000])
def test_a_step_packs_into_one_frame_unless_it_is_large(rows: int) -> None:
    import numpy as np

    from pagedkv.parallel.step_broadcast import FRAME, recv_step, send_step

    class Step:
        input_ids = np.arange(7)
        positions = np.arange(7)
        slot_mapping = np.arange(7) + 100
        logits_indices = np.array([6])
        cu_seqlens_q = np.array([0, 7], dtype=np.int32)
        seq_lens = np.array([7], dtype=np.int32)
        block_tables = np.arange(rows * 9, dtype=np.int32).reshape(rows, 9)
        copy_ops = np.array([[1, 2], [3, 4]], dtype=np.int32)
        swap_out = np.zeros((0, 2), dtype=np.int32)
        swap_in = disk_store = disk_load = np.zeros((0, 2), dtype=np.int32)

    sender = _Recorder()
    send_step(sender, Step)  # type: ignore[arg-type]
    assert len(sender.sent) == (1 if rows * 9 < FRAME - 64 else 2) and sender.sent[0].numel() == FRAME
    got = recv_step(_Recorder(sender.sent))  # type: ignore[arg-type]
    assert got is not None
    for name in ("input_ids", "slot_mapping", "cu_seqlens_q", "block_tables", "copy_ops", "swap_out"):
        assert np.array_equal(getattr(got, name), getattr(Step, name)), name
    assert got.swap_in.shape == (0, 2) and got.disk_load.shape == (0, 2)
    assert got.block_tables.dtype == np.int32 and got.input_ids.dtype == np.int64
