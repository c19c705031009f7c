"""Int8 weights for the model's linears on the CPU (``quantization="int8"``).

A batch-1 decode step reads every weight once and does little arithmetic on each, so on the
CPU it is bound by memory traffic: SmolLM2-135M reads 538 MB of float32 linears per token.
Stored as int8 with one float32 scale per output channel, the same weights are a quarter of
that (and of the memory they take).

Quantization (once, when the model loads): per output row ``n`` of a weight ``W`` [N, K],
``scale[n] = max_k |W[n, k]| / 127`` and ``q[n, k] = round(W[n, k] / scale[n])`` in
[-127, 127] (symmetric, no zero point; an all-zero row gets scale 1). ``q * scale`` is then
within ``scale / 2`` of ``W`` everywhere.

The product: pagedkv's CPU linear kernel (:mod:`pagedkv.worker.cpu_linear`, the Rust core's
``cpu_linear``) on the codes: each code becomes float32 exactly, is multiplied by the float32
input and summed in float32, and the row's scale is applied to the sum. So the error against
the float32 linear is the weights' rounding alone (``scale / 2`` per weight), and a row's
product is the same bits whatever else is in the step. benches/RESULTS.md, "Weight precision",
measures what the rounding does to the next-token distribution. (The first version ran torch's
``_weight_int8pack_mm`` on bfloat16-rounded inputs, with float32 ones it was about 10x slower;
the kernel was faster than it at every row count from 1 to 512, and takes any input width,
where torch's had no tail along K: inf at K = 33, a crash at K = 37.)

Each ``nn.Linear`` (exactly that class) whose weight is floating point on the CPU becomes an
:class:`_Int8Linear` in place: its ``weight`` parameter is replaced by the int8 one (same
shape, so code that reads ``weight.shape`` still works; anything that would multiply by it as
floats fails loudly on the dtype), the scales are a buffer ``weight_scale`` (float32 [N]),
hooks stay, and the kernel reads a float32 copy of the bias (``_bias_f32``; the bias itself
stays in the model's dtype). A head tied to the input embedding keeps the embedding float:
only the head's own parameter is replaced, which unties them.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from pagedkv.worker.cpu_linear import KernelArrays, kernel_linear, op_linear

__all__ = ["quantize_per_channel", "use_int8_linears"]


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [N, K] float -> (int8 [N, K], float32 scales [N]), symmetric per output row."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    scales = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scales


class _Int8Linear(nn.Linear):
    weight_scale: torch.Tensor  # float32 [N]
    _bias_f32: torch.Tensor | None  # float32 [N]: the bias as the kernel reads it
    _arrays: KernelArrays

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] float -> [..., N] x.dtype
        if torch.compiler.is_compiling():
            return op_linear(x, self.weight, self.weight_scale, self._bias_f32)
        return kernel_linear(x, self._arrays)


@torch.no_grad()
def use_int8_linears(model: nn.Module) -> list[nn.Linear]:
    """Switches every plain CPU ``nn.Linear`` of ``model`` with a floating-point weight to int8
    weights (in place); returns the switched modules."""
    switched: list[nn.Linear] = []
    for module in model.modules():
        if type(module) is not nn.Linear:
            continue
        weight = module.weight
        if not weight.is_floating_point() or weight.device.type != "cpu":
            continue
        q, scales = quantize_per_channel(weight)
        module.weight = nn.Parameter(q, requires_grad=False)
        module.register_buffer("weight_scale", scales)
        bias = None if module.bias is None else module.bias.detach().float().contiguous()
        module.register_buffer("_bias_f32", bias, persistent=False)
        module._arrays = KernelArrays.of(q, scales, bias)  # type: ignore[assignment]
        module.__class__ = _Int8Linear
        switched.append(cast(_Int8Linear, module))
    return switched
