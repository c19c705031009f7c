"""Failing requests alone, and counting the failed steps each request was in.

A request is failed (``finish_reason="error"``, its ``error`` set) when its own processing
breaks (a grammar that fails to compile or stops matching, a remote KV pull that fails under
the ``fail`` policy, its detokenization) or when it was in ``max_step_failures`` consecutive
failed steps: each step that raised charges its requests one failure, each step that went
through clears their counts, so a request that breaks every forward cannot block the others
forever and transient failures never add up.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

from pagedkv._core import SchedulerOutput
from pagedkv.engine.admission import Admission
from pagedkv.engine.outputs import RequestOutput
from pagedkv.engine.request_state import RequestState
from pagedkv.errors import StructuredOutputError
from pagedkv.structured.compiler import GrammarCompiler

if TYPE_CHECKING:
    from pagedkv.distributed.connector import KVConnector

__all__ = ["Failures"]

logger = logging.getLogger(__name__)


class Failures:
    """Takes failed requests out of the engine and keeps their outputs until a step returns."""

    def __init__(
        self,
        requests: dict[str, RequestState],
        admission: Admission,
        grammars: GrammarCompiler,
        kv_connector: KVConnector | None,
        counters: dict[str, float],
        max_step_failures: int = 3,
    ) -> None:
        self.requests = requests
        self.admission = admission
        self.grammars = grammars
        self.kv_connector = kv_connector
        self.counters = counters
        self.max_step_failures = max_step_failures
        # Ids of requests with a failure count to clear (may hold ids that left the engine
        # since; the counts live on the states).
        self._charged: set[str] = set()
        # Outputs of requests failed outside a step's own outputs, for the next step().
        self._outputs: list[RequestOutput] = []

    def __bool__(self) -> bool:
        """Outputs are waiting for the next step."""
        return bool(self._outputs)

    def fail(self, state: RequestState, exc: BaseException) -> RequestOutput:
        """Take ``state`` out of the engine (its blocks are freed) with ``finish_reason="error"``."""
        self.requests.pop(state.request_id, None)
        self.admission.leave(state.request_id)
        if state.hold_kv and self.kv_connector is not None:
            self.kv_connector.drop_lease(state.request_id)
        state.error = exc
        state.end("error")
        if isinstance(exc, StructuredOutputError) and state.grammar is not None:
            self.grammars.evict(state.grammar)  # failed mid-generation: never cached as valid
        self.counters["failed_requests"] += 1
        logger.warning("request %r failed: %s: %s", state.request_id, type(exc).__name__, exc)
        return state.output()

    def fail_later(self, state: RequestState, exc: BaseException) -> None:
        """:meth:`fail`, its output returned by the next step."""
        self._outputs.append(self.fail(state, exc))

    def take_outputs(self) -> list[RequestOutput]:
        outputs, self._outputs = self._outputs, []
        return outputs

    def charge(self, req_ids: Iterable[str], exc: Exception) -> None:
        """A step that raised ``exc``: its requests are charged one failure each, and those at
        ``max_step_failures`` are failed."""
        for rid in dict.fromkeys(req_ids):
            state = self.requests.get(rid)
            if state is None:
                continue
            self._charged.add(rid)
            state.num_failed_steps += 1
            if state.num_failed_steps >= self.max_step_failures:
                self.fail_later(state, exc)

    def clear(self, out: SchedulerOutput) -> None:
        """Step ``out`` went through: its requests' failure counts start over."""
        if not self._charged:
            return  # (no look at the step's request ids: nothing is charged in most steps)
        stepped = self._charged.intersection(out.req_ids)
        for rid in stepped:
            state = self.requests.get(rid)
            if state is not None:
                state.num_failed_steps = 0
        self._charged = {rid for rid in self._charged - stepped if rid in self.requests}
