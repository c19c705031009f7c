"""A first compiled forward (``enforce_eager=False``): the model under ``torch.compile``
(inductor, dynamic shapes), with pagedkv's attention as one opaque custom op.

Why an op: the eager attention function (:mod:`pagedkv.worker.attention_backend`) calls the
backend's Python and Rust code on numpy views of the step's metadata, which dynamo cannot
trace (it fails on the metadata's ``from_numpy`` views) and which would break the graph at
every layer (a compile with a graph break per layer ran no faster than eager). So the step's
:class:`~pagedkv.worker.attention_backend.PagedAttentionContext` is not a model argument here:
:meth:`CompiledForward.__call__` holds it in ``_STEP`` for the duration of the forward, the
attention function registered by :func:`install` sees no context and calls
``torch.ops.pagedkv.paged_attention_step(q, k, v, layer, scale)``, and that op (opaque to the
compiler: a fake implementation gives its shape) runs the eager attention function with the
context (one code path: KV cache groups, quantized KV, windows and all). The op's output feeds the next layer,
so the compiled graph keeps the layers' stores and reads in order.

What stays eager (the caller's choice, :meth:`CompiledForward.applies`): probe and profiling
forwards, and steps whose prompt rows go back to the LM head as hidden states (the head's
pre-hook changes per step). Shapes: ``dynamic=True``, so one graph serves every token count but
one, with dynamo's own 0/1 specialisation for a single token (a batch-1 decode step): two
compiles, each cached on disk by inductor's FX graph cache for the next process. On the CPU
the runner compiles with inductor's freezing (``freeze=True``): the weights become graph
constants and the linears oneDNN's prepacked products; without it the linears stay MKL's and
the compiled step was 1.02x (batch 1) and 1.33x (batch 16) eager's, with it 1.40x and 2.49x
(SmolLM2, first compiles 42 s and 58 s on 2 shared cores; benches/RESULTS.md, "Decode step
profile").

Outputs are not bit-identical to eager (inductor fuses the norms and elementwise ops, which
sums in other orders): greedy tokens are checked against transformers
(tests/test_compiled_forward.py), and the default stays eager. Known bug, not found yet: tiny
Gemma 2 / Gemma 3 models (sliding and full layers, KV cache groups) gave other greedy tokens
compiled than eager on chunked prefills (not on whole prompts; a tiny Mistral, all layers
sliding, agreed), so the runner compiles only models whose every layer is plain full attention.
"""

from __future__ import annotations

import functools
import threading
from types import SimpleNamespace
from typing import Any

import torch

from pagedkv.worker.attention_backend import (
    ATTENTION_NAME,
    CONTEXT_KWARG,
    PagedAttentionContext,
    pagedkv_attention_forward,
)

__all__ = ["CompiledForward", "install"]


class _Step(threading.local):
    """The context of the compiled forward running on this thread (None outside one)."""

    context: PagedAttentionContext | None = None


_STEP = _Step()


@torch.library.custom_op("pagedkv::paged_attention_step", mutates_args=())
def paged_attention_step(
    query: torch.Tensor,  # [1, H, T, D]
    key: torch.Tensor,  # [1, Hkv, T, D]
    value: torch.Tensor,  # [1, Hkv, T, Dv]
    layer: int,
    scale: float,
) -> torch.Tensor:  # [1, T, H, Dv]
    """Layer ``layer``'s attention through the running step's context: the eager attention
    function itself (it stores the layer's K/V and attends; it reads only ``layer_idx`` from
    the module), so both paths stay one code. The KV cache write is a side effect the compiler
    does not see, ordered by the data dependence between layers."""
    context = _STEP.context
    if context is None:
        raise RuntimeError("pagedkv::paged_attention_step runs only inside a CompiledForward call")
    layer_module: Any = SimpleNamespace(layer_idx=layer)
    extra: dict[str, Any] = {CONTEXT_KWARG: context}
    out, _ = pagedkv_attention_forward(layer_module, query, key, value, None, scale, **extra)
    return out.contiguous()  # a fresh tensor: a custom op's output may not alias its inputs


@paged_attention_step.register_fake
def _(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int, scale: float) -> torch.Tensor:
    return query.new_empty(1, query.shape[2], query.shape[1], value.shape[3])


def _attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, H, T, D]
    key: torch.Tensor,  # [1, Hkv, T, D]
    value: torch.Tensor,  # [1, Hkv, T, D]
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:  # ([1, T, H, D], no weights)
    """pagedkv's attention function: the custom op when called without a context (inside a
    compiled forward), else the eager function."""
    if kwargs.get(CONTEXT_KWARG) is not None:
        return pagedkv_attention_forward(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
    scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
    out = torch.ops.pagedkv.paged_attention_step(query, key, value, int(module.layer_idx), scale)  # type: ignore[arg-type]
    return out, None


@functools.cache
def install() -> None:
    """Registers :func:`_attention` as ``"pagedkv"`` in transformers (idempotent; it serves
    eager forwards exactly as :func:`pagedkv_attention_forward` does)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, _attention)


class CompiledForward:
    """``model.forward`` under ``torch.compile(dynamic=True)``; call it with the step's
    keyword arguments, the context among them."""

    def __init__(self, model: Any, *, freeze: bool = False) -> None:
        install()
        self._compiled = torch.compile(model.forward, dynamic=True)
        # Freezing: the weights become constants of the graph, so inductor may lay them out for
        # its kernels (on the CPU: oneDNN's packed linears, as linear_kernel="onednn" does). Set
        # around every call, as compiles happen in calls; torch.compile(options={"freezing":
        # True}) compiled the same as without (a batch-16 step 143 ms either way, 120 with this).
        self._freeze = freeze

    @staticmethod
    def applies(context: object, hidden_rows: object) -> bool:
        """Whether a forward with this context runs compiled (see the module docstring)."""
        return isinstance(context, PagedAttentionContext) and hidden_rows is None

    def __call__(self, **kwargs: Any) -> Any:
        context = kwargs.pop(CONTEXT_KWARG)
        _STEP.context = context
        try:
            if not self._freeze:
                return self._compiled(**kwargs)
            import torch._inductor.config as inductor_config

            with inductor_config.patch(freezing=True):
                return self._compiled(**kwargs)
        finally:
            _STEP.context = None
