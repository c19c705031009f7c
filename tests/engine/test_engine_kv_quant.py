"""End to end on SmolLM2 (CPU, float32 model) with quantized KV caches: greedy generation with
``int8`` / ``fp8_e4m3`` KV equals the full-precision cache on these prompts; prefix caching,
preemption (a tiny pool) and ``n > 1`` forks (copy-on-write copies the scales) work on
quantized blocks; the pool size follows the bytes per token; checkpoint scales load."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
import torch

from pagedkv import LLM, SamplingParams
from pagedkv.errors import ModelLoadError
from pagedkv.kernels.kv_quant import round_up_to_bf16

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Photosynthesis is the process by which",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
]
MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
MEMORY = 32 << 20


def _llm(kv_cache_dtype: str, **kwargs: object) -> LLM:
    # torch's linears at every row count: the tests compare runs whose steps differ in size (a
    # preempted request recomputed in one chunk), and pagedkv's kernel at a decode step's rows vs
    # torch's above 32 differ in the last bits, enough to flip an fp8 cache's rounding.
    args: dict[str, object] = {
        "device": "cpu",
        "max_model_len": 512,
        "kv_cache_memory": MEMORY,
        "linear_kernel": "torch",
    }
    args.update(kwargs)
    return LLM(kv_cache_dtype=kv_cache_dtype, **args)


def _tokens(llm: LLM, prompts: list[str], params: SamplingParams = GREEDY) -> list[list[list[int]]]:
    return [[c.token_ids for c in out.outputs] for out in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def full_precision() -> list[list[list[int]]]:
    return _tokens(_llm("auto"), PROMPTS)


@pytest.fixture(scope="module", params=["int8", "fp8_e4m3"])
def quantized(request: pytest.FixtureRequest) -> tuple[str, LLM]:
    return request.param, _llm(request.param)


def test_greedy_matches_the_full_precision_cache(
    quantized: tuple[str, LLM], full_precision: list[list[list[int]]]
) -> None:
    """int8: every token equal. fp8 e4m3 keeps 3 mantissa bits (~3% error per value), so a greedy
    near-tie may flip and the rest of the sequence differs: its quality is checked teacher-forced
    (test_teacher_forced_quality; benches/bench_kv_quality.py over 20k positions)."""
    name, llm = quantized
    got = _tokens(llm, PROMPTS)
    if name == "int8":
        assert got == full_precision
    assert all(len(c) == MAX_TOKENS for out in got for c in out)
    stats = llm.llm_engine.get_stats()
    assert stats["kv_cache_dtype"] == name
    assert stats["kv_bytes_per_token"] == 2 * 30 * 3 * (64 + 2)


TEXT = (
    "The river rises in the hills to the north of the town and runs south for about forty miles "
    "before it reaches the sea. In the spring, when the snow melts, it floods the low fields on "
    "either bank, and the farmers have built long earth walls to keep the water away from their "
    "houses. The old stone bridge in the middle of the town was built more than three hundred "
    "years ago; it has seven arches, and the widest of them lets small boats pass underneath. "
    "Every summer the town holds a fair on the meadow beside the bridge, with music, games and "
    "stalls that sell bread, cheese, honey and cider. Children swim in the shallow water near the "
    "mill, while their parents sit in the shade of the willows and talk about the harvest, the "
    "price of wool and the new railway line that will soon connect the town to the capital. "
    "def mean(values):\n    total = 0\n    for v in values:\n        total += v\n    return total / len(values)\n"
    "Question: what is the capital of Italy? Answer: Rome. Question: how many days are in a leap "
    "year? Answer: 366. Question: which planet is closest to the sun? Answer: Mercury."
)
# Teacher-forced floors per KV dtype (mean KL in nats, top-1 agreement) with margin below what
# SmolLM2 measures on TEXT; a wrong scale, a lost rotation or a misread block is far worse.
QUALITY_FLOORS = {"int8": (2e-3, 0.97), "fp8_e4m3": (1.5e-2, 0.90), "fp8_e5m2": (5e-2, 0.85)}


@pytest.fixture(scope="module")
def text_tokens() -> np.ndarray:
    from transformers import AutoTokenizer

    from pagedkv.worker.model_files import default_model_dir

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    return np.array(tokenizer(TEXT).input_ids, dtype=np.int64)


def _all_logits(kv_cache_dtype: str, tokens: np.ndarray) -> torch.Tensor:  # [T, V]
    """One forward of ``tokens`` through the paged cache, logits at every position (each query
    reads the quantized K/V of all earlier tokens, as a decode would)."""
    from pagedkv.config import CacheConfig, ModelConfig
    from pagedkv.worker.model_runner import ModelRunner
    from pagedkv.worker.step_input import StepInput

    runner = ModelRunner(
        ModelConfig(device="cpu", max_model_len=512), CacheConfig(kv_cache_dtype=kv_cache_dtype, num_blocks=40)
    )
    n = len(tokens)
    step = StepInput(
        input_ids=tokens,
        positions=np.arange(n),
        cu_seqlens_q=np.array([0, n], dtype=np.int32),
        seq_lens=np.array([n], dtype=np.int32),
        block_tables=np.arange(-(-n // 16), dtype=np.int32)[None],
        slot_mapping=np.arange(n),
        logits_indices=np.arange(n),
    )
    return runner.execute(step)


@pytest.mark.parametrize("name", sorted(QUALITY_FLOORS))
def test_teacher_forced_quality(name: str, text_tokens: np.ndarray) -> None:
    full = torch.log_softmax(_all_logits("auto", text_tokens).double(), dim=-1)
    quant = torch.log_softmax(_all_logits(name, text_tokens).double(), dim=-1)
    kl = float((full.exp() * (full - quant)).sum(-1).mean())
    top1 = float((full.argmax(-1) == quant.argmax(-1)).double().mean())
    max_kl, min_top1 = QUALITY_FLOORS[name]
    assert len(text_tokens) > 200
    assert kl < max_kl and top1 >= min_top1, (name, kl, top1)


def test_pool_holds_about_four_times_the_tokens() -> None:
    full, quant = _llm("auto").llm_engine.runner, _llm("int8").llm_engine.runner
    assert full.kv_cache_bytes <= MEMORY and quant.kv_cache_bytes <= MEMORY
    assert quant.num_blocks / full.num_blocks >= 3.8
    assert quant.kv_cache.dtype == torch.int8 and quant.kv_scale_cache is not None
    assert quant.kv_scales is not None and quant.kv_scales[0].key_rotation is not None


def test_prefix_cache_hits_read_quantized_blocks(quantized: tuple[str, LLM]) -> None:
    name, llm = quantized
    long_prompt = PROMPTS[3] * 4  # several full blocks to share
    first = _tokens(llm, [long_prompt])
    before = llm.llm_engine.get_stats()["prefix_cache_hits"]
    second = _tokens(llm, [long_prompt])
    assert llm.llm_engine.get_stats()["prefix_cache_hits"] > before, name
    assert first == second


def test_preemption_with_a_tiny_pool(quantized: tuple[str, LLM]) -> None:
    name, llm = quantized
    roomy = _tokens(llm, PROMPTS)
    tiny = _llm(name, num_blocks=6, kv_cache_memory=None, max_model_len=96, max_num_seqs=4)
    assert _tokens(tiny, PROMPTS) == roomy
    assert tiny.llm_engine.get_stats()["num_preemptions"] > 0


def test_forks_share_and_copy_quantized_blocks(quantized: tuple[str, LLM]) -> None:
    """n = 3 greedy forks share the prompt's blocks; the partly filled last block is copied on
    write (data and scales) for each fork: every fork must equal the single greedy answer."""
    name, llm = quantized
    single = _tokens(llm, PROMPTS[:2])
    forked = _tokens(llm, PROMPTS[:2], SamplingParams(n=3, temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    for one, three in zip(single, forked):
        assert three == one * 3, name
    sampled = _tokens(llm, PROMPTS[:1], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8))
    assert len(sampled[0]) == 3 and all(len(c) == 8 for c in sampled[0])


def test_checkpoint_scales_run(tmp_path: pathlib.Path) -> None:
    """Static per-tensor scales from the checkpoint: the engine runs on them (values far off
    the per-vector ones saturate, so the output may differ, but it is produced)."""
    from safetensors.torch import save_file

    from pagedkv.worker.model_files import default_model_dir

    folder = tmp_path / "model"
    folder.mkdir()
    for entry in pathlib.Path(default_model_dir()).iterdir():
        (folder / entry.name).symlink_to(entry)
    scales = {}
    for i in range(30):
        scales[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.1)
        scales[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(0.05)
    save_file(scales, str(folder / "kv_scales.safetensors"))
    llm = _llm("int8", model=str(folder), kv_cache_scales="checkpoint")
    runner = llm.llm_engine.runner
    assert runner.kv_scales is not None and runner.kv_scales[0].static_key is not None
    assert runner.kv_scales[0].key_rotation is None  # the checkpoint's scales are for unrotated keys
    out = _tokens(llm, PROMPTS[:1])
    assert len(out[0][0]) == MAX_TOKENS
    # Every stored K scale is the checkpoint's (rounded up to bfloat16).
    assert runner.kv_scale_cache is not None
    used = runner.kv_scale_cache[:, 0][runner.kv_scale_cache[:, 0] > 0].float().unique()
    assert used.tolist() == round_up_to_bf16(torch.tensor([0.1])).tolist()


def test_checkpoint_without_scales_is_a_load_error() -> None:
    with pytest.raises(ModelLoadError, match="no k_scale / v_scale"):
        _llm("int8", kv_cache_scales="checkpoint")
