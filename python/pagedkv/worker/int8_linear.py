"""Int8 weights for the model's linears on the CPU (``quantization="int8"``).

A batch-1 decode step reads every weight once and does little arithmetic on each, so on the
CPU it is bound by memory traffic: SmolLM2-135M reads 538 MB of float32 linears per token.
Stored as int8 with one float32 scale per output channel, the same weights are a quarter of
that (and of the memory they take).

Quantization (once, when the model loads): per output row ``n`` of a weight ``W`` [N, K],
``scale[n] = max_k |W[n, k]| / 127`` and ``q[n, k] = round(W[n, k] / scale[n])`` in
[-127, 127] (symmetric, no zero point; an all-zero row gets scale 1). ``q * scale`` is then
within ``scale / 2`` of ``W`` everywhere.

The product: torch's own weight-only int8 kernel, ``torch._weight_int8pack_mm(x, q, s)``
(``x @ (q * s).T``, vectorized on the CPU). It is fast with bfloat16 activations and about
10x slower with float32 ones at 16 rows and more (measured on this project's AMD EPYC, AVX2),
so the input rows are rounded to bfloat16 for the product, it runs with unit scales and
returns bfloat16, and the float32 scale (exact, not rounded to bfloat16) is applied to that
output in the model's dtype. So the error against the float32 linear has three parts: the
weights' rounding (``scale / 2`` per weight), the input's rounding to bfloat16 (8 bits of
mantissa) and the output's. benches/RESULTS.md, "Weight precision: quality", measures what
they do to the next-token distribution.

Each ``nn.Linear`` (exactly that class) whose weight is floating point on the CPU, with an
input width the kernel takes (``_K_MULTIPLE``), becomes an :class:`_Int8Linear` in place: its
``weight`` parameter is replaced by the int8 one (same shape, so code that reads
``weight.shape`` still works; anything that would multiply by it as floats fails loudly on the
dtype), the scales are a buffer ``weight_scale`` (float32 [N]), and hooks and bias stay. A head
tied to the input embedding keeps the embedding float: only the head's own parameter is
replaced, which unties them.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

__all__ = ["int8_linears_available", "quantize_per_channel", "use_int8_linears"]

# torch's CPU kernel reads the reduction dimension in whole vectors and has no tail: with K = 33
# it returned inf, with K = 37 it crashed the process (torch 2.15, AVX2). Every K that is a
# multiple of 32 agreed with the float product (tests/test_int8_linear.py sweeps shapes), so a
# linear whose K is not stays in floating point (real models' widths are multiples of 64).
_K_MULTIPLE = 32


def int8_linears_available() -> bool:
    return hasattr(torch, "_weight_int8pack_mm")


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [N, K] float -> (int8 [N, K], float32 scales [N]), symmetric per output row."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    scales = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scales


class _Int8Linear(nn.Linear):
    weight_scale: torch.Tensor  # float32 [N]
    _unit_scales: torch.Tensor  # bfloat16 [N] of ones: the kernel's scales (see the module docstring)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] float -> [..., N] x.dtype
        rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16).contiguous()
        out = torch._weight_int8pack_mm(rows, self.weight, self._unit_scales)  # [M, N] bfloat16
        out = out.to(x.dtype).mul_(self.weight_scale.to(x.dtype))
        if self.bias is not None:
            out.add_(self.bias)
        return out.view(*x.shape[:-1], out.shape[-1])


@torch.no_grad()
def use_int8_linears(model: nn.Module) -> list[nn.Linear]:
    """Switches every plain CPU ``nn.Linear`` of ``model`` with a floating-point weight to int8
    weights (in place); returns the switched modules."""
    switched: list[nn.Linear] = []
    for module in model.modules():
        if type(module) is not nn.Linear:
            continue
        weight = module.weight
        if not weight.is_floating_point() or weight.device.type != "cpu" or weight.shape[1] % _K_MULTIPLE:
            continue
        q, scales = quantize_per_channel(weight)
        module.weight = nn.Parameter(q, requires_grad=False)
        module.register_buffer("weight_scale", scales)
        module.register_buffer("_unit_scales", torch.ones(q.shape[0], dtype=torch.bfloat16), persistent=False)
        module.__class__ = _Int8Linear
        switched.append(cast(_Int8Linear, module))
    return switched
