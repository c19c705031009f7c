"""Where one engine step's time goes: timers wrapped around the parts of a real
``LLMEngine.step()`` (benches/profile_step.py).

Each part is timed where it is called, by wrapping, never by editing the engine:

* ``schedule`` / ``update``: the Rust scheduler's two calls (a proxy in front of
  ``engine.scheduler``);
* ``step tensors + metadata``: ``runner.execute`` less the model's forward (the step's tensors,
  their checks, ``AttentionBackend.prepare``, the context);
* inside the forward, per module kind (forward pre/post hooks): embedding, the rotary table,
  the attention projections (q/k/v/o), KV store and paged attention (``backend.store_kv`` /
  ``backend.paged_attention``), the attention module's own glue (views, RoPE applied), norms,
  the MLP's linears and the rest of the MLP (activation, product), the LM head, and the forward's
  rest (residual adds, the decoder layers' and the model's own code, the hooks themselves);
* ``sampling metadata`` (``engine._sample`` less the sampler) and ``sampler``;
* ``detokenize`` (``IncrementalDetokenizer.update``);
* the step's rest: ``step()`` less all of the above (outputs, bookkeeping, the lock).

Time inside a timed part is charged to the innermost part (a stack of open timers), so the
parts add up to the step. The hooks cost a few microseconds each (~450 per SmolLM2 step): the
profile reports the instrumented step beside an uninstrumented one measured in the same rounds.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

# Row order of the table; the forward's kinds are indented under "forward".
PARTS = (
    "schedule (Rust)",
    "step tensors + metadata",
    "embedding",
    "rotary cos/sin",
    "norms",
    "q/k/v/o projections",
    "KV store",
    "paged attention",
    "attention glue (views, RoPE)",
    "MLP linears",
    "MLP act * up",
    "LM head",
    "forward rest (residuals, layer code, hooks)",
    "sampling metadata",
    "sampler",
    "update (Rust)",
    "detokenize",
    "step rest (outputs, bookkeeping)",
)
FORWARD_PARTS = PARTS[2:13]


class StepTimers:
    """Exclusive time per part, accumulated while ``active``; ``stack`` holds the open parts."""

    def __init__(self) -> None:
        self.active = False
        self.totals: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._stack: list[list[Any]] = []  # [part, start, child seconds]

    def push(self, part: str) -> None:
        if self.active:
            self._stack.append([part, time.perf_counter(), 0.0])

    def pop(self, part: str) -> None:
        if not self.active or not self._stack:
            return
        name, start, children = self._stack.pop()
        assert name == part, (name, part)
        elapsed = time.perf_counter() - start
        self.totals[name] += elapsed - children
        self.calls[name] += 1
        if self._stack:
            self._stack[-1][2] += elapsed

    @contextmanager
    def part(self, name: str) -> Iterator[None]:
        self.push(name)
        try:
            yield
        finally:
            self.pop(name)

    def reset(self) -> None:
        self.totals.clear()
        self.calls.clear()


def _wrap(timers: StepTimers, part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def timed(*args: Any, **kwargs: Any) -> Any:
        with timers.part(part):
            return fn(*args, **kwargs)

    return timed


class _SchedulerProxy:
    """``engine.scheduler`` with ``schedule`` and ``update`` timed; everything else passed on."""

    def __init__(self, inner: Any, timers: StepTimers) -> None:
        self._inner = inner
        self.schedule = _wrap(timers, "schedule (Rust)", inner.schedule)
        self.update = _wrap(timers, "update (Rust)", inner.update)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _module_part(name: str, module: torch.nn.Module) -> str | None:
    leaf = name.rsplit(".", 1)[-1]
    kind = type(module).__name__
    if leaf == "embed_tokens":
        return "embedding"
    if leaf == "rotary_emb":
        return "rotary cos/sin"
    if kind.endswith("RMSNorm") or kind.endswith("LayerNorm") or leaf.endswith("norm"):
        return "norms"
    if leaf in ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj"):
        return "q/k/v/o projections"
    if leaf in ("gate_proj", "up_proj", "down_proj", "gate_up_proj"):
        return "MLP linears"
    if leaf == "mlp":
        return "MLP act * up"  # the MLP less its linears
    if leaf == "self_attn":
        return "attention glue (views, RoPE)"  # the attention module less what it calls
    if leaf == "lm_head":
        return "LM head"
    return None


class StepProbe:
    """Installs the timers on ``engine`` (``install``) and removes them (``remove``)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.timers = StepTimers()
        self._undo: list[Callable[[], None]] = []

    def install(self) -> None:
        from pagedkv.engine import detokenizer

        engine, timers = self.engine, self.timers
        runner = engine.runner
        scheduler = engine.scheduler
        engine.scheduler = _SchedulerProxy(scheduler, timers)
        self._undo.append(lambda: setattr(engine, "scheduler", scheduler))
        self._patch(engine, "step", "step rest (outputs, bookkeeping)")
        self._patch(runner, "execute", "step tensors + metadata")
        self._patch(engine, "_sample", "sampling metadata")
        self._patch(engine, "sampler", "sampler")
        self._patch(runner.backend, "store_kv", "KV store")
        self._patch(runner.backend, "paged_attention", "paged attention")
        update = detokenizer.IncrementalDetokenizer.update

        def timed_update(det: Any, *args: Any, **kwargs: Any) -> Any:
            with timers.part("detokenize"):
                return update(det, *args, **kwargs)

        detokenizer.IncrementalDetokenizer.update = timed_update  # type: ignore[method-assign]
        self._undo.append(lambda: setattr(detokenizer.IncrementalDetokenizer, "update", update))
        model = runner.model
        handles = [
            model.register_forward_pre_hook(lambda *_: timers.push("forward rest (residuals, layer code, hooks)")),
            model.register_forward_hook(lambda *_: timers.pop("forward rest (residuals, layer code, hooks)")),
        ]
        for name, module in model.named_modules():
            part = _module_part(name, module)
            if part is None:
                continue
            handles.append(module.register_forward_pre_hook(lambda *_, p=part: timers.push(p)))
            handles.append(module.register_forward_hook(lambda *_, p=part: timers.pop(p)))
        self._undo.extend(h.remove for h in handles)

    def _patch(self, owner: Any, attribute: str, part: str) -> None:
        """Times ``owner.attribute`` (an instance attribute shadowing the method; removed after)."""
        original = getattr(owner, attribute)
        had_own = attribute in vars(owner)
        setattr(owner, attribute, _wrap(self.timers, part, original))
        self._undo.append(lambda: setattr(owner, attribute, original) if had_own else delattr(owner, attribute))

    def remove(self) -> None:
        while self._undo:
            self._undo.pop()()
