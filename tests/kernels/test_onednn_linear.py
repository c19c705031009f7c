"""``linear_kernel="onednn"`` (pagedkv.worker.onednn_linear): the switched linears compute what
``F.linear`` computes (to float32 rounding), fall back to it exactly when switched off, keep
the model's parameters and hooks, leave other dtypes and Linear subclasses alone, and the
configuration refuses what it cannot run. Greedy equality with transformers through the whole
engine is a case of tests/engine/test_engine_greedy.py (``onednn-linears``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedkv.config import ModelConfig
from pagedkv.errors import ConfigError
from pagedkv.worker.onednn_linear import onednn_available, use_onednn_linears

pytestmark = pytest.mark.skipif(not onednn_available(), reason="torch without oneDNN")


class _OwnLinear(torch.nn.Linear):
    """A subclass with its own forward: must keep it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + 1.0


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 48),
        torch.nn.Linear(48, 40, bias=False),
        _OwnLinear(40, 8),
        torch.nn.Linear(8, 8).double(),
    )


@pytest.mark.parametrize("rows", [1, 3, 16, 100])
def test_switched_linears_compute_f_linear(rows: int) -> None:
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    switch = use_onednn_linears(model)
    assert [type(m).__name__ for m in switch.modules] == ["_OneDNNLinear", "_OneDNNLinear"]
    assert type(model[2]) is _OwnLinear and type(model[3]) is torch.nn.Linear  # left alone
    assert model.state_dict().keys() == before.keys()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    x = torch.randn(1, rows, 64)
    threads = torch.get_num_threads()
    with torch.inference_mode():
        for module in model[:2]:
            want = F.linear(x, module.weight, module.bias)
            got = module(x)
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            assert torch.get_num_threads() == threads  # a one-row call restores the thread count
            switch.enabled = False
            assert torch.equal(module(x), want)  # off: torch's own product, bit for bit
            switch.enabled = True
            x = want


def test_hooks_still_run_and_non_contiguous_input() -> None:
    model = _model()
    seen = []
    model[0].register_forward_pre_hook(lambda _m, args: seen.append(args[0].shape))
    use_onednn_linears(model)
    x = torch.randn(64, 5).t()  # [5, 64], not contiguous
    with torch.inference_mode():
        torch.testing.assert_close(model[0](x), F.linear(x, model[0].weight, model[0].bias), rtol=1e-5, atol=1e-5)
    assert seen == [torch.Size([5, 64])]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"linear_kernel": "mkl"}, "linear_kernel must be one of"),
        ({"linear_kernel": "onednn", "dtype": "bfloat16"}, "linear_kernel 'onednn' runs float32 linears on the CPU"),
        ({"linear_kernel": "onednn", "device": "cuda"}, "linear_kernel 'onednn' runs float32 linears on the CPU"),
    ],
)
def test_config_refuses_what_onednn_cannot_run(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ModelConfig(**kwargs)
