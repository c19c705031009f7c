"""pagedkv's own CPU linear kernel for the model's linears (the Rust core's ``cpu_linear``,
rust/cpu_linear.rs): float32 weights at a decode step's few rows (``linear_kernel="pagedkv"``)
and int8 weights at every row count (``quantization="int8"``, :mod:`pagedkv.worker.int8_linear`).

Why: a batch-1 decode step is bound by reading the weights, and torch's default product (MKL,
AVX2 on this project's AMD EPYC machines) streamed SmolLM2's decoder linears at 13-14 GB/s
where the kernel, on the crate's worker threads, reads them at 19-20 GB/s: 31 vs 21 ms per
step for the 210 linears, 61 vs 44 ms at 16 rows; from 64 rows on MKL's blocked product is the
faster one (122 vs 135 ms), so ``linear_kernel="pagedkv"`` hands products of more than
:data:`MAX_KERNEL_ROWS` rows to torch. Int8 weights take the kernel at every row count: it was
faster than torch's weight-only int8 product at 1 to 512 rows (12 vs 16 ms at one row, 36 vs 53
at 16, 1.0 vs 1.36 s at 512) and multiplies float32 inputs exactly where torch's kernel wants
them rounded to bfloat16. (benches/RESULTS.md, "Weight precision" and "Decode step profile".)

The kernel sums every output element in one order whatever the row count and threads, so a
row's product does not depend on the other rows of the step (within products the kernel runs:
with ``linear_kernel="pagedkv"`` a decode row of a step with more than ``MAX_KERNEL_ROWS``
tokens goes through MKL instead). Against MKL's product it differs in the last bits (about
1e-6 relative): greedy tokens can differ at a near-tie, as with ``"onednn"``, so it is an option.

Under ``torch.compile`` the product is the custom op ``pagedkv::cpu_linear`` (opaque to the
compiler, as the attention op is); eager forwards call the kernel directly, without the op's
dispatch cost (~10 microseconds a call, about 2 ms per step).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pagedkv import _core

__all__ = ["MAX_KERNEL_ROWS", "LinearSwitch", "kernel_linear", "use_pagedkv_linears"]

# Float32 products of more rows than this go to torch (see the module docstring: MKL's blocked
# product overtakes the kernel between 16 and 64 rows on AMD EPYC).
MAX_KERNEL_ROWS = 32


@dataclass
class LinearSwitch:
    """The linears a ``linear_kernel`` switched; ``enabled = False`` runs them through
    ``F.linear`` again (benchmarks compare both in one process)."""

    enabled: bool = True
    modules: list[torch.nn.Linear] = field(default_factory=list)


def _run(
    x: torch.Tensor,  # [M, K] float32, C-contiguous
    weight: torch.Tensor,  # [N, K] float32, or int8 codes
    scales: torch.Tensor | None,  # [N] float32, with int8 codes
    bias: torch.Tensor | None,  # [N] float32
) -> torch.Tensor:  # [M, N] float32
    out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
    _core.cpu_linear(
        x.numpy(),
        weight.numpy(),
        out.numpy(),
        torch.get_num_threads(),
        scales=None if scales is None else scales.numpy(),
        bias=None if bias is None else bias.numpy(),
    )
    return out


@torch.library.custom_op("pagedkv::cpu_linear", mutates_args=())
def cpu_linear_op(
    x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor | None, bias: torch.Tensor | None
) -> torch.Tensor:
    """The kernel as an op for compiled graphs (shapes as :func:`_run`)."""
    return _run(x.contiguous(), weight, scales, bias)


@cpu_linear_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0], dtype=torch.float32)


def kernel_linear(
    x: torch.Tensor,  # [..., K] floating point
    weight: torch.Tensor,  # [N, K] float32, or int8 codes; C-contiguous
    scales: torch.Tensor | None,  # [N] float32, with int8 codes
    bias: torch.Tensor | None,  # [N] float32
) -> torch.Tensor:  # [..., N] x.dtype
    """``x @ (weight * scales[:, None]).T + bias`` through the kernel, in ``x``'s dtype."""
    rows = x.reshape(-1, x.shape[-1]).detach().to(torch.float32).contiguous()
    if torch.compiler.is_compiling():
        out = torch.ops.pagedkv.cpu_linear(rows, weight, scales, bias)
    else:
        out = _run(rows, weight, scales, bias)
    return out.to(x.dtype).view(*x.shape[:-1], weight.shape[0])


class _PagedkvLinear(torch.nn.Linear):
    """A float32 CPU linear whose products of up to :data:`MAX_KERNEL_ROWS` rows run the kernel."""

    _switch: LinearSwitch

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        few_rows = x.numel() <= MAX_KERNEL_ROWS * x.shape[-1]
        if not (self._switch.enabled and few_rows and x.dtype == torch.float32 and x.device.type == "cpu"):
            return F.linear(x, self.weight, self.bias)
        bias = None if self.bias is None else self.bias.detach()
        return kernel_linear(x, self.weight.detach(), None, bias)


@torch.no_grad()
def use_pagedkv_linears(model: torch.nn.Module) -> LinearSwitch:
    """Switches every plain float32 CPU ``nn.Linear`` of ``model`` (exactly that class: a
    subclass keeps its own forward) to the kernel at few rows, in place (same parameters and
    hooks)."""
    switch = LinearSwitch()
    for module in model.modules():
        if type(module) is not torch.nn.Linear:
            continue
        weight = module.weight
        if weight.dtype != torch.float32 or weight.device.type != "cpu" or not weight.is_contiguous():
            continue
        module.__class__ = _PagedkvLinear
        module._switch = switch  # type: ignore[assignment]
        switch.modules.append(module)
    return switch
