"""Decode steps through the CUDA-graph machinery (pagedkv.worker.decode_graphs) on the CPU:
``enable_decode_graphs(capture=False)`` keeps everything a replay relies on (static buffers,
padding rows up to the bucket, metadata built once per bucket without host facts) and runs the
forward on the buffers where a GPU would replay the graph. The capture itself is checked on a
GPU by benches/gpu_check.py (section ``cuda_graphs``)."""

from __future__ import annotations

import pytest
import torch
from test_attention_types import _assert_pool_whole

from pagedkv import LLM, SamplingParams
from pagedkv.worker.decode_graphs import DecodeGraphs, capture_sizes
from pagedkv.worker.model_files import default_model_dir


def test_capture_sizes() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = capture_sizes(1000)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256 and all(b - a == 8 for a, b in zip(sizes[3:], sizes[4:]))


class _Replays:
    """Records the batch size of every step that went through the graphs."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, graphs: DecodeGraphs) -> None:
        self.batches: list[int] = []
        run = graphs.run

        def counting(input_ids: torch.Tensor, *args: torch.Tensor) -> torch.Tensor:
            self.batches.append(input_ids.shape[0])
            return run(input_ids, *args)

        monkeypatch.setattr(graphs, "run", counting)


def _prompts_and_params() -> tuple[list[str], list[SamplingParams]]:
    """Five requests that end at different steps, so the decode batch shrinks 5 -> 3 -> 1 and
    runs in buckets 8, 4 and 1 with 3, 1 and 0 padding rows."""
    prompts = ["Hello, my name is", "The capital of France is", "1, 2, 3,", "one two three " * 6, "Once upon"]
    lengths = [12, 6, 12, 6, 20]
    return prompts, [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=1) for n in lengths]


@pytest.mark.parametrize("extra", [{}, {"kv_cache_dtype": "int8"}], ids=["float32", "int8-kv"])
def test_graphed_decodes_generate_what_eager_does(
    tiny_model: str, monkeypatch: pytest.MonkeyPatch, extra: dict
) -> None:
    prompts, params = _prompts_and_params()
    common = {"model": tiny_model, "tokenizer": str(default_model_dir()), "dtype": "float32", "device": "cpu"}
    common |= {"max_model_len": 256, "kv_cache_memory": 16 << 20, "max_num_seqs": 8} | extra
    eager = LLM(**common).generate(prompts, params, use_tqdm=False)
    llm = LLM(**common)
    runner = llm.llm_engine.runner
    runner.enable_decode_graphs(capture=False)
    assert runner.decode_graphs is not None and runner.decode_graphs.sizes == [1, 2, 4, 8]
    replays = _Replays(monkeypatch, runner.decode_graphs)
    graphed = llm.generate(prompts, params, use_tqdm=False)
    for got, want in zip(graphed, eager):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        got_lp = [next(iter(e.values())).logprob for e in got.outputs[0].logprobs]
        want_lp = [next(iter(e.values())).logprob for e in want.outputs[0].logprobs]
        assert got_lp == pytest.approx(want_lp, abs=1e-4)
    # Padded buckets were used (5 in 8, 3 in 4) and one sequence alone (bucket 1); prompt
    # steps ran the usual way.
    assert {5, 3, 1} <= set(replays.batches)
    assert sum(replays.batches) < sum(p.max_tokens for p in params)  # first tokens come from prompt steps
    _assert_pool_whole(llm)  # every block back


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_graphed_decodes_with_kv_cache_groups(tmp_path, monkeypatch: pytest.MonkeyPatch, kv_cache_dtype: str) -> None:
    """Sliding-window and full layers in columns of their own (tiny Gemma 2, whose tokens follow
    its attention closely): every decode step graphed, over prompts several windows long, gives
    transformers' greedy tokens and logprobs (float KV), or the ungraphed engine's (int8 KV)."""
    from test_attention_types import GREEDY, PROMPTS, _build, _check_greedy, _engine, _greedy_reference, _reference

    folder = _build(tmp_path / "gemma2", "gemma2")
    if kv_cache_dtype == "auto":
        expected = [_greedy_reference(_reference(folder), p) for p in PROMPTS]
    else:
        outs = _engine(folder, kv_cache_dtype=kv_cache_dtype).generate(
            [{"prompt_token_ids": p} for p in PROMPTS], GREEDY
        )
        expected = [
            (o.outputs[0].token_ids, [e[t].logprob for e, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outs
        ]
    llm = _engine(folder, kv_cache_dtype=kv_cache_dtype)
    runner = llm.llm_engine.runner
    assert runner.kv_layout.num_kv_groups > 1
    runner.enable_decode_graphs(capture=False)
    assert runner.decode_graphs is not None
    replays = _Replays(monkeypatch, runner.decode_graphs)
    _check_greedy(llm, expected)
    assert len(PROMPTS) in replays.batches
    _assert_pool_whole(llm)


def test_a_captured_step_needs_contiguous_metadata_on_the_caches_device() -> None:
    """``prepare(static_bounds=...)`` keeps the tensors it is given (a graph reads their
    addresses): a non-contiguous table or host slots for a device cache are a typed error."""
    import pagedkv
    from pagedkv.kernels import get_backend

    backend = get_backend(torch.device("cpu"), "torch")
    key_cache = torch.zeros(4, 16, 1, 8)
    tables = torch.zeros(2, 6, dtype=torch.int32)[:, ::2]  # a strided view
    args = (torch.full((2,), -1, dtype=torch.int64), tables, torch.ones(2, dtype=torch.int32))
    with pytest.raises(pagedkv.InvalidArgumentError, match="block_tables must be contiguous"):
        backend.prepare(
            *args,
            torch.arange(3, dtype=torch.int32),
            num_tokens=2,
            key_cache=key_cache,
            value_cache=key_cache.clone(),
            dtype=torch.float32,
            static_bounds=(1, 48),
        )


def test_a_failure_in_a_graphed_step_leaves_the_engine_serving(
    tiny_model: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An exception inside a graphed decode step is a failed step like any other: the engine
    retries it, the requests finish with eager's tokens, and no block is lost."""
    prompts, params = _prompts_and_params()
    common = {"model": tiny_model, "tokenizer": str(default_model_dir()), "dtype": "float32", "device": "cpu"}
    common |= {"max_model_len": 256, "kv_cache_memory": 16 << 20, "max_num_seqs": 8}
    eager = LLM(**common).generate(prompts, params, use_tqdm=False)
    llm = LLM(**common)
    runner = llm.llm_engine.runner
    runner.enable_decode_graphs(capture=False)
    assert runner.decode_graphs is not None
    run = runner.decode_graphs.run
    failures = []

    def failing_once(*args: torch.Tensor) -> torch.Tensor:
        if not failures:
            failures.append(args[0].shape[0])
            raise RuntimeError("graph replay failure (injected)")
        return run(*args)

    monkeypatch.setattr(runner.decode_graphs, "run", failing_once)
    graphed = llm.generate(prompts, params, use_tqdm=False)
    assert failures  # the failure happened in a graphed step
    assert [o.outputs[0].token_ids for o in graphed] == [o.outputs[0].token_ids for o in eager]
    _assert_pool_whole(llm)
