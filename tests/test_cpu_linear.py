"""pagedkv's CPU linear kernel (``_core.cpu_linear``, rust/cpu_linear.rs) and
``linear_kernel="pagedkv"`` (pagedkv.worker.cpu_linear): products against float64 for float32
and int8 weights over shapes around the kernel's tiles, a row's product the same bits alone as
in any batch and on any thread count, typed errors for bad arrays, the switch (which modules,
which row counts) and the configuration. Greedy equality with transformers through the whole
engine is a case of tests/test_engine_greedy.py (``pagedkv-linears``); int8 weights are
tests/test_int8_linear.py."""

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
    with pytest.raises(InvalidTypeError, match="float32 or int8"):
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
