"""Greedy equality with transformers: the token ids `pagedkv.LLM` generates for a batch of
prompts of different lengths equal those of `model.generate(do_sample=False)` run one prompt at
a time — with prefix caching on and off, with a KV pool small enough to force preemption, with
chunked prefill forced by a small token budget, and with block sizes 16 and 32 (float32, CPU).
The embedded SmolLM2 runs the plain and the preemption cases; the other cache configurations
(swap, host and disk tiers, chunked prefill) run on a tiny random model (tests/tiny_models.py):
what they exercise is the KV bookkeeping, which does not depend on the weights."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pagedkv import LLM, SamplingParams
from pagedkv.worker.model_files import default_model_dir

MAX_NEW = 12
SYSTEM = (
    "You are a helpful assistant. You answer questions about science, geography, art and history "
    "briefly and precisely, in one sentence, without repeating the question. Question: "
)
TEXTS = [
    "Hello, my name is",
    "The capital of France is",
    "def fibonacci(n):",
    "In 1492, Columbus",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "Water boils at",
    "List three primary colors:",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    SYSTEM + "What is the tallest mountain on Earth?",
    SYSTEM + "Name a famous painting by Leonardo da Vinci.",
    SYSTEM + "How many legs does a spider have?",
    SYSTEM + "What language is spoken in Brazil?",
    "1, 2, 3, 4, 5,",
    "Photosynthesis is the process by which",
    "import numpy as np\nx = np.arange(10)\nprint(",
    "The mitochondria is",
    "A haiku about autumn:\n",
]


@pytest.fixture(scope="module")
def references() -> Callable[[str], list[list[int]]]:
    """transformers' own greedy generation, one prompt at a time, per model folder (computed
    once each). Past the end-of-text token too: the engine runs with ``ignore_eos``."""
    tok = AutoTokenizer.from_pretrained(default_model_dir())
    cache: dict[str, list[list[int]]] = {}

    def reference(folder: str) -> list[list[int]]:
        if folder not in cache:
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
            out = []
            with torch.inference_mode():
                for text in TEXTS:
                    ids = tok(text, return_tensors="pt").input_ids
                    gen = model.generate(
                        ids,
                        attention_mask=torch.ones_like(ids),
                        max_new_tokens=MAX_NEW,
                        do_sample=False,
                        eos_token_id=None,
                    )
                    out.append(gen[0, ids.shape[1] :].tolist())
            cache[folder] = out
        return cache[folder]

    return reference


SMOLLM2, TINY = "smollm2", "tiny"


@pytest.mark.parametrize(
    "model, engine_args",
    [
        pytest.param(SMOLLM2, {"block_size": 16, "enable_prefix_caching": True}, id="bs16-prefix-cache"),
        # The linears through oneDNN (logits differ from MKL's in the last bits; tokens must not).
        pytest.param(SMOLLM2, {"block_size": 16, "linear_kernel": "onednn"}, id="onednn-linears"),
        # torch's products (MKL) instead of the default, pagedkv's kernel at decode-sized products
        # (the same: last bits, not tokens).
        pytest.param(SMOLLM2, {"block_size": 16, "linear_kernel": "torch"}, id="torch-linears"),
        # The step's forward under torch.compile (a tiny model: compiling SmolLM2 takes a minute
        # here), with the default linears: pagedkv's kernel as the op pagedkv::cpu_linear.
        pytest.param(TINY, {"block_size": 16, "enforce_eager": False}, id="compiled"),
        # Compiled with torch's linears (a frozen graph).
        pytest.param(
            TINY, {"block_size": 16, "enforce_eager": False, "linear_kernel": "torch"}, id="compiled-torch-linears"
        ),
        pytest.param(TINY, {"block_size": 16, "enable_prefix_caching": False}, id="bs16-no-prefix-cache"),
        pytest.param(TINY, {"block_size": 32, "enable_prefix_caching": True}, id="bs32"),
        # 12 blocks x 16 = 192 slots for 17 requests of up to ~40 tokens each: preemption.
        pytest.param(SMOLLM2, {"block_size": 16, "num_blocks": 12, "max_model_len": 192}, id="preemption"),
        # The same pool with a host tier: victims swapped out and back, or chosen by cost.
        pytest.param(
            TINY,
            {
                "block_size": 16,
                "num_blocks": 12,
                "max_model_len": 192,
                "num_host_blocks": 64,
                "preemption_mode": "swap",
            },
            id="preemption-swap",
        ),
        pytest.param(
            TINY,
            {
                "block_size": 16,
                "num_blocks": 12,
                "max_model_len": 192,
                "num_host_blocks": 64,
                "preemption_mode": "auto",
            },
            id="preemption-auto",
        ),
        # A host tier too small for most victims: swaps fall back to recompute.
        pytest.param(
            TINY,
            {"block_size": 16, "num_blocks": 12, "max_model_len": 192, "num_host_blocks": 3, "preemption_mode": "swap"},
            id="preemption-swap-small-host",
        ),
        # Recompute preemption with a host prefix tier (evicted cached blocks written back, loaded on a hit).
        pytest.param(
            TINY,
            {"block_size": 16, "num_blocks": 12, "max_model_len": 192, "num_host_blocks": 64},
            id="host-prefix-tier",
        ),
        # A small host tier over a disk tier (kv_cache_dir: a temporary folder).
        pytest.param(
            TINY,
            {"block_size": 16, "num_blocks": 12, "max_model_len": 192, "num_host_blocks": 4, "kv_cache_dir": "TMP"},
            id="disk-tier",
        ),
        # 24-token budget: long prompts are prefilled in chunks across steps.
        pytest.param(TINY, {"block_size": 16, "max_num_batched_tokens": 24}, id="chunked-prefill"),
    ],
)
def test_greedy_tokens_equal_transformers(
    references: Callable[[str], list[list[int]]], tiny_model: str, model: str, engine_args: dict, tmp_path
) -> None:
    folder = str(default_model_dir()) if model == SMOLLM2 else tiny_model
    reference = references(folder)
    # quantization="none": the float32 weights transformers runs (the embedded model's folder
    # would otherwise be served from its GGUF blocks, tests/kernels/test_gguf_linear.py).
    kwargs = {"dtype": "float32", "device": "cpu", "max_model_len": 512, "kv_cache_memory": 64 << 20}
    kwargs |= {"quantization": "none"}
    kwargs |= {"model": folder, "tokenizer": str(default_model_dir())}
    kwargs.update(engine_args)
    if kwargs.get("kv_cache_dir") == "TMP":
        kwargs["kv_cache_dir"] = str(tmp_path)
    if "num_blocks" in kwargs:
        kwargs.pop("kv_cache_memory")
    llm = LLM(**kwargs)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    outs = llm.generate(TEXTS, params, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    for i, (g, want) in enumerate(zip(got, reference)):
        assert g == want, f"prompt {i} ({TEXTS[i]!r}): pagedkv {g} != transformers {want}"
    stats = llm.llm_engine.get_stats()
    if engine_args.get("num_blocks"):
        assert stats["num_preemptions"] > 0
    if engine_args.get("preemption_mode") == "swap":
        assert stats["num_swap_preemptions"] > 0 and stats["blocks_swapped_in"] > 0
        assert stats["bytes_swapped_out"] == stats["blocks_swapped_out"] * llm.llm_engine.runner.bytes_per_block
    if engine_args.get("num_host_blocks"):
        assert stats["num_host_used_blocks"] == 0 and stats["num_swapped"] == 0
    if engine_args.get("kv_cache_dir"):
        assert stats["blocks_written_to_disk"] > 0
    if engine_args.get("enable_prefix_caching"):
        assert stats["prefix_cache_hits"] > 0
    assert stats["num_free_blocks"] == stats["num_blocks"]
