"""Bfloat16 weights for the model's linears on the CPU (``quantization="bf16"``), float32
everything else.

A batch-1 decode step on the CPU is bound by reading the weights (SmolLM2-135M: 538 MB of
float32 linears per token). Stored as bfloat16 (the top half of each float32's bits, rounded
to nearest even) they are half of that, with 8 bits of mantissa where int8 per-channel codes
have about 7 over the row's range; no scales, and a bfloat16 checkpoint's weights are exact.

The product: pagedkv's CPU linear kernel (:mod:`pagedkv.worker.cpu_linear`, the Rust core's
``cpu_linear`` on the weights' bit patterns as uint16) at every row count. Its path
(``_core.cpu_isa()["linear"]["bfloat16"]``):

- ``avx512_bf16`` (CPUs with AVX512-BF16: Intel Cooper Lake / Sapphire Rapids on, AMD Zen 4):
  ``vdpbf16ps`` on the input rows rounded to bfloat16 once per call. The products of two
  bfloat16 values are exact in float32 and summed in float32, so the error against the float32
  product of the bfloat16 weights is the inputs' rounding: at most ``2^-9 * sum_k |x_k w_k|``
  (plus float32 sums), what torch's ``x.bfloat16().float() @ w.float().T`` gives;
- ``avx512`` / ``avx2`` / ``portable``: each weight made float32 exactly (a shift) and
  multiplied by the float32 inputs, as the float32 kernel does.

Either way a row's product is the same bits whatever else is in the step (on one path), and the
output and everything around the linears (norms, attention, the KV cache, the residual stream)
stay float32. benches/bench_cpu_isa.py measures each path.

Each ``nn.Linear`` (exactly that class) whose weight is floating point on the CPU becomes a
:class:`_Bf16Linear` in place: its ``weight`` parameter is replaced by the bfloat16 one (same
shape), the kernel reads a float32 copy of the bias (``_bias_f32``), hooks stay. A head tied to
the input embedding keeps the embedding float32 (only the head's parameter is replaced, which
unties them).
"""

from __future__ import annotations

from typing import cast

import numpy as np
import torch
from torch import nn

from pagedkv.worker.cpu_linear import KernelArrays, kernel_linear, op_linear

__all__ = ["bf16_bits", "use_bf16_linears"]


def bf16_bits(weight: torch.Tensor) -> np.ndarray:
    """A bfloat16 CPU tensor's bit patterns as a uint16 numpy array sharing its memory (numpy
    has no bfloat16; the kernel takes the patterns)."""
    if weight.dtype != torch.bfloat16:
        raise TypeError(f"bf16_bits wants a bfloat16 tensor, got {weight.dtype}")
    return weight.detach().contiguous().view(torch.int16).numpy().view(np.uint16)


class _Bf16Linear(nn.Linear):
    _bias_f32: torch.Tensor | None  # float32 [N]: the bias as the kernel reads it
    _arrays: KernelArrays

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] float -> [..., N] x.dtype
        if torch.compiler.is_compiling():
            return op_linear(x, self.weight, None, self._bias_f32)
        return kernel_linear(x, self._arrays)


@torch.no_grad()
def use_bf16_linears(model: nn.Module) -> list[nn.Linear]:
    """Switches every plain CPU ``nn.Linear`` of ``model`` with a floating-point weight to
    bfloat16 weights (in place; round to nearest even); returns the switched modules."""
    switched: list[nn.Linear] = []
    for module in model.modules():
        if type(module) is not nn.Linear:
            continue
        weight = module.weight
        if not weight.is_floating_point() or weight.device.type != "cpu":
            continue
        w = weight.detach().to(torch.bfloat16).contiguous()
        module.weight = nn.Parameter(w, requires_grad=False)
        bias = None if module.bias is None else module.bias.detach().float().contiguous()
        module.register_buffer("_bias_f32", bias, persistent=False)
        module._arrays = KernelArrays(bf16_bits(w), None, None if bias is None else bias.numpy())  # type: ignore[assignment]
        module.__class__ = _Bf16Linear
        switched.append(cast(_Bf16Linear, module))
    return switched
