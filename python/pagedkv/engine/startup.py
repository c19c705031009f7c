"""An engine's parts built from its configuration: the model runner (with the tensor-parallel
workers, started first), the tokenizer, and the Rust scheduler sized to the runner's KV pool."""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

from pagedkv._core import Scheduler, SchedulerConfig
from pagedkv.background import BackgroundThreads
from pagedkv.config import EngineConfig, SpeculativeConfig, check_pool_holds_one_request
from pagedkv.engine.draft_model import DraftModelProposer, check_draft_vocabulary
from pagedkv.errors import ConfigError, EngineDeadError, ModelLoadError, PagedKVError
from pagedkv.parallel.executor import MultiprocExecutor, start_workers
from pagedkv.structured.compiler import GrammarCompiler
from pagedkv.worker.model_runner import ModelRunner

if TYPE_CHECKING:
    from pagedkv.distributed.connector import KVConnector
    from pagedkv.parallel.ray_executor import RayExecutor

__all__ = [
    "load_tokenizer",
    "make_drafter",
    "make_grammar_compiler",
    "make_kv_connector",
    "make_scheduler",
    "start_runner",
    "stop_workers",
]

# How long a broken tensor-parallel group waits for a dead worker's exit status (to name it).
_WORKER_EXIT_GRACE_S = 2.0


def start_runner(config: EngineConfig) -> tuple[ModelRunner, MultiprocExecutor | RayExecutor | None]:
    """Rank 0's runner, and the executor of ranks 1..N-1 under tensor parallelism (started
    first: they wait for rank 0 to join); a failure stops whatever was started."""
    executor: MultiprocExecutor | RayExecutor | None = None
    tp = None
    if config.parallel.tensor_parallel_size > 1:
        if config.kv_transfer is not None:
            raise ConfigError("kv_transfer_config with tensor_parallel_size > 1 is not supported")
        tp, executor = start_workers(config)
    spec = config.speculative
    if spec is not None and spec.method == "draft_model":
        check_draft_vocabulary(spec, config.model)  # before any weights load
    try:
        return ModelRunner(config.model, config.cache, config.scheduling, tp=tp), executor
    except BaseException as exc:
        if executor is not None:
            failures = executor.failures()
            executor.shutdown()
            if failures and isinstance(exc, Exception) and not isinstance(exc, PagedKVError):
                raise EngineDeadError(f"tensor-parallel workers failed to start: {'; '.join(failures)}") from exc
        raise


def stop_workers(executor: MultiprocExecutor | RayExecutor | None, exc: EngineDeadError) -> EngineDeadError:
    """The tensor-parallel group broke: stops the workers; returns the error every later step
    raises (naming the workers that died, if any)."""
    failures = [] if executor is None else executor.failures()
    # A killed worker's sockets close as it dies, a moment before its exit status can be
    # read: give it that moment, so the error names it.
    deadline = time.monotonic() + _WORKER_EXIT_GRACE_S
    while executor is not None and not failures and time.monotonic() < deadline:
        time.sleep(0.05)
        failures = executor.failures()
    if executor is not None:
        executor.shutdown()
    return EngineDeadError(str(exc) + (f" ({'; '.join(failures)})" if failures else ""))


def make_scheduler(config: EngineConfig, runner: ModelRunner) -> Scheduler:
    """The Rust scheduler over ``runner``'s KV pool (checked to hold one full-length request)."""
    layout = runner.kv_layout
    scheduler_config = SchedulerConfig(
        num_blocks=runner.num_blocks,
        block_size=runner.block_size,
        max_model_len=runner.max_model_len,
        max_num_seqs=config.scheduling.max_num_seqs,
        max_num_batched_tokens=config.scheduling.max_num_batched_tokens,
        enable_prefix_caching=config.cache.enable_prefix_caching,
        policy=config.scheduling.policy,
        num_host_blocks=runner.num_host_blocks,
        num_disk_blocks=runner.num_disk_blocks,
        preemption_mode=config.scheduling.preemption_mode,
        bytes_per_block=runner.bytes_per_block,
        enable_kv_events=config.cache.enable_kv_cache_events,
        # KV cache groups: one block table per group (worker/kv_layout.py).
        attention_spans=layout.kv_groups,
        **_speculative_args(config.speculative),
    )
    check_pool_holds_one_request(
        runner.num_blocks,
        runner.block_size,
        runner.max_model_len,
        f", {runner.kv_cache_bytes} bytes",
        scheduler_config.blocks_for_sequence(runner.max_model_len) if layout.grouped else None,
    )
    return Scheduler(scheduler_config)


def make_drafter(config: EngineConfig, runner: ModelRunner) -> DraftModelProposer | None:
    """The draft model of ``speculative_config={"method": "draft_model", ...}``, else None."""
    spec = config.speculative
    if spec is None or spec.method != "draft_model":
        return None
    return DraftModelProposer(
        spec,
        config.model,
        config.scheduling,
        max_model_len=runner.max_model_len,
        block_size=runner.block_size,
        vocab_size=runner.vocab_size,
        target_kv_bytes=runner.kv_cache_bytes,
    )


def make_grammar_compiler(
    config: EngineConfig, tokenizer: Any, vocab_size: int, eos_token_ids: list[int], background: BackgroundThreads
) -> GrammarCompiler:
    """Structured outputs' compiler: grammars compile off the engine's thread, cached (its
    threads in ``background``: /health)."""
    structured = config.structured_outputs
    return GrammarCompiler(
        tokenizer,
        vocab_size,
        eos_token_ids,
        workers=structured.compile_workers,
        max_cached=structured.max_cached_grammars,
        max_queued=structured.max_queued_compiles,
        background=background,
    )


def make_kv_connector(
    config: EngineConfig,
    scheduler: Scheduler,
    runner: ModelRunner,
    lock: threading.RLock,
    background: BackgroundThreads,
) -> KVConnector | None:
    """KV transfer between engines (``kv_transfer_config``), else None."""
    if config.kv_transfer is None:
        return None
    from pagedkv.distributed.connector import KVConnector

    return KVConnector(config.kv_transfer, scheduler, runner, lock, background=background)


def _speculative_args(spec: SpeculativeConfig | None) -> dict[str, Any]:
    """The Rust SchedulerConfig's speculative-decoding arguments (none when it is off)."""
    if spec is None:
        return {}
    args: dict[str, Any] = {
        "num_speculative_tokens": spec.num_speculative_tokens,
        "speculative_method": spec.method,
        "speculative_adaptive": spec.adaptive,
    }
    if spec.method == "ngram":
        return args | {"prompt_lookup_min": spec.prompt_lookup_min, "prompt_lookup_max": spec.prompt_lookup_max}
    if spec.method == "suffix":
        return args | {
            "suffix_decoding_max_tree_depth": spec.suffix_decoding_max_tree_depth,
            "suffix_decoding_max_spec_factor": spec.suffix_decoding_max_spec_factor,
            "suffix_decoding_min_token_prob": spec.suffix_decoding_min_token_prob,
            "suffix_decoding_max_cached_requests": spec.suffix_decoding_max_cached_requests,
        }
    return args  # draft_model: the drafts come from the engine (Scheduler.set_drafts)


def load_tokenizer(name: str, trust_remote_code: bool) -> Any:
    """The model's Hugging Face tokenizer (ModelLoadError when there is none)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"could not load a tokenizer from {name!r}: {exc}") from exc
