"""The scheduler's caps, queue policy and preemption (:class:`SchedulingConfig`), tensor
parallelism (:class:`ParallelConfig`) and grammar compiling (:class:`StructuredOutputsConfig`)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

from pagedkv.config.fields import (
    CORE_FIELDS,
    check_core,
    config_from_any,
    core_setting,
    documented,
    positive_int,
    setting,
)
from pagedkv.errors import ConfigError

__all__ = [
    "EXECUTOR_BACKENDS",
    "POLICIES",
    "PREEMPTION_MODES",
    "ParallelConfig",
    "SchedulingConfig",
    "StructuredOutputsConfig",
]

# The Rust core's names (its table's choices).
POLICIES: tuple[str, ...] = tuple(CORE_FIELDS["policy"]["choices"])
PREEMPTION_MODES: tuple[str, ...] = tuple(CORE_FIELDS["preemption_mode"]["choices"])
EXECUTOR_BACKENDS = ("mp", "ray")
MAX_COMPILE_WORKERS = 64


@documented
@dataclass(frozen=True)
class SchedulingConfig:
    """Per-step caps, queue policy and preemption: settings of the Rust scheduler, whose
    defaults and ranges are the core's (``pagedkv._core.config_fields()``) and which the core
    checks. ``max_num_seqs`` and ``max_num_batched_tokens`` also size the runner's CUDA memory
    profile (one such step)."""

    max_num_seqs: int = core_setting("max_num_seqs", "sequences per step at most.")
    max_num_batched_tokens: int = core_setting(
        "max_num_batched_tokens", "tokens per step at most, shared by decodes and prefill chunks."
    )
    policy: str = core_setting(
        "policy",
        '``"fcfs"`` (arrival order) or ``"priority"`` (lower ``priority`` value first, then arrival): the '
        "order of admission and, reversed, of preemption.",
    )
    preemption_mode: str = core_setting(
        "preemption_mode",
        'what happens to a preempted request\'s KV: ``"recompute"`` (its blocks are freed and its tokens '
        'recomputed when it runs again), ``"swap"`` (copied to the host tier and back) or ``"auto"`` (per '
        "preemption, whichever the cost model finds cheaper, from the measured swap bandwidth); "
        '``"swap"`` and ``"auto"`` need a host tier.',
    )

    def __post_init__(self) -> None:
        check_core(
            {"policy": "scheduling_policy"},  # EngineArgs' and the CLI's name
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            policy=self.policy,
            preemption_mode=self.preemption_mode,
        )


@documented
@dataclass(frozen=True)
class ParallelConfig:
    """Tensor parallelism: ranks each hold ``1 / N`` of every layer's attention heads, KV heads
    and MLP columns (``pagedkv.parallel``)."""

    tensor_parallel_size: int = setting(
        1,
        "split every layer's attention heads, KV heads and MLP over N ranks (N processes on the CPU, N devices "
        "on CUDA; the heads and KV heads must divide by N).",
    )
    distributed_executor_backend: str | None = setting(
        None,
        'how the ranks other than the engine\'s own run: ``"mp"`` (local worker processes, the default) or '
        '``"ray"`` (Ray actors placed by a placement group, on this node or others; the ``ray`` extra).',
    )
    timeout: float = setting(60.0, "seconds any collective may take before the engine gives up on its workers.")

    def __post_init__(self) -> None:
        positive_int("tensor_parallel_size", self.tensor_parallel_size)
        backend = self.distributed_executor_backend
        if backend is not None and backend not in EXECUTOR_BACKENDS:
            raise ConfigError(
                f"distributed_executor_backend must be one of {EXECUTOR_BACKENDS} or None, got {backend!r}"
            )
        if backend == "ray" and importlib.util.find_spec("ray") is None:
            raise ConfigError("distributed_executor_backend='ray' needs Ray: pip install 'pagedkv[ray]'")
        if isinstance(self.timeout, bool) or not isinstance(self.timeout, (int, float)) or not self.timeout > 0:
            raise ConfigError(f"the tensor-parallel timeout must be a number > 0, got {self.timeout!r}")


@documented
@dataclass(frozen=True)
class StructuredOutputsConfig:
    """Structured outputs (JSON schemas, regexes, choices, grammars; ``pagedkv.structured``)."""

    compile_timeout_s: float = setting(
        30.0,
        "a request whose grammar is not compiled after this many seconds fails alone (the compile itself is "
        "bounded by llguidance's fuel limits).",
    )
    max_cached_grammars: int = setting(256, "compiled grammars kept for reuse, most recently used first.")
    compile_workers: int = setting(
        2, f"threads that compile grammars (off the engine thread), 1 .. {MAX_COMPILE_WORKERS}."
    )
    max_queued_compiles: int = setting(
        32,
        "compiles that may wait for a thread; a request that needs one more is refused at once "
        "(``OverloadedError``, a server's 503). A compile whose every request went away before a thread took "
        "it is dropped.",
    )

    def __post_init__(self) -> None:
        timeout = self.compile_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ConfigError(f"structured_outputs_config: compile_timeout_s must be a number > 0, got {timeout!r}")
        positive_int("structured_outputs_config: max_cached_grammars", self.max_cached_grammars)
        positive_int("structured_outputs_config: compile_workers", self.compile_workers, maximum=MAX_COMPILE_WORKERS)
        positive_int("structured_outputs_config: max_queued_compiles", self.max_queued_compiles)

    @classmethod
    def from_any(cls, value: Any) -> StructuredOutputsConfig:
        """From a StructuredOutputsConfig, a dict of its fields, its JSON text (the CLI flag), or
        None (the defaults)."""
        return cls() if value is None else config_from_any(cls, value, "structured_outputs_config")
