"""Admission: a checked request enters the Rust scheduler, and leaves it, here.

Every request enters the scheduler in :meth:`Admission.add`, where all of the scheduler's
checks run. One that must first wait — for its grammar to compile (structured outputs), for
its prompt's KV to arrive from another engine (``do_remote_prefill``), or both — enters
*blocked* on what it waits for (``Scheduler.add_request(..., wait_for=[...])``): live, never
scheduled, holding no block. What it waits on is held where it is owned — the compile handle
by ``GrammarCompiler.held``, the pull by the ``KVConnector`` — and each step, before
scheduling, :meth:`Admission.unblock_ready` lifts the reasons that ended
(``Scheduler.unblock``) and fails the requests whose compile or pull failed. Leaving
(:meth:`Admission.leave`: an abort, a failure) is one ``Scheduler.abort_request`` whatever the
request's state; it returns what the request still waited for, whose holders then drop it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedkv._core import Scheduler
from pagedkv.distributed.transfer_config import RemotePrefill
from pagedkv.engine.input_processor import NewRequest
from pagedkv.engine.request_state import RequestState
from pagedkv.errors import KVTransferError, PagedKVError, UnknownRequestError
from pagedkv.structured.compiler import CompiledGrammar, GrammarCompiler, compile_timeout_error
from pagedkv.structured.params import StructuredOutputsParams

if TYPE_CHECKING:
    from pagedkv.distributed.connector import KVConnector

__all__ = ["Admission", "Fail"]

# Takes a request out of the engine with finish_reason "error" (Failures.fail_later).
Fail = Callable[[RequestState, Exception], None]


@dataclass(frozen=True, slots=True)
class SchedulerRequest:
    """A new request as the Rust scheduler takes it (``Scheduler.add``): the fields of
    ``Scheduler.add_request``, converted and checked once, in Rust, with typed errors."""

    request_id: str
    prompt_token_ids: Sequence[int]
    max_tokens: int
    min_tokens: int
    eos_token_ids: Sequence[int]
    stop_token_ids: Sequence[int]
    ignore_eos: bool
    priority: int
    n: int
    retention_priority: int | None
    retention_duration: float | None
    retention_tokens: int | None
    cache_salt: str | None
    hold_kv: bool
    beam_width: int | None
    length_penalty: float | None
    skip_prefix_cache: bool
    speculate: bool
    wait_for: Sequence[str]


class Admission:
    """Adds requests to the scheduler, unblocks them and takes them out (module docs)."""

    def __init__(
        self,
        scheduler: Scheduler,
        grammars: GrammarCompiler,
        kv_connector: KVConnector | None,
        lock: threading.RLock,
        compile_timeout_s: float,
        eos_token_ids: list[int],
    ) -> None:
        self.scheduler = scheduler
        self.grammars = grammars
        self.kv_connector = kv_connector
        self._lock = lock
        self.compile_timeout_s = compile_timeout_s
        self.eos_token_ids = eos_token_ids

    def add(
        self,
        request: NewRequest,
        requests: dict[str, RequestState],
        check_remote: Callable[[NewRequest], RemotePrefill | None],
    ) -> None:
        """Adds ``request`` to the scheduler (blocked on what it waits for) and to ``requests``,
        under the engine's lock; raises, changing nothing, when the scheduler refuses it.
        ``check_remote``: the input processor's check of the pull it asks for."""
        state = request.state
        rid = state.request_id
        constraint = request.constraint
        # OverloadedError here when max_queued_compiles wait already (nothing was changed).
        compiling = None if constraint is None else self.grammars.acquire(constraint, tenant=state.cache_salt)
        try:
            with self._lock:
                wait_for = []
                if compiling is not None:
                    if compiling.future.done():
                        state.attach_grammar(compiling.future.result())  # a cached grammar, or its error
                    else:
                        wait_for.append("grammar")  # compiling off this thread: a later step unblocks it
                remote = check_remote(request)
                if remote is not None:
                    wait_for.append("remote_kv")
                # Every check that can refuse the request runs here (nothing changed on a refusal);
                # a request with reasons to wait is blocked: live, but never scheduled until
                # unblocked (Scheduler.unblock).
                self._add_to_scheduler(request, wait_for)
                requests[rid] = state
                if compiling is not None and "grammar" in wait_for:
                    self.grammars.held.hold(rid, compiling, time.monotonic() + self.compile_timeout_s)
                    compiling = None  # released when the compile ends or the request leaves
                if remote is not None:
                    self._start_kv_load(state, remote, requests)
        finally:
            if compiling is not None:
                compiling.release()

    def _add_to_scheduler(self, request: NewRequest, wait_for: list[str]) -> None:
        """The one call that adds a request to the scheduler, as a typed :class:`SchedulerRequest`."""
        state, params, beam = request.state, request.state.params, request.beam
        self.scheduler.add(
            SchedulerRequest(
                request_id=state.request_id,
                prompt_token_ids=state.prompt_token_ids,
                max_tokens=request.max_tokens,
                min_tokens=params.min_tokens,
                eos_token_ids=[] if params.ignore_eos else self.eos_token_ids,
                stop_token_ids=params.stop_token_ids or [],
                ignore_eos=params.ignore_eos,
                priority=request.priority,
                n=params.n,
                retention_priority=params.retention_priority,
                retention_duration=params.retention_duration,
                retention_tokens=params.retention_tokens,
                cache_salt=state.cache_salt,
                hold_kv=state.hold_kv,
                beam_width=None if beam is None else beam.beam_width,
                length_penalty=None if beam is None else beam.length_penalty,
                # Cached blocks have no logits: a request that wants the prompt's computes it whole.
                skip_prefix_cache=params.prompt_logprobs is not None,
                # A grammar's matcher cannot follow drafts: constrained requests never draft.
                speculate=request.constraint is None,
                wait_for=wait_for,
            )
        )

    def _start_kv_load(self, state: RequestState, remote: RemotePrefill, requests: dict[str, RequestState]) -> None:
        """Starts pulling the prompt's KV of ``state``, added blocked on ``"remote_kv"``; when
        there is nothing to wait for (all cached here, or no room now) it is unblocked at once."""
        connector = self.kv_connector
        assert connector is not None
        rid = state.request_id
        try:
            if not connector.start_load(rid, state.prompt_token_ids, remote, state.cache_salt):
                self.scheduler.unblock(rid, "remote_kv")
        except BaseException:
            # Cannot happen (the scheduler's add checked what a reservation needs): leave
            # nothing of the request behind.
            requests.pop(rid, None)
            self.leave(rid)
            raise

    def leave(self, rid: str) -> None:
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

    def nothing_schedulable(self) -> bool:
        """No request is queued or running: whatever is live is blocked (or none is)."""
        return self.scheduler.num_waiting == 0 and self.scheduler.num_running == 0

    def wait_while_only_loading(self) -> None:
        """Before a step, outside the lock: when only pulls are in flight, wait for one a moment
        instead of spinning."""
        connector = self.kv_connector
        if connector is not None and connector.loads and self.nothing_schedulable():
            connector.wait_for_loads(0.02)

    def unblock_ready(self, requests: Mapping[str, RequestState], fail: Fail) -> None:
        """Under the lock, before scheduling: frees expired KV leases, and unblocks the requests
        whose remote KV arrived (``"remote_kv"``: they compute what did not arrive) or whose
        grammar compiled (``"grammar"``). ``fail`` takes out, at once, a request whose pull
        failed under the ``fail`` policy or whose compile failed or ran past
        ``compile_timeout_s``."""
        if self.kv_connector is not None:
            self.kv_connector.poll()
            self._unblock_loaded(requests, fail)
        self._unblock_compiled(requests, fail)

    def _unblock_loaded(self, requests: Mapping[str, RequestState], fail: Fail) -> None:
        connector = self.kv_connector
        if connector is None or not connector.loads:
            return
        # Pulls of requests that left are not reported (KVConnector.abandon).
        for load in connector.take_finished_loads():
            state = requests.get(load.request_id)
            if state is None:  # cannot happen: a request that leaves abandons its pull
                continue
            if load.error is not None and connector.config.kv_load_failure_policy == "fail":
                fail(state, KVTransferError(load.error))
                continue
            try:
                self.scheduler.unblock(load.request_id, "remote_kv")
            except PagedKVError as exc:  # cannot happen: it waits for its KV until this point
                fail(state, exc)

    def _unblock_compiled(self, requests: Mapping[str, RequestState], fail: Fail) -> None:
        held = self.grammars.held
        if not held:
            return
        if self.nothing_schedulable():
            held.wait_any(0.02)  # only compiles pending: wait for one a moment instead of spinning
        for rid, result in held.take_ended(time.monotonic(), self.compile_timeout_s):
            state = requests.get(rid)
            if state is None:  # cannot happen: a request that leaves releases its compile
                continue
            try:
                if not isinstance(result, CompiledGrammar):
                    raise result  # the compile's error, or its timeout
                state.attach_grammar(result)
                self.scheduler.unblock(rid, "grammar")
            except Exception as exc:
                fail(state, exc)

    def compile_grammars(
        self, constraints: Iterable[StructuredOutputsParams | None], timeout: float | None, cache_salt: str | None
    ) -> None:
        """See ``LLMEngine.compile_grammars``."""
        limit = self.compile_timeout_s if timeout is None else timeout
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

    def disagreements(self, requests: Iterable[str]) -> tuple[list[str], int]:
        """Where the scheduler and the holders disagree on what the live ``requests`` wait
        for (each a sentence; none when they agree), and the pulls in flight: every live
        request is the scheduler's, a compile is held exactly for each request blocked on
        ``"grammar"``, a pull is in flight for each one blocked on ``"remote_kv"``."""
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
        for rid in requests:
            waiting = self.scheduler.waiting_for(rid)
            if waiting is None:
                problems.append(f"request {rid!r} is live in the engine, not in the scheduler")
            elif ("grammar" in waiting) != (rid in held) or ("remote_kv" in waiting) != (rid in loads):
                problems.append(
                    f"request {rid!r} waits for {waiting} in the scheduler, which the holders disagree with"
                )
        return problems, 0 if connector is None else len(connector.loads)
