"""``AsyncLLM``: streaming generation for asyncio servers, from one background step loop.

    engine = pagedkv.AsyncLLM()          # or AsyncLLM(model=..., **engine_args)
    async for out in engine.generate("Hello", pagedkv.SamplingParams(max_tokens=32), "req-1"):
        print(out.outputs[0].text)       # cumulative text so far

One thread owns the :class:`LLMEngine` and runs its step loop; nothing else touches the engine.
Callers talk to it through a command queue (add, abort, stats), so the event loop never blocks
on a forward pass. Every command is answered through a future: a bad request raises its typed
:mod:`pagedkv.errors` exception in the caller, and the loop keeps serving everyone else. Each
stream's outputs are handed to its own event loop with ``call_soon_threadsafe``.

``add_request`` splits ``generate`` in two: it returns a :class:`RequestStream` once the engine
has accepted the request (bad input raises there, before anything streams), so a server can
answer 400 before it starts a response.

Leaving the ``async for`` early — ``break``, an exception, or the task being cancelled (a
client disconnecting) — aborts the request, which frees its KV blocks at once. ``abort()``
ends a stream from outside with a last output whose ``finish_reason`` is ``"abort"``.

A step that raises is rolled back by the engine and retried; the loop keeps serving. A request
the engine gives up on (``max_step_failures`` failed steps, or a failure in its own output
processing) ends its stream with :class:`pagedkv.errors.RequestFailedError`; every other
stream continues. Only the loop thread itself dying (or ``shutdown()``) ends all streams, with
:class:`EngineDeadError`.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from typing import Any

from pagedkv.engine.args import EngineArgs
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.outputs import RequestOutput
from pagedkv.engine.prompts import PromptType
from pagedkv.errors import (
    EngineDeadError,
    PagedKVError,
    RequestFailedError,
    StructuredOutputError,
    UnknownRequestError,
)
from pagedkv.sample.beam_search_params import BeamSearchParams
from pagedkv.sample.prepared import needs_preparation
from pagedkv.sample.sampling_params import SamplingParams
from pagedkv.structured.compiler import compile_timeout_error
from pagedkv.structured.params import StructuredOutputsParams

__all__ = ["AsyncLLM", "EngineDeadError", "RequestStream"]

logger = logging.getLogger(__name__)


class _Stream:
    """Where one request's outputs go: a queue on the caller's event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> bool:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
            return True
        except RuntimeError:  # the caller's loop is closed: nobody is listening
            return False


class RequestStream:
    """The outputs of one request added with :meth:`AsyncLLM.add_request`, as an async
    iterator of cumulative :class:`RequestOutput`; it ends after the output with
    ``finished=True``. A failed request raises RequestFailedError, a dead engine
    EngineDeadError. :meth:`close` before the end aborts the request (its blocks are freed)."""

    def __init__(self, owner: AsyncLLM, request_id: str, stream: _Stream) -> None:
        self.request_id = request_id
        self._owner = owner
        self._stream = stream
        self.finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._stream.queue.get()
        if isinstance(item, BaseException):
            self.finished = True  # the engine already dropped the request
            raise item  # RequestFailedError (this request) or EngineDeadError (all)
        self.finished = item.finished
        return item

    def close(self) -> None:
        """Abort the request unless it has finished (idempotent; safe from any coroutine)."""
        if not self.finished:
            self.finished = True
            rid, stream = self.request_id, self._stream
            self._owner._post(lambda: self._owner._abort_quietly(rid, stream))

    def fail(self, error: BaseException) -> None:
        """Abort the request (unless it has finished) and raise ``error`` to a reader waiting
        for its next output (a server shutting down ends its streams this way). Call it from
        the stream's event loop."""
        if not self.finished:
            self.close()
            self._stream.queue.put_nowait(error)


# A command for the loop thread: a function, and the future that gets its result (None for
# fire-and-forget commands). `None` as a whole asks the loop to stop.
_Command = tuple[Callable[[], Any], "Future[Any] | None"] | None


class AsyncLLM:
    """An :class:`LLMEngine` behind a background step loop, for concurrent async callers."""

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self._start(LLMEngine(EngineArgs.from_kwargs(model, **engine_args)))

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> AsyncLLM:
        self = cls.__new__(cls)
        self._start(LLMEngine(engine_args))
        return self

    def _start(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.Queue[_Command] = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self._dead: EngineDeadError | None = None
        self._kv_event_sink: Callable[[bytes], None] | None = None
        if engine.kv_connector is not None:
            # A pull that ends wakes an idle loop (a no-op command), which then steps.
            engine.kv_connector.wake = lambda: self._post(lambda: None)
        self._thread = threading.Thread(target=self._run_loop, name="pagedkv-step-loop", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ public API

    async def add_request(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | BeamSearchParams | None = None,
        request_id: str | None = None,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> RequestStream:
        """Queue a request and return its :class:`RequestStream`. Bad input raises its typed
        :mod:`pagedkv.errors` exception here, before anything streams (a server answers 400
        before sending headers). A caller cancelled while this waits leaves nothing behind."""
        if request_id is None:
            request_id = f"async-{next(self._ids)}"
        constraint = getattr(sampling_params, "structured_outputs", None)
        if constraint is not None:
            await self._compile(constraint, cache_salt)
        prepared = None
        if isinstance(sampling_params, SamplingParams) and needs_preparation(sampling_params):
            # Checked against the model and built here, in a worker thread: neither the caller's
            # event loop nor the loop thread tokenizes bad words or builds masks.
            prepared = await asyncio.to_thread(self.engine.prepare_params, sampling_params)
        stream = _Stream(asyncio.get_running_loop())

        def add() -> None:
            self.engine.add_request(
                request_id,
                prompt,
                sampling_params,
                priority=priority,
                cache_salt=cache_salt,
                kv_transfer_params=kv_transfer_params,
                prepared=prepared,
            )
            self._streams[request_id] = stream

        try:
            await self._call(add)
        except asyncio.CancelledError:
            # The add may run after all (the loop thread took it already): undo it.
            self._post(lambda: self._abort_quietly(request_id, stream))
            raise
        return RequestStream(self, request_id, stream)

    async def _compile(self, constraint: StructuredOutputsParams, cache_salt: str | None) -> None:
        """Waits (without blocking the loop thread) for the constraint's grammar, so that the
        engine admits the request at once and a schema it cannot serve raises here, before
        anything streams (StructuredOutputError: a server's 400)."""
        # OverloadedError (a 503) at once when max_queued_compiles compiles wait already.
        handle = self.engine.grammars.acquire(constraint, tenant=cache_salt)
        limit = self.engine.config.structured_outputs.compile_timeout_s
        try:
            # shield: cancelling this wait must not cancel the future other requests may share;
            # release() drops the compile when nobody else waits and no thread took it yet (a
            # client that went away, or this request's own time limit).
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(handle.future)), limit)
        except asyncio.TimeoutError:
            raise compile_timeout_error(limit) from None
        finally:
            handle.release()

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | BeamSearchParams | None = None,
        request_id: str | None = None,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream the request's cumulative :class:`RequestOutput` after every step that
        advances it; the last one has ``finished=True``. With :class:`BeamSearchParams` each
        output holds the current best beam, the last one the ``beam_width`` best sequences."""
        stream = await self.add_request(
            prompt,
            sampling_params,
            request_id,
            priority=priority,
            cache_salt=cache_salt,
            kv_transfer_params=kv_transfer_params,
        )
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    async def abort(self, request_id: str) -> None:
        """Abort a live request: its blocks are freed and its stream ends with a last output
        whose ``finish_reason`` is ``"abort"``. Raises UnknownRequestError otherwise."""

        def abort() -> None:
            outputs = self.engine.abort_request(request_id)
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream.put(outputs[0])

        await self._call(abort)

    async def get_stats(self) -> dict[str, Any]:
        """The engine's statistics (see ``LLMEngine.get_stats``), read between steps."""
        return dict(await self._call(self.engine.get_stats))

    async def kv_snapshot(self) -> dict[str, Any]:
        """``LLMEngine.kv_snapshot`` between steps (nothing is computed while nobody asks)."""
        return dict(await self._call(self.engine.kv_snapshot))

    async def check_invariants(self) -> dict[str, int]:
        """``LLMEngine.check_invariants`` between steps."""
        return dict(await self._call(self.engine.check_invariants))

    async def reset_prefix_cache(self) -> int:
        """``LLMEngine.reset_prefix_cache`` between steps."""
        return int(await self._call(self.engine.reset_prefix_cache))

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self._dead is None

    def health(self) -> dict[str, Any]:
        """``{"status": "ok" | "degraded" | "dead", ...}``: ``dead`` once the step loop has
        ended, ``degraded`` while a background thread that requests need is dead
        (``LLMEngine.background``: grammar compiles, KV transfer, KV events), with each
        thread's state and the errors it survived. Read from any thread, without the loop."""
        report = self.engine.background.health()
        if not self.is_running:
            report["status"] = "dead"
        return report

    def shutdown(self) -> None:
        """Stop the step loop; open streams and pending calls end with EngineDeadError. Then
        the KV cache is flushed to the disk tier, if there is one (``LLMEngine.shutdown``)."""
        if self._thread.is_alive():
            self._commands.put(None)
            self._thread.join()
            self.engine.shutdown()

    def __enter__(self) -> AsyncLLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ------------------------------------------------------------------ the loop thread

    def _post(self, fn: Callable[[], Any]) -> None:
        if self._thread.is_alive():
            self._commands.put((fn, None))

    async def _call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` on the loop thread between steps; return its result or raise its error."""
        if self._dead is not None or not self._thread.is_alive():
            raise self._dead or EngineDeadError("the engine has been shut down")
        done: Future[Any] = Future()
        self._commands.put((fn, done))
        return await asyncio.wrap_future(done)

    def _abort_quietly(self, request_id: str, stream: _Stream | None = None) -> None:
        """Abort ``request_id`` if it is live (and, when ``stream`` is given, still that stream's:
        an id reused after the request ended is not touched)."""
        if stream is not None and self._streams.get(request_id) is not stream:
            return
        self._streams.pop(request_id, None)
        try:
            self.engine.abort_request(request_id)
        except UnknownRequestError:
            pass  # it finished in the meantime

    def _run_loop(self) -> None:
        try:
            while True:
                # Wait for work only when nothing runs; otherwise take what is queued and step.
                commands = []
                if not self.engine.has_unfinished_requests():
                    # Idle: wait for a command, or until the next KV lease expires.
                    try:
                        commands.append(self._commands.get(timeout=self.engine.next_kv_lease_expiry()))
                    except queue.Empty:
                        pass
                    self.engine.poll_kv_transfer()
                while True:
                    try:
                        commands.append(self._commands.get_nowait())
                    except queue.Empty:
                        break
                for command in commands:
                    if command is None:
                        self._fail_all(EngineDeadError("the engine has been shut down"))
                        return
                    fn, done = command
                    if done is None:
                        fn()
                    elif done.set_running_or_notify_cancel():
                        try:
                            done.set_result(fn())
                        except BaseException as exc:  # noqa: BLE001 - handed to the caller
                            done.set_exception(exc)
                if self.engine.has_unfinished_requests():
                    try:
                        outputs = self.engine.step()
                    except EngineDeadError:
                        raise  # a broken tensor-parallel group: end every stream
                    except Exception:
                        # Rolled back by the engine; retried next iteration. Requests that
                        # keep failing come out of a later step with an error.
                        logger.warning("a step failed; it was rolled back and will be retried", exc_info=True)
                        continue
                    self._deliver(outputs)
                self._publish_kv_events()
        except BaseException as exc:  # noqa: BLE001 - report to every caller, do not vanish
            error = EngineDeadError(f"the step loop failed: {type(exc).__name__}: {exc}")
            error.__cause__ = exc
            self._fail_all(error)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            if out.error is not None:
                failure = RequestFailedError(f"request {out.request_id!r} failed: {out.error}")
                if out.error.startswith(f"{StructuredOutputError.__name__}: "):
                    # Its constraint broke mid-generation: the request's fault (a server's 400).
                    failure.__cause__ = StructuredOutputError(out.error.partition(": ")[2])
                stream.put(failure)
                continue
            if not stream.put(out) and not out.finished:
                self._abort_quietly(out.request_id)

    def set_kv_event_sink(self, sink: Callable[[bytes], None] | None) -> None:
        """After every step, the loop thread hands the step's KV-cache events (one msgpack
        payload, see ``LLMEngine.take_kv_events``) to ``sink``, e.g.
        ``pagedkv.server.kv_events.KVEventPublisher.publish``; it must not block."""
        self._kv_event_sink = sink

    def _publish_kv_events(self) -> None:
        sink = self._kv_event_sink
        if sink is None:
            return
        payload = self.engine.take_kv_events()
        if payload is not None:
            try:
                sink(payload)
            except Exception:  # a broken sink must not stop the engine
                logger.warning("the KV event sink failed; events of this step are lost", exc_info=True)

    def _fail_all(self, error: EngineDeadError) -> None:
        self._dead = error
        for rid, stream in list(self._streams.items()):
            stream.put(error)
            try:
                self.engine.abort_request(rid)
            except PagedKVError:
                pass
        self._streams.clear()
        while True:  # calls queued behind the failure get the error instead of hanging
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command is not None and command[1] is not None and command[1].set_running_or_notify_cancel():
                command[1].set_exception(error)
