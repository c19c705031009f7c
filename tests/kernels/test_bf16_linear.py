"""``quantization="bf16"`` (pagedkv.worker.bf16_linear): bfloat16 weights, float32 activations.
The switched linears against torch's product of the same bfloat16 weights (on the AVX512-BF16
path, of the inputs rounded to bfloat16 too), what is left alone, the configuration, and the
engine on a tiny model: logits close to float32's, greedy tokens those of transformers running
the same bfloat16 linears. Kernel paths one by one are tests/kernels/test_cpu_linear.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from pagedkv import LLM, SamplingParams, _core
from pagedkv.config import ModelConfig
from pagedkv.errors import ConfigError
from pagedkv.worker.bf16_linear import bf16_bits, use_bf16_linears
from pagedkv.worker.model_files import default_model_dir

# The path the kernel takes for bfloat16 weights here: with AVX512-BF16 it rounds the inputs.
ROUNDS_INPUTS = _core.cpu_isa()["linear"]["bfloat16"] == "avx512_bf16"


def _reference(x: torch.Tensor, linear: torch.nn.Linear) -> torch.Tensor:
    """torch's float32 product of the bfloat16 weights (and inputs, where the kernel rounds them)."""
    xs = x.bfloat16().float() if ROUNDS_INPUTS else x
    return F.linear(xs, linear.weight.float(), None if linear.bias is None else linear.bias.float())


class _OwnLinear(torch.nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + 1.0


@pytest.mark.parametrize("rows", [1, 3, 7, 16, 100])
def test_switched_linears_compute_torchs_bf16_product(rows: int) -> None:
    torch.manual_seed(rows)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 96),
        torch.nn.Linear(96, 33, bias=False),  # N not a multiple of the tile
        _OwnLinear(33, 64),  # a subclass: its own forward stays
        torch.nn.Linear(64, 8).double(),  # float64: switched too, the product in float32
    )
    floats = [m.weight.detach().clone() for m in model]
    assert use_bf16_linears(model) == [model[0], model[1], model[3]]
    assert type(model[2]) is _OwnLinear and model[2].weight.dtype == torch.float32
    x = torch.randn(2, rows, 64)
    with torch.inference_mode():
        for module, weight in zip(model[:2], floats[:2], strict=True):
            assert module.weight.dtype == torch.bfloat16 and module.weight.shape == weight.shape
            assert torch.equal(module.weight, weight.bfloat16())  # round to nearest even, once
            got = module(x)
            assert got.shape == (2, rows, weight.shape[0]) and got.dtype == torch.float32
            torch.testing.assert_close(got, _reference(x, module), rtol=1e-5, atol=1e-5)
            alone = module(x[:1, :1])  # a row alone: the same bits as in the batch
            assert torch.equal(alone[0, 0], got[0, 0])
            x = got
        double = model[3](torch.randn(rows, 64, dtype=torch.float64))
        assert double.dtype == torch.float64 and double.shape == (rows, 8)


def test_bf16_bits_share_the_tensors_memory() -> None:
    w = torch.tensor([[1.0, -2.0, 0.5]], dtype=torch.bfloat16)
    bits = bf16_bits(w)
    assert bits.dtype.name == "uint16" and bits.tolist() == [[0x3F80, 0xC000, 0x3F00]]
    w[0, 0] = 3.0
    assert bits[0, 0] == 0x4040
    with pytest.raises(TypeError, match="bfloat16"):
        bf16_bits(w.float())


def test_config_accepts_bf16_on_the_cpu_only() -> None:
    assert ModelConfig(quantization="bf16").quantization == "bf16"
    with pytest.raises(ConfigError, match="runs pagedkv's CPU linear kernel"):
        ModelConfig(quantization="bf16", device="cuda")
    with pytest.raises(ConfigError, match="cannot be combined with linear_kernel"):
        ModelConfig(quantization="bf16", linear_kernel="pagedkv")


def test_a_tiny_models_logits_stay_close_to_float32(tiny_model: str) -> None:
    """Bfloat16 weights keep 8 bits of mantissa: next-token logits move by about 2^-8 of their
    size, and the argmax (the tiny model's stands clear of the next token) stays."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    ids = torch.randint(0, 49152, (3, 20), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        want = model(ids).logits
        use_bf16_linears(model)
        got = model(ids).logits
    scale = want.abs().amax(dim=-1, keepdim=True)
    assert bool(((got - want).abs() <= 0.02 * scale).all()), float(((got - want).abs() / scale).max())
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_engine_with_bf16_weights_matches_transformers_with_the_same_linears(tiny_model: str) -> None:
    """The paged engine and transformers' forward, both with the bfloat16 linears: greedy tokens
    equal (what differs between them is the attention and the KV cache, in the last bits)."""
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
    max_new = 8
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    use_bf16_linears(model)
    llm = LLM(model=tiny_model, tokenizer=str(default_model_dir()), quantization="bf16", block_size=16)
    try:
        assert llm.llm_engine.runner.model.get_output_embeddings().weight.dtype == torch.bfloat16
        assert llm.llm_engine.runner.kv_fingerprint()["quantization"] == "bf16"
        tokenizer = llm.get_tokenizer()
        params = SamplingParams(max_tokens=max_new, temperature=0.0, ignore_eos=True)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        with torch.inference_mode():
            for text, output in zip(prompts, outputs, strict=True):
                ids = tokenizer(text, return_tensors="pt").input_ids
                want = model.generate(
                    ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False, eos_token_id=None
                )
                assert list(output.outputs[0].token_ids) == want[0, ids.shape[1] :].tolist(), text
    finally:
        llm.shutdown()
