"""pagedkv's own CPU linear kernel for the model's linears (the Rust core's ``cpu_linear``,
rust/cpu_linear.rs): float32 weights at a decode step's few rows (``linear_kernel="pagedkv"``),
int8 weights at every row count (``quantization="int8"``, :mod:`pagedkv.worker.int8_linear`)
and bfloat16 weights at every row count (``quantization="bf16"``,
:mod:`pagedkv.worker.bf16_linear`). The kernel takes the fastest path the CPU has (portable,
AVX2, AVX-512, AVX512-BF16; ``_core.cpu_isa()`` says which).

Why: a batch-1 decode step is bound by reading the weights, and the kernel, prefetching weight
rows ahead on the crate's worker threads, streams them faster than torch's default product
(MKL) up to a few dozen rows; past that MKL's blocked product wins, so
``linear_kernel="pagedkv"`` hands products of more than :data:`MAX_KERNEL_ROWS` rows to torch.
The row limit is checked inside the op, not in the forward: as a check on the step's token
count it was a guard of the compiled graph, and each side of it a graph of its own (a compile
each). Int8 weights take the kernel at every row count: it beats torch's weight-only int8
product at every row count measured and multiplies float32 inputs exactly where torch's kernel
wants them rounded to bfloat16. The figures: benches/RESULTS.md, "Decode step with pagedkv's
CPU linear kernel", "Compiled forward: the step's overhead" and "Weight precision".

The parameters' numpy views are made once, when a linear is switched (:class:`KernelArrays`):
code that later replaces a parameter object (rather than copying into it) must switch again.

The kernel sums every output element in one order whatever the row count and threads, so a
row's product does not depend on the other rows of the step (within products the kernel runs:
with ``linear_kernel="pagedkv"`` a decode row of a step with more than ``MAX_KERNEL_ROWS``
tokens goes through MKL instead). Against MKL's product it differs in the last bits (about
1e-6 relative): greedy tokens can differ at a near-tie, as with ``"onednn"``, so it is an option.

Under ``torch.compile`` the product is the custom op ``pagedkv::cpu_linear`` (opaque to the
compiler, as the attention op is; :func:`op_linear`); eager forwards call the kernel directly
(:func:`kernel_linear`), without the op's dispatch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from pagedkv import _core

__all__ = [
    "MAX_KERNEL_ROWS",
    "KernelArrays",
    "LinearSwitch",
    "describe_cpu_kernels",
    "kernel_linear",
    "op_linear",
    "use_pagedkv_linears",
]

# Float32 products of more rows than this go to torch (see the module docstring: MKL's blocked
# product overtakes the kernel between 16 and 64 rows on AMD EPYC).
MAX_KERNEL_ROWS = 32


def describe_cpu_kernels() -> str:
    """One line for logs and benchmarks: the path each of pagedkv's CPU kernels takes on this
    CPU (``_core.cpu_isa()``, rust/cpu_isa.rs) and the instruction sets it found."""
    info = _core.cpu_isa()
    linear = ", ".join(f"{fmt} {path}" for fmt, path in info["linear"].items())
    features = ", ".join(info["features"]) or "none beyond the baseline"
    return f"CPU kernel paths: linear {linear}; attention {info['attention']} (the CPU has {features})"


@dataclass
class LinearSwitch:
    """The linears a ``linear_kernel`` switched; ``enabled = False`` runs them through
    ``F.linear`` again (benchmarks compare both in one process)."""

    enabled: bool = True
    modules: list[torch.nn.Linear] = field(default_factory=list)


def _run(
    x: torch.Tensor,  # [M, K] float32, C-contiguous
    weight: torch.Tensor,  # [N, K] float32, int8 codes or bfloat16
    scales: torch.Tensor | None,  # [N] float32, with int8 codes
    bias: torch.Tensor | None,  # [N] float32
) -> torch.Tensor:  # [M, N] float32
    out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
    # numpy has no bfloat16: the kernel takes bfloat16 weights as their uint16 bit patterns.
    w = weight.view(torch.int16).numpy().view(np.uint16) if weight.dtype == torch.bfloat16 else weight.numpy()
    _core.cpu_linear(
        x.numpy(),
        w,
        out.numpy(),
        torch.get_num_threads(),
        scales=None if scales is None else scales.numpy(),
        bias=None if bias is None else bias.numpy(),
    )
    return out


# The kernel as the op ``pagedkv::cpu_linear`` for compiled graphs, defined through
# ``torch.library.Library`` rather than ``torch.library.custom_op``: a decode step calls it
# once per linear (hundreds of times), and custom_op's Python wrapper (autograd and aliasing
# checks around the kernel) costs several microseconds more per call than a plain backend
# kernel (benches/RESULTS.md, "Compiled forward: the step's overhead").
_LIBRARY = torch.library.Library("pagedkv", "FRAGMENT")  # type: ignore[no-untyped-call]
_LIBRARY.define("cpu_linear(Tensor x, Tensor weight, Tensor? scales, Tensor? bias) -> Tensor")  # type: ignore[no-untyped-call]


def cpu_linear_op(
    x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor | None, bias: torch.Tensor | None
) -> torch.Tensor:
    """The op's kernel (shapes as :func:`_run`). Float32 products of more than
    :data:`MAX_KERNEL_ROWS` rows go to torch here, at run time, and not in the module's
    forward: a branch on the row count there would be a guard on the step's token count, and
    every side of it a graph of its own (a ~50 s compile each on 2 cores)."""
    if weight.dtype == torch.float32 and x.shape[0] > MAX_KERNEL_ROWS:
        return F.linear(x, weight, bias)
    return _run(x.contiguous(), weight, scales, bias)


_LIBRARY.impl("cpu_linear", cpu_linear_op, "CPU")  # type: ignore[no-untyped-call]


@torch.library.register_fake("pagedkv::cpu_linear")  # type: ignore[untyped-decorator]
def _(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0], dtype=torch.float32)


class KernelArrays(NamedTuple):
    """A linear's parameters as the kernel reads them: numpy views sharing the tensors' memory,
    made once when the linear is switched (a view per call cost microseconds of the ~10 a
    decode-sized call has to spare)."""

    weight: np.ndarray  # [N, K] float32, or int8 codes; C-contiguous
    scales: np.ndarray | None  # [N] float32, with int8 codes
    bias: np.ndarray | None  # [N] float32

    @staticmethod
    def of(weight: torch.Tensor, scales: torch.Tensor | None, bias: torch.Tensor | None) -> KernelArrays:
        def view(t: torch.Tensor | None) -> np.ndarray | None:
            return None if t is None else t.detach().contiguous().numpy()

        w = view(weight)
        assert w is not None
        return KernelArrays(w, view(scales), view(bias))


def op_linear(
    x: torch.Tensor,  # [..., K] floating point
    weight: torch.Tensor,  # [N, K] float32, or int8 codes
    scales: torch.Tensor | None,  # [N] float32, with int8 codes
    bias: torch.Tensor | None,  # [N] float32
) -> torch.Tensor:  # [..., N] x.dtype
    """``x @ (weight * scales[:, None]).T + bias`` as the op ``pagedkv::cpu_linear``: what a
    compiled graph calls (a forward checks ``torch.compiler.is_compiling()`` before it touches
    its :class:`KernelArrays`, which dynamo would otherwise take for graph inputs)."""
    rows = x.reshape(-1, x.shape[-1]).to(torch.float32)
    out: torch.Tensor = torch.ops.pagedkv.cpu_linear(rows, weight, scales, bias)
    return out.to(x.dtype).view(*x.shape[:-1], weight.shape[0])


def kernel_linear(x: torch.Tensor, arrays: KernelArrays) -> torch.Tensor:  # [..., K] -> [..., N] x.dtype
    """``x @ (weight * scales[:, None]).T + bias`` through the kernel, eager: as few torch calls
    as possible (each costs about a microsecond, a small product ~60)."""
    n = arrays.weight.shape[0]
    rows = x.reshape(-1, x.shape[-1])
    if rows.dtype != torch.float32 or rows.requires_grad or not rows.is_contiguous():
        rows = rows.detach().to(torch.float32).contiguous()
    out = torch.empty((rows.shape[0], n), dtype=torch.float32)
    _core.cpu_linear(rows.numpy(), arrays.weight, out.numpy(), torch.get_num_threads(), arrays.scales, arrays.bias)
    if x.dtype != torch.float32:
        out = out.to(x.dtype)
    return out.view(*x.shape[:-1], n)


class _PagedkvLinear(torch.nn.Linear):
    """A float32 CPU linear whose products of up to :data:`MAX_KERNEL_ROWS` rows run the kernel."""

    _switch: LinearSwitch
    _arrays: KernelArrays

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        if not (self._switch.enabled and x.dtype == torch.float32 and x.device.type == "cpu"):
            return F.linear(x, self.weight, self.bias)
        if torch.compiler.is_compiling():
            return op_linear(x, self.weight, None, self.bias)  # the op checks the row count
        if x.numel() > MAX_KERNEL_ROWS * x.shape[-1]:
            return F.linear(x, self.weight, self.bias)
        return kernel_linear(x, self._arrays)


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
        module._arrays = KernelArrays.of(weight, None, module.bias)  # type: ignore[assignment]
        switch.modules.append(module)
    return switch
