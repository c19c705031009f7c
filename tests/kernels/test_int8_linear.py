"""``quantization="int8"`` (pagedkv.worker.int8_linear): per-channel int8 weights, the switched
linears' products against the float product of the dequantized weights, what is left alone,
the configuration's refusals, and the engine on SmolLM2 against transformers running the same
int8 linears (greedy tokens equal). Quality against float32 weights is a benchmark
(benches/bench_weight_quality.py), not a test."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from pagedkv import LLM, SamplingParams
from pagedkv.config import ModelConfig
from pagedkv.errors import ConfigError
from pagedkv.worker.int8_linear import quantize_per_channel, use_int8_linears
from pagedkv.worker.model_files import default_model_dir


def test_per_channel_quantization_is_within_half_a_step() -> None:
    torch.manual_seed(0)
    weight = torch.randn(48, 96) * torch.logspace(-3, 1, 48)[:, None]  # rows of very different size
    weight[5] = 0.0
    q, scales = quantize_per_channel(weight)
    assert q.dtype == torch.int8 and q.shape == weight.shape and scales.dtype == torch.float32
    assert int(q.abs().max()) == 127 and int(q.min()) >= -127
    assert scales[5] == 1.0 and not q[5].any()  # an all-zero row: scale 1, zeros
    error = (q.float() * scales[:, None] - weight).abs()
    assert bool((error <= scales[:, None] / 2 + 1e-7).all())


class _OwnLinear(torch.nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + 1.0


def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 96),
        torch.nn.Linear(96, 33, bias=False),  # N not a multiple of anything
        _OwnLinear(33, 64),  # a subclass: its own forward stays
        torch.nn.Linear(64, 8).double(),  # a float64 weight: switched too, the product in float32
    )


@pytest.mark.parametrize("rows", [1, 3, 16, 100])
def test_switched_linears_compute_the_dequantized_product(rows: int) -> None:
    model = _model()
    floats = [m.weight.detach().clone() for m in model]
    switched = use_int8_linears(model)
    assert switched == [model[0], model[1], model[3]]
    assert type(model[2]) is _OwnLinear and model[2].weight.dtype == torch.float32
    x = torch.randn(2, rows, 64)
    with torch.inference_mode():
        for module, weight in zip(model[:2], floats[:2], strict=True):
            assert module.weight.dtype == torch.int8 and module.weight.shape == weight.shape
            assert "weight_scale" in module.state_dict()
            dequantized = module.weight.float() * module.weight_scale[:, None]
            got = module(x)
            assert got.shape == (2, rows, weight.shape[0]) and got.dtype == torch.float32
            # The dequantized weights times the float32 input, summed in float32.
            want = F.linear(x, dequantized, module.bias)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            # And the weights are close to the float ones (half a step per weight).
            torch.testing.assert_close(dequantized, weight, rtol=0, atol=float(module.weight_scale.max()) / 2 + 1e-7)
            x = got
        double = model[3](torch.randn(rows, 64, dtype=torch.float64))
        assert double.dtype == torch.float64 and double.shape == (rows, 8)


@pytest.mark.parametrize("k", [1, 33, 37, 160, 576])
@pytest.mark.parametrize("n", [1, 5, 17, 49])
@pytest.mark.parametrize("rows", [1, 4, 5, 17])
def test_every_shape_gives_the_dequantized_product(k: int, n: int, rows: int) -> None:
    """Odd output widths and row counts around the kernel's tiles, input widths with and
    without a tail (torch's int8 kernel, the first version's, gave inf at K = 33 and crashed at
    K = 37)."""
    torch.manual_seed(k * 1000 + n * 10 + rows)
    linear = torch.nn.Linear(k, n)
    assert use_int8_linears(torch.nn.Sequential(linear)) == [linear]
    x = torch.randn(rows, k)
    with torch.inference_mode():
        want = F.linear(x, linear.weight.float() * linear.weight_scale[:, None], linear.bias)
        got = linear(x)
    assert bool(torch.isfinite(got).all())
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_tied_head_leaves_the_input_embedding_float() -> None:
    model = AutoModelForCausalLM.from_pretrained(default_model_dir(), dtype=torch.float32)
    embedding = model.get_input_embeddings().weight
    before = embedding.detach().clone()
    assert model.get_output_embeddings().weight is embedding  # SmolLM2 ties them
    use_int8_linears(model)
    assert model.get_input_embeddings().weight.dtype == torch.float32
    assert torch.equal(model.get_input_embeddings().weight, before)
    assert model.get_output_embeddings().weight.dtype == torch.int8


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"quantization": "int4"}, "quantization must be one of"),
        ({"quantization": "int8", "device": "cuda"}, "runs pagedkv's CPU linear kernel"),
        ({"quantization": "int8", "linear_kernel": "onednn"}, "cannot be combined with linear_kernel"),
    ],
)
def test_config_refuses_what_int8_cannot_run(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ModelConfig(**kwargs)


PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "Photosynthesis is the process by which",
]
MAX_NEW = 12


def test_engine_with_int8_weights_matches_transformers_with_the_same_linears() -> None:
    """The paged engine and transformers' own forward, both on SmolLM2 with the int8 linears:
    greedy tokens equal, up to a near-tie (what differs between them is the attention and the
    KV cache, in the last bits; two tokens that close can swap, after which the texts go their
    own ways). A wrong scale or a wrong row would change the first tokens of every prompt."""
    folder = default_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    use_int8_linears(model)
    want = []
    with torch.inference_mode():
        for text in PROMPTS:
            ids = tokenizer(text, return_tensors="pt").input_ids
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None
            )
            want.append(out[0, ids.shape[1] :].tolist())
    llm = LLM(quantization="int8", block_size=16)
    try:
        head = llm.llm_engine.runner.model.get_output_embeddings()
        assert head.weight.dtype == torch.int8
        # Disk files and transferred KV of a float32 engine are not this engine's K/V.
        assert llm.llm_engine.runner.kv_fingerprint()["quantization"] == "int8"
        params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, logprobs=2)
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        exact = 0
        for output, tokens in zip(outputs, want, strict=True):
            got = list(output.outputs[0].token_ids)
            differ = [i for i, (a, b) in enumerate(zip(got, tokens, strict=True)) if a != b]
            if not differ:
                exact += 1
                continue
            top = output.outputs[0].logprobs[differ[0]]  # the engine's top 2 where they part
            assert tokens[differ[0]] in top, (got, tokens)
            assert abs(top[got[differ[0]]].logprob - top[tokens[differ[0]]].logprob) < 0.15, (got, tokens)
        assert exact >= len(PROMPTS) - 1
        assert llm.llm_engine.get_stats()["num_free_blocks"] == llm.llm_engine.get_stats()["num_blocks"]
    finally:
        llm.shutdown()
