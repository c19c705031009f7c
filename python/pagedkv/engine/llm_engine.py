"""``LLMEngine``: the embedding API for servers — add requests, step, read outputs.

One ``step()``:

1. ``Scheduler.schedule()`` (Rust) picks the batch and returns it as flat arrays;
2. ``ModelRunner.execute`` runs its copy-on-write ops and one packed forward over all
   scheduled tokens on the paged KV cache, and returns the logits rows to sample;
3. the :class:`Sampler` draws one token per row (greedy / temperature / top-k / top-p / min-p,
   per-sample seeds; eos and stop ids banned below ``min_tokens``);
4. ``Scheduler.update`` (Rust) appends the tokens and applies the token-based stops (eos, stop
   ids, max_tokens, max_model_len), freeing finished sequences' blocks;
5. each new token is detokenized incrementally; a stop string ends its sample
   (``Scheduler.finish_sample``) and cuts the text;
6. a :class:`RequestOutput` is returned for every request that progressed.

Bad input (unknown ids, invalid parameters, empty or too long prompts, token ids outside the
vocabulary) raises a typed :mod:`pagedkv.errors` exception in ``add_request`` /
``abort_request`` before anything changes, so the engine keeps serving its other requests.

Every request enters the scheduler in ``add_request``, where all of the scheduler's checks run.
One that must first wait — for its grammar to compile (structured outputs), for its prompt's
KV to arrive from another engine (``do_remote_prefill``), or both — enters *blocked* on what it
waits for (``Scheduler.add_request(..., wait_for=[...])``): live, never scheduled, holding no
block. What it waits on is held where it is owned — the compile handle by
``GrammarCompiler.held``, the pull by the ``KVConnector`` — and each step, before scheduling,
lifts the reasons that ended (``Scheduler.unblock``) or fails the request whose compile or
pull failed. ``abort_request`` (and a failure) is one ``Scheduler.abort_request``, whatever the
request's state; it returns what the request still waited for, whose holders then drop it.

Failures inside a step cannot wedge the engine: an exception between ``schedule()`` and
``update()`` (an interrupt, out of memory, a bug) rolls the step back in the scheduler and
propagates; the next ``step()`` retries it. Requests are charged one failure per failed step
they were in (a step that goes through clears the count) and are failed alone
(``finish_reason="error"``) after ``max_step_failures`` in a row, so a request that breaks
every forward cannot block the others forever, and transient failures never add up.

Threading: one lock serializes the public methods. ``add_request`` and ``abort_request`` may
be called from any thread (a server's request handlers) while another thread steps; they wait
for the step in flight to end. ``AsyncLLM`` drives the engine from one thread instead.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import TimeoutError as FutureTimeoutError
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from pagedkv._core import RequestUpdate, Scheduler, SchedulerConfig, SchedulerOutput
from pagedkv.background import BackgroundThreads
from pagedkv.distributed.transfer_config import RemotePrefill, parse_kv_transfer_params
from pagedkv.engine import prompt_logprobs
from pagedkv.engine.args import EngineArgs
from pagedkv.engine.beam_tracker import BeamTracker, beam_candidates
from pagedkv.engine.draft_model import DraftModelProposer, check_draft_vocabulary
from pagedkv.engine.outputs import Logprob, RequestOutput
from pagedkv.engine.prompts import PromptType, to_token_ids
from pagedkv.engine.request_state import RequestState
from pagedkv.engine.spec_decode import DraftContexts, SeededDraws, StepTimeFit
from pagedkv.errors import (
    ConfigError,
    EngineDeadError,
    InvalidArgumentError,
    InvalidTypeError,
    InvariantViolationError,
    KVTransferError,
    ModelLoadError,
    PagedKVError,
    StructuredOutputError,
    UnknownRequestError,
)
from pagedkv.parallel.executor import MultiprocExecutor, start_workers
from pagedkv.sample.beam_search_params import BeamSearchParams
from pagedkv.sample.penalties import bad_words_bans
from pagedkv.sample.prepared import PreparedSampling, prepare_sampling
from pagedkv.sample.sampler import Sampler, SamplerOutput, SamplingMetadata
from pagedkv.sample.sampling_params import SamplingParams
from pagedkv.structured.compiler import CompiledGrammar, GrammarCompiler, compile_timeout_error
from pagedkv.structured.params import StructuredOutputsParams
from pagedkv.structured.step_masks import PendingMasks, StepMasks, apply_token_bitmask_
from pagedkv.worker.model_runner import ModelRunner

if TYPE_CHECKING:
    from pagedkv.config import SpeculativeConfig
    from pagedkv.distributed.connector import KVConnector
    from pagedkv.parallel.ray_executor import RayExecutor

__all__ = ["LLMEngine"]

# How long a broken tensor-parallel group waits for a dead worker's exit status (to name it).
_WORKER_EXIT_GRACE_S = 2.0
logger = logging.getLogger(__name__)


class LLMEngine:
    """A model on a paged KV cache, driven one step at a time.

    ``LLMEngine(EngineArgs(...))``, ``LLMEngine(model=..., **engine_args)`` or
    ``LLMEngine.from_engine_args(args)``.
    """

    def __init__(self, engine_args: EngineArgs | None = None, **kwargs: Any) -> None:
        if engine_args is None:
            engine_args = EngineArgs.from_kwargs(**kwargs)
        elif kwargs:
            raise ConfigError("pass either an EngineArgs or keyword arguments, not both")
        from pagedkv.config import check_pool_holds_one_request

        self.args = args = engine_args
        # Threading contract: every public method takes this lock, so add_request and
        # abort_request may be called from any thread; they wait for a step in flight (one
        # forward) to end. Tokenization in add_request happens before taking it.
        self._lock = threading.RLock()
        # Validated once (pagedkv.config); the runner and the scheduler take its parts.
        self.config = config = args.create_engine_config()
        torch.manual_seed(config.model.seed)
        # Tensor parallelism: ranks 1..N-1 start first (they wait for rank 0 to join), then
        # this process builds rank 0's runner; a failure stops whatever was started.
        self.executor: MultiprocExecutor | RayExecutor | None = None
        tp = None
        if config.parallel.tensor_parallel_size > 1:
            if config.kv_transfer is not None:
                raise ConfigError("kv_transfer_config with tensor_parallel_size > 1 is not supported")
            tp, self.executor = start_workers(config)
        # Set once a tensor-parallel step broke the group: every later step raises it.
        self._dead: EngineDeadError | None = None
        spec = config.speculative
        if spec is not None and spec.method == "draft_model":
            check_draft_vocabulary(spec, config.model)  # before any weights load
        try:
            self.runner = ModelRunner(config.model, config.cache, config.scheduling, tp=tp)
        except BaseException as exc:
            if self.executor is not None:
                failures = self.executor.failures()
                self.executor.shutdown()
                if failures and isinstance(exc, Exception) and not isinstance(exc, PagedKVError):
                    raise EngineDeadError(f"tensor-parallel workers failed to start: {'; '.join(failures)}") from exc
            raise
        self.tokenizer = _load_tokenizer(
            config.model.tokenizer or self.runner.model_path, config.model.trust_remote_code
        )
        self.max_model_len = self.runner.max_model_len
        layout = self.runner.kv_layout
        scheduler_config = SchedulerConfig(
            num_blocks=self.runner.num_blocks,
            block_size=self.runner.block_size,
            max_model_len=self.max_model_len,
            max_num_seqs=config.scheduling.max_num_seqs,
            max_num_batched_tokens=config.scheduling.max_num_batched_tokens,
            enable_prefix_caching=config.cache.enable_prefix_caching,
            policy=config.scheduling.policy,
            num_host_blocks=self.runner.num_host_blocks,
            num_disk_blocks=self.runner.num_disk_blocks,
            preemption_mode=config.scheduling.preemption_mode,
            bytes_per_block=self.runner.bytes_per_block,
            enable_kv_events=config.cache.enable_kv_cache_events,
            # KV cache groups: one block table per column (worker/kv_layout.py).
            attention_spans=layout.columns,
            **_speculative_args(config.speculative),
        )
        check_pool_holds_one_request(
            self.runner.num_blocks,
            self.runner.block_size,
            self.max_model_len,
            f", {self.runner.kv_cache_bytes} bytes",
            scheduler_config.blocks_for_sequence(self.max_model_len) if layout.grouped else None,
        )
        self.scheduler = Scheduler(scheduler_config)
        # enforce_eager=False: the forward compiled (or loaded from disk) now, not in the first
        # request's step; before any block is handed out (the step writes one free block).
        self.runner.warm_up_compiled()
        # The auto preemption cost model: the tiers' copy bandwidth is measured once here; the
        # forward's throughput is measured on the real steps (see _update_cost_model).
        self.swap_bandwidth: float | None = None
        self._recompute_tokens_per_s: float | None = None
        if self.runner.num_host_blocks > 0:
            self.swap_bandwidth = self.runner.measure_swap_bandwidth()
        # The disk tier: entries an earlier engine on the same model left in kv_cache_dir.
        self.num_restored_disk_blocks = 0
        if self.runner.disk_cache is not None:
            self.num_restored_disk_blocks = self.runner.disk_cache.restore(self.scheduler)
        self.sampler = Sampler()
        # Speculative decoding (the scheduler drafts and verifies; spec_decode.py): seeded
        # streams kept independent of the drafts, and the step-time fit behind the cost model.
        self._seeded_draws = SeededDraws()
        self._step_time = StepTimeFit()
        self._drafter: DraftModelProposer | None = None
        if spec is not None and spec.method == "draft_model":
            self._drafter = DraftModelProposer(
                spec,
                config.model,
                config.scheduling,
                max_model_len=self.max_model_len,
                block_size=self.runner.block_size,
                vocab_size=self.runner.vocab_size,
                target_kv_bytes=self.runner.kv_cache_bytes,
            )
        # Ids outside the LM head's rows can never be sampled (nor banned: the sampler refuses them).
        self.eos_token_ids = [t for t in self.runner.eos_token_ids if 0 <= t < self.runner.vocab_size]
        self.requests: dict[str, RequestState] = {}
        # The threads besides the stepping one (grammar compiles, KV transfer): each records the
        # inputs it survived, and a dead one makes the server's /health degraded.
        self.background = BackgroundThreads()
        # Structured outputs: grammars compile off this thread (cached); a request whose grammar
        # is still compiling waits in the scheduler, blocked on "grammar" (its compile handle
        # and deadline held by grammars.held), and each step's masks are filled while its
        # forward runs (pagedkv.structured).
        structured = config.structured_outputs
        self.grammars = GrammarCompiler(
            self.tokenizer,
            self.runner.vocab_size,
            self.eos_token_ids,
            workers=structured.compile_workers,
            max_cached=structured.max_cached_grammars,
            max_queued=structured.max_queued_compiles,
            background=self.background,  # its threads in /health
        )
        self._step_masks = StepMasks(self.runner.vocab_size)
        # Grammar work on the step's critical path so far (waiting for the masks, applying
        # them, advancing the matchers): observed into StepMasks.critical_time per step.
        self._grammar_step_s = 0.0
        self._counters = {
            "steps": 0,
            "tokens_computed": 0,
            "generation_tokens": 0,
            "model_time_s": 0.0,
            "failed_steps": 0,
            "failed_requests": 0,
        }
        # A request in this many consecutive failed steps is failed on its own
        # (finish_reason "error"). _charged: ids of requests with a failure count to clear
        # (may hold ids that left the engine since; the counts live on the states).
        self.max_step_failures = 3
        self._charged: set[str] = set()
        # Outputs of requests failed by a step that raised; returned by the next step().
        self._failed_outputs: list[RequestOutput] = []
        # The last preemptions, (time, request id), for the live KV page.
        self.recent_preemptions: collections.deque[tuple[float, str]] = collections.deque(maxlen=20)
        # KV transfer between engines (kv_transfer_config): a request whose prompt's KV is
        # pulled waits in the scheduler, blocked on "remote_kv"; the connector holds the pull.
        self.kv_connector: KVConnector | None = None
        if config.kv_transfer is not None:
            from pagedkv.distributed.connector import KVConnector

            self.kv_connector = KVConnector(
                config.kv_transfer, self.scheduler, self.runner, self._lock, background=self.background
            )

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLMEngine:
        return cls(engine_args)

    # ------------------------------------------------------------------ requests

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | BeamSearchParams | None = None,
        *,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
        prepared: PreparedSampling | None = None,
    ) -> None:
        """Queue a request. Raises (changing nothing) on a duplicate id, invalid parameters, an
        empty prompt, a prompt longer than ``max_model_len`` or token ids outside the vocabulary.
        ``prepared``: :meth:`prepare_params` of ``params``, made beforehand on another thread
        (AsyncLLM does); without it (or one made for other params) it is made here.

        ``priority``: lower is served first under ``scheduling_policy="priority"``.
        ``cache_salt``: the request's prefix-cache namespace: its blocks are shared only with
        requests under the same salt (vLLM's ``cache_salt``, e.g. one per tenant).
        ``kv_transfer_params`` (an engine with ``kv_transfer_config``): ``{"do_remote_decode":
        True}`` holds the KV when the request ends and puts where it is in the final output's
        ``kv_transfer_params``; a producer's such params (``do_remote_prefill``) pull the
        prompt's KV from it before the request is scheduled (see pagedkv.distributed.connector).

        Everything the request needs later (token ids, the checks that depend on the model,
        its generators and detokenizers) is built before the scheduler sees it, so a request
        that is accepted can always be stepped.

        ``params`` may be :class:`BeamSearchParams`: the request is then a beam search run by
        the scheduler on copy-on-write blocks. Its outputs stream the current best beam
        (``outputs[0]``; it may change from step to step) and end with the ``beam_width`` best
        sequences, best first, each with its ``cumulative_logprob``."""
        if not isinstance(request_id, str):
            raise InvalidTypeError(f"request_id must be a str, got {type(request_id).__name__}")
        beam: BeamSearchParams | None = None
        if params is None:
            params = SamplingParams()
        elif isinstance(params, BeamSearchParams):
            if kv_transfer_params is not None:
                raise InvalidArgumentError("kv_transfer_params cannot be combined with beam search")
            beam = params
            self._check_num_samples(beam.beam_width, "beam_width")
            params = SamplingParams(n=1, max_tokens=beam.max_tokens, temperature=0.0, ignore_eos=beam.ignore_eos)
        elif not isinstance(params, SamplingParams):
            raise InvalidTypeError(
                f"params must be a SamplingParams or a BeamSearchParams, got {type(params).__name__}"
            )
        if arrival_time is not None and not isinstance(arrival_time, (int, float)):
            raise InvalidTypeError(f"arrival_time must be a number or None, got {type(arrival_time).__name__}")
        self._check_params_for_model(params)
        if prepared is None or not prepared.fits(params, self.runner.vocab_size, self.runner.device):
            prepared = self.prepare_params(params)
        transfer = self._check_kv_transfer_params(kv_transfer_params)
        if isinstance(transfer, RemotePrefill) and params.prompt_logprobs is not None:
            raise InvalidArgumentError(
                "prompt_logprobs cannot be combined with a remote prefill: the prompt's KV arrives without its logits"
            )
        text, prompt_ids = to_token_ids(prompt, self.tokenizer, self.runner.vocab_size)
        state = RequestState(
            request_id, text, prompt_ids, params, self.tokenizer, self.runner.device, arrival_time, prepared
        )
        state.hold_kv = transfer is True
        state.cache_salt = cache_salt
        if beam is not None:
            state.beam = BeamTracker(beam, self.tokenizer, self.eos_token_ids)
        max_tokens = (
            params.max_tokens if params.max_tokens is not None else max(1, self.max_model_len - len(prompt_ids))
        )
        constraint = params.structured_outputs if beam is None else beam.structured_outputs
        # OverloadedError here when max_queued_compiles wait already (nothing was changed).
        compiling = None if constraint is None else self.grammars.acquire(constraint, tenant=cache_salt)
        try:
            with self._lock:
                wait_for = []
                if compiling is not None:
                    if compiling.future.done():
                        state.attach_grammar(compiling.future.result())  # a cached grammar, or its error
                    else:
                        wait_for.append("grammar")  # compiling off this thread: a later step unblocks it
                remote = self._check_remote_prefill(state, transfer)
                if remote is not None:
                    wait_for.append("remote_kv")
                # Every check that can refuse the request runs here (nothing changed on a refusal);
                # a request with reasons to wait is blocked: live, but never scheduled until
                # unblocked (Scheduler.unblock).
                self.scheduler.add_request(
                    request_id,
                    prompt_ids,
                    max_tokens=max_tokens,
                    min_tokens=params.min_tokens,
                    eos_token_ids=[] if params.ignore_eos else self.eos_token_ids,
                    stop_token_ids=params.stop_token_ids or [],
                    ignore_eos=params.ignore_eos,
                    priority=priority,
                    n=params.n,
                    retention_priority=params.retention_priority,
                    retention_duration=params.retention_duration,
                    retention_tokens=params.retention_tokens,
                    cache_salt=cache_salt,
                    hold_kv=state.hold_kv,
                    beam_width=None if beam is None else beam.beam_width,
                    length_penalty=None if beam is None else beam.length_penalty,
                    # Cached blocks have no logits: a request that wants the prompt's computes it whole.
                    skip_prefix_cache=params.prompt_logprobs is not None,
                    # A grammar's matcher cannot follow drafts: constrained requests never draft.
                    speculate=constraint is None,
                    wait_for=wait_for,
                )
                self.requests[request_id] = state
                if compiling is not None and "grammar" in wait_for:
                    deadline = time.monotonic() + self.config.structured_outputs.compile_timeout_s
                    self.grammars.held.hold(request_id, compiling, deadline)
                    compiling = None  # released when the compile ends or the request leaves
                if remote is not None:
                    self._start_kv_load(state, remote, cache_salt)
        finally:
            if compiling is not None:
                compiling.release()

    def compile_grammars(
        self,
        constraints: Iterable[StructuredOutputsParams | None],
        timeout: float | None = None,
        *,
        cache_salt: str | None = None,
    ) -> None:
        """Compile every constraint now (on the compile threads, waiting for them here), so that
        requests using them (under ``cache_salt``) are admitted at once; raises the first
        StructuredOutputError. ``LLM.generate`` calls it before adding its requests, so a bad
        schema raises there."""
        limit = self.config.structured_outputs.compile_timeout_s if timeout is None else timeout
        # A trusted batch: queued past max_queued_compiles rather than refused.
        handles = [self.grammars.acquire(c, bounded=False, tenant=cache_salt) for c in constraints if c is not None]
        deadline = time.monotonic() + limit
        try:
            for handle in handles:
                try:
                    handle.future.result(timeout=max(0.0, deadline - time.monotonic()))
                except FutureTimeoutError:  # Python 3.10: not the builtin TimeoutError
                    raise compile_timeout_error(limit) from None
        finally:
            for handle in handles:
                handle.release()  # the cache keeps what compiled

    def _unblock_compiled_requests(self) -> None:
        """Requests whose grammar compiled are unblocked (``"grammar"``); those whose compile
        failed or ran past ``compile_timeout_s`` fail alone (their outputs come with this step's)."""
        held = self.grammars.held
        if not held:
            return
        if self._nothing_schedulable():
            held.wait_any(0.02)  # only compiles pending: wait for one a moment instead of spinning
        timeout_s = self.config.structured_outputs.compile_timeout_s
        for rid, result in held.take_ended(time.monotonic(), timeout_s):
            state = self.requests.get(rid)
            if state is None:  # cannot happen: a request that leaves releases its compile
                continue
            try:
                if not isinstance(result, CompiledGrammar):
                    raise result  # the compile's error, or its timeout
                state.attach_grammar(result)
                self.scheduler.unblock(rid, "grammar")
            except Exception as exc:
                self._failed_outputs.append(self._fail_request(state, exc))

    def _nothing_schedulable(self) -> bool:
        """No request is queued or running: whatever is live is blocked (or none is)."""
        return self.scheduler.num_waiting == 0 and self.scheduler.num_running == 0

    def _check_kv_transfer_params(self, kv_transfer_params: Any) -> bool | RemotePrefill | None:
        """The parsed params (see ``parse_kv_transfer_params``), refused on an engine whose
        ``kv_transfer_config`` cannot serve them."""
        transfer = parse_kv_transfer_params(kv_transfer_params)
        if transfer is None:
            return None
        connector = self.kv_connector
        if connector is None:
            raise InvalidArgumentError("kv_transfer_params need an engine started with kv_transfer_config")
        if transfer is True and not connector.config.is_producer:
            raise InvalidArgumentError("do_remote_decode needs a KV producer (kv_transfer_config.role)")
        if isinstance(transfer, RemotePrefill) and not connector.config.is_consumer:
            raise InvalidArgumentError("do_remote_prefill needs a KV consumer (kv_transfer_config.role)")
        return transfer

    def _check_remote_prefill(self, state: RequestState, transfer: bool | RemotePrefill | None) -> RemotePrefill | None:
        """The pull ``state`` waits for, checked before its request is added (``KVConnector.check_load``),
        or None when its prompt is computed here: no pull asked for, or one refused under the
        ``recompute`` policy (another KV format; under ``fail`` it raises)."""
        if not isinstance(transfer, RemotePrefill):
            return None
        connector = self.kv_connector
        assert connector is not None
        try:
            connector.check_load(state.prompt_token_ids, transfer)
        except KVTransferError as exc:  # refused before anything moved (another KV format)
            if connector.config.kv_load_failure_policy == "fail":
                raise
            logger.warning("request %r: %s; its prompt is computed here", state.request_id, exc)
            return None
        return transfer

    def _start_kv_load(self, state: RequestState, remote: RemotePrefill, cache_salt: str | None) -> None:
        """Starts pulling the prompt's KV of ``state``, added blocked on ``"remote_kv"``; when
        there is nothing to wait for (all cached here, or no room now) it is unblocked at once."""
        connector = self.kv_connector
        assert connector is not None
        rid = state.request_id
        try:
            if not connector.start_load(rid, state.prompt_token_ids, remote, cache_salt):
                self.scheduler.unblock(rid, "remote_kv")
        except BaseException:
            # Cannot happen (the scheduler's add checked what a reservation needs): leave
            # nothing of the request behind.
            self.requests.pop(rid, None)
            self._leave_scheduler(rid)
            raise

    def _unblock_loaded_requests(self) -> None:
        """Requests whose remote KV arrived (or failed) are unblocked (``"remote_kv"``: they
        compute what did not arrive), or fail under the ``fail`` policy. Pulls of aborted
        requests are not reported (``KVConnector.abandon``)."""
        connector = self.kv_connector
        if connector is None or not connector.loads:
            return
        for load in connector.take_finished_loads():
            state = self.requests.get(load.request_id)
            if state is None:  # cannot happen: a request that leaves abandons its pull
                continue
            if load.error is not None and connector.config.kv_load_failure_policy == "fail":
                self._failed_outputs.append(self._fail_request(state, KVTransferError(load.error)))
                continue
            try:
                self.scheduler.unblock(load.request_id, "remote_kv")
            except PagedKVError as exc:  # cannot happen: it waits for its KV until this point
                self._failed_outputs.append(self._fail_request(state, exc))

    def poll_kv_transfer(self) -> None:
        """Frees expired KV leases (a producer's idle loop calls it; ``step`` does it too)."""
        if self.kv_connector is not None:
            with self._lock:
                self.kv_connector.poll()

    def next_kv_lease_expiry(self) -> float | None:
        """Seconds until the next KV lease expires, None when none is held."""
        if self.kv_connector is None:
            return None
        with self._lock:  # the control thread releases leases under it
            return self.kv_connector.next_lease_expiry()

    def _check_num_samples(self, num: int, name: str) -> None:
        """A request's samples (or beams) all run in one step: more than ``max_num_seqs`` could
        never be scheduled. Checked before any per-sample state is built (``n = 10**9`` must
        not allocate a billion detokenizers to be refused)."""
        limit = self.config.scheduling.max_num_seqs
        if num > limit:
            raise InvalidArgumentError(f"{name} = {num} exceeds max_num_seqs = {limit}: its sequences could never run")

    def prepare_params(self, params: SamplingParams) -> PreparedSampling:
        """What ``params`` need at every step, checked against the model and built once
        (pagedkv.sample.prepared: token ids inside the vocabulary, the allowed-token mask, the
        logit-bias tensors, the bad words tokenized); a ConfigError names a bad field. Reads
        only the tokenizer and the model's vocabulary: safe on any thread, so a caller can keep
        the work off the engine's (AsyncLLM runs it in a worker thread)."""
        if not isinstance(params, SamplingParams):
            raise InvalidTypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        return prepare_sampling(
            params,
            vocab_size=self.runner.vocab_size,
            tokenizer=self.tokenizer,
            eos_token_ids=self.eos_token_ids,
            device=self.runner.device,
        )

    def _check_params_for_model(self, params: SamplingParams) -> None:
        """The checks of ``params`` that need the engine's configuration or the model (its
        vocabulary), before any per-request state is built."""
        self._check_num_samples(params.n, "n")
        max_logprobs = self.config.model.max_logprobs
        if params.logprobs is not None and params.logprobs > max_logprobs:
            raise ConfigError(
                f"logprobs = {params.logprobs} exceeds max_logprobs = {max_logprobs} (an engine argument)"
            )
        vocab = self.runner.vocab_size
        if params.logprobs is not None and params.logprobs > vocab:
            raise ConfigError(f"logprobs must be <= the vocabulary size {vocab}, got {params.logprobs}")
        if params.prompt_logprobs is not None and params.prompt_logprobs > min(max_logprobs, vocab):
            raise ConfigError(
                f"prompt_logprobs = {params.prompt_logprobs} exceeds max_logprobs = {max_logprobs} "
                "(an engine argument) or the vocabulary"
            )
        # Token ids are checked against the vocabulary by prepare_params (once, C-speed).

    def abort_request(self, request_id: str | Iterable[str]) -> list[RequestOutput]:
        """End requests now; their blocks are freed at once. Returns their final outputs
        (unfinished samples get ``finish_reason="abort"``), one per distinct id. Unknown ids
        raise UnknownRequestError (the known ones in the same call are still aborted).

        Safe to call from another thread: it waits for a step in flight to end."""
        if isinstance(request_id, str):
            ids = [request_id]
        elif isinstance(request_id, Iterable) and not isinstance(request_id, (bytes, dict)):
            ids = list(dict.fromkeys(request_id))  # each id once, in order
        else:
            raise InvalidTypeError(f"request_id must be a str or an iterable of str, got {type(request_id).__name__}")
        bad = [rid for rid in ids if not isinstance(rid, str)]
        if bad:
            raise InvalidTypeError(f"request ids must be str, got {bad[0]!r} ({type(bad[0]).__name__})")
        unknown, outputs = [], []
        with self._lock:
            for rid in ids:
                state = self.requests.pop(rid, None)
                if state is None:
                    unknown.append(rid)
                    continue
                self._leave_scheduler(rid)
                state.end("abort")
                outputs.append(state.output())
        if unknown:
            raise UnknownRequestError(f"unknown request id(s) {unknown}: never added, finished, or aborted")
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self._failed_outputs)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ------------------------------------------------------------------ the step

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; return the outputs of the requests that progressed.

        If the forward pass or sampling raises (an interrupt, out of memory, a bug), the step
        is rolled back (``Scheduler.rollback_step``: its requests go back to the waiting queue
        with what they had computed before it, nothing is lost but the step's compute) and the
        exception propagates; the next ``step()`` retries. A request that was in
        ``max_step_failures`` consecutive failed steps is failed on its own: its output, with
        ``finish_reason="error"`` and ``error`` set, is returned by the next ``step()``. A
        failure in one request's output processing (detokenization, logprobs) fails only that
        request, in this step's outputs."""
        connector = self.kv_connector
        if connector is not None and connector.loads and self._nothing_schedulable():
            connector.wait_for_loads(0.02)  # only pulls in flight: wait for one, not spin
        with self._lock:
            if self._dead is not None:
                raise self._dead
            if connector is not None:
                connector.poll()
                self._unblock_loaded_requests()
            self._unblock_compiled_requests()
            out = self.scheduler.schedule()
            now = time.time()
            if out.preempted_req_ids:
                self.recent_preemptions.extend((now, rid) for rid in out.preempted_req_ids)
            for rid in dict.fromkeys(out.req_ids):
                state = self.requests.get(rid)
                if state is not None and state.metrics.first_scheduled_time is None:
                    state.metrics.first_scheduled_time = now
            if out.num_tokens == 0 and not _has_copies(out):
                self.scheduler.update(out, [])
                return self._take_failed_outputs()
            t0 = time.perf_counter()
            masks = None
            self._grammar_step_s = 0.0  # a failed step's partial count is not carried over
            try:
                masks = self._start_masks(out)  # filled while the forward runs
                prompt_rows = prompt_logprobs.plan(out, self.requests)
                prompt_step = None if prompt_rows is None else prompt_logprobs.StepWithPromptRows(out, prompt_rows)
                logits = self._execute(out, prompt_step)
                prompt_found = None
                if prompt_step is not None:
                    logits, prompt_found = prompt_logprobs.compute_step(prompt_step, logits)
                if masks is not None:
                    grammar_start = time.perf_counter()
                    apply_token_bitmask_(logits, masks.rows, masks.wait())
                    self._grammar_step_s += time.perf_counter() - grammar_start
                drafts = DraftContexts(out)
                sampled = self._sample(out, logits, drafts)
                tokens = sampled.sampled_token_ids.cpu().numpy()
                beam_ids, beam_logprobs = self._beam_candidates(out, logits)
                updates = self.scheduler.update(out, tokens, beam_ids, beam_logprobs)
                self._seeded_draws.settle(updates, self.sampler, self.runner.vocab_size, logits.device)
            except BaseException as exc:
                self._seeded_draws.forget()
                self._roll_back(out, exc)
                if isinstance(exc, EngineDeadError):
                    raise self._stop_workers(exc) from exc
                raise
            finally:
                if masks is not None:
                    masks.join()  # no matcher is left in use by the fill thread
                self._forget_bad_disk_slots()
            if self._charged:
                self._clear_failures(out)
            elapsed = time.perf_counter() - t0
            self._update_cost_model(out.num_tokens, elapsed)
            if self.config.speculative is not None and out.num_tokens == len(out.logits_indices):
                # Steps whose every token is sampled (decodes, with or without drafts): what a
                # draft adds is a token *and* a logits row, which prompt chunks do not have.
                self._step_time.observe(out.num_tokens, elapsed)
                self.scheduler.set_spec_cost(*self._step_time.as_args())
            self._counters["model_time_s"] += elapsed
            self._counters["steps"] += 1
            self._counters["tokens_computed"] += out.num_tokens
            self._counters["generation_tokens"] += len(updates)
            if prompt_rows is not None and prompt_found is not None:
                prompt_logprobs.record(prompt_rows, prompt_found, self.requests, self.tokenizer)
            outputs = self._take_failed_outputs() + self._apply_updates(out, updates, sampled, drafts)
            if self._drafter is not None:
                self._propose_from_draft_model(updates)
            if masks is not None:
                self._step_masks.critical_time.observe(self._grammar_step_s)
            return outputs

    def _execute(
        self, out: SchedulerOutput, prompt_step: prompt_logprobs.StepWithPromptRows | None = None
    ) -> torch.Tensor:
        """``runner.execute(out)``, with the identities the runner writes into the files of the
        step's disk stores when there are any (``runner.execute(step)`` stays the whole contract
        otherwise). With ``prompt_step`` (``out`` with its prompt rows) the runner also computes
        the prompt rows, after the sampled ones (``prompt_logprobs.compute_step``)."""
        step: Any = out if prompt_step is None else prompt_step
        if len(out.disk_store) == 0:
            return self.runner.execute(step)
        return self.runner.execute(step, self.scheduler.disk_block_info(out.disk_store[:, 1].tolist()))

    def _forget_bad_disk_slots(self) -> None:
        """Disk slots whose file failed to write or read are never served (the KV is recomputed)."""
        if self.runner.disk_cache is not None:
            bad = self.runner.disk_cache.take_bad_slots()
            if bad:
                self.scheduler.invalidate_disk_blocks(bad)

    def reset_prefix_cache(self) -> int:
        """Drop every cached block no request uses, on every tier (a benchmark's cold start, or
        after changing weights); returns how many. With KV events on, emits their removal (or
        ``AllBlocksCleared`` when no cached block is left)."""
        with self._lock:
            return int(self.scheduler.reset_prefix_cache())

    def check_invariants(self) -> dict[str, int]:
        """Checks the KV cache's bookkeeping (ref counts, free queue, prefix index, every
        sequence's table) and that the engine, the scheduler, the grammar compiler and the KV
        connector agree on the live requests and what each waits for: every live request is
        the scheduler's, a compile is held exactly for each request blocked on ``"grammar"``,
        and a pull is in flight for each one blocked on ``"remote_kv"``
        (``InvariantViolationError`` on a mismatch, a bug in pagedkv). Returns who holds
        blocks: ``num_used_blocks`` is 0 once no request, lease or reservation is live, else a
        block was lost."""
        with self._lock:
            self.scheduler.check_invariants()
            stats = self.scheduler.stats()
            held = self.grammars.held
            connector = self.kv_connector
            loads = {} if connector is None else {r: load for r, load in connector.loads.items() if not load.abandoned}
            problems = []
            if stats.num_waiting_for_grammar != len(held) or stats.num_waiting_for_remote_kv != len(loads):
                problems.append(
                    f"{stats.num_waiting_for_grammar} requests wait for a grammar and {len(held)} compiles are held; "
                    f"{stats.num_waiting_for_remote_kv} wait for remote KV and {len(loads)} pulls are in flight"
                )
            for rid in self.requests:
                waiting = self.scheduler.waiting_for(rid)
                if waiting is None:
                    problems.append(f"request {rid!r} is live in the engine, not in the scheduler")
                elif ("grammar" in waiting) != (rid in held) or ("remote_kv" in waiting) != (rid in loads):
                    problems.append(
                        f"request {rid!r} waits for {waiting} in the scheduler, which the holders disagree with"
                    )
            if problems:
                raise InvariantViolationError("; ".join(problems))
            return {
                "num_blocks": stats.num_blocks,
                "num_used_blocks": stats.num_used_blocks,
                "num_free_blocks": stats.num_free_blocks,
                "num_running": stats.num_running,
                "num_waiting": stats.num_waiting,
                "num_waiting_for_grammar": stats.num_waiting_for_grammar,
                "num_waiting_for_remote_kv": stats.num_waiting_for_remote_kv,
                "num_kv_leases": stats.num_kv_leases,
                "num_kv_reservations": stats.num_kv_reservations,
                "num_kv_loads": 0 if connector is None else len(connector.loads),
                "num_held_compiles": len(held),
                "num_unfinished_requests": len(self.requests),
            }

    def take_kv_events(self) -> bytes | None:
        """The prefix cache's block events since the last call, as one msgpack payload in vLLM's
        ``KVEventBatch`` wire format (``pagedkv.server.kv_events`` decodes it), or ``None`` when
        nothing changed or events are off (``enable_kv_cache_events``). Encoded by the Rust core."""
        if not self.config.cache.enable_kv_cache_events:
            return None
        with self._lock:
            return self.scheduler.take_kv_events(time.time())

    def flush_kv_cache(self, max_rounds: int = 64) -> int:
        """Copy the cached KV blocks down the tiers (device → host → disk) where a lower tier
        lacks them, so that the disk tier holds what it has room for: an engine restarted on
        the same model and ``kv_cache_dir`` then starts with those prefixes cached. Runs
        copy-only steps (``Scheduler.schedule_flush``) until one copies nothing, or
        ``max_rounds``. Returns the blocks copied. A no-op without a host tier."""
        copied = 0
        with self._lock:
            if self.runner.num_host_blocks == 0:
                return 0
            for _ in range(max_rounds):
                out = self.scheduler.schedule_flush()
                if not _has_copies(out):
                    self.scheduler.update(out, [])
                    break
                copied += len(out.swap_out) + len(out.disk_store)
                try:
                    self._execute(out)
                    self.scheduler.update(out, [])
                except BaseException:
                    self.scheduler.rollback_step(out)
                    raise
                finally:
                    self._forget_bad_disk_slots()
        return copied

    def _stop_workers(self, exc: EngineDeadError) -> EngineDeadError:
        """The tensor-parallel group broke: stop the workers; the error every later step raises
        (naming the workers that died, if any)."""
        failures = [] if self.executor is None else self.executor.failures()
        # A killed worker's sockets close as it dies, a moment before its exit status can be
        # read: give it that moment, so the error names it.
        deadline = time.monotonic() + _WORKER_EXIT_GRACE_S
        while self.executor is not None and not failures and time.monotonic() < deadline:
            time.sleep(0.05)
            failures = self.executor.failures()
        if self.executor is not None:
            self.executor.shutdown()
        message = str(exc) + (f" ({'; '.join(failures)})" if failures else "")
        self._dead = EngineDeadError(message)
        return self._dead

    def shutdown(self) -> None:
        """Flush the KV cache to the disk tier, if there is one (:meth:`flush_kv_cache`), and
        close the KV connector (its transport, control socket and thread), and stop the
        grammar compile and mask threads."""
        if self.runner.disk_cache is not None:
            self.flush_kv_cache()
        if self.kv_connector is not None:
            self.kv_connector.close()
        self.grammars.shutdown()
        self._step_masks.shutdown()
        if self.executor is not None:
            self.executor.shutdown(None if self._dead is not None else self.runner.tp_group)

    def _update_cost_model(self, num_tokens: int, seconds: float) -> None:
        """Feeds the scheduler's auto preemption rule the forward throughput of prefill-sized
        steps (a recompute is a prefill): an exponential average over steps of at least 64
        tokens, the first one taken as is."""
        if self.swap_bandwidth is None or num_tokens < 64 or seconds <= 0.0:
            return
        rate = num_tokens / seconds
        prev = self._recompute_tokens_per_s
        self._recompute_tokens_per_s = rate if prev is None else 0.8 * prev + 0.2 * rate
        self.scheduler.set_cost_model(self.swap_bandwidth, self._recompute_tokens_per_s, self.runner.bytes_per_block)

    def _take_failed_outputs(self) -> list[RequestOutput]:
        """Outputs of requests failed by earlier steps that raised (kept until a step returns)."""
        outputs, self._failed_outputs = self._failed_outputs, []
        return outputs

    def _roll_back(self, out: SchedulerOutput, exc: BaseException) -> None:
        """Undo the step in flight after ``exc``; charge its requests one failure each."""
        self.scheduler.rollback_step(out)
        self._counters["failed_steps"] += 1
        if not isinstance(exc, Exception):
            return  # KeyboardInterrupt, SystemExit: not the requests' fault
        for rid in dict.fromkeys(out.req_ids):
            state = self.requests.get(rid)
            if state is None:
                continue
            self._charged.add(rid)
            state.num_failed_steps += 1
            if state.num_failed_steps >= self.max_step_failures:
                self._failed_outputs.append(self._fail_request(state, exc))

    def _clear_failures(self, out: SchedulerOutput) -> None:
        """A step went through: its requests' failure counts start over (only consecutive
        failures fail a request, so transient ones never add up)."""
        stepped = self._charged.intersection(out.req_ids)
        for rid in stepped:
            state = self.requests.get(rid)
            if state is not None:
                state.num_failed_steps = 0
        self._charged = {rid for rid in self._charged - stepped if rid in self.requests}

    def _leave_scheduler(self, rid: str) -> None:
        """Ends request ``rid`` in the scheduler, whatever its state (its blocks are freed), and
        drops what was held for what it still waited for: its grammar compile (cancelled if
        nobody else waits for it and it has not started; else it goes on, into the cache), its
        KV pull (the reserved blocks are freed when the read ends: it may still write them)."""
        try:
            waited = self.scheduler.abort_request(rid)
        except UnknownRequestError:
            return  # it had just finished in the scheduler
        if "grammar" in waited:
            self.grammars.held.release(rid)
        if "remote_kv" in waited and self.kv_connector is not None:
            self.kv_connector.abandon(rid)

    def _fail_request(self, state: RequestState, exc: BaseException) -> RequestOutput:
        """Take ``state`` out of the engine (its blocks are freed) with ``finish_reason="error"``."""
        self.requests.pop(state.request_id, None)
        self._leave_scheduler(state.request_id)
        if state.hold_kv and self.kv_connector is not None:
            self.kv_connector.drop_lease(state.request_id)
        state.error = exc
        state.end("error")
        if isinstance(exc, StructuredOutputError) and state.grammar is not None:
            self.grammars.evict(state.grammar)  # failed mid-generation: never cached as valid
        self._counters["failed_requests"] += 1
        logger.warning("request %r failed: %s: %s", state.request_id, type(exc).__name__, exc)
        return state.output()

    def _start_masks(self, out: SchedulerOutput) -> PendingMasks | None:
        """Starts filling the grammar masks of the step's sampled rows that have a matcher (None
        when no row has one)."""
        if not self._has_structured_requests():
            return None
        rows: list[int] = []
        matchers = []
        for row, (rid, index) in enumerate(zip(out.sampled_req_ids, out.sample_indices.tolist())):
            state = self.requests.get(rid)
            matcher = None if state is None else state.matcher(index)
            if matcher is not None:
                rows.append(row)
                matchers.append(matcher)
        return self._step_masks.start(rows, matchers) if rows else None

    def _has_structured_requests(self) -> bool:
        return any(state.grammar is not None for state in self.requests.values())

    def _beam_candidates(
        self, out: SchedulerOutput, logits: torch.Tensor
    ) -> tuple[list[list[int]] | None, list[list[float]] | None]:
        """The candidates of the step's beam rows: ``2 * beam_width`` per row (the widest beam
        request's), or ``(None, None)`` for a step without beam rows."""
        rows = out.beam_rows.tolist()
        if not rows:
            return None, None
        width = 1
        for r in rows:
            state = self.requests.get(out.sampled_req_ids[r])
            if state is not None and state.beam is not None:
                width = max(width, state.beam.params.beam_width)
        return beam_candidates(logits, rows, 2 * width)

    def _sample(self, out: SchedulerOutput, logits: torch.Tensor, drafts: DraftContexts) -> SamplerOutput:
        """One token per logits row. A row after drafts (speculative decoding) is sampled as
        an ordinary step would sample it after the sample's tokens and those drafts: bans,
        penalties and ``min_tokens`` see that context (``drafts``)."""
        params: list[SamplingParams] = []
        prepared: list[PreparedSampling | None] = []  # per row, None on greedy stand-ins
        generators: list[torch.Generator | None] = []
        banned: dict[int, np.ndarray | list[int]] = {}
        # Token arrays of the rows with penalties (pagedkv.sample.penalties), None elsewhere.
        num_rows = len(out.sampled_req_ids)
        token_arrays: dict[str, list[np.ndarray | None]] = {}
        for row, (rid, index) in enumerate(zip(out.sampled_req_ids, out.sample_indices.tolist())):
            state = self.requests.get(rid)
            if state is None or state.beam is not None:
                # A beam row's logits give candidates (_beam_candidates), not a sampled token;
                # a row of a request that is gone (cannot happen under the lock: aborts wait
                # for the step) is dropped by Scheduler.update. Both are sampled greedily.
                params.append(_GREEDY)
                prepared.append(None)
                generators.append(None)
                continue
            p = state.params
            prep = state.prepared
            params.append(p)
            prepared.append(prep)
            sample = state.samples[index]
            generators.append(sample.generator)
            before = drafts.drafts(row) if drafts else []
            if sample.generator is not None and p.temperature > 0.0 and drafts.drafts(row + 1) and not before:
                self._seeded_draws.save(sample.generator, rid, index)  # the group's first row
            ban: np.ndarray | list[int] = []
            if len(sample.token_ids) + len(before) < p.min_tokens:
                # As in vLLM, min_tokens also holds back the model's eos when ignore_eos is set
                # (stop_token_ids and eos, one array made when the request was added).
                ban = prep.min_tokens_ban
            if prep.bad_word_ids:
                # A ban reads at most the last bad_word_context tokens: no copy of the output.
                context = prep.bad_word_context
                tail = (sample.token_ids[-context:] + before) if context else []
                words = bad_words_bans(prep.bad_word_ids, tail)
                if words:
                    ban = np.concatenate([np.asarray(ban, dtype=np.int64), np.asarray(words, dtype=np.int64)])
            if len(ban):
                banned[row] = ban
            if p.has_penalties:
                output_ids = state.output_array(index)
                if before:
                    output_ids = np.concatenate([output_ids, np.asarray(before, dtype=np.int64)])
                token_arrays.setdefault("output_token_ids", [None] * num_rows)[row] = output_ids
                token_arrays.setdefault("prompt_token_ids", [None] * num_rows)[row] = state.prompt_array()
        # Keyword arguments only in steps that need them (the bench swaps in an older build()):
        # the token arrays with penalties, the requests' bias and mask tensors (made when they
        # were added) with logit_bias or allowed_token_ids.
        extra: dict[str, Any] = dict(token_arrays)
        if any(prep is not None and prep.logits.used for prep in prepared):
            extra["prepared"] = prepared
        metadata = SamplingMetadata.build(
            params,
            vocab_size=self.runner.vocab_size,
            device=logits.device,
            generators=generators,
            banned_token_ids=banned or None,
            **extra,
        )
        return self.sampler(logits, metadata)

    def _apply_updates(
        self, out: SchedulerOutput, updates: Sequence[RequestUpdate], sampled: SamplerOutput, drafts: DraftContexts
    ) -> list[RequestOutput]:
        now = time.time()
        if drafts:
            self._count_drafts(out, updates, drafts)
        touched: dict[str, RequestState] = {}
        failed: list[RequestOutput] = []
        beam_steps: dict[str, list[RequestUpdate]] = {}
        for u in updates:
            state = self.requests.get(u.request_id)
            if state is None:
                continue
            if state.beam is not None:
                beam_steps.setdefault(u.request_id, []).append(u)
                touched[u.request_id] = state
                continue
            if state.samples[u.index].finish_reason is not None:
                continue  # a stop string ended it at an earlier token of this step (drafts)
            try:
                self._apply_update(state, u, sampled, now)
            except Exception as exc:  # this request's own processing: fail it alone
                touched.pop(u.request_id, None)
                failed.append(self._fail_request(state, exc))
                continue
            touched[u.request_id] = state
        if beam_steps:
            for output in self._apply_beam_steps(beam_steps, now):
                touched.pop(output.request_id, None)
                failed.append(output)
        outputs = []
        for rid, state in touched.items():
            if state.finished:
                state.metrics.finished_time = now
                del self.requests[rid]
                if state.hold_kv and self.kv_connector is not None:
                    state.kv_transfer_params = self.kv_connector.lease_params(rid, state.prompt_token_ids)
            outputs.append(state.output())
        return outputs + failed

    def _apply_update(
        self,
        state: RequestState,
        u: RequestUpdate,
        sampled: SamplerOutput,
        now: float,
    ) -> None:
        sample = state.samples[u.index]
        token = u.new_token_ids[0]
        matcher = sample.matcher
        if matcher is not None:
            # A matcher in error had a mask of eos alone (StepMasks lets every token through
            # instead), and consumes eos "successfully": checked before and after, so a broken
            # constraint fails the request (and evicts the grammar, _fail_request) and never
            # ends it with "" as if it matched.
            start = time.perf_counter()
            consumed = not matcher.is_error() and matcher.consume_token(token) and not matcher.is_error()
            self._grammar_step_s += time.perf_counter() - start
            if not consumed:
                raise StructuredOutputError(
                    f"structured outputs: the constraint failed after {len(sample.token_ids)} tokens "
                    f"(token {token}): {matcher.get_error()[:2000]}"
                )
        sample.token_ids.append(token)
        if sample.output_buffer is not None:
            sample.output_buffer.append(token)
        if state.metrics.first_token_time is None:
            state.metrics.first_token_time = now
            state.metrics.num_cached_tokens = u.num_cached_tokens
        if sampled.logprobs is not None and state.params.logprobs is not None:
            assert u.logits_row is not None  # a sampled (not beam) update
            self._record_logprobs(state, u.index, u.logits_row, sampled, token)
        reason = u.finish_reason
        stop_str = sample.detokenizer.update([token], stop_terminated=reason == "stop")
        if reason is not None:
            sample.finish_reason = reason
            if reason == "stop" and token in (state.params.stop_token_ids or []):
                sample.stop_reason = token
        elif stop_str is not None:
            sample.finish_reason, sample.stop_reason = "stop", stop_str
            self.scheduler.finish_sample(u.request_id, u.index)
        elif matcher is not None and matcher.is_stopped():
            # The constraint is complete and admits nothing more (only eos would follow).
            sample.finish_reason = "stop"
            self.scheduler.finish_sample(u.request_id, u.index)

    def _propose_from_draft_model(self, updates: Sequence[RequestUpdate]) -> None:
        """The draft model's drafts for every sample still decoding after this step, handed to
        the scheduler for the next step that schedules it."""
        assert self._drafter is not None
        samples: dict[tuple[str, int], tuple[list[int], str | None]] = {}
        for u in updates:
            state = self.requests.get(u.request_id)
            if state is None or state.beam is not None or state.grammar is not None:
                continue  # gone, or a request that never drafts
            sample = state.samples[u.index]
            if sample.finish_reason is None:
                samples[(u.request_id, u.index)] = (state.prompt_token_ids + sample.token_ids, state.cache_salt)
        # As many drafts as the cost model would verify now (none at a large batch: then the
        # draft model does not run at all).
        k = self.scheduler.spec_drafts_worth()
        if not samples or k == 0:
            return
        proposed = self._drafter.propose([(rid, i, tokens, salt) for (rid, i), (tokens, salt) in samples.items()], k)
        for (rid, index), draft in proposed.items():
            self.scheduler.set_drafts(rid, index, len(samples[(rid, index)][0]), draft)

    def _count_drafts(self, out: SchedulerOutput, updates: Sequence[RequestUpdate], drafts: DraftContexts) -> None:
        """Each request's drafted and accepted tokens (``RequestOutput.metrics``): a row group
        of ``d`` drafts that emitted ``m`` tokens accepted ``m - 1`` of them."""
        emitted_rows = {u.logits_row for u in updates}
        for first, drafted in drafts.num_drafted().items():
            state = self.requests.get(out.sampled_req_ids[first])
            if state is None:
                continue
            taken = sum(1 for r in range(first, first + drafted + 1) if r in emitted_rows)
            state.metrics.num_draft_tokens += drafted
            state.metrics.num_accepted_tokens += max(taken - 1, 0)

    def _apply_beam_steps(self, steps: dict[str, list[RequestUpdate]], now: float) -> list[RequestOutput]:
        """Each beam request's live beams after the step, or its result when the search ended
        (one update with a finish reason; the result comes from ``take_beam_results``).
        Returns the outputs of the requests that failed in their own processing."""
        results = {}
        if any(u.finish_reason is not None for rows in steps.values() for u in rows):
            results = dict(self.scheduler.take_beam_results())
        failed = []
        for rid, rows in steps.items():
            state = self.requests[rid]
            beam = state.beam
            assert beam is not None
            if state.metrics.first_token_time is None:
                state.metrics.first_token_time = now
                state.metrics.num_cached_tokens = rows[0].num_cached_tokens
            reason = rows[0].finish_reason
            if reason is None:
                try:
                    beam.advance(rows)
                except Exception as exc:  # a beam's token broke its constraint: fail it alone
                    failed.append(self._fail_request(state, exc))
                continue
            beam.finish(results.get(rid, []))
            state.samples[0].finish_reason = reason
        return failed

    def _record_logprobs(self, state: RequestState, index: int, row: int, sampled: SamplerOutput, token: int) -> None:
        lp = sampled.logprobs
        assert lp is not None
        k = state.params.logprobs or 0
        ids = lp.token_ids[row, : 1 + k].tolist()
        values = lp.logprobs[row, : 1 + k].tolist()
        entries = {ids[0]: Logprob(values[0], int(lp.ranks[row]), self.tokenizer.decode([ids[0]]))}
        for rank, (tid, value) in enumerate(zip(ids[1:], values[1:]), start=1):
            entries.setdefault(tid, Logprob(value, rank, self.tokenizer.decode([tid])))
        state.add_logprobs(index, entries, token)

    # ------------------------------------------------------------------ stats

    def kv_snapshot(self) -> dict[str, Any]:
        """The KV cache as a live view draws it, from the Rust core in one go between steps:
        ``memory_map`` (device ``ref_counts`` int32[N], ``cached`` bool[N], ``owner`` int64[N]:
        the arrival number of the earliest running request holding each block, -1 if none),
        ``tier_map`` (host ``host_ref_counts`` / ``host_cached``, H entries; empty without a
        host tier), ``disk_map`` (``disk_ref_counts`` / ``disk_cached``), the requests'
        summaries (``Scheduler.request_summaries``), the last preemptions (time, request id)
        the stats, ``constraints`` (request id -> the kind of its structured-output
        constraint) and ``drafts`` (request id -> its drafted and accepted tokens, speculative
        decoding); with KV cache groups, ``columns`` (int16[N]: the column each device
        block serves, -1 free and uncached) and ``column_spans`` (each column's span, as the
        start-up log names it)."""
        with self._lock:
            refs, cached, owner = self.scheduler.memory_map()
            columns = self.scheduler.block_kv_groups()
            _, host_refs, host_cached = self.scheduler.tier_map()
            disk_refs, disk_cached = self.scheduler.disk_map()
            summaries = self.scheduler.request_summaries()
            prompts = {rid: state.prompt for rid, state in self.requests.items()}
            constraints = {rid: state.grammar.kind for rid, state in self.requests.items() if state.grammar is not None}
            drafts = {
                rid: (state.metrics.num_draft_tokens, state.metrics.num_accepted_tokens)
                for rid, state in self.requests.items()
                if state.metrics.num_draft_tokens
            }
            preemptions = list(self.recent_preemptions)
        stats = self.get_stats()
        return {
            "ref_counts": refs,
            "cached": cached,
            "owner": owner,
            "host_ref_counts": host_refs,
            "host_cached": host_cached,
            "disk_ref_counts": disk_refs,
            "disk_cached": disk_cached,
            "columns": columns,
            "column_spans": self.runner.kv_layout.column_names(),
            "recent_preemptions": preemptions,
            "requests": summaries,
            "prompts": prompts,
            "constraints": constraints,
            "drafts": drafts,
            "stats": stats,
        }

    def get_stats(self) -> dict[str, Any]:
        """Scheduler statistics (KV usage and utilization, prefix cache, preemptions, queue
        lengths), the KV cache's size, dtype and bytes per token, and engine counters (steps,
        tokens computed, tokens generated, model time, failed steps and requests)."""
        with self._lock:
            stats: dict[str, Any] = self.scheduler.stats().as_dict()
            stats.update(self._counters)
            stats["num_unfinished_requests"] = len(self.requests)
            stats["spec_accepted_per_position"] = self.scheduler.spec_accepted_per_position()
        if self.config.speculative is not None:
            stats["spec_step_overhead_s"], stats["spec_per_token_s"] = self._step_time.as_args()
        stats["structured_compile_seconds"] = self.grammars.compile_time.snapshot()
        stats["structured_mask_seconds"] = self._step_masks.fill_time.snapshot()
        stats["structured_step_seconds"] = self._step_masks.critical_time.snapshot()
        stats["structured_grammar_cache_hits"] = self.grammars.num_cache_hits
        # Compiles dropped (every request that wanted one left before it started) and refused
        # (max_queued_compiles waiting already).
        stats["structured_compiles_cancelled"] = self.grammars.num_cancelled
        stats["structured_compiles_refused"] = self.grammars.num_refused
        stats["structured_masked_rows"] = self._step_masks.num_masked_rows
        stats["kv_cache_bytes"] = self.runner.kv_cache_bytes
        stats["host_kv_cache_bytes"] = self.runner.host_kv_cache_bytes
        stats["num_restored_disk_blocks"] = self.num_restored_disk_blocks
        stats["swap_bandwidth_bytes_per_s"] = self.swap_bandwidth
        stats["recompute_tokens_per_s"] = self._recompute_tokens_per_s
        stats["kv_cache_dtype"] = self.runner.geometry.dtype
        stats["kv_bytes_per_token"] = self.runner.geometry.bytes_per_token
        if self.kv_connector is not None:
            with self._lock:
                stats.update(self.kv_connector.stats())
        stats["background_errors"] = self.background.error_counts()
        return stats


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


def _has_copies(out: SchedulerOutput) -> bool:
    """True when the step moves blocks (copy-on-write, swaps, disk reads or writes)."""
    return any(len(a) > 0 for a in (out.copy_ops, out.swap_out, out.swap_in, out.disk_store, out.disk_load))


# Parameters for a logits row whose request is gone (its token is discarded).
_GREEDY = SamplingParams(temperature=0.0, max_tokens=1)


def _load_tokenizer(name: str, trust_remote_code: bool) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"could not load a tokenizer from {name!r}: {exc}") from exc
