"""The pagedkv exception tree.

Every error pagedkv raises on bad input is a subclass of :class:`PagedKVError`, so a server can
catch one class. Where a built-in class fits too (``ValueError`` for bad values, ``LookupError``
for unknown ids) the exception inherits from it as well, so code written against vLLM-style
``except ValueError`` keeps working.

The Rust core raises these same classes: ``rust/py/errors.rs`` maps each variant of the Rust
``CoreError`` enum to one class here (an exhaustive match, no catch-all arm).
"""

from __future__ import annotations

__all__ = [
    "PagedKVError",
    "ConfigError",
    "InvalidArgumentError",
    "InvalidTypeError",
    "InvalidBlockError",
    "InvalidTokenError",
    "UnknownRequestError",
    "UnknownSequenceError",
    "DuplicateRequestError",
    "PromptTooLongError",
    "StaleOutputError",
    "InvariantViolationError",
    "ModelLoadError",
    "UnsupportedModelError",
    "TraceFormatError",
    "RequestFailedError",
    "EngineDeadError",
    "KVTransferError",
    "MissingDependencyError",
    "StructuredOutputError",
    "OverloadedError",
]


class PagedKVError(Exception):
    """Base class of every error pagedkv raises on purpose."""


class ConfigError(PagedKVError, ValueError):
    """A configuration value (pool size, block size, sampling parameter, ...) is invalid."""


class StructuredOutputError(ConfigError):
    """A structured-output request cannot be served: its JSON schema, regex, choice list or
    grammar is malformed, uses a feature the grammar engine does not implement (the message
    names it), or took longer than the engine's limit to compile. Only that request fails."""


class OverloadedError(PagedKVError, RuntimeError):
    """A shared queue the request needs is full (grammar compiles waiting for a compile
    thread): nothing of the request was started; retry later (a server's 503)."""


class InvalidArgumentError(PagedKVError, ValueError):
    """An argument has the wrong type, dtype, shape, layout or value."""


class InvalidTypeError(InvalidArgumentError, TypeError):
    """An argument has the wrong type or dtype (e.g. floats where token ids are expected)."""


class InvalidBlockError(InvalidArgumentError):
    """A block id is out of range, not allocated (double free), or otherwise unusable."""


class InvalidTokenError(InvalidArgumentError):
    """A token id is negative or outside the int32 range."""


class UnknownRequestError(PagedKVError, LookupError):
    """No live request has this id (never added, already finished, or aborted)."""


class UnknownSequenceError(PagedKVError, LookupError):
    """No live sequence has this id in a :class:`KVCacheManager`."""


class DuplicateRequestError(PagedKVError, ValueError):
    """A request with this id is already live."""


class PromptTooLongError(InvalidArgumentError):
    """The prompt can never be served: longer than ``max_model_len`` or larger than the whole pool."""


class StaleOutputError(PagedKVError, ValueError):
    """``Scheduler.update`` got a ``SchedulerOutput`` that is not the latest step's."""


class InvariantViolationError(PagedKVError, AssertionError):
    """``check_invariants()`` found the allocator's bookkeeping inconsistent (a bug in pagedkv)."""


class ModelLoadError(PagedKVError, OSError):
    """The model could not be found or loaded."""


class UnsupportedModelError(PagedKVError, ValueError):
    """The model loads, but has a feature the runner cannot serve correctly (e.g. sliding window)."""


class TraceFormatError(PagedKVError, ValueError):
    """A workload trace line is malformed; the message names the line number and field."""


class RequestFailedError(PagedKVError, RuntimeError):
    """The engine gave up on one request (its output has ``finish_reason="error"``): a step that
    raised while it was in the batch, too many times, or a failure in its own output
    processing. The original exception is the ``__cause__`` where it is known. Other requests
    are not affected."""


class EngineDeadError(PagedKVError, RuntimeError):
    """``AsyncLLM`` was shut down, or its step loop thread died; no stream can continue."""


class KVTransferError(PagedKVError, RuntimeError):
    """A KV block transfer between two engines failed: the peer died or disconnected, the
    transfer engine reported an error, or it did not finish within the caller's timeout
    (``pagedkv.distributed``). The local target blocks hold undefined data afterwards."""


class MissingDependencyError(PagedKVError, ImportError):
    """A feature needs a package of an extra that is not installed; the message says which
    (``pip install 'pagedkv[engine]'`` for the model engine on a core-only install)."""
