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
context (one code path: KV cache groups, quantized KV, windows and all). The op's output
feeds the next layer, which orders the layers' calls; that the compiler keeps every call is
the op's side-effect mark (below).

What stays eager (the caller's choice, :meth:`CompiledForward.applies`): probe and profiling
forwards, and steps whose prompt rows go back to the LM head as hidden states (the head's
pre-hook changes per step).

One graph for every step: the step's token count and its sampled rows are *unbacked* sizes
(``mark_unbacked``), so dynamo neither specialises a one-token decode or a one-row sample into
graphs of their own nor guards on the counts; each compile of SmolLM2 took 30-50 s on 2 cores
and a server whose steps changed size compiled up to five (benches/RESULTS.md). That needs
transformers' mask code out of the graph: pagedkv registers no mask function, so it builds
none (:func:`~pagedkv.worker.attention_backend.register_pagedkv_attention`). The graph is
captured whole ahead of time (``aot_compile``) and saved to disk
(:mod:`pagedkv.worker.compiled_artifact`), so a second process loads it instead of tracing the
model again: under 1 s more than an eager start for SmolLM2, against 10-21 s when only
inductor's and AOT autograd's caches were reused (benches/RESULTS.md, "Compiled forward:
compile time at start"). A model that dynamo cannot capture as one graph is compiled the usual
way (graph breaks allowed), and nothing is saved.

On the CPU with torch's own linears the runner compiles with inductor's freezing
(``freeze=True``): the weights become graph constants and the linears oneDNN's prepacked
products; without it the linears stay MKL's and compiling gains far less over eager
(benches/RESULTS.md, "Decode step profile"). A frozen graph is neither saved (its weights are constants of the artifact) nor cached
across processes (AOT autograd refuses it), so with pagedkv's own linears
(``linear_kernel="pagedkv"``, int8 weights: ops of their own, nothing to pack) the runner does
not freeze.

The attention op's K/V store is a side effect, so the op is marked as having one: a graph
specialised for a step that samples no row (a prefill chunk before the prompt's last) once
removed the last layer's call as dead code, and that layer's K/V for the chunk was never
written (tiny Gemma 2/3 gave other greedy tokens on chunked prefills; tests/worker/test_compiled_forward.py
counts every layer's call in every step).

Outputs are not bit-identical to eager (inductor fuses the norms and elementwise ops, which
sums in other orders): greedy tokens are checked against transformers and eager
(tests/worker/test_compiled_forward.py, tests/engine/test_engine_greedy.py), and the default stays eager.
"""

from __future__ import annotations

# The bytecode dynamo writes around the graph loads ``collections`` (to rebuild the model's
# output, an OrderedDict) by name from the captured function's globals, which are this module's:
# imported here, a saved forward loads with ``f_globals=globals()``.
import collections  # noqa: F401
import functools
import logging
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from pagedkv.worker.attention_backend import (
    ATTENTION_NAME,
    CONTEXT_KWARG,
    PagedAttentionContext,
    pagedkv_attention_forward,
)
from pagedkv.worker.compiled_artifact import artifact_dir, artifact_key, load_artifact, save_artifact

__all__ = ["CompiledForward", "install"]

logger = logging.getLogger(__name__)


class _Step(threading.local):
    """The context of the compiled forward running on this thread (None outside one)."""

    context: PagedAttentionContext | None = None


_STEP = _Step()

# (keyword argument, its dimension that counts the step's tokens or sampled rows)
_TOKEN_DIMS = (("input_ids", 1), ("position_ids", 1), ("logits_to_keep", 0))
# The size inductor plans those dimensions for (it decides at compile time which loops run in
# parallel; with no hint it assumes 8192 rows, and every small elementwise kernel of a decode
# step opened an OpenMP region).
_TOKEN_HINT: int | None = 1


# Defined through torch.library.Library, not torch.library.custom_op: the plain backend kernel
# costs less per call (cpu_linear.py says why that matters at one call per layer and linear).
_LIBRARY = torch.library.Library("pagedkv", "FRAGMENT")  # type: ignore[no-untyped-call]
_LIBRARY.define("paged_attention_step(Tensor query, Tensor key, Tensor value, int layer, float scale) -> Tensor")  # type: ignore[no-untyped-call]


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
    return out.contiguous()  # a fresh tensor: an op's output may not alias its inputs


# Every device the backends run on (CPU, CUDA): the function dispatches on the context.
_LIBRARY.impl("paged_attention_step", paged_attention_step, "CompositeExplicitAutograd")  # type: ignore[no-untyped-call]


@torch.library.register_fake("pagedkv::paged_attention_step")  # type: ignore[untyped-decorator]
def _(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int, scale: float) -> torch.Tensor:
    return query.new_empty(1, query.shape[2], query.shape[1], value.shape[3])


# The op writes the layer's K/V into the cache, a side effect its signature cannot name (the
# cache is not an argument): marked as having one, no compiler pass removes a call whose
# output reaches no logit (the module docstring says what happened without). Not torch's
# effect tokens (torch.library._register_effectful_op): inductor does not cache graphs that
# carry them, and the calls are ordered by their data already.
torch.fx.node.has_side_effect(torch.ops.pagedkv.paged_attention_step.default)


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


def _model_forward(model: Any, **kwargs: Any) -> Any:
    """The function captured ahead of time: the model is an argument (its weights are the
    graph's inputs at every call), not a constant of the saved artifact."""
    return model(**kwargs)


def _no_guards(guards: list[Any]) -> list[bool]:
    """Drops every guard of the captured forward: guards on object ids cannot be saved, and the
    artifact's key stands for them (:mod:`pagedkv.worker.compiled_artifact`)."""
    return [False] * len(guards)


def _call_signature(kwargs: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    """What of a call a compiled forward is specific to: names, and the tensors' dtypes and ranks."""
    return tuple(
        (name, f"{value.dtype}/{value.dim()}" if isinstance(value, torch.Tensor) else repr(value))
        for name, value in sorted(kwargs.items())
    )


class CompiledForward:
    """``model.forward`` under ``torch.compile(dynamic=True)``; call it with the step's
    keyword arguments, the context among them."""

    def __init__(self, model: Any, *, freeze: bool = False) -> None:
        install()
        self._model = model
        self._freeze = freeze
        # One forward per call signature (in practice one per engine), made at its first call:
        # loaded from disk, captured ahead of time and saved, or torch.compile's lazy path.
        self._forwards: dict[tuple[tuple[str, str], ...], Callable[..., Any]] = {}
        self._jit: Callable[..., Any] | None = None
        # How the last forward was made: "loaded" (a saved artifact), "captured" (compiled whole
        # and saved) or "jit" (torch.compile as called, nothing saved); and the artifact's path.
        self.origin: str | None = None
        self.artifact_path: Path | None = None
        self.seconds: float | None = None  # making the last forward and its first call
        # Inductor's options, set around every call (compiles happen in calls;
        # torch.compile(options={"freezing": True}) compiled the same as without: the options
        # must be in force when the compile happens, which is inside a call).
        # - freezing: the weights become constants of the graph, so inductor may lay them out for
        #   its kernels (on the CPU: oneDNN's packed linears, as linear_kernel="onednn" does).
        # - cpp.threads = 1: inductor's own CPU kernels (norms, RoPE, activations: the graph's
        #   products and attention are ops with their own threads) run on the calling thread.
        #   With torch's threads, a kernel whose loop it split (the MLP's act * up) entered an
        #   OpenMP region at every layer, waking sleeping threads while pagedkv's kernel threads
        #   still spun on the other cores, so the work outside the linears of a batch-1 step took
        #   longer than eager's (benches/RESULTS.md, "Compiled forward: the step's overhead").
        #   One thread costs little at prefill: these kernels read a few MB per layer.
        self._inductor_options: dict[str, Any] = {"freezing": freeze, "cpp.threads": 1}

    @staticmethod
    def applies(context: object, hidden_rows: object) -> bool:
        """Whether a forward with this context runs compiled (see the module docstring)."""
        return isinstance(context, PagedAttentionContext) and hidden_rows is None

    def __call__(self, **kwargs: Any) -> Any:
        context = kwargs.pop(CONTEXT_KWARG)
        # The step's token count and its sampled rows as unbacked sizes: one graph for every
        # count, 1 included (a backed size gets dynamo's 0/1 specialisation: a decode step of
        # one sequence, or one sampled row, would be a graph of its own, ~30-50 s to compile).
        for name, dim in _TOKEN_DIMS:
            tensor = kwargs.get(name)
            if isinstance(tensor, torch.Tensor):
                if tensor.numel() == 0:  # a step that samples no row: its view may have stride 0,
                    tensor = kwargs[name] = tensor.new_empty(tensor.shape)  # a guard of its own
                torch._dynamo.decorators.mark_unbacked(tensor, dim, hint_override=_TOKEN_HINT)
        _STEP.context = context
        try:
            # specialize_float: the layers' attention scales are constants of the graph; as
            # symbolic floats (what dynamic=True makes them) dynamo traced the model twice.
            import torch._inductor.config as inductor_config  # loaded by torch.compile's first call anyway

            with torch._dynamo.config.patch(specialize_float=True), inductor_config.patch(self._inductor_options):
                signature = _call_signature(kwargs)
                forward = self._forwards.get(signature)
                if forward is not None:
                    return forward(**kwargs)
                started = time.perf_counter()
                forward = self._forwards[signature] = self._make_forward(kwargs)
                out = forward(**kwargs)  # the jit path compiles here
                self.seconds = time.perf_counter() - started
                where = "not saved" if self.origin == "jit" else str(self.artifact_path)
                logger.info(
                    "compiled forward of %s: %s in %.1f s (%s)",
                    type(self._model).__name__,
                    self.origin,
                    self.seconds,
                    where,
                )
                return out
        finally:
            _STEP.context = None

    def _make_forward(self, kwargs: dict[str, Any]) -> Callable[..., Any]:
        """The compiled forward for calls like ``kwargs`` (the first such call's arguments)."""
        if self._freeze:  # its weights would be constants of a saved artifact
            return self._jit_forward()
        path = artifact_dir() / f"forward-{artifact_key(self._model, kwargs, self._inductor_options)}.bin"
        self.artifact_path = path
        loaded = load_artifact(path, globals())
        if loaded is not None:
            self.origin = "loaded"
            return functools.partial(loaded, self._model)
        logger.info(
            "compiling the forward of %s (once per model and machine: the next start loads it from %s; "
            "enforce_eager=True skips it)",
            type(self._model).__name__,
            path,
        )
        try:
            # torch.compile's result gains aot_compile (a prototype API) at run time; its stubs
            # type it as the plain function.
            compiler: Any = torch.compile(
                _model_forward, dynamic=True, fullgraph=True, options={"guard_filter_fn": _no_guards}
            )
            captured = compiler.aot_compile(((self._model,), kwargs))
        except Exception as exc:  # a graph break, or a part the capture cannot save
            warnings.warn(
                f"the compiled forward of {type(self._model).__name__} was not captured whole "
                f"({type(exc).__name__}: {exc}); compiling it as called, and a restart compiles again",
                stacklevel=3,
            )
            return self._jit_forward()
        save_artifact(captured, path, globals())
        self.origin = "captured"
        return functools.partial(captured, self._model)

    def _jit_forward(self) -> Callable[..., Any]:
        if self._jit is None:
            self._jit = torch.compile(self._model.forward, dynamic=True)
        self.origin = "jit"
        return self._jit
