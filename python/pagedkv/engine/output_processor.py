"""The output processor: a step's results applied to the requests, and their outputs.

After ``Scheduler.update`` has appended the sampled tokens and applied the token-based stops,
:meth:`OutputProcessor.process` takes its updates (one per emitted token) and, per request,
advances its structured-output matcher, appends the token, records its logprobs, detokenizes
it incrementally (a stop string ends the sample: ``Scheduler.finish_sample``), follows its
beams, counts its drafted and accepted tokens, and builds one :class:`RequestOutput` for each
request that progressed. A failure in one request's processing fails that request alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from pagedkv._core import RequestUpdate, Scheduler, SchedulerOutput
from pagedkv.engine import prompt_logprobs
from pagedkv.engine.outputs import Logprob, RequestOutput
from pagedkv.engine.request_state import RequestState
from pagedkv.engine.spec_decode import DraftContexts
from pagedkv.errors import StructuredOutputError
from pagedkv.sample.sampler import SamplerOutput

if TYPE_CHECKING:
    from pagedkv.distributed.connector import KVConnector

__all__ = ["OutputProcessor"]


class OutputProcessor:
    """Applies steps' updates to the engine's live requests (``requests``, shared with it)."""

    def __init__(
        self,
        requests: dict[str, RequestState],
        scheduler: Scheduler,
        tokenizer: Any,
        kv_connector: KVConnector | None,
        fail: Callable[[RequestState, Exception], RequestOutput],
    ) -> None:
        self.requests = requests
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.kv_connector = kv_connector
        # Takes a request out of the engine with finish_reason "error"; returns its output.
        self._fail = fail
        # Seconds spent advancing grammar matchers since the last reset (the step's critical path).
        self.grammar_s = 0.0

    def process(
        self, out: SchedulerOutput, updates: Sequence[RequestUpdate], sampled: SamplerOutput, drafts: DraftContexts
    ) -> list[RequestOutput]:
        """The outputs of the requests the step's ``updates`` touched (finished ones leave
        ``requests``), then those of the requests that failed in their own processing."""
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
                failed.append(self._fail(state, exc))
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

    def record_prompt_logprobs(self, rows: prompt_logprobs.PromptRows, found: prompt_logprobs.PromptLogprobs) -> None:
        """The step's prompt logprobs, into their requests' lists."""
        prompt_logprobs.record(rows, found, self.requests, self.tokenizer)

    def _apply_update(self, state: RequestState, u: RequestUpdate, sampled: SamplerOutput, now: float) -> None:
        sample = state.samples[u.index]
        token = u.new_token_ids[0]
        matcher = sample.matcher
        if matcher is not None:
            # A matcher in error had a mask of eos alone (StepMasks lets every token through
            # instead), and consumes eos "successfully": checked before and after, so a broken
            # constraint fails the request (and evicts the grammar, Failures.fail)
            # and never ends it with "" as if it matched.
            start = time.perf_counter()
            consumed = not matcher.is_error() and matcher.consume_token(token) and not matcher.is_error()
            self.grammar_s += time.perf_counter() - start
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
                    failed.append(self._fail(state, exc))
                continue
            beam.finish(results.get(rid, []))
            state.samples[0].finish_reason = reason
        return failed

    def _record_logprobs(self, state: RequestState, index: int, row: int, sampled: SamplerOutput, token: int) -> None:
        lp = sampled.logprobs
        assert lp is not None
        k = state.params.logprobs or 0
        ids: list[int] = lp.token_ids[row, : 1 + k].tolist()
        values: list[float] = lp.logprobs[row, : 1 + k].tolist()
        entries = {ids[0]: Logprob(values[0], int(lp.ranks[row]), self.tokenizer.decode([ids[0]]))}
        for rank, (tid, value) in enumerate(zip(ids[1:], values[1:]), start=1):
            entries.setdefault(tid, Logprob(value, rank, self.tokenizer.decode([tid])))
        state.add_logprobs(index, entries, token)
