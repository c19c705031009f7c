"""GGUF block linears (pagedkv.worker.gguf_linear, rust/cpu_linear_gguf): the kernel against
``gguf``'s own dequantization followed by a float64 product, for each type, row count, odd
widths, thread counts and instruction set; bad input; the module swap; the op under
torch.compile; and the embedded SmolLM2 served from its Q4_1 blocks against the float32 model
dequantized from the same file (logits close, greedy tokens equal)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants
from transformers import AutoModelForCausalLM, AutoTokenizer

from pagedkv import LLM, SamplingParams, _core
from pagedkv.config import ModelConfig
from pagedkv.errors import ConfigError, InvalidArgumentError, PagedKVError
from pagedkv.worker import model_files
from pagedkv.worker.gguf_blocks import BLOCKS_FILE, load_gguf_blocks
from pagedkv.worker.gguf_linear import GGUF_BLOCK_FORMATS, GgufArrays, gguf_isas, gguf_linear, use_gguf_linears
from pagedkv.worker.model_files import default_model_dir

TYPES = list(GGUF_BLOCK_FORMATS)


def _blocks(kind: str, n: int, k: int, seed: int) -> np.ndarray:
    """``[n, k]`` weights of ``kind``: gguf's own quantizer where it has one (Q4_0, Q4_1, Q8_0),
    else random blocks with finite fp16 scales (Q4_K; gguf only dequantizes it)."""
    rng = np.random.default_rng(seed)
    qtype = GGMLQuantizationType[kind]
    if kind != "Q4_K":
        weights = rng.standard_normal((n, k)).astype(np.float32) * rng.uniform(0.01, 2, (n, 1)).astype(np.float32)
        return np.ascontiguousarray(quants.quantize(weights, qtype))
    values, nbytes = GGUF_BLOCK_FORMATS[kind]
    raw = rng.integers(0, 256, (n, k // values, nbytes), dtype=np.uint8)
    scales = rng.uniform(1e-3, 5e-2, (n, k // values, 2)).astype(np.float16)
    raw[..., :4] = scales.view(np.uint8).reshape(n, k // values, 4)
    return raw.reshape(n, -1)


def _dequantized(kind: str, blocks: np.ndarray) -> np.ndarray:
    return quants.dequantize(blocks, GGMLQuantizationType[kind]).astype(np.float64)


def _run(x: np.ndarray, blocks: np.ndarray, kind: str, threads: int, isa: str, bias: np.ndarray | None) -> np.ndarray:
    out = np.empty((x.shape[0], blocks.shape[0]), dtype=np.float32)
    _core.cpu_linear_gguf(x, blocks, kind, out, threads, bias=bias, isa=isa)
    return out


@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize("rows", [1, 3, 17, 64])
def test_kernel_matches_gguf_dequantization(kind: str, rows: int) -> None:
    """Every instruction set this CPU has, against the float64 product of gguf's dequantized
    weights (relative 2e-6 of the largest output: float32 sums of K products), on 1 and 3
    threads (same bits); and each row alone gives its row's bits."""
    k = 512
    n = 37  # odd: a short last tile
    blocks = _blocks(kind, n, k, seed=rows)
    rng = np.random.default_rng(100 + rows)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    want = x.astype(np.float64) @ _dequantized(kind, blocks).T + bias
    tolerance = 2e-6 * float(np.abs(want).max()) * np.sqrt(k)
    results = {}
    for isa in gguf_isas():
        got = _run(x, blocks, kind, 1, isa, bias)
        np.testing.assert_allclose(got, want, rtol=0, atol=tolerance, err_msg=f"{kind} {isa}")
        np.testing.assert_array_equal(_run(x, blocks, kind, 3, isa, bias), got, err_msg=f"{isa}: threads")
        for row in (0, rows - 1):
            alone = _run(np.ascontiguousarray(x[row : row + 1]), blocks, kind, 2, isa, bias)
            np.testing.assert_array_equal(alone[0], got[row], err_msg=f"{isa}: row {row} alone")
        results[isa] = got
    # The sets differ in the last bits only (fused multiply-adds, 16 lanes against 8).
    for isa, got in results.items():
        np.testing.assert_allclose(got, results["portable"], rtol=0, atol=tolerance, err_msg=isa)


def test_instruction_sets_the_cpu_lacks_are_refused_not_run() -> None:
    available = gguf_isas()
    assert available[-1] == "portable"
    blocks = _blocks("Q8_0", 4, 32, seed=0)
    x = np.ones((1, 32), dtype=np.float32)
    for isa in ("avx2", "avx512"):
        if isa in available:
            continue
        with pytest.raises(InvalidArgumentError, match="cannot run"):
            _run(x, blocks, "Q8_0", 1, isa, None)
    if len(available) < 3:
        pytest.skip(f"this CPU runs only {available}: the missing sets are checked for refusal, not compared")


@pytest.mark.parametrize(
    "change, message",
    [
        ({"kind": "Q6_K"}, "kind must be"),
        ({"isa": "neon"}, "isa must be"),
        ({"blocks": np.zeros((4, 21), dtype=np.uint8)}, "do not hold"),
        ({"blocks": np.zeros((4, 20), dtype=np.int8)}, "uint8"),
        ({"x": np.zeros((2, 48), dtype=np.float32)}, "do not hold"),
        ({"out": np.zeros((2, 5), dtype=np.float32)}, "out has shape"),
        ({"bias": np.zeros(3, dtype=np.float32)}, "bias has"),
        ({"x": np.zeros((4, 32), dtype=np.float32)[::2]}, "contiguous"),
    ],
)
def test_bad_input_is_a_clear_error(change: dict, message: str) -> None:
    args = {
        "x": np.zeros((2, 32), dtype=np.float32),
        "blocks": np.zeros((4, 20), dtype=np.uint8),
        "kind": "Q4_1",
        "out": np.zeros((2, 4), dtype=np.float32),
        "bias": None,
        "isa": "auto",
    } | change
    with pytest.raises(PagedKVError, match=message):
        _core.cpu_linear_gguf(
            args["x"], args["blocks"], args["kind"], args["out"], 1, bias=args["bias"], isa=args["isa"]
        )


def _block_model() -> tuple[torch.nn.Module, dict[str, tuple[torch.Tensor, str]]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Linear(96, 33, bias=False), torch.nn.Linear(33, 8))
    blocks = {
        "0.weight": (torch.from_numpy(_blocks("Q4_1", 96, 64, seed=1)), "Q4_1"),
        "1.weight": (torch.from_numpy(_blocks("Q8_0", 33, 96, seed=2)), "Q8_0"),
    }
    return model, blocks


def test_switched_linears_compute_the_dequantized_product_and_the_rest_stay() -> None:
    model, blocks = _block_model()
    switched = use_gguf_linears(model, blocks)
    assert switched == [model[0], model[1]] and type(model[2]) is torch.nn.Linear
    assert model[0].weight.device.type == "meta" and model[0].weight.shape == (96, 64)
    x = torch.randn(5, 64)
    with torch.inference_mode():
        got = model[1](model[0](x))
        w0 = torch.from_numpy(_dequantized("Q4_1", blocks["0.weight"][0].numpy())).float()
        w1 = torch.from_numpy(_dequantized("Q8_0", blocks["1.weight"][0].numpy())).float()
        want = torch.nn.functional.linear(torch.nn.functional.linear(x, w0, model[0].bias), w1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    assert model(x).shape == (5, 8)


def test_blocks_that_do_not_fit_their_linear_are_refused() -> None:
    model, blocks = _block_model()
    blocks["0.weight"] = (blocks["0.weight"][0][:, :-1], "Q4_1")
    with pytest.raises(ValueError, match="do not fit"):
        use_gguf_linears(model, blocks)


def test_the_op_under_torch_compile_matches_eager() -> None:
    model, blocks = _block_model()
    use_gguf_linears(model, blocks)
    x = torch.randn(3, 64)
    with torch.inference_mode():
        eager = model(x)
        compiled = torch.compile(model, fullgraph=True, dynamic=False)(x)
    torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-6)


def test_config_takes_gguf_and_auto_and_none() -> None:
    assert ModelConfig().quantization is None  # opt-in until the blocks beat float32 at every batch
    assert ModelConfig(quantization="auto").quantization == "auto"
    assert ModelConfig(quantization="none").quantization is None
    assert ModelConfig(quantization="gguf").quantization == "gguf"
    with pytest.raises(ConfigError, match="CPU GGUF kernel"):
        ModelConfig(quantization="gguf", device="cuda")


def test_gguf_on_a_model_without_blocks_is_refused(tiny_model: str) -> None:
    with pytest.raises(ConfigError, match="not a GGUF model"):
        LLM(model=tiny_model, quantization="gguf", block_size=16)


def test_a_gguf_file_is_converted_into_its_own_cache_folder(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``model="x.gguf"`` resolves to a cache folder named by the file; the conversion itself
    is the embedded models' (exercised by the SmolLM2 tests), replaced here by a stub."""
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")
    converted: list[tuple[str, str]] = []

    def fake_convert(model: model_files.EmbeddedModel, target) -> None:
        converted.append((model.name, str(model.gguf_path(tmp_path))))
        target.mkdir(parents=True)
        (target / "pagedkv_conversion.json").write_text("{}")
        (target / BLOCKS_FILE).write_bytes(b"")

    monkeypatch.setattr(model_files, "_convert_gguf", fake_convert)
    folder = model_files.resolve_model(str(gguf))
    assert converted == [("tiny", str(gguf.resolve()))]
    assert folder.startswith(str(tmp_path / "cache" / "gguf-tiny-"))
    assert model_files.resolve_model(gguf) == folder and len(converted) == 1  # cached, and os.PathLike
    other = tmp_path / "weights.bin"
    other.write_bytes(b"")
    with pytest.raises(model_files.ModelLoadError, match="neither a model folder nor a .gguf file"):
        model_files.resolve_model(str(other))


PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
]
MAX_NEW = 10


def test_smollm2_from_its_q4_1_blocks_matches_the_dequantized_float32_model() -> None:
    """The embedded SmolLM2 with its 210 Q4_1 linears and its Q8_0 head served from the blocks,
    against transformers' float32 model dequantized from the same file: logits within 1e-3 of
    their range (the same weights, summed in another order; Q/K rows permuted as transformers
    permutes them, else they would be far off), and the engine's greedy tokens equal to
    transformers' on the float32 model."""
    folder = default_model_dir()
    blocks = load_gguf_blocks(folder)
    assert {kind for _, kind in blocks.values()} == {"Q4_1", "Q8_0"} and len(blocks) == 211
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = tokenizer(PROMPTS[2], return_tensors="pt").input_ids
    want_tokens = []
    with torch.inference_mode():
        want = model(ids).logits
        for text in PROMPTS:
            prompt = tokenizer(text, return_tensors="pt").input_ids
            out = model.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                max_new_tokens=MAX_NEW,
                do_sample=False,
                eos_token_id=None,
            )
            want_tokens.append(out[0, prompt.shape[1] :].tolist())
        assert len(use_gguf_linears(model, blocks)) == 211
        got = model(ids).logits
    spread = float(want.max() - want.min())
    assert float((got - want).abs().max()) < 1e-3 * spread
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    llm = LLM(block_size=16, quantization="auto")  # "auto": the embedded model, served from its blocks
    try:
        runner = llm.llm_engine.runner
        assert runner.quantization == "gguf" and runner.kv_fingerprint()["quantization"] == "gguf"
        assert type(runner.model.get_output_embeddings()).__name__ == "_GgufLinear"
        params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outputs] == want_tokens
    finally:
        llm.shutdown()


def test_quantization_none_serves_a_gguf_model_as_float32() -> None:
    llm = LLM(quantization="none", block_size=16)  # as the default (None) does
    try:
        runner = llm.llm_engine.runner
        assert runner.quantization is None and "quantization" not in runner.kv_fingerprint()
        assert runner.model.get_output_embeddings().weight.dtype == torch.float32
    finally:
        llm.shutdown()


def test_gguf_arrays_eager_path_takes_other_dtypes() -> None:
    blocks = _blocks("Q4_0", 8, 64, seed=3)
    arrays = GgufArrays(blocks, "Q4_0", None)
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    got = gguf_linear(x, arrays)
    assert got.dtype == torch.bfloat16 and got.shape == (2, 8)
    want = gguf_linear(x.float(), arrays)
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)


def test_an_unreadable_blocks_file_means_float32(tmp_path) -> None:
    from pagedkv.worker.gguf_blocks import has_gguf_blocks

    assert not has_gguf_blocks(tmp_path)
    (tmp_path / BLOCKS_FILE).write_bytes(b"not safetensors")
    with pytest.warns(UserWarning, match="unreadable"):
        assert not has_gguf_blocks(tmp_path)
