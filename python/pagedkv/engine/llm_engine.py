"""``LLMEngine``: the embedding API for servers — add requests, step, read outputs.

A request goes through the :class:`InputProcessor` (checks against the model, tokenization, its
``RequestState``) and :class:`Admission` (into the Rust scheduler, blocked while its grammar
compiles or its remote KV arrives). One ``step()`` then reads: schedule (``Scheduler.schedule``
picks the batch) → execute (``ModelRunner.execute``: copy ops and one packed forward on the
paged KV cache, grammar masks applied) → sample (:mod:`pagedkv.sample.metadata` builds the
rows' parameters, the :class:`Sampler` draws; ``Scheduler.update`` appends the tokens and
applies the token-based stops) → process outputs (:class:`OutputProcessor`: detokenizing, stop
strings, logprobs, beams, drafts; a :class:`RequestOutput` per request that progressed).

Bad input raises a typed :mod:`pagedkv.errors` exception in ``add_request`` / ``abort_request``
before anything changes, so the engine keeps serving its other requests.

Failures: an exception between ``schedule()`` and ``update()`` (an interrupt, out of memory, a
bug) rolls the step back in the scheduler (its requests go back to the waiting queue with what
they had computed before it) and propagates; the next ``step()`` retries it. Requests are
charged one failure per failed step they were in (a step that goes through clears the count)
and are failed alone (``finish_reason="error"``, returned by the next ``step()``) after
``max_step_failures`` in a row, so a request that breaks every forward cannot block the others
and transient failures never add up. A failure in one request's output processing fails only
that request, in that step's outputs.

Threading: one lock serializes the public methods. ``add_request`` and ``abort_request`` may
be called from any thread (a server's request handlers) while another thread steps; they wait
for the step in flight to end. ``AsyncLLM`` drives the engine from one thread instead.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from pagedkv._core import RequestUpdate, Scheduler, SchedulerConfig, SchedulerOutput
from pagedkv.background import BackgroundThreads
from pagedkv.engine import prompt_logprobs
from pagedkv.engine.admission import Admission
from pagedkv.engine.args import EngineArgs
from pagedkv.engine.beam_tracker import beam_candidates
from pagedkv.engine.draft_model import DraftModelProposer, check_draft_vocabulary
from pagedkv.engine.input_processor import InputProcessor
from pagedkv.engine.output_processor import OutputProcessor
from pagedkv.engine.outputs import RequestOutput
from pagedkv.engine.prompts import PromptType
from pagedkv.engine.request_state import RequestState
from pagedkv.engine.spec_decode import DraftContexts, SeededDraws
from pagedkv.engine.stats import StepStats
from pagedkv.errors import (
    ConfigError,
    EngineDeadError,
    InvalidTypeError,
    InvariantViolationError,
    ModelLoadError,
    PagedKVError,
    StructuredOutputError,
    UnknownRequestError,
)
from pagedkv.parallel.executor import MultiprocExecutor, start_workers
from pagedkv.sample.beam_search_params import BeamSearchParams
from pagedkv.sample.metadata import beam_width, grammar_rows, step_metadata
from pagedkv.sample.prepared import PreparedSampling
from pagedkv.sample.sampler import Sampler, SamplerOutput
from pagedkv.sample.sampling_params import SamplingParams
from pagedkv.structured.compiler import GrammarCompiler
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

# A step's prompt logprobs: the rows it computed and what they found.
PromptFound = tuple[prompt_logprobs.PromptRows, prompt_logprobs.PromptLogprobs]


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
        # Every public method takes this lock (module docs, "Threading"); tokenization in
        # add_request happens before taking it.
        self._lock = threading.RLock()
        # Validated once (pagedkv.config); the runner and the scheduler take its parts.
        self.config = config = args.create_engine_config()
        torch.manual_seed(config.model.seed)
        self.runner, self.executor = _start_runner(config)
        # Set once a tensor-parallel step broke the group: every later step raises it.
        self._dead: EngineDeadError | None = None
        runner = self.runner
        self.tokenizer = _load_tokenizer(config.model.tokenizer or runner.model_path, config.model.trust_remote_code)
        self.max_model_len = runner.max_model_len
        layout = runner.kv_layout
        scheduler_config = SchedulerConfig(
            num_blocks=runner.num_blocks,
            block_size=runner.block_size,
            max_model_len=self.max_model_len,
            max_num_seqs=config.scheduling.max_num_seqs,
            max_num_batched_tokens=config.scheduling.max_num_batched_tokens,
            enable_prefix_caching=config.cache.enable_prefix_caching,
            policy=config.scheduling.policy,
            num_host_blocks=runner.num_host_blocks,
            num_disk_blocks=runner.num_disk_blocks,
            preemption_mode=config.scheduling.preemption_mode,
            bytes_per_block=runner.bytes_per_block,
            enable_kv_events=config.cache.enable_kv_cache_events,
            # KV cache groups: one block table per column (worker/kv_layout.py).
            attention_spans=layout.columns,
            **_speculative_args(config.speculative),
        )
        check_pool_holds_one_request(
            runner.num_blocks,
            runner.block_size,
            self.max_model_len,
            f", {runner.kv_cache_bytes} bytes",
            scheduler_config.blocks_for_sequence(self.max_model_len) if layout.grouped else None,
        )
        self.scheduler = Scheduler(scheduler_config)
        # enforce_eager=False: the forward compiled (or loaded from disk) now, not in the first
        # request's step; before any block is handed out (the step writes one free block).
        runner.warm_up_compiled()
        # The auto preemption cost model: the tiers' copy bandwidth is measured once here, the
        # forward's throughput on the real steps (StepStats).
        bandwidth = runner.measure_swap_bandwidth() if runner.num_host_blocks > 0 else None
        self.stats = StepStats(
            self.scheduler,
            bytes_per_block=runner.bytes_per_block,
            swap_bandwidth=bandwidth,
            speculative=config.speculative is not None,
        )
        self._counters = self.stats.counters
        # The disk tier: entries an earlier engine on the same model left in kv_cache_dir.
        self.num_restored_disk_blocks = 0
        if runner.disk_cache is not None:
            self.num_restored_disk_blocks = runner.disk_cache.restore(self.scheduler)
        self.sampler = Sampler()
        # Speculative decoding (spec_decode.py): seeded streams kept independent of the drafts.
        self._seeded_draws = SeededDraws()
        self._drafter: DraftModelProposer | None = None
        spec = config.speculative
        if spec is not None and spec.method == "draft_model":
            self._drafter = DraftModelProposer(
                spec,
                config.model,
                config.scheduling,
                max_model_len=self.max_model_len,
                block_size=runner.block_size,
                vocab_size=runner.vocab_size,
                target_kv_bytes=runner.kv_cache_bytes,
            )
        # Ids outside the LM head's rows can never be sampled (nor banned: the sampler refuses them).
        self.eos_token_ids = [t for t in runner.eos_token_ids if 0 <= t < runner.vocab_size]
        self.requests: dict[str, RequestState] = {}
        # The threads besides the stepping one (grammar compiles, KV transfer): each records the
        # inputs it survived, and a dead one makes the server's /health degraded.
        self.background = BackgroundThreads()
        # Structured outputs: grammars compile off this thread (cached); each step's masks are
        # filled while its forward runs (pagedkv.structured).
        structured = config.structured_outputs
        self.grammars = GrammarCompiler(
            self.tokenizer,
            runner.vocab_size,
            self.eos_token_ids,
            workers=structured.compile_workers,
            max_cached=structured.max_cached_grammars,
            max_queued=structured.max_queued_compiles,
            background=self.background,  # its threads in /health
        )
        self._step_masks = StepMasks(runner.vocab_size)
        # A request in this many consecutive failed steps is failed on its own (module docs).
        # _charged: ids of requests with a failure count to clear (may hold ids that left).
        self.max_step_failures = 3
        self._charged: set[str] = set()
        # Outputs of requests failed outside a step's own outputs; returned by the next step().
        self._failed_outputs: list[RequestOutput] = []
        # KV transfer between engines (kv_transfer_config): the connector holds the pulls.
        self.kv_connector: KVConnector | None = None
        if config.kv_transfer is not None:
            from pagedkv.distributed.connector import KVConnector

            self.kv_connector = KVConnector(
                config.kv_transfer, self.scheduler, runner, self._lock, background=self.background
            )
        self.input_processor = InputProcessor(
            config,
            self.tokenizer,
            vocab_size=runner.vocab_size,
            device=runner.device,
            max_model_len=self.max_model_len,
            eos_token_ids=self.eos_token_ids,
            kv_connector=self.kv_connector,
        )
        self.admission = Admission(
            self.scheduler,
            self.grammars,
            self.kv_connector,
            self._lock,
            compile_timeout_s=structured.compile_timeout_s,
            eos_token_ids=self.eos_token_ids,
        )
        self.output_processor = OutputProcessor(
            self.requests, self.scheduler, self.tokenizer, self.kv_connector, self._fail_request
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

        ``params`` may be :class:`BeamSearchParams`: the request is then a beam search run by
        the scheduler on copy-on-write blocks. Its outputs stream the current best beam
        (``outputs[0]``; it may change from step to step) and end with the ``beam_width`` best
        sequences, best first, each with its ``cumulative_logprob``."""
        request = self.input_processor.process(
            request_id,
            prompt,
            params,
            arrival_time=arrival_time,
            priority=priority,
            cache_salt=cache_salt,
            kv_transfer_params=kv_transfer_params,
            prepared=prepared,
        )
        self.admission.add(request, self.requests, self.input_processor.check_remote_prefill)

    def prepare_params(self, params: SamplingParams) -> PreparedSampling:
        """What ``params`` need at every step, checked against the model and built once
        (pagedkv.sample.prepared: token ids inside the vocabulary, the allowed-token mask, the
        logit-bias tensors, the bad words tokenized); a ConfigError names a bad field. Reads
        only the tokenizer and the model's vocabulary: safe on any thread, so a caller can keep
        the work off the engine's (AsyncLLM runs it in a worker thread)."""
        return self.input_processor.prepare_params(params)

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
        self.admission.compile_grammars(constraints, timeout, cache_salt)

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
                self.admission.leave(rid)
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
        """One step: schedule → execute → sample → process outputs (failures: module docs)."""
        self.admission.wait_while_only_loading()
        with self._lock:
            if self._dead is not None:
                raise self._dead
            self.admission.unblock_ready(self.requests, self._fail_later)
            out = self.scheduler.schedule()
            self.stats.scheduled(out, self.requests, time.time())
            if out.num_tokens == 0 and not _has_copies(out):
                self.scheduler.update(out, [])
                return self._take_failed_outputs()
            start, masks = time.perf_counter(), None
            try:
                masks = self._start_masks(out)  # filled while the forward runs
                logits, prompt = self._execute(out, masks)
                drafts = DraftContexts(out)
                sampled = self._sample(out, logits, drafts)
                updates = self._update_scheduler(out, logits, sampled)
            except BaseException as exc:
                self._step_failed(out, exc)  # rolled back (and the workers stopped if they died)
                raise
            finally:
                self._forward_ended(masks)
            self.stats.stepped(out, time.perf_counter() - start, len(updates))
            return self._process_outputs(out, updates, sampled, drafts, prompt, masks)

    def _start_masks(self, out: SchedulerOutput) -> PendingMasks | None:
        """Starts filling the grammar masks of the step's sampled rows that have a matcher (None
        when no row has one)."""
        self.output_processor.grammar_s = 0.0  # grammar time on this step's critical path
        if not any(state.grammar is not None for state in self.requests.values()):
            return None
        rows, matchers = grammar_rows(out, self.requests)
        return self._step_masks.start(rows, matchers) if rows else None

    def _execute(self, out: SchedulerOutput, masks: PendingMasks | None) -> tuple[torch.Tensor, PromptFound | None]:
        """The logits of the step's sampled rows (grammar masks applied), and the prompt
        logprobs of the requests that want them (pagedkv.engine.prompt_logprobs)."""
        rows = prompt_logprobs.plan(out, self.requests)
        prompt_step = None if rows is None else prompt_logprobs.StepWithPromptRows(out, rows)
        logits = self._run_forward(out, prompt_step)
        prompt = None
        if prompt_step is not None and rows is not None:
            logits, found = prompt_logprobs.compute_step(prompt_step, logits)
            prompt = (rows, found)
        if masks is not None:
            start = time.perf_counter()
            apply_token_bitmask_(logits, masks.rows, masks.wait())
            self.output_processor.grammar_s += time.perf_counter() - start
        return logits, prompt

    def _run_forward(
        self, out: SchedulerOutput, prompt_step: prompt_logprobs.StepWithPromptRows | None = None
    ) -> torch.Tensor:
        """``runner.execute(out)`` (or of ``prompt_step``: ``out`` with its prompt rows), with
        the identities the runner writes into the files of the step's disk stores if any."""
        step: Any = out if prompt_step is None else prompt_step
        if len(out.disk_store) == 0:
            return self.runner.execute(step)
        return self.runner.execute(step, self.scheduler.disk_block_info(out.disk_store[:, 1].tolist()))

    def _sample(self, out: SchedulerOutput, logits: torch.Tensor, drafts: DraftContexts) -> SamplerOutput:
        """One token per logits row (pagedkv.sample.metadata: a row after drafts is sampled as
        an ordinary step would sample it after them)."""
        metadata, seeded = step_metadata(
            out, self.requests, drafts, vocab_size=self.runner.vocab_size, device=logits.device
        )
        for generator, rid, index in seeded:
            self._seeded_draws.save(generator, rid, index)
        return self.sampler(logits, metadata)

    def _update_scheduler(
        self, out: SchedulerOutput, logits: torch.Tensor, sampled: SamplerOutput
    ) -> list[RequestUpdate]:
        """``Scheduler.update`` with the sampled tokens and the beam rows' candidates
        (``2 * beam_width`` per row, the widest beam request's); its updates."""
        tokens = sampled.sampled_token_ids.cpu().numpy()
        rows: list[int] = out.beam_rows.tolist()
        beam_ids, beam_logprobs = None, None
        if rows:
            beam_ids, beam_logprobs = beam_candidates(logits, rows, 2 * beam_width(rows, out, self.requests))
        updates = self.scheduler.update(out, tokens, beam_ids, beam_logprobs)
        self._seeded_draws.settle(updates, self.sampler, self.runner.vocab_size, logits.device)
        return updates

    def _forward_ended(self, masks: PendingMasks | None) -> None:
        if masks is not None:
            masks.join()  # no matcher is left in use by the fill thread
        self._forget_bad_disk_slots()

    def _process_outputs(
        self,
        out: SchedulerOutput,
        updates: list[RequestUpdate],
        sampled: SamplerOutput,
        drafts: DraftContexts,
        prompt: PromptFound | None,
        masks: PendingMasks | None,
    ) -> list[RequestOutput]:
        """The step's outputs (after those of requests failed earlier); then the next drafts."""
        if self._charged:
            self._clear_failures(out)
        if prompt is not None:
            self.output_processor.record_prompt_logprobs(*prompt)
        outputs = self._take_failed_outputs() + self.output_processor.process(out, updates, sampled, drafts)
        if self._drafter is not None:
            self._drafter.propose_after_step(self.scheduler, updates, self.requests)
        if masks is not None:
            self._step_masks.critical_time.observe(self.output_processor.grammar_s)
        return outputs

    def _forget_bad_disk_slots(self) -> None:
        """Disk slots whose file failed to write or read are never served (the KV is recomputed)."""
        if self.runner.disk_cache is not None:
            bad = self.runner.disk_cache.take_bad_slots()
            if bad:
                self.scheduler.invalidate_disk_blocks(bad)

    # ------------------------------------------------------------------ failures

    def _step_failed(self, out: SchedulerOutput, exc: BaseException) -> None:
        """Undo the step in flight after ``exc``; charge its requests one failure each (those
        at ``max_step_failures`` fail). A broken tensor-parallel group stops the workers and
        raises the error every later step raises."""
        self._seeded_draws.forget()
        self.scheduler.rollback_step(out)
        self._counters["failed_steps"] += 1
        if isinstance(exc, EngineDeadError):
            raise self._stop_workers(exc) from exc
        if not isinstance(exc, Exception):
            return  # KeyboardInterrupt, SystemExit: not the requests' fault
        for rid in dict.fromkeys(out.req_ids):
            state = self.requests.get(rid)
            if state is None:
                continue
            self._charged.add(rid)
            state.num_failed_steps += 1
            if state.num_failed_steps >= self.max_step_failures:
                self._fail_later(state, exc)

    def _clear_failures(self, out: SchedulerOutput) -> None:
        """A step went through: its requests' failure counts start over (only consecutive
        failures fail a request, so transient ones never add up)."""
        stepped = self._charged.intersection(out.req_ids)
        for rid in stepped:
            state = self.requests.get(rid)
            if state is not None:
                state.num_failed_steps = 0
        self._charged = {rid for rid in self._charged - stepped if rid in self.requests}

    def _fail_request(self, state: RequestState, exc: BaseException) -> RequestOutput:
        """Take ``state`` out of the engine (its blocks are freed) with ``finish_reason="error"``."""
        self.requests.pop(state.request_id, None)
        self.admission.leave(state.request_id)
        if state.hold_kv and self.kv_connector is not None:
            self.kv_connector.drop_lease(state.request_id)
        state.error = exc
        state.end("error")
        if isinstance(exc, StructuredOutputError) and state.grammar is not None:
            self.grammars.evict(state.grammar)  # failed mid-generation: never cached as valid
        self._counters["failed_requests"] += 1
        logger.warning("request %r failed: %s: %s", state.request_id, type(exc).__name__, exc)
        return state.output()

    def _fail_later(self, state: RequestState, exc: BaseException) -> None:
        """:meth:`_fail_request`, its output returned by the next ``step()``."""
        self._failed_outputs.append(self._fail_request(state, exc))

    def _take_failed_outputs(self) -> list[RequestOutput]:
        outputs, self._failed_outputs = self._failed_outputs, []
        return outputs

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

    # ------------------------------------------------------------------ the KV cache

    def reset_prefix_cache(self) -> int:
        """Drop every cached block no request uses, on every tier (a benchmark's cold start, or
        after changing weights); returns how many. With KV events on, emits their removal (or
        ``AllBlocksCleared`` when no cached block is left)."""
        with self._lock:
            return int(self.scheduler.reset_prefix_cache())

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
                    self._run_forward(out)
                    self.scheduler.update(out, [])
                except BaseException:
                    self.scheduler.rollback_step(out)
                    raise
                finally:
                    self._forget_bad_disk_slots()
        return copied

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

    # ------------------------------------------------------------------ stats

    def check_invariants(self) -> dict[str, int]:
        """Checks the KV cache's bookkeeping (ref counts, free queue, prefix index, every
        sequence's table) and that the engine, the scheduler, the grammar compiler and the KV
        connector agree on the live requests and what each waits for (``Admission.disagreements``;
        ``InvariantViolationError`` on a mismatch, a bug in pagedkv). Returns who holds
        blocks: ``num_used_blocks`` is 0 once no request, lease or reservation is live, else a
        block was lost."""
        with self._lock:
            self.scheduler.check_invariants()
            problems, num_loads = self.admission.disagreements(self.requests)
            if problems:
                raise InvariantViolationError("; ".join(problems))
            stats = self.scheduler.stats()
            names = ("num_blocks", "num_used_blocks", "num_free_blocks", "num_running", "num_waiting")
            counts = {name: int(getattr(stats, name)) for name in names}
            for name in ("waiting_for_grammar", "waiting_for_remote_kv", "kv_leases", "kv_reservations"):
                counts[f"num_{name}"] = int(getattr(stats, f"num_{name}"))
            counts |= {"num_kv_loads": num_loads, "num_held_compiles": len(self.grammars.held)}
            return counts | {"num_unfinished_requests": len(self.requests)}

    def kv_snapshot(self) -> dict[str, Any]:
        """The KV cache as a live view draws it, from the Rust core in one go between steps:
        ``memory_map`` (device ``ref_counts`` int32[N], ``cached`` bool[N], ``owner`` int64[N]:
        the arrival number of the earliest running request holding each block, -1 if none),
        ``tier_map`` (host ``host_ref_counts`` / ``host_cached``; empty without a host tier),
        ``disk_map`` (``disk_ref_counts`` / ``disk_cached``), the requests' summaries
        (``Scheduler.request_summaries``), the last preemptions (time, request id), the stats,
        ``constraints`` (request id -> the kind of its structured-output constraint),
        ``drafts`` (request id -> its drafted and accepted tokens); with KV cache groups,
        ``columns`` (int16[N]: the column each device block serves, -1 free and uncached) and
        ``column_spans`` (each column's span, as the start-up log names it)."""
        with self._lock:
            refs, cached, owner = self.scheduler.memory_map()
            _, host_refs, host_cached = self.scheduler.tier_map()
            disk_refs, disk_cached = self.scheduler.disk_map()
            live = self.requests.items()
            snapshot: dict[str, Any] = {"ref_counts": refs, "cached": cached, "owner": owner}
            snapshot |= {"host_ref_counts": host_refs, "host_cached": host_cached}
            snapshot |= {"disk_ref_counts": disk_refs, "disk_cached": disk_cached}
            snapshot["columns"] = self.scheduler.block_columns()
            snapshot["column_spans"] = self.runner.kv_layout.column_names()
            snapshot["recent_preemptions"] = list(self.stats.recent_preemptions)
            snapshot["requests"] = self.scheduler.request_summaries()
            snapshot["prompts"] = {rid: state.prompt for rid, state in live}
            snapshot["constraints"] = {rid: s.grammar.kind for rid, s in live if s.grammar is not None}
            snapshot["drafts"] = {
                rid: (s.metrics.num_draft_tokens, s.metrics.num_accepted_tokens)
                for rid, s in live
                if s.metrics.num_draft_tokens
            }
        return snapshot | {"stats": self.get_stats()}

    def get_stats(self) -> dict[str, Any]:
        """Scheduler statistics (KV usage and utilization, prefix cache, preemptions, queue
        lengths), the KV cache's size, dtype and bytes per token, and engine counters (steps,
        tokens computed, tokens generated, model time, failed steps and requests)."""
        with self._lock:
            stats: dict[str, Any] = self.scheduler.stats().as_dict()
            stats.update(self.stats.as_dict())
            stats["num_unfinished_requests"] = len(self.requests)
            stats["spec_accepted_per_position"] = self.scheduler.spec_accepted_per_position()
        grammars, masks = self.grammars, self._step_masks
        stats["structured_compile_seconds"] = grammars.compile_time.snapshot()
        stats["structured_mask_seconds"] = masks.fill_time.snapshot()
        stats["structured_step_seconds"] = masks.critical_time.snapshot()
        stats["structured_grammar_cache_hits"] = grammars.num_cache_hits
        # Compiles dropped (every request that wanted one left before it started) and refused
        # (max_queued_compiles waiting already).
        stats["structured_compiles_cancelled"] = grammars.num_cancelled
        stats["structured_compiles_refused"] = grammars.num_refused
        stats["structured_masked_rows"] = masks.num_masked_rows
        stats["kv_cache_bytes"] = self.runner.kv_cache_bytes
        stats["host_kv_cache_bytes"] = self.runner.host_kv_cache_bytes
        stats["num_restored_disk_blocks"] = self.num_restored_disk_blocks
        stats["kv_cache_dtype"] = self.runner.geometry.dtype
        stats["kv_bytes_per_token"] = self.runner.geometry.bytes_per_token
        if self.kv_connector is not None:
            with self._lock:
                stats.update(self.kv_connector.stats())
        stats["background_errors"] = self.background.error_counts()
        return stats


def _start_runner(config: Any) -> tuple[ModelRunner, MultiprocExecutor | RayExecutor | None]:
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


def _load_tokenizer(name: str, trust_remote_code: bool) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"could not load a tokenizer from {name!r}: {exc}") from exc
