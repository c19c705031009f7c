"""Grammar compilation off the engine thread, cached by the constraint's text.

:class:`GrammarCompiler` turns a :class:`~pagedkv.structured.params.StructuredOutputsParams` into a
:class:`CompiledGrammar` on a small thread pool and returns a ``concurrent.futures.Future``:

- a constraint compiled before (same kind, text and whitespace option) is a finished future at
  once: the cache keeps the ``max_cached`` most recently used grammars (failures too: the same
  bad schema fails again without work);
- llguidance bounds every compile and every mask by fuel (``LLParserLimits``: lexer states,
  grammar size, Earley items per step), so a hostile schema cannot run forever; the engine adds
  a wall-clock limit on top (``EngineArgs.structured_outputs_config["compile_timeout_s"]``): a
  request whose grammar is not ready by then fails alone;
- llguidance drops the GIL while it builds a matcher, so compiles run beside the forward.

A compiled grammar is a *template* matcher in its initial state; each sample gets a deep copy
(:meth:`CompiledGrammar.new_matcher`: the compiled lexer and grammar are shared, only the parse
state is copied).
"""

from __future__ import annotations

import collections
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from pagedkv.errors import MissingDependencyError, StructuredOutputError
from pagedkv.structured.params import StructuredOutputsParams
from pagedkv.structured.stats import SecondsHistogram

__all__ = ["CompiledGrammar", "GrammarCompiler", "compile_timeout_error", "load_llguidance"]

# Error texts from llguidance can quote the whole schema; the client gets this much.
_MAX_ERROR_CHARS = 2000


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


@dataclass
class CompiledGrammar:
    """A compiled constraint: ``template`` is an ``llguidance.LLMatcher`` in its initial state."""

    key: tuple[str, str, bool]
    template: Any

    @property
    def kind(self) -> str:
        return self.key[0]

    def new_matcher(self) -> Any:
        """A fresh matcher for one sample (a deep copy of the template)."""
        return self.template.deep_copy()


class GrammarCompiler:
    """Compiles constraints for one tokenizer on ``workers`` threads; see the module docs.

    ``tokenizer``: the engine's Hugging Face (fast) tokenizer; ``vocab_size``: the LM head's rows
    (ids past the tokenizer's vocabulary are never allowed); ``eos_token_ids``: the tokens that
    end a sample (allowed where the grammar is complete).
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: list[int],
        *,
        workers: int = 2,
        max_cached: int = 256,
    ) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos_token_ids = list(eos_token_ids)
        self.max_cached = max_cached
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="pagedkv-grammar")
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict[tuple[str, str, bool], Future[CompiledGrammar]] = collections.OrderedDict()
        self._tokenizer: Any = None
        self._tokenizer_lock = threading.Lock()
        # Seconds per compile (cache misses that finished, failed or not).
        self.compile_time = SecondsHistogram()
        self.num_cache_hits = 0

    def compile(self, params: StructuredOutputsParams) -> Future[CompiledGrammar]:
        """The compiled grammar of ``params``: a finished future when cached, else a running one.
        Its exception is a StructuredOutputError (or MissingDependencyError)."""
        key = params.cache_key()
        with self._lock:
            future = self._cache.get(key)
            if future is not None and not future.cancelled():  # cancelled while queued: again
                self._cache.move_to_end(key)
                self.num_cache_hits += 1
                return future
            future = self._executor.submit(self._compile, params, key)
            self._cache[key] = future
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
        return future

    def tokenizer(self) -> Any:
        """llguidance's view of the tokenizer (built once, ~0.5 s for a 49k vocabulary)."""
        with self._tokenizer_lock:
            if self._tokenizer is None:
                load_llguidance()  # a clear error when it is missing
                from llguidance.hf import from_tokenizer

                try:
                    self._tokenizer = from_tokenizer(
                        self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self._eos_token_ids or None
                    )
                except ValueError as exc:
                    raise StructuredOutputError(
                        f"structured outputs need a fast (Rust) Hugging Face tokenizer: {exc}"
                    ) from None
            return self._tokenizer

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _compile(self, params: StructuredOutputsParams, key: tuple[str, str, bool]) -> CompiledGrammar:
        llguidance = load_llguidance()
        tokenizer = self.tokenizer()
        start = time.perf_counter()
        try:
            grammar = params.to_grammar()
            # Never raises for grammar errors: the matcher enters its error state instead.
            template = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
            if template.is_error():
                message = template.get_error()
                if len(message) > _MAX_ERROR_CHARS:
                    message = message[:_MAX_ERROR_CHARS] + " ..."
                raise StructuredOutputError(
                    f"structured outputs: the {params.kind} constraint is not supported: {message}"
                )
        finally:
            self.compile_time.observe(time.perf_counter() - start)
        return CompiledGrammar(key=key, template=template)
