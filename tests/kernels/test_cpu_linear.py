"""pagedkv's CPU linear kernel (``_core.cpu_linear``, rust/cpu_linear.rs) and
``linear_kernel="pagedkv"`` (pagedkv.worker.cpu_linear): products against float64 for float32
and int8 weights over shapes around the kernel's tiles, a row's product the same bits alone as
in any batch and on any thread count, typed errors for bad arrays, the switch (which modules,
which row counts) and the configuration. Greedy equality with transformers through the whole
engine is a case of tests/engine/test_engine_greedy.py (``pagedkv-linears``); int8 weights are
tests/kernels/test_int8_linear.py."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pagedkv import _core
from pagedkv.config import ModelConfig
from pagedkv.errors import ConfigError, InvalidArgumentError, InvalidTypeError
from pagedkv.worker.cpu_linear import MAX_KERNEL_ROWS, use_pagedkv_linears
from pagedkv.worker.int8_linear import quantize_per_channel


def _linear(x: np.ndarray, weight: np.ndarray, threads: int, scales=None, bias=None) -> np.ndarray:
    out = np.full((x.shape[0], weight.shape[0]), np.nan, dtype=np.float32)
    _core.cpu_linear(x, weight, out, threads, scales=scales, bias=bias)
    return out


# Shapes around the tiles (4 output rows x 3 input rows, 8 lanes): K with and without a tail,
# N and M not multiples of the tile, and SmolLM2's own widths; products big enough for threads.
SHAPES = [(1, 1, 1), (2, 7, 5), (3, 8, 4), (4, 33, 9), (5, 37, 13), (7, 64, 130), (17, 576, 192), (1, 1536, 576)]


@pytest.mark.parametrize("rows, k, n", SHAPES)
@pytest.mark.parametrize("int8", [False, True], ids=["float32", "int8"])
def test_products_match_float64_and_every_row_alone(rows: int, k: int, n: int, int8: bool) -> None:
    rng = np.random.default_rng(rows * 10_000 + k * 10 + n)
    x = rng.standard_normal((rows, k), dtype=np.float32)
    w = rng.standard_normal((n, k), dtype=np.float32)
    bias = rng.standard_normal(n, dtype=np.float32)
    if int8:
        codes, scales_t = quantize_per_channel(torch.from_numpy(w))
        weight, scales = codes.numpy(), scales_t.numpy()
        exact = codes.double().numpy() * scales[:, None].astype(np.float64)
    else:
        weight, scales, exact = w, None, w.astype(np.float64)
    got = _linear(x, weight, 2, scales=scales, bias=bias)
    want = x.astype(np.float64) @ exact.T + bias
    # float32 sums of k products: a few ulps of the terms' size per product.
    tol = 1e-6 * k * (np.abs(x).max() * np.abs(exact).max() + 1)
    np.testing.assert_allclose(got, want, rtol=0, atol=tol)
    for threads in (1, 3):
        assert np.array_equal(_linear(x, weight, threads, scales=scales, bias=bias), got)
    for r in range(rows):  # bit for bit, alone or in any batch
        assert np.array_equal(_linear(x[r : r + 1], weight, 1, scales=scales, bias=bias)[0], got[r])


def test_bad_arrays_are_typed_errors() -> None:
    x, w, out = np.zeros((2, 8), np.float32), np.zeros((3, 8), np.float32), np.zeros((2, 3), np.float32)
    codes, scales = np.zeros((3, 8), np.int8), np.ones(3, np.float32)
    with pytest.raises(InvalidTypeError, match="float32, int8 or uint16"):
        _core.cpu_linear(x, w.astype(np.float64), out, 1)
    with pytest.raises(InvalidArgumentError, match="want \\[2, 3\\]"):
        _core.cpu_linear(x, w, np.zeros((3, 2), np.float32), 1)
    with pytest.raises(InvalidArgumentError, match="do not match"):
        _core.cpu_linear(x, np.zeros((3, 7), np.float32), out, 1)
    with pytest.raises(InvalidArgumentError, match="need their scales"):
        _core.cpu_linear(x, codes, out, 1)
    with pytest.raises(InvalidArgumentError, match="take no scales"):
        _core.cpu_linear(x, w, out, 1, scales=scales)
    with pytest.raises(InvalidArgumentError, match="2 weight scales for 3"):
        _core.cpu_linear(x, codes, out, 1, scales=scales[:2])
    with pytest.raises(InvalidArgumentError, match="bias has 2 values"):
        _core.cpu_linear(x, w, out, 1, bias=np.zeros(2, np.float32))
    with pytest.raises(InvalidArgumentError, match="contiguous"):
        _core.cpu_linear(np.zeros((8, 2), np.float32).T, w, out, 1)
    with pytest.raises(InvalidArgumentError, match=">= 1"):
        _core.cpu_linear(np.zeros((2, 0), np.float32), np.zeros((3, 0), np.float32), out, 1)
    _core.cpu_linear(np.zeros((0, 8), np.float32), w, np.zeros((0, 3), np.float32), 2)  # no rows: nothing to do
    with pytest.raises(InvalidArgumentError, match="isa must be"):
        _core.cpu_linear(x, w, out, 1, isa="sse9")
    with pytest.raises(InvalidArgumentError, match="take no scales"):
        _core.cpu_linear(x, np.zeros((3, 8), np.uint16), out, 1, scales=scales)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
def test_a_forked_child_runs_the_kernel_on_threads() -> None:
    """A fork copies only the calling thread: the child must not hand jobs to the parent's pool
    workers (it would wait forever); it builds its own pool."""
    x = np.ones((4, 4096), np.float32)
    w = np.ones((512, 4096), np.float32)
    _linear(x, w, 2)  # the parent's pool exists
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        ok = bool((_linear(x, w, 2) == 4096).all())
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


class _OwnLinear(torch.nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + 1.0


@pytest.mark.parametrize("rows", [1, 5, MAX_KERNEL_ROWS, MAX_KERNEL_ROWS + 1])
def test_switched_linears_run_the_kernel_up_to_max_rows(rows: int) -> None:
    torch.manual_seed(rows)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 48), torch.nn.Linear(48, 40, bias=False), _OwnLinear(40, 8), torch.nn.Linear(8, 8).double()
    )
    seen = []
    model[0].register_forward_pre_hook(lambda _m, args: seen.append(args[0].shape))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert use_pagedkv_linears(model).modules == [model[0], model[1]]
    assert type(model[2]) is _OwnLinear and type(model[3]) is torch.nn.Linear
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    x = torch.randn(1, rows, 64)
    with torch.inference_mode():
        for module in model[:2]:
            got = module(x)
            want = F.linear(x, module.weight, module.bias)
            if rows > MAX_KERNEL_ROWS:
                assert torch.equal(got, want)  # torch's own product
            else:
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
                alone = module(x[:, :1])
                assert torch.equal(alone[0, 0], got[0, 0])
            x = got
    assert seen[0] == torch.Size([1, rows, 64])  # the hook ran (again for the row alone)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"linear_kernel": "pagedkv", "dtype": "bfloat16"}, "linear_kernel 'pagedkv' runs float32 linears on the CPU"),
        ({"linear_kernel": "pagedkv", "device": "cuda"}, "linear_kernel 'pagedkv' runs float32 linears on the CPU"),
    ],
)
def test_config_refuses_what_the_kernel_cannot_run(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ModelConfig(**kwargs)


# The CPU features each forced path of the kernel needs (rust/cpu_isa.rs).
PATH_NEEDS = {
    "portable": [],
    "avx2": ["avx2", "fma"],
    "avx512": ["avx512f", "avx512bw", "avx512vl"],
    "avx512_bf16": ["avx512f", "avx512bw", "avx512vl", "avx512_bf16"],
}


def _need(isa: str) -> None:
    """Skips the test where this CPU lacks what the path ``isa`` needs, naming the flags."""
    missing = [f for f in PATH_NEEDS[isa] if f not in _core.cpu_isa()["features"]]
    if missing:
        pytest.skip(f"this CPU lacks {', '.join(missing)} (the {isa!r} path)")


def test_cpu_isa_names_the_paths_it_takes() -> None:
    info = _core.cpu_isa()
    assert set(info) == {"features", "linear_paths", "linear", "attention"}
    assert info["linear_paths"][0] == "portable"
    for isa in info["linear_paths"]:
        assert all(f in info["features"] for f in PATH_NEEDS[isa])
    for isa in set(PATH_NEEDS) - set(info["linear_paths"]):  # a path it lacks: a typed error
        with pytest.raises(InvalidArgumentError, match="lacks"):
            _linear_on(isa, np.zeros((1, 8), np.float32), np.zeros((2, 8), np.float32), 1)
    assert set(info["linear"]) == {"float32", "int8", "bfloat16"}
    assert all(path in info["linear_paths"] for path in info["linear"].values())
    fastest = [isa for isa in info["linear_paths"] if isa != "avx512_bf16"][-1]
    assert info["linear"]["float32"] == info["linear"]["int8"] == fastest
    assert info["attention"] in ("avx2", "portable")


def _linear_on(isa: str, x: np.ndarray, weight: np.ndarray, threads: int, scales=None, bias=None) -> np.ndarray:
    out = np.full((x.shape[0], weight.shape[0]), np.nan, dtype=np.float32)
    _core.cpu_linear(x, weight, out, threads, scales=scales, bias=bias, isa=isa)
    return out


def _bf16_bits(w: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 (torch's rounding) as the uint16 bit patterns the kernel takes."""
    return torch.from_numpy(w).bfloat16().view(torch.int16).numpy().view(np.uint16)


def _weights(fmt: str, w: np.ndarray) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """(the kernel's weight, its scales, the float64 weights it stands for)."""
    if fmt == "int8":
        codes, scales = quantize_per_channel(torch.from_numpy(w))
        return codes.numpy(), scales.numpy(), codes.double().numpy() * scales.double().numpy()[:, None]
    if fmt == "bfloat16":
        bits = _bf16_bits(w)
        return bits, None, torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).double().numpy()
    return w, None, w.astype(np.float64)


@pytest.mark.parametrize("rows, k, n", SHAPES)
@pytest.mark.parametrize("fmt", ["float32", "int8", "bfloat16"])
@pytest.mark.parametrize("isa", ["avx2", "avx512", "avx512_bf16"])
def test_every_path_matches_the_portable_one(isa: str, fmt: str, rows: int, k: int, n: int) -> None:
    """Each path against the portable one, and a row alone against the batch on that path.

    The paths sum in different orders (8 or 16 lanes, the tail before or after the horizontal
    sum) and the SIMD ones fuse each multiply-add where the portable one rounds twice: their
    results differ in the last bits, within a few float32 ulps of the terms' size per term
    (``1e-6 * k * max|x| * max|w|``). ``avx512_bf16`` on bfloat16 weights multiplies the inputs
    rounded to bfloat16: it is compared with torch's ``x.bfloat16().float() @ w.float().T``
    instead (and with any other weights it is the ``avx512`` path)."""
    _need(isa)
    rng = np.random.default_rng(rows * 10_000 + k * 10 + n)
    x = rng.standard_normal((rows, k), dtype=np.float32)
    weight, scales, exact = _weights(fmt, rng.standard_normal((n, k), dtype=np.float32))
    bias = rng.standard_normal(n, dtype=np.float32)
    got = _linear_on(isa, x, weight, 2, scales=scales, bias=bias)
    tol = 1e-6 * k * (np.abs(x).max() * np.abs(exact).max() + 1)
    if isa == "avx512_bf16" and fmt == "bfloat16":
        xb = torch.from_numpy(x).bfloat16().float()
        want = (xb @ torch.from_numpy(exact).float().T + torch.from_numpy(bias)).numpy()
        np.testing.assert_allclose(got, want, rtol=0, atol=tol)
        # And against the float32 product: the inputs' rounding, 2^-9 relative each.
        loose = 2.0**-8 * (np.abs(x) @ np.abs(exact).T) + tol
        assert bool((np.abs(got - (x.astype(np.float64) @ exact.T + bias)) <= loose).all())
    else:
        np.testing.assert_allclose(got, _linear_on("portable", x, weight, 2, scales, bias), rtol=0, atol=tol)
    for threads in (1, 3):
        assert np.array_equal(_linear_on(isa, x, weight, threads, scales, bias), got)
    for r in range(rows):  # bit for bit, alone or in any batch, on one path
        assert np.array_equal(_linear_on(isa, x[r : r + 1], weight, 1, scales, bias)[0], got[r])


def test_auto_takes_the_fastest_path() -> None:
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, 40), dtype=np.float32)
    w = rng.standard_normal((9, 40), dtype=np.float32)
    info = _core.cpu_isa()
    assert np.array_equal(_linear(x, w, 1), _linear_on(info["linear"]["float32"], x, w, 1))
    bits = _bf16_bits(w)
    assert np.array_equal(_linear(x, bits, 1), _linear_on(info["linear"]["bfloat16"], x, bits, 1))
