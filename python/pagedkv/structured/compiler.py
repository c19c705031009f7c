"""Grammar compilation off the engine thread: bounded, cancellable, cached, proven usable.

:class:`GrammarCompiler` turns a :class:`~pagedkv.structured.params.StructuredOutputsParams` into a
:class:`CompiledGrammar` on a few threads of its own. A caller takes a :class:`CompileHandle`
(:meth:`GrammarCompiler.acquire`): its ``future`` ends with the grammar or the reason it cannot be
served, and :meth:`CompileHandle.release` says the caller stopped waiting.

- **Bounded.** At most ``max_queued`` compiles wait for a thread; past that, ``acquire`` raises
  :class:`~pagedkv.errors.OverloadedError` at once (a server's 503: nothing was started, the
  client retries). A constraint compiled or compiling already is never refused: it joins.
- **Cancellable.** A compile is shared by every request with the same constraint; when the last
  of them releases its handle (its client went away, or its own ``compile_timeout_s`` passed)
  before a thread took it, it is dropped from the queue and the cache. So a client that sends
  many slow grammars and leaves takes its queue with it. (A compile a thread runs cannot be
  interrupted: llguidance bounds it by fuel, :mod:`pagedkv.structured.limits` by its text.)
- **Proven before admitted.** The compile thread checks the text's complexity
  (:func:`~pagedkv.structured.limits.check_complexity`), builds the matcher under
  :func:`~pagedkv.structured.limits.parser_limits`, then computes its first mask and walks a few
  tokens on a copy: a grammar that fails there (a ``$ref`` cycle, a row past
  ``max_items_in_row``, a lexer blowup) or admits only the empty output is refused before any
  token is generated. What still fails mid-generation fails that request alone and evicts the
  grammar (:meth:`GrammarCompiler.evict`).
- **Cached by text.** The ``max_cached`` most recently used constraints: a grammar, or the
  constraint's own error (the same bad schema gets the same 400 without work). Nothing else is
  cached: not a cancelled compile, not a compile that raised something unexpected (the thread
  survives it, :meth:`BackgroundThreads.record_error <pagedkv.background.BackgroundThreads.record_error>`).
- **Threads.** ``workers`` threads with :data:`~pagedkv.structured.limits.COMPILE_STACK_BYTES`
  of stack (llguidance recurses on rule chains), registered with the engine's
  :class:`~pagedkv.background.BackgroundThreads`: one that dies makes ``/health`` degraded.
  llguidance drops the GIL while it builds a matcher, so compiles run beside the forward, at a
  lower CPU priority than it (niceness +10: they take the cores the forward leaves idle).

A compiled grammar is a *template* matcher in its initial state; each sample gets a deep copy
(:meth:`CompiledGrammar.new_matcher`: the compiled lexer and grammar are shared, only the parse
state is copied).

The llguidance tokenizer (a view of the engine's Hugging Face tokenizer) takes a noticeable part of a
second to build and holds the GIL for most of it (SmolLM2's 49k vocabulary); it is built
once per process and tokenizer (:func:`llguidance_tokenizer`), on a thread the compiler starts
with the engine, so no request waits for it and no stream stalls behind it. The compile threads
start with the first compile.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pagedkv.background import BackgroundThreads
from pagedkv.errors import MissingDependencyError, OverloadedError, StructuredOutputError
from pagedkv.structured.limits import COMPILE_STACK_BYTES, check_complexity, parser_limits
from pagedkv.structured.params import StructuredOutputsParams
from pagedkv.structured.stats import SecondsHistogram

__all__ = [
    "CompileHandle",
    "CompiledGrammar",
    "GrammarCompiler",
    "HeldCompiles",
    "compile_timeout_error",
    "llguidance_tokenizer",
    "load_llguidance",
]

# Error texts from llguidance can quote the whole schema; the client gets this much.
_MAX_ERROR_CHARS = 2000
# Tokens the compile walks on a copy of a new grammar (the first masks and consumes): the
# failures llguidance reports only once a token is consumed (an Earley row past its limit, the
# lexer out of expressions) show at the first tokens of the grammars that have them.
PROBE_TOKENS = 4
# Niceness added to the compile threads (and the tokenizer build): see _lower_priority.
COMPILE_NICENESS = 10
# threading.stack_size is process-wide: set, start the thread, restore, under this lock.
_STACK_LOCK = threading.Lock()
# llguidance tokenizers by (class, name_or_path, size, vocab_size, eos): built once per process.
_TOKENIZERS: dict[tuple[Any, ...], Any] = {}
_TOKENIZERS_LOCK = threading.Lock()


def load_llguidance() -> Any:
    """The llguidance module, or MissingDependencyError naming the extra that brings it."""
    try:
        import llguidance
    except ImportError as exc:  # pragma: no cover - the engine extra installs it
        raise MissingDependencyError("structured outputs need llguidance: pip install 'pagedkv[engine]'") from exc
    return llguidance


def compile_timeout_error(limit: float) -> StructuredOutputError:
    """The error of a request whose grammar was not compiled within ``limit`` seconds."""
    return StructuredOutputError(f"structured outputs: compiling the constraint took longer than {limit} s")


def llguidance_tokenizer(hf_tokenizer: Any, vocab_size: int, eos_token_ids: list[int]) -> Any:
    """llguidance's view of a Hugging Face (fast) tokenizer, built once per process for equal
    tokenizers (same class, name or path, size, LM-head rows and eos); StructuredOutputError
    for a slow (Python) tokenizer."""
    key = (
        type(hf_tokenizer).__qualname__,
        getattr(hf_tokenizer, "name_or_path", None),
        len(hf_tokenizer),
        vocab_size,
        tuple(eos_token_ids),
    )
    with _TOKENIZERS_LOCK:
        found = _TOKENIZERS.get(key)
        if found is None:
            load_llguidance()  # a clear error when it is missing
            from llguidance.hf import from_tokenizer

            try:
                found = from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=list(eos_token_ids) or None)
            except ValueError as exc:
                raise StructuredOutputError(
                    f"structured outputs need a fast (Rust) Hugging Face tokenizer: {exc}"
                ) from None
            _TOKENIZERS[key] = found
        return found


# A compile's identity: (tenant, kind, constraint text, disable_any_whitespace). The tenant is
# the request's cache salt: a grammar compiled for one tenant is never another's cache hit, so
# nobody learns from a compile's time (or from joining one) which constraints another tenant
# sends, as the prefix cache's salts keep prompts apart.
GrammarKey = tuple[str | None, str, str, bool]


@dataclass
class CompiledGrammar:
    """A compiled constraint: ``template`` is an ``llguidance.LLMatcher`` in its initial state."""

    key: GrammarKey
    template: Any

    @property
    def kind(self) -> str:
        return self.key[1]

    def new_matcher(self) -> Any:
        """A fresh matcher for one sample (a deep copy of the template)."""
        return self.template.deep_copy()


@dataclass(eq=False)
class _Job:
    """One constraint's compile: queued, running or done (then cached)."""

    key: GrammarKey
    params: StructuredOutputsParams
    future: Future[CompiledGrammar] = field(default_factory=Future)
    waiters: int = 0
    started: bool = False


class CompileHandle:
    """One caller's wait for a compile: ``future``, and :meth:`release` when it stops waiting
    (whether or not the compile ended; idempotent)."""

    def __init__(self, compiler: GrammarCompiler, job: _Job) -> None:
        self._compiler = compiler
        self._job: _Job | None = job
        self.future = job.future

    def release(self) -> None:
        """This caller no longer waits: a compile nobody waits for that has not started is
        cancelled (dropped from the queue and the cache)."""
        job, self._job = self._job, None
        if job is not None:
            self._compiler._release(job)


class HeldCompiles:
    """The compiles that requests blocked in the scheduler wait for (``Scheduler.add_request``
    with ``wait_for=["grammar"]``), by request id, each with its deadline (monotonic). The
    request itself, and the fact that it waits, live in the scheduler; this keeps only the
    handle, so that it is released exactly once: when the compile ended (:meth:`take_ended`),
    ran past its deadline (idem), or the request was aborted or failed (:meth:`release`).
    Engine thread only (under the engine's lock)."""

    def __init__(self) -> None:
        self._held: dict[str, tuple[CompileHandle, float]] = {}

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._held

    def hold(self, request_id: str, handle: CompileHandle, deadline: float) -> None:
        """Keeps ``handle`` for ``request_id`` (which must hold none) until it is taken or released."""
        if request_id in self._held:
            raise ValueError(f"a compile is already held for request {request_id!r}")
        self._held[request_id] = (handle, deadline)

    def release(self, request_id: str) -> bool:
        """Drops ``request_id``'s handle (its request left the scheduler): a compile nobody else
        waits for that has not started is cancelled. False when none was held."""
        held = self._held.pop(request_id, None)
        if held is None:
            return False
        held[0].release()
        return True

    def wait_any(self, timeout: float) -> None:
        """Blocks up to ``timeout`` seconds for one held compile to end (the oldest)."""
        if self._held:
            first = next(iter(self._held.values()))[0].future
            try:
                first.exception(timeout=timeout)
            except FutureTimeoutError:
                pass

    def take_ended(self, now: float, timeout_s: float) -> list[tuple[str, CompiledGrammar | BaseException]]:
        """The requests whose compile ended (the grammar, or its error) or whose deadline passed
        before (``compile_timeout_error(timeout_s)``), in hold order; their handles are released."""
        ended: list[tuple[str, CompiledGrammar | BaseException]] = []
        for request_id, (handle, deadline) in list(self._held.items()):
            future = handle.future
            if future.done():
                result: CompiledGrammar | BaseException
                exc = None if future.cancelled() else future.exception()
                if future.cancelled():
                    result = StructuredOutputError("structured outputs: the grammar compile was cancelled")
                else:
                    result = exc if exc is not None else future.result()
            elif now > deadline:
                result = compile_timeout_error(timeout_s)
            else:
                continue
            del self._held[request_id]
            handle.release()  # a compile past its deadline, not started, nobody else waits: dropped
            ended.append((request_id, result))
        return ended


class GrammarCompiler:
    """Compiles constraints for one tokenizer; see the module docs.

    ``tokenizer``: the engine's Hugging Face (fast) tokenizer; ``vocab_size``: the LM head's rows
    (ids past the tokenizer's vocabulary are never allowed); ``eos_token_ids``: the tokens that
    end a sample (allowed where the grammar is complete). ``workers``: compile threads;
    ``max_cached``: constraints kept; ``max_queued``: compiles that may wait for a thread;
    ``background``: where the threads report (the engine's; a private one by default).
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: list[int],
        *,
        workers: int = 2,
        max_cached: int = 256,
        max_queued: int = 32,
        background: BackgroundThreads | None = None,
        stack_bytes: int = COMPILE_STACK_BYTES,
    ) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos_token_ids = list(eos_token_ids)
        self.max_cached = max_cached
        self.max_queued = max_queued
        self.background = background if background is not None else BackgroundThreads()
        self._cond = threading.Condition()
        self._queue: collections.deque[_Job] = collections.deque()
        self._cache: collections.OrderedDict[GrammarKey, _Job] = collections.OrderedDict()
        self._stopping = False
        self._tokenizer: Any = None
        self._tokenizer_error: BaseException | None = None
        self._tokenizer_ready = threading.Event()
        # Seconds per compile (cache misses that ran, failed or not).
        self.compile_time = SecondsHistogram()
        self.num_cache_hits = 0
        self.num_cancelled = 0
        self.num_refused = 0  # acquire() past max_queued
        self._names = [f"pagedkv-grammar-{i}" for i in range(workers)]
        self._stack_bytes = stack_bytes
        self._started = False  # the compile threads start with the first compile
        self._alive = 0  # of them, how many started
        # The compiles that blocked requests wait for (the engine's; see HeldCompiles).
        self.held = HeldCompiles()
        # The tokenizer now, on a thread of its own: built before the first request needs it.
        threading.Thread(target=self._build_tokenizer, name="pagedkv-grammar-tokenizer", daemon=True).start()

    # ------------------------------------------------------------------ callers

    def acquire(
        self, params: StructuredOutputsParams, *, bounded: bool = True, tenant: str | None = None
    ) -> CompileHandle:
        """A handle on the compile of ``params``: cached (done, or running and joined), else
        queued. ``bounded``: refuse with OverloadedError when ``max_queued`` compiles wait
        already (the server's requests; a trusted batch, ``LLMEngine.compile_grammars``, waits
        its turn instead). ``tenant``: the request's cache salt (the cache and running compiles
        are shared only within a tenant). The future's exception is a StructuredOutputError
        (the constraint's answer), or MissingDependencyError."""
        key = (tenant, *params.cache_key())
        with self._cond:
            job = self._cache.get(key)
            if job is not None:
                self._cache.move_to_end(key)
                self.num_cache_hits += 1
            else:
                if self._stopping:
                    raise OverloadedError("structured outputs: the grammar compiler is shut down")
                if bounded and len(self._queue) >= self.max_queued:
                    self.num_refused += 1
                    raise OverloadedError(
                        f"structured outputs: {len(self._queue)} grammar compiles are queued "
                        f"(max_queued_compiles={self.max_queued}); retry later"
                    )
                if not self._started:
                    self._started = True
                    self._alive = sum(self._start_thread(name, self._stack_bytes) for name in self._names)
                if not self._alive:
                    raise OverloadedError("structured outputs are unavailable: no grammar compile thread could start")
                job = _Job(key, params)
                self._queue.append(job)
                self._cache[key] = job
                while len(self._cache) > self.max_cached:
                    self._cache.popitem(last=False)  # a queued job stays queued (its waiters hold it)
                self._cond.notify()
            job.waiters += 1
        return CompileHandle(self, job)

    def compile(self, params: StructuredOutputsParams, tenant: str | None = None) -> Future[CompiledGrammar]:
        """The compiled grammar of ``params`` for a caller that waits until it ends (never
        cancelled, never refused): a finished future when cached, else a running one."""
        return self.acquire(params, bounded=False, tenant=tenant).future

    def evict(self, grammar: CompiledGrammar) -> None:
        """``grammar`` failed a request after all (a mask or token past llguidance's limits,
        mid-generation): it is no longer cached as valid; the next request compiles afresh."""
        with self._cond:
            job = self._cache.get(grammar.key)
            if job is not None and job.future.done() and not job.future.cancelled():
                if job.future.exception() is None and job.future.result() is grammar:
                    del self._cache[grammar.key]

    @property
    def num_queued(self) -> int:
        """Compiles waiting for a thread."""
        return len(self._queue)

    def tokenizer(self, timeout: float | None = None) -> Any:
        """llguidance's view of the tokenizer (built on a thread from the start; this waits
        for it)."""
        if not self._tokenizer_ready.wait(timeout):
            raise StructuredOutputError("structured outputs: the grammar tokenizer is still being built")
        if self._tokenizer_error is not None:
            raise self._tokenizer_error
        return self._tokenizer

    def shutdown(self) -> None:
        """Stop the threads (a compile in progress ends on its own) and cancel what is queued."""
        with self._cond:
            self._stopping = True
            for name in self._names:
                self.background.stopping(name)
            for job in self._queue:
                job.future.cancel()
            self._queue.clear()
            self._cond.notify_all()

    # ------------------------------------------------------------------ the threads

    def _release(self, job: _Job) -> None:
        with self._cond:
            job.waiters -= 1
            if job.waiters > 0 or job.started or job.future.done():
                return
            # Nobody waits and no thread took it: dropped, so a client that left frees its slots.
            try:
                self._queue.remove(job)
            except ValueError:  # pragma: no cover - queued jobs that did not start are in the queue
                pass
            if self._cache.get(job.key) is job:
                del self._cache[job.key]
            job.future.cancel()
            self.num_cancelled += 1

    def _start_thread(self, name: str, stack_bytes: int) -> bool:
        """Starts compile thread ``name`` with ``stack_bytes`` of stack; False (the thread dead
        for /health) when it cannot start. Never on a smaller stack: a grammar the limits admit
        could overflow it and end the process."""

        def loop() -> None:
            self._work(name)

        with _STACK_LOCK:
            try:
                previous = threading.stack_size(stack_bytes)
            except (ValueError, RuntimeError) as exc:  # pragma: no cover - a platform without it
                self.background.died(name, exc)
                return False
            try:
                self.background.start(name, loop)
                return True
            except RuntimeError as exc:  # pragma: no cover - "can't start new thread" (no memory)
                self.background.died(name, exc)
                return False
            finally:
                threading.stack_size(previous)

    def _build_tokenizer(self) -> None:
        _lower_priority()
        try:
            self._tokenizer = llguidance_tokenizer(self._hf_tokenizer, self.vocab_size, self._eos_token_ids)
        except Exception as exc:  # every compile reports it (StructuredOutputError, MissingDependencyError)
            self._tokenizer_error = exc
        finally:
            self._tokenizer_ready.set()

    def _work(self, name: str) -> None:
        """One compile thread: the next queued job, until shutdown. Whatever one job raises is
        that job's answer; the loop goes on."""
        _lower_priority()
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
                job = self._queue.popleft()
                job.started = True
            if not job.future.set_running_or_notify_cancel():
                continue
            try:
                job.future.set_result(self._compile(job.params, job.key))
            except (StructuredOutputError, MissingDependencyError) as exc:
                job.future.set_exception(exc)  # the constraint's own answer: cached as such
            except Exception as exc:  # noqa: BLE001 - survived, reported, not cached
                self._forget(job)
                self.background.record_error(name, exc, "a grammar compile")
                job.future.set_exception(
                    StructuredOutputError(f"structured outputs: the constraint could not be compiled: {exc}")
                )
            except BaseException as exc:  # interpreter shutdown: this thread ends (/health says so)
                self._forget(job)
                job.future.set_exception(exc)  # its waiters are told, not left hanging
                raise

    def _forget(self, job: _Job) -> None:
        with self._cond:
            if self._cache.get(job.key) is job:
                del self._cache[job.key]

    def _compile(self, params: StructuredOutputsParams, key: GrammarKey) -> CompiledGrammar:
        llguidance = load_llguidance()
        check_complexity(params)  # before any llguidance work: a 400 naming the limit
        tokenizer = self.tokenizer()
        start = time.perf_counter()
        try:
            grammar = params.to_grammar()
            # Never raises for grammar errors: the matcher enters its error state instead.
            template = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=parser_limits())
            if template.is_error():
                raise StructuredOutputError(
                    f"structured outputs: the {params.kind} constraint is not supported: {_short(template.get_error())}"
                )
            self._prove(params.kind, template)
        finally:
            self.compile_time.observe(time.perf_counter() - start)
        return CompiledGrammar(key=key, template=template)

    def _prove(self, kind: str, template: Any) -> None:
        """The first masks and tokens of a copy of ``template``: what fails there, or a grammar
        that admits only the empty output, is refused now, not after the request started."""
        probe = template.deep_copy()
        eos = np.asarray(self._eos_token_ids, dtype=np.int64)
        for step in range(PROBE_TOKENS + 1):
            mask = probe.compute_bitmask()
            if probe.is_error():
                raise StructuredOutputError(
                    f"structured outputs: the {kind} constraint cannot be served: {_short(probe.get_error())}"
                )
            bits = np.unpackbits(np.frombuffer(mask, dtype=np.uint8), bitorder="little")[: self.vocab_size]
            allowed = np.flatnonzero(bits)
            tokens = allowed[~np.isin(allowed, eos)]
            if len(tokens) == 0:
                if step == 0:
                    what = "only the empty output" if len(allowed) else "no output at all"
                    raise StructuredOutputError(f"structured outputs: the {kind} constraint admits {what}")
                return
            if not probe.consume_token(int(tokens[0])) or probe.is_error():
                raise StructuredOutputError(
                    f"structured outputs: the {kind} constraint cannot be served: {_short(probe.get_error())}"
                )
            if probe.is_stopped():
                return


def _lower_priority() -> None:
    """This thread yields the CPU to the others: +:data:`COMPILE_NICENESS` (Linux sets a
    thread's priority by its id). Compiles then take the cores the forward leaves idle, and a
    flood of them slows generation less (on 2 cores, two compile threads at the same priority
    as the forward doubled an honest request's latency)."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + COMPILE_NICENESS))
    except (AttributeError, OSError):  # pragma: no cover - not Linux, or not permitted
        pass


def _short(message: str) -> str:
    """llguidance's error, for a client: without its (non-verbose) parser-state marker, the
    stop reasons explained, at most _MAX_ERROR_CHARS."""
    message = message.replace("<non-verbose/>", "").strip()
    if message in ("NoExtension", "NoExtensionBias"):
        message = f"{message}: no output can complete it (a $ref cycle, or a rule that never ends)"
    return message if len(message) <= _MAX_ERROR_CHARS else message[:_MAX_ERROR_CHARS] + " ..."
