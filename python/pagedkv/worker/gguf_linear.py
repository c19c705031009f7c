"""Linears served straight from a GGUF file's quantized blocks on the CPU (``quantization="gguf"``,
the default for a GGUF model on the CPU).

A batch-1 decode step reads every weight once, so on the CPU it is bound by the bytes it reads:
SmolLM2-135M's linears are 538 MB as float32 and ~100 MB as the Q4_1 blocks its GGUF file
ships. A linear whose GGUF tensor is Q4_0, Q4_1, Q8_0 or Q4_K keeps those blocks as they are
(a uint8 tensor, one row of blocks per output row) and multiplies them by float32 inputs in the
Rust core's ``cpu_linear_gguf`` (rust/cpu_linear_gguf/): each group of 32 integers is widened
and converted to float32 in registers, multiplied by the input and scaled once per group.

Each ``nn.Linear`` whose weight came from such a tensor becomes a :class:`_GgufLinear` in place
(hooks stay): the blocks are the buffer ``gguf_blocks``, the type the attribute ``gguf_type``,
and ``weight`` a parameter on the ``meta`` device of the weight's shape (code that reads
``weight.shape`` still works; anything that multiplies by it fails loudly). A head tied to the
input embedding gets blocks of its own (the embedding keeps its float weight): the tie is
undone, as with ``quantization="int8"``.

The kernel sums each output element in one order whatever the other rows of the step and the
threads, so a row's product does not depend on its batch. Against the float32 model dequantized
from the same file the product differs by rounding only (the same weights, summed in another
order): tests/kernels/test_gguf_linear.py checks logits and greedy tokens.

Under ``torch.compile`` the product is the custom op ``pagedkv::cpu_linear_gguf`` (opaque to the
compiler); eager forwards call the kernel directly.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple, cast

import numpy as np
import torch
from torch import nn

from pagedkv import _core

__all__ = ["GGUF_BLOCK_FORMATS", "GgufArrays", "gguf_isas", "gguf_linear", "op_gguf_linear", "use_gguf_linears"]

# The GGUF types the kernel reads: (values per block, bytes per block).
GGUF_BLOCK_FORMATS: dict[str, tuple[int, int]] = {
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q8_0": (32, 34),
    "Q4_K": (256, 144),
}


def gguf_isas() -> list[str]:
    """The instruction sets this CPU runs the kernel on (``"portable"`` last; ``"auto"`` is AVX2
    where the CPU has it: see rust/cpu_linear_gguf/mod.rs, ``GgufIsa::Auto``)."""
    return list(_core.gguf_linear_isas())


def _run(
    x: torch.Tensor,  # [M, K] float32, C-contiguous
    blocks: torch.Tensor,  # [N, row_bytes] uint8
    kind: str,
    bias: torch.Tensor | None,  # [N] float32
) -> torch.Tensor:  # [M, N] float32
    out = torch.empty(x.shape[0], blocks.shape[0], dtype=torch.float32)
    _core.cpu_linear_gguf(
        x.numpy(),
        blocks.numpy(),
        kind,
        out.numpy(),
        torch.get_num_threads(),
        bias=None if bias is None else bias.numpy(),
    )
    return out


# The op for compiled graphs, a plain backend kernel as ``pagedkv::cpu_linear`` is (see
# pagedkv.worker.cpu_linear for why not torch.library.custom_op).
_LIBRARY = torch.library.Library("pagedkv", "FRAGMENT")  # type: ignore[no-untyped-call]
_LIBRARY.define("cpu_linear_gguf(Tensor x, Tensor blocks, str kind, Tensor? bias) -> Tensor")  # type: ignore[no-untyped-call]


def _op_kernel(x: torch.Tensor, blocks: torch.Tensor, kind: str, bias: torch.Tensor | None) -> torch.Tensor:
    return _run(x.contiguous(), blocks, kind, bias)


_LIBRARY.impl("cpu_linear_gguf", _op_kernel, "CPU")  # type: ignore[no-untyped-call]


@torch.library.register_fake("pagedkv::cpu_linear_gguf")  # type: ignore[untyped-decorator]
def _(x: torch.Tensor, blocks: torch.Tensor, kind: str, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape[0], blocks.shape[0], dtype=torch.float32)


class GgufArrays(NamedTuple):
    """A block linear's tensors as the kernel reads them: numpy views sharing their memory, made
    once when the linear is switched."""

    blocks: np.ndarray  # [N, row_bytes] uint8, C-contiguous
    kind: str
    bias: np.ndarray | None  # [N] float32


def gguf_linear(
    x: torch.Tensor,  # [..., K] floating point
    arrays: GgufArrays,
    isa: str = "auto",
) -> torch.Tensor:  # [..., N] x.dtype
    """``x @ W.T + bias`` with ``W`` the blocks of ``arrays``, eager; ``isa`` forces an
    instruction set (tests and benchmarks)."""
    n = arrays.blocks.shape[0]
    rows = x.reshape(-1, x.shape[-1])
    if rows.dtype != torch.float32 or rows.requires_grad or not rows.is_contiguous():
        rows = rows.detach().to(torch.float32).contiguous()
    out = torch.empty((rows.shape[0], n), dtype=torch.float32)
    _core.cpu_linear_gguf(
        rows.numpy(), arrays.blocks, arrays.kind, out.numpy(), torch.get_num_threads(), arrays.bias, isa
    )
    if x.dtype != torch.float32:
        out = out.to(x.dtype)
    return out.view(*x.shape[:-1], n)


def op_gguf_linear(x: torch.Tensor, blocks: torch.Tensor, kind: str, bias: torch.Tensor | None) -> torch.Tensor:
    """:func:`gguf_linear` as the op ``pagedkv::cpu_linear_gguf``: what a compiled graph calls."""
    rows = x.reshape(-1, x.shape[-1]).to(torch.float32)
    out: torch.Tensor = torch.ops.pagedkv.cpu_linear_gguf(rows, blocks, kind, bias)
    return out.to(x.dtype).view(*x.shape[:-1], blocks.shape[0])


class _GgufLinear(nn.Linear):
    gguf_blocks: torch.Tensor  # uint8 [N, row_bytes]
    gguf_type: str
    _bias_f32: torch.Tensor | None  # float32 [N]
    _arrays: GgufArrays

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] float -> [..., N] x.dtype
        if torch.compiler.is_compiling():
            return op_gguf_linear(x, self.gguf_blocks, self.gguf_type, self._bias_f32)
        return gguf_linear(x, self._arrays)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, gguf_type={self.gguf_type}"


def _check_blocks(name: str, module: nn.Linear, blocks: torch.Tensor, kind: str) -> None:
    if kind not in GGUF_BLOCK_FORMATS:
        raise ValueError(f"{name}: GGUF type {kind!r} is not one of {tuple(GGUF_BLOCK_FORMATS)}")
    values, nbytes = GGUF_BLOCK_FORMATS[kind]
    n, k = module.out_features, module.in_features
    if blocks.dtype != torch.uint8 or k % values or tuple(blocks.shape) != (n, k // values * nbytes):
        raise ValueError(
            f"{name}: {kind} blocks {tuple(blocks.shape)} {blocks.dtype} do not fit a [{n}, {k}] linear "
            f"(want uint8 [{n}, {k // values * nbytes}])"
        )


@torch.no_grad()
def use_gguf_linears(model: nn.Module, blocks: Mapping[str, tuple[torch.Tensor, str]]) -> list[nn.Linear]:
    """Switches, in place, every plain CPU ``nn.Linear`` of ``model`` whose weight parameter is
    named in ``blocks`` (parameter name -> (uint8 blocks ``[N, row_bytes]``, GGUF type); any
    of a tied parameter's names) to the block kernel; returns the switched modules.
    ``ValueError`` if a block tensor does not fit its linear."""
    by_parameter: dict[int, tuple[str, torch.Tensor, str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        if name in blocks:
            by_parameter[id(parameter)] = (name, *blocks[name])
    switched: list[nn.Linear] = []
    for module in model.modules():
        if type(module) is not nn.Linear or module.weight.device.type != "cpu":
            continue
        entry = by_parameter.get(id(module.weight))
        if entry is None:
            continue
        name, data, kind = entry
        _check_blocks(name, module, data, kind)
        data = data.contiguous()
        shape = tuple(module.weight.shape)
        module.weight = nn.Parameter(torch.empty(shape, device="meta"), requires_grad=False)
        module.register_buffer("gguf_blocks", data)
        bias = None if module.bias is None else module.bias.detach().float().contiguous()
        module.register_buffer("_bias_f32", bias, persistent=False)
        module.gguf_type = kind  # type: ignore[assignment]
        module._arrays = GgufArrays(data.numpy(), kind, None if bias is None else bias.numpy())  # type: ignore[assignment]
        module.__class__ = _GgufLinear
        switched.append(cast(_GgufLinear, module))
    return switched
