"""``LLMEngine``: the embedding API for servers — add requests, step, read outputs.

A request passes the :class:`InputProcessor` (checks against the model, tokenization, its
``RequestState``) and :class:`Admission` (into the Rust scheduler, blocked while its grammar
compiles or its remote KV arrives). One ``step()`` is schedule (``Scheduler.schedule`` picks
the batch) → execute (``ModelRunner.execute``: copy ops and one packed forward on the paged KV
cache; grammar masks applied) → sample (:mod:`pagedkv.sample.metadata`, the :class:`Sampler`;
``Scheduler.update`` appends the tokens and applies the token-based stops) → process outputs
(:class:`OutputProcessor`: a :class:`RequestOutput` per request that progressed).

Bad input raises a typed :mod:`pagedkv.errors` exception before anything changes. An
exception between ``schedule()`` and ``update()`` (an interrupt, out of memory, a bug) rolls
the step back in the scheduler (its requests go back to the waiting queue with what they had
computed before it) and propagates; the next ``step()`` retries it. Requests failed alone
(``finish_reason="error"``: failures.py) come in the next ``step()``'s outputs.

Threading: one lock serializes the public methods. ``add_request`` and ``abort_request`` may
be called from any thread (a server's request handlers) while another thread steps; they wait
for the step in flight to end. ``AsyncLLM`` drives the engine from one thread instead.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from typing import Any

import torch

from pagedkv._core import RequestUpdates, SchedulerOutput
from pagedkv.background import BackgroundThreads
from pagedkv.engine import prompt_logprobs
from pagedkv.engine.admission import Admission
from pagedkv.engine.args import EngineArgs
from pagedkv.engine.beam_tracker import beam_candidates
from pagedkv.engine.failures import Failures
from pagedkv.engine.forward import StepForward, has_copies
from pagedkv.engine.input_processor import InputProcessor, request_ids
from pagedkv.engine.output_processor import OutputProcessor
from pagedkv.engine.outputs import RequestOutput
from pagedkv.engine.prompt_logprobs import Found
from pagedkv.engine.prompts import PromptType
from pagedkv.engine.request_state import RequestState
from pagedkv.engine.spec_decode import DraftContexts, SeededDraws
from pagedkv.engine.startup import (
    load_tokenizer,
    make_drafter,
    make_grammar_compiler,
    make_kv_connector,
    make_scheduler,
    start_runner,
    stop_workers,
)
from pagedkv.engine.stats import StepStats, invariant_counts, kv_maps, structured_stats
from pagedkv.errors import ConfigError, EngineDeadError, InvariantViolationError, UnknownRequestError
from pagedkv.sample.beam_search_params import BeamSearchParams
from pagedkv.sample.metadata import beam_width, grammar_rows, step_metadata
from pagedkv.sample.prepared import PreparedSampling
from pagedkv.sample.sampler import Sampler, SamplerOutput
from pagedkv.sample.sampling_params import SamplingParams
from pagedkv.structured.params import StructuredOutputsParams
from pagedkv.structured.step_masks import PendingMasks, StepMasks, apply_token_bitmask_

__all__ = ["LLMEngine"]


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
        self.args = args = engine_args
        # Every public method takes this lock (module docs, "Threading"); tokenization in
        # add_request happens before taking it.
        self._lock = threading.RLock()
        # Validated once (pagedkv.config); the runner and the scheduler take its parts.
        self.config = config = args.create_engine_config()
        torch.manual_seed(config.model.seed)
        runner, self.executor = start_runner(config)
        self.runner = runner
        # Set once a tensor-parallel step broke the group: every later step raises it.
        self._dead: EngineDeadError | None = None
        self.tokenizer = load_tokenizer(config.model.tokenizer or runner.model_path, config.model.trust_remote_code)
        self.max_model_len = runner.max_model_len
        self.scheduler = make_scheduler(config, runner)
        # enforce_eager=False: the forward compiled (or loaded from disk) now, not in the first
        # request's step; before any block is handed out (the step writes one free block).
        runner.warm_up_compiled()
        # The auto preemption cost model: the tiers' copy bandwidth is measured once here, the
        # forward's throughput on the real steps (StepStats).
        self.swap_bandwidth = runner.measure_swap_bandwidth() if runner.num_host_blocks > 0 else None
        self.stats = StepStats(
            self.scheduler, runner.bytes_per_block, self.swap_bandwidth, config.speculative is not None
        )
        self._counters, self.recent_preemptions = self.stats.counters, self.stats.recent_preemptions
        self.forward = StepForward(runner, self.scheduler)
        # The disk tier: entries an earlier engine on the same model left in kv_cache_dir.
        cache = runner.disk_cache
        self.num_restored_disk_blocks = 0 if cache is None else cache.restore(self.scheduler)
        self.sampler = Sampler()
        # Speculative decoding (spec_decode.py): seeded streams kept independent of the drafts.
        self._seeded_draws = SeededDraws()
        self._drafter = make_drafter(config, runner)
        # Ids outside the LM head's rows can never be sampled (nor banned: the sampler refuses them).
        self.eos_token_ids = [t for t in runner.eos_token_ids if 0 <= t < runner.vocab_size]
        self.requests: dict[str, RequestState] = {}
        # The threads besides the stepping one (grammar compiles, KV transfer): each records the
        # inputs it survived, and a dead one makes the server's /health degraded.
        self.background = BackgroundThreads()
        # Structured outputs: grammars compile off this thread (cached); each step's masks are
        # filled while its forward runs (pagedkv.structured).
        self.grammars = make_grammar_compiler(
            config, self.tokenizer, runner.vocab_size, self.eos_token_ids, self.background
        )
        self._step_masks = StepMasks(runner.vocab_size)
        # KV transfer between engines (kv_transfer_config): the connector holds the pulls.
        self.kv_connector = make_kv_connector(config, self.scheduler, runner, self._lock, self.background)
        self.input_processor = InputProcessor(config, self.tokenizer, runner, self.eos_token_ids, self.kv_connector)
        timeout_s = config.structured_outputs.compile_timeout_s
        self.admission = Admission(
            self.scheduler, self.grammars, self.kv_connector, self._lock, timeout_s, self.eos_token_ids
        )
        # Requests failed alone (failures.py), after max_step_failures failed steps in a row.
        self.failures = Failures(self.requests, self.admission, self.grammars, self.kv_connector, self._counters)
        self.output_processor = OutputProcessor(
            self.requests, self.scheduler, self.tokenizer, self.kv_connector, self.failures.fail
        )

    @property
    def max_step_failures(self) -> int:
        """Consecutive failed steps after which a request is failed on its own."""
        return self.failures.max_step_failures

    @max_step_failures.setter
    def max_step_failures(self, value: int) -> None:
        self.failures.max_step_failures = value

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
        options = (arrival_time, priority, cache_salt, kv_transfer_params, prepared)
        request = self.input_processor.process(request_id, prompt, params, *options)
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
        unknown, outputs = [], []
        with self._lock:
            for rid in request_ids(request_id):
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
        return bool(self.requests) or bool(self.failures)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ------------------------------------------------------------------ the step

    def step(self) -> list[RequestOutput]:
        """One step: schedule → execute → sample → process outputs (failures: module docs)."""
        self.admission.wait_while_only_loading()
        with self._lock:
            if self._dead is not None:
                raise self._dead
            out = self._schedule()
            if out.num_tokens == 0 and not has_copies(out):
                self.scheduler.update(out, [])
                return self.failures.take_outputs()
            start, masks = time.perf_counter(), None
            try:
                masks = self._start_masks(out)  # filled while the forward runs
                logits, prompt = self._execute(out, masks)
                sampled, drafts = self._sample(out, logits)
                updates = self._update_scheduler(out, logits, sampled)
            except BaseException as exc:
                self._step_failed(out, exc)  # rolled back (and the workers stopped if they died)
                raise
            finally:
                self._forward_ended(masks)
            self.stats.stepped(out, time.perf_counter() - start, len(updates))
            return self._process_outputs(out, updates, sampled, drafts, prompt, masks)

    def _schedule(self) -> SchedulerOutput:
        """Unblocks the requests whose wait ended (failing those whose wait failed), then
        schedules the step."""
        self.admission.unblock_ready(self.requests, self.failures.fail_later)
        out = self.scheduler.schedule()
        self.stats.scheduled(out, self.requests, time.time())
        return out

    def _start_masks(self, out: SchedulerOutput) -> PendingMasks | None:
        """Starts filling the grammar masks of the step's sampled rows that have a matcher (None
        when no row has one)."""
        self.output_processor.grammar_s = 0.0  # grammar time on this step's critical path
        if not any(state.grammar is not None for state in self.requests.values()):
            return None
        rows, matchers = grammar_rows(out, self.requests)
        return self._step_masks.start(rows, matchers) if rows else None

    def _execute(self, out: SchedulerOutput, masks: PendingMasks | None) -> tuple[torch.Tensor, Found | None]:
        """The logits of the step's sampled rows (grammar masks applied), and the prompt
        logprobs of the requests that want them (pagedkv.engine.prompt_logprobs)."""
        logits, prompt = prompt_logprobs.run_step(out, self.requests, lambda step: self.forward.run(out, step))
        if masks is not None:
            start = time.perf_counter()
            apply_token_bitmask_(logits, masks.rows, masks.wait())
            self.output_processor.grammar_s += time.perf_counter() - start
        return logits, prompt

    def _sample(self, out: SchedulerOutput, logits: torch.Tensor) -> tuple[SamplerOutput, DraftContexts]:
        """One token per logits row (pagedkv.sample.metadata: a row after drafts is sampled as
        an ordinary step would sample it after them), and the step's drafts."""
        drafts = DraftContexts(out)
        metadata, seeded = step_metadata(
            out, self.requests, drafts, vocab_size=self.runner.vocab_size, device=logits.device
        )
        for generator, rid, index in seeded:
            self._seeded_draws.save(generator, rid, index)
        return self.sampler(logits, metadata), drafts

    def _update_scheduler(self, out: SchedulerOutput, logits: torch.Tensor, sampled: SamplerOutput) -> RequestUpdates:
        """``Scheduler.update`` with the sampled tokens and the beam rows' candidates
        (``2 * beam_width`` per row, the widest beam request's); its updates."""
        rows: list[int] = out.beam_rows.tolist()
        beams = beam_candidates(logits, rows, 2 * beam_width(rows, out, self.requests)) if rows else (None, None)
        updates = self.scheduler.update(out, sampled.sampled_token_ids.cpu().numpy(), *beams)
        self._seeded_draws.settle(updates, self.sampler, self.runner.vocab_size, logits.device)
        return updates

    def _forward_ended(self, masks: PendingMasks | None) -> None:
        if masks is not None:
            masks.join()  # no matcher is left in use by the fill thread
        self.forward.forget_bad_disk_slots()

    def _process_outputs(
        self,
        out: SchedulerOutput,
        updates: RequestUpdates,
        sampled: SamplerOutput,
        drafts: DraftContexts,
        prompt: Found | None,
        masks: PendingMasks | None,
    ) -> list[RequestOutput]:
        """The step's outputs (after those of requests failed earlier); then the next drafts."""
        self.failures.clear(out)
        if prompt is not None:
            self.output_processor.record_prompt_logprobs(*prompt)
        outputs = self.failures.take_outputs() + self.output_processor.process(out, updates, sampled, drafts)
        if self._drafter is not None:
            self._drafter.propose_after_step(self.scheduler, updates, self.requests)
        if masks is not None:
            self._step_masks.critical_time.observe(self.output_processor.grammar_s)
        return outputs

    def _step_failed(self, out: SchedulerOutput, exc: BaseException) -> None:
        """Undo the step in flight after ``exc``; charge its requests one failure each
        (failures.py). A broken tensor-parallel group stops the workers and raises the error
        every later step raises."""
        self._seeded_draws.forget()
        self.scheduler.rollback_step(out)
        self._counters["failed_steps"] += 1
        if isinstance(exc, Exception):  # not KeyboardInterrupt, SystemExit: not the requests' fault
            self.failures.charge(out.req_ids, exc)
        if isinstance(exc, EngineDeadError):
            self._dead = stop_workers(self.executor, exc)
            raise self._dead from exc

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
        with self._lock:
            return self.forward.flush(max_rounds)

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
            held, stats = len(self.grammars.held), self.scheduler.stats()
            return invariant_counts(stats, num_loads, held, len(self.requests))

    def kv_snapshot(self) -> dict[str, Any]:
        """The KV cache as a live view draws it, from the Rust core in one go between steps
        (:func:`pagedkv.engine.stats.kv_maps`), with the last preemptions (time, request id),
        ``kv_group_spans`` (each KV cache group's span, as the start-up log names it) and
        the stats."""
        with self._lock:
            snapshot = kv_maps(self.scheduler, self.requests)
            snapshot["recent_preemptions"] = list(self.stats.recent_preemptions)
        snapshot["kv_group_spans"] = self.runner.kv_layout.kv_group_names()
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
        stats.update(structured_stats(self.grammars, self._step_masks))
        runner = self.runner
        stats["kv_cache_bytes"] = runner.kv_cache_bytes
        stats["host_kv_cache_bytes"] = runner.host_kv_cache_bytes
        stats["num_restored_disk_blocks"] = self.num_restored_disk_blocks
        stats["kv_cache_dtype"] = runner.geometry.dtype
        stats["kv_bytes_per_token"] = runner.geometry.bytes_per_token
        if self.kv_connector is not None:
            with self._lock:
                stats.update(self.kv_connector.stats())
        stats["background_errors"] = self.background.error_counts()
        return stats
