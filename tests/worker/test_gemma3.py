"""The embedded Gemma 3 270M (15 of its 18 layers slide over a 512-token window) through the
engine: greedy tokens and logprobs equal transformers' on prompts longer than the window,
prefilled in chunks that cross the window's edge."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedkv import LLM, SamplingParams

MAX_NEW = 8
WINDOW = 512
# ~700 tokens of plain English prose (the README's opening), and a short prompt beside it.
README_TEXT = (
    "Serve large language models on a paged KV cache. Instead of reserving one contiguous KV region "
    "per request for its maximum length, pagedkv stores keys and values in fixed-size blocks: a "
    "sequence is logically contiguous but physically scattered, a block table maps its logical "
    "blocks to physical ones, blocks are allocated as the sequence grows and go back to a free pool "
    "when it finishes, and blocks are shared between sequences by reference count with copy-on-write. "
)


@pytest.fixture(scope="module")
def gemma(gemma_model: str) -> tuple[str, LLM]:
    llm = LLM(
        gemma_model,
        dtype="float32",
        device="cpu",
        max_model_len=1024,
        max_num_batched_tokens=256,  # the long prompt's prefill crosses the window in chunks
        kv_cache_memory=96 << 20,
    )
    return gemma_model, llm


def test_sliding_layers_are_read_from_the_config(gemma: tuple[str, LLM]) -> None:
    _, llm = gemma
    windows = [layer.sliding_window for layer in llm.llm_engine.runner.layer_attention]
    assert windows == [None if (i + 1) % 6 == 0 else WINDOW for i in range(18)]


def test_greedy_equals_transformers_past_the_window(gemma: tuple[str, LLM]) -> None:
    folder, llm = gemma
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer(README_TEXT * 9).input_ids[:700], tokenizer("The capital of France is").input_ids]
    assert len(prompts[0]) == 700 > WINDOW
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, logprobs=0),
    )
    for out, prompt in zip(outs, prompts):
        with torch.inference_mode():
            ref = reference.generate(
                torch.tensor([prompt]),
                max_new_tokens=MAX_NEW,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                eos_token_id=None,
                pad_token_id=0,
            )
        tokens = ref.sequences[0, len(prompt) :].tolist()
        completion = out.outputs[0]
        assert completion.token_ids == tokens
        want = [torch.log_softmax(step[0], -1)[t].item() for step, t in zip(ref.logits, tokens)]
        got = [entry[t].logprob for entry, t in zip(completion.logprobs, tokens)]
        assert got == pytest.approx(want, abs=1e-3)
    stats = llm.llm_engine.get_stats()
    assert stats["num_free_blocks"] == stats["num_blocks"]
