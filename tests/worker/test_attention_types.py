"""Models whose layers do not all attend to the whole context, served end to end.

Tiny random-weight models of eight architectures, built offline with ``from_config``, each
with a 12-token window (or 16-token chunk) on 8-slot blocks, so windows end on and off block
boundaries and prompts are several windows long:

* gemma2 (every other layer sliding, logit soft-capping on all, final logit soft-capping),
* gemma3_text (three sliding layers to one full), cohere2 and olmo3 (the same pattern),
* mistral (every layer sliding, no ``layer_types``),
* qwen2 with ``use_sliding_window`` (the layers from ``max_window_layers`` on slide),
* gpt_oss (alternating sliding and full, attention sinks on every layer),
* llama4_text (chunked local attention on three layers of four).

Their greedy tokens equal transformers' ``generate`` on the same weights (eager attention, its
own masks), and their logprobs agree within float tolerance: alone with chunked prefill, on a
second run that starts on prefix-cache hits, under preemption (recompute and swap), with
``n > 1`` and with beam search; with an int8 KV cache, teacher-forced top-1 agreement; over two
tensor-parallel ranks; and through the Triton kernels (the interpreter on the CPU).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_models import save_seeded
from transformers import AutoConfig, AutoModelForCausalLM

from pagedkv import LLM, BeamSearchParams, SamplingParams
from pagedkv.worker.model_files import default_model_dir

VOCAB = 512
WINDOW = 12
CHUNK = 16
BLOCK = 8
MAX_NEW = 10
# Several windows long: 57 tokens span five windows and a part; prefilled in 32-token chunks.
PROMPTS = [[(7 * i + 3 * j) % (VOCAB - 10) + 5 for j in range(n)] for i, n in enumerate((40, 57, 9))]
_SLIDING_THEN_FULL = ["sliding_attention"] * 3 + ["full_attention"]
_BASE = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
}
ARCHITECTURES: dict[str, dict] = {
    "gemma2": {
        "sliding_window": WINDOW,
        "attn_logit_softcapping": 20.0,
        "final_logit_softcapping": 30.0,
        "query_pre_attn_scalar": 16,
    },
    "gemma3_text": {"sliding_window": WINDOW, "layer_types": _SLIDING_THEN_FULL, "query_pre_attn_scalar": 16},
    "cohere2": {"sliding_window": WINDOW, "layer_types": _SLIDING_THEN_FULL},
    "olmo3": {"sliding_window": WINDOW, "layer_types": _SLIDING_THEN_FULL},
    "mistral": {"sliding_window": WINDOW},
    "qwen2": {"sliding_window": WINDOW, "use_sliding_window": True, "max_window_layers": 2},
    "gpt_oss": {"sliding_window": WINDOW, "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 64},
    "llama4_text": {
        "attention_chunk_size": CHUNK,
        "no_rope_layers": [1, 1, 1, 0],
        "intermediate_size_mlp": 128,
        "num_local_experts": 2,
        "interleave_moe_layer_step": 2,
    },
}
# What each architecture's layers must come out as: (window, chunk, soft-cap, has sinks).
EXPECTED_LAYERS: dict[str, list[tuple]] = {
    "gemma2": [(WINDOW, None, 20.0, False), (None, None, 20.0, False)] * 2,
    "gemma3_text": [(WINDOW, None, None, False)] * 3 + [(None, None, None, False)],
    "cohere2": [(WINDOW, None, None, False)] * 3 + [(None, None, None, False)],
    "olmo3": [(WINDOW, None, None, False)] * 3 + [(None, None, None, False)],
    "mistral": [(WINDOW, None, None, False)] * 4,
    "qwen2": [(None, None, None, False)] * 2 + [(WINDOW, None, None, False)] * 2,
    "gpt_oss": [(WINDOW, None, None, True), (None, None, None, True)] * 2,
    "llama4_text": [(None, CHUNK, None, False)] * 3 + [(None, None, None, False)],
}
ENGINE_ARGS = {
    "dtype": "float32",
    "device": "cpu",
    "max_model_len": 128,
    "block_size": BLOCK,
    "max_num_batched_tokens": 32,
    "kv_cache_memory": 4 << 20,
}


def _build(folder: Path, model_type: str) -> str:
    save_seeded(AutoConfig.for_model(model_type, **{**_BASE, **ARCHITECTURES[model_type]}), folder, embedding_scale=8.0)
    return str(folder)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("attention_types")
    return {name: _build(root / name, name) for name in ARCHITECTURES}


def _engine(folder: str, **overrides: object) -> LLM:
    args = {**ENGINE_ARGS, **overrides}
    if "num_blocks" in args:
        args.pop("kv_cache_memory")
    return LLM(folder, tokenizer=str(default_model_dir()), **args)


def _reference(folder: str) -> AutoModelForCausalLM:
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()


def _generate(model: AutoModelForCausalLM, prompt: list[int], **kwargs: object) -> object:
    """transformers' ``generate`` of MAX_NEW tokens, eos never ending it."""
    with torch.inference_mode():
        return model.generate(
            torch.tensor([prompt]),
            max_new_tokens=MAX_NEW,
            do_sample=False,
            return_dict_in_generate=True,
            pad_token_id=0,
            eos_token_id=None,
            **kwargs,
        )


def _greedy_reference(model: AutoModelForCausalLM, prompt: list[int]) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens and their logprobs (from the raw, soft-capped logits)."""
    out = _generate(model, prompt, output_logits=True)
    tokens = out.sequences[0, len(prompt) :].tolist()
    logprobs = [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(out.logits, tokens)]
    return tokens, logprobs


def _assert_pool_whole(llm: LLM) -> None:
    llm.llm_engine.scheduler.check_invariants()
    stats = llm.llm_engine.get_stats()
    assert stats["num_free_blocks"] == stats["num_blocks"] and stats["num_running"] == 0, stats


GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, logprobs=0)


def _check_greedy(llm: LLM, expected: list[tuple[list[int], list[float]]], params: SamplingParams = GREEDY) -> None:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    for out, (tokens, logprobs) in zip(outs, expected):
        assert len(out.outputs) == params.n
        for completion in out.outputs:
            assert completion.token_ids == tokens
            got = [entry[t].logprob for entry, t in zip(completion.logprobs, tokens)]
            assert got == pytest.approx(logprobs, abs=2e-4)


@pytest.mark.parametrize("model_type", list(ARCHITECTURES))
def test_greedy_and_logprobs_equal_transformers(models: dict[str, str], model_type: str) -> None:
    folder = models[model_type]
    expected = [_greedy_reference(_reference(folder), p) for p in PROMPTS]
    llm = _engine(folder)
    layers = llm.llm_engine.runner.layer_attention
    got = [(la.sliding_window, la.chunk_size, la.logits_soft_cap, la.sinks is not None) for la in layers]
    assert got == EXPECTED_LAYERS[model_type]
    _check_greedy(llm, expected)  # prompts prefilled in 32-token chunks
    # Again: the prompts' full blocks are prefix-cache hits now.
    hits_before = llm.llm_engine.get_stats()["prefix_cache_hits"]
    _check_greedy(llm, expected)
    assert llm.llm_engine.get_stats()["prefix_cache_hits"] > hits_before
    _assert_pool_whole(llm)


def _peak_kv_bytes(llm: LLM, prompt: list[int]) -> tuple[list[int], int]:
    """Greedy tokens of one request run step by step, and the most KV bytes in use at a step."""
    engine = llm.llm_engine
    engine.add_request(
        "peak", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    )
    peak, tokens = 0, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = out.outputs[0].token_ids
        stats = engine.get_stats()
        peak = max(peak, (stats["num_blocks"] - stats["num_free_blocks"]) * engine.runner.bytes_per_block)
    return list(tokens), peak


@pytest.mark.parametrize("model_type", ["gemma3_text", "mistral", "llama4_text"])
def test_kv_cache_groups_hold_less_and_change_nothing(models: dict[str, str], model_type: str) -> None:
    """With KV cache groups (the default) the sliding and chunked layers give back the blocks
    behind their window: the same tokens as every layer whole, in less KV memory."""
    folder = models[model_type]
    grouped = _engine(folder)
    whole = _engine(folder, disable_hybrid_kv_cache_manager=True)
    assert grouped.llm_engine.runner.kv_layout.grouped
    assert grouped.llm_engine.runner.kv_layout_note.startswith("KV cache groups:")
    assert not whole.llm_engine.runner.kv_layout.grouped
    assert whole.llm_engine.runner.kv_layout_note.startswith("every layer whole: KV cache groups are off")
    prompt = PROMPTS[1]  # 57 tokens, then 40 more: several windows and chunks
    tokens, grouped_peak = _peak_kv_bytes(grouped, prompt)
    whole_tokens, whole_peak = _peak_kv_bytes(whole, prompt)
    assert tokens == whole_tokens
    assert grouped_peak < whole_peak, (grouped_peak, whole_peak)
    for llm in (grouped, whole):
        _assert_pool_whole(llm)


# Soft-capping with windows, sinks with windows, chunks: the three kinds of variant.
VARIANT_MODELS = ["gemma2", "gpt_oss", "llama4_text"]


@pytest.mark.parametrize("model_type", VARIANT_MODELS)
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_and_forks_keep_the_variants(models: dict[str, str], model_type: str, mode: str) -> None:
    folder = models[model_type]
    expected = [_greedy_reference(_reference(folder), p) for p in PROMPTS]
    # Every layer whole, 14 blocks of 8 slots: three prompts of 40, 57 and 9 tokens with n = 2
    # cannot all stay. With KV cache groups a block is a page of some layers and the sliding
    # columns give blocks back: a pool of two pages more than one 96-token request holds.
    llm = _engine(folder, max_model_len=96)
    spans = llm.llm_engine.runner.kv_layout.kv_groups
    pages = llm.llm_engine.scheduler.config.blocks_for_sequence(96) + 2 if len(spans) > 1 else 14
    llm = _engine(
        folder, num_blocks=pages, max_model_len=96, preemption_mode=mode, num_host_blocks=32 if mode == "swap" else 0
    )
    _check_greedy(llm, expected, SamplingParams(n=2, max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, logprobs=0))
    stats = llm.llm_engine.get_stats()
    assert stats["num_preemptions"] > 0
    if mode == "swap":
        assert stats["num_swap_preemptions"] > 0
    _assert_pool_whole(llm)


def _reference_beams(model: AutoModelForCausalLM, prompt: list[int], width: int) -> list[tuple[list[int], float]]:
    out = _generate(
        model, prompt, num_beams=width, num_return_sequences=width, min_new_tokens=MAX_NEW, output_scores=True
    )
    return list(zip(out.sequences[:, len(prompt) :].tolist(), out.sequences_scores.tolist()))


@pytest.mark.parametrize("model_type", VARIANT_MODELS)
def test_beam_search_equals_transformers(models: dict[str, str], model_type: str) -> None:
    folder = models[model_type]
    reference = _reference(folder)
    llm = _engine(folder)
    outs = llm.beam_search(
        [{"prompt_token_ids": p} for p in PROMPTS[:2]],
        BeamSearchParams(beam_width=3, max_tokens=MAX_NEW, ignore_eos=True),
    )
    for out, prompt in zip(outs, PROMPTS):
        beams = _reference_beams(reference, prompt, 3)
        assert [s.output_token_ids for s in out.sequences] == [ids for ids, _ in beams]
        assert [s.score for s in out.sequences] == pytest.approx([score for _, score in beams], abs=1e-4)
    _assert_pool_whole(llm)


@pytest.mark.parametrize("model_type", VARIANT_MODELS)
def test_int8_kv_agrees_teacher_forced(models: dict[str, str], model_type: str) -> None:
    """Each position's top-1 under an int8 KV cache against transformers' float argmax, the
    reference continuation fed as the prompt (chunked: later chunks read quantized keys)."""
    folder = models[model_type]
    reference = _reference(folder)
    sequences = [p + _greedy_reference(reference, p)[0] for p in PROMPTS[:2]]
    llm = _engine(folder, kv_cache_dtype="int8")
    outs = llm.generate(
        [{"prompt_token_ids": s} for s in sequences],
        SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1),
    )
    agree = total = 0
    for out, sequence in zip(outs, sequences):
        with torch.inference_mode():
            want = reference(torch.tensor([sequence])).logits[0].argmax(-1).tolist()
        for position, entry in enumerate(out.prompt_logprobs[1:]):
            top = max(entry.items(), key=lambda item: item[1].logprob)[0]
            agree += top == want[position]
            total += 1
    assert total == sum(len(s) - 1 for s in sequences)
    assert agree / total >= 0.97, f"{agree}/{total}"
    _assert_pool_whole(llm)


def test_tensor_parallel_splits_the_heads_of_a_soft_capped_windowed_model(models: dict[str, str]) -> None:
    """gemma2 over two ranks (two query heads and one KV head each): transformers' tokens."""
    folder = models["gemma2"]
    expected = [_greedy_reference(_reference(folder), p) for p in PROMPTS]
    llm = _engine(folder, tensor_parallel_size=2)
    try:
        assert llm.llm_engine.runner.num_kv_heads == 1
        assert llm.llm_engine.runner.kv_layout.num_kv_groups == 2  # KV cache groups over the ranks
        assert [la.logits_soft_cap for la in llm.llm_engine.runner.layer_attention] == [20.0] * 4
        _check_greedy(llm, expected)
        _assert_pool_whole(llm)
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.parametrize("model_type", ["gemma2", "gpt_oss"])
def test_triton_kernels_serve_the_variants(tmp_path: Path, model_type: str) -> None:
    """The same through the Triton kernels (the interpreter here; head_dim 64, which Triton
    takes): soft-capping with windows, sinks with windows."""
    config = AutoConfig.for_model(model_type, **{**_BASE, **ARCHITECTURES[model_type], "head_dim": 64})
    folder = str(tmp_path / model_type)
    save_seeded(config, Path(folder), embedding_scale=8.0)
    expected = [_greedy_reference(_reference(folder), p) for p in PROMPTS]
    llm = _engine(folder, attention_backend="triton")
    assert llm.llm_engine.runner.attention_backend == "triton"
    _check_greedy(llm, expected)
    _assert_pool_whole(llm)
